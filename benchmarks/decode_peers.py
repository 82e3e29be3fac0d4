"""The three decoders bench_decode.py times, each in a process of its own.

moetier (Engine on a GGUF file), llama.cpp (llama-cpp-python on the same file)
and transformers (the HF float32 checkpoint) each load once into a spawned
worker process and answer `measure` calls over a pipe: prefill a prompt in one
forward, then decode `tokens` greedy steps one token at a time; both phases
timed with perf_counter around whole phases (every engine here computes on the
CPU, so a returned value is a finished one). A process per (engine, file)
because a crash (llama.cpp's repacked buffers segfaulted on an AVX-512 host)
must cost one cell of the table, not the run; because torch's thread count and
both OpenMP runtimes are per process; and so the llama.cpp worker never
imports torch. A worker waiting on its pipe computes nothing, so the one being
timed has the cores to itself. Only the standard library is imported here;
each engine's imports happen inside its worker.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
from pathlib import Path

# llama.cpp's model parameter set before every load: see LlamaCppDecoder
LLAMA_MODEL_PARAMS = {"use_extra_bufts": False}


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class MoetierDecoder:
    """moetier.engine.Engine on the file, the torch backend (native decode kernel where it builds)."""

    def __init__(self, path: Path, threads: int):
        import torch

        from moetier.backends.torch_backend import TorchBackend
        from moetier.engine import Engine
        from moetier.model import open_checkpoint

        torch.set_num_threads(threads)
        backend = TorchBackend("cpu", lanes=threads)  # the native kernels' pool: `threads` threads
        self.engine = Engine(open_checkpoint(path), backend=backend)
        self.engine.warm_up()
        torch_threads = self.engine.torch_threads or threads
        self.settings = (f"{backend.describe()}; decode: {self.engine.decode_path()}; "
                         f"torch ops in a forward on {torch_threads} intra-op thread(s)")

    def measure(self, prompt: list[int], tokens: int) -> dict:
        from moetier.engine import generate

        result = generate(self.engine, prompt, tokens + 1)  # the first new token comes from prefill
        return {"prefill_s": result.prefill_s, "decode_s": result.decode_s, "ids": result.ids}


class LlamaCppDecoder:
    """llama-cpp-python's Llama on the file: `threads` for decode and batch, no mmap, n_batch 256, greedy argmax."""

    def __init__(self, path: Path, threads: int, context: int):
        import llama_cpp
        from llama_cpp import Llama

        default = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            p = default()
            for key, value in LLAMA_MODEL_PARAMS.items():  # use_extra_bufts: the repacked K-quant buffers crashed on the AVX-512 host
                setattr(p, key, value)
            return p

        llama_cpp.llama_cpp.llama_model_default_params = params
        try:
            self.llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=256,
                             use_mmap=False, verbose=False)
        finally:
            llama_cpp.llama_cpp.llama_model_default_params = default
        self.vocab = self.llm.n_vocab()
        c = self.llm.context_params
        settings = {"n_threads": c.n_threads, "n_threads_batch": c.n_threads_batch, "n_ctx": c.n_ctx, "n_batch": c.n_batch,
                    "n_ubatch": c.n_ubatch, "use_mmap": False, **LLAMA_MODEL_PARAMS}
        kv_types = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0"}
        settings["type_k"], settings["type_v"] = (kv_types.get(t, t) for t in (c.type_k, c.type_v))
        self.settings = f"llama-cpp-python {llama_cpp.__version__}: " + " ".join(f"{k}={v}" for k, v in settings.items())

    def _next(self) -> int:
        import numpy as np

        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab,)).argmax())

    def measure(self, prompt: list[int], tokens: int) -> dict:
        self.llm.reset()  # eval drops the KV cache past n_tokens = 0
        begin = time.perf_counter()
        self.llm.eval(prompt)
        ids = [self._next()]
        prefill_s = time.perf_counter() - begin
        begin = time.perf_counter()
        for _ in range(tokens):
            self.llm.eval(ids[-1:])
            ids.append(self._next())
        return {"prefill_s": prefill_s, "decode_s": time.perf_counter() - begin, "ids": ids}


class TransformersDecoder:
    """transformers' model class the folder's config names (else AutoModelForCausalLM) in float32 on the HF folder; a
    greedy loop over forward with a DynamicCache."""

    def __init__(self, path: Path, threads: int):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        torch.set_num_threads(threads)
        names = transformers.AutoConfig.from_pretrained(path).architectures or []  # glm5_next: ...ForConditionalGeneration
        model_class = getattr(transformers, names[0], AutoModelForCausalLM) if names else AutoModelForCausalLM
        self.model = model_class.from_pretrained(path, dtype=torch.float32).eval()
        self.settings = (f"transformers {transformers.__version__} {type(self.model).__name__} float32, "
                         f"attention {self.model.config._attn_implementation}, torch threads {torch.get_num_threads()}")

    def measure(self, prompt: list[int], tokens: int) -> dict:
        import torch
        from transformers import DynamicCache

        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            begin = time.perf_counter()
            logits = self.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            ids = [int(logits[0, -1].argmax())]
            prefill_s = time.perf_counter() - begin
            step = torch.empty(1, 1, dtype=torch.int64)
            begin = time.perf_counter()
            for _ in range(tokens):
                step[0, 0] = ids[-1]
                logits = self.model(input_ids=step, past_key_values=cache, use_cache=True).logits
                ids.append(int(logits[0, -1].argmax()))
        return {"prefill_s": prefill_s, "decode_s": time.perf_counter() - begin, "ids": ids}


DECODERS = {"moetier": MoetierDecoder, "llama.cpp": LlamaCppDecoder, "transformers": TransformersDecoder}


def _serve(conn, engine: str, path: str, threads: int, options: dict) -> None:
    """The worker: load, say ("ready", settings) or ("error", line), then answer ("measure", prompt, tokens)."""
    try:
        decoder = DECODERS[engine](Path(path), threads, **options)
        conn.send(("ready", decoder.settings))
    except BaseException as error:  # noqa: BLE001 - any failure is this cell's result
        conn.send(("error", first_line(error), traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "close":
            return
        try:
            conn.send(("ok", decoder.measure(*message[1:])))
        except BaseException as error:  # noqa: BLE001
            conn.send(("error", first_line(error), traceback.format_exc()))


class WorkerFailed(RuntimeError):
    """A worker's load or measurement failed; str() is the line for the table."""


class DecoderProcess:
    """One decoder loaded in a spawned process; `measure` raises WorkerFailed with the error's first line."""

    def __init__(self, engine: str, path: Path, threads: int, timeout_s: float, **options):
        self.engine, self.timeout_s, self.dead = engine, timeout_s, None
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, engine, str(path), threads, options), daemon=True)
        self._process.start()
        self.pid = self._process.pid
        child.close()
        self.settings = self._receive()

    def measure(self, prompt: list[int], tokens: int) -> dict:
        if self.dead is not None:
            raise WorkerFailed(self.dead)
        self._conn.send(("measure", prompt, tokens))
        return self._receive()

    def _receive(self):
        try:
            if not self._conn.poll(self.timeout_s):
                self._fail(f"timed out after {self.timeout_s:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            code = self._process.exitcode
            self._fail(f"worker died ({f'signal {signal.Signals(-code).name}' if code is not None and code < 0 else f'exit code {code}'})")
        if reply[0] == "error":
            self.traceback = reply[2]
            raise WorkerFailed(reply[1])
        return reply[1]

    def _fail(self, why: str) -> None:
        self.dead = why
        self.close()
        raise WorkerFailed(why)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

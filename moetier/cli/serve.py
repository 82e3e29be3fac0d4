"""Text commands: `serve` (the OpenAI-compatible server) and `chat` (an interactive chat in the terminal).

Both open the model as `run` does (--model, --layout, --bias, --affinity,
--bias-mode, --backend, --device, --threads) with its own tokenizer and chat
template, and keep its state between turns / requests (prefix reuse).
`serve` refuses a non-loopback --host without --api-key, binds before it
says it listens (port 0 takes a free port; the line names it), and with
--record DIR writes each request as a session record and a routing trace
(moetier.serve.record).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from moetier.cli.common import UsageError, errors_to_exit, open_engine, status


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def open_text_model(model, backend, device, threads, layout, bias, affinity, bias_mode):
    """(engine, runtime or None, tokenizer): a model that takes and gives text."""
    from moetier.engine.router_bias import apply_router_options
    from moetier.model.tokenizer import load_tokenizer

    engine, runtime = open_engine(model, backend, device, threads, layout)
    try:
        apply_router_options(engine, bias, affinity, bias_mode)
        tokenizer = load_tokenizer(engine.checkpoint)
    except Exception:
        if runtime is not None:
            runtime.close()
        raise
    return engine, runtime, tokenizer


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@errors_to_exit
def serve(
    model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file; default: the built-in synthetic model"),
    host: str = typer.Option("127.0.0.1", help="address to listen on; anything but loopback needs --api-key"),
    port: int = typer.Option(8000, help="port (0: any free one, named on stderr)"),
    api_key: Optional[str] = typer.Option(None, envvar="MOETIER_API_KEY", help="require Authorization: Bearer KEY"),
    served_model_name: Optional[str] = typer.Option(None, help="the model id /v1/models reports (default: the folder name)"),
    record: Optional[Path] = typer.Option(None, help="folder: write each request as a session record and a routing trace"),
    layout: Optional[Path] = typer.Option(None, help="cluster.toml: run over its tiers"),
    bias: Optional[Path] = typer.Option(None, help="router bias table (.safetensors, from `moetier bias`)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (needs --layout with a vram tier)"),
    bias_mode: Optional[str] = typer.Option(None, help="selection | damped"),
    backend: str = typer.Option("torch", help="expert backend: torch, numpy, cupy, or an entry point"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    max_queue: int = typer.Option(64, help="requests that may wait; more get 503"),
    prefix_marks: int = typer.Option(4, help="prefill states kept for prefix reuse (linear-attention models)"),
    log_level: str = typer.Option("warning", help="uvicorn's log level: critical | error | warning | info | debug"),
):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models)."""
    from moetier.model.output import check_output

    if not _is_loopback(host) and not api_key:
        raise UsageError(f"--host {host} is not a loopback address: give --api-key (or MOETIER_API_KEY) so that "
                         "requests must carry it")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty (expected a secret string)")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port is {port} (expected 0 to 65535)")
    if max_queue < 1 or prefix_marks < 1:
        raise UsageError("--max-queue and --prefix-marks must be >= 1")
    if log_level not in ("critical", "error", "warning", "info", "debug"):
        raise UsageError(f"--log-level {log_level!r} (expected critical, error, warning, info or debug)")
    if record is not None:
        check_output(record, "--record", [("--model", model), ("--layout", layout), ("--bias", bias)], kind="folder")
    engine, runtime, tokenizer = open_text_model(model, backend, device, threads, layout, bias, affinity, bias_mode)
    try:
        _serve(engine, tokenizer, host, port, api_key, served_model_name, record, max_queue, prefix_marks, log_level)
    finally:
        if runtime is not None:
            runtime.close()


def _serve(engine, tokenizer, host, port, api_key, name, record, max_queue, marks, log_level) -> None:
    import uvicorn

    from moetier.serve.api import now
    from moetier.serve.record import Recorder
    from moetier.serve.server import ServerState, create_app
    from moetier.serve.worker import Worker

    recorder = None
    if record is not None:
        recorder = Recorder(record, engine.checkpoint.fingerprint, engine.spec.num_experts, list(engine.spec.moe_layers))
    engine.warm_up()
    worker = Worker(engine, tokenizer, recorder, max_queue, marks)
    folder = Path(engine.checkpoint.folder)
    state = ServerState(worker, tokenizer, name or folder.stem, engine.checkpoint.fingerprint,
                        engine.spec.max_position_embeddings or 4096, api_key, now())
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    worker.start()
    shown = f"[{host}]" if ":" in host else host
    # one plain line (rich would wrap it at 80 columns off a terminal): clients and tests read the URL from it
    print(f"moetier serve: {state.model_name} ({state.fingerprint}) on http://{shown}:{bound}/v1"
          + (f", recording to {record}" if record is not None else ""), file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(state), log_level=log_level, lifespan="off", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()


@errors_to_exit
def chat(
    model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file; default: the built-in synthetic model"),
    system: Optional[str] = typer.Option(None, help="a system message to start the chat with"),
    max_tokens: int = typer.Option(512, help="most tokens an answer may have"),
    temperature: float = typer.Option(0.7, help="0 = greedy"),
    top_p: float = typer.Option(0.95),
    top_k: int = typer.Option(0),
    presence_penalty: float = typer.Option(0.0, help="OpenAI's: off the logit of each token of the answer so far (-2..2)"),
    frequency_penalty: float = typer.Option(0.0, help="OpenAI's: times each token's count in the answer so far (-2..2)"),
    seed: Optional[int] = typer.Option(None, help="sampling seed (default: a new one per answer)"),
    no_think: bool = typer.Option(False, "--no-think", help="pass enable_thinking=false to the template"),
    layout: Optional[Path] = typer.Option(None, help="cluster.toml: run over its tiers"),
    bias: Optional[Path] = typer.Option(None, help="router bias table (.safetensors, from `moetier bias`)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (needs --layout with a vram tier)"),
    bias_mode: Optional[str] = typer.Option(None, help="selection | damped"),
    backend: str = typer.Option("torch"),
    device: str = typer.Option("cpu"),
    threads: Optional[int] = typer.Option(None),
):
    """Chat with the model in the terminal (its own chat template; /reset starts over, Ctrl-C ends an answer, /exit or
    Ctrl-D leaves)."""
    import secrets

    from moetier.engine import Sampling
    from moetier.engine.prefix import PrefixCache
    from moetier.model.chat_template import render_chat
    from moetier.serve.textgen import TextParams, generate_text

    if max_tokens < 1:
        raise UsageError(f"--max-tokens is {max_tokens} (expected >= 1)")
    penalties = {"presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty}
    Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **penalties)  # refuses bad flags before any loading
    engine, runtime, tokenizer = open_text_model(model, backend, device, threads, layout, bias, affinity, bias_mode)
    try:
        template = tokenizer.chat_template()
        if template is None:
            raise UsageError(f"{engine.checkpoint.folder}: the model has no chat template (use `moetier run --prompt`)")
        prefix, start = PrefixCache(engine), [{"role": "system", "content": system}] if system else []
        messages, interactive = list(start), sys.stdin.isatty()
        variables = {"enable_thinking": False} if no_think else {}
        context = engine.spec.max_position_embeddings or 4096
        if interactive:
            status.print("moetier chat: /reset starts over, /exit or Ctrl-D leaves", highlight=False)
        while True:
            try:
                line = input(">>> " if interactive else "")
            except (EOFError, KeyboardInterrupt):
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                messages = list(start)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            text = render_chat(template, messages, add_generation_prompt=True,
                               special_tokens=tokenizer.specials.template_tokens, **variables)
            ids = tokenizer.encode(text, add_special=False, parse_special=True)
            if len(ids) >= context:
                status.print(f"the chat is {len(ids)} tokens, the model's context {context}: /reset to go on")
                messages.pop()
                continue
            sampling = Sampling(temperature, top_k, top_p, seed if seed is not None else secrets.randbits(63), **penalties)
            params = TextParams(min(max_tokens, context - len(ids)), sampling)
            try:
                result = generate_text(engine, tokenizer, ids, params, prefix, on_text=_write)
            except KeyboardInterrupt:  # Ctrl-C ends the answer, not the chat
                _write("\n")
                prefix.reset()  # a forward cut short leaves states the kept ids do not describe
                messages.pop()
                continue
            _write("\n")
            messages.append({"role": "assistant", "content": result.text})
            s = result.stats
            status.print(f"[dim]{s.new_tokens} tokens, {s.to_dict()['decode_tok_per_s']:.1f} tok/s; prefill "
                         f"{s.prefill_tokens} of {s.prompt_tokens} tokens ({s.cached_tokens} reused)[/dim]")
    finally:
        if runtime is not None:
            runtime.close()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()

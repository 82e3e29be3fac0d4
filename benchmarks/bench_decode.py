"""Decode and prefill speed: moetier, llama.cpp and transformers on the same weights, against the read roofline.

Regime: CPU, batch 1, greedy. One synthetic checkpoint (`--preset`, default
`medium`: 16 layers of 80 experts, top-10, 1.0 GB of float32 experts, 32x the
L3 here; `wide`: 4 layers of 32 experts of Qwen3-Next's shape, hidden 2048,
width 512, top-8, 1.6 GB of float32 experts; `deep`: `wide`'s layer 16 times) written by moetier, or a
checkpoint of your own (`--checkpoint DIR`, its prompt drawn from its vocabulary), converted to an F32 GGUF by
moetier and quantized by llama.cpp's own quantizer (BF16, Q8_0, Q4_K_M, Q6_K, IQ3_S), cached in `--models`. Per format moetier's Engine and llama.cpp (llama-cpp-python) run
the same GGUF file; transformers runs the HF float32 checkpoint the files came
from (its row is F32's). Each engine loads once in a process of its own
(decode_peers.py) with `--threads` threads, every process pinned to the same
`--threads` CPUs, is warmed up by one untimed pass, then timed in turn
(moetier, llama.cpp, transformers, moetier, ...) for `--runs` runs, best kept.
A pass: a 256-token prompt in one forward (prefill tok/s, first new token
included), then `--tokens` greedy steps one token at a time (decode tok/s).
The VM is shared: each pass first waits (`--quiet-wait`) for other processes
to go quiet, is repeated (`--retries`) while they took over 10% of the CPUs
during it (every pass kept in the JSON), and their share during the best pass
is reported. The read roofline: weight bytes one decoded token reads, in the
file's stored bytes (every trunk matrix, one embedding row, top_k of each MoE
layer's experts, from the GGUF's tensor sizes; the KV cache not counted), over
the read bandwidth measured in the same run on the same threads (a reduction
over a float32 buffer of max(1 GiB, 8 x the LLC) by torch.sum and by moetier's
two native read probes, the fastest, best of 5, before and after every timed pass,
retried the same way: a bound, so the highest rate read in the whole run).
The VM's bandwidth moves between levels from minute to minute (on the Zen
host: ~33 and ~57 GB/s at 2 threads, as if its two vCPUs shared one memory
link or not), so two more tables keep only the passes both of whose
neighbouring samples read at least TOP_LEVEL of the best (the top level), and
those both of whose samples are within USUAL_BAND of the median sample (the
level the host held most): engines compared at one level, and shares of a
roofline the host held during the pass. Prints the tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# decode_peers and this module's top level import only the standard library: every spawned worker runs them
from decode_models import FORMATS, checkpoint_arch_and_vocab, log, prepare_models, weight_bytes_per_token
from decode_peers import LLAMA_MODEL_PARAMS, DecoderProcess, WorkerFailed
ENGINES = ("moetier", "llama.cpp", "transformers")
PREFILL_TOKENS = 256
QUIET = 0.1  # a timed call during which other processes used more of the machine's CPUs than this is retried
NOT_RUN = "n/a: transformers runs the HF float32 checkpoint (row F32)"
TOP_LEVEL = 0.85  # a pass ran at the host's top bandwidth level when the samples before and after it both read this share of the best
USUAL_BAND = 0.15  # ... at its usual level when both are within this share of the median sample


# -- the machine ---------------------------------------------------------------------------------------------

def last_level_cache_bytes() -> int:
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            sizes[int((index / "level").read_text())] = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
        except (OSError, ValueError, KeyError):
            continue
    return sizes[max(sizes)] if sizes else 32 << 20


@functools.cache
def probe_buffer(nbytes: int):
    """The bandwidth probes' float32 buffer (moetier.calibrate.read_buffer: in memory advised for huge pages, as
    moetier's resident weights), allocated and touched once for the whole run (before the engines load):
    a new one at every sample took gigabytes each time and pushed moetier's memory-mapped GGUF pages out of the page
    cache, while llama.cpp (use_mmap=False) and transformers hold theirs in anonymous memory (seen: moetier's `wide`
    F32 prefill at 330-380 tok/s in the run, ~600 outside it)."""
    from moetier.calibrate import read_buffer

    return read_buffer(nbytes)


def read_bandwidth(threads: int, nbytes: int) -> dict[str, float]:
    """Bytes read per second by each reader of moetier.calibrate.read_bandwidth_bytes_per_s ("torch.sum", "native",
    "native plain", "best": the fastest), over the run's nbytes float32 buffer with `threads` threads, best of 5."""
    from moetier.calibrate import read_bandwidth_bytes_per_s

    return read_bandwidth_bytes_per_s(threads, nbytes, buffer=probe_buffer(nbytes))


def _float_streams(threads: int) -> str:
    """How moetier's float formats read their rows at one token on this host with `threads` threads
    (cpu_streams.streams: the engine's processes choose the same way), a pool opened to choose it if none is yet."""
    import torch

    from moetier.backends import cpu_kernels, cpu_streams

    kernel = cpu_kernels.decode_kernel(threads)
    if kernel is None:
        return f"no native kernels: {cpu_kernels.status()}"
    kernel.read_sum(torch.zeros(1))
    return cpu_streams.streams()


def _busy_ticks() -> int:
    """Clock ticks the whole machine spent computing (user, nice, system, irq, softirq; not idle or steal)."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in Path("/proc/stat").read_text().split()[1:8])
    return user + nice + system + irq + softirq


def _process_ticks(pid: int) -> int:
    """utime + stime of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_until_quiet(limit_s: float, below: float = QUIET, window_s: float = 0.5) -> float:
    """Wait (at most limit_s) for a window_s in which other processes used under `below` of the CPUs; seconds waited.
    Our idle workers are blocked on their pipes, so what is busy is someone else."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < limit_s:
        busy, mine = _busy_ticks(), _process_ticks(os.getpid())
        time.sleep(window_s)
        others = (_busy_ticks() - busy) - (_process_ticks(os.getpid()) - mine)
        if others < below * window_s * os.sysconf("SC_CLK_TCK") * os.cpu_count():
            break
    return time.perf_counter() - begin


def others_share(measure, pids: list[int]):
    """(measure(), the share of the machine's CPUs that processes other than `pids` used meanwhile, or None for
    a call too short to count in clock ticks). The VM is shared, and a busy core costs a thread-synchronised
    engine (llama.cpp's barriers, moetier's kernel pool) far more than its share."""
    ours = lambda: sum(_process_ticks(pid) for pid in pids)
    busy, mine, begin = _busy_ticks(), ours(), time.perf_counter()
    result = measure()
    ticks = (time.perf_counter() - begin) * os.sysconf("SC_CLK_TCK") * os.cpu_count()
    others = (_busy_ticks() - busy) - (ours() - mine)
    return result, (max(0.0, others / ticks) if ticks >= 50 else None)


def quietly(measure, pids: list[int], wait_s: float, retries: int) -> tuple[list[tuple], float]:
    """([(result, others' share)] for each try, seconds waited): measure once the machine is quiet, and again,
    up to `retries` times, while other processes took more than QUIET of the CPUs during it."""
    tries, waited = [], 0.0
    for _ in range(1 + retries):
        waited += wait_until_quiet(wait_s)
        tries.append(others_share(measure, pids))
        if tries[-1][1] is None or tries[-1][1] <= QUIET:
            break
    return tries, waited


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def machine(threads: int) -> dict:
    from moetier import native  # the standard library only
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = lambda key: next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith(key)), "")
    flags = set(line("flags").split())
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], check=False, capture_output=True, text=True).stdout.strip()
    versions = {}
    for package in ("torch", "transformers", "llama_cpp_python", "gguf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": line("model name") or "unknown", "cpus": os.cpu_count(), "llc_bytes": last_level_cache_bytes(),
        "flags": {"avx2": "avx2" in flags, "avx512": "avx512f" in flags,
                  "vnni": bool(flags & {"avx512_vnni", "avx_vnni"}), "amx": bool(flags & {"amx_tile", "amx_int8", "amx_bf16"})},
        "moetier_arch": " ".join(native.arch_flags()), "llama_cpp_lib": os.environ.get("LLAMA_CPP_LIB_PATH", "the package's"),
        "threads": threads, "loadavg": _loadavg(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"), "float_streams": _float_streams(threads),
        # other engineers' uncommitted work in moetier/ is part of what was measured
        "git_uncommitted_in_moetier": git("status", "--porcelain", "--", "moetier").splitlines(),
        "versions": versions,
    }


# -- the run ---------------------------------------------------------------------------------------------------

def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every engine and the bandwidth")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {','.join(FORMATS)}")
    parser.add_argument("--tokens", type=int, default=64, help="timed decode steps per run")
    parser.add_argument("--runs", type=int, default=3, help="timed runs, the engines alternating; best kept")
    parser.add_argument("--models", type=Path, default=REPO / "benchmarks" / ".models", help="cache folder for the model files")
    parser.add_argument("--preset", default="medium", help="moetier.model.synth preset")
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--checkpoint", type=Path, help="an HF checkpoint folder (config.json, *.safetensors) to run "
                        "instead of a synthetic one: converted to F32 GGUF by moetier, quantized by llama.cpp, cached in --models")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one load or timed pass may take")
    parser.add_argument("--quiet-wait", type=float, default=30, help="before each timed pass, wait up to this many "
                        "seconds for other processes to use under 10%% of the CPUs for 0.5 s (0: do not wait)")
    parser.add_argument("--retries", type=int, default=2, help="timed passes repeated while other processes "
                        f"took more than {QUIET * 100:.0f}%% of the CPUs during them (every pass counts; best kept)")
    parser.add_argument("--json", type=Path, help="also write the JSON object here")
    args = parser.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        parser.error(f"--formats {args.formats!r}: {bad or 'none'} (expected a comma-separated list of {','.join(FORMATS)})")
    if not 1 <= args.threads <= 8 * os.cpu_count():
        parser.error(f"--threads {args.threads} (expected 1..{8 * os.cpu_count()})")
    if args.tokens < 1 or args.runs < 1 or args.retries < 0 or args.quiet_wait < 0:
        parser.error("--tokens and --runs must be >= 1, --retries and --quiet-wait >= 0")
    if args.checkpoint is not None:  # its arch and vocabulary as moetier reads them; --arch and --preset name it
        try:
            args.arch, args.vocab_size = checkpoint_arch_and_vocab(args.checkpoint)
        except ValueError as error:
            parser.error(str(error))
        args.preset = args.checkpoint.resolve().name

    # Every engine (each worker inherits this) and the bandwidth run on the same `threads` CPUs, whatever
    # thread count an engine picks by itself ("every CPU this process may run on").
    cpus = sorted(os.sched_getaffinity(0))
    if args.threads < len(cpus):
        cpus = cpus[: args.threads]
        os.sched_setaffinity(0, cpus)

    from moetier.model.synth import sample_session

    loadavg_before = _loadavg()
    hf, files, file_errors = prepare_models(args.models, args.arch, args.preset, formats, args.checkpoint)
    if args.checkpoint is None:
        prompt = [int(i) for i in sample_session(hf, phases=("explore",), tokens_per_phase=PREFILL_TOKENS, seed=1)[0][1]]
    else:  # a user's checkpoint: token ids drawn uniformly from its vocabulary
        import numpy as np

        prompt = [int(i) for i in np.random.default_rng(1).integers(0, args.vocab_size, PREFILL_TOKENS)]
    per_token = {f: weight_bytes_per_token(files[f]) for f in {"F32", *formats} if f in files}
    context = PREFILL_TOKENS + args.tokens + 16

    bandwidth_bytes = max(1 << 30, 8 * last_level_cache_bytes())
    probe_buffer(bandwidth_bytes)  # held from before the engines load to the end (probe_buffer)

    # the timed order within a run; transformers after F32's pair (its weights are F32's)
    order = [(engine, f) for f in formats for engine in ("moetier", "llama.cpp")]
    if "F32" in formats:
        order.insert(2 * formats.index("F32") + 2, ("transformers", "F32"))
    errors = {("transformers", f): NOT_RUN for f in formats if f != "F32"}
    workers, settings = {}, {}
    for engine, f in order:
        if f not in files:
            errors[engine, f] = file_errors[f]
            continue
        log(f"loading {engine} on {'the HF float32 checkpoint' if engine == 'transformers' else files[f].name}")
        options = {"context": context} if engine == "llama.cpp" else {}
        try:
            worker = DecoderProcess(engine, hf if engine == "transformers" else files[f], args.threads, args.timeout, **options)
        except WorkerFailed as error:
            errors[engine, f] = str(error)
            continue
        settings.setdefault(engine, worker.settings)
        try:
            worker.measure(prompt, 2)  # warm-up, untimed
            workers[engine, f] = worker
        except WorkerFailed as error:
            errors[engine, f] = f"warm-up: {error}"
            worker.close()

    bandwidth: dict[int, list[tuple[dict, float | None]]] = {args.threads: [], 1: []}  # (reader -> bytes/s, others' share)
    timings: dict[tuple[str, str], list[tuple[dict, float | None]]] = {key: [] for key in order}
    waited_s = 0.0
    def sample_bandwidth(threads: int) -> None:
        nonlocal waited_s
        tries, waited = quietly(functools.partial(read_bandwidth, threads, bandwidth_bytes), [os.getpid()], args.quiet_wait, args.retries)
        bandwidth[threads] += tries
        waited_s += waited

    def latest(threads: int) -> float:
        return bandwidth[threads][-1][0]["best"]

    beside: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in order}  # per pass: samples before, after
    sample_bandwidth(args.threads)  # the first pass's before; each pass's after is the next one's before
    for run in range(args.runs):
        sample_bandwidth(1)
        for key in order:
            if key not in workers:
                continue
            log(f"run {run + 1}/{args.runs}: {key[0]} {key[1]}")
            before = latest(args.threads)
            try:
                tries, waited = quietly(functools.partial(workers[key].measure, prompt, args.tokens), [workers[key].pid, os.getpid()],
                                        args.quiet_wait, args.retries)
                waited_s += waited
            except WorkerFailed as error:
                errors[key] = str(error)
                continue
            sample_bandwidth(args.threads)  # after every pass: this host's bandwidth moves
            timings[key] += tries
            beside[key] += [(before, latest(args.threads))] * len(tries)
    for worker in workers.values():
        worker.close()

    best_bandwidth = {threads: max(b["best"] for b, _ in samples) for threads, samples in bandwidth.items()}  # a busy machine only slows it
    usual_bandwidth = statistics.median(b["best"] for b, _ in bandwidth[args.threads])  # the level the host held most
    roofline = {f: {"weight_bytes_per_token": b, "expert_tensor_types": types,
                    "tok_per_s": best_bandwidth[args.threads] / b} for f, (b, types) in per_token.items()}
    cells: dict[str, dict[str, dict]] = {engine: {} for engine in ENGINES}
    for engine in ENGINES:
        for f in formats:
            runs = timings.get((engine, f), [])
            if not runs:
                cells[engine][f] = {"error": errors.get((engine, f), "not run")}
                continue
            decode = [args.tokens / r["decode_s"] for r, _ in runs]
            prefill = [PREFILL_TOKENS / r["prefill_s"] for r, _ in runs]
            best = max(range(len(runs)), key=decode.__getitem__)
            pairs = beside[engine, f]
            local = [max(pair) for pair in pairs]  # the host's level around each pass, bytes/s
            top = [i for i, pair in enumerate(pairs) if min(pair) >= TOP_LEVEL * best_bandwidth[args.threads]]
            usual = [i for i, pair in enumerate(pairs) if all(abs(b / usual_bandwidth - 1) <= USUAL_BAND for b in pair)]
            cells[engine][f] = {"decode_tok_per_s": decode[best], "prefill_tok_per_s": max(prefill),
                                "roofline_share": decode[best] / roofline[f]["tok_per_s"],
                                "bandwidth_beside_runs": pairs,
                                "local_roofline_share_runs": [d * roofline[f]["weight_bytes_per_token"] / b for d, b in zip(decode, local)],
                                "top_level": level_cell(decode, prefill, top),
                                "usual_level": level_cell(decode, prefill, usual),
                                "decode_runs": decode, "prefill_runs": prefill, "ids": runs[best][0]["ids"],
                                "others_cpu_share": runs[best][1], "others_cpu_share_runs": [share for _, share in runs],
                                "error": errors.get((engine, f))}
    reference = cells["transformers"].get("F32", {})
    for f in formats:
        mine = cells["moetier"][f]
        if "decode_tok_per_s" not in mine:
            continue
        for peer, cell in (("llama_cpp", cells["llama.cpp"][f]), ("transformers", reference)):
            if "decode_tok_per_s" in cell:
                mine[f"speedup_vs_{peer}"] = mine["decode_tok_per_s"] / cell["decode_tok_per_s"]
                mine[f"prefill_speedup_vs_{peer}"] = mine["prefill_tok_per_s"] / cell["prefill_tok_per_s"]
                mine[f"same_greedy_tokens_as_{peer}"] = same_prefix(mine["ids"], cell["ids"])  # leading tokens equal
                for level in LEVELS:
                    if mine[level]["passes"] and cell[level]["passes"]:
                        mine[level][f"speedup_vs_{peer}"] = mine[level]["decode_tok_per_s"] / cell[level]["decode_tok_per_s"]
                        mine[level][f"prefill_speedup_vs_{peer}"] = mine[level]["prefill_tok_per_s"] / cell[level]["prefill_tok_per_s"]

    result = {
        "bench": "decode", "arch": args.arch, "preset": args.preset, "models": str(args.models),
        "files": {f: str(p) for f, p in files.items()}, "prefill_tokens": PREFILL_TOKENS, "decode_tokens": args.tokens,
        "runs": args.runs, "threads": args.threads, "cpus": cpus, "settings": settings,
        "quiet": {"wait_s": args.quiet_wait, "retries": args.retries, "others_share_above": QUIET, "waited_s": waited_s},
        "llama_model_params": LLAMA_MODEL_PARAMS,
        "read_bandwidth": {"method": f"a reduction over {bandwidth_bytes / 2**30:.2f} GiB float32 by torch.sum and by moetier's "
                                     "two native read probes, the fastest, best of 5 per run, best run",
                           "bytes_per_s": {str(t): v for t, v in best_bandwidth.items()},
                           "usual_bytes_per_s": usual_bandwidth,
                           "samples_bytes_per_s": {str(t): [b for b, _ in v] for t, v in bandwidth.items()},
                           "samples_others_cpu_share": {str(t): [share for _, share in v] for t, v in bandwidth.items()}},
        "roofline": roofline, "cells": cells, "machine": machine(args.threads) | {"loadavg_before": loadavg_before},
    }
    print_table(result, formats)
    line = json.dumps(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        staged = args.json.with_name(f".{args.json.name}.partial-{os.getpid()}")
        staged.write_text(line + "\n")
        os.replace(staged, args.json)
    print(line)


LEVELS = ("top_level", "usual_level")


def level_cell(decode: list[float], prefill: list[float], passes: list[int]) -> dict:
    """The passes that ran at one bandwidth level: how many, and their best decode and prefill tok/s."""
    return {"passes": len(passes), "decode_tok_per_s": max((decode[i] for i in passes), default=None),
            "prefill_tok_per_s": max((prefill[i] for i in passes), default=None)}


def print_table(result: dict, formats: list[str]) -> None:
    m, bandwidth = result["machine"], result["read_bandwidth"]
    print(f"{result['arch']} {result['preset']}: batch 1, greedy, {result['prefill_tokens']}-token prefill then "
          f"{result['decode_tokens']} decode steps, best of {result['runs']} alternating runs, {result['threads']} threads each, "
          f"every process on CPUs {result['cpus']}")
    print(f"{m['cpu']} ({m['cpus']} CPUs; {', '.join(k for k, v in m['flags'].items() if v)}), {m['date']}, "
          f"git {m['git_commit'][:10]} ({len(m['git_uncommitted_in_moetier'])} uncommitted in moetier/), "
          f"load average {m['loadavg_before']} before, {m['loadavg']} after")
    print(f"read bandwidth ({bandwidth['method']}): " + ", ".join(
        f"{v / 1e9:.1f} GB/s at {t} thread(s)" for t, v in sorted(bandwidth["bytes_per_s"].items())))
    for engine, text in result["settings"].items():
        print(f"  {engine}: {text}")
    print(f"  llama.cpp model params set: {result['llama_model_params']} (its repacked K-quant buffers crashed on the AVX-512 host)")
    columns = [("format", 8), ("engine", 14), ("decode tok/s", 13), ("prefill tok/s", 14), ("% read roofline", 16),
               ("vs llama.cpp", 13), ("vs transformers f32", 20), ("others' CPU", 12)]
    row = lambda *values: "".join(f"{v:<{w}}" if i < 2 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(values, columns)))
    print(row(*(name for name, _ in columns)))
    print("-" * sum(w for _, w in columns))
    for f in formats:
        roof = result["roofline"].get(f)
        if roof is not None:
            print(row(f, "read roofline", f"{roof['tok_per_s']:.1f}", "", "", "", "", ""))
        for engine in ENGINES:
            cell = result["cells"][engine][f]
            if cell.get("error") == NOT_RUN:
                continue
            if "decode_tok_per_s" not in cell:
                print(row(f, engine) + "  " + cell["error"][:110])
                continue
            llama, transformers = (f"{cell[k]:.2f}x" if k in cell else "" for k in ("speedup_vs_llama_cpp", "speedup_vs_transformers"))
            print(row(f, engine, f"{cell['decode_tok_per_s']:.1f}", f"{cell['prefill_tok_per_s']:.1f}", f"{cell['roofline_share']:.1%}",
                      llama, transformers, "-" if cell["others_cpu_share"] is None else f"{cell['others_cpu_share']:.0%}")
                  + (f"  (a run failed: {cell['error'][:60]})" if cell["error"] else ""))
    best, usual = bandwidth["bytes_per_s"][str(result["threads"])], bandwidth["usual_bytes_per_s"]
    headings = {"top_level": (best, f"at the top bandwidth level (passes whose samples before and after both read >= {TOP_LEVEL:.0%} "
                                    f"of the best, {best / 1e9:.1f} GB/s; the host's level can change from minute to minute)"),
                "usual_level": (usual, f"at the usual bandwidth level (passes whose samples before and after are both within "
                                       f"{USUAL_BAND:.0%} of the median sample, {usual / 1e9:.1f} GB/s)")}
    for level in LEVELS:
        level_bytes_per_s, heading = headings[level]
        print(f"{heading}: decode tok/s, % of that level's roofline, vs llama.cpp, prefill tok/s, vs llama.cpp")
        for f in formats:
            roof = result["roofline"].get(f)
            for engine in ENGINES:
                at = result["cells"][engine][f].get(level)
                if at is None or roof is None:
                    continue
                if not at["passes"]:
                    print(f"  {f:<8}{engine:<14}no pass at this level")
                    continue
                share = at["decode_tok_per_s"] * roof["weight_bytes_per_token"] / level_bytes_per_s
                vs, pvs = (f"{at[k]:.2f}x" if k in at else "-" for k in ("speedup_vs_llama_cpp", "prefill_speedup_vs_llama_cpp"))
                print(f"  {f:<8}{engine:<14}{at['decode_tok_per_s']:>8.1f} {share:>7.1%} {vs:>7}"
                      f" {at['prefill_tok_per_s']:>9.1f} {pvs:>7}   ({at['passes']} pass(es))")
    for f in formats:
        roof = result["roofline"].get(f)
        if roof is not None:
            types = ", ".join(f"{t} x{n}" for t, n in roof["expert_tensor_types"].items())
            print(f"{f}: {roof['weight_bytes_per_token'] / 1e6:.1f} MB of weights read per token; expert tensors {types}")
    same = [f"{f} vs {peer}: {cell[f'same_greedy_tokens_as_{key}']}/{result['decode_tokens'] + 1}"
            for f in formats for peer, key in (("llama.cpp", "llama_cpp"), ("transformers", "transformers"))
            for cell in [result["cells"]["moetier"][f]] if f"same_greedy_tokens_as_{key}" in cell]
    if same:
        print("moetier's greedy tokens, leading run equal to the peer's: " + "; ".join(same))
    quiet = result["quiet"]
    print(f"others' CPU: the share of the machine's CPUs other processes used during the best pass (- for a pass too short "
          f"to tell); each pass waited up to {quiet['wait_s']:.0f} s for a quiet machine and was repeated up to "
          f"{quiet['retries']} times while others took over {quiet['others_share_above']:.0%}; {quiet['waited_s']:.0f} s waited in all")

if __name__ == "__main__":
    main()

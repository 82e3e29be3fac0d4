"""Reproduce the seed's measurements with the simulator: one parameter set, every figure beside the seed's.

The seed (../shared/DESIGN.md, "Facts from the field") ran GLM-5.3-Flash (UD-IQ3_XXS) on the
machines examples/i7-i5.toml describes. This script builds each of its layouts from that file
(DEFER_CPU, affinity, tail skip, the helper GPU, the i5 over the LAN; DEFER_CPU into GLM-5.3's KDA layers too,
as the seed's engine did: the file's defer_into_linear = true), samples routing traces
from expert profiles whose static caches hit at the rates the seed states (the only hit rates
used as inputs), and predicts each with `moetier.sim.layout_sim.simulate`. The rows of a verify
pass (consecutive tokens) share experts as real consecutive tokens do: REUSE, measured on the real
Qwen1.5-MoE decode trace of shared/traces (`moetier.sim.reuse`; checked against the file when it
is present). Hardware rates come from data sheets (DDR4, GPU bandwidth, PCIe, 2.5 GbE); the nine
free parameters below were fitted once on this table and are the same for every row; `--fit`
reruns that fit from them (Nelder-Mead on the largest error).
Units as the seed reports them (docs/reproduction.md): tok/s counts accepted tokens; the CPU
lane and its waits are ms per accepted token; the GPU times are ms per verify pass.

    python scripts/reproduce_seed.py [--json] [--write-calibration] [--plot docs/reproduction]
    python scripts/reproduce_seed.py --fit [--iterations 150]   # ~5 s an iteration
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moetier.config import PartConfig, TierConfig, load_layout  # noqa: E402
from moetier.sched.cost import Calibration  # noqa: E402
from moetier.sched.placement import place  # noqa: E402
from moetier.sim.layout_sim import SHAPES, inclusion_probabilities, sample_trace, simulate  # noqa: E402
from moetier.sim.reuse import distinct_per_window, excess_overlap  # noqa: E402
from moetier.sim.traces import from_qwen15moe  # noqa: E402

LAYOUT = REPO / "examples" / "i7-i5.toml"
SHAPE = SHAPES["glm-5.3-flash-ud-iq3_xxs"]
E, K, L = SHAPE.num_experts, SHAPE.top_k, len(SHAPE.moe_layers)
EXPERT_PARAMS = 3 * 4096 * 2048

# -- data sheets and fixed assumptions (not fitted) ----------------------------------------
DDR4_BYTES_PER_S = 51.2e9  # DDR4-3200, two channels
GPU_BYTES_PER_S = 288e9  # RTX 4060 Ti
GPU_EFFICIENCY = 0.85  # share of it a batch-1 IQ3/IQ4 expert kernel streams (assumed, typical)
CPU_LANE_FLOPS = 0.5e12  # i7-10700K, 8 cores AVX2, IQ3/IQ4 dot products: each extra token row through an expert
GPU_US_PER_TOKEN_EXPERT = 2.0  # an extra row through an expert on the GPU: compute, next to nothing
ROWS_PER_PASS = 4  # multi-token prediction: 1 token + 3 drafts verified per pass
HELPER_CACHE_SLOTS = 785  # gpu0's expert slots beside the whole trunk (seed)

# -- consecutive tokens share experts (assumption 2): measured on a real trace, not fitted ---------------------
REUSE_TRACE = REPO.parent / "shared" / "traces" / "qwen15moe_gsm8k_layers_0_8_12_18_23.npz"  # not shipped: checked when present
REUSE = 0.045  # its decode steps' excess overlap, the 5 layers' mean (moetier.sim.reuse): the chance a row repeats the last

# -- inputs the seed states ------------------------------------------------------------------
HIT_BIAS, HIT_PLAIN, HIT_HELPER = 0.845, 0.575, 0.46  # 84-85% with bias, 57-58% without; 46% at 785 slots

# -- the free parameters: fitted once, shared by every row --------------------------------------
FITTED = {
    "tokens_per_pass": 2.3369,  # tokens accepted per verify pass (MTP acceptance)
    "cpu_efficiency": 0.7298,  # share of DDR4 bandwidth the CPU lane streams experts at
    "attention_us_per_layer": 845.7,  # trunk per layer and verify pass on a 4060 Ti (attention, shared expert, norms)
    "head_us": 599.9,  # per pass: final norm, lm head, drafting
    "dispatch_us_per_layer": 1.6,  # per MoE layer on the GPU's clock: routing and launching the hits
    "lane_fixed_us": 747.2,  # per CPU-lane call: rows and picks to the host, the lane's wake-up, its partial back
    "affinity_hit_rate": 0.8979,  # VRAM hit rate under live-cache affinity lambda 0.25 (the seed gives none)
    "skip_budget_us": 2735.2,  # the tail-skip budget per MoE layer and pass
    "helper_bytes": 1.263e+10,  # what gpu1 (16 GiB) holds of experts when it carries no trunk: the helper layout
}

SEED = [  # key, what, seed figure, unit
    ("base", "baseline (bias, DEFER_CPU=1)", 18.6, "tok/s"),
    ("plain", "without the bias", 11.3, "tok/s"),
    ("defer", "DEFER_CPU=2", 21.3, "tok/s"),
    ("wait_base", "gpu1 waits for the CPU lane, baseline", 11.6, "ms/token"),
    ("wait_defer", "gpu1 waits for the CPU lane, DEFER_CPU=2", 5.0, "ms/token"),
    ("affinity", "affinity 0.25", 24.8, "tok/s"),
    ("affinity_defer", "affinity 0.25 + DEFER_CPU=2", 29.7, "tok/s"),
    ("gpu0", "gpu0 time, affinity + DEFER_CPU=2", 40.7, "ms/pass"),
    ("gpu1", "gpu1 time, affinity + DEFER_CPU=2", 42.1, "ms/pass"),
    ("lane", "CPU lane, affinity + DEFER_CPU=2", 33.1, "ms/token"),
    ("lane_skip", "CPU lane with tail skip", 27.5, "ms/token"),
    ("skip_speedup", "decode speedup from tail skip", 1.00, "x"),
    ("split", "normal split, lossless (DEFER_CPU=0)", 19.2, "tok/s"),
    ("helper", "helper GPU, lossless", 11.0, "tok/s"),
    ("lan_ms", "LAN round trips, 42 per pass", 6.6, "ms/pass"),
    ("lan_speedup", "i5 over the LAN, best case", 1.15, "x"),
]


def measured_reuse(path: Path = REUSE_TRACE) -> float:
    """The share of a decode token's picks that repeat the previous token's beyond chance, on the real Qwen1.5-MoE
    trace (a request's rows in consecutive vLLM decode calls), averaged over its layers: what REUSE holds."""
    return float(excess_overlap(from_qwen15moe(path)).mean())


def calibration(f: dict = FITTED) -> Calibration:
    """The i7's rates from its data sheets and the fitted efficiencies (examples/i7-i5.calibration.json)."""
    return Calibration(
        cpu_us_per_expert=round(SHAPE.expert_bytes / (f["cpu_efficiency"] * DDR4_BYTES_PER_S) * 1e6, 1),
        cpu_us_per_token_expert=round(2 * EXPERT_PARAMS / CPU_LANE_FLOPS * 1e6, 1),
        gpu_us_per_expert=round(SHAPE.expert_bytes / (GPU_EFFICIENCY * GPU_BYTES_PER_S) * 1e6, 1),
        gpu_us_per_token_expert=GPU_US_PER_TOKEN_EXPERT, attention_us_per_layer=f["attention_us_per_layer"],
        head_us=f["head_us"], dispatch_us_per_layer=f["dispatch_us_per_layer"], expert_bytes=SHAPE.expert_bytes,
        cpu_lane_fixed_us=f["lane_fixed_us"],
        machine="i7-10700K + 2x RTX 4060 Ti (derived by scripts/reproduce_seed.py, not measured)")


# -- routing: expert shares (Zipf-Mandelbrot, rank + b) whose static top-S hits at a given rate ------
def shares(alpha: float, b: float) -> np.ndarray:
    return (np.arange(1, E + 1) + b) ** -alpha  # [E] rank order: expert 0 the hottest


def coverage(share: np.ndarray, slots) -> float:
    """The share of picks a static top-`slots` cache holds; `slots` may be [(slots, layers), ...]: the caches of
    parts of different sizes, averaged over their layers (the seed's hit rates are the whole split's)."""
    q = inclusion_probabilities(share[None], K)[0]
    if isinstance(slots, int):
        return float(q[:slots].sum() / K)
    return float(sum(q[:s].sum() * n for s, n in slots) / K / sum(n for _, n in slots))


def solve(fn, target: float, lo: float, hi: float, rising: bool = True) -> float:
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (fn(mid) < target) == rising else (lo, mid)
    return (lo + hi) / 2


def stretched(scale: float, power: float) -> np.ndarray:
    return np.exp(-((np.arange(E) / scale) ** power))  # [E] rank order: expert 0 the hottest


def profiles(split_slots: list[tuple[int, int]], helper_slots: int, affinity_hit_rate: float = FITTED["affinity_hit_rate"]) -> dict[str, np.ndarray]:
    """[E] shares: with bias (through both stated hit rates), without (a pure Zipf through its one), and
    under affinity (the miss mass cut to the fitted hit rate, spread over residents as before). The biased shares
    are a stretched exponential exp(-(rank / s)^p): with 288 experts no Zipf-Mandelbrot (rank + b)^-a passes
    through both biased points (as a, b grow it tends to the exponential, p = 1, and stops short of 84.5%)."""
    scale_of = lambda p: solve(lambda sc: coverage(stretched(sc, p), split_slots), HIT_BIAS, 1.0, float(E), rising=False)  # noqa: E731
    power = solve(lambda p: coverage(stretched(scale_of(p), p), helper_slots), HIT_HELPER, 0.3, 3.0, rising=False)
    bias = stretched(scale_of(power), power)
    plain = shares(solve(lambda a: coverage(shares(a, 0.0), split_slots), HIT_PLAIN, 0.0, 12.0), 0.0)
    q = inclusion_probabilities(bias[None], K)[0]
    resident = round(sum(s * n for s, n in split_slots) / sum(n for _, n in split_slots))  # the caches' mean size
    hit, target = q[:resident].sum() / K, affinity_hit_rate
    affinity = q.copy()
    affinity[:resident] *= target / hit
    affinity[resident:] *= (1 - target) / (1 - hit)
    return {"bias": bias, "plain": plain, "affinity": affinity}


# -- the layouts -----------------------------------------------------------------------------
def variants(base, f: dict = FITTED) -> dict:
    sched = lambda layout, **kw: layout.with_scheduler(**kw)  # noqa: E731
    vram0, vram1, cpu = base.tiers
    helper = replace(base, parts=(PartConfig("all", "gpu0", 0, None),), tiers=(
        replace(vram0, capacity_bytes=HELPER_CACHE_SLOTS * SHAPE.expert_bytes),
        TierConfig("helper", "helper", device="gpu1", capacity_bytes=int(f["helper_bytes"]), link="pcie1", experts="hot"), cpu))
    i5 = TierConfig("i5", "remote", host="i5", address="tcp://i5.lan:5555", link="lan", experts="all")
    return {
        "base": sched(base, defer_cpu=1), "defer": sched(base, defer_cpu=2), "split": sched(base, defer_cpu=0),
        "skip": sched(base, defer_cpu=2, tail_skip=True),
        "helper": sched(helper, defer_cpu=0), "lan": replace(sched(base, defer_cpu=1), tiers=base.tiers + (i5,)),
    }


def predict(f: dict = FITTED, passes: int = 300) -> tuple[dict, dict]:
    base, cal = load_layout(LAYOUT), calibration(f)
    base = base.with_scheduler(budget_us=f["skip_budget_us"])
    layouts = variants(base, f)
    placed = place(base, SHAPE)
    split_slots = [(placed[t].slots, len(placed[t].layers)) for t in ("vram0", "vram1")]  # each GPU's cache, its layers
    helper_slots = place(layouts["helper"], SHAPE)["vram0"].slots
    prof = profiles(split_slots, helper_slots, f["affinity_hit_rate"])
    tau = f["tokens_per_pass"]
    traces = {name: sample_trace(np.tile(share, (L, 1)), K, passes * ROWS_PER_PASS, seed=0, source=f"profile:{name}",
                               reuse=REUSE) for name, share in prof.items()}  # one sampling per profile, shared by its layouts

    def run(layout, profile: str):
        table, trace = np.tile(prof[profile], (L, 1)), traces[profile]  # [L, E], its sampled passes
        served = {name: placed.layers for name, placed in place(layout, SHAPE).items()}
        held = {t.name: table[: len(served[t.name])] for t in layout.tiers if t.kind != "cpu"}  # caches and hot rules: the same shares
        return simulate(layout, SHAPE, cal, trace, rows_per_pass=ROWS_PER_PASS, tokens_per_pass=tau, profiles=held)

    engine_rule = layouts["defer"].with_scheduler(defer_into_linear=False)  # moetier's engine: no deferral into a KDA layer
    sims = {"base": run(layouts["base"], "bias"), "plain": run(layouts["base"], "plain"), "defer": run(layouts["defer"], "bias"),
            "defer_engine": run(engine_rule, "bias"), "affinity_defer_engine": run(engine_rule, "affinity"),
            "affinity": run(layouts["base"], "affinity"), "affinity_defer": run(layouts["defer"], "affinity"),
            "skip": run(layouts["skip"], "affinity"), "split": run(layouts["split"], "bias"),
            "helper": run(layouts["helper"], "bias"), "lan": run(layouts["lan"], "bias")}
    wait = lambda s: s.prediction.ms_per_token.get("cpu lane wait (part 1)", 0.0)  # noqa: E731
    lane = lambda s: s.prediction.busy_ms_per_token["cpu"]  # noqa: E731
    best = sims["affinity_defer"]
    lan_link = base.link("lan")
    model = {
        "base": sims["base"].tok_per_s, "plain": sims["plain"].tok_per_s, "defer": sims["defer"].tok_per_s,
        "wait_base": wait(sims["base"]), "wait_defer": wait(sims["defer"]),
        "affinity": sims["affinity"].tok_per_s, "affinity_defer": best.tok_per_s,
        "gpu0": best.prediction.part_ms_per_token["first"] * tau, "gpu1": best.prediction.part_ms_per_token["second"] * tau,
        "lane": lane(best), "lane_skip": lane(sims["skip"]), "skip_speedup": sims["skip"].tok_per_s / best.tok_per_s,
        "split": sims["split"].tok_per_s, "helper": sims["helper"].tok_per_s,
        "lan_ms": L * (lan_link.rtt_us + 2 * SHAPE.hidden_bytes * 8 / (lan_link.gbps * 1e3)) / 1e3,
        "lan_speedup": sims["lan"].tok_per_s / sims["base"].tok_per_s,
    }
    extra = {"helper_hit_rate": sims["helper"].tier_hit_rate["vram0"], "base_hit_rate": sims["base"].hit_rate,
             "plain_hit_rate": sims["plain"].hit_rate, "affinity_hit_rate": sims["affinity"].hit_rate,
             "split_slots_per_layer": split_slots, "helper_cache_slots_per_layer": helper_slots,
             "helper_share_per_token": sims["helper"].served_per_token.get("helper", 0.0),
             "lan_remote_experts_per_token": sims["lan"].served_per_token.get("i5", 0.0),
             "distinct_experts_per_pass": distinct_per_window(traces["bias"], ROWS_PER_PASS),  # bias profile, per layer
             "distinct_experts_per_pass_independent": float((1 - (1 - inclusion_probabilities(prof["bias"][None], K)) ** ROWS_PER_PASS).sum()),
             # what the seed's figures need of the parts against what one profile per layer gives (docs/reproduction.md)
             "lane_ratio_needed": lane_ratio_needed((split_slots[0][1], split_slots[1][1])),
             "miss_ratio_modelled": (1 - coverage(prof["bias"], split_slots[0][0])) / (1 - coverage(prof["bias"], split_slots[1][0])),
             # DEFER_CPU=2 as moetier's engine defers (not into KDA layers): what a moetier run of these layouts would give
             "defer_engine_rule_tok_per_s": sims["defer_engine"].tok_per_s,
             "affinity_defer_engine_rule_tok_per_s": sims["affinity_defer_engine"].tok_per_s}
    return model, extra


def plot(folder: Path, passes: int = 200) -> list[str]:
    """tok/s vs the LAN round trip (the i5 against the baseline, with the 1.4x bar) and vs VRAM slots per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moetier.sim.layout_sim import with_value

    base, cal, tau = load_layout(LAYOUT), calibration(), FITTED["tokens_per_pass"]
    layouts = variants(base)
    placed = place(base, SHAPE)
    prof = profiles([(placed[t].slots, len(placed[t].layers)) for t in ("vram0", "vram1")], place(layouts["helper"], SHAPE)["vram0"].slots)
    trace = sample_trace(np.tile(prof["bias"], (L, 1)), K, passes * ROWS_PER_PASS, seed=0, reuse=REUSE)

    def speed(layout) -> float:
        served = {name: placed.layers for name, placed in place(layout, SHAPE).items()}
        held = {t.name: np.tile(prof["bias"], (len(served[t.name]), 1)) for t in layout.tiers if t.kind != "cpu"}
        return simulate(layout, SHAPE, cal, trace, rows_per_pass=ROWS_PER_PASS, tokens_per_pass=tau, profiles=held).tok_per_s

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    reference = speed(layouts["base"])
    rtts = [0, 10, 25, 50, 115, 200, 400]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rtts, [speed(with_value(layouts["lan"], "rtt_us", r)) / reference for r in rtts], marker="o", label="i5 holds every expert")
    ax.axhline(1.4, color="red", linestyle="--", label="1.4x bar")
    ax.axvline(115, color="grey", linestyle=":", label="2.5 GbE (167 us per hidden state)")
    ax.set(xlabel="LAN round trip latency, us (+ 52 us per row on the wire)", ylabel="speedup over the baseline",
           title="expert parallelism over the LAN (seed model)")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, folder / "seed_lan_speedup_vs_rtt.png"))
    slots = [18, 30, 45, 54, 75, 90, 128]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("split", "DEFER_CPU=0"), ("base", "DEFER_CPU=1"), ("defer", "DEFER_CPU=2")):
        ax.plot(slots, [speed(with_value(layouts[key], "slots", s)) for s in slots], marker="o", label=label)
    ax.axvline(54, color="grey", linestyle=":", label="the seed's 54 slots")
    ax.set(xlabel="VRAM slots per layer (each GPU, its own layers)", ylabel="predicted tok/s", title="tok/s vs slots (seed model, bias)")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, folder / "seed_tok_s_vs_slots.png"))
    return written


# -- the fit ---------------------------------------------------------------------------------
STEPS = {"helper_bytes": 0.5e9, "tokens_per_pass": 0.05, "cpu_efficiency": 0.03, "attention_us_per_layer": 50.0, "head_us": 100.0,
         "dispatch_us_per_layer": 20.0, "affinity_hit_rate": 0.01, "skip_budget_us": 200.0, "lane_fixed_us": 150.0}
BOUNDS = {"helper_bytes": (8e9, 16.58e9), "tokens_per_pass": (1.0, ROWS_PER_PASS), "cpu_efficiency": (0.05, 1.0), "affinity_hit_rate": (HIT_BIAS, 0.999)}


def lane_ratio_needed(part_layers: tuple[int, int] = (20, 22)) -> float:
    """The least CPU-lane work per MoE layer of the first part (gpu0) over that of the second (gpu1), at the baseline,
    that the seed's own figures allow in `predict_pass`'s critical path (docs/reproduction.md, "Why DEFER_CPU=2 stays
    above 10%"). Per pass, with T tokens accepted: the GPU times at affinity + DEFER_CPU=2 give T >= 29.7 (40.7 + 42.1)
    / 1000; affinity's saving at DEFER_CPU=1 (13.4T ms) needs the baseline's lane to carry at least that much more than
    its 33.1T; DEFER_CPU=2 saves at most the trunk time A of each deferred layer of the second part, so A >= 6.8T / 21;
    the second part's lane is at most its wait (11.6T, not deferred) plus its GPU expert time (at most 42.1 - 22 A).
    The rest of the baseline's lane is the first part's."""
    seed = {key: value for key, _, value, _ in SEED}
    first, second = part_layers
    tokens = seed["affinity_defer"] * (seed["gpu0"] + seed["gpu1"]) / 1e3  # the least T
    trunk = 1e3 * (1 / seed["base"] - 1 / seed["defer"]) * tokens / (second - 1)  # the least A, ms
    lane = seed["lane"] * tokens + 1e3 * (1 / seed["base"] - 1 / seed["affinity"]) * tokens  # the least baseline lane, ms/pass
    lane_second = seed["wait_base"] * tokens + seed["gpu1"] - second * trunk  # the most of it on the second part's layers
    return ((lane - lane_second) / first) / (lane_second / second)


def errors(model: dict) -> dict[str, float]:
    """Each figure's relative error against the seed: model / seed - 1."""
    return {key: model[key] / seed - 1 for key, _, seed, _ in SEED}


def misfit(f: dict, passes: int = 300) -> tuple[float, dict]:
    """The largest |log(model / seed)| over the table, smoothed as a 16-norm (what the fit minimises), and the errors."""
    error = errors(predict(f, passes)[0])
    return float((np.abs(np.log1p(list(error.values()))) ** 16).sum() ** (1 / 16)), error


def fit(start: dict, iterations: int) -> tuple[dict, float, dict, float]:
    """Nelder-Mead from `start` over its keys (positive, within BOUNDS) -> the best set, its misfit, its errors, and
    the start's misfit."""
    keys = list(start)

    def cost(x: np.ndarray) -> float:
        f = dict(zip(keys, x.tolist()))
        if any(v <= 0 for v in x) or any(not lo <= f[k] <= hi for k, (lo, hi) in BOUNDS.items() if k in f):
            return float("inf")
        return misfit(f)[0]

    simplex = [np.array([start[k] for k in keys], float)]
    simplex += [simplex[0] + STEPS[k] * np.eye(len(keys))[i] for i, k in enumerate(keys)]
    values = [cost(x) for x in simplex]
    start_misfit = values[0]
    for iteration in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = np.mean(simplex[:-1], axis=0)
        reflected = 2 * centre - simplex[-1]
        value = cost(reflected)
        if value < values[0]:
            expanded = 3 * centre - 2 * simplex[-1]
            grown = cost(expanded)
            simplex[-1], values[-1] = (expanded, grown) if grown < value else (reflected, value)
        elif value < values[-2]:
            simplex[-1], values[-1] = reflected, value
        else:
            contracted = (centre + simplex[-1]) / 2
            shrunk = cost(contracted)
            if shrunk < values[-1]:
                simplex[-1], values[-1] = contracted, shrunk
            else:  # shrink towards the best
                simplex = [simplex[0]] + [(simplex[0] + x) / 2 for x in simplex[1:]]
                values = [values[0]] + [cost(x) for x in simplex[1:]]
        print(f"iteration {iteration + 1}: misfit {min(values):.4f}", file=sys.stderr, flush=True)
    best = dict(zip(keys, simplex[int(np.argmin(values))].tolist()))
    return best, *misfit(best), start_misfit


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--write-calibration", action="store_true", help="rewrite examples/i7-i5.calibration.json from the data sheets")
    parser.add_argument("--plot", type=Path, help="also draw tok/s vs LAN round trip and vs slots into this folder")
    parser.add_argument("--fit", action="store_true", help="refit the free parameters from FITTED (Nelder-Mead) and print the result")
    parser.add_argument("--iterations", type=int, default=150, help="with --fit: Nelder-Mead iterations (default 150)")
    args = parser.parse_args()
    if args.fit:
        best, value, error, before = fit(FITTED, args.iterations)
        print(json.dumps({"start_misfit": before, "misfit": value, "fitted": best, "errors": error,
                          "within_10_percent": sum(abs(e) <= 0.10 for e in error.values())}))
        return
    target = LAYOUT.parent / "i7-i5.calibration.json"
    if args.write_calibration:
        target.write_text(calibration().to_json() + "\n")
    elif Calibration.load(target) != calibration():
        raise SystemExit(f"{target} differs from this script's derivation (run with --write-calibration)")
    reuse = measured_reuse() if REUSE_TRACE.exists() else None
    if reuse is not None and round(reuse, 3) != REUSE:
        raise SystemExit(f"{REUSE_TRACE.name}: measured reuse {reuse:.4f} differs from REUSE = {REUSE}")
    if load_layout(LAYOUT).scheduler.budget_us != FITTED["skip_budget_us"]:
        raise SystemExit(f"{LAYOUT}: [scheduler].budget_us differs from FITTED['skip_budget_us']")
    if not load_layout(LAYOUT).scheduler.defer_into_linear:
        raise SystemExit(f"{LAYOUT}: [scheduler].defer_into_linear is false (the seed deferred into the KDA layers: expected true)")
    started = time.perf_counter()
    model, extra = predict()
    error = errors(model)
    rows = [{"key": key, "what": what, "unit": unit, "seed": seed, "model": model[key], "error": error[key]} for key, what, seed, unit in SEED]
    summary = {"rows": rows, "figures": len(rows), "free_parameters": len(FITTED), "fitted": FITTED,
               "inputs": {"hit_rate_bias": HIT_BIAS, "hit_rate_plain": HIT_PLAIN, "hit_rate_helper_cache": HIT_HELPER},
               "reuse": {"value": REUSE, "trace": REUSE_TRACE.name, "measured": reuse},
               "checks": extra, "within_10_percent": sum(abs(r["error"]) <= 0.10 for r in rows),
               "seconds": time.perf_counter() - started}
    if not args.json:
        print(f"{'figure':44} {'seed':>7} {'model':>7} {'error':>7}  unit")
        for r in rows:
            flag = "" if abs(r["error"]) <= 0.10 else "  (> 10%)"
            print(f"{r['what']:44} {r['seed']:7.2f} {r['model']:7.2f} {100 * r['error']:+6.1f}%  {r['unit']}{flag}")
        print(f"{summary['within_10_percent']} of {len(rows)} figures within 10%; {len(FITTED)} free parameters "
              f"({', '.join(FITTED)}); inputs: hit rates {HIT_BIAS:.1%} / {HIT_PLAIN:.1%} / {HIT_HELPER:.0%}")
        print(f"outputs to check: helper cache hit rate {extra['helper_hit_rate']:.1%} (input 46%), affinity hit rate "
              f"{extra['affinity_hit_rate']:.1%}; distinct experts per pass and layer {extra['distinct_experts_per_pass']:.2f} "
              f"(independent rows: {extra['distinct_experts_per_pass_independent']:.2f}) at reuse {REUSE} "
              f"({'measured ' + format(reuse, '.4f') if reuse is not None else 'trace absent, not checked'} on {REUSE_TRACE.name}); "
              f"{summary['seconds']:.1f} s")
        print(f"the seed's figures need gpu0's MoE layers to carry >= {extra['lane_ratio_needed']:.2f}x gpu1's CPU-lane work per "
              f"layer at the baseline; its cache gives them {extra['miss_ratio_modelled']:.2f}x the misses (docs/reproduction.md)")
        print(f"DEFER_CPU=2 as moetier's engine defers (not into KDA layers): {extra['defer_engine_rule_tok_per_s']:.1f} tok/s, "
              f"with affinity {extra['affinity_defer_engine_rule_tok_per_s']:.1f} (the layouts above defer into them, as the seed did)")
    if args.plot is not None:
        summary["plots"] = plot(args.plot)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

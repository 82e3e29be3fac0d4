"""The simulator: routing traces replayed through residency policies, and Belady's optimum."""

from moetier.sim.replay import AffinityReplay, ReplayResult, belady, replay, replay_with_affinity
from moetier.sim.traces import ExpertCounts, RoutingTrace, from_flame, from_qwen15moe, load_counts, synthetic_trace

__all__ = [
    "AffinityReplay", "ExpertCounts", "ReplayResult", "RoutingTrace", "belady", "from_flame", "from_qwen15moe",
    "load_counts", "replay", "replay_with_affinity", "synthetic_trace",
]

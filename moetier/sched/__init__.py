"""The scheduler: a cost model per tier and the per-layer plan under a latency budget."""

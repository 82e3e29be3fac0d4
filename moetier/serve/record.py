"""Recorded sessions: each served request as a session record and a routing trace, the files profiles read.

`Recorder(folder)` appends one line per request to FOLDER/sessions.jsonl in
moetier.profile.sessions' format: {"phase", "ids": prompt + completion,
"session", "profile" (false only when held out), "meta": {request id,
endpoint, token counts, cached and prefilled tokens, timings, finish reason,
trace}}; and writes FOLDER/traces/<request id>.npz, a moetier.sim.traces
RoutingTrace of the tokens the engine computed for it (the prefilled ones,
then each decoded one; extra: request, cached and prefill tokens), which
`moetier simulate` replays. So `moetier profile FOLDER/sessions.jsonl`, `moetier
kl --sessions FOLDER/sessions.jsonl` and `moetier simulate --trace
FOLDER/traces/X.npz` read a recording as it is. Each line is one write on an
append-only file and is fsynced; a line cut short by a crash is removed when
the next recorder opens the file. Traces appear whole (a rename).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

from moetier.sim.traces import RoutingTrace

SESSIONS, TRACES = "sessions.jsonl", "traces"


class TraceRows:
    """An engine observer: each MoE layer's routing of each forward, kept on the host."""

    def __init__(self, layers: list[int]):
        self.layers = list(layers)
        self.rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per (forward, layer): picks, weights, probs

    def __call__(self, layer: int, route) -> None:
        self.rows.append((route.picks.cpu().numpy(), route.weights.float().cpu().numpy(),
                          route.probs.float().cpu().numpy()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """picks [T, L, k], weights [T, L, k], probs [T, L, E] over every token seen; None before any."""
        n = len(self.layers)
        if not self.rows or len(self.rows) % n:
            return None
        forwards = [self.rows[i : i + n] for i in range(0, len(self.rows), n)]
        stack = lambda part: np.concatenate([np.stack([r[part] for r in f], axis=1) for f in forwards])  # noqa: E731
        return stack(0), stack(1), stack(2)


class Recorder:
    def __init__(self, folder: Path, model_fingerprint: str, num_experts: int, layers: list[int]):
        self.folder = Path(folder)
        (self.folder / TRACES).mkdir(parents=True, exist_ok=True)
        self.path = self.folder / SESSIONS
        self.fingerprint, self.num_experts, self.layers = model_fingerprint, num_experts, list(layers)
        self.lock = threading.Lock()
        self._drop_torn_line()

    def _drop_torn_line(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        data = self.path.read_bytes()
        if not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def observer(self) -> TraceRows:
        return TraceRows(self.layers)

    def record(self, request_id: str, endpoint: str, phase: str, session: str, profile: bool, result,
               rows: TraceRows | None) -> dict:
        """Write the request's session line (and trace); returns the record."""
        stats = result.stats
        trace_name = None
        arrays = rows.arrays() if rows is not None else None
        if arrays is not None:
            picks, weights, probs = arrays
            trace = RoutingTrace(picks=picks, weights=weights, probs=probs, num_experts=self.num_experts,
                                 layer_ids=tuple(self.layers), model=self.fingerprint, source=f"moetier serve {request_id}",
                                 phase=np.zeros(len(picks), np.int8), phase_names=(phase,),
                                 extra={"request": request_id, "cached_tokens": stats.cached_tokens,
                                        "prefill_tokens": stats.prefill_tokens, "decode_tokens": len(picks) - stats.prefill_tokens})
            trace_name = f"{TRACES}/{request_id}.npz"
            trace.save(self.folder / trace_name)
        record = {"phase": phase, "ids": [int(i) for i in list(result.prompt_ids) + list(result.ids)], "session": session,
                  "meta": {"request": request_id, "endpoint": endpoint, "finish_reason": result.finish_reason,
                           **stats.to_dict(), "completion_tokens": len(result.ids), "trace": trace_name}}
        if not profile:
            record["profile"] = False
        line = (json.dumps(record) + "\n").encode()
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        return record

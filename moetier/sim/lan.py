"""Expert parallelism over a LAN: would moving CPU-lane work to a second host pay, for a measured round trip?

The seed's negative result (one hidden-state round trip per MoE layer, 42 x
167 us = 6.6 ms/token; modelled best case 1.15x against a 1.4x bar) is this
model's output for the seed's inputs. `moetier ping` feeds it a measured
round trip.
"""

from __future__ import annotations


def lan_speedup(rtt_us: float, layers: int, token_ms: float, cpu_lane_ms: float, cpu_wait_ms: float, remote_speed: float = 1.0) -> dict:
    """Modelled speedup of moving CPU-lane work to a remote host over a link with this round trip.

    Inputs per token: T = token_ms now; the CPU lane's work C = cpu_lane_ms, of
    which W = cpu_wait_ms is on the critical path (the GPU waits for it); one
    round trip per MoE layer, L x rtt. The remote computes `remote_speed` times
    as fast as the local lane.
      best:   the remote takes a share s of the lane's work in parallel with the
              local lane, its round trips overlapped with local work, split so
              both finish together: (1 - s) C = s C / speed + L rtt. The lane then
              takes (1 - s) C, and the wait shrinks by what the lane saved:
              W' = max(0, W - s C); T' = T - W + W'.
      serial: the round trips sit on the critical path and the wait disappears:
              T' = T - W + L rtt.
    speedup = T / T'. Everything else (attention, GPU experts) is unchanged.
    """
    round_trips_ms = layers * rtt_us / 1000.0
    share = min(max((cpu_lane_ms - round_trips_ms) / (cpu_lane_ms + cpu_lane_ms / remote_speed), 0.0), 1.0)
    wait_ms = max(0.0, cpu_wait_ms - share * cpu_lane_ms)
    return {"round_trips_ms_per_token": round_trips_ms, "remote_share": share,
            "best_speedup": token_ms / (token_ms - cpu_wait_ms + wait_ms),
            "serial_speedup": token_ms / (token_ms - cpu_wait_ms + round_trips_ms)}

#!/usr/bin/env bash
# Same speed before and after a change: run a benchmark on a base commit and on this tree, alternated.
#
#   bash scripts/ab_bench.sh BASE [ROUNDS] [BENCH...]     # e.g. bash scripts/ab_bench.sh 34cd9b0 5
#
# BASE is checked out into a temporary git worktree; both sides run with this tree's .venv
# (each benchmark puts its own tree first on sys.path), one process per run, in the order
# base, this tree, base, this tree, ... for each benchmark (default: bench_decode.py and
# bench_sched.py). Prints each run's JSON line, prefixed with "base" or "this", and the
# folder that keeps the full logs. Compare the medians; one run alone says little on a shared VM.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${1:?usage: ab_bench.sh BASE [ROUNDS] [BENCH...]}"
ROUNDS="${2:-3}"
shift $(( $# >= 2 ? 2 : 1 ))
BENCHES=("$@")
[ ${#BENCHES[@]} -gt 0 ] || BENCHES=(bench_decode.py bench_sched.py)
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "ab_bench: no $PY (run make setup first)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'git -C "$ROOT" worktree remove --force "$work/base" >/dev/null 2>&1 || true' EXIT
git -C "$ROOT" worktree add --detach -f "$work/base" "$BASE" >/dev/null 2>&1
for bench in "${BENCHES[@]}"; do
  for round in $(seq "$ROUNDS"); do
    for side in base this; do
      tree="$work/base"; [ "$side" = this ] && tree="$ROOT"
      log="$work/${bench%.py}-$side-$round.log"
      "$PY" "$tree/benchmarks/$bench" > "$log" 2>&1 || { echo "ab_bench: $side $bench failed (see $log)" >&2; exit 1; }
      echo "$side $bench $round $(tail -n 1 "$log")"
    done
  done
done
echo "logs: $work" >&2

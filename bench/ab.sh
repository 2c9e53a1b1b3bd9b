#!/usr/bin/env bash
# bench/ab.sh BIN_A BIN_B [reps] [secs] — two builds of ferrovol on the same job suite,
# in one run, alternating A B A B ... so that both see the same machine noise; prints
# the median of each job per build and B/A ratios (IOPS, mean latency, and server CPU
# per kIOPS). Each rep starts each build on a fresh pool with a 1 GiB working set
# written (../shared/tools/nbd-bench.sh preconditions it).
#
#   bash bench/ab.sh /tmp/ferrovol-before target/release/ferrovol 3 10
#
# Env: JOBS (nbd-bench.sh's job list; default the 4K jobs), WORK, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
A=$(realpath "$1"); B=$(realpath "$2"); REPS=${3:-3}; SECS=${4:-10}
export JOBS=${JOBS:-"rr4k-qd1 rr4k-qd32 rr4k-qd32-mc rw4k-qd32"}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10833}
TSV=$WORK/ab.tsv
mkdir -p "$WORK"; : > "$TSV"
trap 'stop_server; rm -rf "$WORK/ab"' EXIT
for rep in $(seq "$REPS"); do
  for side in A B; do
    if [ "$side" = A ]; then BIN=$A; else BIN=$B; fi
    rm -rf "$WORK/ab"
    start_server "$WORK/ab" "$PORT" --pool-size 8GiB
    "$BIN" --data-dir "$WORK/ab" volume create bench --size 2GiB >/dev/null
    SERVER_PID=$PID LABEL=$side TSV=$TSV bash ../shared/tools/nbd-bench.sh "nbd://127.0.0.1:$PORT/bench" "$SECS" >&2
    stop_server
  done
done
PYTHONPATH=bench /usr/bin/python3 - "$TSV" <<'PY'
import sys, statistics as st
from tsv import load
rows = load(sys.argv[1])
jobs = sorted({j for (_, j) in rows}, key=lambda j: j)
print(f"{'job':<14} {'IOPS A':>9} {'IOPS B':>9} {'B/A':>6} {'mean A':>8} {'mean B':>8} {'cpu/kIOPS A':>12} {'B':>6} {'B/A':>6}")
for j in jobs:
    a, b = rows.get(("A", j)), rows.get(("B", j))
    if not a or not b:
        continue
    med = lambda xs, i: st.median(x[i] for x in xs)
    ca = st.median(x[2] / (x[0] / 1000) for x in a)
    cb = st.median(x[2] / (x[0] / 1000) for x in b)
    print(f"{j:<14} {med(a,0):>9.0f} {med(b,0):>9.0f} {med(b,0)/med(a,0):>6.2f} {med(a,1):>8.1f} {med(b,1):>8.1f} {ca:>12.2f} {cb:>6.2f} {cb/ca:>6.2f}")
PY

#!/usr/bin/env bash
# bench/uring-proto.sh [reps] [secs] — what a completion-based data plane would buy.
#
# Runs the 4K read jobs of ../shared/tools/nbd-bench.sh (QD1, QD32, 4 connections x
# QD8; add more with JOBS) against three servers in one run, alternating them in each
# rep so that all see the same machine noise:
#   ferrovol    the release build, a fresh pool, a 2 GiB volume with its 1 GiB working
#               set written (nbd-bench.sh preconditions it);
#   uring-proto bench/uring-proto: a minimal read-only NBD server whose socket I/O and
#               O_DIRECT file reads share one io_uring, one io_uring_enter per step
#               (no mappings, no budgets: a raw file, like qemu-nbd's);
#   qemu-nbd    --cache=none --aio=io_uring on the same raw file (ferrovol's class).
# Prints per job the median IOPS, mean latency and server CPU per thousand IOPS of each,
# and the ratios.
#
#   bash bench/uring-proto.sh 3 8
#
# Env: JOBS, WORK (default ~/.cache/ferrovol-bench), PORT (three ports from it).
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}; SECS=${2:-8}
export JOBS=${JOBS:-"rr4k-qd1 rr4k-qd32 rr4k-qd32-mc"}
export MC=1
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10841}
. bench/common.sh
build
(cd bench/uring-proto && cargo build --release >&2)
PROTO=${CARGO_TARGET_DIR:-$PWD/target}/release/uring-proto
[ -x "$PROTO" ] || PROTO=$PWD/bench/uring-proto/target/release/uring-proto
mkdir -p "$WORK"
IMG=$WORK/proto.img
TSV=$WORK/proto.tsv
: > "$TSV"
OTHER=
trap 'stop_server; [ -n "$OTHER" ] && kill $OTHER 2>/dev/null; rm -rf "$WORK/proto-data" "$IMG"' EXIT
fio --name=fill --filename="$IMG" --rw=write --bs=1M --size=1G --direct=1 --ioengine=psync >/dev/null

wait_nbd() {
  for _ in $(seq 100); do
    nbdinfo "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "server at $1 did not start" >&2; return 1
}

for rep in $(seq "$REPS"); do
  rm -rf "$WORK/proto-data"
  start_server "$WORK/proto-data" "$PORT" --pool-size 8GiB
  "$BIN" --data-dir "$WORK/proto-data" volume create bench --size 2GiB >/dev/null
  SERVER_PID=$PID LABEL=ferrovol TSV=$TSV bash ../shared/tools/nbd-bench.sh "nbd://127.0.0.1:$PORT/bench" "$SECS" >&2
  stop_server

  "$PROTO" "$IMG" $((PORT + 1)) & OTHER=$!
  wait_nbd "nbd://127.0.0.1:$((PORT + 1))/x"
  PRECOND=0 SERVER_PID=$OTHER LABEL=uring-proto TSV=$TSV \
    bash ../shared/tools/nbd-bench.sh "nbd://127.0.0.1:$((PORT + 1))/x" "$SECS" >&2
  kill $OTHER; wait $OTHER 2>/dev/null || true; OTHER=

  qemu-nbd -f raw -t --shared=8 --cache=none --aio=io_uring -b 127.0.0.1 -p $((PORT + 2)) -x x "$IMG" \
    >/dev/null 2>&1 & OTHER=$!
  wait_nbd "nbd://127.0.0.1:$((PORT + 2))/x"
  PRECOND=0 SERVER_PID=$OTHER LABEL=qemu-nbd TSV=$TSV \
    bash ../shared/tools/nbd-bench.sh "nbd://127.0.0.1:$((PORT + 2))/x" "$SECS" >&2
  kill $OTHER; wait $OTHER 2>/dev/null || true; OTHER=
done

PYTHONPATH=bench /usr/bin/python3 - "$TSV" <<'PY'
import sys, statistics as st
from tsv import load
rows = load(sys.argv[1])
labels = ["ferrovol", "uring-proto", "qemu-nbd"]
print(f"{'job':<14}" + "".join(f"{l + ' IOPS':>17}" for l in labels) + f"{'proto/ferrovol':>16}{'ferrovol/qemu':>15}")
for job in sorted({j for (_, j) in rows}):
    med = {l: st.median(x[0] for x in rows[(l, job)]) for l in labels if rows.get((l, job))}
    if len(med) < 3:
        continue
    print(f"{job:<14}" + "".join(f"{med[l]:>17.0f}" for l in labels)
          + f"{med['uring-proto'] / med['ferrovol']:>16.2f}{med['ferrovol'] / med['qemu-nbd']:>15.2f}")
print()
print(f"{'job':<14}" + "".join(f"{l + ' mean µs':>20}" for l in labels) + "".join(f"{l + ' cpu/kIOPS':>22}" for l in labels))
for job in sorted({j for (_, j) in rows}):
    if not all(rows.get((l, job)) for l in labels):
        continue
    lat = [st.median(x[1] for x in rows[(l, job)]) for l in labels]
    cpu = [st.median(x[2] / (x[0] / 1000) for x in rows[(l, job)]) for l in labels]
    print(f"{job:<14}" + "".join(f"{v:>20.1f}" for v in lat) + "".join(f"{v:>22.2f}" for v in cpu))
PY

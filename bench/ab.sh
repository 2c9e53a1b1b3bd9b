#!/usr/bin/env bash
# bench/ab.sh BIN_A BIN_B [reps] [secs] — two builds of ferrovol on the same job suite,
# in one run, alternating A B A B ... so that both see the same machine noise; prints
# the median of each job per build and B/A ratios (IOPS, mean latency, and server CPU
# per kIOPS). Each rep starts each build on a fresh pool with a 1 GiB working set
# written (../shared/tools/nbd-bench.sh preconditions it), and after nbd-bench's jobs
# runs an allocating job and a copy-on-write job (alloc4k-qd32, cow4k-qd32).
#
#   bash bench/ab.sh /tmp/ferrovol-before target/release/ferrovol 3 10
#
# Env: JOBS (nbd-bench.sh's job list; default the 4K jobs), WORK (where the pools go:
# WORK=/dev/shm/ab takes the disk out, as the file system refuses O_DIRECT and the pool
# is served from memory), PORT, SERVER_CPUS and CLIENT_CPUS (taskset lists: the servers,
# and every fio job, pinned to them), ARGS_A and ARGS_B (extra `serve` flags for each
# side, to compare one build with and without a flag:
#   ARGS_A=--io-immediate-enter bash bench/ab.sh target/release/ferrovol target/release/ferrovol).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
A=$(realpath "$1"); B=$(realpath "$2"); REPS=${3:-3}; SECS=${4:-10}
export JOBS=${JOBS:-"rr4k-qd1 rr4k-qd32 rr4k-qd32-mc rw4k-qd32"}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10833}
TSV=$WORK/ab.tsv
mkdir -p "$WORK"; : > "$TSV"
# extra_job NAME URI FIO-ARGS...: one 4 KiB QD32 fio job against the running server
# ($PID), appended to the TSV as nbd-bench.sh's rows are (label, job, IOPS, MB/s,
# mean and p99 latency in µs, server CPU in % of one core).
extra_job() {
  local name=$1 uri=$2; shift 2
  local c0 t0
  c0=$(awk '{print $14 + $15}' "/proc/$PID/stat"); t0=$(date +%s.%N)
  ${CLIENT_CPUS:+taskset -c $CLIENT_CPUS} fio --name="$name" --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 \
    --output-format=json "$@" \
    | sed -n '/^{/,$p' > "$WORK/$name.json"
  /usr/bin/python3 - "$WORK/$name.json" "$side" "$name" "$c0" "$t0" "$(awk '{print $14 + $15}' "/proc/$PID/stat")" \
    "$(date +%s.%N)" "$(getconf CLK_TCK)" >> "$TSV" <<'PY'
import json, sys
path, label, name, c0, t0, c1, t1, hz = sys.argv[1:]
w = json.load(open(path))["jobs"][0]["write"]
cpu = (float(c1) - float(c0)) / float(hz) / (float(t1) - float(t0)) * 100
p99 = w["clat_ns"]["percentile"]["99.000000"] / 1000
print(label, name, round(w["iops"]), round(w["bw"] / 1024, 1), round(w["lat_ns"]["mean"] / 1000, 1), round(p99, 1), round(cpu, 1))
PY
}
trap 'stop_server; rm -rf "$WORK/ab"' EXIT
for rep in $(seq "$REPS"); do
  for side in A B; do
    if [ "$side" = A ]; then BIN=$A ARGS=${ARGS_A:-}; else BIN=$B ARGS=${ARGS_B:-}; fi
    rm -rf "$WORK/ab"
    # shellcheck disable=SC2086 # ARGS: flags split on spaces
    start_server "$WORK/ab" "$PORT" --pool-size 8GiB $ARGS
    "$BIN" --data-dir "$WORK/ab" volume create bench --size 2GiB >/dev/null
    SERVER_PID=$PID LABEL=$side TSV=$TSV bash ../shared/tools/nbd-bench.sh "nbd://127.0.0.1:$PORT/bench" "$SECS" >&2
    # Allocating writes: 4 KiB into every 64 KiB unit of a new volume, each one a new
    # mapping. Copy-on-write: 4 KiB random writes over the first 256 MiB of the
    # working set after a snapshot of it, each block once (the first write into a
    # unit copies it).
    "$BIN" --data-dir "$WORK/ab" volume create alloc --size 4GiB >/dev/null
    extra_job alloc4k-qd32 "nbd://127.0.0.1:$PORT/alloc" --rw=write --zonemode=strided --zonesize=4k \
      --zonerange=64k --size=4g
    "$BIN" --data-dir "$WORK/ab" snapshot create bench s >/dev/null
    extra_job cow4k-qd32 "nbd://127.0.0.1:$PORT/bench" --rw=randwrite --size=256m
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

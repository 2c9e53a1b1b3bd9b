#!/usr/bin/env bash
# bench/profile.sh [JOB] [seconds] — where ferrovol serve spends its CPU under one fio job.
#
# Starts the release build on a fresh pool in $WORK (default ~/.cache/ferrovol-bench),
# writes a 1 GiB working set, then runs one fio job over NBD (fio's nbd engine, as in
# ../shared/tools/nbd-bench.sh) while `perf record -g` samples the server. Prints the
# flat profile (self time by symbol) and writes perf.data to $WORK/perf.data.
# JOB: rr4k-qd32 (default), rr4k-qd1, rw4k-qd32, sr1m-qd8, sw1m-qd8.
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-rr4k-qd32}
SECS=${2:-8}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10829}
case "$JOB" in
  rr4k-qd32) RW=randread QD=32 BS=4k ;;
  rr4k-qd1) RW=randread QD=1 BS=4k ;;
  rw4k-qd32) RW=randwrite QD=32 BS=4k ;;
  sr1m-qd8) RW=read QD=8 BS=1M ;;
  sw1m-qd8) RW=write QD=8 BS=1M ;;
  *) echo "unknown job $JOB" >&2; exit 2 ;;
esac
. bench/common.sh
build
rm -rf "$WORK/prof"; mkdir -p "$WORK"
trap 'stop_server; rm -rf "$WORK/prof"' EXIT
start_server "$WORK/prof" "$PORT" --pool-size 8GiB
"$BIN" --data-dir "$WORK/prof" volume create bench --size 4GiB >/dev/null
URI=nbd://127.0.0.1:$PORT/bench
fio --name=precond --ioengine=nbd --uri=$URI --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null
perf record ${PERF_CALLGRAPH:+--call-graph $PERF_CALLGRAPH} -g -o "$WORK/perf.data" -p $PID -- sleep "$SECS" 2>/dev/null &
PERF=$!
fio --name=$JOB --ioengine=nbd --uri=$URI --rw=$RW --bs=$BS --iodepth=$QD --size=1G \
  --time_based --runtime="$SECS" --output-format=terse --terse-version=3 | awk -F';' '{printf "fio: read %s IOPS, write %s IOPS\n", $8, $49}'
wait $PERF
perf report -i "$WORK/perf.data" --no-children --sort symbol --stdio 2>/dev/null | grep -v '^#' | grep '%' | head -40

#!/usr/bin/env bash
# bench/qos.sh [REPS] — per-volume QoS limits measured against an unlimited volume of the
# same server in the same run (fio, nbd engine, 4 KiB random reads of written data, QD32,
# RUNTIME seconds after a 2 s ramp):
#   limit      a volume limited to LIMIT read IOPS (default 5000): its IOPS / LIMIT, and the
#              unlimited volume's IOPS / LIMIT (the machine could do more);
#   overhead   a volume whose limit never binds (10 million IOPS: the limiter runs, takes
#              its lock and schedules every request) against the unlimited one: the cost of
#              the limiter on the data path, as a ratio;
#   isolation  the unlimited volume alone, then beside a volume throttled to 20 writes of
#              1 MiB a second with 4 connections × 8 writes always waiting: the ratio.
# Env: WORK, PORT, SERVER_CPUS, CLIENT_CPUS (as the other bench scripts), LIMIT, RUNTIME.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
LIMIT=${LIMIT:-5000}
RUNTIME=${RUNTIME:-10}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10861}
. bench/common.sh
build
D=$WORK/qos
rm -rf "$D"
trap 'stop_server; rm -rf "$D"' EXIT
start_server "$D" "$PORT" --pool-size 8GiB
cli() { "$BIN" --data-dir "$D" "$@" >/dev/null; }
cli volume create free --size 1GiB
cli volume create lim --size 1GiB --read-iops "$LIMIT"
cli volume create high --size 1GiB --read-iops 10000000
cli volume create noisy --size 4GiB --write-iops 20
CLIENT=${CLIENT_CPUS:+taskset -c $CLIENT_CPUS}
for v in free lim high; do # written data, so that reads reach the disk
  $CLIENT fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$v" --rw=write --bs=1m --size=1g \
    --iodepth=8 --output-format=terse >/dev/null
done
iops() { # iops VOLUME: 4 KiB random read IOPS
  $CLIENT fio --name=r --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$1" --rw=randread --bs=4k --iodepth=32 \
    --size=1g --time_based --runtime="$RUNTIME" --ramp_time=2 --output-format=json |
    /usr/bin/python3 -c "import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index('{'):])['jobs'][0]['read']['iops']))"
}
ratio() { /usr/bin/python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.3f}')" "$1" "$2"; }
for rep in $(seq "$REPS"); do
  lim=$(iops lim) free=$(iops free) high=$(iops high)
  echo "rep $rep limit: limited $lim IOPS = $(ratio "$lim" "$LIMIT") x its limit $LIMIT; unlimited $free = $(ratio "$free" "$LIMIT") x"
  echo "rep $rep overhead: never-binding limit $high IOPS / unlimited $free = $(ratio "$high" "$free")"
  alone=$(iops free)
  $CLIENT fio --name=noisy --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/noisy" --rw=randwrite --bs=1m \
    --iodepth=8 --numjobs=4 --size=4g --time_based --runtime=$((RUNTIME + 4)) --output-format=terse >/dev/null &
  noisy=$!
  sleep 1
  beside=$(iops free)
  wait "$noisy"
  echo "rep $rep isolation: unlimited alone $alone IOPS, beside a throttled volume $beside = $(ratio "$beside" "$alone")"
done

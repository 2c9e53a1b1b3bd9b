#!/usr/bin/env bash
# bench/delete-latency.sh [reps] — 4 KiB random read p99 on volume A (QD32, fio's nbd
# engine, 20 s) with a management call (pool status) and with a snapshot delete on
# volume B instead, in one run against one server. B has 4 GiB written, a snapshot, then the same 4 GiB overwritten, so the
# snapshot holds 4 GiB exclusively; in the second pass it is deleted 5 s into the read
# job. Prints the p99 (µs) of both passes and their ratio. Env: WORK, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10859}
. bench/common.sh
build
trap 'stop_server; rm -rf "$WORK/del"' EXIT
F() { "$BIN" --data-dir "$WORK/del" "$@" >/dev/null; }
p99() { # p99 read latency in µs from fio's JSON
  sed -n '/^{/,$p' | /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]["clat_ns"]["percentile"]; print(int(j["99.000000"]/1000))'
}
readjob() { fio --name=a --ioengine=nbd --uri=nbd://127.0.0.1:$PORT/a --bs=4k --iodepth=32 --rw=randread --size=1g --runtime=20 --time_based --output-format=json; }
prepare_b() {
  F volume create b --size 8GiB
  fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:$PORT/b --bs=1m --iodepth=8 --rw=write --size=4g >/dev/null
  F snapshot create b s
  fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:$PORT/b --bs=1m --iodepth=8 --rw=write --size=4g >/dev/null
}
for rep in $(seq "$REPS"); do
  rm -rf "$WORK/del"
  start_server "$WORK/del" "$PORT" --pool-size 24GiB
  F volume create a --size 2GiB
  fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:$PORT/a --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null
  prepare_b
  sleep 10 # let the device finish absorbing the 8 GiB just written
  # The baseline makes a management call at the same moment (a CLI process and a gRPC
  # round trip cost CPU on a small machine too), so the ratio isolates the delete.
  (sleep 5; F pool status) &
  BASE=$!
  base=$(readjob | p99)
  wait $BASE
  F snapshot delete b s
  F volume delete b
  prepare_b
  sleep 10
  (sleep 5; t0=$(date +%s%N); F snapshot delete b s; echo "delete took $(( ($(date +%s%N) - t0) / 1000000 )) ms (CLI round trip)" >&2) &
  DEL=$!
  during=$(readjob | p99)
  wait $DEL
  stop_server
  /usr/bin/python3 -c "import sys; b,d=map(int,sys.argv[1:]); print(f'rep $rep: p99 without delete {b} us, with delete {d} us, ratio {d/b:.2f}')" "$base" "$during"
done

#!/usr/bin/env bash
# bench/snapshot-write.sh [reps] — 4 KiB random writes at QD32 (fio's nbd engine)
# over a 1 GiB working set, in one run against one ferrovol server:
#   overwrite   written data, no snapshot (the baseline)
#   cow-first   the first writes after a snapshot: each unit is copied on first touch
#   cow-second  the same writes again: the units are now the volume's own
# Each job runs until every 4 KiB block of the working set was written once
# (randommap), so cow-first covers every unit's copy. Prints IOPS and the ratios to
# the overwrite baseline. Env: WORK, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10839}
. bench/common.sh
build
mkdir -p "$WORK"
trap 'stop_server; rm -rf "$WORK/snapw"' EXIT
job() {
  fio --name="$1" --ioengine=nbd --uri="$2" --bs=4k --iodepth=32 --rw=randwrite --size=1g --output-format=json \
    | sed -n '/^{/,$p' | /usr/bin/python3 -c 'import json,sys; print(int(json.load(sys.stdin)["jobs"][0]["write"]["iops"]))'
}
for rep in $(seq "$REPS"); do
  rm -rf "$WORK/snapw"
  start_server "$WORK/snapw" "$PORT" --pool-size 8GiB
  "$BIN" --data-dir "$WORK/snapw" volume create v --size 2GiB >/dev/null
  U=nbd://127.0.0.1:$PORT/v
  fio --name=pre --ioengine=nbd --uri=$U --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null
  o=$(job overwrite $U)
  "$BIN" --data-dir "$WORK/snapw" snapshot create v s >/dev/null
  f=$(job cow-first $U)
  s=$(job cow-second $U)
  stop_server
  /usr/bin/python3 -c "import sys; o,f,s=map(int,sys.argv[1:]); print(f'rep $rep: overwrite {o}  cow-first {f} ({f/o:.2f}x)  cow-second {s} ({s/o:.2f}x)')" "$o" "$f" "$s"
done

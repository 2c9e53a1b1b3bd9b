#!/usr/bin/env bash
# bench/alloc-write.sh [reps] — allocating versus overwriting 4 KiB writes at QD32,
# in one run against one ferrovol server (fio's nbd engine).
#
#   alloc      every write lands in a data unit never written before (4 KiB every
#              64 KiB: fio zonemode=strided), so each one allocates a unit and logs a
#              mapping
#   overwrite  the same offsets again: the blocks are written, no metadata changes
#   randwrite  4 KiB random writes over the same 8 GiB range (mixed)
# Prints IOPS per job and the alloc/overwrite ratio. Env: WORK, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10829}
. bench/common.sh
build
mkdir -p "$WORK"
trap 'stop_server; rm -rf "$WORK/alloc"' EXIT
job() { # job NAME URI extra-args... -> IOPS
  local name=$1 uri=$2; shift 2
  fio --name="$name" --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --output-format=json "$@" \
    | sed -n '/^{/,$p' | /usr/bin/python3 -c 'import json,sys; print(int(json.load(sys.stdin)["jobs"][0]["write"]["iops"]))'
}
for rep in $(seq "$REPS"); do
  rm -rf "$WORK/alloc"
  start_server "$WORK/alloc" "$PORT" --pool-size 24GiB
  "$BIN" --data-dir "$WORK/alloc" volume create a --size 8GiB >/dev/null
  "$BIN" --data-dir "$WORK/alloc" volume create r --size 8GiB >/dev/null
  U=nbd://127.0.0.1:$PORT
  STRIDE=(--rw=write --zonemode=strided --zonesize=4k --zonerange=64k --size=8g --io_size=512m)
  a=$(job alloc $U/a "${STRIDE[@]}")
  o=$(job overwrite $U/a "${STRIDE[@]}")
  r=$(job randwrite $U/r --rw=randwrite --size=8g --runtime=5 --time_based)
  stop_server
  /usr/bin/python3 -c "import sys; a,o,r=map(int,sys.argv[1:]); print(f'rep $rep: alloc {a} IOPS  overwrite {o} IOPS  randwrite(mixed) {r} IOPS  alloc/overwrite {a/o:.2f}')" "$a" "$o" "$r"
done

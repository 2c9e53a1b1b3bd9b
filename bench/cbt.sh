#!/usr/bin/env bash
# bench/cbt.sh [SIZE_GIB] — changed-block tracking at scale: the delta between two
# snapshots of a large thin volume (what the CSI SnapshotMetadata service's
# GetMetadataDelta streams), its time, and what the server read from the pool for it.
#   1. a SIZE_GIB (default 1024) volume; BASE_MIB (default 1024) of 4 KiB blocks written
#      at random positions over all of it (fio, nbd engine): mappings in most pages;
#   2. snapshot s1; CHANGE_MIB (default BASE_MIB / 100) more of 4 KiB random writes
#      over the whole volume (another seed: most land on blocks not written before);
#      snapshot s2;
#   3. `ferrovol snapshot diff v@s1 v@s2` (DiffSnapshots), three times: wall time,
#      ranges and bytes listed, and the server's read_bytes and rchar (/proc/PID/io)
#      before and after.
# Env: WORK, PORT, SERVER_CPUS, CLIENT_CPUS (as the other bench scripts).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_GIB=${1:-1024}
BASE_MIB=${BASE_MIB:-1024}
CHANGE_MIB=${CHANGE_MIB:-$((BASE_MIB / 100))}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10859}
. bench/common.sh
build
D=$WORK/cbt
rm -rf "$D"
trap 'stop_server; rm -rf "$D"' EXIT
start_server "$D" "$PORT" --pool-size "$((SIZE_GIB + 64))GiB"
"$BIN" --data-dir "$D" volume create v --size "${SIZE_GIB}GiB" >/dev/null
CLIENT=${CLIENT_CPUS:+taskset -c $CLIENT_CPUS}
fill() { # fill MIB SEED: MIB of 4 KiB random writes over the whole volume
  $CLIENT fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/v" --rw=randwrite --bs=4k \
    --iodepth=32 --size="${SIZE_GIB}g" --io_size="${1}m" --randseed="$2" --norandommap \
    --output-format=terse >/dev/null
}
io() { awk -v k="$1" '$1 == k":" {print $2}' "/proc/$PID/io"; }
since() { /usr/bin/python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.3f}')" "$1"; }
t0=$(date +%s.%N)
fill "$BASE_MIB" 1
echo "base: ${BASE_MIB} MiB of 4 KiB random writes over ${SIZE_GIB} GiB in $(since "$t0") s"
"$BIN" --data-dir "$D" snapshot create v s1 >/dev/null
fill "$CHANGE_MIB" 2
"$BIN" --data-dir "$D" snapshot create v s2 >/dev/null
"$BIN" --data-dir "$D" volume info v --json | /usr/bin/python3 -c \
  "import json,sys; v=json.load(sys.stdin); print('allocated', v['allocated_bytes'] >> 20, 'MiB')"
for rep in 1 2 3; do
  r0=$(io read_bytes) c0=$(io rchar)
  t0=$(date +%s.%N)
  "$BIN" --data-dir "$D" snapshot diff v@s1 v@s2 --json >"$D.diff.json"
  t=$(since "$t0")
  r1=$(io read_bytes) c1=$(io rchar)
  /usr/bin/python3 - "$D.diff.json" "$rep" "$t" "$((r1 - r0))" "$((c1 - c0))" "$CHANGE_MIB" <<'PY'
import json, sys
path, rep, t, rb, rc, change = sys.argv[1:]
ranges = json.load(open(path))
listed = sum(r["length"] for r in ranges)
print(f"rep {rep}: delta in {float(t):.3f} s (CLI round trip included): {len(ranges)} ranges, "
      f"{listed >> 20} MiB listed for {change} MiB written; server read_bytes +{rb}, rchar +{rc}")
PY
done

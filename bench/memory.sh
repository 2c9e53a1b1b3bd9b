#!/usr/bin/env bash
# bench/memory.sh — resident memory of `ferrovol serve` against the target
# "at most 64 MiB plus 160 MiB per TiB of mapped data" (issue: performance), measured on
# VOLUMES thin volumes of 1 TiB virtual size each with MAPPED bytes mapped, then with
# CONNS idle NBD connections open (spread over the volumes).
#
# Data is mapped by writing one 4 KiB block in every 64 KiB data unit of the first
# MAPPED bytes of each volume (fio zonemode=strided), so the pool's mapping holds
# MAPPED bytes per volume while the disk holds a sixteenth of it. The full-scale
# figure of the target (100 volumes x 10 GiB) needs about 63 GiB of disk this way;
# the default (100 x 1 GiB) needs about 7 GiB, and memory is linear in the mapping.
#
# Prints VmRSS (and the peak so far, VmHWM) after start-up, after creating the
# volumes, after mapping, after a restart (the pool loaded from its checkpoint), and
# with the connections open, each against the target for the mapped bytes at that
# point; "ok" means both the current and the peak figure are within it.
# The written blocks hold zeros (fio --zero_buffers): the engine does not look at the
# data, and a compressing backing (bench/memory-full.sh) then stores next to nothing.
# Env: VOLUMES (100), MAPPED (1g, fio size syntax), CONNS (400), POOL_SIZE (2TiB),
# POOL (an existing file of POOL_SIZE bytes holding no pool yet, e.g. a FUSE file; by
# default a new sparse file in WORK), WORK, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
VOLUMES=${VOLUMES:-100}
MAPPED=${MAPPED:-1g}
CONNS=${CONNS:-400}
POOL_SIZE=${POOL_SIZE:-2TiB}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10831}
build
DIR=$WORK/memory
rm -rf "$DIR" "$DIR.log"
trap 'stop_server; kill $HOLDER 2>/dev/null || true; rm -rf "$DIR"' EXIT
HOLDER=
SERVE=(--pool-size "$POOL_SIZE" --max-connections $((CONNS + 16)))
if [ -n "${POOL:-}" ]; then
  # `serve` creates a pool only as a new file: create one beside it, then copy its data
  # extents (superblocks, log, first checkpoint) into POOL, skipping the holes.
  start_server "$DIR/format" "$PORT" --pool-size "$POOL_SIZE"
  stop_server
  /usr/bin/python3 - "$DIR/format/pool.img" "$POOL" <<'PY'
import os, sys
src, dst = (os.open(p, m) for p, m in ((sys.argv[1], os.O_RDONLY), (sys.argv[2], os.O_WRONLY)))
size = os.fstat(src).st_size
if os.lseek(dst, 0, os.SEEK_END) != size:
    sys.exit(f"{sys.argv[2]} must be exactly {size} bytes")
off = 0
while True:
    try:
        off = os.lseek(src, off, os.SEEK_DATA)
    except OSError:
        break
    end = os.lseek(src, off, os.SEEK_HOLE)
    while off < end:
        data = os.pread(src, min(end - off, 1 << 24), off)
        if not data or os.pwrite(dst, data, off) != len(data):
            sys.exit("copy stopped short")
        off += len(data)
os.fsync(dst)
PY
  rm -rf "$DIR/format" "$DIR/format.log"
  SERVE+=(--pool "$POOL")
fi
mapped_bytes=0
report() { # report LABEL
  /usr/bin/python3 - "$1" "$(rss_kib "$PID")" "$(peak_rss_kib "$PID")" "$mapped_bytes" <<'PY'
import sys
label, rss_kib, hwm_kib, mapped = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rss, hwm = rss_kib / 1024, hwm_kib / 1024
tib = mapped / 2**40
limit = 64 + 160 * tib
print(f"{label:<34} RSS {rss:7.1f} MiB (peak {hwm:7.1f})   mapped {mapped / 2**30:6.1f} GiB   target <= {limit:6.1f} MiB   {'ok' if max(rss, hwm) <= limit else 'OVER'}")
PY
}
start_server "$DIR" "$PORT" "${SERVE[@]}"
report "started, empty $POOL_SIZE pool"
for i in $(seq "$VOLUMES"); do "$BIN" --data-dir "$DIR" volume create "v$i" --size 1TiB >/dev/null; done
report "$VOLUMES volumes of 1 TiB"
per_volume=$(/usr/bin/python3 -c "
s='$MAPPED'.lower(); m={'k':2**10,'m':2**20,'g':2**30,'t':2**40}
print(int(float(s[:-1])*m[s[-1]]) if s[-1] in m else int(s))")
for i in $(seq "$VOLUMES"); do
  fio --name=map --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/v$i" --rw=write --bs=4k --iodepth=32 --zero_buffers \
    --zonemode=strided --zonesize=4k --zonerange=64k --size="$per_volume" --io_size=$((per_volume / 16)) \
    --output=/dev/null
  mapped_bytes=$((mapped_bytes + per_volume))
done
report "each with $MAPPED mapped"
stop_server
start_server "$DIR" "$PORT" "${SERVE[@]}"
report "restarted (loaded from checkpoint)"
/usr/bin/python3 - "$PORT" "$VOLUMES" "$CONNS" <<'PY' &
import nbd, sys, time
port, volumes, conns = map(int, sys.argv[1:])
handles = []
for c in range(conns):
    h = nbd.NBD()
    h.connect_uri(f"nbd://127.0.0.1:{port}/v{c % volumes + 1}")
    handles.append(h)
print(f"{conns} connections open", flush=True)
time.sleep(3600)
PY
HOLDER=$!
for _ in $(seq 600); do
  n=$(ss -Htn state established "( sport = :$PORT )" | wc -l)
  [ "$n" -ge "$CONNS" ] && break
  sleep 0.1
done
sleep 1
report "with $n idle NBD connections"

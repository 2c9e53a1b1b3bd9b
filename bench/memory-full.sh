#!/usr/bin/env bash
# bench/memory-full.sh — bench/memory.sh at the target's full scale: 100 volumes of
# 1 TiB, 10 GiB mapped in each (1000 GiB in all), 400 idle NBD connections.
#
# Mapping 1000 GiB writes 62.5 GiB (one 4 KiB block per 64 KiB data unit), more than a
# small machine's disk holds, so the pool lives on a 2 TiB file served by nbdkit's
# memory plugin with its zstd allocator (pages compressed in RAM; the written blocks
# are zeros and compress to almost nothing) and mounted as a file with nbdfuse. The
# engine opens it with O_DIRECT and io_uring like any pool file. Only ferrovol's
# resident memory is reported; nbdkit's is printed at the end for reference.
# Needs nbdkit and nbdfuse (Debian: nbdkit, libnbd-bin) and FUSE (root).
# Env: MAPPED (10g), VOLUMES (100), CONNS (400), WORK, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
B=$WORK/memory-backing
mkdir -p "$B/mnt"
cleanup() {
  umount "$B/mnt" 2>/dev/null || umount -l "$B/mnt" 2>/dev/null || true
  [ -n "${KIT:-}" ] && kill "$KIT" 2>/dev/null || true
  rm -rf "$B"
}
trap cleanup EXIT
rm -f "$B/nbd.sock"
nbdkit -f -U "$B/nbd.sock" memory size=2T allocator=zstd &
KIT=$!
for _ in $(seq 50); do [ -S "$B/nbd.sock" ] && break; sleep 0.1; done
nbdfuse "$B/mnt/pool" --unix "$B/nbd.sock" &
for _ in $(seq 50); do [ -f "$B/mnt/pool" ] && break; sleep 0.1; done
POOL=$B/mnt/pool POOL_SIZE=2TiB MAPPED=${MAPPED:-10g} bash bench/memory.sh
echo "nbdkit (backing store, not ferrovol) RSS: $(awk '/^VmRSS:/ {print $2 / 1024 " MiB"}' /proc/$KIT/status)"

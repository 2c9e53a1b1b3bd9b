#!/usr/bin/env bash
# bench/ublk.sh [secs] — one volume over its local ublk device against the same volume
# over NBD (/dev/nbd0 through nbd-client over TCP loopback), both inside the
# kernel VM of ../shared/tools/nbd-vm with `ferrovol serve` in the guest: fio with
# io_uring (direct) on each block device, 4 KiB random reads and writes at QD1 and
# QD32, then prints IOPS per job and the ublk/NBD ratio. Without KVM the guest is
# emulated (TCG), so only the ratio between the two means anything.
#
#   bash bench/ublk.sh 10
#
# Builds the server with the ublk feature (needs libclang-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
cargo build --release --features ublk --bin ferrovol >&2
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/ferrovol
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
objcopy --strip-debug "$BIN" "$WORK/ferrovol"
cat > "$WORK/guest.sh" <<'GUEST'
#!/bin/sh
set -eu
modprobe ublk_drv 2>/dev/null || true
D=/tmp/fv
ferrovol --data-dir "$D" serve --pool-size 4GiB --listen 127.0.0.1:10809 >/tmp/serve.log 2>&1 &
until ferrovol --data-dir "$D" pool status >/dev/null 2>&1; do sleep 0.2; done
ferrovol --data-dir "$D" volume create v --size 1GiB >/dev/null
UBLK=$(ferrovol --data-dir "$D" volume attach-local v)
nbd-client -N v 127.0.0.1 10809 /dev/nbd0 -b 4096 >/dev/null 2>&1
# Written once through, so that reads find data.
dd if=/dev/urandom of=/tmp/chunk bs=1M count=16 2>/dev/null
i=0; while [ $i -lt 16 ]; do dd if=/tmp/chunk of="$UBLK" bs=1M seek=$((i * 16)) oflag=direct 2>/dev/null; i=$((i + 1)); done
for job in randread:1 randread:32 randwrite:1 randwrite:32; do
  rw=${job%:*}; qd=${job#*:}
  for dev in "$UBLK" /dev/nbd0; do
    iops=$(fio --name=j --filename="$dev" --ioengine=io_uring --direct=1 --bs=4k --rw="$rw" --iodepth="$qd" \
      --size=256m --runtime="$SECS" --time_based --output-format=terse 2>/dev/null |
      awk -F';' -v rw="$rw" '{ print (rw == "randread") ? $8 : $49 }')
    echo "RESULT $rw-qd$qd ${dev#/dev/} $iops"
  done
done
nbd-client -d /dev/nbd0 >/dev/null 2>&1 || true
ferrovol --data-dir "$D" volume detach-local v >/dev/null
GUEST
bash ../shared/tools/nbd-vm/run.sh -t 1200 -f "$WORK/ferrovol:/usr/bin/ferrovol" -f "$(command -v fio):/usr/bin/fio" \
  -e SECS="$SECS" "$WORK/guest.sh" > "$WORK/out.txt" 2>&1 || { tail -30 "$WORK/out.txt"; exit 1; }
grep '^RESULT' "$WORK/out.txt" | awk '
  { iops[$2 " " ($3 ~ /^ublkb/ ? "ublk" : "nbd")] = $4; jobs[$2] = 1 }
  END {
    printf "%-16s %10s %10s %10s\n", "job", "ublk IOPS", "NBD IOPS", "ublk/NBD"
    for (j in jobs) printf "%-16s %10d %10d %10.2f\n", j, iops[j " ublk"], iops[j " nbd"], iops[j " ublk"] / iops[j " nbd"]
  }' | sort

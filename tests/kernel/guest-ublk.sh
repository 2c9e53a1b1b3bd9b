#!/bin/sh
# Guest script: `ferrovol serve` runs here, on a pool in the guest's /tmp, and serves a
# volume as a local ublk device (/dev/ublkbN) beside NBD. Checked: a file system made
# and written on the device passes fsck, and the device's bytes are the bytes NBD
# serves for the volume; fstrim on it frees the volume's units; a snapshot attached
# locally is read-only; a resize grows the device where the kernel can; a second
# attach, a delete while attached and a detach of what
# is not attached are refused; detach removes the device (at once, even under a mounted
# file system), and a new attach sees the data; the server's stop removes its devices. Then kill -9 under writes: the writer
# gets errors rather than hanging, data flushed before is there after a restart, and
# the restart deletes the device the killed server left.
set -eu
modprobe ublk_drv 2>/dev/null || true
D=/tmp/fv
fv() { ferrovol --data-dir "$D" "$@"; }
start() {
  ferrovol --data-dir "$D" serve --pool-size 2GiB --listen 127.0.0.1:10809 >>/tmp/serve.log 2>&1 &
  SERVER=$!
  i=0
  until fv pool status >/dev/null 2>&1; do
    sleep 0.2; i=$((i + 1)); [ "$i" -lt 300 ] || { cat /tmp/serve.log; exit 1; }
  done
}
start
fail() { echo "FAIL: $*"; echo "--- server log"; tail -40 /tmp/serve.log; exit 1; }
allocated() { fv volume info "$1" --json | grep -o '"allocated_bytes":[0-9]*' | cut -d: -f2; }

fv volume create v --size 256MiB >/dev/null
DEV=$(fv volume attach-local v) || fail "attach-local"
echo "attached v as $DEV"
[ -b "$DEV" ] || fail "$DEV is not a block device"
fv volume info v | grep -q "local device: $DEV" || fail "volume info does not show $DEV"
fv volume list | grep -q "^v .* $DEV *\$" || fail "volume list does not show $DEV: $(fv volume list)"
fv volume attach-local v >/dev/null 2>/tmp/err && fail "a second attach succeeded"
grep -q "already" /tmp/err || fail "second attach: $(cat /tmp/err)"

mkfs.ext4 -q -F "$DEV"
mkdir -p /mnt/u
mount -t ext4 "$DEV" /mnt/u
dd if=/dev/urandom of=/mnt/u/data bs=1M count=8 2>/dev/null
SUM=$(md5sum /mnt/u/data | cut -d' ' -f1)
umount /mnt/u
e2fsck -fn "$DEV" >/tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "fsck"; }
echo "ext4 on $DEV: written, fsck clean"

# The device's bytes are what NBD serves for the volume.
nbd-client -N v 127.0.0.1 10809 /dev/nbd0 -b 4096 >/dev/null 2>&1 || fail "nbd-client"
cmp "$DEV" /dev/nbd0 || fail "the ublk device and NBD differ"
nbd-client -d /dev/nbd0 >/dev/null 2>&1
echo "ublk and NBD read the same 256 MiB"

# Discards reach the engine: the file's units are freed.
before=$(allocated v)
mount -t ext4 "$DEV" /mnt/u
rm /mnt/u/data
sync
fstrim -v /mnt/u
umount /mnt/u
after=$(allocated v)
echo "allocated bytes: $before before the trim, $after after"
[ "$after" -lt $((before - 4 * 1048576)) ] || fail "fstrim freed too little: $before -> $after"
mount -t ext4 "$DEV" /mnt/u
dd if=/dev/urandom of=/mnt/u/data bs=1M count=4 2>/dev/null
SUM=$(md5sum /mnt/u/data | cut -d' ' -f1)
umount /mnt/u

# Online resize: the device follows where the driver can (Linux 6.16); on older
# kernels it keeps its size, and the server says so.
fv volume resize v --size 512MiB >/dev/null || fail "resize"
size=$(blockdev --getsize64 "$DEV")
if grep -q "local device resized" /tmp/serve.log; then
  [ "$size" = 536870912 ] || fail "resized online, but the device has $size bytes"
else
  [ "$size" = 268435456 ] || fail "the device has $size bytes"
  grep -q "keeps its old size" /tmp/serve.log || fail "no word of the device keeping its size"
fi
echo "resize: the device has $size bytes"

# A snapshot attached locally is read-only.
fv snapshot create v s >/dev/null
SDEV=$(fv volume attach-local v@s) || fail "attach-local v@s"
[ "$(blockdev --getro "$SDEV")" = 1 ] || fail "$SDEV is writable"
dd if=/dev/zero of="$SDEV" bs=4096 count=1 oflag=direct 2>/dev/null && fail "a write to the snapshot's device succeeded"
fv snapshot delete v s >/dev/null 2>&1 && fail "deleted a snapshot attached locally"
fv volume detach-local v@s >/dev/null || fail "detach v@s"
echo "snapshot device $SDEV read-only"

fv volume delete v >/dev/null 2>/tmp/err && fail "deleted a volume attached locally"
grep -q "attached locally" /tmp/err || fail "delete: $(cat /tmp/err)"
fv volume detach-local v >/dev/null || fail "detach-local"
[ ! -e "$DEV" ] || fail "$DEV is still there after the detach"
fv volume detach-local v >/dev/null 2>&1 && fail "a second detach succeeded"

DEV=$(fv volume attach-local v) || fail "attach-local again"
mount -t ext4 -o ro "$DEV" /mnt/u
[ "$(md5sum /mnt/u/data | cut -d' ' -f1)" = "$SUM" ] || fail "the data differs after a new attach"
umount /mnt/u
echo "attached again as $DEV: data intact"

# A detach with the file system still mounted returns at once (the file system then
# gets I/O errors), and the volume attaches again.
mount -t ext4 -o ro "$DEV" /mnt/u
timeout 60 ferrovol --data-dir "$D" volume detach-local v >/dev/null || fail "a detach under a mounted file system"
[ ! -e "$DEV" ] || fail "$DEV is still there after a detach under a mounted file system"
umount /mnt/u 2>/dev/null || umount -l /mnt/u
DEV=$(fv volume attach-local v) || fail "attach-local after a detach under a mounted file system"
echo "detached under a mounted file system without waiting; attached again as $DEV"

kill "$SERVER"
wait "$SERVER" || fail "the server's stop failed"
grep -q "detached locally: the server is stopping" /tmp/serve.log || fail "no detach logged at the stop"
[ ! -e "$DEV" ] || fail "$DEV is still there after the server stopped"
echo "server stopped: $DEV removed"

# kill -9 under writes.
start
DEV=$(fv volume attach-local v) || fail "attach-local after the restart"
dd if=/dev/urandom of=/tmp/a bs=1M count=2 2>/dev/null
dd if=/tmp/a of="$DEV" bs=1M count=2 oflag=direct conv=fsync 2>/dev/null || fail "flushed write"
SUM=$(md5sum /tmp/a | cut -d' ' -f1)
dd if=/dev/urandom of="$DEV" bs=64k seek=100 count=2000 oflag=direct 2>/dev/null &
DD=$!
sleep 2
kill -9 "$SERVER"
t=0
while kill -0 "$DD" 2>/dev/null; do
  sleep 1; t=$((t + 1)); [ "$t" -lt 60 ] || fail "the writer hangs after kill -9"
done
wait "$DD" && fail "the writer saw no error after kill -9"
echo "kill -9: the writer failed after ${t}s instead of hanging"
ID=${DEV#/dev/ublkb}
[ -e "/dev/ublkc$ID" ] || fail "no leftover /dev/ublkc$ID to delete"
start
[ ! -e "/dev/ublkc$ID" ] || fail "the restart left /dev/ublkc$ID"
grep -q "deleted a local device a killed server left behind" /tmp/serve.log || fail "no deletion logged"
DEV=$(fv volume attach-local v) || fail "attach-local after kill -9"
[ "$(dd if="$DEV" bs=1M count=2 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)" = "$SUM" ] ||
  fail "data flushed before kill -9 is lost"
fv volume detach-local v >/dev/null
kill "$SERVER"
wait "$SERVER" || fail "the server's stop failed"
echo "kill -9: flushed data intact, leftover device deleted at the restart"
echo "UBLK OK"

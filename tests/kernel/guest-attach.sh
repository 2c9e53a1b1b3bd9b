#!/bin/sh
# Guest script for `ferrovol nbd attach`: the kernel's netlink interface, no nbd-client.
# The kernel loads the nbd module when the netlink family is first asked for; the
# volume is attached, formatted and written, listed with its backend, detached, attached again
# with two connections and verified; a missing export is refused and nothing is left
# attached. Env: PORT, NBDVM_HOST.
set -eu
URI="nbd://$NBDVM_HOST:$PORT/kvol"
LIST=$(ferrovol nbd list)
[ -z "$LIST" ] || { echo "attached devices before any attach: $LIST"; exit 1; }
# Waits until $1 is no longer listed as attached.
gone() {
  i=0
  while ferrovol nbd list | grep -q "^$1	attached"; do
    sleep 0.2; i=$((i + 1)); [ "$i" -lt 50 ] || { echo "$1 still attached"; exit 1; }
  done
}
DEV=$(ferrovol nbd attach "$URI")
echo "attached $DEV"
ferrovol nbd list | grep "^$DEV	attached	.*/kvol	alive$" || { ferrovol nbd list; echo "not listed"; exit 1; }
[ "$(blockdev --getsize64 "$DEV")" = "$((256 * 1024 * 1024))" ] || { echo "wrong size"; exit 1; }
[ "$(blockdev --getss "$DEV")" = 4096 ] || { echo "logical block size $(blockdev --getss "$DEV")"; exit 1; }
mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV"
mkdir -p /mnt/v
mount -t ext4 "$DEV" /mnt/v
dd if=/dev/urandom of=/mnt/v/f bs=1M count=8 status=none
sync
SUM=$(md5sum /mnt/v/f | cut -d' ' -f1)
umount /mnt/v
ferrovol nbd detach "$DEV"
gone "$DEV"
if ferrovol nbd detach "$DEV" 2>/tmp/err; then echo "detached a free device"; exit 1; fi
DEV2=$(ferrovol nbd attach --connections 2 --device /dev/nbd2 "$URI")
[ "$DEV2" = /dev/nbd2 ] || { echo "asked for /dev/nbd2, got $DEV2"; exit 1; }
mount -t ext4 "$DEV2" /mnt/v
[ "$(md5sum /mnt/v/f | cut -d' ' -f1)" = "$SUM" ] || { echo "checksum differs"; exit 1; }
umount /mnt/v
e2fsck -fn "$DEV2" >/dev/null
# The device in use is refused; a missing export is refused.
if ferrovol nbd attach --device /dev/nbd2 "$URI" 2>/tmp/err; then echo "attached twice"; exit 1; fi
grep -q "in use" /tmp/err || { cat /tmp/err; exit 1; }
if ferrovol nbd attach "nbd://$NBDVM_HOST:$PORT/nothing" 2>/tmp/err; then echo "attached a missing export"; exit 1; fi
grep -q 'has no export "nothing"' /tmp/err || { cat /tmp/err; exit 1; }
ferrovol nbd detach /dev/nbd2
gone /dev/nbd2
LIST=$(ferrovol nbd list)
[ -z "$LIST" ] || { echo "left attached: $LIST"; exit 1; }
echo "attach ok"

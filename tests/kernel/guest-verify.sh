#!/bin/sh
# Guest phase 2 (after the server was killed with SIGKILL and restarted): reconnect
# with two connections (multi-conn), e2fsck -fn must be clean, every file's checksum
# must match phase 1, then fstrim passes discards through and the fs stays clean.
# Env: PORT, EXPORT, NBDVM_HOST.
set -eu
DEV=/dev/nbd0
modprobe nbd nbds_max=2
nbd-client -N "$EXPORT" "$NBDVM_HOST" "$PORT" "$DEV" -b 4096 -t 60 -C 2
e2fsck -fn "$DEV"
mkdir -p /mnt/v && mount -t ext4 "$DEV" /mnt/v
(cd /mnt/v && md5sum -c /mnt/host/sums) > /tmp/check.log 2>&1 || { cat /tmp/check.log; echo "CHECKSUM MISMATCH"; exit 1; }
echo "checksums: $(grep -c ': OK' /tmp/check.log) files OK"
rm /mnt/v/big
sync   # ext4 trims only blocks whose free is committed to its journal
fstrim -v /mnt/v
umount /mnt/v
e2fsck -fn "$DEV"
nbd-client -d "$DEV"
echo "KERNEL-NBD VERIFY PASS"

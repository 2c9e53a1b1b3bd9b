#!/bin/sh
# Guest phase 1: the Linux kernel's NBD client formats a ferrovol volume with ext4,
# writes files, records their checksums in the shared folder, unmounts, checks the
# file system with e2fsck -fn and disconnects (which flushes).
# Env: PORT, EXPORT, NBDVM_HOST.
set -eu
DEV=/dev/nbd0
modprobe nbd nbds_max=2
nbd-client -N "$EXPORT" "$NBDVM_HOST" "$PORT" "$DEV" -b 4096 -t 60
echo "connected: $(blockdev --getsize64 $DEV) bytes"
mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV"
mkdir -p /mnt/v && mount -t ext4 "$DEV" /mnt/v
dd if=/dev/urandom of=/mnt/v/big bs=1M count=24 status=none
i=0
while [ $i -lt 50 ]; do
  dd if=/dev/urandom of=/mnt/v/small.$i bs=1k count=$((i % 7 + 1)) status=none
  i=$((i + 1))
done
sync
(cd /mnt/v && md5sum big small.*) > /mnt/host/sums
umount /mnt/v
e2fsck -fn "$DEV"
nbd-client -d "$DEV"
echo "KERNEL-NBD WRITE PASS"

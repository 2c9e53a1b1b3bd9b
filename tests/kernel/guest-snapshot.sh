#!/bin/sh
# Guest script for the snapshot test. Phase "write": ext4 on the volume, files written
# and checksummed into the shared folder, unmount, disconnect; the host then takes a
# snapshot. Phase "change": more writes and a deleted file on the volume. Phase
# "verify": the snapshot export (read-only) is connected, e2fsck -fn is clean, it
# mounts read-only and holds the old files with their checksums, not the new ones.
# Env: PORT, EXPORT, SNAPSHOT, PHASE, NBDVM_HOST.
set -eu
DEV=/dev/nbd0
modprobe nbd nbds_max=2
case "$PHASE" in
write)
  nbd-client -N "$EXPORT" "$NBDVM_HOST" "$PORT" "$DEV" -b 4096 -t 60
  mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV"
  mkdir -p /mnt/v && mount -t ext4 "$DEV" /mnt/v
  dd if=/dev/urandom of=/mnt/v/old1 bs=1M count=8 status=none
  dd if=/dev/urandom of=/mnt/v/old2 bs=64k count=3 status=none
  sync
  (cd /mnt/v && md5sum old1 old2) > /mnt/host/sums
  umount /mnt/v
  nbd-client -d "$DEV"
  ;;
change)
  nbd-client -N "$EXPORT" "$NBDVM_HOST" "$PORT" "$DEV" -b 4096 -t 60
  mkdir -p /mnt/v && mount -t ext4 "$DEV" /mnt/v
  rm /mnt/v/old2
  dd if=/dev/urandom of=/mnt/v/old1 bs=1M count=2 conv=notrunc status=none
  dd if=/dev/urandom of=/mnt/v/new bs=1M count=4 status=none
  sync
  umount /mnt/v
  e2fsck -fn "$DEV"
  nbd-client -d "$DEV"
  ;;
verify)
  nbd-client -N "$SNAPSHOT" "$NBDVM_HOST" "$PORT" "$DEV" -b 4096 -t 60 -readonly
  e2fsck -fn "$DEV"
  mkdir -p /mnt/s && mount -t ext4 -o ro,noload "$DEV" /mnt/s
  (cd /mnt/s && md5sum -c /mnt/host/sums)
  [ ! -e /mnt/s/new ] || { echo "snapshot holds a file written after it"; exit 1; }
  if dd if=/dev/zero of="$DEV" bs=4096 count=1 oflag=direct 2>/dev/null; then echo "write to the snapshot device succeeded"; exit 1; fi
  umount /mnt/s
  nbd-client -d "$DEV"
  ;;
esac
echo "KERNEL-SNAPSHOT $PHASE PASS"

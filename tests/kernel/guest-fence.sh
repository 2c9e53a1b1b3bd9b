#!/bin/sh
# Guest script for the fencing test: the kernel client opens the volume by its
# attachment's export name (VOLUME/KEY, in $EXPORT), writes 1 MiB and copies it to the
# shared folder, then tells the host (file "written") and waits until the host has
# unpublished the volume from this node (file "unpublished"). A write after that must
# fail: the server closed the connection and refuses the key.
# Env: PORT, EXPORT, NBDVM_HOST.
set -eu
DEV=/dev/nbd0
modprobe nbd nbds_max=2
nbd-client -N "$EXPORT" "$NBDVM_HOST" "$PORT" "$DEV" -b 4096
dd if=/dev/urandom of=/tmp/a bs=64k count=16 status=none
dd if=/tmp/a of="$DEV" bs=64k oflag=direct status=none
cp /tmp/a /mnt/host/a
touch /mnt/host/written
i=0
while [ ! -e /mnt/host/unpublished ]; do
  sleep 0.2
  i=$((i + 1))
  [ "$i" -lt 1500 ] || { echo "the host never unpublished"; exit 2; }
done
if dd if=/dev/urandom of="$DEV" bs=64k count=16 seek=16 oflag=direct status=none 2>/dev/null; then
  echo "a write after unpublish succeeded"
  exit 1
fi
echo "write after unpublish refused"
# The old key is refused on a new connection too.
nbd-client -d "$DEV" >/dev/null 2>&1 || true
if nbd-client -N "$EXPORT" "$NBDVM_HOST" "$PORT" /dev/nbd1 -b 4096 >/dev/null 2>&1; then
  echo "the old key connected again"
  exit 1
fi
echo "old key refused"

#!/bin/sh
# Guest script for `ferrovol nbd watch`: a volume attached with its key through a TCP
# proxy on the host, ext4 on it, and a writer that writes a file, fsyncs it, and records its
# checksum, over and over. The host (files in /mnt/host tell the steps) cuts the proxy's
# connections, stops and restarts the server cleanly, grows the volume, and at last
# kills it with SIGKILL. The watcher is killed and started again in between. Expected:
# no I/O error through the cut and the clean restart; the device takes the new size
# and resize2fs grows the mounted file system; a reconnect to another volume is refused;
# after the SIGKILL the device is fenced (a server that lost a crash generation may have
# lost acknowledged writes) and the writer sees EIO; every file synced before is intact.
# Then a device with a 3 s dead timeout and its server gone: EIO, listed as
# reconnecting, and detach works. Env: PORT (the proxy), EXPORT (VOLUME/KEY), OTHER (another
# volume's VOLUME/KEY), NBDVM_HOST.
set -eu
H=/mnt/host
URI="nbd://$NBDVM_HOST:$PORT/$EXPORT"
wait_for() {
  i=0
  while [ ! -e "$H/$1" ]; do
    sleep 0.2; i=$((i + 1))
    [ "$i" -lt 1500 ] || { echo "the host never wrote $1"; exit 2; }
  done
}
# Waits until the writer has synced $1 more files.
files_more() {
  want=$(( $(wc -l < /tmp/sums) + $1 )); i=0
  while [ "$(wc -l < /tmp/sums)" -lt "$want" ]; do
    [ ! -e /tmp/writer.done ] || { echo "the writer stopped:"; cat /tmp/writer.err; exit 1; }
    sleep 0.5; i=$((i + 1))
    [ "$i" -lt 600 ] || { echo "the writer made no progress"; ferrovol nbd list; cat /tmp/watch.log; dmesg | tail -20; exit 1; }
  done
}
step() { echo "== $1"; touch "$H/$1"; }

# Without the key, the export is refused.
if ferrovol nbd attach "nbd://$NBDVM_HOST:$PORT/${EXPORT%%/*}" 2>/tmp/err; then echo "attached without the key"; exit 1; fi
grep -q "published" /tmp/err || { cat /tmp/err; exit 1; }

ferrovol nbd watch --retry 0.2 >/tmp/watch.log 2>&1 &
WATCH=$!
DEV=$(ferrovol nbd attach --connections 2 --dead-timeout 120 "$URI")
ferrovol nbd list | grep "^$DEV	attached	.*	alive$" || { ferrovol nbd list; exit 1; }
mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV"
mkdir -p /mnt/v
mount -t ext4 "$DEV" /mnt/v
: > /tmp/sums
(
  n=0
  while [ ! -e /tmp/writer.stop ]; do
    n=$((n + 1))
    if ! dd if=/dev/urandom of=/mnt/v/f$n bs=64k count=4 conv=fsync status=none 2>>/tmp/writer.err; then
      echo "f$n failed" >>/tmp/writer.err; break
    fi
    (cd /mnt/v && md5sum f$n) >> /tmp/sums
  done
  touch /tmp/writer.done
) &
files_more 3

step cut            # the host closes the proxy's connections
wait_for cut-done
files_more 3
grep -q "reconnected" /tmp/watch.log || { cat /tmp/watch.log; echo "no reconnect logged"; exit 1; }

kill -9 "$WATCH"
step restart        # the host stops the server with SIGTERM and starts it again
wait_for restart-done
ferrovol nbd watch --retry 0.2 >>/tmp/watch.log 2>&1 &
WATCH=$!
files_more 3

step grow           # the host grows the volume to 384 MiB
wait_for grow-done
[ "$(ferrovol nbd resize "$DEV")" = $((384 * 1024 * 1024)) ] || { echo "resize did not print the new size"; exit 1; }
[ "$(blockdev --getsize64 "$DEV")" = $((384 * 1024 * 1024)) ] || { echo "device size $(blockdev --getsize64 "$DEV")"; exit 1; }
resize2fs "$DEV" >/dev/null 2>&1 || { echo "online resize2fs failed"; exit 1; }
BLOCKS=$(df -k /mnt/v | awk 'NR==2 {print $2}')
[ "$BLOCKS" -gt 300000 ] || { echo "file system not grown: $BLOCKS KiB"; exit 1; }
files_more 2

# Another volume's backend is refused by the kernel.
if ferrovol nbd reconnect "$DEV" "nbd://$NBDVM_HOST:$PORT/$OTHER" 2>/tmp/err; then echo "reconnected to another volume"; exit 1; fi
grep -q "another backend" /tmp/err || { cat /tmp/err; exit 1; }

# Every file synced so far, read back from the server.
touch /tmp/writer.stop
while [ ! -e /tmp/writer.done ]; do sleep 0.2; done
[ ! -s /tmp/writer.err ] || { echo "I/O errors:"; cat /tmp/writer.err; exit 1; }
umount /mnt/v
echo 3 > /proc/sys/vm/drop_caches
mount -t ext4 "$DEV" /mnt/v
(cd /mnt/v && md5sum -c -s /tmp/sums) || { echo "checksums differ:"; (cd /mnt/v && md5sum -c /tmp/sums | grep -v ': OK$'); exit 1; }
cp /tmp/sums /tmp/sums.synced
echo "$(wc -l < /tmp/sums) files intact after a cut, a restart and a grow"

# SIGKILL of the server: the watcher must not reconnect to the next crash generation.
rm -f /tmp/writer.stop /tmp/writer.done /tmp/writer.err
(
  n=1000
  while :; do
    n=$((n + 1))
    dd if=/dev/urandom of=/mnt/v/g$n bs=64k count=4 conv=fsync status=none 2>>/tmp/writer.err || break
  done
  touch /tmp/writer.done
) &
sleep 2
step kill           # the host kills the server with SIGKILL and starts it again
wait_for kill-done
i=0
until ferrovol nbd list | grep -q "fenced"; do
  sleep 0.5; i=$((i + 1))
  [ "$i" -lt 120 ] || { echo "not fenced"; ferrovol nbd list; cat /tmp/watch.log; exit 1; }
done
ferrovol nbd list
i=0
while [ ! -e /tmp/writer.done ]; do
  sleep 0.5; i=$((i + 1))
  [ "$i" -lt 240 ] || { echo "the writer never failed"; exit 1; }
done
echo "writer stopped: $(tail -1 /tmp/writer.err)"
umount /mnt/v 2>/dev/null || umount -l /mnt/v
grep -q "crash generation" /tmp/watch.log || { cat /tmp/watch.log; exit 1; }
# Attached anew: what was synced before the kill is there and the file system is clean.
sleep 1
DEV=$(ferrovol nbd attach "$URI")
e2fsck -fy "$DEV" >/tmp/fsck 2>&1 || [ $? -le 1 ] || { cat /tmp/fsck; exit 1; }
mount -t ext4 "$DEV" /mnt/v
(cd /mnt/v && md5sum -c -s /tmp/sums.synced) || { echo "checksums differ after the kill:"; (cd /mnt/v && md5sum -c /tmp/sums.synced | grep -v ': OK$'); exit 1; }
umount /mnt/v
ferrovol nbd detach "$DEV"

# A short dead timeout and a server that stays down: EIO, and the device shows it.
DEV=$(ferrovol nbd attach --dead-timeout 3 "$URI")
step down           # the host kills the server and leaves it down
wait_for down-done
if dd if=/dev/zero of="$DEV" bs=4k count=1 oflag=direct status=none 2>/tmp/err; then echo "a write with the server down succeeded"; exit 1; fi
grep -q "Input/output error" /tmp/err || { cat /tmp/err; exit 1; }
i=0
until ferrovol nbd list | grep -q "^$DEV	attached	.*reconnecting"; do
  sleep 0.5; i=$((i + 1)); [ "$i" -lt 60 ] || { ferrovol nbd list; echo "not listed as reconnecting"; exit 1; }
done
ferrovol nbd detach "$DEV"
kill "$WATCH"
echo "reconnect ok"

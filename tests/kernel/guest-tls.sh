#!/bin/sh
# Guest script for NBD over TLS with the kernel's client: `ferrovol nbd attach nbds://`
# does the TLS handshake in userspace and hands the session to the kernel (kernel TLS),
# so /dev/nbdN speaks TLS to a server with --nbd-tls required.
# 1. The server serves in clear text: the volume is attached (nbd://, with the node's
#    credentials directory in its record), formatted and written; then the host
#    restarts the server with TLS required (steps `plain-done`, `tls-on` in the share)
#    and a reconnect goes over to TLS by itself.
# 2. Plain, credential-less and foreign-CA attaches are refused; over TLS the volume
#    is attached again, its files intact, written more, reconnected (new TLS sessions)
#    and checked.
# Env: PORT, EXPORT (VOLUME/KEY), NBDVM_HOST. Share: mods/*.ko.xz (kernel TLS and
# ChaCha20-Poly1305, loaded in order), node/ and stranger/ (ca.crt, tls.crt, tls.key).
set -eu
for m in libchacha chacha_generic libpoly1305 poly1305_generic chacha20poly1305 tls; do
  insmod /mnt/host/mods/$m.ko.xz
done
PLAIN="nbd://$NBDVM_HOST:$PORT/$EXPORT"
URI="nbds://$NBDVM_HOST:$PORT/$EXPORT"
wait_for() {
  i=0
  while [ ! -e "/mnt/host/$1" ]; do
    sleep 0.2; i=$((i + 1)); [ "$i" -lt 1500 ] || { echo "the host never reached $1"; exit 1; }
  done
}

# 1. In clear text, then over to TLS. A dead connection fails requests after 30 s (no
# watcher runs here).
DEV=$(ferrovol nbd attach --dead-timeout 30 --tls-dir /mnt/host/node "$PLAIN")
echo "attached $DEV in clear text"
mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV"
mkdir -p /mnt/v
mount -t ext4 "$DEV" /mnt/v
dd if=/dev/urandom of=/mnt/v/f bs=1M count=8 status=none
sync
SUM=$(md5sum /mnt/v/f | cut -d' ' -f1)
touch /mnt/host/plain-done
wait_for tls-on
ferrovol nbd reconnect "$DEV"
grep -q "^uri=nbds://" /run/ferrovol/nbd/nbd"${DEV#/dev/nbd}" || { cat /run/ferrovol/nbd/nbd*; echo "the record stayed in clear text"; exit 1; }
echo 3 > /proc/sys/vm/drop_caches
[ "$(md5sum /mnt/v/f | cut -d' ' -f1)" = "$SUM" ] || { echo "checksum differs after going over to TLS"; exit 1; }
umount /mnt/v
ferrovol nbd detach "$DEV"
sleep 1

# 2. TLS from the start.
if ferrovol nbd attach "$PLAIN" 2>/tmp/err; then echo "attached without TLS"; exit 1; fi
grep -q "requires TLS" /tmp/err || { cat /tmp/err; exit 1; }
if ferrovol nbd attach "$URI" 2>/tmp/err; then echo "attached over TLS without credentials"; exit 1; fi
grep -q "credentials" /tmp/err || { cat /tmp/err; exit 1; }
if ferrovol nbd attach --tls-dir /mnt/host/stranger "$URI" 2>/tmp/err; then echo "a stranger's certificate attached"; exit 1; fi
grep -q "UnknownCA" /tmp/err || { cat /tmp/err; exit 1; }
DEV=$(ferrovol nbd attach --dead-timeout 5 --tls-dir /mnt/host/node "$URI")
echo "attached $DEV over TLS"
mount -t ext4 "$DEV" /mnt/v
[ "$(md5sum /mnt/v/f | cut -d' ' -f1)" = "$SUM" ] || { echo "checksum differs over TLS"; exit 1; }
dd if=/dev/urandom of=/mnt/v/g bs=1M count=4 status=none
sync
SUM2=$(md5sum /mnt/v/g | cut -d' ' -f1)
echo 3 > /proc/sys/vm/drop_caches
# New sockets, new TLS sessions, from the record's credentials directory.
ferrovol nbd reconnect "$DEV"
[ "$(md5sum /mnt/v/g | cut -d' ' -f1)" = "$SUM2" ] || { echo "checksum differs after the reconnect"; exit 1; }
umount /mnt/v
e2fsck -fn "$DEV" >/dev/null
ferrovol nbd detach "$DEV"
echo "$SUM" > /mnt/host/sum
echo "tls ok"

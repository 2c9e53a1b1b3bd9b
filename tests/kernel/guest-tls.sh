#!/bin/sh
# Guest script for NBD over TLS with the kernel's client: `ferrovol nbd attach nbds://`
# does the TLS handshake in userspace and hands the session to the kernel (kernel TLS),
# so /dev/nbdN speaks TLS to a server with --nbd-tls required. A plain attach is
# refused; over TLS a volume is formatted, written, reconnected (new TLS sessions from
# the record's credentials) and verified; a certificate of another CA is refused.
# Env: PORT, EXPORT (VOLUME/KEY), NBDVM_HOST. Share: mods/*.ko.xz (kernel TLS and
# ChaCha20-Poly1305, loaded in order), node/ and stranger/ (ca.crt, tls.crt, tls.key).
set -eu
for m in libchacha chacha_generic libpoly1305 poly1305_generic chacha20poly1305 tls; do
  insmod /mnt/host/mods/$m.ko.xz
done
URI="nbds://$NBDVM_HOST:$PORT/$EXPORT"
if ferrovol nbd attach "nbd://$NBDVM_HOST:$PORT/$EXPORT" 2>/tmp/err; then echo "attached without TLS"; exit 1; fi
grep -q "requires TLS" /tmp/err || { cat /tmp/err; exit 1; }
if ferrovol nbd attach "$URI" 2>/tmp/err; then echo "attached over TLS without credentials"; exit 1; fi
grep -q "credentials" /tmp/err || { cat /tmp/err; exit 1; }
if ferrovol nbd attach --tls-dir /mnt/host/stranger "$URI" 2>/tmp/err; then echo "a stranger's certificate attached"; exit 1; fi
grep -q "UnknownCA" /tmp/err || { cat /tmp/err; exit 1; }
# A dead connection fails requests after 5 s (no watcher runs here).
DEV=$(ferrovol nbd attach --dead-timeout 5 --tls-dir /mnt/host/node "$URI")
echo "attached $DEV over TLS"
mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV"
mkdir -p /mnt/v
mount -t ext4 "$DEV" /mnt/v
dd if=/dev/urandom of=/mnt/v/f bs=1M count=8 status=none
sync
SUM=$(md5sum /mnt/v/f | cut -d' ' -f1)
echo 3 > /proc/sys/vm/drop_caches
# New sockets, new TLS sessions, from the record's credentials directory.
ferrovol nbd reconnect "$DEV"
[ "$(md5sum /mnt/v/f | cut -d' ' -f1)" = "$SUM" ] || { echo "checksum differs after the reconnect"; exit 1; }
dd if=/dev/urandom of=/mnt/v/g bs=1M count=4 status=none
sync
umount /mnt/v
e2fsck -fn "$DEV" >/dev/null
ferrovol nbd detach "$DEV"
echo "$SUM" > /mnt/host/sum
echo "tls ok"

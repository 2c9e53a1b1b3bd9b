#!/bin/sh
# Guest script: a storage host (`ferrovol serve`), a CSI controller over it and the CSI
# node plugin all run here, the node told of the host on its machine
# (--local-host-socket, --local-ublk always); the test binary that started this VM (at
# /usr/bin/csi-flow) plays the kubelet and the sidecars (guest_side::guest_side_local):
# the host's volumes are staged as its local ublk devices, not over NBD, and an
# unpublish removes the device (fencing). Then the node plugin again with
# --local-ublk auto (guest_side::guest_side_local_auto).
set -eu
modprobe ublk_drv 2>/dev/null || true
H=/tmp/host
mkdir -p /tmp/csi "$H"
ferrovol --data-dir "$H" serve --pool-size 4GiB --listen 127.0.0.1:10809 --nbd-access attached >/tmp/serve.log 2>&1 &
i=0
until ferrovol --data-dir "$H" pool status >/dev/null 2>&1; do
  sleep 0.2; i=$((i + 1)); [ "$i" -lt 300 ] || { cat /tmp/serve.log; exit 1; }
done
printf '[[host]]\nname = "host-a"\napi = "unix://%s/ferrovol.sock"\n' "$H" >/tmp/csi.toml
ferrovol csi controller --endpoint tcp://127.0.0.1:9820 --config /tmp/csi.toml >/tmp/controller.log 2>&1 &
ferrovol nbd watch >/tmp/watch.log 2>&1 &
ferrovol csi node --endpoint unix:///tmp/csi/node.sock --node-name vm-node \
  --local-host-socket "$H/ferrovol.sock" --local-ublk always >/tmp/node.log 2>&1 &
echo $! >/tmp/node.pid
i=0
while [ ! -S /tmp/csi/node.sock ]; do
  sleep 0.2; i=$((i + 1)); [ "$i" -lt 100 ] || { cat /tmp/node.log; exit 1; }
done
if ! NBDVM_HOST=127.0.0.1 CONTROLLER_PORT=9820 csi-flow --ignored --exact guest_side::guest_side_local --nocapture \
  --test-threads 1; then
  echo "--- node log"; tail -60 /tmp/node.log
  echo "--- controller log"; tail -30 /tmp/controller.log
  echo "--- server log"; tail -30 /tmp/serve.log
  exit 1
fi
# The node plugin again, with --local-ublk auto (the default).
kill "$(cat /tmp/node.pid)"
while kill -0 "$(cat /tmp/node.pid)" 2>/dev/null; do sleep 0.2; done
rm -f /tmp/csi/node.sock
ferrovol csi node --endpoint unix:///tmp/csi/node.sock --node-name vm-node \
  --local-host-socket "$H/ferrovol.sock" >/tmp/node-auto.log 2>&1 &
i=0
while [ ! -S /tmp/csi/node.sock ]; do
  sleep 0.2; i=$((i + 1)); [ "$i" -lt 100 ] || { cat /tmp/node-auto.log; exit 1; }
done
if ! NBDVM_HOST=127.0.0.1 CONTROLLER_PORT=9820 csi-flow --ignored --exact guest_side::guest_side_local_auto \
  --nocapture --test-threads 1; then
  echo "--- node log"; tail -60 /tmp/node-auto.log
  exit 1
fi
[ -z "$(ls /dev | grep ublkb || true)" ] || { echo "left attached:"; ls /dev | grep ublkb; exit 1; }
[ -z "$(ferrovol nbd list)" ] || { echo "left attached:"; ferrovol nbd list; exit 1; }
echo "CSI LOCAL OK"

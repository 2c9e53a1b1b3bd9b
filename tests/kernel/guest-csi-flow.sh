#!/bin/sh
# Guest script: the CSI node plugin and the reconnect watcher run here, and the test
# binary that started this VM (at /usr/bin/csi-flow) plays the kubelet and the sidecars
# against it and against the controller on the host. Env: CONTROLLER_PORT, NBDVM_HOST,
# FLOW (the guest-side test to run), DEAD_TIMEOUT (the node's, in seconds).
set -eu
mkdir -p /tmp/csi
ferrovol nbd watch >/tmp/watch.log 2>&1 &
ferrovol csi node --endpoint unix:///tmp/csi/node.sock --node-name vm-node --dead-timeout "${DEAD_TIMEOUT:-120}" \
  >/tmp/node.log 2>&1 &
echo $! >/tmp/node.pid
i=0
while [ ! -S /tmp/csi/node.sock ]; do
  sleep 0.2; i=$((i + 1)); [ "$i" -lt 100 ] || { cat /tmp/node.log; exit 1; }
done
if ! csi-flow --ignored --exact "${FLOW:-guest_side::guest_side_flow}" --nocapture --test-threads 1; then
  echo "--- node log"; tail -60 /tmp/node.log
  echo "--- watcher log"; tail -30 /tmp/watch.log
  echo "--- devices"; ferrovol nbd list
  exit 1
fi
[ -z "$(ferrovol nbd list)" ] || { echo "left attached:"; ferrovol nbd list; exit 1; }

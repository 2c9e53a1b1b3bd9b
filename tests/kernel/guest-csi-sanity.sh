#!/bin/sh
# Guest script: the CSI node plugin (`ferrovol csi node`) and the reconnect watcher run
# in the guest; the storage host and the CSI controller run on the host (the controller
# at $NBDVM_HOST:$CONTROLLER_PORT). csi-sanity runs its Node and Controller cases
# against both, once with mount volumes and once with block volumes, and must fail none.
# Skipped: the three cases that stage a volume the way a driver without ControllerPublish
# would. csi-sanity asks the *node* endpoint's Identity whether a controller service
# exists; a split driver's node plugin truthfully offers none, so those cases stage with
# an empty publish_context, which carries the export key: they cannot pass against a
# storage host that serves volumes only to the nodes they are published to. The same
# steps with ControllerPublish run in csi_node_flow_in_the_kernel_vm.
# Env: CONTROLLER_PORT, NBDVM_HOST.
set -eu
mkdir -p /tmp/csi
ferrovol nbd watch >/tmp/watch.log 2>&1 &
ferrovol csi node --endpoint unix:///tmp/csi/node.sock --node-name vm-node >/tmp/node.log 2>&1 &
i=0
while [ ! -S /tmp/csi/node.sock ]; do
  sleep 0.2; i=$((i + 1)); [ "$i" -lt 100 ] || { cat /tmp/node.log; exit 1; }
done
rc=0
for access in mount block; do
  T=/tmp/sanity-$access
  mkdir -p $T
  echo "== csi-sanity, $access volumes"
  csi-sanity -csi.endpoint unix:///tmp/csi/node.sock \
    -csi.controllerendpoint "$NBDVM_HOST:$CONTROLLER_PORT" \
    -csi.stagingdir $T/staging -csi.mountdir $T/mount \
    -csi.testvolumesize 67108864 -csi.testvolumeexpandsize 134217728 \
    -csi.testvolumeaccesstype $access \
    -ginkgo.skip 'should remove target path|should fail when volume does not exist on the specified path|should work if node-expand is called after node-publish' \
    -ginkgo.no-color -ginkgo.succinct -ginkgo.timeout 10m \
    -ginkgo.junit-report $T/junit.xml >$T/out.log 2>&1 || rc=1
  # Every failure, then the counts (from the JUnit report).
  grep -E "^\s*\[FAIL\]|FAIL!|SUCCESS!" $T/out.log | head -40
  COUNTS=$(grep -o '<testsuite [^>]*>' $T/junit.xml | head -1 | grep -o -E '(tests|failures|errors|skipped)="[0-9]*"' | tr '\n' ' ')
  echo "csi-sanity $access: $COUNTS"
  if [ "$rc" != 0 ]; then
    grep -B2 -A12 "\[FAILED\]" $T/out.log | head -150
    echo "--- node log"; tail -40 /tmp/node.log
    break
  fi
done
[ -z "$(ferrovol nbd list)" ] || { echo "left attached:"; ferrovol nbd list; rc=1; }
exit $rc

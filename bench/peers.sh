#!/usr/bin/env bash
# bench/peers.sh [seconds] — one run of ../shared/tools/nbd-peers.sh with ferrovol
# beside the raw file (O_DIRECT), qemu-nbd (cache=none), nbdkit and nbd-server.
#
# Builds ferrovol (release), starts it on a fresh pool in $WORK (default
# ~/.cache/ferrovol-bench), creates a 4 GiB volume "bench", and runs the peer suite
# with PEERS including ext:ferrovol. The combined table is printed and written to
# $OUT (default $WORK/peers-<date>.txt). Env: PEERS, WSS, SECS as for nbd-peers.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10819}
TOOLS=../shared/tools
. bench/common.sh
build
rm -rf "$WORK/data"; mkdir -p "$WORK"
trap stop_server EXIT
start_server "$WORK/data" "$PORT" --pool-size 16GiB
"$BIN" --data-dir "$WORK/data" volume create bench --size 4GiB
OUT=${OUT:-$WORK/peers-$(date +%Y%m%d-%H%M%S).txt}
PEERS=${PEERS:-"raw-direct qemu-nbd-dir nbdkit-file nbd-server ext:ferrovol"} \
EXT_URI_ferrovol=nbd://127.0.0.1:$PORT/bench EXT_PID_ferrovol=$PID OUT=$OUT \
  bash $TOOLS/nbd-peers.sh "$SECS"
echo "table written to $OUT"

#!/usr/bin/env bash
# bench/peers.sh [seconds] — one run of ../shared/tools/nbd-peers.sh with ferrovol
# beside the raw file (O_DIRECT), qemu-nbd (cache=none), nbdkit and nbd-server.
#
# Builds ferrovol (release), starts it on a fresh pool in $WORK (default
# ~/.cache/ferrovol-bench), creates a 4 GiB volume "bench", and runs the peer suite
# with PEERS including ext:ferrovol. The combined table is printed and written to
# $OUT (default $WORK/peers-<date>.txt). Env: PEERS, WSS, SECS as for nbd-peers.sh.
#
# Also in the run, as ext:nbdkit_memory (on 127.0.0.1, port PORT+1): nbdkit's memory
# plugin, an NBD server that does no disk I/O at all. Its row shows what the NBD round
# trips and fio's client cost on this machine with no disk behind them; it is not a
# peer, and not a hard ceiling (a page-cache server can beat it with 4 connections).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10819}
TOOLS=../shared/tools
. bench/common.sh
build
rm -rf "$WORK/data"; mkdir -p "$WORK"
MEMPORT=$((PORT + 1))
nbdkit -f -i 127.0.0.1 -p "$MEMPORT" --exit-with-parent memory 4G &
MEMPID=$!
trap 'stop_server; kill $MEMPID 2>/dev/null || true' EXIT
start_server "$WORK/data" "$PORT" --pool-size 16GiB
"$BIN" --data-dir "$WORK/data" volume create bench --size 4GiB
OUT=${OUT:-$WORK/peers-$(date +%Y%m%d-%H%M%S).txt}
PEERS=${PEERS:-"raw-direct qemu-nbd-dir nbdkit-file nbd-server ext:ferrovol ext:nbdkit_memory"} \
EXT_URI_ferrovol=nbd://127.0.0.1:$PORT/bench EXT_PID_ferrovol=$PID OUT=$OUT \
EXT_URI_nbdkit_memory=nbd://127.0.0.1:$MEMPORT/ EXT_PID_nbdkit_memory=$MEMPID \
  bash $TOOLS/nbd-peers.sh "$SECS"
echo "table written to $OUT"

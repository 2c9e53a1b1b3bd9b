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
#
# With B_ARGS (extra `serve` flags, e.g. B_ARGS="--busy-poll-us 50"), a second ferrovol
# with those flags joins the same run as ext:ferrovol_b (port PORT+2, its own pool), so
# that one setting is measured against the peers and the default in one run.
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
B_PID=
trap 'stop_server; [ -z "$B_PID" ] || { kill "$B_PID"; wait "$B_PID"; } 2>/dev/null || true
  kill $MEMPID 2>/dev/null || true' EXIT
DEFAULT_PEERS="raw-direct qemu-nbd-dir nbdkit-file nbd-server ext:ferrovol ext:nbdkit_memory"
if [ -n "${B_ARGS:-}" ]; then
  rm -rf "$WORK/data-b"
  # shellcheck disable=SC2086 # B_ARGS: flags split on spaces
  start_server "$WORK/data-b" $((PORT + 2)) --pool-size 16GiB $B_ARGS
  B_PID=$PID
  "$BIN" --data-dir "$WORK/data-b" volume create bench --size 4GiB
  DEFAULT_PEERS="$DEFAULT_PEERS ext:ferrovol_b"
fi
start_server "$WORK/data" "$PORT" --pool-size 16GiB
"$BIN" --data-dir "$WORK/data" volume create bench --size 4GiB
OUT=${OUT:-$WORK/peers-$(date +%Y%m%d-%H%M%S).txt}
PEERS=${PEERS:-$DEFAULT_PEERS} \
EXT_URI_ferrovol=nbd://127.0.0.1:$PORT/bench EXT_PID_ferrovol=$PID OUT=$OUT \
EXT_URI_ferrovol_b=nbd://127.0.0.1:$((PORT + 2))/bench EXT_PID_ferrovol_b=$B_PID \
EXT_URI_nbdkit_memory=nbd://127.0.0.1:$MEMPORT/ EXT_PID_nbdkit_memory=$MEMPID \
  bash $TOOLS/nbd-peers.sh "$SECS"
echo "table written to $OUT"

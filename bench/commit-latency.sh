#!/usr/bin/env bash
# bench/commit-latency.sh [reps] [seconds] — a database commit at QD1: one 4 KiB write
# followed by a flush, over and over, against the raw file, ferrovol and two other NBD
# servers in one run.
#
#   raw-direct   fio io_uring, O_DIRECT, on a 1 GiB file next to the pool, `fdatasync`
#                after every write (fio --fdatasync=1); random offsets
#   ferrovol     fio's nbd engine on a volume whose 1 GiB working set is written, an
#                NBD_CMD_FLUSH after every write (fio --fsync=1); random offsets, so
#                every write overwrites a mapped block, as in a database's data file
#   ferrovol-alloc  the same on a fresh volume, writing 4 KiB in every 64 KiB data unit
#                in turn (fio zonemode=strided), so every write allocates a unit and
#                every flush commits its mapping record (informative; a database file
#                is usually preallocated)
#   qemu-nbd-dir the peer in ferrovol's class: qemu-nbd --cache=none --aio=native on a
#                1 GiB raw file next to the pool, written first; random offsets
#   nbdkit-memory  nbdkit's memory plugin: no disk at all (its flush does nothing), so
#                its commit is two NBD round trips and fio's own cost
#
# fio reports the write and the flush latency apart and keeps no per-commit figure, so
# the script prints, per job: commits per second and the mean commit latency (1/rate,
# exact), the p99 of the write and of the flush (total latency, submission included),
# and their sum (an estimate of a commit's p99, not a bound); latencies in µs.
# While it runs it prints one line per job and repetition:
#   NAME COMMITS/S MEAN_µs P99_WRITE_µs P99_FLUSH_µs
# then a table of the medians over the repetitions (for the sum: of each repetition's
# sum), and the ratios to raw-direct. Jobs are interleaved within each repetition.
# Env: WORK (default ~/.cache/ferrovol-bench), PORT (default 10851; PORT+1 qemu-nbd,
# PORT+2 nbdkit, PORT+3 the second build, all on 127.0.0.1). BIN_B=PATH adds a second
# ferrovol build, run in the same way right after the first in each repetition (jobs
# ferrovol-B and ferrovol-alloc-B), to compare two versions in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SECS=${2:-10}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10851}
QPORT=$((PORT + 1))
MPORT=$((PORT + 2))
BPORT=$((PORT + 3))
. bench/common.sh
build
mkdir -p "$WORK"
QPID= MPID= BPID= OUT=
cleanup() {
  stop_server
  for p in $QPID $MPID $BPID; do kill "$p" 2>/dev/null || true; done
  rm -rf "$WORK/commit" "$WORK/commit-b" "$WORK/commit-raw.img" "$WORK/commit-qemu.img" ${OUT:+"$OUT"}
}
trap cleanup EXIT
trap 'exit 130' INT TERM
rm -rf "$WORK/commit" "$WORK/commit-b"
if [ -n "${BIN_B:-}" ]; then
  A_BIN=$BIN BIN=$(realpath "$BIN_B")
  start_server "$WORK/commit-b" "$BPORT" --pool-size 8GiB
  BPID=$PID BIN=$A_BIN
fi
start_server "$WORK/commit" "$PORT" --pool-size 8GiB
U=nbd://127.0.0.1:$PORT
# ferrovol_jobs SUFFIX DIR URI: the two ferrovol jobs of one repetition on one server.
ferrovol_jobs() {
  local sfx=$1 dir=$2 uri=$3
  job "ferrovol$sfx" --ioengine=nbd --uri="$uri/db" --fsync=1 "${RANDOM_1G[@]}" | tee -a "$OUT"
  "$BIN" --data-dir "$dir" volume delete fresh >/dev/null 2>&1 || true
  "$BIN" --data-dir "$dir" volume create fresh --size 4GiB >/dev/null
  job "ferrovol-alloc$sfx" --ioengine=nbd --uri="$uri/fresh" --fsync=1 \
    --rw=write --zonemode=strided --zonesize=4k --zonerange=64k --size=4G | tee -a "$OUT"
}
for d in "$WORK/commit" ${BPID:+"$WORK/commit-b"}; do
  "$BIN" --data-dir "$d" volume create db --size 2GiB >/dev/null
done
fio --name=precond --ioengine=nbd --uri=$U/db --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null
if [ -n "$BPID" ]; then
  fio --name=precond --ioengine=nbd --uri="nbd://127.0.0.1:$BPORT/db" --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null
fi
for f in commit-raw.img commit-qemu.img; do
  fio --name=precond --filename="$WORK/$f" --ioengine=io_uring --direct=1 --rw=write --bs=1M \
    --iodepth=8 --size=1G >/dev/null
done
qemu-nbd -f raw --cache=none --aio=native -t -b 127.0.0.1 -p "$QPORT" "$WORK/commit-qemu.img" &
QPID=$!
nbdkit -f -i 127.0.0.1 -p "$MPORT" --exit-with-parent memory 1G &
MPID=$!
# Ready when each answers a handshake (and is the process started here).
for _ in $(seq 100); do
  if nbdinfo --size "nbd://127.0.0.1:$QPORT/" >/dev/null 2>&1 && nbdinfo --size "nbd://127.0.0.1:$MPORT/" >/dev/null 2>&1; then
    break
  fi
  sleep 0.1
done
kill -0 "$QPID" && kill -0 "$MPID" || { echo "qemu-nbd or nbdkit did not start (ports $QPORT, $MPORT in use?)" >&2; exit 1; }

# job NAME fio-args... -> "NAME commits/s mean_us p99_write_us p99_flush_us"
job() {
  local name=$1; shift
  fio --name="$name" --bs=4k --iodepth=1 --runtime="$SECS" --time_based --lat_percentiles=1 \
    --output-format=json "$@" | sed -n '/^{/,$p' | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
w, s = j["write"], j["sync"]
p = lambda d: d["percentile"]["99.000000"] / 1000
print(sys.argv[1], round(w["iops"]), round(1e6 / w["iops"], 1), round(p(w["lat_ns"]), 1), round(p(s["lat_ns"]), 1))
' "$name"
}

RANDOM_1G=(--rw=randwrite --size=1G)
OUT=$(mktemp)
for rep in $(seq "$REPS"); do
  job raw-direct --filename="$WORK/commit-raw.img" --ioengine=io_uring --direct=1 --fdatasync=1 "${RANDOM_1G[@]}" | tee -a "$OUT"
  ferrovol_jobs "" "$WORK/commit" "$U"
  if [ -n "$BPID" ]; then ferrovol_jobs -B "$WORK/commit-b" "nbd://127.0.0.1:$BPORT"; fi
  job qemu-nbd-dir --ioengine=nbd --uri="nbd://127.0.0.1:$QPORT/" --fsync=1 "${RANDOM_1G[@]}" | tee -a "$OUT"
  job nbdkit-memory --ioengine=nbd --uri="nbd://127.0.0.1:$MPORT/" --fsync=1 "${RANDOM_1G[@]}" | tee -a "$OUT"
done
/usr/bin/python3 - "$OUT" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rate, mean, pw, pf = line.split()
    pw, pf = float(pw), float(pf)
    rows.setdefault(name, []).append((float(rate), float(mean), pw, pf, pw + pf))
med = {n: [statistics.median(c) for c in zip(*v)] for n, v in rows.items()}
print(f"\n{'job':16} {'commits/s':>10} {'mean µs':>9} {'p99 write µs':>13} {'p99 flush µs':>13} {'p99 sum µs':>11}  (medians of {len(rows['raw-direct'])})")
for n, (rate, mean, pw, pf, ps) in med.items():
    print(f"{n:16} {rate:10.0f} {mean:9.1f} {pw:13.1f} {pf:13.1f} {ps:11.1f}")
r = med["raw-direct"]
for n in med:
    if n == "raw-direct":
        continue
    m = med[n]
    print(f"{n} / raw-direct: mean {m[1] / r[1]:.2f}, p99 write {m[2] / r[2]:.2f}, p99 flush {m[3] / r[3]:.2f}, p99 sum {m[4] / r[4]:.2f}")
EOF

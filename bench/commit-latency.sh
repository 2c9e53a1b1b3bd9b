#!/usr/bin/env bash
# bench/commit-latency.sh [reps] [seconds] — a database commit at QD1: one 4 KiB random
# write followed by a flush, over and over, against the raw file and ferrovol in one run.
#
#   raw-direct   fio io_uring, O_DIRECT, on a 1 GiB file next to the pool, `fdatasync`
#                after every write (fio --fdatasync=1)
#   ferrovol     fio's nbd engine on a volume whose 1 GiB working set is written, an
#                NBD_CMD_FLUSH after every write (fio --fsync=1); every write
#                overwrites a mapped block, as a database's data file does
#   ferrovol-alloc  the same on a fresh volume: each write allocates, so each flush
#                also commits a metadata log record (informative; a database file is
#                usually preallocated)
#   qemu-nbd-dir the peer in ferrovol's class: qemu-nbd --cache=none --aio=native on a
#                1 GiB raw file next to the pool, written first
#   nbdkit-memory  nbdkit's memory plugin: no disk at all (its flush does nothing), so
#                its commit is two NBD round trips, the floor any NBD server has here
#
# fio reports the write and the flush latency apart (it keeps no per-commit log), so
# the script prints, per job: commits per second and the mean commit latency (1/rate,
# exact), and the p99 of the write, of the flush, and their sum (at least the p99 of a
# commit). Then the ratios to raw-direct. Runs are interleaved per repetition.
# Env: WORK (default ~/.cache/ferrovol-bench), PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SECS=${2:-10}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10829}
. bench/common.sh
build
mkdir -p "$WORK"
trap 'stop_server; kill $QPID $MPID 2>/dev/null || true; rm -rf "$WORK/commit" "$WORK/commit-raw.img" "$WORK/commit-qemu.img"' EXIT
rm -rf "$WORK/commit"
start_server "$WORK/commit" "$PORT" --pool-size 8GiB
"$BIN" --data-dir "$WORK/commit" volume create db --size 2GiB >/dev/null
U=nbd://127.0.0.1:$PORT
fio --name=precond --ioengine=nbd --uri=$U/db --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null
for f in commit-raw.img commit-qemu.img; do
  fio --name=precond --filename="$WORK/$f" --ioengine=io_uring --direct=1 --rw=write --bs=1M \
    --iodepth=8 --size=1G >/dev/null
done
qemu-nbd -f raw --cache=none --aio=native -t -p $((PORT + 1)) "$WORK/commit-qemu.img" &
QPID=$!
nbdkit -f -p $((PORT + 2)) --exit-with-parent memory 1G &
MPID=$!
sleep 1

# job NAME fio-args... -> "NAME commits/s mean_us p99_write_us p99_flush_us"
job() {
  local name=$1; shift
  fio --name="$name" --rw=randwrite --bs=4k --iodepth=1 --size=1G --runtime="$SECS" --time_based \
    --output-format=json "$@" | sed -n '/^{/,$p' | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
w, s = j["write"], j["sync"]
p = lambda d: d["percentile"]["99.000000"] / 1000
print(sys.argv[1], round(w["iops"]), round(1e6 / w["iops"], 1), round(p(w["clat_ns"]), 1), round(p(s["lat_ns"]), 1))
' "$name"
}

OUT=$(mktemp)
for rep in $(seq "$REPS"); do
  job raw-direct --filename="$WORK/commit-raw.img" --ioengine=io_uring --direct=1 --fdatasync=1 | tee -a "$OUT"
  job ferrovol --ioengine=nbd --uri=$U/db --fsync=1 | tee -a "$OUT"
  "$BIN" --data-dir "$WORK/commit" volume delete fresh >/dev/null 2>&1 || true
  "$BIN" --data-dir "$WORK/commit" volume create fresh --size 2GiB >/dev/null
  job ferrovol-alloc --ioengine=nbd --uri=$U/fresh --fsync=1 | tee -a "$OUT"
  job qemu-nbd-dir --ioengine=nbd --uri=nbd://127.0.0.1:$((PORT + 1))/ --fsync=1 | tee -a "$OUT"
  job nbdkit-memory --ioengine=nbd --uri=nbd://127.0.0.1:$((PORT + 2))/ --fsync=1 | tee -a "$OUT"
done
/usr/bin/python3 - "$OUT" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rate, mean, pw, pf = line.split()
    rows.setdefault(name, []).append((float(rate), float(mean), float(pw), float(pf)))
med = {n: [statistics.median(c) for c in zip(*v)] for n, v in rows.items()}
print(f"\n{'job':16} {'commits/s':>10} {'mean µs':>9} {'p99 write':>10} {'p99 flush':>10} {'p99 sum':>9}  (medians of {len(rows['raw-direct'])})")
for n, (rate, mean, pw, pf) in med.items():
    print(f"{n:16} {rate:10.0f} {mean:9.1f} {pw:10.1f} {pf:10.1f} {pw + pf:9.1f}")
r = med["raw-direct"]
for n in ("ferrovol", "ferrovol-alloc", "qemu-nbd-dir", "nbdkit-memory"):
    m = med[n]
    print(f"{n} / raw-direct: mean {m[1] / r[1]:.2f}, p99 write {m[2] / r[2]:.2f}, p99 flush {m[3] / r[3]:.2f}, p99 sum {(m[2] + m[3]) / (r[2] + r[3]):.2f}")
EOF
rm -f "$OUT"

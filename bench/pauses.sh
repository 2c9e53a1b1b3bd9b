#!/usr/bin/env bash
# bench/pauses.sh [seconds] — where 4 KiB writes at QD32 wait: fio's nbd engine logs
# every completion, and for each job this prints the longest gap between two
# completions, the p99 and maximum latency, and the server's commit and checkpoint
# costs over the job (its metrics: cycles, the longest commit, checkpoints, the longest,
# and the longest a checkpoint held the maps and the allocator). Jobs, each SECONDS
# long (default 60):
#   overwrite    random writes over 1 GiB of written data (nothing to log)
#   snapshot     the same, with a snapshot taken at a third of the job and deleted at
#                two thirds (copy on write, then frees)
#   allocating   random writes over a fresh 4 GiB volume (every first write to a unit
#                maps it: commits, and checkpoints as the log fills)
# With MAPPED (fio size syntax, e.g. 100g), a volume `bulk` with MAPPED bytes mapped is
# made first (one 4 KiB block written in every 64 KiB unit, as bench/memory.sh does:
# the disk holds a sixteenth of it), so that every job runs on a pool whose mapping
# holds that much more, and its checkpoints are those of such a pool.
# Per job it also prints, from the server's --request-timing histograms, the writes
# slower than 41 ms by stage (receive, serve, reply) and the bucket of the slowest;
# how late the data-plane thread ran its 10 ms tick (busy, blocked, or not given its
# CPU); the share of the server's CPUs the hypervisor took (steal) and softirqs used;
# and when the gaps over 40 ms came.
# Env: MAPPED, WORK, PORT, SERVER_CPUS and CLIENT_CPUS (taskset lists).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10859}
MPORT=$((PORT + 1))
. bench/common.sh
build
D=$WORK/pauses
rm -rf "$D"
trap 'stop_server; rm -rf "$D" "$D.lat"*' EXIT
MAPPED=${MAPPED:-0}
mapped=$(/usr/bin/python3 -c "
s='$MAPPED'.lower(); m={'k':2**10,'m':2**20,'g':2**30,'t':2**40}
print(int(float(s[:-1])*m[s[-1]]) if s[-1] in m else int(s))")
start_server "$D" "$PORT" --pool-size $((8 * 2**30 + mapped * 17 / 16)) --metrics-listen "127.0.0.1:$MPORT" \
  --request-timing
F="$BIN --data-dir $D"
CLIENT=${CLIENT_CPUS:+taskset -c $CLIENT_CPUS}
if [ "$mapped" -gt 0 ]; then
  $F volume create bulk --size "$mapped" >/dev/null
  began=$(date +%s)
  $CLIENT fio --name=map --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/bulk" --rw=write --bs=4k --iodepth=32 \
    --zero_buffers --zonemode=strided --zonesize=4k --zonerange=64k --size="$mapped" --io_size=$((mapped / 16)) \
    --output=/dev/null
  echo "mapped $MAPPED in volume bulk in $(($(date +%s) - began)) s"
fi
$F volume create w --size 2GiB >/dev/null
$F volume create fresh --size 4GiB >/dev/null
$CLIENT fio --name=pre --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/w" --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null
metrics() {
  curl -s "http://127.0.0.1:$MPORT/metrics" |
    grep -E '^ferrovol_(pool_(commit|checkpoint)|nbd_request_stage_seconds_(bucket|count)\{.*command="write"|dataplane_lag)' |
    sort
}
job() { # job NAME VOLUME SIZE [during...]
  local name=$1 vol=$2 size=$3; shift 3
  local before c0; before=$(metrics); c0=$(cpu_times)
  rm -f "$D.lat"*
  $CLIENT fio --name="$name" --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$vol" --bs=4k --iodepth=32 \
    --rw=randwrite --size="$size" --time_based --runtime="$SECS" --write_lat_log="$D.lat" \
    --log_avg_msec=0 >/dev/null &
  local fio=$!
  "$@"
  wait $fio
  local after c1; after=$(metrics); c1=$(cpu_times)
  /usr/bin/python3 - "$name" "$D.lat_lat.1.log" <<'PY' "$before" "$after"
import sys
name, path, before, after = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
t, lat = [], []
for line in open(path):
    f = line.split(',')
    t.append(int(f[0])); lat.append(int(f[1]))
t.sort(); lat.sort()
gap = max((b - a for a, b in zip(t, t[1:])), default=0)
p99 = lat[int(len(lat) * 0.99)] / 1e6 if lat else 0
m = lambda s: {l.split()[0]: float(l.split()[1]) for l in s.splitlines() if l and not l.startswith('#')}
b, a = m(before), m(after)
d = lambda k: a.get(k, 0) - b.get(k, 0)
print(f"{name:11} IOPS {len(t) / (t[-1] / 1000):8.0f}  longest gap {gap:4d} ms  p99 {p99:6.2f} ms  max {lat[-1] / 1e6:7.1f} ms  "
      f"commits {d('ferrovol_pool_commits_total'):5.0f} (longest so far {a.get('ferrovol_pool_commit_max_seconds', 0) * 1000:.0f} ms)  "
      f"checkpoints {d('ferrovol_pool_checkpoints_total'):3.0f} (longest so far {a.get('ferrovol_pool_checkpoint_max_seconds', 0) * 1000:.0f} ms, "
      f"held {a.get('ferrovol_pool_checkpoint_hold_max_seconds', 0) * 1000:.1f} ms)")
# Where the slow writes waited: per stage (the server's --request-timing histograms),
# the writes of this job slower than 41 ms and the bucket its slowest reached; and how
# late the data-plane thread ran its 10 ms tick (busy or blocked).
def buckets(name, *labels):
    out = {}
    for k in set(a) | set(b):
        if k.startswith(name + '{') and 'le="' in k and all(l in k for l in labels):
            le = k.split('le="')[1].split('"')[0]
            out[float('inf') if le == '+Inf' else float(le)] = d(k)
    return out
def tail(name, *labels):
    bs = buckets(name, *labels)
    if not bs:
        return "n/a"
    total = bs.get(float('inf'), 0)
    fast = max((v for le, v in bs.items() if le <= 0.041), default=0)
    top = min((le for le, v in bs.items() if v >= total), default=0)
    return f"{total - fast:.0f} over 41 ms, slowest <= {top * 1000:.1f} ms"
stages = "  ".join(
    f"{st}: " + tail('ferrovol_nbd_request_stage_seconds_bucket', 'command="write"', f'stage="{st}"')
    for st in ("receive", "serve", "reply"))
print(f"            writes by stage: {stages}")
print(f"            data-plane tick late: {tail('ferrovol_dataplane_lag_seconds_bucket')}"
      f" (latest so far {a.get('ferrovol_dataplane_lag_max_seconds', 0) * 1000:.1f} ms)")
gaps = [(round(x / 1000, 1), y - x) for x, y in zip(t, t[1:]) if y - x > 40]
print(f"            gaps over 40 ms (s into the job, ms): {gaps[:20]}")
PY
  echo "            $(cpu_shares "$c0" "$c1")"
}
snap() {
  sleep $((SECS / 3)); $F snapshot create w s >/dev/null
  sleep $((SECS / 3)); $F snapshot delete w s >/dev/null
}
job overwrite w 1g true
job snapshot w 1g snap
job allocating fresh 4g true

#!/usr/bin/env bash
# bench/queue.sh [seconds] [jobs] — where a request at queue depth 32 spends its time,
# and how deep the disk's queue is kept: ferrovol against fio on the raw file, one run.
#
# For each job (default "rr4k-qd32 rw4k-qd32", 4 KiB random reads or writes at QD32 over
# a 1 GiB working set, SECONDS long, default 10; also rr4k-qd1), once through ferrovol (fio's nbd
# engine; `serve --request-timing`) and once with fio's io_uring engine straight on a
# 1 GiB file of the same file system (O_DIRECT, the disk's limit), it prints:
#   - IOPS and the client's mean latency;
#   - the mean time of each server stage (receive: header read to start, serve: start to
#     the volume's answer, reply: answer to the reply flushed), and "outside": the
#     client's mean latency less the three, the time a request spends in the client,
#     its socket and the kernel before the server reads its header or after its reply;
#   - by Little's law (occupancy = IOPS × mean time), how many of the client's
#     requests are in each stage on average;
#   - the disk's side, from /proc/diskstats of the device under WORK: its I/O rate, its
#     mean time per I/O, and the mean number of I/Os in its queue (weighted busy time
#     over elapsed time), against the same figures for fio alone on the file;
#   - how the server's CPUs (SERVER_CPUS, or all) spent the job: steal, softirq,
#     system, user, idle; and, when CLIENT_CPUS is set, fio's CPUs.
# Env: SERVE_ARGS (extra `serve` flags), WORK, PORT, SERVER_CPUS and CLIENT_CPUS (taskset lists), DEV (the diskstats name
# of the disk; default the device of WORK's file system).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
JOBS=${2:-"rr4k-qd32 rw4k-qd32"}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10869}
MPORT=$((PORT + 1))
. bench/common.sh
build
D=$WORK/queue
rm -rf "$D" "$WORK/queue.raw"
mkdir -p "$WORK"
PID=
trap '[ -z "$PID" ] || stop_server; rm -rf "$D" "$WORK/queue.raw" "$WORK/queue.json"' EXIT
DEV=${DEV:-$(basename "$(df --output=source "$WORK" | tail -1)")}
grep -q " $DEV " /proc/diskstats || { echo "no /proc/diskstats line for $DEV; set DEV" >&2; exit 2; }
CLIENT=${CLIENT_CPUS:+taskset -c $CLIENT_CPUS}
# shellcheck disable=SC2086 # SERVE_ARGS: flags split on spaces
start_server "$D" "$PORT" --pool-size 4GiB --metrics-listen "127.0.0.1:$MPORT" --request-timing ${SERVE_ARGS:-}
"$BIN" --data-dir "$D" volume create bench --size 2GiB >/dev/null
URI=nbd://127.0.0.1:$PORT/bench
$CLIENT fio --name=pre --ioengine=nbd --uri="$URI" --bs=1M --iodepth=8 --rw=write --size=1g >/dev/null
$CLIENT fio --name=pre --ioengine=io_uring --direct=1 --filename="$WORK/queue.raw" --bs=1M --iodepth=8 \
  --rw=write --size=1g >/dev/null
snap() { # the disk's counters and the server's stage sums and counts, one line each
  awk -v d="$DEV" '$3 == d {print "disk", $4, $7, $8, $11, $14; exit}' /proc/diskstats
  date +%s.%N | sed 's/^/clock /'
  if [ "$1" = nbd ]; then
    curl -s "http://127.0.0.1:$MPORT/metrics" |
      grep -E '^ferrovol_nbd_request_stage_seconds_(sum|count)\{' || true
  fi
}
for job in $JOBS; do
  case "$job" in
    rr4k-qd1) RW=randread QD=1 ;;
    rr4k-qd32) RW=randread QD=32 ;;
    rw4k-qd32) RW=randwrite QD=32 ;;
    *) echo "unknown job $job (rr4k-qd1, rr4k-qd32, rw4k-qd32)" >&2; exit 2 ;;
  esac
  for side in ferrovol raw-direct; do
    if [ $side = ferrovol ]; then
      engine=(--ioengine=nbd --uri="$URI"); kind=nbd
    else
      engine=(--ioengine=io_uring --direct=1 --filename="$WORK/queue.raw"); kind=raw
    fi
    before=$(snap $kind); c0=$(cpu_times); k0=$(SERVER_CPUS=${CLIENT_CPUS:-} cpu_times)
    $CLIENT fio --name="$job" "${engine[@]}" --rw=$RW --bs=4k --iodepth=$QD --size=1g --time_based \
      --runtime="$SECS" --output-format=json | sed -n '/^{/,$p' > "$WORK/queue.json"
    after=$(snap $kind); c1=$(cpu_times); k1=$(SERVER_CPUS=${CLIENT_CPUS:-} cpu_times)
    /usr/bin/python3 - "$job" "$side" "$RW" "$WORK/queue.json" "$before" "$after" <<'PY'
import json, re, sys
job, side, rw, path, before, after = sys.argv[1:]
io = json.load(open(path))["jobs"][0]["read" if rw == "randread" else "write"]
iops, lat = io["iops"], io["lat_ns"]["mean"] / 1e3
def parse(text):
    out = {}
    for line in text.splitlines():
        f = line.split()
        if f[0] == "disk": out["disk"] = [int(x) for x in f[1:]]
        elif f[0] == "clock": out["clock"] = float(f[1])
        else:
            m = re.match(r'\S+_(sum|count)\{command="(\w+)",stage="(\w+)"\} (\S+)', line)
            if m: out[(m[1], m[2], m[3])] = float(m[4])
    return out
b, a = parse(before), parse(after)
el = a["clock"] - b["clock"]
# diskstats: reads done, ms reading, writes done, ms writing, weighted ms in queue
dr, dmr, dw, dmw, dq = (x - y for x, y in zip(a["disk"], b["disk"]))
ops, ms = (dr, dmr) if rw == "randread" else (dw, dmw)
print(f"{job:9} {side:10} {iops:8.0f} IOPS, client mean {lat:7.1f} us")
cmd = "read" if rw == "randread" else "write"
stages = {}
for st in ("receive", "serve", "reply"):
    n = a.get(("count", cmd, st), 0) - b.get(("count", cmd, st), 0)
    if n: stages[st] = (a[("sum", cmd, st)] - b[("sum", cmd, st)]) / n * 1e6
if stages:
    stages["outside"] = lat - sum(stages.values())
    print("   " + ", ".join(f"{k} {v:6.1f} us ({iops * v / 1e6:4.1f} in it)" for k, v in stages.items()))
print(f"   disk: {ops / el:8.0f} I/O per s, {ms / ops * 1e3 if ops else 0:6.1f} us each, "
      f"{dq / (el * 1e3):5.1f} in its queue on average")
PY
    echo "   $(cpu_shares "$c0" "$c1")"
    [ -z "${CLIENT_CPUS:-}" ] || echo "   $(cpu_shares "$k0" "$k1" | sed 's/^server/client/')"
  done
done

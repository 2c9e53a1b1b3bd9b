#!/usr/bin/env bash
# bench/offcpu.sh [seconds] — what the data-plane thread does while a 4 KiB random write
# load at QD32 runs, and what the machine takes from it (issue 22's "where requests
# wait"). Starts the release build pinned to SERVER_CPUS (default 1), writes a 1 GiB
# working set, runs fio's nbd engine pinned to CLIENT_CPUS (default 0) for SECONDS
# (default 20) and meanwhile, from CLIENT_CPUS, samples the `ferrovol-nbd` thread every
# ~2 ms: its state (R running or runnable, S sleeping, D blocked) and, when not R, its
# kernel stack (/proc/PID/task/TID/stack, needs root). Prints the states, the stacks
# seen, the longest stretches not R, the thread's CPU and run-queue wait (schedstat),
# and the server CPUs' steal and softirq shares (/proc/stat).
# Then, for a baseline without ferrovol, a plain 10 ms ticker pinned to SERVER_CPUS
# while fio writes to a file on the same file system (direct I/O, io_uring): how late
# a thread with nothing to do is run there.
# With SNAP=1 a snapshot of the volume is taken 2 s in and deleted 10 s later.
# Env: WORK, PORT, SERVER_CPUS, CLIENT_CPUS, SNAP.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-20}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10871}
SERVER_CPUS=${SERVER_CPUS:-1}
CLIENT_CPUS=${CLIENT_CPUS:-0}
. bench/common.sh
build
D=$WORK/offcpu
rm -rf "$D"
trap 'stop_server; rm -rf "$D" "$WORK/offcpu.raw"' EXIT
start_server "$D" "$PORT" --pool-size 4GiB
F="$BIN --data-dir $D"
$F volume create w --size 2GiB >/dev/null
C="taskset -c $CLIENT_CPUS"
$C fio --name=pre --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/w" --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null
TID=$(grep -lx ferrovol-nbd /proc/"$PID"/task/*/comm | head -1 | cut -d/ -f5)
c0=$(cpu_times)
s0=$(cat /proc/"$PID"/task/"$TID"/schedstat)
$C fio --name=w --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/w" --bs=4k --iodepth=32 --rw=randwrite --size=1g \
  --time_based --runtime="$SECS" --output="$D.fio" &
FIO=$!
if [ -n "${SNAP:-}" ]; then (sleep 2; $F snapshot create w s >/dev/null; sleep 10; $F snapshot delete w s >/dev/null) & fi
$C /usr/bin/python3 - "$PID" "$TID" "$SECS" <<'PY'
import collections, sys, time
pid, tid, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
states, stacks, runs, cur = collections.Counter(), collections.Counter(), [], 0
end = time.time() + secs
while time.time() < end:
    try:
        st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(')', 1)[1].split()[0]
        stack = open(f"/proc/{pid}/task/{tid}/stack").read()
    except OSError:
        break
    states[st] += 1
    if st != 'R':
        stacks[st + " " + ";".join(l.split()[1].split('+')[0] for l in stack.strip().splitlines()[:6])] += 1
        cur += 1
    elif cur:
        runs.append(cur); cur = 0
    time.sleep(0.002)
n = sum(states.values())
print("thread states (share of samples):", {k: f"{100 * v / n:.0f}%" for k, v in states.items()})
print("longest stretches not R (samples, about 2.5 ms each):", sorted(runs)[-5:])
for s, k in stacks.most_common(5):
    print(f"  {k:6} {s}")
PY
wait $FIO
s1=$(cat /proc/"$PID"/task/"$TID"/schedstat)
cpu_shares "$c0" "$(cpu_times)"
read -r on0 wait0 _ <<<"$s0"; read -r on1 wait1 _ <<<"$s1"
echo "ferrovol-nbd: on CPU $(((on1 - on0) / 1000000)) ms, runnable waiting $(((wait1 - wait0) / 1000000)) ms of ${SECS} s"
grep -E "IOPS|clat \(" "$D.fio" | sed 's/^ */fio: /'
stop_server
echo "baseline without ferrovol: a 10 ms ticker on CPUs $SERVER_CPUS while fio writes direct to a file"
c0=$(cpu_times)
taskset -c "$SERVER_CPUS" /usr/bin/python3 - "$SECS" <<'PY' &
import sys, time
end = time.time() + float(sys.argv[1]); late = []; nxt = time.monotonic() + 0.01
while time.time() < end:
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
    late.append(time.monotonic() - nxt); nxt = time.monotonic() + 0.01
late.sort()
print(f"ticker: late p50 {late[len(late) // 2] * 1e3:.1f} ms  p99 {late[int(len(late) * .99)] * 1e3:.1f} ms  "
      f"max {late[-1] * 1e3:.1f} ms  ticks over 40 ms late: {sum(1 for x in late if x > 0.04)}")
PY
$C fio --name=raw --filename="$WORK/offcpu.raw" --size=1g --rw=randwrite --bs=4k --iodepth=32 --ioengine=io_uring \
  --direct=1 --runtime="$SECS" --time_based 2>&1 | grep -E "IOPS|clat \(" | sed 's/^ */raw fio: /'
wait
cpu_shares "$c0" "$(cpu_times)"

# bench/common.sh — sourced by the bench scripts: build the release binary and start
# or stop one `ferrovol serve` on a data dir.
#
#   build                          cargo build --release; sets BIN (honours CARGO_TARGET_DIR)
#   start_server DIR PORT [ARGS]   serve DIR on 127.0.0.1:PORT (extra serve ARGS, e.g.
#                                  --pool-size; pinned with taskset to $SERVER_CPUS
#                                  when set); waits until the pool is open (a
#                                  `pool status` answers) and the NBD port accepts;
#                                  sets PID; the log goes to DIR.log
#   stop_server                    SIGTERM, then wait for a clean exit
#   rss_kib PID                    resident set size of PID, KiB (VmRSS)
#   peak_rss_kib PID               peak resident set size of PID, KiB (VmHWM)

build() {
  cargo build --release --bin ferrovol >&2
  BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/ferrovol
}

start_server() {
  local dir=$1 port=$2; shift 2
  mkdir -p "$dir"
  ${SERVER_CPUS:+taskset -c "$SERVER_CPUS"} "$BIN" --data-dir "$dir" serve --listen "127.0.0.1:$port" "$@" \
    >/dev/null 2>"$dir.log" &
  PID=$!
  for _ in $(seq 300); do
    if [ -S "$dir/ferrovol.sock" ] && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null &&
      "$BIN" --data-dir "$dir" pool status >/dev/null 2>&1; then return 0; fi
    kill -0 "$PID" 2>/dev/null || { echo "ferrovol serve exited; see $dir.log" >&2; return 1; }
    sleep 0.1
  done
  echo "ferrovol serve did not start in 30 s; see $dir.log" >&2
  return 1
}

stop_server() {
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
}

rss_kib() {
  awk '/^VmRSS:/ {print $2}' "/proc/$1/status"
}

peak_rss_kib() {
  awk '/^VmHWM:/ {print $2}' "/proc/$1/status"
}

# cpu_times: the /proc/stat times (user nice system idle iowait irq softirq steal)
# summed over the CPUs of SERVER_CPUS (a taskset list), or over all CPUs.
cpu_times() {
  /usr/bin/python3 - "${SERVER_CPUS:-}" <<'PY'
import sys
want = set()
for part in filter(None, sys.argv[1].split(',')):
    lo, _, hi = part.partition('-'); want |= set(range(int(lo), int(hi or lo) + 1))
tot = [0] * 8
for line in open('/proc/stat'):
    f = line.split()
    if f[0].startswith('cpu') and f[0] != 'cpu' and (not want or int(f[0][3:]) in want):
        tot = [a + int(b) for a, b in zip(tot, f[1:9])]
print(*tot)
PY
}

# cpu_shares BEFORE AFTER: between two cpu_times outputs, the shares of those CPUs'
# time the hypervisor took (steal), softirqs, the kernel and user space used, and idle.
cpu_shares() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import sys
d = [int(a) - int(b) for a, b in zip(sys.argv[2].split(), sys.argv[1].split())]
n = max(1, sum(d))
print(f"server CPUs: steal {100 * d[7] / n:.0f}%  softirq {100 * d[6] / n:.0f}%  system {100 * d[2] / n:.0f}%  "
      f"user {100 * d[0] / n:.0f}%  idle {100 * (d[3] + d[4]) / n:.0f}%")
PY
}

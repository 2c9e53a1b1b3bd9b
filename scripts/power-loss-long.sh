#!/usr/bin/env bash
# scripts/power-loss-long.sh [MINUTES] — the power-loss simulators' long mode: cut
# points for MINUTES minutes (default 60) of each simulator, half with the fixed seed and
# half with a random one (printed), for the single-threaded workloads
# (tests/power_loss.rs) and the concurrent ones (tests/power_loss_concurrent.rs: two data
# threads and a management thread, each new workload a new schedule), the two side by
# side. POWER_LOSS_CUTS=N instead runs N cut points per seed, however long they take.
# The test command runs 500 and 300 per seed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${POWER_LOSS_CUTS:-}" ]; then export POWER_LOSS_MINUTES=${1:-60}; fi
# The long profile (.config/nextest.toml) lets each test run up to 8 hours; what each
# ran (seeds, cut points, time) is printed at its end, and a failure of the concurrent
# one keeps its evidence in a directory it names.
cargo nextest run -p storage-engine --test power_loss --test power_loss_concurrent \
  --profile long --success-output final --failure-output final

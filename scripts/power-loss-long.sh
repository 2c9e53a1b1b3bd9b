#!/usr/bin/env bash
# scripts/power-loss-long.sh [CUTS] — the power-loss simulators' long mode: CUTS cut
# points (default 100,000) with the fixed seed and as many with a random one (printed),
# for the single-threaded workloads (tests/power_loss.rs) and for the concurrent ones
# (tests/power_loss_concurrent.rs: two data threads and a management thread, each new
# workload a new schedule). Takes hours; the test command runs 500 and 300 per seed.
set -euo pipefail
cd "$(dirname "$0")/.."
export POWER_LOSS_CUTS=${1:-100000}
# The long profile (.config/nextest.toml) lets each test run up to 8 hours; the two
# run side by side, and what each ran (seeds, cut points, time) is printed at its end.
cargo nextest run -p storage-engine --test power_loss --test power_loss_concurrent \
  --profile long --success-output final --failure-output final

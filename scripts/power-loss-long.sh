#!/usr/bin/env bash
# scripts/power-loss-long.sh [CUTS] — the power-loss simulator's long mode: CUTS cut
# points (default 100,000) with the fixed seed and as many with a random one (printed).
# Takes tens of minutes; the test command runs 500 of each.
set -euo pipefail
cd "$(dirname "$0")/.."
POWER_LOSS_CUTS=${1:-100000} cargo nextest run -p storage-engine --test power_loss --no-capture --slow-timeout 7200s

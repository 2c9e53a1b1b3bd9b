#!/usr/bin/env bash
# Runs every test of ferrovol: installs what the tests need, builds, and runs the
# whole workspace's suite (engine property tests, NBD protocol tests, integration
# tests against qemu-io/qemu-img/nbdinfo/nbdcopy/nbdsh/fio, kill -9 crash tests, the
# shared NBD interoperability checklist, and the Linux kernel NBD client in a VM).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
export PATH=/usr/bin:$PATH   # nbdsh needs Debian's python3 (libnbd binding)
cargo build --workspace --all-targets
cargo nextest run --workspace --profile ci --no-fail-fast "$@"

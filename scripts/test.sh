#!/usr/bin/env bash
# Runs every test of ferrovol: installs what the tests need, builds, and runs the
# whole workspace's suite (engine property tests, NBD protocol tests, integration
# tests against qemu-io/qemu-img/nbdinfo/nbdcopy/nbdsh/fio, kill -9 crash tests, the
# shared NBD interoperability checklist, and the Linux kernel NBD client in a VM), then
# the deterministic concurrency checks of the engine's sharing state machine and of its
# io_uring submitter hand-over (shuttle, and loom for its fences),
# and the Kubernetes manifests checked offline (scripts/validate-k8s.sh).
# Formatting (rustfmt) and lints (clippy, warnings as errors) are checked first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
export PATH=/usr/bin:$PATH   # nbdsh needs Debian's python3 (libnbd binding)
cargo fmt --all -- --check
# The server with every frontend: the ublk one is a feature (libublk needs libclang to
# build, which install-test-deps.sh installs).
FEATURES=(--features ferrovol/ublk)
cargo clippy --workspace --all-targets "${FEATURES[@]}" -- -D warnings
cargo build --workspace --all-targets "${FEATURES[@]}"
status=0
# The Kubernetes manifests, offline (schemas, flags against the binary just built).
bash scripts/validate-k8s.sh target/debug/ferrovol || status=$?
cargo nextest run --workspace "${FEATURES[@]}" --profile ci --no-fail-fast "$@" || status=$?
# The deterministic concurrency checks of the sharing state machine and of the io_uring
# submitter's hand-over: the engine built on shuttle's atomics (a build of its own),
# explored by shuttle's schedulers.
cargo nextest run -p storage-engine --features shuttle --test sharing_model --lib --profile ci --no-fail-fast \
  -E 'binary(sharing_model) | test(/submit_model/)' || status=$?
# The memory ordering of that hand-over (its fences): the engine's lib tests built on
# loom's atomics (a build of its own), explored by loom's checker.
cargo nextest run -p storage-engine --features loom --lib --profile ci --no-fail-fast \
  -E 'test(/fence_model/)' || status=$?
exit $status

#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (idempotent):
#   Debian packages: the NBD peers the tests drive (qemu-utils: qemu-io, qemu-img;
#   libnbd-bin: nbdinfo, nbdcopy, nbdsh; python3-libnbd; fio with its nbd engine;
#   nbdkit and nbd-server for the peer comparison; python3-venv for the manifests'
#   validator; libclang-dev, which the ublk frontend's libublk needs to build),
#   cargo-nextest, rustfmt and clippy,
#   and the kernel VM of ../shared/tools/nbd-vm (a stock Debian kernel with nbd.ko,
#   booted in QEMU).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
PKGS=(qemu-utils libnbd-bin python3-libnbd fio nbdkit nbd-server python3-venv libclang-dev)
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo-nextest >/dev/null || cargo install --locked cargo-nextest
# rustfmt and clippy check the code before the tests (part of rustup's default profile).
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
VM=../shared/tools/nbd-vm/setup.sh
if [ -f "$VM" ]; then
  $SUDO bash "$VM" >/tmp/ferrovol-nbd-vm-setup.log 2>&1 || { cat /tmp/ferrovol-nbd-vm-setup.log; exit 1; }
else
  echo "warning: $VM not found; the kernel NBD test will fail" >&2
fi

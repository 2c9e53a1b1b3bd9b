#!/usr/bin/env bash
# Checks deploy/kubernetes offline (tests/k8s/validate.py): the Kubernetes API schemas,
# the snapshot API's fields, the kustomization, every flag against the ferrovol binary
# given (default target/debug/ferrovol) or the sidecars' pinned lists, the node plugin's
# mounts. Installs the validator (kubernetes-validate, from PyPI, pinned) in a venv of
# its own under ~/.cache.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/debug/ferrovol}
VENV=${FERROVOL_K8S_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrovol-k8s-venv}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "kubernetes-validate==1.37.0" "PyYAML==6.0.2"
fi
exec "$VENV/bin/python" tests/k8s/validate.py deploy/kubernetes "$BIN"

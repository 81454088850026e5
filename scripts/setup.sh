#!/usr/bin/env bash
# Creates .venv and installs the project. Keeps an existing torch; otherwise installs the
# pinned CPU build (torch==2.13.0, on local disk here) so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install -q -e ".[hf,dev]"

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
# The browser tests of `autoplan report` (tests/review/test_report.py) open its pages in
# Debian's chromium. Installed here when missing and this user can (root, apt-get); elsewhere those
# tests are skipped and say why. AUTOPLAN_NO_BROWSER=1 skips this step.
if [ -z "${AUTOPLAN_NO_BROWSER:-}" ] && ! command -v chromium >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium (Debian package) for the browser tests" >&2
  { apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; } \
    || echo "setup: chromium could not be installed; the browser tests in tests/review/test_report.py will be skipped" >&2
fi

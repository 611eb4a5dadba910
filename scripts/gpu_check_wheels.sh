#!/usr/bin/env bash
# Fetch, where pip reaches PyPI, the wheels scripts/gpu_check.sh needs on a GPU machine that
# has Python 3.12, torch, triton and numpy but not the rest of PageKV's dependencies: the
# engine's import chain adds cbor2 (the hash chain's CBOR encoding), the tests need pytest. They land in .whl/
# (.gitignore keeps it out of git); gpu_check.sh installs them into a
# private directory before it runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
mkdir -p "$ROOT/.whl"
for spec in "cbor2>=5.6" "pytest>=8" "pluggy>=1.5" "iniconfig>=2" "packaging>=24"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$ROOT/.whl" "$spec"
done
ls -l "$ROOT/.whl"

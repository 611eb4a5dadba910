#!/usr/bin/env bash
# The GPU check (issue #17): on a CUDA machine, the kernel tests and the GPU benchmarks in
# under 8 minutes, their output in a folder.
#
#   scripts/gpu_check.sh [OUT]        # OUT default: $OUT, else ./gpu-check
#
# It needs Python >= 3.11 with torch (CUDA), triton and numpy — what the GPU machines here
# carry, with pytest — and nothing else of the project's dependencies: the paths it runs (the attention
# kernels, the KV cache, the DRAM tier's copies, the memory plan, bench/attention.py and
# bench/tiers.py in --device cuda mode) import only those. Wheels it lacks can be put in .whl/
# (scripts/gpu_check_wheels.sh fetches them where pip works): they are installed into a
# private directory first. Each step has its own time limit; the summary says which failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-${OUT:-$ROOT/gpu-check}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The kernel tests' default matrix (every axis against a base case) fits the 8 minutes;
# PAGEKV_KERNEL_MATRIX=full runs the whole cross product (about 1,800 cases, most of them a
# kernel compile each: allow half an hour).
export PAGEKV_KERNEL_MATRIX="${PAGEKV_KERNEL_MATRIX:-}"
unset TRITON_INTERPRET

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pagekv-gpu-site .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/pagekv-gpu-site:$PYTHONPATH"
fi

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/device.txt" || exit 2
import platform, torch, triton
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}; "
      f"torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}")
PYEOF

status=0
: > "$OUT/summary.txt"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.txt"
  [ "$rc" -eq 0 ] || status=1
}

# Kernels and CUDA paths: every test that runs only where CUDA exists, plus the kernel suites.
step kernel_tests 270 "$PY" -m pytest -q -p no:cacheprovider tests/unit/triton \
  tests/unit/test_cuda_tiers.py
step bench_attention 120 "$PY" -m bench.attention --device cuda --quick
step bench_tiers 90 "$PY" -m bench.tiers --device cuda --lengths 2048,16384
cat "$OUT/summary.txt"
exit "$status"

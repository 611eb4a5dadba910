#!/usr/bin/env bash
# Regenerate the Python code for the PageKV gRPC contract.
#   scripts/gen_proto.sh            # in place, next to the .proto
#   scripts/gen_proto.sh OUT_DIR    # into OUT_DIR/proto/pagekv/v1/ (the freshness test uses this)
# PYTHON selects the interpreter (default: the repository's .venv, else python3).
# The proto is compiled from the repository root (-I .) so the generated grpc module imports
# its messages as `from proto.pagekv.v1 import pagekv_pb2`, which resolves wherever the
# repository root (or the installed `proto` package) is importable.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
"$PYTHON" -m grpc_tools.protoc -I . \
  --python_out="$OUT" --grpc_python_out="$OUT" \
  proto/pagekv/v1/pagekv.proto

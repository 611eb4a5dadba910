#!/usr/bin/env bash
# Regenerate the Python code for the PageKV gRPC contract.
#   scripts/gen_proto.sh            # in place, next to the .proto
#   scripts/gen_proto.sh OUT_DIR    # into OUT_DIR/proto/pagekv/v1/ (the freshness test uses this)
# PYTHON selects the interpreter (default: the repository's .venv, else python3).
# The repository's proto/ is installed as the package `pagekv.proto`, so the proto is compiled
# from a staging tree with that layout: the generated grpc module then imports its messages as
# `from pagekv.proto.pagekv.v1 import pagekv_pb2`. pagekv_pb2.pyi types the messages for mypy
# (the .py builds them at import time from a serialized descriptor, which no checker can read).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$OUT/proto/pagekv/v1"
OUT="$(cd "$OUT" && pwd)"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/src/pagekv/proto/pagekv/v1" "$STAGE/out"
cp "$ROOT/proto/pagekv/v1/pagekv.proto" "$STAGE/src/pagekv/proto/pagekv/v1/"
"$PYTHON" -m grpc_tools.protoc -I "$STAGE/src" \
  --python_out="$STAGE/out" --pyi_out="$STAGE/out" --grpc_python_out="$STAGE/out" \
  pagekv/proto/pagekv/v1/pagekv.proto
cp "$STAGE/out/pagekv/proto/pagekv/v1/"pagekv_pb2*.py "$STAGE/out/pagekv/proto/pagekv/v1/pagekv_pb2.pyi" \
  "$OUT/proto/pagekv/v1/"

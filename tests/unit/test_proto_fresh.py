"""The committed generated code must be what scripts/gen_proto.sh makes from the .proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("pagekv_pb2.py", "pagekv_pb2.pyi", "pagekv_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
                   check=True, env=env, capture_output=True, timeout=120)
    for name in GENERATED:
        fresh = (tmp_path / "proto" / "pagekv" / "v1" / name).read_bytes()
        committed = (ROOT / "proto" / "pagekv" / "v1" / name).read_bytes()
        assert fresh == committed, (
            f"proto/pagekv/v1/{name} is stale: run scripts/gen_proto.sh (make proto) "
            "and commit the result")


def test_generated_modules_import_as_a_package() -> None:
    from pagekv.proto.pagekv.v1 import pagekv_pb2, pagekv_pb2_grpc

    services = pagekv_pb2.DESCRIPTOR.services_by_name
    assert set(services) == {"Generation", "KVNode", "CacheAdmin"}
    assert services["Generation"].full_name == "pagekv.v1.Generation"
    assert hasattr(pagekv_pb2_grpc, "GenerationStub") and hasattr(pagekv_pb2_grpc, "KVNodeStub")


def test_contract_field_names() -> None:
    from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), cache_salt="s")
    assert req.WhichOneof("prompt") == "token_ids"
    # Unset and zero must be told apart where the server applies a default.
    assert not req.sampling.HasField("seed") and not req.sampling.HasField("temperature")
    req.sampling.temperature = 0.0
    assert req.sampling.HasField("temperature")
    usage = pb.Usage(prompt_tokens=10, cached_tokens=8, cached_tokens_gpu=4,
                     cached_tokens_cpu=3, cached_tokens_disk=1)
    chunk = pb.GenerateChunk(request_id="r", index=0, token_ids=[7],
                             finish_reason=pb.FINISH_REASON_STOP, usage=usage, served_by="pod-a")
    chunk.routing.candidates.add(pod_id="pod-a", cached_tokens=8, eligible=True)
    assert pb.GenerateChunk.FromString(chunk.SerializeToString()) == chunk
    stats = pb.StatsResponse(pod_id="p", hash_config=pb.HashConfig(algo="sha256"))
    stats.tiers.add(tier="CPU", used_bytes=1, capacity_bytes=2, entries=3)
    assert stats.tiers[0].tier == "CPU"

"""LoRA adapters across the fleet (issue #32), with real processes: two pods as processes on a
random Llama checkpoint saved by transformers, adapters written by peft, a real Redis, the
router in-process, gRPC and the OpenAI HTTP API with OpenAI's own client.

- the pods publish the adapters they serve; the router routes an adapter's requests to the
  pods that serve it, prices a load into a pod that would have to load it, and refuses an
  adapter no pod serves in the pods' own words (NOT_FOUND / 404);
- /v1/models lists the adapters with their base as `parent`; `model: "<adapter>"` selects it;
- an adapter loaded at run time (POST /v1/load_lora_adapter, admin token) is routed to once
  its pod publishes it; a malformed one is one clear 400 and the pod keeps serving;
- an adapter's prefix pulled from a peer gives the cold run's tokens, and never hits for
  another adapter or the base model.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.router_fixtures import pod_cluster, tokens_req

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

ADMIN = "adm-lora-7c1e"
PROMPT = [(i * 7) % 90 + 1 for i in range(70)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def fleet(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.unit.test_lora import make_adapter
    from tests.unit.test_model_hf import make_checkpoint

    run = tmp_path_factory.mktemp("lora-fleet")
    base = make_checkpoint(run / "base", "llama")
    adapters = {}
    for i, (name, targets) in enumerate((("sql", ["q_proj", "v_proj"]),
                                         ("chat", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]),
                                         ("late", ["o_proj"]))):
        path = run / f"adapter-{name}"
        adapters[name] = (make_adapter(base, path, 8, 16, targets, False, 20 + i), path)
    pod_args = ["--model", str(run / "base"), "--num-gpu-blocks", "64", "--max-model-len",
                "128", "--lease-ttl-s", "1.5", "--attention-backend", "torch",
                "--admin-token", ADMIN, "--peer-api-token", "peer-lora-3b9d"]
    pods = {"node-a": ["--lora-modules", f"sql={adapters['sql'][1]}",
                       f"chat={adapters['chat'][1]}"],
            # One slot, held by "other" (the first named): node-b must load chat to serve it.
            "node-b": ["--lora-modules", f"other={adapters['late'][1]}",
                       f"chat={adapters['chat'][1]}", "--max-loras", "1"]}
    with pod_cluster(redis_binary, run, pod_args, pods) as cluster:
        cluster.model_path = str(run / "base")
        cluster.adapters = adapters
        yield cluster


def router_for(fleet: Any, make_router: Any) -> Any:
    router = make_router(fleet.redis_url, model=fleet.model_path)
    router.wait_pods(2)
    return router


def adapter_req(ids: list[int], lora: str = "", max_tokens: int = 4) -> pb.GenerateRequest:
    req = tokens_req(ids, max_tokens=max_tokens)
    req.lora_name = lora
    return req


def peft_tokens(fleet: Any, name: str, ids: list[int], n: int = 4) -> list[int]:
    import torch

    model = fleet.adapters[name][0]
    with torch.no_grad():
        t = torch.tensor([ids])
        return model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_an_adapters_requests_go_to_the_pods_that_serve_it(fleet, make_router) -> None:
    router = router_for(fleet, make_router)
    for k in range(4):  # only node-a serves sql: every cold sql prompt goes there
        prompt = [(i * (3 + k)) % 90 + 1 for i in range(40)]
        resp = router.stub.Generate(adapter_req(prompt, "sql"), timeout=60)
        assert resp.served_by == "node-a"
        assert list(resp.completions[0].token_ids) == peft_tokens(fleet, "sql", prompt)
        # Only the adapter's pods are scored: node-b could only refuse it.
        assert [c.pod_id for c in resp.routing.candidates] == ["node-a"]
    with pytest.raises(grpc.RpcError) as at_router:
        router.stub.Generate(adapter_req(PROMPT, "nope"), timeout=30)
    with grpc.insecure_channel(fleet.pods[1].address) as ch, \
            pytest.raises(grpc.RpcError) as at_pod:
        pb_grpc.GenerationStub(ch).Generate(adapter_req(PROMPT, "nope"), timeout=30)
    assert at_router.value.code() == at_pod.value.code() == grpc.StatusCode.NOT_FOUND
    assert at_router.value.details() == at_pod.value.details()
    assert "'nope' is not loaded" in at_pod.value.details()


def test_a_pod_that_must_load_the_adapter_pays_for_it_in_the_score(fleet, make_router) -> None:
    router = router_for(fleet, make_router)
    prompt = [(i * 13) % 90 + 1 for i in range(30)]  # cold on both pods
    resp = router.stub.Generate(adapter_req(prompt, "chat"), timeout=60)
    costs = {c.pod_id: c.estimated_cost_s for c in resp.routing.candidates}
    # Both serve chat; node-a has it resident, node-b would load it first (the configured
    # 0.5 s until node-b has measured a load of its own).
    assert resp.served_by == "node-a" and costs["node-b"] - costs["node-a"] >= 0.4
    assert list(resp.completions[0].token_ids) == peft_tokens(fleet, "chat", prompt)


def test_the_openai_api_names_adapters_as_models(fleet, make_router) -> None:
    router = router_for(fleet, make_router)
    client = openai.OpenAI(base_url=router.http_url, api_key="none", timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert {"sql", "chat"} <= set(cards)
    assert cards["sql"].parent == fleet.model_path  # (the base's served name: its path here)
    out = client.completions.create(model="chat", prompt=PROMPT[:30], max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "return_token_ids": True})
    assert out.model == "chat"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "nope" in str(err.value)


def http_post(url: str, body: dict, token: str | None = ADMIN) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"}
                                             if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_an_adapter_loaded_at_run_time_is_routed_to(fleet, make_router, tmp_path: Path
                                                    ) -> None:
    router = router_for(fleet, make_router)
    pod_b = fleet.pods[1]
    url = f"http://127.0.0.1:{pod_b.http_port}/v1"
    path = str(fleet.adapters["late"][1])
    assert http_post(f"{url}/load_lora_adapter", {"lora_name": "late", "lora_path": path},
                     token=None)[0] == 401  # the admin token is required
    bad = tmp_path / "bad-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8, "use_dora": true}')
    status, body = http_post(f"{url}/load_lora_adapter", {"lora_name": "bad",
                                                          "lora_path": str(bad)})
    assert status == 400 and "use_dora not supported" in body["error"]["message"]
    status, body = http_post(f"{url}/load_lora_adapter", {"lora_name": "late",
                                                          "lora_path": path})
    assert status == 200, body
    deadline = time.monotonic() + 10
    while True:  # the router learns it from node-b's registration
        try:
            resp = router.stub.Generate(adapter_req(PROMPT[:40], "late"), timeout=60)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline
            time.sleep(0.2)
    assert resp.served_by == "node-b"
    assert list(resp.completions[0].token_ids) == peft_tokens(fleet, "late", PROMPT[:40])
    status, _ = http_post(f"{url}/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200
    assert http_post(f"{url}/unload_lora_adapter", {"lora_name": "late"})[0] == 404


def test_an_adapters_pulled_prefix_gives_cold_tokens_and_stays_its_own(fleet) -> None:
    a, b = fleet.pods
    cold = peft_tokens(fleet, "chat", PROMPT)
    gen_a = pb_grpc.GenerationStub(grpc.insecure_channel(a.address))
    gen_b = pb_grpc.GenerationStub(grpc.insecure_channel(b.address))
    first = gen_a.Generate(adapter_req(PROMPT, "chat"), timeout=60)
    assert list(first.completions[0].token_ids) == cold
    req = adapter_req(PROMPT, "chat")
    req.kv_source.CopyFrom(pb.KvSource(pod_id=a.name, address=a.address, num_blocks=4))
    pulled = gen_b.Generate(req, timeout=60)
    assert pulled.usage.cached_tokens_peer == 64
    assert list(pulled.completions[0].token_ids) == cold
    # The same tokens as the base model, or as another adapter: nothing of chat's is theirs.
    base = tokens_req(PROMPT, max_tokens=4)
    base.kv_source.CopyFrom(pb.KvSource(pod_id=a.name, address=a.address, num_blocks=4))
    assert gen_b.Generate(base, timeout=60).usage.cached_tokens == 0
    assert gen_a.Generate(adapter_req(PROMPT, "sql"), timeout=60).usage.cached_tokens == 0

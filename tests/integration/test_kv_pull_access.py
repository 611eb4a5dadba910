"""Who may pull KV blocks from a pod, and which, between real pod processes with tokens
(issue #27): `KVNode.PullBlocks` takes the fleet's peer token only (a client's API token is
PERMISSION_DENIED); a peer gets only the chain its request's tokens and salt give (another
tenant's hashes, read from the index, get an empty stream); the pull path between pods still
gives cold tokens; a refused configuration says what differs, never the pod's values."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import grpc
import pytest
import yaml

from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.proto.credentials import bearer
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.tenants import hash_token

pytestmark = pytest.mark.integration

API_TOKEN = "api-2c9e41d07b6a"
ADMIN_TOKEN = "adm-8b13f5a2e4c0"
BLOCK = 16
POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "320", "--num-threads", "1"]
PROMPT = [(i * 11 + 5) % 250 for i in range(300)]
FULL = (len(PROMPT) - 1) // BLOCK
SALT_B = "tenant-b-salt"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[LocalCluster, dict[str, Child]]]:
    """a holds PROMPT under tenant b's salt; b pulls; c computes cold references."""
    cluster = LocalCluster(nodes=0, start_router=False, node_args=POD_ARGS,
                           run_dir=tmp_path_factory.mktemp("kv-pull-access"),
                           api_token=API_TOKEN, pod_token=API_TOKEN,  # the pods' own
                           admin_token=ADMIN_TOKEN)
    cluster.start()
    try:
        pods = {name: cluster.start_pod(f"node-{name}") for name in ("a", "b")}
        pods["c"] = cluster.start_pod("node-c", ["--no-enable-prefix-caching"])
        for child in pods.values():
            wait_healthy(child.address, 120, child.proc)
        yield cluster, pods
    finally:
        cluster.stop()


def generate(pod: Child, salt: str, source: Child | None = None,
             token: str = API_TOKEN) -> pb.GenerateResponse:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), cache_salt=salt,
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0.0,
                                                            ignore_eos=True))
    if source is not None:
        request.kv_source.CopyFrom(pb.KvSource(pod_id=source.name, address=source.address,
                                               num_blocks=FULL))
    with grpc.insecure_channel(pod.address) as ch:
        return pb_grpc.GenerationStub(ch).Generate(request, metadata=bearer(token), timeout=60)


def pull(pod: Child, token: str | None, **fields) -> list[bytes]:
    """PullBlocks on `pod`: the entries, or the RpcError's code."""
    with grpc.insecure_channel(pod.address, [("grpc.max_receive_message_length",
                                              64 << 20)]) as ch:
        kv = pb_grpc.KVNodeStub(ch)
        if "hash_config" not in fields:
            fields["hash_config"] = kv.Stats(pb.StatsRequest(), timeout=30,
                                             metadata=bearer(API_TOKEN)).hash_config
        fields.setdefault("kv_layout", fleet_layout())
        stream = kv.PullBlocks(pb.PullBlocksRequest(**fields), timeout=30,
                               metadata=bearer(token) if token else None)
        return [e for chunk in stream for e in chunk.entries]


@functools.cache
def fleet_layout() -> str:
    """The KV layout every pod of this fleet has, as a puller sends it: its own engine's
    (pagekv-tiny, built in process)."""
    from pagekv.kvnode.engine.engine import Engine

    return Engine(model="pagekv-tiny", num_gpu_blocks=32, max_model_len=320).kv_layout.json


def code_of(fn, *args, **kw) -> grpc.StatusCode:
    try:
        fn(*args, **kw)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def held_hashes() -> list[bytes]:
    return hash_prompt(HashConfig("sha256", "vllm-none-hash"), BLOCK, PROMPT, SALT_B)[:FULL]


def test_pull_between_pods_with_the_peer_token_gives_cold_tokens(fleet):
    cluster, pods = fleet
    assert cluster.peer_token  # LocalCluster made one: the pods have other tokens
    cold = generate(pods["c"], SALT_B).completions[0].token_ids
    first = generate(pods["a"], SALT_B)
    assert first.completions[0].token_ids == cold and first.usage.cached_tokens == 0
    got = generate(pods["b"], SALT_B, pods["a"])
    assert got.completions[0].token_ids == cold
    assert got.usage.cached_tokens_peer == FULL * BLOCK


def test_a_client_token_on_pull_blocks_is_refused(fleet):
    cluster, pods = fleet
    generate(pods["a"], SALT_B)  # a holds the chain (again)
    ask = dict(block_hashes=held_hashes(), chain_token_ids=PROMPT[:FULL * BLOCK],
               cache_salt=SALT_B)
    assert code_of(pull, pods["a"], API_TOKEN, **ask) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(pull, pods["a"], ADMIN_TOKEN, **ask) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(pull, pods["a"], None, **ask) == grpc.StatusCode.UNAUTHENTICATED
    assert len(pull(pods["a"], cluster.peer_token, **ask)) == FULL


def test_another_tenants_chain_gets_nothing(fleet):
    """A peer-token pull for tenant b's hashes (as the index lists them) made for a request
    of tenant a: an empty stream, exactly as for blocks not held; b's own claim is served."""
    cluster, pods = fleet
    generate(pods["a"], SALT_B)
    held, tokens = held_hashes(), PROMPT[:FULL * BLOCK]
    peer = cluster.peer_token
    assert pull(pods["a"], peer, block_hashes=held, chain_token_ids=tokens,
                cache_salt="tenant-a-salt") == []
    assert pull(pods["a"], peer, block_hashes=held) == []  # the hashes alone
    assert pull(pods["a"], peer, block_hashes=held, chain_token_ids=tokens) == []  # no salt
    not_held = hash_prompt(HashConfig("sha256", "vllm-none-hash"), BLOCK,
                           [7] * len(tokens), SALT_B)
    assert pull(pods["a"], peer, block_hashes=not_held, chain_token_ids=[7] * len(tokens),
                cache_salt=SALT_B) == []  # what "not held" looks like: the same
    assert len(pull(pods["a"], peer, block_hashes=held, chain_token_ids=tokens,
                    cache_salt=SALT_B)) == FULL


def test_a_configuration_mismatch_says_only_what_differs(fleet):
    cluster, pods = fleet
    pod = pods["a"]
    with pytest.raises(grpc.RpcError) as exc:
        pull(pod, cluster.peer_token, block_hashes=held_hashes(),
             hash_config=pb.HashConfig(algo="sha256", seed_fingerprint="sha256-00",
                                       block_size=16))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert exc.value.details() == "the puller's hash configuration differs from this pod's"
    layout = fleet_layout()
    with pytest.raises(grpc.RpcError) as exc:
        pull(pod, cluster.peer_token, block_hashes=held_hashes(),
             kv_layout=layout.replace('"dtype":"float32"', '"dtype":"float16"'))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert exc.value.details() == "the puller's KV layout differs from this pod's"
    log = pod.log_path.read_text(errors="replace")
    assert layout in log and "sha256-00/16 (puller)" in log  # the values: in its log only


def test_tenants_pull_their_own_prefix_and_only_theirs(tmp_path):
    """With a tenants file the pods derive each tenant's salt from its token: a pull for
    acme's request lands acme's blocks (cold tokens); globex asking the same prompt, with the
    same hint, gets none of them and computes its own."""
    acme, globex = "acme-tok-61b0e2c4d9", "globex-tok-2f7a93e1c5"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": {
        "acme": {"tokens": [hash_token(acme)]}, "globex": {"tokens": [hash_token(globex)]}}}))
    cluster = LocalCluster(nodes=0, start_router=False, node_args=POD_ARGS,
                           run_dir=tmp_path / "run", api_token=API_TOKEN, pod_token=API_TOKEN,
                           tenants=str(tenants))
    cluster.start()
    try:
        a, b = cluster.start_pod("node-a"), cluster.start_pod("node-b")
        c = cluster.start_pod("node-c", ["--no-enable-prefix-caching"])
        for child in (a, b, c):
            wait_healthy(child.address, 120, child.proc)
        cold = generate(c, "", token=acme).completions[0].token_ids
        assert generate(a, "", token=acme).completions[0].token_ids == cold
        theirs = generate(b, "", a, token=globex)
        assert theirs.usage.cached_tokens_peer == 0 and theirs.completions[0].token_ids == cold
        own = generate(b, "", a, token=acme)
        assert own.usage.cached_tokens_peer == FULL * BLOCK
        assert own.completions[0].token_ids == cold
    finally:
        cluster.stop()

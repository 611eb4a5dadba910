"""The Redis index against a real redis-server and a real Redis Cluster (every test runs on
both): what a lookup finds (depth, tiers, several pods, the first miss, cleared blocks), in
one round trip to one node; hash configurations kept apart by namespace, and the config
handshake's messages. Fixtures: conftest.py (client, make_pod, index_redis); helpers:
index_fixtures.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.cluster

from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.index import (
    IndexSchema,
    PodMatch,
    config_mismatch,
    count_pod_claims,
    list_live_pods,
    list_namespaces,
    lookup_prefix,
    queries,
    register_scripts,
)
from pagekv.proto.index.connect import connection_options, is_cluster
from pagekv.proto.index.queries import LivePods
from pagekv.proto.index.schema import new_claim_id
from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.integration.index_fixtures import SCHEMA, chain, primaries

pytestmark = pytest.mark.integration


def test_stored_gpu_blocks_are_found_with_depth_and_tiers(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(6)
    pod.store(blocks[:4])
    assert pod.pub.flush()
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got == {"pod-a": PodMatch(4, ["GPU"] * 4)}
    assert got["pod-a"].tier_counts() == {"GPU": 4, "CPU": 0, "DISK": 0}
    assert pod.pub.stats()["events_published"] == 1


def test_medium_change_moves_the_claim_to_cpu(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(3)
    pod.store(blocks)
    # Demotion of block 1 reported as store-then-remove in one batch: order must not matter.
    pod.emit([BlockStored([blocks[1]], None, [], 16, medium="CPU"),
              BlockRemoved([blocks[1]], medium="GPU")])
    pod.emit([BlockRemoved([blocks[2]], medium="GPU"),
              BlockStored([blocks[2]], None, [], 16, medium="DISK")])
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"] == PodMatch(3, ["GPU", "CPU", "DISK"])


def test_two_pods_with_different_depths(make_pod, client):
    a, b = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(8)
    a.store(blocks[:2])
    b.store(blocks[:5])
    b.emit([BlockRemoved(blocks[3:5]), BlockStored(blocks[3:5], None, [], 16, medium="CPU")])
    assert a.pub.flush() and b.pub.flush()
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got["pod-a"] == PodMatch(2, ["GPU", "GPU"])
    assert got["pod-b"] == PodMatch(5, ["GPU", "GPU", "GPU", "CPU", "CPU"])


def test_lookup_stops_at_first_miss(make_pod, client):
    a, b = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(6)
    a.store([blocks[0], blocks[1], blocks[3], blocks[4]])  # hole at block 2
    b.store(blocks[1:6])  # everything but block 0
    assert a.pub.flush() and b.pub.flush()
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got["pod-a"].depth == 2
    assert got["pod-b"] == PodMatch(0, [])
    assert lookup_prefix(client, SCHEMA, []) == {"pod-a": PodMatch(0, []),
                                                 "pod-b": PodMatch(0, [])}


def test_all_blocks_cleared(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(4)
    pod.store(blocks[:2])
    pod.store(blocks[2:], medium="CPU")
    pod.emit([AllBlocksCleared(medium="GPU")])
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 0
    assert count_pod_claims(client, SCHEMA, "pod-a") == 2  # the CPU blocks stay
    pod.store(blocks[:2])  # recomputed: the chain is whole again
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"] == PodMatch(4, ["GPU"] * 2 + ["CPU"] * 2)
    pod.emit([AllBlocksCleared()])
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 0
    assert count_pod_claims(client, SCHEMA, "pod-a") == 0


def test_config_mismatch_messages():
    base = {"model": "m", "block_size": 16, "hash_algo": "sha256", "hash_seed": "x"}
    assert config_mismatch(base, dict(base, block_size="16")) is None
    assert config_mismatch(base, dict(base, hash_seed="y")) == "hash_seed differs: 'x' vs 'y'"
    assert (config_mismatch(base, dict(base, block_size=32, hash_algo="xxhash"))
            == "block_size differs: '16' vs '32'; hash_algo differs: 'sha256' vs 'xxhash'")
    no_seed = {k: v for k, v in base.items() if k != "hash_seed"}
    assert config_mismatch(base, no_seed) == "hash_seed differs: 'x' vs missing"
    # Extra fields count only when both sides publish them.
    assert config_mismatch(dict(base, kv_dtype="fp8"), base) is None
    assert (config_mismatch(dict(base, lora="1"), dict(base, lora="2"))
            == "lora differs: '1' vs '2'")
    assert config_mismatch(IndexSchema("m", 16, "sha256", "x"), base) is None
    with pytest.raises(ValueError, match="hash_seed differs"):
        IndexPublisher("redis://127.0.0.1:1/0", SCHEMA, "p", "a", dict(base, hash_seed="z"),
                       dict, dict)


def test_namespaces_isolate_hash_configurations(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(3)
    pod.store(blocks)
    assert pod.pub.flush()
    other_seed = IndexSchema("tiny-llama", 16, "sha256", "seed-2")
    assert other_seed.namespace != SCHEMA.namespace
    assert lookup_prefix(client, other_seed, blocks) == {}
    assert list_live_pods(client, other_seed) == []
    # A router in the other namespace can still find out why it sees nobody.
    spaces = list_namespaces(client)
    assert spaces == {SCHEMA.namespace: SCHEMA.hash_config()}
    assert (config_mismatch(other_seed, spaces[SCHEMA.namespace])
            == "hash_seed differs: 'seed-2' vs 'seed-1'")
    assert IndexSchema.from_config(spaces[SCHEMA.namespace]) == SCHEMA

class CountingRedis(redis.Redis):
    """Counts top-level commands sent by this client (each is one round trip here)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent: list[str] = []

    def execute_command(self, *args: object, **options: object) -> object:
        self.sent.append(str(args[0]).upper())
        return super().execute_command(*args, **options)


class CountingCluster(redis.cluster.RedisCluster):
    """The same for a cluster client (each command goes to one node, or is fanned out)."""

    sent: list[str]  # set before __init__: the constructor already sends COMMAND

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.sent = []
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def execute_command(self, *args: object, **options: object) -> object:
        self.sent.append(str(args[0]).upper())
        return super().execute_command(*args, **options)


def counting_client(client: Any) -> CountingRedis | CountingCluster:
    """A counting client of the same Redis as `client`."""
    if not is_cluster(client):
        kwargs = client.connection_pool.connection_kwargs
        return CountingRedis(host=kwargs["host"], port=kwargs["port"])
    options = connection_options(5.0)
    nodes = [redis.cluster.ClusterNode(n.host, n.port) for n in client.get_primaries()]
    return CountingCluster(startup_nodes=nodes, **options)


def counting_from_now(client: Any) -> tuple[CountingRedis | CountingCluster, list[Any]]:
    """A counting client with the scripts loaded, and every primary with its command stats
    reset: what is counted from here is what the test sends."""
    counting = counting_client(client)
    register_scripts(counting)
    nodes = list(primaries(client))
    for node in nodes:
        node.config_resetstat()
    counting.sent.clear()
    return counting, nodes


def evalsha_calls(nodes: list[Any]) -> list[int]:
    """EVALSHA calls each primary ran since counting_from_now, fewest first."""
    return sorted(node.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                  for node in nodes)


def test_lookup_is_one_round_trip_to_one_node(make_pod, client):
    pod, other = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(64)
    pod.store(blocks[:50])
    other.store(blocks[:3])
    assert pod.pub.flush() and other.pub.flush()
    live = LivePods.of(list_live_pods(client, SCHEMA))  # the router's cache
    counting, nodes = counting_from_now(client)
    got = lookup_prefix(counting, SCHEMA, blocks, live)
    assert got["pod-a"].depth == 50 and got["pod-b"].depth == 3
    assert counting.sent == ["EVALSHA"]
    # One call, on one node (the chain's bucket's shard).
    assert evalsha_calls(nodes) == [0] * (len(nodes) - 1) + [1]
    stats = [node.info("commandstats") for node in nodes]
    assert not any("cmdstat_eval" in s or "cmdstat_script" in s for s in stats)
    counting.close()


def test_the_reply_names_only_the_holders_however_many_pods_are_passed(make_pod, client):
    a, b = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(40, "many")
    a.store(blocks[:5])
    b.store(blocks[:9])
    assert a.pub.flush() and b.pub.flush()
    ids = {f"pod-{i:03d}": new_claim_id() for i in range(256)}
    ids["pod-a"] = next(p.claim_id for p in list_live_pods(client, SCHEMA) if p.pod_id == "pod-a")
    ids["pod-b"] = new_claim_id()  # not its registration's: its claims do not count
    call = queries.lookup(SCHEMA, blocks, LivePods(ids))
    assert len(call.keys) == 1 and len(call.args) == 3  # however long, no pods sent
    assert call.run(client) == {"pod-a": PodMatch(5, ["GPU"] * 5)}

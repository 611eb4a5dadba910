"""LoRA adapters around the model: the pod's slots (LRU, never a busy one, a failed load), the
`--lora-modules` syntax, the registration field the router reads (and what it refuses), the
router's pricing of a load, and its prediction of an adapter it just sent."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pagekv.kvnode.engine.lora_adapters import AdapterSlots, parse_lora_modules
from pagekv.kvnode.model.lora import AdapterError, LoraWeights
from pagekv.proto.index.pod_adapters import (
    EMPTY,
    NO_ADAPTERS,
    PodAdapters,
    adapter_fields,
    parse_adapters,
)
from pagekv.proto.requests import NoSuchAdapter
from pagekv.router.recent_pairs import RecentPairs
from pagekv.router.scoring import Candidate, CostModel, rank, score_all


def adapter_dir(tmp_path: Path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    return str(d)


def wait(slots: AdapterSlots, name: str) -> LoraWeights | None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = slots.ready(name)
        if got is not None or name in slots.failed:
            return got
        time.sleep(0.005)
    raise AssertionError("the load never finished")


def test_slots_load_off_thread_evict_lru_and_never_a_busy_adapter(tmp_path: Path) -> None:
    busy: set[str] = set()
    loaded: list[str] = []

    def loader(name: str, path: str) -> LoraWeights:
        loaded.append(name)
        return LoraWeights(name, path, 4, ("q_proj",), [])

    slots = AdapterSlots(2, loader, lambda: busy)
    for name in "abc":
        slots.register(name, adapter_dir(tmp_path, name))
    assert slots.ready("a") is None  # not resident: its load starts, the caller waits
    assert wait(slots, "a") is not None and wait(slots, "b") is not None
    busy.update({"a", "b"})
    assert slots.ready("c") is None and not slots.has_loading()  # both slots busy: it waits
    busy.discard("a")
    assert wait(slots, "c") is not None
    assert list(slots.resident) == ["b", "c"] and slots.evictions == 1
    assert loaded == ["a", "b", "c"]
    with pytest.raises(NoSuchAdapter, match="'zzz' is not loaded"):
        slots.path_of("zzz")
    slots.close()


def test_a_failed_load_is_reported_and_tried_again_later(tmp_path: Path) -> None:
    attempts: list[str] = []

    def loader(name: str, path: str) -> LoraWeights:
        attempts.append(name)
        raise AdapterError(f"adapter {path}: cannot read adapter_model.safetensors: truncated")

    slots = AdapterSlots(1, loader, set)
    slots.register("x", adapter_dir(tmp_path, "x"))
    assert wait(slots, "x") is None
    assert "truncated" in slots.failed["x"] and slots.load_failures == 1
    assert slots.ready("x") is None and len(attempts) == 1  # not retried while failed
    slots.failed.clear()  # (what the engine does once it failed the waiting requests)
    wait(slots, "x")
    assert len(attempts) == 2
    slots.close()


def test_registering_checks_the_name_and_a_clash(tmp_path: Path) -> None:
    slots = AdapterSlots(1, lambda n, p: LoraWeights(n, p, 1, (), []), set)
    path = adapter_dir(tmp_path, "ok")
    for bad in ("", "a=b", "x" * 129, "tab\there"):
        with pytest.raises(AdapterError, match="adapter name"):
            slots.register(bad, path)
    slots.register("ok", path)
    with pytest.raises(AdapterError, match="already loaded from"):
        slots.register("ok", adapter_dir(tmp_path, "other"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        slots.register("missing", str(tmp_path / "nowhere"))
    slots.unregister("ok")
    with pytest.raises(NoSuchAdapter):
        slots.unregister("ok")


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat"}']) == {
        "sql": "/a/sql", "chat": "/a/chat"}
    for bad, words in ((["nopath"], "expected name=path"), (["a=/x", "a=/y"], "twice"),
                       (['{"name": 1}'], "JSON needs"), (["{oops"], "not JSON")):
        with pytest.raises(AdapterError, match=words):
            parse_lora_modules(bad)


def test_the_registration_field_round_trips_and_garbage_is_refused() -> None:
    fields = adapter_fields({"sql": "/a/sql", "chat": "/a/chat"}, ["chat", "gone"], 0.25)
    got = parse_adapters(fields["lora"])
    assert got == PodAdapters({"sql": "/a/sql", "chat": "/a/chat"}, frozenset({"chat"}), 0.25)
    assert adapter_fields({}, [], None) == {}
    assert parse_adapters(None) is NO_ADAPTERS
    assert parse_adapters(EMPTY) == PodAdapters({}, frozenset(), None)
    for raw in ("not json", "[]", '{"a": {"x": 5}}', '{"a": {"x": "p"}, "r": ["y"]}',
                '{"a": {}, "s": -1}', '{"a": {}, "s": true}', '{"a": {}, "z": 1}',
                json.dumps({"a": {f"n{i}": "/p" for i in range(2000)}}),
                json.dumps({"a": {"x\n": "/p"}}), "[" * 100_000):
        assert parse_adapters(raw) is None, raw[:40]


COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=1e-4, disk_per_token=2e-4,
                  queue_per_request=0.05, adapter_load_s=0.5)


def test_a_pod_that_must_load_pays_the_load_and_ties_do_not_spread_it() -> None:
    resident = Candidate("a", "a:1")
    loading = Candidate("b", "b:1", adapter_load_s=0.5)
    scores = score_all([resident, loading], 100, 16, COSTS, pull=False)
    assert scores[1].cost_s - scores[0].cost_s == pytest.approx(0.5)
    assert rank(scores, COSTS)[0][0].pod_id == "a"
    # Every pod must load it: the band is 5% of the work, not of work + load, so the
    # lighter pod wins outright instead of a rotation over all of them.
    both = [Candidate("a", "a:1", adapter_load_s=0.5, waiting=1),
            Candidate("b", "b:1", adapter_load_s=0.5)]
    for rotation in range(4):
        assert rank(score_all(both, 100, 16, COSTS, pull=False), COSTS,
                    rotation)[0][0].pod_id == "b"


def test_an_adapter_just_sent_is_predicted_resident_for_a_while() -> None:
    now = [100.0]
    pairs = RecentPairs(5.0, clock=lambda: now[0])
    pairs.record("pod-a", "sql")
    assert pairs.recent("pod-a", "sql") and not pairs.recent("pod-b", "sql")
    now[0] += 5.1
    assert not pairs.recent("pod-a", "sql")


def test_an_adapters_block_hash_is_vllms_lora_key_byte_for_byte() -> None:
    """vLLM 0.34 (`kv_cache_utils._gen_lora_extra_hash_keys`): the extra keys of every block
    of an adapter's request hold ("lora", lora_name, lora_path); sha256 hashes the pickle of
    (parent, tokens, extra keys), the root being sha256 of the seed's pickle."""
    import hashlib
    import pickle

    from pagekv.proto.hashing import HashConfig, hash_prompt, lora_key

    tokens = list(range(1, 33))
    got = hash_prompt(HashConfig("sha256", "vllm-none-hash"), 16, tokens,
                      lora=lora_key("sql", "/adapters/sql"))
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    want = []
    for i in range(2):
        extra = (("lora", "sql", "/adapters/sql"),)
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * 16:(i + 1) * 16]), extra),
                                             protocol=5)).digest()
        want.append(parent)
    assert got == want
    assert got != hash_prompt(HashConfig("sha256", "vllm-none-hash"), 16, tokens,
                              lora=lora_key("sql", "/adapters/other"))


def test_an_adapter_unloaded_while_its_request_waits_fails_that_request(tmp_path: Path
                                                                         ) -> None:
    slots = AdapterSlots(1, lambda n, p: LoraWeights(n, p, 1, (), []), set)
    slots.register("gone", adapter_dir(tmp_path, "gone"))
    slots.unregister("gone")
    assert slots.ready("gone") is None
    assert "'gone' is not loaded" in slots.failed["gone"] and not slots.knows("gone")

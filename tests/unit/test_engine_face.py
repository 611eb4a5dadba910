"""The engine's one face: the pod reads its engine through `Engine.stats()` (typed), `load()`
and public methods, never through the scheduler, the pool, the puller, the tiers or the runner.

The first tests walk the pod's code (and what sits above it: deploy, the public package) with
`ast` and fail on any attribute chain that reaches into those parts of an engine; the others
check that the typed record is a copy that the metrics page and the Stats call read alike.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.engine_stats import EngineLoad, EngineStats
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.pod.prom import EngineCollector
from pagekv.kvnode.pod.server import PodServer
from pagekv.proto.medium import Medium

ROOT = Path(__file__).resolve().parents[2]
# The engine's parts that are its own business (and the memory layer's metrics object).
INTERNALS = frozenset({"scheduler", "kv_manager", "puller", "tiers", "runner", "metrics"})
# Names the pod's code gives an engine; `<anything>.engine` is one too.
ENGINE_NAMES = frozenset({"eng", "engine"})


def _is_engine(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def internal_reads(source: str, filename: str = "<source>") -> list[str]:
    """`file:line: expression` for every read of an engine's internals in `source`: one of
    INTERNALS, or a private attribute."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Attribute) or not _is_engine(node.value):
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if node.attr in INTERNALS or private:
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{filename}:{line}: {expr}" for line, _, expr in sorted(found)]


def pod_side_files() -> list[Path]:
    """The code above the engine that holds one: the pod (and the index code that left it),
    deploy, and the public package's own modules (its folders are links to the layers)."""
    files = [p for folder in ("kvnode/pod", "kvnode/index", "deploy")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    return files + sorted((ROOT / "pagekv").glob("*.py"))


def test_the_checker_finds_reads_of_engine_internals():
    bad = """
def load(self):
    eng = self.engine
    return len(eng.scheduler.waiting), self.pod.engine.kv_manager.num_blocks

def costs(engine):
    return engine.tiers.reload_s_per_token(engine.runner.kv_bytes_per_token), engine._groups
"""
    found = internal_reads(bad)
    assert [f.split(": ", 1)[1] for f in found] == [
        "eng.scheduler", "self.pod.engine.kv_manager", "engine.tiers", "engine.runner",
        "engine._groups"]
    good = """
def load(self):
    st = self.engine.stats()
    return st.load.waiting, self.engine.load(), self.engine.tier_costs(), eng.kv_layout
"""
    assert internal_reads(good) == []


def test_the_pod_reads_the_engine_only_through_its_face():
    files = pod_side_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    # The walk must cover the modules that hold the engine (a move must not empty it).
    assert {"kvnode/pod/server.py", "kvnode/pod/prom.py", "kvnode/pod/kv_transfer.py"} <= names
    found = [f for p in files
             for f in internal_reads(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert found == [], "the pod reads engine internals:\n" + "\n".join(found)


@pytest.fixture(scope="module")
def engine():
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=512)
    yield eng
    eng.close()


def run(eng: Engine, rid: str, prompt: list[int]) -> None:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()


def test_stats_is_a_typed_copy(engine):
    before = engine.stats()
    assert isinstance(before, EngineStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.usage = 1.0  # type: ignore[misc]
    prompt = [(i * 7) % 250 for i in range(100)]
    run(engine, "a", prompt)
    run(engine, "b", prompt)
    after = engine.stats()
    # The earlier reading did not move with the engine: its figures are copies.
    assert after.prefix_cache.requests == before.prefix_cache.requests + 2
    assert after.prefix_cache.queries_tokens > before.prefix_cache.queries_tokens
    assert after.prefix_cache.hits_tokens_by_tier[Medium.GPU] > 0
    assert before.prefix_cache.hits_tokens_by_tier.get(Medium.GPU, 0) == 0
    assert after.pool.entries == len(engine.kv_manager.cached_hashes()) > 0
    assert after.chain is None and list(after.tiers) == [Medium.GPU]
    assert after.peer_pull is None  # pull not enabled
    # Idle: the cheap load and the full reading agree, and carry the index's field names.
    budget = after.load.prefill_budget  # measured (0 until both step kinds were timed)
    assert engine.load() == after.load == EngineLoad(0, 0, 64, 64, budget, 0)
    assert after.load.as_fields() == {"waiting": 0, "running": 0, "free_blocks": 64,
                                      "num_blocks": 64, "prefill_budget": budget,
                                      "prefill_backlog": 0}


def test_metrics_page_and_stats_call_read_the_same_record(engine):
    st = engine.stats()
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, {"pod": "p0"}))
    samples = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            samples[s.name, s.labels.get("tier")] = s.value
    assert samples["pagekv_kv_cache_blocks", None] == st.load.num_blocks
    assert samples["pagekv_kv_cache_free_blocks", None] == st.load.free_blocks
    assert samples["pagekv_num_requests_waiting", None] == st.load.waiting
    assert samples["pagekv_prefix_cache_requests_total", None] == st.prefix_cache.requests
    assert (samples["pagekv_prefix_cache_queries_tokens_total", None]
            == st.prefix_cache.queries_tokens)
    assert (samples["pagekv_prefix_cache_hits_tokens_total", "GPU"]
            == st.prefix_cache.hits_tokens_by_tier[Medium.GPU])

    pod = PodServer(EngineArgs(model="pagekv-tiny"), "p0")
    pod.engine = engine
    resp = pod.stats_response()
    assert (resp.num_blocks, resp.num_free_blocks, resp.num_waiting, resp.num_running) == (
        st.load.num_blocks, st.load.free_blocks, st.load.waiting, st.load.running)
    assert resp.usage == pytest.approx(st.usage)
    assert resp.hash_config.seed_fingerprint == engine.hash_config.fingerprint()
    assert pod.load() == st.load.as_fields()
    assert pod.tier_costs() == engine.tier_costs()
    assert set(engine.tier_costs()) <= {"prefill"}  # no tiers, no pulls: nothing else measured

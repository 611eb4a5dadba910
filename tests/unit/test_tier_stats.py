"""One per-tier record, from the tier chain to the engine's stats, Prometheus and StatsResponse."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.pod.prom import EngineCollector
from pagekv.kvnode.pod.server import PodServer
from pagekv.proto.medium import OFFLOAD_MEDIUMS, Medium
from pagekv.proto.tier_stats import MOVES, ChainStats, TierMove, TierStats, move_name

P = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX = [(i * 37) % 250 + 1 for i in range(200)]
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17, 19, 23)]


def test_move_names_and_reload_cost():
    assert [move_name(s, d) for s, d in MOVES] == [
        "pool_to_dram", "pool_to_ssd", "dram_to_ssd", "dram_to_pool", "ssd_to_pool"]
    stats = ChainStats(
        {m: TierStats(m) for m in OFFLOAD_MEDIUMS},
        (TierMove(Medium.GPU, Medium.CPU, 4000, 2.0),  # an eviction is no reload
         TierMove(Medium.CPU, Medium.GPU, 1000, 0.5),
         TierMove(Medium.DISK, Medium.GPU, 0, 0.0)),  # never reloaded from: no figure
    )
    assert stats.reload_s_per_token(10) == {Medium.CPU: 0.005}


def test_exporters_read_the_chains_record_unchanged(tmp_path):
    kw = {"cpu_offload_bytes": 1 << 20, "disk_offload_bytes": 16 << 20,
          "disk_offload_dir": str(tmp_path)}
    llm = LLM("pagekv-tiny", num_gpu_blocks=26, max_model_len=400, **kw)
    for prompt in [PREFIX + [7], *FILLERS, PREFIX + [9]]:
        llm.generate([prompt], P)
    eng = llm.engine
    assert eng.tiers.chain.ssd.flush(timeout=30)  # nothing moves while the exporters read
    st = eng.stats()
    chain = st.chain
    assert st.tiers[Medium.CPU] is chain.tiers[Medium.CPU]  # passed on, not rebuilt
    assert list(st.tiers) == [Medium.GPU, *OFFLOAD_MEDIUMS]
    cpu, disk = chain.tiers[Medium.CPU], chain.tiers[Medium.DISK]
    assert cpu.hits_tokens > 0 and cpu.entries > 0 and disk.used_bytes > 0  # real traffic

    registry = CollectorRegistry()
    registry.register(EngineCollector(eng, {"pod": "p0"}))
    samples = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            key = s.labels.get("tier") or s.labels.get("direction")
            samples[s.name, key] = s.value
    for t in chain.tiers.values():
        for field in ("used_bytes", "capacity_bytes", "entries"):
            assert samples[f"pagekv_tier_{field}", t.medium] == getattr(t, field)
        for field in ("hits_tokens", "queries_tokens"):
            assert samples[f"pagekv_tier_{field}_total", t.medium] == getattr(t, field)
    for move in chain.moves:
        assert samples["pagekv_tier_moved_bytes_total", move.name] == move.bytes
        assert samples["pagekv_tier_moved_seconds_total", move.name] == move.seconds
    assert samples["pagekv_tier_orphans_dropped_total", None] == chain.orphans_dropped
    assert samples["pagekv_tier_checksum_failures_total", None] == chain.checksum_failures
    assert ("pagekv_tier_used_bytes", "GPU") not in samples  # the pool has its own gauges

    pod = PodServer(EngineArgs(model="pagekv-tiny"), "p0")
    pod.engine = eng
    resp = pod.stats_response()
    assert [(t.tier, t.used_bytes, t.capacity_bytes, t.entries) for t in resp.tiers] == [
        (t.medium, t.used_bytes, t.capacity_bytes, t.entries) for t in st.tiers.values()]
    pool = st.tiers[Medium.GPU]
    assert pool.entries == len(eng.kv_manager.cached_hashes())
    assert pool.capacity_bytes == eng.kv_manager.num_blocks * eng.runner.block_bytes
    eng.close()

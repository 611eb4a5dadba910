"""An engine whose SSD tier fills its disk (a real 128 KiB tmpfs): the tier shrinks its budget
and stays on, the shrunk budget is what Prometheus shows, and the tokens equal a cold run's."""

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.pod.prom import EngineCollector
from tests.unit.ssd_fixtures import small_tmpfs

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TARGET = [(i * 37) % 250 + 1 for i in range(200)] + [7, 9]  # 12 full blocks of 16
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17, 19)]
BUDGET = 16 << 20  # far more than the filesystem


def _disk_capacity_metric(llm: LLM) -> float:
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.engine, {"pod": "p0"}))
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name == "pagekv_tier_capacity_bytes" and s.labels.get("tier") == "DISK":
                return s.value
    raise AssertionError("no pagekv_tier_capacity_bytes{tier=DISK}")


def test_engine_on_a_full_disk_keeps_its_ssd_tier_and_a_cold_runs_tokens(tmp_path: Path) -> None:
    cold_llm = LLM("pagekv-tiny", num_gpu_blocks=256, max_model_len=512, enable_prefix_caching=False)
    cold = cold_llm.generate([TARGET], P)[0].outputs[0].token_ids
    with small_tmpfs(tmp_path / "fs", "128k") as fs:
        llm = LLM("pagekv-tiny", num_gpu_blocks=26, max_model_len=400,
                  disk_offload_bytes=BUDGET, disk_offload_dir=str(fs))
        try:
            ssd = llm.engine.tiers.chain.ssd
            assert ssd is not None
            for prompt in FILLERS:  # their evicted blocks fill the disk
                llm.generate([prompt], P)
                assert ssd.flush(30)
            assert ssd.stats()["disk_full_events"] >= 1 and not ssd.disabled
            outs = []
            for prompt in (TARGET, FILLERS[0], FILLERS[1], TARGET, FILLERS[2], FILLERS[3], TARGET):
                outs.append(llm.generate([prompt], P)[0])  # two fillers push TARGET to the SSD
                assert ssd.flush(30)
            for out in (outs[0], outs[3], outs[6]):
                assert out.outputs[0].token_ids == cold
            assert not ssd.disabled
            # Still serving after the full disk: TARGET's tail came back from it.
            assert outs[3].cached_tokens_by_tier["DISK"] > 0 and outs[6].cached_tokens_by_tier["DISK"] > 0
            assert ssd.capacity_bytes <= 128 << 10 < BUDGET
            assert _disk_capacity_metric(llm) == ssd.capacity_bytes
        finally:
            llm.engine.close()

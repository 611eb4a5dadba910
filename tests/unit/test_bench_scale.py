"""bench.scale's pure parts: the trace (seeded, its hit-rate bound equal to what a set of the
real block hashes gives; a hot prefix), the load it is sized for, the step-time model and its
presets, one simulated pod (the real manager, tiers and scheduler) serving a prefix twice,
the sweep's knee, the warm start's per-second figures and a publisher worker's book."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from bench.scale_pod import PRESETS, Oracle, PodConfig, SimPod, StepCost, fit_step
from bench.scale_publishers import PodBook
from bench.scale_sweep import knee, knee_bound
from bench.scale_trace import (
    TraceConfig,
    hot_pods,
    make_trace,
    num_tenants,
    pod_seconds,
    trace_for_load,
)
from bench.scale_warm import by_second, warm_figures
from pagekv.proto.hashing import HashConfig, RequestBlockHasher, max_hit_blocks
from pagekv.proto.kv_events import BlockRemoved, BlockStored
from pagekv.proto.medium import Medium

SMALL = replace(TraceConfig(), system_tokens=(40, 120), message_tokens=(5, 40),
                output_tokens=(3, 30), think_s=(0.5, 3.0))


def test_trace_is_seeded_sorted_and_inside_the_window():
    a = make_trace(SMALL, pods=3, session_rate=2.0, duration_s=20.0, seed=1)
    b = make_trace(SMALL, pods=3, session_rate=2.0, duration_s=20.0, seed=1)
    c = make_trace(SMALL, pods=3, session_rate=2.0, duration_s=20.0, seed=2)
    key = [(r.rid, r.arrival, r.prompt(), r.output) for r in a]
    assert key == [(r.rid, r.arrival, r.prompt(), r.output) for r in b]
    assert key != [(r.rid, r.arrival, r.prompt(), r.output) for r in c]
    assert all(0 <= x.arrival <= y.arrival < 20.0 for x, y in zip(a, a[1:], strict=False))
    assert len({r.tenant for r in a}) <= num_tenants(SMALL, 3) == 6
    for r in a:
        assert len(r.prompt()) == r.prompt_len
        if r.turn:  # a chat client resends the whole conversation
            prev = next(x for x in a if x.session is r.session and x.turn == r.turn - 1)
            assert r.prompt()[:prev.prompt_len + len(prev.output)] == prev.prompt() + prev.output


def test_bound_equals_a_set_of_the_real_block_hashes():
    bs = SMALL.block_size
    reqs = make_trace(SMALL, pods=2, session_rate=3.0, duration_s=30.0, seed=5)
    config = HashConfig("sha256", "vllm-none-hash")
    seen: set[bytes] = set()
    assert any(r.bound_blocks for r in reqs) and any(r.turn for r in reqs)
    for r in reqs:
        hashes: list[bytes] = []
        RequestBlockHasher(config, bs).extend(r.prompt(), hashes)
        limit = min(len(hashes), max_hit_blocks(r.prompt_len, bs))
        hit = 0
        while hit < limit and hashes[hit] in seen:
            hit += 1
        assert r.bound_blocks == hit, r.rid
        computed: list[bytes] = []  # every token's K/V but the answer's last one
        RequestBlockHasher(config, bs).extend((r.prompt() + r.output)[:-1], computed)
        seen.update(computed)


def test_trace_is_sized_for_the_load():
    cost = PRESETS["smollm2-135m-instruct"]
    pool, seqs = 1456 * 16, 64
    reqs, rate = trace_for_load(TraceConfig(), 4, 0.7, 60.0, cost.step_fixed_s,
                                cost.prefill_s_per_token, pool, seqs, seed=3)
    late = [r for r in reqs if r.arrival >= 30.0]
    offered = pod_seconds(late, 16, cost.step_fixed_s, cost.prefill_s_per_token, pool,
                          seqs) / 30.0 / 4
    assert rate > 0 and offered == pytest.approx(0.7, rel=0.15)


def test_step_model_fit_and_presets_reproduce_their_sources():
    assert fit_step([(10, 1.5), (20, 2.5), (30, 3.5)]) == pytest.approx((0.5, 0.1))
    with pytest.raises(ValueError):
        fit_step([(8, 1.0), (8, 2.0)])
    smol = PRESETS["smollm2-135m-instruct"]  # BENCHMARKS §10: cold 2260.8, hit 106.7 ms
    assert smol.step_s(2080) == pytest.approx(2.2608)
    assert smol.step_s(32) == pytest.approx(0.1067)
    assert smol.step_s(32, 1888) - smol.step_s(32) == pytest.approx(0.1997 - 0.1059)
    small = PRESETS["pagekv-small"]  # §3: cold 419.1, hit 16.71 ms
    assert small.step_s(2080) == pytest.approx(0.4191)
    assert small.step_s(32) == pytest.approx(0.01671)


def _run(pod: SimPod, t: float) -> tuple[float, list]:
    """Step the pod until it is idle; (time, finished requests)."""
    done = []
    while pod.busy:
        end = pod.start_step(t)
        assert end is not None
        t = end
        done += pod.end_step(t)
    return t, done


def test_a_simulated_pod_serves_caches_and_evicts_into_dram():
    cost = StepCost("test", 0.01, 0.001, 0.0001, 0.0005, "test")
    cfg = replace(PodConfig(), pool_blocks=40, dram_blocks=64)
    pod = SimPod(0, "pod-a", cfg, cost)
    prompt, out = list(range(1000, 1200)), [7] * 20
    pod.add("r1", prompt, out, 0.0)
    t, done = _run(pod, 0.0)
    assert [s.rid for s in done] == ["r1"] and done[0].first_token == pytest.approx(0.01 + 0.2)
    events = pod.take_events()
    assert any(isinstance(e, BlockStored) for e in events)
    assert pod.manager.get_num_free_blocks() == cfg.pool_blocks  # freed at the finish
    pod.add("r2", prompt + [5] * 10, out, t)  # the same prefix: a pool hit
    t, done = _run(pod, t)
    assert done[0].seq.group.cached_tokens_by_tier[Medium.GPU] == 192
    pod.add("r3", list(range(5000, 5600)), out, t)  # evicts r1's blocks into DRAM
    t, _ = _run(pod, t)
    assert len(pod.chain.dram.keys()) > 0
    pod.add("r4", prompt + [6] * 10, out, t)
    _, done = _run(pod, t)
    by_tier = done[0].seq.group.cached_tokens_by_tier
    assert by_tier[Medium.CPU] > 0 and by_tier[Medium.GPU] + by_tier[Medium.CPU] == 192


def test_the_oracle_picks_the_pod_that_holds_the_prefix():
    cost = StepCost("test", 0.01, 0.001, 0.0001, 0.0005, "test")
    cfg = replace(PodConfig(), pool_blocks=64, dram_blocks=0)
    pods = [SimPod(i, f"pod-{i}", cfg, cost) for i in range(3)]
    prompt = list(range(300))
    pods[2].add("warm", prompt, [1, 2], 0.0)
    _run(pods[2], 0.0)
    hashes: list[bytes] = []
    RequestBlockHasher(pods[0].hash_config, 16).extend(prompt + [9], hashes)
    oracle = Oracle()
    for _ in range(3):  # whatever the rotation
        pod, uncached = oracle.pick(pods, hashes, len(prompt) + 1, 2048)
        assert pod is pods[2] and uncached == 301 - 18 * 16


# -- the hot prefix, the sweep's knee, the warm start's figures, the publishers' books ------

def test_a_hot_prefix_takes_its_share_and_leaves_a_trace_without_one_unchanged():
    plain = make_trace(SMALL, pods=4, session_rate=3.0, duration_s=60.0, seed=4)
    assert [(r.rid, r.prompt()) for r in plain] == [
        (r.rid, r.prompt()) for r in make_trace(replace(SMALL, hot_share=0.0, hot_tokens=99),
                                                pods=4, session_rate=3.0, duration_s=60.0,
                                                seed=4)]
    hot_cfg = replace(SMALL, hot_share=0.3, hot_tokens=200)
    reqs = make_trace(hot_cfg, pods=4, session_rate=3.0, duration_s=60.0, seed=4)
    hot_tenant = num_tenants(hot_cfg, 4)
    sessions = {id(r.session): r.session for r in reqs}.values()
    hot = [s for s in sessions if s.tenant == hot_tenant]
    assert len({id(s.system) for s in hot}) == 1 and len(hot[0].system) == 200
    assert 0.2 < len(hot) / len(sessions) < 0.4
    assert all(s.tenant < hot_tenant for s in sessions if s.system is not hot[0].system)
    cost = PRESETS["smollm2-135m-instruct"]
    need = hot_pods(reqs, hot_cfg, 4, cost.step_fixed_s, cost.prefill_s_per_token,
                    1456 * 16, 64, 60.0)
    total = pod_seconds(reqs, 16, cost.step_fixed_s, cost.prefill_s_per_token, 1456 * 16,
                        64) / 60.0
    assert 0 < need < total


def _sweep(p90s: dict[float, dict[str, float]]) -> dict[float, dict]:
    return {load: {"trace": {}, **{k: {"ttft_p90_s": v, "input_tokens_per_s": 1000 * load}
                                   for k, v in row.items()}}
            for load, row in p90s.items()}


def test_the_knee_is_the_last_load_under_the_oracle_bound_at_every_load_below():
    res = _sweep({0.5: {"oracle": 1.0, "prefix": 1.1, "round_robin": 1.9},
                  0.7: {"oracle": 1.2, "prefix": 1.5, "round_robin": 2.5},
                  0.9: {"oracle": 1.5, "prefix": 2.1, "round_robin": 1.0},  # back under: no
                  1.1: {"oracle": 1.9, "prefix": 1.9, "round_robin": 9.0}})
    bound = knee_bound(res)
    assert bound == 2.0
    assert knee(res, "prefix", bound) == (0.7, 700.0)
    assert knee(res, "round_robin", bound) == (0.5, 500.0)
    assert knee(res, "oracle", bound) == (1.1, 1100.0)
    over = _sweep({0.5: {"oracle": 1.0, "round_robin": 3.0}, 0.9: {"oracle": 1.0,
                                                                   "round_robin": 1.0}})
    assert knee(over, "round_robin", knee_bound(over)) == (None, 500.0)  # at the lowest load


@dataclass
class _Rec:
    arrival: float
    prompt: int
    cached_gpu: int
    cached_cpu: int = 0
    cached_peer: int = 0


def test_warm_figures_are_hit_rates_per_second_since_the_restart():
    control = [_Rec(t / 2, 100, 90) for t in range(40)]  # 90% throughout
    restarted = [_Rec(r.arrival, 100, 50 if 10 <= r.arrival < 11 else 90) for r in control]
    fig = warm_figures(restarted, control, restart_at=10.0, warm_from=2.0, seconds=3)
    assert fig["steady"] == pytest.approx(0.9) and fig["steady_control"] == pytest.approx(0.9)
    assert fig["per_second"] == [(pytest.approx(0.5), 2), (pytest.approx(0.9), 2),
                                 (pytest.approx(0.9), 2)]
    assert fig["first_seconds"] == pytest.approx((50 * 2 + 90 * 4) / 600)
    assert by_second(control, 19.0, 2)[1] == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_a_workers_book_is_the_full_state_of_the_events_it_was_sent():
    book = PodBook()
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    book.mirror.apply([BlockStored([a, b, c], None, [], 16),
                       BlockStored([b], None, [], 16, medium=Medium.CPU),
                       BlockRemoved([b], Medium.GPU),
                       BlockStored([c], None, [], 16, medium=Medium.CPU),
                       BlockRemoved([a])])
    # c is in both tiers: one tier per hash, the lower one, as SimPod.full_state has it
    assert book.full_state() == {b: Medium.CPU.value, c: Medium.CPU.value}

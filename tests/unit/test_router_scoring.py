"""Router scoring, tie-breaks and burst predictions: pure functions, no I/O."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.router.burst import BurstTracker
from pagekv.router.scoring import (
    REASON_BURST,
    REASON_COST,
    REASON_PREFIX,
    REASON_TIE_LOAD,
    REASON_TIE_ROTATE,
    Candidate,
    CostModel,
    max_hit_blocks,
    merge_prediction,
    order_least_loaded,
    order_random,
    order_round_robin,
    rank,
    score_candidate,
)
from pagekv.router.tokenize import ByteEncoder, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
BS = 16
COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=1e-5, disk_per_token=1e-4,
                  queue_per_request=0.05, tie_rel=0.05, tie_abs_s=0.0005)


def scored(cands: list[Candidate], prompt_len: int, costs: CostModel = COSTS):
    return [score_candidate(c, prompt_len, BS, costs) for c in cands]


# -- cost model -------------------------------------------------------------------------------

def test_max_hit_blocks_never_covers_the_last_token() -> None:
    assert max_hit_blocks(1, BS) == 0
    assert max_hit_blocks(16, BS) == 0   # one full block, but its last token must be computed
    assert max_hit_blocks(17, BS) == 1
    assert max_hit_blocks(32, BS) == 1
    assert max_hit_blocks(33, BS) == 2


def test_cost_adds_prefill_tier_reload_and_queue() -> None:
    c = Candidate("a", "h:1", ["GPU"] * 4 + ["CPU"] * 2 + ["DISK"], waiting=1, running=2)
    s = score_candidate(c, 200, BS, COSTS)
    assert (s.cached_gpu, s.cached_cpu, s.cached_disk) == (64, 32, 16)
    expected = (200 - 112) * 1e-3 + 32 * 1e-5 + 16 * 1e-4 + 3 * 0.05
    assert s.cost_s == pytest.approx(expected)


def test_published_costs_override_configuration_but_garbage_is_ignored() -> None:
    c = Candidate("a", "h:1", ["CPU"] * 2,
                  published_costs={"prefill": 2e-3, "CPU": float("nan"), "DISK": -1.0})
    s = score_candidate(c, 33, BS, COSTS)
    assert s.cost_s == pytest.approx(1 * 2e-3 + 32 * 1e-5)


def test_prediction_is_capped_by_the_last_token_rule() -> None:
    # 32 tokens: two full blocks hashed, but only one can be served from cache.
    s = score_candidate(Candidate("a", "h:1", ["GPU", "GPU"]), 32, BS, COSTS)
    assert s.cached_tokens == 16


def test_queue_is_the_larger_of_published_load_and_own_inflight() -> None:
    assert Candidate("a", "x", waiting=1, running=1, inflight=5).queue == 5
    assert Candidate("a", "x", waiting=3, running=4, inflight=2).queue == 7


def test_cost_model_rejects_negative_or_nan() -> None:
    with pytest.raises(ValueError, match="queue_per_request"):
        CostModel(1e-3, 1e-5, 1e-4, -1.0)
    with pytest.raises(ValueError, match="prefill_per_token"):
        CostModel(float("nan"), 1e-5, 1e-4, 0.0)


# -- ranking ----------------------------------------------------------------------------------

def test_longest_prefix_wins_and_says_so() -> None:
    cands = [Candidate("a", "x"), Candidate("b", "x", ["GPU"] * 64), Candidate("c", "x")]
    order, reason = rank(scored(cands, 1040), COSTS)
    assert [s.pod_id for s in order][0] == "b"
    assert reason == REASON_PREFIX


def test_dram_prefix_beats_a_cold_pod_but_a_pool_prefix_beats_dram() -> None:
    cands = [Candidate("a", "x", ["CPU"] * 64), Candidate("b", "x")]
    assert rank(scored(cands, 1040), COSTS)[0][0].pod_id == "a"
    cands = [Candidate("a", "x", ["CPU"] * 64), Candidate("b", "x", ["GPU"] * 64)]
    costs = CostModel(1e-3, 1e-4, 1e-3, 0.05, tie_rel=0.0, tie_abs_s=0.0)
    assert rank(scored(cands, 1040, costs), costs)[0][0].pod_id == "b"


def test_disk_slower_than_recompute_is_not_preferred() -> None:
    costs = CostModel(1e-3, 1e-5, 5e-3, 0.0, tie_rel=0.0, tie_abs_s=0.0)
    cands = [Candidate("a", "x", ["DISK"] * 10), Candidate("b", "x")]
    assert rank(scored(cands, 200, costs), costs)[0][0].pod_id == "b"


def test_a_long_queue_outweighs_a_small_hit() -> None:
    cands = [Candidate("a", "x", ["GPU"] * 2, running=10), Candidate("b", "x")]
    order, reason = rank(scored(cands, 100), COSTS)
    assert order[0].pod_id == "b" and reason == REASON_COST


def test_ties_go_to_the_lighter_pod_then_the_freer_pool() -> None:
    cands = [Candidate("a", "x", waiting=1), Candidate("b", "x"), Candidate("c", "x")]
    costs = CostModel(1e-3, 1e-5, 1e-4, 1e-6)  # queue nearly free: costs within tolerance
    order, reason = rank(scored(cands, 100, costs), costs)
    assert order[0].pod_id in ("b", "c") and reason == REASON_TIE_ROTATE
    cands = [Candidate("a", "x", free_blocks=10), Candidate("b", "x", free_blocks=50)]
    order, reason = rank(scored(cands, 100, costs), costs)
    assert order[0].pod_id == "b" and reason == REASON_TIE_LOAD


def test_exact_ties_rotate_so_cold_requests_spread() -> None:
    cands = [Candidate(p, "x") for p in "abcd"]
    chosen = [rank(scored(cands, 100), COSTS, rotation=i)[0][0].pod_id for i in range(8)]
    assert sorted(chosen) == sorted("abcd" * 2)


def test_small_cost_noise_between_identical_pods_is_a_tie() -> None:
    cands = [Candidate("a", "x", published_costs={"prefill": 1.00e-3}),
             Candidate("b", "x", published_costs={"prefill": 1.02e-3})]
    chosen = {rank(scored(cands, 500), COSTS, rotation=i)[0][0].pod_id for i in range(4)}
    assert chosen == {"a", "b"}


def test_ineligible_pods_are_never_ranked_but_still_scored() -> None:
    cands = [Candidate("a", "x", ["GPU"] * 8, eligible=False,
                       excluded_reason="hash config mismatch"), Candidate("b", "x")]
    scores = scored(cands, 200)
    order, _ = rank(scores, COSTS)
    assert [s.pod_id for s in order] == ["b"]
    assert scores[0].excluded_reason and not scores[0].eligible
    assert rank(scored([cands[0]], 200), COSTS) == ([], "")


def test_order_is_complete_for_retries() -> None:
    cands = [Candidate("a", "x", ["GPU"] * 6), Candidate("b", "x", ["GPU"] * 3),
             Candidate("c", "x")]
    order, _ = rank(scored(cands, 200), COSTS)
    assert [s.pod_id for s in order] == ["a", "b", "c"]


# -- baselines and fallback ------------------------------------------------------------------

def test_round_robin_random_and_least_loaded_orders() -> None:
    scores = scored([Candidate(p, "x", running=r) for p, r in zip("abc", (2, 0, 0), strict=True)],
                    50)
    assert [order_round_robin(scores, i)[0].pod_id for i in range(3)] == ["a", "b", "c"]
    assert {order_least_loaded(scores, i)[0].pod_id for i in range(4)} == {"b", "c"}
    assert order_least_loaded(scores, 0)[-1].pod_id == "a"
    rng = random.Random(1)
    assert {order_random(scores, rng)[0].pod_id for _ in range(50)} == {"a", "b", "c"}


# -- burst predictions -----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return hash_prompt(HashConfig(), BS, tokens, cache_salt=salt)


def test_burst_predicts_the_shared_prefix_until_the_ttl() -> None:
    clock = Clock()
    burst = BurstTracker(ttl_s=2.0, clock=clock)
    system = list(range(1, 129))  # 8 blocks
    first = chain(system + [500] * 40)
    sibling = chain(system + [600] * 40)
    burst.record("a", first)
    assert burst.depths(sibling) == {"a": 8}  # the shared blocks only
    assert burst.depths(first) == {"a": len(first)}
    clock.t += 1.9
    assert burst.depths(sibling) == {"a": 8}
    clock.t += 0.2
    assert burst.depths(sibling) == {}
    assert len(burst) == 0


def test_burst_keeps_pods_apart_and_respects_salt() -> None:
    clock = Clock()
    burst = BurstTracker(ttl_s=2.0, clock=clock)
    tokens = list(range(1, 97))
    burst.record("a", chain(tokens))
    burst.record("b", chain(tokens[:48]))
    assert burst.depths(chain(tokens)) == {"a": 6, "b": 3}
    assert burst.depths(chain(tokens, salt="tenant-2")) == {}


def test_burst_renewal_extends_and_entries_are_bounded() -> None:
    clock = Clock()
    burst = BurstTracker(ttl_s=2.0, max_entries=10, clock=clock)
    hashes = chain(list(range(1, 65)))  # 4 blocks
    burst.record("a", hashes)
    clock.t += 1.5
    burst.record("a", hashes)  # a second sibling renews the claim
    clock.t += 1.0
    assert burst.depths(hashes) == {"a": 4}
    for pod in "bcdefg":
        burst.record(pod, hashes)
    assert len(burst) <= 10


def test_burst_ttl_zero_disables_predictions() -> None:
    burst = BurstTracker(ttl_s=0.0)
    hashes = chain(list(range(1, 65)))
    burst.record("a", hashes)
    assert burst.depths(hashes) == {}


def test_merge_prediction_counts_predicted_blocks_as_pool_hits() -> None:
    assert merge_prediction(["CPU", "CPU"], 0, 10) == (["CPU", "CPU"], 0)
    assert merge_prediction(["CPU", "CPU"], 4, 10) == (["GPU"] * 4, 2)
    assert merge_prediction(["GPU"] * 5, 2, 10) == (["GPU"] * 5, 0)
    assert merge_prediction([], 6, 3) == (["GPU"] * 3, 3)


def test_burst_prediction_decides_a_sibling_and_is_reported() -> None:
    cands = [Candidate("a", "x"),
             Candidate("b", "x", *merge_prediction([], 8, 9)[:1],
                       burst_blocks=merge_prediction([], 8, 9)[1])]
    order, reason = rank(scored(cands, 160), COSTS)
    assert order[0].pod_id == "b" and reason == REASON_BURST


# -- tokenizer and process weight -------------------------------------------------------------

def test_byte_tokenizer_matches_the_pods_rule() -> None:
    assert isinstance(load_tokenizer("pagekv-tiny"), ByteEncoder)
    assert load_tokenizer("pagekv-small").encode("hé") == [256, 104, 195, 169]
    with pytest.raises(ValueError, match="neither a built-in preset"):
        load_tokenizer("no-such-model")


def test_importing_the_router_does_not_load_torch() -> None:
    code = ("import sys, router.server, router.cli, router.routing; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


# -- the router hashes exactly what the pod's KV cache manager hashes --------------------------

@pytest.mark.parametrize("salt,lora_id,algo,seed", [
    ("", None, "sha256", "vllm-none-hash"),
    ("tenant-1", None, "sha256", "vllm-none-hash"),
    ("", "sql", "sha256_cbor", "seed-2"),
    ("tenant-2", "chat-7", "xxhash", "s"),
])
def test_router_chain_equals_the_pods_chain(salt: str, lora_id: str | None, algo: str,
                                            seed: str) -> None:
    from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
    from pagekv.kvnode.memory.request import Request
    from pagekv.proto.index.pod_adapters import PodAdapters
    from pagekv.proto.index.pod_record import PodInfo
    from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
    from pagekv.router.config import RouterConfig
    from pagekv.router.metrics import RouterMetrics
    from pagekv.router.pods import PodEntry
    from pagekv.router.routing import Router

    router = Router(RouterConfig(hash_algo=algo, hash_seed=seed), None, ByteEncoder(),
                    RouterMetrics())
    path = f"/adapters/{lora_id}"
    # A pod serving the adapter (its registration's `lora` field): the router hashes with
    # the path it publishes, as the pod hashes with its own.
    info = PodInfo("p", "p:1", "e", {}, {}, {}, 0.0, 1000,
                   adapters=PodAdapters({lora_id: path} if lora_id else {}))
    router.registry.pods = {"p": PodEntry(info, None)}  # type: ignore[arg-type]
    req = pb.GenerateRequest(text="system prompt " * 20 + "question?", cache_salt=salt,
                             lora_name=lora_id or "")
    prepared = router.prepare(req)
    assert prepared.forward.WhichOneof("prompt") == "token_ids"
    assert list(prepared.forward.token_ids.ids) == ByteEncoder().encode(req.text)
    # What kvnode.pod.server does with the same request, then the pod's own hasher.
    pod_req = Request("r", list(prepared.forward.token_ids.ids), cache_salt=salt or None,
                      lora_id=lora_id, lora_path=path if lora_id else None)
    pod_hashes = KVCacheManager(8, BS, hash_algo=algo, hash_seed=seed)._hashes(pod_req)
    assert prepared.block_hashes == pod_hashes
    assert prepared.lookup_blocks == (len(prepared.token_ids) - 1) // BS


def test_prepare_rejects_empty_prompts() -> None:
    from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
    from pagekv.proto.requests import BadRequest
    from pagekv.router.config import RouterConfig
    from pagekv.router.metrics import RouterMetrics
    from pagekv.router.routing import Router

    router = Router(RouterConfig(), None, ByteEncoder(), RouterMetrics())
    for req in (pb.GenerateRequest(), pb.GenerateRequest(text=""),
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))):
        with pytest.raises(BadRequest):
            router.prepare(req)


@pytest.mark.parametrize("with_bos", [True, False])
def test_hf_tokenizer_matches_the_pods(tmp_path: Path, with_bos: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from pagekv.proto.model_files.tokenizer import HFTokenizer

    vocab = {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3, "again": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:  # a Llama-style post-processor that puts BOS in front
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text('{"bos_token_id": 0}')
    text = "hello world again nope"
    ours = load_tokenizer(str(tmp_path)).encode(text)
    assert ours == HFTokenizer(tmp_path / "tokenizer.json", bos_token_id=0).encode(text)
    assert ours[0] == 0 if with_bos else ours[0] == 2


def test_speeds_within_the_band_count_as_the_median() -> None:
    from pagekv.router.scoring import settle_prefill_costs

    published = {"a": 160e-6, "b": 320e-6, "c": 250e-6, "d": 3e-3, "e": float("nan")}
    settled = settle_prefill_costs(published, band=2.0)
    median = 285e-6  # of a, b, c, d
    assert settled["a"] == settled["b"] == settled["c"] == pytest.approx(median)
    assert settled["d"] == 3e-3  # other hardware: its own figure
    assert "e" not in settled
    assert settle_prefill_costs(published, band=1.0)["a"] == 160e-6
    assert settle_prefill_costs({}, 2.0) == {}
    # A live pod that has not measured yet is scored like its measured peers, not slower.
    assert settle_prefill_costs(published, 2.0, ["new"])["new"] == pytest.approx(median)
    assert settle_prefill_costs({}, 2.0, ["new"]) == {}


def test_queue_cost_scales_with_the_pods_speed() -> None:
    fast = Candidate("a", "x", running=4, published_costs={"prefill": 0.5e-3})
    slow = Candidate("b", "x", running=4, published_costs={"prefill": 2e-3})
    s_fast, s_slow = scored([fast, slow], 1)
    assert s_fast.cost_s == pytest.approx(1 * 0.5e-3 + 4 * 0.05 * 0.5)
    assert s_slow.cost_s == pytest.approx(1 * 2e-3 + 4 * 0.05 * 2)


def test_published_load_is_discounted_by_our_calls_finished_since() -> None:
    c = Candidate("a", "x", waiting=1, running=3, inflight=0, finished_since_load=3)
    assert c.queue == 1
    c.finished_since_load = 9  # more than it published: never negative
    assert c.queue == 0
    c.inflight = 2
    assert c.queue == 2


def test_ties_go_first_to_the_pod_given_the_least_work_lately() -> None:
    cands = [Candidate("a", "x", recent=3.2), Candidate("b", "x", recent=0.4, running=1),
             Candidate("c", "x", recent=2.0)]
    costs = CostModel(1e-3, 1e-5, 1e-4, 1e-6)
    order, reason = rank(scored(cands, 100, costs), costs)
    assert [s.pod_id for s in order] == ["b", "c", "a"] and reason == REASON_TIE_LOAD

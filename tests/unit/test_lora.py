"""LoRA adapters (issue #32) against transformers + peft on a saved random Llama checkpoint:
adapters written by `peft` itself (random A and B: `init_lora_weights=False`), ranks 8/16/64,
on attention only and on attention + MLP. Logits to 1e-4 and greedy tokens equal to peft's
`generate`; a batch mixing three adapters and the base equals each run alone; a malformed
adapter is one clear error."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pagekv.kvnode.model.lora import AdapterError, load_adapter  # noqa: E402
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402
from tests.unit.test_model_hf import make_checkpoint  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERYWHERE = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "r8-attn": (8, 16, ATTENTION, False),
    "r16-all": (16, 8, EVERYWHERE, False),
    "r64-all-rslora": (64, 32, EVERYWHERE, True),
}
PROMPTS = [[5, 17, 3, 88, 41], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
           [60, 61, 9, 9, 9, 33, 90, 72, 12]]


def make_adapter(base, path: Path, rank: int, alpha: int, targets: list[str], rslora: bool,
                 seed: int):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          init_lora_weights=False, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():  # peft's random init is small: widen B so the adapter matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("base")
    base = make_checkpoint(base_dir, "llama")
    adapters = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(sorted(ADAPTERS.items())):
        path = tmp_path_factory.mktemp(name)
        adapters[name] = (make_adapter(base, path, rank, alpha, targets, rslora, 10 + i), path)
    runner = ModelRunner(str(base_dir), block_size=16, num_gpu_blocks=64, device="cpu",
                         max_model_len=128, attention_backend="torch")
    weights = {name: load_adapter(name, path, runner.model_config, torch.float32,
                                  torch.device("cpu"), 64)
               for name, (_, path) in adapters.items()}
    return base, adapters, runner, weights, base_dir


def greedy(runner: ModelRunner, prompts, loras, steps: int):
    """Batched prefill then batched decodes; each item with its own adapter (or None)."""
    per = runner.num_blocks // len(prompts)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    logits = runner.execute([SeqBatchItem(p, 0, t, lora) for p, t, lora
                             in zip(prompts, tables, loras, strict=True)])
    first = logits.clone()
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        batch = []
        for i, (p, t, lora) in enumerate(zip(prompts, tables, loras, strict=True)):
            outs[i].append(nxt[i])
            batch.append(SeqBatchItem([nxt[i]], len(p) + len(outs[i]) - 1, t, lora))
        logits = runner.execute(batch)
    return outs, first


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_an_adapter_gives_peft_s_logits_and_greedy_tokens(setup, name: str) -> None:
    base, adapters, runner, weights, _ = setup
    ref = adapters[name][0]
    steps = 6
    ours, first = greedy(runner, PROMPTS, [weights[name]] * len(PROMPTS), steps)
    plain, _ = greedy(runner, PROMPTS, [None] * len(PROMPTS), steps)
    assert ours != plain  # the adapter changes the answer (else this test proves nothing)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ids = torch.tensor([p])
            torch.testing.assert_close(first[i], ref(ids).logits[0, -1].float(), atol=1e-4,
                                       rtol=1e-4)
            gen = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
            assert ours[i] == gen[0, len(p):].tolist(), f"prompt {i}"


def test_a_batch_mixing_three_adapters_and_the_base_equals_each_alone(setup) -> None:
    _, _, runner, weights, _ = setup
    names = sorted(weights)
    prompts = PROMPTS + [[7, 8, 9, 10, 11, 12, 13]]
    loras = [weights[n] for n in names] + [None]
    mixed, first = greedy(runner, prompts, loras, 5)
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        alone, alone_first = greedy(runner, [p], [lora], 5)
        assert mixed[i] == alone[0]
        torch.testing.assert_close(first[i], alone_first[0], atol=1e-5, rtol=1e-5)


def test_the_adapter_weights_are_fused_as_the_model_fuses_its_projections(setup) -> None:
    _, _, runner, weights, _ = setup
    attn = weights["r8-attn"]
    assert attn.targets == tuple(sorted(ATTENTION)) and attn.rank == 8
    assert set(attn.layers[0]) == {"qkv", "o"}  # no MLP delta at all
    cfg = runner.model_config
    assert attn.layers[0]["qkv"].a_t.shape == (cfg.hidden_size, 24)
    assert attn.layers[0]["qkv"].b_t.shape == (24, cfg.q_size + 2 * cfg.kv_size)
    assert set(weights["r16-all"].layers[1]) == {"qkv", "o", "gate_up", "down"}


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
    (lambda d: (d / "adapter_config.json").write_text("{not json"), "cannot read"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 20), "cannot read"),
    (lambda d: _edit_config(d, use_dora=True), "use_dora not supported"),
    (lambda d: _edit_config(d, bias="all"), "bias='all' not supported"),
    (lambda d: (d / "adapter_model.safetensors").unlink(), "a .bin adapter is a pickle"),
])
def test_a_malformed_adapter_is_one_clear_error(setup, tmp_path: Path, damage, words) -> None:
    import shutil

    _, adapters, runner, _, _ = setup
    directory = tmp_path / "bad"
    shutil.copytree(adapters["r8-attn"][1], directory)
    damage(directory)
    with pytest.raises(AdapterError, match=words) as err:
        load_adapter("bad", directory, runner.model_config, torch.float32,
                     torch.device("cpu"), 64)
    assert "\n" not in str(err.value)


def test_an_adapter_of_another_base_model_or_over_the_rank_cap_is_refused(setup, tmp_path
                                                                           ) -> None:
    _, adapters, runner, _, _ = setup
    with pytest.raises(AdapterError, match="over --max-lora-rank 16"):
        load_adapter("big", adapters["r64-all-rslora"][1], runner.model_config, torch.float32,
                     torch.device("cpu"), 16)
    other = make_checkpoint(tmp_path / "wide", "llama3_rope")  # head_dim 32: other shapes
    make_adapter(other, tmp_path / "wide-adapter", 8, 8, ATTENTION, False, 3)
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter("wide", tmp_path / "wide-adapter", runner.model_config, torch.float32,
                     torch.device("cpu"), 64)


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


# --- through the engine: naming, queueing, the prefix cache and the tiers --------------------
def engine_for(setup, tmp_path: Path | None = None, **kw):
    from pagekv.kvnode.engine.engine import Engine

    _, adapters, _, _, base_dir = setup
    tiers = ({"cpu_offload_bytes": 8 * 8192, "disk_offload_bytes": 4 << 20,
              "disk_offload_dir": str(tmp_path)} if tmp_path is not None else {})
    modules = tuple(f"{name}={path}" for name, (_, path) in sorted(adapters.items()))
    return Engine(model=str(base_dir), num_gpu_blocks=24,
                  max_model_len=128, attention_backend="torch", lora_modules=modules,
                  **tiers, **kw)


def serve(engine, prompt, lora=None, steps=4):
    from pagekv.kvnode.engine.sampling_params import SamplingParams
    from tests.unit.engine_runs import run_request

    return run_request(engine, prompt, SamplingParams(max_tokens=steps, temperature=0.0,
                                                      ignore_eos=True), lora_id=lora)


LONG = [(i * 7) % 90 + 1 for i in range(70)]  # 4 full blocks of 16


def test_through_the_engine_an_adapters_prefix_is_its_own(setup) -> None:
    _, adapters, _, _, _ = setup
    engine = engine_for(setup)
    with torch.no_grad():
        ids = torch.tensor([LONG])
        want = adapters["r16-all"][0].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=4, min_new_tokens=4,
                                               do_sample=False)[0, len(LONG):].tolist()
    first, tokens = serve(engine, LONG, "r16-all")
    assert tokens == want and first.num_cached_tokens == 0
    again, tokens_again = serve(engine, LONG, "r16-all")
    assert again.num_cached_tokens == 64 and tokens_again == want  # a hit gives cold's tokens
    assert serve(engine, LONG, "r8-attn")[0].num_cached_tokens == 0  # another adapter's
    assert serve(engine, LONG)[0].num_cached_tokens == 0  # nor the base model's


def test_an_adapter_not_resident_waits_without_stalling_others(setup) -> None:
    from pagekv.kvnode.engine.sampling_params import SamplingParams

    engine = engine_for(setup, max_loras=1)  # one slot: the other adapters load on demand
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(None, LONG[:20], params, lora_id=name)
            for name in ("r16-all", "r64-all-rslora", "r8-attn")]
    base = engine.add_request(None, LONG[:30], params)
    done: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = tokens[out.request_id]
        if engine.last_step_idle:  # (every waiting request awaits a load: let it run)
            time.sleep(0.002)
    assert set(done) == {*rids, base}
    stats = engine.adapters.stats()
    assert stats.loads >= 2 and stats.evictions >= 2 and len(stats.resident) == 1
    for rid, name in zip(rids, ("r16-all", "r64-all-rslora", "r8-attn"), strict=True):
        assert done[rid] == serve(engine_for(setup), LONG[:20], name, steps=3)[1]


def test_an_unknown_adapter_is_refused_naming_it(setup) -> None:
    from pagekv.proto.requests import NoSuchAdapter

    engine = engine_for(setup)
    with pytest.raises(NoSuchAdapter, match="'nope' is not loaded"):
        serve(engine, LONG, "nope")


def test_adapter_blocks_come_back_from_dram_and_ssd_as_computed(setup, tmp_path: Path) -> None:
    engine = engine_for(setup, tmp_path)
    cold = serve(engine, LONG, "r8-attn")[1]
    for k in range(6):  # push it out of the 24-block pool, into DRAM and the SSD
        serve(engine, [(i * (11 + 2 * k)) % 90 + 1 for i in range(70)], "r16-all")
    out, tokens = serve(engine, LONG, "r8-attn")
    assert out.num_cached_tokens == 64 and tokens == cold
    by_tier = out.cached_tokens_by_tier
    assert by_tier.get("CPU", 0) + by_tier.get("DISK", 0) > 0
    engine.close()


def test_a_load_that_fails_later_fails_its_requests_and_the_pod_serves_on(setup, tmp_path
                                                                          ) -> None:
    import shutil

    from pagekv.kvnode.engine.lora_adapters import AdapterUnavailable
    from pagekv.kvnode.engine.sampling_params import SamplingParams

    _, adapters, _, _, base_dir = setup
    from pagekv.kvnode.engine.engine import Engine

    copy = tmp_path / "fragile"
    shutil.copytree(adapters["r8-attn"][1], copy)
    engine = Engine(model=str(base_dir), num_gpu_blocks=24, max_model_len=128,
                    attention_backend="torch", max_loras=1,
                    lora_modules=(f"first={adapters['r16-all'][1]}", f"fragile={copy}"))
    (copy / "adapter_model.safetensors").write_bytes(b"\x00" * 16)  # broken since start
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    doomed = engine.add_request(None, LONG[:20], params, lora_id="fragile")
    fine = engine.add_request(None, LONG[:20], params, lora_id="first")
    finished, failures = set(), []
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        finished |= {o.request_id for o in engine.step() if o.finished}
        failures += engine.take_failures()
        if engine.last_step_idle:
            time.sleep(0.002)
    assert finished == {fine}
    assert [rid for rid, _ in failures] == [doomed]
    error = failures[0][1]
    assert isinstance(error, AdapterUnavailable) and "cannot read" in str(error)
    assert serve(engine, LONG[:20], "first", steps=2)[0].finished  # serving on

"""Our loader + paged model against Hugging Face transformers on real checkpoints written by
``save_pretrained``: logits to 1e-4 (fp32) and greedy tokens equal to ``generate``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from pagekv.kvnode.model import ModelLoadError  # noqa: E402
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402

VOCAB = 96
PROMPTS = [
    "w5 w17 w3 w88 w41",
    "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21",
    "w60 w61 w9 w9 w9 w33 w90 w72 w12",
]

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # wide logits: greedy ties would make token comparisons flaky
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
            "head_dim": 32,  # head_dim from config, != hidden / heads
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(1, VOCAB)} | {"[UNK]": 0}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(path: Path, case: str, seed: int = 0, **save_kwargs):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**(_COMMON | extra))
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0, which would hide a bias bug
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(std=0.2)
    model.save_pretrained(str(path), **save_kwargs)
    _write_tokenizer(path)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(path, request.param), path


def _runner(path: Path, block_size: int = 16) -> ModelRunner:
    return ModelRunner(str(path), block_size=block_size, num_gpu_blocks=64, device="cpu",
                       max_model_len=128, attention_backend="torch")


def _shuffled_tables(runner: ModelRunner, n: int, seed: int) -> list[list[int]]:
    ids = list(range(runner.num_blocks))
    random.Random(seed).shuffle(ids)
    per = runner.num_blocks // n
    return [ids[i * per : (i + 1) * per] for i in range(n)]


def greedy_paged(runner: ModelRunner, prompts: list[list[int]], steps: int,
                 seed: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    """Batched prefill of every prompt, then one batched decode per step."""
    tables = _shuffled_tables(runner, len(prompts), seed)
    logits = runner.execute([SeqBatchItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    first_logits = logits.clone()
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        batch = []
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
            outs[i].append(nxt[i])
            batch.append(SeqBatchItem([nxt[i]], len(p) + len(outs[i]) - 1, t))
        logits = runner.execute(batch)
    return outs, first_logits


def test_logits_and_greedy_match_transformers(checkpoint):
    hf, path = checkpoint
    runner = _runner(path)
    assert runner.model_config.architecture == type(hf).__name__
    prompts = [runner.tokenizer.encode(p, add_bos=False) for p in PROMPTS]
    assert all(0 not in p for p in prompts)  # every word is in the vocab
    steps = 6
    ours, first_logits = greedy_paged(runner, prompts, steps)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            ref = hf(ids).logits[0, -1].float()
            torch.testing.assert_close(first_logits[i], ref, atol=1e-4, rtol=1e-4)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                              min_new_tokens=steps, do_sample=False)
            assert ours[i] == gen[0, len(p):].tolist(), f"prompt {i}"


def test_prefill_logits_every_position_via_chunks(checkpoint):
    """Feeding a prompt in uneven chunks on top of its own cached prefix gives the HF logits
    at each chunk's last position (chunked prefill over cached blocks)."""
    hf, path = checkpoint
    runner = _runner(path, block_size=8)
    p = runner.tokenizer.encode(PROMPTS[1], add_bos=False)
    table = _shuffled_tables(runner, 1, seed=3)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float()
    done = 0
    for size in (3, 7, 1, 9, 1):
        logits = runner.execute([SeqBatchItem(p[done : done + size], done, table)])
        done += size
        torch.testing.assert_close(logits[0], ref[done - 1], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_checkpoint(tmp_path, "llama", seed=1, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    runner = _runner(tmp_path)
    p = runner.tokenizer.encode(PROMPTS[0], add_bos=False)
    logits = runner.execute([SeqBatchItem(p, 0, [3, 1])])
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-4)


@pytest.fixture
def llama_dir(tmp_path):
    make_checkpoint(tmp_path, "llama", seed=2)
    return tmp_path


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_a_clear_error(llama_dir, missing):
    (llama_dir / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
        _runner(llama_dir)


def test_missing_shard_is_named(tmp_path):
    make_checkpoint(tmp_path, "llama", seed=1, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        _runner(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(llama_dir):
    cfg_path = llama_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        _runner(llama_dir)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in msg
    assert isinstance(err.value, ValueError)


def test_wrong_tensor_shape_names_tensor_and_shapes(llama_dir):
    from safetensors.torch import load_file, save_file

    file = llama_dir / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert tuple(tensors[name].shape) == (32, 64)
    tensors[name] = torch.zeros(48, 64)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as err:
        _runner(llama_dir)
    msg = str(err.value)
    assert name in msg and "(48, 64)" in msg and "(32, 64)" in msg


def test_missing_tensor_is_named(llama_dir):
    from safetensors.torch import load_file, save_file

    file = llama_dir / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.norm.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        _runner(llama_dir)


def test_unknown_preset_or_path():
    with pytest.raises(ModelLoadError, match="pagekv-tiny"):
        ModelRunner("no-such-model-anywhere", num_gpu_blocks=8, device="cpu")


def test_hf_tokenizer_roundtrip(llama_dir):
    runner = _runner(llama_dir)
    ids = runner.tokenizer.encode("w3 w4 w95", add_bos=False)
    assert ids == [3, 4, 95]
    assert runner.tokenizer.decode(ids) == "w3 w4 w95"

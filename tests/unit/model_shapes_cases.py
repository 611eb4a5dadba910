"""Shared by the checkpoint-shape tests (tests/unit/test_model_shapes_*.py): the shapes
real models ship (CASES), each written by transformers' ``save_pretrained`` with random
weights, transformers' ``from_pretrained`` as the reference, our paged runner, and the check
that the two agree (logits at 1e-4 in fp32 at every prompt and decode position, greedy
tokens). The saved (checkpoint per case) and one_thread fixtures are in conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402

BLOCK = 8
STEPS = 7
# 1, 2 and 3 blocks of 8; every prompt's decodes cross a block boundary (12 -> 8, 20 -> 16,
# 28 -> 24).
PROMPTS = [
    [5, 17, 3, 88, 41],
    [60, 61, 9, 9, 9, 33, 90, 72, 12, 7, 7, 19, 2],
    list(range(1, 22)),
]
WORDS = 96  # the tokenizer's vocabulary: w0..w95

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
BASE = dict(
    vocab_size=WORDS,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # wide logits: greedy near-ties would make token checks flaky
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# name -> (architecture, config overrides, options: dtype, max_model_len, edit of config.json)
CASES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("llama", {}, {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}, {}),
    "llama_head_dim_32": ("llama", {"head_dim": 32}, {}),
    "llama_head_dim_8_mha": ("llama", {"head_dim": 8, "num_key_value_heads": 4}, {}),
    "llama_mqa": ("llama", {"num_key_value_heads": 1}, {}),
    "llama_gqa_8_to_2": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}, {}),
    "llama_theta_1e6": ("llama", {"rope_theta": 1e6}, {}),
    "llama_theta_100": ("llama", {"rope_theta": 100.0}, {}),
    "llama_rope_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.5}}, {}),
    "llama_rope_dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, {}),
    "llama_rope_llama3": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}, {}),
    "llama_rope_llama3_no_orig": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}},
        {"edit": lambda c: c["rope_parameters"].pop("original_max_position_embeddings")}),
    "llama_rope_linear_4x_spelling": ("llama", {"rope_theta": 20000.0, "rope_scaling": {
        "rope_type": "linear", "factor": 2.0}}, {"edit": lambda c: c.update(
            rope_theta=c["rope_parameters"]["rope_theta"],
            rope_scaling={"type": "linear", "factor": c.pop("rope_parameters")["factor"]})}),
    "llama_rope_yarn": ("llama", {"rope_scaling": dict(_YARN)}, {}),
    "llama_rope_yarn_mscale": ("llama", {"rope_theta": 50000.0, "rope_scaling": _YARN | {
        "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}}, {}),
    "llama_rope_yarn_attn_factor": ("llama", {"rope_scaling": _YARN | {
        "attention_factor": 1.3, "truncate": False}}, {}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}, {}),
    "llama_eps_1e-5": ("llama", {"rms_norm_eps": 1e-5}, {}),
    "llama_vocab_97_tied": ("llama", {"vocab_size": 97, "tie_word_embeddings": True}, {}),
    "llama_vocab_1001": ("llama", {"vocab_size": 1001}, {}),
    "llama_fp16": ("llama", {}, {"dtype": torch.float16}),
    "llama_bf16_tied": ("llama", {"tie_word_embeddings": True}, {"dtype": torch.bfloat16}),
    "mistral_no_window": ("mistral", {"sliding_window": None}, {}),
    "mistral_window_48": ("mistral", {"sliding_window": 48, "head_dim": 32}, {}),
    "mistral_window_12": ("mistral", {"sliding_window": 12}, {}),  # shorter than the prompts
    "mistral_bias_keys_ignored": ("mistral", {"sliding_window": 4096}, {
        "edit": lambda c: c.update(attention_bias=True, mlp_bias=True)}),
    "qwen2": ("qwen2", {}, {}),
    "qwen2_tied_bf16": ("qwen2", {"tie_word_embeddings": True}, {"dtype": torch.bfloat16}),
    "qwen2_yarn_mqa": ("qwen2", {"num_key_value_heads": 1, "rope_scaling": dict(_YARN)}, {}),
    "qwen2_window_12_upper_layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 12,
                                              "max_window_layers": 1}, {}),
}


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def save_case(path: Path, case: str, seed: int = 0, **save_kwargs) -> None:
    """A random-weight checkpoint of ``case`` in ``path`` (config, safetensors, tokenizer)."""
    arch, overrides, opts = CASES[case]
    cfg_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**(BASE | overrides))
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # HF initialises biases and norms to 0 / 1, which hides bugs
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.to(opts.get("dtype", torch.float32)).save_pretrained(str(path), **save_kwargs)
    if "edit" in opts:  # config.json as other exporters write it
        _edit_config(path, opts["edit"])
    _write_tokenizer(path)


def _edit_config(path: Path, edit) -> None:
    file = path / "config.json"
    raw = json.loads(file.read_text())
    edit(raw)
    file.write_text(json.dumps(raw))


def reference(path: Path):
    """What transformers makes of the directory, in fp32, generating greedily with no EOS."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def runner(path: Path, max_model_len: int | None = 64, backend: str = "torch") -> ModelRunner:
    return ModelRunner(str(path), block_size=BLOCK, num_gpu_blocks=40, device="cpu",
                       max_model_len=max_model_len, attention_backend=backend)


def paged_greedy(r: ModelRunner, prompts: list[list[int]], steps: int
                 ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched prefill, then batched decodes; blocks handed out in reverse so no table is
    contiguous. Returns the greedy tokens and each prompt's logits at every step."""
    free = list(range(r.num_blocks))[::-1]
    per = -(-(max(map(len, prompts)) + steps) // BLOCK)
    tables = [[free.pop() for _ in range(per)][::-1] for _ in prompts]
    logits = r.execute([SeqBatchItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    outs: list[list[int]] = [[] for _ in prompts]
    seen = [[row] for row in logits]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        for o, t in zip(outs, nxt, strict=True):
            o.append(t)
        logits = r.execute([SeqBatchItem([o[-1]], len(p) + len(o) - 1, t)
                            for p, o, t in zip(prompts, outs, tables, strict=True)])
        for s, row in zip(seen, logits, strict=True):
            s.append(row)
    return outs, [torch.stack(s) for s in seen]


def assert_matches_hf(hf, r: ModelRunner, prompts=PROMPTS, steps: int = STEPS) -> None:
    ours, logits = paged_greedy(r, prompts, steps)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                              do_sample=False)[0, len(p):].tolist()
            assert ours[i] == gen, f"prompt {i}: greedy tokens differ"
            # HF logits over prompt + our tokens, at the prefill and each decode position.
            full = hf(torch.tensor([p + ours[i]])).logits[0].float()
            want = full[len(p) - 1 : len(p) + steps]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, i=i: f"prompt {i}: {m}")


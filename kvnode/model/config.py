"""Model configuration: the subset of a Hugging Face ``config.json`` the runner needs.

Accepts both the transformers 4.x spelling (top-level ``rope_theta`` + ``rope_scaling``) and
the 5.x one (``rope_parameters`` holding ``rope_theta`` and ``rope_type``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Architectures the Llama-family implementation covers, and what distinguishes them.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model directory, preset or config that cannot be loaded (missing file,
    unsupported architecture, tensor of the wrong shape...)."""


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    name: str = ""

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (HF configs may list several; see ``eos_token_ids``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def validate(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope_scaling type {self.rope.rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)} (or none)"
            )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # 5.x: everything under rope_parameters; 4.x: rope_theta at top level, rope_scaling dict.
    params = raw.get("rope_parameters")
    scaling = params if isinstance(params, dict) else raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    rope = RopeConfig(theta=float(theta if theta is not None else 10000.0))
    if not scaling:
        return rope
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    rope.rope_type = str(rope_type)
    if rope.rope_type == "default":
        return rope
    rope.factor = float(scaling.get("factor", 1.0))
    rope.low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    rope.high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    rope.original_max_position_embeddings = int(
        scaling.get("original_max_position_embeddings", 8192)
    )
    return rope


def config_from_hf_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """Build a ModelConfig from a parsed ``config.json``; raises ModelLoadError."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else None)
    if arch is None:
        # No architectures list: fall back on model_type, as transformers does.
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}.get(raw.get("model_type", ""), "<missing>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in config.json; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id")),
            name=name,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json is missing required field {exc.args[0]!r}") from exc
    # Mistral's sliding window only matters beyond its length; Qwen2 gates it by a flag.
    window = raw.get("sliding_window")
    if window and (arch == "MistralForCausalLM" or raw.get("use_sliding_window")):
        cfg.sliding_window = int(window)
    cfg.validate()
    return cfg

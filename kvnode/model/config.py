"""Model configuration: the subset of a Hugging Face ``config.json`` the runner needs.

Accepts both the transformers 4.x spelling (top-level ``rope_theta`` + ``rope_scaling``) and
the 5.x one (``rope_parameters`` holding ``rope_theta`` and ``rope_type``). A field the file
omits takes the default of transformers' config class for that architecture, so a sparse
``config.json`` means the same model to both. Anything that would change the math in a way
this implementation does not reproduce is refused at load time, naming the field.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from pagekv.proto.model_files.errors import ModelLoadError  # noqa: E402 - one definition for pod and router

logger = logging.getLogger(__name__)

# Architectures the Llama-family implementation covers, and what distinguishes them.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "swish")  # the same function in transformers
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}

# What transformers' LlamaConfig / MistralConfig / Qwen2Config use when config.json omits a
# field (tests/unit/test_model_shapes_config.py checks this table against the installed classes).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None,
                         "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                           "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
                         "bos_token_id": None, "eos_token_id": None, "sliding_window": 4096,
                         "use_sliding_window": False, "max_window_layers": 28},
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}

# vLLM's escape hatch for a max_model_len above what the checkpoint declares.
ALLOW_LONG_ENV = "PAGEKV_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | dynamic | llama3 | yarn
    factor: float = 1.0
    # llama3 and yarn: the context length the model was pre-trained at.
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    # Multiplies cos and sin (yarn's attention temperature); 1.0 for every other type.
    attention_factor: float = 1.0


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
    sliding_window_layers: tuple[int, ...] = ()  # the layers it applies to
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
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
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

    def max_len_limit(self) -> tuple[int, str, bool]:
        """The longest context this model serves exactly: (tokens, why, may_override).

        Like vLLM: ``max_position_embeddings``, times ``factor`` for ``linear``, and
        ``original_max_position_embeddings * factor`` for ``yarn``;
        ``PAGEKV_ALLOW_LONG_MAX_MODEL_LEN=1`` lifts that limit. ``dynamic`` RoPE's limit is
        hard: past ``max_position_embeddings`` transformers re-derives the base for the whole
        sequence, which cached keys cannot follow (below it, dynamic equals default)."""
        rope = self.rope
        limit, why = self.max_position_embeddings, "max_position_embeddings"
        if rope.rope_type == "linear":
            limit = int(limit * rope.factor)
            why = f"max_position_embeddings * rope factor {rope.factor:g}"
        elif rope.rope_type == "yarn":
            limit = int(rope.original_max_position_embeddings * rope.factor)
            why = f"yarn original_max_position_embeddings * factor {rope.factor:g}"
        hard = rope.rope_type == "dynamic"
        if hard:
            why = "max_position_embeddings (dynamic RoPE rescales beyond it)"
        return limit, why, not hard

    def resolve_max_model_len(self, requested: int | None) -> int:
        """``requested`` checked against ``max_len_limit`` (ModelLoadError, a ValueError),
        or the limit when None."""
        limit, why, may_override = self.max_len_limit()
        if requested is None:
            return limit
        if requested <= 0:
            raise ModelLoadError(f"max_model_len={requested} must be positive")
        if requested <= limit:
            return requested
        if may_override and os.environ.get(ALLOW_LONG_ENV, "").lower() in ("1", "true"):
            logger.warning("max_model_len=%d exceeds the model's %d (%s); allowed by %s",
                           requested, limit, why, ALLOW_LONG_ENV)
            return requested
        hint = f"; set {ALLOW_LONG_ENV}=1 to allow it anyway" if may_override else ""
        raise ModelLoadError(
            f"max_model_len={requested} is out of range for {self.name or self.architecture}: "
            f"must be in [1, {limit}] ({why}){hint}"
        )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    """RoPE settings, resolved the way transformers' ``modeling_rope_utils`` does."""
    # 4.x rope_scaling wins over 5.x rope_parameters, as in transformers; rope_theta inside
    # the dict wins over the top-level one.
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"unsupported rope_parameters {params!r}: per-layer RoPE settings")
    theta = params.get("rope_theta", raw.get("rope_theta", _COMMON_DEFAULTS["rope_theta"]))
    rope = RopeConfig(theta=float(theta))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(
            f"unsupported partial_rotary_factor={partial}: RoPE over the whole head only"
        )
    rope.rope_type = str(params.get("rope_type", params.get("type")) or "default")
    if rope.rope_type == "default" or rope.rope_type not in SUPPORTED_ROPE_TYPES:
        return rope  # an unsupported type is reported by ModelConfig.validate
    factor = params.get("factor")
    # A top-level original_max_position_embeddings (Phi-3 style) wins, then the rope dict's,
    # then max_position_embeddings.
    orig_key = "original_max_position_embeddings"
    orig = raw[orig_key] if orig_key in raw else params.get(orig_key) or max_pos
    rope.original_max_position_embeddings = int(orig)
    if factor is None and rope.rope_type == "yarn":
        factor = max_pos / rope.original_max_position_embeddings
    if factor is None:
        raise ModelLoadError(f"rope_scaling type {rope.rope_type!r} needs a 'factor'")
    rope.factor = float(factor)
    if rope.rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ModelLoadError(f"rope_scaling type 'llama3' needs {key!r}")
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
    elif rope.rope_type == "yarn":
        rope.beta_fast = float(params.get("beta_fast") or 32)
        rope.beta_slow = float(params.get("beta_slow") or 1)
        rope.truncate = bool(params.get("truncate", True))
        attn = params.get("attention_factor")
        if attn is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all:
                attn = _yarn_mscale(rope.factor, mscale) / _yarn_mscale(rope.factor, mscale_all)
            else:
                attn = _yarn_mscale(rope.factor)
        rope.attention_factor = float(attn)
    return rope


def _sliding_window(raw: dict[str, Any], arch: str, defaults: dict[str, Any]
                    ) -> tuple[int | None, tuple[int, ...]]:
    """The window transformers would apply and the layers it applies to. Llama has none;
    Mistral applies its window to every layer; Qwen2 only with use_sliding_window, to the
    layers layer_types (default: those from max_window_layers on) marks as sliding."""
    window = None if arch == "LlamaForCausalLM" else raw.get("sliding_window",
                                                             defaults["sliding_window"])
    if window is None:
        return None, ()
    layers = int(raw["num_hidden_layers"])
    sliding = tuple(range(layers))
    if arch == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window", defaults["use_sliding_window"]):
            return None, ()
        first = int(raw.get("max_window_layers", defaults["max_window_layers"]))
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window), sliding) if sliding else (None, ())


def config_from_hf_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """Build a ModelConfig from a parsed ``config.json``; raises ModelLoadError."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else None)
    if arch is None:
        # No architectures list: fall back on model_type, as transformers does.
        arch = _MODEL_TYPES.get(raw.get("model_type", ""), "<missing>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in config.json; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ModelLoadError(
            f"unsupported quantization_config (quant_method={method!r}): only unquantized "
            f"fp32/fp16/bf16 checkpoints load"
        )
    defaults = _COMMON_DEFAULTS | HF_DEFAULTS[arch]

    def get(key: str) -> Any:
        value = raw.get(key)
        return defaults[key] if value is None else value

    act = str(get("hidden_act"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported hidden_act {act!r} in config.json; supported: "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    # Only Llama reads attention_bias / mlp_bias; Qwen2 always has q/k/v biases (not o_proj);
    # Mistral never has biases. transformers ignores these keys elsewhere, so do we.
    llama = arch == "LlamaForCausalLM"
    attention_bias = llama and bool(get("attention_bias"))
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        max_pos = int(get("max_position_embeddings"))
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            # An explicit null means "as many as heads"; absent means the class default.
            num_key_value_heads=int(raw.get("num_key_value_heads", defaults["num_key_value_heads"])
                                    or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope=_parse_rope(raw, max_pos),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=llama and bool(get("mlp_bias")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            # bos/eos may be saved as an explicit null, which means none (not the default).
            bos_token_id=raw["bos_token_id"] if "bos_token_id" in raw else defaults["bos_token_id"],
            eos_token_ids=_as_id_list(raw["eos_token_id"] if "eos_token_id" in raw
                                      else defaults["eos_token_id"]),
            name=name,
        )
        cfg.sliding_window, cfg.sliding_window_layers = _sliding_window(raw, arch, defaults)
    except KeyError as exc:
        raise ModelLoadError(f"config.json is missing required field {exc.args[0]!r}") from exc
    cfg.validate()
    return cfg

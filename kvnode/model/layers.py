"""Building blocks of the Llama family: linear, RMSNorm, RoPE, SwiGLU MLP, paged attention.

Parameters are created with ``torch.empty`` on the target device and dtype (no random init:
the loader or the dummy initialiser fills them), and q/k/v and gate/up are each fused into one
matrix so a layer runs four matmuls instead of seven.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagekv.kvnode.model.attention import AttentionBackend
from pagekv.kvnode.model.attention.kv_cache import KVCache
from pagekv.kvnode.model.config import ModelConfig, RopeConfig
from pagekv.kvnode.model.lora import LoraBatch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, cached + new
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    lora: LoraBatch | None = None  # the batch's LoRA adapters, per token row (model/lora.py)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param((size,), dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the weight dtype, then scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, [head_dim/2]) for every supported ``rope_type``, computed
    as transformers' ``modeling_rope_utils`` does so that logits match to fp32 rounding."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope)
    if rope.rope_type != "llama3":
        # default, and dynamic: transformers only rescales dynamic RoPE past
        # max_position_embeddings, which ModelConfig.max_len_limit never lets us reach.
        return inv
    # Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, and the band in
    # between interpolated linearly in 1/wavelength.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    mid_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid_band, blended, scaled)


def _yarn_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those turning more than ``beta_fast`` times
    kept, with a linear ramp between. (The attention temperature is applied to cos/sin.)"""
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)

    def dim_for(rotations: float) -> float:
        ctx = rope.original_max_position_embeddings
        return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return interpolated * (1 - keep) + extrapolated * keep


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE; cos/sin computed once per step for the batch's
    positions and shared by all layers."""

    inv_freq: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, head_dim: int, rope: RopeConfig, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope).to(device), persistent=False)
        self.attention_factor = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D], broadcast over heads
        if self.attention_factor != 1.0:  # yarn scales q.k through both rotated operands
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> rotated, computed in fp32, returned in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                   dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                dtype, device)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None, layer: int = 0
                ) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add(layer, "gate_up", x, gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        out = self.down_proj(h)
        return lora.add(layer, "down", h, out) if lora is not None else out


class PagedSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        # Keys this layer may look back over; None = all (see LlamaForCausalLM.serve_up_to).
        self.sliding_window = cfg.sliding_window if layer_idx in cfg.sliding_window_layers else None
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias,
                               dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        i = self.layer_idx
        qkv = self.qkv_proj(x)
        if meta.lora is not None:
            qkv = meta.lora.add(i, "qkv", x, qkv)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv.key_caches[i], kv.value_caches[i]
        k_scale, v_scale = kv.k_scales[i], kv.v_scales[i]
        # Write first, then attend through the cache: new tokens see exactly what later
        # steps (and prefix hits) will read back, quantisation included.
        backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        window = {} if self.sliding_window is None else {"sliding_window": self.sliding_window}
        out = backend.paged_attention(
            q.float(), k_cache, v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, self.scale, k_scale, v_scale, **window,
        )
        attended = out.to(x.dtype).reshape(n, self.q_size)
        o = self.o_proj(attended)
        return meta.lora.add(i, "o", attended, o) if meta.lora is not None else o


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = PagedSelfAttention(cfg, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SwiGLU(cfg, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x), meta.lora,
                            self.self_attn.layer_idx)

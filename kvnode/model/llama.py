"""The Llama-family causal LM (Llama, Mistral, Qwen2) over the paged KV pool.

The three architectures differ only in configuration: Qwen2 adds q/k/v biases, Mistral (and
Qwen2 optionally) a sliding window, Llama 3.1 uses ``llama3`` RoPE scaling. Inputs are the flattened new tokens of every sequence in the batch (no padding).
"""

from __future__ import annotations

import torch
from torch import nn

from pagekv.kvnode.model.attention import AttentionBackend
from pagekv.kvnode.model.attention.kv_cache import KVCache
from pagekv.kvnode.model.config import ModelConfig
from pagekv.kvnode.model.layers import AttentionMetadata, DecoderLayer, RMSNorm, RotaryEmbedding


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, device)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )

    def serve_up_to(self, max_model_len: int) -> bool:
        """Drop the sliding windows no sequence of ``max_model_len`` tokens can exceed (full
        attention is the same there, and every backend has it). True if one remains: then
        the attention backend must implement ``sliding_window`` (the torch reference does)."""
        remaining = False
        for layer in self.decoder_layers():
            attn = layer.self_attn
            if attn.sliding_window is not None and attn.sliding_window >= max_model_len:
                attn.sliding_window = None
            remaining |= attn.sliding_window is not None
        return remaining

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers``, typed (an nn.ModuleList holds plain Modules)."""
        out: list[DecoderLayer] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            out.append(layer)
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.parameters():  # parameters() already dedups tied weights
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens[input_ids]
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, kv, meta, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32."""
        return torch.nn.functional.linear(hidden, self.lm_head).float()

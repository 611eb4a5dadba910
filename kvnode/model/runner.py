"""ModelRunner: the model, its paged KV pool, and one forward step over a mixed batch.

The scheduler hands ``execute`` a list of ``SeqBatchItem`` (new tokens, how many tokens of the
sequence are already in the cache, the whole block table) and gets back the logits of each
sequence's last new token. Prefill chunks (on top of a cached prefix or not) and decodes mix
freely in one batch; all per-token bookkeeping (positions, slot mapping, block tables) is
built with tensor ops.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.kvnode.model.attention import ENV_VAR as ATTENTION_ENV_VAR
from pagekv.kvnode.model.attention import REFERENCE_BACKEND, AttentionBackend, get_attention_backend
from pagekv.kvnode.model.attention.kv_cache import KVCache, KVCacheSpec, resolve_kv_dtype
from pagekv.kvnode.model.config import ModelConfig
from pagekv.kvnode.model.layers import AttentionMetadata
from pagekv.kvnode.model.loader import load_model
from pagekv.kvnode.model.lora import LoraBatch, LoraWeights
from pagekv.kvnode.model.memory_planning import (
    CudaMemoryProfile,
    GiB,
    MemoryPlan,
    copy_staging_bytes,
    measure_cuda_memory,
    plan_kv_cache,
)
from pagekv.proto.model_files.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqBatchItem:
    token_ids: list[int]  # the new tokens to run this step
    num_computed_tokens: int  # position of the first new token (= tokens already cached)
    block_ids: list[int]  # the sequence's whole block table
    lora: LoraWeights | None = None  # its LoRA adapter (None: the base model)


def _adapter_order(batch: Sequence[SeqBatchItem]) -> list[int] | None:
    """The batch's items grouped by LoRA adapter, in order of first appearance (stable);
    None when they already are (the common case)."""
    if all(it.lora is None for it in batch):  # the base model's step: nothing to order
        return None
    keys = [id(it.lora) if it.lora is not None else 0 for it in batch]
    first: dict[int, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    order = sorted(range(len(batch)), key=lambda i: (first[keys[i]], i))
    return None if order == list(range(len(batch))) else order


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_dtype_for(device: torch.device) -> torch.dtype:
    """fp32 on CPU; bf16 on CUDA where supported, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class ModelRunner:
    def __init__(
        self,
        model_config_or_path: str,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        num_gpu_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        device: str | None = None,
        attention_backend: str | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """`max_num_batched_tokens`: the largest step (the CUDA memory profile runs one of
        that many tokens; default 2048, the engine's)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.device = torch.device(device or default_device())
        self.dtype = model_dtype_for(self.device)
        self.block_size = block_size

        start = time.perf_counter()
        loaded = load_model(model_config_or_path, self.dtype, self.device)
        self.model = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.weights_bytes = self.model.weight_bytes()
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "Model loading took %.4f GiB and %.3f seconds",
            self.weights_bytes / GiB, self.load_seconds,
        )

        self.max_model_len = self._resolve_max_model_len(max_model_len)
        cfg = self.model_config
        self.kv_cache_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        self.kv_spec = KVCacheSpec(
            cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim,
            self.kv_cache_dtype,
        )
        self.attention: AttentionBackend = get_attention_backend(
            attention_backend, str(self.device)
        )
        if self.model.serve_up_to(self.max_model_len) and self.attention.name != "torch":
            # The C++ kernel has no sliding window; the reference does.
            if (attention_backend or os.environ.get(ATTENTION_ENV_VAR, "")).lower() == "cpp":
                raise ValueError(
                    f"attention backend 'cpp' has no sliding-window attention, which "
                    f"{cfg.name or cfg.architecture} needs beyond {cfg.sliding_window} tokens "
                    f"(sliding_window): use 'torch' or max_model_len <= {cfg.sliding_window}"
                )
            logger.info("sliding_window=%d < max_model_len=%d: torch attention backend",
                        cfg.sliding_window, self.max_model_len)
            self.attention = REFERENCE_BACKEND
        logger.debug("attention backend: %s", self.attention.name)
        self.max_num_batched_tokens = max_num_batched_tokens or 2048
        self.memory_plan: MemoryPlan = plan_kv_cache(
            block_size=block_size,
            block_bytes=self.kv_spec.block_bytes,
            max_model_len=self.max_model_len,
            device=self.device,
            num_gpu_blocks=num_gpu_blocks,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            profile=self._profile_cuda_memory if self.device.type == "cuda" else None,
        )
        self.kv_cache = KVCache.allocate(self.kv_spec, self.memory_plan.num_blocks, self.device)

    def _profile_cuda_memory(self) -> CudaMemoryProfile:
        """One forward pass of the largest step over a scratch KV cache, measuring the peak
        of memory it allocates above the weights (the scratch cache itself excluded)."""
        dev = self.device
        n = max(1, min(self.max_num_batched_tokens, self.max_model_len))
        blocks = -(-n // self.block_size)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.kv_cache = KVCache.allocate(self.kv_spec, blocks, dev)
        scratch = torch.cuda.memory_allocated(dev) - weights
        try:
            self.execute([SeqBatchItem([0] * n, 0, list(range(blocks)))])
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - weights - scratch
        finally:
            del self.kv_cache
            torch.cuda.empty_cache()
        return measure_cuda_memory(dev, weights, max(0, peak),
                                   copy_staging_bytes(self.kv_spec.block_bytes))

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (what read_block returns)."""
        return self.kv_spec.block_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_spec.bytes_per_token

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def _resolve_max_model_len(self, requested: int | None) -> int:
        # The model's limit (max_position_embeddings, RoPE scaling) and the
        # ValueError beyond it live with the config: ModelConfig.resolve_max_model_len.
        return self.model_config.resolve_max_model_len(requested)

    # ---- the forward step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Sequence[SeqBatchItem], all_positions: bool = False
                ) -> torch.Tensor:
        """Run one step; returns the logits [num_seqs, vocab] (float32) of each sequence's
        last new token, in batch order — or, with `all_positions`, of every new token
        [num_new_tokens, vocab] (perplexity, prompt log-probabilities)."""
        vocab = self.model_config.vocab_size
        if not batch:
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        order = None if all_positions else _adapter_order(batch)
        if order is not None:  # each adapter's rows made one run (model/lora.py)
            batch = [batch[i] for i in order]
        input_ids, positions, meta, last = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attention)
        logits = self.model.compute_logits(hidden if all_positions else hidden[last])
        if order is None:
            return logits
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(logits.device)]

    @torch.inference_mode()
    def execute_with_token_logits(
        self, batch: Sequence[SeqBatchItem], token_rows: Sequence[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`execute`'s logits, and those of chosen new tokens besides: `token_rows` are
        (batch item, offset among its new tokens, count), their logits returned concatenated
        in that order [sum of counts, vocab]. Only those rows go through the LM head, so the
        rest of the batch costs what it costs in `execute` (prompt log-probabilities)."""
        for i, off, count in token_rows:
            if not (0 <= i < len(batch) and count > 0 and off >= 0
                    and off + count <= len(batch[i].token_ids)):
                raise ValueError(f"token rows {(i, off, count)} are not new tokens of the batch")
        input_ids, positions, meta, last = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attention)
        starts = [0, *itertools.accumulate(len(it.token_ids) for it in batch)]
        extra = torch.cat([torch.arange(starts[i] + off, starts[i] + off + count)
                           for i, off, count in token_rows] or [torch.empty(0, dtype=torch.long)]
                          ).to(last.device)
        logits = self.model.compute_logits(hidden[torch.cat([last, extra])])
        return logits[: len(batch)], logits[len(batch) :]

    def _prepare(
        self, batch: Sequence[SeqBatchItem]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        n = len(batch)
        bs = self.block_size
        q_lens = torch.tensor([len(it.token_ids) for it in batch], dtype=torch.long)
        computed = torch.tensor([it.num_computed_tokens for it in batch], dtype=torch.long)
        b_lens = torch.tensor([len(it.block_ids) for it in batch], dtype=torch.long)
        tokens = torch.tensor(
            list(itertools.chain.from_iterable(it.token_ids for it in batch)), dtype=torch.long
        )
        flat_blocks = torch.tensor(
            list(itertools.chain.from_iterable(it.block_ids for it in batch)), dtype=torch.long
        )
        seq_lens = computed + q_lens
        self._validate(q_lens, computed, seq_lens, b_lens, tokens, flat_blocks)

        qsl = torch.zeros(n + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        seq_of_tok = torch.repeat_interleave(torch.arange(n), q_lens)
        positions = torch.arange(tokens.numel()) - qsl[seq_of_tok] + computed[seq_of_tok]

        # Padded block table (pad = block 0: never read past seq_len, but always a valid id).
        max_blocks = int(b_lens.max())
        tables = torch.zeros(n, max_blocks, dtype=torch.long)
        b_starts = torch.cumsum(b_lens, 0) - b_lens
        seq_of_blk = torch.repeat_interleave(torch.arange(n), b_lens)
        tables[seq_of_blk, torch.arange(flat_blocks.numel()) - b_starts[seq_of_blk]] = flat_blocks
        slots = tables[seq_of_tok, positions // bs] * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=tables.to(torch.int32).to(dev),
            seq_lens=seq_lens.to(torch.int32).to(dev),
            query_start_loc=qsl.to(torch.int32).to(dev),
            lora=LoraBatch.of([it.lora for it in batch], q_lens.tolist()),
        )
        return tokens.to(dev), positions.to(dev), meta, (qsl[1:] - 1).to(dev)

    def _validate(
        self,
        q_lens: torch.Tensor,
        computed: torch.Tensor,
        seq_lens: torch.Tensor,
        b_lens: torch.Tensor,
        tokens: torch.Tensor,
        flat_blocks: torch.Tensor,
    ) -> None:
        def first(mask: torch.Tensor) -> int:
            return int(mask.nonzero()[0, 0])

        if bool((q_lens == 0).any()):
            raise ValueError(f"batch item {first(q_lens == 0)} has no new tokens")
        if bool((computed < 0).any()):
            raise ValueError(f"batch item {first(computed < 0)} has num_computed_tokens < 0")
        short = seq_lens > b_lens * self.block_size
        if bool(short.any()):
            i = first(short)
            raise ValueError(
                f"batch item {i}: {int(seq_lens[i])} tokens need "
                f"{-(-int(seq_lens[i]) // self.block_size)} blocks of {self.block_size}, "
                f"block table has {int(b_lens[i])}"
            )
        too_long = seq_lens > self.max_model_len
        if bool(too_long.any()):
            i = first(too_long)
            raise ValueError(
                f"batch item {i}: {int(seq_lens[i])} tokens exceed max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        if bool(((tokens < 0) | (tokens >= vocab)).any()):
            raise ValueError(f"token id out of range [0, {vocab})")
        if flat_blocks.numel() and bool(
            ((flat_blocks < 0) | (flat_blocks >= self.num_blocks)).any()
        ):
            raise ValueError(f"block id out of range [0, {self.num_blocks})")

    # ---- whole-block operations (copy-on-write, offload tiers) -----------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src → dst in every layer, K and V. Call before ``execute``."""
        self.kv_cache.copy_blocks(pairs)

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block, all layers' K and V, as a flat uint8 CPU tensor of ``block_bytes``
        (a copy). Order: layer 0 K, layer 0 V, layer 1 K, ..."""
        return self.kv_cache.read_block(block_id)

    def write_block(self, block_id: int, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Inverse of ``read_block``."""
        self.kv_cache.write_block(block_id, data)

    def block_views(self, block_id: int) -> list[memoryview] | None:
        """The block's bytes in place, in ``read_block``'s order (None on a device pool)."""
        return self.kv_cache.block_planes(block_id)

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Many blocks at once: [n, block_bytes] uint8 (rows as ``read_block``); `out` is an
        optional reusable buffer."""
        return self.kv_cache.read_blocks(block_ids, out)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        self.kv_cache.write_blocks(block_ids, data)

"""KV cache tensors: dtypes, fp8 scales, allocation and whole-block byte packing.

Each layer owns one K and one V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_size]`` (see ``kvnode.model.attention.paged`` for why
this layout). Values are stored in the configured KV dtype and always dequantized to fp32
for compute: ``stored = (x / scale).to(kv_dtype)``, ``x ≈ stored.float() * scale``.

Scales: one ``k_scale`` and one ``v_scale`` per layer, default 1.0 — vLLM's default when a
checkpoint ships no calibrated scales. 1.0 is safe for E4M3 (max 448) and E5M2 (max 57344)
because K/V activations of Llama-family models stay far below those ranges; the per-layer
slots are where calibrated (checkpoint-provided) scales would go.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")

_NAMED_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp32": torch.float32,
    "float32": torch.float32,
}

FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a ``--kv-cache-dtype`` string to a torch dtype; ``auto`` = the model dtype
    (fp32 on CPU, bf16/fp16 on CUDA)."""
    key = kv_cache_dtype.lower()
    if key == "auto":
        return model_dtype
    if key not in _NAMED_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return _NAMED_DTYPES[key]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer and KV head, for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * element_size(self.dtype)

    @property
    def layer_block_bytes(self) -> int:
        """One block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_size * element_size(self.dtype)

    @property
    def block_bytes(self) -> int:
        """One block across all layers, K and V."""
        return self.bytes_per_token * self.block_size


@dataclass(slots=True)
class KVCache:
    """The allocated pool: per-layer K/V tensors and their scales."""

    spec: KVCacheSpec
    num_blocks: int
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)
    # block_planes' byte views of each layer's K and V, made on first use: indexing numpy
    # rows is ~0.2 µs, slicing 60 torch tensors per block ~2 ms (a 2,048-token pull: 0.26 s).
    # numpy arrays (torch's own .numpy(): this module imports no numpy, a CUDA host has none)
    _planes: list[Any] | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> KVCache:
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        # Zeroed, not empty: padded tails of a block are read (then masked) by attention,
        # and uninitialised memory could hold NaN bit patterns that survive a 0 weight.
        keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        values = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        return cls(spec, num_blocks, keys, values, [1.0] * spec.num_layers, [1.0] * spec.num_layers)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.block_bytes

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to ``dst`` in every layer (copy-on-write). All pairs read
        before any write, so chains such as (a→b, b→c) behave as simultaneous copies."""
        if not pairs:
            return
        device = self.key_caches[0].device
        idx = torch.tensor(pairs, dtype=torch.long, device=device)
        self._check_ids(idx)
        src, dst = idx[:, 0], idx[:, 1]
        for cache in (*self.key_caches, *self.value_caches):
            cache[dst] = cache[src]

    def read_block(self, block_id: int) -> torch.Tensor:
        """All layers' K and V of one block packed into a flat uint8 CPU tensor (a copy).
        Order: layer 0 K, layer 0 V, layer 1 K, ..."""
        self._check_id(block_id)
        n = self.spec.layer_block_bytes
        out = torch.empty(self.spec.block_bytes, dtype=torch.uint8)
        off = 0
        for k, v in zip(self.key_caches, self.value_caches, strict=True):
            out[off : off + n].copy_(_as_bytes(k[block_id]))
            out[off + n : off + 2 * n].copy_(_as_bytes(v[block_id]))
            off += 2 * n
        return out

    def block_planes(self, block_id: int) -> list[memoryview] | None:
        """One block's bytes where they lie, in `read_block`'s order (layer 0 K, layer 0 V,
        ...): writable byte views a socket can send from or receive into without a copy.
        None when the pool is not in host memory (a device pool)."""
        self._check_id(block_id)
        if self.key_caches[0].device.type != "cpu":
            return None
        if self._planes is None:
            self._planes = [cache.view(torch.uint8).numpy().reshape(self.num_blocks, -1)
                            for pair in zip(self.key_caches, self.value_caches, strict=True)
                            for cache in pair]
        return [plane[block_id].data for plane in self._planes]

    def write_block(self, block_id: int, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Inverse of ``read_block``."""
        self._check_id(block_id)
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        flat = data.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        if flat.numel() != self.spec.block_bytes:
            raise ValueError(
                f"write_block({block_id}): got {flat.numel()} bytes, a block is "
                f"{self.spec.block_bytes} bytes"
            )
        n = self.spec.layer_block_bytes
        flat = flat.to(self.key_caches[0].device)
        off = 0
        for k, v in zip(self.key_caches, self.value_caches, strict=True):
            _as_bytes(k[block_id]).copy_(flat[off : off + n])
            _as_bytes(v[block_id]).copy_(flat[off + n : off + 2 * n])
            off += 2 * n

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """`read_block` for many blocks at once: [n, block_bytes] uint8 on CPU, one gather
        per layer and K/V instead of one copy per block (tier demotion of a batch).

        `out` (uint8, at least n rows) is filled and its first n rows returned: a caller that
        demotes often reuses one buffer instead of faulting in fresh pages each time. On CUDA
        the blocks are gathered on the device and cross in one copy (pin `out` for speed).
        """
        n = len(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.key_caches[0].device)
        self._check_ids(idx)
        bb = self.spec.block_bytes
        if out is None or out.shape[0] < n or out.shape[1] != bb or out.dtype != torch.uint8:
            out = torch.empty((n, bb), dtype=torch.uint8)
        out = out[:n]
        if idx.device.type != "cpu":
            rows = torch.empty((n, bb), dtype=torch.uint8, device=idx.device)
            self.gather_rows(idx, rows)
            out.copy_(rows)
            return out
        ids = idx.numpy()
        planes_np = out.view(n, self.spec.num_layers, 2, self.spec.layer_block_bytes).numpy()
        for layer, (k, v) in enumerate(zip(self.key_caches, self.value_caches, strict=True)):
            for plane, cache in ((0, k), (1, v)):
                # numpy: one plain gather, no intra-op thread pool (see tiers.base)
                flat = cache.view(torch.uint8).numpy().reshape(cache.shape[0], -1)
                planes_np[:, layer, plane] = flat[ids]
        return out

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of `read_blocks`: `data` is [n, block_bytes] uint8."""
        n = len(block_ids)
        if tuple(data.shape) != (n, self.spec.block_bytes) or data.dtype != torch.uint8:
            raise ValueError(
                f"write_blocks: expected uint8 [{n}, {self.spec.block_bytes}], got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        device = self.key_caches[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        self._check_ids(idx)
        if device.type != "cpu":
            self.scatter_rows(idx, data.to(device))
            return
        planes = data.view(n, self.spec.num_layers, 2, self.spec.layer_block_bytes)
        ids = idx.numpy()
        for layer, (k, v) in enumerate(zip(self.key_caches, self.value_caches, strict=True)):
            for plane, cache in ((0, k), (1, v)):
                raw = cache.view(torch.uint8)  # [blocks, bs, heads, head_size * elem]
                src = planes[:, layer, plane].reshape(n, *raw.shape[1:])
                # numpy: a plain scatter, no intra-op thread pool (see tiers.base)
                raw.numpy()[ids] = src.numpy()

    # ---- device-side batches (the copy stream's gather and scatter) ----------------------
    def gather_rows(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Blocks `idx` (a long tensor on the pool's device) packed into the rows of `out`
        ([n, block_bytes] uint8 on the pool's device), as `read_blocks` packs them: one
        index_select per layer and K/V, all on the caller's current stream."""
        planes = out.view(idx.numel(), self.spec.num_layers, 2, self.spec.layer_block_bytes)
        for layer, (k, v) in enumerate(zip(self.key_caches, self.value_caches, strict=True)):
            for plane, cache in ((0, k), (1, v)):
                flat = cache.view(torch.uint8).view(cache.shape[0], -1)
                planes[:, layer, plane].copy_(flat.index_select(0, idx))

    def scatter_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Inverse of `gather_rows`: the rows of `rows` into blocks `idx` (index_copy_ of bytes:
        it has no fp8 kernels, and bytes are what the tiers store anyway)."""
        planes = rows.view(idx.numel(), self.spec.num_layers, 2, self.spec.layer_block_bytes)
        for layer, (k, v) in enumerate(zip(self.key_caches, self.value_caches, strict=True)):
            for plane, cache in ((0, k), (1, v)):
                flat = cache.view(torch.uint8).view(cache.shape[0], -1)
                flat.index_copy_(0, idx, planes[:, layer, plane])

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block id out of range [0, {self.num_blocks}): {ids.tolist()}")


def _as_bytes(block: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of one contiguous block (no copy)."""
    return block.reshape(-1).view(torch.uint8)

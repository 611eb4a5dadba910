"""Batched block copies between the KV pool on the device and rows of host memory.

A batch moves in chunks of at most `staging_rows` blocks through one staging tensor on the
device, every step on the copy stream (tiers.copy_stream):

- pool ▸ host (`to_host`): one gather of the chunk's blocks into the staging rows, then one
  copy per contiguous run of destination rows (slots of the DRAM slab: a batch demoted
  together gets consecutive slots, so usually one copy);
- host ▸ pool (`from_host`): one copy per contiguous run of source rows into the staging
  rows, then one scatter into the pool blocks.

Both first wait for the compute issued so far (the step that wrote or last read the pool
blocks). `to_host` also makes later compute wait for its gathers, so the pool may reuse the
blocks at once; compute that reads blocks `from_host` wrote must wait for its `done` event
(the tier connector holds them pinned until then). The staging tensor is reused by each
chunk and each batch: copies on one stream run in order, so no event is needed between them.

`transfer_for(runner)` is the one transfer of a runner whose pool is on CUDA (None on CPU,
where the tiers copy synchronously, as before); `make_copy_stream` is where tests put a CPU
stand-in for the CUDA stream.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.kvnode.model.attention.kv_cache import KVCache
from pagekv.kvnode.model.memory_planning import copy_staging_bytes
from pagekv.tiers.copy_stream import CopyEvent, CopyStream, CudaCopyStream, contiguous_runs


@dataclass(slots=True)
class Copy:
    """One submitted batch: `start` and `done` bracket it on the copy stream."""

    start: CopyEvent
    done: CopyEvent
    nbytes: int


class BlockTransfer:
    def __init__(self, kv_cache: KVCache, stream: CopyStream,
                 staging_bytes: int | None = None) -> None:
        """`staging_bytes`: default the size memory planning reserved for it."""
        self.kv = kv_cache
        self.stream = stream
        self.block_bytes = kv_cache.spec.block_bytes
        if staging_bytes is None:
            staging_bytes = copy_staging_bytes(self.block_bytes)
        self.staging_rows = max(1, staging_bytes // self.block_bytes)
        device = kv_cache.key_caches[0].device
        self.staging = torch.empty((self.staging_rows, self.block_bytes), dtype=torch.uint8,
                                   device=device)
        self.device = device

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> Copy:
        """Pool blocks `block_ids[i]` ▸ `host[rows[i]]`. Later compute may overwrite the
        blocks (it waits for the gathers); the CPU reads the rows after `done`."""
        pairs = self._pairs(block_ids, rows, host)
        stream = self.stream
        stream.wait_compute()
        start = stream.record()
        for chunk in self._chunks(pairs):
            ids = [b for _, b in chunk]
            stream.submit(functools.partial(self._gather, ids))
            gathered = stream.record()
            stream.submit(functools.partial(self._runs_to_host, chunk, host))
            stream.order_compute(gathered)  # the pool may overwrite these blocks after this
        return Copy(start, stream.record(), len(pairs) * self.block_bytes)

    def from_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]
                  ) -> Copy:
        """`host[rows[i]]` ▸ pool block `block_ids[i]`. Compute must not read (nor write)
        the blocks before `done` (stream.order_compute); the CPU may write the rows after it."""
        pairs = self._pairs(block_ids, rows, host)
        stream = self.stream
        stream.wait_compute()
        start = stream.record()
        for chunk in self._chunks(pairs):
            stream.submit(functools.partial(self._runs_from_host, chunk, host))
        return Copy(start, stream.record(), len(pairs) * self.block_bytes)

    def upload(self, block_ids: Sequence[int], rows: torch.Tensor) -> Copy:
        """Host rows [n, block_bytes] (pinned for an async copy) ▸ pool blocks, in order."""
        return self.from_host(block_ids, rows, range(len(block_ids)))

    def seconds(self, copy: Copy) -> float:
        """How long a completed copy ran on the stream."""
        return self.stream.elapsed_s(copy.start, copy.done)

    # -- internals (the submitted work runs on the copy stream) ---------------------------------
    def _pairs(self, block_ids: Sequence[int], rows: Sequence[int], host: torch.Tensor
               ) -> list[tuple[int, int]]:
        """(host row, block id), ascending rows, checked on the host (no device sync)."""
        if len(block_ids) != len(rows):
            raise ValueError(f"{len(block_ids)} blocks but {len(rows)} host rows")
        if host.dim() != 2 or host.shape[1] != self.block_bytes or host.dtype != torch.uint8:
            raise ValueError(f"host rows must be uint8 [n, {self.block_bytes}], got "
                             f"{host.dtype} {tuple(host.shape)}")
        num_blocks, num_rows = self.kv.num_blocks, host.shape[0]
        for b, r in zip(block_ids, rows, strict=True):
            if not (0 <= b < num_blocks and 0 <= r < num_rows):
                raise ValueError(f"block {b} / host row {r} out of range "
                                 f"[0, {num_blocks}) / [0, {num_rows})")
        return sorted(zip(rows, block_ids, strict=True))

    def _chunks(self, pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        step = self.staging_rows
        return [pairs[i:i + step] for i in range(0, len(pairs), step)]

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _gather(self, ids: list[int]) -> None:
        self.kv.gather_rows(self._index(ids), self.staging[: len(ids)])

    def _runs_to_host(self, chunk: list[tuple[int, int]], host: torch.Tensor) -> None:
        for i, row, n in contiguous_runs([r for r, _ in chunk]):
            host[row:row + n].copy_(self.staging[i:i + n], non_blocking=True)

    def _runs_from_host(self, chunk: list[tuple[int, int]], host: torch.Tensor) -> None:
        for i, row, n in contiguous_runs([r for r, _ in chunk]):
            self.staging[i:i + n].copy_(host[row:row + n], non_blocking=True)
        ids = [b for _, b in chunk]
        self.kv.scatter_rows(self._index(ids), self.staging[: len(ids)])


# -- one transfer per runner --------------------------------------------------------------------
_TRANSFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_copy_stream(runner) -> CopyStream | None:
    """The copy stream of a runner's pool: a CUDA stream on CUDA, none on CPU."""
    return CudaCopyStream(runner.device) if runner.device.type == "cuda" else None


def transfer_for(runner) -> BlockTransfer | None:
    """The runner's BlockTransfer (made once; the evictor, the connector and the DRAM tier
    share its stream and staging tensor), or None when its copies stay synchronous."""
    transfer = _TRANSFERS.get(runner)
    if transfer is None:
        stream = make_copy_stream(runner)
        if stream is None:
            return None
        transfer = _TRANSFERS[runner] = BlockTransfer(runner.kv_cache, stream)
    return transfer

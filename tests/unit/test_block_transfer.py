"""Batched pool <-> host copies (kvnode.engine.block_transfer) on CPU tensors, through a copy
stream that runs its work only when waited for (tests/unit/fake_copy_stream.py).

The reference is the pool's per-block packing, `KVCache.read_block` / `write_block`: one block
at a time, layer by layer, with no index tensors, chunks or runs.
"""

from __future__ import annotations

import pytest
import torch

from pagekv.kvnode.engine.block_transfer import BlockTransfer
from pagekv.kvnode.model.attention.kv_cache import KVCache, KVCacheSpec
from tests.unit.fake_copy_stream import FakeCopyStream

DTYPES = [torch.float32, torch.float16, torch.float8_e4m3fn]


def pool(dtype=torch.float32, blocks: int = 12) -> KVCache:
    spec = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=dtype)
    kv = KVCache.allocate(spec, blocks, "cpu")
    gen = torch.Generator().manual_seed(0)
    for cache in (*kv.key_caches, *kv.value_caches):
        cache.view(torch.uint8).copy_(torch.randint(0, 120, cache.view(torch.uint8).shape,
                                                    generator=gen, dtype=torch.uint8))
    return kv


def transfer(kv: KVCache, staging_rows: int, lag: int = 10**6):
    stream = FakeCopyStream(lag=lag)
    return BlockTransfer(kv, stream, staging_bytes=staging_rows * kv.spec.block_bytes), stream


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter_rows_pack_like_read_block(dtype):
    kv = pool(dtype)
    ids = [7, 0, 3, 11]
    rows = torch.empty((4, kv.spec.block_bytes), dtype=torch.uint8)
    kv.gather_rows(torch.tensor(ids), rows)
    assert torch.equal(rows, torch.stack([kv.read_block(i) for i in ids]))
    other = pool(dtype)
    other.scatter_rows(torch.tensor([1, 2, 5, 9]), rows)
    for src, dst in zip(ids, [1, 2, 5, 9], strict=True):
        assert torch.equal(other.read_block(dst), kv.read_block(src))


@pytest.mark.parametrize("staging_rows", [1, 3, 64])
def test_to_host_lands_every_block_in_its_row_through_a_small_staging_buffer(staging_rows):
    kv = pool()
    t, stream = transfer(kv, staging_rows)
    host = torch.zeros((10, kv.spec.block_bytes), dtype=torch.uint8)
    ids, rows = [5, 1, 8, 2, 9, 0, 4], [6, 0, 1, 2, 9, 3, 4]  # rows not in block order
    want = {r: kv.read_block(b) for b, r in zip(ids, rows, strict=True)}
    copy = t.to_host(ids, host, rows)
    assert copy.nbytes == len(ids) * kv.spec.block_bytes
    copy.done.synchronize()
    for r in range(10):
        assert torch.equal(host[r], want.get(r, torch.zeros_like(host[r]))), r


def test_to_host_gathers_before_compute_may_overwrite_the_blocks():
    kv = pool()
    t, stream = transfer(kv, staging_rows=2)
    want = [kv.read_block(b) for b in (3, 4, 5)]
    host = torch.zeros((3, kv.spec.block_bytes), dtype=torch.uint8)
    copy = t.to_host([3, 4, 5], host, [0, 1, 2])
    assert stream.compute_waits == 2  # one per chunk of the staging buffer
    kv.write_blocks([3, 4, 5], torch.full((3, kv.spec.block_bytes), 255, dtype=torch.uint8))
    copy.done.synchronize()  # the host copies run now, long after the pool changed
    assert all(torch.equal(host[i], want[i]) for i in range(3))


@pytest.mark.parametrize("staging_rows", [1, 2, 16])
def test_from_host_writes_the_pool_only_when_the_copy_runs(staging_rows):
    kv = pool()
    t, stream = transfer(kv, staging_rows)
    host = torch.randint(0, 200, (8, kv.spec.block_bytes), dtype=torch.uint8)
    before = {b: kv.read_block(b) for b in (2, 6, 7, 10, 11)}
    copy = t.from_host([6, 2, 11, 10, 7], host, [1, 3, 4, 5, 7])
    assert all(torch.equal(kv.read_block(b), x) for b, x in before.items())  # not yet
    assert not copy.done.query()
    copy.done.synchronize()
    for b, r in zip([6, 2, 11, 10, 7], [1, 3, 4, 5, 7], strict=True):
        assert torch.equal(kv.read_block(b), host[r]), (b, r)


def test_round_trip_of_a_batch_larger_than_the_staging_buffer():
    kv = pool(torch.float16, blocks=40)
    t, stream = transfer(kv, staging_rows=3)
    ids = list(range(0, 40, 2))  # 20 blocks, 7 chunks
    ref = torch.stack([kv.read_block(b) for b in ids])
    host = torch.zeros((25, kv.spec.block_bytes), dtype=torch.uint8)
    slots = [24 - i for i in range(20)]  # descending slots: still runs after sorting
    t.to_host(ids, host, slots).done.synchronize()
    back = pool(torch.float16, blocks=40)
    dst = list(range(1, 40, 2))
    t2, _ = transfer(back, staging_rows=3)
    t2.from_host(dst, host, slots).done.synchronize()
    assert torch.equal(torch.stack([back.read_block(b) for b in dst]), ref)


def test_host_copies_are_one_per_contiguous_run(monkeypatch):
    kv = pool()
    t, stream = transfer(kv, staging_rows=8)
    host = torch.zeros((10, kv.spec.block_bytes), dtype=torch.uint8)
    t.to_host([0, 1, 2, 3, 4], host, [2, 3, 4, 8, 9])
    assert len(stream.jobs) == 2  # one gather and one job of host copies for the one chunk
    lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
    copies = []
    real = torch.Tensor.copy_

    def counting(self, src, non_blocking=False):
        if lo <= self.data_ptr() < hi:
            copies.append((self.shape[0], non_blocking))
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    stream.drain()
    assert copies == [(3, True), (2, True)]  # rows [2, 3, 4] and [8, 9]: two async copies


def test_bad_arguments_are_refused_before_anything_is_submitted():
    kv = pool()
    t, stream = transfer(kv, staging_rows=4)
    host = torch.zeros((4, kv.spec.block_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="out of range"):
        t.to_host([12], host, [0])
    with pytest.raises(ValueError, match="out of range"):
        t.from_host([0], host, [4])
    with pytest.raises(ValueError, match="host rows"):
        t.from_host([0], host[:, :8], [0])
    with pytest.raises(ValueError, match="2 blocks but 1"):
        t.to_host([0, 1], host, [0])
    assert stream.jobs == []

"""The serving side of a cross-pod pull, in the engine: find a chain's blocks, pin, read, pack.

`is_chain_of` first: the caller's prompt tokens and salt must hash to the chain it asks for
(a tenant's blocks go only to a pull made for that tenant's request).

`open` (on the engine thread) walks the asked chain through the pool, then the tiers, and
stops at the first block this pod does not hold. The pool blocks of the run get a reference
each, as a request's would, so no eviction can hand them out for reuse while a peer reads
them; `close` gives the references back (tail first, as a request frees). Rows are read off
the engine thread: a pinned pool block is never written (its content is fixed by its hash
and no one can be handed it for reuse), so `read_pool` may gather it while a step runs; tier
blocks are copied where they lie (TierChain.read_run). `read_entries` packs the rows as the
entries a peer receives (tiers.peer_entries, whose `unpack_block` the puller,
kvnode.engine.peer_pull, checks them with): the pod's transfer service only sends bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagekv.kvnode.memory.block_pool import KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.proto.hashing import hash_prompt, lora_key
from pagekv.proto.medium import Medium
from pagekv.tiers.chain import TierChain
from pagekv.tiers.peer_entries import KvLayout, pack_block


@dataclass(frozen=True, slots=True)
class ChainClaim:
    """What a puller shows to be served a chain: the prompt tokens of its blocks from the
    root on, and the cache salt and LoRA adapter its request was hashed with."""

    tokens: list[int]
    cache_salt: str | None = None
    lora_id: str | None = None


@dataclass(slots=True)
class ExportRun:
    hashes: list[bytes]  # the leading run of the asked chain this pod holds
    media: list[Medium]  # where each one is
    pinned: list[KVCacheBlock] = field(default_factory=list)  # the pool's, referenced
    closed: bool = False
    parent: bytes | None = None  # the block hashes[0] continues (None: the chain's root)

    def pool_ids(self, lo: int, hi: int) -> list[int]:
        """Block ids of the pool blocks among hashes[lo:hi] (they are pinned in order)."""
        first = self.media[:lo].count(Medium.GPU)
        return [b.block_id for b in
                self.pinned[first : first + self.media[lo:hi].count(Medium.GPU)]]


class KvExporter:
    def __init__(self, manager: KVCacheManager, runner, chain: TierChain | None,
                 layout: KvLayout, salt_block: Callable[[Sequence[int]], int] = lambda _: 0,
                 adapter_path: Callable[[str], str | None] = lambda _: None) -> None:
        """`salt_block`: which block of a prompt carries its salt (after the shared region's:
        proto/shared_prefix.py), as the pod's own requests hash; `adapter_path`: a LoRA
        adapter's directory by name (None: not on this pod), which its hash holds too."""
        self.adapter_path = adapter_path
        self.manager = manager
        self.salt_block = salt_block
        self.runner = runner
        self.chain = chain
        self.layout = layout
        self.open_runs = 0  # runs not closed yet (a leak check for tests and /metrics)

    def is_chain_of(self, block_hashes: Sequence[bytes], parent_hash: bytes | None,
                    claim: ChainClaim) -> bool:
        """Any thread. Whether `block_hashes` (continuing `parent_hash`) end the chain the
        claim's tokens give when hashed as this pod hashes a request. The salt is in block
        0's hash (block k after k shared-region blocks, which are public) and every hash is
        its parent's child, so only a caller holding the salt and
        the very prompt gets another request's blocks: hashes read from the index are not
        enough, and this pod keeps nothing per block to decide it."""
        bs = self.manager.block_size
        blocks = len(claim.tokens) // bs
        first = blocks - len(block_hashes)
        if not block_hashes or len(claim.tokens) % bs or first < 0:
            return False
        lora = None
        if claim.lora_id:
            path = self.adapter_path(claim.lora_id)
            if path is None:
                return False  # an adapter this pod does not serve: none of its blocks here
            lora = lora_key(claim.lora_id, path)
        chain = hash_prompt(self.manager.hash_config, bs, claim.tokens, claim.cache_salt,
                            lora, salt_block=self.salt_block(claim.tokens))
        return (chain[first:] == list(block_hashes)
                and (parent_hash or None) == (chain[first - 1] if first else None))

    def open(self, block_hashes: Sequence[bytes], parent_hash: bytes | None = None
             ) -> ExportRun:
        """Engine thread. The run this pod can serve, its pool blocks pinned; the chain
        asked for continues `parent_hash` (None: it starts at the root)."""
        cached = self.manager.block_pool.get_cached_block
        blocks = [cached(h) for h in block_hashes]
        below = (self.chain.media_below(block_hashes) if self.chain is not None
                 else [None] * len(block_hashes))
        run = ExportRun([], [], parent=parent_hash)
        for h, block, medium in zip(block_hashes, blocks, below, strict=True):
            if block is not None:
                run.pinned.append(block)
                medium = Medium.GPU
            elif medium is None:
                break
            run.hashes.append(h)
            run.media.append(medium)
        self.manager.pin(run.pinned)
        self.open_runs += 1
        return run

    def read_pool(self, run: ExportRun, lo: int, hi: int) -> torch.Tensor:
        """Any thread, while the run is open. The pool blocks among run.hashes[lo:hi], as
        [n, block_bytes] uint8 rows on the CPU."""
        return self.runner.read_blocks(run.pool_ids(lo, hi)).cpu()

    def read_below(self, run: ExportRun, lo: int, hi: int) -> list[torch.Tensor]:
        """Any thread. Copies of the tier blocks among run.hashes[lo:hi], up to the first that
        is gone (the run is cut there)."""
        if self.chain is None:
            return []
        hashes = [h for h, m in zip(run.hashes[lo:hi], run.media[lo:hi], strict=True)
                  if m != Medium.GPU]
        return self.chain.read_run(hashes)

    def pool_blocks(self, run: ExportRun, lo: int, hi: int) -> list[KVCacheBlock | None]:
        """The pool block of each of run.hashes[lo:hi] (None: a tier's), pinned by the run."""
        pinned = iter(run.pinned[run.media[:lo].count(Medium.GPU):])
        return [next(pinned) if m == Medium.GPU else None for m in run.media[lo:hi]]

    def payloads(self, run: ExportRun, lo: int, hi: int) -> list[list[memoryview]]:
        """Any thread, while the run is open. The blocks run.hashes[lo:hi] in order, each as
        its raw payload's pieces (`read_block`'s order), cut at the first tier block that is
        gone: a host pool's blocks where they lie (they are pinned: nothing writes them), a
        device pool's and the tiers' blocks copied into rows of their own."""
        media = run.media[lo:hi]
        ids = run.pool_ids(lo, hi)
        in_place = [self.runner.block_views(i) for i in ids]
        pool: list[list[memoryview]] = (
            [[row.numpy().data] for row in self.read_pool(run, lo, hi)]
            if ids and any(v is None for v in in_place) else in_place)
        pool_blocks = iter(pool)
        below = iter(self.read_below(run, lo, hi) if any(m != Medium.GPU for m in media)
                     else ())
        out: list[list[memoryview]] = []
        for m in media:
            if m == Medium.GPU:
                out.append(next(pool_blocks))
                continue
            row = next(below, None)
            if row is None:
                break
            out.append([row.numpy().data])
        return out

    def read_entries(self, run: ExportRun, lo: int, hi: int, compress: bool = False
                     ) -> list[bytes]:
        """Any thread, while the run is open. The blocks run.hashes[lo:hi] in order, each
        packed as the entry a peer receives (its parent the block before it), cut at the
        first tier block that is gone. `compress`: LZ4 where it pays (tiers.peer_entries)."""
        media = run.media[lo:hi]
        pool = iter(self.read_pool(run, lo, hi) if Medium.GPU in media else ())
        below = iter(self.read_below(run, lo, hi) if any(m != Medium.GPU for m in media)
                     else ())
        parent = run.hashes[lo - 1] if lo else run.parent
        out = []
        for h, m in zip(run.hashes[lo:hi], media, strict=True):
            row = next(pool) if m == Medium.GPU else next(below, None)
            if row is None:
                break
            out.append(pack_block(self.layout, h, parent, row.numpy(), compress))
            parent = h
        return out

    def close(self, run: ExportRun) -> None:
        """Engine thread. Release the run's pool blocks (once)."""
        if run.closed:
            return
        run.closed = True
        self.manager.unpin(run.pinned)
        self.open_runs -= 1

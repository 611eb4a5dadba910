"""What one vLLM pod holds, in PageKV's full block hashes, learned from its KV events.

vLLM names a block by the low 64 bits of its hash by default (proto.vllm_events.short_hash);
the index and the router need the full hash. A stored event carries its blocks' tokens and
the short hash of the block before them, so the full hashes can be recomputed with PageKV's
own chain (proto.hashing): the parent's full hash (known from an earlier event, or the
seeded root for block 0), the tokens of each block, and the event's extra keys if it has
them. Each recomputed hash must have the short form the event says, or the event is refused:
a pod whose seed or algorithm is not the one configured here, or a block whose extra keys
(a LoRA adapter, a cache salt, an image) the event does not carry, can never be indexed
under a wrong name.

A stored event's tokens span every block from its parent to its last hash; a block already
cached in between is left out of its hashes (vLLM and PageKV alike), so the walk may pass
over as many blocks as the tokens have beyond the hashes. An event without tokens (vLLM's
offloading tiers send them) can only name blocks already known here.

The book keeps, per external hash (the int, or the digest when the pod sends digests), the
full hash, its parent's full hash, its bucket (the index files a claim under its chain's
block 0: a block's bucket is its parent's, block 0's its own) and its tier mask: exactly for
every block the pod holds, and for a bounded number of blocks it held recently, so a block
that comes back, or whose child is stored after it left, is still known. Since every block
stored has a known parent (or none), every block is placed at once, and the book hands the
index publisher its claim writes directly (`BucketChange`s, see proto.index.mirror's
PlacedClaims) rather than events for another mirror to replay. Pure and single-threaded:
the ingester owns it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from pagekv.proto.hashing import HashConfig
from pagekv.proto.index.mirror import BucketChange
from pagekv.proto.index.schema import bucket_of
from pagekv.proto.medium import ALL_BITS, MEDIUMS, Medium
from pagekv.proto.vllm_events import (
    ExternalHash,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
)

_MEDIUM = {m.value: m for m in MEDIUMS}

# Why an event (or the part of one naming unknown blocks) was not applied: a metric label.
REFUSAL_REASONS = ("block_size", "hash_length", "hash_mismatch", "unknown_parent",
                   "unknown_hash", "lora", "medium", "kv_group", "book_full", "bad_event",
                   "unknown_event")


class _Block:
    __slots__ = ("bucket", "full", "mask", "parent")

    def __init__(self, full: bytes, parent: bytes | None, bucket: int) -> None:
        self.full = full
        self.parent = parent
        self.bucket = bucket
        self.mask = 0


# A stored block as the walk found it: (external hash, full hash, parent's full hash, bucket).
_Found = tuple[ExternalHash, bytes, "bytes | None", int]


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # one of REFUSAL_REASONS
    detail: str


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _tupled(value: Any) -> Any:
    """msgpack turns tuples into lists; the hash was taken over tuples."""
    if type(value) is list:
        return tuple(_tupled(v) for v in value)
    return value


class VllmBlockBook:
    def __init__(self, hash_config: HashConfig, block_size: int, *,
                 max_blocks: int = 4_000_000, recent_blocks: int = 262_144) -> None:
        if block_size <= 0 or max_blocks <= 0 or recent_blocks < 0:
            raise ValueError("block_size and max_blocks must be positive, recent_blocks >= 0")
        self.hash_config = hash_config
        self.block_size = block_size
        self.digest_size = len(hash_config.root)
        self.max_blocks = max_blocks
        self.recent_blocks = recent_blocks
        self._held: dict[ExternalHash, _Block] = {}
        self._recent: OrderedDict[ExternalHash, _Block] = OrderedDict()
        self.refused: Counter[str] = Counter()
        self.refusals: list[Refusal] = []  # since the caller last took them
        self.ignored_removals = 0  # removals of blocks never indexed (e.g. refused ones)
        self.blocks_stored = 0
        self.blocks_removed = 0

    def __len__(self) -> int:
        return len(self._held)

    # -- what the index publisher republishes --------------------------------------------
    def full_state(self) -> dict[int, dict[str, int]]:
        """Every block held, as the index publisher republishes it: bucket -> full hash in
        hex -> tier mask."""
        out: dict[int, dict[str, int]] = {}
        for b in self._held.values():
            claims = out.get(b.bucket)
            if claims is None:
                claims = out[b.bucket] = {}
            claims[b.full.hex()] = b.mask
        return out

    def masks(self) -> dict[bytes, int]:
        """Every block held: full hash -> tier mask."""
        return {b.full: b.mask for b in self._held.values()}

    def take_refusals(self) -> list[Refusal]:
        out, self.refusals = self.refusals, []
        return out

    def refuse(self, reason: str, detail: str, count: int = 1) -> None:
        self.refused[reason] += count
        self.refusals.append(Refusal(reason, detail))

    # -- events ----------------------------------------------------------------------------
    def apply(self, events: list[WireEvent]) -> list[BucketChange]:
        """Apply one batch in order; return the claim changes, (full hash, bucket, mask
        before, mask after) in order, for the index publisher. Refused events change
        nothing."""
        out: list[BucketChange] = []
        for ev in events:
            try:
                if isinstance(ev, WireBlockStored):
                    self._stored(ev, out)
                elif isinstance(ev, WireBlockRemoved):
                    self._removed(ev, out)
                else:
                    self._cleared(None if ev.medium is None else self._medium(ev.medium), out)
            except _Refused as exc:
                self.refuse(exc.reason, exc.detail)
        return out

    def clear(self) -> list[BucketChange]:
        """Forget what the pod holds (a gap that cannot be replayed, a restart): the changes
        that remove its claims. Known hashes stay known: they are a function of content."""
        out: list[BucketChange] = []
        self._cleared(None, out)
        return out

    def _medium(self, name: str | None) -> Medium:
        if name is None:
            return Medium.GPU
        medium = _MEDIUM.get(name)
        if medium is None:
            raise _Refused("medium", f"unknown medium {name!r} (known: GPU, CPU, DISK)")
        return medium

    def _lookup(self, key: ExternalHash) -> _Block | None:
        block = self._held.get(key)
        return block if block is not None else self._recent.get(key)

    def _stored(self, ev: WireBlockStored, out: list[BucketChange]) -> None:
        medium = self._medium(ev.medium)
        if ev.group_idx:
            raise _Refused("kv_group", f"KV cache group {ev.group_idx}: the index holds one "
                                       "group (full attention)")
        if not ev.block_hashes:
            return
        if not ev.token_ids:
            self._stored_known(ev, medium, out)
            return
        if ev.block_size != self.block_size:
            raise _Refused("block_size", f"block_size {ev.block_size} in the event, "
                                         f"{self.block_size} configured")
        if type(ev.block_hashes[0]) is bytes:
            runs = self._given(ev)
        else:
            runs = self._recomputed(ev)
        self._hold(runs, medium, out)

    def _parent(self, key: ExternalHash | None) -> tuple[bytes | None, int | None]:
        """The full hash and bucket of a stored run's parent (None, None: block 0 next)."""
        if key is None:
            return None, None
        known = self._lookup(key)
        if known is None:
            raise _Refused("unknown_parent", "the parent block was never seen here "
                                             "(stored before this ingester joined?)")
        return known.full, known.bucket

    def _given(self, ev: WireBlockStored) -> list[_Found]:
        """Digests on the wire: they are the full hashes (checked for their length)."""
        key = ev.parent_block_hash
        if key is not None and type(key) is not bytes:
            raise _Refused("bad_event", "digest block hashes with an int parent hash")
        digests: list[bytes] = []
        for h in ev.block_hashes:
            if type(h) is not bytes or len(h) != self.digest_size:
                raise _Refused("hash_length", f"a {self.hash_config.algo} block hash is "
                                              f"{self.digest_size} bytes, the event's is not")
            digests.append(h)
        parent, bucket = self._parent(key)
        blocks: list[_Found] = []
        for h in digests:
            if bucket is None:
                bucket = bucket_of(h)
            blocks.append((h, h, parent, bucket))
            parent = h
        return blocks

    def _recomputed(self, ev: WireBlockStored) -> list[_Found]:
        """Short hashes on the wire: walk the tokens' blocks from the parent, recomputing
        each full hash; every hash of the event must come out, in order."""
        hashes = ev.block_hashes
        bs = self.block_size
        tokens = ev.token_ids
        n_blocks = len(tokens) // bs
        if len(tokens) % bs:
            raise _Refused("block_size", f"{len(tokens)} tokens are not whole blocks of {bs}")
        skips = n_blocks - len(hashes)
        if skips < 0:
            raise _Refused("bad_event", f"{len(hashes)} block hashes for {n_blocks} blocks "
                                        "of tokens")
        extra = ev.extra_keys
        if extra is not None and len(extra) != len(hashes):
            raise _Refused("bad_event", "extra_keys is not one entry per block hash")
        if extra is None and (ev.lora_id or ev.lora_name):
            raise _Refused("lora", "a LoRA block without extra_keys: its hash cannot be "
                                   "recomputed here")
        parent, bucket = self._parent(ev.parent_block_hash)
        hash_block = self.hash_config.hash_block
        lookup = self._lookup
        blocks: list[_Found] = []
        j = 0
        for i in range(n_blocks):
            if j == len(hashes):
                break
            key = hashes[j]
            known = lookup(key) if not skips else None
            if known is not None:
                full = known.full  # verified when first seen
            else:
                keys = _tupled(extra[j]) if extra is not None else None
                full = hash_block(parent, tokens[i * bs:(i + 1) * bs], keys)
            if int.from_bytes(full[-8:], "big") == key:  # short_hash(full), inlined
                if bucket is None:
                    bucket = bucket_of(full)
                blocks.append((key, full, parent, bucket))
                j += 1
            elif skips:
                skips -= 1  # a block cached before: its hash is not in the event
            else:
                where = "block 0" if parent is None and i == 0 else f"block {i} of the run"
                raise _Refused("hash_mismatch", f"the recomputed hash of {where} is not the "
                               "event's: are --hash-algo and --hash-seed the pod's? (or the "
                               "block has extra keys the event does not carry)")
            parent = full
        if j != len(hashes):
            raise _Refused("hash_mismatch", "the event's block hashes do not follow from its "
                                            "tokens and parent")
        return blocks

    def _stored_known(self, ev: WireBlockStored, medium: Medium,
                      out: list[BucketChange]) -> None:
        """A store without tokens (an offloading tier's): only blocks known here, each with
        the parent it was first stored with."""
        runs: list[_Found] = []
        unknown = 0
        for h in ev.block_hashes:
            known = self._lookup(h)
            if known is None:
                unknown += 1
            else:
                runs.append((h, known.full, known.parent, known.bucket))
        if unknown:
            self.refuse("unknown_hash", f"{unknown} of {len(ev.block_hashes)} blocks stored "
                        f"in {medium} without tokens were never seen here", unknown)
        self._hold(runs, medium, out)

    def _hold(self, blocks: list[_Found], medium: Medium, out: list[BucketChange]) -> None:
        """Add `medium` to each block's mask."""
        bit = medium.bit
        held, recent = self._held, self._recent
        full_refused = 0
        for key, full, parent, bucket in blocks:
            block = held.get(key)
            if block is None:
                if len(held) >= self.max_blocks:
                    full_refused += 1
                    continue
                block = recent.pop(key, None) or _Block(full, parent, bucket)
                held[key] = block
            old = block.mask
            if not old & bit:
                block.mask = old | bit
                out.append((block.full, block.bucket, old, old | bit))
        self.blocks_stored += len(blocks) - full_refused
        if full_refused:
            self.refuse("book_full", f"{full_refused} blocks not indexed: the pod holds "
                        f"{self.max_blocks} already (raise --max-blocks)", full_refused)

    def _release(self, key: ExternalHash, block: _Block) -> None:
        del self._held[key]
        if self.recent_blocks:
            self._recent[key] = block
            if len(self._recent) > self.recent_blocks:
                self._recent.popitem(last=False)

    def _removed(self, ev: WireBlockRemoved, out: list[BucketChange]) -> None:
        medium = self._medium(ev.medium)
        if ev.group_idx:
            raise _Refused("kv_group", f"KV cache group {ev.group_idx}: the index holds one "
                                       "group (full attention)")
        bit = medium.bit
        held = self._held
        removed = 0
        for key in ev.block_hashes:
            block = held.get(key)
            if block is None or not block.mask & bit:
                self.ignored_removals += 1
                continue
            old = block.mask
            block.mask = new = old & ~bit
            out.append((block.full, block.bucket, old, new))
            removed += 1
            if not new:
                self._release(key, block)
        self.blocks_removed += removed

    def _cleared(self, medium: Medium | None, out: list[BucketChange]) -> None:
        keep = 0 if medium is None else ALL_BITS & ~medium.bit
        for key, block in list(self._held.items()):
            old = block.mask
            if old & ~keep:
                block.mask = old & keep
                out.append((block.full, block.bucket, old, block.mask))
            if not block.mask:
                self._release(key, block)

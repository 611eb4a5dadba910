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
full hash, its parent's full hash (the index files a claim under its chain's block 0, found
through parents) and its tier mask: exactly for every block the pod holds, and for a bounded
number of blocks it held recently, so a block that comes back, or whose child is stored after
it left, is still known. Pure and single-threaded: the ingester owns it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from pagekv.proto.hashing import HashConfig
from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekv.proto.medium import ALL_BITS, MEDIUMS, Medium
from pagekv.proto.vllm_events import (
    ExternalHash,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    short_hash,
)

_MEDIUM = {m.value: m for m in MEDIUMS}

# Why an event (or the part of one naming unknown blocks) was not applied: a metric label.
REFUSAL_REASONS = ("block_size", "hash_length", "hash_mismatch", "unknown_parent",
                   "unknown_hash", "lora", "medium", "kv_group", "book_full", "bad_event",
                   "unknown_event")


class _Block:
    __slots__ = ("full", "mask", "parent")

    def __init__(self, full: bytes, parent: bytes | None) -> None:
        self.full = full
        self.parent = parent
        self.mask = 0


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
    def full_state(self) -> dict[bytes, int]:
        """Every block held: full hash -> tier mask."""
        return {b.full: b.mask for b in self._held.values()}

    def take_refusals(self) -> list[Refusal]:
        out, self.refusals = self.refusals, []
        return out

    def refuse(self, reason: str, detail: str, count: int = 1) -> None:
        self.refused[reason] += count
        self.refusals.append(Refusal(reason, detail))

    # -- events ----------------------------------------------------------------------------
    def apply(self, events: list[WireEvent]) -> list[KVEvent]:
        """Apply one batch in order; return the same changes as PageKV events (full
        hashes), for the index publisher. Refused events change nothing."""
        out: list[KVEvent] = []
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

    def clear(self) -> list[KVEvent]:
        """Forget what the pod holds (a gap that cannot be replayed, a restart): the event
        that removes its claims. Known hashes stay known: they are a function of content."""
        out: list[KVEvent] = []
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

    def _stored(self, ev: WireBlockStored, out: list[KVEvent]) -> None:
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
        self._hold(runs, medium, ev.lora_id, out)

    def _given(self, ev: WireBlockStored) -> list[tuple[ExternalHash, bytes, bytes | None]]:
        """Digests on the wire: they are the full hashes (checked for their length)."""
        parent = ev.parent_block_hash
        if parent is not None and type(parent) is not bytes:
            raise _Refused("bad_event", "digest block hashes with an int parent hash")
        blocks = []
        for h in ev.block_hashes:
            if type(h) is not bytes or len(h) != self.digest_size:
                raise _Refused("hash_length", f"a {self.hash_config.algo} block hash is "
                                              f"{self.digest_size} bytes, the event's is not")
            blocks.append((h, h, parent))
            parent = h
        return blocks

    def _recomputed(self, ev: WireBlockStored
                    ) -> list[tuple[ExternalHash, bytes, bytes | None]]:
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
        parent_key = ev.parent_block_hash
        if parent_key is None:
            parent: bytes | None = None
        else:
            known = self._lookup(parent_key)
            if known is None:
                raise _Refused("unknown_parent", "the parent block was never seen here "
                                                 "(stored before this ingester joined?)")
            parent = known.full
        hash_block = self.hash_config.hash_block
        blocks: list[tuple[ExternalHash, bytes, bytes | None]] = []
        j = 0
        for i in range(n_blocks):
            if j == len(hashes):
                break
            known = self._lookup(hashes[j]) if not skips else None
            if known is not None:
                full = known.full  # verified when first seen
            else:
                keys = _tupled(extra[j]) if extra is not None else None
                full = hash_block(parent, tokens[i * bs:(i + 1) * bs], keys)
            if short_hash(full) == hashes[j]:
                blocks.append((hashes[j], full, parent))
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

    def _stored_known(self, ev: WireBlockStored, medium: Medium, out: list[KVEvent]) -> None:
        """A store without tokens (an offloading tier's): only blocks known here, each with
        the parent it was first stored with."""
        runs: list[tuple[ExternalHash, bytes, bytes | None]] = []
        unknown = 0
        for h in ev.block_hashes:
            known = self._lookup(h)
            if known is None:
                unknown += 1
            else:
                runs.append((h, known.full, known.parent))
        if unknown:
            self.refuse("unknown_hash", f"{unknown} of {len(ev.block_hashes)} blocks stored "
                        f"in {medium} without tokens were never seen here", unknown)
        self._hold(runs, medium, ev.lora_id, out)

    def _hold(self, blocks: list[tuple[ExternalHash, bytes, bytes | None]], medium: Medium,
              lora_id: int | None, out: list[KVEvent]) -> None:
        """Add `medium` to each block's mask; emit consecutive blocks as one run."""
        bit = medium.bit
        held, recent = self._held, self._recent
        run: list[bytes] = []
        run_parent: bytes | None = None
        full_refused = 0
        for key, full, parent in blocks:
            block = held.get(key)
            if block is None:
                if len(held) >= self.max_blocks:
                    full_refused += 1
                    continue
                block = recent.pop(key, None) or _Block(full, parent)
                held[key] = block
            block.mask |= bit
            if run and block.parent != run[-1]:
                out.append(BlockStored(run, run_parent, [], self.block_size, lora_id, medium))
                run = []
            if not run:
                run_parent = block.parent
            run.append(block.full)
        if run:
            out.append(BlockStored(run, run_parent, [], self.block_size, lora_id, medium))
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

    def _removed(self, ev: WireBlockRemoved, out: list[KVEvent]) -> None:
        medium = self._medium(ev.medium)
        if ev.group_idx:
            raise _Refused("kv_group", f"KV cache group {ev.group_idx}: the index holds one "
                                       "group (full attention)")
        bit = medium.bit
        removed: list[bytes] = []
        for key in ev.block_hashes:
            block = self._held.get(key)
            if block is None or not block.mask & bit:
                self.ignored_removals += 1
                continue
            block.mask &= ~bit
            removed.append(block.full)
            if not block.mask:
                self._release(key, block)
        if removed:
            self.blocks_removed += len(removed)
            out.append(BlockRemoved(removed, medium))

    def _cleared(self, medium: Medium | None, out: list[KVEvent]) -> None:
        keep = 0 if medium is None else ALL_BITS & ~medium.bit
        for key, block in list(self._held.items()):
            block.mask &= keep
            if not block.mask:
                self._release(key, block)
        out.append(AllBlocksCleared(medium))

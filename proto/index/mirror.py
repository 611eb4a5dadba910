"""A pod's claims as last written to the index (block hash -> tier bitmask, and its
bucket), and the net change a batch of KV events makes to them.

Tiers are an exclusive chain, but a demotion arrives as two events (removed from one tier,
stored in the next) in either order, so a claim is a set of tiers and removing one tier
never removes another. Pure: the publisher writes what `apply` returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pagekv.proto.index.placement import ChainBuckets
from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekv.proto.medium import ALL_BITS, MEDIUMS

_BIT = {m.value: m.bit for m in MEDIUMS}  # by wire name, a str or a Medium

Change = tuple[bytes, int, int]  # (block hash, mask before, mask after); 0 = no claim
# (block hash, its bucket, mask before, mask after): a claim write (proto.index.writes).
BucketChange = tuple[bytes, int, int, int]

# Buckets of hashes no longer held are forgotten once there are this many more of them
# than twice the claims (so the compaction's cost is spread over that many events).
COMPACT_SLACK = 4096


class ClaimMirror:
    __slots__ = ("masks",)

    def __init__(self, masks: dict[bytes, int] | None = None) -> None:
        self.masks: dict[bytes, int] = masks if masks is not None else {}

    def __len__(self) -> int:
        return len(self.masks)

    @classmethod
    def from_state(cls, state: Mapping[bytes, str]) -> ClaimMirror:
        """From a pod's full state (hash -> the tier holding it)."""
        masks: dict[bytes, int] = {}
        for block_hash, tier in state.items():
            masks[block_hash] = masks.get(block_hash, 0) | _BIT[tier]
        return cls(masks)

    def apply(self, events: Iterable[KVEvent]) -> list[Change]:
        """Apply events in order; return each touched hash whose mask ended up different,
        in first-touched order (a store undone in the same batch writes nothing)."""
        before: dict[bytes, int] = {}  # first-seen mask of each touched hash
        masks = self.masks
        for ev in events:
            if isinstance(ev, BlockStored):
                bit = _BIT[ev.medium]
                for h in ev.block_hashes:
                    old = masks.get(h, 0)
                    before.setdefault(h, old)
                    masks[h] = old | bit
            elif isinstance(ev, BlockRemoved):
                bit = _BIT[ev.medium]
                for h in ev.block_hashes:
                    old = masks.get(h, 0)
                    before.setdefault(h, old)
                    if old & ~bit:
                        masks[h] = old & ~bit
                    elif old:
                        del masks[h]
            elif isinstance(ev, AllBlocksCleared):
                keep = 0 if ev.medium is None else ALL_BITS & ~_BIT[ev.medium]
                for h in list(masks):
                    old = masks[h]
                    before.setdefault(h, old)
                    if old & keep:
                        masks[h] = old & keep
                    else:
                        del masks[h]
        changes: list[Change] = []
        for h, old in before.items():
            new = masks.get(h, 0)
            if new != old:
                changes.append((h, old, new))
        return changes


class PodClaims:
    """A pod's claims as the publisher wrote them: the tier masks (ClaimMirror), the bucket
    of each (ChainBuckets), and the hashes held whose bucket is not known yet (unplaced: not
    in Redis; written as soon as their chain is). Pure; the publisher thread owns it."""

    __slots__ = ("buckets", "mirror", "unplaced")

    def __init__(self) -> None:
        self.mirror = ClaimMirror()
        self.buckets = ChainBuckets()
        self.unplaced: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.mirror)

    def learn(self, events: Iterable[KVEvent]) -> None:
        """Learn buckets from events whose tier changes are not applied (dropped while Redis
        was away: the next full state covers those)."""
        self.buckets.learn(events)

    def apply(self, events: Sequence[KVEvent]) -> list[BucketChange]:
        """Apply events in order; return the claim writes they need, with their buckets:
        each changed hash that has a bucket, and each hash placed just now (its whole mask:
        nothing of it was written before)."""
        placed = self.buckets.learn(events)
        changes = self.mirror.apply(events)
        fresh = set(placed)
        get = self.buckets.get
        out: list[BucketChange] = []
        for h, old, new in changes:
            if h in fresh:
                continue
            bucket = get(h)
            if bucket is not None:
                out.append((h, bucket, old, new))
            elif new:
                self.unplaced.add(h)
            else:
                self.unplaced.discard(h)
        masks = self.mirror.masks
        known = self.buckets.buckets  # every hash placed just now has its bucket there
        for h in placed:
            self.unplaced.discard(h)
            mask = masks.get(h, 0)
            if mask:
                out.append((h, known[h], 0, mask))
        if len(self.buckets) > 2 * len(masks) + COMPACT_SLACK:
            self.buckets.compact(masks)
        return out

    def reset(self, state: Mapping[bytes, str]) -> dict[int, dict[str, int]]:
        """Start over from a pod's full state (hash -> tier). Returns what to publish:
        bucket -> hex hash -> tier mask, for every hash whose bucket is known."""
        self.mirror = ClaimMirror.from_state(state)
        masks = self.mirror.masks
        self.buckets.compact(masks)
        get = self.buckets.get
        wanted: dict[int, dict[str, int]] = {}
        self.unplaced = set()
        for h, mask in masks.items():
            bucket = get(h)
            if bucket is None:
                self.unplaced.add(h)
            else:
                wanted.setdefault(bucket, {})[h.hex()] = mask
        return wanted

    def clear(self) -> None:
        self.mirror = ClaimMirror()
        self.unplaced = set()


class PlacedClaims:
    """The claims of a pod whose owner places every block itself and keeps its own full
    state (the vLLM ingester's book, proto.vllm_chain): what is submitted is lists of
    BucketChange, the full state is already bucket -> hex hash -> tier mask. Only the set of
    hashes claimed is kept here (for the publisher's count). Same interface as PodClaims."""

    __slots__ = ("held",)
    unplaced: frozenset[bytes] = frozenset()  # nothing waits for a parent here

    def __init__(self) -> None:
        self.held: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.held)

    def learn(self, events: Iterable[object]) -> None:
        """Nothing to learn: the owner placed every block."""

    def apply(self, items: Sequence[Sequence[BucketChange]]) -> list[BucketChange]:
        """The net change of the submitted lists: each hash once, with its last mask."""
        net: dict[bytes, BucketChange] = {}
        for changes in items:
            for change in changes:
                net[change[0]] = change
        held = self.held
        for h, _bucket, _old, new in net.values():
            if new:
                held.add(h)
            else:
                held.discard(h)
        return list(net.values())

    def reset(self, state: Mapping[int, Mapping[str, int]]) -> dict[int, dict[str, int]]:
        """Start over from the owner's full state; it is what to publish, as it is."""
        wanted = {bucket: dict(claims) for bucket, claims in state.items() if claims}
        self.held = {bytes.fromhex(h) for claims in wanted.values() for h in claims}
        return wanted

    def clear(self) -> None:
        self.held = set()

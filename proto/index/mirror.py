"""A pod's claims as last written to the index (block hash -> tier bitmask), and the net
change a batch of KV events makes to them.

Tiers are an exclusive chain, but a demotion arrives as two events (removed from one tier,
stored in the next) in either order, so a claim is a set of tiers and removing one tier
never removes another. Pure: the publisher writes what `apply` returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekv.proto.medium import ALL_BITS, MEDIUMS

_BIT = {m.value: m.bit for m in MEDIUMS}  # by wire name, a str or a Medium

Change = tuple[bytes, int, int]  # (block hash, mask before, mask after); 0 = no claim


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

"""Whose cached blocks are where, and who is over its quota (the tenants file's `quota:`).

A block's owner is the tenant whose request cached it (`SHARED_OWNER` for the shared region's
blocks, `NO_OWNER` for a request without a tenant, or a block found on the SSD at start-up,
whose owner was not kept). Tenant salts make a tenant's hashes its own, so one hash has one
owner. The pool places a hash with its owner when it caches it; the tiers below place it as
it moves (the tier chain's tree reports every move), and the owner is forgotten once the hash
is in no tier.

Per tier and owner the ledger keeps the hashes in the order they arrived or were last hit
(oldest first) and, for the owners with a quota in that tier, whether they are over it.
`over(medium)` is what a tier asks after a change; it then evicts `oldest(owner, medium)`
blocks of that owner only (`victims`) — never another's — until the owner is back within its quota.
The pool's blocks a running request holds cannot go: a tenant's running requests are never
refused for its quota; their blocks are trimmed back to it when they are released.

Thread-safe (its own lock, a leaf: the ledger never calls out): the engine thread places pool
blocks, the tier chain (under its lock, also from a loader thread) the rest.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from itertools import islice

from pagekv.proto.medium import MEDIUMS, Medium

logger = logging.getLogger(__name__)

SHARED_OWNER = "_shared"  # (tenant names are the file's; these two cannot be confused with
NO_OWNER = "_none"  # one because the labels below are also what /metrics shows)


class TenantLedger:
    def __init__(self, quota_blocks: Mapping[str, Mapping[Medium, int]]) -> None:
        """`quota_blocks`: owner -> tier -> the most blocks it keeps there (a tier absent:
        not bounded)."""
        self.quota_blocks = {owner: dict(q) for owner, q in quota_blocks.items()}
        self._owner: dict[bytes, str] = {}
        self._mask: dict[bytes, int] = {}  # the tiers (Medium.bit) each hash is in
        self._order: dict[Medium, dict[str, OrderedDict[bytes, None]]] = {m: {} for m in MEDIUMS}
        self._over: dict[Medium, set[str]] = {m: set() for m in MEDIUMS}
        self.evicted: dict[tuple[str, Medium], int] = {}  # over-quota evictions, per owner
        self._lock = threading.Lock()

    def owner_of(self, block_hash: bytes) -> str | None:
        return self._owner.get(block_hash)

    # --- the tiers' reports ------------------------------------------------------------
    def placed(self, block_hashes: Iterable[bytes], medium: Medium,
               owner: str | None = None) -> None:
        """These hashes are in `medium` now (again: they become its newest). `owner`: whose
        they are (the pool's caller knows); None: the owner already recorded (a move)."""
        bit = medium.bit
        orders = self._order[medium]
        with self._lock:
            for h in block_hashes:
                known = self._owner.get(h)
                who = owner if owner is not None else (known or NO_OWNER)
                if known is not None and known != who:
                    self._reown_locked(h, known, who)
                self._owner[h] = who
                mask = self._mask.get(h, 0)
                order = orders.get(who)
                if order is None:
                    order = orders[who] = OrderedDict()
                if mask & bit:
                    order.move_to_end(h)
                    continue
                self._mask[h] = mask | bit
                order[h] = None
                self._check_locked(who, medium)

    def touched(self, block_hashes: Iterable[bytes], medium: Medium) -> None:
        """A hit: these hashes become their owners' newest in `medium`."""
        orders = self._order[medium]
        with self._lock:
            for h in block_hashes:
                who = self._owner.get(h)
                order = orders.get(who) if who is not None else None
                if order is not None and h in order:
                    order.move_to_end(h)

    def gone(self, block_hashes: Iterable[bytes], medium: Medium) -> None:
        """These hashes left `medium` (evicted, moved, promoted, deleted)."""
        bit = medium.bit
        with self._lock:
            for h in block_hashes:
                self._gone_locked(h, medium, bit)

    def cleared(self, medium: Medium) -> None:
        """Every block of `medium` went at once."""
        bit = medium.bit
        with self._lock:
            for order in list(self._order[medium].values()):
                for h in list(order):
                    self._gone_locked(h, medium, bit)

    # --- enforcement -------------------------------------------------------------------------
    def over(self, medium: Medium) -> list[str]:
        """The owners over their quota in `medium` now."""
        over = self._over[medium]
        if not over:
            return []
        with self._lock:
            return list(over)

    def excess(self, owner: str, medium: Medium) -> int:
        quota = self.quota_blocks.get(owner, {}).get(medium)
        if quota is None:
            return 0
        with self._lock:
            return max(0, len(self._order[medium].get(owner, ())) - quota)

    def victims(self, owner: str, medium: Medium, n: int, usable: Callable[[bytes], bool],
                retained: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Up to `n` of the owner's hashes in `medium` that the tier can evict now (`usable`),
        oldest first, those `retained` (pinned, sessions) after the rest. A bounded look:
        past `n` + 4096 (a running request's blocks, held copies) it stops."""
        with self._lock:
            order = self._order[medium].get(owner)
            candidates = list(islice(order, n + 4096)) if order else []
        plain: list[bytes] = []
        kept: list[bytes] = []
        for h in candidates:
            if not usable(h):
                continue
            (kept if retained is not None and retained(h) else plain).append(h)
            if len(plain) >= n:
                break
        return (plain + kept)[:n]

    def count_evicted(self, owner: str, medium: Medium, n: int) -> None:
        if n <= 0:
            return
        key = (owner, medium)
        with self._lock:
            first = key not in self.evicted
            self.evicted[key] = self.evicted.get(key, 0) + n
        if first:
            logger.info("quota: %s is over its %s quota of %d blocks: evicting its own oldest "
                        "blocks (pagekv_pod_tenant_quota_evictions_total counts them)", owner,
                        medium.value, self.quota_blocks.get(owner, {}).get(medium, 0))

    # --- figures -----------------------------------------------------------------------------
    def usage(self) -> dict[tuple[str, Medium], int]:
        """(owner, tier) -> blocks held there now."""
        with self._lock:
            return {(owner, medium): len(order) for medium, orders in self._order.items()
                    for owner, order in orders.items() if order}

    # --- internals (lock held) ---------------------------------------------------------------
    def _gone_locked(self, h: bytes, medium: Medium, bit: int) -> None:
        mask = self._mask.get(h, 0)
        if not mask & bit:
            return
        who = self._owner[h]
        order = self._order[medium][who]
        del order[h]
        if not order:
            del self._order[medium][who]
        mask &= ~bit
        if mask:
            self._mask[h] = mask
        else:
            del self._mask[h]
            del self._owner[h]
        self._check_locked(who, medium)

    def _reown_locked(self, h: bytes, old: str, new: str) -> None:
        """A hash seen before under another owner (an SSD block of no known owner cached
        again by a tenant's request): its entries in every tier move to the new owner."""
        mask = self._mask.get(h, 0)
        for medium in MEDIUMS:
            if mask & medium.bit:
                orders = self._order[medium]
                del orders[old][h]
                if not orders[old]:
                    del orders[old]
                orders.setdefault(new, OrderedDict())[h] = None
                self._check_locked(old, medium)
                self._check_locked(new, medium)

    def _check_locked(self, owner: str, medium: Medium) -> None:
        quota = self.quota_blocks.get(owner, {}).get(medium)
        if quota is None:
            return
        if len(self._order[medium].get(owner, ())) > quota:
            self._over[medium].add(owner)
        else:
            self._over[medium].discard(owner)

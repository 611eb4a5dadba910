"""The pod's tenancy: the tenants file's quotas and shared region, as the engine applies them.

With a tenants file (`--tenants`), every request carries its tenant (read from the caller's
token, or from the router's `GenerateRequest.tenant` over the fleet credential) and the
engine keeps a `TenantLedger` (proto/tenant_ledger.py): whose cached blocks are in which
tier. Its quotas are the file's bytes per tier, in blocks of this pod's size (rounded down:
a quota smaller than a block keeps nothing in that tier). The shared region's prefixes are
tokenized with the model's tokenizer (`SharedPrefixes`), and a request's leading blocks
within one are hashed without its salt and counted against the region's own quota.

Figures: per tenant label and tier, blocks held, the quota, and the blocks evicted for being
over it. Label values are bounded: each tenant with a quota, the first 32 others (in sorted
order), `_shared`, `_none` (no tenant), and `_other` for the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekv.proto.medium import Medium
from pagekv.proto.shared_prefix import SharedPrefixes
from pagekv.proto.tenant_ledger import NO_OWNER, SHARED_OWNER, TenantLedger
from pagekv.proto.tenants import QUOTA_TIERS, TenantMap, TierQuota

logger = logging.getLogger(__name__)

MAX_UNQUOTED_LABELS = 32
OTHER_LABEL = "_other"
_TIER_MEDIUM = dict(zip(QUOTA_TIERS, (Medium.GPU, Medium.CPU, Medium.DISK), strict=True))


@dataclass(frozen=True, slots=True)
class TenancyStats:
    held_blocks: dict[tuple[str, Medium], int]  # (label, tier) -> blocks cached there now
    quota_blocks: dict[tuple[str, Medium], int]  # (label, tier) -> its quota
    evicted: dict[tuple[str, Medium], int]  # (label, tier) -> blocks evicted over its quota
    block_bytes: int


class PodTenancy:
    def __init__(self, tenants: TenantMap, encode: Callable[[str], Sequence[int]],
                 block_size: int, block_bytes: int) -> None:
        self.tenants = tenants
        self.block_bytes = block_bytes
        self.shared = SharedPrefixes.of(tenants.shared, encode, block_size)
        quotas: dict[str, TierQuota] = dict(tenants.quotas)
        if tenants.shared is not None:
            quotas[SHARED_OWNER] = tenants.shared.quota
        self.ledger = TenantLedger({owner: self._in_blocks(q) for owner, q in quotas.items()})
        unquoted = [n for n in tenants.names if n not in tenants.quotas]
        self._labels = {*tenants.quotas, *unquoted[:MAX_UNQUOTED_LABELS], SHARED_OWNER,
                        NO_OWNER}
        logger.info("tenancy: %d tenants, %d with a quota; shared region: %s",
                    len(tenants.names), len(tenants.quotas),
                    f"{len(self.shared)} prefixes, {self.shared.num_tokens} tokens in whole "
                    "blocks" if self.shared is not None else "none")

    def shared_blocks(self, token_ids: Sequence[int]) -> int:
        """The prompt's leading blocks in the shared region (hashed without its salt)."""
        return self.shared.blocks(token_ids) if self.shared is not None else 0

    def label(self, owner: str) -> str:
        return owner if owner in self._labels else OTHER_LABEL

    def stats(self) -> TenancyStats:
        held: dict[tuple[str, Medium], int] = {}
        for (owner, medium), n in self.ledger.usage().items():
            key = (self.label(owner), medium)
            held[key] = held.get(key, 0) + n
        quota = {(owner, medium): n for owner, tiers in self.ledger.quota_blocks.items()
                 for medium, n in tiers.items()}
        evicted: dict[tuple[str, Medium], int] = {}
        for (owner, medium), n in dict(self.ledger.evicted).items():
            key = (self.label(owner), medium)
            evicted[key] = evicted.get(key, 0) + n
        return TenancyStats(held, quota, evicted, self.block_bytes)

    def _in_blocks(self, quota: TierQuota) -> dict[Medium, int]:
        return {_TIER_MEDIUM[tier]: size // self.block_bytes
                for tier in QUOTA_TIERS if (size := quota.of(tier)) is not None}

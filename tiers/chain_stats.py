"""The chain's figures: every raw counter flat (`TierChain.stats`), and the typed per-tier
record the engine, Prometheus and the StatsResponse read (`TierChain.tier_stats`).

Both run with the chain's lock held, after its SSD reports were applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagekv.proto.medium import Medium
from pagekv.proto.tier_stats import MOVES, ChainStats, TierMove, TierStats, move_name

if TYPE_CHECKING:
    from pagekv.tiers.chain import TierChain

_SSD_KEYS = ("checksum_failures", "torn_entries", "read_errors", "evictions", "put_drops",
             "pending_bytes", "bytes_written", "write_seconds", "bytes_read", "read_seconds",
             "disabled")


def flat_stats_locked(chain: TierChain) -> dict[str, float]:
    out = dict(chain._c)
    out["blocks_below_pool"] = len(chain._tree)
    for prefix, tier in (("dram", chain.dram), ("ssd", chain.ssd)):
        out[f"{prefix}_used_bytes"] = tier.used_bytes if tier is not None else 0
        out[f"{prefix}_capacity_bytes"] = tier.capacity_bytes if tier is not None else 0
        out[f"{prefix}_entries"] = tier.num_entries if tier is not None else 0
    if chain.ssd is not None:
        ssd = chain.ssd.stats()
        for key in _SSD_KEYS:
            out[f"ssd_{key}"] = ssd[key]
    out["checksum_failures"] = out.get("ssd_checksum_failures", 0)
    return out


def tier_stats_locked(chain: TierChain, block_size: int) -> ChainStats:
    c = chain._c
    tiers = {}
    for medium, prefix, tier in ((Medium.CPU, "dram", chain.dram),
                                 (Medium.DISK, "ssd", chain.ssd)):
        tiers[medium] = TierStats(
            medium,
            tier.used_bytes if tier is not None else 0,
            tier.capacity_bytes if tier is not None else 0,
            tier.num_entries if tier is not None else 0,
            c[f"{prefix}_hits"] * block_size,
            c[f"{prefix}_queries"] * block_size,
        )
    moves = tuple(TierMove(src, dst, c[f"{move_name(src, dst)}_bytes"],
                           c[f"{move_name(src, dst)}_seconds"]) for src, dst in MOVES)
    failures = chain.ssd.stats()["checksum_failures"] if chain.ssd is not None else 0
    return ChainStats(tiers, moves, c["orphans_dropped"], failures)

"""The chain's counters, and the figures built from them: every raw counter flat
(`TierChain.stats`), and the typed per-tier record the engine, Prometheus and the
StatsResponse read (`TierChain.tier_stats`).

The tiers' sizes are not counted here: they are read from the tiers when a figure is built.
Not thread-safe: the chain's lock guards every call.
"""

from __future__ import annotations

import time

from pagekv.proto.medium import Medium
from pagekv.proto.tier_stats import MOVES, ChainStats, TierMove, TierStats, move_name
from pagekv.tiers.base import Tier

COUNTERS = (
    "demotions", "lookups", "dram_queries", "dram_hits", "ssd_queries", "ssd_hits",
    "promotions_dram", "promotions_ssd", "promote_misses",
    "promote_failures",  # found but unreadable (checksum failure, I/O error)
    "drops",  # blocks that left the bottom of the chain (nowhere to go, SSD eviction or loss)
    "orphans_dropped",
    *(f"{move_name(*move)}_{unit}" for move in MOVES for unit in ("bytes", "seconds")),
)  # fmt: skip

_SSD_KEYS = ("checksum_failures", "torn_entries", "read_errors", "evictions", "put_drops",
             "pending_bytes", "bytes_written", "write_seconds", "bytes_read", "read_seconds",
             "disabled")


class ChainCounters:
    """What the chain did, by name (COUNTERS): an unknown name is a KeyError, not a new
    counter. Counts (blocks, lookups, bytes) are ints; the `..._seconds` counters are the
    only floats, and each kind is added to by its own call."""

    def __init__(self) -> None:
        self._n: dict[str, int] = dict.fromkeys(
            (name for name in COUNTERS if not name.endswith("_seconds")), 0)
        self._s: dict[str, float] = dict.fromkeys(
            (name for name in COUNTERS if name.endswith("_seconds")), 0)

    def add(self, name: str, n: int = 1) -> None:
        self._n[name] += n

    def add_seconds(self, name: str, seconds: float) -> None:
        self._s[name] += seconds

    def count_move(self, direction: str, nbytes: int, t0: float) -> None:
        """A copy between levels (e.g. "pool_to_dram") of `nbytes` that started at `t0`
        (perf_counter) and ended now."""
        self._s[f"{direction}_seconds"] += time.perf_counter() - t0
        self._n[f"{direction}_bytes"] += nbytes

    def flat(self, blocks_below_pool: int, dram: Tier | None, ssd: Tier | None
             ) -> dict[str, float]:
        """Every counter, the tiers' sizes and the SSD's own counters (`ssd_...`), flat."""
        out: dict[str, float] = {
            name: self._s[name] if name in self._s else self._n[name] for name in COUNTERS}
        out["blocks_below_pool"] = blocks_below_pool
        for prefix, tier in (("dram", dram), ("ssd", ssd)):
            out[f"{prefix}_used_bytes"] = tier.used_bytes if tier is not None else 0
            out[f"{prefix}_capacity_bytes"] = tier.capacity_bytes if tier is not None else 0
            out[f"{prefix}_entries"] = tier.num_entries if tier is not None else 0
        if ssd is not None:
            ssd_stats = ssd.stats()
            for key in _SSD_KEYS:
                out[f"ssd_{key}"] = ssd_stats[key]
        out["checksum_failures"] = out.get("ssd_checksum_failures", 0)
        return out

    def tier_stats(self, dram: Tier | None, ssd: Tier | None, block_size: int) -> ChainStats:
        """The typed record: per tier what it holds and its lookups in tokens (`block_size`
        per block), per direction the bytes moved and the seconds it took."""
        n, s = self._n, self._s
        tiers = {}
        for medium, prefix, tier in ((Medium.CPU, "dram", dram), (Medium.DISK, "ssd", ssd)):
            tiers[medium] = TierStats(
                medium,
                tier.used_bytes if tier is not None else 0,
                tier.capacity_bytes if tier is not None else 0,
                tier.num_entries if tier is not None else 0,
                n[f"{prefix}_hits"] * block_size,
                n[f"{prefix}_queries"] * block_size,
            )
        moves = tuple(TierMove(src, dst, n[f"{move_name(src, dst)}_bytes"],
                               s[f"{move_name(src, dst)}_seconds"]) for src, dst in MOVES)
        # A tier's stats() are floats by type (sizes, counts and seconds in one dict); this
        # one is a count.
        failures = int(ssd.stats()["checksum_failures"]) if ssd is not None else 0
        return ChainStats(tiers, moves, n["orphans_dropped"], failures)

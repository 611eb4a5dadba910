"""Per-tier statistics as one typed record, from the tier chain to every exporter.

The chain builds a `ChainStats` (one `TierStats` per medium below the pool, one `TierMove` per
direction blocks travel), the engine adds the pool's own `TierStats`, and the Prometheus
collector and the gRPC `StatsResponse` read the same fields. Nothing on the way flattens or
renames them, so per-tier figures cannot drift apart between exporters (llm-d #1952).

Torch-free: the router and tests read these records too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekv.proto.medium import Medium

# How the chain and the metrics name each place a block can be (`pool_to_dram`, ...).
PLACE_NAMES = {Medium.GPU: "pool", Medium.CPU: "dram", Medium.DISK: "ssd"}
# Every direction a block moves in, in the order the metrics list them.
MOVES: tuple[tuple[Medium, Medium], ...] = (
    (Medium.GPU, Medium.CPU),  # eviction into DRAM
    (Medium.GPU, Medium.DISK),  # eviction straight to SSD (no DRAM tier)
    (Medium.CPU, Medium.DISK),  # DRAM's LRU victims
    (Medium.CPU, Medium.GPU),  # reloads
    (Medium.DISK, Medium.GPU),
)


def move_name(source: Medium, target: Medium) -> str:
    return f"{PLACE_NAMES[source]}_to_{PLACE_NAMES[target]}"


@dataclass(slots=True, frozen=True)
class TierStats:
    """What one medium holds, and how often a prefix lookup found its blocks there.

    Hits and queries count prompt tokens looked up in this tier after the ones above it missed
    (the pool's own hits are the prefix-cache metrics); the pool's record leaves them 0.
    """

    medium: Medium
    used_bytes: int = 0
    capacity_bytes: int = 0
    entries: int = 0
    hits_tokens: int = 0
    queries_tokens: int = 0


@dataclass(slots=True, frozen=True)
class TierMove:
    """Blocks moved from one medium to another, and the seconds spent copying them."""

    source: Medium
    target: Medium
    bytes: int = 0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return move_name(self.source, self.target)


@dataclass(slots=True, frozen=True)
class ChainStats:
    """The tiers below the pool: each medium (present or not), each direction of travel."""

    tiers: dict[Medium, TierStats]
    moves: tuple[TierMove, ...]
    orphans_dropped: int = 0  # unreachable descendants of dropped blocks
    checksum_failures: int = 0  # SSD entries that failed their checksum on the way back

    def reload_s_per_token(self, kv_bytes_per_token: int) -> dict[Medium, float]:
        """Measured seconds per token to bring a block back into the pool from each tier
        (the router weighs these against recomputing); a tier never reloaded from is absent."""
        out = {}
        for move in self.moves:
            if move.target is Medium.GPU and move.bytes > 0 and move.seconds > 0:
                out[move.source] = move.seconds / move.bytes * kv_bytes_per_token
        return out

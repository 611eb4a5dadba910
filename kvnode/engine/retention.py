"""The pod's retention: its table of pinned and session blocks, their caps per tier, the file
that carries them across a restart, and their figures.

The table itself (proto/retention.py) is read by the pool, the DRAM tier and the SSD tier; this
module sizes it from the engine's options and keeps it: the caps (`--retained-*-bytes`,
half of each tier by default), the save beside the SSD tier's files (at most once a second
while marks change, and at close), and `stats()` for /metrics and Stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable

logger = logging.getLogger(__name__)

SAVE_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class RetentionStats:
    marks: int  # live retained block hashes (pins and sessions)
    resident: dict[Medium, int]  # of them, blocks held per tier now
    cap_blocks: dict[Medium, int]  # the most each tier keeps from eviction
    spared: dict[str, int]  # per tier: retained victims passed over
    yielded: dict[str, int]  # per tier: retained blocks evicted all the same
    refused: int  # marks refused: the table was full
    expired: int


class PodRetention:
    def __init__(self, args: EngineArgs, num_pool_blocks: int, block_bytes: int) -> None:
        def cap(explicit: int | None, tier_bytes: int) -> int:
            return (explicit if explicit is not None else tier_bytes // 2) // block_bytes

        self.cap_blocks = {
            Medium.GPU: cap(args.retained_pool_bytes, num_pool_blocks * block_bytes),
            Medium.CPU: cap(args.retained_dram_bytes, args.cpu_offload_bytes),
            Medium.DISK: cap(args.retained_ssd_bytes, args.disk_offload_bytes),
        }
        self.block_bytes = block_bytes
        # Marks past what every tier together can keep could never be honoured.
        self.table = RetentionTable(max(1, sum(self.cap_blocks.values())))
        self.session_idle_s = args.session_idle_s
        self.directory = args.disk_offload_dir if args.disk_offload_bytes > 0 else None
        self._saved_at = 0.0
        if self.directory:
            restored = self.table.load(self.directory)
            if restored:
                logger.info("retention: %d pinned or session blocks restored from %s",
                            restored, self.directory)
        logger.info("retention: caps pool %d, DRAM %d, SSD %d blocks; sessions kept %.0f s "
                    "idle", self.cap_blocks[Medium.GPU], self.cap_blocks[Medium.CPU],
                    self.cap_blocks[Medium.DISK], self.session_idle_s)

    def cap_bytes(self, medium: Medium) -> int:
        return self.cap_blocks[medium] * self.block_bytes

    def tick(self, force: bool = False) -> None:
        """Engine thread: save the marks when they changed (at most once a second)."""
        if not self.directory or not self.table.dirty:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_INTERVAL_S:
            return
        self._saved_at = now
        try:
            self.table.save(self.directory)
        except OSError as exc:  # a full or broken disk: pins stay in memory, said once a save
            logger.warning("retention: cannot save the pins to %s: %s", self.directory, exc)

    def stats(self, in_pool: Callable[[bytes], bool],
              media_below: Callable[[Sequence[bytes]], list[Medium | None]] | None
              ) -> RetentionStats:
        live = self.table.live()
        resident = {Medium.GPU: sum(map(in_pool, live)), Medium.CPU: 0, Medium.DISK: 0}
        if media_below is not None and live:
            for medium in media_below(live):
                if medium is not None:
                    resident[medium] += 1
        t = self.table
        return RetentionStats(len(live), resident, dict(self.cap_blocks), dict(t.spared),
                              dict(t.yielded), t.refused, t.expired)

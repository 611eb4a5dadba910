"""What a pod keeps while its time runs: pinned prefixes and idle sessions' blocks.

A request may ask (`CacheControl`) that its prompt's first tokens be kept for a TTL (a pin),
that it will not come back (one-shot: its private blocks are evicted first and never written
below the pool), or that it belongs to a session (its blocks are kept for the pod's idle
time, `--session-idle-s`, after each turn). The pool, the DRAM tier and the SSD tier all read
one `RetentionTable`: block hash -> (until, ttl). A tier choosing a victim spares a retained
block (it moves to the most-recently-used end) up to its cap of retained blocks; past the
cap, or when no other block is left to take, the retained block yields — the tier evicts it
and counts it (`yielded`), so a pin never refuses or stalls a request. Every hit renews a
retained block's time by its TTL.

Times are wall-clock seconds (`time.time()`), so the table written beside the SSD tier's
files (`save` / `load`) means the same after a restart; a mark whose time has run is gone.

Thread-safe: the engine thread marks and renews, the SSD writer thread and a peer's pull read.
Reads (`holds`) are one dict lookup, taken without the lock (a dict read is atomic in CPython).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The longest TTL a request may ask (a day): a longer one is an operator's decision.
MAX_TTL_S = 86_400.0
# A file of the table: magic, then entries of (hash length, hash, until, ttl).
_MAGIC = b"PKVRET1\n"
_ENTRY = struct.Struct("<dd")
FILE_NAME = "retention.bin"


@dataclass(frozen=True, slots=True)
class CacheControl:
    """A request's retention asks (gRPC `GenerateRequest.cache_control`, `one_shot`,
    `session_id`; the OpenAI API's extensions of the same names, README "Cache control")."""

    pin_ttl_s: float = 0.0  # > 0: keep the prompt's first `pin_tokens` this long
    pin_tokens: int = 0  # 0: the whole prompt
    one_shot: bool = False
    session_id: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.pin_ttl_s <= MAX_TTL_S:
            raise ValueError(f"cache_control ttl must be between 0 and {MAX_TTL_S:.0f} s, "
                             f"got {self.pin_ttl_s}")
        if self.pin_tokens < 0:
            raise ValueError(f"cache_control tokens must be >= 0, got {self.pin_tokens}")
        if self.one_shot and (self.pin_ttl_s or self.session_id):
            raise ValueError("a one_shot request cannot also pin a prefix or join a session")
        if len(self.session_id) > 256:
            raise ValueError("session_id is at most 256 characters")

    @property
    def pins(self) -> bool:
        return self.pin_ttl_s > 0

    def pin_blocks(self, num_prompt_tokens: int, block_size: int, num_hashes: int) -> int:
        """How many leading full blocks of the prompt the pin covers."""
        tokens = self.pin_tokens or num_prompt_tokens
        return min(min(tokens, num_prompt_tokens) // block_size, num_hashes)


NO_CACHE_CONTROL = CacheControl()


class RetentionTable:
    """block hash -> (until, ttl), capped at `max_blocks` marks."""

    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.time) -> None:
        self.max_blocks = max_blocks
        self._clock = clock
        self._until: dict[bytes, float] = {}
        self._ttl: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self.refused = 0  # marks not taken: the table was full
        self.expired = 0
        self.dirty = False  # changed since the last save
        # Per tier (Medium's value): retained blocks a victim choice passed over, and those
        # evicted all the same. One thread counts each tier, so no lock.
        self.spared: dict[str, int] = {}
        self.yielded: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._until)

    def __bool__(self) -> bool:  # (the hot paths skip an empty table in one test)
        return bool(self._until)

    def now(self) -> float:
        return float(self._clock())

    def holds(self, block_hash: bytes, now: float | None = None) -> bool:
        until = self._until.get(block_hash)
        return until is not None and until > (self._clock() if now is None else now)

    def note(self, tier: str, spared: int, yielded: int) -> None:
        """A tier's victim choice passed over `spared` retained blocks and evicted `yielded`
        all the same; the first yield of a tier is logged (every one is counted)."""
        if spared:
            self.spared[tier] = self.spared.get(tier, 0) + spared
        if yielded:
            if not self.yielded.get(tier):
                logger.warning("retention: tier %s evicted %d retained (pinned or session) "
                               "blocks to make room (over its cap of retained bytes, or nothing "
                               "else left to evict); pagekv_pod_retained_yielded_total{tier} "
                               "counts every one", tier, yielded)
            self.yielded[tier] = self.yielded.get(tier, 0) + yielded

    def spare_lru(self, lru: OrderedDict[bytes, Any], cap: int, tier: str) -> bytes:
        """The victim of a non-empty LRU mapping (oldest first): retained entries ahead of it
        move to the newest end, up to `cap` of them; past that the oldest goes regardless."""
        now = self._clock()
        spared = 0
        for _ in range(min(cap, len(lru))):
            h = next(iter(lru))
            if not self.holds(h, now):
                break
            lru.move_to_end(h)
            spared += 1
        victim = next(iter(lru))
        self.note(tier, spared, 1 if self.holds(victim, now) else 0)
        return victim

    def retain(self, block_hashes: Iterable[bytes], ttl_s: float) -> int:
        """Keep these blocks `ttl_s` from now (a longer time already set stays). Returns how
        many are marked; the rest were refused (the table is full of live marks)."""
        if ttl_s <= 0:
            return 0
        now = self._clock()
        marked = 0
        swept = False  # at most one sweep a call: a full table of live marks stays full
        with self._lock:
            for h in block_hashes:
                until = self._until.get(h)
                if until is None and len(self._until) >= self.max_blocks:
                    if not swept:
                        self._sweep_locked(now)
                        swept = True
                    if len(self._until) >= self.max_blocks:
                        self.refused += 1
                        continue
                self._until[h] = max(until or 0.0, now + ttl_s)
                self._ttl[h] = max(self._ttl.get(h, 0.0), ttl_s)
                marked += 1
            self.dirty = self.dirty or marked > 0
        return marked

    def renew(self, block_hashes: Iterable[bytes]) -> None:
        """A hit: each retained block's time runs its TTL from now again."""
        now = self._clock()
        with self._lock:
            for h in block_hashes:
                ttl = self._ttl.get(h)
                if ttl is not None and self._until[h] > now:
                    self._until[h] = now + ttl
                    self.dirty = True

    def release(self, block_hashes: Iterable[bytes]) -> int:
        """Forget these marks (a delete); returns how many there were."""
        with self._lock:
            gone = 0
            for h in block_hashes:
                if self._until.pop(h, None) is not None:
                    del self._ttl[h]
                    gone += 1
            self.dirty = self.dirty or gone > 0
            return gone

    def sweep(self) -> int:
        """Drop the marks whose time has run; returns how many."""
        with self._lock:
            return self._sweep_locked(self._clock())

    def live(self) -> list[bytes]:
        now = self._clock()
        with self._lock:
            return [h for h, until in self._until.items() if until > now]

    def _sweep_locked(self, now: float) -> int:
        gone = [h for h, until in self._until.items() if until <= now]
        for h in gone:
            del self._until[h]
            del self._ttl[h]
        self.expired += len(gone)
        self.dirty = self.dirty or bool(gone)
        return len(gone)

    # --- beside the SSD tier's files ----------------------------------------------------
    def save(self, directory: str | Path) -> int:
        """Write the live marks to `directory/retention.bin` (atomically); returns how many."""
        now = self._clock()
        with self._lock:
            entries = [(h, u, self._ttl[h]) for h, u in self._until.items() if u > now]
            self.dirty = False
        parts = [_MAGIC]
        for h, until, ttl in entries:
            parts += [bytes((len(h),)), h, _ENTRY.pack(until, ttl)]
        path = Path(directory) / FILE_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(parts))
        os.replace(tmp, path)
        return len(entries)

    def load(self, directory: str | Path) -> int:
        """Read the marks a previous run saved (those still live); returns how many. A missing
        file is no marks; a damaged one is ignored with a warning (pins are a preference,
        never a reason not to start)."""
        path = Path(directory) / FILE_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            logger.warning("retention: cannot read %s (%s): no pins restored", path, exc)
            return 0
        entries = _parse(data)
        if entries is None:
            logger.warning("retention: %s is damaged: no pins restored", path)
            return 0
        now = self._clock()
        with self._lock:
            for h, until, ttl in entries:
                if until > now and 0 < ttl <= MAX_TTL_S and len(self._until) < self.max_blocks:
                    self._until[h] = min(until, now + ttl)
                    self._ttl[h] = ttl
            return len(self._until)


def _parse(data: bytes) -> list[tuple[bytes, float, float]] | None:
    if not data.startswith(_MAGIC):
        return None
    out = []
    at = len(_MAGIC)
    while at < len(data):
        n = data[at]
        end = at + 1 + n + _ENTRY.size
        if n == 0 or end > len(data):
            return None
        until, ttl = _ENTRY.unpack_from(data, at + 1 + n)
        out.append((data[at + 1 : at + 1 + n], until, ttl))
        at = end
    return out

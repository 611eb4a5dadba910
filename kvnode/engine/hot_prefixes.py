"""The pod's hottest prefixes: what a new pod of the fleet pre-warms from it (issue #31).

Each finished request that hit cached blocks counts one hit for its deepest hit prefix (the
prompt's first `num_hit_blocks` blocks, keyed by the last one's hash, which names the whole
chain: its salt, adapter and every token before it). The table keeps the most-hit prefixes
in bounded memory with the space-saving scheme of Metwally et al.: a new prefix arriving at a
full table replaces the least-hit one and inherits its count, so a prefix that is truly hot
is never missed and the counts overestimate by at most the smallest one kept.

A scale-out pod (`pagekv node --prewarm-hottest N`) asks its peers for theirs
(`CacheAdmin.HotPrefixes`, admin token) and warms the top N by pulling from them. Tokens are
kept as 4-byte arrays: the table holds at most `max_tokens` of them.

Thread-safe: the engine thread records, the admin call reads.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CAPACITY = 256
DEFAULT_MAX_TOKENS = 1 << 18


@dataclass(slots=True)
class HotPrefix:
    key: bytes  # the hash of its last block
    token_ids: array  # whole blocks
    cache_salt: str | None
    lora_id: str | None
    tenant: str
    hits: int


class HotPrefixes:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_tokens: int = DEFAULT_MAX_TOKENS
                 ) -> None:
        self.capacity = capacity
        self.max_tokens = max_tokens
        self._entries: dict[bytes, HotPrefix] = {}
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, key: bytes, token_ids: Sequence[int], cache_salt: str | None,
               lora_id: str | None, tenant: str) -> None:
        """One hit on the prefix `token_ids` (whole blocks) whose last block hashes to `key`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.hits += 1
                return
            if len(token_ids) > self.max_tokens:
                return
            inherited = 0
            while self._entries and (len(self._entries) >= self.capacity
                                     or self._tokens + len(token_ids) > self.max_tokens):
                coldest = min(self._entries.values(), key=lambda e: e.hits)
                inherited = max(inherited, coldest.hits)
                del self._entries[coldest.key]
                self._tokens -= len(coldest.token_ids)
            self._entries[key] = HotPrefix(key, array("I", token_ids), cache_salt, lora_id,
                                           tenant, inherited + 1)
            self._tokens += len(token_ids)

    def top(self, n: int) -> list[HotPrefix]:
        """The `n` most-hit prefixes, most first (copies)."""
        with self._lock:
            ranked = sorted(self._entries.values(), key=lambda e: (-e.hits, e.key))[:n]
            return [HotPrefix(e.key, array("I", e.token_ids), e.cache_salt, e.lora_id,
                              e.tenant, e.hits) for e in ranked]

"""The tiers a block can live in, named once: wire name, index code letter, bit.

`Medium` is vLLM's word (its KV events carry `medium="GPU"|"CPU"|"DISK"`), and its values are
those strings, so events from unmodified vLLM pods read the same. The pool is "GPU" whatever
the device; "CPU" is the DRAM tier, "DISK" the SSD tier. Members are best (cheapest to serve)
first. A `StrEnum` member equals its string, so a medium read off the wire or out of Redis
compares equal without conversion.
"""

from __future__ import annotations

from enum import StrEnum


class Medium(StrEnum):
    GPU = "GPU"  # the KV pool itself
    CPU = "CPU"  # the DRAM tier
    DISK = "DISK"  # the SSD tier

    @property
    def code(self) -> str:
        """One letter for index claim values (docs/INDEX.md)."""
        return _CODE[self]

    @property
    def bit(self) -> int:
        """This medium's bit in a tier bitmask."""
        return _BIT[self]

    @classmethod
    def from_code(cls, code: str) -> Medium:
        return _FROM_CODE[code]


MEDIUMS: tuple[Medium, ...] = tuple(Medium)  # best first
# The share of a request's cached tokens pulled from a peer pod (GenerateRequest.kv_source):
# a key of the per-tier token counts, not a medium (the blocks land in the pool).
PEER_SHARE = "PEER"
OFFLOAD_MEDIUMS: tuple[Medium, ...] = (Medium.CPU, Medium.DISK)  # the tiers below the pool
ALL_BITS = (1 << len(MEDIUMS)) - 1

_CODE = {Medium.GPU: "G", Medium.CPU: "C", Medium.DISK: "D"}
_BIT = {m: 1 << i for i, m in enumerate(MEDIUMS)}
_FROM_CODE = {code: m for m, code in _CODE.items()}


def mask_codes(mask: int) -> str:
    """The code letters of the media in `mask`, best first ("GC" for pool + DRAM)."""
    return "".join(m.code for m in MEDIUMS if mask & m.bit)

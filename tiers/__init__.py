"""Offload tiers below the KV pool: DRAM, SSD, the chain that demotes and promotes, the codec.

Exports resolve lazily so `tiers.codec` / `tiers.ssd_format` stay importable without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Tier": "pagekv.tiers.base",
    "DramTier": "pagekv.tiers.dram",
    "SsdTier": "pagekv.tiers.ssd",
    "TierChain": "pagekv.tiers.chain",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiers' has no attribute {name!r}")

"""Shared by the SSD tier's tests (tests/unit/test_tiers_ssd_*.py): the block layout, blocks
and hashes made from an index, and the tier's segment files. The make_tier and stalled_sync
fixtures are in conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagekv.tiers.ssd import SsdTier

LAYOUT = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": "float16"}
BB = 2 * 2 * 16 * 2 * 32 * 2  # layers * (K,V) * tokens * heads * head_size * 2 bytes = 8 KiB
MiB = 1 << 20


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(BB // 2, generator=gen).half().view(torch.uint8)


def tokens(i: int) -> list[int]:
    return list(range(i * 16, i * 16 + 16))


def segment_files(tier: SsdTier) -> list[Path]:
    return sorted(Path(tier.directory).glob("seg-*.pkv"))


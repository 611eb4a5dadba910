"""Shared by the SSD tier's tests (tests/unit/test_tiers_ssd_*.py): the block layout, blocks
and hashes made from an index, the tier's segment files, a small real filesystem. The
make_tier and stalled_sync fixtures are in conftest.py.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
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


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "4m") -> Iterator[Path]:
    """A real filesystem of `size` mounted at `path` (a fresh directory), unmounted after; the
    test is skipped, saying why, only where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the full-disk tests need a small tmpfs")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here ({got.stderr.strip() or got.returncode}): "
                    "the full-disk tests need root or CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # still busy: detach

"""Unit-test fixtures shared by several modules: the SSD tier's (test_tiers_ssd_*.py, helpers
in ssd_fixtures.py) and the checkpoint shapes' (test_model_shapes_*.py, helpers in
model_shapes_cases.py). Helpers are imported inside the fixtures, so that collecting a unit test
that uses none of these imports nothing for them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pagekv.tiers.ssd import SsdTier


# -- the SSD tier's tests (test_tiers_ssd_*.py) --------------------------------------------------

@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., SsdTier]]:
    from pagekv.tiers.ssd import SsdTier
    from tests.unit.ssd_fixtures import BB, LAYOUT, MiB

    made: list[SsdTier] = []

    def make(directory: Path | None = None, **kw: object) -> SsdTier:
        kw.setdefault("capacity_bytes", 64 * MiB)
        tier = SsdTier(directory or tmp_path / "ssd", block_bytes=BB, layout=LAYOUT, **kw)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def stalled_sync(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """While the returned event is clear, the writer stops before each write (starts set)."""
    from pagekv.tiers.ssd_writer import SsdWriter

    release = threading.Event()
    release.set()
    real = SsdWriter.write_batch

    async def held(self: SsdWriter, batch: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        await real(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(SsdWriter, "write_batch", held)
    return release


# -- the checkpoint shapes' tests (test_model_shapes_*.py) -------------------------------------

@pytest.fixture(scope="module")
def one_thread():
    """These models are tiny: threads only add synchronisation, which costs seconds per test
    on a busy machine. (Each test_model_shapes_*.py module uses it for all its tests.)"""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """case -> checkpoint directory, each written once per session (the tests only read
    them: one that edits a checkpoint copies it first)."""
    from tests.unit.model_shapes_cases import save_case

    dirs: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in dirs:
            dirs[case] = tmp_path_factory.mktemp(case)
            save_case(dirs[case], case)
        return dirs[case]

    return get

"""The SSD tier on real files: failures (an unwritable directory, an I/O error: disabled with one
log line; a block of the wrong size). A full disk does not disable it: test_tiers_ssd_full.py.
Fixtures: conftest.py (make_tier, stalled_sync); helpers: ssd_fixtures.py.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagekv.tiers.ssd import SsdTier
from tests.unit.ssd_fixtures import BB, LAYOUT, MiB, block, h


# --- failures -------------------------------------------------------------------------------------
def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pagekv.tiers.ssd" and r.levelno >= logging.ERROR]


def test_unwritable_directory_disables_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    caplog.set_level(logging.INFO)
    tier = SsdTier(not_a_dir / "ssd", 64 * MiB, BB, LAYOUT)
    try:
        assert tier.disabled
        assert not tier.put(h(1), block(1))
        assert tier.get(h(1)) is None and tier.pop(h(1)) is None
        assert not tier.contains(h(1))
        assert tier.flush(1)
        errors = _errors(caplog)
        assert len(errors) == 1
        assert "disabled" in errors[0].getMessage() and "\n" not in errors[0].getMessage()
    finally:
        tier.close()


def test_io_error_disables_with_one_log_line_and_reports_losses(
    make_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier()
    tier.put(h(0), block(0))
    tier.flush(30)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", broken)
    caplog.set_level(logging.INFO)
    accepted = {h(i) for i in range(1, 6) if tier.put(h(i), block(i))}
    assert accepted  # refused only once the failure is known
    assert tier.flush(30)
    assert tier.disabled
    assert tier.stats()["disabled"] == 1
    errors = _errors(caplog)
    assert len(errors) == 1 and "[Errno 5] Input/output error" in errors[0].getMessage()
    # Everything it held is reported lost; from now on it is an always-miss tier.
    assert set(tier.take_dropped()) == {h(0)} | accepted
    assert tier.get(h(0)) is None and not tier.put(h(9), block(9))
    assert len(_errors(caplog)) == 1


def test_wrong_block_size_is_rejected(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    with pytest.raises(ValueError, match="blocks of"):
        tier.put(h(1), torch.zeros(10, dtype=torch.uint8))

"""An SSD tier's directory belongs to one tier at a time (tiers/dir_lock.py): a second
process, or a second tier in this one, is refused with the holder named; closing the tier, or
the holder's death by SIGKILL, frees the directory at once and the next tier recovers its
blocks. The holders here are real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagekv.tiers.dir_lock import DirectoryInUse, DirectoryLock, holder_description
from pagekv.tiers.ssd import SsdTier
from tests.unit.ssd_fixtures import BB, LAYOUT, MiB, block, h, tokens

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = 6

# A process that opens a tier on argv[1] as pod argv[2], writes BLOCKS blocks, says "ready"
# and waits to be killed; or says "refused: <message>" and exits 3.
HOLDER = f"""
import sys, time
from pagekv.tiers.dir_lock import DirectoryInUse, describe_holder_as
from pagekv.tiers.ssd import SsdTier
from tests.unit.ssd_fixtures import BB, LAYOUT, MiB, block, h, tokens

describe_holder_as(sys.argv[2])
try:
    tier = SsdTier(sys.argv[1], 64 * MiB, BB, LAYOUT)
except DirectoryInUse as e:
    print("refused:", e, flush=True)
    sys.exit(3)
for i in range({BLOCKS}):
    assert tier.put(h(i), block(i), token_ids=tokens(i))
assert tier.flush(30)
print("ready", flush=True)
time.sleep(120)
"""


def start_holder(directory: Path, pod_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), pod_id], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = start_holder(tmp_path / "ssd", "node-a")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # a dead child closes its stdout: no hang
        assert line == "ready\n", line + proc.communicate(timeout=30)[1]
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_a_second_process_is_refused_naming_the_holder(tmp_path: Path,
                                                       holder: subprocess.Popen[str]) -> None:
    second = start_holder(tmp_path / "ssd", "node-b")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 3, out + err
    assert out.startswith("refused: SSD tier directory"), out
    assert f"in use by pod node-a (pid {holder.pid} on host " in out
    assert "give each its own --disk-offload-dir" in out
    # The refused process wrote nothing: no segment of node-b's beside node-a's.
    assert len(list((tmp_path / "ssd").glob("layout-*/seg-*.pkv"))) == 1


def test_a_sigkilled_holders_directory_is_free_at_once_and_recovered(
        tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    with pytest.raises(DirectoryInUse):
        SsdTier(tmp_path / "ssd", 64 * MiB, BB, LAYOUT)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(30)
    assert holder.returncode == -signal.SIGKILL
    tier = SsdTier(tmp_path / "ssd", 64 * MiB, BB, LAYOUT)  # no stale lock to clean up
    try:
        recovered = tier.take_recovered()
        assert [(r.block_hash, list(r.token_ids)) for r in recovered] == [
            (h(i), tokens(i)) for i in range(BLOCKS)]
        for i in range(BLOCKS):
            got = tier.get(h(i))
            assert got is not None and bool((got == block(i)).all()), i
    finally:
        tier.close()


def test_a_second_tier_in_one_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first = SsdTier(tmp_path / "ssd", 64 * MiB, BB, LAYOUT)
    try:
        assert first.put(h(1), block(1))
        with pytest.raises(DirectoryInUse, match=f"pid {os.getpid()}"):
            SsdTier(tmp_path / "ssd", 64 * MiB, BB, {**LAYOUT, "num_layers": 3})  # any layout
    finally:
        first.close()
    again = SsdTier(tmp_path / "ssd", 64 * MiB, BB, LAYOUT)
    try:
        assert again.get(h(1)) is not None
    finally:
        again.close()


def test_an_unlockable_directory_still_disables_the_tier_not_the_pod(tmp_path: Path) -> None:
    """A path that cannot be a directory: the tier starts disabled (as before the lock), the
    caller is not refused."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tier = SsdTier(blocker / "ssd", 64 * MiB, BB, LAYOUT)
    try:
        assert tier.disabled and not tier.put(h(1), block(1))
    finally:
        tier.close()


def test_release_frees_the_lock_and_the_record_names_the_holder(tmp_path: Path) -> None:
    lock = DirectoryLock(tmp_path)
    with pytest.raises(DirectoryInUse) as refused:
        DirectoryLock(tmp_path)
    assert refused.value.holder is not None and refused.value.holder["pid"] == os.getpid()
    lock.release()
    lock.release()  # idempotent
    DirectoryLock(tmp_path).release()


def test_holder_description_says_what_the_record_knows() -> None:
    assert holder_description(None).startswith("another process")
    assert holder_description({"pid": 7}) == "another process (pid 7)"
    assert holder_description({"pid": 7, "host": "h", "pod_id": "node-a", "since": "t"}) == (
        "pod node-a (pid 7 on host h, since t)")

"""One process at a time in a directory: an OS lock (`flock`) on a file inside it.

The SSD tier holds it for its whole life, so two pods given the same --disk-offload-dir never
write segments side by side (each would read the other's segments as its own and drop the
blocks it cannot find). `flock` belongs to the open file: closing it releases the lock, and so
does the death of the process, SIGKILL included. A killed pod's directory is therefore free
for its successor at once, with no stale lock file to clean up; the file stays and is reused.

The file also records who holds it (pid, host, pod, since when), so the refusal can name the
holder. The pod id comes from the program that runs the process (`pagekv node` calls
`describe_holder_as`): the tier itself does not know which pod it belongs to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE_NAME = "pagekv.lock"
_HOLDER_RECORD_MAX = 4096
_holder_label: dict[str, str] = {}  # what this process calls itself in the lock files it holds


def describe_holder_as(pod_id: str) -> None:
    """Name this process's pod in every lock it takes from now on (one per process)."""
    _holder_label["pod_id"] = pod_id


def holder_description(record: dict[str, object] | None) -> str:
    """'pod node-a (pid 123 on host h, since 2024-05-01 12:00:00)', as far as the record goes."""
    if not record:
        return "another process (it has not written its name yet)"
    where = " ".join(part for part in (
        f"pid {record['pid']}" if "pid" in record else "",
        f"on host {record['host']}" if "host" in record else "") if part)
    details = ", ".join(part for part in (
        where, f"since {record['since']}" if "since" in record else "") if part)
    who = f"pod {record['pod_id']}" if record.get("pod_id") else "another process"
    return f"{who} ({details})" if details else who


class DirectoryInUse(OSError):
    """The directory is locked by another live process (or another open lock in this one)."""

    def __init__(self, directory: Path, holder: dict[str, object] | None) -> None:
        self.directory = directory
        self.holder = holder
        super().__init__(
            errno.EBUSY,
            f"SSD tier directory {directory} is in use by {holder_description(holder)}: two "
            "pods must not share one directory; give each its own --disk-offload-dir "
            "(under `pagekv up`: put {pod_id} in the path)")

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 16]"
        return str(self.strerror)


class DirectoryLock:
    """Held from construction to `release()` (or the process's end). Raises DirectoryInUse
    when another holder has it, OSError when the directory or the file cannot be made."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / LOCK_FILE_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise DirectoryInUse(self.directory, holder) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S"), **_holder_label}
        with contextlib.suppress(OSError):  # the record is for messages only; the lock holds
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock (closing the file does it). Idempotent. The file stays for the next holder:
        removing it would let a third process lock a new file while a second waits on the
        old one."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_record(fd: int) -> dict[str, object] | None:
    try:
        record = json.loads(os.pread(fd, _HOLDER_RECORD_MAX, 0) or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None

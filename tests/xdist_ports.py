"""Free ports under pytest-xdist: each worker picks from a slice of its own.

deploy/redis_server.free_port asks the OS for a free port and closes it; the process that was
handed it binds it seconds later (a pod binds once its model has loaded). Another worker's
free_port can be offered the same port in between (measured: 3,000 picks on this box gave 274
repeats), and one of the two processes then fails to bind ("Address already in use"). Each
worker keeps only the ports of its own slice, and none it handed out recently, so no two
workers, and no two pickers of one worker, ever hold the same port. The function keeps its
contract (a port that was free a moment ago); only which one changes."""

from __future__ import annotations

import sys
from collections import deque

from pagekv.deploy import redis_server

RECENT = 256  # ports this worker handed out lately: not handed out again


def slice_of(port: int, count: int) -> int:
    # Halved first: the kernel hands out ports of one parity for bind(0) (odd here).
    return (port // 2) % count


def install(index: int, count: int) -> None:
    """Rebind redis_server.free_port (in pytest_configure, before collection: the modules
    imported later that `from ... import free_port` get this one; any imported earlier are
    rebound here too)."""
    ask_os = redis_server.free_port
    recent: deque[int] = deque(maxlen=RECENT)

    def free_port(host: str = "127.0.0.1") -> int:
        while True:
            port = ask_os(host)
            if slice_of(port, count) == index and port not in recent:
                recent.append(port)
                return port

    free_port.__doc__ = f"{ask_os.__doc__} (xdist worker {index} of {count}: its own ports)"
    for module in list(sys.modules.values()):
        if getattr(module, "free_port", None) is ask_os:
            module.free_port = free_port

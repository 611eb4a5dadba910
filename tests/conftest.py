"""Shared pytest configuration: make the repository root importable; under pytest-xdist
(`make test` runs `-n 3 --dist loadgroup`), hand out whole groups of tests to the workers
(tests/xdist_groups.py says which, tests/xdist_scheduling.py schedules them), each
worker picking free ports of its own (tests/xdist_ports.py)."""
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.xdist_groups import write_groups  # noqa: E402  (needs ROOT on sys.path)

GROUPS_DIR_KEY = "pagekv_groups_dir"  # in each worker's workerinput
groups_dir_key = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    # Registered by xdist too; here so that a run without xdist does not warn about it.
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker with the "
                            "other tests of that name (tests/xdist_groups.py)")
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        config.stash[groups_dir_key] = Path(tempfile.mkdtemp(prefix="pagekv-xdist-groups-"))
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: ports of its own (tests/xdist_ports.py)
        # and one torch/OpenMP thread (read when torch is first imported, in collection, and
        # by the processes it starts): three workers on two cores already fill them, and a
        # second thread would mostly spin at barriers. A test that wants more sets them.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from tests.xdist_ports import install

        install(int(workerinput["workerid"].removeprefix("gw")), workerinput["workercount"])


def pytest_unconfigure(config: pytest.Config) -> None:
    if groups_dir_key in config.stash:
        shutil.rmtree(config.stash[groups_dir_key], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller tells each worker where to write its groups."""
    if groups_dir_key in node.config.stash:
        node.workerinput[GROUPS_DIR_KEY] = str(node.config.stash[groups_dir_key])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if groups_dir_key not in config.stash:
        return None  # another --dist mode: xdist's own scheduler
    from tests.xdist_scheduling import GroupScheduling

    return GroupScheduling(config, log, config.stash[groups_dir_key])


@pytest.hookimpl(trylast=True)  # the final collection: after every other hook reordered it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput = getattr(config, "workerinput", {})
    if GROUPS_DIR_KEY in workerinput:
        write_groups(Path(workerinput[GROUPS_DIR_KEY]), workerinput["workerid"], items)

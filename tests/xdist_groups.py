"""Which tests pytest-xdist keeps on one worker (`make test`: `-n 3 --dist loadgroup`, its
scheduler replaced by xdist_scheduling.py's, which reads these groups).

* A module is one group: its module-scoped servers and pods start once, as in a serial run.
* Modules sharing a session-scoped cluster (SHARED_FIXTURES) are one group: one cluster for
  all of them, as in a serial run, not one per worker that happens to get one of them.
* Modules marked `xdist_group(NAME)` themselves share NAME's group with every other module
  so marked: the network-namespace beds (`netns`) run one at a time, as their 10.77.x subnet
  pick and their shaped links expect.

Without xdist nothing here runs. (xdist's own loadgroup cannot do this under pytest 9.2: it
renames node ids through an attribute that pytest no longer reads, so every test would be a
group of its own, splitting modules and session clusters across workers.)"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

# Session fixtures that start processes (seconds each): a worker should start each at most once.
SHARED_FIXTURES = ("contract_cluster", "chat_cluster")


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def explicit_group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def module_groups(items: list[pytest.Item]) -> dict[str, str]:
    """module path -> group name: modules linked by a shared fixture or an explicit group name
    are merged (union-find over modules and those names)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    links: dict[str, set[str]] = defaultdict(set)
    for item in items:
        module = module_of(item)
        find(module)
        names = {f"fixture:{f}" for f in SHARED_FIXTURES if f in item.fixturenames}
        group = explicit_group(item)
        if group is not None:
            names.add(f"group:{group}")
        links[module] |= names
    for module, names in links.items():
        for name in names:
            union(module, name)
    members: dict[str, list[str]] = defaultdict(list)
    for module in links:
        members[find(module)].append(module)
    named = {}
    for modules in members.values():
        explicit = sorted({n.removeprefix("group:") for m in modules for n in links[m]
                           if n.startswith("group:")})
        if len(explicit) > 1:  # xdist would put each name's tests in a group of its own
            raise pytest.UsageError(f"modules {sorted(modules)} share a session fixture "
                                    f"but are marked with different groups {explicit}")
        if explicit:
            label = explicit[0]
        elif len(modules) == 1:
            label = modules[0]
        else:
            label = f"{sorted(modules)[0]}+{len(modules) - 1}"
        for module in modules:
            named[module] = label
    return named


def write_groups(directory: Path, worker: str, items: list[pytest.Item]) -> None:
    """This worker's module -> group map, for the controller's scheduler (xdist_scheduling.py):
    it sees only node ids, so the groups, which need the collected items, come from here."""
    path = directory / f"{worker}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(module_groups(items)))
    os.replace(partial, path)  # the scheduler reads it whole or not at all


def read_groups(directory: Path) -> dict[str, str]:
    """The workers' maps (every worker collected the same tests: they agree)."""
    groups: dict[str, str] = {}
    for path in sorted(directory.glob("*.json")):
        groups.update(json.loads(path.read_text()))
    return groups

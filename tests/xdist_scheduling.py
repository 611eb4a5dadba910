"""The controller's side of the xdist groups (tests/xdist_groups.py): a scheduler that hands
out whole groups, as xdist's loadfile hands out whole files, with the groups the workers
computed from their collected tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from tests.xdist_groups import read_groups


class GroupScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is a test's group. `_split_scope` is the method
    xdist's own schedulers (loadfile, loadgroup) override to say what a scope is."""

    def __init__(self, config: pytest.Config, log: Producer, groups_dir: Path) -> None:
        super().__init__(config, log)
        self.groups_dir = groups_dir
        self.groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        # First called once every worker has collected, so every map is written by then.
        if self.groups is None:
            self.groups = read_groups(self.groups_dir)
            if not self.groups:
                raise RuntimeError(f"no worker wrote its test groups into {self.groups_dir}")
        module = nodeid.split("::", 1)[0]
        return self.groups.get(module, module)

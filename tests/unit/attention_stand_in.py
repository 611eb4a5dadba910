"""Put a stand-in in place of one of the attention package's kernel modules for a test.

The dispatcher imports its kernel modules with `from pagekv.kvnode.model.attention import
cpu_kernel`, which finds an already imported submodule as the package's attribute before it
looks in sys.modules: both are replaced (None: the module fails to import).
"""

from __future__ import annotations

import sys
import types

import pytest

from pagekv.kvnode.model import attention


def stand_in(monkeypatch: pytest.MonkeyPatch, name: str, module: types.ModuleType | None) -> None:
    monkeypatch.setitem(sys.modules, name, module)
    attr = name.rsplit(".", 1)[1]
    if module is None:
        monkeypatch.delattr(attention, attr, raising=False)
    else:
        monkeypatch.setattr(attention, attr, module, raising=False)

"""The layer rules of docs/ARCHITECTURE.md, enforced by walking every module's imports.

A layer may import the layers below it and never one above. The contract (`proto`) and the
router are light processes' code: they never import torch, and importing them must not pull
torch in by way of something else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Project packages a layer may import (its own included). Third-party imports are free
# except where FORBIDDEN_THIRD_PARTY says otherwise.
# Layers are named by their folders; installed (and imported) they live under `pagekv.`.
ALLOWED: dict[str, set[str]] = {
    "proto": {"proto"},
    "tiers": {"proto", "tiers"},
    "router": {"proto", "router"},
    "kvnode.memory": {"proto", "kvnode.memory"},
    "kvnode.model": {"proto", "kvnode.model"},
    "kvnode.engine": {"proto", "tiers", "kvnode.memory", "kvnode.model", "kvnode.engine"},
    # the publisher and the vLLM ingester: no engine (the memory layer only for Histogram)
    "kvnode.index": {"proto", "kvnode.memory", "kvnode.index"},
    "kvnode.pod": {"proto", "tiers", "kvnode"},
    "kvnode": {"proto", "tiers", "kvnode"},  # the package's own face (kvnode/__init__.py)
    # the public API (lazily) and the `pagekv` command's dispatcher (pagekv/cli.py)
    "pagekv": {"proto", "tiers", "kvnode", "router", "deploy", "pagekv"},
    "deploy": {"proto", "tiers", "kvnode", "router", "deploy"},
}
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "proto": {"torch", "ray", "numpy"},
    "router": {"torch", "ray", "numpy", "safetensors"},
    "kvnode.memory": {"torch"},
    "kvnode.index": {"torch", "numpy"},
}
PROJECT = ("proto", "tiers", "router", "kvnode", "deploy")
NAMESPACE = "pagekv."


def layer_of(module: str) -> str | None:
    """The most specific layer a dotted module name belongs to."""
    best = None
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and (
                best is None or len(layer) > len(best)):
            best = layer
    return best


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _names_a_module(text: str) -> bool:
    """Is this string the dotted name of one of the project's modules (`pagekv.router.cli`)?"""
    if not text.startswith(NAMESPACE) or not all(p.isidentifier() for p in text.split(".")):
        return False
    rel = Path(*text.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def imports_of(path: Path, mod: str) -> list[tuple[int, str]]:
    """Every absolute module a file imports, at any depth (functions, TYPE_CHECKING too), and
    every string constant that names a project module: the dispatcher's lazily imported
    subcommands, or any other import by string, are checked like import statements."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = NAMESPACE + ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                _names_a_module(node.value):
            out.append((node.lineno, node.value))
    return out


def source_files() -> list[Path]:
    """The product's modules, each once: pagekv/kvnode etc. are symlinks to the top-level
    folders (so static tools resolve `pagekv.kvnode`), not more modules."""
    return [p for top in (*PROJECT, "pagekv") for p in sorted((ROOT / top).rglob("*.py"))
            if not any((ROOT / d).is_symlink() for d in p.relative_to(ROOT).parents)]


def violations_in(path: Path, mod: str) -> list[str]:
    layer = layer_of(mod)
    if layer is None:
        return [f"{mod}: belongs to no layer (add it to ALLOWED and ARCHITECTURE.md)"]
    bad = []
    # grpc only in the generated code, in proto.serving (the servers' shared pieces) and in
    # proto.grpc_security (TLS and tokens: pods, the router and every client need the same)
    serving = mod.startswith("proto.pagekv.") or mod in ("proto.serving", "proto.grpc_security")
    for lineno, target in imports_of(path, mod):
        where = f"{mod}:{lineno} imports {target}"
        top = target.split(".")[0]
        if top in PROJECT:
            bad.append(f"{where}: import the project through its namespace (pagekv.{target})")
            continue
        if target.startswith(NAMESPACE):
            target = target[len(NAMESPACE):]
            top = target.split(".")[0]
        if top in PROJECT:
            if not any(target == a or target.startswith(a + ".") for a in ALLOWED[layer]):
                bad.append(f"{where}: layer {layer} may import only {sorted(ALLOWED[layer])}")
        elif top in FORBIDDEN_THIRD_PARTY.get(layer, set()):
            bad.append(f"{where}: layer {layer} must not import {top}")
        elif top in ("grpc", "grpc_health") and layer == "proto" and not serving:
            bad.append(f"{where}: the contract's own modules do not import grpc")
    return bad


def test_every_import_respects_the_layers() -> None:
    bad = [v for path in source_files() for v in violations_in(path, module_name(path))]
    assert not bad, "layer rules broken:\n" + "\n".join(bad)


def test_the_checker_sees_violations(tmp_path: Path) -> None:
    """The walk finds imports inside functions, relative ones, and forbidden libraries."""
    f = tmp_path / "probe.py"
    f.write_text("def f():\n    from pagekv.kvnode.engine import engine\n    from . import base\n"
                 "import torch\n")
    assert sorted(t for _, t in imports_of(f, "tiers.probe")) == [
        "pagekv.kvnode.engine", "pagekv.tiers", "torch"]
    assert len(violations_in(f, "tiers.probe")) == 1  # tiers may use torch, not kvnode
    assert len(violations_in(f, "router.probe")) == 2  # neither kvnode nor torch
    assert len(violations_in(f, "kvnode.pod.probe")) == 0
    bare = tmp_path / "bare.py"
    bare.write_text("from kvnode.engine import engine\n")  # not through the namespace
    assert ["namespace" in v for v in violations_in(bare, "kvnode.pod.bare")] == [True]
    by_name = tmp_path / "by_name.py"  # an import by string is an import too
    by_name.write_text('import importlib\nimportlib.import_module("pagekv.router.cli")\n'
                       '"""pagekv.router.cli is named in prose here."""\n')
    assert len(violations_in(by_name, "kvnode.index.by_name")) == 1
    assert violations_in(by_name, "pagekv.cli") == []


def test_the_checkout_resolves_pagekv_as_python_does() -> None:
    """pagekv/<folder> is a symlink to the folder, so static tools see `pagekv.kvnode`."""
    for top in PROJECT:
        link = ROOT / "pagekv" / top
        assert link.is_symlink() and link.resolve() == (ROOT / top).resolve(), link
    assert {p.name for p in (ROOT / "pagekv").iterdir() if p.suffix == ".py"} == {
        "__init__.py", "__main__.py", "cli.py"}


@pytest.mark.parametrize("module", [
    "pagekv", "pagekv.proto.hashing", "pagekv.proto.kv_events", "pagekv.proto.medium",
    "pagekv.router.server", "pagekv.router.cli", "pagekv.kvnode.memory.kv_cache_manager",
    "pagekv.kvnode.pod.client", "pagekv.kvnode.index.vllm_ingest_cli", "pagekv.cli",
])
def test_light_modules_do_not_pull_torch_in(module: str) -> None:
    """Importing the module in a fresh interpreter leaves torch (and ray) unloaded."""
    code = (f"import sys, {module}\n"
            "heavy = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_grpc_in_the_contract_only_where_servers_share_it(tmp_path: Path) -> None:
    f = tmp_path / "probe.py"
    f.write_text("import grpc\nfrom grpc_health.v1 import health\n")
    assert len(violations_in(f, "proto.hashing_probe")) == 2
    assert violations_in(f, "proto.serving") == []
    assert violations_in(f, "proto.pagekv.v1.pagekv_pb2_grpc") == []

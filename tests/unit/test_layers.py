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
    "proto": {"torch", "ray", "numpy", "gguf"},
    "router": {"torch", "ray", "numpy", "safetensors", "gguf"},
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
    """Importing the module in a fresh interpreter leaves torch (and ray, and gguf: the model
    layer imports it only for a tensor type PageKV does not dequantize itself) unloaded."""
    code = (f"import sys, {module}\n"
            "heavy = sorted(m for m in ('torch', 'ray', 'gguf') if m in sys.modules)\n"
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


# Third-party internals the product has to touch: attribute -> (the modules that may, why).
PRIVATE_ACCESS_ALLOWED: dict[str, tuple[tuple[str, ...], str]] = {
    "_actions": (("pagekv.cli",), "argparse has no public list of a parser's arguments; "
                 "--config FILE.yaml maps each of its keys to the flag that parses it"),
    "_subparsers": (("pagekv.cli",), "argparse has no public way from a parser back to the "
                    "action add_subparsers() made; --config needs the chosen subcommand's parser"),
    "_group_actions": (("pagekv.cli",), "(the same) that action is in the subparsers group's "
                       "_group_actions"),
    "_get_help_string": (("pagekv.cli",), "HelpFormatter's only hook for one flag's help line "
                         "(argparse calls the formatters' methods implementation details): the "
                         "CLI's formatter overrides it and falls back to super()'s"),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_members(cls: ast.ClassDef) -> set[str]:
    """What a class defines itself: its methods and class attributes, and every attribute
    its methods assign on self / cls (not what classes nested in it define)."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    stack: list[ast.AST] = list(cls.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        stack.extend(ast.iter_child_nodes(node))
    return names


def private_accesses(path: Path, mod: str) -> tuple[list[str], set[str]]:
    """The accesses `x._name` in a module that reach into another object's private members,
    and the PRIVATE_ACCESS_ALLOWED attributes the module uses.

    `x._name` (one leading underscore or a mangled `__name`; dunders are public) is the
    object's own business, and fine, when
    - `x` is `self` or `cls`;
    - the access is written inside a class of this module that defines `_name` itself (a
      method, a class attribute or a `self._name =` in one of its methods): one instance of
      a class may use another's members (`other._key` in `__eq__`);
    - `_name` is defined by a private class of this module (`class _Pending`): such a class
      is the module's own helper as a whole, not a face for anyone else;
    - `x` is `super()` inside a class whose bases are all classes of this module: the base's
      implementation is the module's own. (A base from elsewhere, argparse's formatter, is
      another module's internals: allow-listed or not at all.)
    Anything else, `triton_decode._decode_split_kernel` or `chain._tree` from a module that
    is not the chain's, fails unless PRIVATE_ACCESS_ALLOWED lets this module touch that
    attribute, with its reason: only third-party internals with no public way to them (an
    underscored public API like a namedtuple's `_replace` would go there too). The check is
    by name, not by type: the rule is what a reader sees in the module's text.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    members: dict[ast.ClassDef, set[str]] = {}
    helpers: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            members[node] = _class_members(node)
            if node.name.startswith("_"):
                helpers |= members[node]
    local_classes = {c.name for c in members}
    bad: list[str] = []
    listed: set[str] = set()

    def own(access: ast.Attribute, classes: tuple[ast.ClassDef, ...]) -> bool:
        value = access.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            return True
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id == "super"):
            return bool(classes) and all(isinstance(b, ast.Name) and b.id in local_classes
                                         for b in classes[-1].bases)
        return any(access.attr in members[c] for c in classes) or access.attr in helpers

    def visit(node: ast.AST, classes: tuple[ast.ClassDef, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (*classes, child) if isinstance(child, ast.ClassDef) else classes
            if isinstance(child, ast.Attribute) and _is_private(child.attr) \
                    and not own(child, classes):
                if mod in PRIVATE_ACCESS_ALLOWED.get(child.attr, ((), ""))[0]:
                    listed.add(child.attr)
                else:
                    bad.append(f"{mod}:{child.lineno} {ast.unparse(child)}")
            visit(child, inner)

    visit(tree, ())
    return bad, listed


def test_no_module_touches_another_objects_privates() -> None:
    """A leading underscore is its owner's business: a module uses another object's members
    through its public face (see private_accesses for what counts as the module's own).
    The product only: generated gRPC code (`*_pb2*.py`) is protobuf's, tests and bench may
    look inside. Every allow-list entry is still needed."""
    bad: list[str] = []
    used: set[str] = set()
    for path in source_files():
        if "_pb2" in path.name:
            continue
        found, listed = private_accesses(path, module_name(path))
        bad += found
        used |= listed
    assert not bad, "another object's private members touched:\n" + "\n".join(bad)
    assert used == set(PRIVATE_ACCESS_ALLOWED), (
        f"allow-listed but not used any more: {sorted(set(PRIVATE_ACCESS_ALLOWED) - used)}")


def test_the_private_access_check_sees_violations(tmp_path: Path) -> None:
    """Another module's `_x` fails; self/cls, a class's own members on another instance, a
    private helper class's members, super() into this module's class and the allow-listed
    argparse internals (in the CLI only) pass; super() into another module's class fails."""
    f = tmp_path / "probe.py"
    f.write_text(
        "import argparse\nfrom pagekv.tiers import chain\n\n"
        "class Pair:\n"
        "    _shared = 0\n"
        "    def __init__(self, other):\n"
        "        self._key = other._key\n"  # same class, another instance: fine
        "        self.n = cls._shared + type(self)._shared\n"
        "    def __eq__(self, other):\n"
        "        return self.__class__ is other.__class__ and other._probe()\n"
        "    def _probe(self):\n"
        "        return chain._tree\n"  # 1: another module's object
        "\n"
        "class _Pending:\n"
        "    def __init__(self):\n"
        "        self._future = None\n"
        "\n"
        "def land(p, q):\n"
        "    return p._future, q._key\n"  # 2: _key is Pair's, and land is no method of Pair
        "\n"
        "class Sub(Pair):\n"
        "    def _probe(self):\n"
        "        return super()._probe()\n"  # the base is this module's: fine
        "\n"
        "class Help(argparse.HelpFormatter):\n"
        "    def _get_help_string(self, action):\n"
        "        return super()._get_help_string(action)\n"  # 3 (allowed in the CLI)
        "\n"
        "def flags(parser):\n"
        "    return parser._actions, parser._subparsers._group_actions\n"  # 4, 5, 6
    )
    bad, listed = private_accesses(f, "tiers.probe")
    assert [b.split(" ", 1)[1] for b in bad] == [
        "chain._tree", "q._key", "super()._get_help_string", "parser._actions",
        "parser._subparsers._group_actions", "parser._subparsers"]
    assert listed == set()
    bad, listed = private_accesses(f, "pagekv.cli")
    assert [b.split(" ", 1)[1] for b in bad] == ["chain._tree", "q._key"]
    assert listed == set(PRIVATE_ACCESS_ALLOWED)


def test_the_map_lists_every_module() -> None:
    """docs/ARCHITECTURE.md's "Modules by package" names every module of the product, each
    under its own folder's entry (`ssd_ring` or `ssd_ring.py`)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Modules by package", 1)[1]
    entries = {}  # folder -> its bullet's text, e.g. "kvnode/index/" -> "..."
    for bullet in section.split("\n- ")[1:]:
        folder = bullet.split("`", 2)[1]
        entries[folder.rstrip("/") + "/"] = bullet
    missing = []
    for path in source_files():
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py" or "_pb2" in path.name:
            continue
        # kvnode's layers have a bullet each; every other top-level folder has one
        folder = "/".join(rel.parts[:2 if rel.parts[0] == "kvnode" else 1]) + "/"
        entry = entries.get(folder, "")
        if f"`{path.stem}.py`" not in entry and f"`{path.stem}`" not in entry and \
                f"{path.stem}.py" not in entry:
            missing.append(str(rel))
    assert not missing, "docs/ARCHITECTURE.md does not list: " + ", ".join(missing)

"""`pagekv` — the command line: `node`, `router`, `up`, `generate`, `bench-cluster`, `ray-up`,
`build-kernels`.

Each subcommand lives in its own module and registers itself here through two functions,
`add_arguments(parser)` and `main(args) -> int`, so that importing the CLI stays cheap (the
router and the client never import torch).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import fields

from kvnode.engine.config import HELP, EngineArgs

# subcommand -> (module, help)
SUBCOMMANDS = {
    "node": ("kvnode.pod.server", "run one pod: the engine behind a gRPC Generate service"),
    "router": ("router.cli", "run the prefix-aware gRPC router over the Redis index"),
    "up": ("deploy.local_cluster", "start a local cluster: Redis, N pods and the router"),
    "generate": ("kvnode.pod.client", "send one Generate call to a router or a pod"),
    "bench-cluster": ("deploy.bench_cluster", "drive a shared-prefix workload through a cluster"),
    "ray-up": ("deploy.ray_cluster", "deploy pods and the router as Ray actors"),
    "build-kernels": ("kvnode.model.attention.cpu_kernel",
                      "compile the C++ CPU kernel now, so no pod compiles at start"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, named like vLLM's (--block-size, --kv-cache-dtype...)."""
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            group.add_argument(
                _flag(f.name), dest=f.name, default=default,
                action=argparse.BooleanOptionalAction, help=HELP.get(f.name),
            )
            continue
        kind = {int: int, float: float}.get(type(default), str)
        if f.type in ("int | None",):
            kind = int
        elif f.type in ("float | None",):
            kind = float
        if f.name.endswith("_bytes") or f.name == "kv_cache_memory":
            kind = parse_bytes
        group.add_argument(_flag(f.name), dest=f.name, type=kind, default=default,
                           help=f"{HELP.get(f.name, '')} (default: {default})")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1e9', '4096' -> bytes."""
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    s = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(float(s))


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Only the selected subcommand's module is imported (the client must not load torch)."""
    parser = argparse.ArgumentParser(prog="pagekv", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if selected is not None and name != selected:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a part not installed here must not break the others
            p.set_defaults(_missing=f"{name}: {e}")
            continue
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(selected).parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "_missing", None):
        print(f"pagekv {args._missing}", file=sys.stderr)
        return 2
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

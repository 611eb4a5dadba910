"""`pagekv` — the command line: `node`, `router`, `ingest-vllm`, `up`, `generate`, `cache`,
`bench-cluster`, `ray-up`, `build-kernels`, `export-tokenizer`.

The dispatcher, above every layer (it starts pods, the router and deploy's clusters). Each
subcommand lives in its own module and registers itself here through two functions,
`add_arguments(parser)` and `main(args) -> int`; only the selected one is imported, so that
the router and the client never import torch. Their module names below are the one place the
project imports itself by string, and tests/unit/test_layers.py reads them as imports.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib import metadata
from pathlib import Path

from pagekv.proto.command_line import CliError, flag_name

# subcommand -> (module, help)
SUBCOMMANDS = {
    "node": ("pagekv.kvnode.pod.node_cli", "run one pod: the engine behind a gRPC Generate service"),
    "router": ("pagekv.router.cli", "run the prefix-aware gRPC router over the Redis index"),
    "ingest-vllm": ("pagekv.kvnode.index.vllm_ingest_cli",
                    "index a vLLM pod's blocks from its KV events (ZeroMQ), for the router"),
    "up": ("pagekv.deploy.local_cluster", "start a local cluster: Redis, N pods and the router"),
    "generate": ("pagekv.kvnode.pod.client", "send one Generate call to a router or a pod"),
    "cache": ("pagekv.kvnode.pod.cache_cli",
              "where a prefix is cached, delete it, or pre-warm a pod with it (admin calls)"),
    "bench-cluster": ("pagekv.deploy.bench_cluster", "drive a shared-prefix workload through a cluster"),
    "ray-up": ("pagekv.deploy.ray_cluster", "deploy pods and the router as Ray actors"),
    "build-kernels": ("pagekv.kvnode.model.attention.cpu_kernel",
                      "compile the C++ CPU kernel now, so no pod compiles at start"),
    "export-tokenizer": ("pagekv.proto.model_files.tokenizer_export",
                         "write a model's tokenizer as a directory transformers' AutoTokenizer "
                         "loads (for guidellm, aiperf, genai-perf)"),
}
# What `pagekv --help` says above the subcommands' list (the module docstring is for readers
# of the code).
DESCRIPTION = (
    "PageKV serves LLM generation with a paged, prefix-cached KV pool per pod (DRAM and SSD "
    "tiers below it, blocks pulled between pods) behind a prefix-aware router that finds "
    "cached prefixes through a Redis index; pods and routers speak gRPC and OpenAI's HTTP API. "
    "This command runs each part, starts a local or Ray cluster, drives and benchmarks it, and "
    "prepares files for it. Subcommands: " + ", ".join(SUBCOMMANDS) + "; `pagekv SUBCOMMAND "
    "--help` lists each one's flags."
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def config_tokens(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """A YAML file of flag names (`block-size: 32` or `block_size: 32`) as command-line
    tokens, placed before the real ones so that flags on the command line win."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise CliError(f"--config {path}: {e}") from e
    if not isinstance(data, dict):
        raise CliError(f"--config {path}: expected a mapping of flag names to values")
    known = {opt: a for a in parser._actions for opt in a.option_strings}
    tokens: list[str] = []
    for key, value in data.items():
        flag = flag_name(str(key))
        action = known.get(flag)
        if action is None:
            raise CliError(f"--config {path}: unknown option {key!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise CliError(f"--config {path}: {key} must be true or false")
            tokens.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for v in value:
                tokens += [flag, str(v)]
        elif value is not None:
            tokens += [flag, str(value)]
    return tokens


def version() -> str:
    try:
        return metadata.version("pagekv")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: not where the help already says it, nor when it is None."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or ""  # (typeshed: str | None; it is a str)


def _common() -> argparse.ArgumentParser:
    """Flags every subcommand takes too, so they work before or after its name."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=argparse.SUPPRESS, help="logging level (default: INFO)")
    common.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                        help="options as YAML, keys named like the flags; flags given on the "
                             "command line win")
    return common


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Only the selected subcommand's module is imported (the client must not load torch)."""
    common = _common()
    parser = argparse.ArgumentParser(prog="pagekv", description=DESCRIPTION,
                                     parents=[common])
    parser.add_argument("--version", action="version", version=f"pagekv {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.set_defaults(_missing={})
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, parents=[common],
                           formatter_class=_DefaultsHelp)
        if selected is not None and name != selected:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a part not installed here must not break the others
            # e.g. a light router host without torch: say what to install, in one line
            # (PageKV is on no package index: the wheel is built from the repository.)
            wheel = "dist/pagekv-*.whl" + ("[ray]" if name == "ray-up" else "")
            parser.get_default("_missing")[name] = (
                f"{name}: needs {e.name or e} installed: pip install '{wheel}' (the wheel built "
                f"from the repository, with its dependencies; README, Install)")
            continue
        mod.add_arguments(p)
        p.set_defaults(run_command=mod.main)
    return parser


def with_config(argv: list[str], parser: argparse.ArgumentParser, selected: str | None
                 ) -> list[str]:
    """argv with --config's options spliced in right after the subcommand's name."""
    if selected is None:
        return argv
    ns, _ = _common().parse_known_args(argv)
    path = getattr(ns, "config", None)
    if path is None:
        return argv
    subparsers = parser._subparsers  # the group of the action add_subparsers() made
    assert subparsers is not None, "build_parser adds the subcommands"
    choices = subparsers._group_actions[0].choices  # subcommand name -> its parser
    assert isinstance(choices, dict)
    subparser = choices[selected]
    at = argv.index(selected) + 1
    return argv[:at] + config_tokens(path, subparser) + argv[at:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(selected)
    missing = parser.get_default("_missing").get(selected)
    if missing is not None:
        parser.exit(2, f"pagekv {missing}\n")
    try:
        args = parser.parse_args(with_config(argv, parser, selected))
    except CliError as e:
        parser.exit(2, f"pagekv: error: {e}\n")
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "INFO")),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run_command(args) or 0)
    except (CliError, ValueError, OSError) as e:
        # A value argparse could not judge (a model path, a length past the model's limit) or
        # a missing piece (no redis-server for `pagekv up`): one line naming it, as for a bad
        # flag (the traceback only at --log-level DEBUG).
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        parser.exit(2, f"pagekv {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())

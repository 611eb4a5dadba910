"""The engine's flags, one per `EngineArgs` field, named like vLLM's: `pagekv node` and
`pagekv ray-up` take them."""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields

from pagekv.kvnode.engine.config import BYTE_SIZES, CHOICES, HELP, EngineArgs
from pagekv.proto.command_line import CliError, flag_name, parse_bytes


def _value_type(name: str, annotation: object) -> typing.Callable[[str], object]:
    """The argparse type of one EngineArgs field, from its annotation (`int | None` -> int)."""
    if name in BYTE_SIZES:
        return parse_bytes
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0] if args[0] in (int, float) else str


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (--block-size, --kv-cache-dtype...). The positional
    MODEL (as in `vllm serve MODEL`) is the same as --model."""
    defaults = EngineArgs()
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    group.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help="the model, as --model")
    for f in fields(EngineArgs):
        default = getattr(defaults, f.name)
        if hints[f.name] is bool:
            group.add_argument(flag_name(f.name), dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction, help=HELP.get(f.name))
            continue
        if typing.get_origin(hints[f.name]) is tuple:  # a list of values (--lora-modules)
            group.add_argument(flag_name(f.name), dest=f.name, default=default, nargs="*",
                               help=HELP.get(f.name))
            continue
        group.add_argument(flag_name(f.name), dest=f.name, default=default,
                           type=_value_type(f.name, hints[f.name]),
                           choices=CHOICES.get(f.name), help=HELP.get(f.name))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}
    values["lora_modules"] = tuple(values["lora_modules"] or ())
    if getattr(ns, "model_tag", None):
        values["model"] = ns.model_tag
    if values["disk_offload_bytes"] > 0 and not values["disk_offload_dir"]:
        # Here, before the model loads: the tier connector would find it only after.
        raise CliError("--disk-offload-bytes needs --disk-offload-dir (the SSD tier's "
                       "directory, one per pod)")
    return EngineArgs(**values)

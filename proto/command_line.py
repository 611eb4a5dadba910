"""What every `pagekv` subcommand's flags share: the one-line error and flag spellings.

Subcommands live in every layer (the pod, the router, deploy); the dispatcher
(`pagekv/cli.py`) catches `CliError` from any of them and prints it as one line, exit code 2.
"""

from __future__ import annotations

import argparse


class CliError(Exception):
    """A bad value found after parsing: one line on stderr, exit code 2, no traceback."""


def flag_name(name: str) -> str:
    """A field's flag: `block_size` -> `--block-size`."""
    return "--" + name.replace("_", "-")


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '2GB', '1e9', '4096' -> bytes (humanfriendly, plus plain numbers)."""
    from humanfriendly import InvalidSize, parse_size

    try:
        return int(float(text))
    except ValueError:
        pass
    try:
        return int(parse_size(text, binary=False))
    except InvalidSize as e:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from e

"""The flags `pagekv up` gives every pod (--node-arg): placeholders, and one SSD directory
per pod.

`{pod_id}` and `{run_dir}` in a node arg become the pod's id and the cluster's run directory
(e.g. `--node-arg=--disk-offload-dir={run_dir}/{pod_id}-ssd`); any other `{name}` is refused,
since a misspelt placeholder would be taken literally, as one path for every pod.

An SSD tier directory belongs to one pod (the tier locks it, tiers/dir_lock.py), so the same
--disk-offload-dir for every pod would have every pod but one refused. A directory named
without `{pod_id}` therefore holds one sub-directory per pod, `D/<pod id>`; with
--disk-offload-bytes and no directory, each pod's is `{run_dir}/<pod id>-ssd`. Either way the
cluster says so in its log.
"""

from __future__ import annotations

import re
from pathlib import Path

PLACEHOLDERS = {"pod_id": "the pod's id (node-a, node-b...)",
                "run_dir": "the cluster's run directory (--run-dir)"}
DISK_DIR_FLAG = "--disk-offload-dir"
DISK_BYTES_FLAG = "--disk-offload-bytes"
DEFAULT_DISK_DIR = "{run_dir}/{pod_id}-ssd"
_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")  # names only: JSON or "{0}" pass


def check_placeholders(node_args: list[str]) -> None:
    """ValueError naming the first unknown `{name}` in the node args."""
    for arg in node_args:
        for name in _PLACEHOLDER.findall(arg):
            if name not in PLACEHOLDERS:
                known = ", ".join(f"{{{n}}}" for n in PLACEHOLDERS)
                raise ValueError(f"--node-arg {arg!r}: unknown placeholder {{{name}}} "
                                 f"(known: {known})")


def expand(node_args: list[str], pod_id: str, run_dir: Path) -> list[str]:
    """One pod's flags: the placeholders replaced (nothing else in the args is touched)."""
    return [a.replace("{pod_id}", pod_id).replace("{run_dir}", str(run_dir)) for a in node_args]


def _flag_value_at(node_args: list[str], flag: str) -> tuple[int, str] | None:
    """(index, value) of the flag's last occurrence (argparse keeps the last), written as
    `--flag=V` or as `--flag`, `V`; the index is of the token that holds V."""
    found = None
    for i, arg in enumerate(node_args):
        if arg.startswith(flag + "="):
            found = (i, arg[len(flag) + 1:])
        elif arg == flag and i + 1 < len(node_args):
            found = (i + 1, node_args[i + 1])
    return found


def flag_value(node_args: list[str], flag: str) -> str | None:
    """The value the pods will see for `flag` (its last occurrence), None when absent."""
    found = _flag_value_at(node_args, flag)
    return found[1] if found is not None else None


def one_ssd_dir_per_pod(node_args: list[str]) -> tuple[list[str], str | None]:
    """The node args with each pod's own SSD directory, and what was changed, to log
    (None: nothing was)."""
    disk_dir = _flag_value_at(node_args, DISK_DIR_FLAG)
    if disk_dir is None:
        if _flag_value_at(node_args, DISK_BYTES_FLAG) is None:
            return node_args, None
        return [*node_args, DISK_DIR_FLAG, DEFAULT_DISK_DIR], (
            f"SSD tiers: {DISK_DIR_FLAG} not given, each pod's is "
            f"{DEFAULT_DISK_DIR.replace('{pod_id}', '<pod id>')}")
    at, value = disk_dir
    if "{pod_id}" in value or not value.strip():  # (an empty one: the pod refuses it)
        return node_args, None
    own = value.rstrip("/") + "/{pod_id}"
    out = list(node_args)
    out[at] = f"{DISK_DIR_FLAG}={own}" if out[at].startswith(DISK_DIR_FLAG + "=") else own
    return out, (f"SSD tiers: {DISK_DIR_FLAG} {value} is given to every pod, so each pod gets "
                 f"its own sub-directory, {own.replace('{pod_id}', '<pod id>')} (an SSD "
                 "directory serves one pod; put {pod_id} in the path to place them yourself)")

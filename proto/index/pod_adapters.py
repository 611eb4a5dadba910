"""Which LoRA adapters a pod serves, as its registration carries them (field `lora`).

A pod writes, with every lease renewal, one compact JSON field:

    lora = {"a": {"<name>": "<path>", ...}, "r": ["<resident name>", ...], "s": 0.21}

`a`: every adapter it knows (it can serve each, loading it if not resident); `r`: those in
its slots now (no load before serving); `s`: the seconds its last adapter load took (absent
until it loaded one). The router hashes an adapter's request with the name and path the
pods publish (vLLM's ("lora", name, path) key), leaves out pods that do not know the adapter,
and prices a load into the score of a pod that has it known but not resident.

Read back field by field: a value that is not what a pod writes is skipped (counted as a bad
registration), its adapters then taken as none. Bounded: a router reads every pod's on each
refresh.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagekv.proto.requests import MAX_ADAPTER_NAME

FIELD = "lora"
EMPTY = '{"a":{},"r":[]}'  # what replaces a pod's adapters once it has none left
MAX_ADAPTERS = 1024
MAX_PATH = 4096
MAX_LOAD_S = 3600.0


@dataclass(frozen=True, slots=True)
class PodAdapters:
    paths: Mapping[str, str] = field(default_factory=dict)  # name -> path, every known one
    resident: frozenset[str] = frozenset()
    load_s: float | None = None  # its last load's seconds

    def knows(self, name: str) -> bool:
        return name in self.paths


NO_ADAPTERS = PodAdapters()


def adapter_fields(paths: Mapping[str, str], resident: Iterable[str], load_s: float | None
                   ) -> dict[str, str]:
    """The registration field of a pod's adapters (none: no field)."""
    if not paths:
        return {}
    value: dict[str, object] = {"a": dict(paths), "r": sorted(set(resident) & set(paths))}
    if load_s is not None and math.isfinite(load_s):
        value["s"] = round(load_s, 6)
    return {FIELD: json.dumps(value, separators=(",", ":"), sort_keys=True)}


def parse_adapters(raw: str | None) -> PodAdapters | None:
    """The field read back; None when it is not what a pod writes."""
    if raw is None:
        return NO_ADAPTERS
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or set(value) - {"a", "r", "s"}:
        return None
    paths, resident, load_s = value.get("a", {}), value.get("r", []), value.get("s")
    if not isinstance(paths, dict) or len(paths) > MAX_ADAPTERS or not all(
            _text(k, MAX_ADAPTER_NAME) and _text(v, MAX_PATH) for k, v in paths.items()):
        return None
    if not isinstance(resident, list) or not all(isinstance(n, str) and n in paths
                                                 for n in resident):
        return None
    if load_s is not None and (isinstance(load_s, bool) or not isinstance(load_s, int | float)
                               or not math.isfinite(load_s) or not 0 <= load_s <= MAX_LOAD_S):
        return None
    return PodAdapters(dict(paths), frozenset(resident),
                       None if load_s is None else float(load_s))


def _text(value: object, limit: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit and value.isprintable()

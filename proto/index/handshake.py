"""The configuration handshake: do two parties hash blocks alike?

A pod publishes its hash configuration with its lease (`cfg.*` fields) and in its
namespace's config key; a router compares it with its own and refuses, loudly, to route to a
mismatch rather than see every lookup miss in silence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagekv.proto.index.pod_record import PodInfo
from pagekv.proto.index.schema import HASH_CONFIG_FIELDS, IndexSchema, text


def _as_config(obj: Mapping[str, Any] | IndexSchema | PodInfo) -> dict[str, str]:
    if isinstance(obj, IndexSchema):
        return obj.hash_config()
    if isinstance(obj, PodInfo):
        return dict(obj.hash_config)
    return {text(k): text(v) for k, v in obj.items()}


def config_mismatch(
    a: Mapping[str, Any] | IndexSchema | PodInfo,
    b: Mapping[str, Any] | IndexSchema | PodInfo,
) -> str | None:
    """One line describing how two hash configurations differ, or None if they agree.

    The hash-changing fields (model, block_size, hash_algo, hash_seed) must be present and
    equal on both sides; any other field is compared only when both sides have it. Values
    are compared as text, so block_size 16 and "16" agree.
    """
    ca, cb = _as_config(a), _as_config(b)
    problems: list[str] = []
    extra = sorted((ca.keys() & cb.keys()) - set(HASH_CONFIG_FIELDS))
    for name in (*HASH_CONFIG_FIELDS, *extra):
        va, vb = ca.get(name), cb.get(name)
        if va == vb:
            continue
        shown_a = repr(va) if va is not None else "missing"
        shown_b = repr(vb) if vb is not None else "missing"
        problems.append(f"{name} differs: {shown_a} vs {shown_b}")
    return "; ".join(problems) if problems else None

"""A pod's registration as the index holds it (`PodInfo`), read back field by field.

Every value is checked on the way in, since anyone who reaches Redis can write the pod HASH:
a load figure that is not a finite count in range is dropped (that pod's load is unknown
and the router counts its own requests there instead), a cost outside a sane range is
dropped (the configured one stands in), so is a pull cost per holder with either part out
of range or missing (both parts go: half of it would misprice the pull), and a registration
the router could not reach (no address, an unknown kind, an unreadable field) skips the
pod. Each is counted in `BadRecords`; nothing here raises.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from pagekv.proto.index.bad_records import (
    BAD_COST,
    BAD_ENCODING,
    BAD_LOAD,
    BAD_REGISTRATION,
    BAD_REPLY,
    BadRecords,
)
from pagekv.proto.index.pod_adapters import FIELD as ADAPTERS_FIELD
from pagekv.proto.index.pod_adapters import NO_ADAPTERS, PodAdapters, parse_adapters
from pagekv.proto.index.schema import (
    POD_KIND_PAGEKV,
    POD_KIND_VLLM,
    POD_KINDS,
    POD_ROLES,
    ROLE_MIXED,
    text,
    valid_claim_id,
)
from pagekv.proto.pull_cost import FIXED_PREFIX, PER_TOKEN_PREFIX, PullCost

logger = logging.getLogger(__name__)

# A load count above this is no pod's (a queue of a billion requests): garbage.
MAX_LOAD_COUNT = 1e9
# Seconds per token above this is no tier's (prefill on the slowest CPU is ~0.1 s/token).
MAX_COST_S_PER_TOKEN = 10.0
# Never free, so never 0 (a forged 0 prefill would win every cold prompt); the pool's own
# reload (cost.GPU) is 0.
NONZERO_COSTS = ("prefill", "peer")
# Seconds per pull above this is no pull's fixed part (their deadline is seconds).
MAX_PULL_FIXED_S = 10.0


@dataclass(slots=True)
class PodInfo:
    """A live pod as registered: where to reach it, its load, its hash configuration."""

    pod_id: str
    address: str
    epoch: str
    hash_config: dict[str, str]
    load: dict[str, float]
    tier_costs: dict[str, float]  # tier -> seconds per token to reload from that tier
    updated_at: float  # unix time of the last lease renewal
    lease_ms: int  # time left on the lease
    kind: str = POD_KIND_PAGEKV  # how it is reached (schema.POD_KINDS)
    http_address: str = ""  # host:port of its OpenAI HTTP API, when registered
    # holder pod id -> what a pull from it costs this pod, as measured (proto/pull_cost.py)
    pull_costs: dict[str, PullCost] = field(default_factory=dict)
    role: str = ROLE_MIXED  # its P/D phase (schema.POD_ROLES)
    # Its registration's claim id: what its block claims carry (b"": none readable, so
    # none of its claims count; it is still routed to by load).
    claim_id: bytes = b""
    adapters: PodAdapters = NO_ADAPTERS  # the LoRA adapters it serves (pod_adapters.py)

    @property
    def waiting(self) -> int:
        return int(self.load.get("waiting", 0))

    @property
    def running(self) -> int:
        return int(self.load.get("running", 0))

    @property
    def free_blocks(self) -> int:
        return int(self.load.get("free_blocks", 0))


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def _load_value(value: str) -> float | None:
    number = _number(value)
    if number is None or not math.isfinite(number) or not 0 <= number <= MAX_LOAD_COUNT:
        return None
    return number


def _cost_value(name: str, value: str) -> float | None:
    number = _number(value)
    if number is None or not math.isfinite(number) or not 0 <= number <= MAX_COST_S_PER_TOKEN:
        return None
    if number == 0 and name in NONZERO_COSTS:
        return None
    return number


def _fixed_value(value: str) -> float | None:
    number = _number(value)
    if number is None or not math.isfinite(number) or not 0 <= number <= MAX_PULL_FIXED_S:
        return None
    return number


def _pull_costs(pod_id: str, costs: dict[str, str], bad: BadRecords) -> dict[str, PullCost]:
    """The per-holder pull costs among `costs` (cost.<name> -> value): those whose two
    parts are both present and sane; any other is counted and skipped whole."""
    per_token = {n[len(PER_TOKEN_PREFIX):]: v for n, v in costs.items()
                 if n.startswith(PER_TOKEN_PREFIX)}
    fixed = {n[len(FIXED_PREFIX):]: v for n, v in costs.items() if n.startswith(FIXED_PREFIX)}
    out: dict[str, PullCost] = {}
    for holder in sorted(per_token.keys() | fixed.keys()):
        slope = _cost_value("peer", per_token.get(holder, ""))
        intercept = _fixed_value(fixed.get(holder, ""))
        if not holder or slope is None or intercept is None:
            bad.note(BAD_COST, f"pod {pod_id}: pull cost from {holder!r} = "
                               f"{fixed.get(holder)!r} s + {per_token.get(holder)!r} s/token; "
                               "its pod-wide peer cost stands in")
        else:
            out[holder] = PullCost(intercept, slope)
    return out


def _claim_id(value: str) -> bytes:
    """A registration's claim id from its hex, b"" when it is not one (schema.new_claim_id)."""
    try:
        claim_id = bytes.fromhex(value)
    except ValueError:
        return b""
    return claim_id if valid_claim_id(claim_id) else b""


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536
                and address.isprintable() and " " not in address)


def _reachable(fields: dict[str, str]) -> str:
    """Why a router could not reach this registration ("" when it can)."""
    kind = fields.get("kind", POD_KIND_PAGEKV)
    if kind not in POD_KINDS:
        return f"kind {kind!r} (known: {', '.join(POD_KINDS)})"
    address = fields.get("address", "")
    if kind == POD_KIND_VLLM:
        url = fields.get("http_address") or address
        return "" if url and url.isprintable() and " " not in url else \
            f"http_address {url!r}"
    if fields.get("role", ROLE_MIXED) not in POD_ROLES:
        return f"role {fields['role']!r} (known: {', '.join(POD_ROLES)})"
    return "" if _is_host_port(address) else f"address {address!r}"


def parse_pod_record(record: Any, bad: BadRecords) -> PodInfo | None:
    """One `[pod, lease epoch, pttl, [hash flat]]` of the live pods script, or None when it
    is skipped (counted in `bad`; a lease whose epoch is not the registration's is normal,
    an instance taking over right now, and only logged)."""
    try:
        pod, epoch, pttl, flat = record
        pod_id, lease_epoch, lease_ms = text(pod), text(epoch), int(pttl)
        fields = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
    except UnicodeDecodeError:
        bad.note(BAD_ENCODING, f"a pod registration that is not UTF-8 ({record[0]!r})")
        return None
    except (TypeError, ValueError, IndexError):
        bad.note(BAD_REPLY, f"a live pod record of the wrong shape: {record!r}")
        return None
    if fields.get("epoch") != lease_epoch:
        # Registration and lease are written in one MULTI; a mismatch means another
        # instance of this pod id is taking over right now. Trust neither yet.
        logger.debug("pod %s: lease epoch %s != registered %s", pod_id, lease_epoch,
                     fields.get("epoch"))
        return None
    unreachable = _reachable(fields)
    if unreachable:
        bad.note(BAD_REGISTRATION, f"pod {pod_id}: {unreachable}; not routed to")
        return None
    cfg: dict[str, str] = {}
    load: dict[str, float] = {}
    costs: dict[str, float] = {}
    per_holder: dict[str, str] = {}  # cost.peer.<pod> / cost.peer_fixed.<pod>, read below
    for name, value in fields.items():
        if name.startswith("cfg."):
            cfg[name[4:]] = value
        elif name.startswith("load."):
            number = _load_value(value)
            if number is None:
                bad.note(BAD_LOAD, f"pod {pod_id}: {name}={value!r}; its load taken as "
                                   "unknown")
            else:
                load[name[5:]] = number
        elif name.startswith(("cost." + PER_TOKEN_PREFIX, "cost." + FIXED_PREFIX)):
            per_holder[name[5:]] = value
        elif name.startswith("cost."):
            number = _cost_value(name[5:], value)
            if number is None:
                bad.note(BAD_COST, f"pod {pod_id}: {name}={value!r}; the configured cost "
                                   "stands in")
            else:
                costs[name[5:]] = number
    # A record without the field (a tool's or a test's hand-written registration) has no
    # claim id to count: nothing to note; one that is not a claim id is garbage.
    claim_id = _claim_id(fields.get("claim", ""))
    if not claim_id and "claim" in fields:
        bad.note(BAD_REGISTRATION, f"pod {pod_id}: claim id {fields['claim']!r}; its "
                                   "claims cannot count")
    adapters = parse_adapters(fields.get(ADAPTERS_FIELD))
    if adapters is None:
        bad.note(BAD_REGISTRATION, f"pod {pod_id}: {ADAPTERS_FIELD}="
                                   f"{fields[ADAPTERS_FIELD][:80]!r}; its adapters taken as none")
        adapters = NO_ADAPTERS
    updated = _number(fields.get("updated", "0"))
    if updated is None or not math.isfinite(updated) or updated < 0:
        bad.note(BAD_REGISTRATION, f"pod {pod_id}: updated={fields.get('updated')!r}")
        updated = 0.0
    return PodInfo(
        pod_id=pod_id,
        address=fields.get("address", ""),
        epoch=lease_epoch,
        hash_config=cfg,
        load=load,
        tier_costs=costs,
        updated_at=updated,
        lease_ms=lease_ms,
        kind=fields.get("kind", POD_KIND_PAGEKV),
        http_address=fields.get("http_address", ""),
        pull_costs=_pull_costs(pod_id, per_holder, bad),
        role=fields.get("role", ROLE_MIXED),
        claim_id=claim_id,
        adapters=adapters,
    )

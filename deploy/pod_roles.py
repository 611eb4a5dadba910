"""The pods of a deployment by P/D role (`pagekv up`, `pagekv ray-up`): how many, their ids.

--nodes (`up`) and --num-nodes (`ray-up`) count mixed pods, which prefill and decode as every
pod did before disaggregation; --prefill-nodes and --decode-nodes add pods of those roles
(`pagekv node --role`; the split itself: router/disaggregation.py). Given either, --nodes
defaults to 0: `pagekv up --prefill-nodes 1 --decode-nodes 1` is two pods. A pod's id says
its role: node-a, node-b... (mixed: the ids `pagekv up` always gave), prefill-a...,
decode-a...; on Ray ray-pod-0... (mixed, as before), ray-prefill-0..., ray-decode-0....

A pod's role comes from these counts only: a --role among the flags every pod gets would give
them all one role, whatever the counts say, so it is refused there. On Ray an engine --role
other than mixed with no role counts gives every pod that role, as it always did (the ids then
say it: ray-decode-0...); beside role counts it is refused.

Pure (no Ray, no processes): the plumbing is checked without a cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagekv.deploy import pod_args
from pagekv.proto.index.schema import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL

ROLE_FLAG = "--role"
DEFAULT_MIXED_NODES = 2  # --nodes when no count is given at all
# The id of a pod of `role`, `index` within that role: `pagekv up`'s, Ray's.
LOCAL_PREFIXES = {ROLE_MIXED: "node", ROLE_PREFILL: "prefill", ROLE_DECODE: "decode"}
RAY_PREFIXES = {ROLE_MIXED: "ray-pod", ROLE_PREFILL: "ray-prefill", ROLE_DECODE: "ray-decode"}


@dataclass(frozen=True, slots=True)
class PodSpec:
    pod_id: str
    role: str


def role_flags(role: str) -> list[str]:
    """`pagekv node` flags for a pod of `role` (none for a mixed pod: the default)."""
    return [] if role == ROLE_MIXED else [ROLE_FLAG, role]


def local_pod_id(role: str, index: int) -> str:
    """node-a... node-z, then node-26...: letters while they last (ids `pagekv up` gave)."""
    suffix = chr(ord("a") + index) if index < 26 else str(index)
    return f"{LOCAL_PREFIXES[role]}-{suffix}"


def ray_pod_id(role: str, index: int) -> str:
    return f"{RAY_PREFIXES[role]}-{index}"


def check_counts(mixed: int, prefill: int, decode: int) -> None:
    """ValueError for a negative count."""
    for flag, n in (("--nodes", mixed), ("--prefill-nodes", prefill),
                    ("--decode-nodes", decode)):
        if n < 0:
            raise ValueError(f"{flag} must be >= 0, got {n}")


def mixed_nodes(nodes: int | None, prefill: int, decode: int,
                default: int = DEFAULT_MIXED_NODES) -> int:
    """The mixed pods to run: --nodes as given; unset, `default` without role counts, else 0."""
    if nodes is not None:
        return nodes
    return 0 if prefill or decode else default


def pod_plan(mixed: int, prefill: int = 0, decode: int = 0,
             pod_id: Callable[[str, int], str] = local_pod_id) -> list[PodSpec]:
    """Every pod, in start order: the mixed ones, the prefill ones, the decode ones."""
    check_counts(mixed, prefill, decode)
    return [PodSpec(pod_id(role, i), role)
            for role, n in ((ROLE_MIXED, mixed), (ROLE_PREFILL, prefill), (ROLE_DECODE, decode))
            for i in range(n)]


def refuse_role_flag(node_args: list[str]) -> None:
    """ValueError when the flags for every pod set a role (the counts set each pod's)."""
    if pod_args.flag_value(node_args, ROLE_FLAG) is not None:
        raise ValueError(f"--node-arg {ROLE_FLAG}: every pod would get that role; give pods "
                         "roles with --prefill-nodes N and --decode-nodes M (--nodes counts "
                         "the mixed ones)")


def plan_warning(plan: list[PodSpec]) -> str | None:
    """What is odd about a plan, to log (None: nothing): prefill pods with no decode or mixed
    pod serve whole requests themselves (the router's degraded mode), never splitting."""
    roles = {spec.role for spec in plan}
    if roles == {ROLE_PREFILL}:
        return ("only prefill pods: the router serves every request on them whole (no decode "
                "pod to hand over to); add --decode-nodes or --nodes")
    return None


def split_note(plan: list[PodSpec]) -> str:
    """What the router does with this plan's pods, for start-up lines."""
    if not any(spec.role == ROLE_PREFILL for spec in plan):
        return "no prefill pod: the router splits nothing"
    return ("the router prefills a long uncached prompt on a prefill pod and hands its KV to "
            "a decode pod (from the pod's measured prefill budget; set it with "
            "--router-arg=--pd-threshold-tokens=N)")


def describe_roles(plan: list[PodSpec]) -> str:
    """'1 prefill + 1 decode', '2 mixed'...: the counts of a plan, for start-up lines."""
    counts = {role: sum(spec.role == role for spec in plan)
              for role in (ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE)}
    return " + ".join(f"{n} {role}" for role, n in counts.items() if n) or "no pods"


# -- `pagekv ray-up`: the pod actors' engine options ------------------------------------


@dataclass(frozen=True, slots=True)
class RayPodSpec:
    pod_id: str
    role: str
    engine_kwargs: dict[str, Any]  # EngineArgs fields, its role and SSD directory included


def ray_pod_specs(mixed: int, prefill: int, decode: int,
                  engine_kwargs: dict[str, Any]) -> list[RayPodSpec]:
    """Every pod actor, in bundle order. ValueError: no pods, a negative count, or an engine
    --role beside role counts."""
    role = engine_kwargs.get("role", ROLE_MIXED)
    if role != ROLE_MIXED:
        if prefill or decode:
            raise ValueError(f"--role {role} gives every pod one role; with --prefill-nodes/"
                             "--decode-nodes leave it out (--num-nodes counts the mixed pods)")
        # Every pod has the engine's role: count them as pods of that role (ids say it).
        if role == ROLE_PREFILL:
            mixed, prefill = 0, mixed
        elif role == ROLE_DECODE:
            mixed, decode = 0, mixed
    plan = pod_plan(mixed, prefill, decode, ray_pod_id)
    if not plan:
        raise ValueError("no pods to deploy: --num-nodes, --prefill-nodes or --decode-nodes "
                         "must be >= 1")
    specs = []
    for spec in plan:
        kwargs = {**engine_kwargs, "role": spec.role}
        if kwargs.get("disk_offload_dir"):  # each pod its own SSD directory
            kwargs["disk_offload_dir"] = str(Path(kwargs["disk_offload_dir"]) / spec.pod_id)
        specs.append(RayPodSpec(spec.pod_id, spec.role, kwargs))
    return specs


def mixed_pod_count(num_pods: int | None, prefill: int, decode: int, gpus: float) -> int:
    """--num-nodes as given; unset: none beside role counts, else one per GPU, else 2."""
    if num_pods is not None:
        return num_pods
    if prefill or decode:
        return 0
    return int(gpus) or 2

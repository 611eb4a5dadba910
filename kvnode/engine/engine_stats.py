"""The engine's figures as typed records: what the pod reads of its engine, and nothing more.

`Engine.stats()` builds one `EngineStats` (the pod's gRPC `StatsResponse` and its Prometheus
page read it); `Engine.load()` builds only the `EngineLoad`, which the index lease reads every
renewal and which costs four integer reads. Every record is a copy taken on the reading
thread (ints, floats and small dicts, atomic under the GIL): a reader never holds a reference
into the scheduler, the pool or the puller, and never takes a lock of the step loop. The
per-tier records are the chain's own (proto/tier_stats.py), passed on unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagekv.kvnode.engine.handover_holds import HoldStats
from pagekv.kvnode.engine.lora_adapters import AdapterStats
from pagekv.kvnode.engine.retention import RetentionStats
from pagekv.kvnode.engine.tenancy import TenancyStats
from pagekv.kvnode.memory.metrics import Histogram
from pagekv.proto.medium import Medium
from pagekv.proto.tier_stats import ChainStats, TierStats


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How busy the pod is (published with its index lease; the router weighs it)."""

    waiting: int
    running: int
    free_blocks: int
    num_blocks: int
    prefill_budget: int = 0  # Engine.prefill_budget: the router's P/D split threshold
    prefill_backlog: int = 0  # prompt tokens queued or part-computed (a prefill pod's queue)

    def as_fields(self) -> dict[str, float]:
        """The lease's `load.<name>` figures, by the names the index carries."""
        return {"waiting": self.waiting, "running": self.running,
                "free_blocks": self.free_blocks, "num_blocks": self.num_blocks,
                "prefill_budget": self.prefill_budget, "prefill_backlog": self.prefill_backlog}


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The pool's prefix cache: admissions, tokens looked up and found (by tier), and the
    sampled block-lifecycle histograms (copies)."""

    requests: int
    queries_tokens: int
    hits_tokens_by_tier: dict[Medium, int]
    hit_rate: float
    pool_too_small: bool | None  # None until both histograms it compares have samples
    block_lifetime_seconds: Histogram
    block_idle_before_evict_seconds: Histogram
    block_reuse_gap_seconds: Histogram


@dataclass(frozen=True, slots=True)
class PeerPullStats:
    """Cross-pod KV pulls so far (cumulative), with the fallbacks by reason."""

    pulls: int
    blocks: int
    bytes: int
    fallbacks: dict[str, int]
    s_per_token: float | None  # median of recent complete pulls; None before the first


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One reading of the engine. `pool` is the pool's `TierStats`, `chain` the tier chain's
    whole record (None without tiers), `peer_pull` None unless cross-pod pull is on."""

    load: EngineLoad
    usage: float  # fraction of pool blocks in use
    num_preemptions: int
    pool: TierStats
    chain: ChainStats | None
    prefix_cache: PrefixCacheStats
    peer_pull: PeerPullStats | None
    handover: HoldStats  # P/D: prompt blocks held for decode pods' pulls
    role: str = "mixed"
    # The fitted costs as published to the router (Engine.tier_costs: "prefill", "CPU",
    # "DISK", "peer", "peer.<holder>", "peer_fixed.<holder>"), and the median decode-only
    # step (None until timed): what the pod's /metrics exports as its fitted costs.
    costs: dict[str, float] = field(default_factory=dict)
    decode_step_s: float | None = None
    retention: RetentionStats | None = None  # pins and sessions (kvnode/engine/retention.py)
    tenancy: TenancyStats | None = None  # per tenant and tier (kvnode/engine/tenancy.py)
    adapters: AdapterStats | None = None  # LoRA (kvnode/engine/lora_adapters.py)

    @property
    def tiers(self) -> dict[Medium, TierStats]:
        """A `TierStats` per medium: the pool, then the chain's own records as they are."""
        return {Medium.GPU: self.pool, **(self.chain.tiers if self.chain is not None else {})}


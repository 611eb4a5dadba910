"""The router's configuration: one dataclass that the CLI and the tests both fill.

Default costs (seconds), used for a pod until it publishes its own measured figures. Measured
on the 2-core AMD EPYC development machine with pagekv-small (the demo and benchmark model),
one pod with 2 torch threads:

* prefill 6e-4 s/token: a queued cold 1,071-token prompt delays a probe by 0.60 s
  (`bench/prefix_ttft.py --quick` measured 1.2-2.0 ms/token while other processes loaded
  the machine; pagekv-tiny runs at 60-100 µs/token).
* CPU (DRAM reload) 6e-6 s/token: copying pagekv-small's fp32 KV (6 KiB/token) block by
  block measured 6 µs/token (about 1 GB/s).
* DISK (SSD reload) 3e-5 s/token: five times the DRAM figure for the read, checksum and
  decode of an SSD entry; an estimate, not a measurement (pods publish the real one).
* peer (a pull from another pod, GenerateRequest.kv_source) 6e-5 s/token: the 6 KiB/token
  is copied three times (read and checksummed on the peer, sent through gRPC, checked and
  landed in the pool here), 1.8e-5 at the DRAM figure; gRPC framing, Python-side copies and
  a round trip per pull on top make it ten times the DRAM reload. Twice the SSD estimate and
  a tenth of prefill: a pull wins only where it saves most of the recompute. An estimate,
  not a measurement: pods publish `cost.peer`, and per peer a fitted fixed part and cost
  per token (proto/pull_cost.py), from which the router derives each pair's crossover.
* queue 0.025 s/request: each queued request with a 48-token uncached suffix delayed a
  probe's first token by about 25 ms (0 -> 8 queued: 39 -> 238 ms). It is scaled by each
  pod's prefill speed (pagekv-tiny measured 5.5 ms per queued request). A queued cold
  prompt costs far more, but under prefix routing queued requests are mostly hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pagekv.proto.credentials import TlsFiles
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HASH_ALGOS
from pagekv.proto.index.connect import (
    DEFAULT_MAX_CONNECTIONS,
    check_tls_url,
)
from pagekv.proto.openai.limits import HttpLimits
from pagekv.proto.redact import redact_url
from pagekv.proto.requests import PromptLimits
from pagekv.proto.tenants import TenantMap
from pagekv.router.placement import COLD_PLACEMENTS
from pagekv.router.scoring import CostModel
from pagekv.router.stall import StallBound

# prefix: the cost model (a queue priced per request); sticky: the same with the queue
# priced as its prompt tokens at the pod's measured rate (sticky until saturated).
PREFIX_POLICIES = ("prefix", "sticky")
POLICIES = (*PREFIX_POLICIES, "round_robin", "random")
POD_KEEPALIVE_MIN_S = 2.0  # pods permit a ping a second (kvnode/pod/server.py): a margin

# A call queued behind a full Redis pool waits for this many commands' timeouts at most.
POOL_WAIT_COMMANDS = 4
DEFAULT_COSTS = CostModel(
    prefill_per_token=6e-4,
    cpu_per_token=6e-6,
    disk_per_token=3e-5,
    queue_per_request=0.025,
    peer_per_token=6e-5,
)


@dataclass(slots=True)
class RouterConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    model: str = "pagekv-tiny"
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str = DEFAULT_HASH_SEED
    index_prefix: str = "pagekv"
    # sticky wins bench.scale --sweep (docs/BENCHMARKS.md §22) but, as the default, sent a
    # shared prompt's siblings away from its real pod in the router tests: not yet
    policy: str = "prefix"
    costs: CostModel = field(default_factory=lambda: DEFAULT_COSTS)
    burst_ttl_s: float = 2.0
    shared_bursts: bool = True        # burst predictions through the index, for other routers
    kv_pull: bool = True              # score the pull option and send pods kv_source hints
    cold_placement: str = "hash"      # no pod holds the prefix: router/placement.py
    # Session affinity (router/sessions.py): a session_id's turns stay on its pod for this
    # long after the last one, while the pod has fewer than session_max_waiting waiting.
    session_idle_s: float = 600.0
    session_max_waiting: int = 2
    # LoRA adapters (README "LoRA adapters"): hash an adapter's request with the path its
    # pods publish, score only the pods serving it, price a load. False: a router that knows
    # nothing of adapters (a baseline: hashes without them, scores every pod alike).
    adapter_routing: bool = True
    refresh_interval_s: float = 0.5
    namespace_check_interval_s: float = 2.0
    reap_dead_after_s: float = 60.0   # drop a lease-less pod's index entries after this; 0: never
    redis_timeout_s: float = 0.25     # per Redis command; a slow index must not stall routing
    # Connections to Redis (per node of a cluster): calls past it queue for one, up to
    # redis_pool_wait_s (None: POOL_WAIT_COMMANDS x redis_timeout_s, see pool_wait_s())
    redis_max_connections: int = DEFAULT_MAX_CONNECTIONS
    redis_pool_wait_s: float | None = None
    max_attempts: int = 3             # pods tried per request when earlier ones are UNAVAILABLE
    unavailable_cooldown_s: float = 2.0  # a pod that was UNAVAILABLE is tried last this long
    # A pod call with no progress (router/stall.py): no first chunk, or no next one, within
    # min(cap, floor + factor x the pod's estimated TTFT) is abandoned; floor 0: no bound.
    # 10 s: a pod on a loaded 2-core host was seen pausing 5 s between chunks (a false stall
    # ends a healthy stream); a hung pod still fails over long before a 20-60 s deadline.
    pod_stall_floor_s: float = 10.0
    pod_stall_factor: float = 4.0
    pod_stall_cap_s: float = 60.0
    pod_stall_cooldown_s: float = 2.0  # a stalled pod is tried last this long, x2 per stall
    # HTTP/2 pings on the pod channels: a peer that acks none in the timeout is dead (0: off).
    # Not below POD_KEEPALIVE_MIN_S: faster pings than pods accept would end in GOAWAY.
    pod_keepalive_s: float = 5.0
    pod_keepalive_timeout_s: float = 3.0
    random_seed: int | None = None    # for --policy random (reproducible benchmarks)
    # --max-prompt-bytes / --max-prompt-tokens: the pods' own, so refusals read the same
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # --http-port's (limits.py)
    # Security (README "Security"). tls: the router's own port; pod_tls / pod_api_token:
    # what it presents to pods (its own, never a client's); redis_tls: rediss:// files;
    # vllm_tls: the CA of https:// vLLM pods and the router's client certificate for them.
    tls: TlsFiles | None = None
    api_token: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)  # CacheAdmin (cache_admin.py)
    pod_tls: TlsFiles | None = None
    pod_api_token: str | None = field(default=None, repr=False)
    redis_tls: TlsFiles | None = None
    vllm_tls: TlsFiles | None = None
    # --tenants: clients' salts derived from their tenant (proto/tenant_identity.py); the
    # pods must load the same file (checked at join: proto/auth_profile.py).
    tenants: TenantMap | None = field(default=None, repr=False)
    # --http-port's OpenAI API: the model names it answers to (default: [model])
    served_model_names: list[str] | None = None
    # Prefill/decode disaggregation (router/disaggregation.py), with live prefill pods: a
    # prompt whose uncached part on its decode pod reaches the threshold is prefilled on a
    # prefill pod and handed over. The threshold: the decode pod's measured prefill budget
    # (load.prefill_budget), or pd_threshold_tokens where that is larger (0: the budget
    # alone). 1024: bench/pd.py's sweep on a quiet 2-core box (docs/BENCHMARKS.md §21): the
    # budget alone (16-31 tokens) sent chat turns to the prefill pod, where those arriving
    # during a document's prefill waited 5.4 s (chat TTFT p90 0.54x mixed's in one run,
    # 13.2x in another); at 1024 chats stay on the decode pod: 11.8x over two runs.
    pd_split: bool = True
    pd_threshold_tokens: int = 1024
    pd_hold_ms: int = 10_000          # how long a prefill pod holds the prompt's blocks

    def __repr__(self) -> str:  # the URL's password and the tokens never reach a log
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        values["redis_url"] = redact_url(self.redis_url)
        return f"RouterConfig({', '.join(f'{k}={v!r}' for k, v in values.items())})"

    def pool_wait_s(self) -> float:
        """How long an index call waits for a connection: as set, else long enough for the
        pool to turn over POOL_WAIT_COMMANDS times, each command bounded by its timeout."""
        if self.redis_pool_wait_s is not None:
            return self.redis_pool_wait_s
        return POOL_WAIT_COMMANDS * self.redis_timeout_s

    def stall_bound(self) -> StallBound:
        return StallBound(self.pod_stall_floor_s, self.pod_stall_factor, self.pod_stall_cap_s,
                          self.pod_stall_cooldown_s)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.cold_placement not in COLD_PLACEMENTS:
            raise ValueError(f"cold_placement must be one of {', '.join(COLD_PLACEMENTS)}, "
                             f"got {self.cold_placement!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                             f"got {self.hash_algo!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.pod_stall_floor_s < 0 or self.pod_stall_factor < 0 or \
                self.pod_stall_cap_s < 0 or self.pod_stall_cooldown_s < 0:
            raise ValueError("pod_stall_floor_s, pod_stall_factor, pod_stall_cap_s and "
                             "pod_stall_cooldown_s must be >= 0")
        if self.pod_keepalive_s and self.pod_keepalive_s < POD_KEEPALIVE_MIN_S:
            raise ValueError(f"pod_keepalive_s must be 0 (off) or >= {POD_KEEPALIVE_MIN_S:g} "
                             f"(pods refuse faster pings), got {self.pod_keepalive_s:g}")
        if self.pod_keepalive_timeout_s <= 0:
            raise ValueError(f"pod_keepalive_timeout_s must be positive, got "
                             f"{self.pod_keepalive_timeout_s:g}")
        if self.reap_dead_after_s < 0:
            raise ValueError(f"reap_dead_after_s must be >= 0, got {self.reap_dead_after_s}")
        if self.tls is not None:
            self.tls.require_identity()
        check_tls_url(self.redis_url, self.redis_tls)
        if self.session_idle_s < 0 or self.session_max_waiting < 1:
            raise ValueError("session_idle_s must be >= 0 and session_max_waiting >= 1")
        if self.burst_ttl_s < 0 or self.refresh_interval_s <= 0 or self.redis_timeout_s <= 0:
            raise ValueError("burst_ttl_s must be >= 0; refresh_interval_s and "
                             "redis_timeout_s must be positive")
        if self.pd_threshold_tokens < 0 or not 0 < self.pd_hold_ms <= 120_000:
            raise ValueError("pd_threshold_tokens must be >= 0 and pd_hold_ms in 1..120000")
        if self.redis_max_connections < 1 or self.pool_wait_s() <= 0:
            raise ValueError(f"redis_max_connections must be >= 1 and redis_pool_wait_s > 0, "
                             f"got {self.redis_max_connections} and {self.pool_wait_s()}")

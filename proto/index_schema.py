"""The Redis index: key schema, the one-round-trip prefix lookup, pod discovery.

Shared by the pods (through `index_publisher`) and the router. No torch here: the router is a
light process. See docs/INDEX.md for the layout and the reasoning behind it.

Every key of one index lives under `pagekv:{ns}:` where `ns` is a short digest of everything
that changes a block hash (model, block size, hash algorithm, seed). Pods whose hashes could
not agree therefore never share keys, so they cannot produce false hits; the braces make `ns`
a Redis Cluster hash tag, keeping the keys a lookup script touches in one slot.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

logger = logging.getLogger(__name__)

TIERS: tuple[str, ...] = ("GPU", "CPU", "DISK")  # best first
TIER_CODE: dict[str, str] = {"GPU": "G", "CPU": "C", "DISK": "D"}
CODE_TIER: dict[str, str] = {code: tier for tier, code in TIER_CODE.items()}
TIER_BIT: dict[str, int] = {"GPU": 1, "CPU": 2, "DISK": 4}

# The fields that change a block hash, in the order config_mismatch reports them.
HASH_CONFIG_FIELDS: tuple[str, ...] = ("model", "block_size", "hash_algo", "hash_seed")

NAMESPACES_SUFFIX = ":namespaces"  # `<prefix>:namespaces`, a SET of every namespace id


def _text(value: Any) -> str:
    """Redis replies are bytes or str depending on the client's decode_responses."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def _tier_codes(mask: int) -> str:
    return "".join(TIER_CODE[t] for t in TIERS if mask & TIER_BIT[t])


# Claim value per tier bitmask (index 0 unused): codes of the tiers present, best first.
MASK_CODES: tuple[str, ...] = tuple(_tier_codes(m) for m in range(8))


@dataclass(frozen=True, slots=True)
class IndexSchema:
    """Key names for one namespace (one hash configuration).

    `hash_seed` is kept as text so that 0 and "0" name the same namespace.
    """

    model: str
    block_size: int
    hash_algo: str
    hash_seed: str
    prefix: str = "pagekv"
    namespace: str = field(init=False)
    base: str = field(init=False)

    def __init__(
        self,
        model: str,
        block_size: int,
        hash_algo: str,
        hash_seed: str | int,
        prefix: str = "pagekv",
    ) -> None:
        if int(block_size) <= 0:
            raise ValueError(f"block_size must be positive, got {block_size!r}")
        if ":" in prefix or "{" in prefix:
            raise ValueError(f"prefix must not contain ':' or '{{', got {prefix!r}")
        object.__setattr__(self, "model", str(model))
        object.__setattr__(self, "block_size", int(block_size))
        object.__setattr__(self, "hash_algo", str(hash_algo))
        object.__setattr__(self, "hash_seed", str(hash_seed))
        object.__setattr__(self, "prefix", prefix)
        parts = "\x1f".join((self.model, str(self.block_size), self.hash_algo, self.hash_seed))
        ns = hashlib.sha256(parts.encode()).hexdigest()[:12]
        object.__setattr__(self, "namespace", ns)
        object.__setattr__(self, "base", f"{prefix}:{{{ns}}}:")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], prefix: str = "pagekv") -> IndexSchema:
        """From a hash-config mapping (e.g. a pod's published one, or the config key)."""
        missing = [k for k in HASH_CONFIG_FIELDS if k not in config]
        if missing:
            raise ValueError(f"hash config lacks {', '.join(missing)}")
        return cls(
            _text(config["model"]),
            int(_text(config["block_size"])),
            _text(config["hash_algo"]),
            _text(config["hash_seed"]),
            prefix=prefix,
        )

    def hash_config(self) -> dict[str, str]:
        """The readable form of the namespace (what the config key holds)."""
        return {
            "model": self.model,
            "block_size": str(self.block_size),
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
        }

    def seed_fingerprint(self) -> str:
        return hashlib.sha256(self.hash_seed.encode()).hexdigest()[:12]

    # -- key names ---------------------------------------------------------------------
    @property
    def config_key(self) -> str:
        return self.base + "config"  # HASH: hash_config()

    @property
    def namespaces_key(self) -> str:
        return self.prefix + NAMESPACES_SUFFIX  # SET of namespace ids (outside the tag)

    @property
    def pods_key(self) -> str:
        return self.base + "pods"  # SET of pod ids that registered here

    @property
    def block_prefix(self) -> str:
        return self.base + "b:"

    def block_key(self, block_hash: bytes) -> str:
        return self.block_prefix + block_hash.hex()  # HASH pod_id -> "<tiers>:<epoch>"

    def pod_key(self, pod_id: str) -> str:
        return self.base + "p:" + pod_id  # HASH: address, epoch, cfg.*, load.*, cost.*

    def lease_key(self, pod_id: str) -> str:
        return self.base + "l:" + pod_id  # STRING: the live epoch, with a TTL

    def pod_blocks_key(self, pod_id: str) -> str:
        return self.base + "pb:" + pod_id  # SET of hex hashes this pod id claims


def claim_value(mask: int, epoch: str) -> str:
    """The value a pod writes into a block's HASH: tier codes (best first), ':', epoch."""
    return f"{MASK_CODES[mask]}:{epoch}"


@dataclass(slots=True)
class PodMatch:
    """A live pod's consecutive prefix from block 0; tiers[i] is where block i lives."""

    depth: int
    tiers: list[str]

    def tier_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(TIERS, 0)
        for tier in self.tiers:
            counts[tier] += 1
        return counts


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

    @property
    def waiting(self) -> int:
        return int(self.load.get("waiting", 0))

    @property
    def running(self) -> int:
        return int(self.load.get("running", 0))

    @property
    def free_blocks(self) -> int:
        return int(self.load.get("free_blocks", 0))


# KEYS: the request's block keys in chain order. ARGV[1]: the namespace base.
# Reply: flat [pod, tier codes, pod, tier codes, ...] for every live pod; the code string's
# length is the pod's depth. Only pods still matching are asked about the next block, and
# the walk ends as soon as none is left.
LOOKUP_LUA = """
local base = ARGV[1]
local live, suffix, codes = {}, {}, {}
for _, pod in ipairs(redis.call('SMEMBERS', base .. 'pods')) do
  local epoch = redis.call('GET', base .. 'l:' .. pod)
  if epoch then
    live[#live + 1] = pod
    suffix[pod] = ':' .. epoch
    codes[pod] = {}
  end
end
local active = live
for i = 1, #KEYS do
  if #active == 0 then break end
  local vals = redis.call('HMGET', KEYS[i], unpack(active))
  local still = {}
  for j = 1, #active do
    local v = vals[j]
    if v then
      local pod = active[j]
      local s = suffix[pod]
      if #v > #s and string.sub(v, -#s) == s then
        local c = codes[pod]
        c[#c + 1] = string.sub(v, 1, 1)
        still[#still + 1] = pod
      end
    end
  end
  active = still
end
local out = {}
for _, pod in ipairs(live) do
  out[#out + 1] = pod
  out[#out + 1] = table.concat(codes[pod])
end
return out
"""

# ARGV[1]: the namespace base. Reply: [[pod, lease epoch, lease pttl, [pod hash flat]], ...].
LIVE_PODS_LUA = """
local base = ARGV[1]
local out = {}
for _, pod in ipairs(redis.call('SMEMBERS', base .. 'pods')) do
  local lease = base .. 'l:' .. pod
  local epoch = redis.call('GET', lease)
  if epoch then
    out[#out + 1] = {pod, epoch, redis.call('PTTL', lease), redis.call('HGETALL', base .. 'p:' .. pod)}
  end
end
return out
"""


# ARGV[1]: the namespace base. Reply: flat [pod, registered epoch or ""] for every pod id in
# the pods set whose lease is gone: crashed or cut off, or mid-restart.
DEAD_PODS_LUA = """
local base = ARGV[1]
local out = {}
for _, pod in ipairs(redis.call('SMEMBERS', base .. 'pods')) do
  if redis.call('EXISTS', base .. 'l:' .. pod) == 0 then
    out[#out + 1] = pod
    out[#out + 1] = redis.call('HGET', base .. 'p:' .. pod, 'epoch') or ''
  end
end
return out
"""

# ARGV: base, pod, the epoch seen dead ("" = no registration), batch size. Removes up to
# `batch` of the pod's claims, but only while the pod id is still lease-less under that same
# epoch: a restarted instance (new lease and epoch, written in one MULTI) is left alone.
# Reply: -1 refused (it came back), else {claims removed, 1 when nothing of it is left}.
REAP_POD_LUA = """
local base, pod, epoch, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', base .. 'l:' .. pod) == 1 then return -1 end
if (redis.call('HGET', base .. 'p:' .. pod, 'epoch') or '') ~= epoch then return -1 end
local set = base .. 'pb:' .. pod
local members = redis.call('SPOP', set, n)
local removed = 0
for _, h in ipairs(members) do
  removed = removed + redis.call('HDEL', base .. 'b:' .. h, pod)
end
if #members < n then
  redis.call('DEL', base .. 'p:' .. pod, set)
  redis.call('SREM', base .. 'pods', pod)
  return {removed, 1}
end
return {removed, 0}
"""


@dataclass(slots=True)
class _Script:
    """A Lua script run by EVALSHA; loaded with SCRIPT LOAD only when the server lacks it."""

    source: str
    sha: str = ""

    def __post_init__(self) -> None:
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    async def call_async(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


LOOKUP_SCRIPT = _Script(LOOKUP_LUA)
LIVE_PODS_SCRIPT = _Script(LIVE_PODS_LUA)
DEAD_PODS_SCRIPT = _Script(DEAD_PODS_LUA)
REAP_POD_SCRIPT = _Script(REAP_POD_LUA)


def register_scripts(redis_client: Any) -> None:
    """SCRIPT LOAD both scripts up front so that even the first lookup is one round trip."""
    for script in (LOOKUP_SCRIPT, LIVE_PODS_SCRIPT):
        redis_client.script_load(script.source)


def _parse_lookup(reply: Sequence[Any]) -> dict[str, PodMatch]:
    out: dict[str, PodMatch] = {}
    for i in range(0, len(reply), 2):
        codes = _text(reply[i + 1])
        out[_text(reply[i])] = PodMatch(len(codes), [CODE_TIER[c] for c in codes])
    return out


def lookup_prefix(
    redis_client: Any, schema: IndexSchema, block_hashes: Sequence[bytes]
) -> dict[str, PodMatch]:
    """For every live pod, how many leading blocks of `block_hashes` it holds, and where.

    One EVALSHA round trip. Pods that are live but hold no prefix map to depth 0.
    """
    keys = [schema.block_key(h) for h in block_hashes]
    return _parse_lookup(LOOKUP_SCRIPT(redis_client, keys, (schema.base,)))


async def lookup_prefix_async(
    redis_client: Any, schema: IndexSchema, block_hashes: Sequence[bytes]
) -> dict[str, PodMatch]:
    """lookup_prefix for a `redis.asyncio` client."""
    keys = [schema.block_key(h) for h in block_hashes]
    return _parse_lookup(await LOOKUP_SCRIPT.call_async(redis_client, keys, (schema.base,)))


def _float(value: Any, default: float = 0.0) -> float:
    try:
        return float(_text(value))
    except ValueError:
        return default


def _parse_pods(reply: Sequence[Any]) -> list[PodInfo]:
    pods: list[PodInfo] = []
    for pod, epoch, pttl, flat in reply:
        fields = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
        pod_id, lease_epoch = _text(pod), _text(epoch)
        if fields.get("epoch") != lease_epoch:
            # Registration and lease are written in one MULTI; a mismatch means another
            # instance of this pod id is taking over right now. Trust neither yet.
            logger.debug("pod %s: lease epoch %s != registered %s", pod_id, lease_epoch,
                         fields.get("epoch"))
            continue
        cfg: dict[str, str] = {}
        load: dict[str, float] = {}
        costs: dict[str, float] = {}
        for name, value in fields.items():
            if name.startswith("cfg."):
                cfg[name[4:]] = value
            elif name.startswith("load."):
                load[name[5:]] = _float(value)
            elif name.startswith("cost."):
                costs[name[5:]] = _float(value)
        pods.append(
            PodInfo(
                pod_id=pod_id,
                address=fields.get("address", ""),
                epoch=lease_epoch,
                hash_config=cfg,
                load=load,
                tier_costs=costs,
                updated_at=_float(fields.get("updated", "0")),
                lease_ms=int(pttl),
            )
        )
    pods.sort(key=lambda p: p.pod_id)
    return pods


def list_live_pods(redis_client: Any, schema: IndexSchema) -> list[PodInfo]:
    """Every pod of this namespace whose lease is present and whose epoch matches it."""
    return _parse_pods(LIVE_PODS_SCRIPT(redis_client, (), (schema.base,)))


async def list_live_pods_async(redis_client: Any, schema: IndexSchema) -> list[PodInfo]:
    """list_live_pods for a `redis.asyncio` client."""
    return _parse_pods(await LIVE_PODS_SCRIPT.call_async(redis_client, (), (schema.base,)))


async def dead_pods_async(redis_client: Any, schema: IndexSchema) -> dict[str, str]:
    """Pod ids registered in this namespace without a lease, with their registered epoch
    ("" when even the registration is gone)."""
    flat = await DEAD_PODS_SCRIPT.call_async(redis_client, (), (schema.base,))
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


async def reap_pod_async(redis_client: Any, schema: IndexSchema, pod_id: str, epoch: str,
                         batch: int = 1000) -> int | None:
    """Remove a dead pod's claims and registration, `batch` claims per script call so
    Redis is never blocked for long. Returns the claims removed, or None when the pod id
    came back (a lease, or another epoch) before it was gone."""
    removed = 0
    while True:
        reply = await REAP_POD_SCRIPT.call_async(
            redis_client, (), (schema.base, pod_id, epoch, batch))
        if reply == -1:
            return None
        removed += int(reply[0])
        if int(reply[1]):
            return removed


def list_namespaces(redis_client: Any, prefix: str = "pagekv") -> dict[str, dict[str, str]]:
    """Every namespace pods have registered in, with its readable hash config.

    Lets a router find pods that registered under a *different* configuration and say so,
    instead of silently seeing an empty index.
    """
    ids = sorted(_text(n) for n in redis_client.smembers(prefix + NAMESPACES_SUFFIX))
    pipe = redis_client.pipeline(transaction=False)
    for ns in ids:
        pipe.hgetall(f"{prefix}:{{{ns}}}:config")
    out: dict[str, dict[str, str]] = {}
    for ns, flat in zip(ids, pipe.execute(), strict=True):
        out[ns] = {_text(k): _text(v) for k, v in flat.items()}
    return out


def _as_config(obj: Mapping[str, Any] | IndexSchema | PodInfo) -> dict[str, str]:
    if isinstance(obj, IndexSchema):
        return obj.hash_config()
    if isinstance(obj, PodInfo):
        return dict(obj.hash_config)
    return {_text(k): _text(v) for k, v in obj.items()}


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


def clear_pod_claims(redis_client: Any, schema: IndexSchema, pod_id: str,
                     batch: int = 1000) -> int:
    """Remove every block claim of `pod_id` (any epoch), using its per-pod set.

    Costs work proportional to the pod's own blocks; never scans the keyspace. Returns the
    number of claims removed. The registration and lease are left alone.
    """
    set_key = schema.pod_blocks_key(pod_id)
    removed = 0
    pending: list[str] = []

    def _flush() -> None:
        nonlocal removed
        pipe = redis_client.pipeline(transaction=False)
        for hex_hash in pending:
            pipe.hdel(schema.block_prefix + hex_hash, pod_id)
        removed += sum(int(n) for n in pipe.execute())
        pending.clear()

    for member in redis_client.sscan_iter(set_key, count=batch):
        pending.append(_text(member))
        if len(pending) >= batch:
            _flush()
    if pending:
        _flush()
    redis_client.delete(set_key)
    return removed

"""The index's key layout: namespace, key names, buckets, claim values and pod epochs.

Every key of one index carries `ns`, a short digest of everything that changes a block hash
(model, block size, hash algorithm, seed): pods whose hashes could not agree never share keys,
so they cannot produce false hits. Two kinds of keys, two kinds of Redis Cluster hash tags:

- control keys (config, the pods SET, each pod's HASH, lease and bucket list) under `{ns}`:
  few, read by the router's registry refresh, never per request;
- block claims (one HASH per bucket: a block's field holds every holder's claim, packed)
  and the routers' short-lived burst predictions under `{ns.<bucket>}`, where the bucket is
  taken from the hash of the chain's block 0. Every block of a chain descends from block 0,
  so all the keys one lookup reads share one slot (one shard, one round trip), while
  different chains spread over BUCKETS tags, hence over the cluster's shards.

A claim names its pod by a short claim id (CLAIM_ID_BYTES random bytes, unique among the
namespace's registrations, new with each registration), not by its pod id and epoch: that is
what makes a claim CLAIM_ENTRY_BYTES long (docs/INDEX.md, "Memory per claim").
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The fields that change a block hash, in the order config_mismatch reports them.
HASH_CONFIG_FIELDS: tuple[str, ...] = ("model", "block_size", "hash_algo", "hash_seed")
# The key layout's version, also in every hash config and in the namespace id: processes of
# two layouts never read each other's keys, and config_mismatch names the difference (it
# compares the field where both sides have it, as any other extra field).
LAYOUT_FIELD = "index_layout"
# 1: a HASH per block (pod id -> "<tiers>:<epoch>") and per-pod hash sets; 2: one HASH per
# bucket, block field -> packed (claim id, tier mask) entries. A config without the field
# is layout 1's (it predates the field).
INDEX_LAYOUT = "2"
LEGACY_LAYOUT = "1"

# A claim: the registration's claim id, then one byte, its tier mask. A block's field is the
# last FIELD_BYTES of its hash (64 bits: a collision within one bucket of a million blocks is
# a 1 in 30,000 chance, and costs a wrong hit the pod then recomputes).
CLAIM_ID_BYTES = 4
CLAIM_ENTRY_BYTES = CLAIM_ID_BYTES + 1
FIELD_BYTES = 8

NAMESPACES_SUFFIX = ":namespaces"  # `<prefix>:namespaces`, a SET of every namespace id

# A pod registration's `kind`: how a router reaches it. PageKV pods serve gRPC at `address`;
# a vLLM pod (its blocks written by `pagekv ingest-vllm`) serves OpenAI HTTP at `http_address`.
POD_KIND_PAGEKV, POD_KIND_VLLM = "pagekv", "vllm"
POD_KINDS: tuple[str, ...] = (POD_KIND_PAGEKV, POD_KIND_VLLM)
# A pod's phase in prefill/decode disaggregation (`pagekv node --role`): a prefill pod
# computes prompts for decode pods, a decode pod generates from handed-over KV, a mixed pod
# does both (and every pod without the field is mixed).
ROLE_PREFILL, ROLE_DECODE, ROLE_MIXED = "prefill", "decode", "mixed"
POD_ROLES: tuple[str, ...] = (ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE)

# Block claims are spread over this many hash tags, by the first bits of the chain's root
# hash. Enough to spread over any realistic shard count; few enough that the claims keys a
# pod lists (at most BUCKETS of them) stay cheap to list, clear and reap. Part of the key
# layout: every pod and router of one namespace must agree on it.
BUCKET_BITS = 10
BUCKETS = 1 << BUCKET_BITS

def text(value: Any) -> str:
    """Redis replies are bytes or str depending on the client's decode_responses."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def bucket_of(root_hash: bytes) -> int:
    """The bucket of every block of the chain whose block 0 hashes to `root_hash`."""
    return int.from_bytes(root_hash[:2], "big") >> (16 - BUCKET_BITS)


def bucket_name(bucket: int) -> str:
    """A bucket as written in key names and in a pod's bucket list (3 hex digits)."""
    return f"{bucket:03x}"


def namespaces_key(prefix: str) -> str:
    """The SET of every namespace id pods registered in (outside any hash tag)."""
    return prefix + NAMESPACES_SUFFIX


def namespace_base(prefix: str, namespace: str) -> str:
    """The start of every key of one namespace."""
    return f"{prefix}:{{{namespace}}}:"


def namespace_config_key(prefix: str, namespace: str) -> str:
    """The config HASH of any namespace, known only by its id (see `list_namespaces`)."""
    return namespace_base(prefix, namespace) + "config"


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
    index_layout: str = INDEX_LAYOUT
    namespace: str = field(init=False)
    base: str = field(init=False)

    def __init__(
        self,
        model: str,
        block_size: int,
        hash_algo: str,
        hash_seed: str | int,
        prefix: str = "pagekv",
        index_layout: str = INDEX_LAYOUT,
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
        object.__setattr__(self, "index_layout", str(index_layout))
        parts = "\x1f".join((self.model, str(self.block_size), self.hash_algo, self.hash_seed))
        if self.index_layout != LEGACY_LAYOUT:  # (layout 1's ids stay what they were)
            parts += "\x1f" + self.index_layout
        ns = hashlib.sha256(parts.encode()).hexdigest()[:12]
        object.__setattr__(self, "namespace", ns)
        object.__setattr__(self, "base", namespace_base(prefix, ns))

    @classmethod
    def from_config(cls, config: Mapping[str, Any], prefix: str = "pagekv") -> IndexSchema:
        """From a hash-config mapping (e.g. a pod's published one, or the config key)."""
        missing = [k for k in HASH_CONFIG_FIELDS if k not in config]
        if missing:
            raise ValueError(f"hash config lacks {', '.join(missing)}")
        return cls(
            text(config["model"]),
            int(text(config["block_size"])),
            text(config["hash_algo"]),
            text(config["hash_seed"]),
            prefix=prefix,
            index_layout=text(config.get(LAYOUT_FIELD, LEGACY_LAYOUT)),
        )

    def hash_config(self) -> dict[str, str]:
        """The readable form of the namespace (what the config key holds)."""
        return {
            "model": self.model,
            "block_size": str(self.block_size),
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
            LAYOUT_FIELD: self.index_layout,
        }

    def seed_fingerprint(self) -> str:
        return hashlib.sha256(self.hash_seed.encode()).hexdigest()[:12]

    # -- key names ---------------------------------------------------------------------
    @property
    def config_key(self) -> str:
        return namespace_config_key(self.prefix, self.namespace)  # HASH: hash_config()

    @property
    def namespaces_key(self) -> str:
        return namespaces_key(self.prefix)

    @property
    def pods_key(self) -> str:
        return self.base + "pods"  # SET of pod ids that registered here

    def pod_key(self, pod_id: str) -> str:
        return self.base + "p:" + pod_id  # HASH: address, epoch, cfg.*, load.*, cost.*

    def lease_key(self, pod_id: str) -> str:
        return self.base + "l:" + pod_id  # STRING: the live epoch, with a TTL

    def pod_buckets_key(self, pod_id: str) -> str:
        """SET of the buckets (as integers: an intset) where this pod id may have claims:
        what its clean-up and the reaper walk, so neither ever scans the keyspace."""
        return self.base + "pbk:" + pod_id

    def pod_claim_ids_key(self, pod_id: str) -> str:
        """SET of the claim ids (hex) this pod id registered under whose claims may remain:
        its current one and those retired (a restart, a republish) not yet stripped."""
        return self.base + "pc:" + pod_id

    @property
    def claim_ids_key(self) -> str:
        """HASH claim id (hex) -> pod id: every claim id in use in this namespace, so a new
        registration never takes one whose claims may still be in the index."""
        return self.base + "cids"

    # -- claim keys: one hash tag per bucket --------------------------------------------
    def bucket_base(self, bucket: int) -> str:
        """The start of every key of one bucket: `pagekv:{ns.<bucket>}:`."""
        return f"{self.prefix}:{{{self.namespace}.{bucket_name(bucket)}}}:"

    def claims_key(self, bucket: int) -> str:
        """The bucket's HASH: claim_field(block hash) -> packed claim entries."""
        return self.bucket_base(bucket) + "c"

    def chain_claims_key(self, block_hashes: Sequence[bytes]) -> str:
        """The claims key of a chain (block 0's bucket's): every block of it is there."""
        return self.claims_key(bucket_of(block_hashes[0]))

    def chain_prediction_keys(self, block_hashes: Sequence[bytes], start: int = 0) -> list[str]:
        """The burst-prediction keys of blocks `start`... of a chain, beside its claims (same
        tag): HASH pod_id -> expiry (ms, Redis's clock), written by routers for each other."""
        if start >= len(block_hashes):
            return []
        base = self.bucket_base(bucket_of(block_hashes[0])) + "r:"
        return [base + h.hex() for h in block_hashes[start:]]


def claim_field(block_hash: bytes) -> bytes:
    """A block's field in its bucket's claims HASH: the hash's last FIELD_BYTES (its first
    bits are the bucket's, shared by the whole HASH)."""
    return block_hash[-FIELD_BYTES:].rjust(FIELD_BYTES, b"\0")


def claim_field_hex(hex_hash: str) -> bytes:
    """claim_field of a hash written in hex (a full state's keys)."""
    return claim_field(bytes.fromhex(hex_hash[-2 * FIELD_BYTES:]))


def new_claim_id() -> bytes:
    """A random claim id. Its bytes are never 0 or 1: ids of that shape are what
    `valid_claim_id` accepts, so a garbled registration's id (or the placeholder of none)
    never matches a real one."""
    return bytes(2 + secrets.randbelow(254) for _ in range(CLAIM_ID_BYTES))


def valid_claim_id(claim_id: bytes) -> bool:
    return len(claim_id) == CLAIM_ID_BYTES and 0 not in claim_id and 1 not in claim_id


def new_epoch() -> str:
    """A pod instance's epoch: milliseconds since 1970 in base 36 plus 4 random base-36
    digits (11-12 chars). A restart gets a new one, so its old claims stop counting."""
    def b36(n: int, width: int = 0) -> str:
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"
        out = ""
        while n:
            n, r = divmod(n, 36)
            out = digits[r] + out
        return out.rjust(width, "0")

    return b36(time.time_ns() // 1_000_000) + b36(secrets.randbelow(36**4), 4)

"""The index's key layout: namespace, key names, claim values and pod epochs.

Every key of one index lives under `pagekv:{ns}:` where `ns` is a short digest of everything
that changes a block hash (model, block size, hash algorithm, seed). Pods whose hashes could
not agree therefore never share keys, so they cannot produce false hits; the braces make `ns`
a Redis Cluster hash tag, keeping the keys a lookup script touches in one slot.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagekv.proto.medium import ALL_BITS, mask_codes

# The fields that change a block hash, in the order config_mismatch reports them.
HASH_CONFIG_FIELDS: tuple[str, ...] = ("model", "block_size", "hash_algo", "hash_seed")

NAMESPACES_SUFFIX = ":namespaces"  # `<prefix>:namespaces`, a SET of every namespace id

# Claim value per tier bitmask (index 0 unused): codes of the tiers present, best first.
MASK_CODES: tuple[str, ...] = tuple(mask_codes(m) for m in range(ALL_BITS + 1))


def text(value: Any) -> str:
    """Redis replies are bytes or str depending on the client's decode_responses."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


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
        return namespace_config_key(self.prefix, self.namespace)  # HASH: hash_config()

    @property
    def namespaces_key(self) -> str:
        return namespaces_key(self.prefix)

    @property
    def pods_key(self) -> str:
        return self.base + "pods"  # SET of pod ids that registered here

    @property
    def block_prefix(self) -> str:
        return self.base + "b:"

    def block_key(self, block_hash: bytes) -> str:
        return self.block_key_hex(block_hash.hex())

    def block_key_hex(self, hex_hash: str) -> str:
        """A block key from a per-pod set member (the set holds hex hashes)."""
        return self.block_prefix + hex_hash  # HASH pod_id -> "<tiers>:<epoch>"

    def pod_key(self, pod_id: str) -> str:
        return self.base + "p:" + pod_id  # HASH: address, epoch, cfg.*, load.*, cost.*

    def lease_key(self, pod_id: str) -> str:
        return self.base + "l:" + pod_id  # STRING: the live epoch, with a TTL

    def pod_blocks_key(self, pod_id: str) -> str:
        return self.base + "pb:" + pod_id  # SET of hex hashes this pod id claims


def claim_value(mask: int, epoch: str) -> str:
    """The value a pod writes into a block's HASH: tier codes (best first), ':', epoch."""
    return f"{MASK_CODES[mask]}:{epoch}"


def claim_values(epoch: str) -> list[str]:
    """claim_value of every tier bitmask for one epoch, by mask ("" for the empty mask):
    made once per epoch so writing a claim is a list lookup."""
    return [claim_value(m, epoch) if m else "" for m in range(ALL_BITS + 1)]


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

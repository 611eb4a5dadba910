"""Who a client is: the tenants file (`--tenants FILE` on `pagekv node`, `router`, `up`).

A YAML or JSON mapping of tenant names to their credentials:

    tenants:
      acme:
        tokens: ["sha256:9f86d081884c7d65..."]   # sha256 of each API token, hex
        cert_subjects: ["CN=acme-client,O=Acme"]  # mutual TLS: the client certificate's subject
      globex:
        tokens: ["sha256:..."]
        quota: {pool: 256MiB, dram: 1GiB, ssd: 8GiB}   # cached bytes per tier (optional)
    shared:                                       # optional: cached once, hit by every tenant
      prefixes:
        - text: "<|im_start|>system\nYou are a helpful assistant"   # tokenized by each process
        - token_ids: [1, 2, 3]
      quota: {pool: 64MiB}

A tenant's quota bounds the bytes its cached blocks hold in each tier (`kvnode/engine/
tenancy.py` enforces it by evicting that tenant's own blocks); a tier not named is not bounded.
The shared region: a prompt's leading full blocks that lie within one of the `prefixes` are
hashed without the tenant's salt (the salt goes on the first block after them), so every
tenant hits them; they are counted apart, against the region's own quota. Only put public text
there: whoever sends it hits it.

Tokens are stored as their SHA-256, so the file is not a list of usable tokens (it may be
shipped to every pod and read by their operators). A plain hash is enough: an API token is a
long random string (`openssl rand -hex 32`; its hash: `printf %s TOKEN | sha256sum`),
which no dictionary guesses, and a slow password hash would cost every call its time. A presented token is
hashed once and compared in constant time against every stored hash (no early exit).

`digest` names the file's content (sorted, whitespace-free JSON of what was read): the
fleet's processes must all hold the same one, which the join check compares.

No grpc here: the routers and pods resolve the caller in `proto/tenant_identity.py`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TOKEN_HASH_PREFIX = "sha256:"
MAX_TENANT_NAME = 64
QUOTA_TIERS = ("pool", "dram", "ssd")  # the tenants file's names of the tiers, best first
MAX_SHARED_PREFIXES = 64
MAX_SHARED_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class TierQuota:
    """The most bytes of cached blocks one tenant (or the shared region) keeps in each tier;
    None: not bounded."""

    pool: int | None = None
    dram: int | None = None
    ssd: int | None = None

    def of(self, tier: str) -> int | None:
        return {"pool": self.pool, "dram": self.dram, "ssd": self.ssd}[tier]

    @classmethod
    def from_mapping(cls, data: Any, what: str) -> TierQuota:
        if not isinstance(data, dict) or set(data) - set(QUOTA_TIERS) or not data:
            raise ValueError(f"{what} quota must map some of {', '.join(QUOTA_TIERS)} to a "
                             "size in bytes (e.g. 256MiB)")
        sizes: dict[str, int] = {}
        for tier, value in data.items():
            size = _size(value)
            if size is None:
                raise ValueError(f"{what} quota {tier}: {value!r} is not a size in bytes "
                                 "(a number, or e.g. 512MiB, 2GiB)")
            sizes[tier] = size
        return cls(**sizes)


NO_QUOTA = TierQuota()


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """The tenants file's `shared:`: prefixes every tenant hits, as text (each process
    tokenizes it with its model's tokenizer) or token ids, and their own quota."""

    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    quota: TierQuota = NO_QUOTA

    @classmethod
    def from_mapping(cls, data: Any) -> SharedRegion:
        if not isinstance(data, dict) or set(data) - {"prefixes", "quota"} or \
                not isinstance(data.get("prefixes"), list) or not data["prefixes"]:
            raise ValueError("'shared:' must hold 'prefixes:' (a list of {text: ...} or "
                             "{token_ids: [...]}) and optionally 'quota:'")
        if len(data["prefixes"]) > MAX_SHARED_PREFIXES:
            raise ValueError(f"'shared:' lists more than {MAX_SHARED_PREFIXES} prefixes")
        texts: list[str] = []
        ids: list[tuple[int, ...]] = []
        for entry in data["prefixes"]:
            if isinstance(entry, dict) and set(entry) == {"text"} and \
                    isinstance(entry["text"], str) and entry["text"]:
                texts.append(entry["text"])
            elif isinstance(entry, dict) and set(entry) == {"token_ids"} and \
                    _token_list(entry["token_ids"]):
                ids.append(tuple(entry["token_ids"]))
            else:
                raise ValueError(f"shared prefix {entry!r}: expected {{text: \"...\"}} or "
                                 "{token_ids: [non-negative ints]}")
        if sum(map(len, texts)) + sum(map(len, ids)) > MAX_SHARED_TOKENS:
            raise ValueError(f"the shared prefixes hold more than {MAX_SHARED_TOKENS} "
                             "characters and tokens")
        quota = TierQuota.from_mapping(data["quota"], "the shared region's") \
            if "quota" in data else NO_QUOTA
        return cls(tuple(texts), tuple(ids), quota)


def hash_token(token: str) -> str:
    """The form a token takes in a tenants file."""
    return TOKEN_HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantMap:
    """The tenants file as read: token hashes and certificate subjects -> tenant name."""

    token_hashes: tuple[tuple[bytes, str], ...]  # (sha256 digest, tenant)
    subjects: Mapping[str, str]
    digest: str
    source: str = ""
    quotas: Mapping[str, TierQuota] = field(default_factory=dict)  # tenants with a quota
    shared: SharedRegion | None = None
    name_set: frozenset[str] = field(default=frozenset(), init=False)  # every tenant named

    @classmethod
    def load(cls, path: str) -> TenantMap:
        """Read a tenants file; ValueError naming the file and the problem."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read tenants file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"tenants file {path} is not UTF-8 text") from None
        try:
            data = yaml.safe_load(text)  # JSON is YAML too
        except yaml.YAMLError as exc:
            raise ValueError(f"tenants file {path} is neither YAML nor JSON: "
                             f"{str(exc).splitlines()[0]}") from None
        try:
            return cls.from_mapping(data, source=path)
        except ValueError as exc:
            raise ValueError(f"tenants file {path}: {exc}") from None

    @classmethod
    def from_mapping(cls, data: Any, source: str = "") -> TenantMap:
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) \
                or not data["tenants"] or set(data) - {"tenants", "shared"}:
            raise ValueError("expected a mapping 'tenants:' of tenant names to "
                             "{tokens: [...], cert_subjects: [...], quota: {...}} (and "
                             "optionally 'shared:')")
        hashes: list[tuple[bytes, str]] = []
        subjects: dict[str, str] = {}
        seen_hashes: dict[bytes, str] = {}
        quotas: dict[str, TierQuota] = {}
        for name, entry in data["tenants"].items():
            if not isinstance(name, str) or not name or len(name) > MAX_TENANT_NAME or \
                    not name.isprintable():
                raise ValueError(f"tenant name {name!r} must be printable text of 1 to "
                                 f"{MAX_TENANT_NAME} characters")
            if not isinstance(entry, dict) or set(entry) - {"tokens", "cert_subjects", "quota"}:
                raise ValueError(f"tenant {name!r}: expected 'tokens' and/or "
                                 "'cert_subjects' lists (and optionally 'quota')")
            if "quota" in entry:
                quotas[name] = TierQuota.from_mapping(entry["quota"], f"tenant {name!r}")
            tokens = _strings(entry.get("tokens", []), f"tenant {name!r} tokens")
            names = _strings(entry.get("cert_subjects", []), f"tenant {name!r} cert_subjects")
            if not tokens and not names:
                raise ValueError(f"tenant {name!r} has no tokens and no cert_subjects")
            for stored in tokens:
                digest = _token_digest(stored, name)
                if digest in seen_hashes:
                    raise ValueError(f"one token hash is listed for both {seen_hashes[digest]!r}"
                                     f" and {name!r}")
                seen_hashes[digest] = name
                hashes.append((digest, name))
            for subject in names:
                if subject in subjects:
                    raise ValueError(f"certificate subject {subject!r} is listed for both "
                                     f"{subjects[subject]!r} and {name!r}")
                subjects[subject] = name
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
        digest_hex = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        shared = SharedRegion.from_mapping(data["shared"]) if "shared" in data else None
        return cls(tuple(hashes), subjects, digest_hex, source, quotas, shared)

    def tenant_for_token(self, token: str) -> str | None:
        """The token's tenant, or None. Every stored hash is compared (constant time each),
        so how long it takes tells nothing about which, or how much, matched."""
        given = hashlib.sha256(token.encode()).digest()
        found: str | None = None
        for stored, tenant in self.token_hashes:
            if hmac.compare_digest(given, stored):
                found = tenant
        return found

    def tenant_for_subject(self, subject: str) -> str | None:
        return self.subjects.get(subject)

    @property
    def has_subjects(self) -> bool:
        return bool(self.subjects)

    def describe(self) -> str:
        return (f"{len(self.names)} tenants from {self.source or 'a mapping'} (digest "
                f"{self.digest})")

    @property
    def names(self) -> list[str]:
        """Every tenant the file names, in sorted order."""
        return sorted(self.name_set)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name_set", frozenset(
            {t for _, t in self.token_hashes} | set(self.subjects.values())))


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{what} must be a list of non-empty strings")
    return value


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        type(v) is int and v >= 0 for v in value)


def _size(value: Any) -> int | None:
    """Bytes from a number or a size string ('512MiB'); None if it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value) if value >= 0 else None
    if not isinstance(value, str):
        return None
    from humanfriendly import InvalidSize, parse_size
    try:
        size: int = int(parse_size(value, binary=False))
    except InvalidSize:
        return None
    return size


def _token_digest(stored: str, tenant: str) -> bytes:
    hex_part = stored[len(TOKEN_HASH_PREFIX):] if stored.startswith(TOKEN_HASH_PREFIX) else ""
    try:
        digest = bytes.fromhex(hex_part)
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise ValueError(f"tenant {tenant!r}: a token must be stored as 'sha256:<64 hex "
                         "digits>', its SHA-256, not the token itself (printf %s TOKEN | "
                         "sha256sum)")
    return digest


def add_tenants_argument(parser: Any) -> None:
    """--tenants FILE (`pagekv node`, `router`, `up`)."""
    parser.add_argument(
        "--tenants", default=None, metavar="FILE",
        help="tenants file (YAML or JSON: tenant -> sha256 token hashes and/or client "
             "certificate subjects); each request's cache salt is then derived from its "
             "caller's tenant, so tenants never share cached prefixes; every pod and router "
             "of a fleet must load the same file (README \"Security\")")


def tenants_from(args: Any) -> TenantMap | None:
    """The --tenants file, read; CliError-worthy ValueError naming the file."""
    return TenantMap.load(args.tenants) if getattr(args, "tenants", None) else None

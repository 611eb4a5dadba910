"""Who a client is: the tenants file (`--tenants FILE` on `pagekv node`, `router`, `up`).

A YAML or JSON mapping of tenant names to their credentials:

    tenants:
      acme:
        tokens: ["sha256:9f86d081884c7d65..."]   # sha256 of each API token, hex
        cert_subjects: ["CN=acme-client,O=Acme"]  # mutual TLS: the client certificate's subject
      globex:
        tokens: ["sha256:..."]

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TOKEN_HASH_PREFIX = "sha256:"
MAX_TENANT_NAME = 64


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
                or not data["tenants"]:
            raise ValueError("expected a mapping 'tenants:' of tenant names to "
                             "{tokens: [...], cert_subjects: [...]}")
        hashes: list[tuple[bytes, str]] = []
        subjects: dict[str, str] = {}
        seen_hashes: dict[bytes, str] = {}
        for name, entry in data["tenants"].items():
            if not isinstance(name, str) or not name or len(name) > MAX_TENANT_NAME or \
                    not name.isprintable():
                raise ValueError(f"tenant name {name!r} must be printable text of 1 to "
                                 f"{MAX_TENANT_NAME} characters")
            if not isinstance(entry, dict) or set(entry) - {"tokens", "cert_subjects"}:
                raise ValueError(f"tenant {name!r}: expected 'tokens' and/or "
                                 "'cert_subjects' lists")
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
        return cls(tuple(hashes), subjects, digest_hex, source)

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
        names = {t for _, t in self.token_hashes} | set(self.subjects.values())
        return f"{len(names)} tenants from {self.source or 'a mapping'} (digest {self.digest})"


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{what} must be a list of non-empty strings")
    return value


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

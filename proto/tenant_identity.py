"""Which salt a call may hash with, and whose quota it counts against: the caller's tenant,
read from its own credential.

`TenantSalting.identity(context, client_salt, client_tenant)` -> (salt, tenant), on the
router and on pods alike:
- no tenants file: the client's salt, as before (the single `--api-token` mode);
- a tenant's token (`authorization: Bearer`), or with mutual TLS a client certificate whose
  subject the file lists: `tenant_salt(tenant, client_salt)`;
- a pod's fleet credential (its `--api-token`, which the router calls it with as
  `--pod-api-token`, or the admin token): the salt and the tenant as sent. The router has
  already derived them from its own client's credential, and the pod hashes with that same
  string, so the router's hit prediction holds (a tenant the file does not name is refused). A client never holds the fleet token: on the router, the
  plain API token names no tenant and is refused once a tenants file is given;
- anything else: `NoTenant` (the servers answer PERMISSION_DENIED).

Duck-typed on the servicer context (no grpc import): a context without call metadata (the
HTTP front end's in-process calls) names no tenant.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from pagekv.proto.tenant_salt import tenant_salt
from pagekv.proto.tenants import TenantMap


class NoTenant(Exception):
    """The call's credential names no tenant of the tenants file."""


class TenantSalting:
    def __init__(self, tenants: TenantMap | None, fleet_tokens: Iterable[str | None] = ()
                 ) -> None:
        self.tenants = tenants
        self.fleet_tokens = tuple(t.encode() for t in fleet_tokens if t)

    @property
    def active(self) -> bool:
        return self.tenants is not None

    def names_tenant(self, token: str) -> bool:
        """Whether `token` is a tenant's (the HTTP front end lets it call /v1/* as the gRPC
        guard does)."""
        return self.tenants is not None and self.tenants.tenant_for_token(token) is not None

    def salt(self, context: Any, client_salt: str | None) -> str | None:
        """The salt this call hashes with (see the module docstring); NoTenant."""
        return self.identity(context, client_salt)[0]

    def identity(self, context: Any, client_salt: str | None, client_tenant: str = ""
                 ) -> tuple[str | None, str]:
        """(the salt this call hashes with, its tenant: "" for none); NoTenant."""
        tenants = self.tenants
        if tenants is None:
            return client_salt, ""
        token = _bearer(context)
        if token is not None:
            given = token.encode()
            if any([hmac.compare_digest(given, t) for t in self.fleet_tokens]):
                if client_tenant and client_tenant not in tenants.name_set:
                    raise NoTenant(f"tenant {client_tenant[:64]!r} is not in the tenants file")
                return client_salt, client_tenant
            tenant = tenants.tenant_for_token(token)
            if tenant is not None:
                return tenant_salt(tenant, client_salt), tenant
        for subject in _subjects(context):
            tenant = tenants.tenant_for_subject(subject)
            if tenant is not None:
                return tenant_salt(tenant, client_salt), tenant
        raise NoTenant("this credential names no tenant of the tenants file: send a "
                       "tenant's token (or its client certificate)")


def _bearer(context: Any) -> str | None:
    metadata = getattr(context, "invocation_metadata", None)
    if metadata is None:
        return None
    for item in metadata() or ():
        if item.key == "authorization":
            scheme, _, token = str(item.value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _subjects(context: Any) -> list[str]:
    """The client certificate's subject as gRPC reports it ('CN=...,O=...'), and 'CN=<name>'
    for its common name; none without mutual TLS."""
    auth = getattr(context, "auth_context", None)
    if auth is None:
        return []
    props = auth() or {}
    found = [v.decode("utf-8", "replace") for v in props.get("x509_subject", ())]
    found += ["CN=" + v.decode("utf-8", "replace") for v in props.get("x509_common_name", ())]
    return found

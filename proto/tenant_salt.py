"""The cache salt a tenant's request hashes with, derived on the server from who it is.

`cache_salt` is a client field: on its own, anyone who learns (or guesses) another tenant's
salt shares that tenant's cached prefixes, and a hit's speed or `cached_tokens` tells them
the prompt (issue #27). With a tenants file every server that authenticates a client (the
router, or a pod called directly) replaces the client's salt with this derivation from the
authenticated tenant, so a salt only partitions within its tenant; the router hashes with
the very string the pod then uses, so its hit predictions stay right.
"""

from __future__ import annotations

import hashlib
import hmac

DERIVED_SALT_PREFIX = "tenant:"


def tenant_salt(tenant: str, client_salt: str | None) -> str:
    """HMAC-SHA256 keyed by the tenant's name over the client's salt ('' for none): two
    tenants never get the same salt, whatever each sends."""
    mac = hmac.new(tenant.encode(), b"pagekv-cache-salt\0" + (client_salt or "").encode(),
                   hashlib.sha256)
    return DERIVED_SALT_PREFIX + mac.hexdigest()[:32]

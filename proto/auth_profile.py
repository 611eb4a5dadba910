"""A pod's auth settings as the fleet compares them at join (issue #27, finding 8).

A pod publishes its own with its registration (the `cfg.auth` field, beside the hash
settings); a router derives the fleet's from how it calls pods (`--pod-api-token`,
`--pod-tls-*`, `--tenants`) and writes it to the namespace's `auth` key. A pod that differs
is refused at join in one line naming the setting: by the pod itself, which reads that key
before it registers, and by every router, which never routes to it (a log line and
`pagekv_router_join_refused_total{setting}`). Otherwise a pod started without tokens joins
and is open to everything, ResetPrefixCache included, or one with another tenants file
derives other salts than the router predicts with.

No secret is published: whether a token is set, the TLS mode, the tenants file's digest.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekv.proto.credentials import TlsFiles
from pagekv.proto.index.schema import IndexSchema
from pagekv.proto.tenants import TenantMap

AUTH_CONFIG_FIELD = "auth"  # published as cfg.auth
NO_TENANTS = "none"


def fleet_auth_key(schema: IndexSchema) -> str:
    """STRING: the fleet's AuthProfile.encode(), written by routers."""
    return schema.base + "auth"


@dataclass(frozen=True, slots=True)
class AuthProfile:
    api_token: bool
    admin_token: bool
    tls: str  # "plaintext", "tls" or "mtls"
    tenants: str  # the tenants file's digest, or NO_TENANTS

    @classmethod
    def of_pod(cls, api_token: str | None, admin_token: str | None, tls: TlsFiles | None,
               tenants: TenantMap | None) -> AuthProfile:
        mode = "plaintext" if tls is None else "mtls" if tls.client_auth else "tls"
        return cls(bool(api_token), bool(admin_token), mode,
                   tenants.digest if tenants else NO_TENANTS)

    @classmethod
    def of_fleet(cls, pod_token: str | None, pod_tls: TlsFiles | None,
                 tenants: TenantMap | None) -> AuthProfile:
        """What a router that calls pods this way expects of them: its token means pods
        require one (and an admin token: a fleet with tokens has no open admin port); its
        client certificate means pods require certificates."""
        mode = "plaintext" if pod_tls is None else "mtls" if pod_tls.cert else "tls"
        return cls(bool(pod_token), bool(pod_token), mode,
                   tenants.digest if tenants else NO_TENANTS)

    def encode(self) -> str:
        return (f"api_token={int(self.api_token)};admin_token={int(self.admin_token)};"
                f"tls={self.tls};tenants={self.tenants}")

    @classmethod
    def decode(cls, text: str) -> AuthProfile | None:
        """None for anything that is not an encode() (the index may hold garbage)."""
        try:
            fields = dict(part.split("=", 1) for part in text.split(";"))
            profile = cls(fields["api_token"] == "1", fields["admin_token"] == "1",
                          fields["tls"], fields["tenants"])
        except (KeyError, ValueError):
            return None
        if profile.tls not in ("plaintext", "tls", "mtls") or \
                fields["api_token"] not in "01" or fields["admin_token"] not in "01":
            return None
        return profile


def _token(on: bool) -> str:
    return "token required" if on else "none"


def auth_mismatch(fleet: AuthProfile, pod: AuthProfile | None) -> str | None:
    """One line naming each setting in which `pod` differs from `fleet`, or None. An admin
    token is only required where the fleet uses tokens."""
    if pod is None:
        return "auth settings unreadable (cfg.auth is not one this version writes)"
    problems = []
    if fleet.api_token != pod.api_token:
        problems.append(f"--api-token: fleet {_token(fleet.api_token)}, pod "
                        f"{_token(pod.api_token)}")
    if fleet.admin_token and not pod.admin_token:
        problems.append("--admin-token: fleet token required, pod none (ResetPrefixCache "
                        "open)")
    if fleet.tls != pod.tls:
        problems.append(f"TLS (--tls-cert/--tls-ca): fleet {fleet.tls}, pod {pod.tls}")
    if fleet.tenants != pod.tenants:
        problems.append(f"--tenants: fleet {fleet.tenants}, pod {pod.tenants} (file digests)")
    return "; ".join(problems) if problems else None


def mismatched_settings(fleet: AuthProfile, pod: AuthProfile | None) -> list[str]:
    """The settings auth_mismatch names, as metric labels."""
    if pod is None:
        return ["unreadable"]
    names = []
    if fleet.api_token != pod.api_token:
        names.append("api_token")
    if fleet.admin_token and not pod.admin_token:
        names.append("admin_token")
    if fleet.tls != pod.tls:
        names.append("tls")
    if fleet.tenants != pod.tenants:
        names.append("tenants")
    return names

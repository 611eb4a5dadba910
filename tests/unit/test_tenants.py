"""The tenants file, the derived salt and the auth profile compared at join: pure functions
(the processes: tests/integration/test_tenants_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekv.proto.auth_profile import AuthProfile, auth_mismatch, mismatched_settings
from pagekv.proto.credentials import TlsFiles
from pagekv.proto.tenant_salt import tenant_salt
from pagekv.proto.tenants import TenantMap, hash_token


def tenants(**entries: dict[str, list[str]]) -> TenantMap:
    return TenantMap.from_mapping({"tenants": entries})


def test_tokens_and_subjects_name_their_tenant() -> None:
    m = tenants(acme={"tokens": [hash_token("a1"), hash_token("a2")]},
                globex={"tokens": [hash_token("g")], "cert_subjects": ["CN=globex"]})
    assert [m.tenant_for_token(t) for t in ("a1", "a2", "g", "nope", "")] == \
        ["acme", "acme", "globex", None, None]
    assert m.tenant_for_subject("CN=globex") == "globex" and m.has_subjects
    assert m.tenant_for_subject("CN=acme") is None


def test_the_file_holds_hashes_not_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"tenants": {"acme": {"tokens": ["secret-token"]}}}')
    with pytest.raises(ValueError, match=r"t.json: tenant 'acme': a token must be stored as "
                                         r"'sha256:<64 hex digits>'"):
        TenantMap.load(str(path))


@pytest.mark.parametrize(("text", "message"), [
    ("tenants: []", "expected a mapping 'tenants:'"),
    ("[1, 2", "neither YAML nor JSON"),
    ("tenants: {acme: {}}", "tenant 'acme' has no tokens and no cert_subjects"),
    ("tenants: {acme: {tokens: 'x'}}", "tokens must be a list of non-empty strings"),
    ("tenants: {acme: {token: []}}", "expected 'tokens' and/or 'cert_subjects'"),
    (f"tenants: {{a: {{tokens: ['{hash_token('t')}']}}, b: {{tokens: ['{hash_token('t')}']}}}}",
     "one token hash is listed for both 'a' and 'b'"),
    ("tenants: {a: {cert_subjects: [CN=x]}, b: {cert_subjects: [CN=x]}}",
     "subject 'CN=x' is listed for both"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="tenants file .*tenants.yaml") as err:
        TenantMap.load(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read tenants file .*absent.yaml"):
        TenantMap.load(str(tmp_path / "absent.yaml"))


def test_yaml_and_json_of_one_content_share_the_digest(tmp_path: Path) -> None:
    h = hash_token("a")
    (tmp_path / "a.yaml").write_text(f"tenants:\n  acme:\n    tokens: ['{h}']\n")
    (tmp_path / "a.json").write_text(f'{{"tenants": {{"acme": {{"tokens": ["{h}"]}}}}}}')
    a, b = (TenantMap.load(str(tmp_path / n)) for n in ("a.yaml", "a.json"))
    assert a.digest == b.digest
    assert tenants(acme={"tokens": [hash_token("b")]}).digest != a.digest


def test_a_salt_is_the_tenants_own() -> None:
    assert tenant_salt("acme", "s") == tenant_salt("acme", "s")
    assert len({tenant_salt("acme", "s"), tenant_salt("globex", "s"), tenant_salt("acme", ""),
                tenant_salt("acme", None), tenant_salt("acme", "t")}) == 4  # '' == None
    assert tenant_salt("acme", "s").startswith("tenant:")


def test_auth_profiles_round_trip_and_name_what_differs() -> None:
    m = tenants(acme={"tokens": [hash_token("a")]})
    mtls = TlsFiles("c.pem", "k.pem", "ca.pem")
    fleet = AuthProfile.of_fleet("pod-token", mtls, m)
    pod = AuthProfile.of_pod("pod-token", "admin", mtls, m)
    assert fleet == AuthProfile.decode(fleet.encode()) and auth_mismatch(fleet, pod) is None
    open_pod = AuthProfile.of_pod(None, None, None, None)
    diff = auth_mismatch(fleet, open_pod)
    assert diff == ("--api-token: fleet token required, pod none; --admin-token: fleet token "
                    "required, pod none (ResetPrefixCache open); TLS (--tls-cert/--tls-ca): "
                    f"fleet mtls, pod plaintext; --tenants: fleet {m.digest}, pod none (file "
                    "digests)")
    assert mismatched_settings(fleet, open_pod) == ["api_token", "admin_token", "tls", "tenants"]
    # An open fleet asks no admin token, and does not mind one.
    open_fleet = AuthProfile.of_fleet(None, None, None)
    assert auth_mismatch(open_fleet, AuthProfile.of_pod(None, "admin", None, None)) is None
    assert "unreadable" in (auth_mismatch(fleet, AuthProfile.decode("garbage")) or "")
    assert AuthProfile.decode("api_token=2;admin_token=1;tls=tls;tenants=none") is None


class _Md:
    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value


def test_the_guard_takes_a_tenants_token_for_api_calls_only() -> None:
    import grpc

    from pagekv.proto.grpc_security import TokenGuard

    guard = TokenGuard(None, "admin", ["/x.Admin/Reset"],
                       tenants=tenants(acme={"tokens": [hash_token("a")]}))
    assert guard.active
    assert guard.check("/x.Gen/Generate", [_Md("authorization", "Bearer a")]) is None
    refused = guard.check("/x.Gen/Generate", [_Md("authorization", "Bearer b")])
    assert refused is not None and refused[0] == grpc.StatusCode.UNAUTHENTICATED
    refused = guard.check("/x.Gen/Generate", [])
    assert refused is not None and refused[0] == grpc.StatusCode.UNAUTHENTICATED
    refused = guard.check("/x.Admin/Reset", [_Md("authorization", "Bearer a")])
    assert refused is not None and refused[0] == grpc.StatusCode.UNAUTHENTICATED

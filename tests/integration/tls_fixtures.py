"""Real certificates for the security tests, made with the `openssl` command line.

Two CAs: `ca` signs the servers' certificate and a client's; `other_ca` signs a client
certificate that servers trusting `ca` must refuse. Every leaf names IP 127.0.0.1 and
localhost, and may serve or connect (serverAuth + clientAuth), so one certificate can be a
local cluster's servers' and its router's client identity.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagekv.proto.credentials import TlsFiles

LEAF_EXTENSIONS = """\
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
"""


@dataclass(frozen=True)
class Certs:
    ca: str
    server: TlsFiles        # cert + key, no CA: a TLS server that asks no client certificate
    client: TlsFiles        # cert + key signed by `ca`, and `ca` to check the server by
    other_ca: str
    other_client: TlsFiles  # cert + key signed by `other_ca`, and `ca`

    def mtls_server(self) -> TlsFiles:
        return TlsFiles(self.server.cert, self.server.key, self.ca)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _key_args(key: Path) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key)]


def make_ca(out: Path, name: str) -> tuple[Path, Path]:
    cert, key = out / f"{name}.pem", out / f"{name}.key"
    _openssl("req", "-x509", *_key_args(key), "-out", str(cert), "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_leaf(out: Path, name: str, ca: tuple[Path, Path]) -> tuple[str, str]:
    cert, key, csr, ext = (out / f"{name}{s}" for s in (".pem", ".key", ".csr", ".ext"))
    ext.write_text(LEAF_EXTENSIONS)
    _openssl("req", "-new", *_key_args(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return str(cert), str(key)


def make_certs(out: Path) -> Certs:
    if shutil.which("openssl") is None:  # an install problem, not a reason to skip silently
        pytest.fail("the security tests make their certificates with `openssl`: install it")
    ca, other = make_ca(out, "pagekv-test-ca"), make_ca(out, "pagekv-other-ca")
    server = make_leaf(out, "server", ca)
    client = make_leaf(out, "client", ca)
    stranger = make_leaf(out, "stranger", other)
    return Certs(ca=str(ca[0]), server=TlsFiles(*server), client=TlsFiles(*client, str(ca[0])),
                 other_ca=str(other[0]), other_client=TlsFiles(*stranger, str(ca[0])))

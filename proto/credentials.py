"""What a process is given to prove who it is and whom it trusts: TLS files and bearer tokens,
and the command-line flags that carry them (the same names on `pagekv node`, `router`, `up`
and `generate`).

No grpc here: the Redis connection (proto/index/connect.py) uses the same files.
`proto/grpc_security.py` turns them into gRPC credentials.

Tokens are never a flag's default (`--help` prints defaults) and never logged; the
environment variables are the better carrier, since a flag's value shows in `ps`.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from typing import overload

ADMIN_TOKEN_ENV = "PAGEKV_ADMIN_TOKEN"
API_TOKEN_ENV = "PAGEKV_API_TOKEN"
POD_API_TOKEN_ENV = "PAGEKV_POD_API_TOKEN"
PEER_API_TOKEN_ENV = "PAGEKV_PEER_API_TOKEN"  # a pod's token when it pulls KV from a peer
METRICS_TOKEN_ENV = "PAGEKV_METRICS_TOKEN"  # what a metrics port's /metrics requires
REDIS_URL_ENV = "PAGEKV_REDIS_URL"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM file paths of one end of a TLS connection.

    A server: `cert` + `key` are its identity; `ca`, when given, is the CA its clients'
    certificates must be signed by (mutual TLS: a client without one is refused).
    A client: `ca` is the CA the server's certificate must be signed by (None: the system's
    roots); `cert` + `key` are its own certificate, for a server that asks for one."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate and its key go together: give both or neither")

    @property
    def client_auth(self) -> bool:
        """As a server's: whether clients must present a certificate."""
        return self.ca is not None

    def require_identity(self) -> None:
        """As a server's: it must have a certificate to serve TLS at all."""
        if self.cert is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key (--tls-ca only names "
                             "the CA that clients' certificates are checked against)")

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(cert, key, ca) as PEM bytes; a missing or non-PEM file is a ValueError naming it."""
        return _read_pem(self.cert), _read_pem(self.key), _read_pem(self.ca)

    def describe(self) -> str:
        """For a log line: which files, never their contents."""
        parts = [f"cert {self.cert}"] if self.cert else []
        if self.ca:
            parts.append(f"CA {self.ca}")
        return ", ".join(parts) or "system CAs"


def client_ssl_context(tls: TlsFiles | None) -> ssl.SSLContext:
    """The context for https:// origins: the system's CAs, or `tls.ca`; `tls.cert` +
    `tls.key` are presented to a server that asks for a client certificate. A file that
    cannot be read, is not PEM, or a key that is not the certificate's, is a ValueError
    naming the file. Built once, at a process's start (the router's --vllm-tls-*, the vLLM
    ingester's health probe)."""
    context = ssl.create_default_context()
    if tls is None:
        return context
    cert, _key, ca = tls.read()  # readable and PEM, or a ValueError naming the file
    if ca is not None:
        try:
            context = ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
        except ssl.SSLError as exc:
            raise ValueError(f"TLS CA file {tls.ca} holds no usable certificate "
                             f"({exc.reason or exc})") from None
    if cert is not None:
        try:
            context.load_cert_chain(str(tls.cert), str(tls.key))
        except ssl.SSLError as exc:
            raise ValueError(f"TLS certificate {tls.cert} with key {tls.key} cannot be used "
                             f"({exc.reason or exc})") from None
    return context


def server_ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """A TLS server's context from the same files as its gRPC port (a pod's KV data port):
    its certificate and key; with `tls.ca`, clients must present a certificate it signed."""
    tls.require_identity()
    tls.read()  # readable and PEM, or a ValueError naming the file
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(tls.cert), str(tls.key))
        if tls.ca is not None:
            context.load_verify_locations(tls.ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        raise ValueError(f"TLS certificate {tls.cert} with key {tls.key} or CA {tls.ca} cannot "
                         f"be used ({exc.reason or exc})") from None
    return context


def _read_pem(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = open(path, "rb").read()  # noqa: SIM115 - read once, closed by refcount
    except OSError as e:
        raise ValueError(f"cannot read TLS file {path}: {e.strerror}") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"TLS file {path} is not PEM (no -----BEGIN line)")
    return data


def token_from(value: str | None, env: str) -> str | None:
    """A flag's token, else the environment's; '' counts as none."""
    return value or os.environ.get(env) or None


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `token`."""
    return (("authorization", f"Bearer {token}"),)


# -- command-line flags -----------------------------------------------------------------------

def add_tls_arguments(parser: argparse.ArgumentParser, prefix: str, title: str,
                      ca_help: str) -> None:
    """--{prefix}-cert, --{prefix}-key, --{prefix}-ca (dest {prefix}_cert...)."""
    group = parser.add_argument_group(title)
    group.add_argument(f"--{prefix}-cert", default=None, metavar="PEM",
                       help="certificate (chain) file")
    group.add_argument(f"--{prefix}-key", default=None, metavar="PEM",
                       help="the certificate's private key")
    group.add_argument(f"--{prefix}-ca", default=None, metavar="PEM", help=ca_help)


def add_server_tls_arguments(parser: argparse.ArgumentParser) -> None:
    add_tls_arguments(
        parser, "tls", "TLS (gRPC; plaintext without --tls-cert)",
        "CA that clients' certificates must be signed by: mutual TLS, a client without "
        "one is refused")


def add_client_tls_arguments(parser: argparse.ArgumentParser, prefix: str = "tls") -> None:
    add_tls_arguments(
        parser, prefix, "TLS to the server (plaintext without any of these)",
        "CA the server's certificate must be signed by; --*-cert/--*-key: this client's "
        "certificate, when the server asks for one (mutual TLS)")


def add_redis_arguments(parser: argparse.ArgumentParser, default_url: str | None) -> None:
    """--redis-url (else $PAGEKV_REDIS_URL) and the rediss:// files."""
    where = f"default: ${REDIS_URL_ENV}" + (f", else {default_url}" if default_url else "")
    parser.add_argument(
        "--redis-url", default=None,
        help=f"Redis index, e.g. redis://:PASSWORD@10.0.0.5:6379/0 or rediss://... for TLS; "
             f"a Redis Cluster from seed nodes: redis+cluster://:PASSWORD@h1:p1,h2:p2 "
             f"(rediss+cluster:// for TLS) ({where}); the variable keeps a password out of "
             f"`ps`")
    add_redis_tls_arguments(parser)


def add_redis_tls_arguments(parser: argparse.ArgumentParser) -> None:
    add_tls_arguments(
        parser, "redis", "Redis over TLS (with a rediss:// URL)",
        "CA the Redis server's certificate must be signed by; --redis-cert/--redis-key: "
        "this process's certificate, for a Redis with tls-auth-clients yes")


@overload
def redis_url_from(args: argparse.Namespace, default_url: str) -> str: ...


@overload
def redis_url_from(args: argparse.Namespace, default_url: None = None) -> str | None: ...


def redis_url_from(args: argparse.Namespace, default_url: str | None = None) -> str | None:
    return args.redis_url or os.environ.get(REDIS_URL_ENV) or default_url


def tls_from(args: argparse.Namespace, prefix: str = "tls") -> TlsFiles | None:
    """The TlsFiles of one flag set (`prefix` as in the flags: "tls", "pod-tls", "redis"),
    or None when none of its flags was given."""
    dest = prefix.replace("-", "_")
    cert, key, ca = (getattr(args, f"{dest}_{part}") for part in ("cert", "key", "ca"))
    if cert is None and key is None and ca is None:
        return None
    try:
        return TlsFiles(cert, key, ca)
    except ValueError as e:
        raise ValueError(f"--{prefix}-cert/--{prefix}-key: {e}") from e


def add_token_argument(parser: argparse.ArgumentParser, flag: str, env: str,
                       help_text: str) -> None:
    parser.add_argument(flag, default=None, metavar="TOKEN",
                        help=f"{help_text} (or ${env}, better: a flag shows in `ps`)")


def add_metrics_token_argument(parser: argparse.ArgumentParser) -> None:
    """--metrics-token, the same on pods, the router and the vLLM ingester."""
    add_token_argument(parser, "--metrics-token", METRICS_TOKEN_ENV,
                       "bearer token the metrics port's /metrics requires ('Authorization: "
                       "Bearer TOKEN'; Prometheus: authorization.credentials_file); default: "
                       "open to anyone who reaches the port")


def metrics_token_from(args: argparse.Namespace) -> str | None:
    return token_from(args.metrics_token, METRICS_TOKEN_ENV)

"""TLS and bearer tokens for gRPC, the same for a pod, the router and their clients.

`bind` serves a port over TLS (mutual when the server's TlsFiles has a CA) or plaintext;
`open_channel` dials one the same way. `TokenGuard` is a server interceptor: admin methods
need the admin token, health and reflection need nothing (probes and discovery), every other
method needs the API token (the admin token, and with a tenants file a tenant's token, work
there too); a role without a configured token is open. A refused call gets UNAUTHENTICATED
(no, malformed or unknown token) or PERMISSION_DENIED (the API token on an admin method),
never the handler.

With `proto/serving.py` the only contract modules that import grpc (see the layer test):
the client side (`pagekv generate`, `pagekv.Client`, the router's pod channels, health
checks) needs it as much as the servers do.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, overload

import grpc

from pagekv.proto.credentials import TlsFiles
from pagekv.proto.tenants import TenantMap

logger = logging.getLogger(__name__)

# Method prefixes that never need a token: a load balancer's health probe carries none, and
# reflection only describes the API (it serves no data).
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    tls.require_identity()
    cert, key, ca = tls.read()
    assert cert is not None and key is not None  # require_identity: a server has both
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def transport(tls: TlsFiles | None) -> str:
    """How a server's port is served, for its start-up line."""
    if tls is None:
        return "plaintext"
    return "mutual TLS: client certificates required" if tls.client_auth else "TLS"


def bind(server: grpc.Server | grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Add `address` to a grpc (or grpc.aio) server; the bound port, 0 when it failed."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


@overload
def open_channel(address: str, tls: TlsFiles | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, aio: Literal[False] = False,
                 credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel: ...


@overload
def open_channel(address: str, tls: TlsFiles | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, aio: Literal[True],
                 credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel: ...


def open_channel(address: str, tls: TlsFiles | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, aio: bool = False,
                 credentials: grpc.ChannelCredentials | None = None
                 ) -> grpc.Channel | grpc.aio.Channel:
    """A channel to `address`: TLS when `tls` (or ready `credentials`) is given.
    `aio=True`: a grpc.aio channel."""
    if credentials is None and tls is not None:
        credentials = channel_credentials(tls)
    if aio:
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, credentials, options=list(options))
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=list(options))


# -- bearer tokens ------------------------------------------------------------------------------

def _same(given: str, want: str) -> bool:
    return hmac.compare_digest(given.encode(), want.encode())  # no timing hint


class TokenGuard(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` before a call reaches its handler.

    `admin_methods`: full method names (`/pagekv.v1.KVNode/ResetPrefixCache`) that need the
    admin token. `on_refused(method, code)` is called once per refused call (a metric); the
    method is the short name of an existing method (unknown ones are UNIMPLEMENTED first), so
    a metric label stays bounded."""

    def __init__(self, api_token: str | None, admin_token: str | None,
                 admin_methods: Sequence[str] = (),
                 on_refused: Callable[[str, str], None] | None = None,
                 tenants: TenantMap | None = None) -> None:
        self.api_token = api_token
        self.admin_token = admin_token
        self.tenants = tenants  # its tokens are API tokens too (proto/tenants.py)
        self.admin_methods = frozenset(admin_methods)
        self.on_refused = on_refused
        self._warned: set[tuple[str, str]] = set()
        # Calls only peer pods make (KVNode.PullBlocks): the peer token alone opens them.
        self.peer_token: str | None = None
        self.peer_methods: frozenset[str] = frozenset()

    def serve_peers(self, peer_token: str | None, peer_methods: Sequence[str]) -> None:
        """`peer_methods` take the peer token only: never the API token (a client's) nor the
        admin token. Without a peer token they are open only on a pod with no token at all;
        a pod that guards anything else refuses them to everyone."""
        self.peer_token = peer_token
        self.peer_methods = frozenset(peer_methods)

    @property
    def active(self) -> bool:
        return bool(self.api_token or self.admin_token or self.tenants)

    def describe(self) -> str:
        admin = "token required" if self.admin_token else "OPEN to anyone who reaches the port"
        api = "token required" if self.api_token or self.tenants else "open"
        if self.tenants is not None:
            api += f" (a tenant's, {self.tenants.describe()})"
        return f"admin calls: {admin}; API calls: {api}; health and reflection: open"

    def check(self, method: str, metadata: Sequence[Any] | None
              ) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else (code, message)."""
        if method.startswith(OPEN_PREFIXES):
            return None
        if method in self.peer_methods:
            return self._check_peer(method.rsplit("/", 1)[-1], metadata)
        admin = method in self.admin_methods
        tenants = None if admin else self.tenants
        if not (self.admin_token if admin else self.api_token) and tenants is None:
            return None  # this role has no token configured: open
        accepted = [t for t in (self.admin_token, None if admin else self.api_token) if t]
        role = "an admin" if admin else "an API"
        header = next((m.value for m in (metadata or ()) if m.key == "authorization"), None)
        if header is None and tenants is not None and tenants.has_subjects:
            return None  # a client certificate may name the tenant: the handler reads it
        if header is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"{method.rsplit('/', 1)[-1]} needs {role} token: send the metadata "
                    "'authorization: Bearer <token>'")
        scheme, _, token = str(header).partition(" ")
        if scheme.lower() != "bearer" or not token:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "the authorization metadata must read 'Bearer <token>'")
        token = token.strip()
        if any([_same(token, t) for t in accepted]):
            return None
        if tenants is not None and tenants.tenant_for_token(token) is not None:
            return None
        if admin and self.api_token and _same(token, self.api_token):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"the API token does not allow {method.rsplit('/', 1)[-1]}: it needs the "
                    "admin token")
        return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"

    def _check_peer(self, short: str, metadata: Sequence[Any] | None
                    ) -> tuple[grpc.StatusCode, str] | None:
        if not self.peer_token:
            if not self.active:
                return None  # a pod open to everything (no token of any role)
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{short} is served to peer pods only, and this pod has no peer token "
                    "(--peer-api-token)")
        header = next((m.value for m in (metadata or ()) if m.key == "authorization"), None)
        scheme, _, token = str(header or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"{short} needs the peer token: send the metadata "
                    "'authorization: Bearer <token>'")
        if _same(token, self.peer_token):
            return None
        if any([_same(token, t) for t in (self.api_token, self.admin_token) if t]):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{short} is served to peer pods only: it needs the peer token")
        return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails],
                               Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # no such method: UNIMPLEMENTED, as without the guard
        method = handler_call_details.method
        refusal = self.check(method, handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        return self._refusing(handler, method, *refusal)

    def _refusing(self, handler: grpc.RpcMethodHandler[Any, Any], method: str,
                  code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler[Any, Any]:
        short = method.rsplit("/", 1)[-1]

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if self.on_refused is not None:
                self.on_refused(short, code.name)
            key = (short, code.name)
            # One warning per method and code: a client retrying in a loop must not flood
            # the log (the metric counts every refusal). Never the token itself.
            log = logger.debug if key in self._warned else logger.warning
            self._warned.add(key)
            log("refused %s from %s: %s (%s)", short, context.peer(), code.name, message)
            await context.abort(code, message)

        make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary else
                grpc.unary_stream_rpc_method_handler if handler.unary_stream else
                grpc.stream_unary_rpc_method_handler if handler.stream_unary else
                grpc.stream_stream_rpc_method_handler)
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

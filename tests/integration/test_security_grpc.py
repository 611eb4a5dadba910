"""proto.grpc_security on real gRPC servers and real certificates, in-process: TLS and
mutual TLS accept and refuse the right clients; TokenGuard's answers per method and token.
The pod and the router as processes with these flags: test_security_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagekv.proto.credentials import TlsFiles, bearer
from pagekv.proto.grpc_security import TokenGuard, bind, open_channel
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.serving import HealthServicer
from tests.integration.tls_fixtures import Certs, make_certs

pytestmark = pytest.mark.integration

ADMIN = ("/pagekv.v1.KVNode/ResetPrefixCache",)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


class _Servicer(pb_grpc.KVNodeServicer, pb_grpc.GenerationServicer):
    async def ResetPrefixCache(self, request, context):
        return pb.ResetPrefixCacheResponse(success=True, message="cleared 0 blocks")

    async def Stats(self, request, context):
        return pb.StatsResponse(pod_id="probe")

    async def GenerateStream(self, request, context):
        yield pb.GenerateChunk(request_id="r", text="hi")

    async def PullBlocks(self, request, context):
        yield pb.PullBlocksChunk(entries=[b"block"])


class _Server:
    """An aio server on the test loop: health, KVNode, Generation; TLS and tokens as given."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tls: TlsFiles | None,
                 guard: TokenGuard | None = None) -> None:
        self.loop = loop

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(interceptors=[guard] if guard else [])
            health = HealthServicer()
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            pb_grpc.add_KVNodeServicer_to_server(_Servicer(), server)
            pb_grpc.add_GenerationServicer_to_server(_Servicer(), server)
            port = bind(server, "127.0.0.1:0", tls)
            await server.start()
            return server, port

        self.server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)


@pytest.fixture
def serve(loop: asyncio.AbstractEventLoop) -> Iterator:
    made: list[_Server] = []

    def make(tls: TlsFiles | None, guard: TokenGuard | None = None) -> str:
        made.append(_Server(loop, tls, guard))
        return made[-1].address

    yield make
    for s in made:
        s.close()


def health_code(address: str, tls: TlsFiles | None) -> grpc.StatusCode:
    with open_channel(address, tls) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_accepts_its_ca_refuses_plaintext_and_strangers(serve, certs: Certs) -> None:
    address = serve(certs.server)
    assert health_code(address, TlsFiles(ca=certs.ca)) == grpc.StatusCode.OK
    # Plaintext to a TLS port, and a client that trusts another CA: no connection at all.
    assert health_code(address, None) == grpc.StatusCode.UNAVAILABLE
    assert health_code(address, TlsFiles(ca=certs.other_ca)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_its_ca(serve, certs: Certs) -> None:
    address = serve(certs.mtls_server())
    assert health_code(address, certs.client) == grpc.StatusCode.OK
    assert health_code(address, TlsFiles(ca=certs.ca)) == grpc.StatusCode.UNAVAILABLE
    assert health_code(address, certs.other_client) == grpc.StatusCode.UNAVAILABLE


def test_token_guard_per_method_and_token(serve) -> None:
    refused: list[tuple[str, str]] = []
    guard = TokenGuard("api-tok", "admin-tok", ADMIN, lambda m, c: refused.append((m, c)))
    address = serve(None, guard)
    with grpc.insecure_channel(address) as ch:
        kv, gen = pb_grpc.KVNodeStub(ch), pb_grpc.GenerationStub(ch)

        def code(call, token: str | None, raw: tuple | None = None) -> grpc.StatusCode:
            md = raw if raw is not None else (bearer(token) if token else None)
            try:
                result = call(metadata=md, timeout=5)
                if not hasattr(result, "success") and not hasattr(result, "pod_id"):
                    list(result)  # a stream: the status comes with its end
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        def reset(**kw):
            return kv.ResetPrefixCache(pb.ResetPrefixCacheRequest(), **kw)

        def stats(**kw):
            return kv.Stats(pb.StatsRequest(), **kw)

        def stream(**kw):
            return gen.GenerateStream(pb.GenerateRequest(text="x"), **kw)

        assert code(reset, None) == grpc.StatusCode.UNAUTHENTICATED
        assert code(reset, "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert code(reset, "api-tok") == grpc.StatusCode.PERMISSION_DENIED
        assert code(reset, None, (("authorization", "admin-tok"),)) == \
            grpc.StatusCode.UNAUTHENTICATED  # no "Bearer " scheme
        assert code(reset, "admin-tok") == grpc.StatusCode.OK
        assert code(stats, None) == grpc.StatusCode.UNAUTHENTICATED
        assert code(stats, "api-tok") == grpc.StatusCode.OK
        assert code(stats, "admin-tok") == grpc.StatusCode.OK  # admin covers the API
        assert code(stream, None) == grpc.StatusCode.UNAUTHENTICATED
        assert code(stream, "api-tok") == grpc.StatusCode.OK
    assert health_code(address, None) == grpc.StatusCode.OK  # probes carry no token
    assert refused == [("ResetPrefixCache", "UNAUTHENTICATED")] * 2 + [
        ("ResetPrefixCache", "PERMISSION_DENIED"), ("ResetPrefixCache", "UNAUTHENTICATED"),
        ("Stats", "UNAUTHENTICATED"), ("GenerateStream", "UNAUTHENTICATED")]


def test_a_role_without_a_token_stays_open(serve) -> None:
    address = serve(None, TokenGuard(None, "admin-tok", ADMIN))
    with grpc.insecure_channel(address) as ch:
        kv = pb_grpc.KVNodeStub(ch)
        assert kv.Stats(pb.StatsRequest(), timeout=5).pod_id == "probe"
        with pytest.raises(grpc.RpcError) as exc:
            kv.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in exc.value.details()


PEER = ("/pagekv.v1.KVNode/PullBlocks",)


def pull_code(address: str, token: str | None) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        try:
            list(pb_grpc.KVNodeStub(ch).PullBlocks(
                pb.PullBlocksRequest(), metadata=bearer(token) if token else None, timeout=5))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_peer_methods_take_the_peer_token_only(serve) -> None:
    """PullBlocks hands out KV blocks: a client's API token (or the admin's) is refused
    there, PERMISSION_DENIED; only the fleet's peer token opens it."""
    guard = TokenGuard("api-tok", "admin-tok", ADMIN)
    guard.serve_peers("peer-tok", PEER)
    address = serve(None, guard)
    assert pull_code(address, "peer-tok") == grpc.StatusCode.OK
    assert pull_code(address, "api-tok") == grpc.StatusCode.PERMISSION_DENIED
    assert pull_code(address, "admin-tok") == grpc.StatusCode.PERMISSION_DENIED
    assert pull_code(address, None) == grpc.StatusCode.UNAUTHENTICATED
    assert pull_code(address, "wrong") == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as ch:  # and the peer token is no API token
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.KVNodeStub(ch).Stats(pb.StatsRequest(), metadata=bearer("peer-tok"),
                                         timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_guarded_pod_without_a_peer_token_serves_no_peer(serve) -> None:
    guard = TokenGuard("api-tok", None, ADMIN)
    guard.serve_peers(None, PEER)
    address = serve(None, guard)
    for token in ("api-tok", None, "anything"):
        assert pull_code(address, token) == grpc.StatusCode.PERMISSION_DENIED
    open_guard = TokenGuard(None, None, ADMIN)  # a pod with no token at all stays open
    open_guard.serve_peers(None, PEER)
    assert pull_code(serve(None, open_guard), None) == grpc.StatusCode.OK

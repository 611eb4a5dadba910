"""The router's HTTP client to vLLM pods over HTTPS, against a real TLS server (python's ssl,
certificates made by tls_fixtures.py) that requires a client certificate signed by the test
CA, as vLLM serves with `--ssl-ca-certs CA --ssl-cert-reqs 2`:

- the client (router/http_client.py, through the router's vLLM stub) with the CA and the
  router's certificate streams the answer; without a certificate, with one of another CA, or
  without the CA it fails as UNAVAILABLE (the router tries the next pod), saying why;
- a whole router (`vllm_tls` in its config: --vllm-tls-ca/-cert/-key) reaches a vLLM pod
  registered with an https:// address;
- a bad file is one line at the router's start, naming it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagekv.deploy.redis_server import RedisProcess, free_port
from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.credentials import TlsFiles, client_ssl_context
from pagekv.proto.index.schema import POD_KIND_VLLM
from pagekv.proto.index.writes import kind_fields
from pagekv.router.http_client import ConnectFailed, HttpOrigin
from pagekv.router.openai_forward import VllmStub
from tests.integration.router_fixtures import SCHEMA, tokens_req
from tests.integration.tls_fixtures import Certs, make_certs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class MutualTlsOpenAI:
    """A vLLM-shaped /v1/completions stream over HTTPS that only clients with a certificate
    of `ca` may reach; it records each client certificate's common name."""

    def __init__(self, certs: Certs) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(certs.server.cert), str(certs.server.key))
        context.load_verify_locations(cafile=certs.ca)
        context.verify_mode = ssl.CERT_REQUIRED
        self.context = context
        self.clients: list[str] = []
        self.address = ""

    async def start(self) -> MutualTlsOpenAI:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0,
                                                 ssl=self.context)
        self.address = f"https://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peercert") or {}
        self.clients.append(next((v for rdn in peer.get("subject", ()) for k, v in rdn
                                  if k == "commonName"), ""))
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                length = next(int(line.split(":", 1)[1]) for line in head.split("\r\n")
                              if line.lower().startswith("content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for event in self._events():
                    writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        writer.close()

    @staticmethod
    def _events() -> list[dict[str, Any]]:
        def event(text: str, finish: str | None, usage: Any = None) -> dict[str, Any]:
            return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish, "stop_reason": None}],
                    "usage": usage}
        return [event("Paris", None), event(".", "stop"),
                {**event("", None), "choices": [],
                 "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}}]


async def answer(stub: VllmStub) -> str:
    chunks = [c async for c in stub.GenerateStream(tokens_req(list(range(20))), timeout=10)]
    return "".join(c.text for c in chunks)


async def refusal(stub: VllmStub) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await answer(stub)
    return info.value.code(), info.value.details()


def test_the_right_ca_and_client_certificate_pass_and_anything_less_is_refused(
        certs: Certs) -> None:
    async def go() -> None:
        server = await MutualTlsOpenAI(certs).start()
        try:
            stub = VllmStub(server.address, ssl_context=client_ssl_context(certs.client))
            assert await answer(stub) == "Paris."
            assert await answer(stub) == "Paris."  # the TLS connection is kept alive
            await stub.close()
            assert server.clients == ["client"]  # one connection, the router's certificate

            # The CA alone: the server asks for a certificate and gets none.
            bare = VllmStub(server.address, ssl_context=client_ssl_context(TlsFiles(
                ca=certs.ca)))
            code, details = await refusal(bare)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert details.startswith(f"vLLM pod at {server.address}: ")
            assert "requires a client certificate" in details, details
            # A certificate the server's CA did not sign.
            stranger = VllmStub(server.address,
                                ssl_context=client_ssl_context(certs.other_client))
            code, details = await refusal(stranger)
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert "requires a client certificate" in details, details
            # No CA: the system's roots do not know the test CA; the server is not trusted.
            untrusted = VllmStub(server.address, ssl_context=client_ssl_context(TlsFiles(
                cert=certs.client.cert, key=certs.client.key)))
            code, details = await refusal(untrusted)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert "CERTIFICATE_VERIFY_FAILED" in details, details
            # And the HTTP client itself says the same, as ConnectFailed.
            origin = HttpOrigin(server.address)
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await origin.request("POST", "/v1/completions", [], b"{}", None)
        finally:
            await server.stop()

    asyncio.run(go())


def test_a_router_with_vllm_tls_reaches_an_https_vllm_pod(certs: Certs, make_router: Any,
                                                           redis_server: RedisProcess,
                                                           loop: asyncio.AbstractEventLoop
                                                           ) -> None:
    server = asyncio.run_coroutine_threadsafe(MutualTlsOpenAI(certs).start(), loop).result(10)
    publisher = IndexPublisher(redis_server.url, SCHEMA, "vllm-0", server.address,
                               SCHEMA.hash_config(), load_fn=dict, full_state_fn=dict,
                               registration=kind_fields(POD_KIND_VLLM, server.address))
    try:
        assert publisher.start()
        router = make_router(redis_server.url, vllm_tls=certs.client)
        router.wait_pods(1)
        reply = router.stub.Generate(tokens_req(list(range(20))), timeout=20)
        assert reply.served_by == "vllm-0"
        assert reply.completions[0].text == "Paris."
        assert server.clients == ["client"]
    finally:
        publisher.stop()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)


def router_start_error(*flags: str) -> tuple[int, str]:
    """Start `pagekv router` with these flags; its exit code and its last stderr line."""
    done = subprocess.run([sys.executable, "-m", "pagekv", "router", "--port", "0",
                           "--metrics-port", "0", "--redis-url",
                           f"redis://127.0.0.1:{free_port()}/0", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.returncode, lines[-1] if lines else ""


def test_a_bad_vllm_tls_file_stops_the_router_at_start_in_one_line(
        certs: Certs, tmp_path: Path) -> None:
    missing = tmp_path / "missing-ca.pem"
    code, line = router_start_error("--vllm-tls-ca", str(missing))
    assert code == 2
    assert line.endswith(f"router cannot start: TLS to vLLM pods: cannot read TLS file "
                         f"{missing}: No such file or directory"), line
    # A private key where the CA should be: PEM, but no certificate in it.
    code, line = router_start_error("--vllm-tls-ca", str(certs.client.key))
    assert code == 2 and f"TLS CA file {certs.client.key} holds no usable certificate" in line
    # A key that is not the certificate's.
    code, line = router_start_error("--vllm-tls-cert", str(certs.client.cert),
                                    "--vllm-tls-key", str(certs.server.key))
    assert code == 2, line
    assert (f"TLS certificate {certs.client.cert} with key {certs.server.key} cannot be "
            "used") in line, line
    # A certificate without its key is a configuration error, named by the flags.
    code, line = router_start_error("--vllm-tls-cert", str(certs.client.cert))
    assert code == 2 and "--vllm-tls-cert/--vllm-tls-key" in line, line

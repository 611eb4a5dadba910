"""The data transports a pod pulls and serves KV with (`--kv-transports`), built at start.

"tcp" is PageKV's own (kvnode/pod/kv_data_tcp.py), always available. "mooncake" is
Mooncake's transfer engine (kvnode/pod/kv_data_mooncake.py), imported only when asked for;
when its package or its system libraries are missing the pod says why once and goes on with
the others (a pair then uses the next transport both have). "grpc" needs nothing: the
PullBlocks stream itself, which every pod serves to a puller that offers no transport.
"""

from __future__ import annotations

import logging

from pagekv.kvnode.pod.kv_data_tcp import TcpDataClient, TcpDataServer
from pagekv.kvnode.pod.kv_pull_client import DataClient
from pagekv.kvnode.pod.kv_transfer import DataServer, TransferConfig
from pagekv.proto.credentials import TlsFiles, client_ssl_context, server_ssl_context

logger = logging.getLogger(__name__)


def mooncake_unavailable() -> str | None:
    """Why Mooncake's transport cannot run here, or None."""
    try:
        from pagekv.kvnode.pod import kv_data_mooncake
    except ImportError as exc:
        return f"kvnode.pod.kv_data_mooncake: {exc}"
    return kv_data_mooncake.unavailable_reason()


def data_servers(config: TransferConfig, host: str, tls: TlsFiles | None) -> list[DataServer]:
    """The holder ends, listening (on `host`, the pod's gRPC host)."""
    servers: list[DataServer] = []
    for name in config.transports:
        if name == "tcp":
            try:
                servers.append(TcpDataServer(host, config.data_port,
                                             server_ssl_context(tls) if tls is not None
                                             else None))
            except OSError as exc:
                for server in servers:
                    server.close()
                raise RuntimeError(f"cannot listen on the KV data port {host}:"
                                   f"{config.data_port} (--kv-data-port): {exc.strerror or exc}"
                                   ) from None
        elif name == "mooncake" and _mooncake_usable(tls):
            from pagekv.kvnode.pod.kv_data_mooncake import MooncakeDataServer
            try:  # a slab per pull served at once, each as big as a call may send
                servers.append(MooncakeDataServer(host, slabs=config.serve_max_concurrent,
                                                  slab_bytes=config.serve_max_bytes))
            except RuntimeError as exc:  # its engine would not start or register memory
                logger.warning("KV transport mooncake: not served (%s)", exc)
    return servers


def data_clients(config: TransferConfig, tls: TlsFiles | None) -> dict[str, DataClient]:
    """The puller ends, in the pod's preference order (what a pull offers)."""
    clients: dict[str, DataClient] = {}
    for name in config.transports:
        if name == "tcp":
            clients[name] = TcpDataClient(client_ssl_context(tls) if tls is not None else None)
        elif name == "mooncake" and _mooncake_usable(tls):
            from pagekv.kvnode.pod.kv_data_mooncake import MooncakeDataClient
            clients[name] = MooncakeDataClient()
    return clients


_said: set[str] = set()


def _mooncake_usable(tls: TlsFiles | None) -> bool:
    why = ("its TCP transport has no TLS and this pod's connections are TLS"
           if tls is not None else mooncake_unavailable())
    if why is not None and why not in _said:
        _said.add(why)
        logger.warning("KV transport mooncake: not used (%s)", why)
    return why is None


"""The pod's side of pulling KV from a peer: the control on `KVNode.PullBlocks` (gRPC), the
bytes on a data transport.

`PeerFetcher` is the fetch kvnode.engine.peer_pull calls from its worker threads: it asks the
peer for a chain's blocks, offering the data transports this pod receives on (its preference
first: `--kv-transports`). The peer answers with a ticket naming the one it picked (kvnode/
pod/kv_data_tcp.py: framed TCP; kv_data_mooncake.py: Mooncake's transfer engine) and the
transport puts the blocks into the pull's BlockSink; a peer without any of them (or a pod
pulling with "grpc" only) sends the entries in the stream itself. Either way the sink checks
every block. gRPC failures become `PullFailed` with the reason the metrics count. One channel
per peer address, kept (a bounded number): a pull does not pay a TCP/TLS handshake for its
control.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Protocol

import grpc

from pagekv.kvnode.engine.peer_pull import (
    CONFIG_MISMATCH,
    DEADLINE,
    ERROR,
    PEER_BUSY,
    PEER_UNAVAILABLE,
    BlockSink,
    KvSource,
    PullAsk,
    PullFailed,
    PullHandle,
)
from pagekv.proto.credentials import TlsFiles
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.tiers.peer_entries import KvLayout

MAX_CHANNELS = 64
GRPC = "grpc"  # no data transport: the entries in the PullBlocks stream

_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: DEADLINE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PEER_BUSY,
    grpc.StatusCode.FAILED_PRECONDITION: CONFIG_MISMATCH,  # hash configuration or KV layout
    grpc.StatusCode.UNAVAILABLE: PEER_UNAVAILABLE,
    grpc.StatusCode.CANCELLED: PEER_UNAVAILABLE,  # the peer went away mid-stream
    grpc.StatusCode.UNKNOWN: PEER_UNAVAILABLE,
    # The peer token missing or not the peer's: the fleet's settings differ.
    grpc.StatusCode.UNAUTHENTICATED: CONFIG_MISMATCH,
    grpc.StatusCode.PERMISSION_DENIED: CONFIG_MISMATCH,
}


class DataClient(Protocol):
    """A data transport's puller end: the ticket's blocks into the sink, in order; raises
    PullFailed or EntryRejected. `control` yields the rest of the PullBlocks stream (the
    holder's `ready_blocks`), for a transport that reads only what is ready."""

    name: str

    def receive(self, host: str, ticket: pb.TransferTicket, ask: PullAsk, sink: BlockSink,
                handle: PullHandle, control: Iterator[pb.PullBlocksChunk]) -> None: ...


def host_of(address: str) -> str:
    """The host part of host:port (an IPv6 literal in brackets without them)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class PeerFetcher:
    def __init__(self, hash_config: pb.HashConfig, layout: KvLayout,
                 tls: TlsFiles | None = None, token: str | None = None,
                 clients: Mapping[str, DataClient] | None = None) -> None:
        self.hash_config = hash_config
        self.layout = layout
        self.clients = dict(clients or {})  # preference order: the request offers them so
        self.tls = tls
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # A message holds up to ~4 MiB of blocks, at least one block.
        self.max_message = max(64 << 20, 4 * layout.block_bytes)
        self._channels: OrderedDict[str, tuple[grpc.Channel, pb_grpc.KVNodeStub]] = OrderedDict()
        self._lock = threading.Lock()

    def _stub(self, address: str) -> pb_grpc.KVNodeStub:
        with self._lock:
            entry = self._channels.get(address)
            if entry is None:
                channel = open_channel(address, self.tls, [
                    ("grpc.max_receive_message_length", self.max_message)])
                entry = self._channels[address] = (channel, pb_grpc.KVNodeStub(channel))
                while len(self._channels) > MAX_CHANNELS:
                    self._channels.popitem(last=False)[1][0].close()
            self._channels.move_to_end(address)
            return entry[1]

    def __call__(self, source: KvSource, ask: PullAsk, handle: PullHandle, sink: BlockSink
                 ) -> None:
        timeout = ask.deadline - time.monotonic()
        if timeout <= 0:
            raise PullFailed(DEADLINE, "no time left before the pull's deadline")
        request = pb.PullBlocksRequest(
            block_hashes=ask.hashes, parent_hash=ask.parent or b"",
            hash_config=self.hash_config, kv_layout=self.layout.json,
            request_id=ask.request_id, chain_token_ids=ask.tokens,
            cache_salt=ask.cache_salt or "", lora_id=ask.lora_id or "",
            transports=list(self.clients), handover_id=ask.handover_id)
        call = self._stub(source.address).PullBlocks(request, timeout=timeout,
                                                     metadata=self.metadata)
        handle.on_cancel(call.cancel)
        try:
            chunks = iter(call)
            for chunk in chunks:
                sink.answered = sink.answered or time.monotonic()
                if chunk.HasField("ticket"):
                    self._receive(source, chunk.ticket, ask, sink, handle, chunks)
                    return
                sink.transport = GRPC
                for entry in chunk.entries:
                    sink.take_entry(entry)
        except grpc.RpcError as exc:
            if handle.cancelled:
                return
            code = exc.code()
            raise PullFailed(_REASONS.get(code, ERROR),
                             f"{source.pod_id} at {source.address}: {code.name}: "
                             f"{exc.details()}") from None
        finally:
            call.cancel()  # ended early (deadline, a bad entry, the data done): the call too

    def _receive(self, source: KvSource, ticket: pb.TransferTicket, ask: PullAsk,
                 sink: BlockSink, handle: PullHandle,
                 control: Iterator[pb.PullBlocksChunk]) -> None:
        client = self.clients.get(ticket.transport)
        if client is None:  # a peer must pick one of those offered
            raise PullFailed(CONFIG_MISMATCH, f"{source.pod_id} answered on transport "
                                              f"{ticket.transport[:32]!r}, not offered")
        sink.transport = client.name
        client.receive(host_of(source.address), ticket, ask, sink, handle, control)

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()

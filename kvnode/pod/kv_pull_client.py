"""The pod's side of pulling KV from a peer: `KVNode.PullBlocks` over gRPC.

`PeerFetcher` is the transport kvnode.engine.peer_pull calls from its worker threads: it
asks the peer for a chain's blocks and yields the entries of each message (the puller checks
them). gRPC failures become `PullFailed` with the reason the metrics count. One channel per
peer address, kept (a bounded number): a pull does not pay a TCP/TLS handshake.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import grpc

from pagekv.kvnode.engine.peer_pull import (
    CONFIG_MISMATCH,
    DEADLINE,
    ERROR,
    PEER_BUSY,
    PEER_UNAVAILABLE,
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


class PeerFetcher:
    def __init__(self, hash_config: pb.HashConfig, layout: KvLayout,
                 tls: TlsFiles | None = None, token: str | None = None) -> None:
        self.hash_config = hash_config
        self.layout = layout
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

    def __call__(self, source: KvSource, ask: PullAsk, handle: PullHandle
                 ) -> Iterator[list[bytes]]:
        timeout = ask.deadline - time.monotonic()
        if timeout <= 0:
            raise PullFailed(DEADLINE, "no time left before the pull's deadline")
        request = pb.PullBlocksRequest(
            block_hashes=ask.hashes, parent_hash=ask.parent or b"",
            hash_config=self.hash_config, kv_layout=self.layout.json,
            request_id=ask.request_id, chain_token_ids=ask.tokens,
            cache_salt=ask.cache_salt or "", lora_id=ask.lora_id or "")
        call = self._stub(source.address).PullBlocks(request, timeout=timeout,
                                                     metadata=self.metadata)
        handle.on_cancel(call.cancel)
        try:
            for chunk in call:
                yield list(chunk.entries)
        except grpc.RpcError as exc:
            if handle.cancelled:
                return
            code = exc.code()
            raise PullFailed(_REASONS.get(code, ERROR),
                             f"{source.pod_id} at {source.address}: {code.name}: "
                             f"{exc.details()}") from None
        finally:
            call.cancel()  # a generator closed early (deadline, bad entry) ends the call too

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()

"""A KV peer that misbehaves on purpose, for tests/integration/test_kv_pull_faults.py.

It serves KVNode.PullBlocks by relaying the same request to a real pod (--upstream) and
forwarding its entries one per message, except as --mode says:

  relay          every entry, intact (shows the relay itself is faithful)
  stall-after N  the first N entries, then "SENT N" on stdout and nothing more, ever
                 (the test kills this process there)
  corrupt K      one payload byte of entry K (0-based) flipped, every entry sent
  delay S        S seconds before the first message

Prints "READY <port>" once it listens on 127.0.0.1:<port>.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent import futures

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

MAX_MESSAGE = 64 << 20


def say(line: str) -> None:
    print(line, flush=True)


class FakePeer(pb_grpc.KVNodeServicer):
    def __init__(self, upstream: str, mode: str, arg: float) -> None:
        channel = grpc.insecure_channel(upstream, [
            ("grpc.max_receive_message_length", MAX_MESSAGE)])
        self.stub = pb_grpc.KVNodeStub(channel)
        self.mode = mode
        self.arg = arg

    def _wait(self, context, seconds: float) -> None:
        # In steps, so a puller that gave up does not keep this handler's thread.
        end = time.monotonic() + seconds
        while context.is_active() and time.monotonic() < end:
            time.sleep(0.02)

    def PullBlocks(self, request, context):
        if self.mode == "delay":
            self._wait(context, self.arg)
            if not context.is_active():
                return
        del request.transports[:]  # the entries in the stream, where this relay alters them
        upstream = self.stub.PullBlocks(request, timeout=30)
        sent = 0
        for chunk in upstream:
            for entry in chunk.entries:
                if self.mode == "stall-after" and sent == int(self.arg):
                    upstream.cancel()
                    say(f"SENT {sent}")
                    threading.Event().wait()  # never answers again
                if self.mode == "corrupt" and sent == int(self.arg):
                    damaged = bytearray(entry)
                    damaged[-1] ^= 0xFF  # the payload ends the entry
                    entry = bytes(damaged)
                yield pb.PullBlocksChunk(entries=[entry])
                sent += 1
        say(f"DONE {sent}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--mode", choices=["relay", "stall-after", "corrupt", "delay"],
                   default="relay")
    p.add_argument("--arg", type=float, default=0)
    args = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(8), options=[
        ("grpc.max_send_message_length", MAX_MESSAGE)])
    pb_grpc.add_KVNodeServicer_to_server(FakePeer(args.upstream, args.mode, args.arg), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    say(f"READY {port}")
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())

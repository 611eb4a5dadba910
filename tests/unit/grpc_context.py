"""A stand-in for grpc.aio's servicer context, for calling a servicer's handler in a test."""

from __future__ import annotations

import grpc


class Aborted(Exception):
    """What grpc.aio's context.abort raises (AbortError), with the status kept."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class FakeContext:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

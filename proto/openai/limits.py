"""The HTTP front end's limits (pods and routers alike) and their flags.

Defaults follow the field's servers: nginx reads a request's headers into at most 4 x 8 KiB
buffers (32 KiB) and cuts a client that has not sent them within client_header_timeout, or
stalls between two body reads longer than client_body_timeout (60 s each); Apache takes at
most 100 header fields; h11 and Node stop at 16 KiB of headers. 32 KiB leaves room for long
tokens and proxies' headers while bounding what a connection can make the server hold.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

REQUEST_TIMEOUT_HEADER = "x-pagekv-timeout-s"  # a client's own, shorter, deadline


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_header_bytes: int = 32 << 10   # request line and headers together
    max_headers: int = 100
    header_timeout_s: float = 30.0     # from the connection (or the request's first byte)
    body_timeout_s: float = 60.0       # the longest pause between two pieces of a body
    request_timeout_s: float = 600.0   # a generation's deadline; 0: none

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--http-{name.replace('_', '-')} must be at least 1")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--http-{name.replace('_', '-')} must be above 0")
        if not self.request_timeout_s >= 0:
            raise ValueError("--http-request-timeout-s must be 0 (none) or more")

    def deadline_s(self, asked: str | None) -> float | None:
        """A request's deadline in seconds: the server's, or the client's when shorter (a
        header that is no positive number is ignored); None: no deadline."""
        server = self.request_timeout_s or None
        try:
            own = float(asked) if asked is not None else None
        except ValueError:
            own = None
        if own is None or not 0 < own < float("inf"):
            return server
        return own if server is None else min(own, server)

    def describe(self) -> str:
        return (f"HTTP headers <= {self.max_header_bytes} bytes / {self.max_headers} fields "
                f"within {self.header_timeout_s:g} s, body pauses <= {self.body_timeout_s:g} s, "
                f"request deadline "
                f"{f'{self.request_timeout_s:g} s' if self.request_timeout_s else 'none'}")


def add_http_limit_arguments(parser: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    g = parser.add_argument_group("HTTP API limits (README \"OpenAI API\")")
    g.add_argument("--http-max-header-bytes", type=int, default=d.max_header_bytes,
                   help="request line and headers, in bytes; more: 431 and the connection "
                        "closed, before more is read")
    g.add_argument("--http-max-headers", type=int, default=d.max_headers,
                   help="header fields per request; more: 431")
    g.add_argument("--http-header-timeout-s", type=float, default=d.header_timeout_s,
                   help="a client that has not sent its whole headers by then is cut (408)")
    g.add_argument("--http-body-timeout-s", type=float, default=d.body_timeout_s,
                   help="a body that pauses longer than this is refused (408)")
    g.add_argument("--http-request-timeout-s", type=float, default=d.request_timeout_s,
                   help="a completion's deadline (504 deadline_exceeded, its engine request "
                        f"aborted); a client may shorten it with {REQUEST_TIMEOUT_HEADER}; "
                        "0: none")


def http_limits_from(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(max_header_bytes=args.http_max_header_bytes,
                      max_headers=args.http_max_headers,
                      header_timeout_s=args.http_header_timeout_s,
                      body_timeout_s=args.http_body_timeout_s,
                      request_timeout_s=args.http_request_timeout_s)

"""Server-side pieces the pod and the router share: gRPC health with `List`, and the metrics page.

The only module of the contract that touches server machinery, and only servers import it
(the layer test allows it here and nowhere else in `proto`): the router may not import pod
code, so what both servers need has to live below both.
"""

from __future__ import annotations

import logging
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry, make_wsgi_app

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 with `List` answered (grpcio's servicer leaves it UNIMPLEMENTED)."""

    async def List(self, request: health_pb2.HealthListRequest, context
                   ) -> health_pb2.HealthListResponse:
        statuses = {name: health_pb2.HealthCheckResponse(status=status)
                    for name, status in dict(self._server_status).items()}
        return health_pb2.HealthListResponse(statuses=statuses)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per scrape is noise
        pass


def _metrics_only(app):
    """The exposition on /metrics; every other path is a 404 that says where to look."""
    def wrapped(environ, start_response):
        if environ.get("PATH_INFO", "") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: metrics are served on /metrics\n"]
        return app(environ, start_response)
    return wrapped


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread; returns the server
    (its `server_port` is the bound port, for port 0). Call `shutdown()` to stop it."""
    server = make_server(host, port, _metrics_only(make_wsgi_app(registry)),
                         server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="pagekv-metrics", daemon=True).start()
    return server

"""Is the vLLM pod behind an ingester still serving? Its KV events cannot say: an idle pod
sends none, and a dead one just stops. So the ingester asks its OpenAI server's /health
(200 while it serves) every `interval_s`; after `failures` answers in a row that are not
200, the pod is down, and it is up again at the first 200. The ingester keeps a pod that is
down out of the index (no lease), so the router never counts on a dead pod's blocks.

With `load_path` ("/metrics"), each check that finds the pod serving also reads its load
from that page on the same connection (kvnode/index/vllm_load.py), for the ingester's lease;
a pod without the page (404) is not asked again.

An `https://` address is checked over TLS with the context the ingester builds once from its
--vllm-tls-* files (the CA of the pod's certificate, and a client certificate for a vLLM
started with --ssl-cert-reqs 2), as the router reaches the same pod.

One HTTP/1.1 connection is kept open between checks (a new connection per check costs
several times the CPU, every 2 s for as long as the ingester runs); any failure closes it,
and the next check opens a new one.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from pagekv.kvnode.index.vllm_load import parse_vllm_load

logger = logging.getLogger(__name__)


def health_url(openai_address: str) -> str:
    """The /health URL of an OpenAI server registered as `host:port`, `http://host:port` or
    `https://host:port` (the forms the router reaches)."""
    base = openai_address.rstrip("/")
    return f"{base}/health" if "://" in base else f"http://{base}/health"


class HealthProbe:
    def __init__(self, url: str, on_down: Callable[[str], None], on_up: Callable[[], None],
                 interval_s: float = 2.0, failures: int = 3,
                 load_path: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`ssl_context`: for an https:// URL (default: the system's CAs)."""
        if interval_s <= 0 or failures <= 0:
            raise ValueError("the health probe needs interval_s > 0 and failures > 0")
        self.url = url
        self.on_down = on_down
        self.on_up = on_up
        self.interval_s = interval_s
        self.failures = failures
        self.up = True  # until shown otherwise: the pod's events may well be flowing
        self.checks = 0
        self._failed = 0
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the health URL must be http(s)://host:port/path, got {url!r}")
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._tls = ssl_context or ssl.create_default_context()
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._path = parts.path or "/"
        self._conn: http.client.HTTPConnection | None = None
        self.load_path = load_path
        self.load: dict[str, float] = {}  # the last load read (replaced whole, never mutated)
        self.load_at = 0.0  # monotonic time it was read; 0: never
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # (never started: nothing to join)
            self._thread.join(self.interval_s + 5)
        self._close()

    def check(self) -> str | None:
        """None if the pod answers 200, else why not."""
        try:
            status, _ = self._get(self._path)
            if status != 200:
                return f"HTTP {status}"
            if self.load_path:
                self._read_load()
            return None
        except (OSError, http.client.HTTPException) as exc:  # refused, timed out, cut, TLS
            self._close()
            return f"{type(exc).__name__}: {exc}"

    def _get(self, path: str) -> tuple[int, bytes]:
        if self._conn is None:
            timeout = min(self.interval_s, 5.0)
            self._conn = (http.client.HTTPSConnection(self._host, self._port, timeout=timeout,
                                                      context=self._tls)
                          if self._tls is not None else
                          http.client.HTTPConnection(self._host, self._port, timeout=timeout))
        self._conn.request("GET", path)
        resp = self._conn.getresponse()
        body = resp.read()
        if resp.will_close:
            self._close()
        return resp.status, body

    def _read_load(self) -> None:
        assert self.load_path is not None
        status, body = self._get(self.load_path)
        if status == 404:
            logger.info("%s%s: no such page (HTTP 404); the pod's load is not published",
                        self.url.removesuffix(self._path), self.load_path)
            self.load_path = None
            return
        if status == 200:
            self.load = parse_vllm_load(body.decode("utf-8", "replace"))
            self.load_at = time.monotonic()

    def fresh_load(self) -> dict[str, float]:
        """The load read within the last three checks, else nothing (it would mislead)."""
        if self.up and self.load_at and time.monotonic() - self.load_at <= 3 * self.interval_s:
            return self.load
        return {}

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            why = self.check()
            self.checks += 1
            if why is None:
                self._failed = 0
                if not self.up:
                    self.up = True
                    self.on_up()
                continue
            self._failed += 1
            if self.up and self._failed >= self.failures:
                self.up = False
                self.on_down(f"{self.url}: {why}, {self._failed} times in a row")

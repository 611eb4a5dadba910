"""Is the vLLM pod behind an ingester still serving? Its KV events cannot say: an idle pod
sends none, and a dead one just stops. So the ingester asks its OpenAI server's /health
(200 while it serves) every `interval_s`; after `failures` answers in a row that are not
200, the pod is down, and it is up again at the first 200. The ingester keeps a pod that is
down out of the index (no lease), so the router never counts on a dead pod's blocks.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

logger = logging.getLogger(__name__)


def health_url(openai_address: str) -> str:
    return f"http://{openai_address}/health"


class HealthProbe:
    def __init__(self, url: str, on_down: Callable[[str], None], on_up: Callable[[], None],
                 interval_s: float = 2.0, failures: int = 3) -> None:
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.interval_s + 5)

    def check(self) -> str | None:
        """None if the pod answers 200, else why not."""
        try:
            with urllib.request.urlopen(self.url, timeout=min(self.interval_s, 5.0)) as resp:
                return None if resp.status == 200 else f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # refused, timed out, unresolvable
            return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"

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

"""The Ray actors of `pagekv ray-up`: a pod (`PodActor`) and the router (`RouterActor`).

Each runs its server on an asyncio loop in a thread of its own (`proto.loop_thread`), bound to
its node's IP, and starts serving in its constructor, so an actor Ray restarts comes back
serving (a pod with a new epoch, which makes the router drop the dead instance's claims).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import ray

from pagekv.proto.loop_thread import LoopThread

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # engine build + weights; a big checkpoint on a cold node is slow
BIND_ATTEMPTS = 3


def pod_name(index: int) -> str:
    return f"pagekv-pod-{index}"


# -- inside the actors ---------------------------------------------------------------------

def _actor_logging() -> None:
    # Ray forwards a worker's stderr to the driver; without a handler our INFO lines vanish.
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _is_bind_error(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno == errno.EADDRINUSE
    return "bind" in str(exc)  # PodServer: RuntimeError("cannot bind host:port")


def _bind_host(host: str | None) -> str:
    return host or ray.util.get_node_ip_address()


class PodActor:
    """One pod. The constructor starts it, so a restarted actor comes back serving."""

    def __init__(self, pod_id: str, redis_url: str, engine_kwargs: dict[str, Any],
                 host: str | None = None, serve_metrics: bool = True,
                 lease_ttl_s: float = 3.0, max_queue: int = 1024) -> None:
        _actor_logging()
        # Imported here: the driver (and the router actor) never load torch.
        from pagekv.deploy.redis_server import free_port
        from pagekv.kvnode.engine.config import EngineArgs
        from pagekv.kvnode.pod.server import PodServer
        from pagekv.proto.heap import freeze_startup_heap

        self.pod_id = pod_id
        self.host = _bind_host(host)
        self._loop = LoopThread(f"pod-{pod_id}")
        for attempt in range(BIND_ATTEMPTS):
            # A port that was free a moment ago can be taken by another process on the node
            # before we bind it: pick new ones and start again.
            port = free_port(self.host)
            self.metrics_port = free_port(self.host) if serve_metrics else None
            self.server = PodServer(
                EngineArgs(**engine_kwargs), pod_id, host=self.host, port=port,
                metrics_port=self.metrics_port, redis_url=redis_url,
                advertise_address=f"{self.host}:{port}", max_queue=max_queue,
                lease_ttl_s=lease_ttl_s,
            )
            try:
                self._loop.run(self.server.start(), START_TIMEOUT_S)
                break
            except (OSError, RuntimeError) as exc:
                if attempt + 1 == BIND_ATTEMPTS or not _is_bind_error(exc):
                    raise
                logger.warning("pod %s: %s; retrying on other ports", pod_id, exc)
                self._loop.run(self.server.stop(0.0), 60.0)
        freeze_startup_heap(logger)
        logger.info("pod actor %s (pid %d) serving on %s, epoch %s", pod_id, os.getpid(),
                    self.address(), self.epoch())

    def address(self) -> str:
        return self.server.address

    def metrics_address(self) -> str | None:
        return f"{self.host}:{self.metrics_port}" if self.metrics_port else None

    def pid(self) -> int:
        return os.getpid()

    def epoch(self) -> str:
        pub = self.server.publisher
        return pub.epoch if pub is not None else ""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Graceful: health NOT_SERVING, drain, leave the index. Ray still holds the actor;
        the caller kills it (with no_restart=True) afterwards."""
        self._loop.run(self.server.stop(drain_timeout_s), drain_timeout_s + 30.0)
        self._loop.stop()


class RouterActor:
    """The prefix-aware router over the same Redis index."""

    def __init__(self, config_kwargs: dict[str, Any], host: str | None = None,
                 port: int = 50050, metrics_port: int = 0,
                 advertise_host: str | None = None, http_port: int | None = None) -> None:
        _actor_logging()
        from pagekv.proto.heap import freeze_startup_heap
        from pagekv.router.config import RouterConfig
        from pagekv.router.scoring import CostModel
        from pagekv.router.server import RouterServer

        kwargs = dict(config_kwargs)
        if isinstance(kwargs.get("costs"), dict):
            kwargs["costs"] = CostModel(**kwargs["costs"])
        self.host = _bind_host(host)
        # Bound to 0.0.0.0 the router is reachable on every interface; it advertises the
        # node's IP.
        self.advertise_host = advertise_host or (
            ray.util.get_node_ip_address() if self.host == "0.0.0.0" else self.host)
        metrics_host = "127.0.0.1" if self.host == "127.0.0.1" else "0.0.0.0"
        self.metrics_port = metrics_port
        self.server = RouterServer(RouterConfig(**kwargs), host=self.host, port=port,
                                   metrics_port=metrics_port, metrics_host=metrics_host,
                                   http_port=http_port)
        self._loop = LoopThread("router")
        self.port = self._loop.run(self.server.start(), 60.0)
        freeze_startup_heap(logger)
        logger.info("router actor (pid %d) serving on %s", os.getpid(), self.address())

    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    def metrics_address(self) -> str | None:
        return f"{self.advertise_host}:{self.metrics_port}" if self.metrics_port else None

    def http_address(self) -> str | None:
        """host:port of the OpenAI API (None: not served)."""
        port = self.server.http_port
        return f"{self.advertise_host}:{port}" if port is not None else None

    def pid(self) -> int:
        return os.getpid()

    def live_pods(self) -> list[str]:
        """Pod ids the router would route to right now."""
        router = self.server.router
        return sorted(p.pod_id for p in router.registry.eligible()) if router else []

    def pods(self) -> dict[str, dict[str, Any]]:
        """The router's view of every live pod: address, epoch, P/D role, published costs."""
        router = self.server.router
        if router is None:
            return {}
        return {p.pod_id: {"address": p.info.address, "epoch": p.info.epoch,
                           "role": p.info.role, "costs": dict(p.info.tier_costs),
                           "excluded": p.excluded_reason}
                for p in router.registry.pods.values()}

    def stop(self) -> None:
        self._loop.run(self.server.stop(2.0), 30.0)
        self._loop.stop()


# -- on the driver -------------------------------------------------------------------------

"""Resources for a Ray deployment: sized so every actor fits, and waits that say what they wait on.

On a fixed-size cluster an actor that does not fit waits for ever, silently: two 1-CPU pods
on a 2-CPU cluster leave the router no CPU. So the CPUs are planned up front against the
cluster's total (refused with the numbers when they cannot fit), and every wait for placement
logs what is pending and what is free every few seconds, and times out naming what is missing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)

LOG_EVERY_S = 5.0


def plan_pod_cpus(num_pods: int, pod_cpus: float | None, router_cpus: float,
                  start_router: bool, total_cpus: float) -> float:
    """CPUs per pod: as asked, or (None) at most 1 and what is left after the router.
    Raises ValueError, with the numbers, when the pods and the router cannot all fit."""
    router = router_cpus if start_router else 0.0
    if pod_cpus is None:
        pod_cpus = min(1.0, (total_cpus - router) / num_pods)
        if pod_cpus > 0:
            logger.info("ray: %g CPUs per pod (%d pods + %g for the router on %g CPUs)",
                        pod_cpus, num_pods, router, total_cpus)
    needed = num_pods * pod_cpus + router
    if pod_cpus <= 0 or needed > total_cpus + 1e-9:
        raise ValueError(
            f"the deployment needs {needed:g} CPUs ({num_pods} pods x {max(pod_cpus, 0):g} + "
            f"router {router:g}) but the Ray cluster has {total_cpus:g}: lower --pod-cpus or "
            f"--router-cpus, run fewer pods, or add nodes")
    return pod_cpus


def wait_ready(refs: dict[str, Any], demands: dict[str, dict[str, float]],
               timeout_s: float) -> dict[str, Any]:
    """ray.get of each named ref, logging the pending names and the free resources every
    LOG_EVERY_S; on timeout a TimeoutError that names each pending actor and its demand."""
    pending = {ref: name for name, ref in refs.items()}
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = ", ".join(f"{name} (needs {demands.get(name, {})})"
                                for name in sorted(pending.values()))
            raise TimeoutError(
                f"not placed within {timeout_s:.0f} s: {missing}; free on the cluster: "
                f"{_free()}")
        done, _ = ray.wait(list(pending), num_returns=len(pending),
                           timeout=min(LOG_EVERY_S, left))
        for ref in done:
            results[pending.pop(ref)] = ray.get(ref)
        if pending:
            logger.info("ray: waiting for %s to be placed and start (%.0f s left); free: %s",
                        ", ".join(sorted(pending.values())), deadline - time.monotonic(),
                        _free())
    return results


def _free() -> dict[str, float]:
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}

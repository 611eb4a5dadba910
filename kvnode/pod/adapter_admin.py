"""A pod's run-time LoRA adapter loading: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (the admin token), as vLLM's.

A load reads the whole adapter on a worker thread first (a bad file is one clear error, 400,
and nothing changes), then registers it on the engine thread, resident at once if a slot is
free. An unload forgets the name (404 if unknown); requests already running with it finish
with it. Log lines `lora: adapter sql loaded at run time from /adapters/sql (rank 16, ...)`
and `lora: adapter sql unloaded`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagekv.kvnode.pod.server import PodServer

logger = logging.getLogger(__name__)


class PodAdapterAdmin:
    def __init__(self, pod: PodServer) -> None:
        self.pod = pod

    async def load(self, name: str, path: str) -> None:
        """AdapterError (a ValueError: one line) when it cannot be served."""
        engine = self.pod.built_engine()
        weights = await asyncio.to_thread(engine.read_adapter, name, path)
        aengine = self.pod.aengine
        assert aengine is not None
        await asyncio.to_thread(aengine.call, lambda: engine.adapters.register(name, path,
                                                                               weights))
        logger.info("lora: adapter %s loaded at run time from %s (rank %d, %s)", name, path,
                    weights.rank, "+".join(weights.targets))

    async def unload(self, name: str) -> None:
        """NoSuchAdapter when the pod does not know it."""
        engine = self.pod.built_engine()
        aengine = self.pod.aengine
        assert aengine is not None
        await asyncio.to_thread(aengine.call, lambda: engine.adapters.unregister(name))
        logger.info("lora: adapter %s unloaded", name)

"""A scale-out pod pre-warms its peers' hottest prefixes (`pagekv node --prewarm-hottest N`).

Once the pod serves, it reads the live pods from the index, asks every other PageKV pod for
its most-hit prefixes (`CacheAdmin.HotPrefixes`, with this pod's admin token: a fleet's pods
share it), merges them by hits (one entry per prefix: the holder with the most hits), and
warms the top N one after another by pulling each from its holder (`CacheAdminServicer.warm`,
the pre-warm's own path: a peer that fails to serve is a recompute, as any pull). Traffic is
served meanwhile; the warm-up yields to it by running one prefix at a time.

A peer that does not answer within `PEER_TIMEOUT_S`, refuses the token or is not reachable
is skipped with a log line; nothing here can stop the pod from serving. The outcome is one
log line and `pagekv_pod_prewarm_peer_prefixes_total{outcome}` /
`pagekv_pod_prewarm_peer_tokens_total{source}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pagekv.kvnode.engine.peer_pull import KvSource
from pagekv.proto.credentials import bearer
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.index.connect import connect
from pagekv.proto.index.queries import list_live_pods
from pagekv.proto.index.schema import POD_KIND_PAGEKV
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pagekv.kvnode.pod.cache_admin import CacheAdminServicer
    from pagekv.kvnode.pod.server import PodServer

logger = logging.getLogger(__name__)

PEER_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class WarmupOutcome:
    prefixes: int  # warmed
    failed: int
    pulled_tokens: int
    computed_tokens: int
    peers_asked: int
    peers_answered: int
    seconds: float


class PeerWarmup:
    def __init__(self, pod: PodServer, admin: CacheAdminServicer, count: int) -> None:
        self.pod = pod
        self.admin = admin
        self.count = count

    async def run(self) -> WarmupOutcome:
        start = time.monotonic()
        peers = await asyncio.to_thread(self._peers)
        answers = await asyncio.gather(*(self._hot_of(pod_id, address)
                                         for pod_id, address in peers))
        addresses = dict(peers)
        best: dict[bytes, pb.HotPrefix] = {}
        for prefixes in answers:
            for p in prefixes or ():
                if p.prefix_hash not in best or p.hits > best[p.prefix_hash].hits:
                    best[p.prefix_hash] = p
        ranked = sorted(best.values(), key=lambda p: -p.hits)[: self.count]
        warmed = failed = pulled = computed = 0
        for p in ranked:
            bs = self.pod.args.block_size
            tokens = list(p.token_ids.ids)
            source = KvSource(p.pod_id, addresses[p.pod_id], len(tokens) // bs)
            try:
                done = await self.admin.warm(tokens, p.cache_salt or None, p.tenant, source,
                                             lora_id=p.lora_id or None)
            except Exception as exc:  # a rejected prompt, a full queue: the next one
                logger.warning("prewarm from peers: a %d-token prefix of %s failed: %s",
                               len(tokens), p.pod_id, exc)
                failed += 1
                self.pod.prewarm_peer_prefixes.labels(**self.pod.metric_labels,
                                                      outcome="failed").inc()
                continue
            warmed += 1
            pulled += done.pulled_tokens
            computed += done.computed_tokens
            labels = self.pod.metric_labels
            self.pod.prewarm_peer_prefixes.labels(**labels, outcome="warmed").inc()
            self.pod.prewarm_peer_tokens.labels(**labels, source="pulled").inc(
                done.pulled_tokens)
            self.pod.prewarm_peer_tokens.labels(**labels, source="computed").inc(
                done.computed_tokens)
        outcome = WarmupOutcome(warmed, failed, pulled, computed, len(peers),
                                sum(a is not None for a in answers), time.monotonic() - start)
        logger.info("prewarm from peers: %d of the %d hottest prefixes warmed (%d failed) in "
                    "%.2f s: %d tokens pulled, %d computed; %d of %d peers answered",
                    warmed, len(ranked), failed, outcome.seconds, pulled, computed,
                    outcome.peers_answered, outcome.peers_asked)
        return outcome

    def _peers(self) -> list[tuple[str, str]]:
        """(pod id, address) of every other live PageKV pod of the index."""
        pod = self.pod
        if not pod.redis_url or pod.schema is None:
            return []
        try:
            client = connect(pod.redis_url, 2.0, pod.redis_tls)
            try:
                infos = list_live_pods(client, pod.schema)
            finally:
                client.close()
        except Exception as exc:  # Redis down: nothing to warm from, the pod serves anyway
            logger.warning("prewarm from peers: cannot list the pods: %s", exc)
            return []
        return [(i.pod_id, i.address) for i in infos
                if i.pod_id != pod.pod_id and i.kind == POD_KIND_PAGEKV and i.address]

    async def _hot_of(self, pod_id: str, address: str) -> list[pb.HotPrefix] | None:
        token = self.pod.admin_token
        try:
            async with open_channel(address, self.pod.tls, aio=True) as channel:
                reply = await pb_grpc.CacheAdminStub(channel).HotPrefixes(
                    pb.HotPrefixesRequest(limit=self.count),
                    metadata=bearer(token) if token else (), timeout=PEER_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.warning("prewarm from peers: %s (%s) did not answer: %s", pod_id, address,
                           exc.details() or exc.code().name)
            return None
        return [p for p in reply.prefixes if p.pod_id == pod_id and p.token_ids.ids]

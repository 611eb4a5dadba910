"""The router's CacheAdmin service (admin token): the same calls as a pod's, for the fleet.

- Locate / DeletePrefix: a prompt is hashed here as a request would be (the salt as sent),
  and every PageKV pod the router knows is asked for that chain of hashes at once (a prefix
  hash is passed on as is: each pod walks back from it). The answer lists each pod's own
  reply; a pod that fails or does not answer in time is listed with its error. A delete goes
  to every pod, not only the index's holders: the index may lag what a pod holds.
- Prewarm: the named pod is told to load the prompt; when the index shows another live pod
  holding some of it, the deepest such holder is named as its `kv_source`, so the blocks are
  pulled rather than recomputed.
- HotPrefixes: every pod's most-hit prefixes, merged (most hits first; a pod that fails is
  left out, logged).

The caller's admin credential (its `authorization` header) is passed on to the pods, which
check it themselves; without one, the router's --pod-api-token is sent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from pagekv.proto.credentials import bearer
from pagekv.proto.index import REDIS_ERRORS
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.requests import BadRequest, prompt_request
from pagekv.router.routing import Router

logger = logging.getLogger(__name__)

POD_CALL_TIMEOUT_S = 10.0  # a stopped pod is listed with its error, not waited on
PREWARM_TIMEOUT_S = 600.0


class RouterCacheAdmin(pb_grpc.CacheAdminServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def _metadata(self, context: Any) -> tuple[tuple[str, str], ...]:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                return ((key, value),)
        token = self.router.config.pod_api_token
        return bearer(token) if token else ()

    def _hashes(self, message: Any, salt: str) -> list[bytes]:
        """The block hashes of the prompt `message` carries, hashed here as a request's."""
        request = prompt_request(message, salt)
        return self.router.prepare(request).block_hashes  # BadRequest in a pod's words

    def _pod_query(self, query: pb.PrefixQuery) -> pb.PrefixQuery:
        kind = query.WhichOneof("prefix")
        if kind in ("text", "token_ids"):
            hashes = self._hashes(query, query.cache_salt)
            return pb.PrefixQuery(block_hashes=pb.BlockHashes(hashes=hashes))
        if kind is None:
            raise BadRequest("a prefix is required: text, token_ids, block_hashes or "
                             "prefix_hash")
        return query

    async def _ask(self, pod_id: str, method: str, query: pb.PrefixQuery,
                   metadata: tuple[tuple[str, str], ...]) -> pb.PrefixHoldings:
        stub = self.router.registry.admin_stub(pod_id)
        if stub is None:
            return pb.PrefixHoldings(pods=[pb.PodHolding(pod_id=pod_id,
                                                         error="not a PageKV pod")])
        try:
            answer: pb.PrefixHoldings = await getattr(stub, method)(
                query, metadata=metadata, timeout=POD_CALL_TIMEOUT_S)
            return answer
        except grpc.aio.AioRpcError as exc:
            return pb.PrefixHoldings(pods=[pb.PodHolding(
                pod_id=pod_id, error=f"{exc.code().name}: {exc.details()}")])

    async def _fan_out(self, method: str, query: pb.PrefixQuery, context: Any
                       ) -> pb.PrefixHoldings:
        try:
            pod_query = self._pod_query(query)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metadata = self._metadata(context)
        pods = sorted(self.router.registry.pods)
        answers = await asyncio.gather(*(self._ask(p, method, pod_query, metadata)
                                         for p in pods))
        out = pb.PrefixHoldings()
        for answer in answers:
            out.pods.extend(answer.pods)
            out.total_blocks += answer.total_blocks
        if method == "DeletePrefix":
            failed = [h.pod_id for h in out.pods if h.error]
            logger.info("cache admin: deleted a prefix on %d pods: %d blocks%s",
                        len(pods) - len(failed), out.total_blocks,
                        f"; not on {', '.join(failed)}" if failed else "")
        return out

    async def Locate(self, request: pb.PrefixQuery, context: Any) -> pb.PrefixHoldings:
        return await self._fan_out("Locate", request, context)

    async def DeletePrefix(self, request: pb.PrefixQuery, context: Any) -> pb.PrefixHoldings:
        return await self._fan_out("DeletePrefix", request, context)

    async def HotPrefixes(self, request: pb.HotPrefixesRequest, context: Any
                          ) -> pb.HotPrefixesResponse:
        metadata = self._metadata(context)

        async def ask(pod_id: str) -> list[pb.HotPrefix]:
            stub = self.router.registry.admin_stub(pod_id)
            if stub is None:
                return []
            try:
                reply: pb.HotPrefixesResponse = await stub.HotPrefixes(
                    request, metadata=metadata, timeout=POD_CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                logger.warning("cache admin: %s did not list its hot prefixes: %s", pod_id,
                               exc.details() or exc.code().name)
                return []
            return [p for p in reply.prefixes if p.pod_id == pod_id]

        answers = await asyncio.gather(*(ask(p) for p in sorted(self.router.registry.pods)))
        merged = sorted((p for answer in answers for p in answer), key=lambda p: -p.hits)
        return pb.HotPrefixesResponse(prefixes=merged[: request.limit or 16])

    async def Prewarm(self, request: pb.PrewarmRequest, context: Any) -> pb.PrewarmResponse:
        registry = self.router.registry
        target = registry.pods.get(request.pod_id)
        if not request.pod_id or target is None:
            await context.abort(grpc.StatusCode.NOT_FOUND if request.pod_id else
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"no pod {request.pod_id!r} to pre-warm" if request.pod_id
                                else "pod_id is required: the pod to pre-warm")
        stub = registry.admin_stub(request.pod_id)
        if stub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.pod_id} is not a PageKV pod: no pre-warm there")
        try:
            hashes = self._hashes(request, request.cache_salt)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        forward = pb.PrewarmRequest()
        forward.CopyFrom(request)
        forward.ClearField("kv_source")
        holder = await self._deepest_holder(hashes, request.pod_id)
        if holder is not None:
            pod_id, depth = holder
            forward.kv_source.CopyFrom(pb.KvSource(
                pod_id=pod_id, address=registry.pods[pod_id].info.address, num_blocks=depth))
        try:
            warmed: pb.PrewarmResponse = await stub.Prewarm(
                forward, metadata=self._metadata(context), timeout=PREWARM_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or exc.code().name)
            raise  # (abort raises)
        return warmed

    async def _deepest_holder(self, hashes: list[bytes], target: str
                              ) -> tuple[str, int] | None:
        """The live pod other than `target` holding the longest prefix of `hashes` (index)."""
        if not hashes:
            return None
        try:
            matches = await self.router.index.lookup_prefix(hashes,
                                                            self.router.registry.live_pods())
        except REDIS_ERRORS as exc:
            logger.warning("pre-warm: index lookup failed (%s): the pod computes it", exc)
            return None
        own = matches.get(target)
        best = max(((p, m.depth) for p, m in matches.items()
                    if p != target and p in self.router.registry.pods),
                   key=lambda pm: pm[1], default=None)
        if best is None or best[1] == 0 or (own is not None and own.depth >= best[1]):
            return None
        return best

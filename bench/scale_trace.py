"""The scale benchmark's trace: many tenants, shared system prompts, multi-turn users.

* T tenants (`tenants_per_pod` × pods, so every pod count sees the same pressure per pod),
  each with 1-4 system prompts of 1-4k tokens; tenants are Zipf-popular, and so are a
  tenant's prompts.
* A session is one user of one tenant: the tenant's system prompt, then turns. Turn t's
  prompt is the system prompt, every earlier message and answer, and a new message, as a
  chat client sends it; the answer is fixed by the trace (the simulated pod "generates"
  exactly those tokens), so a later turn can hit the earlier answer's blocks.
* Sessions start as a Poisson process; a session's next turn comes a think time after the
  previous one arrived. Only arrivals before the end of the trace are kept.
* A hot prefix (`hot_share` > 0): that share of the sessions, whatever their tenant's draw,
  open with one system prompt of `hot_tokens` tokens (tenant `num_tenants`, one more): a
  prompt whose traffic outgrows one pod once the fleet is large or loaded enough
  (`hot_pods` says how many pods' time it needs).

Everything is a pure function of the configuration and the seed. Token ids are drawn from
one shared list of int objects, and a prompt is assembled only when asked for
(`ScaleRequest.prompt()`), so ten thousand 3k-token prompts cost their segments, not
their full copies.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass, field

from pagekv.proto.hashing import max_hit_blocks


@dataclass(frozen=True, slots=True)
class TraceConfig:
    tenants_per_pod: float = 2.0
    prompts_per_tenant: tuple[int, int] = (1, 4)
    system_tokens: tuple[int, int] = (1024, 4096)
    tenant_zipf: float = 0.9     # exponent of the tenants' popularity
    prompt_zipf: float = 1.0     # exponent of a tenant's prompts' popularity
    mean_turns: float = 3.0      # turns per session: geometric with this mean ...
    max_turns: int = 8           # ... capped here
    message_tokens: tuple[int, int] = (32, 256)
    output_tokens: tuple[int, int] = (16, 128)
    think_s: tuple[float, float] = (5.0, 20.0)  # next turn's arrival after the previous one's
    vocab: int = 32000
    block_size: int = 16
    hot_share: float = 0.0       # sessions opening with the one hot system prompt
    hot_tokens: int = 2048       # its length


@dataclass(slots=True, eq=False)
class Session:
    tenant: int
    system: list[int]
    messages: list[list[int]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class ScaleRequest:
    rid: str
    arrival: float
    session: Session
    turn: int
    prompt_len: int
    bound_blocks: int = 0  # the most blocks any cache could serve (see `bound_blocks`)

    def prompt(self) -> list[int]:
        s = self.session
        out = list(s.system)
        for i in range(self.turn):
            out += s.messages[i]
            out += s.answers[i]
        out += s.messages[self.turn]
        return out

    @property
    def output(self) -> list[int]:
        return self.session.answers[self.turn]

    @property
    def tenant(self) -> int:
        return self.session.tenant


def _zipf_cdf(n: int, s: float) -> list[float]:
    weights = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
    return [w / weights[-1] for w in weights]


def _pick(rng: random.Random, cdf: list[float]) -> int:
    return min(bisect.bisect_left(cdf, rng.random()), len(cdf) - 1)


def num_tenants(cfg: TraceConfig, pods: int) -> int:
    return max(2, round(cfg.tenants_per_pod * pods))


def make_trace(cfg: TraceConfig, pods: int, session_rate: float, duration_s: float,
               seed: int = 0) -> list[ScaleRequest]:
    """Every request arriving in [0, duration_s), in arrival order (ties by id)."""
    if session_rate <= 0 or duration_s <= 0:
        raise ValueError("session_rate and duration_s must be positive")
    rng = random.Random(seed)
    ids = list(range(cfg.vocab))  # shared int objects: a token costs a reference

    def tokens(n: int) -> list[int]:
        return rng.choices(ids, k=n)

    n_tenants = num_tenants(cfg, pods)
    tenants = []
    for _ in range(n_tenants):
        k = rng.randint(*cfg.prompts_per_tenant)
        tenants.append([tokens(rng.randint(*cfg.system_tokens)) for _ in range(k)])
    # Drawn only with a hot prefix: a trace without one is the same as before it existed.
    hot = tokens(cfg.hot_tokens) if cfg.hot_share > 0 else None
    rank = list(range(n_tenants))
    rng.shuffle(rank)  # popularity is not tenant order (pod ids and hashes are not either)
    tenant_cdf = _zipf_cdf(n_tenants, cfg.tenant_zipf)
    prompt_cdfs = {k: _zipf_cdf(k, cfg.prompt_zipf) for k in range(1, 1 + max(
        cfg.prompts_per_tenant))}
    stop = 1.0 / cfg.mean_turns  # geometric: P(last turn) after each turn

    reqs: list[ScaleRequest] = []
    start = 0.0
    for n in itertools.count():
        start += rng.expovariate(1.0) / session_rate
        if start >= duration_s:
            break
        tenant = rank[_pick(rng, tenant_cdf)]
        prompts = tenants[tenant]
        system = prompts[_pick(rng, prompt_cdfs[len(prompts)])]
        if hot is not None and rng.random() < cfg.hot_share:
            tenant, system = n_tenants, hot
        session = Session(tenant, system)
        t, length = start, len(system)
        for turn in range(cfg.max_turns):
            session.messages.append(tokens(rng.randint(*cfg.message_tokens)))
            session.answers.append(tokens(rng.randint(*cfg.output_tokens)))
            length += len(session.messages[-1])
            if t < duration_s:
                reqs.append(ScaleRequest(f"s{n}-t{turn}", t, session, turn, length))
            length += len(session.answers[-1])
            if rng.random() < stop:
                break
            t += rng.uniform(*cfg.think_s)
    reqs.sort(key=lambda r: (r.arrival, r.rid))
    bound_blocks(reqs, cfg.block_size)
    return reqs


def bound_blocks(reqs: list[ScaleRequest], block_size: int) -> None:
    """Set each request's `bound_blocks`: the longest prefix any cache (one pod, unbounded)
    could serve, given everything that arrived before it. Two sessions share only their
    system prompt's full blocks (the block that straddles its end holds a user's tokens);
    turn t also continues turn t-1's prompt and answer, whose KV covers every token but the
    answer's last. The unit test checks this against a set of the real block hashes."""
    seen: set[int] = set()  # system prompts some earlier request carried (by identity)
    for r in reqs:
        s = r.session
        limit = max_hit_blocks(r.prompt_len, block_size)
        best = len(s.system) // block_size if id(s.system) in seen else 0
        if r.turn:
            prev = r.prompt_len - len(s.messages[r.turn])  # previous prompt + its answer
            best = max(best, (prev - 1) // block_size)
        r.bound_blocks = min(best, limit)
        seen.add(id(s.system))


def pod_seconds(reqs: list[ScaleRequest], block_size: int, step_fixed_s: float,
                s_per_token: float, pool_tokens: int, max_seqs: int) -> float:
    """The step time the requests need, at the bound's hit rate, from pods that batch as
    many sequences as their pool holds (prompt + answer each, nothing shared: every
    sequence's blocks its own) up to `max_seqs`: each decode step's fixed cost is shared by
    that many, and every computed token costs `s_per_token`."""
    if not reqs:
        return 0.0
    tokens = sum(r.prompt_len + len(r.output) for r in reqs) / len(reqs)
    batch = max(1.0, min(max_seqs, pool_tokens / tokens))
    total = 0.0
    for r in reqs:
        uncached = r.prompt_len - r.bound_blocks * block_size
        out = len(r.output)
        total += uncached * s_per_token + out * (step_fixed_s / batch + s_per_token)
    return total


def hot_pods(reqs: list[ScaleRequest], cfg: TraceConfig, pods: int, step_fixed_s: float,
             s_per_token: float, pool_tokens: int, max_seqs: int, window_s: float) -> float:
    """How many pods' time the hot prompt's requests among `reqs` (those arriving in a
    window of `window_s`) need (`pod_seconds`, at the bound's hit rate): above 1, no one
    pod can serve it."""
    hot = [r for r in reqs if r.tenant == num_tenants(cfg, pods)]
    return pod_seconds(hot, cfg.block_size, step_fixed_s, s_per_token, pool_tokens,
                       max_seqs) / window_s


def trace_for_load(cfg: TraceConfig, pods: int, load: float, duration_s: float,
                   step_fixed_s: float, s_per_token: float, pool_tokens: int, max_seqs: int,
                   seed: int = 0) -> tuple[list[ScaleRequest], float]:
    """A trace whose requests arriving in the window's second half (the first half ramps
    up: no session started before t=0) need `load` × the pods' time (`pod_seconds`).
    Returns the trace and its session rate, found by rescaling twice (the work per
    request hardly depends on the rate)."""
    if load <= 0:
        raise ValueError(f"load must be positive, got {load}")
    rate, rescaled = pods / 10.0, 0
    for _ in range(12):
        reqs = make_trace(cfg, pods, rate, duration_s, seed)
        late = [r for r in reqs if r.arrival >= duration_s / 2]
        work = pod_seconds(late, cfg.block_size, step_fixed_s, s_per_token, pool_tokens,
                           max_seqs)
        offered = work / (duration_s / 2) / pods
        if offered <= 0:
            rate *= 10  # no request in the window yet
            continue
        rate *= load / offered
        rescaled += 1
        if rescaled == 2:
            break
    return make_trace(cfg, pods, rate, duration_s, seed), rate

"""Partitions on the network-namespace test bed (deploy/netns_bed.py), each under load: a link
cut, held, restored, while a bounded number of clients call through the router.

What a scenario measures, from public behaviour only (calls, their codes and tokens, the
pods' Stats):
- every call's outcome: OK with the cold greedy tokens (asked of a pod with prompt_logprobs,
  which computes the whole prompt), or a gRPC code; `wrong` counts OK calls whose tokens
  differ, `hung` calls that returned later than their deadline (plus slack);
- leaked blocks: per pod, pool blocks not free once the cluster is idle again;
- recovery: seconds from the restore until calls are served normally again (the cut pod
  serves again, no failure after it; for a pull: a pull across the link succeeds again).

tests/integration/test_partitions.py runs them short and asserts; bench/faults.py runs them
longer and prints the figures.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bench.closed_loop import ClosedLoop
from pagekv.deploy.netns_bed import NetnsBed
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

HANG_SLACK_S = 2.0  # a call returning later than its deadline by more than this hung
BLOCK = 16


def prompts(groups: int, per_group: int, prefix_tokens: int = 96, seed: int = 0
            ) -> list[list[int]]:
    """Byte-tokenizer prompts sharing one prefix per group, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 256) for _ in range(prefix_tokens)] for _ in range(groups)]
    return [prefixes[g] + [rng.randrange(1, 256) for _ in range(8)]
            for _ in range(per_group) for g in range(groups)]


def request(tokens: list[int], max_tokens: int, cold: bool = False,
            source: pb.KvSource | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if cold:
        sampling.prompt_logprobs = 0  # computes the whole prompt: no cache, tier or peer read
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens), sampling=sampling)
    if source is not None:
        req.kv_source.CopyFrom(source)
    return req


def generate(address: str, req: pb.GenerateRequest, timeout: float) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout)


def cold_tokens(address: str, work: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [list(generate(address, request(p, max_tokens, cold=True), 60).completions[0]
                 .token_ids) for p in work]


@dataclass
class Outcome:
    started: float  # monotonic
    done: float
    code: str
    wrong: bool = False
    served_by: str = ""
    peer_tokens: int = 0  # prompt tokens pulled from a peer


@dataclass
class CheckedLoad:
    """Unary Generate calls from `concurrency` threads, each with `deadline_s`, until stopped;
    every OK answer is compared with `expected` (the cold tokens of the same prompt)."""

    address: str
    work: list[list[int]]
    expected: list[list[int]]
    concurrency: int = 4
    deadline_s: float = 10.0
    max_tokens: int = 4
    max_calls: int = 20_000  # a bound; scenarios stop the load by time first
    _loop: ClosedLoop[Outcome] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._loop = ClosedLoop(self.address, self.concurrency, self.max_calls, self._call)

    def start(self) -> CheckedLoad:
        self._loop.start()
        return self

    def _call(self, stub: pb_grpc.GenerationStub, i: int) -> Outcome:
        k = i % len(self.work)
        t0 = time.monotonic()
        try:
            resp = stub.Generate(request(self.work[k], self.max_tokens), timeout=self.deadline_s)
        except grpc.RpcError as e:
            return Outcome(t0, time.monotonic(), e.code().name)
        return Outcome(t0, time.monotonic(), "OK",
                       list(resp.completions[0].token_ids) != self.expected[k],
                       resp.served_by, resp.usage.cached_tokens_peer)

    def stop(self) -> tuple[list[Outcome], int]:
        """(the calls, threads still inside a call a deadline past the stop: hung)."""
        return self._loop.stop(self.deadline_s + HANG_SLACK_S)


def summary(calls: list[Outcome], deadline_s: float, stuck: int = 0) -> dict:
    failed = Counter(c.code for c in calls if c.code != "OK")
    return {"calls": len(calls), "failed": dict(failed), "wrong": sum(c.wrong for c in calls),
            "hung": stuck + sum(c.done - c.started > deadline_s + HANG_SLACK_S for c in calls),
            # A failure other than the client's own deadline running out.
            "failed_not_deadline": sum(n for code, n in failed.items()
                                       if code != "DEADLINE_EXCEEDED"),
            "max_call_s": max((c.done - c.started for c in calls), default=0.0)}


def leaked_blocks(bed: NetnsBed, timeout: float = 15.0) -> dict[str, int]:
    """Per pod, pool blocks still not free once idle (waited for up to `timeout`: releases
    finish on the pods' own threads, a pull's on the holder at its deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        leaked = {}
        for name in bed.pod_names:
            with grpc.insecure_channel(bed.address(name)) as ch:
                st = pb_grpc.KVNodeStub(ch).Stats(pb.StatsRequest(), timeout=5)
            leaked[name] = st.num_blocks - st.num_free_blocks
        if not any(leaked.values()) or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


def recovery_after(calls: list[Outcome], restored: float, served: Callable[[Outcome], bool]
                   ) -> float | None:
    """Seconds from `restored` until calls are served normally: the first call started after
    it that `served` accepts has finished, and no call failed after that. None: never."""
    good = [c.done for c in calls if c.started >= restored and c.code == "OK" and served(c)]
    if not good:
        return None
    bad = [c.done for c in calls if c.done >= restored and c.code != "OK"]
    return max([min(good), *bad]) - restored


def start_load(bed: NetnsBed, concurrency: int, deadline_s: float, groups: int = 4,
          per_group: int = 4, seed: int = 0) -> CheckedLoad:
    work = prompts(groups, per_group, seed=seed)
    expected = cold_tokens(bed.address(bed.pod_names[0]), work, 4)
    return CheckedLoad(bed.address("router"), work, expected, concurrency, deadline_s).start()


def router_pod_cut(bed: NetnsBed, victim: str, warm_s: float = 3.0, cut_s: float = 5.0,
                   after_s: float = 8.0, concurrency: int = 4, deadline_s: float = 10.0,
                   seed: int = 0) -> dict:
    """The router's link to `victim` cut under load (Redis still sees the pod alive)."""
    load = start_load(bed, concurrency, deadline_s, seed=seed)
    time.sleep(warm_s)
    bed.mesh.cut("router", victim)
    cut = time.monotonic()
    time.sleep(cut_s)
    bed.mesh.restore("router", victim)
    restored = time.monotonic()
    time.sleep(after_s)
    calls, stuck = load.stop()
    during = [c for c in calls if cut <= c.started < restored]
    return {**summary(calls, deadline_s, stuck), "cut_s": cut_s,
            "served_by_victim_during_cut": sum(c.served_by == victim for c in during
                                               if c.done < restored),
            "recovery_s": recovery_after(calls, restored, lambda c: c.served_by == victim),
            "leaked_blocks": leaked_blocks(bed)}


def pod_redis_cut(bed: NetnsBed, victim: str, warm_s: float = 3.0, cut_s: float = 6.0,
                  after_s: float = 10.0, concurrency: int = 4, deadline_s: float = 10.0,
                  seed: int = 1) -> dict:
    """`victim`'s link to Redis cut under load: its lease runs out, the router drops it;
    restored, it republishes and serves again."""
    load = start_load(bed, concurrency, deadline_s, seed=seed)
    time.sleep(warm_s)
    bed.mesh.cut(victim, "redis")
    time.sleep(cut_s)
    bed.mesh.restore(victim, "redis")
    restored = time.monotonic()
    time.sleep(after_s)
    calls, stuck = load.stop()
    return {**summary(calls, deadline_s, stuck), "cut_s": cut_s,
            "recovery_s": recovery_after(calls, restored, lambda c: c.served_by == victim),
            "leaked_blocks": leaked_blocks(bed)}


def pod_pod_cut_during_pull(bed: NetnsBed, holder: str, puller: str, rate: str = "5mbit",
                            prompt_tokens: int = 720, pulls: int = 2, cut_s: float = 4.0, after_s: float = 20.0, concurrency: int = 2,
                            deadline_s: float = 15.0, seed: int = 2) -> dict:
    """The holder <-> puller link (slowed to `rate`, so a pull takes a while) cut while the
    puller pulls a prompt's blocks from the holder (the kv_source a router would send),
    with the router's load running; restored, pulls across it must succeed again."""
    rng = random.Random(seed)
    load = start_load(bed, concurrency, deadline_s, seed=seed)
    bed.mesh.set_rate(holder, puller, rate)
    source = pb.KvSource(pod_id=holder, address=bed.address(holder),
                         num_blocks=(prompt_tokens - 1) // BLOCK)

    def fresh() -> tuple[list[int], list[int]]:
        """A prompt the holder computes (so holds); its cold tokens."""
        p = [rng.randrange(1, 256) for _ in range(prompt_tokens)]
        return p, list(generate(bed.address(holder), request(p, 4, cold=True), 60)
                       .completions[0].token_ids)

    def pull(p: list[int], want: list[int]) -> Outcome:
        t0 = time.monotonic()
        try:
            r = generate(bed.address(puller), request(p, 4, source=source), deadline_s)
            return Outcome(t0, time.monotonic(), "OK",
                           list(r.completions[0].token_ids) != want, r.served_by,
                           r.usage.cached_tokens_peer)
        except grpc.RpcError as e:
            return Outcome(t0, time.monotonic(), e.code().name)

    results: list[Outcome] = []
    try:
        p, want = fresh()  # one pull uncut: how long the link takes, to cut a third in
        results.append(pull(p, want))
        uncut_s = results[0].done - results[0].started
        for _ in range(pulls):
            p, want = fresh()
            got: list[Outcome] = []
            worker = threading.Thread(
                target=lambda p=p, w=want, got=got: got.append(pull(p, w)), daemon=True)
            worker.start()
            time.sleep(uncut_s / 3)
            bed.mesh.cut(holder, puller)
            time.sleep(cut_s)
            bed.mesh.restore(holder, puller)
            worker.join(deadline_s + HANG_SLACK_S)
            if not got:
                results.append(Outcome(0.0, 1e9, "HUNG"))
                continue
            results.append(got[0])
        restored = time.monotonic()
        recovery = None
        while recovery is None and time.monotonic() - restored < after_s:
            p, want = fresh()
            out = pull(p, want)
            results.append(out)
            if out.code == "OK" and out.peer_tokens > 0:
                recovery = out.done - restored
    finally:
        bed.mesh.set_rate(holder, puller, bed.mesh.rate)
    calls, stuck = load.stop()
    s = summary(calls, deadline_s, stuck)
    pulls_s = summary(results, deadline_s)
    return {**s, "rate": rate, "pulls": len(results), "uncut_pull_s": uncut_s,
            "full_pull_tokens": results[0].peer_tokens, "pull_failed": pulls_s["failed"],
            "pull_wrong": pulls_s["wrong"], "pull_hung": pulls_s["hung"],
            "pulled_tokens_during_cut": [o.peer_tokens for o in results[1:pulls + 1]],
            "cut_pull_s": [o.done - o.started for o in results[1:pulls + 1]],
            "recovery_s": recovery, "leaked_blocks": leaked_blocks(bed)}

"""A cross-pod pull whose link goes down while its bytes move, on the network-namespace bed.

The holder <-> puller link is shaped slow (so a pull takes a second or two), then:

1. an uncut pull of a fresh prompt: how long the link takes (and that it works);
2. the cut: the holder computes a fresh prompt (its cold greedy tokens), the puller is asked
   for it with `kv_source` naming the holder, and the link is set down (NetnsMesh.cut) a
   fraction of the uncut time into the call. The call must still come back OK with the cold
   tokens, fewer prefix tokens from the peer than a whole pull (the rest recomputed), one
   fallback counted by reason in the puller's metrics, and within the pull deadline plus a
   recompute (no hang; the recompute bounded by 3x the holder's own cold run of the prompt
   plus 5 s, unless given: generous, the box is shared, and a hang is a TCP timeout's
   minutes). While the link is still down, every pod's pool must be all free again
   (the holder's pins of the cut pull released, not waiting for the link to come back);
3. the link restored: pulls of fresh prompts until one brings the whole prefix again
   (`recovery_s`: seconds from the restore, the holder's computing of each fresh prompt not
   counted; None if none did within `after_s`); `next` is the first
   of them, on its own: over a gRPC channel it may still fall back, its connection backing
   off its retransmits and queueing the cut pull's stale bytes ahead of the new ones.

Only the pods' public behaviour is used (Generate, Stats, ResetPrefixCache, metrics), so the
scenario holds whatever moves a pull's bytes. tests/integration/test_pull_partition.py runs
it on pagekv-tiny; bench/kv_pull_netns.py runs it on the real model as its cut row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bench.kv_pull import reset
from bench.netns_partitions import BLOCK, generate, request
from bench.pod_metrics import fallback_reasons, grown, scrape_url, transports
from pagekv.deploy.netns_bed import NetnsBed
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

PULLED_BYTES = "pagekv_kv_pulled_bytes_total"


@dataclass
class PullCall:
    """One Generate on the puller naming the holder as kv_source, and what it changed."""

    seconds: float = 0.0
    code: str = "HUNG"  # until it returns
    tokens: list[int] = field(default_factory=list)
    peer_tokens: int = 0
    change: dict[str, float] = field(default_factory=dict)  # the puller's metric deltas

    @property
    def fallbacks(self) -> dict[str, float]:
        return fallback_reasons(self.change)

    @property
    def transports(self) -> dict[str, float]:
        return transports(self.change)


def pull_call(bed: NetnsBed, holder: str, puller: str, prompt: list[int], max_tokens: int,
              timeout_s: float, out: PullCall) -> PullCall:
    source = pb.KvSource(pod_id=holder, address=bed.address(holder),
                         num_blocks=(len(prompt) - 1) // BLOCK)
    before = scrape_url(bed.metrics_url(puller))
    t0 = time.monotonic()
    try:
        r = generate(bed.address(puller), request(prompt, max_tokens, source=source), timeout_s)
        out.code, out.tokens = "OK", list(r.completions[0].token_ids)
        out.peer_tokens = r.usage.cached_tokens_peer
    except grpc.RpcError as e:
        out.code = e.code().name
    out.seconds = time.monotonic() - t0
    out.change = grown(before, scrape_url(bed.metrics_url(puller)))
    return out


def pool_in_use(bed: NetnsBed) -> dict[str, int]:
    """Per pod, pool blocks not free (a pinned, or running, block)."""
    used = {}
    for name in bed.pod_names:
        with grpc.insecure_channel(bed.address(name)) as ch:
            st = pb_grpc.KVNodeStub(ch).Stats(pb.StatsRequest(), timeout=5)
        used[name] = st.num_blocks - st.num_free_blocks
    return used


def seconds_until_free(bed: NetnsBed, timeout_s: float) -> tuple[float | None, dict[str, int]]:
    """(seconds until every pod's pool is all free, or None; what was in use at the end)."""
    t0 = time.monotonic()
    while True:
        used = pool_in_use(bed)
        if not any(used.values()):
            return time.monotonic() - t0, used
        if time.monotonic() - t0 > timeout_s:
            return None, used
        time.sleep(0.1)


def cut_mid_pull(bed: NetnsBed, holder: str, puller: str, make_prompt: Callable[[], list[int]],
                 rate: str, pull_deadline_s: float, recompute_s: float | None = None,
                 max_tokens: int = 4,
                 cut_at: float = 0.4, release_timeout_s: float = 15.0,
                 after_s: float = 15.0) -> dict:
    """The scenario above; `pull_deadline_s`: the puller's --kv-pull-deadline-s;
    `recompute_s`: a bound on the puller recomputing the prompt (no hang = the cut call back
    within the deadline plus that; default: from the holder's cold run, see above)."""
    cold_s: list[float] = []  # the holder's cold runs, each a fresh prompt

    def held() -> tuple[list[int], list[int]]:
        """A fresh prompt computed by the holder (so held there), its cold greedy tokens."""
        p = make_prompt()
        t0 = time.monotonic()
        r = generate(bed.address(holder), request(p, max_tokens), 300)
        cold_s.append(time.monotonic() - t0)
        return p, list(r.completions[0].token_ids)

    def pulled(p: list[int]) -> PullCall:
        reset(bed.address(puller))
        return pull_call(bed, holder, puller, p, max_tokens, call_timeout_s, PullCall())

    bed.mesh.set_rate(holder, puller, rate)
    cut = False
    try:
        p, want = held()
        if recompute_s is None:
            recompute_s = 3.0 * cold_s[-1] + 5.0
        call_timeout_s = pull_deadline_s + recompute_s + 30.0  # a backstop: checked below
        uncut = pulled(p)
        uncut_ok = uncut.code == "OK" and uncut.tokens == want
        full_tokens = (len(p) - 1) // BLOCK * BLOCK

        p, want = held()
        reset(bed.address(puller))
        during = PullCall()
        worker = threading.Thread(target=pull_call, daemon=True, args=(
            bed, holder, puller, p, max_tokens, call_timeout_s, during))
        t0 = time.monotonic()
        worker.start()
        time.sleep(uncut.seconds * cut_at)
        bed.mesh.cut(holder, puller)
        cut = True
        cut_after_s = time.monotonic() - t0
        worker.join(call_timeout_s + 5.0)
        # Still cut: the holder must let go of the pull's pins on its own.
        release_s, in_use = seconds_until_free(bed, release_timeout_s)
        bed.mesh.restore(holder, puller)
        cut = False

        restored = time.monotonic()
        tries: list[tuple[PullCall, bool]] = []
        recovery_s = None
        computing_s = 0.0  # the holder's cold runs since the restore: not the link's time
        while recovery_s is None and time.monotonic() - restored - computing_s < after_s:
            p, want_next = held()
            computing_s += cold_s[-1]
            after = pulled(p)
            whole = after.code == "OK" and after.tokens == want_next \
                and after.peer_tokens == full_tokens and not after.fallbacks
            tries.append((after, after.code == "OK" and after.tokens == want_next))
            if whole:
                recovery_s = time.monotonic() - restored - computing_s
    finally:
        if cut:
            bed.mesh.restore(holder, puller)
        bed.mesh.set_rate(holder, puller, bed.mesh.rate)
    return {
        "rate": rate, "full_tokens": full_tokens, "holder_cold_s": cold_s[0],
        "pull_deadline_s": pull_deadline_s, "recompute_bound_s": recompute_s,
        "uncut": {"ok": uncut_ok, "code": uncut.code, "seconds": uncut.seconds,
                  "peer_tokens": uncut.peer_tokens, "fallbacks": uncut.fallbacks,
                  "pulled_bytes": uncut.change.get(PULLED_BYTES, 0.0),
                  "pull_s": uncut.change.get("pagekv_kv_pull_seconds_sum", 0.0),
                  "transports": uncut.transports},
        "cut": {"code": during.code, "seconds": during.seconds, "cut_after_s": cut_after_s,
                "wrong": during.code == "OK" and during.tokens != want,
                "peer_tokens": during.peer_tokens, "fallbacks": during.fallbacks,
                "pulled_bytes": during.change.get(PULLED_BYTES, 0.0),
                "transports": during.transports, "hung": during.code == "HUNG"
                or during.seconds > pull_deadline_s + recompute_s},
        "release_s": release_s, "in_use_after_cut": in_use,
        "recovery_s": recovery_s, "pulls_after_restore": len(tries),
        "after_restore_wrong": sum(not ok for _, ok in tries),
        "next": summary(tries[0][0]) if tries else None,
    }


def summary(c: PullCall) -> dict:
    return {"code": c.code, "seconds": c.seconds, "peer_tokens": c.peer_tokens,
            "fallbacks": c.fallbacks, "transports": c.transports}


def problems(r: dict) -> list[str]:
    """What a cut_mid_pull result got wrong (empty: all held)."""
    out = []
    full, u, c, n = r["full_tokens"], r["uncut"], r["cut"], r["next"]
    if not u["ok"] or u["peer_tokens"] != full or u["fallbacks"]:
        out.append(f"the uncut pull did not bring the whole prefix: {u}")
    if c["code"] != "OK" or c["wrong"] or c["hung"]:
        out.append(f"the cut call failed, was wrong or hung: {c}")
    if not c["peer_tokens"] < full or sum(c["fallbacks"].values()) != 1:
        out.append(f"the cut did not land mid-pull as one counted fallback: {c}")
    if r["release_s"] is None:
        out.append(f"pool blocks still in use with the link down: {r['in_use_after_cut']}")
    if r["after_restore_wrong"]:
        out.append(f"{r['after_restore_wrong']} pulls after the restore failed or were wrong")
    if r["recovery_s"] is None:
        out.append(f"no pull brought the whole prefix again after the restore: {n}")
    return out


def first_pull_problem(r: dict) -> str | None:
    """Whether the very first pull after the restore fell short (reported apart: see above)."""
    n = r["next"]
    if n is None or n["code"] != "OK" or n["peer_tokens"] != r["full_tokens"] or n["fallbacks"]:
        return f"the first pull after the restore did not bring the whole prefix: {n}"
    return None

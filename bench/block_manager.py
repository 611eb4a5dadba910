"""Block-manager benchmark: replay a synthetic trace through the KV cache manager.

Prints, side by side in one run:
1. the replay of a held-out trace through PageKV's manager and vLLM 0.33's own
   `vllm.v1.core.kv_cache_manager.KVCacheManager` (fetched by bench/vllm_reference.py; with
   KV events and prefix stats on, as PageKV, and again "lean", both off), alternating in this
   process: µs per admit / decode token / finish (median, p99, total), total manager time,
   the ratios, and the prefix-hit tokens of each (they must be equal); `--baseline PATH` adds
   another checkout's manager (e.g. a worktree of 27bf799) to the rounds;
2. per-operation cost at pool sizes 10^3..10^6 blocks, against a deque.remove free list;
3. chained hashing cost per block for the four algorithms (bench/hashing_cost.py);
4. KV memory waste and peak concurrency, paged vs. contiguous max_model_len reservation.

    python -m bench.block_manager [--quick] [--json PATH] [--seed N] [--rounds N]
        [--replay-only] [--no-fetch] [--no-vllm] [--no-lean] [--baseline PATH ...]

Without vLLM (no network for the first fetch, an import failure) the replay says so and
runs PageKV alone: there is no stored vLLM figure to fall back on.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from array import array
from collections import deque
from pathlib import Path

from bench.machine import machine_info
from bench.stats import pct
from bench.trace import TraceRequest, make_trace
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request

BS = 16
NUM_BLOCKS = 32768
WATERMARK = 0.01
HASH_ALGO = "sha256"  # PageKV's default, and vLLM's (pickle + SHA-256, the same bytes)
MAX_MODEL_LEN = 4096  # the trace's longest request is 3,000 + 200 tokens
# The replay's trace: a seed never used while tuning the manager (tuning used seed 0).
HELD_OUT_SEED = 25
OPS = ("admit", "decode", "finish")
clock = time.perf_counter_ns


# -- the managers, each through its public face ------------------------------------------------
class PageKVFace:
    """PageKV's manager: `lookup` → `allocate_slots(request, n, hit)` per admission,
    `append_output_token_ids` + `allocate_slots(request, 1)` per decode token, `free`.
    Hashing is the manager's own (at lookup, and as tokens are appended)."""

    def __init__(self, name: str, manager_cls=KVCacheManager, request_cls=Request,
                 num_blocks: int = NUM_BLOCKS, queue_factory=None) -> None:
        self.name = name
        self.manager_cls = manager_cls
        self.request_cls = request_cls
        self.num_blocks = num_blocks
        self.queue_factory = queue_factory

    def reset(self) -> None:
        self.mgr = self.manager_cls(self.num_blocks, BS, hash_algo=HASH_ALGO,
                                    watermark=WATERMARK)
        if self.queue_factory is not None:
            pool = self.mgr.block_pool
            pool.free_block_queue = self.queue_factory(pool.blocks)
        self.block_ops = 0

    def request(self, tr: TraceRequest):
        return self.request_cls(tr.request_id, tr.prompt)

    def admit(self, req, any_running: bool) -> tuple[int, int] | None:
        """(ns, hit tokens), or None when it does not fit (and nothing changed)."""
        mgr = self.mgr
        t0 = clock()
        hit = mgr.lookup(req)
        new = mgr.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
        t1 = clock()
        if new is None:
            return None
        self.block_ops += len(new) + len(hit.blocks)
        req.num_computed_tokens = req.num_tokens
        return t1 - t0, hit.num_tokens

    def decode(self, req, token: int) -> int:
        mgr = self.mgr
        t0 = clock()
        req.append_output_token_ids(token)
        new = mgr.allocate_slots(req, 1)
        t1 = clock()
        if new is None:
            raise RuntimeError("pool too small for the replay; raise num_blocks")
        self.block_ops += len(new)
        req.num_computed_tokens += 1
        return t1 - t0

    def finish(self, req) -> int:
        self.block_ops += len(self.mgr.get_blocks(req.request_id))
        t0 = clock()
        self.mgr.free(req)
        return clock() - t0

    def end_step(self) -> None:
        self.mgr.take_events()


class OldPageKVFace(PageKVFace):
    """A checkout from before #12 (no `lookup`): `get_computed_blocks` → (blocks, tokens),
    `allocate_slots(request, n, tokens, blocks)`."""

    def admit(self, req, any_running: bool) -> tuple[int, int] | None:
        mgr = self.mgr
        t0 = clock()
        hits, n = mgr.get_computed_blocks(req)
        new = mgr.allocate_slots(req, req.num_tokens - n, n, hits)
        t1 = clock()
        if new is None:
            return None
        self.block_ops += len(new) + len(hits)
        req.num_computed_tokens = req.num_tokens
        return t1 - t0, n


class VllmFace:
    """vLLM 0.33's manager as its scheduler drives it: `get_computed_blocks` →
    `allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)`
    and `record_prefix_cache_stats` per admission, `allocate_slots(request, 1)` per decode
    token, `free`. Prefix caching on, block size 16, the same usable pool, watermark and
    hash; KV events and prefix stats on, as PageKV's manager always makes both (`lean`:
    both off, vLLM's cheapest configuration, to show the comparison does not hinge on them).

    vLLM hashes in its Request (`update_block_hashes`: `block_hashes.extend(block_hasher(req))`)
    at creation and after each append. Requests are made here without the hasher and that same
    call is made inside the timed admission and decode, so vLLM's hashing is counted in vLLM's
    time and its Request construction is not (as PageKV's is not)."""

    def __init__(self, v, num_blocks: int = NUM_BLOCKS, lean: bool = False) -> None:
        self.name = f"vLLM {v.version}" + (" lean" if lean else "")
        self.v = v
        self.lean = lean
        self.num_blocks = num_blocks
        hash_fn = v.hash_fns[HASH_ALGO]
        v.init_none_hash(hash_fn)  # the chain's root, from vLLM's default seed
        self.hasher = v.get_request_block_hasher(BS, hash_fn)
        spec = v.FullAttentionSpec(block_size=BS, num_kv_heads=8, head_size=64,
                                   dtype=v.float16)
        self.group = v.KVCacheGroupSpec(["layers.0.attn"], spec)

    def reset(self) -> None:
        v = self.v
        # vLLM keeps block 0 as its null block: one more gives the same usable pool.
        config = v.KVCacheConfig(num_blocks=self.num_blocks + 1, kv_cache_tensors=[],
                                 kv_cache_groups=[self.group])
        self.mgr = v.KVCacheManager(
            config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BS, hash_block_size=BS,
            enable_caching=True, log_stats=not self.lean, enable_kv_cache_events=not self.lean,
            watermark=WATERMARK,
        )
        self.running = v.RequestStatus.RUNNING

    def request(self, tr: TraceRequest):
        v = self.v
        return v.Request(tr.request_id, list(tr.prompt),
                         v.SamplingParams(max_tokens=len(tr.output)), None)

    def admit(self, req, any_running: bool) -> tuple[int, int] | None:
        mgr = self.mgr
        t0 = clock()
        req.block_hashes.extend(self.hasher(req))
        blocks, n, _ = mgr.get_computed_blocks(req)
        new = mgr.allocate_slots(req, req.num_tokens - n, n, blocks,
                                 has_scheduled_reqs=any_running)
        if new is not None and not self.lean:
            mgr.record_prefix_cache_stats(req, n)
        t1 = clock()
        if new is None:
            return None
        req.num_computed_tokens = req.num_tokens
        req.status = self.running  # the scheduler's step, not the manager's
        return t1 - t0, n

    def decode(self, req, token: int) -> int:
        mgr = self.mgr
        t0 = clock()
        req.append_output_token_ids(token)
        req.block_hashes.extend(self.hasher(req))
        new = mgr.allocate_slots(req, 1)
        t1 = clock()
        if new is None:
            raise RuntimeError("pool too small for the replay; raise num_blocks")
        req.num_computed_tokens += 1
        return t1 - t0

    def finish(self, req) -> int:
        t0 = clock()
        self.mgr.free(req)
        return clock() - t0

    def end_step(self) -> None:
        self.mgr.take_events()


# -- the replay ------------------------------------------------------------------------------
def replay(face, trace: list[TraceRequest], max_running: int = 64) -> dict:
    """Interleave arrivals, one decode token per running request per step, and completions;
    each manager call timed on its own (ns)."""
    face.reset()
    times = {op: array("q") for op in OPS}
    t_admit, t_decode, t_free = times["admit"], times["decode"], times["finish"]
    hit_tokens = 0
    pending = deque(trace)
    waiting: deque[TraceRequest] = deque()
    running: dict[str, list] = {}  # request id -> [request, trace entry, tokens decoded]
    step = 0
    gc.collect()
    gc.disable()  # a collection pause inside one timed call would be noise, not manager cost
    try:
        while pending or waiting or running:
            while pending and pending[0].arrival_step <= step:
                waiting.append(pending.popleft())
            while waiting and len(running) < max_running:
                tr = waiting[0]
                req = face.request(tr)
                got = face.admit(req, bool(running))
                if got is None:
                    break
                t_admit.append(got[0])
                hit_tokens += got[1]
                running[tr.request_id] = [req, tr, 0]
                waiting.popleft()
            finished = []
            for rid, entry in running.items():
                req, tr, pos = entry
                t_decode.append(face.decode(req, tr.output[pos]))
                entry[2] = pos + 1
                if pos + 1 == len(tr.output):
                    finished.append(rid)
            for rid in finished:
                t_free.append(face.finish(running.pop(rid)[0]))
            face.end_step()
            step += 1
    finally:
        gc.enable()
    out: dict = {op: times[op] for op in OPS}
    out["total_s"] = {op: sum(times[op]) / 1e9 for op in OPS}
    out["total_manager_s"] = sum(out["total_s"].values())
    out["hit_tokens"] = hit_tokens
    out["query_tokens"] = sum(len(t.prompt) for t in trace)
    if isinstance(face, PageKVFace):
        out["block_ops_per_s"] = face.block_ops / out["total_manager_s"]
    return out


def import_checkout(root: Path) -> tuple[type, type, bool]:
    """(KVCacheManager, Request, has `lookup`) of another checkout of this repository (e.g. a
    worktree of 27bf799), imported in this process: while it loads, the package names it uses
    (pagekv.*, or kvnode.* before #13) point at that checkout; then ours are put back."""
    tops = {"pagekv", "kvnode", "proto", "router", "tiers"}
    ours = {k: m for k, m in sys.modules.items() if k.split(".")[0] in tops}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        if (root / "kvnode" / "memory").is_dir():
            mgr_mod = importlib.import_module("pagekv.kvnode.memory.kv_cache_manager")
            req_mod = importlib.import_module("pagekv.kvnode.memory.request")
        else:
            mgr_mod = importlib.import_module("kvnode.kv_cache_manager")
            req_mod = importlib.import_module("kvnode.request")
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k.split(".")[0] in tops]:
            del sys.modules[k]
        sys.modules.update(ours)
    cls = mgr_mod.KVCacheManager
    return cls, req_mod.Request, hasattr(cls, "lookup")


def same_block_hashes(faces: list, tr: TraceRequest) -> bool:
    """Whether every manager hashes this request's blocks to the same bytes."""
    chains = []
    for face in faces:
        face.reset()
        req = face.request(tr)
        face.admit(req, False)
        chains.append(list(req.block_hashes))
    return all(c == chains[0] for c in chains) and bool(chains[0])


def compare(faces: list, trace: list[TraceRequest], rounds: int) -> dict[str, list[dict]]:
    """Every manager replays the same trace, alternating, `rounds` times."""
    runs: dict[str, list[dict]] = {f.name: [] for f in faces}
    for _ in range(rounds):
        for face in faces:
            runs[face.name].append(replay(face, trace))
    return runs


def summarize(runs: list[dict]) -> dict:
    """Per op: median and p99 over every round's calls, total = median of the rounds' sums."""
    row: dict = {}
    for op in OPS:
        pooled = [t for r in runs for t in r[op]]
        row[op] = {"median_us": statistics.median(pooled) / 1e3, "p99_us": pct(pooled, 0.99) / 1e3,
                   "total_s": statistics.median(r["total_s"][op] for r in runs),
                   "calls": len(runs[0][op])}
    row["total_manager_s"] = statistics.median(r["total_manager_s"] for r in runs)
    row["round_totals_s"] = [r["total_manager_s"] for r in runs]
    row["hit_tokens"] = sorted({r["hit_tokens"] for r in runs})
    row["query_tokens"] = runs[0]["query_tokens"]
    return row


def print_replay(rows: dict[str, dict], ours: str) -> dict:
    """The per-op table of every manager, and each one's total time over ours; the total's
    ratio is the median of the rounds' ratios (each round's runs are adjacent in time)."""
    names = list(rows)
    others = [n for n in names if n != ours]
    per_round = {n: [a / b for a, b in zip(rows[n]["round_totals_s"],
                                           rows[ours]["round_totals_s"], strict=True)]
                 for n in others}
    ratios = {n: statistics.median(per_round[n]) for n in others}
    print("| op | " + " | ".join(f"{n} median µs | {n} p99 µs | {n} total s" for n in names)
          + "".join(f" | {n} / {ours}" for n in others) + " |")
    print("|---|" + "---|---|---|" * len(names) + "---|" * len(others))
    for op in OPS:
        cells = [f"{rows[n][op]['median_us']:.2f} | {rows[n][op]['p99_us']:.2f} | "
                 f"{rows[n][op]['total_s']:.3f}" for n in names]
        op_ratios = [f"{rows[n][op]['total_s'] / rows[ours][op]['total_s']:.2f}x"
                     for n in others]
        print(f"| {op} ({rows[ours][op]['calls']:,} calls) | " + " | ".join(cells)
              + "".join(f" | {r}" for r in op_ratios) + " |")
    total = ["**total**"]
    for n in names:
        total += ["", "", f"**{rows[n]['total_manager_s']:.3f}**"]
    total += [f"**{ratios[n]:.2f}x**" for n in others]
    print("| " + " | ".join(total) + " |")
    print()
    for n in names:
        rt = ", ".join(f"{t:.3f}" for t in rows[n]["round_totals_s"])
        hits = ", ".join(map(str, rows[n]["hit_tokens"]))
        print(f"- {n}: round totals {rt} s; prefix-hit tokens {hits} "
              f"of {rows[n]['query_tokens']} prompt tokens")
    for n in others:
        print(f"- {n} / {ours}, round by round: "
              + ", ".join(f"{x:.2f}x" for x in per_round[n]))
    distinct = {tuple(rows[n]["hit_tokens"]) for n in names}  # over managers and rounds
    same = len(distinct) == 1 and len(next(iter(distinct))) == 1
    print(f"- identical hit tokens: {'yes' if same else 'NO'}")
    return {"ratios_vs_ours": ratios, "identical_hit_tokens": same}


# -- pool-size scaling --------------------------------------------------------------------
class DequeFreeQueue:
    """The naive free list, same interface as FreeKVCacheBlockQueue: `remove` of a prefix
    hit from the middle is O(n) in the pool size."""

    def __init__(self, blocks):
        self.q = deque(blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.q)

    def popleft(self):
        return self.q.popleft()

    def popleft_n(self, n):
        return [self.q.popleft() for _ in range(n)]

    def remove(self, b):
        self.q.remove(b)

    def remove_n(self, blocks):
        for b in blocks:
            self.q.remove(b)

    def append(self, b):
        self.q.append(b)

    def append_n(self, blocks):
        self.q.extend(blocks)

    def prepend_n(self, blocks):
        self.q.extendleft(reversed(blocks))


def scaling(trace: list[TraceRequest], sizes: list[int], num_requests: int) -> list[dict]:
    """Mean µs per manager operation (admit, decode token, finish) for the same requests on
    pools of growing size, with the linked free queue and with a deque-based one."""
    rows = []
    for n in sizes:
        row: dict = {"num_blocks": n}
        for name in ("linked", "deque"):
            # deque.remove scans the pool: keep its run short on big pools.
            reqs = num_requests if name == "linked" else max(20, num_requests * 1000 // n)
            face = PageKVFace(name, num_blocks=n,
                              queue_factory=None if name == "linked" else DequeFreeQueue)
            r = replay(face, trace[:reqs], max_running=4)
            calls = sum(len(r[op]) for op in OPS)
            row[f"{name}_us"] = r["total_manager_s"] * 1e6 / calls
            row[f"{name}_requests"] = reqs
        rows.append(row)
    return rows


# -- memory waste and concurrency -----------------------------------------------------------
def memory_waste(trace: list[TraceRequest], num_blocks: int, max_model_len: int) -> dict:
    """Same trace, same memory: paged allocation vs. reserving max_model_len per request.

    Waste = reserved token slots not holding a token, averaged over steps. Prefix sharing
    is off here so the comparison isolates fragmentation.
    """
    capacity_tokens = num_blocks * BS
    out = {}
    for mode in ("paged", "contiguous"):
        mgr = KVCacheManager(num_blocks, BS, enable_caching=False, watermark=0)
        slots_contig = capacity_tokens // max_model_len
        headroom = num_blocks // 20  # room for running decodes, as a scheduler's watermark
        pending = deque(t for t in trace if len(t.prompt) + len(t.output) <= max_model_len)
        running: dict[str, tuple[Request, TraceRequest]] = {}
        peak = 0
        waste_sum = 0.0
        steps = 0
        preempted: list[str] = []
        while (pending or running) and steps < 3000:
            while pending:  # saturated: a request is always waiting
                tr = pending[0]
                req = Request(tr.request_id, tr.prompt)
                if mode == "contiguous":
                    if len(running) >= slots_contig:
                        break
                elif (
                    mgr.get_num_free_blocks() < headroom
                    or mgr.allocate_slots(req, req.num_tokens) is None
                ):
                    break
                req.num_computed_tokens = req.num_tokens
                running[tr.request_id] = (req, tr)
                pending.popleft()
            peak = max(peak, len(running))
            done = []
            for rid, (req, tr) in list(running.items()):
                if rid in preempted:
                    continue
                pos = len(req.output_token_ids)
                req.append_output_token_ids(tr.output[pos])
                if mode == "paged":
                    while mgr.allocate_slots(req, 1) is None:
                        # Out of blocks: the newest request gives its blocks back and requeues.
                        victim_id = next(
                            v for v in reversed(running) if v not in preempted and v not in done
                        )
                        vreq, vtr = running[victim_id]
                        mgr.free(vreq)
                        preempted.append(victim_id)
                        pending.appendleft(vtr)
                        if victim_id == rid:
                            break
                    if rid in preempted:
                        continue
                req.num_computed_tokens += 1
                if pos + 1 == len(tr.output):
                    done.append(rid)
            used = sum(r.num_tokens for k, (r, _) in running.items() if k not in preempted)
            if mode == "paged":
                reserved = (num_blocks - mgr.get_num_free_blocks()) * BS
            else:
                reserved = len(running) * max_model_len
            if reserved:
                waste_sum += 1 - used / reserved
                steps += 1
            for rid in preempted:
                running.pop(rid)
            preempted.clear()
            for rid in done:
                req, _ = running.pop(rid)
                if mode == "paged":
                    mgr.free(req)
        out[mode] = {"peak_concurrency": peak, "waste": waste_sum / max(1, steps)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs, < 60 s")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seed", type=int, default=HELD_OUT_SEED,
                    help=f"the replay trace's seed (default {HELD_OUT_SEED}, held out)")
    ap.add_argument("--rounds", type=int, help="replay rounds per manager (2 quick, 3 full)")
    ap.add_argument("--no-fetch", action="store_true",
                    help="do not download vLLM; compare only if it was fetched before")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison")
    ap.add_argument("--no-lean", action="store_true",
                    help="skip the second vLLM run with KV events and prefix stats off")
    ap.add_argument("--baseline", action="append", default=[], metavar="PATH",
                    help="another checkout's manager to replay too (e.g. a worktree of 27bf799)")
    ap.add_argument("--replay-only", action="store_true", help="only the replay section")
    args = ap.parse_args()
    n_req = 1500 if args.quick else 5000
    rounds = args.rounds or (2 if args.quick else 3)
    info = machine_info()
    print(f"# Block manager benchmark — {info}")

    ours = "PageKV"
    faces: list = [PageKVFace(ours)]
    if not args.no_vllm:
        from bench import vllm_reference

        v = vllm_reference.load(allow_fetch=not args.no_fetch)
        if isinstance(v, str):
            print(f"\n**No vLLM comparison**: {v}.")
        else:
            faces.append(VllmFace(v))
            if not args.no_lean:
                faces.append(VllmFace(v, lean=True))
    for path in args.baseline:
        root = Path(path).resolve()
        mgr_cls, req_cls, has_lookup = import_checkout(root)
        face_cls = PageKVFace if has_lookup else OldPageKVFace
        faces.append(face_cls(root.name, mgr_cls, req_cls))

    trace = make_trace(n_req, seed=args.seed)
    same_hash = same_block_hashes(faces, trace[0])
    runs = compare(faces, trace, rounds)
    rows = {name: summarize(r) for name, r in runs.items()}
    decode_calls = rows[ours]["decode"]["calls"]
    print(f"\n## Replay: {n_req} requests (trace seed {args.seed}), {decode_calls} decode tokens, "
          f"{rounds} rounds alternating {', '.join(rows)}")
    print(f"PageKV: {statistics.median(r['block_ops_per_s'] for r in runs[ours]) / 1e6:.2f} "
          f"M block ops/s; block hashes byte-identical across managers: "
          f"{'yes' if same_hash else 'NO'} ({HASH_ALGO})\n")
    verdict = print_replay(rows, ours)
    q = rows[ours]["query_tokens"]
    print(f"\nPrefix hit rate: {rows[ours]['hit_tokens'][0] / q:.1%}")
    if args.replay_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "seed": args.seed, "rounds": rounds,
                           "replay": rows, "same_block_hashes": same_hash, **verdict}, f, indent=2)
        return

    trace0 = make_trace(n_req)  # the other sections' trace (seed 0, as before)
    sizes = [10**3, 10**4, 10**5] + ([] if args.quick else [10**6])
    sc = scaling(trace0, sizes, 300 if args.quick else 1000)
    print("\n## Mean µs per manager operation vs pool size (same requests, 4 running)")
    print("| blocks | linked free queue µs | deque free list µs |")
    print("|---|---|---|")
    for row in sc:
        print(f"| {row['num_blocks']:,} | {row['linked_us']:.2f} | {row['deque_us']:.2f} |")
    flat = sc[-1]["linked_us"] / sc[0]["linked_us"]
    deq = sc[-1]["deque_us"] / sc[0]["deque_us"]
    print(f"largest/smallest: linked {flat:.2f}x (target ≤ 1.3x), deque {deq:.0f}x")

    from bench import hashing_cost
    hrows = hashing_cost.measure(args.quick)
    print("\n## Chained hashing per 16-token block (vLLM reference functions in the same run)")
    print("| algo | PageKV µs | vLLM µs | speed-up | serialization share (ours / vLLM) "
          "| byte-identical |")
    print("|---|---|---|---|---|---|")
    for h in hrows:
        print(f"| {h['algo']} | {h['ours_us']:.2f} | {h['ref_us']:.2f} | {h['speedup']:.2f}x "
              f"| {h['ours_ser_share']:.0%} / {h['ref_ser_share']:.0%} "
              f"| {'yes' if h['identical'] else 'NO'} |")

    mw = memory_waste(trace0, num_blocks=4096, max_model_len=4096)
    print("\n## KV memory waste and peak concurrency (4,096 blocks × 16 = 65,536 tokens, "
          "max_model_len 4,096)")
    print("| allocation | mean waste | peak concurrency |")
    print("|---|---|---|")
    for mode in ("paged", "contiguous"):
        print(f"| {mode} | {mw[mode]['waste']:.1%} | {mw[mode]['peak_concurrency']} |")
    print(f"paged/contiguous concurrency: "
          f"{mw['paged']['peak_concurrency'] / mw['contiguous']['peak_concurrency']:.1f}x")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "seed": args.seed, "rounds": rounds,
                       "replay": rows, "same_block_hashes": same_hash, **verdict,
                       "scaling": sc, "hashing": hrows, "memory": mw}, f, indent=2)


if __name__ == "__main__":
    main()

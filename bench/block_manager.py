"""Block-manager benchmark: replay a synthetic trace through the KV cache manager.

Prints, side by side in one run:
1. µs per admit / decode token / finish (median, p99) and block operations per second,
   against vLLM 0.33's KVCacheManager figures measured on this machine kind (the anchor);
2. per-operation cost at pool sizes 10^3..10^6 blocks, against a deque.remove free list;
3. chained hashing cost per block for the four algorithms (bench/hashing_cost.py);
4. KV memory waste and peak concurrency, paged vs. contiguous max_model_len reservation;
5. prefix hit rate.

    python -m bench.block_manager [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import deque

from bench.machine import machine_info
from bench.stats import pct
from bench.trace import TraceRequest, make_trace
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request

BS = 16
# vLLM 0.33 KVCacheManager replaying a 5,000-request trace of this shape on this machine kind
# (from the issue; vLLM is not installable here without a CUDA build).
VLLM_ANCHOR_US = {"admit": 280.0, "decode": 7.8, "finish": 32.0}



def replay(
    trace: list[TraceRequest], num_blocks: int, max_running: int = 64, queue_factory=None
) -> dict:
    """Interleave arrivals, one decode token per running request per step, and completions."""
    mgr = KVCacheManager(num_blocks, BS, watermark=0.01)
    if queue_factory is not None:
        pool = mgr.block_pool
        pool.free_block_queue = queue_factory(pool.blocks)
    t_admit: list[float] = []
    t_decode: list[float] = []
    t_free: list[float] = []
    block_ops = 0
    pending = deque(trace)
    waiting: deque[TraceRequest] = deque()
    running: dict[str, tuple[Request, TraceRequest]] = {}
    step = 0
    clock = time.perf_counter_ns
    gc.disable()  # a collection pause inside one timed call would be noise, not manager cost
    try:
        while pending or waiting or running:
            while pending and pending[0].arrival_step <= step:
                waiting.append(pending.popleft())
            while waiting and len(running) < max_running:
                tr = waiting[0]
                req = Request(tr.request_id, tr.prompt)
                t0 = clock()
                hit = mgr.lookup(req)
                new = mgr.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
                t1 = clock()
                if new is None:
                    break
                t_admit.append((t1 - t0) / 1000)
                block_ops += len(new) + len(hit.blocks)
                req.num_computed_tokens = req.num_tokens
                running[tr.request_id] = (req, tr)
                waiting.popleft()
            finished = []
            for rid, (req, tr) in running.items():
                pos = len(req.output_token_ids)
                t0 = clock()
                req.append_output_token_ids(tr.output[pos])
                new = mgr.allocate_slots(req, 1)
                t1 = clock()
                if new is None:
                    raise RuntimeError("pool too small for the replay; raise num_blocks")
                t_decode.append((t1 - t0) / 1000)
                block_ops += len(new)
                req.num_computed_tokens += 1
                if pos + 1 == len(tr.output):
                    finished.append(rid)
            for rid in finished:
                req, _ = running.pop(rid)
                nblk = len(mgr.req_to_blocks[rid])
                t0 = clock()
                mgr.free(req)
                t1 = clock()
                t_free.append((t1 - t0) / 1000)
                block_ops += nblk
            mgr.take_events()
            step += 1
    finally:
        gc.enable()
    total_s = (sum(t_admit) + sum(t_decode) + sum(t_free)) / 1e6
    return {
        "admit": t_admit,
        "decode": t_decode,
        "finish": t_free,
        "total_manager_s": total_s,
        "block_ops_per_s": block_ops / total_s,
        "hit_rate": mgr.metrics.hit_rate,
        "hit_tokens": mgr.metrics.prefix_hits_tokens,
        "query_tokens": mgr.metrics.prefix_queries_tokens,
    }


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
            mgr_times: list[float] = []
            r = replay(trace[:reqs], num_blocks=n, max_running=4,
                       queue_factory=None if name == "linked" else DequeFreeQueue)
            mgr_times = r["admit"] + r["decode"] + r["finish"]
            row[f"{name}_us"] = statistics.fmean(mgr_times)
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
    args = ap.parse_args()
    n_req = 1500 if args.quick else 5000
    trace = make_trace(n_req)
    info = machine_info()
    print(f"# Block manager benchmark — {info}")

    r = replay(trace, num_blocks=32768)
    print(f"\n## Replay: {n_req} requests, {len(r['decode'])} decode tokens, "
          f"manager time {r['total_manager_s']:.2f} s, "
          f"{r['block_ops_per_s'] / 1e6:.2f} M block ops/s")
    print("| op | PageKV median µs | PageKV p99 µs | vLLM 0.33 median µs | speed-up |")
    print("|---|---|---|---|---|")
    replay_rows = {}
    for op in ("admit", "decode", "finish"):
        med = statistics.median(r[op])
        p99 = pct(r[op], 0.99)
        ratio = VLLM_ANCHOR_US[op] / med
        replay_rows[op] = {"median_us": med, "p99_us": p99, "speedup_vs_vllm": ratio}
        print(f"| {op} | {med:.2f} | {p99:.2f} | {VLLM_ANCHOR_US[op]} | {ratio:.1f}x |")
    print(f"\nPrefix hit rate: {r['hit_rate']:.1%} "
          f"({r['hit_tokens']} of {r['query_tokens']} prompt tokens)")

    sizes = [10**3, 10**4, 10**5] + ([] if args.quick else [10**6])
    sc = scaling(trace, sizes, 300 if args.quick else 1000)
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

    mw = memory_waste(trace, num_blocks=4096, max_model_len=4096)
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
            json.dump({"machine": info, "replay": replay_rows, "hit_rate": r["hit_rate"],
                       "scaling": sc, "hashing": hrows, "memory": mw}, f, indent=2)


if __name__ == "__main__":
    main()

"""bench.block_manager's replay, without vLLM: every face replays the same trace to the same
prefix hits, the summary and the table agree with the runs, and another checkout's manager
imports beside ours without replacing it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench import block_manager as bm
from bench.trace import make_trace
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager

REPO = Path(__file__).resolve().parents[2]


def test_faces_replay_to_the_same_hits_and_the_summary_counts_every_call():
    trace = make_trace(60, seed=3)
    linked = bm.PageKVFace("linked", num_blocks=2048)
    deque_queue = bm.PageKVFace("deque", num_blocks=2048, queue_factory=bm.DequeFreeQueue)
    runs = bm.compare([linked, deque_queue], trace, rounds=2)
    rows = {name: bm.summarize(r) for name, r in runs.items()}
    assert rows["linked"]["hit_tokens"] == rows["deque"]["hit_tokens"]
    assert len(rows["linked"]["hit_tokens"]) == 1 and rows["linked"]["hit_tokens"][0] > 0
    decode_calls = sum(len(t.output) for t in trace)
    assert rows["linked"]["decode"]["calls"] == decode_calls
    assert rows["linked"]["admit"]["calls"] == rows["linked"]["finish"]["calls"] == len(trace)
    r = runs["linked"][0]
    assert r["total_manager_s"] == sum(r["total_s"].values()) > 0
    verdict = bm.print_replay(rows, "linked")
    assert verdict["identical_hit_tokens"] and verdict["ratios_vs_ours"]["deque"] > 0


def test_block_hashes_agree_between_faces():
    tr = make_trace(5, seed=4)[0]
    assert bm.same_block_hashes([bm.PageKVFace("a"), bm.PageKVFace("b")], tr)


def test_another_checkout_imports_beside_ours(tmp_path):
    """The HEAD commit's manager, as a --baseline would load it; our modules stay in place."""
    root = tmp_path / "head"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "kvnode", "proto",
                              "pagekv/__init__.py"], check=True, capture_output=True).stdout
    root.mkdir()
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    for link in ("kvnode", "proto"):  # a checkout's pagekv/ folders, as the repository has
        path = root / "pagekv" / link
        if not path.exists():
            path.symlink_to(Path("..") / link)
    mgr_cls, req_cls, has_lookup = bm.import_checkout(root)
    assert has_lookup and mgr_cls is not KVCacheManager
    code_file = Path(mgr_cls.allocate_slots.__code__.co_filename).resolve()
    assert code_file.is_relative_to(root.resolve())
    from pagekv.kvnode.memory import kv_cache_manager
    assert kv_cache_manager.KVCacheManager is KVCacheManager
    face = bm.PageKVFace("head", mgr_cls, req_cls, num_blocks=1024)
    ours = bm.PageKVFace("ours", num_blocks=1024)
    trace = make_trace(30, seed=5)
    assert bm.replay(face, trace)["hit_tokens"] == bm.replay(ours, trace)["hit_tokens"]

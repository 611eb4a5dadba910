"""bench/vllm_ingest.py's workload is what a vLLM pod sends: every batch passes the
ingester's checks (hashes follow from tokens and parents), and the pod's pool stays bounded."""

from __future__ import annotations

from bench.vllm_ingest import BS, SCHEMA, Workload
from pagekv.proto.hashing import HashConfig
from pagekv.proto.vllm_chain import VllmBlockBook
from pagekv.proto.vllm_events import WireBlockRemoved, decode_batch, encode_batch


def test_the_workload_is_accepted_and_bounded() -> None:
    work = Workload(blocks_per_event=4, pool=200, seed=3)
    book = VllmBlockBook(HashConfig(SCHEMA.hash_algo, SCHEMA.hash_seed), BS)
    removals = 0
    for _ in range(300):
        events, (key, field) = work.batch()
        removals += any(isinstance(e, WireBlockRemoved) for e in events)
        book.apply(decode_batch(encode_batch(0.0, events)).events)
        assert key.startswith(SCHEMA.prefix) and len(field) == 8  # a claims HASH's field
    assert not book.refused and book.ignored_removals == 0
    assert removals > 0 and len(book) <= 200 + 4
    assert work.blocks == book.blocks_stored + book.blocks_removed

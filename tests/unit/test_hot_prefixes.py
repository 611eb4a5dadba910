"""The pod's table of its most-hit prefixes (what a scale-out pod pre-warms): bounded in
entries and tokens, a hot prefix never lost to a stream of one-off ones."""

from __future__ import annotations

from pagekv.kvnode.engine.hot_prefixes import HotPrefixes


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_the_most_hit_come_first_and_counts_add_up() -> None:
    hot = HotPrefixes(capacity=8)
    for _ in range(5):
        hot.record(key(1), [1] * 16, "s", None, "acme")
    hot.record(key(2), [2] * 32, None, "lora-a", "")
    top = hot.top(2)
    assert [(p.key, p.hits) for p in top] == [(key(1), 5), (key(2), 1)]
    assert (top[0].cache_salt, top[0].tenant, list(top[0].token_ids)) == ("s", "acme", [1] * 16)
    assert top[1].lora_id == "lora-a"


def test_a_stream_of_one_off_prefixes_never_pushes_out_a_hot_one() -> None:
    hot = HotPrefixes(capacity=4)
    for i in range(1000):
        hot.record(key(0), [0] * 16, None, None, "")  # one hit in every two records
        hot.record(key(100 + i), [i % 7] * 16, None, None, "")
    assert len(hot) == 4
    assert hot.top(1)[0].key == key(0) and hot.top(1)[0].hits == 1000


def test_the_tokens_kept_are_bounded() -> None:
    hot = HotPrefixes(capacity=100, max_tokens=64)
    for i in range(10):
        hot.record(key(i), [i] * 32, None, None, "")
    assert len(hot) == 2 and sum(len(p.token_ids) for p in hot.top(10)) <= 64
    hot.record(key(99), [1] * 65, None, None, "")  # larger than the whole table: not kept
    assert key(99) not in {p.key for p in hot.top(10)}

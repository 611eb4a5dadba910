"""What a pod hands the index writer, before any Redis: the ingester's placed claims
(proto.index.mirror.PlacedClaims) netted per hash, and the CLAIM_WRITES calls
(proto.index.writes.ClaimRecords): one record per claim, buckets grouped, calls bounded, one
bucket per call on a cluster."""

from __future__ import annotations

import pytest

from pagekv.proto.index import writes
from pagekv.proto.index.mirror import PlacedClaims
from pagekv.proto.index.schema import IndexSchema, claim_values

SCHEMA = IndexSchema("m", 16, "sha256", "seed")
H = [bytes([i]) * 32 for i in range(6)]


def test_placed_claims_net_each_hash_to_its_last_change() -> None:
    claims = PlacedClaims()
    out = claims.apply([[(H[0], 3, 0, 1), (H[1], 3, 0, 1)], [(H[0], 3, 1, 0), (H[2], 9, 0, 2)]])
    assert out == [(H[0], 3, 1, 0), (H[1], 3, 0, 1), (H[2], 9, 0, 2)]
    assert len(claims) == 2 and claims.unplaced == frozenset()
    wanted = claims.reset({3: {H[4].hex(): 1}, 5: {}})
    assert wanted == {3: {H[4].hex(): 1}} and len(claims) == 1
    claims.learn([object()])  # nothing to learn: the owner placed everything
    claims.clear()
    assert len(claims) == 0


def test_records_are_one_char_of_mask_and_the_hex_hash() -> None:
    recs = writes.ClaimRecords(len(claim_values("e")))
    recs.add(7, 3, H[0].hex())
    recs.add(7, 0, H[1].hex())
    recs.add(2, 1, H[2].hex())
    assert recs.by_bucket == {7: ["3" + H[0].hex(), "0" + H[1].hex()], 2: ["1" + H[2].hex()]}
    assert recs.claimed == {7, 2} and len(recs) == 3
    removals_only = writes.ClaimRecords(8)
    removals_only.add(4, 0, H[3].hex())
    assert removals_only.claimed == set()  # nothing to list for a removal


@pytest.mark.parametrize("one_bucket_each", [False, True])
def test_calls_stay_within_the_record_bound(one_bucket_each: bool, monkeypatch) -> None:
    monkeypatch.setattr(writes, "CLAIM_RECORDS", 3)
    recs = writes.ClaimRecords(8)
    for i in range(5):
        recs.add(1, 1, H[i].hex())
    recs.add(2, 2, H[5].hex())
    calls = list(recs.calls(SCHEMA, "pod", one_bucket_each))
    for keys, args in calls:
        assert len(args) == 2 * len(keys)
        assert sum(len(a) // 65 for a in args[1::2]) <= 3
        for key, base in zip(keys, args[0::2], strict=True):
            assert key.startswith(base)  # the bucket's SET is under the bucket's tag
    if one_bucket_each:  # a cluster: never two buckets (two hash tags) in one call
        assert all(len(set(keys)) == 1 for keys, _ in calls)
    else:
        assert len(calls) == 2  # 5 + 1 records, at most 3 a call: bucket 1's tail shares
    sent = "".join(a for _, args in calls for a in args[1::2])
    assert sent == "".join(recs.by_bucket[1] + recs.by_bucket[2])


def test_too_many_masks_for_one_char_are_refused() -> None:
    with pytest.raises(ValueError):
        writes.ClaimRecords(37)

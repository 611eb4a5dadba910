"""What a pod hands the index writer, before any Redis: the ingester's placed claims
(proto.index.mirror.PlacedClaims) netted per hash, and the CLAIM_WRITES calls
(proto.index.writes.ClaimRecords): one record per claim, buckets grouped, calls bounded, one
bucket per call on a cluster; claim fields and claim ids."""

from __future__ import annotations

import pytest

from pagekv.proto.index import writes
from pagekv.proto.index.bad_records import BAD_REGISTRATION, BadRecords
from pagekv.proto.index.mirror import PlacedClaims
from pagekv.proto.index.pod_record import parse_pod_record
from pagekv.proto.index.schema import (
    FIELD_BYTES,
    IndexSchema,
    claim_field,
    claim_field_hex,
    new_claim_id,
    valid_claim_id,
)

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


def test_records_are_one_byte_of_mask_and_the_claim_field() -> None:
    recs = writes.ClaimRecords()
    recs.add(7, 3, claim_field(H[0]))
    recs.add(7, 0, claim_field(H[1]))
    recs.add(2, 1, claim_field(H[2]))
    assert recs.by_bucket == {7: [b"\x03" + H[0][-8:], b"\x00" + H[1][-8:]],
                              2: [b"\x01" + H[2][-8:]]}
    assert recs.claimed == {7, 2} and len(recs) == 3
    removals_only = writes.ClaimRecords()
    removals_only.add(4, 0, claim_field(H[3]))
    assert removals_only.claimed == set()  # nothing to list for a removal


def test_claim_fields_are_a_hash_tail_of_fixed_width() -> None:
    assert claim_field(H[1]) == H[1][-FIELD_BYTES:]
    assert claim_field_hex(H[1].hex()) == claim_field(H[1])
    assert claim_field(b"\x05\x06") == b"\0" * 6 + b"\x05\x06"  # a short hash, padded
    assert claim_field_hex("0506") == claim_field(b"\x05\x06")


def test_claim_ids_never_hold_the_lookups_separators() -> None:
    ids = [new_claim_id() for _ in range(2000)]
    assert all(valid_claim_id(c) for c in ids)
    assert len(set(ids)) > 1990  # random (a repeat among 2000 is a 1 in 2,000 chance)
    assert not valid_claim_id(b"\x00abc") and not valid_claim_id(b"ab\x01c")
    assert not valid_claim_id(b"abc")


@pytest.mark.parametrize("one_bucket_each", [False, True])
def test_calls_stay_within_the_record_bound(one_bucket_each: bool, monkeypatch) -> None:
    monkeypatch.setattr(writes, "CLAIM_RECORDS", 3)
    recs = writes.ClaimRecords()
    for i in range(5):
        recs.add(1, 1, claim_field(H[i]))
    recs.add(2, 2, claim_field(H[5]))
    calls = list(recs.calls(SCHEMA, one_bucket_each))
    for keys, args in calls:
        assert len(args) == len(keys)
        assert sum(len(a) // (1 + FIELD_BYTES) for a in args) <= 3
        for key in keys:
            assert key in (SCHEMA.claims_key(1), SCHEMA.claims_key(2))
    if one_bucket_each:  # a cluster: never two buckets (two hash tags) in one call
        assert all(len(set(keys)) == 1 for keys, _ in calls)
    else:
        assert len(calls) == 2  # 5 + 1 records, at most 3 a call: bucket 1's tail shares
    sent = b"".join(a for _, args in calls for a in args)
    assert sent == b"".join(recs.by_bucket[1] + recs.by_bucket[2])


def test_a_mask_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError):
        writes.ClaimRecords().add(1, 8, claim_field(H[0]))


def test_a_registration_whose_claim_is_not_a_claim_id_counts_none() -> None:
    flat = ["address", "127.0.0.1:1", "epoch", "e", "claim", "00000000"]  # bytes 0: no id
    bad = BadRecords()
    info = parse_pod_record(["p", "e", 1000, flat], bad)
    assert info is not None and info.claim_id == b""  # routed by load, no claim counts
    assert bad.counts[BAD_REGISTRATION] == 1
    good = new_claim_id()
    bad = BadRecords()
    info = parse_pod_record(["p", "e", 1000, [*flat[:-1], good.hex()]], bad)
    assert info is not None and info.claim_id == good and not any(bad.counts.values())

"""vLLM's KV-event wire format (proto/vllm_events.py): each event type's exact msgpack bytes,
compared with msgpack assembled by hand here (not by msgspec), in both of vLLM's event forms
and both hash forms; decoding every form; the short hash's byte order; sequence frames."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest

from pagekv.proto import kv_events
from pagekv.proto.medium import Medium
from pagekv.proto.vllm_events import (
    END_SEQ,
    MASK64,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireError,
    decode_batch,
    encode_batch,
    seq_from_bytes,
    seq_to_bytes,
    short_hash,
    to_wire,
)


# -- a minimal msgpack writer, for the expected bytes ------------------------------------------
def s(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def u(n: int) -> bytes:
    if n < 128:
        return bytes([n])
    if n < 256:
        return b"\xcc" + bytes([n])
    if n < 1 << 16:
        return b"\xcd" + n.to_bytes(2, "big")
    if n < 1 << 32:
        return b"\xce" + n.to_bytes(4, "big")
    return b"\xcf" + n.to_bytes(8, "big")


def b(raw: bytes) -> bytes:
    return b"\xc4" + bytes([len(raw)]) + raw


def f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


NIL = b"\xc0"


def arr(*items: bytes) -> bytes:
    assert len(items) < 16
    return bytes([0x90 | len(items)]) + b"".join(items)


def mp(*pairs: tuple[str, bytes]) -> bytes:
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(s(k) + v for k, v in pairs)


H1, H2 = 0x0123456789ABCDEF, 0xFEDCBA9876543210
D1, D2 = hashlib.sha256(b"one").digest(), hashlib.sha256(b"two").digest()


def stored_map(hashes: bytes, parent: bytes) -> bytes:
    return mp(("type", s("BlockStored")), ("block_hashes", hashes),
              ("parent_block_hash", parent), ("token_ids", arr(u(1), u(2), u(300), u(4))),
              ("block_size", u(2)), ("lora_id", NIL), ("medium", s("GPU")),
              ("lora_name", NIL))


# -- exact encodings -------------------------------------------------------------------------
def test_block_stored_map_form_bytes() -> None:
    ev = WireBlockStored([H1, H2], None, [1, 2, 300, 4], 2, None, "GPU", None)
    want = arr(f64(1.5), arr(stored_map(arr(u(H1), u(H2)), NIL)), u(0))
    assert encode_batch(1.5, [ev]) == want
    # Digests: msgpack bin, parent too; defaults (extra_keys, group_idx...) stay out.
    ev = WireBlockStored([D2], D1, [1, 2, 300, 4], 2, None, "GPU", None)
    assert encode_batch(1.5, [ev]) == arr(f64(1.5), arr(stored_map(arr(b(D2)), b(D1))), u(0))
    ev = WireBlockStored([H1], None, [1, 2], 2, 3, "CPU", "ad", group_idx=1)
    got = msgspec.msgpack.encode(ev)
    assert got == mp(("type", s("BlockStored")), ("block_hashes", arr(u(H1))),
                     ("parent_block_hash", NIL), ("token_ids", arr(u(1), u(2))),
                     ("block_size", u(2)), ("lora_id", u(3)), ("medium", s("CPU")),
                     ("lora_name", s("ad")), ("group_idx", u(1)))


def test_block_removed_and_cleared_map_form_bytes() -> None:
    events = [WireBlockRemoved([H1], "CPU"), WireAllBlocksCleared(),
              WireAllBlocksCleared("DISK")]
    want = arr(f64(2.0), arr(
        mp(("type", s("BlockRemoved")), ("block_hashes", arr(u(H1))), ("medium", s("CPU"))),
        mp(("type", s("AllBlocksCleared"))),
        mp(("type", s("AllBlocksCleared")), ("medium", s("DISK"))),
    ), NIL)
    assert encode_batch(2.0, events, data_parallel_rank=None) == want


def test_array_form_bytes() -> None:
    events = [WireBlockStored([H1], H2, [1, 2], 2, None, "GPU", None, extra_keys=[None]),
              WireBlockRemoved([D1], "GPU"), WireAllBlocksCleared(),
              WireAllBlocksCleared("CPU")]
    want = arr(f64(0.25), arr(
        arr(s("BlockStored"), arr(u(H1)), u(H2), arr(u(1), u(2)), u(2), NIL, s("GPU")),
        arr(s("BlockRemoved"), arr(b(D1)), s("GPU")),
        arr(s("AllBlocksCleared")),
        arr(s("AllBlocksCleared"), s("CPU")),
    ), u(0))
    assert encode_batch(0.25, events, form="array") == want
    with pytest.raises(ValueError, match="wire form"):
        encode_batch(0.0, events, form="json")


# -- decoding --------------------------------------------------------------------------------
def test_every_form_decodes_to_the_same_events() -> None:
    events = [WireBlockStored([H1, D1], None, [5, 6], 2, None, "GPU", None),
              WireBlockRemoved([H2], "CPU"), WireAllBlocksCleared(),
              WireAllBlocksCleared("DISK")]
    for form in ("map", "array"):
        batch = decode_batch(encode_batch(3.0, events, form=form, data_parallel_rank=2))
        assert batch.ts == 3.0 and batch.data_parallel_rank == 2 and not batch.skipped
        assert batch.events == events
    # A batch sent as a map (an EventBatch without array_like) reads the same.
    as_map = msgspec.msgpack.encode({"ts": 3.0, "events": events, "data_parallel_rank": 2})
    assert decode_batch(as_map).events == events


def test_older_and_newer_positional_events() -> None:
    raw = [1.0, [
        ["BlockStored", [H1], None, [1, 2], 2, None],  # before `medium` existed
        ["BlockRemoved", [H1]],
        ["BlockStored", [H2], H1, [3, 4], 2, None, "CPU", None, [None], 0, "full", None,
         "a field from the future"],
        ["AllBlocksCleared"],
    ]]
    batch = decode_batch(msgspec.msgpack.encode(raw))
    first, removed, third, cleared = batch.events
    assert first == WireBlockStored([H1], None, [1, 2], 2, None, None, None)
    assert removed == WireBlockRemoved([H1], None)
    assert third.medium == "CPU" and third.extra_keys == [None] and third.group_idx == 0
    assert third.kv_cache_spec_kind == "full"
    assert cleared == WireAllBlocksCleared()


def test_unknown_and_malformed_events_are_skipped_with_a_reason() -> None:
    raw = [1.0, [
        {"type": "TransferInitiated", "id": 3},  # an event type not read here
        {"type": "BlockStored", "block_hashes": "nope", "token_ids": []},
        ["BlockRemoved", [-1], "GPU"],  # a signed 64-bit hash: the same 64 bits
        {"type": "BlockStored", "block_hashes": [H1], "token_ids": [1, 2], "block_size": 2,
         "unknown_field": True},  # map forms ignore fields they do not know
        42,
    ]]
    batch = decode_batch(msgspec.msgpack.encode(raw))
    assert batch.skipped == ["unknown_event", "bad_event", "unknown_event"]
    assert batch.events[0] == WireBlockRemoved([MASK64], "GPU")
    assert batch.events[1].block_hashes == [H1] and batch.events[1].medium is None


def test_the_typed_path_and_the_field_by_field_path_read_the_same() -> None:
    """vLLM's own form is read by msgspec's typed decoder; what it refuses (a signed hash,
    here) is read field by field, with the same events as a result."""
    stored = WireBlockStored([H1, 7], 5, [1, 2, 3, 4], 2, None, "GPU", None)
    payload = encode_batch(3.5, [stored, WireBlockRemoved([7], "CPU")])
    batch = decode_batch(payload)
    assert batch.ts == 3.5 and batch.data_parallel_rank == 0 and not batch.skipped
    assert batch.events == [stored, WireBlockRemoved([7], "CPU")]
    signed = msgspec.msgpack.encode([3.5, [{"type": "BlockRemoved", "block_hashes": [-1, 7],
                                            "medium": "CPU"}], 0])
    assert decode_batch(signed).events == [WireBlockRemoved([MASK64, 7], "CPU")]


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"garbage!", msgspec.msgpack.encode(5),
                                     msgspec.msgpack.encode([1.0]),
                                     msgspec.msgpack.encode(["ts", []]),
                                     msgspec.msgpack.encode({"ts": 1.0, "events": 3})])
def test_garbage_is_a_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


# -- hashes and sequence numbers -----------------------------------------------------------
def test_short_hash_is_the_low_64_bits_big_endian() -> None:
    digest = bytes(range(32))
    assert short_hash(digest) == 0x18191A1B1C1D1E1F  # the last 8 bytes, most significant first
    assert short_hash(D1) == int(D1.hex()[-16:], 16)
    assert short_hash(b"\x01" * 8) == 0x0101010101010101


def test_sequence_frames() -> None:
    assert seq_to_bytes(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert seq_to_bytes(END_SEQ) == b"\xff" * 8
    assert seq_from_bytes(b"\xff" * 8) == END_SEQ
    assert seq_from_bytes(seq_to_bytes(2**40 + 7)) == 2**40 + 7
    with pytest.raises(ValueError, match="8 bytes"):
        seq_from_bytes(b"\x00\x01")


def test_pagekv_events_in_vllm_words() -> None:
    events = [kv_events.BlockStored([D1, D2], None, [1, 2, 3, 4], 2, None, Medium.GPU),
              kv_events.BlockStored([D2], D1, [3, 4], 2, 7, Medium.CPU),
              kv_events.BlockRemoved([D1], Medium.DISK),
              kv_events.AllBlocksCleared(Medium.CPU), kv_events.AllBlocksCleared()]
    short = to_wire(events, "int")
    assert short[0] == WireBlockStored([short_hash(D1), short_hash(D2)], None, [1, 2, 3, 4],
                                       2, None, "GPU", None)
    assert short[1].parent_block_hash == short_hash(D1) and short[1].lora_id == 7
    assert short[2] == WireBlockRemoved([short_hash(D1)], "DISK")
    assert short[3:] == [WireAllBlocksCleared("CPU"), WireAllBlocksCleared()]
    full = to_wire(events, "bytes")
    assert full[1].block_hashes == [D2] and full[1].parent_block_hash == D1
    assert type(full[3].medium) is str  # plain strings on the wire, not the enum
    with pytest.raises(ValueError, match="hash form"):
        to_wire(events, "hex")

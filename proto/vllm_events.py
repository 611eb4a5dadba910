"""vLLM's KV-event wire format: what a vLLM pod started with `--kv-events-config` (publisher
"zmq") sends, and what a PageKV pod sends with `--kv-events-zmq`.

Written from vLLM's documented schema (vllm/distributed/kv_events.py), not from its code:

* ZeroMQ PUB, one multipart message per batch: (topic, 8-byte big-endian sequence number,
  msgpack payload). Sequence numbers count batches from 0 per publisher process.
* Replay: a ROUTER socket. A client sends the first sequence number it misses (8 bytes, big
  endian); the publisher answers one message per buffered batch from there, then an end
  marker whose sequence number is -1 (signed) and whose payload is empty. Newer vLLM puts
  the topic in front of each answer ((topic, seq, payload)), older vLLM does not ((seq,
  payload)); both are read here.
* The payload is a msgspec-encoded batch `[ts, events, data_parallel_rank]` (a positional
  array; very recent vLLM may send it as a map with those keys). Each event is a tagged
  msgspec Struct, the tag under "type" and equal to the class name. vLLM before its PR
  #42892 sent events as positional arrays (`array_like=True`: `["BlockStored", hashes, ...]`),
  later versions as maps (`{"type": "BlockStored", "block_hashes": ...}`); fields were only
  ever appended, so an old array simply stops early.
* A block hash is `bytes | int` (vLLM's ExternalBlockHash). By default vLLM sends an int:
  the low 64 bits of the hash read as a big-endian number (`short_hash`); with
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 it sends the full digest.

`decode_batch` reads vLLM's current form by msgspec's typed decoding (in C, ~5x faster),
and every other form, or a batch that mixes in event types this module does not know (vLLM
keeps adding some), field by field: such a batch still yields the ones it knows.
No torch; the router's side may import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from pagekv.proto import kv_events
from pagekv.proto.kv_events import KVEvent

MASK64 = (1 << 64) - 1
END_SEQ = -1  # the replay's end marker, as a signed 8-byte number
WIRE_FORMS = ("map", "array")  # events as tagged maps (vLLM today) or positional arrays
HASH_FORMS = ("int", "bytes")  # vLLM's default short form, or the full digest

ExternalHash = int | bytes
# As the typed decoder reads one: a negative int (a producer sending the 64 bits signed)
# fails it, and the batch is read field by field, which takes the low 64 bits.
_WireHash = Annotated[int, msgspec.Meta(ge=0)] | bytes


def short_hash(full_hash: bytes) -> int:
    """vLLM's int form of a block hash: the digest as a big-endian number, low 64 bits."""
    return int.from_bytes(full_hash, "big") & MASK64


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def seq_from_bytes(frame: bytes) -> int:
    """A sequence frame; -1 is the replay's end marker. ValueError if not 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    value = int.from_bytes(frame, "big")
    return END_SEQ if value == MASK64 else value


# -- the events as vLLM declares them today (tagged maps) -----------------------------------
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class WireBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[_WireHash]
    parent_block_hash: _WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # one entry per block hash: its hash's extra keys
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class WireBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[_WireHash]
    medium: str | None
    group_idx: int | None = None


class WireAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    # PageKV's extension: the one tier that was cleared. Left out when None, which is
    # vLLM's own event (and means every tier here).
    medium: str | None = None


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


# -- the older positional form (vLLM's documented subscriber example) ------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag_field="type"):
    pass


class ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalHash]
    medium: str | None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayTierCleared(_ArrayEvent, tag="AllBlocksCleared"):
    """PageKV's one-tier clear in the positional form (a trailing element old readers skip;
    an array_like Struct writes every field, so vLLM's plain event needs its own class)."""

    medium: str


class ArrayEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _as_array(ev: WireEvent) -> _ArrayEvent:
    if isinstance(ev, WireBlockStored):
        return ArrayBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                ev.block_size, ev.lora_id, ev.medium)
    if isinstance(ev, WireBlockRemoved):
        return ArrayBlockRemoved(ev.block_hashes, ev.medium)
    return ArrayTierCleared(ev.medium) if ev.medium is not None else ArrayAllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: Sequence[WireEvent], form: str = "map",
                 data_parallel_rank: int | None = 0) -> bytes:
    """One batch's payload in `form` ("map": vLLM today; "array": before its PR #42892)."""
    if form == "map":
        return _ENCODER.encode(WireEventBatch(ts, list(events), data_parallel_rank))
    if form == "array":
        return _ENCODER.encode(ArrayEventBatch(ts, [_as_array(e) for e in events],
                                               data_parallel_rank))
    raise ValueError(f"unknown KV event wire form {form!r}; valid: {', '.join(WIRE_FORMS)}")


# -- PageKV's events in vLLM's words ---------------------------------------------------------
def to_wire(events: Iterable[KVEvent], hash_form: str = "int") -> list[WireEvent]:
    """PageKV's events as vLLM would send them, with hashes in `hash_form`."""
    if hash_form not in HASH_FORMS:
        raise ValueError(f"unknown hash form {hash_form!r}; valid: {', '.join(HASH_FORMS)}")
    short = hash_form == "int"
    out: list[WireEvent] = []
    for ev in events:
        if isinstance(ev, kv_events.BlockStored):
            parent = ev.parent_block_hash
            out.append(WireBlockStored(
                [short_hash(h) for h in ev.block_hashes] if short else list(ev.block_hashes),
                (short_hash(parent) if short else parent) if parent else None,
                list(ev.token_ids), ev.block_size, ev.lora_id, str(ev.medium), None))
        elif isinstance(ev, kv_events.BlockRemoved):
            out.append(WireBlockRemoved(
                [short_hash(h) for h in ev.block_hashes] if short else list(ev.block_hashes),
                str(ev.medium)))
        else:
            out.append(WireAllBlocksCleared(None if ev.medium is None else str(ev.medium)))
    return out


# -- reading a payload -----------------------------------------------------------------------
class WireError(ValueError):
    """A payload that is not a batch of KV events."""


@dataclass(slots=True)
class DecodedBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None
    # Events left out, one reason each: "unknown_event" (a type not read here) or
    # "bad_event" (a known type with a field of the wrong kind).
    skipped: list[str] = field(default_factory=list)


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_CLEARED_FIELDS = ("medium",)
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS,
           "AllBlocksCleared": _CLEARED_FIELDS}


class _BadEvent(Exception):
    pass


def _hash(value: Any) -> ExternalHash:
    t = type(value)  # not isinstance: a bool is no hash
    if t is int:
        number: int = value
        return number & MASK64  # some producers send the 64 bits as a signed number
    if t is bytes:
        digest: bytes = value
        return digest
    raise _BadEvent


def _opt_hash(value: Any) -> ExternalHash | None:
    return None if value is None else _hash(value)


def _hashes(value: Any) -> list[ExternalHash]:
    if type(value) is not list:
        raise _BadEvent
    return [_hash(v) for v in value]


def _opt(value: Any, kind: type) -> Any:
    if value is None or type(value) is kind:
        return value
    raise _BadEvent


def _fields(raw: Any) -> tuple[str, dict[str, Any]] | None:
    """(tag, fields by name) of one raw event, positional or a map; None if neither."""
    if type(raw) is list and raw and type(raw[0]) is str:
        names = _FIELDS.get(raw[0], ())
        return raw[0], dict(zip(names, raw[1:], strict=False))
    if type(raw) is dict and type(raw.get("type")) is str:
        return raw["type"], raw
    return None


def _event(tag: str, f: dict[str, Any]) -> WireEvent:
    get = f.get
    if tag == "BlockStored":
        tokens = get("token_ids")
        extra = get("extra_keys")
        return WireBlockStored(
            _hashes(get("block_hashes")), _opt_hash(get("parent_block_hash")),
            [] if tokens is None else _opt(tokens, list), _opt(get("block_size"), int) or 0,
            _opt(get("lora_id"), int), _opt(get("medium"), str), _opt(get("lora_name"), str),
            _opt(extra, list), _opt(get("group_idx"), int),
            _opt(get("kv_cache_spec_kind"), str),
            _opt(get("kv_cache_spec_sliding_window"), int))
    if tag == "BlockRemoved":
        return WireBlockRemoved(_hashes(get("block_hashes")), _opt(get("medium"), str),
                                _opt(get("group_idx"), int))
    return WireAllBlocksCleared(_opt(get("medium"), str))


_TYPED = msgspec.msgpack.Decoder(WireEventBatch)


def decode_batch(payload: bytes) -> DecodedBatch:
    """Any of vLLM's batch forms (see the module docstring). WireError if the payload is
    not msgpack or not a batch; single events that cannot be read are skipped, with why."""
    try:
        typed = _TYPED.decode(payload)
    except msgspec.DecodeError:  # (ValidationError too) another form, or not msgpack
        pass
    else:
        return DecodedBatch(typed.ts, typed.events, typed.data_parallel_rank)
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if type(raw) is list and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif type(raw) is dict and "events" in raw:
        ts, events, rank = raw.get("ts"), raw["events"], raw.get("data_parallel_rank")
    else:
        raise WireError(f"not an event batch: a msgpack {type(raw).__name__}")
    if type(ts) not in (int, float) or type(events) is not list:
        raise WireError("not an event batch: ts is not a number or events not a list")
    batch = DecodedBatch(float(ts), [], rank if type(rank) is int else None)
    for raw_event in events:
        parsed = _fields(raw_event)
        if parsed is None or parsed[0] not in _FIELDS:
            batch.skipped.append("unknown_event")
            continue
        try:
            batch.events.append(_event(*parsed))
        except _BadEvent:
            batch.skipped.append("bad_event")
    return batch

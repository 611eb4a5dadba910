"""The SSD tier's on-disk format: segment headers and self-describing block entries.

A segment file is `segment header | entry | entry | ...`, append-only. The header and every
entry start at a multiple of the segment's alignment (4096: what O_DIRECT needs); the bytes
between the end of one and the start of the next are zero padding. Every integer is
little-endian. Nothing here is a pickle: a reader needs only this module (no torch).

Segment header::

    magic "PKVS" | version u16 | align_shift u16 | layout_id u64 | layout_len u32
    | layout (canonical JSON, layout_len bytes) | xxh3_64 of everything before it (u64)

Entry::

    magic "PKVB" | version u16 | codec u8 | dtype u8 | hash_len u8 | parent_len u8
    | n_tokens u16 | layout_id u64 | raw_len u64 | payload_len u64 | payload_xxh3 u64
    | block hash | parent hash (parent_len 0: no parent) | token ids (u32 each)
    | header_xxh3 u64 (over every header byte before it) | payload (payload_len bytes)

The header checksum lets a start-up scan trust an entry's lengths without reading its
payload; the payload checksum is verified on every read (`decode_entry`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from pagekv.tiers.codec import CODEC_RAW, U8Array, decode_array

SEG_MAGIC = b"PKVS"
ENTRY_MAGIC = b"PKVB"
FORMAT_VERSION = 1

_SEG_FIXED = struct.Struct("<4sHHQI")
_ENTRY_FIXED = struct.Struct("<4sHBBBBHQQQQ")
_U64 = struct.Struct("<Q")
ENTRY_FIXED_LEN = _ENTRY_FIXED.size
MAX_TOKENS = 1024  # bounds a header to ~4 KiB, so a scan reads it in one go
MAX_HASH_LEN = 64
MAX_ENTRY_HEADER_LEN = ENTRY_FIXED_LEN + 2 * MAX_HASH_LEN + 4 * MAX_TOKENS + _U64.size
MAX_LAYOUT_LEN = 1 << 16
ALIGN_SHIFT = 12
ALIGN = 1 << ALIGN_SHIFT


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def entry_header_size(hash_len: int, parent_len: int, n_tokens: int) -> int:
    """Exact header length of an entry with these variable parts."""
    return ENTRY_FIXED_LEN + hash_len + parent_len + 4 * n_tokens + _U64.size


def check_entry_fields(
    block_hash: bytes, parent_hash: bytes | None, tokens: tuple[int, ...]
) -> None:
    """ValueError unless these fields fit an entry header (checked when a block is offered,
    so that packing its header later cannot fail)."""
    if not isinstance(block_hash, bytes) or not 0 < len(block_hash) <= MAX_HASH_LEN:
        raise ValueError(f"block hash must be 1..{MAX_HASH_LEN} bytes")
    if parent_hash is not None and not 0 < len(parent_hash) <= MAX_HASH_LEN:
        raise ValueError(f"parent hash must be 1..{MAX_HASH_LEN} bytes or None")
    if len(tokens) > MAX_TOKENS or (tokens and (min(tokens) < 0 or max(tokens) >= 1 << 32)):
        raise ValueError(f"token ids must be at most {MAX_TOKENS} values in [0, 2**32)")


class FormatError(ValueError):
    """Bytes that are not a valid segment header or entry (torn, corrupt, or foreign)."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checksum_of_pieces(pieces: Sequence[bytes | bytearray | memoryview]) -> int:
    """`checksum` of the pieces back to back, without joining them (xxh3 streams)."""
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
    return state.intdigest()


def canonical_layout(layout: dict[str, Any] | str) -> bytes:
    """Stable bytes for a layout descriptor: sorted compact JSON for a dict, UTF-8 for a str."""
    if isinstance(layout, str):
        return layout.encode()
    return json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()


def layout_id_of(layout_bytes: bytes) -> int:
    return checksum(layout_bytes)


# --- segment header ----------------------------------------------------------------------
def pack_segment_header(layout_bytes: bytes, align_shift: int = ALIGN_SHIFT) -> bytes:
    """The segment header, unpadded (the writer pads it to the alignment)."""
    if len(layout_bytes) > MAX_LAYOUT_LEN:
        raise ValueError(f"layout descriptor is {len(layout_bytes)} bytes, at most {MAX_LAYOUT_LEN}")
    head = _SEG_FIXED.pack(SEG_MAGIC, FORMAT_VERSION, align_shift, layout_id_of(layout_bytes), len(layout_bytes))
    body = head + layout_bytes
    return body + _U64.pack(checksum(body))


def parse_segment_header(buf: bytes | bytearray | memoryview) -> tuple[int, bytes, int, int]:
    """(layout_id, layout bytes, offset of the first entry, alignment); FormatError if invalid."""
    mv = memoryview(buf)
    if len(mv) < _SEG_FIXED.size:
        raise FormatError("segment header truncated")
    magic, version, align_shift, layout_id, layout_len = _SEG_FIXED.unpack_from(mv)
    if magic != SEG_MAGIC:
        raise FormatError("not a PageKV segment (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatError(f"segment format version {version}, this build reads {FORMAT_VERSION}")
    if layout_len > MAX_LAYOUT_LEN:
        raise FormatError("segment header: layout length out of range")
    end = _SEG_FIXED.size + layout_len
    if len(mv) < end + _U64.size:
        raise FormatError("segment header truncated")
    (stored,) = _U64.unpack_from(mv, end)
    if stored != checksum(mv[:end]):
        raise FormatError("segment header checksum mismatch")
    layout_bytes = bytes(mv[_SEG_FIXED.size : end])
    if layout_id_of(layout_bytes) != layout_id:
        raise FormatError("segment header: layout id does not match its layout")
    if align_shift > 24:
        raise FormatError("segment header: alignment out of range")
    align = 1 << align_shift
    return layout_id, layout_bytes, align_up(end + _U64.size, align), align


# --- entries -----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class EntryHeader:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    layout_id: int
    dtype_code: int
    codec: int
    raw_len: int
    payload_len: int
    payload_xxh: int
    header_len: int

    @property
    def entry_len(self) -> int:
        return self.header_len + self.payload_len


def pack_entry_header(
    *,
    block_hash: bytes,
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    layout_id: int,
    dtype_code: int,
    codec: int,
    raw_len: int,
    payload: bytes | bytearray | memoryview,
) -> bytes:
    return pack_entry_header_of(
        block_hash=block_hash, parent_hash=parent_hash, token_ids=token_ids,
        layout_id=layout_id, dtype_code=dtype_code, codec=codec, raw_len=raw_len,
        payload_len=memoryview(payload).nbytes, payload_xxh=checksum(payload))


def pack_entry_header_of(
    *,
    block_hash: bytes,
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    layout_id: int,
    dtype_code: int,
    codec: int,
    raw_len: int,
    payload_len: int,
    payload_xxh: int,
) -> bytes:
    """The header of an entry whose payload's length and checksum the caller has (a payload
    in pieces, sent from where it lies: tiers/peer_entries.py)."""
    if not 0 < len(block_hash) <= MAX_HASH_LEN:
        raise ValueError(f"block hash must be 1..{MAX_HASH_LEN} bytes, got {len(block_hash)}")
    parent = parent_hash or b""
    if len(parent) > MAX_HASH_LEN:
        raise ValueError(f"parent hash must be at most {MAX_HASH_LEN} bytes")
    if len(token_ids) > MAX_TOKENS:
        raise ValueError(f"at most {MAX_TOKENS} token ids per block, got {len(token_ids)}")
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    fixed = _ENTRY_FIXED.pack(
        ENTRY_MAGIC,
        FORMAT_VERSION,
        codec,
        dtype_code,
        len(block_hash),
        len(parent),
        len(token_ids),
        layout_id,
        raw_len,
        payload_len,
        payload_xxh,
    )
    head = b"".join((fixed, block_hash, parent, tokens))
    return head + _U64.pack(checksum(head))


def entry_header_len(buf: bytes | bytearray | memoryview) -> int:
    """Total header length announced by an entry's fixed part (needs ENTRY_FIXED_LEN bytes)."""
    mv = memoryview(buf)
    if len(mv) < ENTRY_FIXED_LEN:
        raise FormatError("entry header truncated")
    magic, _, _, _, hash_len, parent_len, n_tokens, *_ = _ENTRY_FIXED.unpack_from(mv)
    if magic != ENTRY_MAGIC:
        raise FormatError("bad entry magic")
    if not 0 < hash_len <= MAX_HASH_LEN or parent_len > MAX_HASH_LEN or n_tokens > MAX_TOKENS:
        raise FormatError("entry header: field out of range")
    return entry_header_size(hash_len, parent_len, n_tokens)


def parse_entry_header(buf: bytes | bytearray | memoryview) -> EntryHeader:
    """Parse and checksum-verify an entry header at the start of `buf` (payload not checked)."""
    mv = memoryview(buf)
    header_len = entry_header_len(mv)
    if len(mv) < header_len:
        raise FormatError("entry header truncated")
    body_len = header_len - _U64.size
    (stored,) = _U64.unpack_from(mv, body_len)
    if stored != checksum(mv[:body_len]):
        raise FormatError("entry header checksum mismatch")
    (_, version, codec, dtype_code, hash_len, parent_len, n_tokens, layout_id, raw_len,
     payload_len, payload_xxh) = _ENTRY_FIXED.unpack_from(mv)  # fmt: skip
    if version != FORMAT_VERSION:
        raise FormatError(f"entry format version {version}, this build reads {FORMAT_VERSION}")
    pos = ENTRY_FIXED_LEN
    block_hash = bytes(mv[pos : pos + hash_len])
    pos += hash_len
    parent_hash = bytes(mv[pos : pos + parent_len]) if parent_len else None
    pos += parent_len
    token_ids = struct.unpack_from(f"<{n_tokens}I", mv, pos)
    return EntryHeader(
        block_hash=block_hash,
        parent_hash=parent_hash,
        token_ids=token_ids,
        layout_id=layout_id,
        dtype_code=dtype_code,
        codec=codec,
        raw_len=raw_len,
        payload_len=payload_len,
        payload_xxh=payload_xxh,
        header_len=header_len,
    )


def is_torn(chunk: bytes, remaining: int) -> bool:
    """True if an entry header failed to parse because the log ends here: the file ends inside
    it, or the rest is zeros (space allocated but never written before a crash)."""
    if remaining < ENTRY_FIXED_LEN or chunk.count(0) == len(chunk):
        return True
    try:
        return remaining < entry_header_len(chunk)
    except FormatError:
        return False


def decode_entry(
    entry: memoryview, block_hash: bytes, layout_id: int, raw_len: int, elem_size: int
) -> U8Array | None:
    """The block stored in one whole entry, in memory of its own; None unless the entry is
    intact (both checksums) and is that block of that layout and size."""
    try:
        hdr = parse_entry_header(entry)
    except FormatError:
        return None
    if (
        hdr.block_hash != block_hash
        or hdr.layout_id != layout_id
        or hdr.raw_len != raw_len
        or hdr.entry_len != len(entry)
    ):
        return None
    payload = entry[hdr.header_len :]
    if checksum(payload) != hdr.payload_xxh:
        return None
    try:
        arr = decode_array(hdr.codec, payload, hdr.raw_len, elem_size)
    except ValueError:
        return None
    return arr.copy() if hdr.codec == CODEC_RAW else arr  # raw: a view of the caller's buffer

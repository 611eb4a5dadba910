"""Blocks between pods: the SSD tier's self-describing entry, one per block, on the wire.

A pod serving a cross-pod pull packs each block as an SSD entry (tiers/ssd_format.py), in its
engine's exporter (kvnode/engine/kv_export.py; the pod's transfer service only sends the
bytes): header with the block's hash, its parent's hash, the KV layout id, the codec and both
checksums, then the payload (tiers/codec.py: raw or byte-shuffled LZ4).
The puller (kvnode/engine/peer_pull.py) unpacks it here and checks everything the entry says
before a byte reaches its pool: both checksums, the layout, the length, and that the entry
continues the chain it asked for (its hash is the next expected one and its parent the
previous). A refused entry raises `EntryRejected`, whose `reason` the puller counts. No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pagekv.tiers.codec import CODEC_RAW, U8Array, decode_array, dtype_code, encode
from pagekv.tiers.ssd_format import (
    EntryHeader,
    FormatError,
    canonical_layout,
    checksum,
    checksum_of_pieces,
    entry_header_size,
    layout_id_of,
    pack_entry_header,
    pack_entry_header_of,
    parse_entry_header,
)

# Why an entry was refused (metric label values on the puller).
BAD_CHECKSUM = "checksum"        # torn or corrupt bytes
BAD_CHAIN = "hash_mismatch"      # not the block asked for, or not its chain
BAD_LAYOUT = "config_mismatch"   # another KV layout (model, dtype, shape)


class EntryRejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The KV layout both pods must share for a block to be usable: its canonical JSON
    (the SSD tier's layout descriptor), its id, and the sizes a decode needs."""

    json: str
    layout_id: int
    dtype: str
    elem_size: int
    block_bytes: int

    @classmethod
    def of(cls, layout: dict[str, Any], elem_size: int, block_bytes: int) -> KvLayout:
        data = canonical_layout(layout)
        return cls(data.decode(), layout_id_of(data), str(layout["dtype"]), elem_size,
                   block_bytes)


def pack_block(layout: KvLayout, block_hash: bytes, parent_hash: bytes | None,
               data: NDArray[np.generic], compress: bool = False) -> bytes:
    """One block as one entry (header + payload). `compress`: LZ4 over byte planes when it
    shrinks the block enough (tiers.codec's rule); raw otherwise (cheapest on a fast link)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != layout.block_bytes:
        raise ValueError(f"block is {raw.size} bytes, the layout's blocks {layout.block_bytes}")
    codec, payload = encode(raw, layout.elem_size) if compress else (CODEC_RAW, raw.data)
    header = pack_entry_header(block_hash=block_hash, parent_hash=parent_hash, token_ids=(),
                               layout_id=layout.layout_id, dtype_code=dtype_code(layout.dtype),
                               codec=codec, raw_len=raw.size, payload=payload)
    return header + bytes(payload)


def pack_header(layout: KvLayout, block_hash: bytes, parent_hash: bytes | None,
                pieces: Sequence[memoryview], payload_xxh: int | None = None
                ) -> tuple[bytes, int]:
    """(the header, the payload's checksum) of a raw entry whose payload is `pieces` back to
    back (a pool block's planes where they lie): a data transport sends it, then the pieces,
    and never joins them. `payload_xxh`: the pieces' checksum, when the caller has it."""
    size = sum(p.nbytes for p in pieces)
    if size != layout.block_bytes:
        raise ValueError(f"block is {size} bytes, the layout's blocks {layout.block_bytes}")
    if payload_xxh is None:
        payload_xxh = checksum_of_pieces(pieces)
    return pack_entry_header_of(
        block_hash=block_hash, parent_hash=parent_hash, token_ids=(),
        layout_id=layout.layout_id, dtype_code=dtype_code(layout.dtype), codec=CODEC_RAW,
        raw_len=size, payload_len=size, payload_xxh=payload_xxh), payload_xxh


def raw_header_len(block_hash: bytes, parent_hash: bytes | None) -> int:
    """The header length of `pack_header`'s entry for this block (no token ids): what a
    receiver posts for it before the bytes come."""
    return entry_header_size(len(block_hash), len(parent_hash or b""), 0)


def check_header(layout: KvLayout, header: bytes | bytearray | memoryview, block_hash: bytes,
                 parent_hash: bytes | None) -> EntryHeader:
    """The entry header at the start of `header`, verified: intact, of this layout, and
    exactly that block of the chain (EntryRejected otherwise). Its payload is not checked."""
    try:
        hdr = parse_entry_header(header)
    except FormatError as exc:
        raise EntryRejected(BAD_CHECKSUM, str(exc)) from None
    if hdr.layout_id != layout.layout_id or hdr.raw_len != layout.block_bytes:
        raise EntryRejected(BAD_LAYOUT, f"layout {hdr.layout_id:016x} of {hdr.raw_len} bytes, "
                                        f"expected {layout.layout_id:016x} of "
                                        f"{layout.block_bytes}")
    if hdr.block_hash != block_hash or hdr.parent_hash != parent_hash:
        raise EntryRejected(BAD_CHAIN, "the entry is not the next block of the chain asked for")
    return hdr


def check_pieces(hdr: EntryHeader, pieces: Sequence[memoryview]) -> None:
    """EntryRejected unless `pieces`, back to back, are the raw payload `hdr` announces."""
    if hdr.codec != CODEC_RAW or sum(p.nbytes for p in pieces) != hdr.payload_len:
        raise EntryRejected(BAD_CHECKSUM, "the payload is not the raw block its header says")
    if checksum_of_pieces(pieces) != hdr.payload_xxh:
        raise EntryRejected(BAD_CHECKSUM, "payload checksum mismatch")


def unpack_block(layout: KvLayout, entry: bytes | memoryview, block_hash: bytes,
                 parent_hash: bytes | None) -> U8Array:
    """The block in `entry`, as a uint8 array of the layout's block size; EntryRejected
    (with its reason) unless the entry is intact, of this layout, and exactly that block."""
    mv = memoryview(entry)
    hdr = check_header(layout, mv, block_hash, parent_hash)
    if hdr.entry_len != len(mv):
        raise EntryRejected(BAD_CHECKSUM, f"entry is {len(mv)} bytes, its header says "
                                          f"{hdr.entry_len}")
    payload = mv[hdr.header_len:]
    if checksum(payload) != hdr.payload_xxh:
        raise EntryRejected(BAD_CHECKSUM, "payload checksum mismatch")
    try:
        arr = decode_array(hdr.codec, payload, hdr.raw_len, layout.elem_size)
    except ValueError as exc:
        raise EntryRejected(BAD_CHECKSUM, str(exc)) from None
    return arr


def scatter(block: U8Array, pieces: Sequence[memoryview]) -> None:
    """A block's bytes into `pieces` (a pool block's planes), in order."""
    pos = 0
    for piece in pieces:
        n = piece.nbytes
        np.frombuffer(piece, np.uint8)[:] = block[pos : pos + n]
        pos += n


def unpack_chain(layout: KvLayout, entries: Sequence[bytes], hashes: Sequence[bytes],
                 parent_hash: bytes | None) -> list[U8Array]:
    """Consecutive entries for `hashes[0], hashes[1], ...` continuing `parent_hash`."""
    out = []
    parent = parent_hash
    for entry, h in zip(entries, hashes, strict=False):
        out.append(unpack_block(layout, entry, h, parent))
        parent = h
    return out

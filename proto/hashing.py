"""Block hashing: the hash chain that names every full KV block.

    block_hash[i] = H((block_hash[i-1] or ROOT, tuple(tokens of block i), extra_keys))

with ROOT = H(seed). `H` is one of vLLM's four algorithms and produces the same bytes as
vLLM's reference functions, so a pod, the router and an unmodified vLLM pod agree:

    sha256       SHA-256 of pickle protocol 5
    sha256_cbor  SHA-256 of canonical CBOR (cbor2 `dumps(x, canonical=True)`)
    xxhash       XXH3-128 of pickle protocol 5
    xxhash_cbor  XXH3-128 of canonical CBOR

The CBOR variants use a hand-written encoder for the block shape (parent bytes, a list or tuple
of exact ints, extra keys None or a tuple of tuples of str/int) that is byte-identical to
cbor2's canonical output and about 1.5-2x faster, from per-id encodings cached on first use;
anything outside that shape goes to cbor2. Pickle stays `pickle.dumps`: a hand-assembled
protocol-5 pickle of the same tuple measured 3x slower than the C pickler.

Extra keys are a tuple of tagged tuples, in this order, or None when there are none:
    ("lora", name, path)                on every block when a LoRA adapter is set
    ("mm", identifier, offset_in_block) for each multimodal input overlapping the block
    ("cache_salt", salt)                on block 0 only
offset_in_block = item_start_token - block_start_token; it is negative for an item that began
in an earlier block, so a block's key says where the item sits relative to it.

The router imports this module: it must never import torch.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import cbor2
import xxhash

logger = logging.getLogger(__name__)

DEFAULT_HASH_SEED = "vllm-none-hash"
PICKLE_PROTOCOL = 5
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

BlockHash = bytes
ExtraKeys = tuple[tuple[str | int, ...], ...]
HashFn = Callable[[object], bytes]
MMInput = tuple[str, int, int]  # (identifier, start_token, length)

_sha256 = hashlib.sha256
_xxh3_128 = xxhash.xxh3_128_digest
_pickle_dumps = pickle.dumps
_cbor2_dumps = cbor2.dumps
_join = b"".join


# --- canonical CBOR, fast path -------------------------------------------------------------

def _cbor_head(major: int, n: int) -> bytes:
    """Initial byte(s) of a CBOR item of major type `major` (0..7) with argument n >= 0."""
    mt = major << 5
    if n < 24:
        return bytes((mt | n,))
    if n < 0x100:
        return bytes((mt | 24, n))
    if n < 0x10000:
        return bytes((mt | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((mt | 26,)) + n.to_bytes(4, "big")
    return bytes((mt | 27,)) + n.to_bytes(8, "big")


# Heads for the lengths a block actually has; longer ones are computed on demand.
_ARRAY_HEADS = tuple(_cbor_head(4, n) for n in range(256))
_TEXT_HEADS = tuple(_cbor_head(3, n) for n in range(256))
# "array of 3" + "byte string of length n": the start of every block's encoding.
_BLOCK_PREFIX = tuple(b"\x83" + _cbor_head(2, n) for n in range(256))
_CBOR_NONE = b"\xf6"
_INT_CACHE_LIMIT = 1 << 18  # covers every vocabulary in use (Gemma: 256k) with room to spare

# CBOR bytes of each token id seen so far (memory grows with the distinct ids hashed, about
# 100 B each). Keys are exact ints and are only ever looked up with exact ints: True == 1
# and 2.0 == 2 hash alike, so a bool or float would otherwise be served an int's bytes.
_INT_CBOR: dict[int, bytes] = {}


def _int_cbor(value: int) -> bytes:
    """Canonical CBOR of one exact int; cached when it is a plausible token id."""
    enc = _INT_CBOR.get(value)
    if enc is None:
        if 0 <= value < 0x10000000000000000:
            enc = _cbor_head(0, value)
        elif -0x10000000000000000 <= value < 0:
            enc = _cbor_head(1, -1 - value)
        else:  # bignum: a tagged byte string, rare enough to leave to cbor2
            enc = _cbor2_dumps(value, canonical=True)
        if 0 <= value < _INT_CACHE_LIMIT:
            _INT_CBOR[value] = enc
    return enc


# CBOR of each extra key tuple seen (the LoRA key repeats on every block of a request). Only
# tuples of exact str/int are stored or looked up, so tuple equality is exact here too.
_KEY_CBOR: dict[tuple[str | int, ...], bytes] = {}
_KEY_CACHE_LIMIT = 4096  # mm keys vary per block: stop caching rather than grow without bound
_KEY_ITEM_TYPES = frozenset((str, int))


def _key_cbor(key: tuple[str | int, ...]) -> bytes | None:
    """Canonical CBOR of one extra key whose items are exact str/int (None: lone surrogate)."""
    parts = [_ARRAY_HEADS[len(key)]]
    for item in key:
        if type(item) is str:
            try:
                raw = item.encode()
            except UnicodeEncodeError:  # let cbor2 raise its own error
                return None
            parts.append(_TEXT_HEADS[len(raw)] if len(raw) < 256 else _cbor_head(3, len(raw)))
            parts.append(raw)
        else:
            parts.append(_int_cbor(item))  # type: ignore[arg-type]
    enc = _join(parts)
    if len(_KEY_CBOR) < _KEY_CACHE_LIMIT:
        _KEY_CBOR[key] = enc
    return enc


def _cbor_extra(extra: object) -> bytes | None:
    """Canonical CBOR of extra keys, or None when they are outside the fast shape."""
    if type(extra) is not tuple or len(extra) > 255:
        return None
    parts = [_ARRAY_HEADS[len(extra)]]
    for key in extra:
        if (type(key) is not tuple or len(key) > 255
                or not _KEY_ITEM_TYPES.issuperset(map(type, key))):
            return None
        enc = _KEY_CBOR.get(key) or _key_cbor(key)
        if enc is None:
            return None
        parts.append(enc)
    return _join(parts)


def _cbor_block(parent: object, tokens: Sequence[int], extra: object) -> bytes:
    """Canonical CBOR of (parent, tuple(tokens), extra); `tokens` must be a list or tuple.

    Inlined into one function on purpose: this runs once per block on every pod and router.
    """
    n = len(tokens)
    # One C-level pass proves every token is an exact int (not bool, float, numpy, ...),
    # which is what makes the cache lookups below exact.
    if type(parent) is bytes and [*map(type, tokens)].count(int) == n:
        extra_enc = _CBOR_NONE if extra is None else _cbor_extra(extra)
        if extra_enc is not None:
            if n > 1:
                try:
                    # itemgetter fetches every entry in one C call: the fast path.
                    body = _join(itemgetter(*tokens)(_INT_CBOR))
                except KeyError:  # an id seen for the first time (or beyond the cache)
                    body = _join([_int_cbor(t) for t in tokens])
            else:
                body = _join([_int_cbor(t) for t in tokens])
            plen = len(parent)
            return _join((
                _BLOCK_PREFIX[plen] if plen < 256 else b"\x83" + _cbor_head(2, plen),
                parent,
                _ARRAY_HEADS[n] if n < 256 else _cbor_head(4, n),
                body,
                extra_enc,
            ))
    return _cbor2_dumps((parent, tuple(tokens), extra), canonical=True)


def cbor_dumps(obj: object) -> bytes:
    """Byte-identical to `cbor2.dumps(obj, canonical=True)`; fast for the block shape."""
    if type(obj) is tuple and len(obj) == 3:
        parent, tokens, extra = obj
        if type(tokens) is tuple or type(tokens) is list:
            return _cbor_block(parent, tokens, extra)
    return _cbor2_dumps(obj, canonical=True)


def pickle_dumps(obj: object) -> bytes:
    """The pickle serialization the sha256/xxhash algorithms hash."""
    return _pickle_dumps(obj, PICKLE_PROTOCOL)


# --- the four hash functions ---------------------------------------------------------------

def hash_sha256(obj: object) -> bytes:
    return _sha256(_pickle_dumps(obj, PICKLE_PROTOCOL)).digest()


def hash_sha256_cbor(obj: object) -> bytes:
    return _sha256(cbor_dumps(obj)).digest()


def hash_xxhash(obj: object) -> bytes:
    return _xxh3_128(_pickle_dumps(obj, PICKLE_PROTOCOL))


def hash_xxhash_cbor(obj: object) -> bytes:
    return _xxh3_128(cbor_dumps(obj))


_HASH_FNS: dict[str, HashFn] = {
    "sha256": hash_sha256,
    "sha256_cbor": hash_sha256_cbor,
    "xxhash": hash_xxhash,
    "xxhash_cbor": hash_xxhash_cbor,
}


def get_hash_fn(name: str) -> HashFn:
    """The hash function called `name`; ValueError naming the valid ones otherwise."""
    try:
        return _HASH_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown block hash algorithm {name!r}; valid: {', '.join(HASH_ALGOS)}"
        ) from None


# Per-block fast paths: same bytes as hash_fn((parent, tuple(tokens), extra)), minus the
# generic shape dispatch and, for CBOR, without building the tuple at all.
def _block_sha256(parent: bytes, tokens: Sequence[int], extra: ExtraKeys | None) -> bytes:
    return _sha256(_pickle_dumps((parent, tuple(tokens), extra), PICKLE_PROTOCOL)).digest()


def _block_xxhash(parent: bytes, tokens: Sequence[int], extra: ExtraKeys | None) -> bytes:
    return _xxh3_128(_pickle_dumps((parent, tuple(tokens), extra), PICKLE_PROTOCOL))


def _block_sha256_cbor(parent: bytes, tokens: Sequence[int], extra: ExtraKeys | None) -> bytes:
    if type(tokens) is not list and type(tokens) is not tuple:
        tokens = tuple(tokens)
    return _sha256(_cbor_block(parent, tokens, extra)).digest()


def _block_xxhash_cbor(parent: bytes, tokens: Sequence[int], extra: ExtraKeys | None) -> bytes:
    if type(tokens) is not list and type(tokens) is not tuple:
        tokens = tuple(tokens)
    return _xxh3_128(_cbor_block(parent, tokens, extra))


BlockFn = Callable[[bytes, Sequence[int], ExtraKeys | None], bytes]
_BLOCK_FNS: dict[HashFn, BlockFn] = {
    hash_sha256: _block_sha256,
    hash_sha256_cbor: _block_sha256_cbor,
    hash_xxhash: _block_xxhash,
    hash_xxhash_cbor: _block_xxhash_cbor,
}


# --- the chain -----------------------------------------------------------------------------

def root_hash(hash_fn: HashFn, seed: str = DEFAULT_HASH_SEED) -> bytes:
    """Parent of block 0. From configuration only: a random root would split the cluster."""
    return hash_fn(seed)


_DEFAULT_ROOTS: dict[HashFn, bytes] = {}


def _default_root(hash_fn: HashFn) -> bytes:
    root = _DEFAULT_ROOTS.get(hash_fn)
    if root is None:
        root = _DEFAULT_ROOTS[hash_fn] = root_hash(hash_fn, DEFAULT_HASH_SEED)
    return root


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
    root: bytes | None = None,
) -> bytes:
    """hash_fn((parent_hash or root, tuple(token_ids), extra_keys)).

    `root` defaults to root_hash(hash_fn, DEFAULT_HASH_SEED), computed once per hash_fn.
    """
    if not parent_hash:
        parent_hash = root if root is not None else _default_root(hash_fn)
    fast = _BLOCK_FNS.get(hash_fn)
    if fast is None:
        return hash_fn((parent_hash, tuple(token_ids), extra_keys))
    return fast(parent_hash, token_ids, extra_keys)


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Everything that changes a block hash except the block size (the index adds that)."""

    algo: str = "sha256"
    seed: str = DEFAULT_HASH_SEED
    hash_fn: HashFn = field(init=False, repr=False, compare=False)
    root: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, str):
            raise ValueError(f"hash seed must be a str, got {type(self.seed).__name__}")
        fn = get_hash_fn(self.algo)
        object.__setattr__(self, "hash_fn", fn)
        object.__setattr__(self, "root", root_hash(fn, self.seed))
        logger.debug("hash config %s", self.fingerprint())

    def fingerprint(self) -> str:
        """Short stable name of algo+seed, e.g. "sha256-066b1e8987e02713".

        Built from the root hash, which is exactly the value every party must agree on, so
        it is safe inside Redis keys whatever characters the seed holds.
        """
        return f"{self.algo}-{self.root[:8].hex()}"

    def hash_block(
        self, parent_hash: bytes | None, token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
    ) -> bytes:
        return hash_block_tokens(self.hash_fn, parent_hash, token_ids, extra_keys, self.root)


# --- extra keys and the per-request hasher -------------------------------------------------

def _check_inputs(
    block_size: int, cache_salt: str | None, lora: tuple[str, str] | None,
    mm_inputs: Sequence[MMInput],
) -> tuple[MMInput, ...]:
    """Validate, and return mm inputs sorted by start so caller order never changes a hash."""
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    if lora is not None and (
        len(lora) != 2 or not all(isinstance(part, str) for part in lora)
    ):
        raise ValueError(f"lora must be a (name, path) pair of str, got {lora!r}")
    checked = []
    for item in mm_inputs:
        if len(item) != 3:
            raise ValueError(f"mm input must be (identifier, start_token, length), got {item!r}")
        ident, start, length = item
        if not isinstance(ident, str) or type(start) is not int or type(length) is not int:
            raise ValueError(f"mm input must be (str, int, int), got {item!r}")
        if start < 0 or length <= 0:
            raise ValueError(f"mm input needs start >= 0 and length > 0, got {item!r}")
        checked.append((ident, start, length))
    return tuple(sorted(checked, key=lambda item: item[1]))


def _extra_keys(
    block_index: int, block_size: int, salt: str | None,
    lora_key: tuple[str, str, str] | None, mm: tuple[MMInput, ...],
) -> ExtraKeys | None:
    keys: list[tuple[str | int, ...]] = []
    if lora_key is not None:
        keys.append(lora_key)
    if mm:
        begin = block_index * block_size
        end = begin + block_size
        for ident, start, length in mm:
            if start >= end:
                break  # sorted by start: nothing later overlaps either
            if start + length > begin:
                keys.append(("mm", ident, start - begin))
    if salt is not None and block_index == 0:
        keys.append(("cache_salt", salt))
    return tuple(keys) if keys else None


def block_extra_keys(
    block_index: int,
    block_size: int,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
    mm_inputs: Sequence[MMInput] = (),
) -> ExtraKeys | None:
    """Extra keys of block `block_index` (see the module docstring for the layout)."""
    mm = _check_inputs(block_size, cache_salt, lora, mm_inputs)
    lora_key = ("lora", lora[0], lora[1]) if lora is not None else None
    return _extra_keys(block_index, block_size, cache_salt, lora_key, mm)


class RequestBlockHasher:
    """Hashes a request's full blocks as its tokens arrive, each block exactly once.

    `block_hashes` (owned by the caller, usually the request) is the state: its length is
    the number of blocks already hashed and its last entry the parent of the next one.
    """

    __slots__ = ("config", "block_size", "_block_fn", "_root", "_plain", "_salt", "_lora_key",
                 "_mm")

    def __init__(
        self,
        config: HashConfig,
        block_size: int,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_inputs: Sequence[MMInput] = (),
    ) -> None:
        self._mm = _check_inputs(block_size, cache_salt, lora, mm_inputs)
        self.config = config
        self.block_size = block_size
        self._block_fn = _BLOCK_FNS[config.hash_fn]  # HashConfig only knows these
        self._root = config.root
        self._salt = cache_salt
        self._lora_key = ("lora", lora[0], lora[1]) if lora is not None else None
        # Most requests have no extra keys: skip building them per block.
        self._plain = cache_salt is None and lora is None and not self._mm

    def extend(self, token_ids: Sequence[int], block_hashes: list[bytes]) -> int:
        """Append the hashes of every full block of `token_ids` not in `block_hashes` yet.

        Returns how many were added. Called per decoded token: the common case (no block
        became full) is two len() calls and a compare.
        """
        bs = self.block_size
        start = len(block_hashes)
        stop = len(token_ids) // bs
        if stop <= start:
            return 0
        block_fn = self._block_fn
        parent = block_hashes[-1] if start else self._root
        if self._plain:
            for i in range(start, stop):
                parent = block_fn(parent, token_ids[i * bs:(i + 1) * bs], None)
                block_hashes.append(parent)
        else:
            salt, lora_key, mm = self._salt, self._lora_key, self._mm
            for i in range(start, stop):
                extra = _extra_keys(i, bs, salt, lora_key, mm)
                parent = block_fn(parent, token_ids[i * bs:(i + 1) * bs], extra)
                block_hashes.append(parent)
        return stop - start


def lora_key(lora_name: object | None, lora_path: str | None = None) -> tuple[str, str] | None:
    """The (name, path) pair a LoRA adapter adds to every block's extra keys; None without
    one. The pods (by request) and the router (by gRPC field) both derive it here, so they
    cannot hash an adapter differently."""
    if lora_name is None or lora_name == "":
        return None
    return (str(lora_name), lora_path or "")


def hash_prompt(
    config: HashConfig,
    block_size: int,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
    mm_inputs: Sequence[MMInput] = (),
) -> list[bytes]:
    """The hash of every full block of `token_ids` (what the router looks up)."""
    hashes: list[bytes] = []
    RequestBlockHasher(config, block_size, cache_salt, lora, mm_inputs).extend(token_ids, hashes)
    return hashes

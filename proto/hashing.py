"""Block hashing: the hash chain that names every full KV block.

    block_hash[i] = H((block_hash[i-1] or ROOT, tuple(tokens of block i), extra_keys))

with ROOT = H(seed). `H` is one of vLLM's four algorithms and produces the same bytes as
vLLM's reference functions, so a pod, the router and an unmodified vLLM pod agree:

    sha256       SHA-256 of pickle protocol 5
    sha256_cbor  SHA-256 of canonical CBOR (cbor2 `dumps(x, canonical=True)`)
    xxhash       XXH3-128 of pickle protocol 5
    xxhash_cbor  XXH3-128 of canonical CBOR

The CBOR variants use the hand-written block encoder of `proto.hashing_cbor` (byte-identical
to cbor2's canonical output, 1.5-2x faster). Pickle stays `pickle.dumps`: a hand-assembled
protocol-5 pickle of the same tuple measured 3x slower than the C pickler.

Extra keys are a tuple of tagged tuples, in this order, or None when there are none:
    ("lora", name, path)                on every block when a LoRA adapter is set
    ("mm", identifier, offset_in_block) for each multimodal input overlapping the block
    ("cache_salt", salt)                on block 0 only (block k after a shared region of k
                                        blocks: proto/shared_prefix.py)
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

import xxhash

from pagekv.proto.hashing_cbor import cbor_block, cbor_dumps

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
    return _sha256(cbor_block(parent, tokens, extra)).digest()


def _block_xxhash_cbor(parent: bytes, tokens: Sequence[int], extra: ExtraKeys | None) -> bytes:
    if type(tokens) is not list and type(tokens) is not tuple:
        tokens = tuple(tokens)
    return _xxh3_128(cbor_block(parent, tokens, extra))


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


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks a cache may serve: the last prompt token is never a hit,
    because its logits must be computed. Pods (pool and tiers) and the router all stop here."""
    return max(0, (num_prompt_tokens - 1) // block_size)


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
    lora_key: tuple[str, str, str] | None, mm: tuple[MMInput, ...], salt_block: int = 0,
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
    if salt is not None and block_index == salt_block:
        keys.append(("cache_salt", salt))
    return tuple(keys) if keys else None


def block_extra_keys(
    block_index: int,
    block_size: int,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
    mm_inputs: Sequence[MMInput] = (),
    salt_block: int = 0,
) -> ExtraKeys | None:
    """Extra keys of block `block_index` (see the module docstring for the layout)."""
    mm = _check_inputs(block_size, cache_salt, lora, mm_inputs)
    lora_key = ("lora", lora[0], lora[1]) if lora is not None else None
    return _extra_keys(block_index, block_size, cache_salt, lora_key, mm, salt_block)


class RequestBlockHasher:
    """Hashes a request's full blocks as its tokens arrive, each block exactly once.

    `block_hashes` (owned by the caller, usually the request) is the state: its length is
    the number of blocks already hashed and its last entry the parent of the next one.
    `salt_block`: the block that carries the salt (0; k after a shared region of k blocks).
    """

    __slots__ = ("config", "block_size", "_block_fn", "_root", "_plain", "_salt", "_lora_key",
                 "_mm", "salt_block")

    def __init__(
        self,
        config: HashConfig,
        block_size: int,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_inputs: Sequence[MMInput] = (),
        salt_block: int = 0,
    ) -> None:
        self._mm = _check_inputs(block_size, cache_salt, lora, mm_inputs)
        if type(salt_block) is not int or salt_block < 0:
            raise ValueError(f"salt_block must be an int >= 0, got {salt_block!r}")
        self.salt_block = salt_block
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
            salt, lora_key, mm, salted = self._salt, self._lora_key, self._mm, self.salt_block
            for i in range(start, stop):
                extra = _extra_keys(i, bs, salt, lora_key, mm, salted)
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
    salt_block: int = 0,
) -> list[bytes]:
    """The hash of every full block of `token_ids` (what the router looks up)."""
    hashes: list[bytes] = []
    RequestBlockHasher(config, block_size, cache_salt, lora, mm_inputs, salt_block).extend(
        token_ids, hashes)
    return hashes

"""Block hashing: vLLM's vectors byte for byte, hash configurations (names, fingerprints,
roots, seeds), custom hash functions, and no torch or process randomness. Reference
functions: hashing_reference.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.proto.hashing import (
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    HashConfig,
    get_hash_fn,
    hash_block_tokens,
    hash_prompt,
    root_hash,
)
from tests.unit.hashing_reference import REFERENCE

ROOT_DIR = Path(__file__).resolve().parents[2]

# Seed "vllm-none-hash"; b0 = tokens 0..15; b1 = tokens 16..31 chained on b0;
# salted = b0 with extra keys (("cache_salt", "tenant-a"),).
VECTORS = {
    "sha256": {
        "root": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "b0": "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
        "b1": "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
        "salted": "255b152c89e763273cf1498dce0dfd4efdf44000fe683cd2af1845b5b8426a35",
    },
    "sha256_cbor": {
        "root": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "b0": "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "b1": "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
        "salted": "4e31e1ced73eb044a95997f0109d0ddab3d9145878214f1a0ee37c048b397859",
    },
    "xxhash_cbor": {
        "root": "a4e364baa0791a6f63bbf917db9b700d",
        "b0": "f2313f4548e185b1a011187a342021cc",
    },
}

# --- vectors and configuration -------------------------------------------------------------

@pytest.mark.parametrize("algo", sorted(VECTORS))
def test_vllm_vectors_byte_for_byte(algo: str) -> None:
    want = VECTORS[algo]
    fn = get_hash_fn(algo)
    root = root_hash(fn, DEFAULT_HASH_SEED)
    b0 = hash_block_tokens(fn, None, range(16))
    assert root.hex() == want["root"]
    assert b0.hex() == want["b0"]
    config = HashConfig(algo)
    assert config.root == root
    assert hash_prompt(config, 16, list(range(16)))[0] == b0
    if "b1" in want:
        b1 = hash_block_tokens(fn, b0, list(range(16, 32)))
        salted = hash_block_tokens(fn, None, list(range(16)), (("cache_salt", "tenant-a"),))
        assert b1.hex() == want["b1"]
        assert salted.hex() == want["salted"]
        assert hash_prompt(config, 16, list(range(32))) == [b0, b1]
        assert hash_prompt(config, 16, list(range(20)), cache_salt="tenant-a") == [salted]


def test_unknown_algorithm_names_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        get_hash_fn("md5")
    message = str(err.value)
    assert "md5" in message
    for algo in HASH_ALGOS:
        assert algo in message
    with pytest.raises(ValueError, match="sha256_cbor"):
        HashConfig(algo="blake3")
    with pytest.raises(ValueError):
        get_hash_fn(["sha256"])  # type: ignore[arg-type]


def test_hash_config_is_frozen_and_fingerprinted() -> None:
    config = HashConfig()
    assert config == HashConfig("sha256", DEFAULT_HASH_SEED)
    assert hash(config) == hash(HashConfig())
    assert config.hash_fn is get_hash_fn("sha256")
    assert config.root is config.root  # computed once, not per access
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.algo = "xxhash"  # type: ignore[misc]
    # Stable across processes and releases: it namespaces Redis keys.
    assert config.fingerprint() == "sha256-066b1e8987e02713"
    prints = {HashConfig(a, s).fingerprint() for a in HASH_ALGOS for s in ("a", "b", "a:b c")}
    assert len(prints) == 3 * len(HASH_ALGOS)
    assert all(p.isprintable() and " " not in p and ":" not in p for p in prints)
    with pytest.raises(ValueError, match="seed"):
        HashConfig(seed=42)  # type: ignore[arg-type]
    shipped = pickle.loads(pickle.dumps(HashConfig("xxhash_cbor", "s")))  # e.g. to a Ray actor
    assert shipped == HashConfig("xxhash_cbor", "s")
    assert shipped.root == HashConfig("xxhash_cbor", "s").root
    assert shipped.hash_fn is get_hash_fn("xxhash_cbor")


def test_explicit_root_and_empty_parent() -> None:
    fn = get_hash_fn("xxhash")
    other_root = root_hash(fn, "other-seed")
    tokens = list(range(100, 116))
    chained = hash_block_tokens(fn, None, tokens, root=other_root)
    assert chained == REFERENCE["xxhash"]((other_root, tuple(tokens), None))
    assert chained == HashConfig("xxhash", "other-seed").hash_block(None, tokens)
    assert hash_block_tokens(fn, b"", tokens) == hash_block_tokens(fn, None, tokens)


def test_custom_hash_fn_takes_the_generic_path() -> None:
    def md5(obj: object) -> bytes:
        return hashlib.md5(pickle.dumps(obj, protocol=5)).digest()

    parent = hash_block_tokens(md5, None, [1, 2, 3])
    assert parent == md5((md5(DEFAULT_HASH_SEED), (1, 2, 3), None))


def test_no_torch_and_no_process_randomness() -> None:
    """The router imports this module: no torch; and hashes do not depend on the process."""
    code = (
        "import sys; from proto.hashing import HashConfig, hash_prompt, HASH_ALGOS\n"
        "assert 'torch' not in sys.modules, 'proto.hashing pulled in torch'\n"
        "print(','.join(hash_prompt(HashConfig(a), 16, list(range(48)), 's')[-1].hex()"
        " for a in HASH_ALGOS))"
    )
    outs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT_DIR, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        outs.add(done.stdout.strip())
    here = ",".join(hash_prompt(HashConfig(a), 16, list(range(48)), "s")[-1].hex()
                    for a in HASH_ALGOS)
    assert outs == {here}


"""Shared by the block-hashing tests (tests/unit/test_hashing_*.py): vLLM's reference
serializers and hash functions, written out independently of the code under test, and the
hypothesis settings they use.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import xxhash
from hypothesis import HealthCheck, settings

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# vLLM's reference functions, written out independently of the code under test.
def _ref_pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _ref_cbor(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


REFERENCE = {
    "sha256": lambda o: hashlib.sha256(_ref_pickle(o)).digest(),
    "sha256_cbor": lambda o: hashlib.sha256(_ref_cbor(o)).digest(),
    "xxhash": lambda o: xxhash.xxh3_128_digest(_ref_pickle(o)),
    "xxhash_cbor": lambda o: xxhash.xxh3_128_digest(_ref_cbor(o)),
}

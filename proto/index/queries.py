"""The index's reads: what each script call sends, and what its reply means.

A `Call` pairs one script's keys and arguments with the parser of its reply, so the same
query runs on a pod's or a test's synchronous client (`run`) and on the router's asyncio
client (`run_async`, through `IndexClient`), each a single node's or a cluster's, without
being written twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from redis.exceptions import ResponseError

from pagekv.proto.index import scripts
from pagekv.proto.index.bad_records import (
    BAD_CLAIM,
    BAD_ENCODING,
    BAD_PREDICTION,
    BAD_REPLY,
    UNCOUNTED,
    WRONG_TYPE,
    BadRecords,
)
from pagekv.proto.index.pod_record import PodInfo as PodInfo  # re-exported: its old home
from pagekv.proto.index.pod_record import parse_pod_record
from pagekv.proto.index.schema import (
    IndexSchema,
    bucket_of,
    namespace_config_key,
    namespaces_key,
    text,
)
from pagekv.proto.medium import MEDIUMS, Medium

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TIER_OF_CODE: dict[str, Medium] = {m.code: m for m in MEDIUMS}


@dataclass(slots=True)
class PodMatch:
    """A live pod's consecutive prefix from block 0; tiers[i] is where block i lives.
    `predicted`: its prefix held or predicted by a router's recent dispatch there (shared
    burst predictions), when that is longer than `depth`; else 0."""

    depth: int
    tiers: list[str]
    predicted: int = 0

    def tier_counts(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(MEDIUMS, 0)
        for tier in self.tiers:
            counts[tier] += 1
        return counts


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One script call, ready to send on either kind of client."""

    script: scripts.Script
    keys: Sequence[str]
    args: Sequence[Any]
    parse: Callable[[Any], T]

    def run(self, client: Any) -> T:
        return self.parse(self.script.run(client, self.keys, self.args))

    async def run_async(self, client: Any) -> T:
        return self.parse(await self.script.run_async(client, self.keys, self.args))


class LivePods(Mapping[str, str]):
    """The pods a lookup counts claims of (pod id -> the epoch they must carry), packed once
    into the script's one argument: the router's registry keeps one per refresh, so a lookup
    neither rebuilds nor encodes a pair per pod. Pod ids holding the packing's separators
    (NUL, \\x01: no command line can pass the first) are left out."""

    __slots__ = ("_epochs", "arg")

    def __init__(self, epochs: Mapping[str, str]) -> None:
        self._epochs = {pod: epoch for pod, epoch in epochs.items()
                        if epoch and "\0" not in pod and "\1" not in pod}
        packed = "".join(f"\0{pod}\1{epoch}" for pod, epoch in self._epochs.items())
        self.arg = (packed + "\0").encode()

    def __getitem__(self, pod: str) -> str:
        return self._epochs[pod]

    def __iter__(self) -> Iterator[str]:
        return iter(self._epochs)

    def __len__(self) -> int:
        return len(self._epochs)


# -- replies ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _tiers(codes: str) -> tuple[Medium, ...]:
    """A claim code string's tiers, up to the first letter no pod writes (a forged claim:
    the prefix ends there). A prefix's codes repeat across lookups and pods."""
    out: list[Medium] = []
    for code in codes:
        tier = _TIER_OF_CODE.get(code)
        if tier is None:
            break
        out.append(tier)
    return tuple(out)


def _parse_lookup(bad: BadRecords, reply: Sequence[Any]) -> dict[str, PodMatch]:
    """The lookup's reply: its three garbage counts first (see scripts.LOOKUP_LUA), then a
    triple per pod. A claim with an unknown tier letter ends that pod's prefix there."""
    if len(reply) < 3 or (len(reply) - 3) % 3:
        bad.note(BAD_REPLY, f"lookup reply of {len(reply)} items")
        return {}
    bad.note(WRONG_TYPE, "a claim or prediction key of another Redis type", int(reply[0]))
    bad.note(BAD_PREDICTION, "a prediction whose expiry is not a number", int(reply[1]))
    bad.note(BAD_CLAIM, "a claim value without '<tiers>:<epoch>'", int(reply[2]))
    out: dict[str, PodMatch] = {}
    for i in range(3, len(reply), 3):
        try:
            pod, codes = text(reply[i]), text(reply[i + 1])
        except UnicodeDecodeError:
            bad.note(BAD_ENCODING, f"a claim of pod {reply[i]!r} that is not UTF-8")
            continue
        tiers = _tiers(codes)
        if len(tiers) < len(codes):
            bad.note(BAD_CLAIM, f"pod {pod}: claim tier {codes[len(tiers)]!r} at block "
                                f"{len(tiers)} (known: {', '.join(m.code for m in MEDIUMS)})")
        out[pod] = PodMatch(len(tiers), list(tiers), int(reply[i + 2]))
    return out


def _parse_int(reply: Any) -> int:
    return int(reply)


def _parse_pods(bad: BadRecords, reply: Sequence[Any]) -> list[PodInfo]:
    """The live pods' script reply: its wrong-type count first, then one record per pod;
    a record that does not parse is skipped (parse_pod_record says why)."""
    if not reply:
        bad.note(BAD_REPLY, "an empty live pods reply")
        return []
    bad.note(WRONG_TYPE, "a pods SET, lease or pod HASH of another Redis type", int(reply[0]))
    pods = [info for record in reply[1:]
            if (info := parse_pod_record(record, bad)) is not None]
    pods.sort(key=lambda p: p.pod_id)
    return pods


def _parse_pairs(bad: BadRecords, flat: Sequence[Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(0, len(flat) - 1, 2):
        try:
            out[text(flat[i])] = text(flat[i + 1])
        except UnicodeDecodeError:
            bad.note(BAD_ENCODING, f"a pod id or epoch that is not UTF-8: {flat[i]!r}")
    return out


def _parse_reap_start(reply: Any) -> list[int] | None:
    if reply == -1:
        return None
    return sorted(int(text(name), 16) for name in reply)


def _parse_reap_bucket(reply: Any) -> tuple[int, bool] | None:
    if reply == -1:
        return None
    return int(reply[0]), bool(int(reply[1]))


def _parse_refused(reply: Any) -> bool:
    """True when the script went ahead, False when it refused (-1)."""
    return bool(reply != -1)


# -- the calls -------------------------------------------------------------------------------
def lookup(schema: IndexSchema, block_hashes: Sequence[bytes],
           live: Mapping[str, str] | LivePods,
           predictions: bool = False, bad: BadRecords = UNCOUNTED
           ) -> Call[dict[str, PodMatch]]:
    """For the pods of `live` (pod id -> the epoch its claims must carry) that hold a prefix
    of `block_hashes`, how many leading blocks, and where; with `predictions`, also the
    routers' burst predictions (PodMatch.predicted), and the pods only predicted. Pods absent
    from the reply hold nothing. Every key is in block 0's bucket: one script, one slot.
    Four arguments and one key however long the chain and however many pods are passed."""
    if not isinstance(live, LivePods):
        live = LivePods(live)
    bucket = bucket_of(block_hashes[0])
    args = (schema.bucket_base(bucket), b"".join(block_hashes).hex(), live.arg,
            "1" if predictions else "")
    return Call(scripts.LOOKUP, (schema.block_key(block_hashes[0], bucket),), args,
                functools.partial(_parse_lookup, bad))


def predict(schema: IndexSchema, pod_id: str, block_hashes: Sequence[bytes], start: int,
            ttl_ms: int, max_pods: int) -> Call[int]:
    """Predict `pod_id` holding blocks `start`... of the chain for `ttl_ms` (a router's
    dispatch, for the others' lookups); each key keeps at most `max_pods` pods. One script,
    one slot; the reply is the number of keys written."""
    return Call(scripts.PREDICT, schema.chain_prediction_keys(block_hashes, start),
                (pod_id, ttl_ms, max_pods), _parse_int)


def live_pods(schema: IndexSchema, bad: BadRecords = UNCOUNTED) -> Call[list[PodInfo]]:
    """Every pod of this namespace whose lease is present and whose epoch matches it (and
    whose registration parses: `bad` counts the others)."""
    return Call(scripts.LIVE_PODS, (schema.pods_key,), (schema.base,),
                functools.partial(_parse_pods, bad))


def dead_pods(schema: IndexSchema, bad: BadRecords = UNCOUNTED) -> Call[dict[str, str]]:
    """Pod ids registered in this namespace without a lease, with their registered epoch
    ("" when even the registration is gone)."""
    return Call(scripts.DEAD_PODS, (schema.pods_key,), (schema.base,),
                functools.partial(_parse_pairs, bad))


def reap_start(schema: IndexSchema, pod_id: str, epoch: str) -> Call[list[int] | None]:
    """The buckets a dead pod may have claims in, or None when the pod id came back."""
    return Call(scripts.REAP_START, (schema.pods_key,), (schema.base, pod_id, epoch),
                _parse_reap_start)


def reap_bucket(schema: IndexSchema, pod_id: str, epoch: str, bucket: int,
                batch: int) -> Call[tuple[int, bool] | None]:
    """Remove up to `batch` of a dead pod's claims in one bucket: (claims removed, none of
    its claims left there), or None when a claim of another epoch shows the pod id back."""
    return Call(scripts.REAP_BUCKET, (schema.pod_blocks_key(pod_id, bucket),),
                (schema.bucket_base(bucket), pod_id, epoch, batch), _parse_reap_bucket)


def reap_finish(schema: IndexSchema, pod_id: str, epoch: str) -> Call[bool]:
    """Remove a reaped pod's registration: False when the pod id came back meanwhile."""
    return Call(scripts.REAP_FINISH, (schema.pods_key,), (schema.base, pod_id, epoch),
                _parse_refused)


def namespace_config_keys(prefix: str, ids: Sequence[str]) -> list[str]:
    return [namespace_config_key(prefix, ns) for ns in ids]


def parse_namespaces(ids: Sequence[str], configs: Sequence[Any],
                     bad: BadRecords = UNCOUNTED) -> dict[str, dict[str, str]]:
    """Namespace id -> its readable hash config, from HGETALL replies in `ids` order (a
    pipeline's, errors returned in place: a config key of another type, or one not UTF-8,
    is left out)."""
    out: dict[str, dict[str, str]] = {}
    for ns, flat in zip(ids, configs, strict=True):
        if isinstance(flat, ResponseError):
            bad.note(WRONG_TYPE, f"namespace {ns}'s config key: {flat}")
            continue
        try:
            out[ns] = {text(k): text(v) for k, v in flat.items()}
        except UnicodeDecodeError:
            bad.note(BAD_ENCODING, f"namespace {ns}'s config key is not UTF-8")
    return out


# -- on a synchronous client (pods, tests, tools) -------------------------------------------
def lookup_prefix(
    redis_client: Any, schema: IndexSchema, block_hashes: Sequence[bytes],
    live: Mapping[str, str] | None = None, predictions: bool = False,
) -> dict[str, PodMatch]:
    """`lookup` in one EVALSHA round trip, for the pods of `live`; without it, for the
    pods live right now (read first: a second round trip, fine outside the request path).
    Every pod asked about is in the result, depth 0 where it holds nothing."""
    if live is None:
        live = {p.pod_id: p.epoch for p in list_live_pods(redis_client, schema)}
    found = lookup(schema, block_hashes, live, predictions).run(redis_client) \
        if block_hashes and live else {}
    return {pod: found.get(pod) or PodMatch(0, []) for pod in live}


def list_live_pods(redis_client: Any, schema: IndexSchema) -> list[PodInfo]:
    return live_pods(schema).run(redis_client)


def count_pod_claims(redis_client: Any, schema: IndexSchema, pod_id: str) -> int:
    """How many claims `pod_id` has (any epoch): the sizes of its per-bucket claim sets."""
    buckets = [int(text(b), 16) for b in redis_client.smembers(schema.pod_buckets_key(pod_id))]
    pipe = redis_client.pipeline(transaction=False)
    for bucket in buckets:
        pipe.scard(schema.pod_blocks_key(pod_id, bucket))
    return sum(int(n) for n in pipe.execute()) if buckets else 0


def list_namespaces(redis_client: Any, prefix: str = "pagekv") -> dict[str, dict[str, str]]:
    """Every namespace pods have registered in, with its readable hash config.

    Lets a router find pods that registered under a *different* configuration and say so,
    instead of silently seeing an empty index.
    """
    ids = sorted(text(n) for n in redis_client.smembers(namespaces_key(prefix)))
    pipe = redis_client.pipeline(transaction=False)
    for key in namespace_config_keys(prefix, ids):
        pipe.hgetall(key)
    return parse_namespaces(ids, pipe.execute(raise_on_error=False)) if ids else {}

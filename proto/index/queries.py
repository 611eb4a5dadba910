"""The index's reads, and the claims' strip (clean-up and reaping): what each script call
sends, and what its reply means.

A `Call` pairs one script's keys and arguments with the parser of its reply, so the same
query runs on a pod's or a test's synchronous client (`run`) and on the router's asyncio
client (`run_async`, through `IndexClient`), each a single node's or a cluster's, without
being written twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
    BUCKETS,
    IndexSchema,
    bucket_of,
    claim_field,
    namespace_config_key,
    namespaces_key,
    text,
    valid_claim_id,
)
from pagekv.proto.medium import MEDIUMS, Medium

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Claims HASH fields per STRIP call (one HSCAN page): a bucket is cleaned in steps this size.
STRIP_PAGE = 1000

_TIER_OF_BYTE: dict[int, Medium] = {ord(m.code): m for m in MEDIUMS}  # a claim code's byte


@dataclass(slots=True, eq=False)
class PodMatch:
    """A live pod's consecutive prefix from block 0; tiers[i] is where block i lives.
    `predicted`: its prefix held or predicted by a router's recent dispatch there (shared
    burst predictions), when that is longer than `depth`; else 0. `tiers` is read-only: a
    lookup's are shared by every match of the same claim codes (a list or a tuple compares
    alike)."""

    depth: int
    tiers: Sequence[str]
    predicted: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PodMatch):
            return NotImplemented
        return (self.depth, tuple(self.tiers), self.predicted) == \
            (other.depth, tuple(other.tiers), other.predicted)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass's with eq

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


class LivePods(Mapping[str, bytes]):
    """The pods a lookup counts claims of (pod id -> the claim id their claims carry: their
    registration's), and the reverse map `pods_of` (claim id -> pod id) that turns the
    lookup's holders, named by claim id, into pods: the router's registry keeps one per
    refresh, so a lookup sends nothing per pod and maps each holder with one dict lookup. A
    claim id that is not here (a dead, retired or forged one) is dropped. A pod without a
    valid claim id (unknown: a garbled registration) is listed but matches nothing, and is
    never predicted."""

    __slots__ = ("_ids", "pods_of")

    def __init__(self, claim_ids: Mapping[str, bytes]) -> None:
        self._ids = dict(claim_ids)
        self.pods_of: dict[bytes, str] = {cid: pod for pod, cid in self._ids.items()
                                          if valid_claim_id(cid)}

    @classmethod
    def of(cls, infos: Iterable[PodInfo]) -> LivePods:
        """From the registry's live pods (their registrations' claim ids)."""
        return cls({info.pod_id: info.claim_id for info in infos})

    def claim_id(self, pod: str) -> bytes | None:
        """`pod`'s valid claim id, else None (not live, or no valid registration)."""
        cid = self._ids.get(pod)
        return cid if cid is not None and cid in self.pods_of else None

    def __getitem__(self, pod: str) -> bytes:
        return self._ids[pod]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


# -- replies ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _tiers(codes: bytes) -> tuple[Medium, ...]:
    """A claim code string's tiers, up to the first letter no pod writes (a forged claim:
    the prefix ends there). A prefix's codes repeat across lookups and pods: the tuple is
    shared (PodMatch.tiers is read-only)."""
    out: list[Medium] = []
    for code in codes:
        tier = _TIER_OF_BYTE.get(code)
        if tier is None:
            break
        out.append(tier)
    return tuple(out)


def _parse_lookup(bad: BadRecords, pods_of: Mapping[bytes, str], reply: Sequence[Any]
                  ) -> dict[str, PodMatch]:
    """The lookup's reply: its three garbage counts first (see scripts.LOOKUP_LUA), then a
    triple per holder (claim id, codes, predicted depth): the claim ids of `pods_of` (the
    live pods') become pods, any other is dropped. A claim with an unknown tier letter ends
    that pod's prefix there."""
    n = len(reply)
    if n < 3 or (n - 3) % 3:
        bad.note(BAD_REPLY, f"lookup reply of {n} items")
        return {}
    if reply[0] or reply[1] or reply[2]:
        bad.note(WRONG_TYPE, "a claim or prediction key of another Redis type", int(reply[0]))
        bad.note(BAD_PREDICTION, "a prediction whose expiry is not a number", int(reply[1]))
        bad.note(BAD_CLAIM, "a claims field that is not whole (claim id, tier mask) entries",
                 int(reply[2]))
    out: dict[str, PodMatch] = {}
    pod_of = pods_of.get
    for i in range(3, n, 3):
        pod = pod_of(reply[i])
        if pod is None:
            continue
        codes = reply[i + 1]
        try:
            tiers = _tiers(codes)
        except TypeError:  # a client decoding replies: bytes expected
            tiers = _tiers(codes.encode())
        if len(tiers) < len(codes):
            bad.note(BAD_CLAIM, f"pod {pod}: claim tier {codes[len(tiers):len(tiers) + 1]!r} "
                                f"at block {len(tiers)} "
                                f"(known: {', '.join(m.code for m in MEDIUMS)})")
        out[pod] = PodMatch(len(tiers), tiers, int(reply[i + 2]))
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


def parse_buckets(members: Iterable[Any]) -> list[int]:
    """A bucket list's members (integers); anything else (garbage) is left out."""
    out: list[int] = []
    for member in members:
        try:
            bucket = int(text(member))
        except (ValueError, UnicodeDecodeError):
            continue
        if 0 <= bucket < BUCKETS:
            out.append(bucket)
    return sorted(out)


def parse_claim_ids(members: Iterable[Any]) -> list[str]:
    """A claim id set's members (hex); anything else is left out."""
    out: list[str] = []
    for member in members:
        try:
            cid = text(member)
            if valid_claim_id(bytes.fromhex(cid)):
                out.append(cid)
        except (ValueError, UnicodeDecodeError):
            continue
    return sorted(out)


def _parse_reap_start(reply: Any) -> tuple[list[int], list[str]] | None:
    if reply == -1:
        return None
    return parse_buckets(reply[0]), parse_claim_ids(reply[1])


def _parse_strip(reply: Any) -> tuple[int, int, int]:
    return int(reply[0]), int(reply[1]), int(reply[2])


def _parse_refused(reply: Any) -> bool:
    """True when the script went ahead, False when it refused (-1)."""
    return bool(reply != -1)


# -- the calls -------------------------------------------------------------------------------
def lookup(schema: IndexSchema, block_hashes: Sequence[bytes], live: LivePods,
           predictions: bool = False, bad: BadRecords = UNCOUNTED
           ) -> Call[dict[str, PodMatch]]:
    """For the pods of `live` (pod id -> the claim id its claims carry) that hold a prefix
    of `block_hashes`, how many leading blocks, and where; with `predictions`, also the
    routers' burst predictions (PodMatch.predicted), and the pods only predicted. Pods absent
    from the reply hold nothing. Every key is in block 0's bucket: one script, one slot.
    One key and at most four arguments however long the chain, none naming pods: the reply
    names holders by claim id, which `live` maps back."""
    bucket = bucket_of(block_hashes[0])
    fields = b"".join([claim_field(h) for h in block_hashes])
    args = [schema.bucket_base(bucket), fields, "1" if predictions else ""]
    if predictions:
        args.append(b"".join(block_hashes).hex())
    return Call(scripts.LOOKUP, (schema.claims_key(bucket),), args,
                functools.partial(_parse_lookup, bad, live.pods_of))


def predict(schema: IndexSchema, claim_id: bytes, block_hashes: Sequence[bytes], start: int,
            ttl_ms: int, max_pods: int) -> Call[int]:
    """Predict the pod registered under `claim_id` (a valid one: LivePods.claim_id) holding
    blocks `start`... of the chain for `ttl_ms` (a router's dispatch, for the others'
    lookups); each key keeps at most `max_pods` pods. One script, one slot; the reply is the
    number of keys written."""
    return Call(scripts.PREDICT, schema.chain_prediction_keys(block_hashes, start),
                (claim_id, ttl_ms, max_pods), _parse_int)


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


def reap_start(schema: IndexSchema, pod_id: str, epoch: str
               ) -> Call[tuple[list[int], list[str]] | None]:
    """A dead pod's buckets and claim ids (hex), or None when the pod id came back."""
    return Call(scripts.REAP_START, (schema.pods_key,), (schema.base, pod_id, epoch),
                _parse_reap_start)


def strip(schema: IndexSchema, bucket: int, cursor: int, claim_ids: Sequence[str],
          remove: bool = True, count: int | None = None, keep_id: str = ""
          ) -> Call[tuple[int, int, int]]:
    """One HSCAN page of a bucket's claims: the claims of `claim_ids` (hex) removed (or,
    `remove` False, only counted). Reply: (next cursor, 0 when done; their claims seen; the
    claims of `keep_id` seen, left alone)."""
    packed = b"".join(bytes.fromhex(c) for c in claim_ids)
    args: list[Any] = [cursor, count or STRIP_PAGE, packed, "1" if remove else ""]
    if keep_id:
        args.append(bytes.fromhex(keep_id))
    return Call(scripts.STRIP, (schema.claims_key(bucket),), args, _parse_strip)


def reap_finish(schema: IndexSchema, pod_id: str, epoch: str,
                claim_ids: Sequence[str]) -> Call[bool]:
    """Release the stripped claim ids and remove a reaped pod's registration: False when the
    pod id came back meanwhile (its registration stays)."""
    return Call(scripts.REAP_FINISH, (schema.pods_key,),
                (schema.base, pod_id, epoch, *claim_ids), _parse_refused)


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
    live: LivePods | Mapping[str, str] | None = None, predictions: bool = False,
) -> dict[str, PodMatch]:
    """`lookup` in one EVALSHA round trip, for the pods of `live` (LivePods); without it,
    or given pod id -> epoch, for the pods live right now (read first: a second round trip,
    fine outside the request path). Every pod asked about is in the result, depth 0 where it
    holds nothing."""
    if not isinstance(live, LivePods):
        live = live_claim_ids(redis_client, schema, live)
    found = lookup(schema, block_hashes, live, predictions).run(redis_client) \
        if block_hashes and live else {}
    return {pod: found.get(pod) or PodMatch(0, []) for pod in live}


def live_claim_ids(redis_client: Any, schema: IndexSchema,
                   epochs: Mapping[str, str] | None = None) -> LivePods:
    """The live pods as a lookup takes them (one round trip): all of them, or those of
    `epochs` (pod id -> epoch) that are live under that epoch; the others of `epochs` with no
    claim id (a lookup finds only their predictions)."""
    infos = {p.pod_id: p for p in list_live_pods(redis_client, schema)}
    if epochs is None:
        return LivePods.of(infos.values())
    return LivePods({pod: (info.claim_id if (info := infos.get(pod)) is not None
                           and info.epoch == epoch else b"")
                     for pod, epoch in epochs.items()})


def list_live_pods(redis_client: Any, schema: IndexSchema) -> list[PodInfo]:
    return live_pods(schema).run(redis_client)


def count_pod_claims(redis_client: Any, schema: IndexSchema, pod_id: str) -> int:
    """How many claims `pod_id` has (any of its claim ids): its listed buckets' claims HASHes
    read page by page (work proportional to those buckets, never the keyspace)."""
    buckets = parse_buckets(redis_client.smembers(schema.pod_buckets_key(pod_id)))
    claim_ids = parse_claim_ids(redis_client.smembers(schema.pod_claim_ids_key(pod_id)))
    return sum(strip_bucket(redis_client, schema, bucket, claim_ids, remove=False)[0]
               for bucket in buckets) if claim_ids else 0


def strip_bucket(redis_client: Any, schema: IndexSchema, bucket: int,
                 claim_ids: Sequence[str], remove: bool = True, keep_id: str = ""
                 ) -> tuple[int, int]:
    """`strip` over a whole bucket, page by page: (claims of `claim_ids` removed or counted,
    claims of `keep_id` left)."""
    cursor, hits, kept = 0, 0, 0
    while True:
        cursor, n, k = strip(schema, bucket, cursor, claim_ids, remove,
                             keep_id=keep_id).run(redis_client)
        hits, kept = hits + n, kept + k
        if not cursor:
            return hits, kept


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

"""The Redis index that pods publish their blocks to and the router looks prefixes up in.

Torch-free: the router is a light process. See docs/INDEX.md for the layout and the
reasoning behind it. One module per concern:

- `schema`: the namespace, every key name, buckets, claim fields and ids, pod epochs
- `scripts`: the Lua scripts and the EVALSHA runner
- `queries`: the reads (prefix lookup, live / dead pods, namespaces) and their replies
- `pod_record`: a pod's registration (`PodInfo`), every field checked as it is read
- `bad_records`: records that do not parse, skipped and counted per reason
- `index_slots`: at most as many calls at once as the router's pool has connections
- `handshake`: whether two hash configurations agree
- `placement`: each block's bucket, learned from the KV events' parent links
- `mirror`: a pod's claims as tier bitmasks, and the net change of a batch of KV events
- `writes`: what a pod writes (registration, lease, claims) on a synchronous client
- `client`: the router's `IndexClient` on an asyncio client
- `connect`: one node or a Redis Cluster (redis+cluster:// URLs), the retry settings both
  sides use, and `REDIS_ERRORS`
"""

from pagekv.proto.index.client import IndexClient
from pagekv.proto.index.connect import (
    REDIS_ERRORS,
    check_tls_url,
    connect,
    connect_async,
    is_cluster_url,
)
from pagekv.proto.index.handshake import config_mismatch
from pagekv.proto.index.pod_record import PodInfo
from pagekv.proto.index.queries import (
    PodMatch,
    count_pod_claims,
    list_live_pods,
    list_namespaces,
    lookup_prefix,
)
from pagekv.proto.index.schema import (
    BUCKETS,
    HASH_CONFIG_FIELDS,
    IndexSchema,
    bucket_of,
    claim_field,
    new_epoch,
)
from pagekv.proto.index.scripts import register_scripts
from pagekv.proto.index.writes import clear_pod_claims

__all__ = [
    "BUCKETS",
    "HASH_CONFIG_FIELDS",
    "REDIS_ERRORS",
    "IndexClient",
    "IndexSchema",
    "PodInfo",
    "PodMatch",
    "bucket_of",
    "check_tls_url",
    "claim_field",
    "clear_pod_claims",
    "config_mismatch",
    "connect",
    "connect_async",
    "count_pod_claims",
    "is_cluster_url",
    "list_live_pods",
    "list_namespaces",
    "lookup_prefix",
    "new_epoch",
    "register_scripts",
]

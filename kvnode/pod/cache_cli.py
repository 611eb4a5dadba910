"""`pagekv cache locate|delete|prewarm` — the CacheAdmin calls, to a router or a pod.

    pagekv cache locate --target ROUTER --text "You are..."         # which pods hold it, where
    pagekv cache delete --target ROUTER --prefix-hash 9f86d081...   # gone from every tier
    pagekv cache prewarm --target ROUTER --pod node-c --token-ids 1,2,3 --pin-ttl-s 3600

Prints one line per pod (or the pre-warm's outcome); `--json` the whole answer. Exit code 1
on a refused or failed call, with its status on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from pagekv.proto.credentials import (
    ADMIN_TOKEN_ENV,
    add_client_tls_arguments,
    add_token_argument,
    bearer,
    tls_from,
    token_from,
)
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.tenant_salt import tenant_salt

ACTIONS = ("locate", "delete", "prewarm")


def _ids(value: str) -> list[int]:
    try:
        return [int(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated token ids") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("--target", default="127.0.0.1:50050", help="router or pod address")
    prefix = p.add_mutually_exclusive_group(required=True)
    prefix.add_argument("--text", help="the prefix as prompt text")
    prefix.add_argument("--token-ids", type=_ids, help="the prefix as comma-separated ids")
    prefix.add_argument("--prefix-hash", type=bytes.fromhex, metavar="HEX",
                        help="locate/delete: the hash of the prefix's last block")
    p.add_argument("--cache-salt", default="", help="the salt the prefix was hashed with")
    p.add_argument("--tenant", default="",
                   help="a tenant of the tenants file: the prefix is that tenant's (its salt "
                        "derived from the name and --cache-salt, as the router derives it) and "
                        "a prewarm counts against its quota")
    p.add_argument("--pod", default="", help="prewarm through a router: the pod to warm")
    p.add_argument("--pin-ttl-s", type=int, default=0,
                   help="prewarm: also pin it this many seconds")
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    p.add_argument("--timeout", type=float, default=600.0)
    add_client_tls_arguments(p)
    add_token_argument(p, "--admin-token", ADMIN_TOKEN_ENV, "the servers' --admin-token")


def salt_of(args: argparse.Namespace) -> str:
    """The salt the servers hash with: a tenant's is derived (the admin token's salt is taken
    as sent, like the router's)."""
    return tenant_salt(args.tenant, args.cache_salt) if args.tenant else args.cache_salt


def query_of(args: argparse.Namespace) -> pb.PrefixQuery:
    if args.prefix_hash is not None:
        return pb.PrefixQuery(prefix_hash=args.prefix_hash)
    if args.token_ids is not None:
        return pb.PrefixQuery(token_ids=pb.TokenIds(ids=args.token_ids),
                              cache_salt=salt_of(args))
    return pb.PrefixQuery(text=args.text, cache_salt=salt_of(args))


def prewarm_of(args: argparse.Namespace) -> pb.PrewarmRequest:
    if args.prefix_hash is not None:
        raise SystemExit("pagekv cache prewarm: error: give the prompt (--text or "
                         "--token-ids), not its hash")
    req = pb.PrewarmRequest(pod_id=args.pod, cache_salt=salt_of(args), tenant=args.tenant)
    if args.token_ids is not None:
        req.token_ids.ids.extend(args.token_ids)
    else:
        req.text = args.text
    if args.pin_ttl_s:
        req.cache_control.ttl_s = args.pin_ttl_s
    return req


def main(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    token = token_from(args.admin_token, ADMIN_TOKEN_ENV)
    metadata = bearer(token) if token else None
    with open_channel(args.target, tls_from(args)) as channel:
        stub = pb_grpc.CacheAdminStub(channel)
        try:
            if args.action == "prewarm":
                answer = stub.Prewarm(prewarm_of(args), timeout=args.timeout,
                                      metadata=metadata)
            elif args.action == "locate":
                answer = stub.Locate(query_of(args), timeout=args.timeout, metadata=metadata)
            else:
                answer = stub.DeletePrefix(query_of(args), timeout=args.timeout,
                                           metadata=metadata)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(MessageToDict(answer, always_print_fields_with_no_presence=True),
                         indent=2))
    elif args.action == "prewarm":
        print(f"{answer.pod_id}: {answer.prompt_tokens} tokens ready in {answer.seconds:.3f} s "
              f"({answer.cached_tokens} cached, {answer.pulled_tokens} pulled"
              f"{' from ' + answer.source if answer.source else ''}, "
              f"{answer.computed_tokens} computed)")
    else:
        verb = "held" if args.action == "locate" else "deleted"
        for h in answer.pods:
            if h.error:
                print(f"{h.pod_id}: error: {h.error}")
                continue
            print(f"{h.pod_id}: {h.gpu_blocks + h.cpu_blocks + h.disk_blocks} of "
                  f"{h.prefix_blocks} blocks {verb} (pool {h.gpu_blocks}, DRAM {h.cpu_blocks}, "
                  f"SSD {h.disk_blocks}; {'marks released' if verb == 'deleted' else 'pinned'} "
                  f"{h.pinned_blocks})")
        print(f"total: {answer.total_blocks} blocks")
    return 0

"""The demo's report (`make demo` = `pagekv bench-cluster`): a request whose prefix was pulled
from a peer pod shows those tokens as cached, in its row and in the hit rate."""

from __future__ import annotations

import re

from pagekv.deploy.bench_cluster import SOURCES, Result, report, result_of
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb


def pulled_chunk() -> pb.GenerateChunk:
    """The last chunk of a request that node-b served with 96 prompt tokens pulled from node-a
    and 16 from its own pool, as the router's stream ends it."""
    chunk = pb.GenerateChunk(served_by="node-b")
    chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 128, 8
    chunk.usage.cached_tokens = 112
    chunk.usage.cached_tokens_gpu, chunk.usage.cached_tokens_peer = 16, 96
    chunk.routing.reason = "prefix_hit"
    chunk.routing.pull_from = "node-a"
    return chunk


def test_result_of_keeps_the_peer_share_of_the_usage() -> None:
    r = result_of("warm", 1, "", 0.02, pulled_chunk(), [1, 2])
    assert r.cached == {"gpu": 16, "cpu": 0, "disk": 0, "peer": 96}
    assert sum(r.cached[s] for s in SOURCES) == pulled_chunk().usage.cached_tokens
    assert (r.served_by, r.prompt_tokens, r.reason) == ("node-b", 128, "prefix_hit")


def test_report_counts_pulled_tokens_in_the_tables_and_the_hit_rate() -> None:
    cold = Result("cold", 1, 0.2, "node-a", {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0}, 128,
                  "least_cost")
    pulled = result_of("warm", 1, "", 0.02, pulled_chunk(), [])
    text = report([cold, pulled])
    table = text.split("Prefix hits per source")[1].split("\n\n")[0]
    header, _rule, *rows = table.strip().splitlines()[1:]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "peer pull" in columns
    by_round = {cells[0]: dict(zip(columns, cells, strict=True)) for cells in
                ([c.strip() for c in row.strip("|").split("|")] for row in rows)}
    assert by_round["warm"]["peer pull"] == "96"
    assert by_round["warm"]["hit rate"] == "88%"  # (16 + 96) / 128
    assert by_round["all"]["hit rate"] == "44%"   # 112 / 256
    # The per-request line shows the pulled tokens, not 0 cached.
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("warm"))
    assert re.search(r"\b16/\s*0/\s*0/\s*96\b", line), line

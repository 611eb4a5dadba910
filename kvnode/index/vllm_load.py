"""A vLLM pod's load, read off its Prometheus page (`/metrics` on its OpenAI server), for the
lease the ingester renews: `waiting` and `running` requests (vllm:num_requests_waiting,
vllm:num_requests_running, summed over the page's series: one per engine), and `free_blocks`
when the page says both the KV cache's usage (vllm:kv_cache_usage_perc, or
vllm:gpu_cache_usage_perc before vLLM 0.9) and its size (the num_gpu_blocks label of
vllm:cache_config_info) for a single engine. The router scores a vLLM pod's queue with these
as it does a PageKV pod's; without them it knows only its own requests in flight there.

Only the lines of those few names are parsed, so the page's size (tens of KB of
histograms) costs a split and a prefix test per line.
"""

from __future__ import annotations

import re

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_CONFIG = "vllm:cache_config_info"
_NAMES = (WAITING, RUNNING, *USAGE, CACHE_CONFIG)  # (a prefix test first: cheap)
_BLOCKS = re.compile(r'(?:^|[{,])\s*num_gpu_blocks="(\d+)"')


def _sample(line: str) -> tuple[str, str, float] | None:
    """(name, labels text, value) of one sample line; None if it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        end, quoted, i = -1, False, brace + 1
        while i < len(line):  # the closing brace outside quotes (a label may hold one)
            ch = line[i]
            if ch == "\\" and quoted:
                i += 2
                continue
            if ch == '"':
                quoted = not quoted
            elif ch == "}" and not quoted:
                end = i
                break
            i += 1
        if end == -1:
            return None
        labels, rest = line[brace + 1:end], line[end + 1:]
    else:
        name, labels, rest = line[:space], "", line[space:]
    fields = rest.split()
    if not fields:
        return None
    try:
        return name, labels, float(fields[0])  # (a timestamp may follow)
    except ValueError:
        return None


def parse_vllm_load(page: str) -> dict[str, float]:
    """The load fields a vLLM /metrics page gives (absent: not on the page)."""
    waiting = running = None
    usage: list[float] = []
    blocks: list[int] = []
    for line in page.splitlines():
        if not line.startswith(_NAMES):
            continue
        sample = _sample(line)
        if sample is None:
            continue
        name, labels, value = sample
        if name == WAITING:
            waiting = (waiting or 0.0) + value
        elif name == RUNNING:
            running = (running or 0.0) + value
        elif name in USAGE:
            usage.append(value)
        elif name == CACHE_CONFIG:
            found = _BLOCKS.search(labels)
            if found:
                blocks.append(int(found.group(1)))
    load: dict[str, float] = {}
    if waiting is not None:
        load["waiting"] = waiting
    if running is not None:
        load["running"] = running
    if len(usage) == 1 and len(blocks) == 1:
        load["free_blocks"] = float(round((1.0 - min(max(usage[0], 0.0), 1.0)) * blocks[0]))
    return load

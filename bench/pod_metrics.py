"""A pod's metrics page read from any address (bench.kv_pull's `scrape` reads loopback only):
every sample summed over its labels by name, the pull fallbacks also kept by reason and the
pulls by data transport and outcome."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

FALLBACKS = "pagekv_kv_pull_fallbacks_total"
BY_TRANSPORT = "pagekv_kv_pulls_by_transport_total"


def scrape_url(url: str, timeout: float = 10.0) -> dict[str, float]:
    """{sample name: sum over labels}, plus "pagekv_kv_pull_fallbacks_total/<reason>" and
    "pagekv_kv_pulls_by_transport_total/<transport>/<outcome>"."""
    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if s.name == FALLBACKS:
                key = f"{FALLBACKS}/{s.labels.get('reason', '')}"
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == BY_TRANSPORT:
                key = (f"{BY_TRANSPORT}/{s.labels.get('transport', '')}/"
                       f"{s.labels.get('outcome', '')}")
                out[key] = out.get(key, 0.0) + s.value
    return out


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The samples that changed between two scrapes, by how much."""
    return {k: after[k] - before.get(k, 0.0) for k in after
            if after[k] != before.get(k, 0.0)}


def fallback_reasons(change: dict[str, float]) -> dict[str, float]:
    """The fallbacks in a `grown` result, by reason."""
    return {k.split("/", 1)[1]: v for k, v in change.items()
            if k.startswith(FALLBACKS + "/") and v}


def transports(change: dict[str, float]) -> dict[str, float]:
    """The pulls in a `grown` result by "<transport>/<outcome>" (a pod before the data
    transports has none)."""
    return {k.split("/", 1)[1]: v for k, v in change.items()
            if k.startswith(BY_TRANSPORT + "/") and v}

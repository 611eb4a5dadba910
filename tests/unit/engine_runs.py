"""Running one request through an in-process engine to its end (the engine tests' helper)."""

from __future__ import annotations

from typing import Any

from pagekv.kvnode.engine.sampling_params import SamplingParams


def run_request(engine: Any, prompt: list[int], params: SamplingParams, **request: Any):
    """The request's last delta and every token it produced; `request`: add_request's
    keywords (cache_control, cache_salt, tenant, lora_id...)."""
    rid = engine.add_request(None, prompt, params, **request)
    last, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                last = out
                tokens += out.outputs[0].token_ids
    assert last is not None and last.finished
    return last, tokens

"""Offline API: `LLM(...).generate(prompts, SamplingParams)`, vLLM's shape, on the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.outputs import CompletionOutput, RequestOutput
from pagekv.kvnode.engine.prompt_inputs import parse_prompts
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.engine.transformers_tokenizer import TransformersStyleTokenizer
from pagekv.kvnode.engine.vllm_options import VLLM_ONLY_OPTIONS, check_vllm_options
from pagekv.proto.model_files.chat import Message, apply_chat_template

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # (typing's own from Python 3.13)

logger = logging.getLogger(__name__)


def _one_conversation(messages: Sequence[Message] | Sequence[Sequence[Message]]
                      ) -> TypeIs[Sequence[Message]]:
    """True for one conversation (its first item is a message); False for a list of them,
    or for no conversation at all (an empty list, which is both)."""
    return bool(messages) and isinstance(messages[0], Mapping)


class LLM:
    """Every `EngineArgs` field is a keyword: `LLM(model="pagekv-tiny", block_size=16, ...)`,
    `dtype=` and `seed=` as vLLM's. A few vLLM-only options are taken at the value that asks
    for nothing PageKV lacks and refused, naming why, at any other (vllm_options.py)."""

    def __init__(self, model: str = "pagekv-tiny", **kwargs: Any) -> None:
        vllm_only = {k: kwargs.pop(k) for k in list(kwargs) if k in VLLM_ONLY_OPTIONS}
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s): {sorted(unknown)}")
        check_vllm_options(model, vllm_only)
        self.engine = Engine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def get_tokenizer(self) -> TransformersStyleTokenizer:
        """The model's tokenizer with transformers' `encode`, `decode` and
        `apply_chat_template` (as vLLM's `LLM.get_tokenizer()` hands out)."""
        return TransformersStyleTokenizer(self.tokenizer)

    def reset_prefix_cache(self, include_tiers: bool = False) -> bool:
        """Forget every cached prefix (with `include_tiers`, the DRAM and SSD tiers' too);
        False while requests are running (between generate calls they never are)."""
        ok, _ = self.engine.reset_prefix_cache(include_tiers)
        return ok

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, together as one continuous batch. A prompt is a
        str, a list of token ids, or vLLM's dict (prompt_inputs.py); `prompts` is one or a
        list of them. `use_tqdm`: a progress bar over finished requests (or a callable made
        like tqdm's, as vLLM takes); False: none."""
        batch = parse_prompts(prompts)
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError("need one SamplingParams per prompt, or a single one for all")
        tokens = [p.token_ids if p.token_ids is not None else self.tokenizer.encode(p.text or "")
                  for p in batch]
        # Every prompt is checked before any is queued: a bad one leaves nothing behind.
        for ids, sp in zip(tokens, per_prompt, strict=True):
            self.engine.validate(ids, sp)
        request_ids = []
        for ids, p, sp in zip(tokens, batch, per_prompt, strict=True):
            self._counter += 1
            request_ids.append(self.engine.add_request(
                str(self._counter), ids, sp, cache_salt=p.cache_salt or cache_salt,
                prompt=p.text))
        return self._run(request_ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]
             ) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        results: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    results[delta.request_id] = out = merge(results.get(delta.request_id),
                                                            delta)
                    if out.finished and bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in request_ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or
        several, each rendered with the model's chat template and generated together. The
        template writes its own special tokens, so no BOS is added (as vLLM does); each
        output's `prompt` is the rendered text."""
        convs = [messages] if _one_conversation(messages) else list(messages)
        texts = [apply_chat_template(self.tokenizer, conv, chat_template=chat_template,
                                     add_generation_prompt=add_generation_prompt,
                                     **(chat_template_kwargs or {}))
                 for conv in convs]
        prompts = [{"prompt_token_ids": self.tokenizer.encode(t, add_bos=False), "prompt": t}
                   for t in texts]
        return self.generate(prompts, sampling_params, cache_salt=cache_salt,
                             use_tqdm=use_tqdm)


def merge(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold one step's delta into the accumulated output of a request."""
    if acc is None:
        acc = RequestOutput(delta.request_id, delta.prompt_token_ids, [], prompt=delta.prompt)
    if delta.prompt_logprobs is not None:  # the first delta's (once)
        acc.prompt_logprobs = delta.prompt_logprobs
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        cur = by_index.get(c.index)
        if cur is None:
            cur = by_index[c.index] = CompletionOutput(c.index, [], "")
        cur.token_ids.extend(c.token_ids)
        cur.text += c.text
        cur.finish_reason = c.finish_reason
        cur.stop_reason = c.stop_reason
        cur.cumulative_logprob = c.cumulative_logprob  # a running sum: the latest is the total
        if c.logprobs is not None:
            if cur.logprobs is None:
                cur.logprobs = []
            cur.logprobs.extend(c.logprobs)
    acc.outputs = [by_index[i] for i in sorted(by_index)]
    acc.finished = delta.finished
    acc.num_cached_tokens = delta.num_cached_tokens
    acc.cached_tokens_by_tier = delta.cached_tokens_by_tier
    acc.metrics = delta.metrics
    return acc

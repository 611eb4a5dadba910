"""Offline API: `LLM(...).generate(prompts, SamplingParams)`, vLLM's shape, on the engine."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.outputs import CompletionOutput, RequestOutput
from pagekv.kvnode.engine.sampling_params import SamplingParams
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
    """Every `EngineArgs` field is a keyword: `LLM(model="pagekv-tiny", block_size=16, ...)`."""

    def __init__(self, model: str = "pagekv-tiny", **kwargs) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s): {sorted(unknown)}")
        self.engine = Engine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, together as one continuous batch."""
        batch: Sequence[str | Sequence[int]] = [prompts] if isinstance(prompts, str) else prompts
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError("need one SamplingParams per prompt, or a single one for all")
        ids = []
        for prompt, p in zip(batch, per_prompt, strict=True):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._counter += 1
            ids.append(self.engine.add_request(str(self._counter), tokens, p, cache_salt=cache_salt))
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                results[delta.request_id] = merge(results.get(delta.request_id), delta)
        return [results[i] for i in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or
        several, each rendered with the model's chat template and generated together. The
        template writes its own special tokens, so no BOS is added (as vLLM does)."""
        convs = [messages] if _one_conversation(messages) else list(messages)
        prompts = [
            self.tokenizer.encode(
                apply_chat_template(self.tokenizer, conv, chat_template=chat_template,
                                    add_generation_prompt=add_generation_prompt,
                                    **(chat_template_kwargs or {})),
                add_bos=False)
            for conv in convs
        ]
        return self.generate(prompts, sampling_params, cache_salt=cache_salt)


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

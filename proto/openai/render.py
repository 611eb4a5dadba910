"""The pods' stream chunks (pb.GenerateChunk) as OpenAI's JSON objects.

One `Renderer` per HTTP request: it takes each backend chunk of each prompt's request, returns
the stream event for it (streaming) and accumulates the whole response (non-streaming), so
both shapes come from one reading of the chunks. Choice `k * n + i` is completion i of prompt
k, as OpenAI and vLLM number them.

With vLLM's `return_token_ids`, each choice carries `token_ids` too (a stream: the new ones
of each event) and `prompt_token_ids` (a stream: in each choice's first event).

vLLM's echo and prompt logprobs (prompt_echo.py says what a prompt shows): echo puts the
prompt's text before each choice's text and, with logprobs, its tokens before the generated
ones in `logprobs` (the first with a null logprob and top_logprobs); a stream does both in
each choice's first event. `prompt_logprobs` are each choice's (chat: the response's) list
of `null` then, per prompt token, `{token id: {logprob, rank, decoded_token}}` for the
token and the top ones (rank: 1 = most likely; null where the token is below the top ones
asked for, whose rank the engine does not report). Completions' `top_logprobs` show the
chosen token and the `logprobs` best (up to logprobs + 1 entries, as OpenAI's and vLLM's).
JSON has no -inf: a logprob below -9999 shows as -9999 (vLLM's clamp).

Usage sits where OpenAI puts it (`usage.prompt_tokens_details.cached_tokens`); the `pagekv`
object is PageKV's extension: the cached prompt tokens by the tier they came from and, for
a request that went through a router, the pod that served it and why (README "OpenAI API").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from pagekv.proto.openai.prompt_echo import PromptEcho
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
TOKEN_TEXT_CACHE = 65536  # token strings kept for logprobs (one vocabulary's worth)
MIN_LOGPROB = -9999.0  # vLLM's floor: JSON cannot carry -inf

# One position of completions' logprobs: the token, its logprob and the top tokens there
# (None, None for the first prompt token of an echo: nothing precedes it).
_Position = tuple[int, float | None, Sequence[pb.Logprob] | None]


class TokenTexts:
    """A token id's text as logprobs show it: the token decoded alone, special tokens
    included (a token that is part of a multi-byte character shows as U+FFFD)."""

    def __init__(self, decode: Callable[..., str]) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    @staticmethod
    def as_id(token_id: int) -> str:
        """vLLM's return_tokens_as_token_ids form: exact where a token is not text alone."""
        return f"token_id:{token_id}"

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id], skip_special_tokens=False)
            if len(self._cache) < TOKEN_TEXT_CACHE:
                self._cache[token_id] = text
        return text


def stop_reason(msg: pb.GenerateChunk | pb.Completion) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended a choice (None for
    EOS, length or abort)."""
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # a chat stream names the role in a choice's first delta


@dataclass(slots=True)
class _PromptResult:
    usage: pb.Usage | None = None
    served_by: str = ""
    routing: pb.RoutingInfo | None = None
    echo: PromptEcho = field(default_factory=PromptEcho)
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _positions(items: Sequence[pb.TokenLogprobs]) -> list[_Position]:
    return [(t.sampled.token_id, t.sampled.logprob, t.top) for t in items]


class Renderer:
    """One request's chunks → OpenAI's objects; `chat` picks the chat.completion shapes."""

    def __init__(self, *, chat: bool, response_id: str, model: str, n: int, num_prompts: int,
                 token_texts: Callable[[int], str], logprobs: bool, streaming: bool = False,
                 include_usage: bool = False, token_ids: bool = False,
                 echo: bool = False, echoes: list[PromptEcho] | None = None,
                 echo_only: bool = False,
                 num_logprobs: int | None = None, prompt_logprobs: bool = False,
                 chat_echo: str = "") -> None:
        self.chat = chat
        self.streaming = streaming
        self.id = response_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self.texts = token_texts
        self.want_logprobs = logprobs
        self.include_usage = include_usage
        self.want_token_ids = token_ids
        self.echo = echo
        self.echo_only = echo_only  # the prompt alone: the one computed token left out
        # completions' top_logprobs: the chosen token and the `logprobs` best
        self.top_limit = None if num_logprobs is None else num_logprobs + 1
        self.want_prompt_logprobs = prompt_logprobs
        self.chat_echo = chat_echo  # chat's echo: the last message, before every answer
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.prompts = [_PromptResult() for _ in range(num_prompts)]
        for res, prompt_echo in zip(self.prompts, echoes or (), strict=False):
            res.echo = prompt_echo

    # -- reading the chunks -----------------------------------------------------------------
    def add(self, prompt: int, chunk: pb.GenerateChunk) -> dict[str, Any] | None:
        """Take one chunk of prompt `prompt`'s stream; when streaming, returns its event
        (None for a chunk that moves no choice, such as a bare usage chunk)."""
        res = self.prompts[prompt]
        if chunk.prompt_logprobs:  # the request's first chunk: before any choice's event
            res.prompt_logprobs = list(chunk.prompt_logprobs)
        if chunk.HasField("usage"):
            res.usage = chunk.usage
            res.served_by = chunk.served_by
            if chunk.HasField("routing"):
                res.routing = chunk.routing
        if not (chunk.token_ids or chunk.text or chunk.finish_reason):
            return None
        index = prompt * self.n + chunk.index
        c = self.choices[index]
        text, ids, items = chunk.text, list(chunk.token_ids), list(chunk.logprobs)
        if self.echo_only:
            text, ids, items = "", [], []
        c.text.append(text)
        if self.want_token_ids:
            c.token_ids.extend(ids)
        if chunk.finish_reason:
            c.finish_reason = FINISH_NAMES.get(chunk.finish_reason, "stop")
            c.stop_reason = stop_reason(chunk)
        if not self.streaming:
            if self.want_logprobs:
                c.logprobs.extend(items)
            return None
        if c.started or not self._echoes(res):
            if not (text or chunk.finish_reason or self.want_logprobs
                    or (self.want_token_ids and ids)):
                return None  # tokens whose text is held back (a partial character): no event
        positions = _positions(items)
        if not c.started:  # the choice's first event: what it shows of the prompt first
            text = self._echo_text(res) + text
            positions = self._prompt_positions(res) + positions
        logprobs = self._logprobs(positions, c) if self.want_logprobs else None
        return self._event(index, c, text, logprobs, ids, res)

    # -- the prompt's part ------------------------------------------------------------------
    def _echoes(self, res: _PromptResult) -> bool:
        """Whether a choice's first event has something of the prompt to show."""
        return bool(self._echo_text(res) or self._prompt_positions(res))

    def _echo_text(self, res: _PromptResult) -> str:
        return self.chat_echo if self.chat else res.echo.text

    def _prompt_positions(self, res: _PromptResult) -> list[_Position]:
        """Echo with logprobs: the prompt's tokens, first in completions' logprobs."""
        ids = res.echo.token_ids
        if self.chat or not (self.echo and self.want_logprobs and ids):
            return []
        first: list[_Position] = [(ids[0], None, None)]
        return first + _positions(res.prompt_logprobs)

    def _prompt_logprobs_json(self, res: _PromptResult) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: null for the first token, then per prompt token its
        entry and the top ones', keyed by token id."""
        texts = self.texts
        out: list[dict[str, Any] | None] = [None]
        for t in res.prompt_logprobs:
            entry = {str(t.sampled.token_id): {
                "logprob": _finite(t.sampled.logprob), "rank": None,
                "decoded_token": texts(t.sampled.token_id)}}
            for rank, x in enumerate(t.top, 1):  # the prompt's token among them: its rank
                entry[str(x.token_id)] = {"logprob": _finite(x.logprob), "rank": rank,
                                          "decoded_token": texts(x.token_id)}
            out.append(entry)
        return out

    # -- streaming --------------------------------------------------------------------------
    def _event(self, index: int, c: _Choice, text: str, logprobs: Any,
               token_ids: list[int], res: _PromptResult) -> dict[str, Any]:
        first = not c.started
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
        c.started = True
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if self.want_token_ids:
            choice["token_ids"] = token_ids
            if first and not self.chat and res.echo.token_ids is not None:
                choice["prompt_token_ids"] = res.echo.token_ids
        event = self._envelope([choice])
        if self.include_usage:
            event["usage"] = None  # OpenAI's rule: null on every chunk but the last
        return event

    def usage_event(self) -> dict[str, Any]:
        """The stream's last event when include_usage: no choices, the usage, and `pagekv`."""
        return {**self._envelope([]), "usage": self.usage(), "pagekv": self.pagekv()}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    # -- the whole response -----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(self.choices):
            res = self.prompts[index // self.n]
            text = self._echo_text(res) + "".join(c.text)
            logprobs = None
            if self.want_logprobs:
                logprobs = self._logprobs(self._prompt_positions(res) + _positions(c.logprobs),
                                          c)
            if self.chat:
                choice: dict[str, Any] = {
                    "index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs, "finish_reason": c.finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}
            choice["stop_reason"] = c.stop_reason
            if self.want_token_ids:
                choice["token_ids"] = c.token_ids
                if not self.chat and res.echo.token_ids is not None:
                    choice["prompt_token_ids"] = res.echo.token_ids
            if self.want_prompt_logprobs and not self.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs_json(res)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
               "choices": choices, "usage": self.usage(), "pagekv": self.pagekv()}
        if self.want_prompt_logprobs and self.chat:  # vLLM's place for chat: the response's
            out["prompt_logprobs"] = self._prompt_logprobs_json(self.prompts[0])
        return out

    def usage(self) -> dict[str, Any]:
        prompt = completion = cached = 0
        for r in self.prompts:
            if r.usage is not None:
                prompt += r.usage.prompt_tokens
                completion += r.usage.completion_tokens
                cached += r.usage.cached_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def pagekv(self) -> dict[str, Any]:
        """PageKV's extension object (documented in README "OpenAI API")."""
        per_prompt = [_prompt_extension(r) for r in self.prompts]
        tiers = {t: sum(p["cached_tokens_by_tier"][t] for p in per_prompt)
                 for t in ("gpu", "cpu", "disk", "peer")}
        out: dict[str, Any] = {"cached_tokens_by_tier": tiers,
                               "served_by": per_prompt[0]["served_by"],
                               "routing": per_prompt[0]["routing"]}
        if len(per_prompt) > 1:
            out["prompts"] = per_prompt
        return out

    # -- logprobs ---------------------------------------------------------------------------
    def _logprobs(self, positions: list[_Position], c: _Choice) -> dict[str, Any]:
        texts = self.texts
        if self.chat:
            return {"content": [
                {**_token_entry(texts(tid), lp or 0.0),
                 "top_logprobs": [_token_entry(texts(x.token_id), x.logprob) for x in top or ()]}
                for tid, lp, top in positions], "refusal": None}
        tokens, offsets, values, tops = [], [], [], []
        for tid, lp, top in positions:
            token = texts(tid)
            tokens.append(token)
            offsets.append(c.text_offset)
            c.text_offset += len(token)
            values.append(None if lp is None else _finite(lp))
            tops.append(None if lp is None else self._top(tid, lp, top or ()))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _top(self, token_id: int, logprob: float, top: Sequence[pb.Logprob]
             ) -> dict[str, float]:
        """The chosen token, then the best ones (by id: the chosen one once), as texts."""
        by_id = {token_id: logprob}
        for x in top:
            by_id[x.token_id] = x.logprob
        return {self.texts(t): _finite(v) for t, v in islice(by_id.items(), self.top_limit)}


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _prompt_extension(r: _PromptResult) -> dict[str, Any]:
    u = r.usage or pb.Usage()
    return {"served_by": r.served_by or None,
            "cached_tokens_by_tier": {"gpu": u.cached_tokens_gpu, "cpu": u.cached_tokens_cpu,
                                      "disk": u.cached_tokens_disk,
                                      "peer": u.cached_tokens_peer},
            "routing": routing_json(r.routing) if r.routing is not None else None}


def routing_json(info: pb.RoutingInfo) -> dict[str, Any]:
    """A router's decision, every field present (proto3 would drop the zeros)."""
    return {
        "chosen_pod": info.chosen_pod, "chosen_address": info.chosen_address,
        "reason": info.reason, "predicted_cached_tokens": info.predicted_cached_tokens,
        "prompt_blocks": info.prompt_blocks, "lookup_ms": round(info.lookup_ms, 3),
        "pull_from": info.pull_from or None, "pull_tokens": info.pull_tokens,
        "predicted_pull_saving_s": info.predicted_pull_saving_s,
        "candidates": [{
            "pod_id": s.pod_id, "address": s.address, "cached_tokens": s.cached_tokens,
            "cached_tokens_by_tier": {"gpu": s.cached_tokens_gpu, "cpu": s.cached_tokens_cpu,
                                      "disk": s.cached_tokens_disk},
            "queue_waiting": s.queue_waiting, "queue_running": s.queue_running,
            "estimated_cost_s": s.estimated_cost_s, "eligible": s.eligible,
            "excluded_reason": s.excluded_reason or None,
            "pull_from": s.pull_from or None, "pull_tokens": s.pull_tokens,
            "pull_saving_s": s.pull_saving_s,
        } for s in info.candidates],
    }

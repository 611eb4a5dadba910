"""Sampling parameters of a generation request (vLLM's names, defaults and bounds)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagekv.proto.requests import MAX_LOGPROBS


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Strings that end a completion once its text contains one (cut before it); a str is one.
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # no EOS, stop token or stop string ends a completion before this
    presence_penalty: float = 0.0  # OpenAI's, on the completion's own tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's (CTRL's), on prompt and completion tokens
    logprobs: int | None = None  # the sampled token's and this many top tokens' logprobs
    # After temperature: tokens less likely than min_p x the most likely one are dropped.
    min_p: float = 0.0
    # Every prompt token's logprob and this many top tokens' at its position (raw logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # special tokens stay out of the detokenized text

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", "must be >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if type(self.top_k) is not int or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive int")
        if self.seed is not None and type(self.seed) is not int:
            raise bad("seed", "must be an int or None")
        if type(self.n) is not int or self.n < 1:
            raise bad("n", "must be an int >= 1")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative ints")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        rep = self.repetition_penalty
        if not _is_number(rep) or not (rep > 0 and math.isfinite(rep)):
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.logprobs is not None and (
                type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.prompt_logprobs is not None and (
                type(self.prompt_logprobs) is not int
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if type(self.skip_special_tokens) is not bool:
            raise bad("skip_special_tokens", "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's tokens so far (penalties, min_tokens)."""
        return self.min_tokens > 0 or self.has_penalties

"""What a generation returns: vLLM's RequestOutput / CompletionOutput shape, plus timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagekv.proto.medium import MEDIUMS


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """One token's log-probabilities under the model's raw distribution: a generated token,
    or a prompt token (given the prompt before it)."""

    token_id: int  # the sampled token (the prompt's token)
    logprob: float  # its natural log-probability
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # One per token id when SamplingParams.logprobs is set, else None.
    logprobs: list[TokenLogprobs] | None = None
    # What stopped a "stop" completion: the stop string, the stop token id; None for EOS.
    stop_reason: str | int | None = None
    # The sum of the sampled tokens' logprobs so far (vLLM's): set when logprobs were asked.
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(slots=True)
class RequestOutput:
    """Either the whole result (offline API) or one step's delta (engine.step, streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(MEDIUMS, 0)
    )
    metrics: RequestMetrics | None = None
    prompt: str | None = None  # the prompt text, when the caller gave text
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing
    # precedes it); on the request's first delta only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Its peer pull (a P/D handover on a decode pod): seconds its admission waited, and the
    # fallback reason ("" : none, or no pull).
    kv_pull_s: float = 0.0
    kv_pull_fallback: str = ""

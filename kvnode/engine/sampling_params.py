"""Sampling parameters of a generation request (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-compatible)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings with the names and defaults vLLM users know.

    Invariant after construction: every field is in its valid range (``ValueError`` otherwise).
    ``temperature == 0`` means greedy. ``max_tokens=None`` means "up to the model context".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # number of top logprobs to return per token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

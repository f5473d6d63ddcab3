"""Per-request and per-step records: the raw data every metric and plot is computed from.

All times are seconds relative to the start of one run (``t0``, a ``time.monotonic`` reading
taken just before the first request is due), so a record is meaningful on its own and the
JSON a run writes is enough to recompute every metric offline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request.

    Invariants once a run is over: ``ok`` implies ``sent_s <= first_token_s <= end_s`` and
    ``output_len >= 1``; ``chunk_times`` is non-decreasing and starts at ``first_token_s``.
    ``sent_s is None`` means the request was never sent (run interrupted or out of time).
    """

    index: int
    prompt_len: int  # prompt tokens sent (exact for token-id prompts)
    expected_output_len: int  # max_tokens asked for (== min_tokens when ignore_eos)
    scheduled_s: float  # when the workload wanted it sent
    sent_s: float | None = None  # when it was actually sent (>= scheduled_s)
    first_token_s: float | None = None
    end_s: float | None = None
    output_len: int = 0  # output tokens generated, as verified (see ``count_source``)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    ok: bool = False
    error: str | None = None
    prompt_len_reported: int | None = None  # the server's usage.prompt_tokens, if given
    count_source: str = ""  # "usage", "chunks" or "engine": where output_len came from
    count_mismatch: bool = False  # output_len != expected_output_len although ignore_eos

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first output token."""
        if self.sent_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e(self) -> float | None:
        """Seconds from sending to the end of the response."""
        if self.sent_s is None or self.end_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None with fewer than 2 tokens."""
        if self.first_token_s is None or self.end_s is None or self.output_len < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed chunks (one token per chunk on most servers)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step as seen by the in-process driver (from ``engine.stats``).

    ``batches`` holds ``(rows, min_kv_len, max_kv_len, kv_tokens)`` per decode batch.
    """

    t: float
    step_id: int
    prefill_tokens: int
    decode_rows: int
    batches: tuple[tuple[int, int, int, int], ...]
    bubble_fraction: float
    compute_s: float
    copy_wait_s: float

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["batches"] = [list(b) for b in self.batches]
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepSample:
        data = dict(data)
        data["batches"] = tuple(tuple(b) for b in data["batches"])
        return cls(**data)


@dataclass(slots=True)
class RunResult:
    """One target driven with one load (one rate, one round).

    ``engine_stats``: totals over the run from the engine (in-process) or from its /metrics
    (HTTP), including ``bubble_fraction`` when the engine exposes it; None otherwise.
    """

    label: str
    target: str  # the URL or "policy:NAME"
    rate: float | None  # offered request rate; None = replay or all at once
    round: int
    records: list[RequestRecord]
    started_at: str  # wall-clock ISO time
    interrupted: bool = False
    engine_stats: dict[str, Any] | None = None
    steps: list[StepSample] | None = None
    notes: list[str] = field(default_factory=list)

"""``Load``: everything a driver (HTTP client or in-process) needs to replay one workload."""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.bench.openai_stream import RequestOptions
from alignedserve.bench.prompts import PromptFactory
from alignedserve.bench.records import RequestRecord
from alignedserve.bench.workloads import RequestSpec


@dataclass(frozen=True, slots=True)
class Load:
    """Requests with due times, limits and request options.

    ``offsets[i]`` (seconds from the run start, non-decreasing) is when ``requests[i]`` is due;
    ``concurrency`` caps requests in flight (None = no cap); after ``duration_s`` seconds no
    new request is sent, and those in flight finish. ``warmup`` small requests run before the
    measured run and are not recorded.
    """

    requests: tuple[RequestSpec, ...]
    offsets: tuple[float, ...]
    prompts: PromptFactory
    options: RequestOptions
    concurrency: int | None = None
    duration_s: float | None = None
    warmup: int = 1

    def __post_init__(self) -> None:
        if len(self.requests) != len(self.offsets):
            raise ValueError("one due time per request is needed")
        if any(b < a for a, b in zip(self.offsets, self.offsets[1:])):
            raise ValueError("due times must be non-decreasing")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be > 0")

    def new_records(self) -> list[RequestRecord]:
        return [RequestRecord(r.index, r.prompt_len, r.output_len, t)
                for r, t in zip(self.requests, self.offsets)]

    def out_of_time(self, now: float) -> bool:
        return self.duration_s is not None and now >= self.duration_s

    def warmup_prompt(self, i: int) -> list[int] | str:
        # Its own RNG stream, so warm-up never repeats (and pre-caches) a measured prompt.
        return self.prompts.build(i, 16, stream=1)

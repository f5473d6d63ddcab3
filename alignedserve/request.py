"""Request: the engine's record of one sequence being served.

A request is owned by the scheduler; the executor only reads it. Its KV cache holds
``num_computed_tokens`` tokens; the last sampled token is not yet in the cache until the next
decode step feeds it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from alignedserve.kv.store import KVHandle
from alignedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV yet
    RUNNING = "running"  # prefilling or decoding, KV resident on a device tier
    PAUSED = "paused"  # in flight, KV parked in the host tier (swapped out / pooled)
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or model context reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside the engine


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # One {token_id: logprob} per output token, kept only when params.logprobs is set.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    kv: KVHandle | None = None
    num_computed_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    # Scheduler step at which the request first entered the waiting queue (set by
    # sched.waiting.WaitingQueue.push, kept across preemptions: it orders aged requests).
    queued_step: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while prompt (or recomputed) tokens remain to be put in the KV cache."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """Upper bound on prompt + output tokens this request can reach."""
        limit = self.max_model_len
        if self.params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + self.params.max_tokens)
        return limit

    def stop_reason_after_append(self) -> FinishReason | None:
        """Token-level stop check for the newest output token (stop strings are the engine's)."""
        n_out = len(self.output_token_ids)
        token = self.output_token_ids[-1]
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in self.params.stop_token_ids:
                return FinishReason.STOP
        if self.num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

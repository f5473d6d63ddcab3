"""The step plan (scheduler -> executor) and the step output (executor -> scheduler).

A plan says, for one engine step: which KV operations to replay first (in order), which
prefill chunks to compute, and which decode batches to run. All token work of a plan runs in
one forward pass; attention is computed per prefill chunk and per decode row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alignedserve.kv.store import KVOp
from alignedserve.request import Request


@dataclass(slots=True)
class PrefillChunk:
    """Prompt (or recomputed) tokens ``[start, start + num_tokens)`` of one request.

    ``sample`` is True on the chunk that completes a fresh prompt: its last position yields the
    request's first output token.
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.start + self.num_tokens]


@dataclass(slots=True)
class DecodeBatch:
    """Requests that each feed their newest token (at position ``num_tokens - 1``) this step.

    ``batch_id`` names the scheduler's cohort (−1 when the policy has no cohorts).
    """

    requests: list[Request]
    batch_id: int = -1

    def kv_lengths(self) -> list[int]:
        """KV length each row attends over this step (its new token included)."""
        return [r.num_tokens for r in self.requests]


@dataclass(slots=True)
class StepPlan:
    step_id: int
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_batches: list[DecodeBatch] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def decode_requests(self) -> list[Request]:
        return [r for b in self.decode_batches for r in b.requests]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decode_requests)

    @property
    def has_work(self) -> bool:
        return bool(self.prefills or self.decode_batches)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # None on the plain-greedy path (no row asked for logprobs)
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class StepOutput:
    """What the executor returns: one sampled token per sampling request, plus timings."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    compute_s: float = 0.0
    copy_wait_s: float = 0.0
    copy_bytes: int = 0

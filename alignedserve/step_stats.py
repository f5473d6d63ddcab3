"""Per-step records: what ran, how aligned it was, and what it waited on.

The *bubble* of a decode batch is the attention work its rows would waste if every row were
padded to the batch's longest KV length (or, equivalently, the time the shorter rows idle
while the longest finishes): ``sum(max_len - len_i)`` over rows, reported as a fraction of
``rows * max_len``. Zero means perfectly aligned.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from alignedserve.kv.store import KVStore
from alignedserve.sched.plan import StepOutput, StepPlan


@dataclass(frozen=True, slots=True)
class BatchRecord:
    rows: int
    min_len: int
    max_len: int
    kv_tokens: int  # sum of the rows' KV lengths: the attention work actually needed

    @property
    def spread(self) -> int:
        return self.max_len - self.min_len

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.max_len

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.kv_tokens / self.padded_tokens if self.padded_tokens else 0.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    step_id: int
    prefill_tokens: int
    decode_rows: int
    batches: tuple[BatchRecord, ...]
    compute_s: float
    copy_wait_s: float
    copy_bytes: int
    device_kv_used: float  # fraction of the device tier(s) in use after the step
    first_tokens: int = 0  # prefill chunks that completed a prompt (each sampled a token)

    @property
    def output_tokens(self) -> int:
        """Tokens sampled by the step: one per decode row and per completed prompt."""
        return self.decode_rows + self.first_tokens

    @property
    def bubble_fraction(self) -> float:
        padded = sum(b.padded_tokens for b in self.batches)
        needed = sum(b.kv_tokens for b in self.batches)
        return 1.0 - needed / padded if padded else 0.0


def record_step(plan: StepPlan, out: StepOutput, store: KVStore) -> StepRecord:
    batches = []
    for batch in plan.decode_batches:
        lengths = batch.kv_lengths()
        if lengths:
            batches.append(BatchRecord(len(lengths), min(lengths), max(lengths), sum(lengths)))
    devices = store.device_tiers
    total = sum(store.total(t) for t in devices)
    used = sum(store.used(t) for t in devices)
    return StepRecord(plan.step_id, sum(c.num_tokens for c in plan.prefills),
                      sum(b.rows for b in batches), tuple(batches), out.compute_s,
                      out.copy_wait_s, out.copy_bytes, used / total if total else 0.0,
                      sum(1 for c in plan.prefills if c.sample))


@dataclass(slots=True)
class StepStats:
    """A bounded window of recent step records plus running totals since start."""

    window: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4096))
    # (end time, output tokens) of recent steps, for rates over wall time (times given to add)
    timeline: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=8192))
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_tokens: int = 0
    padded_tokens: int = 0
    compute_s: float = 0.0
    copy_wait_s: float = 0.0
    copy_bytes: int = 0

    def add(self, rec: StepRecord, end_time: float | None = None) -> None:
        self.window.append(rec)
        if end_time is not None:
            self.timeline.append((end_time, rec.output_tokens))
        self.steps += 1
        self.prefill_tokens += rec.prefill_tokens
        self.decode_tokens += rec.decode_rows
        self.kv_tokens += sum(b.kv_tokens for b in rec.batches)
        self.padded_tokens += sum(b.padded_tokens for b in rec.batches)
        self.compute_s += rec.compute_s
        self.copy_wait_s += rec.copy_wait_s
        self.copy_bytes += rec.copy_bytes

    def output_tokens_per_s(self, now: float, span_s: float) -> float:
        """Output tokens per second over the ``span_s`` seconds before ``now`` (timeline
        clock); safe to call from another thread while steps are added."""
        recent = [n for t, n in tuple(self.timeline) if now - span_s <= t <= now]
        return sum(recent) / span_s if span_s > 0 else 0.0

    def recent_bubble_fraction(self, steps: int | None = None) -> float:
        """Attention work lost to misalignment over the decode batches of the last ``steps``
        records in the window (all of it when None); safe to call from another thread."""
        window = tuple(self.window)  # a C-level copy of the deque: atomic under the GIL
        batches = [b for rec in window[-steps if steps else 0:] for b in rec.batches]
        padded = sum(b.padded_tokens for b in batches)
        return 1.0 - sum(b.kv_tokens for b in batches) / padded if padded else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Attention work lost to misalignment over all decode batches so far."""
        return 1.0 - self.kv_tokens / self.padded_tokens if self.padded_tokens else 0.0

"""Drive an ``LLMEngine`` directly (no HTTP), honouring due times, for policy comparisons.

The loop admits every request that is due (and fits under the concurrency cap), runs one
engine step, and timestamps the tokens each step produced, exactly where a server would
stream them. A request is given to the engine with ``arrival_time`` set to when it was due
(or when its concurrency slot freed), so time it waited while a step was running counts
against the engine, as it would over HTTP. Per-step records (batch KV lengths, bubble) are
copied from ``engine.stats`` after every step.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from datetime import datetime, timezone
from typing import Any

from alignedserve.bench.load import Load
from alignedserve.bench.openai_stream import check_count
from alignedserve.bench.progress import Progress
from alignedserve.bench.records import RequestRecord, RunResult, StepSample

_TOTALS = ("steps", "prefill_tokens", "decode_tokens", "kv_tokens", "padded_tokens",
           "compute_s", "copy_wait_s", "copy_bytes")
_IDLE_POLL_S = 0.05  # longest sleep while idle, so Ctrl-C and due times stay responsive


def _params(load: Load, max_tokens: int) -> Any:
    from alignedserve.sampling_params import SamplingParams

    opts = load.options
    return SamplingParams(max_tokens=max_tokens, temperature=opts.temperature,
                          ignore_eos=opts.ignore_eos,
                          min_tokens=max_tokens if opts.ignore_eos else 0)


def _warmup(engine: Any, load: Load) -> None:
    for i in range(load.warmup):
        engine.add_request(f"bench-warmup-{i}", load.warmup_prompt(i), _params(load, 4))
    while engine.has_unfinished():
        engine.step()


def _totals(engine: Any) -> dict[str, float]:
    return {k: getattr(engine.stats, k, 0) for k in _TOTALS}


def _step_samples(engine: Any, seen: int, t: float) -> list[StepSample]:
    """Samples for the steps recorded since ``seen`` steps (bounded by the stats window)."""
    new = engine.stats.steps - seen
    if new <= 0:
        return []
    out = []
    for rec in list(engine.stats.window)[-new:]:
        batches = tuple((b.rows, b.min_len, b.max_len, b.kv_tokens) for b in rec.batches)
        out.append(StepSample(t, rec.step_id, rec.prefill_tokens, rec.decode_rows, batches,
                              rec.bubble_fraction, rec.compute_s, rec.copy_wait_s))
    return out


class _Driver:
    """State of one in-process run; ``run`` is the loop, the rest are its steps."""

    def __init__(self, engine: Any, load: Load, progress: Progress):
        self.engine, self.load, self.progress = engine, load, progress
        self.records = load.new_records()
        self.steps: list[StepSample] = []
        self.inflight: dict[str, RequestRecord] = {}
        self.next = 0  # index of the next request to admit
        cap = load.concurrency
        # When each concurrency slot became free; a request waiting for a slot is "sent"
        # at the later of its due time and that moment.
        self.free_at: deque[float] | None = deque([0.0] * cap) if cap else None
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _admit(self, now: float) -> None:
        load, n = self.load, len(self.records)
        while self.next < n and self.records[self.next].scheduled_s <= now \
                and (self.free_at is None or self.free_at) and not load.out_of_time(now):
            rec, spec = self.records[self.next], load.requests[self.next]
            self.next += 1
            rec.sent_s = max(rec.scheduled_s, self.free_at.popleft() if self.free_at else 0.0)
            prompt = load.prompts.build(spec.index, spec.prompt_len)
            try:
                self.engine.add_request(str(rec.index), prompt, _params(load, spec.output_len),
                                        arrival_time=self.t0 + rec.sent_s)
            except ValueError as exc:  # e.g. longer than the model context
                rec.error, rec.end_s = f"rejected: {exc}", now
                self._release(rec, now)
                continue
            self.inflight[str(rec.index)] = rec

    def _release(self, rec: RequestRecord, t: float) -> None:
        if self.free_at is not None:
            self.free_at.append(t)
        self.progress.done(rec)

    def _observe(self, out: Any, t: float) -> None:
        rec = self.inflight.get(out.request_id)
        if rec is None:
            return
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        if n > rec.output_len:
            rec.chunk_times.append(t)
            rec.first_token_s = t if rec.first_token_s is None else rec.first_token_s
            rec.output_len = n
        rec.prompt_len_reported = len(out.prompt_token_ids)
        if not out.finished:
            return
        del self.inflight[out.request_id]
        rec.end_s, rec.count_source = t, "engine"
        if out.error or rec.first_token_s is None:
            rec.error = out.error or "finished without output"
        else:
            check_count(rec, self.load.options)
        self._release(rec, t)

    def run(self) -> None:
        engine, n = self.engine, len(self.records)
        while True:
            now = self.now()
            self._admit(now)
            if not engine.has_unfinished():
                if self.next >= n or self.load.out_of_time(now):
                    return
                time.sleep(min(_IDLE_POLL_S, max(0.0, self.records[self.next].scheduled_s - now)))
                continue
            seen = engine.stats.steps
            outputs = engine.step()
            t = self.now()
            self.steps.extend(_step_samples(engine, seen, t))
            for out in outputs:
                self._observe(out, t)

    def abort_inflight(self) -> None:
        t = self.now()
        for rid, rec in list(self.inflight.items()):
            # The engine may have been interrupted mid-step; the run is over either way.
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)
            rec.ok, rec.error, rec.end_s = False, "interrupted", t
        self.inflight.clear()


def run_inprocess(engine: Any, load: Load, label: str, target: str,
                  show_progress: bool = True) -> RunResult:
    """Run ``load`` on ``engine``; Ctrl-C returns the partial result (``interrupted``)."""
    _warmup(engine, load)
    before = _totals(engine)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    progress = Progress(len(load.requests), label, show_progress)
    driver = _Driver(engine, load, progress)
    interrupted = False
    try:
        driver.run()
    except KeyboardInterrupt:
        interrupted = True
        driver.abort_inflight()
    finally:
        progress.close()
    after = _totals(engine)
    delta = {k: after[k] - before[k] for k in _TOTALS}
    padded = delta["padded_tokens"]
    stats = {"source": "engine.stats", **delta,
             "bubble_fraction": 1.0 - delta["kv_tokens"] / padded if padded else None}
    return RunResult(label, target, None, 0, driver.records, started, interrupted, stats,
                     driver.steps, _engine_notes(engine))


def _engine_notes(engine: Any) -> list[str]:
    """The kernel path the engine ran and its per-CPU decode-attention choices, as a run
    against a server notes the server's ``/version`` (none for an engine without kernels)."""
    kernels = getattr(engine, "kernels", None)
    if kernels is None:
        return []
    order = kernels.decode_read_order()
    return [f"engine kernel path: {kernels.name}"
            + (f" (decode attention: {order})" if order else "")]

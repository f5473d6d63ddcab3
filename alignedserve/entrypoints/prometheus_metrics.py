"""Prometheus metrics of one server: request latencies and tokens, engine load, KV, alignment.

Every series lives on the ``ServerMetrics`` instance's own ``CollectorRegistry`` (never the
process-global one), so several apps can coexist in one process (tests) without duplicate
registration errors. Names follow vLLM's (``vllm:`` -> ``alignedserve:``) so dashboards carry
over; every series has a ``model_name`` label.

Two kinds of series:
* request series (TTFT, TPOT, end-to-end latency, token counters, outcomes), observed on the
  event loop when an engine request ends;
* engine series, read from the engine at scrape time by ``EngineCollector``. The engine thread
  mutates what is read, without a lock; the reads are single attribute/len reads or C-level
  copies (atomic under the GIL), and the few Python-level iterations are retried if the
  engine changed the container mid-read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from alignedserve.outputs import RequestOutput

P = "alignedserve:"
T = TypeVar("T")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


def racy_read(read: Callable[[], T], default: T, attempts: int = 5) -> T:
    """``read()`` of state the engine thread mutates without a lock, retried when the engine
    changed it mid-read ("changed size during iteration", a handle freed or a group emptied
    between two lookups); ``default`` if every attempt collided."""
    for _ in range(attempts):
        try:
            return read()
        except (RuntimeError, KeyError, ValueError):
            continue
    return default


class EngineCollector(Collector):
    """Scrape-time view of an ``LLMEngine``: queues, KV per tier, step and alignment stats."""

    def __init__(self, engine: Any, model_name: str,
                 extra_gauges: Callable[[], dict[str, tuple[str, float]]] | None = None):
        self.engine = engine
        self.model_name = model_name
        self.extra_gauges = extra_gauges

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(P + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(P + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(P + "engine_info", "The engine's build: kernel instruction "
                                 "set path (kernel_path) and policy; the value is 1.",
                                 labels=["model_name", "kernel_path", "policy"])
        info.add_metric([self.model_name, self.engine.kernels.name, self.engine.config.policy],
                        1.0)
        yield info
        sched = self.engine.scheduler
        yield self._gauge("num_requests_running", "Sequences prefilling or decoding.",
                          racy_read(sched.num_running, 0))
        yield self._gauge("num_requests_waiting",
                          "Sequences queued (or swapped out) in the engine.",
                          racy_read(sched.num_waiting, 0))
        for name, (doc, value) in (self.extra_gauges() if self.extra_gauges else {}).items():
            yield self._gauge(name, doc, value)
        yield from self._kv()
        yield from self._steps()
        yield from self._alignment()

    def _kv(self) -> Iterator[Metric]:
        usage = racy_read(self.engine.store.usage_bytes, {})
        docs = {"kv_cache_used_bytes": "KV-cache bytes allocated, per tier.",
                "kv_cache_total_bytes": "KV-cache capacity in bytes, per tier.",
                "kv_cache_usage_perc": "Fraction of the tier's KV capacity allocated (0-1)."}
        families = {n: GaugeMetricFamily(P + n, d, labels=["model_name", "tier"])
                    for n, d in docs.items()}
        for tier, (used, total) in sorted(usage.items()):
            labels = [self.model_name, tier]
            families["kv_cache_used_bytes"].add_metric(labels, used)
            families["kv_cache_total_bytes"].add_metric(labels, total)
            families["kv_cache_usage_perc"].add_metric(labels, used / total if total else 0.0)
        yield from families.values()

    def _steps(self) -> Iterator[Metric]:
        s = self.engine.stats
        yield self._counter("engine_steps", "Engine steps run.", s.steps)
        yield self._counter("prefill_tokens_computed", "Prompt tokens computed by prefill chunks.",
                            s.prefill_tokens)
        yield self._counter("decode_tokens_computed", "Decode rows computed.", s.decode_tokens)
        yield self._counter("engine_compute_seconds", "Time spent in forward passes.", s.compute_s)
        yield self._counter("kv_copy_wait_seconds", "Time steps waited on KV copies between tiers.",
                            s.copy_wait_s)
        yield self._counter("kv_copy_bytes", "KV bytes copied between tiers.", s.copy_bytes)
        yield self._gauge("prompt_tokens_per_step_budget",
                          "Most prompt tokens the next step may carry (the token cap, or less "
                          "under --step-time-target).",
                          self.engine.scheduler.prompt_budget.tokens())

    def _alignment(self) -> Iterator[Metric]:
        s = self.engine.stats
        yield self._counter("decode_kv_tokens", "Attention KV tokens decode batches needed.",
                            s.kv_tokens)
        yield self._counter("decode_padded_tokens",
                            "KV tokens decode batches would touch if padded to their longest row.",
                            s.padded_tokens)
        yield self._gauge("decode_bubble_fraction",
                          "Share of padded decode attention work lost to misalignment "
                          "since start.",
                          s.bubble_fraction)
        window = tuple(s.window)  # a C-level copy of the deque: atomic under the GIL
        batches = [b for rec in window for b in rec.batches]
        decode_steps = sum(1 for rec in window if rec.batches)
        yield self._gauge("decode_bubble_fraction_recent",
                          "Bubble fraction over the recent step window.",
                          s.recent_bubble_fraction())
        yield self._gauge("decode_batches_per_step_recent",
                          "Mean decode batches per decode step over the recent window.",
                          len(batches) / decode_steps if decode_steps else 0.0)
        yield self._gauge("decode_batch_rows_recent",
                          "Mean rows per decode batch over the recent window.",
                          sum(b.rows for b in batches) / len(batches) if batches else 0.0)
        yield self._gauge("decode_batch_spread_max_recent",
                          "Largest KV-length spread inside one decode batch, recent window.",
                          max((b.spread for b in batches), default=0))
        yield self._gauge("decode_batch_spread_mean_recent",
                          "Mean KV-length spread inside decode batches, recent window.",
                          sum(b.spread for b in batches) / len(batches) if batches else 0.0)


class ServerMetrics:
    """The metrics of one server app; call order: construct, then observe_* from the loop."""

    def __init__(self, model_name: str, engine_series: Collector | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(P + "time_per_output_token_seconds",
                              "Mean time per output token after the first.", labels,
                              buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of requests served.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self._outcomes = Counter(P + "request_success", "Engine requests ended, by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._rejected = Counter(P + "request_rejected", "Requests refused before the engine.",
                                 labels + ["reason"], registry=r)
        if engine_series is not None:
            r.register(engine_series)

    def observe_request_end(self, out: RequestOutput | None) -> None:
        """Record an engine request that ended; ``out`` is its last output (None: no output)."""
        if out is None:
            self._outcomes.labels(self.model_name, "abort").inc()
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        generated = [len(c.token_ids) for c in out.outputs]
        self.generation_tokens.inc(sum(generated))
        reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"
        self._outcomes.labels(self.model_name, reason if out.finished else "abort").inc()
        if not out.finished or out.error:
            return
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        longest = max(generated, default=0)
        if m.ttft is not None and m.e2e is not None and longest > 1:
            self.tpot.observe((m.e2e - m.ttft) / (longest - 1))

    def observe_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Benchmark metrics against hand-computed cases (see docs/benchmarks.md for definitions)."""

from __future__ import annotations

import math

import pytest

from alignedserve.bench.metrics import SLO, Distribution, ratio, run_duration, summarize
from alignedserve.bench.prom import engine_stats_from_metrics, parse_metrics
from alignedserve.bench.records import RequestRecord, RunResult
from alignedserve.bench.report import make_entry, ratios


def rec(index, prompt, out, sent, first, end, chunks, scheduled=None, ok=True, error=None):
    return RequestRecord(index, prompt, out, sent if scheduled is None else scheduled, sent,
                         first, end, out if ok else 0, list(chunks), ok, error)


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # TTFT 1.0, TPOT (3-1)/4 = 0.5, E2E 3.0, ITLs 0.5 x4
        rec(0, 10, 5, 0.0, 1.0, 3.0, [1.0, 1.5, 2.0, 2.5, 3.0]),
        # sent at 1.0 but due at 0.5 (client queue 0.5); TTFT 0.5, TPOT (3.5-1.5)/2 = 1.0,
        # E2E 2.5, ITLs 1.0 x2
        rec(1, 20, 3, 1.0, 1.5, 3.5, [1.5, 2.5, 3.5], scheduled=0.5),
        # failed: counts in the duration, not in latencies or throughput
        RequestRecord(2, 40, 8, 2.0, 2.0, None, 4.0, 0, [], False, "HTTP 500: boom"),
        # never sent
        RequestRecord(3, 50, 8, 5.0),
    ]


def test_request_record_properties(records):
    r0, r1 = records[0], records[1]
    assert (r0.ttft, r0.tpot, r0.e2e) == (1.0, 0.5, 3.0)
    assert r0.itls == [0.5] * 4
    assert (r1.ttft, r1.tpot, r1.e2e) == (0.5, 1.0, 2.5)
    one = rec(9, 5, 1, 0.0, 0.2, 0.2, [0.2])
    assert one.tpot is None and one.itls == []
    assert records[3].ttft is None and records[3].e2e is None


def test_summary_counts_and_throughput(records):
    s = summarize(records)
    assert (s.completed, s.failed, s.not_sent) == (2, 1, 1)
    assert s.duration_s == 4.0  # first send 0.0 -> last end 4.0 (the failed request)
    assert (s.input_tokens, s.output_tokens) == (30, 8)
    assert s.request_throughput == pytest.approx(0.5)
    assert s.input_throughput == pytest.approx(7.5)
    assert s.output_throughput == pytest.approx(2.0)
    assert s.total_token_throughput == pytest.approx(9.5)
    assert s.goodput is None and s.goodput_fraction is None


def test_summary_distributions(records):
    s = summarize(records)
    # TTFT [1.0, 0.5]: linear-interpolated percentiles between the two values
    assert s.ttft.count == 2
    assert s.ttft.mean == pytest.approx(0.75)
    assert s.ttft.std == pytest.approx(0.25)  # population std
    assert s.ttft.p50 == pytest.approx(0.75)
    assert s.ttft.p99 == pytest.approx(0.5 + 0.99 * 0.5)
    assert (s.ttft.min, s.ttft.max) == (0.5, 1.0)
    assert s.tpot.p50 == pytest.approx(0.75) and s.tpot.p90 == pytest.approx(0.95)
    assert s.e2e.p50 == pytest.approx(2.75) and s.e2e.max == 3.0
    # ITL pools every gap: [0.5]*4 + [1.0]*2
    assert s.itl.count == 6
    assert s.itl.mean == pytest.approx(4 / 6)
    assert s.itl.p50 == pytest.approx(0.5) and s.itl.p90 == pytest.approx(1.0)
    # client queue over the 3 sent requests: [0, 0.5, 0]
    assert s.client_queue.max == pytest.approx(0.5) and s.client_queue.count == 3


def test_prompt_tokens_reported_by_server_win(records):
    records[0].prompt_len_reported = 12
    assert summarize(records).input_tokens == 32


@pytest.mark.parametrize("slo, good", [
    (SLO(ttft=0.8), 1),  # only r1 (TTFT 0.5)
    (SLO(tpot=0.6), 1),  # only r0 (TPOT 0.5)
    (SLO(ttft=0.8, tpot=0.6), 0),
    (SLO(ttft=2.0, tpot=2.0, e2e=2.6), 1),  # r0's E2E 3.0 misses
    (SLO(e2e=10.0), 2),
])
def test_goodput(records, slo, good):
    s = summarize(records, slo)
    assert s.goodput == pytest.approx(good / 4.0)  # per second of the 4 s run
    assert s.goodput_fraction == pytest.approx(good / 3)  # of the 3 requests sent


def test_single_token_reply_meets_tpot_slo():
    one = rec(0, 5, 1, 0.0, 0.2, 0.2, [0.2])
    assert SLO(tpot=0.001).met_by(one)
    assert not SLO(ttft=0.1).met_by(one)


def test_empty_and_all_failed_runs_do_not_crash():
    s = summarize([])
    assert s.completed == 0 and s.duration_s == 0.0
    assert math.isnan(s.output_throughput) and s.ttft.count == 0 and math.isnan(s.ttft.p50)
    failed = [RequestRecord(0, 4, 4, 0.0, 0.0, None, 1.0, 0, [], False, "x")]
    s = summarize(failed, SLO(ttft=1.0))
    assert (s.completed, s.failed, s.duration_s, s.goodput) == (0, 1, 1.0, 0.0)


def test_distribution_single_value_and_duration():
    d = Distribution.of([2.0])
    assert (d.p50, d.p99, d.std) == (2.0, 2.0, 0.0)
    assert run_duration([RequestRecord(0, 1, 1, 0.0)]) == 0.0


def test_ratio():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert ratio(math.nan, 1.0) is None


def _entry(label: str, rnd: int, throughput_scale: float):
    # One request, 10 tokens over 1 s / throughput_scale.
    end = 1.0 / throughput_scale
    records = [rec(0, 8, 10, 0.0, end / 10, end, [end / 10 * (i + 1) for i in range(10)])]
    result = RunResult(label, label, None, rnd, records, "now")
    return make_entry(result, f"{label}-{rnd}", SLO())


def test_ratios_pair_rounds_then_take_the_median():
    entries = [_entry("base", 0, 1.0), _entry("new", 0, 2.0),
               _entry("base", 1, 0.5), _entry("new", 1, 1.5),
               _entry("base", 2, 1.0), _entry("new", 2, 1.1)]
    rows = {r["label"]: r for r in ratios(entries, "base")}
    # per-round ratios 2.0, 3.0, 1.1 -> median 2.0
    assert rows["new"]["out tok/s"] == pytest.approx(2.0)
    assert rows["new"]["rounds"] == 3
    assert rows["base"]["out tok/s"] == pytest.approx(1.0)
    assert rows["new"]["E2E p50"] == pytest.approx(0.5)


METRICS_BEFORE = """\
# HELP alignedserve:decode_kv_tokens_total Attention KV tokens.
# TYPE alignedserve:decode_kv_tokens_total counter
alignedserve:decode_kv_tokens_total{model_name="m"} 100.0
alignedserve:decode_padded_tokens_total{model_name="m"} 200.0
alignedserve:decode_bubble_fraction{model_name="m"} 0.5
alignedserve:kv_cache_used_bytes{model_name="m",tier="host"} 10
alignedserve:kv_cache_used_bytes{model_name="m",tier="device0"} 5
"""
METRICS_AFTER = METRICS_BEFORE.replace(" 100.0", " 1000.0").replace(" 200.0", " 1300.0")


def test_prometheus_bubble_over_the_run_only():
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    assert before[("alignedserve:kv_cache_used_bytes", '{model_name="m",tier="host"}')] == 10
    stats = engine_stats_from_metrics(before, after)
    # d(kv) = 900, d(padded) = 1100 -> 1 - 900/1100
    assert stats["bubble_fraction"] == pytest.approx(1 - 900 / 1100)
    assert stats["counter_deltas"]["alignedserve:decode_kv_tokens_total"] == 900
    assert stats["gauges_after"]["alignedserve:kv_cache_used_bytes"] == 15  # tiers summed


def test_prometheus_fallbacks():
    gauge_only = parse_metrics('x:decode_bubble_fraction{a="b"} 0.25\n')
    stats = engine_stats_from_metrics(gauge_only, gauge_only)
    assert stats["bubble_fraction"] == 0.25 and "not this run only" in stats["bubble_from"]
    unrelated = parse_metrics("vllm:num_requests_running 3\n")
    assert engine_stats_from_metrics(unrelated, unrelated) is None
    assert engine_stats_from_metrics(None, unrelated) is None

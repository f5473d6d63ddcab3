"""The load drivers and the whole bench command without a model: the in-process driver on a
stub engine, the HTTP client on a fake OpenAI server, and ``alignedserve bench`` end to end
on that server (report files and their consistency)."""

from __future__ import annotations

import argparse
import json

import pytest

from alignedserve.bench import cli
from alignedserve.bench.client import HttpTarget, TargetUnavailable, run_http
from alignedserve.bench.inprocess import run_inprocess
from alignedserve.bench.load import Load
from alignedserve.bench.openai_stream import RequestOptions
from alignedserve.bench.prompts import PromptFactory, TokenSpace
from alignedserve.bench.workloads import RequestSpec
from tests.bench_fakes import FakeOpenAIServer, StubEngine

PROMPTS = PromptFactory(TokenSpace(500, frozenset(range(10))), seed=0)


def make_load(lengths, offsets=None, concurrency=None, duration=None, **opts) -> Load:
    specs = tuple(RequestSpec(i, p, o) for i, (p, o) in enumerate(lengths))
    offsets = tuple(offsets or [0.0] * len(specs))
    return Load(specs, offsets, PROMPTS, RequestOptions(**opts), concurrency, duration, warmup=1)


# ---- in-process -----------------------------------------------------------------------------
def test_inprocess_counts_tokens_and_honours_concurrency():
    engine = StubEngine(step_s=0.003)
    load = make_load([(20, 4), (30, 6), (40, 3), (50, 5)], concurrency=2)
    result = run_inprocess(engine, load, "stub", "policy:stub", show_progress=False)
    recs = result.records
    assert all(r.ok and r.output_len == r.expected_output_len for r in recs)
    assert all(r.count_source == "engine" and r.prompt_len_reported == r.prompt_len for r in recs)
    assert engine.max_inflight == 2
    # Request 2 waited for request 0's slot: it was "sent" when request 0 finished.
    assert recs[2].sent_s == pytest.approx(recs[0].end_s)
    assert recs[3].sent_s == pytest.approx(min(recs[1].end_s, recs[2].end_s))
    for r in recs:
        assert r.sent_s <= r.first_token_s <= r.end_s and len(r.chunk_times) == r.output_len
    assert result.steps and all(s.decode_rows <= 2 for s in result.steps)
    stats = result.engine_stats
    assert stats["decode_tokens"] == 18 and stats["steps"] == len(result.steps)
    assert 0.0 < stats["bubble_fraction"] < 1.0


def test_inprocess_arrivals_rejections_and_duration():
    engine = StubEngine(step_s=0.002, max_prompt=100)
    load = make_load([(10, 3), (500, 3), (10, 3), (10, 3)], offsets=[0.0, 0.05, 0.1, 5.0],
                     duration=0.5)
    result = run_inprocess(engine, load, "stub", "policy:stub", show_progress=False)
    ok, rejected, late, unsent = result.records
    assert ok.ok and late.ok
    assert late.sent_s == late.scheduled_s == 0.1 and late.first_token_s > 0.1
    # The engine was told the request arrived when it was due, not when it was added.
    assert engine.arrivals["2"] - engine.arrivals["0"] == pytest.approx(0.1)
    assert not rejected.ok and rejected.error.startswith("rejected:")
    assert unsent.sent_s is None


def test_inprocess_ctrl_c_gives_a_partial_result():
    engine = StubEngine(step_s=0.001, interrupt_after_steps=8)  # warm-up takes 4
    load = make_load([(10, 50), (10, 50)])
    result = run_inprocess(engine, load, "stub", "policy:stub", show_progress=False)
    assert result.interrupted
    assert all(not r.ok and r.error == "interrupted" for r in result.records)
    assert set(engine.aborted) == {"0", "1"}


def test_inprocess_count_check():
    engine = StubEngine()
    load = make_load([(10, 3)], ignore_eos=False)
    assert run_inprocess(engine, load, "s", "s", show_progress=False).records[0].ok


# ---- HTTP -----------------------------------------------------------------------------------
def test_http_client_streams_checks_counts_and_caps_concurrency():
    with FakeOpenAIServer() as server:
        load = make_load([(20, 5), (30, 8), (25, 3), (40, 6), (15, 4)], concurrency=2)
        result = run_http(HttpTarget(server.url), load, "fake", show_progress=False)
    recs = result.records
    assert all(r.ok and r.count_source == "usage" for r in recs)
    assert [r.output_len for r in recs] == [5, 8, 3, 6, 4]
    assert all(len(r.chunk_times) == r.output_len for r in recs)
    assert server.max_inflight <= 2
    sent = server.bodies[1:]  # the first is the warm-up; the rest arrive in any order
    sent.sort(key=lambda b: [20, 30, 25, 40, 15].index(len(b["prompt"])))
    assert [len(b["prompt"]) for b in sent] == [20, 30, 25, 40, 15]
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] for b in sent)
    assert all(b["model"] == "fake-model" and b["stream"] for b in sent)
    assert sent[0]["prompt"] == PROMPTS.build(0, 20)
    assert result.engine_stats["bubble_fraction"] == pytest.approx(0.25)


@pytest.mark.parametrize("check, ok", [("strict", False), ("warn", True), ("off", True)])
def test_http_count_mismatch(check, ok):
    with FakeOpenAIServer(short_by=1) as server:
        load = make_load([(10, 4)], count_check=check)
        # The warm-up asks for 4 tokens too and would fail under strict: skip it here.
        load = Load(load.requests, load.offsets, load.prompts, load.options, warmup=0)
        rec = run_http(HttpTarget(server.url), load, "fake", show_progress=False).records[0]
    assert rec.output_len == 3 and rec.ok is ok
    assert rec.count_mismatch is (check != "off")


def test_http_counts_chunks_without_usage_and_reports_http_errors():
    with FakeOpenAIServer(send_usage=False, max_prompt=50) as server:
        load = make_load([(10, 4), (60, 4)])
        good, bad = run_http(HttpTarget(server.url + "/v1"), load, "f", False).records
    assert good.ok and good.count_source == "chunks" and good.output_len == 4
    assert not bad.ok and bad.error.startswith("HTTP 400: prompt too long")


def test_http_reads_a_chunk_longer_than_a_default_read_buffer():
    # One SSE line of ~1 MB (aiohttp's default buffer would refuse a line over 128 KiB).
    with FakeOpenAIServer(first_text="x" * (1 << 20)) as server:
        rec = run_http(HttpTarget(server.url), make_load([(10, 3)]), "f", False).records[0]
    assert rec.ok and rec.output_len == 3 and len(rec.chunk_times) == 3


def test_http_unreachable_server_is_a_clear_error():
    with FakeOpenAIServer() as server:
        url = server.url
    with pytest.raises(TargetUnavailable, match="cannot list models"):
        run_http(HttpTarget(url), make_load([(10, 2)]), "gone", show_progress=False)


# ---- the bench command ----------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_every_flag_is_documented():
    parser = argparse.ArgumentParser()
    bench = cli.add_parser(parser.add_subparsers())
    undocumented = [a.option_strings for a in bench._actions if a.option_strings and not a.help]
    assert undocumented in ([], [["--dtype"]])  # --dtype is the engine's, documented by choices
    assert "synthetic:NAME" in bench.format_help()


def test_bench_command_writes_a_consistent_report(tmp_path):
    out = tmp_path / "out"
    with FakeOpenAIServer() as server:
        args = _parse(["--compare", f"a={server.url}", f"b={server.url}", "--baseline", "b",
                       "--workload", "synthetic:uniform:in=8-32,out=2-6", "--num-requests", "5",
                       "--rate", "50", "inf", "--token-range", "10:400", "--output-dir",
                       str(out), "--no-progress", "--slo-ttft-ms", "5000"])
        assert args.func(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["a_rate-50", "b_rate-50", "a_rate-inf",
                                                     "b_rate-inf"]
    for run in summary["runs"]:
        raw = json.loads((out / "runs" / run["name"] / "requests.json").read_text())
        reqs = raw["requests"]
        m = run["metrics"]
        assert len(reqs) == 5 and m["completed"] == 5 and m["failed"] == 0
        assert m["output_tokens"] == sum(r["output_len"] for r in reqs)
        assert m["output_tokens"] == sum(r["expected_output_len"] for r in reqs)
        assert m["input_tokens"] == sum(r["prompt_len"] for r in reqs)
        assert run["engine_stats"]["bubble_fraction"] == pytest.approx(0.25)
        assert m["goodput"] is not None
        # Which build each run measured: the server's /version, verbatim.
        assert 'server /version: {"kernel_path":"none","version":"fake-1.0"}' in run["notes"]
    assert {(r["label"], r["rate"]) for r in summary["ratios"]} == {
        ("a", 50.0), ("b", 50.0), ("a", "inf"), ("b", "inf")}
    assert summary["workload"]["description"]["requests"] == 5
    machine = summary["machine"]
    assert machine["kernel_paths"][-1] == "reference"
    assert {"cpu_vendor", "cpu_family", "cpu_model", "cpu_core", "isa_flags"} <= set(machine)
    report = (out / "report.md").read_text()
    assert "## Results" in report and "## Versus the baseline" in report
    assert f"- machine: {machine['summary']}" in report and "kernel paths" in report
    assert '- note (a_rate-50): server /version: {"kernel_path"' in report
    assert "a_rate-50" in report and "sweep.png" in report
    for png in ("latency_cdf.png", "sweep.png"):
        assert (out / png).stat().st_size > 1000


def test_bench_command_rejects_bad_flags(capsys):
    for argv in (["--workload", "synthetic:fixed"],  # no target
                 ["--policy", "no-such-policy"],
                 ["--url", "http://x:1", "--baseline", "zzz"],
                 ["--url", "http://x:1", "--workload", "azure-conv", "--trace-dir", "/nonexistent"],
                 ["--url", "http://x:1", "--endpoint", "chat"]):
        args = _parse(argv)
        assert args.func(args) == 2, argv
        assert "error:" in capsys.readouterr().err


def test_an_unreachable_target_is_skipped_not_fatal(tmp_path, capsys):
    with FakeOpenAIServer() as dead:
        dead_url = dead.url
    out = tmp_path / "out"
    with FakeOpenAIServer() as server:
        args = _parse(["--compare", f"dead={dead_url}", f"live={server.url}", "--workload",
                       "synthetic:fixed:in=8,out=2", "--num-requests", "2", "--token-range",
                       "10:400", "--output-dir", str(out), "--no-progress", "--no-plots"])
        assert args.func(args) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["live"]
    assert any("dead skipped" in n for n in summary["notes"])
    assert "target dead skipped" in capsys.readouterr().err

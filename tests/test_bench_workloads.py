"""Workload loaders (on the small trace sample in tests/data), synthetic generators,
scaling, arrivals, prompts and target parsing. No model, no network."""

from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from alignedserve.bench.arrivals import gamma_offsets, plan_arrivals
from alignedserve.bench.prompts import TokenSpace
from alignedserve.bench.targets import parse_target, unique_labels
from alignedserve.bench.traces import TRACE_DIR_ENV, Selection, find_trace, load_trace, read_rows
from alignedserve.bench.workloads import SYNTHETIC, Scaling, describe, parse_range, synthetic

SAMPLE = Path(__file__).parent / "data" / "azure_llm_2023_conv_sample200.csv"


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- synthetic ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_shapes_and_seeds(name):
    w = synthetic(f"synthetic:{name}", 400, seed=3)
    assert len(w) == 400 and [r.index for r in w.requests] == list(range(400))
    assert not w.timed
    assert all(1 <= r.prompt_len <= 3072 and r.output_len == 256 for r in w.requests)
    assert w.requests == synthetic(f"synthetic:{name}", 400, seed=3).requests
    if name != "fixed":
        assert w.requests != synthetic(f"synthetic:{name}", 400, seed=4).requests
    assert w.source["generator"] == name and w.source["seed"] == 3


def test_synthetic_distributions():
    fixed = synthetic("synthetic:fixed", 50, 0)
    assert {r.prompt_len for r in fixed.requests} == {512}
    uni = np.array([r.prompt_len for r in synthetic("synthetic:uniform", 4000, 0).requests])
    logu = np.array([r.prompt_len for r in synthetic("synthetic:log-uniform", 4000, 0).requests])
    varied = synthetic("synthetic:varied", 4000, 0)
    assert uni.min() >= 64 and uni.max() <= 3072 and abs(np.median(uni) - 1568) < 120
    # log-uniform on [64, 3072]: median near sqrt(64 * 3073) ~ 443
    assert abs(np.median(logu) - math.sqrt(64 * 3073)) < 60 and logu.min() >= 64
    assert {r.output_len for r in varied.requests} == {256}
    bi = synthetic("synthetic:bimodal:short=10-20,long=1000-1100,long_frac=0.3", 4000, 0)
    lens = np.array([r.prompt_len for r in bi.requests])
    assert set(np.unique(lens < 500)) == {True, False}
    assert all((10 <= x <= 20) or (1000 <= x <= 1100) for x in lens)
    assert abs((lens > 500).mean() - 0.3) < 0.03


def test_synthetic_params():
    w = synthetic("synthetic:uniform:in=5-7,out=2-3", 200, 1)
    assert {r.prompt_len for r in w.requests} == {5, 6, 7}
    assert {r.output_len for r in w.requests} == {2, 3}
    assert w.name == "synthetic:uniform:in=5-7,out=2-3"
    assert parse_range("12") == (12, 12) and parse_range("3-9") == (3, 9)
    for bad in ("synthetic:nope", "synthetic:fixed:in=1-5", "synthetic:uniform:foo=1",
                "synthetic:uniform:in=9-3", "synthetic:uniform:in", "synthetic:varied:out=1-9",
                "synthetic:bimodal:long_frac=2"):
        with pytest.raises(ValueError):
            synthetic(bad, 10, 0)
    with pytest.raises(ValueError):
        synthetic("synthetic:fixed", 0, 0)


# ---- traces ---------------------------------------------------------------------------------
def test_trace_sample_loads_with_real_arrivals():
    w = load_trace(str(SAMPLE), None, Selection())
    rows = _csv_rows(SAMPLE)
    assert len(w) == 200 and w.timed
    assert w.requests[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] == pytest.approx(61.2635, abs=1e-3)  # 18:15:46.68 -> 18:16:47.94
    assert (w.requests[0].prompt_len, w.requests[0].output_len) == (374, 44)
    assert [r.prompt_len for r in w.requests] == [int(r["ContextTokens"]) for r in rows]
    assert w.source["layout"] == "azure" and w.source["rows_in_file"] == 200
    assert len(w.source["sha256"]) == 64
    d = describe(w)
    assert d["arrivals"]["mean_rate"] == pytest.approx(199 / arrivals[-1])


def test_trace_selection_window_and_random():
    rows = _csv_rows(SAMPLE)
    w = load_trace(str(SAMPLE), None, Selection(start=10, count=20))
    assert [r.prompt_len for r in w.requests] == [int(r["ContextTokens"]) for r in rows[10:30]]
    assert w.requests[0].arrival_s == 0.0
    r1 = load_trace(str(SAMPLE), None, Selection(count=50, sample="random", seed=5))
    r2 = load_trace(str(SAMPLE), None, Selection(count=50, sample="random", seed=5))
    assert r1.requests == r2.requests and len(r1) == 50
    assert [r.arrival_s for r in r1.requests] == sorted(r.arrival_s for r in r1.requests)
    assert load_trace(str(SAMPLE), None, Selection(count=10_000)).source["selected"] == 200
    with pytest.raises(ValueError):
        load_trace(str(SAMPLE), None, Selection(start=200))


def test_trace_by_name_from_dir_or_env(tmp_path, monkeypatch):
    folder = tmp_path / "azure_llm_2023_conv"
    folder.mkdir()
    shutil.copy(SAMPLE, folder / "AzureLLMInferenceTrace_conv.csv")
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="--trace-dir"):
        find_trace("azure-conv")
    assert find_trace("azure-conv", str(tmp_path))[0] == folder / "AzureLLMInferenceTrace_conv.csv"
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    w = load_trace("azure_llm_2023_conv", None, Selection(count=5))
    assert w.name == "azure_llm_2023_conv" and "CC-BY" in w.source["licence"] and len(w) == 5
    with pytest.raises(FileNotFoundError):
        find_trace("azure-code")
    with pytest.raises(ValueError, match="not synthetic"):
        find_trace("no-such-trace")


@pytest.mark.parametrize("header, row, expected", [
    ("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio", "3772,54,3826,69.8",
     ("vidur", None, 3772, 54)),
    ("id,n_turns,prompt_chars,prompt_tokens_dsv4,output_chars,output_tokens_dsv4",
     "a_0,2,190,32,1298,246", ("sharegpt", None, 32, 246)),
    ("arrival_s,input_tokens,output_tokens", "1.5,0,7", ("generic", 1.5, 1, 7)),
])
def test_other_trace_layouts(tmp_path, header, row, expected):
    path = tmp_path / "t.csv"
    path.write_text(f"{header}\n{row}\n")
    layout, rows = read_rows(path)
    assert (layout, *rows[0]) == expected


def test_bad_trace_files(tmp_path):
    (tmp_path / "a.csv").write_text("foo,bar\n1,2\n")
    with pytest.raises(ValueError, match="unrecognised"):
        read_rows(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("input_tokens,output_tokens\nx,2\n")
    with pytest.raises(ValueError, match="b.csv:2"):
        read_rows(tmp_path / "b.csv")


# ---- scaling --------------------------------------------------------------------------------
def test_scaling_order_and_record():
    w = load_trace(str(SAMPLE), None, Selection(count=40))
    s = Scaling(length_scale=0.5, max_input=300, max_output=100, max_total=350, time_scale=4.0)
    scaled = s.apply(w)
    for a, b in zip(w.requests, scaled.requests):
        p = min(max(1, round(a.prompt_len * 0.5)), 300)
        o = min(max(1, round(a.output_len * 0.5)), 100)
        if p + o > 350:
            p = 350 - o
        assert (b.prompt_len, b.output_len) == (p, o)
        assert b.arrival_s == pytest.approx(a.arrival_s / 4.0)
    rec = scaled.source["scaling"]
    assert rec["length_scale"] == 0.5 and rec["time_scale"] == 4.0 and rec["max_total"] == 350
    assert rec["input_capped"] > 0 and "before_scaling" in scaled.source
    assert Scaling().apply(w) is w


def test_scaling_output_override_and_validation():
    w = synthetic("synthetic:uniform", 10, 0)
    out = Scaling(output_len=7, max_total=20).apply(w)
    assert all(r.output_len == 7 and r.prompt_len <= 13 for r in out.requests)
    assert Scaling(max_total=5, output_len=9).apply(w).requests[0].output_len == 4
    for bad in (dict(length_scale=0), dict(time_scale=-1), dict(max_input=0), dict(max_total=1)):
        with pytest.raises(ValueError):
            Scaling(**bad)


# ---- arrivals -------------------------------------------------------------------------------
def test_gamma_arrivals():
    t = gamma_offsets(20_000, rate=4.0, burstiness=1.0, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson: CV 1
    bursty = np.diff(gamma_offsets(20_000, 4.0, 0.25, 0))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1/sqrt(shape)
    assert gamma_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        gamma_offsets(3, 0.0, 1.0, 0)


def test_arrival_modes():
    timed = load_trace(str(SAMPLE), None, Selection(count=10))
    untimed = synthetic("synthetic:fixed", 10, 0)
    assert plan_arrivals(timed, None, 1.0, 0).mode == "replay"
    assert plan_arrivals(timed, None, 1.0, 0).offsets == tuple(r.arrival_s for r in timed.requests)
    assert plan_arrivals(timed, 2.0, 1.0, 0).mode == "poisson"
    assert plan_arrivals(untimed, 2.0, 0.5, 0).mode == "gamma"
    assert plan_arrivals(untimed, None, 1.0, 0).offsets == (0.0,) * 10
    assert plan_arrivals(untimed, math.inf, 1.0, 0).mode == "all-at-once"
    # The arrival stream does not depend on lengths and is reproducible.
    assert plan_arrivals(untimed, 2.0, 1.0, 7) == plan_arrivals(timed, 2.0, 1.0, 7)


# ---- prompts and targets --------------------------------------------------------------------
def test_token_space_prompts():
    space = TokenSpace(100, frozenset(range(10)) | {50})
    ids = space.prompt_ids(seed=1, index=3, length=500)
    assert len(ids) == 500 and all(10 <= i < 100 and i != 50 for i in ids)
    assert ids == space.prompt_ids(1, 3, 500)
    assert ids != space.prompt_ids(1, 4, 500) and ids != space.prompt_ids(2, 3, 500)
    assert ids != space.prompt_ids(1, 3, 500, stream=1)
    assert space.prompt_ids(1, 3, 7) == ids[:7]
    r = TokenSpace.parse("5:9")
    assert set(r.prompt_ids(0, 0, 200)) == {5, 6, 7, 8}
    for bad in ("9:5", "x", "3"):
        with pytest.raises(ValueError):
            TokenSpace.parse(bad)


def test_parse_targets():
    assert parse_target("http://127.0.0.1:8000").label == "127.0.0.1:8000"
    t = parse_target("vllm=http://h:8101/v1")
    assert (t.label, t.url, t.in_process) == ("vllm", "http://h:8101/v1", False)
    assert parse_target("fcfs").policy == "fcfs" and parse_target("fcfs").in_process
    assert parse_target("tight=aligned").label == "tight"
    with pytest.raises(ValueError):
        parse_target("not a policy")
    labels = [t.label for t in unique_labels([parse_target("fcfs"), parse_target("fcfs")])]
    assert labels == ["fcfs", "fcfs-2"]

"""Write a benchmark's results: raw per-request JSON, ``summary.json``, ``report.md``.

Layout of ``--output-dir``::

    report.md            summary table, ratios vs the baseline, workload and scaling, command
    summary.json         the same as data (every run's metrics and engine stats)
    runs/NAME/requests.json   raw per-request records of one run (metrics recompute from it)
    runs/NAME/steps.json      per-step batch records (in-process runs)
    *.png                plots (see ``plots``)

Files are rewritten after every run, so an interrupted comparison keeps what finished.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignedserve.bench.markdown import render
from alignedserve.bench.metrics import RATIO_METRICS, SLO, Summary, summarize
from alignedserve.bench.records import RunResult


@dataclass(slots=True)
class RunEntry:
    """A finished run with its folder name and metrics."""

    name: str
    result: RunResult
    summary: Summary


@dataclass(slots=True)
class Context:
    """Everything about the benchmark that is not a run: written at the top of the report."""

    command: str
    started_at: str
    machine: dict[str, Any]
    workload: dict[str, Any]
    load: dict[str, Any]
    slo: SLO
    baseline: str | None = None
    notes: list[str] = field(default_factory=list)


def run_name(result: RunResult, multi_rate: bool, multi_round: bool) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", result.label)
    if multi_rate:
        name += f"_rate-{fmt_rate(result.rate)}"
    if multi_round:
        name += f"_round-{result.round}"
    return name


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return "inf" if math.isinf(rate) else f"{rate:g}"


def make_entry(result: RunResult, name: str, slo: SLO) -> RunEntry:
    return RunEntry(name, result, summarize(result.records, slo))


def write_run(out_dir: Path, entry: RunEntry) -> None:
    d = out_dir / "runs" / entry.name
    d.mkdir(parents=True, exist_ok=True)
    r = entry.result
    data = {"label": r.label, "target": r.target, "rate": r.rate, "round": r.round,
            "started_at": r.started_at, "interrupted": r.interrupted, "notes": r.notes,
            "requests": [rec.to_json() for rec in r.records if rec.sent_s is not None],
            "not_sent": sum(1 for rec in r.records if rec.sent_s is None)}
    _dump(d / "requests.json", data, indent=None)
    if r.steps:
        _dump(d / "steps.json", [s.to_json() for s in r.steps], indent=None)


def _strict(value: Any) -> Any:
    """Make ``value`` strict JSON: NaN (a metric without samples) becomes null, an infinite
    rate (everything sent at once) the string "inf"."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _dump(path: Path, data: Any, indent: int | None = 1) -> None:
    """Write strict JSON atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_strict(data), indent=indent, allow_nan=False))
    tmp.replace(path)


def _get(summary: dict[str, Any], dotted: str) -> float | None:
    value: Any = summary
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def ratios(entries: list[RunEntry], baseline: str) -> list[dict[str, Any]]:
    """Per target and rate: the median over rounds of (target / baseline of the same round).

    Pairing runs of the same round before taking the median is what makes ratios robust to
    a machine whose speed drifts during the comparison.
    """
    base = {(e.result.rate, e.result.round): e.summary.to_json()
            for e in entries if e.result.label == baseline}
    groups: dict[tuple[str, float | None], dict[str, list[float]]] = {}
    for e in entries:
        b = base.get((e.result.rate, e.result.round))
        if b is None:
            continue
        row = groups.setdefault((e.result.label, e.result.rate), {})
        s = e.summary.to_json()
        for name, path, _ in RATIO_METRICS:
            v, bv = _get(s, path), _get(b, path)
            if v is not None and bv and not math.isnan(v) and not math.isnan(bv):
                row.setdefault(name, []).append(v / bv)
    return [{"label": label, "rate": rate, "rounds": max(map(len, m.values()), default=0),
             **{k: _median(v) for k, v in m.items()}} for (label, rate), m in groups.items()]


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def summary_json(ctx: Context, entries: list[RunEntry]) -> dict[str, Any]:
    runs = [{"name": e.name, "label": e.result.label, "target": e.result.target,
             "rate": e.result.rate, "round": e.result.round,
             "started_at": e.result.started_at, "interrupted": e.result.interrupted,
             "count_mismatches": sum(r.count_mismatch for r in e.result.records),
             "metrics": e.summary.to_json(), "engine_stats": e.result.engine_stats,
             "notes": e.result.notes} for e in entries]
    return {"command": ctx.command, "started_at": ctx.started_at, "machine": ctx.machine,
            "workload": ctx.workload, "load": ctx.load, "slo": _slo_json(ctx.slo),
            "baseline": ctx.baseline, "notes": ctx.notes, "runs": runs,
            "ratios": ratios(entries, ctx.baseline) if ctx.baseline else []}


def _slo_json(slo: SLO) -> dict[str, float | None]:
    return {"ttft_s": slo.ttft, "tpot_s": slo.tpot, "e2e_s": slo.e2e}


def write_summary(out_dir: Path, ctx: Context, entries: list[RunEntry], plots: list[str]) -> str:
    """Write ``summary.json`` and ``report.md``; return the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = summary_json(ctx, entries)
    _dump(out_dir / "summary.json", data)
    text = render(_strict(data), plots)
    (out_dir / "report.md").write_text(text)
    return text

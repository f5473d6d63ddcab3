"""Render ``summary.json`` data as the markdown report (also printed to the terminal)."""

from __future__ import annotations

import json
import math
from typing import Any

from alignedserve.bench.metrics import RATIO_METRICS


def _num(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return f"{value * scale:.{digits}f}"


def _pair(dist: dict[str, Any], scale: float, digits: int) -> str:
    return f"{_num(dist.get('p50'), scale, digits)} / {_num(dist.get('p99'), scale, digits)}"


def _rate(rate: float | str | None) -> str:
    if rate is None:
        return "-"
    return rate if isinstance(rate, str) else f"{rate:g}"


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def runs_table(runs: list[dict[str, Any]], with_goodput: bool) -> str:
    header = ["run", "rate", "ok / failed", "duration s", "req/s", "in tok/s", "out tok/s",
              "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 s", "bubble"]
    if with_goodput:
        header.insert(-1, "goodput req/s (share)")
    rows = []
    for run in runs:
        m, stats = run["metrics"], run.get("engine_stats") or {}
        bubble = stats.get("bubble_fraction")
        row = [run["name"] + (" (interrupted)" if run["interrupted"] else ""), _rate(run["rate"]),
               f"{m['completed']} / {m['failed']}", _num(m["duration_s"]),
               _num(m["request_throughput"], digits=2), _num(m["input_throughput"]),
               _num(m["output_throughput"]), _pair(m["ttft"], 1e3, 0), _pair(m["tpot"], 1e3, 1),
               _pair(m["itl"], 1e3, 1), _pair(m["e2e"], 1.0, 2),
               "-" if bubble is None else f"{bubble * 100:.1f}%"]
        if with_goodput:
            share = _num(m["goodput_fraction"], 100, 0)
            row.insert(-1, f"{_num(m['goodput'], digits=2)} ({share}%)")
        rows.append(row)
    return table(rows, header)


def ratios_table(ratios: list[dict[str, Any]], baseline: str) -> str:
    names = [name for name, _, _ in RATIO_METRICS]
    rows = [[r["label"], _rate(r["rate"]), str(r["rounds"])]
            + [f"{r[n]:.2f}x" if n in r else "-" for n in names] for r in ratios]
    note = (f"Ratios are target / `{baseline}` from runs of the same round (median over rounds): "
            "above 1 is better for throughput, below 1 is better for latency.")
    return note + "\n\n" + table(rows, ["target", "rate", "rounds"] + names)


def _workload_lines(w: dict[str, Any]) -> list[str]:
    desc = w.get("description", {})
    lines = [f"- workload: `{desc.get('name', '?')}`, {desc.get('requests', '?')} requests"]
    for key in ("input_tokens", "output_tokens"):
        s = desc.get(key) or {}
        if s:
            lines.append(f"- {key.replace('_', ' ')}: mean {s['mean']:.0f}, p50 {s['p50']:.0f}, "
                         f"p99 {s['p99']:.0f}, max {s['max']:.0f}, CV {s['cv']:.2f}")
    if arr := desc.get("arrivals"):
        lines.append(f"- trace arrivals: {arr['span_s']:.1f} s span, "
                     f"mean {arr['mean_rate']:.2f} req/s")
    source = dict(w.get("source", {}))
    if before := source.pop("before_scaling", None):
        ins, outs = before.get("input_tokens") or {}, before.get("output_tokens") or {}
        if ins and outs:
            lines.append(f"- before scaling: {before['requests']} requests, input mean "
                         f"{ins['mean']:.0f} (CV {ins['cv']:.2f}), output mean {outs['mean']:.0f}")
    lines.append(f"- source and scaling: `{json.dumps(source, sort_keys=True)}`")
    return lines


def render(data: dict[str, Any], plots: list[str]) -> str:
    runs = data["runs"]
    with_goodput = any(r["metrics"].get("goodput") is not None for r in runs)
    parts = ["# Benchmark report", "",
             f"- command: `{data['command']}`", f"- started: {data['started_at']}",
             f"- machine: {data['machine'].get('summary', '')}",
             *_workload_lines(data["workload"]),
             f"- load: `{json.dumps(data['load'], sort_keys=True)}`"]
    slo = {k: v for k, v in data["slo"].items() if v is not None}
    if slo:
        parts.append(f"- SLO for goodput: {', '.join(f'{k} <= {v:g}' for k, v in slo.items())}")
    parts += [f"- note: {n}" for n in data.get("notes", [])]
    parts += [f"- note ({r['name']}): {n}" for r in runs for n in r.get("notes", [])]
    parts += ["", "## Results", "", runs_table(runs, with_goodput), ""]
    mismatched = [f"{r['name']} ({r['count_mismatches']})" for r in runs if r["count_mismatches"]]
    if mismatched:
        parts += [f"**Output token count mismatches**: {', '.join(mismatched)}.", ""]
    if data.get("ratios"):
        parts += ["## Versus the baseline", "", ratios_table(data["ratios"], data["baseline"]), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(parts)

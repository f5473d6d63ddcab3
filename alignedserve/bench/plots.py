"""PNG plots of a benchmark (matplotlib's object API, no pyplot global state).

* ``latency_cdf.png``: CDFs of TTFT, TPOT, ITL and E2E, one line per run;
* ``sweep.png``: output throughput and p50/p99 TTFT and E2E against the offered request
  rate, one line per target (only when more than one rate was run; median over rounds);
* ``kv_spread_NAME.png``: per engine step, the KV-length range [min, max] of every decode
  batch and the step's bubble fraction (in-process runs, where the engine exposes steps).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from alignedserve.bench.report import RunEntry

_LATENCIES = (("TTFT (s)", lambda r: [r.ttft]), ("TPOT (s)", lambda r: [r.tpot]),
              ("ITL (s)", lambda r: r.itls), ("E2E (s)", lambda r: [r.e2e]))


def _figure(rows: int, cols: int, size: tuple[float, float], sharex: bool = False) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False, sharex=sharex)


def latency_cdf(entries: list[RunEntry], path: Path) -> bool:
    fig, axes = _figure(2, 2, (11, 8))
    drawn = False
    for ax, (title, values_of) in zip(axes.flat, _LATENCIES):
        for e in entries:
            vals = np.sort([v for r in e.result.records if r.ok for v in values_of(r)
                            if v is not None])
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=e.name)
                drawn = True
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
        ax.grid(alpha=0.3)
    if not drawn:
        return False
    axes[0][0].legend(fontsize="small")
    fig.suptitle("Latency CDFs")
    fig.savefig(path, dpi=110)
    return True


def _median_by_target(entries: list[RunEntry], getter: Any) -> dict[str, list[tuple[float, float]]]:
    cells: dict[tuple[str, float], list[float]] = {}
    for e in entries:
        if e.result.rate is not None:
            cells.setdefault((e.result.label, e.result.rate), []).append(getter(e.summary))
    lines: dict[str, list[tuple[float, float]]] = {}
    for (label, rate), vals in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        lines.setdefault(label, []).append((rate, float(np.median(vals))))
    return lines


def sweep(entries: list[RunEntry], path: Path) -> bool:
    rates = sorted({e.result.rate for e in entries if e.result.rate is not None})
    if len(rates) < 2:
        return False
    finite = [r for r in rates if not math.isinf(r)]
    # Plot "inf" (everything at once) one step to the right of the largest finite rate.
    inf_x = (max(finite) * 1.5) if finite else 1.0

    def x_of(rate: float) -> float:
        return inf_x if math.isinf(rate) else rate

    fig, axes = _figure(1, 3, (15, 4.5))
    panels = (("output tokens/s", [("", lambda s: s.output_throughput)]),
              ("TTFT (s)", [("p50", lambda s: s.ttft.p50), ("p99", lambda s: s.ttft.p99)]),
              ("E2E latency (s)", [("p50", lambda s: s.e2e.p50), ("p99", lambda s: s.e2e.p99)]))
    for ax, (ylabel, series) in zip(axes[0], panels):
        for suffix, getter in series:
            for label, points in _median_by_target(entries, getter).items():
                xs, ys = zip(*points)
                ax.plot([x_of(x) for x in xs], ys, marker="o",
                        linestyle="--" if suffix == "p99" else "-",
                        label=f"{label} {suffix}".strip())
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_xticks([x_of(r) for r in rates],
                      ["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return True


def kv_spread(entry: RunEntry, path: Path) -> bool:
    steps = entry.result.steps or []
    segments, rows_per_step = [], []
    for i, s in enumerate(steps):
        segments += [((i, lo), (i, hi)) for _rows, lo, hi, _kv in s.batches]
        rows_per_step.append(s.decode_rows)
    if not segments:
        return False
    from matplotlib.collections import LineCollection

    fig, axes = _figure(2, 1, (11, 7), sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    top.add_collection(LineCollection(segments, linewidths=1.5, alpha=0.6))
    top.scatter([a[0] for a, _ in segments], [b[1] for _, b in segments], s=2, color="black")
    top.autoscale()
    top.set_ylabel("KV length in a decode batch\n(line = min..max, dot = max)")
    top.set_title(f"{entry.name}: per-step batch KV-length spread")
    # Steps without decode batches (pure prefill) have no bubble: leave a gap, not a 0.
    bubble = [s.bubble_fraction if s.batches else math.nan for s in steps]
    bottom.plot(bubble, label="bubble fraction", color="tab:red", marker=".", markersize=3)
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("bubble fraction (red)", color="tab:red")
    bottom.set_xlabel("engine step")
    twin = bottom.twinx()
    twin.plot(rows_per_step, color="tab:gray", alpha=0.6, label="decode rows")
    twin.set_ylabel("decode rows (grey)", color="tab:gray")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return True


def write_plots(out_dir: Path, entries: list[RunEntry]) -> list[str]:
    """Draw every plot that has data; return file names relative to ``out_dir``."""
    made = []
    if latency_cdf(entries, out_dir / "latency_cdf.png"):
        made.append("latency_cdf.png")
    if sweep(entries, out_dir / "sweep.png"):
        made.append("sweep.png")
    for e in entries:
        name = f"kv_spread_{e.name}.png"
        if kv_spread(e, out_dir / name):
            made.append(name)
    return made

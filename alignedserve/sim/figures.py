"""Tables (markdown) and PNG figures from ``experiments`` result rows (matplotlib object API)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b and not math.isnan(a) and not math.isnan(b) else "-"


def kernels_table(rows: list[Row]) -> str:
    """Output tok/s and E2E p50 per variant x kernel, ratio to fcfs on the same kernel."""
    out = []
    for wl in ("varied", "uniform"):
        sel = [r for r in rows if r["experiment"] == "kernels" and r["workload"] == wl]
        base = {r["kernel"]: r for r in sel if r["system"] == "fcfs"}
        body = [[r["system"], r["kernel"], _fmt(r["output_tok_s"], 0),
                 _ratio(r["output_tok_s"], base[r["kernel"]]["output_tok_s"]),
                 _fmt(r["e2e_p50"], 1), _fmt(100 * r["bubble"], 1) + "%",
                 _fmt(r["rows_per_step"], 0), _fmt(100 * r["share"].get("copy_wait_s", 0), 0) + "%",
                 _fmt(sum(r["copy_gb"].values()) / 1e3, 1)]
                for r in sel if r["kernel"] in base]
        title = f"**{wl}** ({sel[0]['requests'] if sel else 0} requests at t=0, 1x H100)"
        out.append(title + "\n\n" + _table(
            ["policy", "kernel", "out tok/s", "vs fcfs", "E2E p50 s", "bubble", "rows/step",
             "copy wait", "copied TB"], body))
    return "\n\n".join(out)


def nodes_table(rows: list[Row]) -> str:
    sel = [r for r in rows if r["experiment"] == "nodes"]
    body = []
    for r in sel:
        base = next(b for b in sel if b["node"] == r["node"] and b["workload"] == r["workload"]
                    and b["system"].startswith("vLLM"))
        ft = next(b for b in sel if b["node"] == r["node"] and b["workload"] == r["workload"]
                  and b["system"].startswith("FT"))
        body.append([r["node"].replace(":dp", " (dp)"), r["workload"], r["system"],
                     _fmt(r["output_tok_s"], 0), _ratio(r["output_tok_s"], base["output_tok_s"]),
                     _ratio(r["output_tok_s"], ft["output_tok_s"]), _fmt(r["e2e_p50"], 1),
                     _fmt(r["ttft_p50"], 1)])
    return _table(["node", "workload", "system", "out tok/s", "vs vLLM-like", "vs FT-like",
                   "E2E p50 s", "TTFT p50 s"], body)


def latency_table(rows: list[Row]) -> str:
    sel = [r for r in rows if r["experiment"] == "latency"]
    body = []
    for r in sel:
        peers = [b for b in sel if (b["node"], b["workload"], b["load"]) ==
                 (r["node"], r["workload"], r["load"])]
        vllm = next(b for b in peers if b["system"].startswith("vLLM"))
        ft = next(b for b in peers if b["system"].startswith("FT"))
        body.append([r["node"].replace(":dp", " (dp)"), r["workload"], _fmt(r["offered_rate"], 1),
                     r["system"], _fmt(r["e2e_p50"]), _fmt(r["e2e_p99"]), _fmt(r["ttft_p50"]),
                     _ratio(vllm["e2e_p50"], r["e2e_p50"]), _ratio(ft["e2e_p50"], r["e2e_p50"])])
    return _table(["node", "trace", "req/s", "system", "E2E p50 s", "E2E p99 s", "TTFT p50 s",
                   "vLLM-like / this (p50)", "FT-like / this (p50)"], body)


def staging_table(rows: list[Row]) -> str:
    sel = [r for r in rows if r["experiment"] == "staging"]
    body = [[r["node"], r["system"], _fmt(r["output_tok_s"], 0), _fmt(r["e2e_p50"], 1),
             _fmt(100 * r["share"].get("copy_wait_s", 0), 0) + "%",
             *(_fmt(r["copy_gb"].get(k, 0.0) / 1e3, 1) for k in ("h2d", "d2h", "peer"))]
            for r in sel]
    return _table(["node", "policy", "out tok/s", "E2E p50 s", "copy wait", "h2d TB", "d2h TB",
                   "peer TB"], body)


def admission_table(rows: list[Row]) -> str:
    sel = [r for r in rows if r["experiment"] == "admission"]
    body = [[r["node"], r["workload"], _fmt(r["offered_rate"], 1) if r["load"] else "offline",
             r["system"], _fmt(r["output_tok_s"], 0), _fmt(r["ttft_p50"]), _fmt(r["ttft_p99"]),
             _fmt(r["e2e_p50"]), _fmt(r["e2e_p99"])] for r in sel]
    return _table(["node", "workload", "req/s", "system", "out tok/s", "TTFT p50 s",
                   "TTFT p99 s", "E2E p50 s", "E2E p99 s"], body)


# ---- figures -------------------------------------------------------------------------------
def _figure(rows: int, cols: int, size: tuple[float, float]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _throughput_bars(ax: Any, sel: list[Row], workload: str, axis_key: str,
                     categories: list[str]) -> None:
    """One group of bars per category (``row[axis_key]``), one bar per system, of a workload."""
    systems = list(dict.fromkeys(r["system"] for r in sel))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        vals = [next((r["output_tok_s"] for r in sel if r["workload"] == workload and
                      r["system"] == system and r[axis_key] == c), 0) for c in categories]
        ax.bar([j + i * width for j in range(len(categories))], vals, width, label=system)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories)
    ax.grid(alpha=0.3, axis="y")


def kernels_figure(rows: list[Row], path: Path) -> bool:
    sel = [r for r in rows if r["experiment"] == "kernels"]
    if not sel:
        return False
    fig, axes = _figure(1, 2, (13, 4.5))
    kernels = sorted({r["kernel"] for r in sel}, key=["padded", "per-seq", "split-kv"].index)
    for ax, wl in zip(axes[0], ("varied", "uniform")):
        _throughput_bars(ax, sel, wl, "kernel", kernels)
        ax.set_xlabel("decode-attention kernel model")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{wl}: Llama-2-7B, 1x H100, all requests at t=0")
    axes[0][0].legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return True


def nodes_figure(rows: list[Row], path: Path) -> bool:
    sel = [r for r in rows if r["experiment"] == "nodes"]
    if not sel:
        return False
    nodes = list(dict.fromkeys(r["node"] for r in sel))
    fig, axes = _figure(1, 2, (13, 4.5))
    for ax, wl in zip(axes[0], ("varied", "uniform")):
        _throughput_bars(ax, sel, wl, "node", nodes)
        ax.set_xticks(ax.get_xticks(), [n.replace(":dp", "").replace(":", " x") for n in nodes])
        ax.set_ylabel("output tokens/s (node)")
        ax.set_title(f"{wl}: Llama-2-7B, data-parallel replicas")
    axes[0][0].legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return True


def latency_figure(rows: list[Row], path: Path) -> bool:
    sel = [r for r in rows if r["experiment"] == "latency"]
    if not sel:
        return False
    panels = list(dict.fromkeys((r["node"], r["workload"]) for r in sel))
    fig, axes = _figure(1, len(panels), (4.2 * len(panels), 4.2))
    for ax, (node, wl) in zip(axes[0], panels):
        for system in dict.fromkeys(r["system"] for r in sel):
            pts = sorted((r["offered_rate"], r["e2e_p50"], r["e2e_p99"]) for r in sel
                         if (r["node"], r["workload"], r["system"]) == (node, wl, system))
            if pts:
                line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                               label=f"{system} p50")[0]
                ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--",
                        color=line.get_color(), alpha=0.6)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("E2E latency s (solid p50, dashed p99)")
        ax.set_title(f"{wl}, {node.replace(':dp', '').replace(':', ' x')}", fontsize="medium")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="x-small")
    fig.savefig(path, dpi=110)
    return True


def breakdown_figure(rows: list[Row], path: Path) -> bool:
    sel = [r for r in rows if r["experiment"] == "kernels" and r["workload"] == "varied"
           and r["kernel"] in ("padded", "split-kv")]
    if not sel:
        return False
    parts = ("decode_attn_s", "prefill_attn_s", "linear_s", "host_s", "copy_wait_s")
    fig, axes = _figure(1, 1, (12, 4.5))
    ax = axes[0][0]
    labels = [f"{r['system']}\n{r['kernel']}" for r in sel]
    bottom = [0.0] * len(sel)
    for part in parts:
        vals = [100 * r["share"].get(part, 0.0) for r in sel]
        ax.bar(range(len(sel)), vals, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(sel)), labels, fontsize="x-small", rotation=25, ha="right")
    ax.set_ylabel("% of virtual time")
    ax.set_title("where the time goes (varied, 1x H100)")
    ax.legend(fontsize="small", loc="lower right")
    fig.savefig(path, dpi=110)
    return True


def write_all(rows: list[Row], out_dir: Path) -> str:
    """Draw the figures; return the tables as markdown."""
    kernels_figure(rows, out_dir / "kernels.png")
    nodes_figure(rows, out_dir / "nodes.png")
    latency_figure(rows, out_dir / "latency.png")
    breakdown_figure(rows, out_dir / "breakdown.png")
    parts = []
    for title, fn, exp in (("Kernels", kernels_table, "kernels"), ("Nodes", nodes_table, "nodes"),
                           ("Latency", latency_table, "latency"),
                           ("Staging", staging_table, "staging"),
                           ("Admission", admission_table, "admission")):
        if any(r["experiment"] == exp for r in rows):
            parts.append(f"### {title}\n\n{fn(rows)}")
    text = "\n\n".join(parts)
    (out_dir / "tables.md").write_text(text + "\n")
    return text

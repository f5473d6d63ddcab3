"""``alignedserve simulate``: build the system from flags, run every variant, write reports.

Reports are the benchmark tool's (``alignedserve.bench.report`` / ``plots``), so simulated
and measured runs read the same; simulator-only figures (step breakdown, copy traffic) go
into each run's ``engine_stats`` and a second table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from alignedserve.bench.arrivals import plan_arrivals
from alignedserve.bench.config import workload_from_args
from alignedserve.bench.metrics import SLO
from alignedserve.bench.records import RunResult
from alignedserve.bench.report import (Context, RunEntry, make_entry, run_name, write_run,
                                       write_summary)
from alignedserve.bench.workloads import Workload, describe
from alignedserve.config import SchedulerConfig
from alignedserve.sim.config import SimConfig
from alignedserve.sim.hardware import profile_to_json, node_profile
from alignedserve.sim.models import ModelProfile, load_model_profile
from alignedserve.sim.runner import SimResult, simulate
from alignedserve.sim.variants import PolicyVariant, parse_variants


def config_from_args(args: argparse.Namespace) -> SimConfig:
    model = load_model_profile(args.model, args.dtype_bytes)
    node = node_profile(args.hardware, args.num_devices, host_link=args.host_link,
                        peer_link=args.peer_link, host_ram_gb=args.host_ram_gb,
                        profile_path=args.hardware_profile)
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        step_time_target_s=args.step_time_target,
        kv_reserve_tokens=args.kv_reserve_tokens, align_tolerance=args.align_tolerance,
        max_cohort_rows=args.max_cohort_rows, max_inflight=args.max_inflight,
        max_wait_steps=args.max_wait_steps, catchup_window=args.catchup_window)
    kernel = args.attention_kernel or node.attention_kernel
    launch = args.attention_launch or node.attention_launch
    return SimConfig(model, node, kernel, launch, sched,
                     args.topology, args.dispatch, args.device_kv_gb, args.host_kv_gb,
                     args.prefetch_link_tokens, record_itl=args.itl, nodes=args.nodes)


def load_workload(args: argparse.Namespace, model: ModelProfile) -> Workload:
    """The benchmark tool's workload, capped at the model context unless told otherwise."""
    ns = argparse.Namespace(**vars(args))
    ns.max_total_len = args.max_total_len or model.max_model_len
    ns.duration, ns.concurrency = None, None
    workload = workload_from_args(ns)
    if not workload.requests:
        raise ValueError("the workload has no requests")
    return workload


def _baseline(variants: list[PolicyVariant], wanted: str | None) -> str:
    labels = [v.label for v in variants]
    if wanted is not None and wanted not in labels:
        raise ValueError(f"--baseline {wanted!r} is not one of {labels}")
    return wanted or ("fcfs" if "fcfs" in labels else labels[0])


def _machine(cfg: SimConfig) -> dict[str, Any]:
    from alignedserve.bench.runner import machine_info

    host = machine_info()
    node = cfg.node
    summary = (f"SIMULATED {node.name} ({cfg.topology}), model {cfg.model.name}; "
               f"simulator ran on {host['summary']}")
    return {"summary": summary, "simulated_node": profile_to_json(node, {
        "name": node.name, "num_devices": node.num_devices,
        "peer_link": node.peer_link and dataclasses.asdict(node.peer_link)}),
        "model": dataclasses.asdict(cfg.model), "host": host}


def _result(variant: PolicyVariant, cfg: SimConfig, res: SimResult,
            rate: float | None) -> RunResult:
    stats = dict(res.engine_stats, sim_wall_s=res.wall_s, policy=variant.policy,
                 overrides=dict(variant.overrides), kernel=cfg.kernel.value,
                 launch=cfg.launch.value, topology=cfg.topology,
                 scheduler=dataclasses.asdict(cfg.scheduler_config()))
    return RunResult(variant.label, f"sim:{variant.policy}", rate, 0, res.records,
                     datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     engine_stats=stats, steps=res.steps, notes=res.notes)


def run_simulate(args: argparse.Namespace, command: str) -> int:
    base = config_from_args(args)
    variants = parse_variants(args.policies)
    baseline = _baseline(variants, args.baseline)
    workload = load_workload(args, base.model)
    rates = args.rate or [None]
    out = Path(args.output_dir or f"sim-results/{datetime.now():%Y%m%d-%H%M%S}")
    slo = SLO(*(None if v is None else v / 1e3
                for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)))
    modes: dict[str, str] = {}
    ctx = Context(command, datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  _machine(base), {"description": describe(workload), "source": workload.source},
                  {"arrival_modes": modes, "burstiness": args.burstiness, "seed": args.seed},
                  slo, baseline)
    entries: list[RunEntry] = []
    for rate in rates:
        arrivals = plan_arrivals(workload, rate, args.burstiness, args.seed)
        modes[str(rate)] = arrivals.mode
        for variant in variants:
            cfg = variant.apply(base)
            res = simulate(workload, arrivals.offsets, variant.policy, cfg)
            result = _result(variant, cfg, res, rate)
            entry = make_entry(result, run_name(result, len(rates) > 1, False), slo)
            entries.append(entry)
            write_run(out, entry)
            write_summary(out, ctx, entries, [])
            print(one_line(entry), file=sys.stderr, flush=True)
    plots: list[str] = []
    if not args.no_plots:
        from alignedserve.bench.plots import write_plots

        plots = write_plots(out, entries)
    text = write_summary(out, ctx, entries, plots)
    print("## Results" + text.split("## Results", 1)[-1].split("## Plots", 1)[0].rstrip())
    print("\n## Simulator breakdown\n\n" + breakdown_table(entries))
    print(f"\nreport: {out / 'report.md'}")
    return 0 if all(e.summary.completed == len(workload) for e in entries) else 1


def one_line(entry: RunEntry) -> str:
    s, e = entry.summary, entry.result.engine_stats or {}
    return (f"[{entry.name}] ok {s.completed}, {s.output_throughput:.1f} out tok/s, "
            f"TTFT p50 {s.ttft.p50 * 1e3:.0f} ms, E2E p50 {s.e2e.p50:.2f} s, "
            f"{e.get('steps', 0)} steps simulated in {e.get('sim_wall_s', math.nan):.1f} s")


def breakdown_table(entries: list[RunEntry]) -> str:
    """Per run: where virtual time went, how aligned the batches were, what crossed links."""
    header = ["run", "kernel", "steps", "rows/step", "batches/step", "bubble", "attn %",
              "linear %", "host %", "copy wait %", "h2d GB", "d2h GB", "peer GB", "sim s"]
    rows = []
    for entry in entries:
        e = entry.result.engine_stats or {}
        busy = e["host_s"] + e["device_s"] + e["grow_s"] + e["copy_wait_s"]
        pct = (lambda x: f"{100 * x / busy:.0f}") if busy else (lambda x: "-")
        copies = e.get("copy_bytes_by_route", {})
        steps = max(1, e["steps"])
        batches = sum(len(s.batches) for s in entry.result.steps or []) / max(
            1, len(entry.result.steps or []))
        rows.append([entry.name, e["kernel"] + ("" if e["launch"] == "per-batch" else "+grouped"),
                     str(e["steps"]), f"{e['decode_tokens'] / steps:.1f}", f"{batches:.1f}",
                     f"{100 * e['bubble_fraction']:.1f}%",
                     pct(e["decode_attn_s"] + e["prefill_attn_s"]), pct(e["linear_s"]),
                     pct(e["host_s"]), pct(e["copy_wait_s"]),
                     *(f"{copies.get(k, 0) / 1e9:.1f}" for k in ("h2d", "d2h", "peer")),
                     f"{e['sim_wall_s']:.1f}"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])

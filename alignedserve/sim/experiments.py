"""The simulated evaluation in docs/simulation.md: run the grid, write tables, JSON and PNGs.

    python -m alignedserve.sim.experiments --trace-dir ../shared/workloads --output-dir docs/sim

Five experiments, all Llama-2-7B, each policy the engine's real scheduler:

* ``kernels``: one H100, offline (every request at t=0), every policy variant on every
  decode-attention kernel model — which kernel makes alignment pay;
* ``nodes``: 2- and 8-GPU A100/H100 nodes as data-parallel replicas, offline, the three
  systems each on its own kernel (vLLM-like, FasterTransformer-like, AlignedServe);
* ``latency``: the Azure conversation and code traces replayed at rising speed on a
  2xH100 and an 8xA100 node — latency versus offered load;
* ``staging``: the engine's own multi-GPU semantics (dev0 computes, peers stage KV) on
  1, 2 and 8 H100s — what GPU-Prefetch-For-GPU moves and what it costs;
* ``admission``: the aligned policy admitting the shortest prompt first (the default) vs in
  arrival order, offline and on the conversation trace.

Scheduler settings are ``SchedulerConfig``'s defaults with ``catchup_window=8``, as
``alignedserve simulate`` runs it (its padded and grouped kernels are where catch-up pays).

Everything is deterministic; ``--quick`` shrinks the grid to a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from alignedserve.bench.metrics import summarize
from alignedserve.bench.traces import Selection, load_trace
from alignedserve.bench.workloads import Scaling, Workload, synthetic
from alignedserve.config import SchedulerConfig
from alignedserve.sim.config import SimConfig
from alignedserve.sim.hardware import node_profile
from alignedserve.sim.models import load_model_profile
from alignedserve.sim.runner import simulate
from alignedserve.sim.variants import PolicyVariant, parse_variant

MODEL = "llama-2-7b"
ALIGNED_GROUPED = "aligned:kernel=padded:launch=grouped:host_kv_gb=0"
SYSTEMS: Mapping[str, str] = MappingProxyType({  # each system on the kernel it ships with
    "vLLM-like (fcfs, split-kv)": "fcfs:kernel=split-kv",
    "FT-like (static, padded)": "static:kernel=padded",
    "aligned, engine defaults": "aligned:kernel=padded",
    "aligned, grouped, no host pool": ALIGNED_GROUPED,
})
SCHEDULER = SchedulerConfig(catchup_window=8, step_time_target_s=0.0)  # GPU engines: fixed budgets
ADMISSION_SYSTEMS: Mapping[str, str] = MappingProxyType({
    "vLLM-like (fcfs, split-kv)": "fcfs:kernel=split-kv",
    "aligned, grouped, no pool, arrival order": ALIGNED_GROUPED + ":admission=fcfs",
    "aligned, grouped, no pool, shortest first": ALIGNED_GROUPED + ":admission=shortest",
})
KERNEL_VARIANTS: Mapping[str, str] = MappingProxyType({
    "fcfs": "fcfs", "static": "static", "aligned (defaults)": "aligned",
    "aligned grouped": "aligned:launch=grouped",
    "aligned, no pool": "aligned:host_kv_gb=0",
    "aligned grouped, no pool": "aligned:launch=grouped:host_kv_gb=0",
})


@dataclass(frozen=True, slots=True)
class Case:
    experiment: str
    workload: str
    node: str  # "HW:N:topology"
    system: str
    variant: str  # policy variant text
    load: float | None = None  # trace time scale (None: offline)


def _variant(label: str, text: str) -> PolicyVariant:
    return parse_variant(f"{label}={text}")


def _node(spec: str) -> tuple[Any, str]:
    hw, n, topology = spec.split(":")
    return node_profile(hw, int(n)), topology


def _workloads(trace_dir: str, n: int) -> dict[str, Workload]:
    cap = Scaling(max_total=4096)
    out = {"varied": synthetic("synthetic:varied", n, 0),
           "uniform": synthetic("synthetic:fixed:in=512,out=256", n, 0)}
    for name in ("azure-conv", "azure-code"):
        out[name] = cap.apply(load_trace(name, trace_dir, Selection(count=n)))
    return out


def run_case(case: Case, workload: Workload) -> dict[str, Any]:
    node, topology = _node(case.node)
    variant = _variant(case.system, case.variant)
    cfg = variant.apply(SimConfig(load_model_profile(MODEL), node, topology=topology,
                                  scheduler=SCHEDULER))
    if case.load is None:
        offsets = [0.0] * len(workload.requests)
    else:
        offsets = [r.arrival_s / case.load for r in workload.requests]
    res = simulate(workload, offsets, variant.policy, cfg)
    s, e = summarize(res.records), res.engine_stats
    busy = e["host_s"] + e["device_s"] + e["grow_s"] + e["copy_wait_s"]
    return {**asdict(case), "kernel": cfg.kernel.value, "launch": cfg.launch.value,
            "requests": len(workload.requests), "completed": s.completed,
            "offered_rate": (len(offsets) - 1) / offsets[-1] if offsets[-1] else None,
            "output_tok_s": s.output_throughput, "req_s": s.request_throughput,
            "ttft_p50": s.ttft.p50, "ttft_p99": s.ttft.p99, "tpot_p50": s.tpot.p50,
            "e2e_p50": s.e2e.p50, "e2e_p99": s.e2e.p99, "bubble": e["bubble_fraction"],
            "rows_per_step": e["decode_tokens"] / max(1, e["steps"]),
            "share": {k: e[k] / busy for k in ("decode_attn_s", "prefill_attn_s", "linear_s",
                                               "host_s", "copy_wait_s")} if busy else {},
            "copy_gb": {k: v / 1e9 for k, v in e["copy_bytes_by_route"].items()},
            "steps": e["steps"], "sim_wall_s": res.wall_s}


def cases(quick: bool) -> list[Case]:
    out: list[Case] = []
    kernels = ("padded", "per-seq", "split-kv")
    for wl in ("varied", "uniform"):
        for k in kernels:
            for label, text in KERNEL_VARIANTS.items():
                out.append(Case("kernels", wl, "h100:1:staging", label, f"{text}:kernel={k}"))
    nodes = ("h100:2:dp",) if quick else ("a100:2:dp", "h100:2:dp", "a100:8:dp", "h100:8:dp")
    for node in nodes:
        for wl in ("varied", "uniform"):
            out += [Case("nodes", wl, node, s, v) for s, v in SYSTEMS.items()]
    lat_nodes = {"h100:2:dp": 2, "a100:8:dp": 8}
    loads = {"azure-conv": (1, 2, 3), "azure-code": (2, 4, 8)}
    for node, n in lat_nodes.items():
        for wl, ks in loads.items():
            for k in (ks[:1] if quick else ks):
                out += [Case("latency", wl, node, s, v, float(k * n)) for s, v in SYSTEMS.items()
                        if "defaults" not in s]
    for n in ((1, 2) if quick else (1, 2, 8)):
        for label in ("fcfs", "aligned (defaults)", "aligned grouped"):
            out.append(Case("staging", "varied", f"h100:{n}:staging", label,
                            KERNEL_VARIANTS[label] + ":kernel=padded"))
    for wl, node, load in (("varied", "h100:1:staging", None), ("azure-conv", "h100:2:dp", 4.0),
                           ("azure-conv", "h100:2:dp", 6.0)):
        out += [Case("admission", wl, node, s, v, load) for s, v in ADMISSION_SYSTEMS.items()]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace-dir", required=True)
    p.add_argument("--output-dir", default="docs/sim")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per offline run and device (default 1000; quick 150)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=None, help="run only this experiment")
    args = p.parse_args(argv)
    per_device = args.requests or (150 if args.quick else 1000)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    cache: dict[int, dict[str, Workload]] = {}
    rows: list[dict[str, Any]] = []
    if args.only and results_path.is_file():  # keep the other experiments' rows
        rows = [r for r in json.loads(results_path.read_text()) if r["experiment"] != args.only]
    for case in cases(args.quick):
        if args.only and case.experiment != args.only:
            continue
        devices = int(case.node.split(":")[1]) if case.node.endswith(":dp") else 1
        n = per_device * devices * (2 if case.load is not None else 1)  # traces: twice
        wl = cache.setdefault(n, _workloads(args.trace_dir, n))[case.workload]
        t = time.perf_counter()
        rows.append(run_case(case, wl))
        r = rows[-1]
        print(f"[{case.experiment}] {case.workload} {case.node} {case.system} {r['kernel']} "
              f"load={case.load}: {r['output_tok_s']:.0f} tok/s, E2E p50 {r['e2e_p50']:.2f} s "
              f"({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
        results_path.write_text(json.dumps(rows, indent=1))
    from alignedserve.sim.figures import write_all

    print(write_all(rows, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

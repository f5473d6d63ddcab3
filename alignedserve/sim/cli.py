"""``alignedserve simulate`` and ``alignedserve calibrate``: the command lines of the simulator.

``simulate`` runs the engine's real schedulers against the cost model over a benchmark
workload and writes the benchmark tool's report (``report.md``, ``summary.json``, ``runs/``,
PNG plots) plus a comparison table on stdout. ``calibrate`` measures the real engine on
this machine and writes the ``cpu-local`` hardware profile (see ``calibrate``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from alignedserve.sim.costmodel import AttentionKernel, AttentionLaunch

EXAMPLES = """\
examples:
  # the Azure conversation trace on one H100, the three policies, split-KV attention
  alignedserve simulate --workload azure-conv --trace-dir ../shared/workloads \\
      --num-requests 10000 --hardware h100 --model llama-2-7b --policies aligned,fcfs,static
  # an 8-GPU node as 8 data-parallel replicas, padded attention, synthetic varied prompts
  alignedserve simulate --workload synthetic:varied --num-requests 4000 --rate 40 \\
      --hardware a100 --num-devices 8 --topology dp --attention-kernel padded
  # each policy on its own kernel (vLLM-like, FasterTransformer-like), aligned without a pool
  alignedserve simulate --workload synthetic:uniform --num-requests 2000 --policies \\
      aligned=aligned:launch=grouped fcfs=fcfs:kernel=per-seq static=static:kernel=padded
"""


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    # The flag names and meanings of `alignedserve bench`, so a workload spec carries over.
    g = p.add_argument_group("workload (the benchmark tool's specs and scaling)")
    g.add_argument("--workload", "--trace", dest="workload", default="synthetic:varied",
                   metavar="SPEC", help="synthetic:NAME[:k=v,...], a trace name (azure-conv, "
                   "azure-code, arxiv, sharegpt) or a CSV path")
    g.add_argument("--num-requests", type=int, default=1000, metavar="N",
                   help="requests (0 = the whole trace)")
    g.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="folder holding the named traces (default: $ALIGNEDSERVE_TRACE_DIR)")
    g.add_argument("--trace-start", type=int, default=0, metavar="K",
                   help="skip the trace's first K rows")
    g.add_argument("--trace-sample", choices=["window", "random"], default="window",
                   help="N consecutive rows (keeps bursts) or N random rows in trace order")
    g.add_argument("--output-len", type=int, default=None, metavar="N",
                   help="override every request's output length")
    g.add_argument("--length-scale", type=float, default=1.0, metavar="F",
                   help="multiply prompt and output lengths by F")
    g.add_argument("--max-input-len", type=int, default=None, metavar="N", help="cap prompts")
    g.add_argument("--max-output-len", type=int, default=None, metavar="N", help="cap outputs")
    g.add_argument("--max-total-len", type=int, default=None, metavar="N",
                   help="cap prompt + output (default: the model's context)")
    g.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                   help="replay trace arrivals F times faster")
    g.add_argument("--rate", type=float, nargs="+", default=None, metavar="R",
                   help="Poisson request rate(s) in req/s (several = a sweep; inf = all at "
                   "once). Default: replay trace times, else all at once")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of inter-arrival gaps with --rate (1 = Poisson)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of synthetic lengths and arrivals (same seed = same workload)")


def _add_system_args(p: argparse.ArgumentParser) -> None:
    from alignedserve.sim.config import DISPATCH
    from alignedserve.sim.hardware import LINKS, hardware_names
    from alignedserve.sim.models import model_names

    g = p.add_argument_group("simulated system")
    g.add_argument("--hardware", default="h100", help=f"one of {hardware_names()}")
    g.add_argument("--hardware-profile", default=None, metavar="PATH",
                   help="a calibrated profile JSON (overrides --hardware)")
    g.add_argument("--num-devices", type=int, default=1, help="accelerators in the node")
    g.add_argument("--topology", choices=["staging", "dp"], default="staging",
                   help="staging: one engine, dev0 computes, peers stage KV (the engine's "
                   "semantics); dp: one replica per device")
    g.add_argument("--dispatch", choices=list(DISPATCH), default="round-robin",
                   help="how dp replicas get requests (kv, kv+length: the served replica "
                   "router of serve --replicas)")
    g.add_argument("--nodes", type=int, default=1,
                   help="dp: identical nodes (replicas = nodes x --num-devices)")
    g.add_argument("--host-link", choices=sorted(LINKS), default=None,
                   help="host<->device link (default: PCIe Gen4 for A100, Gen5 for H100/H200)")
    g.add_argument("--peer-link", choices=sorted(LINKS) + ["none"], default=None,
                   help="device<->device link (default: the GPU's NVLink; none = via host)")
    g.add_argument("--host-ram-gb", type=float, default=None,
                   help="host RAM of the node (default: 256 GiB per device)")
    g.add_argument("--model", default="llama-2-7b",
                   help=f"one of {model_names()} or a HF config.json path")
    g.add_argument("--dtype-bytes", type=int, default=2,
                   help="bytes per weight / activation / KV element (2 = bf16)")
    g.add_argument("--attention-kernel", choices=[k.value for k in AttentionKernel],
                   default=None, help="decode-attention cost model (default: the hardware "
                   "profile's, split-kv for the GPUs)")
    g.add_argument("--attention-launch", choices=[k.value for k in AttentionLaunch],
                   default=None, help="one kernel call per decode batch, or one grouped call "
                   "per step (default: the profile's, per-batch for the GPUs)")


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policies and limits")
    g.add_argument("--policies", nargs="+", default=["aligned,fcfs,static"],
                   metavar="VARIANT", help="POLICY or LABEL=POLICY:key=value:...; comma- or "
                   "space-separated; policies: aligned, fcfs, static, vllm-plugin (vLLM with "
                   "our scheduler plug-in; set align_tolerance=64 for its default) (keys: "
                   "SchedulerConfig fields, kernel, launch, host_kv_gb, device_kv_gb, "
                   "prefetch_link_tokens, topology, dispatch, plugin_admission=0|1)")
    g.add_argument("--baseline", default=None, help="label ratios are computed against "
                   "(default: fcfs if present, else the first)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max requests decoding at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="per-step token budget (prefills are chunked to fit)")
    g.add_argument("--step-time-target", type=float, default=0.0,
                   help="seconds: hold a step's prompt tokens to what the modelled devices "
                        "prefill in about this long (the engine's alignedserve.sched.budget; "
                        "default 0, off: the simulated GPU engines use fixed token budgets)")
    g.add_argument("--kv-reserve-tokens", type=int, default=256,
                   help="output headroom reserved in each request's KV allocation")
    g.add_argument("--align-tolerance", type=int, default=2,
                   help="aligned: max KV-length difference inside a decode batch")
    g.add_argument("--max-cohort-rows", type=int, default=64,
                   help="aligned: cohorts above this are split")
    g.add_argument("--max-inflight", type=int, default=4096,
                   help="aligned: requests admitted at once (device + host tiers)")
    g.add_argument("--max-wait-steps", type=int, default=16,
                   help="aligned: steps a ready cohort waits before it has priority")
    g.add_argument("--catchup-window", type=int, default=8,
                   help="aligned: hold a small cohort up to this many steps so a shorter one "
                        "catches up and merges (pays where decode pads a batch to its longest "
                        "row; the serving engine's default is 0, its kernels never pad)")
    g.add_argument("--device-kv-gb", type=float, default=None,
                   help="KV budget per device (default: memory - reserve - weights)")
    g.add_argument("--host-kv-gb", type=float, default=None,
                   help="host-tier KV budget (default: half the host RAM; 0 = no host pool)")
    g.add_argument("--prefetch-link-tokens", type=int, default=None,
                   help="per-step link budget for prefetch (default: derived; 0 = unlimited)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="report folder (default: sim-results/DATE-TIME)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--itl", action="store_true",
                   help="record every token's time (ITL metrics; memory grows with tokens)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT objective for goodput")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT objective for goodput")
    g.add_argument("--slo-e2e-ms", type=float, default=None, help="E2E objective for goodput")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="run the real schedulers on a cost model of GPU servers",
        description="Run the engine's real schedulers (unchanged) against a cost model of GPU "
        "servers over a benchmark workload, in virtual time; print a comparison table and "
        "write the benchmark tool's report files.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_args(p)
    _add_system_args(p)
    _add_policy_args(p)
    _add_output_args(p)
    p.set_defaults(func=_main_simulate)
    c = subparsers.add_parser(
        "calibrate", help="fit the cpu-local hardware profile from the real engine",
        description="Measure the real engine on this machine, fit the cpu-local profile, "
        "then compare simulated and measured throughput and p50 latency on held-out runs.")
    c.add_argument("--model", default=None, help="model for the engine (default: the "
                   "engine's default model)")
    c.add_argument("--output", default=None, metavar="PATH",
                   help="profile JSON to write (default: alignedserve/sim/profiles/cpu-local.json)")
    c.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    c.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    c.add_argument("--repeats", type=int, default=3, help="runs per fit shape and held-out "
                   "case; the fastest is kept (filters out interference on a shared machine)")
    c.add_argument("--skip-validation", action="store_true",
                   help="fit and write the profile without the held-out comparison")
    c.set_defaults(func=_main_calibrate)


def _main_simulate(args: argparse.Namespace) -> int:
    from alignedserve.sim.command import run_simulate

    try:
        return run_simulate(args, " ".join(map(shlex.quote, sys.argv)))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main_calibrate(args: argparse.Namespace) -> int:
    from alignedserve.sim.calibrate import run_calibrate

    return run_calibrate(args)

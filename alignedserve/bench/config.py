"""``BenchConfig``: a whole benchmark, and how parsed ``alignedserve bench`` flags become a
validated one.

Everything that can be wrong with the flags is reported here, before any model loads or
request is sent: unknown policies, an unknown baseline, a missing trace, bad lengths.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from alignedserve.bench.metrics import SLO
from alignedserve.bench.openai_stream import RequestOptions
from alignedserve.bench.targets import Target, parse_target, unique_labels
from alignedserve.bench.traces import Selection, load_trace
from alignedserve.bench.workloads import SYNTHETIC_PREFIX, Scaling, Workload, synthetic


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """A whole benchmark as parsed from the command line (see ``cli``)."""

    targets: tuple[Target, ...]
    workload: Workload
    output_dir: Path
    rates: tuple[float | None, ...] = (None,)
    burstiness: float = 1.0
    concurrency: int | None = None
    duration_s: float | None = None
    seed: int = 0
    warmup: int = 1
    rounds: int = 1
    baseline: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    text_prompts: bool = False
    token_range: str | None = None
    tokenizer: str | None = None
    slo: SLO = field(default_factory=SLO)
    engine_config: Any = None  # EngineConfig for in-process targets (policy set per target)
    model_name: str | None = None
    api_key: str | None = None
    request_timeout_s: float = 3600.0
    plots: bool = True
    show_progress: bool = True
    command: str = ""


DEFAULT_NUM_REQUESTS = 64
_DURATION_POOL = 100_000  # requests prepared for a closed loop that runs for --duration


def targets_from_args(args: argparse.Namespace) -> tuple[Target, ...]:
    specs = ([args.url] if args.url else []) + ([args.policy] if args.policy else [])
    targets = unique_labels([parse_target(s) for s in specs + list(args.compare)])
    if not targets:
        raise ValueError("nothing to benchmark: give --url URL, --policy NAME or --compare ...")
    policies = {t.policy for t in targets if t.policy is not None}
    if policies:
        from alignedserve.sched.registry import POLICIES

        if unknown := policies - set(POLICIES):
            raise ValueError(f"unknown policy {sorted(unknown)}; this engine has "
                             f"{sorted(POLICIES)} (URLs must start with http://)")
    return tuple(targets)


def _num_requests(args: argparse.Namespace, is_trace: bool) -> int:
    """Explicit --num-requests wins; with --duration, enough requests to last it."""
    if args.num_requests is not None:
        if args.num_requests < 0:
            raise ValueError("--num-requests must be >= 0")
        return args.num_requests
    if args.duration is None:
        return DEFAULT_NUM_REQUESTS
    if is_trace:
        return 0
    finite = [r for r in (args.rate or []) if not math.isinf(r)]
    if finite and len(finite) == len(args.rate):
        return math.ceil(max(finite) * args.duration * 1.2) + 16
    return _DURATION_POOL if args.concurrency else DEFAULT_NUM_REQUESTS


def workload_from_args(args: argparse.Namespace) -> Workload:
    spec: str = args.workload
    is_trace = not spec.startswith(SYNTHETIC_PREFIX)
    n = _num_requests(args, is_trace)
    if is_trace:
        sel = Selection(args.trace_start, n or None, args.trace_sample, args.seed)
        workload = load_trace(spec, args.trace_dir, sel)
    else:
        workload = synthetic(spec, n, args.seed)
    scaling = Scaling(args.output_len, args.length_scale, args.max_input_len,
                      args.max_output_len, args.max_total_len, args.time_scale)
    return scaling.apply(workload)


def _slo(args: argparse.Namespace) -> SLO:
    ms = (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    if any(v is not None and v <= 0 for v in ms):
        raise ValueError("SLOs must be > 0 ms")
    return SLO(*(None if v is None else v / 1e3 for v in ms))


def _options(args: argparse.Namespace) -> RequestOptions:
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as exc:
            raise ValueError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if args.endpoint == "chat" and args.prompt_format != "text":
        raise ValueError("--endpoint chat needs --prompt-format text")
    return RequestOptions(args.endpoint, args.temperature, args.ignore_eos, args.count_check, extra)


def _engine_config(args: argparse.Namespace) -> Any:
    from alignedserve.entrypoints.args import engine_config_from_args

    # --policy is per target here; the engine's own default stands in until a target sets it.
    return engine_config_from_args(argparse.Namespace(**{**vars(args), "policy": "fcfs"}))


def config_from_args(args: argparse.Namespace, command: str) -> BenchConfig:
    targets = targets_from_args(args)
    labels = [t.label for t in targets]
    baseline = args.baseline or (labels[0] if len(labels) > 1 else None)
    if baseline is not None and baseline not in labels:
        raise ValueError(f"--baseline {baseline!r} is not a target label; labels: {labels}")
    for flag in ("rounds", "warmup"):
        if getattr(args, flag) < (1 if flag == "rounds" else 0):
            raise ValueError(f"--{flag} is too small")
    workload = workload_from_args(args)
    if not workload.requests:
        raise ValueError("the workload has no requests")
    out = Path(args.output_dir or f"bench-results/{datetime.now():%Y%m%d-%H%M%S}")
    return BenchConfig(
        targets=targets, workload=workload, output_dir=out,
        rates=tuple(args.rate) if args.rate else (None,), burstiness=args.burstiness,
        concurrency=args.concurrency, duration_s=args.duration, seed=args.seed,
        warmup=args.warmup, rounds=args.rounds, baseline=baseline, options=_options(args),
        text_prompts=args.prompt_format == "text", token_range=args.token_range,
        tokenizer=args.tokenizer, slo=_slo(args),
        engine_config=_engine_config(args) if any(t.in_process for t in targets) else None,
        model_name=args.model_name, api_key=args.api_key,
        request_timeout_s=args.request_timeout, plots=not args.no_plots,
        show_progress=not args.no_progress, command=command)

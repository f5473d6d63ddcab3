"""Run a benchmark: every target x every rate x every round, then report.

Targets run one after another, never at the same time, on the same ``Load`` (same prompts,
same due times). On odd rounds the target order is reversed (A B, B A, ...) so slow drift of
a shared machine falls evenly on every target; ratios against the baseline are taken within a
round, then the median over rounds is reported.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import traceback
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import alignedserve.kernels.isa as isa
from alignedserve.bench.arrivals import plan_arrivals
from alignedserve.bench.client import TargetUnavailable
from alignedserve.bench.config import BenchConfig
from alignedserve.bench.load import Load
from alignedserve.bench.prompts import PromptFactory, TokenSpace, load_tokenizer
from alignedserve.bench.records import RunResult
from alignedserve.bench.report import (
    Context,
    RunEntry,
    make_entry,
    run_name,
    write_run,
    write_summary,
)
from alignedserve.bench.targets import Target
from alignedserve.bench.workloads import describe


class _Engines:
    """Builds one fresh engine per in-process run, loading the model weights only once."""

    def __init__(self, config: Any):
        self.config = config
        self.loaded: Any = None

    def build(self, policy: str) -> Any:
        from alignedserve.engine import LLMEngine

        engine = LLMEngine(dataclasses.replace(self.config, policy=policy), self.loaded)
        self.loaded = engine.loaded
        return engine

    def tokenizer(self) -> Any:
        if self.loaded is None:
            import torch

            from alignedserve.engine import resolve_dtype
            from alignedserve.model.loader import load_model

            # The same device choice as LLMEngine, so the engines can reuse these weights.
            device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.loaded = load_model(self.config.model, resolve_dtype(self.config.dtype), device)
        return self.loaded.tokenizer


def machine_info() -> dict[str, Any]:
    """The machine a run measured: the CPU by name, numbers, core and instruction-set flags (a
    VM may name Zen 4 and Zen 5 alike "AMD EPYC"), the kernel paths it runs and any forced
    one, cores, memory and platform; ``summary`` says it in one line."""
    cpu = isa.cpu_info()
    mem = next((line.split()[1] for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), None)
    mem_gib = round(int(mem) / 2**20, 1) if mem else None
    info = {"cpu": cpu.model_name or platform.processor() or "?", "cpu_vendor": cpu.vendor,
            "cpu_family": cpu.family, "cpu_model": cpu.model, "cpu_stepping": cpu.stepping,
            "cpu_core": cpu.core, "isa_flags": list(cpu.recorded_flags),
            "kernel_paths": list(isa.cpu_paths()),
            "forced_kernel_path": os.environ.get(isa.ENV_VAR) or None,
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or None,
            "cores": os.cpu_count(), "memory_gib": mem_gib,
            "platform": platform.platform(), "python": platform.python_version()}
    forced = f", {isa.ENV_VAR}={info['forced_kernel_path']}" if info["forced_kernel_path"] else ""
    info["summary"] = (f"{cpu.summary()}; kernel paths {', '.join(info['kernel_paths'])}"
                       f"{forced}; {info['cores']} cores, {mem_gib} GiB, {info['platform']}")
    return info


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _prompt_factory(cfg: BenchConfig, engines: _Engines | None) -> PromptFactory:
    tokenizer = None
    if cfg.text_prompts or cfg.token_range is None:
        tokenizer = (engines.tokenizer() if engines is not None and cfg.tokenizer is None
                     else load_tokenizer(cfg.tokenizer))
    space = (TokenSpace.parse(cfg.token_range) if cfg.token_range
             else TokenSpace.from_tokenizer(tokenizer))
    return PromptFactory(space, cfg.seed, tokenizer, cfg.text_prompts)


def _load(cfg: BenchConfig, prompts: PromptFactory, rate: float | None) -> tuple[Load, str]:
    arrivals = plan_arrivals(cfg.workload, rate, cfg.burstiness, cfg.seed)
    load = Load(cfg.workload.requests, arrivals.offsets, prompts, cfg.options, cfg.concurrency,
                cfg.duration_s, cfg.warmup)
    return load, arrivals.mode


def _run_one(cfg: BenchConfig, target: Target, load: Load, label: str,
             engines: _Engines | None) -> RunResult:
    if target.url is not None:
        from alignedserve.bench.client import HttpTarget, run_http

        http = HttpTarget(target.url, cfg.model_name, cfg.api_key, cfg.request_timeout_s)
        return run_http(http, load, label, cfg.show_progress)
    from alignedserve.bench.inprocess import run_inprocess

    assert engines is not None and target.policy is not None
    engine = engines.build(target.policy)
    try:
        return run_inprocess(engine, load, label, target.description, cfg.show_progress)
    finally:
        engine.close()


def _context(cfg: BenchConfig, modes: list[dict[str, Any]]) -> Context:
    load = {"arrival_modes": modes, "burstiness": cfg.burstiness, "concurrency": cfg.concurrency,
            "duration_s": cfg.duration_s, "seed": cfg.seed, "warmup": cfg.warmup,
            "rounds": cfg.rounds, "prompts": "text" if cfg.text_prompts else "token ids",
            **dataclasses.asdict(cfg.options)}
    workload = {"description": describe(cfg.workload), "source": cfg.workload.source}
    return Context(cfg.command, datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   machine_info(), workload, load, cfg.slo, cfg.baseline)


def _one_line(entry: RunEntry) -> str:
    s = entry.summary
    line = f"[{entry.name}] ok {s.completed}, failed {s.failed}"
    if s.completed:
        line += (f", {s.output_throughput:.1f} out tok/s, TTFT p50 {s.ttft.p50 * 1e3:.0f} ms, "
                 f"E2E p50 {s.e2e.p50:.2f} s")
    errors = sorted({r.error for r in entry.result.records if r.error})
    if errors:
        line += f"; errors: {'; '.join(errors[:3])}"
    return line


def run_bench(cfg: BenchConfig) -> int:
    """Run everything, writing the report after each run. Exit code: 0 ok; 1 if a target was
    unreachable (skipped) or a run had no successful request; 2 if nothing ran; 130 if
    interrupted (the partial report is still written)."""
    needs_engine = any(t.in_process for t in cfg.targets)
    engines = _Engines(cfg.engine_config) if needs_engine else None
    prompts = _prompt_factory(cfg, engines)
    loads = {rate: _load(cfg, prompts, rate) for rate in cfg.rates}
    ctx = _context(cfg, [{"rate": rate, "mode": mode} for rate, (_, mode) in loads.items()])
    entries: list[RunEntry] = []
    skipped: set[str] = set()
    try:
        interrupted = _run_all(cfg, ctx, engines, loads, entries, skipped)
    except KeyboardInterrupt:  # outside a run's own handling: loading, warm-up, between runs
        interrupted = True
    return _finish(cfg, ctx, entries, interrupted or bool(skipped), interrupted)


def _run_all(cfg: BenchConfig, ctx: Context, engines: _Engines | None,
             loads: dict[float | None, tuple[Load, str]], entries: list[RunEntry],
             skipped: set[str]) -> bool:
    """Run the schedule, appending to ``entries``; True if a run was interrupted."""
    for rnd, rate, target in _schedule(cfg, skipped):
        try:
            result = _run_one(cfg, target, loads[rate][0], target.label, engines)
        except Exception as exc:  # one dead target must not sink a long comparison
            if not isinstance(exc, TargetUnavailable):
                traceback.print_exc()
            skipped.add(target.label)
            ctx.notes.append(f"target {target.label} skipped: {exc}")
            print(f"warning: target {target.label} skipped: {exc}", file=sys.stderr, flush=True)
            continue
        result.rate, result.round = rate, rnd
        entry = make_entry(result, run_name(result, len(cfg.rates) > 1, cfg.rounds > 1), cfg.slo)
        entries.append(entry)
        write_run(cfg.output_dir, entry)
        write_summary(cfg.output_dir, ctx, entries, [])
        print(_one_line(entry), file=sys.stderr, flush=True)
        if result.interrupted:
            return True
    return False


def _schedule(cfg: BenchConfig, skipped: set[str]) -> Iterator[tuple[int, float | None, Target]]:
    """(round, rate, target) in run order; targets in ``skipped`` (filled by the caller as
    it goes) are left out from then on."""
    for rnd in range(cfg.rounds):
        order = cfg.targets if rnd % 2 == 0 else tuple(reversed(cfg.targets))
        for rate in cfg.rates:
            for target in order:
                if target.label not in skipped:
                    yield rnd, rate, target


def _finish(cfg: BenchConfig, ctx: Context, entries: list[RunEntry], degraded: bool,
            interrupted: bool) -> int:
    if not entries:
        print("error: no run completed; nothing to report", file=sys.stderr)
        return 2
    if interrupted:
        ctx.notes.append("interrupted with Ctrl-C: partial results")
    plots: list[str] = []
    if cfg.plots:
        from alignedserve.bench.plots import write_plots

        try:
            plots = write_plots(cfg.output_dir, entries)
        except Exception as exc:  # a plotting problem must not cost the measured data
            traceback.print_exc()
            ctx.notes.append(f"plots failed: {exc}")
    text = write_summary(cfg.output_dir, ctx, entries, plots)
    results = text.split("## Results", 1)[-1].split("## Plots", 1)[0]
    print("## Results" + results.rstrip())
    print(f"\nreport: {cfg.output_dir / 'report.md'}")
    if interrupted:
        return 130
    return 1 if degraded or any(e.summary.completed == 0 for e in entries) else 0

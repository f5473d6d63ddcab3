"""``alignedserve calibrate``: fit the ``cpu-local`` hardware profile from the real engine.

1. **Measure.** Load the engine once and warm it up; run short in-process batches of fixed
   shapes (prefill-only, and decode batches of several sizes and prompt lengths) ``--repeats``
   times, timing every ``engine.step()``, recording its plan's shape, and keeping per step
   the fastest repeat. Time large tensor reads and copies for the memory and copy bandwidths.
2. **Fit.** Model a step as the simulator prices it on a CPU:
   ``step_s = overhead + per_row * rows + linear(R) + prefill_attn_flops / R_attn +
   decode_kv_bytes / B_attn``, where ``linear(R)`` is the cost model's roofline (linear
   layers, LM head, sampling) with GEMM rate ``R`` and the measured bandwidth. ``R`` is
   grid-searched; for each value the other four coefficients are a non-negative least-squares
   fit weighted by 1/step_s (relative errors count, so small steps matter as much as big ones).
3. **Write** the profile JSON (device, host link, host, plus the fit and its residuals).
4. **Validate** on held-out workloads (shapes and a policy not used in the fit): each runs
   through the benchmark tool's in-process driver on the real engine (best of ``--repeats``)
   and through the simulator with the new profile; throughput and p50 latency errors are
   reported.

The CPU engine computes decode attention for all rows in one call, one sequence per work
item, so the profile is meant for ``--attention-kernel per-seq --attention-launch grouped``
(recorded in the JSON under ``simulate_with``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from alignedserve.sim.costmodel import CostModel
from alignedserve.sim.hardware import (CPU_LOCAL_PATH, DeviceProfile, HostProfile, LinkProfile,
                                       NodeProfile, profile_to_json)
from alignedserve.sim.models import ModelProfile

SIMULATE_WITH: Mapping[str, str] = MappingProxyType(
    {"attention_kernel": "per-seq", "attention_launch": "grouped"})
# the same, as SimConfig fields
SIMULATE_WITH_CFG: Mapping[str, str] = MappingProxyType({"kernel": "per-seq", "launch": "grouped"})
# (requests, prompt length, output length) per fit shape; prefill-only shapes have output 1.
FIT_SHAPES = ((1, 1024, 1), (2, 512, 1), (1, 200, 1), (1, 64, 12), (8, 256, 10),
              (24, 512, 8), (48, 128, 8), (64, 32, 8), (16, 2048, 6))
QUICK_SHAPES = ((1, 96, 1), (1, 16, 6), (4, 48, 5), (8, 24, 5))
WARMUP = ((1, 8, 2), (6, 700, 2))
WARMUP_QUICK = ((1, 8, 2),)
# Held out: workload spec, requests, policy.
VALIDATION = (("synthetic:varied:in=32-1536,out=24", 16, "fcfs"),
              ("synthetic:uniform:in=64-512,out=32", 24, "aligned"),
              ("synthetic:varied:in=64-3072,out=16", 32, "fcfs"))
QUICK_VALIDATION = (("synthetic:varied:in=8-64,out=4", 4, "fcfs"),
                    ("synthetic:uniform:in=8-32,out=5", 6, "aligned"))


@dataclass(frozen=True, slots=True)
class StepShape:
    """One measured engine step: its plan's shape and how long ``engine.step()`` took."""

    chunks: tuple[tuple[int, int], ...]  # prefill (start, num_tokens)
    decode: tuple[int, ...]  # KV length of each decode row
    sampled: int  # rows that sample (decode rows + completing prefill chunks)
    wall_s: float


@dataclass(frozen=True, slots=True)
class Fit:
    gemm_flops: float
    attn_flops: float
    attn_bw: float
    step_overhead_s: float
    per_row_s: float
    median_rel_error: float
    p90_rel_error: float


# ---- measuring ----------------------------------------------------------------------------
class _PlanTap:
    """Wraps one engine's ``executor.execute`` to record the shape of each plan it runs."""

    def __init__(self, engine: Any):
        self._inner = engine.executor.execute
        engine.executor.execute = self
        self.shape: tuple | None = None

    def detach(self, engine: Any) -> None:
        engine.executor.execute = self._inner

    def __call__(self, plan: Any) -> Any:
        decode = tuple(r.num_tokens for r in plan.decode_requests)
        chunks = tuple((c.start, c.num_tokens) for c in plan.prefills)
        self.shape = (chunks, decode, len(decode) + sum(c.sample for c in plan.prefills))
        return self._inner(plan)


def measure_steps(engine: Any, shapes: tuple[tuple[int, int, int], ...],
                  repeats: int = 1) -> list[StepShape]:
    """Run each shape ``repeats`` times; keep, step by step, the fastest of the repeats.

    The scheduler is deterministic, so every repeat of a shape runs the same plans; the
    minimum filters out steps slowed by other processes on a shared machine (with two
    cores, one busy neighbour can stall a multi-threaded step many times over).
    """
    best: list[StepShape] = []
    for k, shape in enumerate(shapes):
        runs = [_run_shape(engine, shape, f"cal-{k}-{rep}") for rep in range(repeats)]
        for steps in zip(*runs):
            if all(s.chunks == steps[0].chunks and s.decode == steps[0].decode for s in steps):
                best.append(min(steps, key=lambda s: s.wall_s))
    return best


def _run_shape(engine: Any, shape: tuple[int, int, int], tag: str) -> list[StepShape]:
    from alignedserve.sampling_params import SamplingParams

    n, prompt, gen = shape
    tap = _PlanTap(engine)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=gen, min_tokens=gen, ignore_eos=True, temperature=0.0)
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [(7 + 31 * (i + j)) % (vocab - 10) + 5
                                          for j in range(prompt)], params)
    out: list[StepShape] = []
    while engine.has_unfinished():
        tap.shape = None
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        if tap.shape is not None and (tap.shape[0] or tap.shape[1]):
            out.append(StepShape(*tap.shape, wall))
    tap.detach(engine)
    return out


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(read bytes/s, copy bytes/s moved) of large float32 tensors, best of ``repeats``."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read = copy = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        read = min(read, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        copy = min(copy, time.perf_counter() - t)
    return nbytes / read, nbytes / copy


# ---- fitting -------------------------------------------------------------------------------
def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set, few columns)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def _unit_device(flops: float, bw: float) -> DeviceProfile:
    return DeviceProfile("fit", flops, bw, 1.0, 1, gemm_efficiency=1.0, mem_efficiency=1.0,
                         attn_efficiency=1.0, attn_flops_efficiency=1.0, kernel_launch_s=0.0)


def _design(steps: list[StepShape], model: ModelProfile) -> np.ndarray:
    rows, pa, kv = [], [], []
    for s in steps:
        rows.append(len(s.decode) + len(s.chunks))
        pairs = sum(n * st + n * (n + 1) // 2 for st, n in s.chunks)
        pa.append(pairs * model.attn_flops_per_pair_layer * model.num_layers)
        kv.append(sum(s.decode) * model.kv_bytes_per_token)
    return np.column_stack([np.ones(len(steps)), rows, pa, kv]).astype(float)


def _known(steps: list[StepShape], model: ModelProfile, flops: float, bw: float) -> np.ndarray:
    cm = CostModel(model, _unit_device(flops, bw), HostProfile("fit", 1.0, 0.0, 0.0, 0.0))
    return np.array([cm.linear_s(sum(n for _, n in s.chunks) + len(s.decode))
                     + cm.lm_head_s(s.sampled) + cm.sample_s(s.sampled) for s in steps])


def fit_steps(steps: list[StepShape], model: ModelProfile, bw: float) -> Fit:
    """Grid-search the GEMM rate; non-negative least squares for the rest (see module doc)."""
    if len(steps) < 6:
        raise ValueError(f"only {len(steps)} steps measured: too few to fit")
    t = np.array([s.wall_s for s in steps])
    x = _design(steps, model)
    w = 1.0 / t
    best: tuple[float, float, np.ndarray] | None = None
    for flops in np.logspace(9, 13.5, 181):
        y = t - _known(steps, model, flops, bw)
        coef = _nnls(x * w[:, None], y * w)
        err = float(np.sum(((x @ coef - y) * w) ** 2))
        if best is None or err < best[0]:
            best = (err, float(flops), coef)
    assert best is not None
    _, flops, (c0, c_row, a_pa, b_kv) = best
    pred = _known(steps, model, flops, bw) + x @ best[2]
    rel = np.abs(pred - t) / t
    return Fit(flops, 1 / a_pa if a_pa > 0 else flops, 1 / b_kv if b_kv > 0 else bw,
               float(c0), float(c_row), float(np.median(rel)), float(np.percentile(rel, 90)))


def profile_from_fit(fit: Fit, read_bw: float, copy_bw: float, ncores: int,
                     ram_bytes: float) -> NodeProfile:
    """The fitted rates as a profile; peaks are the larger rate so efficiencies stay <= 1."""
    peak, mem = max(fit.gemm_flops, fit.attn_flops), max(read_bw, fit.attn_bw)
    device = DeviceProfile(
        "cpu-local", peak, mem, ram_bytes, max(1, ncores), gemm_efficiency=fit.gemm_flops / peak,
        mem_efficiency=read_bw / mem, attn_efficiency=fit.attn_bw / mem,
        attn_flops_efficiency=fit.attn_flops / peak, unit_burst=1.0, kernel_launch_s=0.0)
    host = HostProfile("cpu-local", ram_bytes, fit.step_overhead_s, fit.per_row_s, 0.0)
    link = LinkProfile("memcpy", copy_bw, latency_s=0.0, efficiency=1.0)
    return NodeProfile("cpu-local", device, 1, link, link, host, single_copy_queue=True,
                       attention_kernel=SIMULATE_WITH["attention_kernel"],
                       attention_launch=SIMULATE_WITH["attention_launch"])


# ---- validation ----------------------------------------------------------------------------
def _measure_case(make_engine: Any, workload: Any, policy: str,
                  repeats: int) -> tuple[Any, list[float], Any]:
    """Run ``workload`` (all at t=0) on fresh engines ``repeats`` times through the benchmark
    tool's in-process driver; return (fastest run's Summary, every run's duration, the engine
    config). Best of N, for the reason given in ``measure_steps``."""
    from alignedserve.bench.inprocess import run_inprocess
    from alignedserve.bench.load import Load
    from alignedserve.bench.metrics import summarize
    from alignedserve.bench.openai_stream import RequestOptions
    from alignedserve.bench.prompts import PromptFactory, TokenSpace

    best, durations, config = None, [], None
    offsets = tuple([0.0] * len(workload.requests))
    for _ in range(repeats):
        engine = make_engine(policy)
        try:
            config = engine.config
            eos = frozenset(engine.loaded.eos_token_ids) | frozenset(range(4))
            space = TokenSpace(engine.loaded.config.vocab_size, eos)
            load = Load(workload.requests, offsets, PromptFactory(space, 11), RequestOptions())
            run = summarize(run_inprocess(engine, load, policy, f"policy:{policy}", False).records)
        finally:
            engine.close()
        durations.append(run.duration_s)
        best = run if best is None or run.duration_s < best.duration_s else best
    return best, durations, config


def validate(make_engine: Any, node: NodeProfile, model: ModelProfile,
             cases: tuple[tuple[str, int, str], ...], repeats: int = 1) -> list[dict[str, Any]]:
    """Run each held-out case on the real engine (best of ``repeats``) and in the simulator."""
    from alignedserve.bench.metrics import summarize
    from alignedserve.bench.workloads import synthetic
    from alignedserve.sim.config import SimConfig
    from alignedserve.sim.runner import simulate

    rows = []
    for spec, n, policy in cases:
        workload = synthetic(spec, n, seed=11)
        real, durations, config = _measure_case(make_engine, workload, policy, repeats)
        cache = config.cache
        cfg = SimConfig(model, replace(node, num_devices=cache.num_devices), **SIMULATE_WITH_CFG,
                        scheduler=config.scheduler, device_kv_gb=cache.device_kv_gb,
                        host_kv_gb=cache.host_kv_gb, prefetch_link_tokens=0)
        sim = summarize(simulate(workload, [0.0] * n, policy, cfg).records)
        row: dict[str, Any] = {"workload": spec, "requests": n, "policy": policy,
                               "measured_durations_s": durations}
        for name, get in (("output_tok_s", lambda s: s.output_throughput),
                          ("ttft_p50_s", lambda s: s.ttft.p50), ("e2e_p50_s", lambda s: s.e2e.p50)):
            r, s = get(real), get(sim)
            row[name] = {"measured": r, "simulated": s, "error": (s - r) / r if r else math.nan}
        rows.append(row)
    return rows


# ---- the command -------------------------------------------------------------------------------
def _engine_factory(model: str | None, threads: int | None) -> tuple[Any, Any]:
    from alignedserve.config import EngineConfig
    from alignedserve.engine import LLMEngine

    config = EngineConfig(model=model, num_threads=threads, policy="fcfs", seed=0)
    first = LLMEngine(config)
    loaded = first.loaded

    def make(policy: str) -> Any:
        return LLMEngine(replace(config, policy=policy), loaded)

    return first, make


def _ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 8.0 * (1 << 30)


def run_calibrate(args: argparse.Namespace) -> int:
    from alignedserve.bench.runner import machine_info

    engine, make_engine = _engine_factory(args.model, args.num_threads)
    model = ModelProfile.from_config(args.model or "default-model", engine.loaded.config,
                                     engine.dtype.itemsize)
    repeats = 1 if args.quick else args.repeats
    measure_steps(engine, WARMUP_QUICK if args.quick else WARMUP)  # kernels built, caches warm
    steps = measure_steps(engine, QUICK_SHAPES if args.quick else FIT_SHAPES, repeats)
    engine.close()
    read_bw, copy_bw = measure_bandwidth(64 if args.quick else 512)
    fit = fit_steps(steps, model, read_bw)
    node = profile_from_fit(fit, read_bw, copy_bw, os.cpu_count() or 1, _ram_bytes())
    extra: dict[str, Any] = {"calibration": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": asdict(model), "steps_measured": len(steps),
        "bandwidth": {"read_bytes_s": read_bw, "copy_bytes_s": copy_bw}, "fit": asdict(fit)},
        "simulate_with": dict(SIMULATE_WITH)}
    path = Path(args.output or CPU_LOCAL_PATH)
    _write(path, profile_to_json(node, extra))
    print(_fit_text(fit, read_bw, copy_bw, len(steps), path))
    if not args.skip_validation:
        rows = validate(make_engine, node, model, QUICK_VALIDATION if args.quick else VALIDATION,
                        repeats)
        extra["calibration"]["validation"] = rows
        _write(path, profile_to_json(node, extra))
        print(validation_table(rows))
    return 0


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _fit_text(fit: Fit, read_bw: float, copy_bw: float, n: int, path: Path) -> str:
    return (f"fitted on {n} engine steps (median |error| {fit.median_rel_error:.1%}, "
            f"p90 {fit.p90_rel_error:.1%}):\n"
            f"  linear-layer GEMM rate  {fit.gemm_flops / 1e9:8.1f} GFLOP/s\n"
            f"  prefill attention       {fit.attn_flops / 1e9:8.1f} GFLOP/s\n"
            f"  decode attention        {fit.attn_bw / 1e9:8.2f} GB/s of KV\n"
            f"  memory read / copy      {read_bw / 1e9:8.1f} / {copy_bw / 1e9:.1f} GB/s\n"
            f"  per-step overhead       {fit.step_overhead_s * 1e3:8.2f} ms "
            f"(+{fit.per_row_s * 1e6:.0f} us per row)\n"
            f"profile written to {path}")


def validation_table(rows: list[dict[str, Any]]) -> str:
    header = "| held-out workload | policy | metric | measured | simulated | error |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        for metric in ("output_tok_s", "ttft_p50_s", "e2e_p50_s"):
            m = r[metric]
            lines.append(f"| {r['workload']} x{r['requests']} | {r['policy']} | {metric} | "
                         f"{m['measured']:.3g} | {m['simulated']:.3g} | {m['error']:+.1%} |")
    return "\n".join(lines)

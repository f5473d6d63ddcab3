"""Where an in-process run's wall time goes: prefill-only, mixed and decode-only steps.

Runs one synthetic workload through ``LLMEngine.step`` (no server, no client) and sums each
kind of step's wall time; for decode-only steps with all rows present it reports the mean
step time and KV tokens read. Engine options are ``key=value`` (EngineConfig, SchedulerConfig
and CacheConfig fields; 0/1 for booleans), e.g.

    python benchmarks/step_breakdown.py --workload varied kv_cache_dtype=fp8_e5m2
    python benchmarks/step_breakdown.py --workload uniform policy=fcfs max_num_batched_tokens=2048
    python benchmarks/step_breakdown.py --workload varied tiled_layout=0

The KV budget is faulted in before the first step (``preallocate_kv=1``, as ``serve`` runs):
otherwise the first writes into fresh cache memory take page faults inside the prefill steps
(on this VM they made a uniform prefill chunk's cache writes ~25x slower); pass
``preallocate_kv=0`` to see the offline default.

Per step kind it prints the steps' wall time, the part inside the forward pass, and the rest
(scheduling, KV bookkeeping and copies, detokenizing), so policies can be compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from alignedserve.bench.workloads import synthetic
from alignedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.sampling_params import SamplingParams

WORKLOADS = {
    "varied": "synthetic:varied:in=64-3072,out=256",
    "uniform": "synthetic:fixed:in=512,out=256",
}


def engine_config(options: list[str]) -> EngineConfig:
    """EngineConfig from ``key=value`` strings (scheduler and cache fields go to their configs)."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    engine_kw: dict = {"dtype": "bfloat16", "num_threads": 2}
    sched_kw: dict = {}
    cache_kw: dict = {"preallocate_kv": True}
    for option in options:
        key, _, text = option.partition("=")
        value = int(text) if text.lstrip("-").isdigit() else text
        if key in sched_fields:
            sched_kw[key] = value
        elif key in cache_fields:
            cache_kw[key] = value
        elif key in engine_fields:
            engine_kw[key] = value
        else:
            raise SystemExit(f"unknown option {key!r}")
    return EngineConfig(**engine_kw, scheduler=SchedulerConfig(**sched_kw),
                        cache=CacheConfig(**cache_kw))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="varied")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("options", nargs="*", help="engine options, key=value")
    args = parser.parse_args()
    engine = LLMEngine(engine_config(args.options))
    workload = synthetic(WORKLOADS[args.workload], args.num_requests, args.seed)
    rng = np.random.default_rng(args.seed)
    for spec in workload.requests:
        prompt = rng.integers(100, 40000, spec.prompt_len).tolist()
        engine.add_request(str(spec.index), prompt, SamplingParams(
            temperature=0.0, max_tokens=spec.output_len, ignore_eos=True))
    # kind -> [steps, wall s, forward-pass s, copy-wait s, copied bytes]
    totals = {k: [0, 0.0, 0.0, 0.0, 0] for k in ("prefill", "mixed", "decode")}
    full_steps: list[tuple[float, int]] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        rec = engine.stats.window[-1]
        kind = "decode" if not rec.prefill_tokens else "mixed" if rec.decode_rows else "prefill"
        for i, value in enumerate((1, dt, rec.compute_s, rec.copy_wait_s, rec.copy_bytes)):
            totals[kind][i] += value
        if kind == "decode" and rec.decode_rows == args.num_requests:
            full_steps.append((dt, sum(b.kv_tokens for b in rec.batches)))
    wall = time.perf_counter() - start
    engine.close()
    outputs = sum(r.output_len for r in workload.requests)
    print(f"{args.workload} {' '.join(args.options)}: wall {wall:.1f} s, "
          f"{outputs / wall:.1f} output tok/s")
    for kind, (steps, seconds, forward, copy_wait, copied) in totals.items():
        # "other": the step outside the forward pass (scheduling, KV bookkeeping and copies,
        # detokenizing, stats)
        print(f"  {kind:8s} steps {steps:5d}  {seconds:6.1f} s  (forward {forward:6.1f} s, "
              f"other {seconds - forward:5.2f} s, copy wait {copy_wait:5.2f} s, "
              f"copied {copied / 2**20:7.1f} MiB)")
    if full_steps:
        print(f"  full decode steps ({args.num_requests} rows): {len(full_steps)}, mean "
              f"{1e3 * statistics.mean(d for d, _ in full_steps):.1f} ms, mean KV tokens "
              f"{statistics.mean(k for _, k in full_steps):.0f}")


if __name__ == "__main__":
    main()

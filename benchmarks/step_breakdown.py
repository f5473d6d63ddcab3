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
(scheduling, KV bookkeeping and copies, detokenizing), so policies can be compared. With
``--parts`` it also times every kernel-layer call (each linear shape, attention and, inside
it, the prefill kernel, the decode kernel and the cache writes, the norms, RoPE, sampling)
and prints ms per step of each kind; the wrappers add about a microsecond a call.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

import numpy as np

from alignedserve.bench.workloads import synthetic
from alignedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.executor.attention import StepAttention
from alignedserve.kernels.dispatch import Kernels
from alignedserve.kernels.linear import PackedLinear
from alignedserve.model.sampler import Sampler
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


def add_workload(engine: LLMEngine, name: str, num_requests: int, seed: int) -> int:
    """Submit workload ``name`` (random token-id prompts, greedy, exact output lengths) to
    ``engine``, all at once; returns the output tokens it will produce."""
    workload = synthetic(WORKLOADS[name], num_requests, seed)
    rng = np.random.default_rng(seed)
    for spec in workload.requests:
        prompt = rng.integers(100, 40000, spec.prompt_len).tolist()
        engine.add_request(str(spec.index), prompt, SamplingParams(
            temperature=0.0, max_tokens=spec.output_len, ignore_eos=True))
    return sum(r.output_len for r in workload.requests)


KINDS = ("prefill", "mixed", "decode")


class PartTimer:
    """Seconds per (step kind, part) of the engine's kernel-layer calls, through wrapped
    methods. Parts nest (``attention`` contains the prefill and decode kernels and the cache
    writes), so they do not add up to the step."""

    def __init__(self) -> None:
        self.step = collections.Counter()  # part -> seconds, in the current step
        self.totals = {kind: collections.Counter() for kind in KINDS}

    def wrap(self, owner: type, name: str, label) -> None:
        """Time ``owner.name`` under ``label`` (a string, or a function of the call's args)."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                part = label(args) if callable(label) else label
                self.step[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def end_step(self, kind: str) -> None:
        self.totals[kind].update(self.step)
        self.step.clear()

    @classmethod
    def installed(cls) -> PartTimer:
        """A timer wrapped around every kernel-layer call the forward pass makes."""
        timer = cls()

        def shape(args) -> str:  # a linear's weight shape, out x in features
            return f"{args[0].out_features}x{args[0].in_features}"

        timer.wrap(PackedLinear, "forward", lambda args: f"linear {shape(args)}")
        timer.wrap(PackedLinear, "silu_mul", lambda args: f"linear+SiLU {shape(args)}")
        timer.wrap(PackedLinear, "rotary", lambda args: f"linear+RoPE {shape(args)}")
        timer.wrap(PackedLinear, "argmax", lambda args: f"linear+argmax {shape(args)}")
        for name in ("rms_norm", "add_rms_norm", "rotary_qkv", "argmax_rows", "write_tiled",
                     "prefill_attention", "decode_attention"):
            timer.wrap(Kernels, name, name)
        timer.wrap(StepAttention, "__call__", "attention (all)")
        timer.wrap(Sampler, "__call__", "sampler")
        return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="varied")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", action="store_true",
                        help="also time each kernel-layer call per step kind")
    parser.add_argument("options", nargs="*", help="engine options, key=value")
    args = parser.parse_args()
    timer = PartTimer.installed() if args.parts else None
    engine = LLMEngine(engine_config(args.options))
    outputs = add_workload(engine, args.workload, args.num_requests, args.seed)
    # kind -> [steps, wall s, forward-pass s, copy-wait s, copied bytes]
    totals = {k: [0, 0.0, 0.0, 0.0, 0] for k in KINDS}
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
        if timer is not None:
            timer.end_step(kind)
        if kind == "decode" and rec.decode_rows == args.num_requests:
            full_steps.append((dt, sum(b.kv_tokens for b in rec.batches)))
    wall = time.perf_counter() - start
    engine.close()
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
    if timer is not None:
        for kind in KINDS:
            steps = totals[kind][0]
            if steps:
                print(f"  {kind} steps, ms per step:")
                for part, seconds in timer.totals[kind].most_common():
                    print(f"    {part:28s} {1e3 * seconds / steps:9.2f}")


if __name__ == "__main__":
    main()

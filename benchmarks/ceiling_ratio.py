"""Output tok/s as a share of the roofline ceiling, both measured in one process, in turns.

On a shared VM one measurement of the ceiling's rates moves 10-20% within minutes, so a
ratio between an engine run and a ceiling measured at another time, in another process,
carries that error. This tool alternates, in one process:

    rates 0, run 1, rates 1, run 2, rates 2, ...

where ``rates`` is ``roofline.measure`` (read bandwidth, linears, prefill attention) and a
run submits the whole workload to one `LLMEngine` at once and steps it to the end (as
``step_breakdown.py`` does; the KV budget faulted in first, as ``serve`` runs). Run i is
priced at the better of each rate measured just before and just after it
(``roofline.best_rates``: a slow phase in one measurement must not raise the run's share),
and all runs together at the medians of every measurement. The engine is built once, so
every run after the first finds it warm.

Usage: python benchmarks/ceiling_ratio.py [--workload uniform varied] [--rounds 3]
       [key=value engine options, as for step_breakdown.py]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from alignedserve.engine import LLMEngine
from roofline import WORKLOADS, best_rates, measure, median_rates, price
from step_breakdown import add_workload, engine_config


def run_once(engine: LLMEngine, workload: str, num_requests: int, seed: int) -> float:
    """Output tok/s of one whole run of ``workload`` through ``engine``."""
    outputs = add_workload(engine, workload, num_requests, seed)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return outputs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), nargs="+",
                        default=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3, help="engine runs per workload")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("options", nargs="*", help="engine options, key=value")
    args = parser.parse_args()
    config = engine_config(args.options)
    engine = LLMEngine(config)  # sets torch's thread count from the config
    kernels, c = engine.kernels, engine.loaded.config  # the rates are the engine's own path's
    print(f"kernel path {kernels.path}, {torch.get_num_threads()} threads")

    rates = [measure(c, kernels, args.num_requests)]
    print(f"rates 0: {rates[-1]}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {w: [] for w in args.workload}
    for i in range(1, args.rounds + 1):
        for name in args.workload:
            tok_s = run_once(engine, name, args.num_requests, args.seed)
            rates.append(measure(c, kernels, args.num_requests))
            around = best_rates(rates[-2:])
            ceiling = price(c, around, WORKLOADS[name], args.num_requests, args.seed).ceiling
            results[name].append((tok_s, ceiling))
            print(f"{name} run {i}: {tok_s:.1f} output tok/s; ceiling around it {ceiling:.0f}; "
                  f"share {tok_s / ceiling:.3f}", flush=True)
            print(f"rates {len(rates) - 1}: {rates[-1]}", flush=True)
    engine.close()

    everything = median_rates(rates)
    print(f"medians of all {len(rates)} measurements: {everything}")
    for name, runs in results.items():
        ceiling = price(c, everything, WORKLOADS[name], args.num_requests, args.seed).ceiling
        speeds = [tok_s for tok_s, _ in runs]
        ratios = [tok_s / around for tok_s, around in runs]
        print(f"{name}: runs {', '.join(f'{s:.1f}' for s in speeds)} output tok/s; share of "
              f"the ceiling around each run {', '.join(f'{r:.3f}' for r in ratios)} (median "
              f"{statistics.median(ratios):.3f}); median run / ceiling at the medians of all "
              f"measurements ({ceiling:.0f}): {statistics.median(speeds) / ceiling:.3f}")


if __name__ == "__main__":
    main()

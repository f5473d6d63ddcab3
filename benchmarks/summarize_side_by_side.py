"""Markdown tables of a side-by-side run (output of run_side_by_side.sh), ratios against vLLM.

    python benchmarks/summarize_side_by_side.py RUN_DIR [--baseline vllm]
"""

import argparse
import json
from pathlib import Path

ORDER = ("aligned", "aligned-fp8", "fcfs", "static", "vllm", "vllm-fp8", "llamacpp")


def row(target: str, run: dict, base: dict | None) -> str:
    m = run["metrics"]
    tput = m["output_throughput"]
    ratio = f"{tput / base['metrics']['output_throughput']:.2f}×" if base else "-"
    bubble = (run.get("engine_stats") or {}).get("bubble_fraction")
    cells = [target, f"{m['completed']} / {m['failed']}", f"{tput:.1f}", ratio,
             f"{m['ttft']['p50']:.2f} / {m['ttft']['p99']:.2f}",
             f"{1e3 * m['tpot']['p50']:.0f} / {1e3 * m['tpot']['p99']:.0f}",
             f"{m['e2e']['p50']:.2f} / {m['e2e']['p99']:.2f}",
             f"{run['count_mismatches']}", "-" if bubble is None else f"{100 * bubble:.2f}%"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--baseline", default="vllm")
    args = parser.parse_args()
    for workload in sorted(p for p in args.run_dir.iterdir() if p.is_dir()):
        runs = {}
        for target in workload.iterdir():
            summary = target / "summary.json"
            if summary.is_file():
                runs[target.name] = json.loads(summary.read_text())["runs"][0]
        if not runs:
            continue
        base = runs.get(args.baseline)
        print(f"\n**{workload.name}**\n")
        print("| engine | ok / failed | out tok/s | vs " + args.baseline + " | TTFT p50 / p99 s | "
              "TPOT p50 / p99 ms | E2E p50 / p99 s | count mismatches | bubble |")
        print("|---|---|---|---|---|---|---|---|---|")
        for target in sorted(runs, key=lambda t: ORDER.index(t) if t in ORDER else len(ORDER)):
            print(row(target, runs[target], base))


if __name__ == "__main__":
    main()

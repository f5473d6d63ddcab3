"""What the vLLM plug-in changes in vLLM's own scheduler, counted step by step (no timing).

Runs ``tests/vllm_harness.py`` (vLLM's ``Scheduler`` / ``AsyncScheduler`` in-process, a stand-in
model, no server) over fixed synthetic workloads with and without the plug-in and its
admission lever, and prints one markdown row per (workload, variant): steps to finish, decode
rows and length groups per decode step, the bubble a padded kernel would have over the whole
batch and per group, the share of admissions whose prompt fit a running group, admissions out
of arrival order, the longest and mean wait for admission (steps), the mean churn of the
scheduled set per step (requests entering or leaving it: what vLLM's persistent input batch
adds and removes), how often a request left it and came back, the share of steps that used
the whole token budget, and preemptions. Deterministic: the same command prints the same
table.

    python benchmarks/vllm_plugin_counts.py                 # every workload and variant
    python benchmarks/vllm_plugin_counts.py --workload queued --variant vanilla,lever-64
    python benchmarks/vllm_plugin_counts.py --workload budget,budget-kv,roomy \
        --variant vanilla,plugin,vanilla-async,plugin-async

Needs vLLM's venv (``scripts/setup_vllm.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.vllm_harness import mixed_requests, summary  # noqa: E402  (ROOT, just added)

TOLERANCE = 32
# name -> (requests, seed, arrivals over steps, scheduler limits)
WORKLOADS: dict[str, tuple[int, int, int, dict[str, int]]] = {
    # 12 running slots for ~1.3 arrivals per step: a queue forms in front of admission
    "queued": (80, 4, 60, {"max_num_seqs": 12}),
    "queued-deep": (120, 5, 60, {"max_num_seqs": 12}),
    # prefill chunks and decode rows compete for a 256-token step budget
    "budget": (160, 6, 120, {"max_num_seqs": 64, "max_num_batched_tokens": 256}),
    # the same with KV for 3,200 tokens: vLLM preempts too
    "budget-kv": (160, 6, 120, {"max_num_seqs": 64, "max_num_batched_tokens": 256,
                                "num_blocks": 200}),
    # roomy: only admissions and finishes change the scheduled set
    "roomy": (160, 6, 120, {"max_num_seqs": 64}),
}
# name -> (scheduler, plug-in environment beyond the tolerance)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "vanilla": ("vanilla", {}),
    "plugin": ("plugin", {}),
    "vanilla-async": ("vanilla-async", {}),
    "plugin-async": ("plugin-async", {}),
    **{f"lever-{w}": ("plugin", {"ALIGNEDSERVE_VLLM_ALIGNED_ADMISSION": "1",
                                 "ALIGNEDSERVE_VLLM_MAX_ADMIT_WAIT": str(w)})
       for w in (20, 40, 64, 100000)},
}
COLUMNS = ("steps", "rows", "groups", "bubble", "group_bubble", "fitting_share",
           "out_of_order", "max_wait", "mean_wait", "churn", "rejoins", "budget_bound",
           "preemptions")


def run_all(cells: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Harness results for (workload, variant) cells, in one vLLM process."""
    runs = []
    for workload, variant in cells:
        count, seed, over, limits = WORKLOADS[workload]
        scheduler, env = VARIANTS[variant]
        runs.append({"scheduler": scheduler, "requests": mixed_requests(count, seed, over),
                     **limits, "env": {"ALIGNEDSERVE_ALIGN_TOLERANCE": str(TOLERANCE), **env}})
    python = subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm.sh")], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"runs": runs}))
        subprocess.run([python, str(ROOT / "tests" / "vllm_harness.py"), str(spec), str(out)],
                       check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
        return json.loads(out.read_text())["runs"]


def _cell(value: float) -> str:
    return f"{value:.3f}" if isinstance(value, float) and value < 10 else f"{value:.4g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=",".join(WORKLOADS))
    parser.add_argument("--variant", default=",".join(VARIANTS))
    args = parser.parse_args()
    cells = [(w, v) for w in args.workload.split(",") for v in args.variant.split(",")]
    print("| workload | variant | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for (workload, variant), run in zip(cells, run_all(cells)):
        counts = summary(run, TOLERANCE)
        print(f"| {workload} | {variant} | " +
              " | ".join(_cell(counts[c]) for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()

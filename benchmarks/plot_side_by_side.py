"""E2E latency CDFs of every engine in a side-by-side run (output of run_side_by_side.sh).

    python benchmarks/plot_side_by_side.py RUN_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(run_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for workload in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in sorted(workload.iterdir()):
            files = list(target.glob("runs/*/requests.json"))
            if not files:
                continue
            reqs = json.loads(files[0].read_text())["requests"]
            e2e = np.sort([r["end_s"] - r["sent_s"] for r in reqs if r["ok"]])
            ax.plot(e2e, np.arange(1, len(e2e) + 1) / len(e2e), label=target.name)
        ax.set_xlabel("E2E latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{workload.name}: E2E latency of every request")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / f"{workload.name}_e2e_cdf.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

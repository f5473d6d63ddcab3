"""Linear layers alone: the kernel path's packed linears on the default model's shapes, against
torch's float32 ``F.linear`` (its sgemm: the rate an fp32 engine such as vLLM in float32 gets)
on the same shapes.

    python benchmarks/linear_micro.py [--threads 2] [--path amx|avx512_bf16|avx512|avx2]
        [--rows 6 36 64 512]

For each projection of SmolLM2-135M (out x in: fused qkv 960x576, o 576x576, fused gate/up
3072x576 with the SwiGLU epilogue where the path has it, down 576x1536) and each row count it
prints the useful GFLOP/s (2 x rows x in x out per call) of both, timed alternately.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from alignedserve.kernels import select_kernels
from alignedserve.kernels.isa import PATHS
from alignedserve.kernels.linear import PackedLinear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def per_call(fn, budget_s: float = 0.2, repeats: int = 5) -> float:
    """Seconds per call: the best of ``repeats`` means over ~budget_s/repeats each (after a
    warm-up call); the best, because a shared machine only ever adds time."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / repeats / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--path", choices=PATHS, default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[6, 36, 64, 512])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = select_kernels(args.path)
    print(f"kernel path {kernels.path}, {args.threads} threads; GFLOP/s ours | torch fp32")
    gen = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        swiglu = name == "gate_up"
        layer = PackedLinear(weight.bfloat16(), None, kernels, swiglu=swiglu)
        ours = layer.silu_mul if swiglu and layer.fused_swiglu else layer
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, in_features, generator=gen)
            xb = x.bfloat16()
            flop = 2 * rows * in_features * out_features
            t_ours = per_call(lambda: ours(xb))
            t_fp32 = per_call(lambda: F.linear(x, weight))
            cells.append(f"{rows} rows {flop / t_ours / 1e9:.0f} | {flop / t_fp32 / 1e9:.0f}")
        print(f"{name:8s} {out_features}x{in_features}: " + "; ".join(cells))


if __name__ == "__main__":
    main()

"""Prefill attention alone: the kernel path's prefill kernel on the default model's shapes,
against torch's SDPA on the same inputs.

    python benchmarks/prefill_micro.py [--threads 2] [--path amx|avx512_bf16|avx512|avx2]

* ``shapes``: ms per call and useful GFLOP/s (4 x head_dim x causal (query, key, head)
  pairs) for chunks of T queries after ``start`` cached keys, kernel and SDPA alternating
  (9 heads / 3 kv heads / head_dim 64; the AMX path reads a tiled bf16 cache, the others a
  token-major one, as the engine does).
* ``varied``: the varied workload's 64 prompts (log-uniform 64..3072, seed 0) cut into
  2048-token chunks, one layer; x30 is the model's prefill attention.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from alignedserve.kernels import kv_layout, reference, select_kernels
from alignedserve.kernels.isa import PATHS

HEADS, KV_HEADS, DIM, SCALE = 9, 3, 64, 0.125


def per_call(fn, budget_s: float = 0.3, repeats: int = 5) -> float:
    """Seconds per call of ``fn``: the best of ``repeats`` means over ~budget_s/repeats each
    (after one warm-up call); the best, because a shared machine only ever adds time."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, calls = time.perf_counter(), 0
        while (elapsed := time.perf_counter() - start) < budget_s / repeats or not calls:
            fn()
            calls += 1
        best = min(best, elapsed / calls)
    return best


class Setup:
    """A bf16 cache of 8k tokens in the layout the path's kernel reads, and calls over it."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.tiled = kernels.amx
        flat = torch.randn(2, KV_HEADS, 8192 + 16, DIM).bfloat16()
        self.flat = flat
        if self.tiled:
            self.cache = torch.empty_like(flat)
            kv_layout.write(self.cache[0], 0, flat[0], kv_layout.KEYS)
            kv_layout.write(self.cache[1], 0, flat[1], kv_layout.VALUES)

    def kernel(self, q: torch.Tensor, start: int):
        stop = start + q.shape[0]
        if self.tiled:
            hi = kv_layout.round_up(stop)
            k, v = self.cache[0, :, :hi], self.cache[1, :, :hi]
        else:
            k, v = self.flat[0, :, :stop], self.flat[1, :, :stop]
        return lambda: self.kernels.prefill_attention(q, k, v, start, SCALE, tiled=self.tiled)

    def sdpa(self, q: torch.Tensor, start: int):
        stop = start + q.shape[0]
        mask = reference.continuation_mask(start, q.shape[0], q.dtype, q.device)
        k, v = self.flat[0, :, :stop], self.flat[1, :, :stop]
        return lambda: reference.prefill_attention(q, k, v, SCALE, mask)


def useful_flops(start: int, tokens: int) -> float:
    """4 x head_dim x the causal (query, key, head) pairs of a chunk."""
    return 4 * DIM * HEADS * tokens * (start + (tokens + 1) / 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--path", choices=PATHS, default=None,
                        help="kernel path (default: $ALIGNEDSERVE_ISA, else the CPU's best)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = select_kernels(args.path)
    if not kernels.prefill_kernel_applies(torch.empty(1, HEADS, DIM, dtype=torch.bfloat16)):
        raise SystemExit(f"the {kernels.path} path has no prefill kernel")
    setup = Setup(kernels)
    print(f"kernel path {kernels.path}, {args.threads} threads")
    print("shapes (kernel vs SDPA, alternating):")
    for start, tokens in [(0, 16), (0, 64), (0, 256), (0, 512), (0, 1024), (0, 2048), (0, 3072),
                          (500, 16), (2000, 48), (2048, 512), (4096, 2048)]:
        q = torch.randn(tokens, HEADS, DIM).bfloat16()
        k_s, s_s = per_call(setup.kernel(q, start)), per_call(setup.sdpa(q, start))
        flops = useful_flops(start, tokens)
        print(f"  start {start:5d} T {tokens:5d}: kernel {k_s * 1e3:8.3f} ms "
              f"{flops / k_s / 1e9:6.1f} GFLOP/s   SDPA {s_s * 1e3:8.3f} ms "
              f"{flops / s_s / 1e9:6.1f} GFLOP/s   ({s_s / k_s:.2f}x)")

    rng = np.random.default_rng(0)
    lens = np.exp(rng.uniform(np.log(64), np.log(3072), 64)).astype(int)
    chunks = [(s, min(2048, int(n) - s)) for n in lens for s in range(0, int(n), 2048)]
    queries = {t: torch.randn(t, HEADS, DIM).bfloat16() for _, t in chunks}
    for name, make in (("kernel", setup.kernel), ("SDPA", setup.sdpa)):
        calls = [make(queries[t], s) for s, t in chunks]
        dt = per_call(lambda: [c() for c in calls], budget_s=2.0, repeats=3)
        print(f"varied ({name}): {len(chunks)} chunks, one layer {dt * 1e3:.1f} ms -> "
              f"x30 layers {30 * dt:.2f} s")


if __name__ == "__main__":
    main()

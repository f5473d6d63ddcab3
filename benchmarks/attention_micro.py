"""Decode-attention kernel alone: cold (DRAM) and hot (cache-resident) rates per KV dtype.

cold: 30 layers over 64 rows whose lengths follow the varied workload (log-uniform 64..3072
plus 128 decoded tokens), each row its own cache as in the engine; every call reads each
row's KV once, so the rows come from DRAM. hot: 8 rows of 1,000 tokens, one layer, called
repeatedly (~6 MB in bf16: stays in cache), i.e. the kernel's arithmetic rate.

    python benchmarks/attention_micro.py [--dtypes bfloat16 float8_e5m2] [--threads 2] [--tiled]
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

from alignedserve.executor.kernels import load_kernels

LAYERS, KV_HEADS, HEADS, DIM = 30, 3, 9, 64  # SmolLM2-135M


def time_calls(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def run(kernels, dtype: torch.dtype, lengths: list[int], layers: int, calls: int,
        tiled: bool = False) -> float:
    """Seconds per pass over ``layers`` layers of all rows."""
    rows = len(lengths)
    caches = [torch.randn(layers, 2, KV_HEADS, (n + 256) // 16 * 16, DIM).to(dtype)
              for n in lengths]
    q = torch.randn(rows, HEADS, DIM, dtype=torch.bfloat16)
    kv = torch.randn(rows, KV_HEADS, DIM, dtype=torch.bfloat16)
    pos = torch.tensor(lengths, dtype=torch.long)

    def one_pass() -> None:
        for layer in range(layers):
            kernels.decode_attention(q, kv, kv, caches, pos, layer, DIM ** -0.5, tiled)

    return time_calls(one_pass, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8_e5m2"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiled", action="store_true",
                        help="bf16 caches in the AMX tile layout (alignedserve.executor.kv_layout)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the compiled kernels are unavailable")
    rng = random.Random(0)
    varied = [int(math.exp(rng.uniform(math.log(64), math.log(3072)))) + 128 for _ in range(64)]
    for name in args.dtypes:
        dtype = getattr(torch, name)
        pairs = sum(varied) * KV_HEADS * LAYERS
        cold = run(kernels, dtype, varied, LAYERS, calls=5, tiled=args.tiled)
        hot = run(kernels, dtype, [1000] * 8, 1, calls=300, tiled=args.tiled)
        nbytes = pairs * 2 * DIM * dtype.itemsize
        print(f"{name}: cold {cold * 1e3:.1f} ms per 30 layers x 64 rows ({sum(varied)} tokens), "
              f"{nbytes / cold / 1e9:.1f} GB/s, {pairs / cold / 1e6:.0f} M (token, kv head)/s; "
              f"hot {8000 * KV_HEADS / hot / 1e6:.0f} M (token, kv head)/s")


if __name__ == "__main__":
    main()

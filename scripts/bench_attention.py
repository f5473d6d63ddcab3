"""Micro-benchmark of decode attention on CPU: the compiled kernel vs matmul reference vs SDPA.

Default case (DESIGN.md section 4): 64 rows, 9 query / 3 KV heads, head_dim 64, KV lengths
log-uniform in 64..3072 (the seed is picked so the mean is close to 867), one layer.

Two cache regimes, because this machine's last-level cache can hold one layer's KV:
  hot  - the same layer every call (KV stays in cache; an upper bound)
  cold - calls cycle over enough layers that the KV far exceeds the LLC, as in a real model
         step where every layer's KV and the weights stream through.

    .venv/bin/python scripts/bench_attention.py [--dtypes bfloat16 float32] [--iters 40]

On a shared machine compare the "min" column: other processes only ever add time, and a
2-thread OpenMP region whose second thread is descheduled waits for it (medians then jump by
milliseconds for every method alike).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from alignedserve.executor.kernels import decode_attention_reference, load_kernels  # noqa: E402


@dataclass(frozen=True, slots=True)
class Case:
    rows: int
    heads: int
    kv_heads: int
    head_dim: int
    lengths: tuple[int, ...]

    def kv_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one layer's decode attention must read."""
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(self.lengths) * self.kv_heads * self.head_dim * 2 * elem


def log_uniform_lengths(rows: int, lo: int, hi: int, target_mean: float) -> tuple[int, ...]:
    """Log-uniform lengths; among seeds 0..199 the one whose mean is closest to target."""
    best: tuple[float, tuple[int, ...]] | None = None
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(rows, generator=gen, dtype=torch.float64)
        lengths = tuple(int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))))
                        for x in u.tolist())
        gap = abs(sum(lengths) / rows - target_mean)
        if best is None or gap < best[0]:
            best = (gap, lengths)
    assert best is not None
    return best[1]


def make_inputs(case: Case, dtype: torch.dtype, layers: int):
    """Caches (capacity = length + 16) and one decode step's q/k/v at position length-1."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(layers, 2, case.kv_heads, n + 16, case.head_dim, generator=gen).to(dtype)
              for n in case.lengths]
    q = torch.randn(case.rows, case.heads, case.head_dim, generator=gen).to(dtype)
    k_new = torch.randn(case.rows, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    v_new = torch.randn_like(k_new)
    positions = torch.tensor([n - 1 for n in case.lengths], dtype=torch.int64)
    return q, k_new, v_new, caches, positions


def sdpa_per_row(q, k_new, v_new, caches, positions, layer, scale):
    """SDPA with q_len 1 per row (GQA via enable_gqa), in the cache dtype."""
    out = torch.empty_like(q)
    for b, pos in enumerate(positions.tolist()):
        cache = caches[b]
        cache[layer, 0, :, pos].copy_(k_new[b])
        cache[layer, 1, :, pos].copy_(v_new[b])
        k = cache[layer, 0, :, : pos + 1].unsqueeze(0)
        v = cache[layer, 1, :, : pos + 1].unsqueeze(0)
        qb = q[b].unsqueeze(0).unsqueeze(2).to(cache.dtype)
        o = F.scaled_dot_product_attention(qb, k, v, scale=scale, enable_gqa=True)
        out[b] = o.view(q.shape[1], q.shape[2]).to(q.dtype)
    return out


def time_ms(fn: Callable[[int], object], layers: int, iters: int) -> tuple[float, float]:
    """(min, median) wall time of fn(layer) in ms, cycling layers 0..layers-1, after warm-ups.

    The minimum is the number to compare on a shared machine: other processes only ever add
    time (an OpenMP barrier waiting on a descheduled thread adds a lot).
    """
    for i in range(2):
        fn(i % layers)
    samples = []
    for i in range(iters):
        start = time.perf_counter()
        fn(i % layers)
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples), statistics.median(samples)


def read_roofline(nbytes: int, layers: int) -> Callable[[int], object]:
    """fn(layer) that streams nbytes (a plain fp32 sum): what reading the KV alone costs."""
    buf = torch.ones(layers, nbytes // 4)
    return lambda layer: buf[layer].sum()


def bench_dtype(case: Case, dtype: torch.dtype, args: argparse.Namespace) -> list[str]:
    """Markdown rows for one dtype: every method, hot and cold."""
    kernels = load_kernels()
    scale = case.head_dim ** -0.5
    methods: dict[str, Callable] = {}
    if kernels is not None:
        methods["kernel (alignedserve)"] = kernels.decode_attention
    methods["matmul reference (fp32)"] = decode_attention_reference
    if not args.skip_sdpa:
        methods["SDPA per row"] = sdpa_per_row
    cold_layers = max(2, math.ceil(args.cold_gb * 2**30 / case.kv_bytes(dtype)))
    rows = []
    for regime, layers in (("hot", 1), ("cold", cold_layers)):
        q, k_new, v_new, caches, positions = make_inputs(case, dtype, layers)
        timed: dict[str, Callable[[int], object]] = {
            name: functools.partial(
                lambda fn, layer: fn(q, k_new, v_new, caches, positions, layer, scale), fn)
            for name, fn in methods.items()}
        timed["memory read of the same bytes (fp32 sum)"] = read_roofline(
            case.kv_bytes(dtype), layers)
        for name, fn in timed.items():
            iters = args.iters if "kernel" in name or "memory" in name else max(3, args.iters // 4)
            best, median = time_ms(fn, layers, iters)
            gbs = case.kv_bytes(dtype) / best / 1e6
            rows.append(f"| {str(dtype).removeprefix('torch.')} | {regime} | {name} | "
                        f"{best:.3f} | {median:.3f} | {gbs:.1f} |")
        del caches, timed
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=3072)
    parser.add_argument("--mean-len", type=float, default=867)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--cold-gb", type=float, default=1.5,
                        help="KV footprint the cold regime cycles through (>> LLC)")
    parser.add_argument("--skip-sdpa", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lengths = log_uniform_lengths(args.rows, args.min_len, args.max_len, args.mean_len)
    case = Case(args.rows, args.heads, args.kv_heads, args.head_dim, lengths)
    print(f"rows={case.rows} heads={case.heads}/{case.kv_heads} head_dim={case.head_dim} "
          f"lengths mean={sum(lengths) / len(lengths):.0f} min={min(lengths)} "
          f"max={max(lengths)}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n| dtype | regime | method | min ms | median ms | GB/s of KV (min) |\n"
          "|---|---|---|---|---|---|")
    for name in args.dtypes:
        for row in bench_dtype(case, getattr(torch, name), args):
            print(row, flush=True)


if __name__ == "__main__":
    main()

"""Decode-attention kernel alone: cold (DRAM) and hot (cache-resident) rates per KV dtype.

cold: 30 layers over 64 rows whose lengths follow the varied workload (log-uniform 64..3072
plus 128 decoded tokens), each row its own cache as in the engine; every call reads each
row's KV once, so the rows come from DRAM (``--huge-pages``: caches on huge pages, as the
engine allocates them). hot: 8 rows of ``--hot-length`` tokens (1,000: ~6 MB in bf16, L3;
250 stays in L2), one layer, called repeatedly, i.e. the kernel's arithmetic rate.

    python benchmarks/attention_micro.py [--dtypes bfloat16 float8_e5m2] [--threads 2] [--tiled]
        [--path amx|avx512_bf16|avx512|avx2|reference] [--huge-pages] [--hot-length 1000]
    python benchmarks/attention_micro.py --huge-pages-ab [--length 640]
    python benchmarks/attention_micro.py --layout-ab [--length 640]
    python benchmarks/attention_micro.py --read-share [--rounds 4]
    python benchmarks/attention_micro.py --read-ahead-ab [BYTES|units ...] [--rounds 4]
    python benchmarks/attention_micro.py --builds-ab NAME=CSRC_DIR ... [--rounds 6]

--huge-pages-ab times 30 layers over 64 bf16 tiled rows of one length with the caches on huge
pages (alignedserve.huge_pages, as the engine allocates them) and on torch's 4 KiB pages,
alternating in one process so that the machine's drift hits both alike. --layout-ab times the
path's tiled and token-major bf16 kernels the same way, over the same huge-page caches (the
bytes are the same; only how the kernel reads them differs). --read-share measures the cold
bf16 tiled calls (huge pages) and ``roofline.py``'s plain read rates (4 KiB and huge pages)
in turns, in one process, and prints each round's shares: the issue's "decode attention reads
KV at >= 80% of the read rate", with both sides measured in the same minute. --read-ahead-ab
times the same cold calls with the dot-product kernel's per-head items at each read-ahead
distance given, or as row units for ``units`` (default 0 and 8192 bytes; avx512_bf16 path),
in turns, with the huge-page read before each round, and prints each order's median rate
relative to the first. --builds-ab compiles each
given copy of ``alignedserve/kernels/csrc`` (edited to try a change) with the path's flags,
checks that every build's output equals the first's, then times each build in turns: hot
(one thread, one 1,200-token row, which stays in L2; two threads, 8 rows of 1,000 tokens, L3)
and cold (the 30-layer varied pass over huge pages, with the huge-page read before each
round); it prints each build's median and its median ratio to the first build.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from alignedserve.kernels import select_kernels
from alignedserve.kernels.isa import PATHS
from alignedserve.huge_pages import HugePageArena, huge_pages_supported

LAYERS, KV_HEADS, HEADS, DIM = 30, 3, 9, 64  # SmolLM2-135M


def time_calls(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def make_caches(dtype: torch.dtype, lengths: list[int], layers: int,
                arena: HugePageArena | None = None) -> list[torch.Tensor]:
    """One random cache per row, from ``arena`` (huge pages) or torch's allocator."""
    caches = []
    for n in lengths:
        shape = (layers, 2, KV_HEADS, (n + 256) // 16 * 16, DIM)
        cache = arena.empty(shape, dtype) if arena else torch.empty(shape, dtype=dtype)
        caches.append(cache.copy_(torch.randn(shape)))
    return caches


def kv_bytes(lengths: list[int], dtype: torch.dtype) -> int:
    """Bytes of K and V that one pass over ``LAYERS`` layers of rows of ``lengths`` reads."""
    return sum(lengths) * KV_HEADS * LAYERS * 2 * DIM * dtype.itemsize


def run(kernels, dtype: torch.dtype, lengths: list[int], layers: int, calls: int,
        tiled: bool = False, caches: list[torch.Tensor] | None = None) -> float:
    """Seconds per pass over ``layers`` layers of all rows."""
    rows = len(lengths)
    caches = caches or make_caches(dtype, lengths, layers)
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
                        help="bf16 caches in the tiled layout (alignedserve.kernels.kv_layout)")
    parser.add_argument("--path", choices=PATHS, default=None,
                        help="kernel path (default: $ALIGNEDSERVE_ISA, else the CPU's best)")
    parser.add_argument("--huge-pages-ab", action="store_true",
                        help="huge-page vs 4 KiB caches, alternating (bf16, tiled)")
    parser.add_argument("--layout-ab", action="store_true",
                        help="tiled vs token-major bf16 kernel, alternating (huge pages)")
    parser.add_argument("--length", type=int, default=640, help="tokens per row (A/B only)")
    parser.add_argument("--read-share", action="store_true",
                        help="cold bf16 tiled calls against the plain read rate, in turns")
    parser.add_argument("--read-ahead-ab", nargs="*", type=read_order, metavar="BYTES|units",
                        help="per-head items at these read-ahead distances, or row units "
                             "('units'), alternated (default: 0 8192)")
    parser.add_argument("--builds-ab", nargs="+", metavar="NAME=CSRC_DIR",
                        help="kernel source trees built and alternated (first: the baseline)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds of --read-share, --read-ahead-ab or --builds-ab")
    parser.add_argument("--huge-pages", action="store_true",
                        help="cold caches on huge pages (alignedserve.huge_pages)")
    parser.add_argument("--hot-length", type=int, default=1000, help="tokens per hot row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = select_kernels(args.path)
    print(f"kernel path: {kernels.path}")
    if args.huge_pages_ab:
        huge_pages_ab(kernels, args.length)
        return
    if args.layout_ab:
        layout_ab(kernels, args.length)
        return
    rng = random.Random(0)
    varied = [int(math.exp(rng.uniform(math.log(64), math.log(3072)))) + 128 for _ in range(64)]
    if args.read_share:
        read_share(kernels, varied, args.rounds)
        return
    if args.builds_ab:
        builds_ab(kernels, varied, args.builds_ab, args.rounds)
        return
    if args.read_ahead_ab is not None:
        read_ahead_ab(kernels, varied, args.read_ahead_ab or [0, 8192], args.rounds)
        return
    if args.huge_pages:
        require_huge_pages()
    for name in args.dtypes:
        dtype = getattr(torch, name)
        if args.tiled and dtype != torch.bfloat16:  # the tiled layout is bf16's alone
            print(f"{name}: skipped (--tiled caches are bf16 only)")
            continue
        pairs = sum(varied) * KV_HEADS * LAYERS
        caches = make_caches(dtype, varied, LAYERS, HugePageArena() if args.huge_pages else None)
        cold = run(kernels, dtype, varied, LAYERS, calls=5, tiled=args.tiled, caches=caches)
        del caches
        hot_rows = [args.hot_length] * 8
        hot = run(kernels, dtype, hot_rows, 1, calls=300, tiled=args.tiled)
        nbytes = kv_bytes(varied, dtype)
        print(f"{name}: cold {cold * 1e3:.1f} ms per 30 layers x 64 rows ({sum(varied)} tokens), "
              f"{nbytes / cold / 1e9:.1f} GB/s, {pairs / cold / 1e6:.0f} M (token, kv head)/s; "
              f"hot {sum(hot_rows) * KV_HEADS / hot / 1e6:.0f} M (token, kv head)/s")


def alternate(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each run's seconds over ``rounds`` rounds, the order flipped every round so that the
    machine's drift hits every run alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 else reversed(list(runs))):
            times[name].append(runs[name]())
    return times


def require_huge_pages() -> None:
    if not huge_pages_supported():
        raise SystemExit("huge pages are unavailable here (or ALIGNEDSERVE_HUGE_PAGES=0)")


def huge_pages_ab(kernels, length: int, rounds: int = 20) -> None:
    require_huge_pages()
    lengths = [length] * 64
    caches = {"huge pages": make_caches(torch.bfloat16, lengths, LAYERS, HugePageArena()),
              "4 KiB pages": make_caches(torch.bfloat16, lengths, LAYERS)}
    times = alternate({name: functools.partial(run, kernels, torch.bfloat16, lengths, LAYERS, 1,
                                               True, c) for name, c in caches.items()}, rounds)
    for name, seconds in times.items():
        print(f"{name}: {sum(seconds) / rounds * 1e3:.1f} ms per 30 layers x 64 rows of "
              f"{length} tokens")


def read_share(kernels, lengths: list[int], rounds: int) -> None:
    """Cold tiled bf16 calls (30 layers over ``lengths``, huge pages) and the plain read rates
    in turns: the kernel's GB/s as a share of the reads measured just before it, on 4 KiB
    pages and on huge pages (the caches' own kind of memory)."""
    from roofline import read_rates  # a sibling script: benchmarks/ is on sys.path

    require_huge_pages()
    caches = make_caches(torch.bfloat16, lengths, LAYERS, HugePageArena())
    nbytes = kv_bytes(lengths, torch.bfloat16)
    for r in range(rounds):
        reads = read_rates()
        rate = nbytes / run(kernels, torch.bfloat16, lengths, LAYERS, 5, True, caches)
        print(f"round {r}: decode attention {rate / 1e9:.1f} GB/s; " + "; ".join(
            f"read on {kind} {read / 1e9:.1f} GB/s, share {rate / read:.3f}"
            for kind, read in reads.items()))


def read_order(text: str) -> int | str:
    """A --read-ahead-ab entry: a read-ahead distance in bytes (per-head items), or 'units'
    (row units, which take no read-ahead)."""
    return text if text == "units" else int(text)


def order_name(order: int | str) -> str:
    """How --read-ahead-ab prints one of its read orders."""
    return "row units" if order == "units" else f"read-ahead {order}"


def read_ahead_ab(kernels, lengths: list[int], distances: list[int | str], rounds: int) -> None:
    """Cold tiled bf16 calls (as --read-share) with each read order in turns: per-head items
    at each read-ahead distance given, or row units ('units'); the huge-page read measured
    before each round."""
    from roofline import read_rates

    require_huge_pages()
    if kernels.path != "avx512_bf16":
        raise SystemExit("the read-ahead is the avx512_bf16 path's (dot-product kernel)")
    variants = {}
    for distance in distances:
        variant = copy.copy(kernels)  # a private copy: the shared instance stays as chosen
        variant.row_units = distance == "units"
        variant.read_ahead = 0 if distance == "units" else distance
        variants[distance] = variant
    caches = make_caches(torch.bfloat16, lengths, LAYERS, HugePageArena())
    nbytes = kv_bytes(lengths, torch.bfloat16)
    rates: dict[int, list[float]] = {d: [] for d in distances}
    for r in range(rounds):
        read = read_rates()["huge pages"]
        for d in (distances if r % 2 else distances[::-1]):
            rates[d].append(nbytes / run(variants[d], torch.bfloat16, lengths, LAYERS, 3,
                                         True, caches))
        print(f"round {r}: read {read / 1e9:.1f} GB/s; " + "; ".join(
            f"{order_name(d)}: {rates[d][-1] / 1e9:.1f} GB/s" for d in distances))
    first = rates[distances[0]]
    for d in distances:
        ratios = sorted(x / y for x, y in zip(rates[d], first))
        print(f"{order_name(d)}: median {sorted(rates[d])[rounds // 2] / 1e9:.1f} GB/s, "
              f"median ratio to {order_name(distances[0])}: {ratios[rounds // 2]:.3f} "
              f"({ratios[0]:.3f}-{ratios[-1]:.3f})")


def load_build(kernels, name: str, csrc: str):
    """A private copy of ``kernels`` whose compiled ops come from the source tree ``csrc``
    (all of the extension's sources, as in alignedserve/kernels/csrc), built with the path's
    flags under the cache (``builds-ab/NAME``)."""
    from alignedserve.kernels.build import cache_root, compile_extension

    variant = copy.copy(kernels)
    variant.ext = compile_extension(f"alignedserve_ab_{name}", kernels.path, Path(csrc),
                                    cache_root() / "builds-ab" / name)
    return variant


def builds_ab(kernels, lengths: list[int], specs: list[str], rounds: int) -> None:
    """Hot and cold tiled bf16 calls of each build in turns (see the module docstring)."""
    from roofline import read_rates

    require_huge_pages()
    if kernels.ext is None:
        raise SystemExit("--builds-ab needs a compiled path")
    builds = {}
    for spec in specs:
        name, _, csrc = spec.partition("=")
        builds[name] = load_build(kernels, name, csrc)
    check = [700, 33, 2500]  # a partial last block, a short row, a row cut into two spans
    q = torch.randn(len(check), HEADS, DIM, dtype=torch.bfloat16)
    kv = torch.randn(len(check), KV_HEADS, DIM, dtype=torch.bfloat16)
    caches = make_caches(torch.bfloat16, check, 1)
    outs = {name: b.decode_attention(q, kv, kv, [c.clone() for c in caches],
                                     torch.tensor(check), 0, DIM ** -0.5, True)
            for name, b in builds.items()}
    first = next(iter(outs.values()))
    print("output equal to the first build's:",
          ", ".join(f"{name} {torch.equal(out, first)}" for name, out in outs.items()))
    cold = make_caches(torch.bfloat16, lengths, LAYERS, HugePageArena())
    threads = torch.get_num_threads()

    def hot(build, rows: int, length: int, n_threads: int) -> float:
        torch.set_num_threads(n_threads)
        try:
            return min(run(build, torch.bfloat16, [length] * rows, 1, 200, True)
                       for _ in range(3))
        finally:
            torch.set_num_threads(threads)

    cases = {"hot, 1 thread, 1 x 1200 tokens (L2)": lambda b: hot(b, 1, 1200, 1),
             f"hot, {threads} threads, 8 x 1000 tokens (L3)": lambda b: hot(b, 8, 1000, threads),
             f"cold, {threads} threads, 30 layers x 64 varied rows": lambda b: run(
                 b, torch.bfloat16, lengths, LAYERS, 3, True, cold)}
    times = {case: {name: [] for name in builds} for case in cases}
    reads = []
    for r in range(rounds):
        reads.append(read_rates()["huge pages"])
        for case, fn in cases.items():
            for name in (list(builds) if r % 2 else reversed(list(builds))):
                times[case][name].append(fn(builds[name]))
    print(f"huge-page read before each round: {', '.join(f'{x / 1e9:.1f}' for x in reads)} GB/s")
    base = next(iter(builds))
    for case, per_build in times.items():
        print(case + ": " + "; ".join(
            f"{name} {statistics.median(t) * 1e6:.1f} us (ratio "
            f"{statistics.median(x / y for x, y in zip(t, per_build[base])):.3f})"
            for name, t in per_build.items()))


def layout_ab(kernels, length: int, rounds: int = 20) -> None:
    require_huge_pages()
    lengths = [length] * 64
    caches = make_caches(torch.bfloat16, lengths, LAYERS, HugePageArena())
    times = alternate({name: functools.partial(run, kernels, torch.bfloat16, lengths, LAYERS, 1,
                                               tiled, caches)
                       for name, tiled in (("tiled", True), ("token-major", False))}, rounds)
    nbytes = kv_bytes(lengths, torch.bfloat16)
    for name, seconds in times.items():
        median = sorted(seconds)[rounds // 2]
        print(f"{name}: median {median * 1e3:.1f} ms per 30 layers x 64 rows of {length} "
              f"tokens ({nbytes / median / 1e9:.1f} GB/s), best {min(seconds) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

"""Throughput ceiling of this machine for a synthetic workload, from measured rates.

Measures, on this machine and with the threads torch is given:
  * read bandwidth: a float32 sum over 1 GiB (best of several; torch's reduction is
    vectorised and threaded, and matches a hand-written AVX-512 read loop here), on 4 KiB
    pages and on huge pages (where the engine keeps its KV), the faster of the two;
  * bf16 linear time of the model's layer shapes at prefill (4096 rows) and decode (64 rows),
    through the kernel path's linears (``PackedLinear``; ``--path``, default the CPU's best);
  * bf16 causal prefill attention throughput (useful FLOPs/s) at a 2048-token prompt: the
    path's prefill kernel where it has one, else SDPA.
Then prices the workload as if every step ran at those rates with nothing else:
  prefill  = prompt tokens x linear time per token + causal attention FLOPs / SDPA rate
  decode   = steps x (decode linears + LM head at 64 rows) + KV bytes read / bandwidth
where a request's first output token comes from its prefill, so it takes output - 1 decode
steps, and each decode step reads the request's whole KV (layers x 2 x kv_heads x head_dim
elements per cached token). The sum is a floor on wall time (no scheduling, no sampling, no
Python), so ``output tokens / floor`` is a ceiling on output tok/s. ``--kv-bytes 1`` prices an
8-bit KV.

On a shared machine one measurement can be off by 10-20% either way (another tenant, a
frequency change), so ``--rounds N`` measures every rate N times, rounds one after another,
and prices the workload at each rate's median.

Usage: python benchmarks/roofline.py [--workload varied|uniform] [--threads 2] [--kv-bytes 2]
       [--path amx|avx512_bf16|avx512|avx2|reference] [--rounds 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from alignedserve.bench.workloads import synthetic
from alignedserve.huge_pages import HugePageArena, huge_pages_supported
from alignedserve.kernels import Kernels, select_kernels
from alignedserve.kernels.isa import PATHS
from alignedserve.kernels.linear import PackedLinear
from alignedserve.model.config import ModelConfig
from alignedserve.model.default_model import default_model_path
from alignedserve.model.loader import read_gguf_config

WORKLOADS = {
    "varied": "synthetic:varied:in=64-3072,out=256",
    "uniform": "synthetic:fixed:in=512,out=256",
}


def best_time(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_rates(nbytes: int = 2**30) -> dict[str, float]:
    """Bytes/s of a threaded float32 sum over ``nbytes`` in torch's own memory (4 KiB pages)
    and, where Linux grants them, on transparent huge pages (how the engine holds its KV
    caches: alignedserve.huge_pages). On a VM the huge-page read can be 10-20% faster (no page
    walks that miss the caches), so a ceiling for KV held there must be priced at it."""
    def rate(x: torch.Tensor) -> float:
        return nbytes / best_time(x.fill_(1.0).sum)

    rates = {"4 KiB pages": rate(torch.empty(nbytes // 4))}
    if huge_pages_supported():
        rates["huge pages"] = rate(_huge_arena().empty((nbytes // 4,), torch.float32))
    return rates


@functools.lru_cache(maxsize=1)
def _huge_arena() -> HugePageArena:
    """One arena per process: its pages are faulted in once and reused by every round (fresh
    huge pages fault in slowly on some VMs)."""
    return HugePageArena()


def layer_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's linears, fused as the engine runs them."""
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [(c.hidden_size, qkv), (c.num_heads * c.head_dim, c.hidden_size),
            (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]


def linear_time(rows: int, shapes: list[tuple[int, int]], kernels: Kernels) -> float:
    """Seconds for one pass of bf16 linears over ``rows`` rows on the path's linears."""
    total = 0.0
    for k, n in shapes:
        a = torch.randn(rows, k, dtype=torch.bfloat16)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        layer = PackedLinear(w, None, kernels) if kernels.ext is not None else None
        total += best_time(lambda: layer(a) if layer is not None else F.linear(a, w))
    return total


def attention_rate(c: ModelConfig, kernels: Kernels, tokens: int = 2048) -> float:
    """Useful FLOPs/s of causal bf16 prefill attention (GQA) over one ``tokens``-long prompt:
    the path's prefill kernel where it has one (over a token-major cache), else SDPA."""
    q = torch.randn(tokens, c.num_heads, c.head_dim, dtype=torch.bfloat16)
    kv = torch.randn(c.num_kv_heads, tokens, c.head_dim, dtype=torch.bfloat16)
    if kernels.prefill_kernel_applies(q):
        def run():
            return kernels.prefill_attention(q, kv, kv, 0, c.head_dim ** -0.5)
    else:
        qs, kvs = q.transpose(0, 1)[None], kv[None]

        def run():
            return F.scaled_dot_product_attention(qs, kvs, kvs, is_causal=True, enable_gqa=True)
    seconds = best_time(run, repeats=3)
    return causal_flops(c, tokens) / c.num_layers / seconds


def causal_flops(c: ModelConfig, tokens: int) -> float:
    """QK^T and PV FLOPs of causal attention over a prompt, all layers."""
    return 4.0 * c.num_heads * c.head_dim * (tokens * (tokens + 1) / 2) * c.num_layers


@dataclasses.dataclass(frozen=True)
class Rates:
    """One round of measurements (bytes/s, s/token, s/step, FLOP/s)."""

    read_bandwidth: float
    prefill_per_token: float  # linears, per prompt token
    decode_step: float  # linears + LM head of one decode step at `decode_rows` rows
    attention_rate: float  # causal prefill attention, useful FLOPs/s
    decode_rows: int
    read_4k: float = 0.0  # the read on 4 KiB pages alone (reported; 0: not measured)

    def __str__(self) -> str:
        plain = f" (4 KiB pages {self.read_4k / 1e9:.1f})" if self.read_4k else ""
        return (f"read {self.read_bandwidth / 1e9:.1f} GB/s{plain}; prefill linears "
                f"{self.prefill_per_token * 1e6:.1f} us/token; decode linears+head at "
                f"{self.decode_rows} rows {self.decode_step * 1e3:.1f} ms/step; causal prefill "
                f"attention {self.attention_rate / 1e9:.0f} GFLOP/s")


def measure(c: ModelConfig, kernels: Kernels, decode_rows: int) -> Rates:
    """Every rate the floor is priced at, measured once."""
    shapes = layer_shapes(c)
    reads = read_rates()  # KV reads are priced at the faster one (see read_rates)
    return Rates(
        read_bandwidth=max(reads.values()), read_4k=reads["4 KiB pages"],
        prefill_per_token=linear_time(4096, shapes, kernels) * c.num_layers / 4096,
        decode_step=(linear_time(decode_rows, shapes, kernels) * c.num_layers
                     + linear_time(decode_rows, [(c.hidden_size, c.vocab_size)], kernels)),
        attention_rate=attention_rate(c, kernels),
        decode_rows=decode_rows)


def median_rates(rounds: list[Rates]) -> Rates:
    """Each measured rate's median over the rounds."""
    medians = {f.name: statistics.median(getattr(r, f.name) for r in rounds)
               for f in dataclasses.fields(Rates) if f.name != "decode_rows"}
    return Rates(**medians, decode_rows=rounds[0].decode_rows)


def best_rates(rounds: list[Rates]) -> Rates:
    """Each measured rate's best over the rounds (fastest read, quickest linears, highest
    attention rate): a slow phase of a shared machine cannot lower the price it sets."""
    return Rates(read_bandwidth=max(r.read_bandwidth for r in rounds),
                 read_4k=max(r.read_4k for r in rounds),
                 prefill_per_token=min(r.prefill_per_token for r in rounds),
                 decode_step=min(r.decode_step for r in rounds),
                 attention_rate=max(r.attention_rate for r in rounds),
                 decode_rows=rounds[0].decode_rows)


@dataclasses.dataclass(frozen=True)
class Floor:
    """A workload priced at one set of rates: seconds per part, and what they imply."""

    prefill: float  # prompt linears + causal attention
    decode_linears: float  # decode steps x (layers' linears + LM head) at full batch
    kv_reads: float  # every decode step's whole-KV reads at the read bandwidth
    kv_bytes: float  # bytes those reads move
    output_tokens: float

    @property
    def floor(self) -> float:
        """Seconds: a lower bound on the workload's wall time."""
        return self.prefill + self.decode_linears + self.kv_reads

    @property
    def ceiling(self) -> float:
        """Output tokens per second: an upper bound on throughput."""
        return self.output_tokens / self.floor


def price(c: ModelConfig, rates: Rates, spec: str, num_requests: int, seed: int,
          kv_bytes: float = 2.0) -> Floor:
    """The floor of workload ``spec`` (``synthetic(...)`` syntax) at ``rates`` (module
    docstring), with ``kv_bytes`` bytes per cached K/V element."""
    wl = synthetic(spec, num_requests, seed)
    prompts = np.array([r.prompt_len for r in wl.requests], dtype=np.float64)
    outputs = np.array([r.output_len for r in wl.requests], dtype=np.float64)
    prefill = prompts.sum() * rates.prefill_per_token + sum(
        causal_flops(c, int(p)) for p in prompts) / rates.attention_rate
    # Decode step j = 1 .. output - 1 of a request feeds output token j - 1 and attends over
    # prompt + j cached tokens (the prefill sampled token 0).
    steps = outputs - 1
    kv_tokens = float((steps * prompts + steps * (steps + 1) / 2).sum())
    moved = kv_tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_bytes
    return Floor(prefill=prefill, decode_linears=steps.max() * rates.decode_step,
                 kv_reads=moved / rates.read_bandwidth, kv_bytes=moved,
                 output_tokens=float(outputs.sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), nargs="+",
                        default=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-bytes", type=float, nargs="+", default=[2.0],
                        help="bytes per cached K/V element (2: bf16, 1: fp8)")
    parser.add_argument("--path", choices=PATHS, default=None,
                        help="kernel path (default: $ALIGNEDSERVE_ISA, else the CPU's best)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every rate this many times and use the medians")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = select_kernels(args.path)

    c = read_gguf_config(default_model_path())  # the default model's shapes, no weights
    rounds = [measure(c, kernels, args.num_requests) for _ in range(args.rounds)]
    for i, r in enumerate(rounds):
        label = f" (round {i + 1})" if args.rounds > 1 else ""
        print(f"kernel path {kernels.path}; measured{label}: {r}")
    rates = median_rates(rounds)
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds: {rates}")

    for name in args.workload:
        for kv_bytes in args.kv_bytes:
            f = price(c, rates, WORKLOADS[name], args.num_requests, args.seed, kv_bytes)
            print(f"{name} (KV {kv_bytes:g} B/elem): prefill {f.prefill:.1f} s, decode linears "
                  f"{f.decode_linears:.1f} s, KV reads {f.kv_bytes / 1e9:.0f} GB "
                  f"= {f.kv_reads:.1f} s; floor {f.floor:.1f} s -> ceiling "
                  f"{f.ceiling:.0f} output tok/s")


if __name__ == "__main__":
    main()

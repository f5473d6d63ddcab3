"""Our engine in-process on a prompts JSON (benchmarks/prompts_json.py): every request at
once, greedy, exactly ``max_tokens`` output tokens each; prints output tok/s. The KV budget
is faulted in before the clock starts, as the server does. The peer driver
benchmarks/openvino_inprocess.py runs the same file the same way.

    python benchmarks/generate_inprocess.py PROMPTS.json [--policy aligned] [--threads 2]
        [--kv-cache-dtype auto] [--path avx512_bf16] [--no-tiled-kv] [--batch-invariant]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from alignedserve import LLM, SamplingParams
from alignedserve.config import CacheConfig, EngineConfig
from alignedserve.kernels.isa import PATHS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompts")
    parser.add_argument("--policy", default="aligned")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--path", choices=PATHS, default=None)
    parser.add_argument("--no-tiled-kv", dest="tiled_kv", action="store_false",
                        help="keep bf16 caches token-major where the path could tile them")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the same bits whatever shares a step "
                             "(on amx: its own linear at any row count)")
    args = parser.parse_args()
    requests = json.load(open(args.prompts))["requests"]
    # The KV budget is faulted in up front, as the server does (and as peers reserve theirs).
    llm = LLM.from_config(EngineConfig(
        policy=args.policy, num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
        kernel_path=args.path, batch_invariant=args.batch_invariant,
        cache=CacheConfig(preallocate_kv=True, tiled_layout=args.tiled_kv)))
    warm = [{"prompt_token_ids": r["prompt_token_ids"][:32]} for r in requests[:2]]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"],
                             ignore_eos=True, temperature=0) for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(r["max_tokens"] for r in requests), generated
    print(json.dumps({"engine": "alignedserve", "policy": args.policy,
                      "kernel_path": llm.engine.kernels.path,
                      "tiled_kv": llm.engine.executor.pool.tiled,
                      "batch_invariant": args.batch_invariant, "seconds": round(seconds, 2),
                      "output_tokens": generated, "out_tok_s": round(generated / seconds, 1),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()

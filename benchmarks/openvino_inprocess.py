"""OpenVINO GenAI's ContinuousBatchingPipeline in-process on a prompts JSON
(benchmarks/prompts_json.py), the way benchmarks/generate_inprocess.py runs ours: every
request at once, greedy, exactly ``max_tokens`` output tokens each; prints output tok/s.

Runs in OpenVINO's own environment (it does not import alignedserve), with the model exported
as ../shared/peers/README.md describes:

    $OV_VENV/bin/python benchmarks/openvino_inprocess.py PROMPTS.json OV_MODEL_DIR [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompts")
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    requests = json.load(open(args.prompts))["requests"]
    sc = genai.SchedulerConfig()
    sc.cache_size = 8
    sc.max_num_batched_tokens = 2048
    sc.max_num_seqs = 64
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = False
    pipe = genai.ContinuousBatchingPipeline(args.model_dir, sc, "CPU",
                                            {"INFERENCE_NUM_THREADS": args.threads})

    def tensor(ids: list[int]) -> ov.Tensor:
        return ov.Tensor(np.array([ids], dtype=np.int64))

    def config(n: int) -> genai.GenerationConfig:
        c = genai.GenerationConfig()
        c.max_new_tokens = n
        c.min_new_tokens = n
        c.ignore_eos = True
        c.do_sample = False
        return c

    warm = [tensor(r["prompt_token_ids"][:32]) for r in requests[:2]]
    pipe.generate(warm, [config(4)] * len(warm))
    inputs = [tensor(r["prompt_token_ids"]) for r in requests]
    configs = [config(r["max_tokens"]) for r in requests]
    start = time.perf_counter()
    results = pipe.generate(inputs, configs)
    seconds = time.perf_counter() - start
    generated = sum(len(r.m_generation_ids[0]) for r in results)
    assert generated == sum(r["max_tokens"] for r in requests), generated
    print(json.dumps({"engine": "openvino-genai", "seconds": round(seconds, 2),
                      "output_tokens": generated, "out_tok_s": round(generated / seconds, 1),
                      "threads": args.threads}))


if __name__ == "__main__":
    main()

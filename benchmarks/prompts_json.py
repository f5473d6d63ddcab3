"""Write a workload's prompts (token ids of exact lengths) and output lengths to JSON, so
in-process peers (benchmarks/openvino_inprocess.py) run the very prompts our engine runs.

    python benchmarks/prompts_json.py OUT.json [--workload synthetic:varied:in=64-3072,out=256]
        [--num-requests 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import json

from alignedserve.bench.prompts import PromptFactory, TokenSpace, load_tokenizer
from alignedserve.bench.workloads import synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--workload", default="synthetic:varied:in=64-3072,out=256")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = synthetic(args.workload, args.num_requests, args.seed)
    factory = PromptFactory(TokenSpace.from_tokenizer(load_tokenizer(None)), args.seed)
    requests = [{"prompt_token_ids": factory.build(r.index, r.prompt_len),
                 "max_tokens": r.output_len} for r in workload.requests]
    with open(args.out, "w") as f:
        json.dump({"workload": args.workload, "seed": args.seed, "requests": requests}, f)
    print(f"{len(requests)} requests, {sum(len(r['prompt_token_ids']) for r in requests)} "
          f"prompt tokens -> {args.out}")


if __name__ == "__main__":
    main()

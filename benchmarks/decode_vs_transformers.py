"""Decode speed of AlignedServe vs Hugging Face transformers ``generate()`` on the same weights.

Single stream and batch 64, prompt 512 tokens, 128 new tokens, bfloat16, greedy, ignore EOS.
Decode throughput is measured as (tokens of a 128-token run − tokens of a 1-token run) /
(time of the 128-token run − time of the 1-token run), so prefill is excluded for both.

    python benchmarks/decode_vs_transformers.py [--batch 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PROMPT_LEN, NEW_TOKENS = 512, 128


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (batch, PROMPT_LEN), generator=g).tolist()


def time_ours(llm, ids: list[list[int]], new: int) -> float:
    from alignedserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return elapsed


@torch.inference_mode()
def time_hf(model, ids: list[list[int]], new: int) -> float:
    x = torch.tensor(ids)
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == PROMPT_LEN + new
    return elapsed


def decode_rate(timer, batch: int) -> float:
    t1, tn = timer(1), timer(NEW_TOKENS)
    return batch * (NEW_TOKENS - 1) / (tn - t1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--hf-dir", default=None,
                        help="Hugging Face directory with the same (dequantized) weights; default: "
                             "transformers loads the GGUF itself")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from alignedserve import LLM
    from alignedserve.model.default_model import default_model_path
    path = default_model_path()
    llm = LLM(dtype="bfloat16", num_threads=args.threads)
    if args.hf_dir:  # plain dense bf16 weights: transformers' fastest path
        hf = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.bfloat16).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.bfloat16).eval()
    vocab = llm.engine.loaded.config.vocab_size
    time_ours(llm, prompts(2, vocab), 4)  # warm-up: kernel build, allocator
    results = {}
    for batch in args.batches:
        ids = prompts(batch, vocab)
        ours = decode_rate(lambda n: time_ours(llm, ids, n), batch)
        theirs = decode_rate(lambda n: time_hf(hf, ids, n), batch)
        results[batch] = {"alignedserve_tok_s": round(ours, 1),
                          "transformers_tok_s": round(theirs, 1),
                          "ratio": round(ours / theirs, 2)}
        print(f"batch {batch}: ours {ours:.1f} tok/s, transformers {theirs:.1f} tok/s, "
              f"ratio {ours / theirs:.2f}x", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""bfloat16 closeness: the engine's greedy tokens are ones float32 transformers also rates top.

Exact tokens cannot be expected in bf16, so for each step we teacher-force our bf16 sequence
through transformers in float32 and check (a) our chosen token's logprob is within
``LOGPROB_TOL`` nats of the best float32 logprob at that step (it was a top choice, or a
near-tie), and (b) the logprob the engine reports for it is within ``REPORT_TOL`` of
float32's for the same token.
"""

import pytest
import torch

from alignedserve.config import EngineConfig
from alignedserve.engine import LLMEngine
from alignedserve.sampling_params import SamplingParams
from tests.test_engine_parity import document

pytestmark = pytest.mark.model

# Observed on the default model (2026-11-30): largest gap 0.04 nats, largest logprob
# difference 0.095; the bounds leave room for other prompts without hiding a real bug
# (a wrong token or a broken layer moves these by whole nats).
LOGPROB_TOL = 0.25  # nats below float32's best token at the same step
REPORT_TOL = 0.25  # |reported bf16 logprob - float32 logprob| of the chosen token
NEW = 16


@torch.inference_mode()
def test_bf16_greedy_is_close_to_float32(default_model_path, default_model_fp32,
                                          default_model_hf_fp32):
    doc = document(default_model_fp32.tokenizer)
    prompts = [doc[:16], doc[40:240], doc[100:800]]
    engine = LLMEngine(EngineConfig(dtype="bfloat16", policy="aligned"))
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    engine.close()
    for i, prompt in enumerate(prompts):
        tokens = outs[str(i)].token_ids
        reported = [lp[t] for lp, t in zip(outs[str(i)].logprobs, tokens)]
        logits = default_model_hf_fp32(torch.tensor([prompt + tokens])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        for step, token in enumerate(tokens):
            gap = (logp[step].max() - logp[step, token]).item()
            assert gap <= LOGPROB_TOL, f"prompt {i} step {step}: {gap:.3f} nats below best"
            diff = abs(reported[step] - logp[step, token].item())
            assert diff <= REPORT_TOL, f"prompt {i} step {step}: logprob off by {diff:.3f}"

"""bfloat16 closeness: the engine's greedy tokens are ones a float32 reference also rates top.

Run with the bf16 KV cache (in the AMX tile layout where this CPU has AMX, and token-major)
and with the 8-bit (fp8 e5m2) one.

Exact tokens cannot be expected in bf16, so for each step we teacher-force our bf16 sequence
through a float32 reference and check (a) our chosen token's logprob is within a tolerance
(``TOLERANCES``) of the reference's best logprob at that step (it was a top choice, or a
near-tie), and (b) the logprob the engine reports for it is within a second tolerance of the
reference's for the same token.

The reference is what the cache promises: for the bf16 cache, float32 transformers; for the
fp8 cache, our float32 model (bit-identical to transformers, tests/test_engine_parity.py)
attending over K/V rounded to bfloat16, then to e5m2, and back: the engine computes K/V in
bfloat16 and stores their e5m2 rounding, and the double rounding matters (a value that
bfloat16 moves onto an e5m2 midpoint rounds the other way, a quarter of its size). The
e5m2 rounding itself (2 mantissa bits, no scales) moves logits by up to ~1 nat: on prompt 2
step 1 it flips a 0.91-nat lead in float32 with every kernel disabled, on any CPU. Comparing
against full precision with a per-token bound therefore tested which side of that rounding
one CPU's bf16 arithmetic fell on, not the kernels; the e5m2 cost is bounded separately, as a
mean over all steps against transformers (``FP8_MEAN_GAP``).
"""

import pytest
import torch
import torch.nn.functional as F

from alignedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.sampling_params import SamplingParams
from tests.test_engine_parity import document

pytestmark = pytest.mark.model

# Observed on the default model (2026-11-30, AMX; 2026-12-01, AVX512-BF16): largest gap 0.04
# nats, largest logprob difference 0.095 (bf16 cache) and 0.0 / 0.27 (fp8 cache against its
# bf16-then-e5m2 reference; 0.70 against e5m2 of float32 K/V: a K whose bf16 arithmetic lands
# on the other side of an e5m2 rounding step moves by a quarter of its value, so reported
# logprobs scatter more than with the bf16 cache). The bounds leave room
# for other prompts without hiding a real bug (a wrong token or a broken layer moves these
# by whole nats).
# kv_cache_dtype -> (nats below the reference's best token at the same step,
#                    |reported logprob - reference logprob| of the chosen token)
TOLERANCES = {"auto": (0.25, 0.25), "fp8_e5m2": (0.25, 0.6)}
# Mean over all steps of the fp8 run's gap to float32 transformers' best token (observed
# 0.026: one flip of 0.91 and one of 0.33 in 48 steps).
FP8_MEAN_GAP = 0.1
NEW = 16


class RoundedKVAttention:
    """Causal attention for one sequence, no cache, over K/V rounded to ``via``, then to
    ``kv_dtype``, and back: a float32 model computes what an engine running in ``via`` with a
    ``kv_dtype`` cache stores, and attends over it in float32."""

    def __init__(self, kv_dtype: torch.dtype, via: torch.dtype) -> None:
        self.kv_dtype, self.via = kv_dtype, via

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        k, v = (x.to(self.via).to(self.kv_dtype).to(q.dtype).transpose(0, 1)[None]
                for x in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)


def reference_logprobs(kv_cache_dtype: str, hf_fp32, ours_fp32, ids: list[int]) -> torch.Tensor:
    """float32 log-probabilities [T, vocab] of the sequence ``ids`` as a ``kv_cache_dtype``
    cache would give them (see the module docstring)."""
    if kv_cache_dtype == "auto":
        logits = hf_fp32(torch.tensor([ids])).logits[0]
    else:
        tokens = torch.tensor(ids)
        attn = RoundedKVAttention(torch.float8_e5m2, via=torch.bfloat16)
        logits = ours_fp32.compute_logits(ours_fp32(tokens, torch.arange(len(ids)), attn))
    return torch.log_softmax(logits.float(), dim=-1)


def _emulated_amx_case():
    """The amx path on emulated tiles, where this CPU lacks AMX but can run them (conftest):
    its kernels' logic over the real weights. (Where the CPU has AMX the default path is amx.)"""
    from alignedserve.kernels import isa

    return pytest.param("auto", True, "amx", id="auto-True-amx-emulated", marks=pytest.mark.skipif(
        not isa.amx_emulated(), reason="amx is this CPU's own path, or cannot run emulated here"))


@torch.inference_mode()
@pytest.mark.parametrize("kv_cache_dtype,tiled,kernel_path",
                         [("auto", True, None), ("auto", False, None), ("fp8_e5m2", True, None),
                          _emulated_amx_case()])
def test_bf16_greedy_is_close_to_float32(default_model_path, default_model_fp32,
                                          default_model_hf_fp32, kv_cache_dtype, tiled,
                                          kernel_path):
    doc = document(default_model_fp32.tokenizer)
    prompts = [doc[:16], doc[40:240], doc[100:800]]
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                                    policy="aligned", cache=CacheConfig(tiled_layout=tiled),
                                    kernel_path=kernel_path))
    assert kernel_path is None or engine.kernels.path == kernel_path
    if kv_cache_dtype == "auto":  # the tiled run must really take the tiled path where it can
        assert engine.executor.pool.tiled == (tiled and engine.kernels.tiled_kv_applies(
            torch.bfloat16, 64, 16, torch.device("cpu")))
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    engine.close()
    logprob_tol, report_tol = TOLERANCES[kv_cache_dtype]
    full_precision_gaps = []
    for i, prompt in enumerate(prompts):
        tokens = outs[str(i)].token_ids
        reported = [lp[t] for lp, t in zip(outs[str(i)].logprobs, tokens)]
        ids = prompt + tokens
        logp = reference_logprobs(kv_cache_dtype, default_model_hf_fp32,
                                  default_model_fp32.model, ids)[len(prompt) - 1:-1]
        hf_logp = torch.log_softmax(
            default_model_hf_fp32(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float(), -1)
        for step, token in enumerate(tokens):
            gap = (logp[step].max() - logp[step, token]).item()
            assert gap <= logprob_tol, f"prompt {i} step {step}: {gap:.3f} nats below best"
            diff = abs(reported[step] - logp[step, token].item())
            assert diff <= report_tol, f"prompt {i} step {step}: logprob off by {diff:.3f}"
            full_precision_gaps.append((hf_logp[step].max() - hf_logp[step, token]).item())
    mean_gap = sum(full_precision_gaps) / len(full_precision_gaps)
    bound = FP8_MEAN_GAP if kv_cache_dtype == "fp8_e5m2" else logprob_tol
    assert mean_gap <= bound, f"mean gap to float32 transformers {mean_gap:.3f} nats"


NEAR_TIE_NATS = 0.1


@torch.inference_mode()
def test_fp8_cache_survives_write_back_and_prefetch(default_model_fp32):
    """Tier moves copy the 8-bit cache exactly: a device tier too small for all requests (so KV
    is written back to host and prefetched again) gives the same greedy tokens as a large one.

    The two runs batch the prompts differently (the tight tier admits fewer at once), and bf16
    GEMMs round differently at different row counts, so a near-tie may flip: the sequences
    must agree up to a step where the ample run had the tight run's token within
    NEAR_TIE_NATS of its choice, and are not compared past it. A lost or garbled KV copy
    changes the distribution itself, not a near-tie."""
    doc = document(default_model_fp32.tokenizer)
    prompts = [doc[:16], doc[40:240], doc[100:800], doc[900:1300]]

    def run(device_kv_gb: float) -> tuple[list[list[int]], int]:
        engine = LLMEngine(EngineConfig(
            dtype="bfloat16", kv_cache_dtype="fp8_e5m2", policy="aligned",
            scheduler=SchedulerConfig(max_num_batched_tokens=256, kv_reserve_tokens=32),
            cache=CacheConfig(device_kv_gb=device_kv_gb, host_kv_gb=1.0)))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs, copied = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0]
            copied += engine.stats.window[-1].copy_bytes
        engine.close()
        return [outs[str(i)] for i in range(len(prompts))], copied

    ample, ample_copies = run(2.0)
    tight, tight_copies = run(0.012)  # ~1,100 tokens of fp8 KV: not all four fit at once
    assert ample_copies == 0 and tight_copies > 0
    compared = 0
    for i, (a, t) in enumerate(zip(ample, tight)):
        for step, (want, got) in enumerate(zip(a.token_ids, t.token_ids)):
            if want != got:
                top = a.logprobs[step]
                assert got in top and top[want] - top[got] <= NEAR_TIE_NATS, (
                    f"prompt {i} step {step}: {got} instead of {want}, not a near-tie ({top})")
                break
            compared += 1
    assert compared >= 24, f"only {compared} of 32 tokens agreed before a near-tie"

"""The decode fast path (executor/decode_fast_path.py) is the module path, minus the modules.

bf16 on the real default model: a decode step's hidden states are bit-identical through both
paths, and whole greedy generations (prefill steps on the modules, decode steps on the fast
path, arrivals while others decode) are token-identical with the fast path on and off.
"""

from __future__ import annotations

import pytest
import torch

from alignedserve.config import CacheConfig, EngineConfig
from alignedserve.engine import LLMEngine
from alignedserve.executor.attention import PrefillSegment, StepAttention
from alignedserve.executor.decode_fast_path import DecodeFastPath
from alignedserve.executor.kernels import amx_linear_kernels
from alignedserve.sampling_params import SamplingParams
from tests.model_utils import ours_from_hf, tiny_hf_model
from tests.test_engine_parity import document

needs_amx = pytest.mark.skipif(amx_linear_kernels() is None,
                               reason="no AMX-BF16 kernel on this CPU/build")


def test_float32_models_keep_the_module_path():
    assert DecodeFastPath.build(ours_from_hf(tiny_hf_model())) is None


def _engine(tiled: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="bfloat16", policy="aligned",
                                  cache=CacheConfig(tiled_layout=tiled)))


def _generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, list]:
    """Greedy outputs; the second half of the prompts arrives after three steps."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    half = len(prompts) // 2
    for i, prompt in enumerate(prompts[:half]):
        engine.add_request(str(i), prompt, params)
    outputs, steps = {}, 0
    while engine.has_unfinished():
        if steps == 3:
            for i, prompt in enumerate(prompts[half:], start=half):
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return outputs


@pytest.mark.model
@needs_amx
@pytest.mark.parametrize("tiled", [True, False])
def test_generations_match_the_module_path(default_model_fp32, tiled):
    doc = document(default_model_fp32.tokenizer)
    prompts = [doc[:16], doc[30:230], doc[50:120], doc[300:1000]]
    fast_engine = _engine(tiled)
    fast = fast_engine.executor.fast_decode
    assert fast is not None
    calls = 0

    def counting(*args):
        nonlocal calls
        calls += 1
        return fast(*args)

    fast_engine.executor.fast_decode = counting  # also answers applies() below
    counting.applies = fast.applies
    with_fast = _generate(fast_engine, prompts, 20)
    fast_engine.close()
    assert calls > 10  # the decode steps really took it

    plain_engine = _engine(tiled)
    plain_engine.executor.fast_decode = None
    without = _generate(plain_engine, prompts, 20)
    plain_engine.close()
    assert with_fast == without


@pytest.mark.model
@needs_amx
def test_a_decode_step_is_bit_identical():
    engine = _engine(tiled=True)
    prompts = [[100 + i + j for j in range(n)] for i, n in enumerate((5, 40, 130))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    executor = engine.executor
    captured: list[tuple] = []
    model_forward = executor.model.forward

    def capture(input_ids, positions, attn):
        captured.append((input_ids, positions, attn))
        return model_forward(input_ids, positions, attn)

    executor.fast_decode, fast = None, executor.fast_decode
    executor.model.forward = capture
    for _ in range(4):  # prefill, then decode steps
        engine.step()
    executor.model.forward = model_forward
    input_ids, positions, attn = captured[-1]
    assert not attn.prefills and len(attn.decode_caches) == 3
    with torch.inference_mode():
        assert fast.applies(3, attn)
        # Both write the same new K/V at the same positions, so their order does not matter.
        expected = model_forward(input_ids, positions, attn)
        got = fast(input_ids, positions, attn)
    assert torch.equal(got, expected)
    engine.close()


@pytest.mark.model
@needs_amx
def test_steps_with_prefill_chunks_are_not_taken():
    cache = torch.zeros(30, 2, 3, 16, 64, dtype=torch.bfloat16)
    with_prefill = StepAttention([PrefillSegment(cache, 0, 4)], [], torch.zeros(0), 0.125)
    decode_only = StepAttention([], [cache], torch.zeros(1, dtype=torch.int64), 0.125)
    engine = _engine(tiled=True)
    fast = engine.executor.fast_decode
    with torch.inference_mode():
        assert not fast.applies(4, with_prefill)
        assert fast.applies(1, decode_only)
        assert not fast.applies(fast.max_rows + 1, decode_only)
    assert not fast.applies(1, decode_only)  # autograd on: the module path decides
    engine.close()

"""Greedy generation through the whole engine equals Hugging Face transformers, token for token.

float32, the real default model, 8 prompts of 16..1500 tokens, every policy, with half the
requests arriving while the others decode, and (aligned) with a device KV budget so small
that cohorts are written back to the host tier and prefetched again.

Near-ties: where transformers' own top-2 logits at a step differ by less than ``TIE`` the
argmax is decided by rounding noise, so we compare tokens up to (not past) the first such step.
"""

from __future__ import annotations

import pytest
import torch

from alignedserve.config import CacheConfig, EngineConfig, GiB, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.huge_pages import HUGE_PAGE
from alignedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.model

LENGTHS = [16, 37, 90, 200, 420, 700, 1100, 1500]
NEW_TOKENS = 24
TIE = 1e-3
TOPICS = ["rivers", "bridges", "comets", "violins", "glaciers", "lighthouses", "orchards",
          "telescopes", "harbours", "libraries", "volcanoes", "railways"]


def document(tokenizer) -> list[int]:
    """A long, deterministic, natural-language document (> 1500 tokens)."""
    sentences = []
    for i in range(160):
        topic = TOPICS[i % len(TOPICS)]
        sentences.append(f"Note {i}: the study of {topic} began in year {1700 + 7 * i}, and "
                         f"by {1750 + 11 * i} there were {3 + i % 17} schools devoted to it.")
    ids = tokenizer("\n".join(sentences))["input_ids"]
    assert len(ids) > max(LENGTHS)
    return list(ids)


@pytest.fixture(scope="module")
def prompts(default_model_fp32) -> list[list[int]]:
    doc = document(default_model_fp32.tokenizer)
    return [doc[i * 13: i * 13 + n] for i, n in enumerate(LENGTHS)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], int]:
    """transformers greedy tokens and the number of leading steps that are not near-ties."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, comparable = [], None
    for step in range(steps):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        if comparable is None and (top2[0] - top2[1]).item() < TIE:
            comparable = step
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, steps if comparable is None else comparable


@pytest.fixture(scope="module")
def reference(default_model_hf_fp32, prompts):
    return [hf_greedy(default_model_hf_fp32, p, NEW_TOKENS) for p in prompts]


def run_engine(loaded, prompts, policy: str, device_kv_gb: float = 2.0,
               max_batched: int = 512, preallocate_kv: bool = False) -> list[list[int]]:
    config = EngineConfig(dtype="float32", policy=policy,
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_batched,
                                                    kv_reserve_tokens=32),
                          cache=CacheConfig(device_kv_gb=device_kv_gb, host_kv_gb=2.0,
                                            preallocate_kv=preallocate_kv))
    engine = LLMEngine(config, loaded)
    arena = engine.executor.pool._arena
    if preallocate_kv and arena is not None:  # the device budget was faulted in up front
        assert arena.mapped_pages * HUGE_PAGE >= device_kv_gb * GiB
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results: dict[str, list[int]] = {}
    half = len(prompts) // 2
    for i in range(half):
        engine.add_request(str(i), prompts[i], params)
    steps = 0
    while engine.has_unfinished():
        if steps == 3:  # the rest arrive while the first half is prefilling / decoding
            for i in range(half, len(prompts)):
                engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    engine.close()
    assert engine.store.used("dev0") == 0 and engine.store.used("host") == 0
    return [results[str(i)] for i in range(len(prompts))]


def assert_matches(reference, got):
    for i, ((want, comparable), tokens) in enumerate(zip(reference, got)):
        assert len(tokens) == NEW_TOKENS
        assert comparable >= NEW_TOKENS // 2, f"prompt {i}: too many near-ties to compare"
        assert tokens[:comparable] == want[:comparable], f"prompt {i} ({LENGTHS[i]} tokens)"


@pytest.mark.parametrize("policy", ["aligned", "fcfs", "static"])
def test_greedy_matches_transformers_fp32(default_model_fp32, prompts, reference, policy):
    assert_matches(reference, run_engine(default_model_fp32, prompts, policy))


def test_aligned_with_tiny_device_budget_writes_back_and_prefetches(default_model_fp32, prompts,
                                                                    reference):
    # ~0.15 GiB of fp32 KV holds ~3.5k tokens: the long prompts cannot all stay on the device.
    # The device budget is preallocated, so caches reuse memory that earlier ones wrote.
    assert_matches(reference, run_engine(default_model_fp32, prompts, "aligned",
                                         device_kv_gb=0.15, max_batched=256,
                                         preallocate_kv=True))

"""Full-sequence parity with transformers on the real default model (float32).

Both sides dequantize the same Q4_1 GGUF to float32; the only possible differences are
floating-point summation order (fused QKV/gate-up GEMMs, SDPA kernel choice) -- on the
development machine the logits were in fact bit-identical. Tolerance: max |logit diff|
< 1e-3 over every position, and the greedy token at the last position identical. Logits
of this model span about +-45, so 1e-3 is ~2e-5 relative; any real bug (rope layout, a
swapped shard, a missing bias) shows up as O(1) differences.
"""

from __future__ import annotations

import pytest
import torch

from alignedserve.model.loader import LoadedModel
from tests.model_utils import hf_logits, our_logits

TOLERANCE = 1e-3

_ADJ = ("quiet", "red", "ancient", "rapid", "curious", "broken", "golden")
_NOUN = ("river", "engine", "garden", "letter", "mountain", "signal", "harbor", "lamp", "city")
_VERB = ("crossed", "repaired", "described", "ignored", "followed", "measured")


def _long_text(n_sentences: int) -> str:
    # Deterministic but non-repeating enough that the model cannot just copy.
    parts = []
    for i in range(n_sentences):
        a, b = _ADJ[i % 7], _ADJ[(i * 3 + 1) % 7]
        n1, n2 = _NOUN[i % 9], _NOUN[(i * 5 + 2) % 9]
        parts.append(f"On day {i * 7 + 3}, the {a} {n1} {_VERB[i % 6]} the {b} {n2}.")
    return " ".join(parts)


def _prompts(lm: LoadedModel) -> dict[str, torch.Tensor]:
    chat = [{"role": "user", "content": "Write a haiku about the ocean."}]
    chat_ids = lm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    texts = {
        "medium": "The history of the printing press begins " + _long_text(12),
        "long": _long_text(75),
    }
    prompts = {"chat": torch.tensor(chat_ids["input_ids"])}
    prompts.update({k: torch.tensor(lm.tokenizer(t).input_ids) for k, t in texts.items()})
    return prompts


@pytest.mark.model
def test_full_sequence_logits_match_transformers(
    default_model_fp32: LoadedModel, default_model_hf_fp32: torch.nn.Module
) -> None:
    prompts = _prompts(default_model_fp32)
    assert 900 <= prompts["long"].numel() <= 1200
    for name, ids in prompts.items():
        ours = our_logits(default_model_fp32.model, ids)
        ref = hf_logits(default_model_hf_fp32, ids)
        assert ours.shape == ref.shape == (ids.numel(), default_model_fp32.config.vocab_size)
        diff = (ours - ref).abs().max().item()
        assert diff < TOLERANCE, f"{name} ({ids.numel()} tokens): max abs diff {diff}"
        assert ours[-1].argmax() == ref[-1].argmax(), name
        agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree > 0.99, f"{name}: greedy tokens agree at only {agree:.3f} of positions"

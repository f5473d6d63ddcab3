"""Our Llama-family model vs transformers on tiny random models (no model files needed)."""

from __future__ import annotations

import pytest
import torch

from alignedserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from alignedserve.model.llama import DenseCausalAttention, LlamaForCausalLM
from tests.model_utils import (
    SegmentedCausalAttention,
    SingleSequenceCache,
    hf_logits,
    our_logits,
    ours_from_hf,
    tiny_hf_model,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-head-dim": ("llama", {"head_dim": 24}),  # head_dim != hidden / heads
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
}


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str) -> None:
    arch, overrides = CASES[case]
    hf = tiny_hf_model(arch, **overrides)
    ours = ours_from_hf(hf)
    ids = _ids(40)
    diff = (our_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4, f"{case}: max abs logit diff {diff}"


def test_qwen2_config_has_qkv_bias_only() -> None:
    cfg = ModelConfig.from_hf_config(tiny_hf_model("qwen2").config.to_dict())
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert cfg.attention_bias and not cfg.attention_out_bias
    model = LlamaForCausalLM(cfg)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.layers[0].self_attn.o_proj.bias is None


def test_flattened_sequences_match_separate_calls() -> None:
    ours = ours_from_hf(tiny_hf_model("llama"))
    a, b = _ids(7, seed=1), _ids(11, seed=2)
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(7), torch.arange(11)])
    with torch.inference_mode():
        joint = ours.compute_logits(ours(ids, positions, SegmentedCausalAttention([7, 11])))
    separate = torch.cat([our_logits(ours, a), our_logits(ours, b)])
    torch.testing.assert_close(joint, separate, atol=1e-5, rtol=0)


def test_cached_decode_matches_full_forward() -> None:
    """Prefill 10 tokens, then decode one token per call at its absolute position:
    each step's logits must equal the full-sequence forward at that position."""
    ours = ours_from_hf(tiny_hf_model("qwen2"))
    ids = _ids(16, seed=3)
    full = our_logits(ours, ids)
    cache = SingleSequenceCache()
    steps = [ours(ids[:10], torch.arange(10), cache)]
    for pos in range(10, 16):
        steps.append(ours(ids[pos : pos + 1], torch.tensor([pos]), cache))
    with torch.inference_mode():
        incremental = ours.compute_logits(torch.cat(steps))
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)

    # RoPE only sees relative positions: a uniform shift keeps the logits, but spreading
    # the positions apart must change them (positions really reach the rotary tables).
    with torch.inference_mode():
        shifted = ours.compute_logits(ours(ids[:10], torch.arange(10) + 5, DenseCausalAttention()))
        spread = ours.compute_logits(ours(ids[:10], torch.arange(10) * 2, DenseCausalAttention()))
    torch.testing.assert_close(shifted, full[:10], atol=1e-4, rtol=0)
    assert not torch.allclose(spread, full[:10], atol=1e-2)


def test_output_shapes_and_dtype_bf16() -> None:
    ours = ours_from_hf(tiny_hf_model("llama")).to(torch.bfloat16)
    ids = _ids(5)
    with torch.inference_mode():
        hidden = ours(ids, torch.arange(5), DenseCausalAttention())
        logits = ours.compute_logits(hidden[-2:])
    assert hidden.shape == (5, 64) and hidden.dtype == torch.bfloat16
    assert logits.shape == (2, 256) and logits.dtype == torch.float32


def test_unknown_architecture_lists_supported() -> None:
    d = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(d)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    assert "GPT2LMHeadModel" in str(err.value)


def test_model_type_fallback_and_v4_rope_layout() -> None:
    d = {
        "model_type": "mistral",
        "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
        "max_position_embeddings": 32768, "sliding_window": 4096,
    }
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.architecture == "MistralForCausalLM"
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.head_dim == 8 and not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.max_position_embeddings == 4096  # capped at the sliding window
    assert cfg.kv_bytes_per_token(2) == 3 * 2 * 2 * 8 * 2


def test_unknown_rope_type_is_rejected() -> None:
    d = tiny_hf_model("llama").config.to_dict()
    d["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config(d)


def test_load_weights_rejects_incomplete_checkpoint() -> None:
    hf = tiny_hf_model("llama")
    ours = LlamaForCausalLM(ModelConfig.from_hf_config(hf.config.to_dict()))
    state = dict(hf.state_dict())
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[k\]"):
        ours.load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape mismatch"):
        ours.load_weights(state.items())

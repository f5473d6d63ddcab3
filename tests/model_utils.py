"""Helpers shared by the model tests: tiny random HF models and toy attention backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from alignedserve.model.config import ModelConfig
from alignedserve.model.llama import DenseCausalAttention, LlamaForCausalLM

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny transformers model (float32, eval) with *all* weights randomised, including
    norm weights and biases, which HF initialises to constants that would hide bugs."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


def ours_from_hf(hf_model: torch.nn.Module) -> LlamaForCausalLM:
    """Our model carrying the same weights as ``hf_model`` (float32)."""
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = LlamaForCausalLM(config)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


@torch.inference_mode()
def our_logits(model: LlamaForCausalLM, ids: Tensor) -> Tensor:
    """Full-sequence float32 logits [T, vocab] of one sequence starting at position 0."""
    positions = torch.arange(ids.numel())
    hidden = model(ids, positions, DenseCausalAttention())
    return model.compute_logits(hidden)


@torch.inference_mode()
def hf_logits(hf_model: torch.nn.Module, ids: Tensor) -> Tensor:
    return hf_model(ids[None]).logits[0].float()


class SegmentedCausalAttention:
    """No-cache backend for several whole sequences flattened back to back in T."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens
        self.dense = DenseCausalAttention()

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs = [
            self.dense(layer, qs, ks, vs)
            for qs, ks, vs in zip(
                q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)
            )
        ]
        return torch.cat(outs)


class SingleSequenceCache:
    """Minimal KV-cached backend for ONE sequence: appends k/v per layer, and lets the
    new tokens attend to everything cached before them plus causally among themselves."""

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        past = self.k[layer].shape[0] if layer in self.k else 0
        self.k[layer] = torch.cat([self.k[layer], k]) if past else k.clone()
        self.v[layer] = torch.cat([self.v[layer], v]) if past else v.clone()
        keys, values = self.k[layer], self.v[layer]
        group = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        t, total = q.shape[0], keys.shape[1]
        # Query i (absolute position past + i) sees keys 0..past+i.
        mask = torch.arange(total)[None, :] <= (past + torch.arange(t))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)

"""Model profiles: what one token costs in FLOPs and bytes, from a Hugging Face config.

The shape comes from the engine's own ``ModelConfig.from_hf_config`` (the one description of
a model that the model code, the KV store and this cost model share); this module only
derives per-token costs from it. The built-in configs are the published ``config.json``
fields of each model (no network access is needed).

Conventions: one multiply-add is 2 FLOPs; all byte counts assume ``dtype_bytes`` per element
(2 for bf16) for weights, activations and KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from alignedserve.model.config import ModelConfig


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, ctx: int,
           theta: float = 10000.0, tie: bool = False, model_type: str = "llama") -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    return {"architectures": [arch], "model_type": model_type, "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "max_position_embeddings": ctx, "rope_theta": theta, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": tie}


HF_CONFIGS: Mapping[str, dict[str, Any]] = MappingProxyType({
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 4096),
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 8192, theta=500000.0),
    "qwen2-7b": _llama(3584, 18944, 28, 28, 4, 152064, 32768, theta=1e6, model_type="qwen2"),
    "smollm2-135m": _llama(576, 1536, 30, 9, 3, 49152, 8192, theta=100000.0, tie=True),
})
_ALIASES: Mapping[str, str] = MappingProxyType({
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "llama2-7b": "llama-2-7b",
    "meta-llama/llama-2-13b-hf": "llama-2-13b", "llama2-13b": "llama-2-13b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "qwen/qwen2-7b": "qwen2-7b", "huggingfacetb/smollm2-135m": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m", "default": "smollm2-135m",
})


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-token costs of one decoder-only model (all layers unless ``_layer`` says so)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int
    linear_flops_per_token: float  # QKV, O and MLP projections, all layers
    linear_weight_bytes: float  # their weights, read once per step
    activation_bytes_per_token: float  # linear-layer inputs and outputs, all layers
    lm_head_flops_per_row: float  # only rows that sample
    lm_head_bytes: float
    weight_bytes: float  # everything resident on the compute device
    kv_bytes_per_token: int  # K and V, all layers
    kv_bytes_per_token_layer: int
    attn_flops_per_pair_layer: float  # one query token against one KV token, one layer

    @classmethod
    def from_config(cls, name: str, c: ModelConfig, dtype_bytes: int = 2) -> ModelProfile:
        q, kv, h, i = c.q_size, c.kv_size, c.hidden_size, c.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
        act_per_layer = 4 * h + 2 * q + 2 * kv + 3 * i
        embed = c.vocab_size * h
        lm_head = embed  # tied or not, the LM head reads a vocab x hidden matrix
        kv_layer = 2 * c.num_kv_heads * c.head_dim * dtype_bytes
        return cls(
            name=name, num_layers=c.num_layers, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=h,
            vocab_size=c.vocab_size, max_model_len=c.max_position_embeddings,
            dtype_bytes=dtype_bytes,
            linear_flops_per_token=2.0 * c.num_layers * per_layer,
            linear_weight_bytes=float(c.num_layers * per_layer * dtype_bytes),
            activation_bytes_per_token=float(c.num_layers * act_per_layer * dtype_bytes),
            lm_head_flops_per_row=2.0 * lm_head,
            lm_head_bytes=float(lm_head * dtype_bytes),
            weight_bytes=float((c.num_layers * per_layer + embed
                                + (0 if c.tie_word_embeddings else lm_head)) * dtype_bytes),
            kv_bytes_per_token=c.num_layers * kv_layer,
            kv_bytes_per_token_layer=kv_layer,
            attn_flops_per_pair_layer=4.0 * c.num_heads * c.head_dim,
        )

    @property
    def params(self) -> float:
        return self.weight_bytes / self.dtype_bytes


def model_names() -> list[str]:
    return sorted(HF_CONFIGS)


def load_model_profile(name_or_path: str, dtype_bytes: int = 2) -> ModelProfile:
    """A built-in model by name (see ``model_names``), or a ``config.json`` (or its folder)."""
    key = _ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in HF_CONFIGS:
        return ModelProfile.from_config(key, ModelConfig.from_hf_config(HF_CONFIGS[key]),
                                        dtype_bytes)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: choose one of {model_names()} or "
                         f"pass a Hugging Face config.json path")
    config = ModelConfig.from_hf_config(json.loads(path.read_text()))
    return ModelProfile.from_config(path.parent.name or path.stem, config, dtype_bytes)

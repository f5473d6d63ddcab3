"""Model hyper-parameters for the Llama family (Llama, Mistral, Qwen2).

`ModelConfig` is the single description of a model shape that the model code, the KV
store and the cost model share. It is built from a Hugging Face ``config.json`` dict
(`ModelConfig.from_hf_config`) or from GGUF metadata (see ``loader.py``).

Invariants (checked in ``__post_init__``):
  * ``num_heads % num_kv_heads == 0`` (grouped-query attention groups are whole);
  * ``head_dim`` is even (rotary embeddings rotate pairs of halves);
  * ``rope_scaling`` is None or a dict whose ``rope_type`` is in `SUPPORTED_ROPE_TYPES`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# "default" means plain RoPE; it is normalised to rope_scaling=None.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("llama3", "linear")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of one Llama-family decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Dicts are unhashable, so this field is left out of __hash__ (it still takes part in ==).
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Bias on the Q/K/V projections (Qwen2 always; Llama when attention_bias=true).
    attention_bias: bool = False
    # Bias on the output projection (Llama with attention_bias=true; never Qwen2).
    attention_out_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported_message(self.architecture))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _validate_rope_scaling(self.rope_scaling)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def q_size(self) -> int:
        """Width of the query projection output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises ValueError for architectures or features this engine does not implement,
        rather than silently producing a model that computes something else.
        """
        arch = _architecture_of(d)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // num_heads
        rope_theta, rope_scaling = _rope_from_hf(d)
        llama_bias = bool(d.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(d, is_qwen2),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            attention_out_bias=(not is_qwen2) and llama_bias,
        )


def _unsupported_message(name: str) -> str:
    return f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _architecture_of(d: dict[str, Any]) -> str:
    for arch in d.get("architectures") or ():
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = d.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    shown = (d.get("architectures") or [None])[0] or model_type
    raise ValueError(_unsupported_message(str(shown)))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = dict(d.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings when this key is absent.
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **scaling}


def _max_positions(d: dict[str, Any], is_qwen2: bool) -> int:
    max_pos = int(d.get("max_position_embeddings", 2048))
    window = d.get("sliding_window")
    uses_window = bool(d.get("use_sliding_window", False)) if is_qwen2 else window is not None
    # The attention backends attend to the full context, which equals sliding-window
    # attention as long as no sequence outgrows the window: cap the context there.
    if uses_window and window:
        max_pos = min(max_pos, int(window))
    return max_pos


def _validate_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = _LLAMA3_KEYS if rope_type == "llama3" else ("factor",)
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} is missing keys {missing}")

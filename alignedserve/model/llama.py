"""Plain PyTorch Llama-family decoder (Llama, Mistral, Qwen2).

The model owns no KV cache. Each forward call processes T tokens that may belong to many
sequences, flattened into one dimension so every linear layer runs once over all of them;
attention is delegated to an `AttentionBackend`, which owns the cache and knows which
tokens belong to which sequence.

Call order: construct (or load via ``loader.load_model``), then per engine step
``hidden = model(input_ids, positions, attn)`` followed by
``logits = model.compute_logits(hidden[rows_to_sample])``, under ``torch.inference_mode()``
(the model itself does not disable autograd).

Weights are stored fused (``qkv_proj`` = [q; k; v] rows, ``gate_up_proj`` = [gate; up]
rows) so that each block does two GEMMs where Hugging Face does five; `load_weights`
accepts Hugging Face tensor names and does the fusing.

Every op runs through the model's `Kernels` (``alignedserve.kernels``), chosen when the
model is built: norms, RoPE, SiLU·up and attention's kernels are its methods, and the linear
layers are `PackedLinear` modules prepared for it by the loader. There is one forward pass:
prefill, decode and mixed steps, every path and dtype, all run this code (float32 routes
every op to the PyTorch reference, so it stays bit-identical to transformers).

The module tree is built for speed: inside a layer, submodules are reached through
``self._modules`` and called by ``.forward``, and parameters read from ``_parameters``.
``nn.Module.__getattr__`` and ``__call__`` (hook dispatch) each cost about a microsecond,
which a decode step would pay ~20 times per layer around kernels that take a few
microseconds each; the model registers no hooks, so nothing is skipped but the lookups.
"""

from __future__ import annotations

import math
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignedserve.kernels import Kernels, kernels_for_path
from alignedserve.model.config import ModelConfig


class AttentionBackend(Protocol):
    """Attention over the KV cache for the T flattened tokens of one engine step.

    ``q``: [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim], with rotary
    embeddings already applied to q and k (they may be non-contiguous views). The backend
    stores k and v in its cache for ``layer`` and returns the attention output
    [T, num_heads, head_dim] using softmax scale 1/sqrt(head_dim) and causal masking
    within each sequence. It is called once per layer, layers in increasing order.
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class DenseCausalAttention:
    """Reference backend for ONE sequence and no cache: the T tokens are the whole
    sequence, in position order. Used by tests and as a numerical reference."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # 4-D inputs with enable_gqa: 3-D ones fall back to the slow math kernel on CPU,
        # and enable_gqa avoids materialising repeated kv heads.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Rotary inverse frequencies [head_dim / 2] in float32, with any scaling applied,
    computed exactly as Hugging Face does so that logits match bit-for-bit in float32."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(config: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """float32 [max_position_embeddings, head_dim]: row p is cat(cos(p*f), sin(p*f))."""
    inv_freq = rope_inv_freq(config).to(device)
    positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as HF Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, k: Kernels) -> Tensor:
        return k.rms_norm(x, self._parameters["weight"], self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor | None,
                     k: Kernels) -> tuple[Tensor, Tensor]:
        """``residual += x`` (maybe in place), then normalise: returns (normed, residual).
        With no residual yet (the first layer) ``x`` starts the stream."""
        weight = self._parameters["weight"]
        if residual is None:
            return k.rms_norm(x, weight, self.eps), x
        return k.add_rms_norm(x, residual, weight, self.eps)


class LlamaAttention(nn.Module):
    """Fused-QKV projection + rotary; the attention itself is the backend's job."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.split_sizes), bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.attention_out_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                k: Kernels) -> Tensor:
        t = x.shape[0]
        linears = self._modules
        q, key, value = k.qkv_rotary(linears["qkv_proj"], x, cos, sin, self.num_heads,
                                     self.num_kv_heads, self.head_dim)
        out = attn(self.layer_idx, q, key, value)
        return linears["o_proj"].forward(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU with gate and up fused into one GEMM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, k: Kernels) -> Tensor:
        linears = self._modules
        return linears["down_proj"].forward(k.swiglu(linears["gate_up_proj"], x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)).

    The residual stream is threaded through explicitly so that each residual add fuses with
    the norm after it: a layer takes the previous layer's MLP output ``x`` and the stream
    ``residual`` (None for the first layer, whose ``x`` is the embedding) and returns its own
    MLP output and the stream, still to be added.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor,
                attn: AttentionBackend, k: Kernels) -> tuple[Tensor, Tensor]:
        parts = self._modules
        normed, residual = parts["input_layernorm"].add_and_norm(x, residual, k)
        normed, residual = parts["post_attention_layernorm"].add_and_norm(
            parts["self_attn"].forward(normed, cos, sin, attn, k), residual, k)
        return parts["mlp"].forward(normed, k), residual


# HF projection name -> (our fused module name, shard name).
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_SHARDS_OF = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over flattened tokens; see the module docstring.

    Invariant: ``rope_cache`` is float32 [max_position_embeddings, head_dim] on the
    parameters' device; every position passed to `forward` must be below
    ``config.max_position_embeddings``. ``kernels`` runs every op (default: the PyTorch
    reference); linear layers take its compiled kernels once ``kernels.linear.pack_linears``
    has prepared them (the loader does).
    """

    rope_cache: Tensor

    def __init__(self, config: ModelConfig, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels or kernels_for_path("reference")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models read the embedding matrix in compute_logits instead.
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("rope_cache", rope_table(config), persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """input_ids, positions: int64 [T] -> final-normed hidden states [T, hidden]."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        k = self.kernels
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, attn, k)
        return self.norm.add_and_norm(h, residual, k)[0]

    def rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, head_dim / 2] in ``dtype`` for ``positions``: one gather per step, which
        every layer reuses."""
        return self.rope_cache[positions].to(dtype).chunk(2, dim=-1)

    def compute_logits(self, hidden: Tensor, widen: bool = True) -> Tensor:
        """[N, hidden] -> logits [N, vocab]: float32, or with ``widen=False`` the model's dtype
        (the sampler widens what it needs; a greedy argmax does not)."""
        logits = (F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None
                  else self.lm_head(hidden))
        return logits.float() if widen else logits

    def greedy_tokens(self, hidden: Tensor) -> list[int] | None:
        """[N, hidden] -> each row's greedy token (the first maximum of its logits, as the
        sampler's argmax picks it), from the LM head's greedy epilogue, which never stores the
        logits; None where the head has none (then `compute_logits` and the sampler)."""
        argmax = getattr(self.lm_head, "argmax", None)
        return argmax(hidden) if argmax is not None else None

    def reset_rotary(self) -> None:
        """Recompute ``rope_cache`` in float32 on the parameters' device (needed after
        ``to_empty()``, which leaves buffers uninitialised)."""
        self.rope_cache = rope_table(self.config, self.embed_tokens.weight.device)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...)
        into the fused parameters, casting to each parameter's dtype, then rebuild the
        rotary table. Valid on a model materialised with ``to_empty()``.

        Raises ValueError on an unknown name, a shape mismatch, or any parameter (shard)
        left unfilled, so a partially loaded model can never be returned.
        """
        params = dict(self.named_parameters())
        filled: set[tuple[str, str | None]] = set()
        for hf_name, tensor in weights:
            target = self._map_hf_name(hf_name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} (maps to {name!r})")
            dst = self._shard_view(params[name], shard)
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, "
                    f"model {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            filled.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in self._expected_slots(params) - filled)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
        self.reset_rotary()

    def _map_hf_name(self, hf_name: str) -> tuple[str, str | None] | None:
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return None  # derived from the config, not a weight
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # some tied checkpoints still store a copy
        parts = name.split(".")
        # layers.{i}.{self_attn|mlp}.{proj}.{weight|bias}
        if len(parts) == 5 and parts[0] == "layers" and parts[3] in _FUSED:
            fused, shard = _FUSED[parts[3]]
            return ".".join((*parts[:3], fused, parts[4])), shard
        return name, None

    def _shard_view(self, param: Tensor, shard: str | None) -> Tensor:
        if shard is None:
            return param
        cfg = self.config
        offsets = {
            "q": (0, cfg.q_size),
            "k": (cfg.q_size, cfg.kv_size),
            "v": (cfg.q_size + cfg.kv_size, cfg.kv_size),
            "gate": (0, cfg.intermediate_size),
            "up": (cfg.intermediate_size, cfg.intermediate_size),
        }
        start, size = offsets[shard]
        return param.narrow(0, start, size)

    @staticmethod
    def _expected_slots(params: dict[str, Tensor]) -> set[tuple[str, str | None]]:
        slots: set[tuple[str, str | None]] = set()
        for name in params:
            module = name.split(".")[-2]
            for shard in _SHARDS_OF.get(module, (None,)):
                slots.add((name, shard))
        return slots

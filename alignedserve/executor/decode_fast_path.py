"""A decode step's forward pass without the module tree: the same kernels, called directly.

In a decode-only step each layer runs ten small compiled kernels (two norms, four linears,
RoPE, attention, SiLU·up). Reaching them through ``LlamaDecoderLayer`` → ``LlamaAttention``
→ ``PackedLinear`` → ``ops`` costs Python time per call (module dispatch, per-call routing
checks, environment lookups) on the thread that starts every parallel region, while the other
core spins: perf put ~16% of a 64-row step's wall time there. `DecodeFastPath` keeps each
layer's weights in a flat tuple and calls the kernels back to back: ~2.5 ms less per step at
any batch size (64 rows x 640 tokens 65.5 -> 62.9 ms, 8 x 500 19.3 -> 16.8 ms; see
docs/architecture.md, "The bf16 CPU step").

Invariant: for the inputs it accepts (`applies`) it calls exactly the kernels the module path
calls for them, in the same order and with the same arguments, so its output is bit-identical
to ``LlamaForCausalLM.forward`` (tests/test_decode_fast_path.py). It accepts only what the
module path would route to those kernels: bf16 weights on CPU with the compiled kernels
loaded and not disabled, every layer linear holding AMX tiles (``PackedLinear.tiles``), at
most ``amx_max_rows`` rows, and a decode-only ``StepAttention`` (no prefill chunks) whose
caches the decode kernel takes. Anything else keeps using the model's own forward.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from alignedserve.executor.attention import StepAttention
from alignedserve.executor.kernels import (amx_linear_kernels, decode_kernel_rejects,
                                           kernels_disabled)
from alignedserve.model.llama import LlamaForCausalLM
from alignedserve.model.packed_linear import PackedLinear


class _Layer(NamedTuple):
    """One decoder layer's tensors, in the order the forward pass uses them."""

    input_norm: Tensor
    qkv: Tensor      # AMX tiles
    qkv_bias: Tensor | None
    o: Tensor        # AMX tiles
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor  # AMX tiles (no bias in Llama MLPs)
    down: Tensor     # AMX tiles


class DecodeFastPath:
    """Callable like ``model(input_ids, positions, attn)`` for decode-only steps."""

    def __init__(self, model: LlamaForCausalLM, kernels: ModuleType, max_rows: int) -> None:
        config = model.config
        self.model = model
        self.kernels = kernels
        self.max_rows = max_rows
        self.heads, self.kv_heads, self.head_dim = (config.num_heads, config.num_kv_heads,
                                                    config.head_dim)
        self.splits = (config.q_size, config.kv_size, config.kv_size)
        self.eps = model.norm.eps
        self.layers = [_Layer(layer.input_layernorm.weight, layer.self_attn.qkv_proj.tiles,
                              layer.self_attn.qkv_proj.bias, layer.self_attn.o_proj.tiles,
                              layer.self_attn.o_proj.bias, layer.post_attention_layernorm.weight,
                              layer.mlp.gate_up_proj.tiles, layer.mlp.down_proj.tiles)
                       for layer in model.layers]

    @classmethod
    def build(cls, model: torch.nn.Module) -> DecodeFastPath | None:
        """The fast path for ``model``, or None where the module path would not take the AMX
        kernels (another dtype or device, no AMX, linears not packed, norms with eps that
        differ between layers)."""
        kernels = amx_linear_kernels()
        if kernels is None or not isinstance(model, LlamaForCausalLM) or not model.layers:
            return None
        linears = [lin for layer in model.layers for lin in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        if not all(isinstance(lin, PackedLinear) and lin.tiles is not None for lin in linears):
            return None
        norms = [model.norm] + [n for layer in model.layers
                                for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.eps != model.norm.eps or n.weight.dtype != torch.bfloat16
               or n.weight.device.type != "cpu" or n.weight.dim() != 1
               or not n.weight.is_contiguous() for n in norms):
            return None
        if model.embed_tokens.weight.dtype != torch.bfloat16:
            return None
        return cls(model, kernels, min(lin.amx_max_rows for lin in linears))

    def applies(self, rows: int, attn: object) -> bool:
        """Whether this step may take the fast path (checked once per step)."""
        return (isinstance(attn, StepAttention) and not attn.prefills
                and 0 < rows <= self.max_rows and len(attn.decode_caches) == rows
                and not kernels_disabled() and not torch.is_grad_enabled()
                and decode_kernel_rejects(self.head_dim, "cpu", attn.decode_caches) is None)

    def __call__(self, input_ids: Tensor, positions: Tensor, attn: StepAttention) -> Tensor:
        """Final-normed hidden states [rows, hidden], as ``LlamaForCausalLM.forward``."""
        k = self.kernels
        heads, kv_heads, dim, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, h.dtype)
        rows = h.shape[0]
        caches, pos, scale, tiled = (attn.decode_caches, attn.decode_positions, attn.scale,
                                     attn.tiled)
        residual = None
        for index, layer in enumerate(self.layers):
            if residual is None:  # the first layer: the stream is the embedding itself
                residual, normed = h, k.rms_norm(h, layer.input_norm, eps)
            else:  # add_rms_norm writes the sum into residual
                normed = k.add_rms_norm(h, residual, layer.input_norm, eps)
            qkv = k.amx_linear(normed, layer.qkv, layer.qkv_bias)
            k.rotary_qkv_(qkv, cos, sin, heads, kv_heads, dim)
            q, key, value = qkv.split(self.splits, dim=-1)
            out = k.decode_attention(q.view(rows, heads, dim), key.view(rows, kv_heads, dim),
                                     value.view(rows, kv_heads, dim), caches, pos, index, scale,
                                     tiled)
            attended = k.amx_linear(out.view(rows, heads * dim), layer.o, layer.o_bias)
            normed = k.add_rms_norm(attended, residual, layer.post_norm, eps)
            h = k.amx_linear(k.silu_mul(k.amx_linear(normed, layer.gate_up, None)), layer.down,
                             None)
        return k.add_rms_norm(h, residual, self.model.norm.weight, eps)

"""Fused elementwise ops of the Llama block: compiled bf16 kernels with PyTorch references.

Each public op (`rms_norm`, `add_rms_norm`, `rotary_qkv`, `silu_mul`) runs the C++ kernel
from ``alignedserve/csrc/fused.cpp`` when it can, else its ``*_reference``, which is the
model's plain PyTorch code. The kernel is used only when all tensors are bfloat16 on CPU, no
autograd graph is wanted, ``ALIGNEDSERVE_NO_KERNELS`` is not set, the extension built, and the
layout is direct (2-d, unit stride on the last dim; rows may be strided). Everything else,
float32 in particular, takes the reference: float32 results must stay bit-identical to
Hugging Face transformers.

The kernels round to bf16 exactly where the reference's bf16 ops do, so on torch's x86 builds
their results are bit-identical to it (fused.cpp states the rare 1-ulp caveats of another
ATen). The two in-place ops differ by path in what happens to their inputs: the kernel path of
`add_rms_norm` writes the sum into ``residual``, and that of `rotary_qkv` rotates ``qkv`` in
place and returns views of it, while the references leave their inputs alone. Callers must use
the returned tensors and not rely on the inputs being either updated or preserved.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from alignedserve.executor.kernels import kernels_disabled, load_kernels


def kernels_for(*tensors: Tensor) -> ModuleType | None:
    """The compiled module if it may take these tensors (dtype/device/autograd), else None."""
    # Plain loops and is_cpu: this runs ~4 times per layer per step, so it is kept to ~1 us.
    for t in tensors:
        if t.dtype != torch.bfloat16 or not t.is_cpu:
            return None
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return None  # the kernels have no backward
    if kernels_disabled():
        return None
    return load_kernels()


def _rows(t: Tensor) -> bool:
    """2-d with a unit-stride last dim: the layout the kernels index directly."""
    return t.dim() == 2 and t.stride(1) == 1


def _disjoint_rows(t: Tensor) -> bool:
    """Rows that do not overlap in memory (required where the kernel writes in place)."""
    return t.shape[0] <= 1 or t.stride(0) >= t.shape[1]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [T, H] with weight [H]: ``w * r(x * rsqrt(mean(x^2) + eps))``.

    The statistics are float32 and the normalised value is cast back to x's dtype before the
    weight (as Hugging Face Llama does). Returns a new tensor; x is not modified.
    """
    module = kernels_for(x, weight)
    if module is not None and _rows(x) and weight.dim() == 1 and weight.is_contiguous():
        return module.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """PyTorch RMSNorm, exactly the model's original code."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """``residual = residual + x``, then ``(rms_norm(residual), residual)``.

    x, residual: [T, H] (x must not partially overlap residual). Kernel path: the sum is
    written into ``residual`` and the returned residual is that same tensor; reference path:
    a new tensor. Use the returned one either way.
    """
    module = kernels_for(x, residual, weight)
    if (module is not None and _rows(x) and _rows(residual) and _disjoint_rows(residual)
            and weight.dim() == 1 and weight.is_contiguous()):
        return module.add_rms_norm(x, residual, weight, eps), residual
    return add_rms_norm_reference(x, residual, weight, eps)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    """PyTorch residual add + RMSNorm; returns (normed, new residual), inputs untouched."""
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (Hugging Face convention). x: [T, heads, D]; cos, sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split fused qkv [T, (H + 2*KVH) * D] into q [T, H, D], k, v [T, KVH, D] with RoPE on q, k.

    cos, sin: [T, D/2] or [T, 1, D/2] (the model's views), rows may be strided. For each head,
    with halves x1, x2: ``(x1*cos - x2*sin, x2*cos + x1*sin)``. v is never modified. Kernel
    path: qkv is rotated in place and q, k, v are views of it; reference path: new q, k.
    """
    if cos.dim() == 3:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    module = kernels_for(qkv, cos, sin)
    if (module is not None and _rows(qkv) and _disjoint_rows(qkv) and _rows(cos)
            and _rows(sin)):
        module.rotary_qkv_(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
        t = qkv.shape[0]
        q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim), dim=-1)
        return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
                v.view(t, num_kv_heads, head_dim))
    return rotary_qkv_reference(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


def rotary_qkv_reference(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int,
                         num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch split + RoPE, exactly the model's original code; cos, sin: [T, D/2]."""
    t = qkv.shape[0]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim), dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    q = apply_rotary(q.view(t, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(t, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(t, num_kv_heads, head_dim)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU activation: gate_up [T, 2*I] = [gate | up] -> ``silu(gate) * up`` [T, I]."""
    module = kernels_for(gate_up)
    if module is not None and _rows(gate_up):
        return module.silu_mul(gate_up)
    return silu_mul_reference(gate_up)


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """PyTorch SwiGLU activation, exactly the model's original code."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

"""Linear layers with weights prepared once for the kernel path: ``PackedLinear``.

``F.linear`` on a bf16 CPU tensor asks oneDNN for a matmul and lets it reorder the weight into
its blocked layout on every call; at decode shapes (tens of rows) that reorder is a large
share of the call. A `PackedLinear` keeps the weight in the layout of the kernel that takes
each batch size on its path (``Kernels.path``):

* ``amx``: AMX tiles (``csrc/small_gemm.cpp``) up to ``AMX_MAX_ROWS`` rows
  (``AMX_MAX_ROWS_LM_HEAD`` for the 49k-wide LM head, where oneDNN catches up sooner), then
  oneDNN's prepacked call up to ``PACKED_MAX_ROWS``, then plain ``F.linear``; with
  ``Kernels.batch_invariant``, AMX tiles at every row count;
* ``avx512_bf16`` and ``avx512``: the AVX-512 kernel (``csrc/linear_avx512.cpp``: vdpbf16ps,
  or without AVX512-BF16 the same products from FMAs) at every row count;
* ``avx2``: the AVX2 FMA kernel (``csrc/linear_avx2.cpp``) at every row count (oneDNN has no
  bf16 matmul below AVX512-BF16, and torch's fallback is far slower);
* ``reference``, float32 weights, other devices: plain ``F.linear`` (float32 must stay
  bit-identical to transformers).

Where the path's own kernel takes every batch size (``avx512_bf16``, ``avx512``, ``avx2``),
`pack_linears` then drops each layer's unpacked weight (`PackedLinear.release_weight`): the
packing is the only copy the model holds, so its linears cost their size once, not twice.

The AMX and AVX-512 kernels have epilogues (`OwnKernel`), each bit-identical to the plain
product followed by the separate op, which never store the product and read it back:

* a fused qkv projection whose heads have 64 dims (``rotary_cols``: its q and k columns) is
  packed with each of those heads' 16-row blocks in the order dims [0, 16), [32, 48),
  [16, 32), [48, 64) (`swap_rotary_quarters`), so that each block pair holds the two halves
  rotate-half RoPE mixes, and `PackedLinear.rotary` asks the kernel for the rotated q and k
  (``rotary_qkv(forward(x))``);
* a fused ``[gate | up]`` projection (``swiglu=True``) is packed with its 16-row blocks
  interleaved (gate 0, up 0, gate 1, ...), and `PackedLinear.silu_mul` asks the kernel for
  ``silu(gate) * up`` (``silu_mul(forward(x))``);
* an LM head gives each row's greedy token (`PackedLinear.argmax`) without its logits.

On the amx path they run where the AMX kernel does (up to ``kernel_max_rows``); above that
the caller takes oneDNN's product of the natural weight and the separate op.

The AMX, AVX-512 and AVX2 kernels compute every output element as the same sequence of
products and sums whatever the batch, so a row's result does not depend on the rows beside
it; oneDNN's blocking, and so its rounding, changes with the row count (hence the amx
path's ``batch_invariant`` switch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignedserve.kernels.dispatch import Kernels

log = logging.getLogger(__name__)

PACKED_MAX_ROWS = 256  # oneDNN: above this many rows the plain call is as fast
AMX_MAX_ROWS = 1024  # AMX tiles win up to here on the layers' shapes
AMX_MAX_ROWS_LM_HEAD = 128  # ... and up to here on the LM head
_PACK_HINT_ROWS = 64  # oneDNN picks its blocking for this batch size
_SWIGLU_BLOCK = 16  # rows per gate / up block of the interleaved packing (the kernel's zmm)
ROTARY_HEAD_DIM = 64  # head width the rotary epilogue takes: one 64-column panel of the kernel
_EVERY_ROW_COUNT = 1 << 62  # kernel_max_rows of a path whose own kernel takes any batch


def interleave_gate_up(t: Tensor) -> Tensor:
    """Rows (or bias entries) of a ``[gate | up]`` tensor reordered into 16-row blocks gate 0,
    up 0, gate 1, up 1, ...; the first dim must be a multiple of 32."""
    blocks = t.shape[0] // (2 * _SWIGLU_BLOCK)
    return t.reshape(2, blocks, _SWIGLU_BLOCK, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def deinterleave_gate_up(y: Tensor) -> Tensor:
    """Columns of an interleaved product ``[rows, 2 I]`` back in ``[gate | up]`` order."""
    blocks = y.shape[1] // (2 * _SWIGLU_BLOCK)
    return y.reshape(y.shape[0], blocks, 2, _SWIGLU_BLOCK).transpose(1, 2).reshape(y.shape)


def swap_rotary_quarters(t: Tensor, rotary_cols: int, dim: int = 0) -> Tensor:
    """``t`` with, along ``dim``, each 64-wide head among its first ``rotary_cols`` entries
    reordered as dims [0, 16), [32, 48), [16, 32), [48, 64) (the second and third quarters
    swapped); a new tensor. Its own inverse: it packs a qkv weight's rows (or bias) for the
    rotary epilogue and restores a product's columns computed from such a packing."""
    heads = rotary_cols // ROTARY_HEAD_DIM
    moved = t.movedim(dim, 0)
    head = moved[:rotary_cols].reshape(heads, 4, ROTARY_HEAD_DIM // 4, *moved.shape[1:])
    swapped = head[:, [0, 2, 1, 3]].reshape(rotary_cols, *moved.shape[1:])
    return torch.cat((swapped, moved[rotary_cols:])).movedim(0, dim)


def onednn_packing_supported(weight: Tensor) -> bool:
    """True when oneDNN can prepack ``weight``: bf16 on CPU, with oneDNN bf16 in this torch."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def path_linear(kernels: Kernels, weight: Tensor) -> tuple[Callable, Callable] | None:
    """(kernel, packer) of the path's own any-row-count linear (AVX-512 or AVX2) for a
    bf16 CPU ``weight``; None where the path has none (AMX, reference) or the weight does not
    qualify."""
    name = "avx512" if kernels.avx512 else "avx2" if kernels.avx2 else None
    if name is None or weight.dtype != torch.bfloat16 or not weight.is_cpu:
        return None
    return getattr(kernels.ext, f"linear_{name}"), getattr(kernels.ext, f"pack_weight_{name}")


@dataclass(frozen=True)
class OwnKernel:
    """The path's own linear kernel for one weight: ``linear(x, tiles, bias[, swiglu, cos,
    sin, rotary_cols])`` over ``pack(weight)``, taking up to ``max_rows`` rows; where it has
    the epilogues (AMX and AVX-512), ``rotary`` (the rotary epilogue's q, k, v call) and
    ``argmax`` (the greedy epilogue), else None."""

    linear: Callable
    pack: Callable
    max_rows: int
    rotary: Callable | None = None
    argmax: Callable | None = None

    @property
    def epilogues(self) -> bool:
        """Whether the kernel has the SwiGLU, RoPE and greedy epilogues."""
        return self.argmax is not None


def own_kernel(kernels: Kernels, weight: Tensor, lm_head: bool = False) -> OwnKernel | None:
    """`OwnKernel` of the path for a bf16 CPU ``weight`` (``lm_head``: an LM head, whose AMX
    kernel hands over to oneDNN sooner), or None where the path has none for it: the reference
    path, other dtypes and devices, and AMX shapes the tiles do not take (out_features % 16,
    in_features % 32)."""
    ext = kernels.ext
    if kernels.amx:
        out_features, in_features = weight.shape
        if (out_features % 16 or in_features % 32 or weight.dtype != torch.bfloat16
                or not weight.is_cpu):
            return None
        max_rows = (_EVERY_ROW_COUNT if kernels.batch_invariant
                    else AMX_MAX_ROWS_LM_HEAD if lm_head else AMX_MAX_ROWS)
        return OwnKernel(ext.amx_linear, ext.pack_weight, max_rows, ext.amx_linear_rotary_qkv,
                         ext.amx_linear_argmax)
    own = path_linear(kernels, weight)
    if own is None:
        return None
    if kernels.avx512:
        return OwnKernel(*own, _EVERY_ROW_COUNT, ext.linear_avx512_rotary_qkv,
                         ext.linear_avx512_argmax)
    return OwnKernel(*own, _EVERY_ROW_COUNT)


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` for 2-D ``x`` through the kernel ``kernels`` picks per
    batch size (see the module docstring); N-D ``x`` takes ``F.linear``.

    Invariant: ``tiles`` (the path's own kernel layout: AMX tiles, AVX-512 or AVX2 panels) and
    ``packed`` (oneDNN's) are ``weight`` reordered, each None where no batch size uses it, and
    never go stale: weights are frozen after loading. ``weight`` may be shared with another
    module (a tied LM head reads the embedding matrix), or None once `release_weight` dropped
    it (``tiles`` is then the only copy, and every call goes to the path's own kernel).
    ``fused_swiglu``: ``tiles`` holds the interleaved packing (module docstring), and so does
    ``kernel_bias``, the bias as the kernel takes it. ``fused_rotary_cols`` > 0: ``tiles`` and
    ``kernel_bias`` hold the rotary packing of that many leading output features
    (`swap_rotary_quarters`), and `forward` restores the natural column order.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, kernels: Kernels,
                 lm_head: bool = False, swiglu: bool = False, rotary_cols: int = 0) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape  # as nn.Linear names them
        self.kernel_bias = bias
        self.kernel_max_rows = 0  # rows up to which the path's own kernel runs
        self.fused_swiglu = False
        self.fused_rotary_cols = 0
        self._kernel = None
        self._rotary_kernel = None  # the rotary epilogue (`rotary`), for a rotary packing
        self._argmax_kernel = None  # the greedy epilogue (`argmax`), for a plain-packed LM head
        tiles = None
        own = own_kernel(kernels, weight, lm_head)
        if own is not None:
            self._kernel = own.linear
            self.kernel_max_rows = own.max_rows
            epilogues = own.epilogues
            self.fused_swiglu = (swiglu and epilogues
                                 and self.out_features % (2 * _SWIGLU_BLOCK) == 0)
            if (epilogues and rotary_cols > 0 and rotary_cols % ROTARY_HEAD_DIM == 0
                    and rotary_cols <= self.out_features
                    and self.out_features % (2 * _SWIGLU_BLOCK) == 0 and not self.fused_swiglu):
                self.fused_rotary_cols = rotary_cols
            if self.fused_swiglu:
                tiles = own.pack(interleave_gate_up(weight.detach()))
                if bias is not None:
                    self.kernel_bias = interleave_gate_up(bias.detach())
            elif self.fused_rotary_cols:
                self._rotary_kernel = own.rotary
                tiles = own.pack(swap_rotary_quarters(weight.detach(), rotary_cols))
                if bias is not None:
                    self.kernel_bias = swap_rotary_quarters(bias.detach(), rotary_cols)
            else:
                tiles = own.pack(weight.detach())
                if lm_head and epilogues:
                    self._argmax_kernel = own.argmax
        self.register_buffer("tiles", tiles, persistent=False)
        self.packed_max_rows = (PACKED_MAX_ROWS if self.kernel_max_rows < PACKED_MAX_ROWS
                                and onednn_packing_supported(weight) else 0)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), _PACK_HINT_ROWS) if self.packed_max_rows else None,
            persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        # Registered members are read from their dicts: nn.Module.__getattr__ costs about as
        # much as a decode-sized kernel call's own overhead, and this runs ~120 times a step.
        bias = self._parameters["bias"] if "bias" in self._parameters else self.bias
        if x.dim() == 2:
            rows = x.shape[0]
            if rows <= self.kernel_max_rows and x.stride(1) == 1:
                if self.fused_swiglu:
                    return deinterleave_gate_up(
                        self._kernel(x, self._buffers["tiles"], self.kernel_bias))
                if self.fused_rotary_cols:
                    return swap_rotary_quarters(
                        self._kernel(x, self._buffers["tiles"], self.kernel_bias),
                        self.fused_rotary_cols, dim=1)
                return self._kernel(x, self._buffers["tiles"], bias)
            if rows <= self.packed_max_rows:
                return torch.ops.mkldnn._linear_pointwise(x, self._buffers["packed"], bias,
                                                          "none", [], "")
        weight = self._parameters["weight"]
        if weight is None:  # released: the path's own kernel takes every call as dense rows
            dense = x.reshape(-1, x.shape[-1]).contiguous()
            return self.forward(dense).view(*x.shape[:-1], -1)
        return F.linear(x, weight, bias)

    def release_weight(self) -> bool:
        """Drop this module's unpacked ``weight`` where the path's own kernel takes every call
        (any row count; `forward` hands it N-d and strided inputs as dense 2-D rows), so a
        packed model does not hold its linear weights twice. Returns whether it dropped it.

        Meant for a weight no other module shares: a tied LM head's matrix is the
        embedding's, and `pack_linears` leaves that head's reference in place."""
        if self.kernel_max_rows < _EVERY_ROW_COUNT or self._parameters["weight"] is None:
            return False
        self.weight = None
        return True

    def silu_mul(self, x: Tensor) -> Tensor | None:
        """``silu(gate) * up`` of this ``[gate | up]`` projection of rows x [T, in], in one
        kernel call, where it was packed for that (``fused_swiglu``) and x is dense rows, at most
        ``kernel_max_rows`` of them; else None (the caller applies its own ``silu_mul`` to
        `forward`'s output)."""
        if (self.fused_swiglu and x.dim() == 2 and x.stride(1) == 1
                and x.shape[0] <= self.kernel_max_rows):
            return self._kernel(x, self._buffers["tiles"], self.kernel_bias, True)
        return None

    def argmax(self, x: Tensor) -> list[int] | None:
        """For each row of x [T, in], the index of the first maximum of this layer's bf16
        output (the values `forward` returns), from the kernel's greedy epilogue, which never
        stores the [T, out] product (an LM head's logits). None where this packing has no such
        kernel, x is not dense rows or has more than ``kernel_max_rows``, or an output is a NaN
        (the caller then takes `forward` and its own argmax)."""
        if (self._argmax_kernel is None or x.dim() != 2 or x.stride(1) != 1 or not x.shape[0]
                or x.shape[0] > self.kernel_max_rows):
            return None
        bias = self._parameters["bias"] if "bias" in self._parameters else self.bias
        tokens = self._argmax_kernel(x, self._buffers["tiles"], bias).tolist()
        return None if -1 in tokens else tokens

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor, num_heads: int,
               num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(q, k, v): this qkv projection of rows x [T, in] with rotate-half RoPE on its q
        and k heads (cos, sin: [T, 32] bf16), in one kernel call, as views of one product:
        bit-identical to `forward` followed by ``Kernels.rotary_qkv``. None where it was not
        packed for that, x is not dense rows or has more than ``kernel_max_rows``, or cos /
        sin are not 2-d bf16 (the caller does the two steps)."""
        if (self.fused_rotary_cols and x.dim() == 2 and x.stride(1) == 1
                and x.shape[0] <= self.kernel_max_rows and cos.dim() == 2
                and sin.dim() == 2 and cos.dtype == sin.dtype == torch.bfloat16
                and (num_heads + num_kv_heads) * ROTARY_HEAD_DIM == self.fused_rotary_cols):
            return self._rotary_kernel(x, self._buffers["tiles"], self.kernel_bias, cos, sin,
                                       num_heads, num_kv_heads)
        return None


def pack_linears(model: nn.Module, kernels: Kernels) -> int:
    """Replace every bf16 CPU ``nn.Linear`` in ``model`` by a `PackedLinear` for ``kernels``;
    return how many (0 on the reference path and for other dtypes or devices).

    A model with a tied LM head (``lm_head is None``) gets a packed head that shares the
    embedding matrix, so ``compute_logits`` takes the fast path too. A ``qkv_proj`` whose
    parent names its heads (``num_heads``, ``num_kv_heads``, ``head_dim`` = 64) is packed for
    the rotary epilogue.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if kernels.ext is None or not targets:
        return 0
    weight = targets[0][1].weight
    if path_linear(kernels, weight) is None and not onednn_packing_supported(weight):
        return 0
    try:
        for name, linear in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            packed = PackedLinear(linear.weight, linear.bias, kernels,
                                  lm_head=name == "lm_head", swiglu=attr == "gate_up_proj",
                                  rotary_cols=_rotary_cols(parent, attr))
            packed.release_weight()  # the module owned it; its packing is the only copy now
            setattr(parent, attr, packed)
        if getattr(model, "lm_head", "absent") is None:
            model.lm_head = PackedLinear(model.embed_tokens.weight, None, kernels, lm_head=True)
    except RuntimeError as exc:  # a oneDNN build without the op: plain linears still work
        log.warning("weight prepacking failed, using plain linear layers: %s", exc)
        return 0
    return len(targets)


def _rotary_cols(parent: nn.Module, attr: str) -> int:
    """The q and k columns of a fused qkv projection ``parent.attr`` whose heads the rotary
    epilogue takes (64 dims); 0 for any other linear."""
    if attr != "qkv_proj" or getattr(parent, "head_dim", 0) != ROTARY_HEAD_DIM:
        return 0
    return (parent.num_heads + parent.num_kv_heads) * ROTARY_HEAD_DIM

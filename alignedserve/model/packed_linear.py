"""Prepacked bf16 linear layers for small CPU batches (decode steps).

``F.linear`` on a bf16 CPU tensor asks oneDNN for a matmul and lets it reorder the weight into
its blocked (AMX/AVX-512) layout on every call. For a step of a few hundred tokens or fewer
that reorder is a large share of the call: measured on the 2-core Sapphire Rapids VM, prepacked
weights make decode-shaped GEMMs (64 rows) 1.3-1.5x faster and the 49k-vocab LM head ~2x. At
prefill shapes (1024 rows) the plain call is as fast or faster, so each layer keeps both forms
and picks by the number of rows.

Where the CPU has AMX-BF16, batches of up to ``AMX_MAX_ROWS`` rows go to our own kernel
(``alignedserve/csrc/small_gemm.cpp``) instead: it streams each weight once in AMX tile order
and is 1.3-2.4x faster than oneDNN's prepacked call at 4-128 rows (measured on the 2-core
VM, 30 distinct layer weights so they come from memory, see docs/architecture.md); summed
over a layer's four shapes it is 1.25x / 1.4x / 1.1x faster than plain ``F.linear`` at
512 / 768 / 1024 rows and 0.7x at 1536 (it re-reads the activations once per 32 output
columns). The 49k-wide LM head only ties with oneDNN from 64 rows and loses at 256, so it
stops at ``AMX_MAX_ROWS_LM_HEAD``. The kernel's results do not depend on the batch a row is
in. A layer whose every small batch goes to the kernel gets no oneDNN copy.

Only bf16 weights on CPU are packed; float32 keeps plain ``F.linear`` (the float32 path must
stay bit-identical to Hugging Face transformers). ``pack_linears`` is a no-op where torch has
no oneDNN bf16 support.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignedserve.executor.kernels import amx_linear_kernels

log = logging.getLogger(__name__)

PACKED_MAX_ROWS = 256  # above this many rows the plain call wins (see the module docstring)
AMX_MAX_ROWS = 1024  # layers: up to this many rows the AMX kernel wins (module docstring)
AMX_MAX_ROWS_LM_HEAD = 128  # the LM head: up to here it wins or ties
_PACK_HINT_ROWS = 64  # oneDNN picks its blocking for this batch size


def packing_supported(weight: Tensor) -> bool:
    """True when ``weight`` can be prepacked: bf16 on CPU, with oneDNN bf16 in this torch."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _amx_tiles(weight: Tensor) -> tuple[ModuleType | None, Tensor | None]:
    """The AMX kernel module and ``weight`` in its tile layout, or (None, None) where the
    kernel is unavailable or the shape is not whole tiles (out % 16, in % 32)."""
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % 32:
        return None, None
    module = amx_linear_kernels()
    if module is None:
        return None, None
    return module, module.pack_weight(weight.detach())


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` for 2-D ``x``, with prepacked copies of ``weight``.

    Invariant: ``packed`` (oneDNN's layout, or None where the AMX kernel takes every batch
    oneDNN would) and ``tiles`` (the AMX kernel's, or None) are ``weight`` reordered and never
    go stale, because weights are frozen after loading (the model is inference-only).
    ``weight`` may be shared with another module (a tied LM head reads the embedding matrix).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, max_rows: int = PACKED_MAX_ROWS,
                 amx_max_rows: int = AMX_MAX_ROWS):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        self.bias = bias
        self.max_rows = max_rows
        self.amx_max_rows = amx_max_rows
        self._amx, tiles = _amx_tiles(weight)
        self.register_buffer("tiles", tiles, persistent=False)
        # oneDNN's copy only where some batch size would use it (not when AMX covers them all).
        needs_onednn = tiles is None or amx_max_rows < max_rows
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), _PACK_HINT_ROWS) if needs_onednn else None, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            rows = x.shape[0]
            if self._amx is not None and rows <= self.amx_max_rows and x.stride(1) == 1:
                return self._amx.amx_linear(x, self.tiles, self.bias)
            if rows <= self.max_rows and self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none",
                                                          [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` in ``model`` by a `PackedLinear`; return how many.

    A model with a tied LM head (``lm_head is None``) gets a packed head that shares the
    embedding matrix, so ``compute_logits`` takes the fast path too.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if not targets or not packing_supported(targets[0][1].weight):
        return 0
    try:
        for name, linear in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            amx_rows = AMX_MAX_ROWS_LM_HEAD if name == "lm_head" else AMX_MAX_ROWS
            setattr(parent, attr, PackedLinear(linear.weight, linear.bias, amx_max_rows=amx_rows))
        if getattr(model, "lm_head", "absent") is None:
            model.lm_head = PackedLinear(model.embed_tokens.weight, None,
                                         amx_max_rows=AMX_MAX_ROWS_LM_HEAD)
    except RuntimeError as exc:  # a oneDNN build without the op: plain linears still work
        log.warning("weight prepacking failed, using plain linear layers: %s", exc)
        return 0
    return len(targets)

"""`Kernels`: every op of the forward pass on one instruction-set path, chosen once.

An engine, a model and a sampler hold one `Kernels` (``select_kernels()`` at start-up); ops
are its methods. Each op takes the compiled kernel of the path where the kernel applies —
bfloat16 tensors on CPU in the layout it indexes — and the PyTorch reference
(``reference.py``) everywhere else: float32 (bit-identical to transformers), other devices,
the ``reference`` path, tensors that want autograd. Routing checks are O(1) per call; the
elementwise ops leave them to the build (its ``try_*`` entry points run the kernel or return
None), as a decode step's Python runs with cold caches and each tensor attribute call in a
Python check costs microseconds there.

What each path runs (see ``isa.py`` for the paths):

========================  ==========================  ==============  ==============  =============
op                        amx                         avx512_bf16     avx512          avx2
========================  ==========================  ==============  ==============  =============
linears (``linear.py``)   AMX tiles, oneDNN above     AVX512-BF16     as avx512_bf16  AVX2 FMA
                          1024 rows (LM head: 128)    (any rows)      (emulated dot)  (any rows)
prefill attention         AMX                         AVX512-BF16     as avx512_bf16  AVX2
                                                                      (emulated dot)
decode attention          AMX over tiled bf16         AVX512-BF16     AVX-512 FMA     AVX2 FMA
                          caches, AVX-512 FMA         over tiled bf16                 (tiled bf16
                          otherwise                   caches, AVX-512                 caches too)
                                                      FMA otherwise
norms, RoPE, SiLU·up      AVX-512                     AVX-512         AVX-512         AVX2
argmax                    AVX-512                     AVX-512         AVX-512         portable C++
========================  ==========================  ==============  ==============  =============

The ``avx512`` path runs the ``avx512_bf16`` path's linear and prefill kernels with each
``vdpbf16ps`` built from two AVX-512F FMAs (``csrc/bf16_pairs.h``). On these two and on amx
(where the AMX linear runs), RoPE is the epilogue of the qkv linear, SiLU·up that of the
gate_up linear (``swiglu``), and a step whose rows are all plain greedy takes its argmax from
the LM head's epilogue (``PackedLinear.argmax``) instead of the logits.

The in-place ops differ by implementation in what happens to their inputs: the compiled
``add_rms_norm`` writes the sum into ``residual`` and ``rotary_qkv`` rotates ``qkv`` in place
(returning views of it), while the references leave their inputs alone. Callers use the
returned tensors and rely on the inputs being neither updated nor preserved.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from alignedserve.kernels import isa, reference
from alignedserve.kernels.build import load_extension
from alignedserve.kernels.kv_layout import CAPACITY_MULTIPLE

log = logging.getLogger(__name__)

_DECODE_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e5m2)
_MAX_HEAD_DIM = 256
_BF16 = torch.bfloat16


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step's decode rows (``Kernels.decode_rows``): the caches and positions that every
    layer's `Kernels.decode_attention_over` attends over, and, where the compiled kernel takes
    them, its own form of them (``compiled``): the rows checked and their work planned once
    for all layers, so a layer's call does not revisit every row's tensors."""

    caches: list[Tensor]
    positions: Tensor
    tiled: bool
    compiled: object | None  # the extension's DecodeRows; None where the reference runs


class Kernels:
    """The ops of one path (``path``) over its compiled build (``ext``; None: reference).

    Invariant: ``ext`` is a build whose ``compiled_path()`` is ``path``, loaded only where
    ``path`` can run (``isa.runnable_paths``: the CPU supports it, or amx on emulated tiles);
    ``amx`` is True only where that build has the AMX kernels and the OS granted tile state.
    Instances are immutable and shared (``kernels_for_path``).

    ``batch_invariant``: every op gives a row the same bits whatever else shares its step, at
    any step size. Every path but ``amx`` is built that way and unchanged by it; on ``amx``
    it makes the AMX linear take every row count, where by default steps of more than
    ``linear.AMX_MAX_ROWS`` rows (and LM heads of more than ``AMX_MAX_ROWS_LM_HEAD``) go to
    oneDNN, faster there but with a rounding that depends on the row count. (A layer whose
    shape no kernel of the path takes stays on torch's linear, on every path.)
    """

    def __init__(self, path: str, ext: ModuleType | None, batch_invariant: bool = False) -> None:
        self.path = path
        self.ext = ext
        self.batch_invariant = batch_invariant
        self.amx = ext is not None and path == "amx" and bool(ext.amx_available())
        # Tiles emulated in software (isa.amx_emulated): the amx path's logic, not its speed.
        self.amx_emulated = self.amx and bool(ext.amx_emulated())
        # The AVX-512 linear and prefill kernels: vdpbf16ps, or its AVX-512F equivalent.
        self.avx512 = ext is not None and path in ("avx512_bf16", "avx512")
        self.avx2 = ext is not None and path == "avx2"
        # Row units are the dot-product decode kernel's read order where they read faster.
        self.row_units = ext is not None and path == "avx512_bf16" and isa.decode_row_units()
        # Bytes its per-head items keep requested ahead of their reads, where that is faster.
        self.read_ahead = (isa.decode_read_ahead()
                           if ext is not None and path == "avx512_bf16" else 0)

    def __repr__(self) -> str:
        return f"Kernels({self.path!r})"

    @property
    def name(self) -> str:
        """The path as logs, ``/version``, metrics and records name it: ``path``, marked where
        the amx path runs on emulated tiles, so no figure is taken for the hardware's."""
        return f"{self.path} (emulated tiles)" if self.amx_emulated else self.path

    def decode_read_order(self) -> str:
        """How the decode attention reads KV where that is chosen per CPU ("" elsewhere), for
        the start-up log and the notes of an in-process benchmark run."""
        notes = ["row units"] if self.row_units else []
        if self.read_ahead:
            notes.append(f"{self.read_ahead} bytes read ahead")
        return ", ".join(notes)

    def enter_thread(self) -> None:
        """Make this thread's first parallel loop in the compiled build now.

        ATen's inlined ``at::parallel_for`` keeps, per shared library and per thread, a flag
        "thread count initialised"; the library's first loop in a thread sets the thread's
        OpenMP count to the process-wide default, whatever the thread set before. A thread
        that runs on its own count (``SplitForward``'s workers) calls this once, while the
        default is its own count, so that later kernel calls keep it."""
        if self.ext is not None:
            self.ext.try_rms_norm(torch.zeros(2, 64, dtype=_BF16), torch.ones(64, dtype=_BF16),
                                  1e-6)

    # ------------------------------------------------------------ elementwise and sampling

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm of x [T, H] (``reference.rms_norm``); a new tensor, x unchanged."""
        out = self.ext.try_rms_norm(x, weight, eps) if self.ext is not None else None
        return out if out is not None else reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        """``residual + x`` and its RMSNorm: (normed, residual). The compiled path writes the
        sum into ``residual`` and returns it; use the returned residual either way."""
        out = (self.ext.try_add_rms_norm(x, residual, weight, eps) if self.ext is not None
               else None)
        if out is not None:
            return out, residual
        return reference.add_rms_norm(x, residual, weight, eps)

    def rotary_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        """Split fused qkv into q, k, v with RoPE on q and k (``reference.rotary_qkv``);
        cos, sin: [T, D/2] or [T, 1, D/2]. The compiled path rotates ``qkv`` in place and
        returns views of it."""
        if self.ext is not None:
            views = self.ext.try_rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
            if views is not None:
                return views
        return reference.rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def qkv_rotary(self, qkv_proj: torch.nn.Module, x: Tensor, cos: Tensor,
                   sin: Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        """`rotary_qkv` of a fused qkv projection of x: one call into the projection where
        it applies RoPE itself (``PackedLinear.rotary``, bit-identical), else the projection,
        then `rotary_qkv`. q, k, v are views of one [T, (H + 2 KVH) D] product either way on
        the compiled paths."""
        fused = getattr(qkv_proj, "rotary", None)
        views = fused(x, cos, sin, num_heads, num_kv_heads) if fused is not None else None
        if views is not None:
            return views
        return self.rotary_qkv(qkv_proj.forward(x), cos, sin, num_heads, num_kv_heads,
                               head_dim)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """SwiGLU activation ``silu(gate) * up`` of gate_up [T, 2 I] = [gate | up]."""
        out = self.ext.try_silu_mul(gate_up) if self.ext is not None else None
        return out if out is not None else reference.silu_mul(gate_up)

    def swiglu(self, gate_up_proj: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """``silu(gate) * up`` of a fused [gate | up] projection of x: one call into the
        projection where it computes that itself (``PackedLinear.silu_mul``, bit-identical),
        else `silu_mul` of its output."""
        fused = getattr(gate_up_proj, "silu_mul", None)
        out = fused(x) if fused is not None else None
        return out if out is not None else self.silu_mul(gate_up_proj(x))

    def argmax_rows(self, logits: Tensor) -> list[int]:
        """Each row's first largest index (a row holding NaN: torch's max decides)."""
        tokens = self.ext.try_argmax_rows(logits) if self.ext is not None else None
        if tokens is None:
            return reference.argmax_rows(logits)
        for i, token in enumerate(tokens):
            if token < 0:  # the kernel's NaN signal
                tokens[i] = int(logits[i].max(dim=-1).indices)
        return tokens

    # ------------------------------------------------------------------------ attention

    def decode_kernel_rejects(self, head_dim: int, device_type: str,
                              caches: list[Tensor]) -> str | None:
        """Why the compiled decode kernel cannot take a call (None: it can). O(1): only
        properties that route a whole call are screened; row-level problems (a row of
        another dtype, a position past capacity) raise ValueError in the kernel."""
        if self.ext is None:
            return f"the {self.path} path has no compiled kernels"
        if head_dim % 16 or not 0 < head_dim <= _MAX_HEAD_DIM:
            return f"head_dim {head_dim} is not a multiple of 16 up to {_MAX_HEAD_DIM}"
        if device_type != "cpu":
            return f"inputs on {device_type}"
        if caches and caches[0].dtype not in _DECODE_DTYPES:
            return f"cache dtype {caches[0].dtype}"
        return None

    def decode_attention(self, q: Tensor, k_new: Tensor, v_new: Tensor, caches: list[Tensor],
                         positions: Tensor, layer: int, scale: float,
                         tiled: bool = False) -> Tensor:
        """Append each row's new K/V at ``positions[b]`` and attend over ``0..positions[b]``
        (exact semantics: ``reference.decode_attention``)."""
        reason = self.decode_kernel_rejects(q.shape[-1], q.device.type, caches)
        if reason is None:
            return self.ext.decode_attention(q, k_new, v_new, caches, positions, layer, scale,
                                             tiled, self.row_units, self.read_ahead)
        if self.ext is not None:
            _warn_once(f"decode-attention kernel skipped ({reason}); using the reference")
        return reference.decode_attention(q, k_new, v_new, caches, positions, layer, scale,
                                          tiled)

    def decode_rows(self, caches: list[Tensor], positions: Tensor,
                    tiled: bool = False) -> DecodeRows:
        """The decode rows of one step (``caches[b]`` takes its new K/V at ``positions[b]``),
        for `decode_attention_over`. Bad caches or positions raise ValueError here, from the
        compiled kernel's checks, or at the first layer's call on the reference."""
        compiled = None
        if caches and self.decode_kernel_rejects(caches[0].shape[-1], caches[0].device.type,
                                                 caches) is None:
            compiled = self.ext.DecodeRows(caches, positions, tiled)
        return DecodeRows(caches, positions, tiled, compiled)

    def decode_attention_over(self, q: Tensor, k_new: Tensor, v_new: Tensor, rows: DecodeRows,
                              layer: int, scale: float) -> Tensor:
        """`decode_attention` over ``rows`` (see `decode_rows`): the same results."""
        if rows.compiled is not None:  # the kernel checks q's device (ValueError)
            return self.ext.decode_attention_rows(q, k_new, v_new, rows.compiled, layer, scale,
                                                  self.row_units, self.read_ahead)
        return self.decode_attention(q, k_new, v_new, rows.caches, rows.positions, layer,
                                     scale, rows.tiled)

    def tiled_kv_applies(self, dtype: torch.dtype, head_dim: int, granularity: int,
                         device: torch.device) -> bool:
        """Whether KV caches of this kind use ``kv_layout``'s tiled layout: every compiled
        path (the decode kernels take pairs of bf16 straight from it: into AMX tiles, into
        ``vdpbf16ps``, or widened for fp32 FMA with no horizontal sums), bf16 on CPU, head_dim
        64, capacities in multiples of 16."""
        return (self.ext is not None and dtype == _BF16 and head_dim == 64
                and device.type == "cpu"
                and granularity % CAPACITY_MULTIPLE == 0)

    def prefill_kernel_applies(self, q: Tensor) -> bool:
        """Whether `prefill_attention` takes chunks with queries like ``q`` (bf16 on CPU, a
        head_dim the path's kernel takes: % 32 with AMX or AVX-512, % 8 with AVX2); else
        the caller uses ``reference.prefill_attention`` (SDPA)."""
        dim = q.shape[-1]
        if q.dtype != _BF16 or not q.is_cpu or dim > _MAX_HEAD_DIM or self.ext is None:
            return False
        return dim % 8 == 0 if self.avx2 else dim % 32 == 0

    def prefill_attention(self, q: Tensor, keys: Tensor, values: Tensor, start: int,
                          scale: float, tiled: bool = False) -> Tensor:
        """Causal attention of queries q [T, H, D] at positions start.. over keys / values
        [KVH, start + T, D] (token-major), or a tiled cache's K and V planes (``tiled``:
        [KVH, start + T rounded up to 16, D]); SDPA's semantics with a bottom-right causal
        mask and GQA. A query's result depends only on its own position's keys and values,
        not on how the prompt was cut into chunks. Call only where
        `prefill_kernel_applies`."""
        if self.amx:
            return self.ext.prefill_attention(q, keys, values, start, scale, tiled)
        if self.avx512:
            return self.ext.prefill_attention_avx512(q, keys, values, start, scale, tiled)
        return self.ext.prefill_attention_avx2(q, keys, values, start, scale, tiled)

    def write_tiled(self, cache: Tensor, layer: int, k: Tensor, v: Tensor, start: int) -> None:
        """Store k, v [T, KVH, D] at positions start.. of a tiled cache's layer ``layer``."""
        if self.ext is not None:
            self.ext.write_tiled(cache, layer, k, v, start)
        else:
            reference.write_tiled(cache, layer, k, v, start)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """Log each distinct fallback reason once per process (the cache is the 'seen' set)."""
    log.warning(message)


@functools.lru_cache(maxsize=None)
def kernels_for_path(path: str, batch_invariant: bool = False) -> Kernels:
    """The `Kernels` of ``path`` (built on first use; ``batch_invariant``: see `Kernels`).
    Raises ValueError for an unknown path or one this CPU lacks, RuntimeError when its build
    fails or (AMX) the OS refuses tile state; `select_kernels` turns those into a fallback."""
    isa.check_path(path)
    if path == "reference":
        return Kernels(path, None, batch_invariant)
    ext = load_extension(path)
    if ext is None:
        raise RuntimeError(f"the {path} kernels did not build (see the log above)")
    if ext.compiled_path() != path:
        raise RuntimeError(f"the {path} build targets {ext.compiled_path()}")
    kernels = Kernels(path, ext, batch_invariant)
    if path == "amx" and not kernels.amx:
        raise RuntimeError("the OS did not grant AMX tile state")
    return kernels


def select_kernels(path: str | None = None, batch_invariant: bool = False) -> Kernels:
    """The kernels to run: ``path`` if given, else ``ALIGNEDSERVE_ISA``, else the best path
    this CPU supports (``batch_invariant``: see `Kernels`). A path that cannot run here (build
    failed, AMX not granted) falls to the next lower one with a warning; naming a path the CPU
    lacks is a ValueError.

    Forcing a lower path than the CPU's best also caps oneDNN (torch's bf16 GEMMs, used where
    our kernels do not apply) at the same instruction set through ``ONEDNN_MAX_CPU_ISA``,
    unless that is set already; oneDNN reads it once, at its first GEMM in the process.
    """
    wanted = path or isa.requested_path()
    if wanted is not None:
        isa.check_path(wanted)
        if wanted != isa.cpu_paths()[0]:
            _cap_onednn(wanted)
    runnable = isa.runnable_paths()
    candidates = runnable[runnable.index(wanted):] if wanted else isa.cpu_paths()
    for candidate in candidates:
        try:
            return kernels_for_path(candidate, batch_invariant)
        except RuntimeError as exc:
            log.warning("kernel path %s unavailable (%s); trying the next one", candidate, exc)
    raise AssertionError("the reference path cannot fail")


def _cap_onednn(path: str) -> None:
    ceiling = isa.ONEDNN_CEILING.get(path)
    if ceiling and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        os.environ["ONEDNN_MAX_CPU_ISA"] = ceiling
        log.info("kernel path %s forced: ONEDNN_MAX_CPU_ISA=%s", path, ceiling)

"""CPU kernels: a small C++ extension (decode attention, and the fused bf16 elementwise ops
used through ``alignedserve.model.ops``) with pure-PyTorch reference fallbacks.

``decode_attention`` is this module's entry point for attention (the fused ops are reached
through ``alignedserve.model.ops``). It calls the compiled kernel
(``alignedserve/csrc/attention.cpp``) when it is available and supports the inputs, and
otherwise ``decode_attention_reference``, which has the same semantics. Both:

* write ``k_new[b]`` / ``v_new[b]`` into ``caches[b][layer, 0/1, :, positions[b]]`` first;
* then attend ``q[b]`` over cache positions ``0..positions[b]`` inclusive, query head ``h``
  reading kv head ``h // (num_heads // num_kv_heads)``, softmax(scale * q.k) accumulated in
  float32, and return ``[B, num_heads, head_dim]`` in ``q``'s dtype.

Nothing else in any cache is modified. With ``tiled=True`` the caches are bf16 in
``kv_layout``'s AMX tile layout (chosen per engine by ``tiled_kv_applies``); positions mean
the same, only the element order inside each plane differs.

The kernel is built once per machine with
``torch.utils.cpp_extension.load`` into ``$ALIGNEDSERVE_CACHE/torch_extensions`` (default
``~/.cache/alignedserve``) and memoised per process; a failed build is logged once and the
reference is used from then on. ``ALIGNEDSERVE_NO_KERNELS=1`` forces the reference (read at
every call, so tests can flip it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from alignedserve.executor import kv_layout

log = logging.getLogger(__name__)

_EXT_NAME = "alignedserve_attention"
_SOURCES = ("attention.cpp", "fused.cpp", "prefill_attention.cpp", "small_gemm.cpp")
_KERNEL_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e5m2)
_MAX_HEAD_DIM = 256


def kernels_disabled() -> bool:
    """True when ``ALIGNEDSERVE_NO_KERNELS=1`` asks for the pure-PyTorch path."""
    return os.environ.get("ALIGNEDSERVE_NO_KERNELS", "") == "1"


def cache_root() -> Path:
    """Root of AlignedServe's per-machine cache (``$ALIGNEDSERVE_CACHE`` or ~/.cache/...)."""
    return Path(os.environ.get("ALIGNEDSERVE_CACHE", Path.home() / ".cache" / "alignedserve"))


def _machine_tag() -> str:
    """Short hash of what the binary depends on beyond its sources.

    ``-march=native`` code runs only on CPUs with the same features, and the extension's ABI
    follows the torch build and the Python interpreter, so all of these name the build dir: a
    home directory shared by different machines or environments gets one build per
    combination instead of a crash or two environments rebuilding each other's binary
    (torch's own rebuild check hashes only sources and flags).
    """
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = f"{torch.__version__}|{sys.version}|{sys.prefix}|{flags}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _ensure_ninja_on_path() -> None:
    """Make torch use the ``ninja`` that pip installed next to this interpreter, if any.

    torch looks ninja up on PATH only, and a venv's console scripts run without the venv's bin
    dir on PATH: without it a build fails where no other ninja exists, and where one does
    (e.g. /usr/bin/ninja 1.11 beside the venv's 1.13) the two versions hash commands
    differently in the build dir's .ninja_log, so each one sees the other's build as stale and
    every switch between an activated and a plain launch rebuilt the extension (~30 s in the
    first step). Side effect: that one directory goes first on PATH.
    """
    bin_dir = Path(sys.executable).parent
    own = bin_dir / "ninja"
    if own.exists() and Path(shutil.which("ninja") or "") != own:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.lru_cache(maxsize=1)
def load_kernels() -> ModuleType | None:
    """Build (first time on this machine) and import the extension; None if that fails.

    Memoised: the build or import is attempted at most once per process, and a failure is
    logged once. Concurrent processes are serialised by torch's lock file in the build dir.
    """
    from torch.utils import cpp_extension

    csrc = Path(__file__).resolve().parent.parent / "csrc"
    build_dir = cache_root() / "torch_extensions" / f"{_EXT_NAME}-{_machine_tag()}"
    start = time.perf_counter()
    try:
        _ensure_ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=_EXT_NAME,
            sources=[str(csrc / s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # any build/import failure must degrade, not crash the engine
        # The compiler output sits inside the message; cap it so the log stays readable.
        log.warning("compiled kernels (decode attention, fused bf16 ops) unavailable, using "
                    "the PyTorch references (slower): %s", str(exc)[-4000:])
        return None
    log.info("compiled kernels ready in %.1f s (%s, %s)",
             time.perf_counter() - start, module.compiled_path(), build_dir)
    return module


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """Log each distinct fallback reason once per process (the cache is the 'seen' set)."""
    log.warning(message)


def decode_kernel_rejects(head_dim: int, device_type: str,
                          caches: list[torch.Tensor]) -> str | None:
    """Why the compiled decode kernel cannot take a call with queries of ``head_dim`` on
    ``device_type`` over ``caches`` (None: it can).

    O(1) on purpose (a Python pass over 64 caches costs ~50 us, 5% of the kernel): only
    properties that route a whole call elsewhere are screened. Row-level problems (a row of
    another dtype, device or layout, a position past capacity) raise ValueError in the kernel.
    """
    if head_dim % 16 or not 0 < head_dim <= _MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 16 up to {_MAX_HEAD_DIM}"
    if device_type != "cpu":
        return f"inputs on {device_type}"
    if caches and caches[0].dtype not in _KERNEL_DTYPES:
        return f"cache dtype {caches[0].dtype} (kernel takes {_KERNEL_DTYPES})"
    return None


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     caches: list[torch.Tensor], positions: torch.Tensor, layer: int,
                     scale: float, tiled: bool = False) -> torch.Tensor:
    """Append each row's new K/V at ``positions[b]`` and attend over ``0..positions[b]``.

    Shapes: q [B, H, D]; k_new, v_new [B, KVH, D] (cast to the cache dtype); caches[b]
    [layers, 2, KVH, capacity_b, D]; positions int64 [B] on CPU. Returns [B, H, D] in q's
    dtype. See the module docstring for the exact semantics shared with the reference.
    ``tiled``: the caches use ``kv_layout``'s tiled layout (made only where
    ``tiled_kv_applies``); the AMX kernel then rounds q and the probabilities to bf16.
    """
    if not kernels_disabled():
        reason = decode_kernel_rejects(q.shape[-1], q.device.type, caches)
        module = load_kernels() if reason is None else None
        if module is not None:
            return module.decode_attention(q, k_new, v_new, caches, positions, layer, scale,
                                           tiled)
        if reason is not None:
            _warn_once(f"decode-attention kernel skipped ({reason}); using the PyTorch reference")
    return decode_attention_reference(q, k_new, v_new, caches, positions, layer, scale, tiled)


def decode_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                               caches: list[torch.Tensor], positions: torch.Tensor, layer: int,
                               scale: float, tiled: bool = False) -> torch.Tensor:
    """Pure-PyTorch decode attention with exactly ``decode_attention``'s semantics.

    One matmul -> softmax -> matmul per row in float32, GQA by viewing the row's query heads
    as [kv_heads, group, dim]. Correct for any dtype/head_dim; slower than the kernel.
    """
    rows, heads, dim = q.shape
    if len(caches) != rows or positions.numel() != rows:
        raise ValueError("decode_attention: need one cache and one position per row")
    pos_list = positions.tolist()
    for cache, pos in zip(caches, pos_list):  # validate all rows before mutating any
        if not 0 <= layer < cache.shape[0]:
            raise ValueError(f"decode_attention: layer {layer} out of range for {cache.shape[0]}")
        if not 0 <= pos < cache.shape[3]:
            raise ValueError(f"decode_attention: position {pos} outside capacity {cache.shape[3]}")
    out = torch.empty_like(q)
    for b, (cache, pos) in enumerate(zip(caches, pos_list)):
        if tiled:
            kv_layout.write(cache[layer, 0], pos, k_new[b].unsqueeze(1), kv_layout.KEYS)
            kv_layout.write(cache[layer, 1], pos, v_new[b].unsqueeze(1), kv_layout.VALUES)
            k = kv_layout.read(cache[layer, 0], pos + 1, kv_layout.KEYS).float()
            v = kv_layout.read(cache[layer, 1], pos + 1, kv_layout.VALUES).float()
        else:
            cache[layer, 0, :, pos].copy_(k_new[b])
            cache[layer, 1, :, pos].copy_(v_new[b])
            k = cache[layer, 0, :, : pos + 1].float()  # [kv_heads, n, dim]
            v = cache[layer, 1, :, : pos + 1].float()
        qg = q[b].float().reshape(k.shape[0], heads // k.shape[0], dim)
        probs = torch.softmax(torch.matmul(qg, k.transpose(1, 2)) * scale, dim=-1)
        out[b] = torch.matmul(probs, v).reshape(heads, dim).to(q.dtype)
    return out


def _kernels_with(available: str) -> ModuleType | None:
    """The compiled module if kernels are not disabled and its ``available()`` check (e.g.
    ``"amx_linear_available"``: built with AMX-BF16, tile state granted by the OS) passes."""
    if kernels_disabled():
        return None
    module = load_kernels()
    return module if module is not None and getattr(module, available)() else None


def tiled_kv_applies(dtype: torch.dtype, head_dim: int, granularity: int,
                     device: torch.device) -> bool:
    """Whether KV caches of this kind should use ``kv_layout``'s tiled layout: bf16 on CPU,
    head_dim 64, capacities in multiples of 16, and a build and CPU with AMX-BF16."""
    if (dtype != torch.bfloat16 or head_dim != 64 or device.type != "cpu"
            or granularity % kv_layout.CAPACITY_MULTIPLE):
        return False
    return _kernels_with("tiled_kv_available") is not None


def amx_linear_kernels() -> ModuleType | None:
    """The compiled module if it has the AMX small-batch linear (``amx_linear``); else None."""
    return _kernels_with("amx_linear_available")


def prefill_kernel_applies(q: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` takes this step's prefill chunks: a build and CPU with
    AMX-BF16, bf16, head_dim % 32 == 0. At any chunk size: it beats SDPA from 16 tokens up
    (1.5-2x over token-major caches, 2-4x over tiled ones, which SDPA must read back first;
    docs/architecture.md), so there is no small-chunk threshold any more."""
    dim = q.shape[-1]
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or dim % 32 or dim > _MAX_HEAD_DIM:
        return False
    return _kernels_with("prefill_attention_available") is not None


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                      scale: float, tiled: bool = False) -> torch.Tensor:
    """Causal attention of prefill queries ``q`` [T, H, D] (absolute positions start..start+T-1)
    over ``keys`` / ``values`` [KVH, start + T, D] on the AMX kernel
    (``alignedserve/csrc/prefill_attention.cpp``); same semantics as SDPA with a bottom-right
    causal mask and GQA. ``tiled``: keys / values are instead a tiled cache's K and V planes
    (``kv_layout``). Call only where ``prefill_kernel_applies``."""
    module = load_kernels()
    assert module is not None, "prefill_attention without prefill_kernel_applies"
    return module.prefill_attention(q, keys, values, start, scale, tiled)


def write_tiled(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                start: int) -> None:
    """Store ``k``, ``v`` [T, KVH, D] at positions start.. of ``cache``'s layer ``layer``, in
    ``kv_layout``'s tiled layout (the compiled writer, or ``kv_layout.write``)."""
    module = None if kernels_disabled() else load_kernels()
    if module is not None:
        module.write_tiled(cache, layer, k, v, start)
        return
    kv_layout.write(cache[layer, 0], start, k.transpose(0, 1), kv_layout.KEYS)
    kv_layout.write(cache[layer, 1], start, v.transpose(0, 1), kv_layout.VALUES)

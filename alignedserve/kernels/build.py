"""Build (once per machine) and load the compiled kernels for one instruction-set path.

Every path except ``reference`` is one build of the same sources (``csrc/``) for a fixed
target, so a machine can hold and run the builds of every path its CPU supports (the tests
run them all side by side). Each source guards its code with the compiler's feature macros
(``__AVX512BF16__``, ``bf16_pairs.h``'s AVX-512 macro, AMX's in ``amx.h``), so a build
contains exactly the kernels its target can run, and reports which in ``compiled_path()``.

Builds go to ``$ALIGNEDSERVE_CACHE/torch_extensions`` (default ``~/.cache/alignedserve``),
one directory per path, torch build and interpreter, and are memoised per process; a failed
build is logged once and the caller falls back to a lower path.
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

from alignedserve.config import cache_root
from alignedserve.kernels import isa

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("module.cpp", "attention.cpp", "fused.cpp", "prefill_attention.cpp",
           "prefill_attention_avx512.cpp", "prefill_attention_avx2.cpp", "small_gemm.cpp",
           "linear_avx512.cpp", "linear_avx2.cpp")
_AVX512_BF16 = ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]
# The compiler target of each path; isa._REQUIRED_FLAGS lists the CPU flags they imply.
TARGET_FLAGS = {
    "amx": _AVX512_BF16 + ["-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": _AVX512_BF16,
    "avx512": ["-march=x86-64-v4"],
    "avx2": ["-march=x86-64-v3"],
}


def _build_tag(path: str) -> str:
    """Short hash of what a build depends on beyond its sources: the extension's ABI follows
    the torch build and the interpreter, and -mtune=native the CPU, so each names its own
    directory (torch's own rebuild check hashes only sources and flags). The CPU is named by
    its vendor, family, model and stepping as well as its model name, which a VM may show as
    just "AMD EPYC" on Zen 4 and Zen 5 hosts alike (a cache carried between them rebuilds)."""
    cpu = isa.cpu_info()
    key = (f"{path}|{torch.__version__}|{sys.version}|{sys.prefix}|{cpu.model_name}|"
           f"{cpu.vendor}|{cpu.family}|{cpu.model}|{cpu.stepping}")
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _ensure_ninja_on_path() -> None:
    """Make torch use the ``ninja`` that pip installed next to this interpreter, if any.

    torch looks ninja up on PATH only, and a venv's console scripts run without the venv's bin
    dir on PATH: without it a build fails where no other ninja exists, and where one does the
    two versions hash commands differently in the build dir's .ninja_log, so each one sees the
    other's build as stale and rebuilds. Side effect: that one directory goes first on PATH.
    """
    bin_dir = Path(sys.executable).parent
    own = bin_dir / "ninja"
    if own.exists() and Path(shutil.which("ninja") or "") != own:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


# The amx path's sources on emulated tiles (csrc/amx_emulated.h): an avx512_bf16 target.
EMULATED_AMX_FLAGS = [*_AVX512_BF16, "-DALIGNEDSERVE_AMX_EMULATED"]


def build_flags(path: str, emulated_amx: bool = False) -> list[str]:
    """Compiler flags of ``path``'s build (``emulated_amx``: the amx path on emulated tiles)."""
    target = EMULATED_AMX_FLAGS if emulated_amx else TARGET_FLAGS[path]
    return ["-O3", *target, "-mtune=native", "-fopenmp"]


def compile_extension(name: str, path: str, csrc: Path, build_dir: Path,
                      emulated_amx: bool = False) -> ModuleType:
    """The extension ``name`` built from every source in ``csrc`` (a tree like ``CSRC``) with
    ``path``'s flags (`build_flags`) in ``build_dir``, or reused from there when nothing
    changed. Raises what the build or the import raises."""
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name, sources=[str(csrc / s) for s in SOURCES],
        extra_cflags=build_flags(path, emulated_amx),
        extra_ldflags=["-fopenmp"], extra_include_paths=[str(csrc)],
        build_directory=str(build_dir), verbose=False)


@functools.lru_cache(maxsize=None)
def load_extension(path: str) -> ModuleType | None:
    """The compiled kernels of ``path`` (built the first time on this machine), or None if the
    build or import fails. Memoised per path; concurrent processes are serialised by torch's
    lock file in the build directory. Call only for paths that can run here
    (isa.runnable_paths): importing a build for a richer CPU may fault. The amx path where its
    tiles are emulated (isa.amx_emulated, as it is at the first call) is its own build."""
    emulated = path == "amx" and isa.amx_emulated()
    name = f"alignedserve_kernels_{path}" + ("_emulated" if emulated else "")
    build_dir = cache_root() / "torch_extensions" / f"{name}-{_build_tag(path)}"
    start = time.perf_counter()
    try:
        module = compile_extension(name, path, CSRC, build_dir, emulated)
    except Exception as exc:  # any build/import failure must degrade, not crash the engine
        # The compiler output sits inside the message; cap it so the log stays readable.
        log.warning("compiled kernels for %s unavailable: %s", path, str(exc)[-4000:])
        return None
    log.info("compiled kernels (%s) ready in %.1f s: %s", path, time.perf_counter() - start,
             build_dir)
    return module

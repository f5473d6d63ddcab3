"""The kernel layer: the one place that builds and loads compiled kernels and picks, once per
process, which implementation runs each op on this CPU.

* ``isa`` — the instruction-set paths (``amx``, ``avx512_bf16``, ``avx512``, ``avx2``,
  ``reference``), what this CPU supports, and the ``ALIGNEDSERVE_ISA`` override;
* ``build`` — one build of ``csrc/`` per path, made on first use and cached per machine;
* ``dispatch`` — `Kernels`, the ops of one path, `select_kernels`, and `DecodeRows` (a
  step's decode rows, checked once for every layer's decode attention);
* ``linear`` — `PackedLinear`, linear layers with weights prepared for the path;
* ``reference`` — the PyTorch semantics every compiled op implements;
* ``kv_layout`` — the tiled bf16 KV-cache layout the AMX and AVX512-BF16 decode kernels read.

Nothing here imports the model, the executor or the engine: they import this. The package
itself imports nothing heavy until a name is used (the CLI reads ``isa.PATHS`` without
loading torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alignedserve.kernels.dispatch import (DecodeRows, Kernels, kernels_for_path,
                                               select_kernels)
    from alignedserve.kernels.isa import PATHS, cpu_paths

_EXPORTS = {"Kernels": "dispatch", "DecodeRows": "dispatch", "kernels_for_path": "dispatch",
            "select_kernels": "dispatch", "PATHS": "isa", "cpu_paths": "isa"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

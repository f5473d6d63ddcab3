"""Shared pytest fixtures.

The default-model fixtures are session-scoped because loading costs seconds; tests that
use them are marked ``@pytest.mark.model`` (deselect with ``-m "not model"``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the cache if needed."""
    from alignedserve.model import default_model

    return default_model.default_model_path()


@pytest.fixture(scope="session")
def default_model_fp32(default_model_path: Path) -> Any:
    """Our LoadedModel for the default model, in float32 (for exact comparisons)."""
    from alignedserve.model.loader import load_model

    return load_model(default_model_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def default_model_hf_fp32(default_model_path: Path) -> torch.nn.Module:
    """transformers' own GGUF loading of the default model, float32: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


# ------------------------------------------------------------------------ kernel paths

def _emulate_amx_where_missing() -> None:
    """On a CPU without AMX, the tests run the amx path on emulated tiles (where the CPU runs
    the avx512_bf16 path; `isa.amx_emulated`): its kernels' logic is checked on every such
    machine. Only tests that name the amx path run it; the default path stays the CPU's best.
    An explicit ALIGNEDSERVE_AMX_EMULATE=0 turns this off."""
    from alignedserve.kernels import isa

    if "amx" not in isa.cpu_paths():
        os.environ.setdefault(isa.AMX_EMULATE_ENV, "1")


_emulate_amx_where_missing()


def path_skip_reason(path: str) -> str | None:
    """Why the tests cannot run kernel path ``path`` here, or None where they can (the amx path
    counts as runnable on emulated tiles: `isa.runnable_paths`)."""
    from alignedserve.kernels import isa

    if path in isa.runnable_paths():
        return None
    why = ""
    if path == "amx":
        why = (f" ({isa.AMX_EMULATE_ENV}=1 runs it on emulated tiles)"
               if "avx512_bf16" in isa.cpu_paths() else
               " (its emulated tiles need the avx512_bf16 path)")
    return (f"the {path} path needs CPU features this machine lacks: "
            f"{', '.join(isa.missing_flags(path))}{why}")


def kernel_path_params(paths: tuple[str, ...]) -> list[Any]:
    """pytest params for kernel paths, each skipped (saying why) where it cannot run here; the
    amx path runs on emulated tiles (id ``amx-emulated``) where the CPU lacks AMX."""
    from alignedserve.kernels import isa

    params = []
    for path in paths:
        reason = path_skip_reason(path)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        emulated = path == "amx" and reason is None and isa.amx_emulated()
        params.append(pytest.param(path, marks=marks, id="amx-emulated" if emulated else path))
    return params


def _compiled_paths() -> tuple[str, ...]:
    from alignedserve.kernels.isa import PATHS

    return tuple(p for p in PATHS if p != "reference")


@pytest.fixture(params=kernel_path_params(_compiled_paths()))
def compiled(request: pytest.FixtureRequest) -> Any:
    """The `Kernels` of each compiled path this CPU runs (its build must succeed: a failed
    build fails the test instead of hiding behind the reference)."""
    from alignedserve.kernels import kernels_for_path

    return kernels_for_path(request.param)


@pytest.fixture(scope="session")
def reference_kernels() -> Any:
    from alignedserve.kernels import kernels_for_path

    return kernels_for_path("reference")

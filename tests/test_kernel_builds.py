"""Every path's build compiles here, the paths this CPU cannot run included.

The suite builds and runs the paths this CPU has (tests/conftest.py's ``compiled``). A path it
lacks, most often ``amx`` (few machines here have AMX), would otherwise meet a change to the
shared sources only on a machine that has it: there the kernel tests fail (and the engine
falls back to a slower path with a warning, kernels.select_kernels), so whoever next draws
such a machine inherits a red suite. So each source is compiled here into an object file with
the missing path's compiler flags, as torch.utils.cpp_extension compiles it; nothing is
linked, loaded or executed, so instructions this CPU lacks never run.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from alignedserve.kernels.build import CSRC, SOURCES, build_flags
from alignedserve.kernels.isa import PATHS, cpu_paths

COMPILED_PATHS = [p for p in PATHS if p != "reference"]


def compile_source(source: str, path: str, out_dir: Path) -> subprocess.CompletedProcess:
    """``source`` compiled to an object file with ``path``'s flags (cpp_extension's own
    defines, standard and include directories beside them)."""
    includes = [*cpp_extension.include_paths(), sysconfig.get_path("include"), str(CSRC)]
    command = [cpp_extension.get_cxx_compiler(), "-c", str(CSRC / source),
               "-o", str(out_dir / f"{source}.o"), "-std=c++20", "-fPIC",
               "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=build_check",
               *build_flags(path), *(f"-I{d}" for d in includes)]
    return subprocess.run(command, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("path", COMPILED_PATHS)
def test_every_source_compiles_for_the_path(path: str, tmp_path: Path) -> None:
    if path in cpu_paths():
        pytest.skip(f"this CPU runs the {path} path: the kernel tests build and run it")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda s: compile_source(s, path, tmp_path), SOURCES))
    failed = {s: r.stderr[-3000:] for s, r in zip(SOURCES, results) if r.returncode != 0}
    assert not failed, f"sources that do not compile for the {path} path: {failed}"
    assert all((tmp_path / f"{s}.o").stat().st_size > 0 for s in SOURCES)

"""A plain (non-editable) install carries everything the kernels need to build on first use.

Builds a wheel of the project, installs it into a scratch directory, and in a fresh process
that imports the installed copy (not the checkout) with an empty kernel cache, builds the
best kernel path this CPU has and runs an op. A source missing from the package data (as
``amx.h`` once was) fails the build here instead of silently falling back to the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from alignedserve.kernels import build
from alignedserve.kernels.isa import cpu_paths

ROOT = Path(__file__).resolve().parent.parent

CHECK = """
import alignedserve, sys, torch
from alignedserve.kernels import select_kernels
assert alignedserve.__file__.startswith(sys.argv[1]), alignedserve.__file__
kernels = select_kernels()
assert kernels.path == sys.argv[2], kernels.path
x = torch.randn(3, 64, dtype=torch.bfloat16)
out = kernels.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
assert out.shape == (3, 64)
print("ok", kernels.path)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=600)
    (path,) = out.glob("alignedserve-*.whl")
    return path


def test_the_wheel_holds_every_kernel_source(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    headers = sorted(h.name for h in build.CSRC.glob("*.h"))
    assert {"amx.h", "checks.h", "work_queue.h"} <= set(headers)
    for source in (*build.SOURCES, *headers):
        assert f"alignedserve/kernels/csrc/{source}" in names, source


def test_the_wheel_holds_the_web_console(wheel: Path):
    assert "alignedserve/entrypoints/console.html" in zipfile.ZipFile(wheel).namelist()


@pytest.mark.skipif(cpu_paths()[0] == "reference", reason="no compiled path on this CPU")
def test_an_installed_copy_builds_its_kernels_on_first_use(wheel: Path, tmp_path: Path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(target), "ALIGNEDSERVE_CACHE": str(tmp_path / "cache")}
    env.pop("ALIGNEDSERVE_ISA", None)
    env.pop("ALIGNEDSERVE_NO_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", CHECK, str(target), cpu_paths()[0]],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "cache" / "torch_extensions").is_dir()

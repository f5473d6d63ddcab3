"""The software AMX tiles (kernels/csrc/amx_emulated.h) against the Intel SDM's definitions.

On a CPU without AMX the tests run the amx path's kernels on these tiles (conftest), so the
emulation must do what the hardware does: ``tdpbf16ps`` sums pairs of bf16 products into fp32
lanes (``C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1]``) over the configured shapes,
``tileloadd`` zeroes what the configuration leaves out, and where the hardware faults (#UD:
tiles used unconfigured, shapes that do not fit) the emulation stops the process, saying why.
The glue below drives the emulated instructions directly, on any CPU with AVX512-BF16.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from alignedserve.kernels.build import CSRC, EMULATED_AMX_FLAGS
from alignedserve.kernels.isa import missing_flags

pytestmark = pytest.mark.skipif(
    bool(missing_flags("avx512_bf16")),
    reason=f"emulated tiles use AVX512-BF16; this CPU lacks {missing_flags('avx512_bf16')}")

# tile_product(a [M, 2K] bf16, b [K, 2N] bf16, c [M, N] fp32, k_rows) configures tiles 0 (C),
# 1 (A), 2 (B, k_rows rows: K fits, anything else must fault), runs one tdpbf16ps and returns
# C; unconfigured() zeroes a tile with no configuration loaded; ninth_tile() configures a tile
# palette 1 does not have.
_GLUE = """
#include "amx.h"
#include <ATen/ATen.h>
namespace amx = alignedserve::amx;
at::Tensor tile_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        int64_t k_rows) {
  const int64_t M = c.size(0), N = c.size(1), K = a.size(1) / 2;
  amx::TileConfig cfg;
  cfg.rows[0] = M; cfg.colsb[0] = N * 4;
  cfg.rows[1] = M; cfg.colsb[1] = K * 4;
  cfg.rows[2] = k_rows; cfg.colsb[2] = N * 4;
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
  at::Tensor out = c.clone();
  _tile_loadd(0, out.data_ptr(), N * 4);
  _tile_loadd(1, a.data_ptr(), K * 4);
  _tile_loadd(2, b.data_ptr(), N * 4);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out.data_ptr(), N * 4);
  _tile_release();
  return out;
}
void unconfigured() { _tile_release(); _tile_zero(3); }
void ninth_tile() {
  amx::TileConfig cfg;
  cfg.rows[8] = 16; cfg.colsb[8] = 64;
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}
bool emulated() { return amx::tiles_emulated() && amx::available(); }
"""


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline

    directory = tmp_path_factory.mktemp("amx_emulation")
    module = load_inline(name="amx_emulation_test", cpp_sources=[_GLUE],
                         functions=["tile_product", "unconfigured", "ninth_tile", "emulated"],
                         extra_cflags=["-O2", *EMULATED_AMX_FLAGS, f"-I{CSRC}"],
                         build_directory=str(directory))
    module.directory = directory
    return module


def _operands(m: int, k: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, 2 * k, generator=gen).bfloat16()
    b = torch.randn(k, 2 * n, generator=gen).bfloat16()
    c = torch.randn(m, n, generator=gen)
    return a, b, c


def test_the_glue_runs_on_emulated_tiles(glue):
    assert glue.emulated()


@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (3, 16, 16), (16, 2, 16), (5, 7, 3), (1, 1, 1)])
def test_tdpbf16ps_sums_pairs_of_products(glue, m: int, k: int, n: int):
    a, b, c = _operands(m, k, n, seed=m * 100 + k * 10 + n)
    got = glue.tile_product(a, b, c, k)
    # C[m][n] + sum over k of A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], in float64.
    pairs_a = a.double().view(m, k, 2)
    pairs_b = b.double().view(k, n, 2)
    want = c.double() + torch.einsum("mkp,knp->mn", pairs_a, pairs_b)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def _run_in_child(glue, call: str) -> subprocess.CompletedProcess:
    code = ("import torch\n"
            f"import sys; sys.path.insert(0, {str(glue.directory)!r})\n"
            "import amx_emulation_test as g\n"
            "a = torch.ones(4, 8).bfloat16(); b = torch.ones(4, 8).bfloat16()\n"
            f"c = torch.zeros(4, 4)\n{call}\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("call,message", [
    ("g.tile_product(a, b, c, 5)", "tdpbf16ps tile shapes do not fit together"),
    ("g.unconfigured()", "tile used before ldtilecfg configured it"),
    ("g.ninth_tile()", "palette 1 has eight tiles"),
])
def test_what_faults_on_the_hardware_stops_the_process(glue, call: str, message: str):
    a, b, c = _operands(4, 4, 4, seed=1)
    assert glue.tile_product(a, b, c, 4).shape == (4, 4)  # the same call with shapes that fit
    result = _run_in_child(glue, call)
    assert result.returncode != 0
    assert f"emulated AMX: {message}" in result.stderr

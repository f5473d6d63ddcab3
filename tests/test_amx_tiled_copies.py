"""The AMX prefill kernel's copies out of a tiled KV cache, checked on CPUs without AMX.

`prefill_attention.cpp` turns a tiled cache's planes into the operands its AMX tiles take
(`untile_keys`: token-major K rows; `transpose_values_tiled`: V^T). Those copies are plain
C++, so this test compiles the real source file with the amx path's compiler flags into a
small extension that calls them, runs no AMX instruction, and compares both copies with
`kv_layout`'s own writes, bit for bit. The whole kernel runs in test_prefill_kernel.py (on
emulated tiles where the CPU lacks AMX, which compares with tolerances); this checks the
copies' addressing exactly.
The amx flags target AVX-512, so the test needs the avx512_bf16 path's CPU flags.
"""

from __future__ import annotations

import pytest
import torch

from alignedserve.kernels import kv_layout
from alignedserve.kernels.build import CSRC, build_flags
from alignedserve.kernels.isa import missing_flags

pytestmark = pytest.mark.skipif(
    bool(missing_flags("avx512_bf16")),
    reason=f"the amx path's flags target AVX-512; this CPU lacks {missing_flags('avx512_bf16')}")

_GLUE = """
#include "prefill_attention.cpp"
at::Tensor untile(const at::Tensor& k, int64_t S) { return alignedserve::untile_keys(k, S); }
at::Tensor values_t(const at::Tensor& v, int64_t S, int64_t s_pad) {
  return alignedserve::transpose_values_tiled(v, S, s_pad);
}
"""


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline

    return load_inline(name="amx_tiled_copies_test", cpp_sources=[_GLUE],
                       functions=["untile", "values_t"],
                       extra_cflags=build_flags("amx") + [f"-I{CSRC}"],
                       extra_ldflags=["-fopenmp"],
                       build_directory=str(tmp_path_factory.mktemp("amx_copies")))


@pytest.mark.parametrize("kv_heads,capacity,dim", [(3, 64, 64), (2, 256, 64), (1, 48, 128),
                                                   (4, 32, 32)])
def test_copies_match_the_layout(copies, kv_heads: int, capacity: int, dim: int):
    torch.manual_seed(capacity + dim)
    for keys in range(1, capacity + 1, 3):
        k = torch.randn(kv_heads, keys, dim, dtype=torch.bfloat16)
        v = torch.randn(kv_heads, keys, dim, dtype=torch.bfloat16)
        # Stale NaNs past the keys, as a reused cache holds: the copies must not read them
        # into a position they keep.
        planes = torch.full((2, kv_heads, capacity, dim), float("nan"), dtype=torch.bfloat16)
        kv_layout.write(planes[0], 0, k, kv_layout.KEYS)
        kv_layout.write(planes[1], 0, v, kv_layout.VALUES)
        s_pad = -(-keys // 32) * 32  # the AMX kernel's kv block
        want_vt = torch.zeros(kv_heads, dim, s_pad, dtype=torch.bfloat16)
        want_vt[:, :, :keys] = v.transpose(1, 2)
        assert torch.equal(copies.untile(planes[0], keys).view(torch.int16),
                           k.view(torch.int16)), keys
        assert torch.equal(copies.values_t(planes[1], keys, s_pad).view(torch.int16),
                           want_vt.view(torch.int16)), keys

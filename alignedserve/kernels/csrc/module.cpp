// The Python module of one kernel build: every source registers its functions here, plus what
// the build is (compiled_path) so the Python side can check it loaded what it asked for.

#include <torch/csrc/utils/pybind.h>

#include <string>

#include "amx.h"         // defines ALIGNEDSERVE_AMX where the build targets AMX-BF16
#include "bf16_pairs.h"  // defines ALIGNEDSERVE_AVX512 where it targets AVX-512 F/BW/VL

namespace alignedserve {

void register_attention(pybind11::module_& m);   // attention.cpp: decode attention
void register_fused(pybind11::module_& m);       // fused.cpp: bf16 elementwise ops, argmax
void register_prefill(pybind11::module_& m);     // prefill_attention.cpp: AMX prefill attention
void register_prefill_avx512(pybind11::module_& m);  // prefill_attention_avx512.cpp
void register_prefill_avx2(pybind11::module_& m);    // prefill_attention_avx2.cpp
void register_small_gemm(pybind11::module_& m);  // small_gemm.cpp: AMX small-batch linear
void register_linear_avx512(pybind11::module_& m);  // linear_avx512.cpp: AVX-512 linear
void register_linear_avx2(pybind11::module_& m);    // linear_avx2.cpp: AVX2 FMA linear

namespace {

// The instruction set this build targets, named as alignedserve/kernels/isa.py names paths.
std::string compiled_path() {
#if defined(ALIGNEDSERVE_AMX)
  return "amx";
#elif defined(ALIGNEDSERVE_AVX512) && defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(ALIGNEDSERVE_AVX512)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace
}  // namespace alignedserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compiled_path", &alignedserve::compiled_path,
        "The instruction set this build targets: amx, avx512_bf16, avx512, avx2 or portable.");
  m.def("amx_available", &alignedserve::amx::available,
        "True when this build has the AMX-BF16 kernels and the OS granted tile state.");
  m.def("amx_emulated", &alignedserve::amx::tiles_emulated,
        "True when this build's AMX tiles are emulated in software (a test build).");
  alignedserve::register_attention(m);
  alignedserve::register_fused(m);
  alignedserve::register_prefill(m);
  alignedserve::register_prefill_avx512(m);
  alignedserve::register_prefill_avx2(m);
  alignedserve::register_small_gemm(m);
  alignedserve::register_linear_avx512(m);
  alignedserve::register_linear_avx2(m);
}

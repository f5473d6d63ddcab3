// The binding attribute of every compute function: it runs without the GIL. Such a function
// touches no Python object (pybind11 converts the arguments before the call and the result
// after it, both under the GIL), so other Python threads run meanwhile: the runner's other
// micro-batch (executor/runner.py) or a server's event loop.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace alignedserve {

inline const pybind11::call_guard<pybind11::gil_scoped_release> kReleaseGil{};

}  // namespace alignedserve

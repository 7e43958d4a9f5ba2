// The compiled CPU kernel's Python module, named by the build's LGC_MODULE_NAME: binds the entry points of the other
// sources (listed in common.h). The one source that includes pybind11 (no torch headers or libraries).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "common.h"

namespace py = pybind11;

namespace lgc {

GilRelease::GilRelease(bool release) : held_(release ? new py::gil_scoped_release() : nullptr) {}

GilRelease::~GilRelease() { delete static_cast<py::gil_scoped_release*>(held_); }

namespace {

int detect_level() {
#if LGC_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("popcnt")) return 1;
    if (__builtin_cpu_supports("avx512f")) return 3;
    if (__builtin_cpu_supports("avx2")) return 2;
    return 1;
#else
    return 0;
#endif
}

}  // namespace

const int kLevel = detect_level();

namespace {

py::array_t<int64_t> to_array(const int64_t* src, int64_t count) {
    py::array_t<int64_t> out(count);
    if (count > 0) std::memcpy(out.mutable_data(), src, static_cast<size_t>(count) * sizeof(int64_t));
    return out;
}

py::tuple approx(uintptr_t x, int64_t n, bool is_double, int64_t offset, int64_t stride, double aim1, double aim2,
                 int64_t k, int64_t lo, int64_t hi, int level) {
    int64_t count = 0;
    const int status = select_approx(x, n, is_double, offset, stride, aim1, aim2, k, lo, hi, level, &count);
    py::array_t<int64_t> result = to_array(selected(), count);
    release_scratch();
    return py::make_tuple(status, result);
}

py::object exact(uintptr_t x, int64_t n, bool is_double, int64_t k, int64_t step, int level) {
    const bool found = select_exact(x, n, is_double, k, step, level);
    py::object result = py::none();
    if (found) result = to_array(selected(), k);
    release_scratch();
    return result;
}

}  // namespace
}  // namespace lgc

PYBIND11_MODULE(LGC_MODULE_NAME, m) {
    using namespace lgc;
    m.def("at_least", &at_least, pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("approx", &approx);
    m.def("exact", &exact);
    m.def("stochastic_round", &stochastic_round);
    m.def("dequantize", &dequantize);
    m.def("dequantize_add", &dequantize_add);
    m.def("dequantize_mean", &dequantize_mean);
    m.def("add_scaled", &add_scaled);
    m.def("scaled_cast", &scaled_cast);
    m.def("widen", &widen);
    m.def("any_nonfinite", &any_nonfinite);
    m.def("compensate", &compensate);
    m.def("sign_codes", &sign_codes);
    m.def("sign_quantize", &sign_quantize);
    m.def("thin_matmul", &thin_matmul);
    m.def("thin_matmul_t", &thin_matmul_t);
    m.def("subtract_product", &subtract_product);
    m.def("delta16_encode", &delta16_encode);
    m.def("delta16_decode", &delta16_decode);
    m.attr("thin_max") = kThinMax;
    m.def("pack", &pack, pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("unpack", &unpack, pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("pack_into", &pack_into);
    m.attr("level") = kLevel;
}

// base + alpha * x in one pass (axpy.py): add_scaled; axpy_avx2 is also dequantize_add's and sign_residual's last step.
#include "common.h"

namespace lgc {

#if LGC_X86
__attribute__((target("avx2,fma"))) void axpy_avx2(const float* d, const float* b, int64_t m, float a1, float* o1,
                                                    float a2, float* o2) {
    const __m256 w1 = _mm256_set1_ps(a1), w2 = _mm256_set1_ps(a2);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256 x = _mm256_loadu_ps(d + j), y = _mm256_loadu_ps(b + j);
        _mm256_storeu_ps(o1 + j, _mm256_fmadd_ps(w1, x, y));
        if (o2 != nullptr) _mm256_storeu_ps(o2 + j, _mm256_fmadd_ps(w2, x, y));
    }
    axpy_generic(d + j, b + j, m - j, a1, o1 + j, a2, o2 == nullptr ? nullptr : o2 + j);
}
#endif

// axpy.add_scaled: out1 = base + alpha1 * x and, when out2 is not 0, out2 = base + alpha2 * x, each entry one fused
// multiply-add (torch.add(base, x, alpha=a)'s bits, as dequantize_add's). The outputs may alias base or x.
void add_scaled(uintptr_t x, uintptr_t base, int64_t n, double alpha1, uintptr_t out1, double alpha2, uintptr_t out2,
                int level) {
    const GilRelease release(n >= kReleaseGil);
    const float* d = reinterpret_cast<const float*>(x);
    const float* b = reinterpret_cast<const float*>(base);
    float* o1 = reinterpret_cast<float*>(out1);
    float* o2 = reinterpret_cast<float*>(out2);
    const float a1 = static_cast<float>(alpha1), a2 = static_cast<float>(alpha2);
#if LGC_X86
    if (std::min(level, kLevel) >= 2 && fma_supported()) {
        axpy_avx2(d, b, n, a1, o1, a2, o2);
        return;
    }
#endif
    axpy_generic(d, b, n, a1, o1, a2, o2);
}

}  // namespace lgc

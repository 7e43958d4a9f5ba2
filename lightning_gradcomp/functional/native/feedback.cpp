// Error feedback (feedback.py): compensate.
#include "common.h"

namespace lgc {
namespace {

#if LGC_X86
template <bool Divide, bool Clear>
__attribute__((target("avx2"))) int64_t compensate_avx2(const float* m, float* g, int64_t n, float d, float* p,
                                                        bool* bad) {
    const __m256 div = _mm256_set1_ps(d), zero = _mm256_setzero_ps();
    const __m256i exponent = _mm256_set1_epi32(0x7f800000);
    __m256i seen = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(g + j);
        const __m256i u = _mm256_castps_si256(v);
        seen = _mm256_or_si256(seen, _mm256_cmpeq_epi32(_mm256_and_si256(u, exponent), exponent));
        if constexpr (Divide) v = _mm256_div_ps(v, div);
        _mm256_storeu_ps(p + j, _mm256_add_ps(_mm256_loadu_ps(m + j), v));
        if constexpr (Clear) _mm256_storeu_ps(g + j, zero);
    }
    *bad = !_mm256_testz_si256(seen, seen);
    return j;
}
#endif

}  // namespace

// feedback.compensate: p = m + g (or m + g / d when d > 0), fp32, one pass; with clear, g = 0 in the same pass
// (the engine's sparsifiers write their few kept entries into g's zeroed storage). Each value is one fp32 add
// (after one fp32 division), as torch's add / addcdiv round it. Returns whether some g is NaN or infinite
// (exponent bits all ones), checked on the values as loaded.
bool compensate(uintptr_t memory, uintptr_t grad, int64_t n, double divisor, uintptr_t out, bool clear, int level) {
    const GilRelease release(n >= kReleaseGil);
    const float* m = reinterpret_cast<const float*>(memory);
    float* g = reinterpret_cast<float*>(grad);
    float* p = reinterpret_cast<float*>(out);
    const float d = static_cast<float>(divisor);
    const bool divide = divisor > 0;
    bool bad = false;
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2) {
        if (divide)
            j = clear ? compensate_avx2<true, true>(m, g, n, d, p, &bad)
                      : compensate_avx2<true, false>(m, g, n, d, p, &bad);
        else
            j = clear ? compensate_avx2<false, true>(m, g, n, d, p, &bad)
                      : compensate_avx2<false, false>(m, g, n, d, p, &bad);
    }
#endif
    for (; j < n; ++j) {
        uint32_t bits;
        std::memcpy(&bits, g + j, 4);
        bad = bad || (bits & 0x7f800000u) == 0x7f800000u;
        const float v = divide ? g[j] / d : g[j];
        p[j] = m[j] + v;
        if (clear) g[j] = 0.0f;
    }
    return bad;
}

}  // namespace lgc

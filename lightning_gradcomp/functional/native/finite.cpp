// The NaN/Inf scan: any_nonfinite.
// finite.nonfinite_flag: whether any of n fp32 values is NaN or infinite (exponent bits all ones), one read pass.
#include "common.h"

namespace lgc {
namespace {

#if LGC_X86
__attribute__((target("avx2"))) int64_t any_nonfinite_avx2(const uint32_t* x, int64_t n, bool* bad) {
    const __m256i exponent = _mm256_set1_epi32(0x7f800000);
    __m256i seen = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
        seen = _mm256_or_si256(seen, _mm256_cmpeq_epi32(_mm256_and_si256(v, exponent), exponent));
    }
    *bad = !_mm256_testz_si256(seen, seen);
    return j;
}
#endif

}  // namespace

bool any_nonfinite(uintptr_t src, int64_t n, int level) {
    const GilRelease release(n >= kReleaseGil);
    const uint32_t* x = reinterpret_cast<const uint32_t*>(src);
    bool bad = false;
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2) j = any_nonfinite_avx2(x, n, &bad);
#endif
    for (; j < n && !bad; ++j) bad = (x[j] & 0x7f800000u) == 0x7f800000u;
    return bad;
}

}  // namespace lgc

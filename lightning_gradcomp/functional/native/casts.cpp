// 16-bit casts: scaled_cast and widen.
// half.scaled_cast / half.widen: fp32 x / d rounded to fp16 (kind 0) or bf16 (kind 1), to nearest even, and back
// to fp32 (exact) with a NaN/Inf check in the same pass. Finite values and infinities give torch's bits
// (`.div_(d)` then `.half()` / `.bfloat16()`); NaNs stay NaNs (torch's own NaN bits differ between its vector and
// scalar loops). fp16 uses the F16C conversions, as torch's vector loop does.
#include "common.h"

namespace lgc {
namespace {

inline uint16_t half_from_float(float value) {  // F16C's vcvtps2ph, round to nearest even
    uint32_t u;
    std::memcpy(&u, &value, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN, quiet
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);                         // inf, overflow
    if (a < 0x38800000u) {                                                                     // fp16 subnormal
        const float shifted = std::fabs(value) + 0.5f;  // the low bits of 0.5 + |x| are |x| / 2^-24, rounded RNE
        uint32_t v;
        std::memcpy(&v, &shifted, 4);
        return static_cast<uint16_t>(sign | (v - 0x3f000000u));
    }
    const uint32_t rounded = a + 0xfff + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round at bit 13
    return static_cast<uint16_t>(sign | (rounded >> 13));
}

inline uint16_t bf16_from_float(float value) {  // torch's vector rounding: NaN -> 0xffff
    uint32_t u;
    std::memcpy(&u, &value, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float float_from_half(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);
    else if (e != 0) u = sign | ((e + 112u) << 23) | (m << 13);
    else if (m == 0) u = sign;
    else {
        float f = static_cast<float>(m) * 0x1p-24f;  // exact
        std::memcpy(&u, &f, 4);
        u |= sign;
    }
    float out;
    std::memcpy(&out, &u, 4);
    return out;
}

inline bool f16c_supported() {
#if LGC_X86
    static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
    return has;
#else
    return false;
#endif
}

#if LGC_X86
__attribute__((target("avx2,f16c"))) int64_t cast_fp16_avx2(const float* x, int64_t n, float d, uint16_t* out) {
    const __m256 div = _mm256_set1_ps(d);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + j), div);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    return j;
}

__attribute__((target("avx2"))) int64_t cast_bf16_avx2(const float* x, int64_t n, float d, uint16_t* out) {
    const __m256 div = _mm256_set1_ps(d);
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0xffff);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + j), div);
        const __m256i u = _mm256_castps_si256(v);
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        r = _mm256_srli_epi32(r, 16);
        r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), packed);
    }
    return j;
}

// 16-bit values (bf16 when Bf16, else fp16) into fp32; ORs "exponent all ones" (NaN or inf) into *bad.
template <bool Bf16>
__attribute__((target("avx2,f16c"))) int64_t widen_avx2(const uint16_t* h, int64_t n, float* out, bool* bad) {
    const __m128i exponent = _mm_set1_epi16(Bf16 ? 0x7f80 : 0x7c00);
    __m128i seen = _mm_setzero_si128();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j));
        if constexpr (Bf16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
        } else {
            _mm256_storeu_ps(out + j, _mm256_cvtph_ps(v));
        }
        seen = _mm_or_si128(seen, _mm_cmpeq_epi16(_mm_and_si128(v, exponent), exponent));
    }
    *bad = *bad || !_mm_testz_si128(seen, seen);
    return j;
}
#endif

}  // namespace

void scaled_cast(uintptr_t src, int64_t n, double divisor, uintptr_t dst, int kind, int level) {
    const GilRelease release(n >= kReleaseGil);
    const float* x = reinterpret_cast<const float*>(src);
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    const float d = static_cast<float>(divisor);
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2 && f16c_supported())
        j = kind == 0 ? cast_fp16_avx2(x, n, d, out) : cast_bf16_avx2(x, n, d, out);
#endif
    for (; j < n; ++j) out[j] = kind == 0 ? half_from_float(x[j] / d) : bf16_from_float(x[j] / d);
}

bool widen(uintptr_t src, int64_t n, int kind, uintptr_t dst, int level) {
    const GilRelease release(n >= kReleaseGil);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
    float* out = reinterpret_cast<float*>(dst);
    bool bad = false;
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2 && f16c_supported())
        j = kind == 0 ? widen_avx2<false>(h, n, out, &bad) : widen_avx2<true>(h, n, out, &bad);
#endif
    const uint16_t exponent = kind == 0 ? 0x7c00 : 0x7f80;
    for (; j < n; ++j) {
        bad = bad || (h[j] & exponent) == exponent;
        if (kind == 0) {
            out[j] = float_from_half(h[j]);
        } else {
            const uint32_t u = static_cast<uint32_t>(h[j]) << 16;
            std::memcpy(out + j, &u, 4);
        }
    }
    return bad;
}

}  // namespace lgc

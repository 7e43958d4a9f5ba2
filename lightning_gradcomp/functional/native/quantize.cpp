// Stochastic rounding and decoding (quantize.py's fp32 CPU steps): stochastic_round, dequantize, dequantize_mean and
// dequantize_add, each bit-identical to the torch steps it replaces.
#include "common.h"

namespace lgc {
namespace {

// ------------------------------------------------------------------------------------------ stochastic rounding
// The fp32 CPU steps of quantize.stochastic_quantize in one pass per group, bit-identical to its torch steps:
// each step is the same single fp32 operation in the same order (the build passes -ffp-contract=off: no
// FMA). The uniform draw of entry i is counter-based (quantize.hashed_uniform, which the torch steps use too):
//   u(i) = float(mix(mix(i ^ k0) ^ k1) >> 8) * 2^-24,  mix(x): x ^= x >> 16; x *= 0x21f0aaad;
//          x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15   (32-bit unsigned arithmetic)
// with (k0, k1) the low and high halves of the call's 64-bit key and i < 2^32. Per group of m entries (the
// last may be short):
//   scale    = max |x| (given: the p-norm torch computed); NaN anywhere makes it NaN
//   inverse  = (1 / (scale > 0 ? scale : 1)) * L    (torch's L / t is reciprocal(t) * L)
//   usable   = scale > 0 && isfinite(inverse), else scale = inverse = 0 (the group is sent as zeros)
//   y        = min(L, floor(|x| * inverse + u)),  code = L + copysign(y, x) as uint8 (NaN gives 0, as torch).
inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21f0aaadu;
    x ^= x >> 15;
    x *= 0x735a2d97u;
    x ^= x >> 15;
    return x;
}

inline float draw(uint32_t i, uint32_t k0, uint32_t k1) {
    return static_cast<float>(mix32(mix32(i ^ k0) ^ k1) >> 8) * 0x1p-24f;
}

inline uint32_t abs_bits(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return bits & 0x7fffffffu;
}

inline float bits_float(uint32_t bits) {
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

// The inverse of a group's scale, zeroing both when the group is not usable.
inline float group_inverse(float& scale, float levels) {
    const bool positive = scale > 0.0f;
    const float reciprocal = 1.0f / (positive ? scale : 1.0f);
    const float inverse = reciprocal * levels;
    if (positive && std::isfinite(inverse)) return inverse;
    scale = 0.0f;
    return 0.0f;
}

inline uint8_t round_one(float x, float u, float inverse, float levels) {
    float y = std::fabs(x) * inverse;
    y = y + u;
    y = std::floor(y);
    if (std::isnan(y)) return 0;  // torch converts NaN to uint8 as 0
    if (y > levels) y = levels;
    const float code = levels + std::copysign(y, x);
    return static_cast<uint8_t>(static_cast<int32_t>(code));
}

// max |x| of m entries as bits: the bits of |v| order as the values do, and NaN's are above infinity's.
inline uint32_t max_abs_generic(const float* x, int64_t m) {
    uint32_t top = 0;
    for (int64_t j = 0; j < m; ++j) top = std::max(top, abs_bits(x[j]));
    return top;
}

// Entries i0, ..., i0 + m - 1 (draw indices) of x.
inline void round_generic(const float* x, uint32_t i0, uint32_t k0, uint32_t k1, int64_t m, float inverse,
                          float levels, uint8_t* out) {
    for (int64_t j = 0; j < m; ++j)
        out[j] = round_one(x[j], draw(i0 + static_cast<uint32_t>(j), k0, k1), inverse, levels);
}

inline void dequantize_generic(const uint8_t* c, int64_t m, float levels, float step, float* out) {
    for (int64_t j = 0; j < m; ++j) {
        const float v = static_cast<float>(c[j]) - levels;
        out[j] = v * step;
    }
}

#if LGC_X86
__attribute__((target("avx2"))) uint32_t max_abs_avx2(const float* x, int64_t m) {
    const __m256i mask = _mm256_set1_epi32(0x7fffffff);
    __m256i top = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
        top = _mm256_max_epu32(top, _mm256_and_si256(bits, mask));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
    uint32_t best = max_abs_generic(x + j, m - j);
    for (uint32_t v : lanes) best = std::max(best, v);
    return best;
}

__attribute__((target("avx2"))) inline __m256i mix32_avx2(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x21f0aaad));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x735a2d97));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

__attribute__((target("avx2"))) void round_avx2(const float* x, uint32_t i0, uint32_t k0, uint32_t k1, int64_t m,
                                                 float inverse, float levels, uint8_t* out) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int32_t>(k0)), key1 = _mm256_set1_epi32(static_cast<int32_t>(k1));
    const __m256 unit = _mm256_set1_ps(0x1p-24f);
    __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inv = _mm256_set1_ps(inverse), top = _mm256_set1_ps(levels);
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        __m256 y = _mm256_mul_ps(_mm256_and_ps(v, magnitude), inv);
        const __m256i h = mix32_avx2(_mm256_xor_si256(mix32_avx2(_mm256_xor_si256(index, key0)), key1));
        index = _mm256_add_epi32(index, eight);
        const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), unit);  // exact: h >> 8 < 2^24
        y = _mm256_floor_ps(_mm256_add_ps(y, u));
        y = _mm256_min_ps(top, y);                       // min(L, y); a NaN y stays NaN (minps returns it)
        y = _mm256_or_ps(y, _mm256_andnot_ps(magnitude, v));  // copysign(y, x): y is +0, positive or NaN
        __m256i c = _mm256_cvttps_epi32(_mm256_add_ps(top, y));  // NaN gives 0x80000000: low byte 0, as torch
        c = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(c, low_bytes), join);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm256_castsi256_si128(c));
    }
    round_generic(x + j, i0 + static_cast<uint32_t>(j), k0, k1, m - j, inverse, levels, out + j);
}

__attribute__((target("avx2"))) void dequantize_avx2(const uint8_t* c, int64_t m, float levels, float step,
                                                      float* out) {
    const __m256 top = _mm256_set1_ps(levels), s = _mm256_set1_ps(step);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j)));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(v), top), s));
    }
    dequantize_generic(c + j, m - j, levels, step, out + j);
}
#endif

// Codes of x[0:n] and the usable scales of its groups (given: scales holds the p-norms on entry).
void stochastic_round_impl(const float* source, const float* minus, int64_t n, uint64_t key, int64_t group_size,
                           float levels, bool given, float* scales, uint8_t* codes, int level) {
    const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    const bool wide = LGC_X86 && std::min(level, kLevel) >= 2;
    thread_local std::vector<float> difference;  // one group of source - minus (fp32, as torch subtracts)
    if (minus != nullptr) grow(difference, std::min(group_size, n));
    for (int64_t start = 0, g = 0; start < n; start += group_size, ++g) {
        const int64_t m = std::min(group_size, n - start);
        const float* src = source + start;
        if (minus != nullptr) {  // the group's x - minus, read from cache by both passes below
            for (int64_t j = 0; j < m; ++j) difference[j] = source[start + j] - minus[start + j];
            src = difference.data();
        }
        float scale = scales[g];
        if (!given) {
            uint32_t top;
#if LGC_X86
            top = wide ? max_abs_avx2(src, m) : max_abs_generic(src, m);
#else
            top = max_abs_generic(src, m);
#endif
            scale = bits_float(top);
        }
        const float inverse = group_inverse(scale, levels);
        scales[g] = scale;
#if LGC_X86
        if (wide) {
            round_avx2(src, static_cast<uint32_t>(start), k0, k1, m, inverse, levels, codes + start);
            continue;
        }
#endif
        round_generic(src, static_cast<uint32_t>(start), k0, k1, m, inverse, levels, codes + start);
    }
}

// Codes first, ..., first + len - 1 of a row stored `bits` wide (1, 2, 4 or 8; 8 / bits codes per byte, little-endian
// in the byte, as pack writes them). Width 8 is one code per byte: the row itself. Narrower codes are unpacked into
// buf (len <= kCodeChunk), which stays in L1: the row's codes are never written out as bytes.
inline const uint8_t* codes_at(const uint8_t* row, int bits, int64_t first, int64_t len, uint8_t* buf) {
    switch (bits) {
        case 1: unpack_span<1>(row, first, len, buf); return buf;
        case 2: unpack_span<2>(row, first, len, buf); return buf;
        case 4: unpack_span<4>(row, first, len, buf); return buf;
        default: return row + first;
    }
}

// The value of one code, torch's steps: (float(code) - L) * (scale / L), or (float(code) * 2 - 1) * scale for L = 0.
inline float code_value(unsigned code, float top, float step) {
    const float v = top == 0.0f ? static_cast<float>(code) * 2.0f - 1.0f : static_cast<float>(code) - top;
    return v * step;
}

#if LGC_X86
// len values from codes idx, ..., idx + len - 1 of a row packed B bits wide: eight codes (B bytes) per step, shifted
// apart in the lanes of one vector; the same fp32 steps as code_value.
template <int B>
__attribute__((target("avx2"))) void decode_packed_avx2(const uint8_t* row, int64_t idx, int64_t len, float top,
                                                         float step, float* out) {
    constexpr int per = 8 / B;
    constexpr unsigned mask = (1u << B) - 1;
    auto scalar = [&](int64_t j) { out[j] = code_value(packed_code<B>(row, idx + j), top, step); };
    int64_t j = 0;
    for (; j < len && (idx + j) % per != 0; ++j) scalar(j);
    const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
    const __m256i low = _mm256_set1_epi32(static_cast<int32_t>(mask));
    const __m256 t = _mm256_set1_ps(top), s = _mm256_set1_ps(step);
    const __m256 two = _mm256_set1_ps(2.0f), one = _mm256_set1_ps(1.0f);
    const uint8_t* p = row + (idx + j) / per;
    for (; j + 8 <= len; j += 8, p += B) {
        uint32_t word = 0;
        std::memcpy(&word, p, B);
        const __m256i spread = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)), shifts);
        const __m256i c = _mm256_and_si256(spread, low);
        const __m256 f = _mm256_cvtepi32_ps(c);
        const __m256 v = top == 0.0f ? _mm256_sub_ps(_mm256_mul_ps(f, two), one) : _mm256_sub_ps(f, t);
        _mm256_storeu_ps(out + j, _mm256_mul_ps(v, s));
    }
    for (; j < len; ++j) scalar(j);
}
#endif

// len values (len <= kCodeChunk) from codes idx, ..., idx + len - 1 of a row stored `bits` wide (codes_at); buf is
// scratch for the generic path.
inline void decode_span(const uint8_t* row, int bits, int64_t idx, int64_t len, float top, float step, bool wide,
                        uint8_t* buf, float* out) {
#if LGC_X86
    if (wide && bits < 8) {
        if (bits == 1) decode_packed_avx2<1>(row, idx, len, top, step, out);
        else if (bits == 2) decode_packed_avx2<2>(row, idx, len, top, step, out);
        else decode_packed_avx2<4>(row, idx, len, top, step, out);
        return;
    }
#endif
    const uint8_t* src = codes_at(row, bits, idx, len, buf);
    if (top == 0.0f) {  // scaled sign
        sign_generic(src, len, step, out);
        return;
    }
#if LGC_X86
    if (wide) {
        dequantize_avx2(src, len, top, step, out);
        return;
    }
#endif
    dequantize_generic(src, len, top, step, out);
}

}  // namespace

// n < 2^32 (the caller checks): the draw index is the entry's 32-bit position. minus (0: none) is subtracted from
// x first, group by group, without writing x - minus anywhere but a group-sized scratch.
void stochastic_round(uintptr_t x, uintptr_t minus, int64_t n, uint64_t key, int64_t group_size, int levels,
                      bool given, uintptr_t scales, uintptr_t codes, int level) {
    const GilRelease release(n >= kReleaseGil);
    stochastic_round_impl(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(minus), n, key,
                          group_size, static_cast<float>(levels), given, reinterpret_cast<float*>(scales),
                          reinterpret_cast<uint8_t*>(codes), level);
}

// quantize.dequantize into fp32: rows of n codes (row strides in bytes; codes first, ..., first + n - 1 of each row,
// stored `bits` wide as codes_at reads them) with their groups' scales; out is (rows, n), contiguous.
// value = (float(code) - L) * (scale / L), or (float(code) * 2 - 1) * scale for L = 0 (scaled sign), torch's steps.
void dequantize(uintptr_t codes, int64_t rows, int64_t n, int64_t code_stride, int bits, int64_t first,
                uintptr_t scales, int64_t scale_stride, int64_t group_size, int levels, uintptr_t out, int level) {
    const GilRelease release(rows * n >= kReleaseGil);
    const float top = static_cast<float>(levels);
    const bool wide = LGC_X86 && std::min(level, kLevel) >= 2;
    alignas(32) uint8_t buf[kCodeChunk];
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* c = reinterpret_cast<const uint8_t*>(codes) + r * code_stride;
        const float* s = reinterpret_cast<const float*>(scales) + r * scale_stride;
        float* o = reinterpret_cast<float*>(out) + r * n;
        for (int64_t start = 0, g = 0; start < n; start += group_size, ++g) {
            const int64_t m = std::min(group_size, n - start);
            const float step = levels == 0 ? s[g] : s[g] / top;
            for (int64_t off = 0; off < m; off += kCodeChunk) {
                const int64_t len = std::min(kCodeChunk, m - off), at = start + off;
                decode_span(c, bits, first + at, len, top, step, wide, buf, o + at);
            }
        }
    }
}

// quantize.rows_mean: out = (d_0 + d_1 + ... + d_{rows-1}) / rows, d_r the decoded row r (arguments as
// dequantize's), summed in row order with each + rounded once (torch's add) and then divided entry by entry (torch's
// div_ by the integer rows). One pass: the rows are decoded 512 entries at a time into the stack.
void dequantize_mean(uintptr_t codes, int64_t rows, int64_t n, int64_t code_stride, int bits, int64_t first,
                     uintptr_t scales, int64_t scale_stride, int64_t group_size, int levels, uintptr_t out,
                     int level) {
    const GilRelease release(rows * n >= kReleaseGil);
    const float top = static_cast<float>(levels), count = static_cast<float>(rows);
    const bool wide = LGC_X86 && std::min(level, kLevel) >= 2;
    alignas(32) float d[kCodeChunk];
    alignas(32) uint8_t buf[kCodeChunk];
    const uint8_t* c = reinterpret_cast<const uint8_t*>(codes);
    const float* s = reinterpret_cast<const float*>(scales);
    float* o = reinterpret_cast<float*>(out);
    for (int64_t start = 0, g = 0; start < n; start += group_size, ++g) {
        const int64_t m = std::min(group_size, n - start);
        for (int64_t off = 0; off < m; off += kCodeChunk) {
            const int64_t len = std::min(kCodeChunk, m - off), at = start + off;
            float* acc = o + at;
            for (int64_t r = 0; r < rows; ++r) {
                const float scale = s[r * scale_stride + g], step = levels == 0 ? scale : scale / top;
                decode_span(c + r * code_stride, bits, first + at, len, top, step, wide, buf, r == 0 ? acc : d);
                if (r > 0)
                    for (int64_t j = 0; j < len; ++j) acc[j] = acc[j] + d[j];
            }
            for (int64_t j = 0; j < len; ++j) acc[j] = acc[j] / count;
        }
    }
}

// quantize.dequantize_add: out1 = base + alpha1 * d and, when out2 is not 0, out2 = base + alpha2 * d, where d is
// the decoded row of n codes (codes first, ..., first + n - 1, stored `bits` wide; as dequantize computes it). Each
// output entry is one fused multiply-add, rounded once: what torch.add(base, d, alpha=a) computes with its AVX2 /
// AVX-512 kernels. d lives in a small stack
// chunk, so the decoded tensor is never written out. The outputs may alias base (entry by entry).
void dequantize_add(uintptr_t codes, int bits, int64_t first, int64_t n, uintptr_t scales, int64_t group_size,
                    int levels, uintptr_t base, double alpha1, uintptr_t out1, double alpha2, uintptr_t out2,
                    int level) {
    const GilRelease release(n >= kReleaseGil);
    const uint8_t* c = reinterpret_cast<const uint8_t*>(codes);
    const float* s = reinterpret_cast<const float*>(scales);
    const float* b = reinterpret_cast<const float*>(base);
    float* o1 = reinterpret_cast<float*>(out1);
    float* o2 = reinterpret_cast<float*>(out2);
    const float a1 = static_cast<float>(alpha1), a2 = static_cast<float>(alpha2), top = static_cast<float>(levels);
    const bool wide = LGC_X86 && std::min(level, kLevel) >= 2 && fma_supported();
    alignas(32) float d[kAxpyChunk];
    alignas(32) uint8_t buf[kCodeChunk];
    for (int64_t start = 0, g = 0; start < n; start += group_size, ++g) {
        const int64_t m = std::min(group_size, n - start);
        const float step = levels == 0 ? s[g] : s[g] / top;
        for (int64_t off = 0; off < m; off += kAxpyChunk) {
            const int64_t len = std::min(kAxpyChunk, m - off), at = start + off;
            float* second = o2 == nullptr ? nullptr : o2 + at;
            decode_span(c, bits, first + at, len, top, step, wide, buf, d);
#if LGC_X86
            if (wide) {
                axpy_avx2(d, b + at, len, a1, o1 + at, a2, second);
                continue;
            }
#endif
            axpy_generic(d, b + at, len, a1, o1 + at, a2, second);
        }
    }
}

}  // namespace lgc

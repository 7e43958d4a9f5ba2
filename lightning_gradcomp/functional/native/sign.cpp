// Scaled sign (quantize.py): sign_codes and sign_quantize.
#include "common.h"

namespace lgc {
namespace {

// quantize.sign_quantize's codes: 1 where x >= 0, else 0 (NaN: 0), one byte each, as torch.ge(x, 0) gives them.
struct SpreadTable {  // the 8 bits of a compare mask as 8 bytes of 0 or 1 (bit i -> byte i)
    uint64_t bytes[256];
    SpreadTable() {
        for (int b = 0; b < 256; ++b) {
            uint64_t v = 0;
            for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
            bytes[b] = v;
        }
    }
};
const SpreadTable kSpread;

#if LGC_X86
__attribute__((target("avx2"))) int64_t sign_codes_avx2(const float* x, int64_t n, uint8_t* out) {
    const __m256 zero = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), zero, _CMP_GE_OQ));
        std::memcpy(out + j, &kSpread.bytes[bits], 8);
    }
    return j;
}

__attribute__((target("avx2"))) float abs_sum_codes_avx2(const float* x, int64_t m, uint8_t* out, int64_t* done) {
    const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        acc = _mm256_add_ps(acc, _mm256_andnot_ps(sign, v));
        const int bits = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ));
        std::memcpy(out + j, &kSpread.bytes[bits], 8);
    }
    *done = j;
    return lanes_sum(acc);
}
#endif

// The residual x - decode() of one group, written while the group is in cache, with dequantize_add's own steps
// (the decoded chunk from the codes as decode_span gives it, then the same fused multiply-adds by -1): the same bits,
// NaN payloads included. r may alias x.
inline void sign_residual(const float* x, const uint8_t* c, int64_t m, float scale, bool fma_wide, float* r) {
    alignas(32) float d[kAxpyChunk];
    for (int64_t off = 0; off < m; off += kAxpyChunk) {
        const int64_t len = std::min(kAxpyChunk, m - off);
        sign_generic(c + off, len, scale, d);
#if LGC_X86
        if (fma_wide) {
            axpy_avx2(d, x + off, len, -1.0f, r + off, 0.0f, nullptr);
            continue;
        }
#endif
        axpy_generic(d, x + off, len, -1.0f, r + off, 0.0f, nullptr);
    }
}

}  // namespace

// quantize.sign_quantize: the codes above and, per group of group_size (the last one shorter), the mean |x| in one
// pass; when residual is not 0, also the group's x - decode() right after its mean, while the group is in cache
// (sign_residual). Each group's |x| are summed in 8 lanes (entry j of the group into lane j % 8, in order),
// the lanes pairwise ((0+4)+(2+6)) + ((1+5)+(3+7)), then the group's last m % 8 entries in order; the sum is divided
// by the group's length. The same bits at every level (the scalar loop keeps the lanes too); not torch's order.
void sign_quantize(uintptr_t src, int64_t n, int64_t group_size, uintptr_t codes, uintptr_t scales, uintptr_t residual,
                   int level) {
    const GilRelease release(n >= kReleaseGil);
    const float* x = reinterpret_cast<const float*>(src);
    uint8_t* out = reinterpret_cast<uint8_t*>(codes);
    float* mean = reinterpret_cast<float*>(scales);
    float* res = reinterpret_cast<float*>(residual);  // 0: none
    const bool wide = LGC_X86 && std::min(level, kLevel) >= 2;
    const bool fma_wide = wide && fma_supported();  // as dequantize_add decides
    for (int64_t start = 0, g = 0; start < n; start += group_size, ++g) {
        const int64_t m = std::min(group_size, n - start);
        const float* v = x + start;
        uint8_t* c = out + start;
        float total;
        int64_t j = 0;
#if LGC_X86
        if (wide) {
            total = abs_sum_codes_avx2(v, m, c, &j);
        } else
#endif
        {
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (; j + 8 <= m; j += 8)
                for (int k = 0; k < 8; ++k) {
                    lanes[k] += std::fabs(v[j + k]);
                    c[j + k] = v[j + k] >= 0.0f ? 1 : 0;
                }
            total = lanes_sum(lanes);
        }
        for (; j < m; ++j) {
            total += std::fabs(v[j]);
            c[j] = v[j] >= 0.0f ? 1 : 0;
        }
        mean[g] = total / static_cast<float>(m);
        if (res != nullptr) sign_residual(v, c, m, mean[g], fma_wide, res + start);
    }
}

void sign_codes(uintptr_t src, int64_t n, uintptr_t dst, int level) {
    const GilRelease release(n >= kReleaseGil);
    const float* x = reinterpret_cast<const float*>(src);
    uint8_t* out = reinterpret_cast<uint8_t*>(dst);
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2) j = sign_codes_avx2(x, n, out);
#endif
    for (; j < n; ++j) out[j] = x[j] >= 0.0f ? 1 : 0;
}

}  // namespace lgc

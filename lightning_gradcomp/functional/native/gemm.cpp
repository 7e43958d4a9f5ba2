// Thin products (lowrank.py, PowerSGD): thin_matmul, thin_matmul_t and subtract_product.
// lowrank.thin_matmul / thin_matmul_t: PowerSGD's M Q and M^T P for an n x m row-major M and r (<= kThinMax)
// columns, each reading M once (BLAS runs these skinny shapes at a tenth of that speed on one core). Fixed
// summation order: M Q sums each row's products in 8 lanes of m / 8 terms, then the lanes pairwise; M^T P sums
// over the rows in order. fp32 throughout, no FMA (deterministic on any CPU at a given level).
#include "common.h"

namespace lgc {
namespace {

#if LGC_X86
__attribute__((target("avx2"))) void thin_mq_avx2(const float* M, int64_t n, int64_t m, const float* qt, int64_t r,
                                                   float* out) {
    const int64_t body = m / 8 * 8;
    for (int64_t i = 0; i < n; ++i) {
        const float* row = M + i * m;
        __m256 acc[kThinMax];
        for (int64_t c = 0; c < r; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < body; j += 8) {
            const __m256 v = _mm256_loadu_ps(row + j);
            for (int64_t c = 0; c < r; ++c) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(v, _mm256_loadu_ps(qt + c * m + j)));
        }
        for (int64_t c = 0; c < r; ++c) {
            float total = lanes_sum(acc[c]);
            for (int64_t j = body; j < m; ++j) total += row[j] * qt[c * m + j];
            out[i * r + c] = total;
        }
    }
}

__attribute__((target("avx2"))) void thin_mtp_avx2(const float* M, int64_t n, int64_t m, const float* p, int64_t r,
                                                    float* acc) {  // acc: r x m, zeroed
    const int64_t body = m / 8 * 8;
    for (int64_t i = 0; i < n; ++i) {
        const float* row = M + i * m;
        for (int64_t c = 0; c < r; ++c) {
            const __m256 w = _mm256_set1_ps(p[i * r + c]);
            float* a = acc + c * m;
            for (int64_t j = 0; j < body; j += 8)
                _mm256_storeu_ps(a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_mul_ps(_mm256_loadu_ps(row + j), w)));
            for (int64_t j = body; j < m; ++j) a[j] += row[j] * p[i * r + c];
        }
    }
}
#endif

// The r columns of a row-major m x r matrix, each contiguous (its transpose, r x m).
std::vector<float> columns(const float* Q, int64_t m, int64_t r) {
    std::vector<float> qt(static_cast<size_t>(r * m));
    for (int64_t j = 0; j < m; ++j)
        for (int64_t c = 0; c < r; ++c) qt[c * m + j] = Q[j * r + c];
    return qt;
}

#if LGC_X86
__attribute__((target("avx2"))) void subtract_product_avx2(float* M, int64_t n, int64_t m, const float* p,
                                                            const float* qt, int64_t r) {
    const int64_t body = m / 8 * 8;
    for (int64_t i = 0; i < n; ++i) {
        float* row = M + i * m;
        const float* w = p + i * r;
        for (int64_t j = 0; j < body; j += 8) {
            __m256 acc = _mm256_mul_ps(_mm256_set1_ps(w[0]), _mm256_loadu_ps(qt + j));
            for (int64_t c = 1; c < r; ++c)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(qt + c * m + j)));
            _mm256_storeu_ps(row + j, _mm256_sub_ps(_mm256_loadu_ps(row + j), acc));
        }
        for (int64_t j = body; j < m; ++j) {
            float acc = w[0] * qt[j];
            for (int64_t c = 1; c < r; ++c) acc += w[c] * qt[c * m + j];
            row[j] -= acc;
        }
    }
}
#endif

}  // namespace

// M (n x m) -= P (n x r) @ Q (m x r)^T in place, one read and write of M: entry (i, j) subtracts
// sum_c P[i, c] Q[j, c], summed over c in order. All row-major contiguous fp32.
void subtract_product(uintptr_t mat, int64_t n, int64_t m, uintptr_t left, uintptr_t right, int64_t r, int level) {
    const GilRelease release(n * m >= kReleaseGil);
    float* M = reinterpret_cast<float*>(mat);
    const float* P = reinterpret_cast<const float*>(left);
    const float* Q = reinterpret_cast<const float*>(right);
    const std::vector<float> qt = columns(Q, m, r);
#if LGC_X86
    if (std::min(level, kLevel) >= 2) {
        subtract_product_avx2(M, n, m, P, qt.data(), r);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < m; ++j) {
            float acc = P[i * r] * qt[j];
            for (int64_t c = 1; c < r; ++c) acc += P[i * r + c] * qt[c * m + j];
            M[i * m + j] -= acc;
        }
}

// out (n x r) = M (n x m) @ Q (m x r), all row-major contiguous fp32.
void thin_matmul(uintptr_t mat, int64_t n, int64_t m, uintptr_t factor, int64_t r, uintptr_t dst, int level) {
    const GilRelease release(n * m >= kReleaseGil);
    const float* M = reinterpret_cast<const float*>(mat);
    const float* Q = reinterpret_cast<const float*>(factor);
    float* out = reinterpret_cast<float*>(dst);
    const std::vector<float> qt = columns(Q, m, r);
#if LGC_X86
    if (std::min(level, kLevel) >= 2) {
        thin_mq_avx2(M, n, m, qt.data(), r, out);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
        const float* row = M + i * m;
        for (int64_t c = 0; c < r; ++c) {
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const int64_t body = m / 8 * 8;
            for (int64_t j = 0; j < body; j += 8)
                for (int k = 0; k < 8; ++k) lanes[k] += row[j + k] * qt[c * m + j + k];
            float total = lanes_sum(lanes);
            for (int64_t j = body; j < m; ++j) total += row[j] * qt[c * m + j];
            out[i * r + c] = total;
        }
    }
}

// out (m x r) = M^T @ P, M (n x m) and P (n x r) row-major contiguous fp32.
void thin_matmul_t(uintptr_t mat, int64_t n, int64_t m, uintptr_t factor, int64_t r, uintptr_t dst, int level) {
    const GilRelease release(n * m >= kReleaseGil);
    const float* M = reinterpret_cast<const float*>(mat);
    const float* P = reinterpret_cast<const float*>(factor);
    float* out = reinterpret_cast<float*>(dst);
    std::vector<float> acc(static_cast<size_t>(r * m), 0.0f);  // (M^T P)^T: r rows of m
#if LGC_X86
    if (std::min(level, kLevel) >= 2) {
        thin_mtp_avx2(M, n, m, P, r, acc.data());
    } else
#endif
    {
        for (int64_t i = 0; i < n; ++i)
            for (int64_t c = 0; c < r; ++c)
                for (int64_t j = 0; j < m; ++j) acc[c * m + j] += M[i * m + j] * P[i * r + c];
    }
    for (int64_t j = 0; j < m; ++j)
        for (int64_t c = 0; c < r; ++c) out[j * r + c] = acc[c * m + j];
}

}  // namespace lgc

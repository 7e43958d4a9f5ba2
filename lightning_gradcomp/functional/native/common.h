// What several sources of the compiled CPU kernel share, and the entry points module.cpp binds. The kernel is ONE
// pybind11 module built from functional/native/*.cpp by lightning_gradcomp/functional/_native.py (package data,
// compiled once per machine into torch's extensions directory, before training: Compressor.prepare). Only module.cpp
// includes pybind11 (its headers are most of the build's time); the others are plain C++ on raw addresses (the
// Python wrappers check dtypes, sizes and contiguity), in namespace lgc, their helpers in anonymous namespaces:
//   select.cpp    top-k selections: at_least, approx, exact (radix selection, threshold scan)
//   quantize.cpp  stochastic rounding and decoding: stochastic_round, dequantize, dequantize_mean, dequantize_add
//   axpy.cpp      base + alpha * x: add_scaled
//   casts.cpp     16-bit casts: scaled_cast, widen
//   finite.cpp    the NaN/Inf scan: any_nonfinite
//   sign.cpp      scaled sign: sign_codes, sign_quantize
//   gemm.cpp      PowerSGD's thin products: thin_matmul, thin_matmul_t, subtract_product
//   feedback.cpp  error feedback: compensate
//   delta16.cpp   delta16 indices: delta16_encode, delta16_decode
//   bitpack.cpp   bit packing: pack, unpack, pack_into
//   module.cpp    PYBIND11_MODULE(LGC_MODULE_NAME) (the build defines the name), kLevel, GilRelease
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LGC_X86 1
#else
#define LGC_X86 0
#endif

namespace lgc {

constexpr int64_t kReleaseGil = 1 << 16;  // smaller calls keep the GIL (releasing it costs more than they do)

// Releases the GIL for its scope when `release` (pybind11's gil_scoped_release; defined in module.cpp).
class GilRelease {
   public:
    explicit GilRelease(bool release);
    ~GilRelease();
    GilRelease(const GilRelease&) = delete;
    GilRelease& operator=(const GilRelease&) = delete;

   private:
    void* held_;  // the pybind11::gil_scoped_release, or nullptr
};

// The widest instruction set this CPU (and OS) runs: 0 portable C++, 1 SSE2, 2 AVX2, 3 AVX-512F (module.cpp; the
// module's `level`). The entry points run at min(level, kLevel) for the level they are given.
extern const int kLevel;

inline bool fma_supported() {
#if LGC_X86
    static const bool has = __builtin_cpu_supports("fma");
    return has;
#else
    return false;
#endif
}

template <typename V> inline void grow(std::vector<V>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
}

// ------------------------------------------------------------------------ codes (quantize, sign, bitpack)
// The values of scaled sign codes (levels 0): (code * 2 - 1) * scale, torch's steps.
inline void sign_generic(const uint8_t* c, int64_t m, float scale, float* out) {
    for (int64_t j = 0; j < m; ++j) {
        const float v = static_cast<float>(c[j]) * 2.0f - 1.0f;
        out[j] = v * scale;
    }
}

// The most codes decoded at a time (quantize.cpp's codes_at unpacks them into a buffer this long, which stays in L1).
constexpr int64_t kCodeChunk = 512;

// The codes of every byte value, little-endian: entry v holds (v >> (B * k)) & mask at byte k, k < 8 / B.
template <int B> struct UnpackTable {
    uint8_t codes[256][8 / B];
    UnpackTable() {
        for (unsigned v = 0; v < 256; ++v)
            for (int k = 0; k < 8 / B; ++k) codes[v][k] = static_cast<uint8_t>((v >> (B * k)) & ((1u << B) - 1));
    }
};

template <int B> const UnpackTable<B>& unpack_table() {
    static const UnpackTable<B> table;  // thread-safe initialisation (C++11)
    return table;
}

// Code i of a row packed B bits wide.
template <int B> inline unsigned packed_code(const uint8_t* row, int64_t i) {
    constexpr int per = 8 / B;
    return (row[i / per] >> (B * (i % per))) & ((1u << B) - 1);
}

template <int B> void unpack_span(const uint8_t* row, int64_t first, int64_t len, uint8_t* out) {
    constexpr int per = 8 / B;
    const UnpackTable<B>& table = unpack_table<B>();
    int64_t i = first, k = 0;
    for (; k < len && i % per != 0; ++k, ++i) out[k] = static_cast<uint8_t>(packed_code<B>(row, i));
    for (; k + per <= len; k += per, i += per) std::memcpy(out + k, table.codes[row[i / per]], per);
    for (; k < len; ++k, ++i) out[k] = static_cast<uint8_t>(packed_code<B>(row, i));
}

// ------------------------------------------------------------------------ axpy (quantize, sign, axpy)
// o1 = b + a1 * d and, when o2 is not null, o2 = b + a2 * d, each entry one fused multiply-add (torch.add's bits).
constexpr int64_t kAxpyChunk = kCodeChunk;  // the decoded chunk of dequantize_add and sign_residual

inline void axpy_generic(const float* d, const float* b, int64_t m, float a1, float* o1, float a2, float* o2) {
    for (int64_t j = 0; j < m; ++j) {
        const float x = d[j], y = b[j];
        o1[j] = std::fma(a1, x, y);
        if (o2 != nullptr) o2[j] = std::fma(a2, x, y);
    }
}

#if LGC_X86
__attribute__((target("avx2,fma"))) void axpy_avx2(const float* d, const float* b, int64_t m, float a1, float* o1,
                                                    float a2, float* o2);  // axpy.cpp
#endif

// ------------------------------------------------------------------------ lane sums (sign, gemm)
// 8 lanes summed as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)): the order of lanes_sum below, for the scalar loops.
inline float lanes_sum(const float* lanes) {
    const float h0 = lanes[0] + lanes[4], h1 = lanes[1] + lanes[5], h2 = lanes[2] + lanes[6], h3 = lanes[3] + lanes[7];
    return (h0 + h2) + (h1 + h3);
}

#if LGC_X86
// The 8 lanes of v summed as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
__attribute__((target("avx2"))) inline float lanes_sum(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes i + (i + 4)
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));                               // + (i + 2)
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));                      // + (i + 1)
}
#endif

// ------------------------------------------------------------------------ entry points (module.cpp binds them)
// select.cpp: the selection of select_approx / select_exact is in selected() until release_scratch().
int64_t at_least(uintptr_t x, int64_t n, bool is_double, double threshold, uintptr_t out, int64_t capacity, int level);
int select_approx(uintptr_t x, int64_t n, bool is_double, int64_t offset, int64_t stride, double aim1, double aim2,
                  int64_t k, int64_t lo, int64_t hi, int level, int64_t* count);
bool select_exact(uintptr_t x, int64_t n, bool is_double, int64_t k, int64_t step, int level);
const int64_t* selected();
void release_scratch();
// quantize.cpp
void stochastic_round(uintptr_t x, uintptr_t minus, int64_t n, uint64_t key, int64_t group_size, int levels, bool given,
                      uintptr_t scales, uintptr_t codes, int level);
void dequantize(uintptr_t codes, int64_t rows, int64_t n, int64_t code_stride, int bits, int64_t first,
                uintptr_t scales, int64_t scale_stride, int64_t group_size, int levels, uintptr_t out, int level);
void dequantize_mean(uintptr_t codes, int64_t rows, int64_t n, int64_t code_stride, int bits, int64_t first,
                     uintptr_t scales, int64_t scale_stride, int64_t group_size, int levels, uintptr_t out, int level);
void dequantize_add(uintptr_t codes, int bits, int64_t first, int64_t n, uintptr_t scales, int64_t group_size,
                    int levels, uintptr_t base, double alpha1, uintptr_t out1, double alpha2, uintptr_t out2,
                    int level);
// axpy.cpp
void add_scaled(uintptr_t x, uintptr_t base, int64_t n, double alpha1, uintptr_t out1, double alpha2, uintptr_t out2,
                int level);
// casts.cpp
void scaled_cast(uintptr_t src, int64_t n, double divisor, uintptr_t dst, int kind, int level);
bool widen(uintptr_t src, int64_t n, int kind, uintptr_t dst, int level);
// finite.cpp
bool any_nonfinite(uintptr_t src, int64_t n, int level);
// sign.cpp
void sign_codes(uintptr_t src, int64_t n, uintptr_t dst, int level);
void sign_quantize(uintptr_t src, int64_t n, int64_t group_size, uintptr_t codes, uintptr_t scales, uintptr_t residual,
                   int level);
// gemm.cpp: at most kThinMax columns (the module's thin_max).
constexpr int64_t kThinMax = 32;
void thin_matmul(uintptr_t mat, int64_t n, int64_t m, uintptr_t factor, int64_t r, uintptr_t dst, int level);
void thin_matmul_t(uintptr_t mat, int64_t n, int64_t m, uintptr_t factor, int64_t r, uintptr_t dst, int level);
void subtract_product(uintptr_t mat, int64_t n, int64_t m, uintptr_t left, uintptr_t right, int64_t r, int level);
// feedback.cpp
bool compensate(uintptr_t memory, uintptr_t grad, int64_t n, double divisor, uintptr_t out, bool clear, int level);
// delta16.cpp
bool delta16_encode(uintptr_t indices, uintptr_t ks, uintptr_t caps, int64_t layers, uintptr_t out);
int64_t delta16_decode(uintptr_t codes_ptr, uintptr_t caps, int64_t layers, uintptr_t out, int64_t room);
// bitpack.cpp
void pack(uintptr_t codes, int64_t rows, int64_t n, int64_t stride, int bits, uintptr_t out);
void unpack(uintptr_t packed, int64_t rows, int64_t stride, int bits, int64_t n, uintptr_t out);
void pack_into(uintptr_t codes, int64_t n, int bits, uintptr_t row, int64_t first);

}  // namespace lgc

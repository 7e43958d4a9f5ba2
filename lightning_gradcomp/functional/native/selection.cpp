// The compiled CPU kernel of lightning_gradcomp's top-k selections and stochastic rounding: the functions of
// lightning_gradcomp/functional/_native.py, which builds this file (package data) once per machine into
// torch's extensions directory, before training (Compressor.prepare). A plain pybind11 module: no torch
// headers or libraries; the build defines LGC_MODULE_NAME, the module's name.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LGC_X86 1
#else
#define LGC_X86 0
#endif

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------ keys
// key(v): the bits of |v| as an unsigned integer. Keys order as NumPy sorts |v| (by value, NaN last),
// so an order statistic of the keys is NumPy's order statistic of |v|.
template <typename T> struct KeyOf;
template <> struct KeyOf<float> { using type = uint32_t; };
template <> struct KeyOf<double> { using type = uint64_t; };
template <typename T> using Key = typename KeyOf<T>::type;

template <typename T> inline Key<T> key_of(T v) {
    Key<T> bits;
    std::memcpy(&bits, &v, sizeof bits);
    return bits & (~Key<T>(0) >> 1);
}

template <typename T> inline T value_of(Key<T> bits) {
    T v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

constexpr int kRadix = 11;                // bits per histogram level
constexpr int kBins = 1 << kRadix;
constexpr int64_t kSmallBin = 48;         // a bin this small is finished by nth_element
constexpr int64_t kFilterMin = 2048;      // exact(): smaller tensors go straight to radix selection
constexpr int64_t kReleaseGil = 1 << 16;  // smaller calls keep the GIL (releasing it costs more than they do)

template <typename V> inline void grow(std::vector<V>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
}

// The r-th largest (1 <= r <= m) of the keys get(0), ..., get(m - 1), all in [lo, hi]. Radix selection:
// a histogram of 2048 bins over [lo, hi] finds the bin holding it, that bin's keys are copied out, the
// next 11 bits split them, and so on until few are left; nth_element finishes. a and b are scratch.
// Branch-free copies; two interleaved counts, so that repeated bins do not serialise.
template <typename K, typename Get>
K kth_largest(int64_t m, int64_t r, Get get, std::vector<K>& a, std::vector<K>& b, K lo = 0,
              K hi = ~K(0) >> 1) {
    int shift = 0;
    while (((hi - lo) >> shift) >= static_cast<K>(kBins)) ++shift;
    uint32_t hist[2][kBins];
    std::memset(hist, 0, sizeof hist);
    int64_t i = 0;
    for (; i + 2 <= m; i += 2) {
        ++hist[0][(get(i) - lo) >> shift];
        ++hist[1][(get(i + 1) - lo) >> shift];
    }
    if (i < m) ++hist[0][(get(i) - lo) >> shift];
    K bin = kBins - 1;
    for (int64_t c; (c = int64_t(hist[0][bin]) + hist[1][bin]) < r; --bin) r -= c;
    grow(a, m);
    int64_t size = 0;
    for (i = 0; i < m; ++i) {
        const K v = get(i);
        a[size] = v;
        size += ((v - lo) >> shift) == bin;
    }
    while (size > kSmallBin && shift > 0) {  // the keys in a are in [lo, lo + 2^shift)
        lo += bin << shift;
        shift = std::max(0, shift - kRadix);
        std::memset(hist[0], 0, sizeof hist[0]);
        for (i = 0; i < size; ++i) ++hist[0][(a[i] - lo) >> shift];
        bin = kBins - 1;
        for (; static_cast<int64_t>(hist[0][bin]) < r; --bin) r -= hist[0][bin];
        grow(b, size);
        int64_t kept = 0;
        for (i = 0; i < size; ++i) {
            const K v = a[i];
            b[kept] = v;
            kept += ((v - lo) >> shift) == bin;
        }
        a.swap(b);
        size = kept;
    }
    const auto nth = a.begin() + (size - r);
    std::nth_element(a.begin(), nth, a.begin() + size);
    return *nth;
}

// ------------------------------------------------------------------------------------------ threshold scan
// Bit j of mask64<N>(x, t): |x[j]| >= t for the 64 entries at x, false for NaN (as NumPy compares);
// with N = true, also true for NaN (the predicate "not |x[j]| < t").
template <bool N, typename T> inline bool hit(T v, T t) { return N ? !(std::fabs(v) < t) : std::fabs(v) >= t; }

template <bool N, typename T> inline uint64_t mask64_generic(const T* x, T t) {
    uint64_t m = 0;
    for (int j = 0; j < 64; ++j) m |= static_cast<uint64_t>(hit<N>(x[j], t)) << j;
    return m;
}

// Sorted indices of the entries with |x| >= t into out[0:capacity]; returns the true count. Per 64
// entries a bit mask, then (while 64 slots are free) 4 unconditional writes and a loop for the rare
// 5th and later hits, so that the common 0-4 hits per word cost no mispredicted branch.
#define LGC_SCAN_BODY(MASK)                                                            \
    int64_t count = 0;                                                                 \
    int64_t i = 0;                                                                     \
    for (const int64_t body = n - n % 64; i < body; i += 64) {                         \
        uint64_t m = MASK(x + i, t);                                                   \
        if (count + 64 <= capacity) {                                                  \
            const int64_t hits = __builtin_popcountll(m);                              \
            int64_t* o = out + count;                                                  \
            for (int j = 0; j < 4; ++j) { /* past the hits: overwritten later */       \
                o[j] = i + __builtin_ctzll(m | (uint64_t(1) << 63));                   \
                m &= m - 1;                                                            \
            }                                                                          \
            for (int64_t j = 4; j < hits; ++j) {                                       \
                o[j] = i + __builtin_ctzll(m);                                         \
                m &= m - 1;                                                            \
            }                                                                          \
            count += hits;                                                             \
        } else {                                                                       \
            for (; m != 0; m &= m - 1) {                                               \
                if (count < capacity) out[count] = i + __builtin_ctzll(m);             \
                ++count;                                                               \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    for (; i < n; ++i) {                                                               \
        if (hit<N>(x[i], t)) {                                                         \
            if (count < capacity) out[count] = i;                                      \
            ++count;                                                                   \
        }                                                                              \
    }                                                                                  \
    return count;

template <bool N, typename T> int64_t scan_generic(const T* x, int64_t n, T t, int64_t* out, int64_t capacity) {
    LGC_SCAN_BODY(mask64_generic<N>)
}

#if LGC_X86
template <bool N> inline uint64_t mask64_sse2(const float* x, float t) {
    const __m128 abs_bits = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    const __m128 tt = _mm_set1_ps(t);
    uint64_t m = 0;
    for (int q = 0; q < 16; ++q) {
        const __m128 v = _mm_and_ps(_mm_loadu_ps(x + 4 * q), abs_bits);
        m |= static_cast<uint64_t>(_mm_movemask_ps(N ? _mm_cmpnlt_ps(v, tt) : _mm_cmpge_ps(v, tt))) << (4 * q);
    }
    return m;
}

template <bool N> inline uint64_t mask64_sse2(const double* x, double t) {
    const __m128d abs_bits = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffLL));
    const __m128d tt = _mm_set1_pd(t);
    uint64_t m = 0;
    for (int q = 0; q < 32; ++q) {
        const __m128d v = _mm_and_pd(_mm_loadu_pd(x + 2 * q), abs_bits);
        m |= static_cast<uint64_t>(_mm_movemask_pd(N ? _mm_cmpnlt_pd(v, tt) : _mm_cmpge_pd(v, tt))) << (2 * q);
    }
    return m;
}

template <bool N>
__attribute__((target("avx2,popcnt"))) inline uint64_t mask64_avx2(const float* x, float t) {
    const __m256 abs_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 tt = _mm256_set1_ps(t);
    uint64_t m = 0;
    for (int q = 0; q < 8; ++q) {
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + 8 * q), abs_bits);
        const __m256 hit = _mm256_cmp_ps(v, tt, N ? _CMP_NLT_UQ : _CMP_GE_OQ);
        m |= static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_ps(hit))) << (8 * q);
    }
    return m;
}

template <bool N>
__attribute__((target("avx2,popcnt"))) inline uint64_t mask64_avx2(const double* x, double t) {
    const __m256d abs_bits = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    const __m256d tt = _mm256_set1_pd(t);
    uint64_t m = 0;
    for (int q = 0; q < 16; ++q) {
        const __m256d v = _mm256_and_pd(_mm256_loadu_pd(x + 4 * q), abs_bits);
        const __m256d hit = _mm256_cmp_pd(v, tt, N ? _CMP_NLT_UQ : _CMP_GE_OQ);
        m |= static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_pd(hit))) << (4 * q);
    }
    return m;
}

template <bool N>
__attribute__((target("avx512f,popcnt"))) inline uint64_t mask64_avx512(const float* x, float t) {
    const __m512 tt = _mm512_set1_ps(t);
    uint64_t m = 0;
    for (int q = 0; q < 4; ++q) {
        const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + 16 * q));
        m |= static_cast<uint64_t>(_mm512_cmp_ps_mask(v, tt, N ? _CMP_NLT_UQ : _CMP_GE_OQ)) << (16 * q);
    }
    return m;
}

template <bool N>
__attribute__((target("avx512f,popcnt"))) inline uint64_t mask64_avx512(const double* x, double t) {
    const __m512d tt = _mm512_set1_pd(t);
    uint64_t m = 0;
    for (int q = 0; q < 8; ++q) {
        const __m512d v = _mm512_abs_pd(_mm512_loadu_pd(x + 8 * q));
        m |= static_cast<uint64_t>(_mm512_cmp_pd_mask(v, tt, N ? _CMP_NLT_UQ : _CMP_GE_OQ)) << (8 * q);
    }
    return m;
}

template <bool N, typename T> int64_t scan_sse2(const T* x, int64_t n, T t, int64_t* out, int64_t capacity) {
    LGC_SCAN_BODY(mask64_sse2<N>)
}

template <bool N, typename T>
__attribute__((target("avx2,popcnt"))) int64_t scan_avx2(const T* x, int64_t n, T t, int64_t* out, int64_t capacity) {
    LGC_SCAN_BODY(mask64_avx2<N>)
}

template <bool N, typename T>
__attribute__((target("avx512f,popcnt")))
int64_t scan_avx512(const T* x, int64_t n, T t, int64_t* out, int64_t capacity) {
    LGC_SCAN_BODY(mask64_avx512<N>)
}
#endif

// The widest instruction set this CPU (and OS) runs: 0 portable C++, 1 SSE2, 2 AVX2, 3 AVX-512F.
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

const int kLevel = detect_level();

inline bool fma_supported() {
#if LGC_X86
    static const bool has = __builtin_cpu_supports("fma");
    return has;
#else
    return false;
#endif
}

// Sorted indices of |x| >= t (N: or NaN) at the given level, as LGC_SCAN_BODY.
template <typename T, bool N = false>
int64_t scan(const T* x, int64_t n, T t, int64_t* out, int64_t capacity, int level) {
    level = std::min(level, kLevel);
#if LGC_X86
    if (level >= 3) return scan_avx512<N, T>(x, n, t, out, capacity);
    if (level == 2) return scan_avx2<N, T>(x, n, t, out, capacity);
    if (level == 1) return scan_sse2<N, T>(x, n, t, out, capacity);
#endif
    return scan_generic<N, T>(x, n, t, out, capacity);
}

// ------------------------------------------------------------------------------------------ selections
template <typename K> struct Scratch {
    std::vector<K> sample, keys, a, b;
};

template <typename K> Scratch<K>& scratch() {
    thread_local Scratch<K> s;
    return s;
}

thread_local std::vector<int64_t> tl_indices;  // the result, copied into a fresh array at the end

constexpr size_t kKeep = size_t(1) << 22;  // larger scratch vectors are freed after the call

template <typename V> void shrink(std::vector<V>& v) {
    if (v.capacity() > kKeep) std::vector<V>().swap(v);
}

enum Status { kDone = 0, kNone = 1, kTies = 2 };

// The k largest |x| among the sorted candidates idx[0:m] (m > hi >= k, all |x| >= t), compacted in
// place and still sorted; kTies (idx untouched) when more than hi candidates tie at or above the k-th
// largest.
template <typename T> int trim(const T* x, T t, int64_t* idx, int64_t m, int64_t k, int64_t hi, int64_t* count) {
    Scratch<Key<T>>& s = scratch<Key<T>>();
    grow(s.keys, m);
    Key<T>* keys = s.keys.data();
    Key<T> top = 0;
    for (int64_t j = 0; j < m; ++j) top = std::max(top, keys[j] = key_of(x[idx[j]]));  // never NaN
    const Key<T> cut = kth_largest<Key<T>>(m, k, [&](int64_t j) { return keys[j]; }, s.a, s.b, key_of(t), top);
    int64_t kept = 0;
    for (int64_t j = 0; j < m; ++j) kept += keys[j] >= cut;
    if (kept > hi) {
        *count = m;
        return kTies;
    }
    int64_t w = 0;
    for (int64_t j = 0; j < m; ++j) {
        idx[w] = idx[j];
        w += keys[j] >= cut;
    }
    *count = kept;
    return kDone;
}

// The whole NumPy pass of selection._approx_numpy: systematic sample x[offset::stride], its order
// statistic for each aim, the threshold scan, the trim. Result in tl_indices[0:count].
template <typename T>
int approx_impl(const T* x, int64_t n, int64_t offset, int64_t stride, double aim1, double aim2, int64_t k,
                int64_t lo, int64_t hi, int level, int64_t* count) {
    Scratch<Key<T>>& s = scratch<Key<T>>();
    std::vector<int64_t>& idx = tl_indices;
    const int64_t m = (n - offset - 1) / stride + 1;
    s.sample.resize(m);
    for (int64_t j = 0; j < m; ++j) s.sample[j] = key_of(x[offset + j * stride]);
    const size_t reserve = static_cast<size_t>(std::max<int64_t>(hi, 2 * static_cast<int64_t>(std::ceil(aim1)) + 64));
    if (idx.size() < reserve) idx.resize(reserve);
    for (const double aim : {aim1, aim2}) {
        const double share = aim * static_cast<double>(m) / static_cast<double>(n);  // as selection.py rounds
        const int64_t rank = std::min<int64_t>(m, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(share))));
        const T t = value_of<T>(kth_largest<Key<T>>(m, rank, [&](int64_t j) { return s.sample[j]; }, s.a, s.b));
        int64_t found = scan<T>(x, n, t, idx.data(), static_cast<int64_t>(idx.size()), level);
        if (found > hi) {
            if (found > static_cast<int64_t>(idx.size())) {
                idx.resize(found);
                scan<T>(x, n, t, idx.data(), found, level);
            }
            return trim<T>(x, t, idx.data(), found, k, hi, count);
        }
        if (found >= lo) {  // found <= hi <= idx.size(): complete
            *count = found;
            return kDone;
        }
    }
    *count = 0;
    return kNone;
}

py::array_t<int64_t> to_array(const int64_t* src, int64_t count) {
    py::array_t<int64_t> out(count);
    if (count > 0) std::memcpy(out.mutable_data(), src, static_cast<size_t>(count) * sizeof(int64_t));
    return out;
}

void release_scratch() {
    shrink(tl_indices);
    Scratch<uint32_t>& s32 = scratch<uint32_t>();
    Scratch<uint64_t>& s64 = scratch<uint64_t>();
    for (auto* v : {&s32.sample, &s32.keys, &s32.a, &s32.b}) shrink(*v);
    for (auto* v : {&s64.sample, &s64.keys, &s64.a, &s64.b}) shrink(*v);
}

// Raw addresses keep the build free of the torch headers (seconds instead of a minute or more);
// the Python wrappers check dtypes, sizes and contiguity.
int64_t at_least(uintptr_t x, int64_t n, bool is_double, double threshold, uintptr_t out, int64_t capacity,
                 int level) {
    int64_t* dst = reinterpret_cast<int64_t*>(out);
    if (is_double) return scan<double>(reinterpret_cast<const double*>(x), n, threshold, dst, capacity, level);
    return scan<float>(reinterpret_cast<const float*>(x), n, static_cast<float>(threshold), dst, capacity, level);
}

py::tuple approx(uintptr_t x, int64_t n, bool is_double, int64_t offset, int64_t stride, double aim1, double aim2,
                 int64_t k, int64_t lo, int64_t hi, int level) {
    int status;
    int64_t count = 0;
    {
        std::optional<py::gil_scoped_release> release;  // other threads may run while a large x is read
        if (n >= kReleaseGil) release.emplace();
        status = is_double ? approx_impl<double>(reinterpret_cast<const double*>(x), n, offset, stride, aim1, aim2, k,
                                                 lo, hi, level, &count)
                           : approx_impl<float>(reinterpret_cast<const float*>(x), n, offset, stride, aim1, aim2, k,
                                                lo, hi, level, &count);
    }
    py::array_t<int64_t> result = to_array(tl_indices.data(), count);
    release_scratch();
    return py::make_tuple(status, result);
}

// Exact top-k of |x| (1 <= k < n) into tl_indices[0:k]: the k-th largest |x| in NumPy's order (NaN
// last), then every entry at or above it; false when that is not exactly k entries (ties, or NaN, at
// the cut: the caller decides those). The cut is found among the candidates "NaN or |x| >= t", t from a
// systematic sample of every step-th entry (the caller's _native.exact_stride: about 1000 entries, at a
// stride that meets every column of a matrix): one scan aiming at about 1.5 k + 64 candidates; when fewer than k pass (the sample overestimated
// the tail: about one call in twenty), a second scan at the sample's threshold for 4 k + 256; then radix
// selection over all entries, several passes, only when that too finds fewer than k. The thresholds steer
// only the time: the set is the k largest whichever finds it. The cut among the candidates is a radix selection
// over their keys' range (kth_largest), not std::nth_element: 25-40 % less time on the bench models' layers.
template <typename T> bool exact_impl(const T* x, int64_t n, int64_t k, int64_t step, int level) {
    using K = Key<T>;
    Scratch<K>& s = scratch<K>();
    std::vector<int64_t>& idx = tl_indices;
    grow(idx, k);
    if (n >= kFilterMin) {
        const int64_t m = (n - 1) / step + 1;
        for (const double aim : {1.5 * static_cast<double>(k) + 64.0, 4.0 * static_cast<double>(k) + 256.0}) {
            const int64_t rank = std::min<int64_t>(m, static_cast<int64_t>(aim * static_cast<double>(m) / n) + 1);
            const T t = value_of<T>(kth_largest<K>(m, rank, [&](int64_t j) { return key_of(x[step * j]); }, s.a, s.b));
            grow(idx, 2 * static_cast<int64_t>(aim) + 2 * step * rank + 64);
            int64_t found = scan<T, true>(x, n, t, idx.data(), static_cast<int64_t>(idx.size()), level);
            if (found < k) continue;  // too few candidates: a lower threshold
            if (found > static_cast<int64_t>(idx.size())) {  // more than room for: the count is exact, scan again
                grow(idx, found);
                found = scan<T, true>(x, n, t, idx.data(), found, level);
            }
            grow(s.keys, found);  // the cut is among the candidates: radix selection over their keys' own range
            // (not from key(t): a NaN sample threshold makes every entry a candidate, keys below key(t) included)
            K lo = ~K(0), hi = 0;
            for (int64_t j = 0; j < found; ++j) {
                const K key = s.keys[j] = key_of(x[idx[j]]);
                lo = std::min(lo, key);
                hi = std::max(hi, key);
            }
            const K cut = kth_largest<K>(found, k, [&](int64_t j) { return s.keys[j]; }, s.a, s.b, lo, hi);
            if (cut > key_of(std::numeric_limits<T>::infinity())) return false;  // a NaN cut
            int64_t kept = 0;
            for (int64_t j = 0; j < found; ++j) {  // NaN keys are above the cut too: they are not kept
                idx[kept] = idx[j];
                kept += (s.keys[j] >= cut) & (s.keys[j] <= key_of(std::numeric_limits<T>::infinity()));
            }
            return kept == k;
        }
    }
    const T cut = value_of<T>(kth_largest<K>(n, k, [&](int64_t j) { return key_of(x[j]); }, s.a, s.b));
    return scan<T>(x, n, cut, idx.data(), k, level) == k;
}

py::object exact(uintptr_t x, int64_t n, bool is_double, int64_t k, int64_t step, int level) {
    bool found;
    {
        std::optional<py::gil_scoped_release> release;  // other threads may run while a large x is read
        if (n >= kReleaseGil) release.emplace();
        found = is_double ? exact_impl<double>(reinterpret_cast<const double*>(x), n, k, step, level)
                          : exact_impl<float>(reinterpret_cast<const float*>(x), n, k, step, level);
    }
    py::object result = py::none();
    if (found) result = to_array(tl_indices.data(), k);
    release_scratch();
    return result;
}

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

// n < 2^32 (the caller checks): the draw index is the entry's 32-bit position. minus (0: none) is subtracted from
// x first, group by group, without writing x - minus anywhere but a group-sized scratch.
void stochastic_round(uintptr_t x, uintptr_t minus, int64_t n, uint64_t key, int64_t group_size, int levels,
                      bool given, uintptr_t scales, uintptr_t codes, int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
    stochastic_round_impl(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(minus), n, key,
                          group_size, static_cast<float>(levels), given, reinterpret_cast<float*>(scales),
                          reinterpret_cast<uint8_t*>(codes), level);
}

inline void sign_generic(const uint8_t* c, int64_t m, float scale, float* out) {
    for (int64_t j = 0; j < m; ++j) {
        const float v = static_cast<float>(c[j]) * 2.0f - 1.0f;
        out[j] = v * scale;
    }
}

// Codes first, ..., first + len - 1 of a row stored `bits` wide (1, 2, 4 or 8; 8 / bits codes per byte, little-endian
// in the byte, as pack writes them). Width 8 is one code per byte: the row itself. Narrower codes are unpacked into
// buf (len <= kCodeChunk), which stays in L1: the row's codes are never written out as bytes.
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

// quantize.dequantize into fp32: rows of n codes (row strides in bytes; codes first, ..., first + n - 1 of each row,
// stored `bits` wide as codes_at reads them) with their groups' scales; out is (rows, n), contiguous.
// value = (float(code) - L) * (scale / L), or (float(code) * 2 - 1) * scale for L = 0 (scaled sign), torch's steps.
void dequantize(uintptr_t codes, int64_t rows, int64_t n, int64_t code_stride, int bits, int64_t first,
                uintptr_t scales, int64_t scale_stride, int64_t group_size, int levels, uintptr_t out, int level) {
    std::optional<py::gil_scoped_release> release;
    if (rows * n >= kReleaseGil) release.emplace();
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
    std::optional<py::gil_scoped_release> release;
    if (rows * n >= kReleaseGil) release.emplace();
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
constexpr int64_t kAxpyChunk = kCodeChunk;

inline void axpy_generic(const float* d, const float* b, int64_t m, float a1, float* o1, float a2, float* o2) {
    for (int64_t j = 0; j < m; ++j) {
        const float x = d[j], y = b[j];
        o1[j] = std::fma(a1, x, y);
        if (o2 != nullptr) o2[j] = std::fma(a2, x, y);
    }
}

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

void dequantize_add(uintptr_t codes, int bits, int64_t first, int64_t n, uintptr_t scales, int64_t group_size,
                    int levels, uintptr_t base, double alpha1, uintptr_t out1, double alpha2, uintptr_t out2,
                    int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
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

// axpy.add_scaled: out1 = base + alpha1 * x and, when out2 is not 0, out2 = base + alpha2 * x, each entry one fused
// multiply-add (torch.add(base, x, alpha=a)'s bits, as dequantize_add's). The outputs may alias base or x.
void add_scaled(uintptr_t x, uintptr_t base, int64_t n, double alpha1, uintptr_t out1, double alpha2, uintptr_t out2,
                int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
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

// ------------------------------------------------------------------------------------------ 16-bit casts
// half.scaled_cast / half.widen: fp32 x / d rounded to fp16 (kind 0) or bf16 (kind 1), to nearest even, and back
// to fp32 (exact) with a NaN/Inf check in the same pass. Finite values and infinities give torch's bits
// (`.div_(d)` then `.half()` / `.bfloat16()`); NaNs stay NaNs (torch's own NaN bits differ between its vector and
// scalar loops). fp16 uses the F16C conversions, as torch's vector loop does.
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

void scaled_cast(uintptr_t src, int64_t n, double divisor, uintptr_t dst, int kind, int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
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
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
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

// ------------------------------------------------------------------------------------------ NaN/Inf scan
// finite.nonfinite_flag: whether any of n fp32 values is NaN or infinite (exponent bits all ones), one read pass.
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

bool any_nonfinite(uintptr_t src, int64_t n, int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
    const uint32_t* x = reinterpret_cast<const uint32_t*>(src);
    bool bad = false;
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2) j = any_nonfinite_avx2(x, n, &bad);
#endif
    for (; j < n && !bad; ++j) bad = (x[j] & 0x7f800000u) == 0x7f800000u;
    return bad;
}

// ------------------------------------------------------------------------------------------ sign codes
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
#endif

// quantize.sign_quantize: the codes above and, per group of group_size (the last one shorter), the mean |x| in one
// pass; when residual is not 0, also the group's x - decode() right after its mean, while the group is in cache
// (sign_residual). Each group's |x| are summed in 8 lanes (entry j of the group into lane j % 8, in order),
// the lanes pairwise ((0+4)+(2+6)) + ((1+5)+(3+7)), then the group's last m % 8 entries in order; the sum is divided
// by the group's length. The same bits at every level (the scalar loop keeps the lanes too); not torch's order.
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

void sign_quantize(uintptr_t src, int64_t n, int64_t group_size, uintptr_t codes, uintptr_t scales, uintptr_t residual,
                   int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
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
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
    const float* x = reinterpret_cast<const float*>(src);
    uint8_t* out = reinterpret_cast<uint8_t*>(dst);
    int64_t j = 0;
#if LGC_X86
    if (std::min(level, kLevel) >= 2) j = sign_codes_avx2(x, n, out);
#endif
    for (; j < n; ++j) out[j] = x[j] >= 0.0f ? 1 : 0;
}

// ------------------------------------------------------------------------------------------ thin products
// lowrank.thin_matmul / thin_matmul_t: PowerSGD's M Q and M^T P for an n x m row-major M and r (<= kThinMax)
// columns, each reading M once (BLAS runs these skinny shapes at a tenth of that speed on one core). Fixed
// summation order: M Q sums each row's products in 8 lanes of m / 8 terms, then the lanes pairwise; M^T P sums
// over the rows in order. fp32 throughout, no FMA (deterministic on any CPU at a given level).
constexpr int64_t kThinMax = 32;

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

// M (n x m) -= P (n x r) @ Q (m x r)^T in place, one read and write of M: entry (i, j) subtracts
// sum_c P[i, c] Q[j, c], summed over c in order. All row-major contiguous fp32.
void subtract_product(uintptr_t mat, int64_t n, int64_t m, uintptr_t left, uintptr_t right, int64_t r, int level) {
    std::optional<py::gil_scoped_release> release;
    if (n * m >= kReleaseGil) release.emplace();
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
    std::optional<py::gil_scoped_release> release;
    if (n * m >= kReleaseGil) release.emplace();
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
    std::optional<py::gil_scoped_release> release;
    if (n * m >= kReleaseGil) release.emplace();
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

// ------------------------------------------------------------------------------------------ error feedback
// feedback.compensate: p = m + g (or m + g / d when d > 0), fp32, one pass; with clear, g = 0 in the same pass
// (the engine's sparsifiers write their few kept entries into g's zeroed storage). Each value is one fp32 add
// (after one fp32 division), as torch's add / addcdiv round it. Returns whether some g is NaN or infinite
// (exponent bits all ones), checked on the values as loaded.
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

bool compensate(uintptr_t memory, uintptr_t grad, int64_t n, double divisor, uintptr_t out, bool clear, int level) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
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

// ------------------------------------------------------------------------------------------ delta16 indices
// sparsify.encode_delta16_layers: layer l's ks[l] sorted indices as uint16 gaps in its caps[l] codes (code 0 advances
// 65535 without keeping an entry; unused codes stay 0). Returns false, writing nothing past a layer's codes, when an
// index is not above the previous one or the gaps need more codes than the layer has (the caller raises).
bool delta16_encode(uintptr_t indices, uintptr_t ks, uintptr_t caps, int64_t layers, uintptr_t out) {
    const int64_t* idx = reinterpret_cast<const int64_t*>(indices);
    const int64_t* k = reinterpret_cast<const int64_t*>(ks);
    const int64_t* cap = reinterpret_cast<const int64_t*>(caps);
    uint16_t* codes = reinterpret_cast<uint16_t*>(out);
    int64_t e = 0, first = 0;
    for (int64_t l = 0; l < layers; ++l) {
        int64_t c = first, previous = -1;
        const int64_t end = first + cap[l];
        for (int64_t j = 0; j < k[l]; ++j, ++e) {
            int64_t gap = idx[e] - previous;
            if (gap < 1) return false;
            previous = idx[e];
            for (; gap > 65535; gap -= 65535) {
                if (c >= end) return false;
                codes[c++] = 0;
            }
            if (c >= end) return false;
            codes[c++] = static_cast<uint16_t>(gap);
        }
        std::memset(codes + c, 0, sizeof(uint16_t) * (end - c));
        first = end;
    }
    return true;
}

// sparsify.decode_delta16_layers: every layer's indices from its caps[l] codes, back to back into out (room for
// `room`); returns how many, or -1 when they would not fit.
int64_t delta16_decode(uintptr_t codes_ptr, uintptr_t caps, int64_t layers, uintptr_t out, int64_t room) {
    const uint16_t* codes = reinterpret_cast<const uint16_t*>(codes_ptr);
    const int64_t* cap = reinterpret_cast<const int64_t*>(caps);
    int64_t* idx = reinterpret_cast<int64_t*>(out);
    int64_t n = 0, c = 0;
    for (int64_t l = 0; l < layers; ++l) {
        int64_t position = -1;
        for (const int64_t end = c + cap[l]; c < end; ++c) {
            const uint16_t v = codes[c];
            if (v == 0) {
                position += 65535;
            } else {
                if (n >= room) return -1;
                position += v;
                idx[n++] = position;
            }
        }
    }
    return n;
}

// ------------------------------------------------------------------------------------------ bit packing
// packing.pack_bits / unpack_bits for widths that divide 8 (2 or 4; 8 / bits codes per byte, little-endian
// in the byte, the last byte zero-padded), on rows: byte = c0 | c1 << b | ..., each shift truncated to 8
// bits as torch's uint8 shifts are (so codes out of range give the same bytes as the torch steps).
#if LGC_X86
// 32 codes in [0, 2**B) per step into 4 B bytes, little-endian as pack_row writes them. B = 1: each code moved to its
// byte's top bit and gathered by movemask (byte k -> bit k). B = 2, 4: neighbours joined by multiply-adds
// (c0 + c1 << B, ...; no carries, the codes being in range) and the sums narrowed to bytes.
template <int B>
__attribute__((target("avx2"))) void pack_avx2(const uint8_t* c, int64_t blocks, uint8_t* out) {
    for (int64_t b = 0; b < blocks; ++b, c += 32, out += 4 * B) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
        if (B == 1) {
            const uint32_t mask = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
            std::memcpy(out, &mask, 4);
        } else if (B == 4) {  // 16-bit c0 + 16 c1, narrowed: 16 bytes
            const __m256i pairs = _mm256_maddubs_epi16(v, _mm256_set1_epi16(0x1001));
            const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
        } else {  // 16-bit c0 + 4 c1, then 32-bit (c0 + 4 c1) + 16 (c2 + 4 c3), narrowed: 8 bytes
            const __m256i pairs = _mm256_maddubs_epi16(v, _mm256_set1_epi16(0x0401));
            const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x00100001));
            const __m256i words = _mm256_packus_epi32(quads, quads);
            const __m256i bytes = _mm256_packus_epi16(words, words);
            const __m256i joined = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(joined));
        }
    }
}
#endif

template <int B> void pack_row(const uint8_t* c, int64_t n, uint8_t* out) {
    constexpr int per = 8 / B;
    const int64_t whole = n / per;
    for (int64_t i = 0; i < whole; ++i) {
        unsigned byte = 0;
        for (int k = 0; k < per; ++k) byte |= static_cast<unsigned>(c[i * per + k]) << (B * k);
        out[i] = static_cast<uint8_t>(byte);
    }
    if (whole * per < n) {
        unsigned byte = 0;
        for (int64_t k = 0; whole * per + k < n; ++k) byte |= static_cast<unsigned>(c[whole * per + k]) << (B * k);
        out[whole] = static_cast<uint8_t>(byte);
    }
}

// rows of n codes (row stride in bytes) into rows of ceil(n * bits / 8) bytes, contiguous.
void pack(uintptr_t codes, int64_t rows, int64_t n, int64_t stride, int bits, uintptr_t out) {
    const int64_t nbytes = (n * bits + 7) / 8;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* c = reinterpret_cast<const uint8_t*>(codes) + r * stride;
        uint8_t* o = reinterpret_cast<uint8_t*>(out) + r * nbytes;
        if (bits == 4) pack_row<4>(c, n, o); else pack_row<2>(c, n, o);
    }
}

// packing into a payload: n codes (values in [0, 2**bits), one per byte: quantizer codes, in range by construction;
// wider values give other bytes than pack's) become codes first, ..., first + n - 1 of a row packed `bits` wide (1, 2,
// 4 or 8). The bytes they share with codes before first or after the last one are OR-ed into, so the row must be zero
// there; every other byte is written.
template <int B> void pack_span(const uint8_t* c, int64_t n, uint8_t* row, int64_t first) {
    constexpr int per = 8 / B;
    int64_t j = 0, i = first;
    for (; j < n && i % per != 0; ++j, ++i) row[i / per] |= static_cast<uint8_t>(c[j] << (B * (i % per)));
    uint8_t* out = row + i / per;
#if LGC_X86
    if (kLevel >= 2) {
        const int64_t blocks = (n - j) / 32;
        pack_avx2<B>(c + j, blocks, out);
        j += 32 * blocks, i += 32 * blocks, out += 4 * B * blocks;
    }
#endif
    const int64_t whole = (n - j) / per;
    pack_row<B>(c + j, whole * per, out);
    j += whole * per, i += whole * per;
    for (; j < n; ++j, ++i) row[i / per] |= static_cast<uint8_t>(c[j] << (B * (i % per)));
}

void pack_into(uintptr_t codes, int64_t n, int bits, uintptr_t row, int64_t first) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGil) release.emplace();
    const uint8_t* c = reinterpret_cast<const uint8_t*>(codes);
    uint8_t* r = reinterpret_cast<uint8_t*>(row);
    switch (bits) {
        case 1: pack_span<1>(c, n, r, first); break;
        case 2: pack_span<2>(c, n, r, first); break;
        case 4: pack_span<4>(c, n, r, first); break;
        default: std::memcpy(r + first, c, static_cast<size_t>(n));
    }
}

// rows of packed bytes (row stride in bytes) into rows of n codes, contiguous.
void unpack(uintptr_t packed, int64_t rows, int64_t stride, int bits, int64_t n, uintptr_t out) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* p = reinterpret_cast<const uint8_t*>(packed) + r * stride;
        uint8_t* o = reinterpret_cast<uint8_t*>(out) + r * n;
        if (bits == 4) unpack_span<4>(p, 0, n, o); else unpack_span<2>(p, 0, n, o);
    }
}

}  // namespace

PYBIND11_MODULE(LGC_MODULE_NAME, m) {
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

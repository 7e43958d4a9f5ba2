// Top-k selections: the CPU steps of selection.py (approx, exact) and the threshold scan (at_least), in radix
// selection on the bits of |x| and a compare-mask scan with SSE2, AVX2 or AVX-512 chosen at run time. module.cpp
// binds them (and copies the selection into a NumPy array).
#include <limits>

#include "common.h"

namespace lgc {
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

}  // namespace

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

// The approximate selection (approx_impl) into selected()[0:*count]; returns its Status. The GIL is released while
// a large x is read (other threads may run).
int select_approx(uintptr_t x, int64_t n, bool is_double, int64_t offset, int64_t stride, double aim1, double aim2,
                  int64_t k, int64_t lo, int64_t hi, int level, int64_t* count) {
    const GilRelease release(n >= kReleaseGil);
    return is_double ? approx_impl<double>(reinterpret_cast<const double*>(x), n, offset, stride, aim1, aim2, k, lo,
                                           hi, level, count)
                     : approx_impl<float>(reinterpret_cast<const float*>(x), n, offset, stride, aim1, aim2, k, lo, hi,
                                          level, count);
}

// The exact top-k (exact_impl) into selected()[0:k]; false when it is not unique. The GIL as select_approx.
bool select_exact(uintptr_t x, int64_t n, bool is_double, int64_t k, int64_t step, int level) {
    const GilRelease release(n >= kReleaseGil);
    return is_double ? exact_impl<double>(reinterpret_cast<const double*>(x), n, k, step, level)
                     : exact_impl<float>(reinterpret_cast<const float*>(x), n, k, step, level);
}

const int64_t* selected() { return tl_indices.data(); }

}  // namespace lgc

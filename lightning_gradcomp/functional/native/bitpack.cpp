// Bit packing (packing.py and the quantizers' wire layout): pack, unpack and pack_into.
// packing.pack_bits / unpack_bits for widths that divide 8 (2 or 4; 8 / bits codes per byte, little-endian
// in the byte, the last byte zero-padded), on rows: byte = c0 | c1 << b | ..., each shift truncated to 8
// bits as torch's uint8 shifts are (so codes out of range give the same bytes as the torch steps).
#include "common.h"

namespace lgc {
namespace {

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

}  // namespace

// rows of n codes (row stride in bytes) into rows of ceil(n * bits / 8) bytes, contiguous.
void pack(uintptr_t codes, int64_t rows, int64_t n, int64_t stride, int bits, uintptr_t out) {
    const int64_t nbytes = (n * bits + 7) / 8;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* c = reinterpret_cast<const uint8_t*>(codes) + r * stride;
        uint8_t* o = reinterpret_cast<uint8_t*>(out) + r * nbytes;
        if (bits == 4) pack_row<4>(c, n, o); else pack_row<2>(c, n, o);
    }
}

void pack_into(uintptr_t codes, int64_t n, int bits, uintptr_t row, int64_t first) {
    const GilRelease release(n >= kReleaseGil);
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

}  // namespace lgc

// delta16 index encoding (sparsify.py): delta16_encode and delta16_decode.
#include "common.h"

namespace lgc {

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

}  // namespace lgc

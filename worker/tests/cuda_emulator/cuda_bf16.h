// __nv_bfloat16 on the CPU for the kernel emulator (see cuda_runtime.hpp): the top half of an
// f32, rounded to nearest even as __float2bfloat16_rn.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t bits = (uint32_t)h.bits << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    __nv_bfloat16 h;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (uint16_t)((bits >> 16) | 0x40);  // NaN stays a (quiet) NaN
    } else {
        h.bits = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
    }
    return h;
}

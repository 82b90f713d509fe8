// __half on the CPU for the kernel emulator (see cuda_runtime.hpp): IEEE binary16 storage,
// converted with the compiler's _Float16, which rounds to nearest even as __float2half_rn.
#pragma once

#include <cstdint>
#include <cstring>

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    _Float16 f;
    std::memcpy(&f, &h.bits, sizeof f);
    return (float)f;
}

inline __half __float2half_rn(float x) {
    const _Float16 f = (_Float16)x;
    __half h;
    std::memcpy(&h.bits, &f, sizeof f);
    return h;
}

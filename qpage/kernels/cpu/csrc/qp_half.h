/* IEEE half <-> float bit conversions shared by the quantized-cache kernels (exact, round to
 * nearest even, subnormals included), written with integer operations so every build and
 * the torch references agree bit for bit. */
#ifndef QP_HALF_H
#define QP_HALF_H
#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

static inline float bits_f32(uint32_t b) {
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* IEEE half bits -> float (exact, subnormals included). */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0) {
        const float v = (float)mant * (1.0f / 16777216.0f); /* mant * 2^-24 */
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7F800000 | (mant << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Round mant >> shift to nearest, ties to even (1 <= shift <= 31). */
static inline uint32_t round_shift(uint32_t mant, int shift) {
    const uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    return q + (rem > half || (rem == half && (q & 1)));
}

/* float -> IEEE half bits, round to nearest even (finite inputs; overflow gives inf). */
static inline uint16_t f32_to_half(float x) {
    const uint32_t b = f32_bits(x), sign = (b >> 16) & 0x8000, a = b & 0x7FFFFFFF;
    if (a >= 0x7F800000) return (uint16_t)(sign | (a > 0x7F800000 ? 0x7E00 : 0x7C00));
    if (a >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* >= 65520 rounds to inf */
    if (a < 0x38800000) {                                   /* below 2^-14: a half subnormal (or 0) */
        int shift = 126 - (int)(a >> 23);
        shift = shift > 31 ? 31 : shift;
        return (uint16_t)(sign | round_shift((a & 0x7FFFFF) | 0x800000, shift));
    }
    const uint32_t r = a + 0xFFF + ((a >> 13) & 1);
    return (uint16_t)(sign | ((r - (112u << 23)) >> 13));
}

#endif

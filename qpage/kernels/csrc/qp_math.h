/* Shared by qpage's C kernels. */
#ifndef QP_MATH_H
#define QP_MATH_H
#include <stdint.h>

/* exp(x) for x <= 0 in plain arithmetic so loops over it vectorize (libm's expf is a scalar
 * call unless the whole file is built with -ffast-math, which would also switch the process
 * to flush-to-zero). x = n ln2 + r with |r| <= ln2 / 2; exp(r) by its degree-7 Taylor
 * polynomial (relative error < 2e-7, about 2 ulp); 2^n goes into the exponent bits. Below
 * -87.3 the result is 0 (fp32 underflow). */
static inline float exp_nonpos(float x) {
    const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
    const int under = x < -87.3f;
    x = under ? 0.0f : x;
    /* Round to nearest by adding and subtracting 1.5 * 2^23 (roundf has no vector form). */
    const float n = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    __builtin_memcpy(&two_n, &e, sizeof two_n);
    return under ? 0.0f : p * two_n;
}

/* Reductions in 16-float vectors (GCC/Clang vector extensions: AVX-512 registers where the
 * CPU has them, pairs of AVX2 ones otherwise), summed by a fixed halving tree: a float
 * reduction does not vectorize without -ffast-math, and omp-simd reductions go through
 * the stack. Results differ from a left-to-right sum by rounding only. */
typedef float qp_v16 __attribute__((vector_size(64)));
typedef float qp_v8 __attribute__((vector_size(32)));
typedef float qp_v4 __attribute__((vector_size(16)));

static inline qp_v16 load16(const float *p) {
    qp_v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(qp_v16 v) {
    const qp_v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const qp_v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

static inline float dot(const float *a, const float *b, int n) {
    qp_v16 acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
    float s = hsum16(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float sum(const float *a, int64_t n) {
    qp_v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += load16(a + i);
    float s = hsum16(acc);
    for (; i < n; i++) s += a[i];
    return s;
}

#endif

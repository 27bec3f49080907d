/* Shared by qpage's C kernels. */
#ifndef QP_MATH_H
#define QP_MATH_H
#include <stdint.h>
#include <stdlib.h>

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

/* y[:n] += sum over t < count of p[t] * x[t * stride : t * stride + n]: the output row stays
 * in registers over a cache block's tokens (n % 16 == 0 and n <= 256), else a plain loop. */
static inline void weighted_rows(float *y, const float *p, const float *x, int64_t stride, int64_t count, int n) {
    if (n % 16 == 0 && n <= 256) {
        qp_v16 acc[16];
        for (int c = 0; c < n / 16; c++) acc[c] = (qp_v16){0};
        for (int64_t t = 0; t < count; t++)
            for (int c = 0; c < n / 16; c++) acc[c] += p[t] * load16(x + t * stride + 16 * c);
        for (int c = 0; c < n / 16; c++) {
            const qp_v16 r = load16(y + 16 * c) + acc[c];
            __builtin_memcpy(y + 16 * c, &r, sizeof r);
        }
        return;
    }
    for (int64_t t = 0; t < count; t++)
        for (int d = 0; d < n; d++) y[d] += p[t] * x[t * stride + d];
}

/* Row-wise softmax numerators in place over scores [num_rows, len] with the rows' maxima in
 * m; m[r] becomes 1 / the row's denominator (applied later by qp_scale_rows). */
static inline void qp_softmax_numerators(float *scores, float *m, int num_rows, int64_t len) {
    for (int r = 0; r < num_rows; r++) {
        float *row = scores + (int64_t)r * len;
        for (int64_t t = 0; t < len; t++) row[t] = exp_nonpos(row[t] - m[r]);
        m[r] = 1.0f / sum(row, len);
    }
}

/* out [num_rows, n] row r times mul[r]. */
static inline void qp_scale_rows(float *out, const float *mul, int num_rows, int n) {
    for (int r = 0; r < num_rows; r++) {
        float *o = out + (int64_t)r * n;
        for (int d = 0; d < n; d++) o[d] *= mul[r];
    }
}

/* The longest seq_len of a decode batch, after checking its block table: every seq_len >= 1,
 * its blocks within table_cols, and each block id it reaches in [0, num_blocks). Returns -2
 * when a check fails (the caller then reads nothing). */
static inline int64_t qp_check_decode_tables(const int64_t *block_table, int64_t table_stride, int64_t table_cols,
                                             const int64_t *seq_lens, int num_seqs, int block_size,
                                             int64_t num_blocks) {
    int64_t longest = 1;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t used = (seq_lens[s] + block_size - 1) / block_size;
        if (seq_lens[s] < 1 || used > table_cols) return -2;
        for (int64_t b = 0; b < used; b++)
            if (block_table[s * table_stride + b] < 0 || block_table[s * table_stride + b] >= num_blocks) return -2;
        if (seq_lens[s] > longest) longest = seq_lens[s];
    }
    return longest;
}

/* Decode scratch: scores [num_heads, longest] followed by m [num_heads]; NULL on failure. */
static inline float *qp_score_scratch(int num_heads, int64_t longest, float **m) {
    float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(longest + 1));
    if (scores) *m = scores + (size_t)num_heads * (size_t)longest;
    return scores;
}

#endif

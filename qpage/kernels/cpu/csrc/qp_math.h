/* Shared by qpage's C kernels. */
#ifndef QP_MATH_H
#define QP_MATH_H
#include <math.h>
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

/* tanh(x) without libm's scalar call, so that loops over it vectorize: an odd Taylor
 * polynomial (to x^9; next term < 3e-9 relative) below |x| = 0.25, (1 - e) / (1 + e) with
 * e = exp(-2|x|) above (no cancellation there: e < 0.61); a few ulp either way. */
static inline float qp_tanh(float x) {
    const float a = fabsf(x), e = exp_nonpos(-2.0f * a), a2 = a * a;
    const float big = (1.0f - e) / (1.0f + e);
    const float small =
        a * (1.0f + a2 * (-1.0f / 3.0f + a2 * (2.0f / 15.0f + a2 * (-17.0f / 315.0f + a2 * (62.0f / 2835.0f)))));
    const float t = a < 0.25f ? small : big;
    return x < 0.0f ? -t : t;
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

/* hsum16 of 16 vectors at once: lane t of the result is hsum16(v[t]), bit for bit (the same
 * pairs are added, in the same tree), with 45 vector operations instead of 16 reductions of 7. */
static inline __attribute__((always_inline)) qp_v16 hsum16x16(const qp_v16 *v) {
    qp_v16 r[8], s[4], u[2];
    for (int i = 0; i < 8; i++)
        r[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        s[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* dst[t] = dot(q, x + t * stride, n) for t < count, bit for bit: a cache block's scores
 * against one query. With n % 16 == 0, n <= 128 and 16 rows readable at x (readable >= 16 >=
 * count; rows past count are computed and dropped), all 16 reductions run at once. */
static inline __attribute__((always_inline)) void block_dots(const float *q, const float *x, int64_t stride,
                                                             int64_t count, int64_t readable, int n, float *dst) {
    if (n % 16 || n > 128 || count > 16 || readable < 16) {
        for (int64_t t = 0; t < count; t++) dst[t] = dot(q, x + t * stride, n);
        return;
    }
    qp_v16 acc[16];
    for (int t = 0; t < 16; t++) {
        acc[t] = (qp_v16){0};
        for (int i = 0; i < n; i += 16) acc[t] += load16(q + i) * load16(x + t * stride + i);
    }
    const qp_v16 r = hsum16x16(acc);
    __builtin_memcpy(dst, &r, sizeof(float) * (size_t)count);
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

/* Row-wise softmax numerators in place over scores [num_rows, len] (rows stride floats apart)
 * with the rows' maxima in m; m[r] becomes 1 / the row's denominator (applied later by
 * qp_scale_rows). sinks [num_rows] or NULL: one more logit per row in the denominator, with no
 * value (gpt-oss's attention sinks). */
static inline void qp_softmax_numerators(float *scores, int64_t stride, float *m, int num_rows, int64_t len,
                                         const float *sinks) {
    for (int r = 0; r < num_rows; r++) {
        float *row = scores + (int64_t)r * stride;
        const float mx = sinks && sinks[r] > m[r] ? sinks[r] : m[r];
        for (int64_t t = 0; t < len; t++) row[t] = exp_nonpos(row[t] - mx);
        m[r] = 1.0f / (sum(row, len) + (sinks ? exp_nonpos(sinks[r] - mx) : 0.0f));
    }
}

/* The first position a row of context length seq_len attends to: seq_len - window with a
 * sliding window (window > 0) shorter than its context, else 0. */
static inline int64_t qp_window_start(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* A score soft-capped: softcap * tanh(s / softcap) (Gemma 2); unchanged when softcap is 0. */
static inline float qp_softcap(float s, float softcap) {
    return softcap > 0.0f ? softcap * qp_tanh(s / softcap) : s;
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

/* Threads for attention over num_seqs query rows: one for a decode step's few rows (bound by
 * memory; a second thread pool would fight the matmuls' for the cores), `threads` when the
 * rows' work is large (a prompt chunk's rows, each over its own context). Each row is
 * computed by one thread in one order, so the count changes no result. */
static inline int qp_attention_threads(const int64_t *seq_lens, int num_seqs, int num_heads, int head_dim,
                                       int threads) {
    int64_t work = 0;
    for (int s = 0; s < num_seqs; s++) work += seq_lens[s];
    return num_seqs > 1 && threads > 1 && work * num_heads * head_dim >= ((int64_t)1 << 21) ? threads : 1;
}

/* Attention scratch for `rows` queries: scores [rows * num_heads, longest] followed by m
 * [rows * num_heads]; NULL on failure. */
static inline float *qp_score_scratch(int rows, int num_heads, int64_t longest, float **m) {
    const size_t n = (size_t)rows * (size_t)num_heads;
    float *scores = malloc(sizeof(float) * n * (size_t)(longest + 1));
    if (scores) *m = scores + n * (size_t)longest;
    return scores;
}

#endif

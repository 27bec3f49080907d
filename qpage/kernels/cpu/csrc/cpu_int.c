/* The int8/int4 KV cache on CPU: cache write (per-token-head parameters) and paged decode
 * attention reading the codes in place, called through ctypes (qpage/kernels/cpu/native_int.py).
 *
 * Layout as qpage/kernels/kv_int.py (K and V may differ in width): per slot and kv head, int8 codes [head_dim] with one fp16
 * scale (value = code * scale), or int4 codes packed two a byte [head_dim / 2] (low nibble:
 * channel d, high nibble: channel d + head_dim / 2) with fp16 (scale, zero) (value = code *
 * scale + zero). The write is bit-exact with kv_int.write_int_cache_ref: fp32 amax or
 * min/max, an fp32 divide, the scale rounded up to fp16 and the zero to nearest even, codes
 * rounded to nearest even by nearbyintf (the default rounding mode) and clamped.
 *
 * Decode converts a block's codes for one kv head to floats once and applies each token's
 * parameters to the score and the probability, not per element: with k = c * s + z,
 * q.k = s * (q.c) + z * sum(q), and sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t.
 * Codes are widened by vpmovsx/vpmovzx and converted by vcvtdq2ps, 16 at a time with
 * AVX-512, 8 with AVX2 (intrinsics: GCC scalarizes byte -> float vector conversions), the
 * rest in a plain loop; the ISA is the build's (-march=native, chosen per CPU at run time).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qp_half.h"
#include "qp_math.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define QP_INT_AVX2 1
#else
#define QP_INT_AVX2 0
#endif
#if defined(__AVX512F__)
#define QP_INT_AVX512 1
#else
#define QP_INT_AVX512 0
#endif

#define QP_MIN_SCALE 5.9604644775390625e-08f /* 2^-24, kv_int.MIN_SCALE */

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* Bytes of codes and fp16 parameters per (slot, kv head), as kv_int.code_width and PARAMS. */
static inline int code_width(int bits, int head_dim) { return bits == 8 ? head_dim : head_dim / 2; }
static inline int num_params(int bits) { return bits == 8 ? 1 : 2; }

/* The smallest fp16 >= s (s positive and finite), as kv_int.half_at_least. */
static inline uint16_t half_at_least(float s) {
    const uint16_t h = f32_to_half(s);
    return half_to_f32(h) < s ? (uint16_t)(h + 1) : h;
}

/* One head's row x[n] -> codes and fp16 parameters (bits 8: scale; 4: scale, zero). */
static void quantize_row_int(const float *x, int n, int bits, uint8_t *codes, uint16_t *params) {
    if (bits == 8) {
        float amax = 0.0f;
        for (int d = 0; d < n; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        float s = amax / 127.0f;
        s = s < QP_MIN_SCALE ? QP_MIN_SCALE : s;
        params[0] = half_at_least(s);
        const float sf = half_to_f32(params[0]);
        for (int d = 0; d < n; d++) ((int8_t *)codes)[d] = (int8_t)clampf(nearbyintf(x[d] / sf), -127.0f, 127.0f);
        return;
    }
    float lo = x[0], hi = x[0];
    for (int d = 1; d < n; d++) {
        lo = x[d] < lo ? x[d] : lo;
        hi = x[d] > hi ? x[d] : hi;
    }
    float s = (hi - lo) / 15.0f;
    s = s < QP_MIN_SCALE ? QP_MIN_SCALE : s;
    params[0] = half_at_least(s);
    params[1] = f32_to_half(lo);
    const float sf = half_to_f32(params[0]), zf = half_to_f32(params[1]);
    const int half = n / 2;
    for (int d = 0; d < half; d++) {
        const int c0 = (int)clampf(nearbyintf((x[d] - zf) / sf), 0.0f, 15.0f);
        const int c1 = (int)clampf(nearbyintf((x[d + half] - zf) / sf), 0.0f, 15.0f);
        codes[d] = (uint8_t)(c0 | (c1 << 4));
    }
}

/* Cache write of K or V. x: fp32 rows of [kv_heads * head_dim] (heads contiguous), x_stride
 * floats apart; slots[i] = -1 skips token i; params fp16 bits [num_slots, kv_heads, 1 or 2].
 * Returns 0, or -2 (nothing written) when a slot is outside [-1, num_slots). */
int qp_write_int(const float *x, int64_t x_stride, uint8_t *cache, uint16_t *params, const int64_t *slots,
                 int num_tokens, int kv_heads, int head_dim, int64_t num_slots, int bits) {
    for (int i = 0; i < num_tokens; i++)
        if (slots[i] < -1 || slots[i] >= num_slots) return -2;
    const int width = code_width(bits, head_dim), np = num_params(bits);
    for (int i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t at = slots[i] * kv_heads + h;
            quantize_row_int(x + i * x_stride + (int64_t)h * head_dim, head_dim, bits, cache + at * width,
                             params + at * np);
        }
    }
    return 0;
}

/* row[:n] = the codes of one (slot, head) as floats (int4: unpacked, without scale or zero). */
static inline void codes_to_float(float *row, const uint8_t *codes, int n, int bits) {
    int d = 0;
#if QP_INT_AVX512
    if (bits == 8) {
        for (; d + 16 <= n; d += 16)
            _mm512_storeu_ps(row + d,
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + d)))));
    } else {
        const int half = n / 2;
        const __m512i low = _mm512_set1_epi32(15);
        for (; d + 16 <= half; d += 16) {
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + d)));
            _mm512_storeu_ps(row + d, _mm512_cvtepi32_ps(_mm512_and_si512(c, low)));
            _mm512_storeu_ps(row + half + d, _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)));
        }
    }
#endif
    if (bits == 8) {
#if QP_INT_AVX2
        for (; d + 8 <= n; d += 8)
            _mm256_storeu_ps(row + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d)))));
#endif
        for (; d < n; d++) row[d] = (float)((const int8_t *)codes)[d];
        return;
    }
    const int half = n / 2;
#if QP_INT_AVX2
    const __m256i low = _mm256_set1_epi32(15);
    for (; d + 8 <= half; d += 8) {
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d)));
        _mm256_storeu_ps(row + d, _mm256_cvtepi32_ps(_mm256_and_si256(c, low)));
        _mm256_storeu_ps(row + half + d, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)));
    }
#endif
    for (; d < half; d++) {
        row[d] = (float)(codes[d] & 15);
        row[half + d] = (float)(codes[d] >> 4);
    }
}

/* Rows first..first+count-1 of kv head kh: codes as floats into buf [count, head_dim], each
 * row's scale into s and zero into z (0 for int8). */
static inline void load_block(float *buf, float *s, float *z, const uint8_t *cache, const uint16_t *params,
                              int bits, int64_t first, int64_t count, int kh, int num_kv_heads, int head_dim) {
    const int width = code_width(bits, head_dim), np = num_params(bits);
    for (int64_t t = 0; t < count; t++) {
        const int64_t at = (first + t) * num_kv_heads + kh;
        codes_to_float(buf + t * head_dim, cache + at * width, head_dim, bits);
        s[t] = half_to_f32(params[at * np]);
        z[t] = np == 2 ? half_to_f32(params[at * np + 1]) : 0.0f;
    }
}

/* One sequence over integer codes, a cache block and kv head at a time (as attend_seq_fp8 in
 * cpu_fp8.c). w: scratch [4 * block_size]; zs: scratch [num_heads]. */
static inline __attribute__((always_inline)) void attend_seq_int(
    const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const uint16_t *kp, const uint16_t *vp, int k_bits,
    int v_bits,
    const int64_t *blocks, int64_t seq_len, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int64_t window, float softcap, const float *sinks, float *scores, float *m, float *buf, float *w,
    float *zs, float *out) {
    const int group = num_heads / num_kv_heads;
    const int64_t start = qp_window_start(seq_len, window), from = start - start % block_size;
    float *s = w, *z = w + block_size, *pw = w + 2 * block_size;
    for (int h = 0; h < num_heads; h++) {
        m[h] = -INFINITY;
        zs[h] = sum(q + (int64_t)h * head_dim, head_dim); /* sum(q) for the zeros' term */
    }
    for (int64_t b0 = from; b0 < seq_len; b0 += block_size) {
        const int64_t first = blocks[b0 / block_size] * block_size;
        const int64_t count = seq_len - b0 < block_size ? seq_len - b0 : block_size;
        const int64_t t0 = b0 < start ? start - b0 : 0;
        for (int kh = 0; kh < num_kv_heads; kh++) {
            load_block(buf, s, z, k_cache, kp, k_bits, first, count, kh, num_kv_heads, head_dim);
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                float *row = scores + (int64_t)h * seq_len + b0;
                const float qs = zs[h];
                block_dots(q + (int64_t)h * head_dim, buf + t0 * head_dim, head_dim, count - t0, block_size - t0,
                           head_dim, row + t0);
                float mx = m[h]; /* in a register (m and row share one allocation) */
                for (int64_t t = t0; t < count; t++) {
                    row[t] = qp_softcap((row[t] * s[t] + z[t] * qs) * scale, softcap);
                    mx = row[t] > mx ? row[t] : mx;
                }
                m[h] = mx;
            }
        }
    }
    qp_softmax_numerators(scores + start, seq_len, m, num_heads, seq_len - start, sinks);
    memset(out, 0, sizeof(float) * (size_t)num_heads * head_dim);
    memset(zs, 0, sizeof(float) * (size_t)num_heads); /* now sum_t p_t z_t per head */
    for (int64_t b0 = from; b0 < seq_len; b0 += block_size) {
        const int64_t first = blocks[b0 / block_size] * block_size;
        const int64_t count = seq_len - b0 < block_size ? seq_len - b0 : block_size;
        const int64_t t0 = b0 < start ? start - b0 : 0;
        for (int kh = 0; kh < num_kv_heads; kh++) {
            load_block(buf, s, z, v_cache, vp, v_bits, first, count, kh, num_kv_heads, head_dim);
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                const float *p = scores + (int64_t)h * seq_len + b0;
                float pz = 0.0f;
                for (int64_t t = t0; t < count; t++) {
                    pw[t] = p[t] * s[t];
                    pz += p[t] * z[t];
                }
                zs[h] += pz;
                weighted_rows(out + (int64_t)h * head_dim, pw + t0, buf + t0 * head_dim, head_dim, count - t0,
                              head_dim);
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        float *o = out + (int64_t)h * head_dim;
        for (int d = 0; d < head_dim; d++) o[d] += zs[h];
    }
    qp_scale_rows(out, m, num_heads, head_dim);
}

/* Decode attention over an integer cache; arguments as qp_paged_decode_f32 (cpu_attention.c)
 * plus the parameters (fp16 bits per slot and kv head), K's and V's bits (8 or 4), and the
 * window and soft cap (as qp_paged_decode_f32). Returns 0; -1 when
 * the scratch cannot be allocated; -2 for a bad seq_len or block id; -3 for an odd head_dim
 * with int4 codes. */
int qp_paged_decode_int(const float *q, int64_t q_seq_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                        const uint16_t *k_params, const uint16_t *v_params, int k_bits, int v_bits,
                        const int64_t *block_table,
                        int64_t table_stride, int64_t table_cols, const int64_t *seq_lens, float *out, int num_seqs,
                        int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                        int64_t num_blocks, int threads, int64_t window, float softcap, const float *sinks) {
    if (head_dim % 2 && (k_bits == 4 || v_bits == 4)) return -3;
    const int64_t longest =
        qp_check_decode_tables(block_table, table_stride, table_cols, seq_lens, num_seqs, block_size, num_blocks);
    if (longest < 0) return -2;
    int failed = 0;
#pragma omp parallel num_threads(qp_attention_threads(seq_lens, num_seqs, num_heads, head_dim, threads))
    {
        float *m = NULL, *scores = qp_score_scratch(1, num_heads, longest, &m);
        float *buf = malloc(sizeof(float) * ((size_t)block_size * (size_t)(head_dim + 3) + (size_t)num_heads));
        if (!scores || !buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *w = buf ? buf + (size_t)block_size * head_dim : NULL, *zs = w ? w + 3 * (size_t)block_size : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int sq = 0; sq < num_seqs; sq++) {
            if (!scores || !buf) continue;
            const float *qs = q + sq * q_seq_stride;
            float *os = out + (int64_t)sq * num_heads * head_dim;
            const int64_t *bt = block_table + sq * table_stride;
            if (head_dim == 64)
                attend_seq_int(qs, k_cache, v_cache, k_params, v_params, k_bits, v_bits, bt, seq_lens[sq], num_heads,
                               num_kv_heads, 64, block_size, scale, window, softcap, sinks, scores, m, buf, w, zs, os);
            else
                attend_seq_int(qs, k_cache, v_cache, k_params, v_params, k_bits, v_bits, bt, seq_lens[sq], num_heads,
                               num_kv_heads, head_dim, block_size, scale, window, softcap, sinks, scores, m, buf, w, zs, os);
        }
        free(buf);
        free(scores);
    }
    return failed ? -1 : 0;
}


/* The FP8 KV cache on CPU: cache write (quantize, per-token scale search) and paged decode
 * attention over the codes, called through ctypes (qpage/kernels/cpu/native_fp8.py).
 *
 * Layout as qpage/layers/kv_format.py: codes uint8 [num_blocks, block_size, kv_heads,
 * head_dim]; per-token scales fp16 (as uint16 bits) [num_blocks, block_size, kv_heads], or
 * one fp32 scale per tensor. value = decode(code) * scale.
 *
 * The write is bit-exact with qpage.kernels.kv_quant.write_kv_cache_ref: the same
 * candidate scales (fp32 amax * c_j, clamped, rounded to fp16 to nearest even), the same
 * encode (fp32 divide, round to nearest even, saturating; integer arithmetic as
 * fp8/codec.py's f32_to_fp8) and fp64 error sums (summed in another order than torch's, so only
 * a near-tie, equal to ~1e-16 relative, could pick another candidate).
 *
 * Decode converts a token's codes, a cache block and kv head at a time, and applies the
 * token's scale to the score (K) or the probability (V) once, not per element. With AVX2 and
 * F16C (x86 -march=native: Haswell on) 16 codes at a time become fp16 by bit operations and
 * fp32 by vcvtph2ps: an e5m2 code is the top byte of its fp16; an e4m3 code's magnitude
 * bits shifted left by 7 are an fp16 worth value / 256 (subnormals included), so the row
 * multiplier takes the 256 (powers of two: the products round as the table's would). The
 * two NaN codes of e4m3 (never written by the cache write) decode as +-480 there. Without
 * them, or for a head_dim tail (head_dim % 16), a 256-entry table built by the caller from
 * torch's float8 conversion. (Intrinsics, not generic vector code: GCC 12 scalarizes byte -> int vector
 * conversions, and those ran slower than the table.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qp_half.h"
#include "qp_math.h"

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#define QP_FP8_F16C 1
#else
#define QP_FP8_F16C 0
#endif

#define QP_MAX_HEAD_DIM 256

/* fp32 -> FP8 code (e4m3fn or e5m2), round to nearest even, saturating at the largest finite. */
static inline uint8_t f32_to_fp8(float x, int e5m2) {
    const int mb = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7, drop = 23 - mb;
    const float fmax = e5m2 ? 57344.0f : 448.0f;
    x = x < -fmax ? -fmax : (x > fmax ? fmax : x);
    const uint32_t b = f32_bits(x), sign = (b >> 24) & 0x80, a = b & 0x7FFFFFFF;
    uint32_t code;
    if (a < ((uint32_t)(128 - bias) << 23)) { /* the format's subnormals (and zero) */
        int shift = (151 - bias - mb) - (int)(a >> 23);
        shift = shift > 31 ? 31 : (shift < 1 ? 1 : shift);
        code = round_shift((a & 0x7FFFFF) | 0x800000, shift);
    } else {
        const uint32_t r = a + ((1u << (drop - 1)) - 1) + ((a >> drop) & 1);
        code = ((((r >> 23) - 127 + (uint32_t)bias) << mb) | ((r >> drop) & ((1u << mb) - 1)));
    }
    return (uint8_t)(code | sign);
}

/* One head's row x[n]: the scale among the candidates with the least squared error (first on
 * ties), its fp16 bits in *scale_out, and the codes. */
static void quantize_row_search(const float *x, int n, const float *mult, int num_cand, const float *lut, int e5m2,
                                uint8_t *codes, uint16_t *scale_out) {
    float amax = 0.0f;
    for (int d = 0; d < n; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    double best_err = 0.0;
    uint16_t best = 0;
    for (int j = 0; j < num_cand; j++) {
        float s = amax * mult[j];
        s = s < 5.9604644775390625e-08f ? 5.9604644775390625e-08f : s; /* MIN_SCALE = 2^-24 */
        const uint16_t sh = f32_to_half(s);
        const float sf = half_to_f32(sh);
        double err = 0.0;
        for (int d = 0; d < n; d++) {
            const double diff = (double)(lut[f32_to_fp8(x[d] / sf, e5m2)] * sf) - (double)x[d];
            err += diff * diff;
        }
        if (j == 0 || err < best_err) {
            best_err = err;
            best = sh;
        }
    }
    const float sf = half_to_f32(best);
    for (int d = 0; d < n; d++) codes[d] = f32_to_fp8(x[d] / sf, e5m2);
    *scale_out = best;
}

/* Cache write. k/v: fp32 rows of [kv_heads * head_dim] (heads contiguous), k_stride/v_stride
 * floats apart; slots[i] = -1 skips token i. Per-token mode when k_scale != NULL (fp16 bits
 * [num_slots, kv_heads], searched among mult[num_cand]); else codes of x / k_div (v_div).
 * Returns 0, or -2 (nothing written) when a slot is outside [-1, num_slots). */
int qp_write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride, uint8_t *k_cache,
                    uint8_t *v_cache, uint16_t *k_scale, uint16_t *v_scale, float k_div, float v_div,
                    const int64_t *slots, int num_tokens, int kv_heads, int head_dim, int64_t num_slots,
                    const float *mult, int num_cand, const float *lut, int e5m2) {
    for (int i = 0; i < num_tokens; i++)
        if (slots[i] < -1 || slots[i] >= num_slots) return -2;
    const int64_t row = (int64_t)kv_heads * head_dim;
    for (int i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        for (int h = 0; h < kv_heads; h++) {
            const float *kx = k + i * k_stride + (int64_t)h * head_dim, *vx = v + i * v_stride + (int64_t)h * head_dim;
            uint8_t *kc = k_cache + slot * row + (int64_t)h * head_dim;
            uint8_t *vc = v_cache + slot * row + (int64_t)h * head_dim;
            if (k_scale) {
                quantize_row_search(kx, head_dim, mult, num_cand, lut, e5m2, kc, k_scale + slot * kv_heads + h);
                quantize_row_search(vx, head_dim, mult, num_cand, lut, e5m2, vc, v_scale + slot * kv_heads + h);
            } else {
                for (int d = 0; d < head_dim; d++) {
                    kc[d] = f32_to_fp8(kx[d] / k_div, e5m2);
                    vc[d] = f32_to_fp8(vx[d] / v_div, e5m2);
                }
            }
        }
    }
    return 0;
}

/* The factor decode_row leaves out of each value (see the top of the file). */
static inline float decode_unit(int e5m2) { return (QP_FP8_F16C && !e5m2) ? 256.0f : 1.0f; }

/* row[:n] = the values of codes[:n] / decode_unit(e5m2). */
static inline void decode_row(float *row, const uint8_t *codes, const float *lut, int n, int e5m2) {
    int d = 0;
#if QP_FP8_F16C
    const __m256i mag = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
    for (; d + 16 <= n; d += 16) {
        const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + d)));
        const __m256i h = e5m2 ? _mm256_slli_epi16(c, 8)
                               : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, mag), 7),
                                                 _mm256_slli_epi16(_mm256_and_si256(c, sign), 8));
        _mm256_storeu_ps(row + d, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(row + d + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
#endif
    const float inv = 1.0f / decode_unit(e5m2);
    for (; d < n; d++) row[d] = lut[codes[d]] * inv;
}

/* Rows first..first+count-1 of kv head kh decoded into buf [count, head_dim], and each row's
 * scale times extra into w (per-token scales when sc != NULL, else the constant mul). */
static inline void decode_block(float *buf, float *w, const uint8_t *cache, const uint16_t *sc, float mul,
                                float extra, const float *lut, int e5m2, int64_t first, int64_t count, int kh,
                                int num_kv_heads, int head_dim) {
    const int64_t tok_stride = (int64_t)num_kv_heads * head_dim;
    extra *= decode_unit(e5m2);
    for (int64_t t = 0; t < count; t++) {
        decode_row(buf + t * head_dim, cache + (first + t) * tok_stride + (int64_t)kh * head_dim, lut, head_dim,
                   e5m2);
        w[t] = (sc ? half_to_f32(sc[(first + t) * num_kv_heads + kh]) : mul) * extra;
    }
}

/* One sequence, as attend_seq in cpu_attention.c, over FP8 codes, a cache block and kv head
 * at a time: the block's rows for that head are decoded into buf [block_size, head_dim] once
 * and used by all the head's queries. ks/vs: fp16 bits per slot and kv head (per-token
 * mode) or NULL with the constant k_mul/v_mul; w: scratch [block_size]. */
static inline __attribute__((always_inline)) void attend_seq_fp8(
    const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const uint16_t *ks, const uint16_t *vs,
    float k_mul, float v_mul, const float *lut, int e5m2, const int64_t *blocks, int64_t seq_len,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int64_t window, float softcap,
    const float *sinks,
    float *scores, float *m, float *buf, float *w, float *out) {
    const int group = num_heads / num_kv_heads;
    const int64_t start = qp_window_start(seq_len, window), from = start - start % block_size;
    for (int h = 0; h < num_heads; h++) m[h] = -INFINITY;
    for (int64_t b0 = from; b0 < seq_len; b0 += block_size) {
        const int64_t first = blocks[b0 / block_size] * block_size;
        const int64_t count = seq_len - b0 < block_size ? seq_len - b0 : block_size;
        const int64_t t0 = b0 < start ? start - b0 : 0;
        for (int kh = 0; kh < num_kv_heads; kh++) {
            decode_block(buf, w, k_cache, ks, k_mul, scale, lut, e5m2, first, count, kh, num_kv_heads, head_dim);
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                float *row = scores + (int64_t)h * seq_len + b0;
                block_dots(q + (int64_t)h * head_dim, buf + t0 * head_dim, head_dim, count - t0, block_size - t0,
                           head_dim, row + t0);
                float mx = m[h]; /* in a register (m and row share one allocation) */
                for (int64_t t = t0; t < count; t++) {
                    row[t] = qp_softcap(row[t] * w[t], softcap);
                    mx = row[t] > mx ? row[t] : mx;
                }
                m[h] = mx;
            }
        }
    }
    qp_softmax_numerators(scores + start, seq_len, m, num_heads, seq_len - start, sinks);
    memset(out, 0, sizeof(float) * (size_t)num_heads * head_dim);
    float *pw = w + block_size;
    for (int64_t b0 = from; b0 < seq_len; b0 += block_size) {
        const int64_t first = blocks[b0 / block_size] * block_size;
        const int64_t count = seq_len - b0 < block_size ? seq_len - b0 : block_size;
        const int64_t t0 = b0 < start ? start - b0 : 0;
        for (int kh = 0; kh < num_kv_heads; kh++) {
            decode_block(buf, w, v_cache, vs, v_mul, 1.0f, lut, e5m2, first, count, kh, num_kv_heads, head_dim);
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                for (int64_t t = t0; t < count; t++) pw[t] = scores[(int64_t)h * seq_len + b0 + t] * w[t];
                weighted_rows(out + (int64_t)h * head_dim, pw + t0, buf + t0 * head_dim, head_dim, count - t0,
                              head_dim);
            }
        }
    }
    qp_scale_rows(out, m, num_heads, head_dim);
}

/* Decode attention over an FP8 cache; arguments as qp_paged_decode_f32 (cpu_attention.c)
 * plus the scales (k_scale/v_scale fp16 bits per slot and kv head, or NULL with the
 * per-tensor k_mul/v_mul), lut[256] (the value of each code) and the format (e5m2: 1, else
 * e4m3), the window and soft cap (as qp_paged_decode_f32). Returns 0; -1 when the
 * scratch cannot be allocated; -2 for a bad seq_len or block id; -3 when head_dim > 256. */
int qp_paged_decode_fp8(const float *q, int64_t q_seq_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                        const uint16_t *k_scale, const uint16_t *v_scale, float k_mul, float v_mul, const float *lut,
                        int e5m2, const int64_t *block_table, int64_t table_stride, int64_t table_cols,
                        const int64_t *seq_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int64_t num_blocks, int threads, int64_t window,
                        float softcap, const float *sinks) {
    if (head_dim > QP_MAX_HEAD_DIM) return -3;
    const int64_t longest =
        qp_check_decode_tables(block_table, table_stride, table_cols, seq_lens, num_seqs, block_size, num_blocks);
    if (longest < 0) return -2;
    int failed = 0;
#pragma omp parallel num_threads(qp_attention_threads(seq_lens, num_seqs, num_heads, head_dim, threads))
    {
        float *m = NULL, *scores = qp_score_scratch(1, num_heads, longest, &m);
        float *buf = malloc(sizeof(float) * (size_t)block_size * (size_t)(head_dim + 2));
        if (!scores || !buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *w = buf ? buf + (size_t)block_size * head_dim : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < num_seqs; s++) {
            if (!scores || !buf) continue;
            const float *qs = q + s * q_seq_stride;
            float *os = out + (int64_t)s * num_heads * head_dim;
            if (head_dim == 64)
                attend_seq_fp8(qs, k_cache, v_cache, k_scale, v_scale, k_mul, v_mul, lut, e5m2,
                               block_table + s * table_stride, seq_lens[s], num_heads, num_kv_heads, 64, block_size,
                               scale, window, softcap, sinks, scores, m, buf, w, os);
            else
                attend_seq_fp8(qs, k_cache, v_cache, k_scale, v_scale, k_mul, v_mul, lut, e5m2,
                               block_table + s * table_stride, seq_lens[s], num_heads, num_kv_heads, head_dim,
                               block_size, scale, window, softcap, sinks, scores, m, buf, w, os);
        }
        free(buf);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The block formats' layouts (cpu_gguf.c describes them): file rows regrouped into the
 * kernels' 16-row layout, rows read back for an embedding lookup, and the activations'
 * int8 blocks. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "qp_gguf.h"
#include "qp_half.h"

/* File rows src [n, k/32 blocks] -> rows [first_row, first_row + n) of an x16 weight dst
 * (first_row a multiple of 16; rows of the last group past n are 0). Groups in parallel. */
int qp_gguf_repack(int type, const uint8_t *src, int64_t n, int k, uint8_t *dst, int64_t first_row, int threads) {
    const int bs = block_bytes(type), nb = k / BLOCK, at = codes_at(type);
    if (!runs(type, k) || first_row % ROWS) return -1;
    const int64_t groups = (n + ROWS - 1) / ROWS, gbs = (int64_t)ROWS * bs, gsize = group_bytes(type, k);
    const int64_t row_bytes = file_row_bytes(type, k);
    uint8_t *base = dst + first_row / ROWS * gsize;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
#endif
    for (int64_t g = 0; g < groups; g++) {
        memset(base + g * gsize, 0, (size_t)gsize);
        if (is_kquant(type)) {
            for (int j = 0; j < ROWS && g * ROWS + j < n; j++) {
                const uint8_t *row = src + (g * ROWS + j) * row_bytes;
                if (type == QT_Q6_K) qp_q6k_repack_row(row, k, base + g * gsize, j);
                else if (type == QT_IQ4_XS) qp_iq4xs_repack_row(row, k, base + g * gsize, j);
                else qp_q4k_repack_row(type, row, k, base + g * gsize, j);
            }
            continue;
        }
        for (int b = 0; b < nb; b++) {
            uint8_t *out = base + (g * nb + b) * gbs;
            for (int j = 0; j < ROWS && g * ROWS + j < n; j++) {
                const uint8_t *blk = src + (g * ROWS + j) * row_bytes + (int64_t)b * bs;
                memcpy(out + 2 * j, blk, 2);
                if (has_m(type)) memcpy(out + 32 + 2 * j, blk + 2, 2);
                const uint8_t *qs = blk + (has_m(type) ? 4 : 2) + (is_q5(type) ? 4 : 0);
                if (is_q5(type)) { /* the high bits: lane j byte u, bit c = weight 4c+u, bit 4+c = weight 16+4c+u */
                    const uint32_t qh = (uint32_t)rd32(qs - 4);
                    for (int u = 0; u < 4; u++) {
                        uint8_t hb = 0;
                        for (int c = 0; c < 4; c++)
                            hb |= (uint8_t)((((qh >> (4 * c + u)) & 1) << c) | (((qh >> (16 + 4 * c + u)) & 1) << (4 + c)));
                        out[at + 256 + 4 * j + u] = hb;
                    }
                }
                const int vecs = is_q8(type) ? 8 : 4;
                for (int c = 0; c < vecs; c++) {
                    uint32_t lane;
                    memcpy(&lane, qs + 4 * c, 4);
                    if (is_q8(type)) lane ^= 0x80808080u;
                    memcpy(out + at + 64 * c + 4 * j, &lane, 4);
                }
            }
        }
    }
#ifndef _OPENMP
    (void)threads;
#endif
    return 0;
}

/* Rows ids[i] (< n) of an x16 weight, dequantized into out [count, k] exactly as llama.cpp
 * dequantizes them. Returns 0, -1 for an unknown format, -2 for an id outside [0, n). */
int qp_gguf_dequant_rows(int type, const uint8_t *w, int64_t n, int k, const int64_t *ids, int64_t count,
                         float *out) {
    const int bs = block_bytes(type), nb = k / BLOCK, at = codes_at(type);
    if (!runs(type, k)) return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -2;
    for (int64_t i = 0; i < count; i++) {
        const int64_t g = ids[i] / ROWS;
        const int j = (int)(ids[i] % ROWS);
        if (is_kquant(type) || is_codebook32(type)) {
            const uint8_t *group = w + g * group_bytes(type, k);
            if (type == QT_Q6_K) qp_q6k_dequant_row(group, k, j, out + i * k);
            else if (type == QT_IQ4_XS || is_codebook32(type)) qp_iq4_dequant_row(type, group, k, j, out + i * k);
            else qp_q4k_dequant_row(type, group, k, j, out + i * k);
            continue;
        }
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + (g * nb + b) * (int64_t)ROWS * bs;
            float *o = out + i * k + b * BLOCK;
            const float d = half_to_f32(rd16(blk + 2 * j));
            const float m = has_m(type) ? half_to_f32(rd16(blk + 32 + 2 * j)) : 0.0f;
            if (is_q8(type)) {
                for (int t = 0; t < BLOCK; t++)
                    o[t] = d * (float)((int)blk[at + 64 * (t / 4) + 4 * j + t % 4] - 128) + m;
                continue;
            }
            const int shift = type == QT_Q4_0 ? 8 : type == QT_Q5_0 ? 16 : 0;
            for (int t = 0; t < 16; t++) {
                const uint8_t q = blk[at + 64 * (t / 4) + 4 * j + t % 4];
                const uint8_t h = is_q5(type) ? blk[at + 256 + 4 * j + t % 4] : 0;
                o[t] = d * (float)((int)((q & 15) | (((h >> (t / 4)) & 1) << 4)) - shift) + m;
                o[t + 16] = d * (float)((int)((q >> 4) | (((h >> (4 + t / 4)) & 1) << 4)) - shift) + m;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ activations */

/* One block of 32: codes q = round(x / dx), dx = amax / 127; returns dx (NaN for a block with a
 * NaN or infinity, whose codes are then 0, so its outputs become NaN) and the codes' sum. */
static inline float quantize_block(const float *x, int8_t *q, int *sum) {
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++) {
        const float a = x[j] < 0 ? -x[j] : x[j];
        amax = (a > amax || a != a) ? a : amax; /* a NaN sticks */
    }
    if (!(amax <= 3.4e38f)) {
        memset(q, 0, BLOCK);
        *sum = 0;
        return NAN;
    }
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int total = 0; /* a local sum: through the pointer it could alias the codes and stop vectorizing */
    for (int j = 0; j < BLOCK; j++) {
        /* Round to nearest even by adding and subtracting 1.5 * 2^23 (vectorizes). */
        const float v = (x[j] * inv + 12582912.0f) - 12582912.0f;
        q[j] = (int8_t)v;
        total += (int)v;
    }
    *sum = total;
    return amax / 127.0f;
}

/* x fp32 [m, k] (row stride ldx, k % 32 == 0) -> qx int8 [m, k], dx and xs = dx sum(qx) float
 * [m, k / 32]; with qr, dr and sr (else NULL) also the residual level: x - dx qx quantized the
 * same way, its scales and scaled sums. */
void qp_quantize_act(const float *x, int64_t ldx, int m, int k, int8_t *q, float *d, float *s, int8_t *qr, float *dr,
                     float *sr, int threads) {
    const int nb = k / BLOCK;
    /* Rows split across `threads` for prefill-sized inputs (a row's blocks are independent). */
#ifdef _OPENMP
#pragma omp parallel for if ((int64_t)m * k >= (1 << 16)) num_threads(threads > 0 ? threads : 1) schedule(static)
#else
    (void)threads;
#endif
    for (int r = 0; r < m; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * BLOCK;
            const int64_t at = (int64_t)r * k + b * BLOCK, bi = (int64_t)r * nb + b;
            int sum = 0;
            const float dx = quantize_block(xb, q + at, &sum);
            d[bi] = dx;
            s[bi] = dx * (float)sum;
            if (qr == NULL) continue;
            float res[BLOCK];
            for (int j = 0; j < BLOCK; j++) res[j] = xb[j] - dx * (float)q[at + j];
            const float dxr = quantize_block(res, qr + at, &sum);
            dr[bi] = dxr;
            sr[bi] = dxr * (float)sum;
        }
    }
}

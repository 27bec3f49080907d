/* Q4_K and Q5_K weights on the block matmuls (cpu_gguf.c dispatches here).
 *
 * File formats, per row and 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and
 * mins m for 8 sub-blocks of 32, [Q5_K: qh[32]], qs[128]; w = d sc q - dmin m, with q in 0..15
 * (Q4_K, 144 B) or 0..31 (Q5_K, 176 B). Sub-block 2i is the low nibbles of qs[32i .. 32i+31],
 * sub-block 2i+1 their high nibbles; Q5_K's fifth bit of weight t of sub-block u is bit u of
 * qh[t]. Scale bytes b: sc_j = b_j & 63, m_j = b_{j+4} & 63 for j < 4;
 * sc_j = (b_{j+4} & 15) | (b_{j-4} >> 6) << 4, m_j = (b_{j+4} >> 4) | (b_j >> 6) << 4 for j >= 4.
 *
 * Kernel layout (148 / 180 B per row and 256 weights: the scales unpacked to a byte each): per
 * super-block a group holds the 16 rows' d, then dmin (16 fp16 each), sc and m as
 * [sub-block][row] bytes (128 B each), then for each pair of sub-blocks 8 vectors of 64 bytes
 * whose lane j holds row j's qs bytes 4c .. 4c+3 of that pair: the low nibbles are the first
 * sub-block's weights 4c .. 4c+3, the high ones the second's; Q5_K then 2 vectors of fifth
 * bits, one per sub-block: bit c of lane j's byte u belongs to weight 4c+u. A sub-block is one
 * activation block, so each adds (d sc) dx sum(q qx) - (dmin m) xs, as Q4_1 does with d and m.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qp_gguf.h"
#include "qp_half.h"

enum { K4_DMIN = 32, K4_SC = 64, K4_M = 192, K4_CODES = 320 };

/* Bytes of a group's super-block, and of one pair of sub-blocks' codes in it. */
static inline int packed_bytes(int type) { return ROWS * (type == QT_Q5_K ? Q5K_PACKED : Q4K_PACKED); }
static inline int pair_bytes(int type) { return type == QT_Q5_K ? 640 : 512; }

/* The fifth bit of weight 4c+u of sub-block h of a pair (0 for Q4_K), as bit 4. */
static inline int fifth(int type, const uint8_t *pair, int j, int h, int c, int u) {
    return type == QT_Q5_K ? ((pair[512 + 64 * h + 4 * j + u] >> c) & 1) << 4 : 0;
}

static inline void q4k_scale_min(const uint8_t *b, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = b[j] & 63, *m = b[j + 4] & 63;
    } else {
        *sc = (b[j + 4] & 15) | ((b[j - 4] >> 6) << 4);
        *m = (b[j + 4] >> 4) | ((b[j] >> 6) << 4);
    }
}

/* One file row -> row j of an x16 group (zeroed by the caller). */
void qp_q4k_repack_row(int type, const uint8_t *src, int k, uint8_t *group, int j) {
    const int q5 = type == QT_Q5_K, pb = pair_bytes(type);
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *in = src + (int64_t)s * (q5 ? Q5K_BYTES : Q4K_BYTES);
        uint8_t *sb = group + (int64_t)s * packed_bytes(type);
        memcpy(sb + 2 * j, in, 2);
        memcpy(sb + K4_DMIN + 2 * j, in + 2, 2);
        for (int u = 0; u < 8; u++) {
            int sc, m;
            q4k_scale_min(in + 4, u, &sc, &m);
            sb[K4_SC + 16 * u + j] = (uint8_t)sc;
            sb[K4_M + 16 * u + j] = (uint8_t)m;
        }
        const uint8_t *qs = in + 16 + (q5 ? 32 : 0), *qh = in + 16;
        for (int i = 0; i < 4; i++) {
            uint8_t *pair = sb + K4_CODES + pb * i;
            for (int c = 0; c < 8; c++) memcpy(pair + 64 * c + 4 * j, qs + 32 * i + 4 * c, 4);
            for (int h = 0; q5 && h < 2; h++)
                for (int c = 0; c < 8; c++)
                    for (int u = 0; u < 4; u++)
                        pair[512 + 64 * h + 4 * j + u] |= (uint8_t)(((qh[4 * c + u] >> (2 * i + h)) & 1) << c);
        }
    }
}

/* Row j of an x16 group, dequantized as llama.cpp does: (d sc) q - (dmin m). */
void qp_q4k_dequant_row(int type, const uint8_t *group, int k, int j, float *out) {
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *sb = group + (int64_t)s * packed_bytes(type);
        const float d = half_to_f32(rd16(sb + 2 * j)), dmin = half_to_f32(rd16(sb + K4_DMIN + 2 * j));
        for (int u = 0; u < 8; u++) {
            const float ds = d * (float)sb[K4_SC + 16 * u + j], dm = dmin * (float)sb[K4_M + 16 * u + j];
            const uint8_t *codes = sb + K4_CODES + pair_bytes(type) * (u / 2);
            for (int t = 0; t < 32; t++) {
                const uint8_t v = codes[64 * (t / 4) + 4 * j + t % 4];
                const int q = (u % 2 ? v >> 4 : v & 15) | fifth(type, codes, j, u % 2, t / 4, t % 4);
                out[s * QK + 32 * u + t] = ds * (float)q - dm;
            }
        }
    }
}

void qp_q4k_group_scalar(int type, const group_args *a, int mt) {
    const int k = a->nb * BLOCK;
    for (int r = 0; r < mt; r++)
        for (int j = 0; j < a->rows; j++) {
            float acc = 0.0f;
            for (int s = 0; s < a->nb / 8; s++) {
                const uint8_t *sb = a->w + (int64_t)s * packed_bytes(type);
                const float d = half_to_f32(rd16(sb + 2 * j)), dmin = half_to_f32(rd16(sb + K4_DMIN + 2 * j));
                for (int u = 0; u < 8; u++) {
                    const int bi = 8 * s + u;
                    const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                    const uint8_t *codes = sb + K4_CODES + pair_bytes(type) * (u / 2);
                    int isum = 0;
                    for (int t = 0; t < 32; t++) {
                        const uint8_t v = codes[64 * (t / 4) + 4 * j + t % 4];
                        isum += ((u % 2 ? v >> 4 : v & 15) | fifth(type, codes, j, u % 2, t / 4, t % 4)) * x[t];
                    }
                    const int64_t xi = (int64_t)r * a->nb + bi;
                    const float ds = d * (float)sb[K4_SC + 16 * u + j], dm = dmin * (float)sb[K4_M + 16 * u + j];
                    acc += ds * a->xd[xi] * (float)isum - dm * a->xs[xi];
                }
            }
            a->out[r * a->ldo + j] = acc;
        }
}

/* Bit c of each byte of h moved to bit 4 (c in 0..7; 16-bit shifts, masked per byte). */
#define FIFTH(SL, SR, AND, h, c, bit4) ((c) <= 4 ? AND(SL(h, 4 - (c)), bit4) : AND(SR(h, (c) - 4), bit4))

AVX2_TARGET INLINE void q4k_avx2_half(const int type, const int MT, const group_args *a, int half) {
    const int k = a->nb * BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    __m256 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < a->nb / 8; s++) {
        const uint8_t *sb = a->w + (int64_t)s * packed_bytes(type);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * half)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + K4_DMIN + 16 * half)));
        for (int i = 0; i < 4; i++) {
            const uint8_t *codes = sb + K4_CODES + pair_bytes(type) * i + 32 * half;
            __m256i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * c));
                lo[c] = _mm256_and_si256(v, low);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            if (type == QT_Q5_K) {
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(codes + 512));
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(codes + 576)), bit4 = _mm256_set1_epi8(16);
                for (int c = 0; c < 8; c++) {
                    lo[c] = _mm256_or_si256(lo[c], FIFTH(_mm256_slli_epi16, _mm256_srli_epi16, _mm256_and_si256, h0, c, bit4));
                    hi[c] = _mm256_or_si256(hi[c], FIFTH(_mm256_slli_epi16, _mm256_srli_epi16, _mm256_and_si256, h1, c, bit4));
                }
            }
            __m256 ds[2], dm[2];
            for (int h = 0; h < 2; h++) {
                const int u = 2 * i + h;
                const __m128i scb = _mm_loadl_epi64((const __m128i *)(sb + K4_SC + 16 * u + 8 * half));
                const __m128i mb = _mm_loadl_epi64((const __m128i *)(sb + K4_M + 16 * u + 8 * half));
                ds[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scb)));
                dm[h] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb)));
            }
            for (int r = 0; r < MT; r++)
                for (int h = 0; h < 2; h++) {
                    const int bi = 8 * s + 2 * i + h;
                    const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                    __m256i isum = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        const __m256i p = _mm256_maddubs_epi16(h ? hi[c] : lo[c], _mm256_set1_epi32(rd32(x + 4 * c)));
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                    }
                    const int64_t xi = (int64_t)r * a->nb + bi;
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ds[h], _mm256_set1_ps(a->xd[xi])),
                                             acc[r]);
                    acc[r] = _mm256_fnmadd_ps(dm[h], _mm256_set1_ps(a->xs[xi]), acc[r]);
                }
        }
    }
    for (int r = 0; r < MT; r++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[r]);
        for (int j = 0; j < 8 && 8 * half + j < a->rows; j++) a->out[r * a->ldo + 8 * half + j] = tmp[j];
    }
}

AVX2_TARGET void qp_q4k_group_avx2(int type, const group_args *a, int mt) {
    for (int half = 0; half < 2 && 8 * half < a->rows; half++) {
        if (type == QT_Q5_K) MT_CASES4(q4k_avx2_half, QT_Q5_K, a, half)
        else MT_CASES4(q4k_avx2_half, QT_Q4_K, a, half)
    }
}

VNNI_TARGET INLINE void q4k_vnni(const int type, const int MT, const group_args *a) {
    const int k = a->nb * BLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int s = 0; s < a->nb / 8; s++) {
        const uint8_t *sb = a->w + (int64_t)s * packed_bytes(type);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + K4_DMIN)));
        for (int i = 0; i < 4; i++) {
            const uint8_t *codes = sb + K4_CODES + pair_bytes(type) * i;
            __m512i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512(codes + 64 * c);
                lo[c] = _mm512_and_si512(v, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (type == QT_Q5_K) {
                const __m512i h0 = _mm512_loadu_si512(codes + 512), h1 = _mm512_loadu_si512(codes + 576);
                const __m512i bit4 = _mm512_set1_epi8(16);
                for (int c = 0; c < 8; c++) {
                    lo[c] = _mm512_or_si512(lo[c], FIFTH(_mm512_slli_epi16, _mm512_srli_epi16, _mm512_and_si512, h0, c, bit4));
                    hi[c] = _mm512_or_si512(hi[c], FIFTH(_mm512_slli_epi16, _mm512_srli_epi16, _mm512_and_si512, h1, c, bit4));
                }
            }
            __m512 ds[2], dm[2];
            for (int h = 0; h < 2; h++) {
                const int u = 2 * i + h;
                const __m128i scb = _mm_loadu_si128((const __m128i *)(sb + K4_SC + 16 * u));
                const __m128i mb = _mm_loadu_si128((const __m128i *)(sb + K4_M + 16 * u));
                ds[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scb)));
                dm[h] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb)));
            }
            for (int r = 0; r < MT; r++)
                for (int h = 0; h < 2; h++) {
                    const int bi = 8 * s + 2 * i + h;
                    const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                    for (int c = 0; c < 8; c += 2) {
                        s0 = _mm512_dpbusd_epi32(s0, h ? hi[c] : lo[c], _mm512_set1_epi32(rd32(x + 4 * c)));
                        s1 = _mm512_dpbusd_epi32(s1, h ? hi[c + 1] : lo[c + 1], _mm512_set1_epi32(rd32(x + 4 * c + 4)));
                    }
                    const int64_t xi = (int64_t)r * a->nb + bi;
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ds[h], _mm512_set1_ps(a->xd[xi])), acc[r]);
                    acc[r] = _mm512_fnmadd_ps(dm[h], _mm512_set1_ps(a->xs[xi]), acc[r]);
                }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << a->rows) - 1);
    for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(a->out + r * a->ldo, keep, acc[r]);
}

VNNI_TARGET void qp_q4k_group_vnni(int type, const group_args *a, int mt) {
    if (type == QT_Q5_K) MT_CASES8(q4k_vnni, QT_Q5_K, a)
    else MT_CASES8(q4k_vnni, QT_Q4_K, a)
}

/* Q4_K weights on the block matmuls (cpu_gguf.c dispatches here).
 *
 * File format, per row and 256 weights (144 B): fp16 d, fp16 dmin, 12 bytes of 6-bit scales
 * sc and mins m for 8 sub-blocks of 32, qs[128]; w = d sc q - dmin m, q in 0..15. Sub-block
 * 2i is the low nibbles of qs[32i .. 32i+31], sub-block 2i+1 their high nibbles. Scale bytes
 * b: sc_j = b_j & 63, m_j = b_{j+4} & 63 for j < 4; sc_j = (b_{j+4} & 15) | (b_{j-4} >> 6) << 4,
 * m_j = (b_{j+4} >> 4) | (b_j >> 6) << 4 for j >= 4.
 *
 * Kernel layout (148 B per row and 256 weights: the scales unpacked to a byte each): per
 * super-block a group holds the 16 rows' d, then dmin (16 fp16 each), sc and m as
 * [sub-block][row] bytes (128 B each), then for each pair of sub-blocks 8 vectors of 64 bytes
 * whose lane j holds row j's qs bytes 4c .. 4c+3 of that pair: the low nibbles are the first
 * sub-block's weights 4c .. 4c+3, the high ones the second's. A sub-block is one activation
 * block, so each adds (d sc) dx sum(q qx) - (dmin m) xs, as Q4_1 does with its d and m.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qp_gguf.h"
#include "qp_half.h"

enum { K4_DMIN = 32, K4_SC = 64, K4_M = 192, K4_CODES = 320, K4_PACKED = Q4K_PACKED };

static inline void q4k_scale_min(const uint8_t *b, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = b[j] & 63, *m = b[j + 4] & 63;
    } else {
        *sc = (b[j + 4] & 15) | ((b[j - 4] >> 6) << 4);
        *m = (b[j + 4] >> 4) | ((b[j] >> 6) << 4);
    }
}

/* One file row -> row j of an x16 group. */
void qp_q4k_repack_row(const uint8_t *src, int k, uint8_t *group, int j) {
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *in = src + (int64_t)s * Q4K_BYTES;
        uint8_t *sb = group + (int64_t)s * ROWS * K4_PACKED;
        memcpy(sb + 2 * j, in, 2);
        memcpy(sb + K4_DMIN + 2 * j, in + 2, 2);
        for (int u = 0; u < 8; u++) {
            int sc, m;
            q4k_scale_min(in + 4, u, &sc, &m);
            sb[K4_SC + 16 * u + j] = (uint8_t)sc;
            sb[K4_M + 16 * u + j] = (uint8_t)m;
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 8; c++) memcpy(sb + K4_CODES + 512 * i + 64 * c + 4 * j, in + 16 + 32 * i + 4 * c, 4);
    }
}

/* Row j of an x16 group, dequantized as llama.cpp does: (d sc) q - (dmin m). */
void qp_q4k_dequant_row(const uint8_t *group, int k, int j, float *out) {
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *sb = group + (int64_t)s * ROWS * K4_PACKED;
        const float d = half_to_f32(rd16(sb + 2 * j)), dmin = half_to_f32(rd16(sb + K4_DMIN + 2 * j));
        for (int u = 0; u < 8; u++) {
            const float ds = d * (float)sb[K4_SC + 16 * u + j], dm = dmin * (float)sb[K4_M + 16 * u + j];
            const uint8_t *codes = sb + K4_CODES + 512 * (u / 2);
            for (int t = 0; t < 32; t++) {
                const uint8_t v = codes[64 * (t / 4) + 4 * j + t % 4];
                out[s * QK + 32 * u + t] = ds * (float)(u % 2 ? v >> 4 : v & 15) - dm;
            }
        }
    }
}

void qp_q4k_group_scalar(int type, const group_args *a, int mt) {
    (void)type;
    const int k = a->nb * BLOCK;
    for (int r = 0; r < mt; r++)
        for (int j = 0; j < a->rows; j++) {
            float acc = 0.0f;
            for (int s = 0; s < a->nb / 8; s++) {
                const uint8_t *sb = a->w + (int64_t)s * ROWS * K4_PACKED;
                const float d = half_to_f32(rd16(sb + 2 * j)), dmin = half_to_f32(rd16(sb + K4_DMIN + 2 * j));
                for (int u = 0; u < 8; u++) {
                    const int bi = 8 * s + u;
                    const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                    const uint8_t *codes = sb + K4_CODES + 512 * (u / 2);
                    int isum = 0;
                    for (int t = 0; t < 32; t++) {
                        const uint8_t v = codes[64 * (t / 4) + 4 * j + t % 4];
                        isum += (u % 2 ? v >> 4 : v & 15) * x[t];
                    }
                    const int64_t xi = (int64_t)r * a->nb + bi;
                    const float ds = d * (float)sb[K4_SC + 16 * u + j], dm = dmin * (float)sb[K4_M + 16 * u + j];
                    acc += ds * a->xd[xi] * (float)isum - dm * a->xs[xi];
                }
            }
            a->out[r * a->ldo + j] = acc;
        }
}

AVX2_TARGET INLINE void q4k_avx2_half(const int MT, const group_args *a, int half) {
    const int k = a->nb * BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    __m256 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < a->nb / 8; s++) {
        const uint8_t *sb = a->w + (int64_t)s * ROWS * K4_PACKED;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * half)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + K4_DMIN + 16 * half)));
        for (int i = 0; i < 4; i++) {
            const uint8_t *codes = sb + K4_CODES + 512 * i + 32 * half;
            __m256i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * c));
                lo[c] = _mm256_and_si256(v, low);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
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
    (void)type;
    for (int half = 0; half < 2 && 8 * half < a->rows; half++) switch (mt) {
        case 1: q4k_avx2_half(1, a, half); break;
        case 2: q4k_avx2_half(2, a, half); break;
        case 3: q4k_avx2_half(3, a, half); break;
        default: q4k_avx2_half(4, a, half); break;
        }
}

VNNI_TARGET INLINE void q4k_vnni(const int MT, const group_args *a) {
    const int k = a->nb * BLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int s = 0; s < a->nb / 8; s++) {
        const uint8_t *sb = a->w + (int64_t)s * ROWS * K4_PACKED;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + K4_DMIN)));
        for (int i = 0; i < 4; i++) {
            const uint8_t *codes = sb + K4_CODES + 512 * i;
            __m512i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512(codes + 64 * c);
                lo[c] = _mm512_and_si512(v, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
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
    (void)type;
    switch (mt) {
    case 1: q4k_vnni(1, a); break;
    case 2: q4k_vnni(2, a); break;
    case 3: q4k_vnni(3, a); break;
    default: q4k_vnni(4, a); break;
    }
}

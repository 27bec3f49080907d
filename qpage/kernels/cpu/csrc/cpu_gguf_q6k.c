/* Q6_K weights on the block matmuls (cpu_gguf.c dispatches here).
 *
 * File format, per row and 256 weights (210 B): ql[128] (low 4 bits), qh[64] (high 2 bits),
 * 16 int8 scales (one per 16 weights), fp16 d; w = d sc (q - 32), q in 0..63. Weight i of a
 * 128-weight half h: low bits in ql[64h + i % 64] (low nibble for i < 64, else high), high
 * bits (qh[32h + i % 32] >> 2 (i / 32)) & 3.
 *
 * Kernel layout (same bytes as the file): rows in groups of 16; per super-block of 256, a
 * group holds the 16 rows' d (16 fp16), their scales as [sub-block][row] int8 (256 B), then
 * for each 32-weight block 6 vectors of 64 bytes whose 4-byte lane j belongs to row j:
 *   4 nibble vectors as Q4's (vector c, byte u: weight 4c+u low, weight 16+4c+u high nibble),
 *   2 high-bit vectors (vector h, byte u: bits 2c..2c+1 = high bits of weight 16h+4c+u).
 * So one block's codes decode with a few shifts and masks into the 8 unsigned vectors a
 * dpbusd takes, as for Q4. Per 16-weight sub-block s the integer sum is
 *   sc_s (sum q qx - 32 sum qx),
 * exact in int32; the activations' per-16 code sums come with the arguments. Each 32-block
 * then adds d dx isum, as the other formats do.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qp_gguf.h"
#include "qp_half.h"

enum { SC_AT = 32, CODES_AT = 288, BLK = 384 };

/* Weight i (0..255) of a file super-block, as 0..63. */
static inline int q6k_code(const uint8_t *sb, int i) {
    const int h = i / 128, t = i % 128;
    const uint8_t lo = sb[64 * h + t % 64], hi = sb[128 + 32 * h + t % 32];
    return ((t < 64 ? lo & 15 : lo >> 4) | (((hi >> (2 * (t / 32))) & 3) << 4));
}

/* One file row (k / 256 super-blocks) -> row j of an x16 group (zeroed by the caller). */
void qp_q6k_repack_row(const uint8_t *src, int k, uint8_t *group, int j) {
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *in = src + (int64_t)s * Q6K_BYTES;
        uint8_t *sb = group + (int64_t)s * ROWS * Q6K_BYTES;
        memcpy(sb + 2 * j, in + 208, 2);
        for (int u = 0; u < 16; u++) sb[SC_AT + 16 * u + j] = in[192 + u];
        for (int b = 0; b < 8; b++) {
            uint8_t *blk = sb + CODES_AT + b * BLK;
            for (int c = 0; c < 4; c++)
                for (int u = 0; u < 4; u++) {
                    const int lo = q6k_code(in, 32 * b + 4 * c + u), hi = q6k_code(in, 32 * b + 16 + 4 * c + u);
                    blk[64 * c + 4 * j + u] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                    blk[256 + 4 * j + u] |= (uint8_t)((lo >> 4) << (2 * c));
                    blk[320 + 4 * j + u] |= (uint8_t)((hi >> 4) << (2 * c));
                }
        }
    }
}

/* Weight 16h + 4c + u of block blk, row j, as 0..63. */
static inline int code_at(const uint8_t *blk, int j, int h, int c, int u) {
    const uint8_t v = blk[64 * c + 4 * j + u], hb = blk[256 + 64 * h + 4 * j + u];
    return (h ? v >> 4 : v & 15) | (((hb >> (2 * c)) & 3) << 4);
}

/* Row j of an x16 group, dequantized as llama.cpp does: (d sc) (q - 32). */
void qp_q6k_dequant_row(const uint8_t *group, int k, int j, float *out) {
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *sb = group + (int64_t)s * ROWS * Q6K_BYTES;
        const float d = half_to_f32(rd16(sb + 2 * j));
        for (int b = 0; b < 8; b++)
            for (int h = 0; h < 2; h++) {
                const float dsc = d * (float)(int8_t)sb[SC_AT + 16 * (2 * b + h) + j];
                for (int c = 0; c < 4; c++)
                    for (int u = 0; u < 4; u++)
                        out[s * QK + 32 * b + 16 * h + 4 * c + u] =
                            dsc * (float)(code_at(sb + CODES_AT + b * BLK, j, h, c, u) - 32);
            }
    }
}

void qp_q6k_group_scalar(int type, const group_args *a, int mt) {
    (void)type;
    const int k = a->nb * BLOCK;
    for (int r = 0; r < mt; r++)
        for (int j = 0; j < a->rows; j++) {
            float acc = 0.0f;
            for (int s = 0; s < a->nb / 8; s++) {
                const uint8_t *sb = a->w + (int64_t)s * ROWS * Q6K_BYTES;
                const float d = half_to_f32(rd16(sb + 2 * j));
                for (int b = 0; b < 8; b++) {
                    const int bi = 8 * s + b;
                    const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                    int isum = 0;
                    for (int h = 0; h < 2; h++) {
                        int dot = 0;
                        for (int c = 0; c < 4; c++)
                            for (int u = 0; u < 4; u++) dot += code_at(sb + CODES_AT + b * BLK, j, h, c, u) * x[16 * h + 4 * c + u];
                        const int sc = (int8_t)sb[SC_AT + 16 * (2 * b + h) + j];
                        isum += sc * (dot - 32 * a->x16[(int64_t)r * 2 * a->nb + 2 * bi + h]);
                    }
                    acc += d * a->xd[(int64_t)r * a->nb + bi] * (float)isum;
                }
            }
            a->out[r * a->ldo + j] = acc;
        }
}

/* ------------------------------------------------------------------ AVX2: two 8-row halves */

AVX2_TARGET INLINE void q6k_avx2_half(const int type, const int MT, const group_args *a, int half) {
    (void)type;
    const int k = a->nb * BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    __m256 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < a->nb / 8; s++) {
        const uint8_t *sb = a->w + (int64_t)s * ROWS * Q6K_BYTES;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * half)));
        for (int b = 0; b < 8; b++) {
            const uint8_t *blk = sb + CODES_AT + b * BLK + 32 * half;
            const __m256i h0 = _mm256_loadu_si256((const __m256i *)(blk + 256));
            const __m256i h1 = _mm256_loadu_si256((const __m256i *)(blk + 320));
            __m256i wv[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c));
                const __m256i a0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h0, 2 * c), three), 4);
                const __m256i a1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h1, 2 * c), three), 4);
                wv[c] = _mm256_or_si256(_mm256_and_si256(v, low), a0);
                wv[4 + c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), a1);
            }
            const uint8_t *sc = sb + SC_AT + 8 * half;
            const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16 * (2 * b))));
            const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16 * (2 * b + 1))));
            const int bi = 8 * s + b;
            for (int r = 0; r < MT; r++) {
                const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    /* codes <= 63, so the pairwise int16 sums cannot saturate */
                    const __m256i p0 = _mm256_maddubs_epi16(wv[c], _mm256_set1_epi32(rd32(x + 4 * c)));
                    const __m256i p1 = _mm256_maddubs_epi16(wv[4 + c], _mm256_set1_epi32(rd32(x + 16 + 4 * c)));
                    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, ones));
                    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, ones));
                }
                const int32_t *xs = a->x16 + (int64_t)r * 2 * a->nb + 2 * bi;
                s0 = _mm256_mullo_epi32(_mm256_sub_epi32(s0, _mm256_set1_epi32(32 * xs[0])), sc0);
                s1 = _mm256_mullo_epi32(_mm256_sub_epi32(s1, _mm256_set1_epi32(32 * xs[1])), sc1);
                const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(a->xd[(int64_t)r * a->nb + bi]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), dx, acc[r]);
            }
        }
    }
    for (int r = 0; r < MT; r++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[r]);
        for (int j = 0; j < 8 && 8 * half + j < a->rows; j++) a->out[r * a->ldo + 8 * half + j] = tmp[j];
    }
}

AVX2_TARGET void qp_q6k_group_avx2(int type, const group_args *a, int mt) {
    (void)type;
    for (int half = 0; half < 2 && 8 * half < a->rows; half++) MT_CASES4(q6k_avx2_half, QT_Q6_K, a, half)
}

/* ------------------------------------------------------------------ AVX-512 VNNI */

VNNI_TARGET INLINE void q6k_vnni(const int type, const int MT, const group_args *a) {
    (void)type;
    const int k = a->nb * BLOCK;
    const __m512i low = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    __m512 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int s = 0; s < a->nb / 8; s++) {
        const uint8_t *sb = a->w + (int64_t)s * ROWS * Q6K_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        for (int b = 0; b < 8; b++) {
            const uint8_t *blk = sb + CODES_AT + b * BLK;
            const __m512i h0 = _mm512_loadu_si512(blk + 256), h1 = _mm512_loadu_si512(blk + 320);
            __m512i wv[8];
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(blk + 64 * c);
                const __m512i a0 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h0, 2 * c), three), 4);
                const __m512i a1 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h1, 2 * c), three), 4);
                wv[c] = _mm512_or_si512(_mm512_and_si512(v, low), a0);
                wv[4 + c] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), a1);
            }
            const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + SC_AT + 32 * b)));
            const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + SC_AT + 32 * b + 16)));
            const int bi = 8 * s + b;
            for (int r = 0; r < MT; r++) {
                const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(rd32(x + 4 * c)));
                    s1 = _mm512_dpbusd_epi32(s1, wv[4 + c], _mm512_set1_epi32(rd32(x + 16 + 4 * c)));
                }
                const int32_t *xs = a->x16 + (int64_t)r * 2 * a->nb + 2 * bi;
                s0 = _mm512_mullo_epi32(_mm512_sub_epi32(s0, _mm512_set1_epi32(32 * xs[0])), sc0);
                s1 = _mm512_mullo_epi32(_mm512_sub_epi32(s1, _mm512_set1_epi32(32 * xs[1])), sc1);
                const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(a->xd[(int64_t)r * a->nb + bi]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), dx, acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << a->rows) - 1);
    for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(a->out + r * a->ldo, keep, acc[r]);
}

VNNI_TARGET void qp_q6k_group_vnni(int type, const group_args *a, int mt) {
    (void)type;
    MT_CASES8(q6k_vnni, QT_Q6_K, a)
}

/* IQ4_NL, IQ4_XS, NF4, FP4 and MXFP4 weights on the block matmuls (cpu_gguf.c dispatches here).
 *
 * Each holds 4-bit indices into a 16-value int8 codebook (KV below), nibbles laid out as
 * Q4_0's (byte j of a 32-weight block: weight j low, weight j + 16 high). IQ4_NL: per 32
 * weights an fp16 d (18 B); w = d KV[q]. IQ4_XS: per 256 weights an fp16 d, 6-bit sub-block
 * scales ls (low 4 bits in scales_l[4], high 2 in the uint16 scales_h), then 128 B of nibbles
 * (136 B); w = d (ls - 32) KV[q] for the 32-weight sub-block. NF4 and FP4 are bitsandbytes'
 * codebooks (values in [-1, 1]) times 112 and 120, rounded, in IQ4_NL's block (d = absmax / 112
 * or / 120, per 32 weights; those factors round the codebooks with the least error, and FP4's
 * all but 0.0052 exactly); the loader (formats/bnb.py) writes them. MXFP4 (OCP microscaling: E2M1
 * codes, an E8M0 exponent e per 32 weights, w = 2^(e-127) E2M1[q]) is E2M1 times 2 (integers) with
 * d = 2^(e-128) (fp16: exact for e in [104, 143]); matmul/block_rewrite.py writes it.
 *
 * Kernel layouts: IQ4_NL's is Q4_0's (per block the 16 rows' d, then 4 nibble vectors).
 * IQ4_XS per super-block: the 16 rows' d (16 fp16), their ls - 32 as [sub-block][row] int8
 * (128 B), then per sub-block the 4 nibble vectors (138 B per row and 256 weights against the
 * file's 136). A nibble vector's codes go through a byte shuffle into KV + 128 (unsigned, for
 * dpbusd), and the extra 128 sum(x) is removed with the activations' sums, as for Q8_0; the
 * AVX2 path shuffles into KV itself and moves the signs onto the activations.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qp_gguf.h"
#include "qp_half.h"

static const int8_t KV[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t NF4_KV[16] = {-112, -78, -59, -44, -32, -21, -10, 0, 9, 18, 28, 38, 49, 63, 81, 112};
static const int8_t FP4_KV[16] = {0, 1, 80, 120, 40, 60, 20, 30, 0, -1, -80, -120, -40, -60, -20, -30};
static const int8_t MXFP4_KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline const int8_t *codebook(int type) {
    return type == QT_NF4 ? NF4_KV : type == QT_FP4 ? FP4_KV : type == QT_MXFP4_NL ? MXFP4_KV : KV;
}
enum { XS_SC = 32, XS_CODES = 160, NL_BLOCK = ROWS * 18 };

/* One IQ4_XS file row -> row j of an x16 group (zeroed by the caller). */
void qp_iq4xs_repack_row(const uint8_t *src, int k, uint8_t *group, int j) {
    for (int s = 0; s < k / QK; s++) {
        const uint8_t *in = src + (int64_t)s * IQ4XS_BYTES;
        uint8_t *sb = group + (int64_t)s * ROWS * IQ4XS_PACKED;
        memcpy(sb + 2 * j, in, 2);
        const int sh = in[2] | in[3] << 8;
        for (int u = 0; u < 8; u++) {
            const int ls = ((in[4 + u / 2] >> (4 * (u % 2))) & 15) | (((sh >> (2 * u)) & 3) << 4);
            sb[XS_SC + 16 * u + j] = (uint8_t)(int8_t)(ls - 32);
            for (int c = 0; c < 4; c++) memcpy(sb + XS_CODES + 256 * u + 64 * c + 4 * j, in + 8 + 16 * u + 4 * c, 4);
        }
    }
}

/* The 16 rows' scale factor and codes of 32-weight block bi of a group. */
static inline const uint8_t *block_at(int type, const uint8_t *w, int bi) {
    if (type != QT_IQ4_XS) return w + (int64_t)bi * NL_BLOCK;
    return w + (int64_t)(bi / 8) * ROWS * IQ4XS_PACKED;
}
static inline const uint8_t *codes_of(int type, const uint8_t *blk, int bi) {
    return type != QT_IQ4_XS ? blk + 32 : blk + XS_CODES + 256 * (bi % 8);
}
static inline float row_scale(int type, const uint8_t *blk, int bi, int j) {
    const float d = half_to_f32(rd16(blk + 2 * j));
    return type != QT_IQ4_XS ? d : d * (float)(int8_t)blk[XS_SC + 16 * (bi % 8) + j];
}

/* Row j of an x16 group, dequantized as llama.cpp does: d KV[q] ((d (ls - 32)) KV[q]). */
void qp_iq4_dequant_row(int type, const uint8_t *group, int k, int j, float *out) {
    const int8_t *kv = codebook(type);
    for (int bi = 0; bi < k / BLOCK; bi++) {
        const uint8_t *blk = block_at(type, group, bi), *codes = codes_of(type, blk, bi);
        const float d = row_scale(type, blk, bi, j);
        for (int t = 0; t < 16; t++) {
            const uint8_t q = codes[64 * (t / 4) + 4 * j + t % 4];
            out[BLOCK * bi + t] = d * (float)kv[q & 15];
            out[BLOCK * bi + t + 16] = d * (float)kv[q >> 4];
        }
    }
}

void qp_iq4_group_scalar(int type, const group_args *a, int mt) {
    const int k = a->nb * BLOCK;
    const int8_t *kv = codebook(type);
    for (int r = 0; r < mt; r++)
        for (int j = 0; j < a->rows; j++) {
            float acc = 0.0f;
            for (int bi = 0; bi < a->nb; bi++) {
                const uint8_t *blk = block_at(type, a->w, bi), *codes = codes_of(type, blk, bi);
                const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
                int isum = 0;
                for (int c = 0; c < 4; c++)
                    for (int u = 0; u < 4; u++) {
                        const uint8_t q = codes[64 * c + 4 * j + u];
                        isum += kv[q & 15] * x[4 * c + u] + kv[q >> 4] * x[16 + 4 * c + u];
                    }
                acc += row_scale(type, blk, bi, j) * a->xd[(int64_t)r * a->nb + bi] * (float)isum;
            }
            a->out[r * a->ldo + j] = acc;
        }
}

/* type: QT_IQ4_XS or QT_IQ4_NL (the 32-weight layout), a compile-time constant; kv the codebook. */
AVX2_TARGET INLINE void iq4_avx2_half(const int type, const int MT, const group_args *a, int half, const int8_t *kv) {
    const int k = a->nb * BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv));
    __m256 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int bi = 0; bi < a->nb; bi++) {
        const uint8_t *blk = block_at(type, a->w, bi), *codes = codes_of(type, blk, bi) + 32 * half;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half)));
        if (type == QT_IQ4_XS) {
            const __m128i sc = _mm_loadl_epi64((const __m128i *)(blk + XS_SC + 16 * (bi % 8) + 8 * half));
            d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        }
        __m256i wv[8];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * c));
            wv[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
            wv[4 + c] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        }
        for (int r = 0; r < MT; r++) {
            const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
            __m256i isum = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i xv = _mm256_set1_epi32(rd32(x + (t < 4 ? 4 * t : 16 + 4 * (t - 4))));
                /* |kv| <= 127 against the signs moved onto x: no int16 saturation */
                const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv[t]), _mm256_sign_epi8(xv, wv[t]));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
            }
            const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(a->xd[(int64_t)r * a->nb + bi]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dx, acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[r]);
        for (int j = 0; j < 8 && 8 * half + j < a->rows; j++) a->out[r * a->ldo + 8 * half + j] = tmp[j];
    }
}

AVX2_TARGET void qp_iq4_group_avx2(int type, const group_args *a, int mt) {
    for (int half = 0; half < 2 && 8 * half < a->rows; half++) {
        if (type == QT_IQ4_XS) MT_CASES4(iq4_avx2_half, QT_IQ4_XS, a, half, KV)
        else MT_CASES4(iq4_avx2_half, QT_IQ4_NL, a, half, codebook(type))
    }
}

VNNI_TARGET INLINE void iq4_vnni(const int type, const int MT, const group_args *a, const int8_t *kv) {
    const int k = a->nb * BLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i table = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv)),
                                          _mm512_set1_epi8((char)0x80)); /* kv + 128, unsigned */
    __m512 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int bi = 0; bi < a->nb; bi++) {
        const uint8_t *blk = block_at(type, a->w, bi), *codes = codes_of(type, blk, bi);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        if (type == QT_IQ4_XS) {
            const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + XS_SC + 16 * (bi % 8)));
            d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        }
        const __m512 o = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
        __m512i wv[8];
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(codes + 64 * c);
            wv[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
            wv[4 + c] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
        for (int r = 0; r < MT; r++) {
            const int8_t *x = a->xq + (int64_t)r * k + bi * BLOCK;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(rd32(x + 4 * c)));
                s1 = _mm512_dpbusd_epi32(s1, wv[4 + c], _mm512_set1_epi32(rd32(x + 16 + 4 * c)));
            }
            const int64_t xi = (int64_t)r * a->nb + bi;
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->xd[xi])), acc[r]);
            acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(a->xs[xi]), acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << a->rows) - 1);
    for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(a->out + r * a->ldo, keep, acc[r]);
}

VNNI_TARGET void qp_iq4_group_vnni(int type, const group_args *a, int mt) {
    if (type == QT_IQ4_XS) MT_CASES8(iq4_vnni, QT_IQ4_XS, a, KV)
    else MT_CASES8(iq4_vnni, QT_IQ4_NL, a, codebook(type))
}

/* Matmuls on weights in llama.cpp's block formats: out[M, N] = x[M, K] . W[N, K]^T.
 *
 * Formats (per row, K/32 blocks of 32 weights; fp16 d and m): Q4_0 (18 B: d, 16 B of nibbles;
 * w = d (q - 8)), Q4_1 (20 B: d, m, nibbles; w = d q + m), Q5_0 (22 B: d, 32 high bits, nibbles;
 * w = d (q - 16)), Q5_1 (24 B: d, m, high bits, nibbles; w = d q + m), Q8_0 (34 B: d, 32 int8;
 * w = d q). In a nibble block byte j holds weight j in its low and weight j + 16 in its high
 * half. Q4_K/Q5_K, Q6_K and IQ4_NL/IQ4_XS are in cpu_gguf_q4k.c, cpu_gguf_q6k.c and
 * cpu_gguf_iq4.c; the layouts' writers and readers in cpu_gguf_layout.c.
 *
 * Kernel layout ("x16", same bytes as the file): rows in groups of 16; a group holds its
 * blocks in order, and block b of a group is the 16 rows' d (16 fp16), for Q4_1/Q5_1 their m
 * (16 fp16), then the codes as 64-byte vectors whose 4-byte lane j belongs to row j:
 *   Q4/Q5: 4 vectors; vector c, lane j = bytes 4c..4c+3 of row j's nibbles, so its low
 *       nibbles are weights 4c..4c+3 and its high nibbles weights 16+4c..16+4c+3; Q5 then one
 *       vector of high bits: lane j byte u, bit c for weight 4c+u, bit 4+c for 16+4c+u;
 *   Q8: 8 vectors; vector t, lane j = weights 4t..4t+3 of row j, stored + 128 (unsigned).
 * Q8_M (qpage's, 36 B: d, m, 32 int8; w = d c + m) is Q8_0's block with Q4_1's m; it holds
 * integer weights with a zero point (kernels.cpu.matmul.int_blocks).
 * One dpbusd of a code vector with 4 activation bytes broadcast adds 4 products to each of
 * 16 rows, so a block's 16 integer dot products end in 16 lanes with no horizontal sums, and
 * the 16 rows' scales convert in one instruction. Q8_0's + 128 makes its codes unsigned (what
 * dpbusd takes); the extra 128 sum(x) per block is removed with the activations' sums.
 *
 * Activations are quantized once per row to int8 blocks (qp_quantize_act): codes qx, scale
 * dx = amax / 127, and xs = dx sum(qx). Per block, row n gets
 *   d_n dx isum_n + o_n xs,   o = m (Q4_1, Q5_1), -8 d (Q4_0), -16 d (Q5_0), -128 d (Q8_0 as stored),
 *                             m - 128 d (Q8_M as stored).
 * Q8_M also takes a residual level (codes qr, scale dr, xrs = dr sum(qr); act_residual in
 * qp_gguf.h): d_n dr isum_r + o_n xrs is added.
 *
 * Paths, chosen at run time (each compiled with its own target attributes, so every path
 * this CPU has can run and be tested): AVX-512 VNNI, AVX2 (maddubs + madd: two 8-row halves;
 * Q8 codes go back to signed there, since maddubs saturates on 255 x 127 pairs) and portable
 * C. Groups are split across OpenMP threads; each group's block is unpacked once for up to 8
 * (AVX2 and C: 4) activation rows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <stdlib.h>

#include "qp_gguf.h"
#include "qp_half.h"

/* ------------------------------------------------------------------ portable C */

static void group_scalar(int type, const group_args *a, int mt) {
    const int bs = block_bytes(type), at = codes_at(type), k = a->nb * BLOCK;
    const int resid = act_residual(type) && a->xr != NULL;
    for (int r = 0; r < mt; r++)
        for (int j = 0; j < a->rows; j++) {
            float acc = 0.0f;
            for (int b = 0; b < a->nb; b++) {
                const uint8_t *blk = a->w + (int64_t)b * ROWS * bs;
                const int8_t *x = a->xq + (int64_t)r * k + b * BLOCK;
                const int8_t *xr = resid ? a->xr + (int64_t)r * k + b * BLOCK : NULL;
                int isum = 0, rsum = 0;
                for (int c = 0; c < (is_q8(type) ? 8 : 4); c++)
                    for (int u = 0; u < 4; u++) {
                        const int q = blk[at + 64 * c + 4 * j + u], h = is_q5(type) ? blk[at + 256 + 4 * j + u] : 0;
                        const int lo = (q & 15) | (((h >> c) & 1) << 4), hi = (q >> 4) | (((h >> (4 + c)) & 1) << 4);
                        isum += is_q8(type) ? q * x[4 * c + u] : lo * x[4 * c + u] + hi * x[16 + 4 * c + u];
                        if (resid) rsum += q * xr[4 * c + u];
                    }
                const float d = half_to_f32(rd16(blk + 2 * j));
                const float m = has_m(type) ? half_to_f32(rd16(blk + 32 + 2 * j)) : 0.0f;
                const float o = type == QT_Q8_M ? m + offset_mul(type) * d : has_m(type) ? m : offset_mul(type) * d;
                const int64_t xi = (int64_t)r * a->nb + b;
                acc += d * a->xd[xi] * (float)isum + o * a->xs[xi];
                if (resid) acc += d * a->xrd[xi] * (float)rsum + o * a->xrs[xi];
            }
            a->out[r * a->ldo + j] = acc;
        }
}

/* ------------------------------------------------------------------ AVX2 */

/* Rows half*8 .. half*8+7 of the group, MT activation rows. */
AVX2_TARGET INLINE void avx2_half(const int type, const int MT, const group_args *a, int half) {
    const int bs = block_bytes(type), at = codes_at(type), k = a->nb * BLOCK;
    const int resid = act_residual(type) && a->xr != NULL;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const uint8_t *blk = a->w + (int64_t)b * ROWS * bs;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half)));
        const __m256 o = has_m(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * half)))
                                         : _mm256_mul_ps(d, _mm256_set1_ps(offset_mul(type)));
        __m256i wv[8];
        if (is_q8(type)) {
            for (int t = 0; t < 8; t++)
                wv[t] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + at + 64 * t + 32 * half)), flip);
        } else {
            const __m256i h = is_q5(type) ? _mm256_loadu_si256((const __m256i *)(blk + at + 256 + 32 * half))
                                          : _mm256_setzero_si256();
            const __m256i bit4 = _mm256_set1_epi8(16);
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + at + 64 * c + 32 * half));
                wv[c] = _mm256_and_si256(v, low);
                wv[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (is_q5(type)) { /* bit c of h -> bit 4 of weight 4c+u; bit 4+c -> of weight 16+4c+u */
                    wv[c] = _mm256_or_si256(wv[c], _mm256_and_si256(_mm256_slli_epi16(h, 4 - c), bit4));
                    wv[4 + c] = _mm256_or_si256(wv[4 + c], _mm256_and_si256(_mm256_srli_epi16(h, c), bit4));
                }
            }
        }
        for (int r = 0; r < MT; r++) {
            const int8_t *x = a->xq + (int64_t)r * k + b * BLOCK;
            const int64_t xi = (int64_t)r * a->nb + b;
            for (int level = 0; level < 1 + resid; level++) {
                if (level) x = a->xr + (int64_t)r * k + b * BLOCK;
                __m256i isum = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) {
                    /* Q4: wv[c] pairs with x[4c..], wv[4+c] with x[16+4c..]; Q8: wv[t] with x[4t..]. */
                    const int xo = is_q8(type) ? 4 * t : t < 4 ? 4 * t : 16 + 4 * (t - 4);
                    __m256i xv = _mm256_set1_epi32(rd32(x + xo)), wu = wv[t];
                    if (is_q8(type)) xv = _mm256_sign_epi8(xv, wu), wu = _mm256_abs_epi8(wu);
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones));
                }
                const __m256 dot = _mm256_cvtepi32_ps(isum);
                const float dx = level ? a->xrd[xi] : a->xd[xi];
                acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
            }
            /* Q8 codes are signed here, so Q8_0's offset term is 0 and Q8_M's is m. */
            if (type != QT_Q8_0)
                acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(a->xs[xi] + (resid ? a->xrs[xi] : 0.0f)), acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[r]);
        for (int j = 0; j < 8 && 8 * half + j < a->rows; j++) a->out[r * a->ldo + 8 * half + j] = tmp[j];
    }
}

AVX2_TARGET static void group_avx2(int type, const group_args *a, int mt) {
    for (int half = 0; half < 2 && 8 * half < a->rows; half++) {
        if (type == QT_Q4_0) MT_CASES4(avx2_half, QT_Q4_0, a, half)
        else if (type == QT_Q4_1) MT_CASES4(avx2_half, QT_Q4_1, a, half)
        else if (type == QT_Q5_0) MT_CASES4(avx2_half, QT_Q5_0, a, half)
        else if (type == QT_Q5_1) MT_CASES4(avx2_half, QT_Q5_1, a, half)
        else if (type == QT_Q8_M) MT_CASES4(avx2_half, QT_Q8_M, a, half)
        else MT_CASES4(avx2_half, QT_Q8_0, a, half)
    }
}

/* ------------------------------------------------------------------ AVX-512 VNNI */

VNNI_TARGET INLINE void vnni_group(const int type, const int MT, const group_args *a) {
    const int bs = block_bytes(type), at = codes_at(type), k = a->nb * BLOCK;
    const int resid = act_residual(type) && a->xr != NULL;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MT_MAX];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const uint8_t *blk = a->w + (int64_t)b * ROWS * bs;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dm = _mm512_mul_ps(d, _mm512_set1_ps(offset_mul(type)));
        const __m512 m = has_m(type) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : dm;
        const __m512 o = type == QT_Q8_M ? _mm512_add_ps(dm, m) : m; /* Q8_M: m - 128 d as stored */
        __m512i wv[8];
        if (is_q8(type)) {
            for (int t = 0; t < 8; t++) wv[t] = _mm512_loadu_si512(blk + at + 64 * t);
        } else {
            const __m512i h = is_q5(type) ? _mm512_loadu_si512(blk + at + 256) : _mm512_setzero_si512();
            const __m512i bit4 = _mm512_set1_epi8(16);
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(blk + at + 64 * c);
                wv[c] = _mm512_and_si512(v, low);
                wv[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (is_q5(type)) {
                    wv[c] = _mm512_or_si512(wv[c], _mm512_and_si512(_mm512_slli_epi16(h, 4 - c), bit4));
                    wv[4 + c] = _mm512_or_si512(wv[4 + c], _mm512_and_si512(_mm512_srli_epi16(h, c), bit4));
                }
            }
        }
        for (int r = 0; r < MT; r++) {
            const int8_t *x = a->xq + (int64_t)r * k + b * BLOCK;
            /* Two chains, so consecutive dpbusds do not wait on each other. */
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int t = 0; t < 8; t += 2) {
                const int x0 = is_q8(type) ? 4 * t : t < 4 ? 4 * t : 16 + 4 * (t - 4);
                const int x1 = is_q8(type) ? 4 * t + 4 : t + 1 < 4 ? 4 * t + 4 : 16 + 4 * (t - 3);
                s0 = _mm512_dpbusd_epi32(s0, wv[t], _mm512_set1_epi32(rd32(x + x0)));
                s1 = _mm512_dpbusd_epi32(s1, wv[t + 1], _mm512_set1_epi32(rd32(x + x1)));
            }
            const int64_t xi = (int64_t)r * a->nb + b;
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->xd[xi])), acc[r]);
            acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(a->xs[xi]), acc[r]);
            if (resid) { /* the residual level: Q8 codes pair with x[4t..] */
                const int8_t *xr = a->xr + (int64_t)r * k + b * BLOCK;
                __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
                for (int t = 0; t < 8; t += 2) {
                    r0 = _mm512_dpbusd_epi32(r0, wv[t], _mm512_set1_epi32(rd32(xr + 4 * t)));
                    r1 = _mm512_dpbusd_epi32(r1, wv[t + 1], _mm512_set1_epi32(rd32(xr + 4 * t + 4)));
                }
                const __m512 rdot = _mm512_cvtepi32_ps(_mm512_add_epi32(r0, r1));
                acc[r] = _mm512_fmadd_ps(rdot, _mm512_mul_ps(d, _mm512_set1_ps(a->xrd[xi])), acc[r]);
                acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(a->xrs[xi]), acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << a->rows) - 1);
    for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(a->out + r * a->ldo, keep, acc[r]);
}

VNNI_TARGET static void group_vnni(int type, const group_args *a, int mt) {
    if (type == QT_Q4_0) MT_CASES8(vnni_group, QT_Q4_0, a)
    else if (type == QT_Q4_1) MT_CASES8(vnni_group, QT_Q4_1, a)
    else if (type == QT_Q5_0) MT_CASES8(vnni_group, QT_Q5_0, a)
    else if (type == QT_Q5_1) MT_CASES8(vnni_group, QT_Q5_1, a)
    else if (type == QT_Q8_M) MT_CASES8(vnni_group, QT_Q8_M, a)
    else MT_CASES8(vnni_group, QT_Q8_0, a)
}

/* ------------------------------------------------------------------ entry points */

/* 1 when this CPU can run the path (ISA_AUTO: the best one it can), else 0. */
int qp_gguf_isa_supported(int isa) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    switch (isa) {
    case ISA_AUTO:
    case ISA_SCALAR: return 1;
    case ISA_AVX2: return avx2;
    case ISA_VNNI:
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
}

/* The formats the kernels run, one row each: sizes, and the group function of every path (the
 * columns follow ISA_SCALAR, ISA_AVX2, ISA_VNNI). Python reads the sizes from here
 * (qp_gguf_block_type), so nothing mirrors them. The path ISA_AUTO takes is resolved once, when
 * the library loads. */
enum { NUM_ISAS = 4 };
typedef struct {
    int type;
    int weights;            /* per block: BLOCK or QK */
    int file_bytes;         /* one row's block in the file */
    int packed_bytes;       /* the same in the kernels' layout */
    group_fn group[NUM_ISAS]; /* [ISA_SCALAR], [ISA_AVX2], [ISA_VNNI] */
} block_type;

#define LEGACY(T) {T, BLOCK, 0, 0, {NULL, group_scalar, group_avx2, group_vnni}}
#define IQ4(T) {T, BLOCK, 0, 0, {NULL, qp_iq4_group_scalar, qp_iq4_group_avx2, qp_iq4_group_vnni}}
#define KQUANT(T, F) {T, QK, 0, 0, {NULL, F##_scalar, F##_avx2, F##_vnni}}
static block_type TYPES[] = {
    LEGACY(QT_Q4_0), LEGACY(QT_Q4_1), LEGACY(QT_Q5_0), LEGACY(QT_Q5_1), LEGACY(QT_Q8_0), LEGACY(QT_Q8_M),
    IQ4(QT_IQ4_NL), IQ4(QT_NF4), IQ4(QT_FP4), IQ4(QT_MXFP4_NL),
    KQUANT(QT_Q4_K, qp_q4k_group), KQUANT(QT_Q5_K, qp_q4k_group), KQUANT(QT_Q6_K, qp_q6k_group),
    KQUANT(QT_IQ4_XS, qp_iq4_group),
};
enum { NUM_TYPES = sizeof TYPES / sizeof TYPES[0] };
static int best_isa = ISA_SCALAR;

/* At load: each row's sizes (from the layout helpers of qp_gguf.h) and the best path here. */
__attribute__((constructor)) static void resolve_types(void) {
    for (int i = 0; i < NUM_TYPES; i++) {
        block_type *t = &TYPES[i];
        t->file_bytes = t->weights == QK ? k_file_bytes(t->type) : block_bytes(t->type);
        t->packed_bytes = t->weights == QK ? k_packed_bytes(t->type) : block_bytes(t->type);
    }
    best_isa = qp_gguf_isa_supported(ISA_VNNI) ? ISA_VNNI : qp_gguf_isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
}

static const block_type *find_type(int type) {
    for (int i = 0; i < NUM_TYPES; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

/* Row i of the table into info[4] (type id, weights per block, file bytes, packed bytes);
 * returns 0, or -1 past the last row. */
int qp_gguf_block_type(int i, int32_t *info) {
    if (i < 0 || i >= NUM_TYPES) return -1;
    info[0] = TYPES[i].type, info[1] = TYPES[i].weights, info[2] = TYPES[i].file_bytes, info[3] = TYPES[i].packed_bytes;
    return 0;
}

/* The path ISA_AUTO resolves to. */
int qp_gguf_best_isa(void) { return best_isa; }

/* Groups [g0, g1) against all m activation rows, mt_max rows per call. Rows go in tiles of
 * ROW_TILE, so that a tile's activations stay in cache while every group passes over them. */
enum { ROW_TILE = 32 };
static void run_groups(group_fn f, int mt_max, int type, const uint8_t *w, int64_t n, int nb, const int8_t *xq,
                       const float *xd, const float *xs, const int8_t *xr, const float *xrd, const float *xrs,
                       const int32_t *x16, int m, float *out, int64_t ldo, int64_t g0, int64_t g1) {
    const int64_t gbytes = group_bytes(type, nb * BLOCK);
    for (int r0 = 0; r0 < m; r0 += ROW_TILE)
        for (int64_t g = g0; g < g1; g++)
            for (int r = r0; r < m && r < r0 + ROW_TILE; r += mt_max) {
                const int64_t rows = n - g * ROWS;
                const group_args a = {w + g * gbytes, nb, xq + (int64_t)r * nb * BLOCK, xd + (int64_t)r * nb,
                                      xs + (int64_t)r * nb, xr ? xr + (int64_t)r * nb * BLOCK : NULL,
                                      xrd ? xrd + (int64_t)r * nb : NULL, xrs ? xrs + (int64_t)r * nb : NULL,
                                      x16 ? x16 + (int64_t)r * 2 * nb : NULL,
                                      out + r * ldo + g * ROWS, ldo, rows < ROWS ? (int)rows : ROWS};
                const int left = (m < r0 + ROW_TILE ? m : r0 + ROW_TILE) - r;
                f(type, &a, left < mt_max ? left : mt_max);
            }
}

/* Whether the format's matmul takes a residual level of activations (act_residual). */
int qp_gguf_act_residual(int type) { return act_residual(type); }

/* out[m, n] (row stride ldo) = activations (from qp_quantize_act; k = 32 nb) . W^T, W an x16
 * weight of n rows. xr, xrd and xrs: the residual level, read by the formats that take it (NULL:
 * none). Returns 0, -1 for a format or path this build or CPU
 * cannot run, -2 when out of memory. */
int qp_gguf_matmul(int type, const uint8_t *w, int64_t n, int k, const int8_t *xq, const float *xd, const float *xs,
                   const int8_t *xr, const float *xrd, const float *xrs, int m, float *out, int64_t ldo, int threads,
                   int isa) {
    const block_type *t = find_type(type);
    if (t == NULL || k % t->weights) return -1;
    if (isa == ISA_AUTO) isa = best_isa;
    else if (!qp_gguf_isa_supported(isa)) return -1;
    const group_fn f = t->group[isa];
    const int mt_max = isa == ISA_VNNI ? MT_MAX : MT_AVX2;
    const int nb = k / BLOCK;
    int32_t *x16 = NULL; /* Q6_K: the activations' code sums per 16 weights */
    if (type == QT_Q6_K) {
        x16 = malloc(sizeof(int32_t) * (size_t)m * 2 * nb);
        if (x16 == NULL) return -2;
        for (int64_t i = 0; i < (int64_t)m * 2 * nb; i++) {
            int sum = 0;
            for (int u = 0; u < 16; u++) sum += xq[16 * i + u];
            x16[i] = sum;
        }
    }
    const int64_t groups = (n + ROWS - 1) / ROWS;
    /* Small matmuls stay on one thread: waking the others costs more than they save. */
    if (n * k * (int64_t)m < (1 << 16) || groups < 2) threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), per = (groups + nt - 1) / nt;
        const int64_t g0 = per * t, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 < g1) run_groups(f, mt_max, type, w, n, nb, xq, xd, xs, xr, xrd, xrs, x16, m, out, ldo, g0, g1);
    }
#else
    (void)threads;
    run_groups(f, mt_max, type, w, n, nb, xq, xd, xs, xr, xrd, xrs, x16, m, out, ldo, 0, groups);
#endif
    free(x16);
    return 0;
}

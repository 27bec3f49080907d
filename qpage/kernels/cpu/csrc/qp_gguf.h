/* What the block-format matmuls share (cpu_gguf.c for the 32-weight formats and the entry
 * points; cpu_gguf_q4k.c, cpu_gguf_q6k.c and cpu_gguf_iq4.c for Q4_K/Q5_K, Q6_K and IQ4): type
 * and path ids, the layouts' constants and sizes, the arguments of one group of 16 rows, and
 * the per-format functions cpu_gguf.c dispatches to. */
#ifndef QP_GGUF_H
#define QP_GGUF_H
#include <stdint.h>
#include <string.h>

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14,
       QT_IQ4_NL = 20, QT_IQ4_XS = 23,
       /* Not ggml's (qpage's ids): bitsandbytes' NF4 and FP4 codebooks on IQ4_NL's 32-weight layout;
        * Q8_M, Q8_0's block with an fp16 m after d (w = d c + m, c int8: 8-bit codes with a zero point);
        * and MXFP4's E2M1 values (times 2) on IQ4_NL's layout, its E8M0 scale (halved) as the fp16 d. */
       QT_NF4 = 200, QT_FP4 = 201, QT_Q8_M = 202, QT_MXFP4_NL = 203 };
enum { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_VNNI = 3 };
enum { BLOCK = 32, ROWS = 16, QK = 256 };
/* Activation rows one call of a group function takes: each group's decoded codes serve that
 * many rows. The VNNI paths have 32 vector registers for 8 rows' sums, AVX2's 16 for 4. */
enum { MT_MAX = 8, MT_AVX2 = 4 };
/* Bytes per row and 256 weights: in the file, and in the kernels' layout where it differs. */
enum { Q6K_BYTES = 210, Q4K_BYTES = 144, Q4K_PACKED = 148, Q5K_BYTES = 176, Q5K_PACKED = 180, IQ4XS_BYTES = 136,
       IQ4XS_PACKED = 138 };

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define AVX2_TARGET __attribute__((target("avx2,f16c,fma")))
#define INLINE static inline __attribute__((always_inline))

/* The arguments every path takes: one group of 16 rows, MT activation rows. */
typedef struct {
    const uint8_t *w; /* the group's first block */
    int nb;           /* 32-weight blocks per row */
    const int8_t *xq;
    const float *xd, *xs;
    const int8_t *xr;        /* the activations' residual codes [MT, k] (8-bit formats; NULL: none) */
    const float *xrd, *xrs;  /* and their scales and scaled sums [MT, nb] */
    const int32_t *x16; /* sums of the codes per 16 weights, [MT, 2 nb] (Q6_K only, else NULL) */
    float *out;         /* out[r * ldo + j] for row j of the group */
    int64_t ldo;
    int rows; /* valid rows of the group (<= 16) */
} group_args;

typedef void (*group_fn)(int, const group_args *, int);

/* F(T, MT, ...) for the call's row count mt, MT a compile-time constant (up to 4 or 8). */
#define MT_CASES4(F, T, ...) \
    switch (mt) { \
    case 1: F(T, 1, __VA_ARGS__); break; \
    case 2: F(T, 2, __VA_ARGS__); break; \
    case 3: F(T, 3, __VA_ARGS__); break; \
    default: F(T, 4, __VA_ARGS__); break; \
    }
#define MT_CASES8(F, T, ...) \
    switch (mt) { \
    case 1: F(T, 1, __VA_ARGS__); break; \
    case 2: F(T, 2, __VA_ARGS__); break; \
    case 3: F(T, 3, __VA_ARGS__); break; \
    case 4: F(T, 4, __VA_ARGS__); break; \
    case 5: F(T, 5, __VA_ARGS__); break; \
    case 6: F(T, 6, __VA_ARGS__); break; \
    case 7: F(T, 7, __VA_ARGS__); break; \
    default: F(T, 8, __VA_ARGS__); break; \
    }

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline int32_t rd32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

void qp_q6k_group_scalar(int type, const group_args *a, int mt);
void qp_q6k_group_avx2(int type, const group_args *a, int mt);
void qp_q6k_group_vnni(int type, const group_args *a, int mt);
/* Bytes of one row's 32-weight block in the file (0: not a 32-weight format); a group's
 * block is 16 times that. */
static inline int block_bytes(int type) {
    switch (type) {
    case QT_Q4_0:
    case QT_IQ4_NL:
    case QT_NF4:
    case QT_FP4:
    case QT_MXFP4_NL: return 18;
    case QT_Q4_1: return 20;
    case QT_Q5_0: return 22;
    case QT_Q5_1: return 24;
    case QT_Q8_0: return 34;
    case QT_Q8_M: return 36;
    default: return 0;
    }
}

/* The 256-weight formats (K-quants, IQ4_XS), and the bytes of one row's block: in the file, in
 * the kernels' layout. */
static inline int is_kquant(int type) {
    return type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K || type == QT_IQ4_XS;
}
static inline int k_file_bytes(int type) {
    return type == QT_Q4_K ? Q4K_BYTES : type == QT_Q5_K ? Q5K_BYTES : type == QT_IQ4_XS ? IQ4XS_BYTES : Q6K_BYTES;
}
static inline int k_packed_bytes(int type) {
    return type == QT_Q4_K ? Q4K_PACKED : type == QT_Q5_K ? Q5K_PACKED : type == QT_IQ4_XS ? IQ4XS_PACKED : Q6K_BYTES;
}

/* Whether the kernels run this format at row length k. */
static inline int runs(int type, int k) {
    return is_kquant(type) ? k % QK == 0 : block_bytes(type) != 0 && k % BLOCK == 0;
}

/* Bytes of one group of 16 rows of k weights in the kernels' layout. */
static inline int64_t group_bytes(int type, int k) {
    if (is_kquant(type)) return (int64_t)(k / QK) * ROWS * k_packed_bytes(type);
    return (int64_t)(k / BLOCK) * ROWS * block_bytes(type);
}

/* Bytes of one file row of k weights. */
static inline int64_t file_row_bytes(int type, int k) {
    return is_kquant(type) ? (int64_t)(k / QK) * k_file_bytes(type) : (int64_t)(k / BLOCK) * block_bytes(type);
}

/* The 32-weight formats whose 4-bit codes index a 16-value codebook (cpu_gguf_iq4.c). */
static inline int is_codebook32(int type) {
    return type == QT_IQ4_NL || type == QT_NF4 || type == QT_FP4 || type == QT_MXFP4_NL;
}

/* Formats with an m per block, with a fifth (high) bit per weight, and with 8-bit codes. */
static inline int has_m(int type) { return type == QT_Q4_1 || type == QT_Q5_1 || type == QT_Q8_M; }
static inline int is_q8(int type) { return type == QT_Q8_0 || type == QT_Q8_M; }

/* Whether the format's matmul takes the activations with a residual level (qp_quantize_act). Q8_M
 * holds qpage's own 8-bit checkpoints, meant to lose nothing: against 8-bit weights one int8
 * level (amax / 254) is the larger rounding of the two, and a second level makes it negligible,
 * for twice the integer products. Q8_0 keeps llama.cpp's one level, and its speed. */
static inline int act_residual(int type) { return type == QT_Q8_M; }
static inline int is_q5(int type) { return type == QT_Q5_0 || type == QT_Q5_1; }

/* Where a group's 32-weight block keeps its codes (after d, and m). */
static inline int codes_at(int type) { return has_m(type) ? 64 : 32; }

/* The per-block offset factor o / d for the formats whose offset is a multiple of d (Q8_M: the part of
 * its offset that is, m being added; Q8 codes are held + 128 in the kernels' layout). */
static inline float offset_mul(int type) { return type == QT_Q4_0 ? -8.0f : type == QT_Q5_0 ? -16.0f : -128.0f; }


void qp_q4k_group_scalar(int type, const group_args *a, int mt);
void qp_q4k_group_avx2(int type, const group_args *a, int mt);
void qp_q4k_group_vnni(int type, const group_args *a, int mt);
/* IQ4_NL, NF4, FP4 and IQ4_XS (type says which; the 32-weight ones are repacked as Q4_0 is). */
void qp_iq4_group_scalar(int type, const group_args *a, int mt);
void qp_iq4_group_avx2(int type, const group_args *a, int mt);
void qp_iq4_group_vnni(int type, const group_args *a, int mt);
void qp_iq4xs_repack_row(const uint8_t *src, int k, uint8_t *group, int j);
void qp_iq4_dequant_row(int type, const uint8_t *group, int k, int j, float *out);
/* The entry points (cpu_gguf.c, cpu_gguf_layout.c), also called by cpu_decode.c. */
void qp_quantize_act(const float *x, int64_t ldx, int m, int k, int8_t *q, float *d, float *s, int8_t *qr, float *dr,
                     float *sr, int threads);
int qp_gguf_matmul(int type, const uint8_t *w, int64_t n, int k, const int8_t *xq, const float *xd, const float *xs,
                   const int8_t *xr, const float *xrd, const float *xrs, int m, float *out, int64_t ldo, int threads,
                   int isa);
/* Q4_K and Q5_K (type says which). */
void qp_q4k_repack_row(int type, const uint8_t *src, int k, uint8_t *group, int j);
void qp_q4k_dequant_row(int type, const uint8_t *group, int k, int j, float *out);
void qp_q6k_repack_row(const uint8_t *src, int k, uint8_t *group, int j);
void qp_q6k_dequant_row(const uint8_t *group, int k, int j, float *out);

#endif

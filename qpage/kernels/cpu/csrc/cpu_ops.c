/* fp32 elementwise ops of a decoder layer on CPU, called through ctypes (qpage/kernels/cpu/native.py).
 *
 * Why C: at batch 1 each of these is a few microseconds of arithmetic, but in torch it is
 * several ops, each allocating its output, five calls per layer and token. Each function here is one call, in place where it can
 * be. Rows are `stride` floats apart so views of a fused projection's output need no copy.
 */
#include <math.h>
#include <stdint.h>

#include "qp_math.h"

static void rms_norm_row(const float *x, float *out, const float *w, int dim, float eps) {
    const float ss = dot(x, x, dim);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

/* out[t] = rms_norm(x[t]) * w for t < rows; x rows x_stride apart, out contiguous. */
void qp_rms_norm_f32(const float *x, int64_t x_stride, float *out, const float *w, int rows, int dim, float eps) {
    for (int t = 0; t < rows; t++) rms_norm_row(x + t * x_stride, out + (int64_t)t * dim, w, dim, eps);
}

/* In place on `heads` heads of each of `rows` rows (row t's heads contiguous from
 * x + t * row_stride): each head's head_dim values = rms_norm(head) * w (Qwen3's and Gemma 3's
 * q/k norms). */
void qp_rms_norm_heads_f32(float *x, int64_t row_stride, const float *w, int rows, int heads, int head_dim,
                           float eps) {
    for (int t = 0; t < rows; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + t * row_stride + (int64_t)h * head_dim;
            rms_norm_row(v, v, w, head_dim, eps);
        }
}

/* vLLM's fused_add_rms_norm: residual += x, then x = rms_norm(residual) * w, both in place
 * (contiguous [rows, dim]). */
void qp_add_rms_norm_f32(float *x, float *residual, const float *w, int rows, int dim, float eps) {
    for (int t = 0; t < rows; t++) {
        float *r = residual + (int64_t)t * dim, *xt = x + (int64_t)t * dim;
        for (int i = 0; i < dim; i++) r[i] += xt[i];
        rms_norm_row(r, xt, w, dim, eps);
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]; gate_up rows gu_stride apart,
 * out contiguous [rows, inter]. silu(g) = g / (1 + e^-g), computed from e = exp(-|g|) <= 1
 * so it neither overflows nor loses precision for large |g|. */
void qp_silu_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int rows, int inter) {
    for (int t = 0; t < rows; t++) {
        const float *g = gate_up + t * gu_stride;
        const float *u = gate_up + t * gu_stride + inter;
        float *o = out + (int64_t)t * inter;
        for (int i = 0; i < inter; i++) {
            const float x = g[i];
            const float e = exp_nonpos(x >= 0.0f ? -x : x);
            o[i] = x * (x >= 0.0f ? 1.0f : e) / (1.0f + e) * u[i];
        }
    }
}

/* out[t, i] = gelu(gate_up[t, i]) * gate_up[t, inter + i] with GELU's tanh approximation
 * (GeGLU: 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3)); layout as qp_silu_mul_f32.
 * Computed as g / (1 + exp(-2y)), the same value, from e = exp(-2|y|) <= 1 as in
 * qp_silu_mul_f32: no cancellation where tanh(y) is near -1. */
void qp_gelu_tanh_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int rows, int inter) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int t = 0; t < rows; t++) {
        const float *g = gate_up + t * gu_stride;
        const float *u = gate_up + t * gu_stride + inter;
        float *o = out + (int64_t)t * inter;
        for (int i = 0; i < inter; i++) {
            const float x = g[i], y = k * (x + 0.044715f * x * x * x);
            const float e = exp_nonpos(y >= 0.0f ? -2.0f * y : 2.0f * y);
            o[i] = x * (y >= 0.0f ? 1.0f : e) / (1.0f + e) * u[i];
        }
    }
}

/* Rotary embedding in place, rotate-half layout: for the first `heads` heads of row t,
 * x = x * cos[t] + roll(x, head_dim / 2) * signed_sin[t] (qpage/layers/rotary.py), with
 * cos and signed_sin contiguous [rows, head_dim]. x rows x_stride apart, heads contiguous
 * within a row. Returns 0, or -1 (nothing changed) when head_dim is odd or over 512. */
int qp_rope_f32(float *x, int64_t x_stride, const float *cos, const float *sin, int rows, int heads, int head_dim) {
    const int half = head_dim / 2;
    if (head_dim % 2 || head_dim > 512) return -1;
    for (int t = 0; t < rows; t++) {
        const float *c = cos + (int64_t)t * head_dim, *s = sin + (int64_t)t * head_dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + t * x_stride + (int64_t)h * head_dim;
            float lo[256];
            for (int i = 0; i < half; i++) lo[i] = v[i];
            for (int i = 0; i < half; i++) v[i] = v[i] * c[i] + v[half + i] * s[i];
            for (int i = 0; i < half; i++) v[half + i] = v[half + i] * c[half + i] + lo[i] * s[half + i];
        }
    }
    return 0;
}

/* One 16-float vector's butterfly step with partner distance h < 16: lane i with bit h clear
 * becomes x[i] + x[i + h], lane i with it set x[i - h] - x[i]. */
#define QP_SWAP(v, h)                                                                                              \
    __builtin_shufflevector(v, v, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h, 8 ^ h, 9 ^ h, 10 ^ h,       \
                            11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h)
#define QP_PICK(i, h) ((i) & (h) ? 16 + (i) : (i))
#define QP_BUTTERFLY(v, h)                                                                                         \
    do {                                                                                                           \
        const qp_v16 sw = QP_SWAP(v, h), sum_ = v + sw, diff_ = sw - v;                                            \
        v = __builtin_shufflevector(sum_, diff_, QP_PICK(0, h), QP_PICK(1, h), QP_PICK(2, h), QP_PICK(3, h),         \
                                    QP_PICK(4, h), QP_PICK(5, h), QP_PICK(6, h), QP_PICK(7, h), QP_PICK(8, h),       \
                                    QP_PICK(9, h), QP_PICK(10, h), QP_PICK(11, h), QP_PICK(12, h), QP_PICK(13, h),   \
                                    QP_PICK(14, h), QP_PICK(15, h));                                               \
    } while (0)

/* y = x times the block-diagonal Walsh-Hadamard matrix of `block` (a power of two dividing n),
 * scaled by `s`: butterfly steps (a + b, a - b) at distances 1, 2, 4, ... < block, then one
 * multiply, as qpage/kernels/kv_int.py's walsh_hadamard, bit for bit. */
static void hadamard_row(const float *x, float *y, int n, int block, float s) {
    for (int i = 0; i < n; i++) y[i] = x[i];
    int h = 1;
    if (block >= 16 && n % 16 == 0) {
        for (int i = 0; i < n; i += 16) {
            qp_v16 v = load16(y + i);
            QP_BUTTERFLY(v, 1);
            QP_BUTTERFLY(v, 2);
            QP_BUTTERFLY(v, 4);
            QP_BUTTERFLY(v, 8);
            __builtin_memcpy(y + i, &v, sizeof v);
        }
        h = 16;
    }
    for (; h < block; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
    for (int i = 0; i < n; i++) y[i] *= s;
}

/* out [rows, heads, n] contiguous = each head row of x [rows, heads, n] (rows x_stride floats
 * apart, heads contiguous) through hadamard_row. Returns 0, or -1 when block is not a power
 * of two dividing n. */
int qp_hadamard_f32(const float *x, int64_t x_stride, float *out, int rows, int heads, int n, int block) {
    if (block < 1 || block & (block - 1) || n % block) return -1;
    const float s = (float)(1.0 / sqrt((double)block)); /* as Python computes it */
    for (int t = 0; t < rows; t++)
        for (int h = 0; h < heads; h++)
            hadamard_row(x + t * x_stride + (int64_t)h * n, out + ((int64_t)t * heads + h) * n, n, block, s);
    return 0;
}

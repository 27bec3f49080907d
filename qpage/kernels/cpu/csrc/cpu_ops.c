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

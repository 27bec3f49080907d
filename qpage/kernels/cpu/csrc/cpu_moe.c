/* A mixture-of-experts block over block-format experts (qp_step.h's qp_moe).
 *
 * Routing as the reference models do it: fp32 router logits, a softmax over all experts, the
 * top_k largest probabilities (ties to the lower expert id), optionally renormalised. Then the
 * rows are grouped by expert (a counting sort), and each expert that any row chose runs its
 * gate_up and down projections once over its rows, gathered contiguous; its outputs are added
 * to their rows times the routing weight, experts in id order. At one row only the chosen
 * experts' weights are read: what makes a model with few active parameters decode like a
 * small one.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qp_math.h" /* dot, exp_nonpos */
#include "qp_step.h"

void qp_silu_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int rows, int inter); /* cpu_ops.c */

/* logits[rows, e] = x . router[e], rows split across threads when there is enough work. */
static void router_logits(const qp_moe *m, const float *x, int rows, int hidden, float *logits, int threads) {
    const int ne = m->num_experts;
    const int par = (int64_t)rows * ne * hidden > (1 << 18);
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (par) schedule(static)
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < ne; e++)
            logits[(int64_t)r * ne + e] = dot(x + (int64_t)r * hidden, m->router + (int64_t)e * hidden, hidden) +
                                          (m->router_bias ? m->router_bias[e] : 0.0f);
}

/* gpt-oss's clamped SwiGLU, laid out as qp_silu_mul_f32: out[r] = (up + 1) gate sigmoid(alpha
 * gate), gate = min(g, limit), up = clamp(u, -limit, limit). */
static void swiglu_clamped(const float *gate_up, int64_t stride, float *out, int rows, int inter, float limit,
                           float alpha) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + inter;
        float *o = out + (int64_t)r * inter;
        for (int i = 0; i < inter; i++) {
            const float gate = g[i] < limit ? g[i] : limit;
            const float up = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
            const float z = alpha * gate, e = exp_nonpos(z >= 0.0f ? -z : z);
            o[i] = (up + 1.0f) * gate * (z >= 0.0f ? 1.0f : e) / (1.0f + e);
        }
    }
}

/* Row r's chosen experts ids[top_k] and weights w[top_k] from its logits (overwritten by the
 * softmax's probabilities). */
static void route(const qp_moe *m, float *p, int32_t *ids, float *w) {
    const int ne = m->num_experts, k = m->top_k;
    float mx = p[0], total = 0.0f;
    for (int e = 1; e < ne; e++) mx = p[e] > mx ? p[e] : mx;
    for (int e = 0; e < ne; e++) total += (p[e] = expf(p[e] - mx));
    for (int e = 0; e < ne; e++) p[e] /= total;
    float chosen = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < ne; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[j] = best;
        chosen += (w[j] = p[best]);
    }
    if (m->norm_topk)
        for (int j = 0; j < k; j++) w[j] /= chosen;
}

/* y[rows, hidden] = mlp(x[rows]) for one expert (gu and a: scratch), its activation the block's. */
static int run_mlp(const qp_moe *m, const qp_proj *gate_up, const qp_proj *down, int inter, const float *x, int rows,
                   int hidden, float *gu, float *a, float *y, const qp_act *act, int threads) {
    int rc = qp_project(gate_up, x, rows, hidden, gu, 2 * (int64_t)inter, act, threads);
    if (rc) return rc;
    if (m->act == 1)
        swiglu_clamped(gu, 2 * (int64_t)inter, a, rows, inter, m->limit, m->alpha);
    else
        qp_silu_mul_f32(gu, 2 * (int64_t)inter, a, rows, inter);
    return qp_project(down, a, rows, inter, y, hidden, act, threads);
}

int qp_moe_f32(const qp_moe *m, const float *x, int rows, int hidden, float *out, int threads) {
    const int ne = m->num_experts, k = m->top_k;
    if (ne < 1 || k < 1 || k > ne || rows < 0 || m->inter < 1 || m->act < 0 || m->act > 1) return -1;
    if (rows == 0) return 0;
    const int wide = m->inter > m->shared_inter ? m->inter : m->shared_inter;
    const int kmax = hidden > wide ? hidden : wide;
    const size_t nr = (size_t)rows;
    float *logits = malloc(sizeof(float) * nr * (size_t)ne);
    int32_t *ids = malloc(sizeof(int32_t) * nr * (size_t)k), *start = calloc((size_t)ne + 1, sizeof(int32_t));
    int32_t *order = malloc(sizeof(int32_t) * nr * (size_t)k);
    float *w = malloc(sizeof(float) * nr * (size_t)k);
    float *xe = malloc(sizeof(float) * nr * (size_t)hidden), *y = malloc(sizeof(float) * nr * (size_t)hidden);
    float *gu = malloc(sizeof(float) * nr * 2 * (size_t)wide), *a = malloc(sizeof(float) * nr * (size_t)wide);
    const size_t codes = nr * (size_t)kmax, scales = nr * (size_t)(kmax / 32 + 1);
    int8_t *aq = malloc(2 * codes);
    float *af = malloc(sizeof(float) * 4 * scales);
    const qp_act act = {aq, aq + codes, af, af + scales, af + 2 * scales, af + 3 * scales};
    int rc = (logits && ids && start && order && w && xe && y && gu && a && aq && af) ? 0 : -3;
    if (rc == 0) {
        router_logits(m, x, rows, hidden, logits, threads);
        for (int r = 0; r < rows; r++) route(m, logits + (int64_t)r * ne, ids + (int64_t)r * k, w + (int64_t)r * k);
        /* counting sort of the (row, choice) pairs by expert: order holds r * k + j */
        for (int64_t i = 0; i < (int64_t)rows * k; i++) start[ids[i] + 1]++;
        for (int e = 0; e < ne; e++) start[e + 1] += start[e];
        int32_t *fill = malloc(sizeof(int32_t) * (size_t)ne);
        if (!fill) rc = -3;
        else {
            memcpy(fill, start, sizeof(int32_t) * (size_t)ne);
            for (int64_t i = 0; i < (int64_t)rows * k; i++) order[fill[ids[i]]++] = (int32_t)i;
            free(fill);
        }
        memset(out, 0, sizeof(float) * nr * (size_t)hidden);
    }
    for (int e = 0; e < ne && rc == 0; e++) {
        const int n = start[e + 1] - start[e];
        if (n == 0) continue;
        const int32_t *sel = order + start[e];
        for (int i = 0; i < n; i++)
            memcpy(xe + (int64_t)i * hidden, x + (int64_t)(sel[i] / k) * hidden, sizeof(float) * (size_t)hidden);
        if ((rc = run_mlp(m, m->gate_up + e, m->down + e, m->inter, xe, n, hidden, gu, a, y, &act, threads))) break;
        for (int i = 0; i < n; i++) {
            float *o = out + (int64_t)(sel[i] / k) * hidden;
            const float *yi = y + (int64_t)i * hidden, s = w[sel[i]];
            for (int j = 0; j < hidden; j++) o[j] += yi[j] * s;
        }
    }
    if (rc == 0 && m->shared_inter > 0) {
        rc = run_mlp(m, m->shared_gate_up, m->shared_down, m->shared_inter, x, rows, hidden, gu, a, y, &act, threads);
        for (int r = 0; r < rows && rc == 0; r++) {
            const float g = 1.0f / (1.0f + expf(-dot(x + (int64_t)r * hidden, m->shared_gate, hidden)));
            float *o = out + (int64_t)r * hidden;
            const float *yr = y + (int64_t)r * hidden;
            for (int j = 0; j < hidden; j++) o[j] += g * yr[j];
        }
    }
    free(logits), free(ids), free(start), free(order), free(w), free(xe);
    free(y), free(gu), free(a), free(aq), free(af);
    return rc;
}

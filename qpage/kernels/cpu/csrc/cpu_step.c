/* What a model step's C code shares (qp_step.h): a projection over block-format weights,
 * used by the fused decode step (cpu_decode.c) and the mixture-of-experts block (cpu_moe.c). */
#include <stdint.h>

#include "qp_gguf.h" /* qp_quantize_act, qp_gguf_matmul, act_residual */
#include "qp_step.h"

int qp_project(const qp_proj *p, const float *x, int rows, int k, float *out, int64_t n, const qp_act *a,
               int threads) {
    int resid = 0;
    for (int i = 0; i < p->num_pieces; i++) resid |= act_residual(p->pieces[i].type);
    qp_quantize_act(x, k, rows, k, a->q, a->d, a->s, resid ? a->qr : NULL, resid ? a->dr : NULL,
                    resid ? a->sr : NULL, threads);
    for (int i = 0; i < p->num_pieces; i++) {
        const qp_piece *c = p->pieces + i;
        const int rc = qp_gguf_matmul(c->type, c->w, c->n, k, a->q, a->d, a->s, resid ? a->qr : NULL,
                                      resid ? a->dr : NULL, resid ? a->sr : NULL, rows, out + c->col0, n, threads, 0);
        if (rc != 0) return rc == -2 ? -3 : -1; /* -3: out of memory, as for the step's own scratch */
    }
    if (p->bias)
        for (int r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) out[r * n + j] += p->bias[j];
    return 0;
}

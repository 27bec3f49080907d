/* What a model step's C code shares: a projection over block-format weights (cpu_gguf.c's
 * layout), its quantized-activation scratch, and a mixture-of-experts block (cpu_moe.c), used
 * by the fused decode step (cpu_decode.c) and called on their own from Python. */
#ifndef QP_STEP_H
#define QP_STEP_H
#include <stdint.h>

/* Output columns [col0, col0 + n) of a projection, one packed weight. */
typedef struct {
    int32_t type, pad;
    const uint8_t *w;
    int64_t n, col0;
} qp_piece;

/* A projection: its pieces (in column order) and an optional bias [n]. */
typedef struct {
    const qp_piece *pieces;
    int32_t num_pieces, pad;
    const float *bias;
} qp_proj;

/* Quantized activations: codes q [rows, k] and scales d, s [rows, k / 32]; the residual level's
 * qr, dr, sr the same (act_residual). */
typedef struct {
    int8_t *q, *qr;
    float *d, *s, *dr, *sr;
} qp_act;

/* out[rows, n] = x[rows, k] W^T (+ bias) over the projection's pieces; x rows contiguous.
 * Returns 0, -1 (a format this build cannot run) or -3 (out of memory). */
int qp_project(const qp_proj *p, const float *x, int rows, int k, float *out, int64_t n, const qp_act *a,
               int threads);

/* A sparse MLP: a router over num_experts experts (fp32 [num_experts, hidden], never quantized;
 * an optional bias [num_experts]); each row runs its top_k experts by softmax probability,
 * weighted by those probabilities (renormalised to sum 1 when norm_topk); each expert is
 * act(x W_gate) * (x W_up) W_down with gate_up [2 inter, hidden] and down [hidden, inter] (their
 * projections may carry biases); act SiLU, or (act 1) gpt-oss's clamped SwiGLU: gate clamped
 * above at limit, up to [-limit, limit], (up + 1) gate sigmoid(alpha gate). With a shared
 * expert, every row also adds sigmoid(x . shared_gate) times the shared MLP's output. */
typedef struct {
    int32_t num_experts, top_k, inter, norm_topk;
    int32_t shared_inter, act; /* shared_inter 0: no shared expert */
    const float *router;
    const qp_proj *gate_up, *down; /* [num_experts] each */
    const qp_proj *shared_gate_up, *shared_down;
    const float *shared_gate; /* [hidden] */
    const float *router_bias; /* [num_experts] or NULL */
    float limit, alpha;
} qp_moe;

/* out[rows, hidden] = the block's output for x[rows, hidden] (out and x distinct). Rows are
 * grouped by expert so that each chosen expert runs one matmul over its rows. Returns as
 * qp_project (-1 also for a block that is not 1 <= top_k <= num_experts). */
int qp_moe_f32(const qp_moe *m, const float *x, int rows, int hidden, float *out, int threads);

#endif

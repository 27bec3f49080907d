/* A whole decode step of a Llama-family or Gemma model in one call: every decoder layer, for
 * rows that each add one token to a sequence, with weights in llama.cpp's block formats
 * (cpu_gguf.c) and an fp32 paged KV cache (cpu_attention.c).
 *
 * Why: at batch 1 the default model's weights are read in a few milliseconds, while the
 * Python around ~10 kernel calls per layer cost more than that; here each layer is the same
 * calls made from C. It computes what LlamaForCausalLM.forward computes with the same
 * kernels in the same order (vLLM's residual form: the layer output is h + residual, the add
 * fused into the next norm), so its results equal the Python path's
 * (tests/models/test_fused_decode.py).
 *
 * Per layer: residual += h; x = rms_norm(residual) (layer 0: residual = h); qkv = x W_qkv (+ b);
 * [q/k norms on each head]; rotary on the q and k heads (the layer's tables); k, v written at
 * the slots of the layer's KV group; attention over each sequence's blocks of that group
 * [within the layer's window; scores soft-capped]; h = attn W_o [h = rms_norm(h)];
 * residual += h; x = rms_norm(residual); h = act(x W_gate) * (x W_up) W_down [h = rms_norm(h)],
 * act SiLU or tanh-GELU, or a mixture of experts in its place (cpu_moe.c). Bracketed steps are
 * Gemma's and Qwen3's, where the layer has them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qp_step.h" /* qp_proj, qp_act, qp_moe */

/* cpu_ops.c */
void qp_rms_norm_f32(const float *x, int64_t x_stride, float *out, const float *w, int rows, int dim, float eps);
void qp_add_rms_norm_f32(float *x, float *residual, const float *w, int rows, int dim, float eps);
void qp_silu_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int rows, int inter);
void qp_gelu_tanh_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int rows, int inter);
void qp_rms_norm_heads_f32(float *x, int64_t row_stride, const float *w, int rows, int heads, int head_dim,
                           float eps);
int qp_rope_f32(float *x, int64_t x_stride, const float *cos, const float *sin, int rows, int heads, int head_dim);
/* cpu_attention.c */
int qp_paged_decode_f32(const float *q, int64_t q_seq_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_table, int64_t table_stride, int64_t table_cols,
                        const int64_t *seq_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int64_t num_blocks, int threads, int64_t window,
                        float softcap, const float *sinks);
int qp_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                    float *v_cache, const int64_t *slots, int num_tokens, int64_t row, int64_t num_slots);

typedef struct {
    const float *in_norm, *post_norm; /* [hidden]: before attention, before the MLP */
    qp_proj qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    const float *q_norm, *k_norm; /* [head_dim] or NULL */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden] or NULL: norms of the attention's and MLP's outputs */
    int32_t rope, kv_group; /* which rotary tables; which KV group's slots and block tables */
    int64_t window; /* 0: the whole context */
    const qp_moe *moe; /* the MLP is this mixture of experts (gate_up and down unused), or NULL */
    const float *sinks; /* [heads] or NULL: attention sinks */
} qp_layer;

/* Decode rows [start, end) whose sequences share one block table layout. */
typedef struct {
    int32_t start, end;
    const int64_t *block_table;
    int64_t table_stride, table_cols;
    const int64_t *seq_lens;
} qp_group;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, block_size, threads, gelu; /* gelu: tanh-GELU, else SiLU */
    float eps, scale, softcap, pad; /* softcap 0: scores not capped */
    int64_t num_blocks;
} qp_shape;

/* The layer's MLP on the normed h [rows, hidden], its output left in h: gate_up into gu, the
 * activation into a (the step's scratch), down back into h; or the layer's mixture of experts
 * into moe_out, copied back. Then the norm of the MLP's output, where the layer has one. */
static int mlp(const qp_layer *L, const qp_shape *sh, float *h, int rows, float *gu, float *a, float *moe_out,
               const qp_act *act) {
    const int hidden = sh->hidden, inter = sh->inter;
    int rc;
    if (L->moe) {
        if ((rc = qp_moe_f32(L->moe, h, rows, hidden, moe_out, sh->threads))) return rc;
        memcpy(h, moe_out, sizeof(float) * (size_t)rows * (size_t)hidden);
    } else {
        if ((rc = qp_project(&L->gate_up, h, rows, hidden, gu, 2 * (int64_t)inter, act, sh->threads))) return rc;
        if (sh->gelu)
            qp_gelu_tanh_mul_f32(gu, 2 * (int64_t)inter, a, rows, inter);
        else
            qp_silu_mul_f32(gu, 2 * (int64_t)inter, a, rows, inter);
        if ((rc = qp_project(&L->down, a, rows, inter, h, hidden, act, sh->threads))) return rc;
    }
    if (L->mlp_out_norm) qp_rms_norm_f32(h, hidden, h, L->mlp_out_norm, rows, hidden, sh->eps);
    return 0;
}

/* h [rows, hidden]: the embedding output in, the last layer's MLP output out; residual
 * [rows, hidden] out. cos[i], sin[i] [rows, head_dim]: rotary tables i (sin signed as
 * qp_rope_f32 takes it); per KV group g, slots[g] [rows] and num_groups[g] decode groups at
 * groups[g]. Returns 0, -1 (a weight format or head size this build cannot run), -2 (a slot,
 * seq_len or block id out of range; checked before anything is read), -3 (out of memory). */
int qp_gguf_decode_layers(const qp_layer *layers, int num_layers, const qp_shape *sh, float *h, float *residual,
                          int rows, const float *const *cos, const float *const *sin, const int64_t *const *slots,
                          const qp_group *const *groups, const int *num_groups) {
    const int hd = sh->head_dim, hidden = sh->hidden, inter = sh->inter;
    const int64_t qkv_n = (int64_t)(sh->heads + 2 * sh->kv_heads) * hd, q_n = (int64_t)sh->heads * hd;
    const int64_t widest = qkv_n > 2 * inter ? qkv_n : 2 * inter, k_max = hidden > inter ? hidden : inter;
    const int64_t k_max2 = k_max > q_n ? k_max : q_n;
    float *qkv = malloc(sizeof(float) * (size_t)(rows * widest));
    float *attn = malloc(sizeof(float) * (size_t)(rows * (q_n > inter ? q_n : inter)));
    float *moe_out = malloc(sizeof(float) * (size_t)rows * (size_t)hidden);
    /* Both levels' codes in one buffer, and the four scale arrays in another. */
    const size_t codes = (size_t)rows * (size_t)k_max2, scales = (size_t)rows * (size_t)(k_max2 / 32 + 1);
    int8_t *aq = malloc(2 * codes);
    float *af = malloc(sizeof(float) * 4 * scales);
    const qp_act act = {aq, aq + codes, af, af + scales, af + 2 * scales, af + 3 * scales};
    int rc = (qkv && attn && moe_out && aq && af) ? 0 : -3;
    const int64_t num_slots = sh->num_blocks * sh->block_size;
    for (int l = 0; l < num_layers && rc == 0; l++) {
        const qp_layer *L = layers + l;
        if (l == 0) {
            memcpy(residual, h, sizeof(float) * (size_t)rows * (size_t)hidden);
            qp_rms_norm_f32(residual, hidden, h, L->in_norm, rows, hidden, sh->eps);
        } else {
            qp_add_rms_norm_f32(h, residual, L->in_norm, rows, hidden, sh->eps);
        }
        if ((rc = qp_project(&L->qkv, h, rows, hidden, qkv, qkv_n, &act, sh->threads))) break;
        if (L->q_norm) qp_rms_norm_heads_f32(qkv, qkv_n, L->q_norm, rows, sh->heads, hd, sh->eps);
        if (L->k_norm) qp_rms_norm_heads_f32(qkv + q_n, qkv_n, L->k_norm, rows, sh->kv_heads, hd, sh->eps);
        if (qp_rope_f32(qkv, qkv_n, cos[L->rope], sin[L->rope], rows, sh->heads + sh->kv_heads, hd)) {
            rc = -1; /* a head size rotary cannot run */
            break;
        }
        if (qp_write_kv_f32(qkv + q_n, qkv_n, qkv + q_n + (int64_t)sh->kv_heads * hd, qkv_n, L->k_cache, L->v_cache,
                            slots[L->kv_group], rows, (int64_t)sh->kv_heads * hd, num_slots)) {
            rc = -2;
            break;
        }
        for (int g = 0; g < num_groups[L->kv_group] && rc == 0; g++) {
            const qp_group *G = groups[L->kv_group] + g;
            const int r = qp_paged_decode_f32(qkv + G->start * qkv_n, qkv_n, L->k_cache, L->v_cache, G->block_table,
                                              G->table_stride, G->table_cols, G->seq_lens, attn + G->start * q_n,
                                              G->end - G->start, sh->heads, sh->kv_heads, hd, sh->block_size,
                                              sh->scale, sh->num_blocks, sh->threads, L->window, sh->softcap, L->sinks);
            rc = r == -2 ? -2 : r != 0 ? -3 : 0; /* the attention's -1: its scratch allocation failed */
        }
        if (rc) break;
        if ((rc = qp_project(&L->o, attn, rows, (int)q_n, h, hidden, &act, sh->threads))) break;
        if (L->attn_out_norm) qp_rms_norm_f32(h, hidden, h, L->attn_out_norm, rows, hidden, sh->eps);
        qp_add_rms_norm_f32(h, residual, L->post_norm, rows, hidden, sh->eps);
        if ((rc = mlp(L, sh, h, rows, qkv, attn, moe_out, &act))) break;
    }
    free(qkv);
    free(attn);
    free(moe_out);
    free(aq);
    free(af);
    return rc;
}

/* fp32 paged attention and cache write on CPU, called through ctypes (qpage/kernels/cpu/native.py).
 *
 * Cache layout per layer, as qpage/layers/attention.py: k_cache and v_cache are
 * [num_blocks, block_size, kv_heads, head_dim] contiguous; token slot s is block
 * s / block_size, offset s % block_size.
 *
 * Why C: a decode step reads each sequence's K and V once and does ~3 FMAs per element
 * read, so it is bound by memory. In torch it costs a gather of the blocks (a copy of all
 * of K and V) and several dispatches per layer; this reads the blocks where they are, in
 * one call per layer. A decode step's rows run on one thread on purpose: qpage's fp32 matmuls
 * run on NumPy's OpenBLAS threads, which spin between calls, and a second thread pool here
 * would fight them for the cores (see qpage/layers/ops.py). A prompt chunk's rows (each a
 * query over its own context, the decode arithmetic) are spread over OpenMP's threads
 * (qp_attention_threads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qp_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Cache blocks sit anywhere in memory and the hardware prefetcher stops at page edges, so
 * the next block is requested while this one is processed. */
static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

/* One decode row: all heads over its own context, one cache block at a time (a block's K or
 * V is one contiguous run of memory, read once for all heads), the next block requested
 * ahead a token row at a time. Bit for bit what attend_rows computes for a row (dot and
 * block_dots agree; the rest is the same sequence), in the order that is fastest for one
 * row read from memory.
 * q: [num_heads, head_dim] rows head_dim apart; out likewise; scores: scratch [num_heads, seq_len];
 * m: scratch [num_heads]. */
static inline __attribute__((always_inline)) void attend_seq(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *blocks, int64_t seq_len,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int64_t window, float softcap,
    const float *sinks,
    float *scores, float *m, float *out) {
    const int group = num_heads / num_kv_heads;
    const int64_t tok_stride = (int64_t)num_kv_heads * head_dim, block_stride = block_size * tok_stride;
    const int64_t start = qp_window_start(seq_len, window), first = start - start % block_size;
    for (int h = 0; h < num_heads; h++) m[h] = -INFINITY;
    /* Pass 1: scores of positions start.. (blocks before the window are not read), and each
     * head's maximum. */
    for (int64_t b0 = first; b0 < seq_len; b0 += block_size) {
        const float *kb = k_cache + blocks[b0 / block_size] * block_stride;
        const int64_t count = seq_len - b0 < block_size ? seq_len - b0 : block_size;
        const float *next = b0 + block_size < seq_len ? k_cache + blocks[b0 / block_size + 1] * block_stride : NULL;
        for (int64_t t = b0 < start ? start - b0 : 0; t < count; t++) {
            if (next) prefetch_row(next + t * tok_stride, tok_stride);
            for (int h = 0; h < num_heads; h++) {
                const float s = qp_softcap(dot(q + (int64_t)h * head_dim, kb + t * tok_stride +
                                               (int64_t)(h / group) * head_dim, head_dim) * scale, softcap);
                scores[(int64_t)h * seq_len + b0 + t] = s;
                m[h] = s > m[h] ? s : m[h];
            }
        }
    }
    /* Softmax numerators in place; m[h] becomes 1 / denominator. */
    qp_softmax_numerators(scores + start, seq_len, m, num_heads, seq_len - start, sinks);
    memset(out, 0, sizeof(float) * (size_t)num_heads * head_dim);
    /* Pass 2: weighted sum of V. */
    for (int64_t b0 = first; b0 < seq_len; b0 += block_size) {
        const float *vb = v_cache + blocks[b0 / block_size] * block_stride;
        const int64_t count = seq_len - b0 < block_size ? seq_len - b0 : block_size;
        const int64_t t0 = b0 < start ? start - b0 : 0;
        if (b0 + block_size < seq_len) prefetch_row(v_cache + blocks[b0 / block_size + 1] * block_stride,
                                                    count * tok_stride);
        for (int h = 0; h < num_heads; h++)
            weighted_rows(out + (int64_t)h * head_dim, scores + (int64_t)h * seq_len + b0 + t0,
                          vb + t0 * tok_stride + (int64_t)(h / group) * head_dim, tok_stride, count - t0, head_dim);
    }
    qp_scale_rows(out, m, num_heads, head_dim);
}

/* attend_seq out of line, head_dim 64 unrolled: kept apart from the tile code, so the compiler
 * lays the one-row path out as its own function (it is faster so). */
static __attribute__((noinline)) void decode_row(const float *q, const float *k_cache, const float *v_cache,
                                                 const int64_t *blocks, int64_t seq_len, int num_heads,
                                                 int num_kv_heads, int head_dim, int block_size, float scale,
                                                 int64_t window, float softcap, const float *sinks, float *scores,
                                                 float *m, float *out) {
    if (head_dim == 64)
        attend_seq(q, k_cache, v_cache, blocks, seq_len, num_heads, num_kv_heads, 64, block_size, scale, window,
                   softcap, sinks, scores, m, out);
    else
        attend_seq(q, k_cache, v_cache, blocks, seq_len, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                   softcap, sinks, scores, m, out);
}

/* Rows of one prompt chunk attended together, a tile at a time, so each cache block is read
 * from memory once for the tile; a row's arithmetic is the same whatever the tile. */
#define QP_TILE_ROWS 8

/* `rows` queries over one block table (one sequence, or one prompt chunk's rows), all heads,
 * one cache block at a time: a block's K or V is one contiguous run of memory, read once for
 * every row and head. Row r's operations, in their order, depend on seq_lens[r] alone.
 * q: row r's [num_heads, head_dim] at q + r * q_stride; out: [rows, num_heads, head_dim];
 * scores: scratch [rows * num_heads, longest]; m: scratch [rows * num_heads]. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, int64_t q_stride, int rows, const float *k_cache, const float *v_cache, const int64_t *blocks,
    const int64_t *seq_lens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
    int64_t window, float softcap, const float *sinks, float *scores, float *m, float *out) {
    const int group = num_heads / num_kv_heads;
    const int64_t tok_stride = (int64_t)num_kv_heads * head_dim, block_stride = block_size * tok_stride;
    int64_t longest = 0, first = INT64_MAX;
    for (int r = 0; r < rows; r++) {
        const int64_t start = qp_window_start(seq_lens[r], window);
        longest = seq_lens[r] > longest ? seq_lens[r] : longest;
        first = start < first ? start : first;
    }
    first -= first % block_size;
    for (int i = 0; i < rows * num_heads; i++) m[i] = -INFINITY;
    /* Pass 1: scores of each row's positions in its window, and each row and head's maximum. */
    for (int64_t b0 = first; b0 < longest; b0 += block_size) {
        const float *kb = k_cache + blocks[b0 / block_size] * block_stride;
        for (int r = 0; r < rows; r++) {
            const int64_t start = qp_window_start(seq_lens[r], window);
            if (seq_lens[r] <= b0 || b0 + block_size <= start) continue;
            const int64_t count = seq_lens[r] - b0 < block_size ? seq_lens[r] - b0 : block_size;
            const int64_t t0 = b0 < start ? start - b0 : 0;
            for (int h = 0; h < num_heads; h++) {
                const int64_t at = (int64_t)r * num_heads + h;
                float *row = scores + at * longest + b0;
                block_dots(q + r * q_stride + (int64_t)h * head_dim, kb + t0 * tok_stride + (int64_t)(h / group) *
                           head_dim, tok_stride, count - t0, block_size - t0, head_dim, row + t0);
                float mx = m[at]; /* in a register: m and row share one allocation */
                for (int64_t t = t0; t < count; t++) {
                    row[t] = qp_softcap(row[t] * scale, softcap);
                    mx = row[t] > mx ? row[t] : mx;
                }
                m[at] = mx;
            }
        }
    }
    /* Softmax numerators in place; m becomes 1 / denominator. */
    for (int r = 0; r < rows; r++) {
        const int64_t start = qp_window_start(seq_lens[r], window);
        qp_softmax_numerators(scores + (int64_t)r * num_heads * longest + start, longest, m + (int64_t)r * num_heads,
                              num_heads, seq_lens[r] - start, sinks);
    }
    memset(out, 0, sizeof(float) * (size_t)rows * num_heads * head_dim);
    /* Pass 2: weighted sum of V. */
    for (int64_t b0 = first; b0 < longest; b0 += block_size) {
        const float *vb = v_cache + blocks[b0 / block_size] * block_stride;
        for (int r = 0; r < rows; r++) {
            const int64_t start = qp_window_start(seq_lens[r], window);
            if (seq_lens[r] <= b0 || b0 + block_size <= start) continue;
            const int64_t count = seq_lens[r] - b0 < block_size ? seq_lens[r] - b0 : block_size;
            const int64_t t0 = b0 < start ? start - b0 : 0;
            for (int h = 0; h < num_heads; h++) {
                const int64_t at = (int64_t)r * num_heads + h;
                weighted_rows(out + at * head_dim, scores + at * longest + b0 + t0,
                              vb + t0 * tok_stride + (int64_t)(h / group) * head_dim, tok_stride, count - t0, head_dim);
            }
        }
    }
    qp_scale_rows(out, m, rows * num_heads, head_dim);
}

/* One call's arguments, shared by the threads that run its tiles. */
typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_table, *seq_lens;
    float *out;
    int64_t q_seq_stride, table_stride, longest, window;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, tile;
    float scale, softcap;
    const float *sinks;
} qp_attention_call;

/* Tiles first, first + step, ... of a call (one thread's share), with their own scratch.
 * Returns -1 when the scratch cannot be allocated. */
static int attend_tiles(const qp_attention_call *c, int first, int step) {
    float *m = NULL, *scores = qp_score_scratch(c->tile, c->num_heads, c->longest, &m);
    if (!scores) return -1;
    const int tiles = (c->num_seqs + c->tile - 1) / c->tile;
    for (int i = first; i < tiles; i += step) {
        const int s = i * c->tile, rows = c->num_seqs - s < c->tile ? c->num_seqs - s : c->tile;
        const float *qs = c->q + s * c->q_seq_stride;
        const int64_t *bt = c->block_table + s * c->table_stride;
        float *os = c->out + (int64_t)s * c->num_heads * c->head_dim;
        /* A constant head_dim lets the compiler unroll the dot products fully. */
        if (c->table_stride != 0)
            decode_row(qs, c->k_cache, c->v_cache, bt, c->seq_lens[s], c->num_heads, c->num_kv_heads, c->head_dim,
                       c->block_size, c->scale, c->window, c->softcap, c->sinks, scores, m, os);
        else if (c->head_dim == 64)
            attend_rows(qs, c->q_seq_stride, rows, c->k_cache, c->v_cache, bt, c->seq_lens + s, c->num_heads,
                        c->num_kv_heads, 64, c->block_size, c->scale, c->window, c->softcap, c->sinks, scores, m, os);
        else
            attend_rows(qs, c->q_seq_stride, rows, c->k_cache, c->v_cache, bt, c->seq_lens + s, c->num_heads,
                        c->num_kv_heads, c->head_dim, c->block_size, c->scale, c->window, c->softcap, c->sinks, scores,
                        m, os);
    }
    free(scores);
    return 0;
}

/* Decode attention: one query token per row over its paged context.
 * q: [num_seqs, num_heads, head_dim], rows q_seq_stride floats apart (heads contiguous);
 * block_table: int64 [num_seqs, table_cols], rows table_stride apart; table_stride 0: one
 * table for all, the rows of one prompt chunk, attended QP_TILE_ROWS at a time;
 * seq_lens: int64 [num_seqs] (>= 1, this row's token included); out: [num_seqs, num_heads,
 * head_dim] contiguous; threads: the most to use (qp_attention_threads); window > 0: each row
 * attends to its last `window` positions only (the blocks before them are not read: their
 * ids may be any valid block); softcap > 0: scores are soft-capped (qp_softcap); sinks
 * [num_heads] or NULL: each head's softmax has that one more logit (qp_softmax_numerators).
 * Returns 0; -1 when the scratch
 * cannot be allocated; -2 when a seq_len is < 1 or a block id it reaches is outside
 * [0, num_blocks) (nothing is read then). */
int qp_paged_decode_f32(const float *q, int64_t q_seq_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_table, int64_t table_stride, int64_t table_cols,
                        const int64_t *seq_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int64_t num_blocks, int threads, int64_t window,
                        float softcap, const float *sinks) {
    const int64_t longest =
        qp_check_decode_tables(block_table, table_stride, table_cols, seq_lens, num_seqs, block_size, num_blocks);
    if (longest < 0) return -2;
    const qp_attention_call c = {q, k_cache, v_cache, block_table, seq_lens, out, q_seq_stride, table_stride,
                                 longest, window, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                 table_stride == 0 ? QP_TILE_ROWS : 1, scale, softcap, sinks};
    const int n = qp_attention_threads(seq_lens, num_seqs, num_heads, head_dim, threads);
    if (n == 1) return attend_tiles(&c, 0, 1); /* no thread team for a decode step's few rows */
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(| : failed)
    {
#ifdef _OPENMP
        failed |= attend_tiles(&c, omp_get_thread_num(), omp_get_num_threads());
#else
        failed |= attend_tiles(&c, 0, 1);
#endif
    }
    return failed ? -1 : 0;
}

/* Cache write: token i's K and V rows ([kv_heads * head_dim] floats, contiguous within the
 * row; rows k_stride / v_stride floats apart) go to slot slots[i]; slot -1 is skipped.
 * Returns 0, or -2 (nothing written) when a slot is outside [-1, num_slots). */
int qp_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                    float *v_cache, const int64_t *slots, int num_tokens, int64_t row, int64_t num_slots) {
    for (int i = 0; i < num_tokens; i++)
        if (slots[i] < -1 || slots[i] >= num_slots) return -2;
    for (int i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, k + i * k_stride, sizeof(float) * (size_t)row);
        memcpy(v_cache + slot * row, v + i * v_stride, sizeof(float) * (size_t)row);
    }
    return 0;
}

/* Dense fp32 matmul: out[m, n] = x[m, k] . W^T, W [n, k] packed once into panels.
 *
 * Panel layout (qp_dense_pack): panel p holds output columns 16p .. 16p + 15 as [k][16]
 * floats, so one step over k reads 64 contiguous bytes of each panel and the whole weight is
 * one sequential stream; the last panel is padded with zero columns.
 *
 * Every output is one multiply-add chain over k in order 0, 1, .., k - 1 from zero, in one
 * vector lane, whatever m, the tile its row falls in or the thread count: a row's result does
 * not depend on the rows beside it (batch invariance), unlike a BLAS GEMM, which switches
 * kernels and blockings with the shape. Tiles of TILE_ROWS rows x TILE_PANELS panels keep
 * their accumulators in registers; threads split the panels, never a chain. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "qp_math.h"

#define PANEL 16
#ifdef __AVX512F__ /* 32 vector registers: 16 accumulators, 2 weight vectors, a broadcast */
#define TILE_ROWS 8
#define TILE_PANELS 2
#else /* 16 (AVX2) registers, each half a 16-float vector */
#define TILE_ROWS 4
#define TILE_PANELS 1
#endif
/* Weight steps fetched ahead of the multiply (1 KiB per panel): the first row tile reads the
 * panels from memory, the rest from cache. */
#define PREFETCH 16

/* rows x panels outputs at once; cols: the valid columns from the tile's first panel on. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *w, int64_t k,
                                                       float *out, int64_t ldo, const int rows, const int panels,
                                                       int64_t cols) {
    qp_v16 acc[TILE_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) acc[r][p] = (qp_v16){0};
    const int64_t step = k * PANEL;
    for (int64_t i = 0; i < k; i++) {
        qp_v16 wv[TILE_PANELS];
        for (int p = 0; p < panels; p++) {
            wv[p] = load16(w + p * step + i * PANEL);
            __builtin_prefetch(w + p * step + (i + PREFETCH) * PANEL);
        }
        for (int r = 0; r < rows; r++) {
            const float a = x[r * ldx + i];
            for (int p = 0; p < panels; p++) acc[r][p] += a * wv[p];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels && p * PANEL < cols; p++) {
            const int64_t c = cols - p * PANEL < PANEL ? cols - p * PANEL : PANEL;
            if (c == PANEL) __builtin_memcpy(out + r * ldo + p * PANEL, &acc[r][p], sizeof(qp_v16));
            else for (int64_t j = 0; j < c; j++) out[r * ldo + p * PANEL + j] = acc[r][p][j];
        }
}

/* All m rows against `panels` (TILE_PANELS or 1) panels: whole tiles, then the leftover rows. */
static void panel_rows(const float *x, int64_t ldx, int64_t m, const float *w, int64_t k, float *out, int64_t ldo,
                       int panels, int64_t cols) {
    int64_t r = 0;
    if (panels == TILE_PANELS) {
        for (; r + TILE_ROWS <= m; r += TILE_ROWS) tile(x + r * ldx, ldx, w, k, out + r * ldo, ldo, TILE_ROWS, TILE_PANELS, cols);
        for (; r < m; r++) tile(x + r * ldx, ldx, w, k, out + r * ldo, ldo, 1, TILE_PANELS, cols);
    } else {
        for (; r + TILE_ROWS <= m; r += TILE_ROWS) tile(x + r * ldx, ldx, w, k, out + r * ldo, ldo, TILE_ROWS, 1, cols);
        for (; r < m; r++) tile(x + r * ldx, ldx, w, k, out + r * ldo, ldo, 1, 1, cols);
    }
}

static void run_panels(const float *x, int64_t ldx, int64_t m, const float *w, int64_t k, int64_t n, float *out,
                       int64_t ldo, int64_t g0, int64_t g1) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t p0 = g * TILE_PANELS;
        if (p0 + TILE_PANELS <= panels) {
            panel_rows(x, ldx, m, w + p0 * k * PANEL, k, out + p0 * PANEL, ldo, TILE_PANELS, n - p0 * PANEL);
        } else {
            for (int64_t p = p0; p < panels; p++)
                panel_rows(x, ldx, m, w + p * k * PANEL, k, out + p * PANEL, ldo, 1, n - p * PANEL);
        }
    }
}

/* W [n, k] (element strides sn, sk: a transposed view packs in place) -> panels
 * [ceil(n / 16)][k][16], zero-padded. */
void qp_dense_pack(const float *w, int64_t sn, int64_t sk, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int j = 0; j < PANEL; j++) {
                const int64_t row = p * PANEL + j;
                out[(p * k + i) * PANEL + j] = row < n ? w[row * sn + i * sk] : 0.0f;
            }
}

/* out[m, n] (row stride ldo) = x[m, k] (row stride ldx) . W^T, W packed by qp_dense_pack. */
void qp_dense_matmul(const float *x, int64_t ldx, int64_t m, const float *w, int64_t n, int64_t k, float *out,
                     int64_t ldo, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + TILE_PANELS - 1) / TILE_PANELS;
    /* Small matmuls stay on one thread: waking the others costs more than they save. */
    if (n * k * m < (1 << 16) || groups < 2) threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), per = (groups + nt - 1) / nt;
        const int64_t g0 = per * t, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 < g1) run_panels(x, ldx, m, w, k, n, out, ldo, g0, g1);
    }
#else
    (void)threads;
    run_panels(x, ldx, m, w, k, n, out, ldo, 0, groups);
#endif
}

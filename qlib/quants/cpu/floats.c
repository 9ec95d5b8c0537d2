/* qlib CPU kernels: y = x @ W.T for F32, F16 and BF16 weights, the GGUF rows as they are,
 * with ggml semantics: the activation row rounded to the weight's vec_dot type (F16: half,
 * BF16: bf16, both to nearest even; F32: as it is), products and sums in float32.
 *
 * GEMV (decode, and up to qlib_gemm_min_rows rows): a group of 4 weight rows is one FMA chain
 * a row over 16 lanes, element order, then the lane sum. From qlib_gemm_min_rows rows a tiled
 * GEMM (below): equal to the GEMV to float rounding (another order of the same float32
 * products); within each path a row's result never depends on the other rows.
 * kquants.c's entry points (qlib_kgemm, qlib_kgemv_region) hand these types over here: the
 * Python side treats them as one more kind of GGUF rows (layout.BLOCK_CODES).
 * Requires k % 16 == 0. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

enum { QLIB_F32 = 0, QLIB_F16 = 1, QLIB_BF16 = 30 }; /* ggml's type ids */
extern int qlib_gemm_min_rows; /* kernels.c: the rows from which the tiled paths run */

int qlib_float_type(int type) { return type == QLIB_F32 || type == QLIB_F16 || type == QLIB_BF16; }

static size_t row_bytes_of(int type, int k) { return (size_t)k * (type == QLIB_F32 ? 4 : 2); }

static inline __m512 load16(int type, const uint8_t *row, int e) {
    if (type == QLIB_F32) return _mm512_loadu_ps((const float *)row + e);
    if (type == QLIB_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + e)));
    return bf16x16_load((const uint16_t *)row + e);
}

/* f(x) of one input row (input_row: RmsNorm or SwiGLU), rounded to the dot type, into a. */
static void act_row(int type, const float *x, int k, const float *norm_w, float eps,
                    int swiglu, float *a) {
    input_row(x, k, norm_w, eps, swiglu, a);
    for (int e = 0; e < k; e += 16) {
        __m512 v = _mm512_loadu_ps(a + e);
        if (type == QLIB_F16)
            v = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else if (type == QLIB_BF16)
            v = bf16_round(v);
        _mm512_storeu_ps(a + e, v);
    }
}

/* Dots of R rows (type, stride row_bytes) with one activation row a: y[0..R-1]. pf (or
 * NULL): rows to prefetch into L2 as these are read (the same offsets; a GEMV's rows are
 * read once, 4 short streams a group, too short for the hardware prefetcher alone). */
static inline __attribute__((always_inline)) void frows(const int R, const int type,
                                                        const uint8_t *w, size_t row_bytes,
                                                        int k, const float *a, const char *pf,
                                                        float *y) {
    const int esize = type == QLIB_F32 ? 4 : 2;
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int e = 0; e < k; e += 16) {
        if (pf && (esize == 4 || e % 32 == 0)) /* one line a row per 64 bytes read */
            for (int r = 0; r < R; r++) _mm_prefetch(pf + r * row_bytes + e * esize, _MM_HINT_T1);
        const __m512 va = _mm512_loadu_ps(a + e);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(load16(type, w + r * row_bytes, e), va, acc[r]);
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}

/* frows with the type a constant in each copy (the loads' branch out of the loop). */
static void frows_t(int R, int type, const uint8_t *w, size_t row_bytes, int k, const float *a,
                    const char *pf, float *y) {
#define FROWS(T)                                                                              \
    do {                                                                                      \
        if (R == 4)                                                                           \
            frows(4, T, w, row_bytes, k, a, pf, y);                                           \
        else                                                                                  \
            for (int r = 0; r < R; r++) frows(1, T, w + r * row_bytes, row_bytes, k, a, NULL, y + r); \
    } while (0)
    if (type == QLIB_F32)
        FROWS(QLIB_F32);
    else if (type == QLIB_F16)
        FROWS(QLIB_F16);
    else
        FROWS(QLIB_BF16);
#undef FROWS
}

enum { PF_GROUPS = 4 }; /* groups of 4 rows ahead that a GEMV prefetches */

/* Rows j .. j + rows - 1 (rows <= 4) times the m activation rows a (stride k; m < 4: the
 * rows come again from L1); pf: the prefetch of frows (or NULL). */
static inline void group_rows(int type, const uint8_t *wj, size_t row_bytes, int rows, int j,
                              int n, int k, const float *a, int m, const char *pf, float *y,
                              int accumulate) {
    for (int i = 0; i < m; i++) {
        float out[4];
        frows_t(rows, type, wj, row_bytes, k, a + (size_t)i * k, i ? NULL : pf, out);
        float *yi = y + (size_t)i * n + j;
        for (int r = 0; r < rows; r++) yi[r] = accumulate ? yi[r] + out[r] : out[r];
    }
}

/* -- many rows (prefill): a tile of 16 weight rows as float32, transposed so that a 64-byte
 * vector holds element e of the 16 rows (lane = weight row), times FMR activation rows at a
 * time (a broadcast of a[i][e] per FMA): each output element is one float32 FMA chain in
 * element order, no lane sums; a row's result still never depends on the other rows. */
enum { FT = 16, FMR = 8 };

/* Rows j0 .. j0 + 15 of w (rows past n repeat the last) -> t[e * 16 + r]: 16 x 16 blocks
 * transposed in registers (a scalar transposition was ~40% of a 64-row product's time). */
static void ftile(int type, const uint8_t *w, size_t row_bytes, int j0, int n, int k, float *t) {
    const uint8_t *row[FT];
    for (int r = 0; r < FT; r++) row[r] = w + (size_t)(j0 + r < n ? j0 + r : n - 1) * row_bytes;
    for (int e0 = 0; e0 < k; e0 += 16) {
        __m512i x[16];
        for (int r = 0; r < 16; r++) x[r] = _mm512_castps_si512(load16(type, row[r], e0));
        transpose16(x);
        for (int e = 0; e < 16; e++) _mm512_store_si512(t + (size_t)(e0 + e) * FT, x[e]);
    }
}

static inline __attribute__((always_inline)) void ftile_rows(const int MR, const float *t, int k,
                                                             const float *a, float *y, int n,
                                                             int cols, int accumulate) {
    __m512 acc[FMR];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int e = 0; e < k; e++) {
        const __m512 we = _mm512_load_ps(t + (size_t)e * FT);
        for (int i = 0; i < MR; i++)
            acc[i] = _mm512_fmadd_ps(we, _mm512_set1_ps(a[(size_t)i * k + e]), acc[i]);
    }
    for (int i = 0; i < MR; i++) store_lanes(y + (size_t)i * n, acc[i], cols, accumulate);
}

/* y rows 0 .. m-1 (+)= a @ W.T by tiles of 16 weight rows split over the threads. */
static int fgemm_tiled(int type, const uint8_t *w, size_t row_bytes, int n, int k,
                       const float *a, int m, float *y, int accumulate) {
    const int ntiles = (n + FT - 1) / FT;
    int failed = 0;
#pragma omp parallel
    {
        float *t = aligned_alloc(64, sizeof(float) * FT * (size_t)k);
        if (!t) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int tj = 0; tj < ntiles; tj++) {
            if (!t) continue;
            const int j0 = tj * FT, cols = n - j0 < FT ? n - j0 : FT;
            ftile(type, w, row_bytes, j0, n, k, t);
            int i = 0;
            for (; i + FMR <= m; i += FMR)
                ftile_rows(FMR, t, k, a + (size_t)i * k, y + (size_t)i * n + j0, n, cols,
                           accumulate);
            for (; i < m; i++)
                ftile_rows(1, t, k, a + (size_t)i * k, y + (size_t)i * n + j0, n, cols,
                           accumulate);
        }
        free(t);
    }
    return failed ? -1 : 0;
}

/* The rows a GEMV (m == 1) prefetches while it reads group jb: group jb + PF_GROUPS's. */
static inline const char *prefetch(const uint8_t *w, size_t row_bytes, int jb, int nblk, int m) {
    return m == 1 && jb + PF_GROUPS < nblk ? (const char *)(w + (size_t)(jb + PF_GROUPS) * 4 * row_bytes)
                                           : NULL;
}

/* y[m, n] (+)= f(x)[m, k] @ W[n, k].T, arguments as qlib_kgemm's. Returns 0 or -1. */
int qlib_fgemm(int type, const uint8_t *w, int n, int k, const float *x, int m, float *y,
               const float *norm_w, float eps, int swiglu, int accumulate) {
    if (!qlib_float_type(type) || k % 16) return -1;
    const size_t row_bytes = row_bytes_of(type, k);
    float *a = malloc(sizeof(float) * (size_t)m * k);
    if (!a) return -1;
    for (int i = 0; i < m; i++)
        act_row(type, x + (size_t)i * k * (swiglu ? 2 : 1), k, norm_w, eps, swiglu,
                a + (size_t)i * k);
    if (m >= qlib_gemm_min_rows) { /* many rows: the tiled path */
        const int rc = fgemm_tiled(type, w, row_bytes, n, k, a, m, y, accumulate);
        free(a);
        return rc;
    }
    const int nblk = (n + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const int j = jb * 4, rows = n - j < 4 ? n - j : 4;
        group_rows(type, w + (size_t)j * row_bytes, row_bytes, rows, j, n, k, a, m,
                   prefetch(w, row_bytes, jb, nblk, m), y, accumulate);
    }
    free(a);
    return 0;
}

/* qlib_fgemm for one row inside decode.c's parallel region (as qlib_kgemv_region): each
 * thread makes the activation row in its scratch (at least k floats), the groups of 4 rows
 * are shared out statically; ends with the loop's barrier. shared: k floats (swiglu). */
void qlib_fgemv_region(int type, const uint8_t *w, int n, int k, const float *x, float *y,
                       const float *norm_w, float eps, int swiglu, int accumulate,
                       float *scratch, float *shared) {
    if (swiglu) {
        swiglu_shared(x, k, shared);
        x = shared;
    }
    act_row(type, x, k, norm_w, eps, 0, scratch);
    const size_t row_bytes = row_bytes_of(type, k);
    const int nblk = (n + 3) / 4;
#pragma omp for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const int j = jb * 4, rows = n - j < 4 ? n - j : 4;
        group_rows(type, w + (size_t)j * row_bytes, row_bytes, rows, j, n, k, scratch, 1,
                   prefetch(w, row_bytes, jb, nblk, 1), y, accumulate);
    }
}

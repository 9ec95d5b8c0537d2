/* What the K-quant harnesses share (included after kquants.c): the blocks' decode GEMV as the
 * engine runs it (kquants.c's 4-row krows, the rows QLIB_PF_GROUPS groups ahead prefetched),
 * 2 MB-aligned buffers (-DHUGE: advised to transparent huge pages, as the engine's weights),
 * a plain read of a buffer's bytes (the memory's rate beside the GEMVs), and the A/B of the
 * blocks against a panel layout (compare_and_time). */
#include <stdio.h>
#include <sys/mman.h>

static void gemv_blocks(int type, const uint8_t *w, int n, int k, const int8_t *aq,
                        const float *ad, const int16_t *abs_, float *y) {
    int16_t idx_tab[4][32];
    scale_index(type, idx_tab);
    __m512i idx[4];
    for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
    const size_t row_bytes = (size_t)(k / 256) * block_bytes(type);
    const int nblk = n / 4;
#pragma omp for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const uint8_t *wj = w + (size_t)jb * 4 * row_bytes;
        const char *pf = jb + QLIB_PF_GROUPS < nblk
                             ? (const char *)(wj + 4 * QLIB_PF_GROUPS * row_bytes) : NULL;
        dot_rows_k(4, type, wj, row_bytes, k, aq, ad, abs_, idx, pf, y + 4 * jb);
    }
}

static void *big(size_t bytes) {
    bytes = (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    void *p = aligned_alloc(2u << 20, bytes);
#ifdef HUGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    memset(p, 0, bytes);
    return p;
}

static void read_all(const uint8_t *p, size_t bytes, float *y) {
    __m512i acc = _mm512_setzero_si512();
    const size_t nv = bytes / 64;
#pragma omp for schedule(static)
    for (size_t i = 0; i < nv; i++) acc = _mm512_add_epi32(acc, _mm512_load_si512(p + 64 * i));
    y[omp_get_thread_num()] = (float)_mm512_reduce_add_epi32(acc);
}

/* A panel layout's GEMV, called by every thread of a parallel region (as gemv_blocks) */
typedef void (*panel_gemv)(const uint8_t *panels, int n, int k, const int8_t *aq,
                           const float *ad, const int16_t *abs_, float *y);

/* One random activation row of k quantized for type; the blocks' and the panels' outputs
 * compared; then 5 rounds of both GEMVs over the NM matrices w (blocks, wb bytes each) and
 * pw (panels, pb bytes each), alternating, min of 5 each, beside a plain read of the panels:
 * GB/s of the blocks' bytes (the same weights either way). */
static void compare_and_time(int type, panel_gemv gemv_panels, uint8_t **w, uint8_t **pw,
                             int NM, int n, int k, size_t wb, size_t pb) {
    const int nb = k / 256;
    float *x = malloc(4 * (size_t)k), *y1 = malloc(4 * (size_t)n), *y2 = malloc(4 * (size_t)n);
    for (int j = 0; j < k; j++) x[j] = (rand() % 2001 - 1000) / 500.f;
    int8_t *aq = aligned_alloc(64, k);
    float *ad = malloc(4 * (size_t)nb);
    int16_t *abs_ = aligned_alloc(64, 32 * (size_t)nb);
    quantize_row_q8k(x, k, type, aq, ad, abs_);
#pragma omp parallel
    {
        gemv_blocks(type, w[0], n, k, aq, ad, abs_, y1);
        gemv_panels(pw[0], n, k, aq, ad, abs_, y2);
    }
    double err = 0, mx = 0;
    for (int i = 0; i < n; i++) {
        const double e = fabs((double)y1[i] - y2[i]), a = fabs((double)y1[i]);
        err = e > err ? e : err, mx = a > mx ? a : mx;
    }
    printf("max |diff| panels %.3g (max |y| %.3g)\n", err, mx);
    const double bytes = (double)wb * NM;
    for (int round = 0; round < 5; round++) {
        double tA = 1e9, tB = 1e9, tR = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            const double t0 = omp_get_wtime();
#pragma omp parallel
            for (int i = 0; i < NM; i++) gemv_panels(pw[i], n, k, aq, ad, abs_, y2);
            const double t1 = omp_get_wtime();
#pragma omp parallel
            for (int i = 0; i < NM; i++) gemv_blocks(type, w[i], n, k, aq, ad, abs_, y1);
            const double t2 = omp_get_wtime();
#pragma omp parallel
            for (int i = 0; i < NM; i++) read_all(pw[i], pb, y1);
            const double t3 = omp_get_wtime();
            tB = t1 - t0 < tB ? t1 - t0 : tB, tA = t2 - t1 < tA ? t2 - t1 : tA;
            tR = t3 - t2 < tR ? t3 - t2 : tR;
        }
        printf("round %d: blocks %.1f GB/s (%.2f ms), panels %.1f GB/s of the blocks' bytes "
               "(%.2f ms), a plain read of the panels %.1f GB/s (%d matrices, %.0f MB)\n",
               round, bytes / tA / 1e9, tA * 1e3, bytes / tB / 1e9, tB * 1e3,
               (double)pb * NM / tR / 1e9, NM, bytes / 1e6);
    }
    free(x), free(y1), free(y2), free(aq), free(ad), free(abs_);
}

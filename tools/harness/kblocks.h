/* What the K-quant harnesses share (included after kquants.c): the blocks' decode GEMV as the
 * engine runs it (kquants.c's 4-row krows, the rows QLIB_PF_GROUPS groups ahead prefetched),
 * 2 MB-aligned buffers (-DHUGE: advised to transparent huge pages, as the engine's weights)
 * and a plain read of a buffer's bytes (the memory's rate beside the GEMVs). */
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

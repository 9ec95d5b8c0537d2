/* Harness (not part of the engine): the Q4_K decode GEMV over the GGUF blocks (kquants.c's
 * 4-row krows, included from the engine's source) against the same rows re-laid as 16-row
 * panels (the layout below, built into the engine on the local branch wip/q4k-panels and not
 * kept: docs/performance.md, "Q4_K as 16-row panels"): per super-block and 16 rows, 32 vectors
 * of 64 bytes whose low and high nibbles are 4 consecutive codes (act_order positions) of the
 * 16 rows (lane = weight row), so a sub-block of 16 rows is 8 vpdpbusd with broadcast
 * activation codes and one vpmulld by the rows' scales, instead of 16 x (scale decode,
 * 4 vpermw, 4 unpacks, 4 vpmaddubsw, 4 vpdpwssd). 1B-shape gate/up (8192 x 2048; the second
 * argument another row count), random blocks; outputs compared, then timed alternating over
 * NM matrices (16: 151 MB, from DRAM; 2: in the L3), beside a plain read of the panels' bytes.
 * QLIB_KP_PF: panels ahead that the panel GEMV prefetches (0: none); -DHUGE: madvise the
 * buffers to transparent huge pages.
 *
 *   gcc -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma -fopenmp \
 *       -Iqlib/quants/cpu -o /tmp/q4kp tools/harness/q4k_panels.c qlib/quants/cpu/kernels.c \
 *       qlib/quants/cpu/floats.c qlib/quants/cpu/prefill.c -lm
 *   OMP_NUM_THREADS=2 /tmp/q4kp 16
 */
#include "kquants.c"

#include <stdio.h>
#include <sys/mman.h>

/* -- 16-row panels of Q4_K (as built on wip/q4k-panels) -------------------------------------
 * Per 16 weight rows (a panel; the last one padded with zero rows) and super-block, KP_SB
 * bytes: 32 vectors of 64 bytes, vector 4q + i holding in its low nibbles the 4 codes of step
 * 8q + i (act_order positions 4s .. 4s + 3) and in its high nibbles those of step 8q + 4 + i,
 * byte 4l + c for row l (lane = weight row: the tiled GEMM's layout); the rows' 6-bit scales
 * per run q of 32 act_order codes (u8 [8][16]); their mins in natural pairs (u8 [4][16][2]);
 * d and dmin (f16 [16] each). A sub-block of 16 rows is then 8 vpdpbusd with broadcast
 * activation codes and one vpmulld by the rows' scales, where the blocks cost 16 scale
 * decodes, 64 vpermw, 64 vpmaddubsw and 64 vpdpwssd: about 2.3x the blocks' rate on data in
 * the caches. The integer sums are the blocks' (exact), per row
 * float(sumi) * (d_w d_a) - float(min sums) * (dmin_w d_a) per super-block in block order.
 * 2.8% more bytes than the blocks (decoded scales). */
enum { KP = 16, KP_SC = 2048, KP_MN = 2176, KP_D = 2304, KP_DM = 2336, KP_SB = 2368 };

static inline size_t kp_panels(int n) { return (size_t)(n + KP - 1) / KP; }

/* Bytes of the panels of an [n, k] Q4_K weight */
static size_t qlib_kpanel_bytes(int n, int k) { return kp_panels(n) * (size_t)(k / 256) * KP_SB; }

/* Rows j0 .. j0 + rows of a panel weight (panels, zeroed before the first call) from their
 * GGUF Q4_K blocks w (rows x k / 256 blocks). Returns 0, or -1 (type, k). */
static int qlib_kpanel_put(int type, const uint8_t *w, int rows, int k, uint8_t *panels, int j0) {
    if (type != QLIB_Q4_K || k % 256 || rows < 0 || j0 < 0) return -1;
    const int nb = k / 256, *order = act_order(type);
    int16_t idx_tab[4][32];
    scale_index(type, idx_tab);
    __m512i idx[4];
    for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
    for (int r = 0; r < rows; r++) {
        const int j = j0 + r, l = j % KP;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + ((size_t)r * nb + b) * 144;
            uint8_t *o = panels + ((size_t)(j / KP) * nb + b) * KP_SB;
            kunpacked u;
            kunpack(type, blk, idx, &u);
            _Alignas(64) uint8_t c[256];
            int16_t s16[16];
            for (int i = 0; i < 4; i++) _mm512_store_si512(c + 64 * i, u.v[i]);
            _mm256_storeu_si256((__m256i *)s16, u.sc16);
            for (int q = 0; q < 8; q++) o[KP_SC + 16 * q + l] = (uint8_t)s16[order[q]];
            for (int t = 0; t < 8; t++) o[KP_MN + 32 * (t / 2) + 2 * l + t % 2] = (uint8_t)s16[8 + t];
            memcpy(o + KP_D + 2 * l, blk, 2), memcpy(o + KP_DM + 2 * l, blk + 2, 2);
            for (int v = 0; v < 32; v++) /* v = 4q + i: steps 8q + i (low), 8q + 4 + i (high) */
                for (int cc = 0; cc < 4; cc++) {
                    const int s = 8 * (v / 4) + v % 4;
                    o[64 * v + 4 * l + cc] = (uint8_t)(c[4 * s + cc] | c[4 * (s + 4) + cc] << 4);
                }
        }
    }
    return 0;
}

#ifndef QLIB_KP_PF
#define QLIB_KP_PF 2
#endif
#ifndef QLIB_KP_AHEAD
#define QLIB_KP_AHEAD 0
#endif
#ifndef QLIB_KP_HINT
#define QLIB_KP_HINT _MM_HINT_T1
#endif

/* Dots of one panel (16 rows, nb super-blocks) with one Q8_K activation row (act_order
 * codes, d, the Q4_K sums of 32 in lanes 8..15 of each 16): y[0 .. 16). */
static inline __attribute__((always_inline)) void kpanel_dot(const uint8_t *pw, int nb,
                                                              const int8_t *aq, const float *ad,
                                                              const int16_t *abs_,
                                                              const char *pf, float *y) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *o = pw + (size_t)b * KP_SB;
#if QLIB_KP_AHEAD
        (void)pf;
        for (int off = 0; off < KP_SB; off += 64)
            _mm_prefetch((const char *)o + QLIB_KP_AHEAD + off, QLIB_KP_HINT);
#else
        if (pf)
            for (int off = 0; off < KP_SB; off += 64)
                _mm_prefetch(pf + (size_t)b * KP_SB + off, QLIB_KP_HINT);
#endif
        const int32_t *a32 = (const int32_t *)(aq + 256 * b);
        __m512i sumi = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) {
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                const __m512i z = _mm512_loadu_si512(o + 64 * (4 * q + i));
                lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(z, m4),
                                         _mm512_set1_epi32(a32[8 * q + i]));
                hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4),
                                         _mm512_set1_epi32(a32[8 * q + 4 + i]));
            }
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o + KP_SC + 16 * q)));
            sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), sc));
        }
        __m512i msum = _mm512_setzero_si512();
        const int32_t *bs32 = (const int32_t *)(abs_ + 16 * b + 8); /* pairs of sums of 32 */
        for (int p = 0; p < 4; p++)
            msum = _mm512_dpwssd_epi32(
                msum, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(o + KP_MN + 32 * p))),
                _mm512_set1_epi32(bs32[p]));
        const __m512 da = _mm512_set1_ps(ad[b]);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + KP_D)));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + KP_DM)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, da), acc);
        acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dm, da), acc);
    }
    _mm512_storeu_ps(y, acc);
}

/* y[j0 .. j0 + cols) (+)= panel p's dots with one activation row; prefetching panel
 * p + QLIB_KP_PF (of np) into L2 as it goes */
static inline void kpanel_rows(const uint8_t *pw, int p, int np, int nb, const int8_t *aq,
                               const float *ad, const int16_t *abs_, float *y, int cols,
                               int accumulate) {
    float out[KP];
    const size_t bytes = (size_t)nb * KP_SB;
    const char *pf = QLIB_KP_PF && p + QLIB_KP_PF < np ? (const char *)pw + (p + QLIB_KP_PF) * bytes
                                                       : NULL;
    kpanel_dot(pw + p * bytes, nb, aq, ad, abs_, pf, out);
    for (int r = 0; r < cols; r++) y[r] = accumulate ? y[r] + out[r] : out[r];
}

static void gemv_blocks(const uint8_t *w, int n, int k, const int8_t *aq, const float *ad,
                        const int16_t *abs_, float *y) {
    int16_t idx_tab[4][32];
    scale_index(QLIB_Q4_K, idx_tab);
    __m512i idx[4];
    for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
    const size_t row_bytes = (size_t)(k / 256) * 144;
    const int nblk = n / 4;
#pragma omp for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const uint8_t *wj = w + (size_t)jb * 4 * row_bytes;
        const char *pf = jb + QLIB_PF_GROUPS < nblk ? (const char *)(wj + 4 * QLIB_PF_GROUPS * row_bytes) : NULL;
        krows(4, QLIB_Q4_K, wj, row_bytes, k / 256, aq, ad, abs_, idx, pf, y + 4 * jb);
    }
}

static void gemv_panels(const uint8_t *pw, int n, int k, const int8_t *aq, const float *ad,
                        const int16_t *abs_, float *y) {
    const int nb = k / 256, np = (int)kp_panels(n);
#pragma omp for schedule(static)
    for (int p = 0; p < np; p++) kpanel_rows(pw, p, np, nb, aq, ad, abs_, y + KP * p, KP, 0);
}

static void *big(size_t bytes) { /* 2 MB aligned; HUGE: asks for transparent huge pages */
    bytes = (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    void *p = aligned_alloc(2u << 20, bytes);
#ifdef HUGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    memset(p, 0, bytes);
    return p;
}

static void read_all(const uint8_t *p, size_t bytes, float *y) { /* a plain read of the bytes */
    __m512i acc = _mm512_setzero_si512();
    const size_t nv = bytes / 64;
#pragma omp for schedule(static)
    for (size_t i = 0; i < nv; i++) acc = _mm512_add_epi32(acc, _mm512_load_si512(p + 64 * i));
    y[omp_get_thread_num()] = (float)_mm512_reduce_add_epi32(acc);
}

static double now(void) { return omp_get_wtime(); }

int main(int argc, char **argv) {
    const int n = argc > 2 ? atoi(argv[2]) : 8192, k = 2048, nb = k / 256, NM = argc > 1 ? atoi(argv[1]) : 16;
    const size_t wb = (size_t)n * nb * 144, pb = qlib_kpanel_bytes(n, k);
    uint8_t **w = malloc(NM * sizeof(void *)), **pw = malloc(NM * sizeof(void *));
    srand(1);
    for (int i = 0; i < NM; i++) {
        w[i] = big(wb), pw[i] = big(pb);
        for (size_t j = 0; j < wb; j++) w[i][j] = rand();
        for (size_t r = 0; r < (size_t)n * nb; r++) { /* sane d, dmin */
            uint16_t *h = (uint16_t *)(w[i] + r * 144);
            h[0] = 0x1800 + rand() % 0x400, h[1] = 0x1400 + rand() % 0x400;
        }
        qlib_kpanel_put(QLIB_Q4_K, w[i], n, k, pw[i], 0);
    }
    float *x = malloc(4 * k);
    for (int j = 0; j < k; j++) x[j] = (rand() % 2001 - 1000) / 500.f;
    int8_t *aq = aligned_alloc(64, k);
    float *ad = malloc(4 * nb);
    int16_t *abs_ = aligned_alloc(64, 32 * nb);
    quantize_row_q8k(x, k, QLIB_Q4_K, aq, ad, abs_);
    float *y1 = malloc(4 * n), *y2 = malloc(4 * n);
#pragma omp parallel
    {
        gemv_blocks(w[0], n, k, aq, ad, abs_, y1);
        gemv_panels(pw[0], n, k, aq, ad, abs_, y2);
    }
    double err = 0, mx = 0;
    for (int i = 0; i < n; i++) {
        double e = y1[i] - y2[i];
        if (e < 0) e = -e;
        if (e > err) err = e;
        if (y1[i] > mx) mx = y1[i];
    }
    printf("max |diff| panels %.3g (max %.3g)\n", err, mx);
    const double bytes = (double)wb * NM;
    for (int round = 0; round < 5; round++) {
        double tA = 1e9, tB = 1e9, tR = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = now();
#pragma omp parallel
            for (int i = 0; i < NM; i++) gemv_panels(pw[i], n, k, aq, ad, abs_, y2);
            double t1 = now();
#pragma omp parallel
            for (int i = 0; i < NM; i++) gemv_blocks(w[i], n, k, aq, ad, abs_, y1);
            double t2 = now();
            double t3 = now();
#pragma omp parallel
            for (int i = 0; i < NM; i++) read_all(pw[i], pb, y1);
            double t4 = now();
            if (t4 - t3 < tR) tR = t4 - t3;
            if (t2 - t1 < tA) tA = t2 - t1;
            if (t1 - t0 < tB) tB = t1 - t0;
        }
        printf("round %d: blocks %.1f GB/s (%.2f ms), panels %.1f GB/s of the blocks' bytes (%.2f ms), a plain read of the panels %.1f GB/s (%d matrices, %.0f MB)\n",
               round, bytes / tA / 1e9, tA * 1e3, bytes / tB / 1e9, tB * 1e3, (double)pb * NM / tR / 1e9, NM, bytes / 1e6);
    }
    return 0;
}

/* Harness (not part of the engine): the Q4_1 decode GEMV over qlib's planes (kernels.c's
 * 4-row dot_rows, included from the engine's source: 64 elements a step; and a variant tried
 * and not kept, 128 elements a step) against the same rows re-laid as 16-row panels, where one
 * 64-byte load holds 4 consecutive codes of 16 rows (the tiled prefill GEMM's layout: lane =
 * weight row), so a block of 16 rows is 8 vpdpbusd with broadcast activation codes, one float
 * conversion and one FMA with the 16 rows' scales, instead of 16 x (unpack, vpdpbusd,
 * convert, permute, FMA). SmolLM2's gate/up shape (3072 x 576), random codes and scales; the
 * outputs are compared, then timed alternating over NM matrices (64: ~71 MB, streamed from
 * DRAM; 8: ~9 MB, in the L3), on 2 MB and on 4 KB pages, beside a plain read of the same bytes.
 * PF: bytes ahead that the panel kernel prefetches (0: none).
 * docs/performance.md ("Where the decode GEMVs stand against their own compute") has figures.
 *
 *   gcc -O3 -march=native -fopenmp -DPF=2048 -Iqlib/quants/cpu -o /tmp/panel \
 *       tools/harness/panel_gemv.c -lm
 *   OMP_NUM_THREADS=2 /tmp/panel 64
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#ifndef PF
#define PF 0
#endif
static double now(void) { return omp_get_wtime(); }

#include "kernels.c" /* the engine's dot_rows (planes: codes [n][k/2], byte i of 64 elements
                       * e[i] | e[i + 32] << 4; d, m [n][G] f16) */

/* Tried, not kept: 4-bit rows 128 elements a step (one 64-byte load, two vpdpbusd; the
 * activations shuffled to match) */
static inline __attribute__((always_inline)) void dot_rows2(const int R, const uint8_t *codes, size_t row_bytes,
    const uint16_t *dw, const uint16_t *mw, int k, const int8_t *aq, const float *ad, const float *as,
    const char *pf, float *y) {
    const int G = k / 32;
    // acc of a chunk pair: lanes 0-7 block 2c (low nibbles, chunk c), 8-15 block 2c + 2 (chunk
    // c + 1); the high nibbles' acc: blocks 2c + 1, 2c + 3
    const __m512i base = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m512i base1 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 facc[4];
    for (int r = 0; r < R; r++) facc[r] = _mm512_setzero_ps();
    for (int c = 0; c < G; c += 16) {
        const int nb = G - c < 16 ? G - c : 16;
        const __mmask16 mask = (__mmask16)((1u << nb) - 1);
        const __m512 da = _mm512_maskz_loadu_ps(mask, ad + c);
        __m512 dd[4];
        for (int r = 0; r < R; r++) {
            dd[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dw + (size_t)r * G + c)), da);
            facc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mw + (size_t)r * G + c)),
                                      _mm512_maskz_loadu_ps(mask, as + c), facc[r]);
        }
        int p = 0;
        for (; p + 4 <= nb; p += 4) {  // 128 elements: blocks c+p .. c+p+3
            const int e = (c + p) * 32;
            if (pf) for (int r = 0; r < R; r++) _mm_prefetch(pf + r * row_bytes + e / 2, _MM_HINT_T1);
            const __m512i x0 = _mm512_loadu_si512(aq + e), x1 = _mm512_loadu_si512(aq + e + 64);
            const __m512i a1 = _mm512_shuffle_i64x2(x0, x1, 0x44);  // blocks 0, 2
            const __m512i a2 = _mm512_shuffle_i64x2(x0, x1, 0xEE);  // blocks 1, 3
            const __m512i i1 = _mm512_add_epi32(base, _mm512_set1_epi32(p));
            const __m512i i2 = _mm512_add_epi32(base, _mm512_set1_epi32(p + 1));
            for (int r = 0; r < R; r++) {
                const __m512i v = _mm512_loadu_si512(codes + (size_t)r * row_bytes + e / 2);
                const __m512i acc1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, m4), a1);
                const __m512i acc2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), a2);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc1), _mm512_permutexvar_ps(i1, dd[r]), facc[r]);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc2), _mm512_permutexvar_ps(i2, dd[r]), facc[r]);
            }
        }
        for (; p < nb; p += 2) {  // a last chunk of 64
            const int e = (c + p) * 32;
            const __m512i a = _mm512_loadu_si512(aq + e);
            const __m512i idx = _mm512_add_epi32(base1, _mm512_set1_epi32(p));
            for (int r = 0; r < R; r++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(codes + (size_t)r * row_bytes + e / 2));
                __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_permutexvar_ps(idx, dd[r]), facc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(facc[r]);
}

static void gemv_planes(const uint8_t *codes, const uint16_t *dw, const uint16_t *mw, int n, int k,
                        const int8_t *aq, const float *ad, const float *as, float *y, int step128) {
    const int G = k / 32, nblk = n / 4;
    const size_t rb = k / 2;
#pragma omp for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const int j = jb * 4;
        const char *pf = jb + 2 < nblk ? (const char *)(codes + (size_t)(j + 8) * rb) : NULL;
        if (step128)
            dot_rows2(4, codes + (size_t)j * rb, rb, dw + (size_t)j * G, mw + (size_t)j * G, k, aq, ad, as, pf, y + j);
        else
            dot_rows(4, QLIB_Q4_1, codes + (size_t)j * rb, rb, dw + (size_t)j * G, mw + (size_t)j * G, k, aq, ad,
                     as, NULL, pf, y + j);
    }
}

// ---- panel layout: per panel of 16 rows, per block b: 256 bytes codes (load j = 0..3: lane r
// bytes 4r..4r+3 = codes of elements 4j..4j+3 (low nibbles) and 4(j+4).. (high nibbles) of row r),
// then d [G][16] f16 and m [G][16] f16 per panel (separate planes).
static void to_panels(const uint8_t *codes, const uint16_t *dw, const uint16_t *mw, int n, int k,
                      uint8_t *pc, uint16_t *pd, uint16_t *pm) {
    const int G = k / 32;
    for (int p = 0; p < n / 16; p++)
        for (int b = 0; b < G; b++) {
            uint8_t *dst = pc + ((size_t)p * G + b) * 256;
            for (int j = 0; j < 4; j++)
                for (int r = 0; r < 16; r++)
                    for (int t = 0; t < 4; t++) {
                        const int row = 16 * p + r;
                        // element e of block b: current layout chunk of 64 = blocks (2c, 2c+1)
                        // byte i of chunk: e[i] (low) | e[i+32] (high); element within chunk
                        int e_lo = 4 * j + t, e_hi = 4 * (j + 4) + t; // within block
                        int chunk = b / 2, half = b % 2;                // block b = elements 32*half.. of chunk
                        int i_lo = 32 * half + e_lo, i_hi = 32 * half + e_hi; // element index within chunk
                        const uint8_t *cr = codes + (size_t)row * (k / 2) + 32 * chunk;
                        int c_lo = i_lo < 32 ? (cr[i_lo] & 15) : (cr[i_lo - 32] >> 4);
                        int c_hi = i_hi < 32 ? (cr[i_hi] & 15) : (cr[i_hi - 32] >> 4);
                        dst[64 * j + 4 * r + t] = (uint8_t)(c_lo | (c_hi << 4));
                    }
            for (int r = 0; r < 16; r++) {
                pd[((size_t)p * G + b) * 16 + r] = dw[(size_t)(16 * p + r) * G + b];
                pm[((size_t)p * G + b) * 16 + r] = mw[(size_t)(16 * p + r) * G + b];
            }
        }
}

static void gemv_panels(const uint8_t *pc, const uint16_t *pd, const uint16_t *pm, int n, int k,
                        const int8_t *aq, const float *ad, const float *as, float *y) {
    const int G = k / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#pragma omp for schedule(static)
    for (int p = 0; p < n / 16; p++) {
        __m512 facc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
        const uint8_t *c = pc + (size_t)p * G * 256;
        const uint16_t *d = pd + (size_t)p * G * 16, *m = pm + (size_t)p * G * 16;
        for (int b = 0; b < G; b++) {
            const int32_t *a4 = (const int32_t *)(aq + 32 * b);
            if (PF) for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)c + 256 * b + PF + o, _MM_HINT_T0);
            __m512i acc = _mm512_setzero_si512(), acc2 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(c + 256 * b + 64 * j);
                acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(v, m4), _mm512_set1_epi32(a4[j]));
                acc2 = _mm512_dpbusd_epi32(acc2, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_set1_epi32(a4[j + 4]));
            }
            acc = _mm512_add_epi32(acc, acc2);
            const __m512 dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * b)));
            const __m512 mwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 16 * b)));
            facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dwv, _mm512_set1_ps(ad[b])), facc);
            macc = _mm512_fmadd_ps(mwv, _mm512_set1_ps(as[b]), macc);
        }
        _mm512_storeu_ps(y + 16 * p, _mm512_add_ps(facc, macc));
    }
}

/* An arena for NM matrices, planes then panels, 2 MB-aligned: on 2 MB pages (huge) or held
 * to 4 KB pages. (Separate allocations of one matrix, ~1.1 MB each, are below a 2 MB page:
 * the harness measured 4 KB pages only until the twenty-eighth session.) */
typedef struct {
    uint8_t *codes[256], *pc[256];
    uint16_t *dw[256], *mw[256], *pd[256], *pm[256];
    char *base;
    size_t bytes;
} matrices;
static void make(matrices *s, int NM, int n, int k, int huge) {
    const size_t cb = (size_t)n * k / 2, pb = (size_t)n * (k / 32) * 2, al = 2u << 20;
    s->bytes = 2 * (cb + 2 * pb) * NM;
    char *p = mmap(NULL, s->bytes + al, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    s->base = p = (char *)(((uintptr_t)p + al - 1) & ~(uintptr_t)(al - 1));
    madvise(p, s->bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (int i = 0; i < NM; i++) {
        s->codes[i] = (uint8_t *)p; s->dw[i] = (uint16_t *)(p + cb); s->mw[i] = (uint16_t *)(p + cb + pb);
        p += cb + 2 * pb;
    }
    for (int i = 0; i < NM; i++) {
        s->pc[i] = (uint8_t *)p; s->pd[i] = (uint16_t *)(p + cb); s->pm[i] = (uint16_t *)(p + cb + pb);
        p += cb + 2 * pb;
    }
    for (int i = 0; i < NM; i++) {
        for (size_t j = 0; j < cb; j++) s->codes[i][j] = rand();
        for (size_t j = 0; j < pb / 2; j++) { s->dw[i][j] = 0x2000 + rand() % 0x400; s->mw[i][j] = 0xA000 + rand() % 0x400; }
        to_panels(s->codes[i], s->dw[i], s->mw[i], n, k, s->pc[i], s->pd[i], s->pm[i]);
    }
}

/* A plain read of [p, p + n): two 64-byte loads a step, the reference rate */
static __m512i read_range(const char *p, size_t n) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (size_t o = 0; o + 128 <= n; o += 128) {
        a = _mm512_add_epi32(a, _mm512_load_si512(p + o));
        b = _mm512_add_epi32(b, _mm512_load_si512(p + o + 64));
    }
    return _mm512_add_epi32(a, b);
}

int main(int argc, char **argv) {
    const int NM = argc > 1 ? atoi(argv[1]) : 64, n = argc > 2 ? atoi(argv[2]) : 3072,
              k = argc > 3 ? atoi(argv[3]) : 576, G = k / 32;
    const size_t cb = (size_t)n * k / 2, pb = (size_t)n * G;
    if (NM < 1 || NM > 256) return 1;
    static matrices S[2];
    srand(1);
    make(&S[0], NM, n, k, 0);
    make(&S[1], NM, n, k, 1);
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    for (char line[256]; f && fgets(line, sizeof line, f);)
        if (!strncmp(line, "AnonHugePages", 13)) fputs(line, stdout);
    if (f) fclose(f);
    int8_t *aq = aligned_alloc(64, k); float *ad = malloc(4 * G), *as = malloc(4 * G);
    for (int j = 0; j < k; j++) aq[j] = rand() % 255 - 127;
    for (int g = 0; g < G; g++) { ad[g] = 0.01f * (1 + g % 5); as[g] = 0.3f * (g % 7 - 3); }
    float *y1 = malloc(4 * n), *y2 = malloc(4 * n), *y3 = malloc(4 * n);
    matrices *s = &S[1];
#pragma omp parallel
    {
        gemv_planes(s->codes[0], s->dw[0], s->mw[0], n, k, aq, ad, as, y1, 0);
        gemv_panels(s->pc[0], s->pd[0], s->pm[0], n, k, aq, ad, as, y2);
        gemv_planes(s->codes[0], s->dw[0], s->mw[0], n, k, aq, ad, as, y3, 1);
    }
    double err = 0, err3 = 0, mx = 0;
    for (int i = 0; i < n; i++) {
        double e = y1[i] - y2[i], e3 = y1[i] - y3[i];
        if (e < 0) e = -e;
        if (e3 < 0) e3 = -e3;
        if (e > err) err = e;
        if (e3 > err3) err3 = e3;
        if (y1[i] > mx) mx = y1[i];
    }
    printf("max |diff| panels %.3g, 128-element steps %.3g (max %.3g)\n", err, err3, mx);
    const double bytes = (double)(cb + 2 * pb * 2) * NM;
    volatile int sink = 0;
    for (int round = 0; round < 5; round++)
        for (int h = 0; h < 2; h++) {
            s = &S[h];
            double t[4] = {1e9, 1e9, 1e9, 1e9};
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now();
#pragma omp parallel
                { /* the planes' bytes, split over the threads */
                    const int T = omp_get_num_threads();
                    const size_t part = (s->bytes / 2 / T) & ~(size_t)127;
                    if (_mm512_reduce_add_epi32(read_range(s->base + omp_get_thread_num() * part, part)) == 1)
                        sink++;
                }
                double t1 = now();
#pragma omp parallel
                for (int i = 0; i < NM; i++) gemv_planes(s->codes[i], s->dw[i], s->mw[i], n, k, aq, ad, as, y1, 0);
                double t2 = now();
#pragma omp parallel
                for (int i = 0; i < NM; i++) gemv_planes(s->codes[i], s->dw[i], s->mw[i], n, k, aq, ad, as, y3, 1);
                double t3 = now();
#pragma omp parallel
                for (int i = 0; i < NM; i++) gemv_panels(s->pc[i], s->pd[i], s->pm[i], n, k, aq, ad, as, y2);
                double t4 = now(), d[4] = {t1 - t0, t2 - t1, t3 - t2, t4 - t3};
                for (int j = 0; j < 4; j++) t[j] = d[j] < t[j] ? d[j] : t[j];
            }
            printf("round %d, %s pages: read %.1f GB/s; planes, 64 a step %.1f, 128 a step %.1f; panels %.1f "
                   "(%d matrices, %.0f MB)\n", round, h ? "2 MB" : "4 KB", bytes / t[0] / 1e9,
                   bytes / t[1] / 1e9, bytes / t[2] / 1e9, bytes / t[3] / 1e9, NM, bytes / 1e6);
        }
    return 0;
}

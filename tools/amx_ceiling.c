/* What the AMX unit does on this CPU, against the prefill's GEMM (docs/performance.md,
 * "The AMX GEMM's ceiling"). One thread; times are the min of 10 runs.
 *
 *   gcc -O2 -march=sapphirerapids -fopenmp -Iqlib/quants/cpu tools/amx_ceiling.c \
 *       -o /tmp/amx_ceiling -lm && /tmp/amx_ceiling
 *
 * 1. peak: four tdpbf16ps a step on tiles loaded every step (one A and one B tile of 1 KB,
 *    each into two registers), the tiles cycling through 1 KB (L1), 256 KB (L2) and 4 MB.
 * 2. the GEMM's loop alone (prefill.c's amx_gemm without expansion or epilogue): 224 rows,
 *    K = 576, 96 blocks of 32 columns, 30 times; B tiles streaming (a block's own) or one
 *    block's reused, with or without the C tile stores, A as rows (1,152 bytes apart) or as
 *    contiguous 1 KB tiles.
 * 3. amx_expand_tile (prefill.c's, included) alone: w13's 3,456 tiles x 30 of Q4 and Q8
 *    codes, 30 distinct weights. */
#include "prefill.c"

#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void peak(size_t bytes) {
    const long n = 2000000;
    const size_t nt = bytes / 1024;
    uint16_t *A = aligned_alloc(64, bytes), *B = aligned_alloc(64, bytes);
    memset(A, 0, bytes), memset(B, 0, bytes);
    double best = 1e9;
    for (int rep = 0; rep < 10; rep++) {
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        const double t0 = now();
        for (long i = 0; i < n; i++) {
            const size_t o = (size_t)(i % nt) * 512;
            _tile_loadd(0, A + o, 64); _tile_loadd(1, A + o, 64);
            _tile_loadd(2, B + o, 64); _tile_loadd(3, B + o, 64);
            _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2); _tile_dpbf16ps(7, 1, 3);
        }
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    printf("peak, tiles through %7zu bytes: %5.2f TFLOP/s (%.1f ns per four products)\n", bytes,
           n * 4 * 16384.0 / best / 1e12, best / n * 1e9);
    free(A), free(B);
}

static void loop(int stream_b, int stores, int a_tiles) {
    const int K = 576, NB = 96, nkc = K / 32, M = 224;
    uint16_t *A = aligned_alloc(64, (size_t)M * K * 2);
    uint16_t *B = aligned_alloc(64, (size_t)NB * 2 * nkc * 1024);
    memset(A, 0, (size_t)M * K * 2), memset(B, 0, (size_t)NB * 2 * nkc * 1024);
    float cbuf[4][256] __attribute__((aligned(64)));
    double best = 1e9;
    for (int rep = 0; rep < 10; rep++) {
        const double t0 = now();
        for (int l = 0; l < 30; l++)
            for (int nb = 0; nb < NB; nb++) {
                const uint16_t *b0 = B + (size_t)(stream_b ? nb : 0) * 2 * nkc * 512;
                const uint16_t *b1 = b0 + (size_t)nkc * 512;
                for (int mb = 0; mb < M; mb += 32) {
                    const uint16_t *a0 = A + (size_t)mb * K, *a1 = a0 + (size_t)16 * K;
                    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                    for (int kc = 0; kc < nkc; kc++) {
                        if (a_tiles) {
                            _tile_loadd(0, a0 + 512 * kc, 64);
                            _tile_loadd(1, a1 + 512 * kc, 64);
                        } else {
                            _tile_loadd(0, a0 + 32 * kc, K * 2);
                            _tile_loadd(1, a1 + 32 * kc, K * 2);
                        }
                        _tile_loadd(2, b0 + (size_t)kc * 512, 64);
                        _tile_loadd(3, b1 + (size_t)kc * 512, 64);
                        _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(6, 1, 2); _tile_dpbf16ps(7, 1, 3);
                    }
                    if (stores) {
                        _tile_stored(4, cbuf[0], 64);
                        _tile_stored(5, cbuf[1], 64);
                        _tile_stored(6, cbuf[2], 64);
                        _tile_stored(7, cbuf[3], 64);
                    }
                }
            }
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    printf("GEMM loop, B %-9s C stores %-3s A as %-5s: %6.2f ms, %.2f TFLOP/s\n",
           stream_b ? "streaming" : "reused", stores ? "on" : "off", a_tiles ? "tiles" : "rows",
           best * 1e3, 2.0 * M * K * NB * 32 * 30 / best / 1e12);
    free(A), free(B);
}

static void expand(int kind) {
    const int K = 576, N = 3072, nkc = K / 32;
    const size_t ntiles = (size_t)(N / 16) * nkc;
    amx_weight w[30];
    for (int l = 0; l < 30; l++) {
        uint8_t *t = aligned_alloc(64, ntiles * 512);
        float *d = aligned_alloc(64, ntiles * 32 * 4), *m = aligned_alloc(64, ntiles * 32 * 4);
        for (size_t i = 0; i < ntiles * 512; i++) t[i] = (uint8_t)rand();
        for (size_t i = 0; i < ntiles * 32; i++) d[i] = 0.01f, m[i] = -0.08f;
        w[l] = (amx_weight){kind, t, d, m};
    }
    uint16_t *buf = aligned_alloc(64, (size_t)2 * nkc * 1024);
    double best = 1e9;
    for (int rep = 0; rep < 10; rep++) {
        const double t0 = now();
        for (int l = 0; l < 30; l++)
            for (int j = 0; j < N / 16; j++)
                for (int c = 0; c < nkc; c++)
                    amx_expand_tile(&w[l], j, c, nkc, buf + (size_t)((j & 1) * nkc + c) * 512);
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    printf("expansion of %s codes, %zu tiles x 30: %.2f ms, %.1f ns a tile\n",
           kind == AMXW_Q4 ? "Q4" : "Q8", ntiles, best * 1e3, best / 30 / ntiles * 1e9);
    for (int l = 0; l < 30; l++) free((void *)w[l].t), free((void *)w[l].d), free((void *)w[l].m);
    free(buf);
}

int main(void) {
    if (qlib_amx_init()) {
        fprintf(stderr, "amx_ceiling: no AMX tile state (this CPU or kernel has no AMX)\n");
        return 1;
    }
    amx_tiles_16x64();
    peak(1024), peak(256 * 1024), peak(4 * 1024 * 1024);
    for (int variant = 0; variant < 8; variant++)
        loop(!(variant & 1), !(variant & 2), variant >> 2 & 1);
    expand(AMXW_Q4), expand(AMXW_Q8);
    _tile_release();
    return 0;
}

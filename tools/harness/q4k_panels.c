/* Harness (not part of the engine): the Q4_K decode GEMV over the GGUF blocks (kquants.c's
 * 4-row krows, prefetched 2 groups ahead) against the same rows as 16-row panels (kquants.c's
 * qlib_kpanel_put / kpanel_rows, the fast engine's layout since the thirtieth session:
 * docs/performance.md, "Q4_K as 16-row panels, without the prefetch"), both from the engine's
 * source. 1B-shape gate/up (8192 x 2048; the second argument another row count, the fourth
 * another row length: 2048 8192 is ffn_down's), random blocks; outputs compared, then timed
 * alternating over NM matrices (16: 151 MB, from DRAM; 1-2: in the caches), beside a plain
 * read of the panels' bytes. The third argument: bytes ahead that the panels' GEMV prefetches
 * (qlib_kpanel_set_prefetch; 0, the engine's default: none); the fifth: 0 turns off the
 * activation row's prefetch (qlib_gemv_set_act_prefetch; 1, the default). -DHUGE: madvise the
 * buffers to transparent huge pages (as the engine's weights).
 *
 *   gcc -DHUGE -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma -fopenmp \
 *       -Iqlib/quants/cpu -o /tmp/q4kp tools/harness/q4k_panels.c qlib/quants/cpu/kernels.c \
 *       qlib/quants/cpu/floats.c qlib/quants/cpu/prefill.c -lm
 *   OMP_NUM_THREADS=2 /tmp/q4kp 16 [8192 [prefetch bytes [2048 [1]]]]
 */
#include "kquants.c"

#include <stdio.h>

#include "kblocks.h"

void qlib_gemv_set_act_prefetch(int on); /* kernels.c */


static void gemv_panels(const uint8_t *pw, int n, int k, const int8_t *aq, const float *ad,
                        const int16_t *abs_, float *y) {
#pragma omp for schedule(static)
    for (int p = 0; p < n / KP; p++) kpanel_rows(QLIB_Q4_K, pw, p, n, k, aq, ad, abs_, 1, y, 0);
}



int main(int argc, char **argv) {
    const int n = argc > 2 ? atoi(argv[2]) : 8192, k = argc > 4 ? atoi(argv[4]) : 2048;
    const int nb = k / 256, NM = argc > 1 ? atoi(argv[1]) : 16;
    qlib_kpanel_set_prefetch(argc > 3 ? atoi(argv[3]) : 0);
    qlib_gemv_set_act_prefetch(argc > 5 ? atoi(argv[5]) : 1);
    const size_t wb = (size_t)n * nb * 144, pb = qlib_kpanel_bytes(QLIB_Q4_K, n, k);
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
    compare_and_time(QLIB_Q4_K, gemv_panels, w, pw, NM, n, k, wb, pb);
    return 0;
}

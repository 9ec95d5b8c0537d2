/* Harness (not part of the engine): the Q6_K decode GEMV over the GGUF blocks (kquants.c's
 * 4-row krows, prefetched 2 groups ahead) against the same rows re-laid as 16-row panels
 * (the layout below, not in the engine): per 16 rows and super-block 3,360 bytes, as many as
 * the blocks: 32 vectors whose low and high nibbles are the low 4 bits of 4 consecutive codes
 * of 16 rows (lane = weight row; steps 8q + i and 8q + 4 + i, as the Q4_K panels), 16 vectors
 * whose byte 4l + c holds in bits 2j, 2j + 1 the high 2 bits of code c of row l at step
 * 4h + j, the rows' int8 scales per sub-block of 16 (int8 [16][16]) and their d (f16 [16]).
 * A sub-block of 16 rows is then 4 vpdpbusd (each code: a mask, a shift of the high bits,
 * one vpternlogd), one vpmulld by the rows' scales, the -32 offset as the accumulator's start
 * (-32 x the activations' sum of 16): the blocks' exact integer sums, per row
 * float(sumi) * (d_w d_a) per super-block. Outputs compared, then timed alternating over NM
 * 1B-shape down matrices (2048 x 8192; 16: 226 MB from DRAM; 1: in the caches), beside a
 * plain read of the panels' bytes.
 *
 *   gcc -DHUGE -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma -fopenmp \
 *       -Iqlib/quants/cpu -o /tmp/q6kp tools/harness/q6k_panels.c qlib/quants/cpu/kernels.c \
 *       qlib/quants/cpu/floats.c qlib/quants/cpu/prefill.c -lm
 *   OMP_NUM_THREADS=2 /tmp/q6kp 16 [2048]
 */
#include "kquants.c"

#include <stdio.h>

#include "kblocks.h"

enum { P6_HI = 2048, P6_SC = 3072, P6_D = 3328, P6_SB = 3360 };

/* Rows 0 .. n of GGUF Q6_K blocks w (n % 16 == 0) into panels */
static void p6_put(const uint8_t *w, int n, int k, uint8_t *panels) {
    const int nb = k / 256;
    int16_t idx_tab[4][32];
    scale_index(QLIB_Q6_K, idx_tab);
    __m512i idx[4];
    for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
    memset(panels, 0, (size_t)(n / 16) * nb * P6_SB);
    for (int j = 0; j < n; j++) {
        const int l = j % 16;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + ((size_t)j * nb + b) * 210;
            uint8_t *o = panels + ((size_t)(j / 16) * nb + b) * P6_SB;
            kunpacked u;
            kunpack(QLIB_Q6_K, blk, idx, &u);
            _Alignas(64) uint8_t c[256];
            int16_t s16[16];
            for (int i = 0; i < 4; i++) _mm512_store_si512(c + 64 * i, u.v[i]);
            _mm256_storeu_si256((__m256i *)s16, u.sc16);
            for (int t = 0; t < 16; t++) o[P6_SC + 16 * t + l] = (uint8_t)(int8_t)s16[t];
            memcpy(o + P6_D + 2 * l, blk + 208, 2);
            for (int v = 0; v < 32; v++) /* v = 4q + i: steps 8q + i (low), 8q + 4 + i (high) */
                for (int cc = 0; cc < 4; cc++) {
                    const int st = 8 * (v / 4) + v % 4;
                    o[64 * v + 4 * l + cc] =
                        (uint8_t)((c[4 * st + cc] & 15) | (c[4 * (st + 4) + cc] & 15) << 4);
                }
            for (int st = 0; st < 64; st++) /* high 2 bits of step st: vector st / 4, bits 2 (st % 4) */
                for (int cc = 0; cc < 4; cc++)
                    o[P6_HI + 64 * (st / 4) + 4 * l + cc] |= (uint8_t)((c[4 * st + cc] >> 4) << (2 * (st % 4)));
        }
    }
}

/* bits 2j, 2j + 1 of each byte of h moved to bits 4, 5 (other bits: garbage, masked later) */
static inline __m512i hi_bits(__m512i h, int j) {
    return j == 0 ? _mm512_slli_epi16(h, 4) : j == 1 ? _mm512_slli_epi16(h, 2)
         : j == 2 ? h : _mm512_srli_epi16(h, 2);
}

static inline __m512 p6_dot(const uint8_t *o, int nb, const int8_t *aq, const float *ad,
                            const int16_t *abs_) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m45 = _mm512_set1_epi8(0x30);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, o += P6_SB) {
        const int32_t *a32 = (const int32_t *)(aq + 256 * b);
        const int16_t *bs = abs_ + 16 * b; /* sums of each 16 activation codes */
        __m512i sumi = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) {
            const __m512i H0 = _mm512_loadu_si512(o + P6_HI + 64 * (2 * q));
            const __m512i H1 = _mm512_loadu_si512(o + P6_HI + 64 * (2 * q + 1));
            __m512i lo = _mm512_set1_epi32(-32 * bs[2 * q]), hi = _mm512_set1_epi32(-32 * bs[2 * q + 1]);
            for (int i = 0; i < 4; i++) {
                const __m512i z = _mm512_loadu_si512(o + 64 * (4 * q + i));
                const __m512i cl = _mm512_ternarylogic_epi32(_mm512_and_si512(z, m4), hi_bits(H0, i), m45, 0xF8);
                const __m512i ch = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(z, 4), m4),
                                                             hi_bits(H1, i), m45, 0xF8);
                lo = _mm512_dpbusd_epi32(lo, cl, _mm512_set1_epi32(a32[8 * q + i]));
                hi = _mm512_dpbusd_epi32(hi, ch, _mm512_set1_epi32(a32[8 * q + 4 + i]));
            }
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + P6_SC + 16 * (2 * q))));
            const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + P6_SC + 16 * (2 * q + 1))));
            sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(_mm512_mullo_epi32(lo, s0), _mm512_mullo_epi32(hi, s1)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + P6_D)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, _mm512_set1_ps(ad[b])), acc);
    }
    return acc;
}


static void gemv_panels(const uint8_t *pw, int n, int k, const int8_t *aq, const float *ad,
                        const int16_t *abs_, float *y) {
    const int nb = k / 256;
#pragma omp for schedule(static)
    for (int p = 0; p < n / 16; p++)
        _mm512_storeu_ps(y + 16 * p, p6_dot(pw + (size_t)p * nb * P6_SB, nb, aq, ad, abs_));
}



int main(int argc, char **argv) {
    const int NM = argc > 1 ? atoi(argv[1]) : 16, n = argc > 2 ? atoi(argv[2]) : 2048, k = 8192;
    const int nb = k / 256;
    const size_t wb = (size_t)n * nb * 210, pb = (size_t)(n / 16) * nb * P6_SB;
    uint8_t **w = malloc(NM * sizeof(void *)), **pw = malloc(NM * sizeof(void *));
    srand(1);
    for (int i = 0; i < NM; i++) {
        w[i] = big(wb), pw[i] = big(pb);
        for (size_t j = 0; j < wb; j++) w[i][j] = rand();
        for (size_t r = 0; r < (size_t)n * nb; r++) { /* sane d */
            uint16_t *h = (uint16_t *)(w[i] + r * 210 + 208);
            h[0] = 0x1800 + rand() % 0x400;
        }
        p6_put(w[i], n, k, pw[i]);
    }
    compare_and_time(QLIB_Q6_K, gemv_panels, w, pw, NM, n, k, wb, pb);
    return 0;
}

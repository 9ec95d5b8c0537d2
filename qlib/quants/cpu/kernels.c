/* qlib CPU kernels: y = x @ W.T for Q4_0 / Q4_1 / Q8_0 weights with ggml semantics.
 *
 * Every activation row is quantized as ggml's x86 backend does (Q8_0 for Q4_0 and
 * Q8_0 weights, Q8_1 for Q4_1; blocks of 32, d = amax / 127 stored as f16, codes
 * rounded half to even with the multiplier 127 / amax). Each block of 32 gives an
 * exact integer dot (AVX-512 VNNI vpdpbusd: unsigned weight bytes x signed
 * activation bytes), scaled in float32 by d_w * d_a; Q4_1 adds m_w * s_a per block.
 *
 * Weights are repacked by qlib.quants.cpu.packing into per-row planes:
 *   codes  Q4_*: k/2 bytes, per 64 elements 32 bytes, byte i = e[i] | e[i+32] << 4
 *                (codes 0..15, as stored by ggml before the -8 of Q4_0);
 *          Q8_0: k bytes, code + 128 (unsigned);
 *   d      f16 bits, k/32 per row;  m: f16 bits, k/32 per row (Q4_1 only).
 * The unsigned offset (8 or 128) is removed exactly by starting each block's
 * integer accumulator at -offset * (sum of 4 activation codes) per lane.
 * Rows are split over OpenMP threads; each output element is computed by one
 * thread in a fixed order, so a row's result never depends on the other rows.
 * Requires k % 64 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

enum { QLIB_Q4_0 = 2, QLIB_Q4_1 = 3, QLIB_Q5_0 = 6, QLIB_Q8_0 = 8 }; /* Q5_0: repack only */

/* Dots of R consecutive repacked weight rows with one quantized activation row
 * (R is a compile-time constant at each call: the loops unroll, the R chains overlap). */
static inline __attribute__((always_inline)) void dot_rows(
    const int R, int type, const uint8_t *codes, size_t row_bytes, const uint16_t *dw,
    const uint16_t *mw, int k, const int8_t *aq, const float *ad, const float *as,
    const int32_t *corr, float *y) {
    const int G = k / 32;
    const __m512i base = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m512 facc[4];
    for (int r = 0; r < R; r++) facc[r] = _mm512_setzero_ps();
    for (int c = 0; c < G; c += 16) {
        const int nb = G - c < 16 ? G - c : 16;
        const __mmask16 mask = (__mmask16)((1u << nb) - 1);
        const __m512 da = _mm512_maskz_loadu_ps(mask, ad + c);
        __m512 dd[4];
        for (int r = 0; r < R; r++) {
            dd[r] = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dw + (size_t)r * G + c)), da);
            if (type == QLIB_Q4_1) /* the offset term, sum over blocks of m_w * s_a */
                facc[r] = _mm512_fmadd_ps(
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mw + (size_t)r * G + c)),
                    _mm512_maskz_loadu_ps(mask, as + c), facc[r]);
        }
        for (int p = 0; p < nb; p += 2) {
            const int e = (c + p) * 32; /* first element of this pair of blocks */
            const __m512i a = _mm512_loadu_si512(aq + e);
            const __m512i init = type == QLIB_Q4_1 ? _mm512_setzero_si512()
                                                   : _mm512_loadu_si512(corr + e / 4);
            const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(p));
            for (int r = 0; r < R; r++) {
                const uint8_t *cr = codes + (size_t)r * row_bytes;
                __m512i w;
                if (type == QLIB_Q8_0) {
                    w = _mm512_loadu_si512(cr + e);
                } else {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(cr + e / 2));
                    __m256i lo = _mm256_and_si256(v, low4);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                }
                __m512i acc = _mm512_dpbusd_epi32(init, w, a);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),
                                          _mm512_permutexvar_ps(idx, dd[r]), facc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(facc[r]);
}

/* y[m, n] (+)= f(x)[m, k] @ W[n, k].T, where f is RmsNorm with weight norm_w (when not
 * NULL) or, with swiglu, silu(x[:, :k]) * x[:, k:] (x rows then hold 2k floats);
 * accumulate adds into y (a residual). Returns 0, or -1 (k % 64 != 0, out of memory). */
int qlib_qgemm_ex(int type, const uint8_t *codes, const uint16_t *dw, const uint16_t *mw,
                  int n, int k, const float *x, int m, float *y, const float *norm_w,
                  float eps, int swiglu, int accumulate) {
    if (k % 64 || (type != QLIB_Q4_0 && type != QLIB_Q4_1 && type != QLIB_Q8_0)) return -1;
    const int G = k / 32;
    const size_t row_bytes = type == QLIB_Q8_0 ? (size_t)k : (size_t)k / 2;
    int8_t *aq = malloc((size_t)m * k);
    float *ad = malloc(sizeof(float) * (size_t)m * G);
    float *as = malloc(sizeof(float) * (size_t)m * G);
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)m * (k / 4));
    float *row = malloc(sizeof(float) * (size_t)k);
    if (!aq || !ad || !as || !corr || !row) {
        free(aq), free(ad), free(as), free(corr), free(row);
        return -1;
    }
    const int offset = type == QLIB_Q8_0 ? 128 : type == QLIB_Q4_0 ? 8 : 0;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int i = 0; i < m; i++) {
        int8_t *q = aq + (size_t)i * k;
        input_row(x + (size_t)i * k * (swiglu ? 2 : 1), k, norm_w, eps, swiglu, row);
        quantize_row_q8(row, k, q, ad + (size_t)i * G,
                        type == QLIB_Q4_1 ? as + (size_t)i * G : NULL);
        for (int e = 0; e < k; e += 64) { /* -offset * (sum of each 4 codes) */
            __m512i lane = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                               _mm512_loadu_si512(q + e));
            _mm512_storeu_si512(corr + (size_t)i * (k / 4) + e / 4,
                                _mm512_mullo_epi32(lane, _mm512_set1_epi32(-offset)));
        }
    }
    const int nblk = (n + 3) / 4; /* groups of 4 weight rows */
#pragma omp parallel for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const int j = jb * 4, rows = n - j < 4 ? n - j : 4;
        const uint8_t *cj = codes + (size_t)j * row_bytes;
        const uint16_t *dj = dw + (size_t)j * G;
        const uint16_t *mj = mw ? mw + (size_t)j * G : NULL;
        if (jb + 2 < nblk) { /* codes two groups ahead into L2 (rows are short: 288 bytes for
                              * Q4_1 at k = 576; the hardware prefetcher alone left decode
                              * ~17% slower) */
            const char *ahead = (const char *)(cj + 8 * row_bytes);
            for (size_t off = 0; off < 4 * row_bytes; off += 64)
                _mm_prefetch(ahead + off, _MM_HINT_T1);
        }
        for (int i = 0; i < m; i++) {
            float out[4];
            const int8_t *qi = aq + (size_t)i * k;
            const float *di = ad + (size_t)i * G, *si = as + (size_t)i * G;
            const int32_t *ci = corr + (size_t)i * (k / 4);
            if (rows == 4)
                dot_rows(4, type, cj, row_bytes, dj, mj, k, qi, di, si, ci, out);
            else
                for (int r = 0; r < rows; r++)
                    dot_rows(1, type, cj + r * row_bytes, row_bytes, dj + (size_t)r * G,
                             mj ? mj + (size_t)r * G : NULL, k, qi, di, si, ci, out + r);
            float *yi = y + (size_t)i * n + j;
            for (int r = 0; r < rows; r++) yi[r] = accumulate ? yi[r] + out[r] : out[r];
        }
    }
    free(aq), free(ad), free(as), free(corr), free(row);
    return 0;
}

/* The decode attention step (qlib_attn_decode, qlib_attn_decode_kv) is in attn.c. */

/* GGUF blocks [n, k/32 blocks] -> the planes above (codes, d, m). */
void qlib_repack(int type, const uint8_t *blocks, int n, int k, uint8_t *codes, uint16_t *d,
                 uint16_t *m) {
    const int G = k / 32;
    const int bsize = type == QLIB_Q8_0 ? 34 : type == QLIB_Q5_0 ? 22 : type == QLIB_Q4_1 ? 20 : 18;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < n; j++) {
        for (int b = 0; b < G; b++) {
            const uint8_t *blk = blocks + ((size_t)j * G + b) * bsize;
            memcpy(d + (size_t)j * G + b, blk, 2);
            if (type == QLIB_Q8_0) {
                for (int i = 0; i < 32; i++) codes[(size_t)j * k + b * 32 + i] = blk[2 + i] ^ 0x80;
                continue;
            }
            if (type == QLIB_Q5_0) { /* into Q8_0 planes: code (q - 16) + 128, the same d */
                uint32_t qh;
                memcpy(&qh, blk + 2, 4);
                uint8_t *out = codes + (size_t)j * k + b * 32;
                for (int i = 0; i < 16; i++) {
                    const int lo = (blk[6 + i] & 0x0F) | (int)((qh >> i) & 1) << 4;
                    const int hi = (blk[6 + i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
                    out[i] = (uint8_t)(lo + 112);
                    out[i + 16] = (uint8_t)(hi + 112);
                }
                continue;
            }
            if (type == QLIB_Q4_1) memcpy(m + (size_t)j * G + b, blk + 2, 2);
            const uint8_t *qs = blk + (type == QLIB_Q4_1 ? 4 : 2);
            uint8_t *out = codes + (size_t)j * (k / 2) + (b / 2) * 32;
            const int shift = (b % 2) * 4; /* even block: low nibbles, odd block: high */
            for (int i = 0; i < 16; i++) {
                out[i] = (uint8_t)((out[i] & ~(0x0F << shift)) | ((qs[i] & 0x0F) << shift));
                out[i + 16] = (uint8_t)((out[i + 16] & ~(0x0F << shift)) | ((qs[i] >> 4) << shift));
            }
        }
    }
}

/* The planes -> bfloat16 bits [n, k]: ggml's dequantized float, rounded to nearest even. */
void qlib_dequant_bf16(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                       int n, int k, uint16_t *out) {
    const int G = k / 32;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < n; j++) {
        for (int b = 0; b < G; b++) {
            const float dd = _cvtsh_ss(d[(size_t)j * G + b]);
            const float mm = type == QLIB_Q4_1 ? _cvtsh_ss(m[(size_t)j * G + b]) : 0.0f;
            for (int i = 0; i < 32; i++) {
                int q;
                if (type == QLIB_Q8_0) {
                    q = (int)codes[(size_t)j * k + b * 32 + i] - 128;
                } else {
                    uint8_t byte = codes[(size_t)j * (k / 2) + (b / 2) * 32 + i];
                    q = (b % 2 ? byte >> 4 : byte & 0x0F) - (type == QLIB_Q4_0 ? 8 : 0);
                }
                float v = type == QLIB_Q4_1 ? dd * (float)q + mm : dd * (float)q;
                uint32_t u;
                memcpy(&u, &v, 4);
                out[(size_t)j * k + b * 32 + i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
            }
        }
    }
}

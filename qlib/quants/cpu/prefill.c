/* qlib CPU prefill kernels.
 *
 * With AMX-BF16 (built with -mamx-tile -mamx-bf16, see the second half), FastModel's bf16
 * prefill is one call for all the layers, qlib_prefill_layers: our AMX GEMM with fused
 * epilogues, RmsNorm, RoPE + KV write + AMX attention. Without AMX it runs its matmuls in
 * oneDNN on bfloat16 activations and everything between them is here, one call each, parallel over
 * OpenMP threads (torch's pool: the library shares torch's libgomp):
 *   qlib_add_rmsnorm   h += delta (bf16, the previous matmul's output), then RmsNorm(h) * w
 *                      -> bf16 (the next matmul's input) or float32;
 *   qlib_swiglu_bf16   silu(gate) * up -> bf16, from the fused gate/up matmul's output;
 *   qlib_attn_prefill  RoPE of q and k, k and v into the float32 KV cache, causal GQA
 *                      attention over the cache (positions 0..pos+i for row i) -> bf16.
 * Arithmetic is float32; bf16 is only the storage of matmul inputs and outputs
 * (conversions round to nearest even, as torch's). Requires k % 16 == 0, d % 16 == 0,
 * d <= 128.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#ifdef __AVX512BF16__
/* bf16x16_store by the CPU's own conversion (nearest even; a float32 denormal, which these
 * kernels never make, goes to zero): two instructions where the integer rounding takes
 * seven. For the AMX code only: a CPU with AMX has AVX512-BF16. On this VM's cores the AMX
 * products and dense AVX-512 work do not overlap (docs/performance.md), so every vector
 * instruction saved beside the GEMMs shows. */
static inline void bf16n_store(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

/* Test hook: y[i] = e^x[i] (n % 16 == 0). */
void qlib_exp(const float *x, int n, float *y) {
    for (int i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
}

/* Test hook: y[i] = e^(s[i] - m) by the int8 attention's exp16_diff (s[i] <= m, n % 16 == 0). */
void qlib_exp_diff(const float *s, int n, float m, float *y) {
    const __m512 ml = _mm512_set1_ps(m * 1.44269504f);
    for (int i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, exp16_diff(_mm512_loadu_ps(s + i), ml));
}

/* Row x of k floats: x += delta (bf16, when not NULL); out = x / sqrt(mean(x^2) + eps) * w,
 * as bf16 (out_bf16; 2: by bf16n_store, AMX code only) or float32; element e of out at
 * (e / 32) cs + e % 32 (cs = 32: a row; 512: a row of AMX A tiles, a_tile_at). */
static inline void add_rmsnorm_row(float *x, const uint16_t *delta, int k, const float *w,
                                   float eps, void *out, int out_bf16, int cs) {
    __m512 ss = _mm512_setzero_ps();
    for (int e = 0; e < k; e += 16) {
        __m512 v = _mm512_loadu_ps(x + e);
        if (delta) {
            v = _mm512_add_ps(v, bf16x16_load(delta + e));
            _mm512_storeu_ps(x + e, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)k + eps));
    for (int e = 0; e < k; e += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + e), r), _mm512_loadu_ps(w + e));
        const size_t at = (size_t)(e >> 5) * cs + (e & 31);
#ifdef __AVX512BF16__
        if (out_bf16 == 2)
            bf16n_store((uint16_t *)out + at, v);
        else
#endif
        if (out_bf16)
            bf16x16_store((uint16_t *)out + at, v);
        else
            _mm512_storeu_ps((float *)out + at, v);
    }
}

/* Where element (i, c) of a bf16 matrix of nkc * 32 columns lies when it is held as AMX A
 * tiles (the layer kernel's activations): tile (i / 16, c / 32) of 16 rows of 32, 1 KB each,
 * the tiles of a row block side by side; rows of tiles need the same padding as rows. */
static inline size_t a_tile_at(int i, int c, int nkc) {
    return ((((size_t)(i >> 4) * nkc) + (c >> 5)) << 9) + ((i & 15) << 5) + (c & 31);
}

/* For rows i < t of h [t, k] float32: h += delta (bf16 [t, k], when not NULL); then
 * out[i] = h[i] / sqrt(mean(h[i]^2) + eps) * w, stored as bf16 (out_bf16) or float32. */
void qlib_add_rmsnorm(float *h, const uint16_t *delta, int t, int k, const float *w, float eps,
                      void *out, int out_bf16) {
    const size_t osize = out_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel
    {
    FTZ_BEGIN
#pragma omp for schedule(static)
    for (int i = 0; i < t; i++)
        add_rmsnorm_row(h + (size_t)i * k, delta ? delta + (size_t)i * k : NULL, k, w, eps,
                        (char *)out + osize * (size_t)i * k, out_bf16, 32);
    FTZ_END
    }
}

/* gu [t, 2 n_ff] (gate | up) -> out [t, n_ff] = silu(gate) * up, bf16 or float32 in and out
 * (the same arithmetic; bf16 rounds on load and store only). */
static inline __attribute__((always_inline)) void swiglu_rows(const void *gu, int t, int n_ff,
                                                              void *out, const int bf16) {
#pragma omp parallel
    {
    FTZ_BEGIN
#pragma omp for schedule(static)
    for (int i = 0; i < t; i++) {
        const size_t g0 = (size_t)i * 2 * n_ff, u0 = g0 + n_ff, o0 = (size_t)i * n_ff;
        for (int e = 0; e < n_ff; e += 16) {
            const __m512 g = bf16 ? bf16x16_load((const uint16_t *)gu + g0 + e)
                                  : _mm512_loadu_ps((const float *)gu + g0 + e);
            const __m512 u = bf16 ? bf16x16_load((const uint16_t *)gu + u0 + e)
                                  : _mm512_loadu_ps((const float *)gu + u0 + e);
            const __m512 r = _mm512_mul_ps(silu16(g), u);
            if (bf16)
                bf16x16_store((uint16_t *)out + o0 + e, r);
            else
                _mm512_storeu_ps((float *)out + o0 + e, r);
        }
    }
    FTZ_END
    }
}

/* gu [t, 2 n_ff] bf16 (gate | up) -> out [t, n_ff] bf16 = silu(gate) * up. */
void qlib_swiglu_bf16(const uint16_t *gu, int t, int n_ff, uint16_t *out) {
    swiglu_rows(gu, t, n_ff, out, 1);
}

/* The same for float32 rows (the int8 prefill's), without the bf16 roundings. */
void qlib_swiglu_f32(const float *gu, int t, int n_ff, float *out) {
    swiglu_rows(gu, t, n_ff, out, 0);
}

/* Keep a loaded vector in a register (GCC otherwise folds the load into every FMA that
 * uses it, and the loop becomes load-bound). */
#define IN_REG(v) __asm__("" : "+v"(v))

/* RoPE tables of one position as d-float vectors: x' = x * c + partner(x) * s, where
 * partner(x) is x[2i+1], x[2i] (pairs (2i, 2i+1)) or x[i+d/2], x[i] (neox). */
static void rope_tables(const float *cos, const float *sin, int d, int neox, float *c, float *s) {
    for (int i = 0; i < d / 2; i++) {
        const int i0 = neox ? i : 2 * i, i1 = neox ? i + d / 2 : 2 * i + 1;
        c[i0] = c[i1] = cos[i];
        s[i0] = -sin[i];
        s[i1] = sin[i];
    }
}

/* One head of d bf16 -> float32 at dst, rotated (when c) and scaled. */
static inline void head_in(const uint16_t *x, int d, const float *c, const float *s, int neox,
                           float scale, float *dst) {
    float buf[128], partner[128];
    for (int e = 0; e < d; e += 16) _mm512_storeu_ps(buf + e, bf16x16_load(x + e));
    if (c && neox)
        for (int e = 0; e < d; e++) partner[e] = buf[e < d / 2 ? e + d / 2 : e - d / 2];
    for (int e = 0; e < d; e += 16) {
        __m512 v = _mm512_loadu_ps(buf + e);
        if (c) {
            const __m512 pv = neox ? _mm512_loadu_ps(partner + e)
                                   : _mm512_permute_ps(v, 0xB1); /* swap within pairs */
            /* x * c + partner * s, rounded as x0 * cos - x1 * sin (no contraction) */
            v = _mm512_add_ps(_mm512_mul_ps(v, _mm512_loadu_ps(c + e)),
                              _mm512_mul_ps(pv, _mm512_loadu_ps(s + e)));
        }
        if (scale != 1.0f) v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
        _mm512_storeu_ps(dst + e, v);
    }
}

/* Row i of a prefill chunk (position p): the RoPE tables of p into c, s (d floats each);
 * its k (rotated) and v heads into the float32 caches kc, vc [n_kv, max_seq, d] at p. */
static void rope_kv_row(const uint16_t *x, int p, int n_head, int n_kv, int d, int max_seq,
                        const float *cos, const float *sin, int neox, float *kc, float *vc,
                        float *c, float *s) {
    rope_tables(cos + (size_t)p * (d / 2), sin + (size_t)p * (d / 2), d, neox, c, s);
    for (int g = 0; g < n_kv; g++) {
        const size_t at = ((size_t)g * max_seq + p) * d;
        head_in(x + (size_t)(n_head + g) * d, d, c, s, neox, 1.0f, kc + at);
        head_in(x + (size_t)(n_head + n_kv + g) * d, d, NULL, NULL, 0, 1.0f, vc + at);
    }
}

/* Scores of NQ query vectors (d floats each, scaled) with keys 0..32*nb2-1:
 * s[j * ld + l] = q_j . k_l. Kt: keys transposed in blocks of 32, [*, d, 32]. */
static inline __attribute__((always_inline)) void attn_scores(
    const int NQ, const float *const *q, int d, const float *Kt, int nb2, float *s, int ld) {
    for (int b = 0; b < nb2; b++) {
        __m512 acc[8][2];
        for (int j = 0; j < NQ; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
        const float *kb = Kt + (size_t)b * d * 32;
        for (int e = 0; e < d; e++) {
            __m512 k0 = _mm512_loadu_ps(kb + 32 * e), k1 = _mm512_loadu_ps(kb + 32 * e + 16);
            IN_REG(k0);
            IN_REG(k1);
            for (int j = 0; j < NQ; j++) {
                const __m512 qe = _mm512_set1_ps(q[j][e]);
                acc[j][0] = _mm512_fmadd_ps(qe, k0, acc[j][0]);
                acc[j][1] = _mm512_fmadd_ps(qe, k1, acc[j][1]);
            }
        }
        for (int j = 0; j < NQ; j++) {
            _mm512_storeu_ps(s + (size_t)j * ld + 32 * b, acc[j][0]);
            _mm512_storeu_ps(s + (size_t)j * ld + 32 * b + 16, acc[j][1]);
        }
    }
}

/* Scores of one row (Lq valid keys) -> softmax weights in place, zero past Lq; returns
 * 1 / sum. */
static inline float softmax_row(float *sr, int Lq) {
    const int nb = (Lq + 15) / 16;
    const __mmask16 tail = (__mmask16)(0xFFFFu >> (16 * nb - Lq)); /* valid keys, last block */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int b = 0; b < nb; b++)
        mx = _mm512_mask_max_ps(mx, b == nb - 1 ? tail : 0xFFFF, mx, _mm512_loadu_ps(sr + 16 * b));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512 z = _mm512_sub_ps(_mm512_loadu_ps(sr + 16 * b), m);
        /* e^z < 1.6e-38 counts as 0 (no denormal weights) */
        __mmask16 keep = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
        if (b == nb - 1) keep &= tail;
        const __m512 p = _mm512_maskz_mov_ps(keep, exp16(z));
        _mm512_storeu_ps(sr + 16 * b, p);
        sum = _mm512_add_ps(sum, p);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* out_r = (sum over l < Lq of p_r[l] V[l]) * inv_r for R rows of weights p (stride ld),
 * d = 16 DV; out rows bf16 with stride d. */
static inline __attribute__((always_inline)) void attn_values(
    const int R, const int DV, const float *p, int ld, const float *inv, const float *V, int Lq,
    uint16_t *out) {
    const int d = 16 * DV;
    __m512 o[4][8]; /* R and DV are constants at each call: registers */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < DV; j++) o[r][j] = _mm512_setzero_ps();
    for (int l = 0; l < Lq; l++) {
        const float *v = V + (size_t)l * d;
        __m512 w[4];
        for (int r = 0; r < R; r++) w[r] = _mm512_set1_ps(p[(size_t)r * ld + l]);
        for (int j = 0; j < DV; j++) {
            __m512 vj = _mm512_loadu_ps(v + 16 * j);
            IN_REG(vj);
            for (int r = 0; r < R; r++) o[r][j] = _mm512_fmadd_ps(w[r], vj, o[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < DV; j++)
            bf16x16_store(out + (size_t)r * d + 16 * j, _mm512_mul_ps(o[r][j], _mm512_set1_ps(inv[r])));
}

/* Prefill attention for one layer. qkv: [t, (n_head + 2 n_kv) d] bf16 (q | k | v heads)
 * of positions pos..pos+t-1. RoPE (cos, sin: the tables from position 0, d/2 per row;
 * neox pairs (i, i+d/2), else (2i, 2i+1)) of q and k; k, v (float32) into the caches
 * kc, vc [n_kv, max_seq, d] at those positions; then row i, query head h:
 * out[i, h] = softmax(q k^T / sqrt(d)) v over cache positions 0..pos+i of KV head
 * h / (n_head / n_kv), for rows q_from <= i < t only (the rows whose output is used; the
 * cache gets all t): out: [t - q_from, n_head d] bf16, row i at i - q_from.
 * Returns 0, or -1 (d, heads, q_from, memory).
 * Work item: one KV head, two adjacent query rows, up to 4 of its query heads (their
 * scores share every key load). */
int qlib_attn_prefill(const uint16_t *qkv, int t, float *kc, float *vc, int pos, int n_head,
                      int n_kv, int d, int max_seq, const float *cos, const float *sin,
                      int neox, int q_from, uint16_t *out) {
    if (d % 16 || d > 128 || n_head % n_kv || q_from < 0 || q_from >= t) return -1;
    const int rep = n_head / n_kv, L = pos + t, ld = (L + 31) / 32 * 32;
    const int row = (n_head + 2 * n_kv) * d;
    const float scale = 1.0f / sqrtf((float)d);
    float *qf = malloc(sizeof(float) * (size_t)t * n_head * d);
    float *Kt = malloc(sizeof(float) * (size_t)n_kv * d * ld);
    float *sbuf = malloc(sizeof(float) * 8 * (size_t)ld * omp_get_max_threads());
    if (!qf || !Kt || !sbuf) {
        free(qf), free(Kt), free(sbuf);
        return -1;
    }
    const int pairs = (t - q_from + 1) / 2, chunks = (rep + 3) / 4;
#pragma omp parallel
    {
        FTZ_BEGIN
#pragma omp for schedule(static)
        for (int i = 0; i < t; i++) {
            const uint16_t *x = qkv + (size_t)i * row;
            float c[128], s[128];
            rope_kv_row(x, pos + i, n_head, n_kv, d, max_seq, cos, sin, neox, kc, vc, c, s);
            for (int h = 0; h < n_head && i >= q_from; h++)
                head_in(x + (size_t)h * d, d, c, s, neox, scale, qf + ((size_t)i * n_head + h) * d);
        }
        /* keys transposed per KV head in blocks of 32: Kt[g][l / 32][e][l % 32], zero past L */
#pragma omp for schedule(static)
        for (int gb = 0; gb < n_kv * (ld / 32); gb++) {
            const int g = gb / (ld / 32), l0 = gb % (ld / 32) * 32;
            float *kt = Kt + (size_t)g * d * ld + (size_t)l0 * d;
            const float *k = kc + (size_t)g * max_seq * d;
            for (int l = l0; l < l0 + 32; l++)
                for (int e = 0; e < d; e++)
                    kt[(size_t)e * 32 + l - l0] = l < L ? k[(size_t)l * d + e] : 0.0f;
        }
        float *sc = sbuf + (size_t)8 * ld * omp_get_thread_num();
        /* longest rows first, interleaved over threads (row i has pos+i+1 keys) */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < n_kv * pairs * chunks; task++) {
            const int g = task % n_kv, pc = task / n_kv, chunk = pc % chunks;
            const int i0 = t - 1 - 2 * (pc / chunks), nr = i0 > q_from ? 2 : 1; /* i0, i0 - 1 */
            const int h0 = g * rep + 4 * chunk, R = rep - 4 * chunk < 4 ? rep - 4 * chunk : 4;
            const int Lq = pos + i0 + 1, nq = R * nr;
            const float *kt = Kt + (size_t)g * d * ld, *V = vc + (size_t)g * max_seq * d;
            const float *q[8];
            for (int r = 0; r < nr; r++)
                for (int j = 0; j < R; j++)
                    q[r * R + j] = qf + ((size_t)(i0 - r) * n_head + h0 + j) * d;
            const int nb2 = (Lq + 31) / 32;
            switch (nq) {
#define QLIB_QK(n) case n: attn_scores(n, q, d, kt, nb2, sc, ld); break;
            QLIB_QK(1) QLIB_QK(2) QLIB_QK(3) QLIB_QK(4) QLIB_QK(5) QLIB_QK(6) QLIB_QK(7)
            QLIB_QK(8)
#undef QLIB_QK
            }
            for (int r = 0; r < nr; r++) {
                float inv[4];
                for (int j = 0; j < R; j++) inv[j] = softmax_row(sc + (size_t)(r * R + j) * ld, Lq - r);
                const float *p = sc + (size_t)r * R * ld;
                uint16_t *o = out + ((size_t)(i0 - r - q_from) * n_head + h0) * d;
                switch (R * 16 + d / 16) { /* R in 1..4, d / 16 in 1..8 */
#define QLIB_PV(R_, DV_) \
    case R_ * 16 + DV_: attn_values(R_, DV_, p, ld, inv, V, Lq - r, o); break;
#define QLIB_PVS(R_) QLIB_PV(R_, 1) QLIB_PV(R_, 2) QLIB_PV(R_, 3) QLIB_PV(R_, 4) \
    QLIB_PV(R_, 5) QLIB_PV(R_, 6) QLIB_PV(R_, 7) QLIB_PV(R_, 8)
                QLIB_PVS(1) QLIB_PVS(2) QLIB_PVS(3) QLIB_PVS(4)
#undef QLIB_PVS
#undef QLIB_PV
                }
            }
        }
        FTZ_END
    }
    free(qf), free(Kt), free(sbuf);
    return 0;
}

/* ---- Flash-style float32 prefill attention (the int8 prefill's, float32 or bf16 io) -----
 *
 * Same contract as qlib_attn_prefill (RoPE of q and k, k and v into the caches, causal GQA
 * attention over positions 0..pos+i for row i, rows q_from..t-1 out), but qkv and out are
 * float32 or bf16 (in_bf16, out_bf16), the caches float32 or IEEE half (kv_f16: k and v
 * rounded to nearest even as they are stored, and the attention reads the rounded values
 * back, as a later chunk or the decode does), and the attention is tiled for the caches:
 * a task is one KV head x 8 or 16 query rows (their rep query heads: rows x rep query
 * vectors, roped and scaled once); it walks the keys in blocks of FA_BK = 64 (K transposed
 * per block, [d][64], and V as the cache holds them: 32 KB for d = 64, L1), and for each
 * group of up to 6 query vectors computes the 6 x 64 scores in registers (24 accumulators),
 * an online softmax (running max m, sum l; the group's outputs o in an L1 buffer rescaled by
 * e^(m - m') when the max grows) and o += p v. Every query vector is computed alone in a
 * fixed order (its key blocks in order; blocks past its own last key add exact zeros), so a
 * row's output does not depend on the other rows, the task split or q_from. Equal to the
 * exact softmax (SDPA) to float rounding. Work: 4 x heads x d x t^2 / 2 flops. */
enum { FA_BK = 64, FA_NQ = 6 };
/* Query rows of a task: 8, or 16 past 1024 positions (SmolLM2's layer, min of 2-5, 2 threads:
 * 8 / 16 rows 12.9 / 12.8 ms at 203 tokens, 219 / 229 at 1024, 1566 / 1356 at 2800; 4 and 32
 * rows slower). qlib_attn_set_rows(r > 0) fixes it (an A/B hook), 0 restores the rule. */
int qlib_fa_bq = 0;
void qlib_attn_set_rows(int rows) { qlib_fa_bq = rows > 0 ? rows : 0; }

/* One head of d floats (float32 or bf16 at x) -> dst, rotated (when c) and scaled. */
static inline void head_in_any(const void *x, int bf16, int d, const float *c, const float *s,
                               int neox, float scale, float *dst) {
    if (bf16) {
        head_in((const uint16_t *)x, d, c, s, neox, scale, dst);
        return;
    }
    const float *xf = (const float *)x;
    float partner[128];
    if (c && neox)
        for (int e = 0; e < d; e++) partner[e] = xf[e < d / 2 ? e + d / 2 : e - d / 2];
    for (int e = 0; e < d; e += 16) {
        __m512 v = _mm512_loadu_ps(xf + e);
        if (c) {
            const __m512 pv = neox ? _mm512_loadu_ps(partner + e) : _mm512_permute_ps(v, 0xB1);
            v = _mm512_add_ps(_mm512_mul_ps(v, _mm512_loadu_ps(c + e)),
                              _mm512_mul_ps(pv, _mm512_loadu_ps(s + e)));
        }
        if (scale != 1.0f) v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
        _mm512_storeu_ps(dst + e, v);
    }
}

/* Scores of NQ query vectors with the 64 keys of a block (kt: [d][64]) -> s[NQ][4]. */
static inline __attribute__((always_inline)) void fa_scores(const int NQ, const float *const *q,
                                                            int d, const float *kt,
                                                            __m512 s[FA_NQ][4]) {
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < 4; c++) s[j][c] = _mm512_setzero_ps();
    for (int e = 0; e < d; e++) {
        __m512 k[4];
        for (int c = 0; c < 4; c++) {
            k[c] = _mm512_loadu_ps(kt + 64 * e + 16 * c);
            IN_REG(k[c]);
        }
        for (int j = 0; j < NQ; j++) {
            const __m512 qe = _mm512_set1_ps(q[j][e]);
            for (int c = 0; c < 4; c++) s[j][c] = _mm512_fmadd_ps(qe, k[c], s[j][c]);
        }
    }
}

/* o[j] = o[j] * alpha[j] + sum over keys c < nk of p[j][c] v_c (v rows of d = 16 DV floats at
 * V, o rows of d at o[j]). */
static inline __attribute__((always_inline)) void fa_values(const int NQ, const int DV,
                                                            const float *p, const float *alpha,
                                                            const float *V, int nk,
                                                            float *const *o) {
    const int d = 16 * DV;
    __m512 acc[FA_NQ][8];
    for (int j = 0; j < NQ; j++) {
        const __m512 a = _mm512_set1_ps(alpha[j]);
        for (int v = 0; v < DV; v++) acc[j][v] = _mm512_mul_ps(_mm512_loadu_ps(o[j] + 16 * v), a);
    }
    for (int c = 0; c < nk; c++) {
        const float *vr = V + (size_t)c * d;
        __m512 vv[8];
        for (int v = 0; v < DV; v++) {
            vv[v] = _mm512_loadu_ps(vr + 16 * v);
            IN_REG(vv[v]);
        }
        for (int j = 0; j < NQ; j++) {
            const __m512 w = _mm512_set1_ps(p[j * FA_BK + c]);
            for (int v = 0; v < DV; v++) acc[j][v] = _mm512_fmadd_ps(w, vv[v], acc[j][v]);
        }
    }
    for (int j = 0; j < NQ; j++)
        for (int v = 0; v < DV; v++) _mm512_storeu_ps(o[j] + 16 * v, acc[j][v]);
}

/* Each vector's max over the scores s of a key block (keys l0..l0+63) it sees (lim[j]: its
 * last key) -> bmax[j] (-inf where it sees none), with the masks of the keys it sees in km
 * (unless ``whole``: every vector sees all 64, no masks). Returns the keys of the block any
 * vector sees (<= 64). */
static inline __attribute__((always_inline)) int fa_block_max(const int NQ, __m512 s[FA_NQ][4],
                                                              const int *lim, int l0, int whole,
                                                              __mmask16 km[FA_NQ][4],
                                                              float *bmax) {
    int nk = 0;
    for (int j = 0; j < NQ; j++) {
        const int valid = lim[j] - l0 + 1; /* keys of this block vector j sees (may be <= 0) */
        nk = valid > nk ? valid : nk;
        __m512 mx;
        if (whole) {
            for (int c = 0; c < 4; c++) km[j][c] = (__mmask16)0xFFFF;
            mx = _mm512_max_ps(_mm512_max_ps(s[j][0], s[j][1]), _mm512_max_ps(s[j][2], s[j][3]));
        } else {
            mx = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) {
                const int vc = valid - 16 * c;
                km[j][c] = vc >= 16 ? (__mmask16)0xFFFF : vc <= 0 ? 0 : (__mmask16)((1u << vc) - 1);
                mx = _mm512_mask_max_ps(mx, km[j][c], mx, s[j][c]);
            }
        }
        bmax[j] = _mm512_reduce_max_ps(mx);
    }
    return nk > FA_BK ? FA_BK : nk;
}

/* The online softmax update of a group of NQ query vectors (limits lim[j]: the last key each
 * sees) for one key block (keys l0..l0+63) from its scores s: the block's max, the new maxima
 * m, the rescale factors alpha[j] = e^(m - m'), the weights p (pbuf[j][64], zero past a
 * vector's last key) and the sums lsum. Returns the keys of the block any vector sees. */
static inline __attribute__((always_inline)) int fa_softmax(const int NQ, __m512 s[FA_NQ][4],
                                                            const int *lim, int l0, float *m,
                                                            float *lsum, float *pbuf,
                                                            float *alpha) {
    float mnew[16];
    __mmask16 km[FA_NQ][4];
    int nk = fa_block_max(NQ, s, lim, l0, 0, km, mnew);
    { /* new maxima and the rescale factors of all vectors at once: e^(m - m'), exactly 1 when
       * the max did not grow (a block past a vector's last key), ~0 at the first block */
        const __mmask16 all = (__mmask16)((1u << NQ) - 1);
        const __m512 mo = _mm512_maskz_loadu_ps(all, m);
        const __m512 mn = _mm512_max_ps(mo, _mm512_maskz_loadu_ps(all, mnew));
        _mm512_mask_storeu_ps(m, all, mn);
        _mm512_storeu_ps(mnew, mn);
        _mm512_storeu_ps(alpha, exp16(_mm512_sub_ps(mo, mn)));
    }
    for (int j = 0; j < NQ; j++) {
        const __m512 mv = _mm512_set1_ps(mnew[j]);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m512 z = _mm512_sub_ps(s[j][c], mv);
            const __mmask16 keep = km[j][c] & _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
            const __m512 pz = _mm512_maskz_mov_ps(keep, exp16(z));
            _mm512_storeu_ps(pbuf + j * FA_BK + 16 * c, pz);
            sum = _mm512_add_ps(sum, pz);
        }
        lsum[j] = lsum[j] * alpha[j] + _mm512_reduce_add_ps(sum);
    }
    return nk;
}

/* One group of NQ query vectors (limits lim[j]: the last key each sees) and one key block
 * (keys l0..l0+63): scores, online softmax update of m, l, and o. */
static inline __attribute__((always_inline)) void fa_group(
    const int NQ, const float *const *q, const int *lim, int d, const float *kt,
    const float *V, int l0, float *m, float *lsum, float *const *o, float *pbuf) {
    __m512 s[FA_NQ][4];
    fa_scores(NQ, q, d, kt, s);
    float alpha[16];
    const int nk = fa_softmax(NQ, s, lim, l0, m, lsum, pbuf, alpha);
    switch (d / 16) {
#define QLIB_FV(DV_) case DV_: fa_values(NQ, DV_, pbuf, alpha, V, nk, o); break;
    QLIB_FV(1) QLIB_FV(2) QLIB_FV(3) QLIB_FV(4) QLIB_FV(5) QLIB_FV(6) QLIB_FV(7) QLIB_FV(8)
#undef QLIB_FV
    }
}

/* ---- int8 attention (the flash kernel with int8 = 1) -------------------------------------
 *
 * The two products of a block run as int8 dot products (vpdpbusd: 64 multiply-adds an
 * instruction against 16 for a float FMA); the softmax stays float32.
 *   scores: each query vector q (roped, scaled by 1/sqrt(d)) is rounded to int8 codes with one
 *           scale per vector (qs = max|q| / 127), each key row to codes + 128 (unsigned) with
 *           one scale per key (ks = max|k| / 127); s = qs ks (sum(qc (kc + 128)) - 128 sum qc).
 *   values: each value row to int8 codes with one scale per key (vs); a vector's weights of
 *           the block, w_l = p_l vs_l, to unsigned codes with one scale (ws = max w / 255);
 *           o = o alpha + ws sum(wc vc). The sums l keep the float32 weights p.
 * Layouts per KV head and key block of 64 (Kq: d / 4 groups of 4 dims x 64 keys x 4 bytes, the
 * dims of a key contiguous; Vq: 16 groups of 4 keys x d dims x 4 bytes, the keys of a dim
 * contiguous), keys past L zero (their weights are zero). Rounding is to nearest even (the
 * MXCSR's), ties and all; rows whose max is 0 get scale 0 and codes 0. */

/* acc + the sums of 4 products of unsigned bytes u and signed bytes s in each int32 lane
 * (vpdpbusd). In asm: GCC 12's intrinsic copies every accumulator around each instruction and
 * spills them when a group's 24 accumulators are live (the attention measured 1.4x slower). */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

/* Codes of one query vector of d floats: qc[d] int8, its scale and -128 sum(qc). */
static inline void fa_quantize_query(const float *x, int d, int8_t *qc, float *qs, int32_t *corr) {
    __m512 mx = _mm512_setzero_ps();
    for (int e = 0; e < d; e += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + e)));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int e = 0; e < d; e += 16) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + e), inv));
        sum = _mm512_add_epi32(sum, c);
        _mm_storeu_si128((__m128i *)(qc + e), _mm512_cvtsepi32_epi8(c));
    }
    *qs = amax / 127.0f;
    *corr = -128 * _mm512_reduce_add_epi32(sum);
}

/* Codes of one cache row of d floats (row) -> int32 codes c[d], its scale. */
static inline float fa_row_codes(const float *row, int d, int32_t *c) {
    __m512 mx = _mm512_setzero_ps();
    for (int e = 0; e < d; e += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(row + e)));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    for (int e = 0; e < d; e += 16)
        _mm512_storeu_si512(c + e, _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + e), inv)));
    return amax / 127.0f;
}

/* Scores of NQ query vectors (codes qc[j], scales qs[j], corrections corr[j]) with the 64 keys
 * of a block (kq: [d/4][64] dwords of 4 unsigned codes; ks[64]) -> s[NQ][4]. */
static inline __attribute__((always_inline)) void fa_scores_i8(
    const int NQ, const int8_t *const *qc, const float *qs, const int32_t *corr, int d,
    const uint8_t *kq, const float *ks, __m512 s[FA_NQ][4]) {
    __m512i acc[FA_NQ][4];
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = _mm512_set1_epi32(corr[j]);
    for (int e4 = 0; e4 < d / 4; e4++) {
        __m512i k[4];
        for (int c = 0; c < 4; c++) {
            k[c] = _mm512_loadu_si512(kq + 4 * (64 * e4 + 16 * c));
            IN_REG(k[c]);
        }
        for (int j = 0; j < NQ; j++) {
            int32_t qd;
            memcpy(&qd, qc[j] + 4 * e4, 4);
            const __m512i qb = _mm512_set1_epi32(qd);
            for (int c = 0; c < 4; c++) acc[j][c] = dpbusd(acc[j][c], k[c], qb);
        }
    }
    for (int j = 0; j < NQ; j++) {
        const __m512 sj = _mm512_set1_ps(qs[j]);
        for (int c = 0; c < 4; c++)
            s[j][c] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[j][c]), sj),
                                    _mm512_loadu_ps(ks + 16 * c));
    }
}

/* fa_softmax for the int8 products: the same maxima, rescale factors and weights p (e^x by
 * exp16_diff: the weights become 8-bit codes next), but the sums l kept as one vector a
 * query vector (lvec[j][16], summed once at the end), no masks in a block that every vector
 * of the group sees whole, and pmax[j] = e^(block max - m'), the bound of the vector's
 * weights in the block. */
static inline __attribute__((always_inline)) int fa_softmax_i8(const int NQ, __m512 s[FA_NQ][4],
                                                               const int *lim, int l0, float *m,
                                                               float *lvec, float *pbuf,
                                                               float *alpha, float *pmax) {
    float bmax[16];
    int lo = lim[0];
    for (int j = 1; j < NQ; j++) lo = lim[j] < lo ? lim[j] : lo;
    const int whole = lo - l0 + 1 >= FA_BK; /* every vector sees all 64 keys */
    __mmask16 km[FA_NQ][4];
    const int nk = fa_block_max(NQ, s, lim, l0, whole, km, bmax);
    float mnew[16];
    {
        const __mmask16 all = (__mmask16)((1u << NQ) - 1);
        const __m512 mo = _mm512_maskz_loadu_ps(all, m), bm = _mm512_maskz_loadu_ps(all, bmax);
        const __m512 mn = _mm512_max_ps(mo, bm);
        _mm512_mask_storeu_ps(m, all, mn);
        _mm512_storeu_ps(mnew, mn);
        const __m512 mnl = _mm512_mul_ps(mn, _mm512_set1_ps(1.44269504f));
        _mm512_storeu_ps(alpha, exp16_diff(mo, mnl));
        _mm512_storeu_ps(pmax, exp16_diff(bm, mnl));
    }
    for (int j = 0; j < NQ; j++) {
        const __m512 ml = _mm512_set1_ps(mnew[j] * 1.44269504f);
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(lvec + 16 * j), _mm512_set1_ps(alpha[j]));
        for (int c = 0; c < 4; c++) {
            __m512 pz = exp16_diff(s[j][c], ml);
            if (!whole) pz = _mm512_maskz_mov_ps(km[j][c], pz);
            _mm512_storeu_ps(pbuf + j * FA_BK + 16 * c, pz);
            sum = _mm512_add_ps(sum, pz);
        }
        _mm512_storeu_ps(lvec + 16 * j, sum);
    }
    return nk;
}

/* o[j] = o[j] alpha[j] + ws_j sum over keys of wc_l vc_l: the weights w = p vs of vector j
 * rounded to unsigned codes wc (wbuf[j][64]) with the scale ws_j = wmax / 255, wmax = pmax_j
 * vsmax in a block the vector sees whole (their bound: p <= pmax, vs <= vsmax), else their
 * max; vq: [16][d] dwords of the int8 value codes of 4 keys, vs[0..63] their scales and
 * vs[64] = vsmax; nk keys seen. */
static inline __attribute__((always_inline)) void fa_values_i8(
    const int NQ, const int DV, const float *p, const float *alpha, const float *pmax,
    const int *lim, int l0, const uint8_t *vq, const float *vs, int nk, uint8_t *wbuf,
    float *const *o) {
    const int d = 16 * DV;
    float ws[FA_NQ];
    __m512 vsc[4];
    for (int c = 0; c < 4; c++) vsc[c] = _mm512_loadu_ps(vs + 16 * c);
    for (int j = 0; j < NQ; j++) {
        __m512 w[4];
        for (int c = 0; c < 4; c++) w[c] = _mm512_mul_ps(_mm512_loadu_ps(p + j * FA_BK + 16 * c), vsc[c]);
        /* the bound where the vector sees the whole block; else the max of the keys it sees
         * (a bound over all 64 would make a row depend on later rows' values). Decided per
         * vector, so that a row's result does not depend on its group. A vector that sees
         * none of the block: no codes */
        const float wmax = lim[j] - l0 + 1 >= FA_BK ? pmax[j] * vs[FA_BK]
                                 : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(w[0], w[1]),
                                                                      _mm512_max_ps(w[2], w[3])));
        const __m512 inv = _mm512_set1_ps(wmax > 1e-30f ? 255.0f / wmax : 0.0f);
        for (int c = 0; c < 4; c++)
            _mm_storeu_si128((__m128i *)(wbuf + j * FA_BK + 16 * c),
                             _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(w[c], inv))));
        ws[j] = wmax / 255.0f;
    }
    __m512i acc[FA_NQ][8];
    for (int j = 0; j < NQ; j++)
        for (int v = 0; v < DV; v++) acc[j][v] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < (nk + 3) / 4; k4++) {
        __m512i vv[8];
        for (int v = 0; v < DV; v++) {
            vv[v] = _mm512_loadu_si512(vq + 4 * ((size_t)k4 * d + 16 * v));
            IN_REG(vv[v]);
        }
        for (int j = 0; j < NQ; j++) {
            int32_t wd;
            memcpy(&wd, wbuf + j * FA_BK + 4 * k4, 4);
            const __m512i wb = _mm512_set1_epi32(wd);
            for (int v = 0; v < DV; v++) acc[j][v] = dpbusd(acc[j][v], wb, vv[v]);
        }
    }
    for (int j = 0; j < NQ; j++) {
        const __m512 a = _mm512_set1_ps(alpha[j]), sw = _mm512_set1_ps(ws[j]);
        for (int v = 0; v < DV; v++)
            _mm512_storeu_ps(o[j] + 16 * v,
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][v]), sw,
                                             _mm512_mul_ps(_mm512_loadu_ps(o[j] + 16 * v), a)));
    }
}

/* fa_group with int8 products (lvec: the vectors' sums, 16 floats each). */
static inline __attribute__((always_inline)) void fa_group_i8(
    const int NQ, const int8_t *const *qc, const float *qs, const int32_t *corr, const int *lim,
    int d, const uint8_t *kq, const float *ks, const uint8_t *vq, const float *vs, int l0,
    float *m, float *lvec, float *const *o, float *pbuf, uint8_t *wbuf) {
    __m512 s[FA_NQ][4];
    fa_scores_i8(NQ, qc, qs, corr, d, kq, ks, s);
    float alpha[16], pmax[16];
    const int nk = fa_softmax_i8(NQ, s, lim, l0, m, lvec, pbuf, alpha, pmax);
    switch (d / 16) {
#define QLIB_FV(DV_) case DV_: fa_values_i8(NQ, DV_, pbuf, alpha, pmax, lim, l0, vq, vs, nk, wbuf, \
                                            o); break;
    QLIB_FV(1) QLIB_FV(2) QLIB_FV(3) QLIB_FV(4) QLIB_FV(5) QLIB_FV(6) QLIB_FV(7) QLIB_FV(8)
#undef QLIB_FV
    }
}

/* The flash kernel's buffers (roped queries, transposed keys, per-thread o / p / m / l), kept
 * by the calling thread between calls (scratch_grow). */
static __thread void *fa_scratch;
static __thread size_t fa_scratch_bytes;

/* Element l of a cache row of float32 or IEEE half values. */
static inline float cache_at(const void *c, size_t l, int f16) {
    return f16 ? _cvtsh_ss(((const uint16_t *)c)[l]) : ((const float *)c)[l];
}

/* One head of d floats (float32 or bf16 at x), rotated (when c) into the cache row at. */
static inline void head_to_cache(const void *x, int bf16, int d, const float *c, const float *s,
                                 int neox, void *cache, size_t at, int f16) {
    if (!f16) {
        head_in_any(x, bf16, d, c, s, neox, 1.0f, (float *)cache + at);
        return;
    }
    float row[128];
    head_in_any(x, bf16, d, c, s, neox, 1.0f, row);
    for (int e = 0; e < d; e += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)cache + at + e),
                            _mm512_cvtps_ph(_mm512_loadu_ps(row + e), _MM_FROUND_TO_NEAREST_INT));
}

/* The int8 layouts of one KV head's key block (keys l0..l0+63 of cache rows row0.., zero
 * past L): kq / ks and vq / vs (the int8 section above). */
static void fa_block_i8(const void *kc, const void *vc, int f16, size_t row0, int l0, int L, int d,
                        uint8_t *kq, float *ks, uint8_t *vq, float *vs) {
    float row[128];
    int32_t c[128];
    for (int l = l0; l < l0 + FA_BK; l++) {
        const int i = l - l0;
        for (int kv = 0; kv < 2; kv++) {
            const void *cache = kv ? vc : kc;
            float sc = 0.0f;
            if (l < L) {
                const size_t at = row0 + (size_t)l * d;
                for (int e = 0; e < d; e += 16)
                    _mm512_storeu_ps(row + e, load_kv(cache, at + e, f16));
                sc = fa_row_codes(row, d, c);
            } else {
                memset(c, 0, sizeof(int32_t) * (size_t)d);
            }
            if (kv == 0) { /* 4 dims of key i in dword e4 * 64 + i, unsigned */
                ks[i] = sc;
                for (int e = 0; e < d; e++) kq[4 * (64 * (e / 4) + i) + e % 4] = (uint8_t)(c[e] + 128);
            } else { /* key i's value at dim e in byte i % 4 of dword (i / 4) d + e */
                vs[i] = sc;
                vs[FA_BK] = i == 0 || sc > vs[FA_BK] ? sc : vs[FA_BK];
                for (int e = 0; e < d; e++) vq[4 * ((size_t)(i / 4) * d + e) + i % 4] = (uint8_t)(int8_t)c[e];
            }
        }
    }
}

int qlib_attn_prefill_flash(const void *qkv, int in_bf16, int t, void *kc, void *vc, int pos,
                            int n_head, int n_kv, int d, int max_seq, const float *cos,
                            const float *sin, int neox, int q_from, void *out, int out_bf16,
                            int kv_f16, int int8) {
    if (d % 16 || d > 128 || n_head % n_kv || q_from < 0 || q_from >= t) return -1;
    const int rep = n_head / n_kv, L = pos + t, nkb = (L + FA_BK - 1) / FA_BK;
    const size_t row = (size_t)(n_head + 2 * n_kv) * d, esz = in_bf16 ? 2 : 4;
    const float scale = 1.0f / sqrtf((float)d);
    /* groups of query vectors: 6 (d <= 64), 3 (d <= 128): o accumulators NQ x d/16 <= 24 */
    const int nq_max = d <= 64 ? FA_NQ : 3;
    const int FA_BQ = qlib_fa_bq ? qlib_fa_bq : L > 1024 ? 16 : 8;
    const int nqv = FA_BQ * rep; /* query vectors of a task */
    const int nth = omp_get_max_threads();
    /* per thread: o, p, m, l; int8: l as vectors and the weights' codes */
    const size_t fa_base = ((size_t)nqv * d + (size_t)FA_NQ * FA_BK + 2 * (size_t)nqv + 15) / 16 * 16;
    const size_t per_thread = fa_base + (int8 ? 16 * (size_t)nqv + FA_NQ * FA_BK / 4 : 0);
    const size_t nq = (size_t)(t - q_from) * n_head, nqf = (nq * d + 15) / 16 * 16;
    /* float32: Kt (keys transposed) and a half cache's values as float32 (Vf); int8: the codes
     * of the keys and values (kq, vq: 64 d bytes a block each) and their scales, and
     * the queries' codes, scales and corrections */
    const size_t nkt = int8 ? 0 : (size_t)n_kv * nkb * FA_BK * d, nvf = kv_f16 ? nkt : 0;
    const size_t nblk_kv = (size_t)n_kv * nkb, nq8 = int8 ? nblk_kv * (FA_BK * d / 2 + 2 * FA_BK + 16)
                                                             + (nq * d / 4 + 2 * nq + 15) / 16 * 16 : 0;
    float *qf = scratch_grow(&fa_scratch, &fa_scratch_bytes,
                             sizeof(float) * (nqf + nkt + nvf + nq8 + per_thread * nth));
    if (!qf) return -1;
    float *Kt = qf + nqf, *Vf = Kt + nkt, *q8 = Vf + nvf, *scratch = q8 + nq8;
    uint8_t *Kq = (uint8_t *)q8, *Vq = Kq + nblk_kv * FA_BK * d;
    float *Ks = (float *)(Vq + nblk_kv * FA_BK * d), *Vs = Ks + nblk_kv * FA_BK;
    int8_t *Qc = (int8_t *)(Vs + nblk_kv * (FA_BK + 16)); /* Vs: 64 scales and their max */
    float *Qs = (float *)(Qc + nq * d);
    int32_t *Qcorr = (int32_t *)(Qs + nq);
    const int nblk = (t - q_from + FA_BQ - 1) / FA_BQ; /* row blocks, from the last row up */
#pragma omp parallel
    {
        FTZ_BEGIN
#pragma omp for schedule(static)
        for (int i = 0; i < t; i++) {
            const char *x = (const char *)qkv + esz * (size_t)i * row;
            float c[128], s[128];
            rope_tables(cos + (size_t)(pos + i) * (d / 2), sin + (size_t)(pos + i) * (d / 2), d,
                        neox, c, s);
            for (int g = 0; g < n_kv; g++) {
                const size_t at = ((size_t)g * max_seq + pos + i) * d;
                head_to_cache(x + esz * (size_t)(n_head + g) * d, in_bf16, d, c, s, neox, kc, at,
                              kv_f16);
                head_to_cache(x + esz * (size_t)(n_head + n_kv + g) * d, in_bf16, d, NULL, NULL,
                              0, vc, at, kv_f16);
            }
            for (int h = 0; h < n_head && i >= q_from; h++) {
                const size_t v = (size_t)(i - q_from) * n_head + h;
                head_in_any(x + esz * (size_t)h * d, in_bf16, d, c, s, neox, scale, qf + v * d);
                if (int8) fa_quantize_query(qf + v * d, d, Qc + v * d, Qs + v, Qcorr + v);
            }
        }
        /* per KV head and block of 64 keys, zero past L: float32, the keys transposed
         * (Kt[g][b][e][l % 64]) and a half cache's values as float32 (Vf); int8, the codes */
#pragma omp for schedule(static)
        for (int gb = 0; gb < n_kv * nkb; gb++) {
            const int g = gb / nkb, l0 = gb % nkb * FA_BK;
            const size_t row0 = (size_t)g * max_seq * d;
            if (int8) {
                fa_block_i8(kc, vc, kv_f16, row0, l0, L, d, Kq + (size_t)gb * FA_BK * d,
                            Ks + (size_t)gb * FA_BK, Vq + (size_t)gb * FA_BK * d,
                            Vs + (size_t)gb * (FA_BK + 16));
                continue;
            }
            float *kt = Kt + (size_t)gb * FA_BK * d;
            for (int l = l0; l < l0 + FA_BK; l++)
                for (int e = 0; e < d; e++)
                    kt[(size_t)e * FA_BK + l - l0] =
                        l < L ? cache_at(kc, row0 + (size_t)l * d + e, kv_f16) : 0.0f;
            for (int l = l0; l < l0 + FA_BK && kv_f16; l++)
                for (int e = 0; e < d; e++)
                    Vf[(size_t)gb * FA_BK * d + (size_t)(l - l0) * d + e] =
                        l < L ? cache_at(vc, row0 + (size_t)l * d + e, 1) : 0.0f;
        }
        float *obuf = scratch + per_thread * omp_get_thread_num();
        float *pbuf = obuf + (size_t)nqv * d, *mv = pbuf + FA_NQ * FA_BK, *lv = mv + nqv;
        float *lvec = obuf + fa_base; /* int8: the sums as vectors */
        uint8_t *wbuf = (uint8_t *)(lvec + 16 * (size_t)nqv);
        /* longest tasks (the last rows) first */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < n_kv * nblk; task++) {
            const int g = task % n_kv, b = task / n_kv;
            const int i1 = t - b * FA_BQ, i0 = i1 - FA_BQ > q_from ? i1 - FA_BQ : q_from;
            const int nv = (i1 - i0) * rep;
            const float *qp[nqv]; /* VLAs: FA_BQ * rep entries */
            const int8_t *qcp[nqv];
            float *op[nqv], qsv[nqv];
            int32_t qcorr[nqv];
            int lim[nqv];
            for (int r = 0; r < i1 - i0; r++)
                for (int hh = 0; hh < rep; hh++) {
                    const int j = r * rep + hh;
                    const size_t v = (size_t)(i0 + r - q_from) * n_head + g * rep + hh;
                    qp[j] = qf + v * d;
                    if (int8) qcp[j] = Qc + v * d, qsv[j] = Qs[v], qcorr[j] = Qcorr[v];
                    op[j] = obuf + (size_t)j * d;
                    lim[j] = pos + i0 + r;
                }
            for (int j = 0; j < nv; j++) mv[j] = -INFINITY, lv[j] = 0.0f;
            if (int8) memset(lvec, 0, sizeof(float) * 16 * (size_t)nv);
            memset(obuf, 0, sizeof(float) * (size_t)nv * d);
            const int last_b = (pos + i1 - 1) / FA_BK;
            const float *V = kv_f16 ? Vf + (size_t)g * nkb * FA_BK * d
                                    : (const float *)vc + (size_t)g * max_seq * d;
            for (int kb = 0; kb <= last_b; kb++) {
                const size_t gb = (size_t)g * nkb + kb;
                const float *kt = Kt + gb * FA_BK * d;
                const float *Vb = V + (size_t)kb * FA_BK * d;
                const uint8_t *kq = Kq + gb * FA_BK * d, *vq = Vq + gb * FA_BK * d;
                const float *ks = Ks + gb * FA_BK, *vs = Vs + gb * (FA_BK + 16);
                for (int j = 0; j < nv; j += nq_max) {
                    const int n = nv - j < nq_max ? nv - j : nq_max;
                    if (int8) {
                        switch (n) {
#define QLIB_FG(n) case n: fa_group_i8(n, qcp + j, qsv + j, qcorr + j, lim + j, d, kq, ks, vq, \
                                       vs, kb * FA_BK, mv + j, lvec + 16 * j, op + j, pbuf, wbuf); \
                                       break;
                        QLIB_FG(1) QLIB_FG(2) QLIB_FG(3) QLIB_FG(4) QLIB_FG(5) QLIB_FG(6)
#undef QLIB_FG
                        }
                        continue;
                    }
                    switch (n) {
#define QLIB_FG(n) case n: fa_group(n, qp + j, lim + j, d, kt, Vb, kb * FA_BK, mv + j, lv + j, \
                                    op + j, pbuf); break;
                    QLIB_FG(1) QLIB_FG(2) QLIB_FG(3) QLIB_FG(4) QLIB_FG(5) QLIB_FG(6)
#undef QLIB_FG
                    }
                }
            }
            for (int j = 0; j < nv && int8; j++) lv[j] = _mm512_reduce_add_ps(_mm512_loadu_ps(lvec + 16 * j));
            for (int j = 0; j < nv; j++) {
                const int r = j / rep, hh = j % rep;
                const size_t at = ((size_t)(i0 + r - q_from) * n_head + g * rep + hh) * d;
                const __m512 inv = _mm512_set1_ps(1.0f / lv[j]);
                for (int e = 0; e < d; e += 16) {
                    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(op[j] + e), inv);
                    if (out_bf16)
                        bf16x16_store((uint16_t *)out + at + e, y);
                    else
                        _mm512_storeu_ps((float *)out + at + e, y);
                }
            }
        }
        FTZ_END
    }
    return 0;
}

/* ---- AMX (bf16 tiles) prefill attention ------------------------------------------------
 *
 * Same contract as qlib_attn_prefill, but the two matmuls of attention (scores q k^T and
 * the weighted sum p v) run on AMX tiles: q, k, v and the softmax weights p are rounded to
 * bf16 for them (float32 accumulation); RoPE, the cache (float32), the softmax and the
 * output scaling stay float32. Built when the compiler has -mamx-tile -mamx-bf16; used when
 * the CPU has AMX-BF16 and the kernel granted the tile state (qlib_amx_init), d % 32 == 0.
 *
 * Layouts (bf16; a "tile" is 16 rows of 64 bytes, 1 KB):
 *   Qb [n_head][tq16][d]      roped, scaled queries of rows q_from.. (zero rows past t);
 *   KB [n_kv][L/16][d/32]     tiles of B for the scores: row r, column n = the pair of
 *                             dims (2r, 2r+1) of chunk c of key n (AMX's VNNI layout);
 *   VB [n_kv][L/32][d/16]     tiles of B for p v: row r, column n = dim n of keys 2r, 2r+1;
 * keys past L are zero (their weights are zero; zero times garbage could be NaN). One task
 * = one query head x 16 query rows; scores of up to 4 key tiles per pass (tiles 4..7),
 * then softmax per row, then p v into 4 dim tiles per pass. */
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Ask the kernel for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * per process, idempotent. 0 = granted. */
int qlib_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1; }

/* Where the AMX prefill's time goes (tools/cpu_prefill_profile.py; NULL, the default: nothing
 * kept). Each thread below qlib_prefill_threads adds, per phase of prefill_layer (PF_*, in
 * order), the seconds of its own work and of its wait at the phase's closing barrier into
 * qlib_prefill_times[(thread * PF_PHASES + phase) * 2 + {0, 1}]. */
enum { PF_NORM1, PF_QKV, PF_ROPE, PF_CACHE, PF_TASKS, PF_WO, PF_NORM2, PF_W13, PF_W2, PF_PHASES };
static double *qlib_prefill_times;
static int qlib_prefill_threads;
void qlib_prefill_set_times(double *times, int threads) {
    qlib_prefill_times = times;
    qlib_prefill_threads = times ? threads : 0;
}
int qlib_prefill_phases(void) { return PF_PHASES; }
static __thread int pf_phase;  /* this thread's phase */
static __thread double pf_t0;  /* and when its work began */

/* A parallel region's first phase begins (the later ones begin at the barrier before them) */
static inline void pf_begin(int phase) {
    pf_phase = phase;
    if (qlib_prefill_times) pf_t0 = omp_get_wtime();
}

/* The barrier that closes this thread's phase; the next phase (pf_phase, set after it) starts
 * when it ends. */
static inline void pf_barrier(void) {
    if (!qlib_prefill_times) {
#pragma omp barrier
        return;
    }
    const double t1 = omp_get_wtime();
#pragma omp barrier
    const double t2 = omp_get_wtime();
    const int th = omp_get_thread_num();
    if (th < qlib_prefill_threads) {
        double *p = qlib_prefill_times + ((size_t)th * PF_PHASES + pf_phase) * 2;
        p[0] += t1 - pf_t0, p[1] += t2 - t1;
    }
    pf_t0 = t2;
}

static void amx_tiles_16x64(void) {
    amx_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* Scores of one row (Lq valid keys) -> bf16 softmax weights e^(s - max) at pr, zero past Lq
 * up to 32 n32 keys, in one pass after the max (exp16_diff: ~3.5e-6 relative, far below the
 * weights' bf16 rounding); returns 1 / (the float32 sum of the unrounded weights). */
static inline float softmax_row_bf16(const float *sr, int Lq, uint16_t *pr, int n32) {
    const int nb = (Lq + 15) / 16;
    const __mmask16 tail = (__mmask16)(0xFFFFu >> (16 * nb - Lq)); /* valid keys, last block */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int b = 0; b < nb; b++)
        mx = _mm512_mask_max_ps(mx, b == nb - 1 ? tail : 0xFFFF, mx, _mm512_loadu_ps(sr + 16 * b));
    const __m512 mlog2e = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * 1.44269504f);
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512 p = _mm512_maskz_mov_ps(b == nb - 1 ? tail : 0xFFFF,
                                             exp16_diff(_mm512_loadu_ps(sr + 16 * b), mlog2e));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i *)(pr + 16 * b), (__m256i)_mm512_cvtneps_pbh(p));
    }
    for (int b = nb; b < 2 * n32; b++) _mm256_storeu_si256((__m256i *)(pr + 16 * b), _mm256_setzero_si256());
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* The attention's groups of 32 rows (ng of them, the last of last rows; row i of a chunk
 * at pos scores pos + i + 1 keys) dealt to nth threads one way (0: round robin, 1: a snake,
 * the order turning back every nth groups, 2: longest first to the least loaded) into
 * owner[ng]; returns the most loaded thread's cost (a row: its keys plus 32). */
static double deal_way(int way, int ng, int last, int pos, int nth, int *owner, double *load) {
    double most = 0;
    for (int th = 0; th < nth; th++) load[th] = 0;
    for (int n = 0; n < ng; n++) {
        const int j = way == 2 ? ng - 1 - n : n, k = j % nth, rows = j == ng - 1 ? last : 32;
        int th = way == 1 && j / nth % 2 ? nth - 1 - k : k;
        if (way == 2) {
            th = 0;
            for (int o = 1; o < nth; o++) th = load[o] < load[th] ? o : th;
        }
        owner[j] = th;
        load[th] += rows * (pos + 32.0 * j + rows / 2.0 + 32);
        most = load[th] > most ? load[th] : most;
    }
    return most;
}

/* deal_way's best way into owner[ng], or 0 where even that leaves a thread more than 5%
 * above the mean. */
static int deal_groups(int ng, int last, int pos, int nth, int *owner) {
    double load[nth], most[3], total = 0;
    int best = 0;
    for (int way = 0; way < 3; way++) {
        most[way] = deal_way(way, ng, last, pos, nth, owner, load);
        best = most[way] < most[best] ? way : best;
    }
    deal_way(best, ng, last, pos, nth, owner, load);
    for (int th = 0; th < nth; th++) total += load[th];
    return most[best] <= 1.05 * total / nth;
}

/* The owners of a chunk's groups of 32 rows (t rows at pos, deal_groups) among nth threads,
 * in a new array; NULL where they are dealt no way (one thread, fewer than 2 groups a thread,
 * no balanced deal, no memory): then each step splits its rows or columns as it would. */
static int *deal_rows(int t, int pos, int nth) {
    const int ng = (t + 31) / 32;
    int *owner = nth > 1 && ng >= 2 * nth ? malloc(sizeof(int) * ng) : NULL;
    if (owner && !deal_groups(ng, t - 32 * (ng - 1), pos, nth, owner)) {
        free(owner);
        owner = NULL;
    }
    return owner;
}

/* Row i of the AMX attention's step 1 in one pass (position p): k rotated and v into the
 * float32 caches at p, each q head rotated, scaled and split into bf16 hi and lo at qhi and
 * qlo (heads qs apart; qhi NULL: no q). RoPE's cos and sin as vectors, no row buffers: the
 * operations of rope_kv_row and head_in in the same order, so the same bits. d % 32 == 0,
 * d <= 128. */
static void rope_row_amx(const uint16_t *x, int p, int n_head, int n_kv, int d, int max_seq,
                         const float *cos, const float *sin, int neox, float scale, float *kc,
                         float *vc, uint16_t *qhi, uint16_t *qlo, size_t qs) {
    const int h2 = d / 2, nj = d / 16;
    const float *cr = cos + (size_t)p * h2, *sr = sin + (size_t)p * h2;
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i even_sign = _mm512_set_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN,
                                               0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN);
    __m512 c[8], s[8];
    for (int j = 0; j < nj; j++) {
        if (neox) { /* (i, i + d/2): cos i on both, -sin i on the first, sin i on the second */
            c[j] = _mm512_loadu_ps(cr + 16 * j % h2);
            s[j] = _mm512_loadu_ps(sr + 16 * j % h2);
            if (16 * j < h2) s[j] = _mm512_castsi512_ps(_mm512_xor_si512(
                                        _mm512_castps_si512(s[j]), _mm512_set1_epi32(INT32_MIN)));
        } else { /* (2i, 2i + 1) */
            c[j] = _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(0xFF, cr + 8 * j));
            s[j] = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(0xFF, sr + 8 * j))),
                even_sign));
        }
    }
#define ROTATED(hx, j) /* x * c + partner(x) * s, no contraction (head_in's rounding) */ \
    _mm512_add_ps(_mm512_mul_ps(bf16x16_load((hx) + 16 * (j)), c[j]),                       \
                  _mm512_mul_ps(neox ? bf16x16_load((hx) + (16 * (j) + h2) % d)              \
                                     : _mm512_permute_ps(bf16x16_load((hx) + 16 * (j)), 0xB1), \
                                s[j]))
    for (int g = 0; g < n_kv; g++) {
        const size_t at = ((size_t)g * max_seq + p) * d;
        const uint16_t *xk = x + (size_t)(n_head + g) * d, *xv = x + (size_t)(n_head + n_kv + g) * d;
        for (int j = 0; j < nj; j++) {
            _mm512_storeu_ps(kc + at + 16 * j, ROTATED(xk, j));
            _mm512_storeu_ps(vc + at + 16 * j, bf16x16_load(xv + 16 * j));
        }
    }
    for (int h = 0; h < n_head && qhi; h++) {
        const uint16_t *xq = x + (size_t)h * d;
        for (int j = 0; j < nj; j++) {
            __m512 v = ROTATED(xq, j);
            if (scale != 1.0f) v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
            const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
            _mm256_storeu_si256((__m256i *)(qhi + h * qs + 16 * j), hi);
            _mm256_storeu_si256((__m256i *)(qlo + h * qs + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
        }
    }
#undef ROTATED
}

static int attn_prefill_amx(const uint16_t *qkv, int t, float *kc, float *vc, int pos,
                            int n_head, int n_kv, int d, int max_seq, const float *cos,
                            const float *sin, int neox, int q_from, uint16_t *out, int out_tiles,
                            const int *owner) {
    const int rep = n_head / n_kv, L = pos + t, nk32 = (L + 31) / 32, nk16 = 2 * nk32;
    const int row = (n_head + 2 * n_kv) * d, nc = d / 32, nd = d / 16;
    const int tq = t - q_from, tq16 = (tq + 15) / 16 * 16, nqb = tq16 / 16;
    const int ldS = (nk16 + 3) / 4 * 64, ldP = nk32 * 32; /* floats / bf16 per row */
    const float scale = 1.0f / sqrtf((float)d);
    const int nth = omp_get_max_threads();
    const size_t qsz = (size_t)n_head * tq16 * d, ksz = (size_t)n_kv * nk16 * nc * 512;
    uint16_t *Qb = aligned_alloc(64, sizeof(uint16_t) * 2 * qsz); /* hi | lo */
    uint16_t *KB = aligned_alloc(64, sizeof(uint16_t) * 2 * ksz); /* hi | lo */
    uint16_t *VB = aligned_alloc(64, sizeof(uint16_t) * (size_t)n_kv * nk32 * nd * 512);
    const size_t per_thread = 16 * (size_t)ldS * 4 + 16 * (size_t)ldP * 2 + 16 * (size_t)d * 4;
    char *work = aligned_alloc(64, (per_thread + 63) / 64 * 64 * nth);
    /* With owner (deal_rows(t, pos, nth), q_from 0): rows in groups of 32 (a group: one key
     * block of step 2, two query blocks of step 3), each group's three steps on its owner,
     * so that the rows a thread rotated, the keys it made tiles of and the queries it scores
     * stay in its caches (same sums; docs/performance.md, "Each thread's own rows in the
     * attention"). Without: contiguous rows and key blocks a thread, and the tasks to
     * whichever thread is free. */
    const int ng = (tq16 + 31) / 32, by_group = owner && q_from == 0;
    if (!Qb || !KB || !VB || !work) {
        free(Qb), free(KB), free(VB), free(work);
        return -1;
    }
    int next_task = 0; /* the tasks taken so far, without groups */
#pragma omp parallel
    {
        FTZ_BEGIN
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        const int grouped = by_group && team == nth; /* (the same in every thread) */
        /* 1. RoPE; k, v -> float32 cache; scaled q -> bf16 rows of Qb */
        pf_begin(PF_ROPE);
        const int nrow = tq16 + q_from, r0 = grouped ? 0 : nrow * me / team;
        const int r1 = grouped ? nrow : nrow * (me + 1) / team;
        for (int i = r0; i < r1; i++) {
            if (grouped && owner[i / 32] != me) continue;
            if (i >= t) { /* padding rows of the last query block */
                for (int h = 0; h < n_head; h++) {
                    memset(Qb + ((size_t)h * tq16 + i - q_from) * d, 0, sizeof(uint16_t) * d);
                    memset(Qb + qsz + ((size_t)h * tq16 + i - q_from) * d, 0, sizeof(uint16_t) * d);
                }
                continue;
            }
            uint16_t *qh = i >= q_from ? Qb + (size_t)(i - q_from) * d : NULL;
            rope_row_amx(qkv + (size_t)i * row, pos + i, n_head, n_kv, d, max_seq, cos, sin, neox,
                         scale, kc, vc, qh, qh ? qh + qsz : NULL, (size_t)tq16 * d);
        }
        pf_barrier();
        pf_phase = PF_CACHE;
        /* 2. the cache (positions 0..L-1) -> bf16 tiles KB, VB */
        const int ngb = n_kv * nk32, gb0 = grouped ? 0 : ngb * me / team;
        const int gb1 = grouped ? ngb : ngb * (me + 1) / team;
        for (int gb = gb0; gb < gb1; gb++) {
            const int g = gb / nk32, b = gb % nk32; /* keys 32 b .. 32 b + 31 */
            /* by group: the thread that wrote the keys' rows (an earlier chunk's: any) */
            if (grouped) {
                const int grp = (32 * b - pos) / 32;
                if ((32 * b < pos ? b % team : owner[grp < ng ? grp : ng - 1]) != me) continue;
            }
            const float *k = kc + (size_t)g * max_seq * d, *v = vc + (size_t)g * max_seq * d;
            for (int half = 0; half < 2; half++) {
                const int kb = 2 * b + half;
                for (int c = 0; c < nc; c++) {
                    uint32_t *tile = (uint32_t *)(KB + (((size_t)g * nk16 + kb) * nc + c) * 512);
                    uint32_t *tlo = tile + ksz / 2;
                    __m512i ph[16], pl[16];
                    for (int n = 0; n < 16; n++) {
                        const int l = 16 * kb + n;
                        __m512i p = _mm512_setzero_si512(), plo = p;
                        if (l < L) {
                            const float *kr = k + (size_t)l * d + 32 * c;
                            const __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16);
                            const __m512 h0 = bf16_round(k0), h1 = bf16_round(k1);
                            /* 32 bf16 in order: u32 j = the pair (2j, 2j + 1) */
                            p = (__m512i)_mm512_cvtne2ps_pbh(h1, h0);
                            plo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(k1, h1), _mm512_sub_ps(k0, h0));
                        }
                        ph[n] = p, pl[n] = plo;
                    }
                    /* key n's pairs are column n of the tile (16 scatters each, before: the
                     * step took 1.5x as long) */
                    transpose16(ph);
                    transpose16(pl);
                    for (int r = 0; r < 16; r++) {
                        _mm512_storeu_si512(tile + 16 * r, ph[r]);
                        _mm512_storeu_si512(tlo + 16 * r, pl[r]);
                    }
                }
            }
            const __m512i interleave = _mm512_set_epi16(
                31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int db = 0; db < nd; db++) {
                uint32_t *tile = (uint32_t *)(VB + (((size_t)g * nk32 + b) * nd + db) * 512);
                for (int r = 0; r < 16; r++) {
                    const int l0 = 32 * b + 2 * r;
                    const __m512 v0 = l0 < L ? _mm512_loadu_ps(v + (size_t)l0 * d + 16 * db)
                                             : _mm512_setzero_ps();
                    const __m512 v1 = l0 + 1 < L ? _mm512_loadu_ps(v + (size_t)(l0 + 1) * d + 16 * db)
                                                 : _mm512_setzero_ps();
                    /* u32 n = (v0[n], v1[n]): the two rows' bf16 interleaved */
                    _mm512_storeu_si512(tile + 16 * r, _mm512_permutexvar_epi16(
                        interleave, (__m512i)_mm512_cvtne2ps_pbh(v1, v0)));
                }
            }
        }
        /* 3. one query head x 16 rows per task, longest (last) blocks first */
        char *mine = work + (per_thread + 63) / 64 * 64 * omp_get_thread_num();
        float *S = (float *)mine;
        uint16_t *P = (uint16_t *)(mine + 16 * (size_t)ldS * 4);
        float *O = (float *)(mine + 16 * (size_t)ldS * 4 + 16 * (size_t)ldP * 2);
        pf_barrier();
        pf_phase = PF_TASKS;
        amx_tiles_16x64();
        const int ntask = n_head * nqb;
#define NEXT_TASK(j) (grouped ? (j) + 1 : __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED))
        for (int task = grouped ? 0 : NEXT_TASK(0); task < ntask; task = NEXT_TASK(task)) {
            const int h = task % n_head, qb = nqb - 1 - task / n_head, g = h / rep;
            if (grouped && owner[qb / 2] != me) continue;
            const int i0 = q_from + 16 * qb, rows = t - i0 < 16 ? t - i0 : 16;
            const int Lmax = pos + i0 + rows, m16 = (Lmax + 15) / 16, m32 = (Lmax + 31) / 32;
            const uint16_t *q = Qb + ((size_t)h * tq16 + 16 * qb) * d;
            const uint16_t *kg = KB + (size_t)g * nk16 * nc * 512;
            const uint16_t *vg = VB + (size_t)g * nk32 * nd * 512;
#define KT(kb, c) (kg + ((size_t)(kb) * nc + (c)) * 512)
            /* scores in three bf16 products, q k ~ qh kh + ql kh + qh kl (hi/lo splits: about
             * 16 significant bits; one bf16 product alone skews the softmax) */
#define QK3(j, acc) /* acc: tile 4 + j, a literal (the intrinsics paste it into asm) */ \
    if (kb + j < m16) { \
        _tile_loadd(1, KT(kb + j, c), 64); \
        _tile_loadd(2, KT(kb + j, c) + ksz, 64); \
        _tile_dpbf16ps(acc, 0, 1); \
        _tile_dpbf16ps(acc, 3, 1); \
        _tile_dpbf16ps(acc, 0, 2); \
    }
            for (int kb = 0; kb < m16; kb += 4) {
                _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                for (int c = 0; c < nc; c++) {
                    _tile_loadd(0, q + 32 * c, d * 2);
                    _tile_loadd(3, q + qsz + 32 * c, d * 2);
                    QK3(0, 4) QK3(1, 5) QK3(2, 6) QK3(3, 7)
                }
                _tile_stored(4, S + 16 * kb, ldS * 4);
                if (kb + 1 < m16) _tile_stored(5, S + 16 * (kb + 1), ldS * 4);
                if (kb + 2 < m16) _tile_stored(6, S + 16 * (kb + 2), ldS * 4);
                if (kb + 3 < m16) _tile_stored(7, S + 16 * (kb + 3), ldS * 4);
            }
#undef QK3
#undef KT
            float inv[16];
            for (int r = 0; r < 16; r++) {
                uint16_t *pr = P + (size_t)r * ldP;
                if (r >= rows) {
                    memset(pr, 0, sizeof(uint16_t) * 32 * m32);
                    continue;
                }
                inv[r] = softmax_row_bf16(S + (size_t)r * ldS, pos + i0 + r + 1, pr, m32);
            }
#define VT(kb, db) (vg + ((size_t)(kb) * nd + (db)) * 512)
            for (int db = 0; db < nd; db += 4) {
                _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                for (int kb = 0; kb < m32; kb++) {
                    _tile_loadd(0, P + 32 * kb, ldP * 2);
                    _tile_loadd(1, VT(kb, db), 64);
                    _tile_dpbf16ps(4, 0, 1);
                    if (db + 1 < nd) { _tile_loadd(2, VT(kb, db + 1), 64); _tile_dpbf16ps(5, 0, 2); }
                    if (db + 2 < nd) { _tile_loadd(3, VT(kb, db + 2), 64); _tile_dpbf16ps(6, 0, 3); }
                    if (db + 3 < nd) { _tile_loadd(1, VT(kb, db + 3), 64); _tile_dpbf16ps(7, 0, 1); }
                }
                _tile_stored(4, O + 16 * db, d * 4);
                if (db + 1 < nd) _tile_stored(5, O + 16 * (db + 1), d * 4);
                if (db + 2 < nd) _tile_stored(6, O + 16 * (db + 2), d * 4);
                if (db + 3 < nd) _tile_stored(7, O + 16 * (db + 3), d * 4);
            }
#undef VT
            for (int r = 0; r < rows; r++) {
                const int i = i0 + r - q_from;
                const __m512 w = _mm512_set1_ps(inv[r]);
                for (int e = 0; e < d; e += 16) {
                    const size_t at = out_tiles ? a_tile_at(i, h * d + e, n_head * d / 32)
                                                : ((size_t)i * n_head + h) * d + e;
                    bf16n_store(out + at, _mm512_mul_ps(_mm512_loadu_ps(O + (size_t)r * d + e), w));
                }
            }
        }
#undef NEXT_TASK
        pf_barrier();
        _tile_release();
        FTZ_END
    }
    free(Qb), free(KB), free(VB), free(work);
    return 0;
}

/* ---- AMX GEMM and the whole prefill layer -----------------------------------------------
 *
 * Weights for the layer kernel are AMX B tiles of bf16: W [N, K] -> [N / 16][K / 32][16][16][2]
 * (tile (j, c): row r, column n = W[16 j + n][32 c + 2r + {0,1}]), held as such or as 4/8-bit
 * codes in the same order, expanded per column block (amx_weight, below);
 * the gate/up weight interleaves its tiles (gate tile j, up tile j, ...) so that one 32-column
 * block holds matching gate and up columns. Activations (A) are bf16 rows of K; row blocks of
 * 32 read whole blocks, so A buffers need 32 rows of padding past the last row used.
 * One microkernel: 32 rows x 32 columns (tiles 0-1 = A, 2-3 = B, 4-7 = C), float32
 * accumulation, then an epilogue on the 32 x 32 block; threads split the column blocks. */

enum { EPI_BF16 = 0, EPI_ADD = 1, EPI_SWIGLU = 2 };
#ifndef AMX_PASS_BYTES
#define AMX_PASS_BYTES (1 << 20) /* A rows a pass of amx_gemm */
#endif

/* A weight for amx_gemm: bf16 B tiles, or 4/8-bit codes in the same tile order expanded
 * to bf16 tiles per column block as the GEMM goes (a third / a half of the bytes to read).
 *   AMXW_BF16: t = bf16 tiles [N/16][K/32][16][16][2];
 *   AMXW_Q8:   t = int8 [N/16][K/32][16 rows][32]: byte 2n + e of row r = the code of
 *              (column n, k 2r + e), the bf16 tile row's order;
 *   AMXW_Q4:   t = uint8 [N/16][K/32][16 rows][16]: byte i = byte i of the Q8 row (columns
 *              0..7) | byte 16 + i of it (columns 8..15) << 4 (codes 0..15), so that a row's
 *              two halves come out of one load already in the tile's order;
 *   d, m:      float32 [N/16][K/32][16]: value = code * d + m (m NULL: 0), rounded to bf16,
 *              the bf16 copy's value bit for bit (code * d is exact in float32);
 *   AMXW_Q4_G16, AMXW_Q8_G16: the same codes with a scale (and offset) per 16 k, as the
 *              K-quants with sub-blocks of 16 have them: d, m float32 [N/16][K/16][16] (a
 *              tile's rows 0-7 hold k 0-15 of its 32, rows 8-15 k 16-31). */
enum { AMXW_BF16 = 0, AMXW_Q4 = 1, AMXW_Q8 = 2, AMXW_Q4_G16 = 3, AMXW_Q8_G16 = 4 };
typedef struct {
    int kind;
    const void *t;
    const float *d, *m;
} amx_weight;

/* Tile (j, c) of a quantized weight (16 columns x 32 k) -> one bf16 tile at out. A row's
 * 32 values are two vectors of 16 floats, x (columns 0..7, k 2r and 2r + 1 in turn) and y
 * (columns 8..15), each with its columns' scales doubled; cvtne2ps puts them side by side,
 * which is the tile row (no word permute). */
static inline void amx_expand_tile(const amx_weight *w, int j, int c, int nkc, uint16_t *out) {
    const __m512i ix = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i iy = _mm512_add_epi32(ix, _mm512_set1_epi32(8));
    const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const size_t tile = (size_t)j * nkc + c;
    const int g16 = w->kind >= AMXW_Q4_G16, q4 = w->kind == AMXW_Q4 || w->kind == AMXW_Q4_G16;
    const size_t at = 16 * (tile << g16); /* g16: two sets of 16 scales a tile */
    __m512 dx, dy, mx, my;
    uint32_t *o = (uint32_t *)out;
    for (int r = 0; r < 16; r++) {
        if (r == 0 || (g16 && r == 8)) { /* g16, rows 8..15: k 16..31, the second scales */
            const size_t s = at + (r ? 16 : 0);
            const __m512 d = _mm512_loadu_ps(w->d + s);
            const __m512 m = w->m ? _mm512_loadu_ps(w->m + s) : _mm512_setzero_ps();
            dx = _mm512_permutexvar_ps(ix, d), dy = _mm512_permutexvar_ps(iy, d);
            mx = _mm512_permutexvar_ps(ix, m), my = _mm512_permutexvar_ps(iy, m);
        }
        __m512 fx, fy; /* the codes as floats */
        if (q4) { /* a nibble's value from a table by vpermps, which reads its index's low 4
                   * bits: no mask, no cvtdq2ps (the prefill 0.968 of the time with them) */
            const __m512i b = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)((const uint8_t *)w->t + tile * 256 + 16 * r)));
            fx = _mm512_permutexvar_ps(b, levels);
            fy = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), levels);
        } else {
            const int8_t *p = (const int8_t *)w->t + tile * 512 + 32 * r;
            fx = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            fy = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        }
        const __m512 vx = _mm512_fmadd_ps(fx, dx, mx);
        const __m512 vy = _mm512_fmadd_ps(fy, dy, my);
        /* bf16, nearest even (the values are never float32 denormals) */
        _mm512_store_si512(o + 16 * r, (__m512i)_mm512_cvtne2ps_pbh(vy, vx));
    }
}

/* The epilogue of rows r0..r1-1 of a 32 x 32 block (C tiles stored in buf: rows 0-15 in
 * buf[0] | buf[1], rows 16-31 in buf[2] | buf[3]) at rows mb.., column block nb of out
 * (EPI_SWIGLU's out as A tiles of ldo columns when out_tiles). */
static inline void amx_epilogue(float (*buf)[256], int r0, int r1, int mb, int nb, int epi,
                                void *out, int ldo, int out_tiles) {
    for (int r = r0; r < r1; r++) {
        const __m512 c0 = _mm512_load_ps(buf[(r >> 4) * 2] + (r & 15) * 16);
        const __m512 c1 = _mm512_load_ps(buf[(r >> 4) * 2 + 1] + (r & 15) * 16);
        const size_t row = (size_t)(mb + r) * ldo;
        if (epi == EPI_BF16) {
            uint16_t *o = (uint16_t *)out + row + 32 * nb;
            bf16n_store(o, c0);
            bf16n_store(o + 16, c1);
        } else if (epi == EPI_ADD) {
            float *o = (float *)out + row + 32 * nb;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), c0));
            _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), c1));
        } else {
            uint16_t *o = (uint16_t *)out + (out_tiles ? a_tile_at(mb + r, 16 * nb, ldo / 32)
                                                       : row + 16 * nb);
            bf16n_store(o, _mm512_mul_ps(silu16(c0), c1));
        }
    }
}

/* amx_gemm's layouts: A as tiles (a_tile_at) rather than rows; EPI_SWIGLU's out likewise */
enum { AMX_A_TILES = 1, AMX_OUT_TILES = 2 };

/* Inside a parallel region (tiles configured): rows 0..M-1 of A [*, K] bf16 (rows, or tiles:
 * tiles & AMX_A_TILES, each A tile one contiguous load instead of 16 rows K apart) times the
 * weight's N columns; column blocks of 32 split over the threads, or with owner (deal_rows)
 * every column block for the groups of 32 rows each thread owns, and the last row block's
 * column blocks split (ends with a barrier).
 * EPI_BF16: out bf16 [M, ldo] = C; EPI_ADD: out float32 [M, ldo] += C; EPI_SWIGLU: out bf16
 * [M, ldo] column 16 b + n = silu(C[:, 32 b + n]) * C[:, 32 b + 16 + n] (gate | up tiles).
 * Software-pipelined: a block's C tiles go to one of two buffers, and its epilogue runs a few
 * rows per k step of the next block's products (AVX-512 and AMX busy at once; an epilogue
 * right after its tile stores waited for them and left the AMX unit idle: half the time).
 * Returns 0, or -1 when this thread could not allocate its expansion buffer. */
static int amx_gemm(const uint16_t *A, int M, int K, const amx_weight *w, int N, int epi,
                    void *out, int ldo, int tiles, const int *owner) {
    const int nkc = K / 32, nb32 = N / 32;
    float buf[2][4][256] __attribute__((aligned(64)));
    /* quantized weights: a column block's 2 nkc tiles expanded into xb by its first row
     * block, two per k step just before their products (then in L1 for the next row blocks;
     * expanding the next block's tiles during this one's products, into a second buffer,
     * pushed this block's tiles and A rows out of L1, and was no faster) */
    const int quant = w->kind != AMXW_BF16, ntile = 2 * nkc;
    uint16_t *xb = quant ? aligned_alloc(64, (size_t)ntile * 1024) : NULL;
    const int fail = quant && !xb;
    /* the column blocks' static split (of omp for), or with owner every column block for
     * the row blocks of the groups this thread owns */
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int nb_lo = owner ? 0 : (int)((long)nb32 * tid / nth);
    const int nb_hi = owner ? nb32 : (int)((long)nb32 * (tid + 1) / nth);
    const int per_step = (32 + nkc - 1) / nkc; /* epilogue rows per k step */
    /* rows in passes whose A rows fit in L2 next to the weight tiles: every column block
     * re-reads its pass's A rows (from L3 when A is larger: 0.4 against 1.2 TFLOP/s) */
    int pass = AMX_PASS_BYTES / (K * 2) / 32 * 32;
    pass = pass < 32 ? 32 : pass;
    const int at = tiles & AMX_A_TILES, ot = tiles & AMX_OUT_TILES;
    const int lda = at ? 64 : K * 2; /* an A tile's row stride */
    const size_t as = at ? 512 : 32;  /* from one A tile to the next along k */
    int cb = 0;                                     /* C buffer */
    int p_rows = 0, p_done = 0, p_mb = 0, p_nb = 0; /* the pending epilogue (buf[1 - cb]) */
    /* with owner, the last row block (the odd one out of the dealt groups, often short)
     * split by column blocks as without: dealt whole, it made its owner's share the longer
     * (SmolLM2's 203 rows: 3 blocks and 11 rows against 3 blocks) */
    const int shared = owner ? (M - 1) / 32 : -1;
    const int sh_lo = (int)((long)nb32 * tid / nth), sh_hi = (int)((long)nb32 * (tid + 1) / nth);
#define MINE(mb, nb) (!owner || ((mb) / 32 == shared ? (nb) >= sh_lo && (nb) < sh_hi \
                                                     : owner[(mb) / 32] == tid))
    for (int m0 = 0; m0 < M && !fail; m0 += pass) {
        const int m1 = M - m0 < pass ? M : m0 + pass;
        for (int nb = nb_lo; nb < nb_hi; nb++) {
            int first = m0; /* the column block's first row block here (expands its tiles) */
            while (first < m1 && !MINE(first, nb)) first += 32;
            if (first >= m1) continue;
            const uint16_t *b0 = quant ? xb : (const uint16_t *)w->t + (size_t)(2 * nb) * nkc * 512;
            const uint16_t *b1 = b0 + (size_t)nkc * 512;
            for (int mb = first; mb < m1; mb += 32) {
                if (!MINE(mb, nb)) continue;
                /* the A tiles of rows mb.. and mb + 16.. at a0, a1 + kc * as */
                const uint16_t *a0 = A + (at ? a_tile_at(mb, 0, nkc) : (size_t)mb * K);
                const uint16_t *a1 = a0 + (at ? (size_t)nkc * 512 : (size_t)16 * K);
                float (*pend)[256] = buf[1 - cb];
                /* a last block of at most 16 rows: the products of its first A tile only
                 * (SmolLM2's 203-row prefill on an AMX VM: 31.2 against 31.6 ms) */
                const int two = M - mb > 16;
                _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                for (int kc = 0; kc < nkc; kc++) {
                    if (quant && mb == first) {
                        amx_expand_tile(w, 2 * nb, kc, nkc, xb + (size_t)kc * 512);
                        amx_expand_tile(w, 2 * nb + 1, kc, nkc, xb + (size_t)(nkc + kc) * 512);
                    }
                    /* every operand by tileloaddt1 (a hint that it is not read again soon):
                     * with plain loads the A tiles streaming through L1 pushed out the column
                     * block's B tiles before the next row block could reuse them (SmolLM2's
                     * 203-row prefill: 0.927 of the time with A streamed, 0.992 of that with B
                     * streamed too) */
                    _tile_stream_loadd(0, a0 + as * kc, lda);
                    _tile_stream_loadd(2, b0 + (size_t)kc * 512, 64);
                    _tile_stream_loadd(3, b1 + (size_t)kc * 512, 64);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(5, 0, 3);
                    if (two) {
                        _tile_stream_loadd(1, a1 + as * kc, lda);
                        _tile_dpbf16ps(6, 1, 2);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                    if (p_done < p_rows) {
                        const int r1 = p_done + per_step < p_rows ? p_done + per_step : p_rows;
                        amx_epilogue(pend, p_done, r1, p_mb, p_nb, epi, out, ldo, ot);
                        p_done = r1;
                    }
                }
                amx_epilogue(pend, p_done, p_rows, p_mb, p_nb, epi, out, ldo, ot);
                _tile_stored(4, buf[cb][0], 64);
                _tile_stored(5, buf[cb][1], 64);
                if (two) {
                    _tile_stored(6, buf[cb][2], 64);
                    _tile_stored(7, buf[cb][3], 64);
                }
                p_rows = M - mb < 32 ? M - mb : 32, p_done = 0, p_mb = mb, p_nb = nb;
                cb = 1 - cb;
            }
        }
    }
    amx_epilogue(buf[1 - cb], p_done, p_rows, p_mb, p_nb, epi, out, ldo, ot);
#undef MINE
    pf_barrier();
    free(xb);
    return fail;
}

/* RmsNorm of rows 0..t-1 of h [*, k] -> bf16 A tiles out, contiguous rows a thread or (owner)
 * the groups of 32 it owns (ends with a barrier) */
static void rmsnorm_rows_bf16(float *h, int t, int k, const float *w, float eps, uint16_t *out,
                              const int *owner) {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int i = owner ? 0 : t * tid / nth; i < (owner ? t : t * (tid + 1) / nth); i++)
        if (!owner || owner[i / 32] == tid)
            add_rmsnorm_row(h + (size_t)i * k, NULL, k, w, eps, out + a_tile_at(i, 0, k / 32), 2,
                            512);
    pf_barrier();
}

/* Test hook: out = A [M, K] x W^T through amx_gemm (A with 32 rows of padding); 0 or -1. */
int qlib_amx_gemm(const uint16_t *A, int M, int K, int kind, const void *tiles, const float *d,
                  const float *m, int N, int epi, void *out, int ldo) {
    const amx_weight w = {kind, tiles, d, m};
    int fail = 0;
#pragma omp parallel reduction(| : fail)
    {
        FTZ_BEGIN
        amx_tiles_16x64();
        fail |= amx_gemm(A, M, K, &w, N, epi, out, ldo, 0, NULL);
        _tile_release();
        FTZ_END
    }
    return fail ? -1 : 0;
}

/* One llama layer of a prefill chunk of t rows (positions pos..pos+t-1), AMX throughout:
 *   a = RmsNorm(h) (bf16) -> qkv = a Wqkv^T (bf16) -> RoPE, KV cache, attention (rows
 *   q_from..t-1) -> y; h[q_from:] += y Wo^T (float32) -> a = RmsNorm(h[q_from:]) ->
 *   g = silu(a Wg^T) * (a Wu^T) (bf16) -> h[q_from:] += g Wd^T.
 * h [t, k] float32 (the residual stream); a [t + 32, k], qkv [t + 32, n_qkv], y [t + 32,
 * n_head d], g [t + 32, n_ff] bf16 scratch (a, y and g, the GEMMs' A operands, held as AMX
 * A tiles: a_tile_at). ws: the 4 weights wqkv, wo, w13 (tiles
 * interleaved), w2, as amx_weight. owner (deal_rows, or NULL): the threads' groups of 32
 * rows for the first RmsNorm, the qkv GEMM (split by rows, not columns), the attention, wo
 * (by rows) and the second RmsNorm (q_from 0).
 * Needs k, n_qkv, n_head d, n_ff % 32 == 0 and d % 32 == 0. Returns 0 or -1. */
static int prefill_layer(float *h, int t, int k, const float *attn_norm, const float *ffn_norm,
                       float eps, const amx_weight *ws, int n_qkv, int n_ff, uint16_t *a,
                       uint16_t *qkv, uint16_t *y, uint16_t *g, float *kc, float *vc, int pos,
                       int n_head, int n_kv, int d, int max_seq, const float *cos,
                       const float *sin, int neox, int q_from, const int *owner) {
    const int nd = n_head * d, nth = omp_get_max_threads();
    const amx_weight *wqkv = ws, *wo = ws + 1, *w13 = ws + 2, *w2 = ws + 3;
    int fail = 0;
    if (k % 32 || n_qkv % 32 || nd % 32 || n_ff % 32 || d % 32 || q_from < 0 || q_from >= t ||
        n_qkv != (n_head + 2 * n_kv) * d)
        return -1;
#pragma omp parallel reduction(| : fail)
    {
        FTZ_BEGIN
        amx_tiles_16x64();
        /* the norm, the qkv GEMM and the attention's rotation by the same groups of rows
         * where they are dealt: each thread's qkv rows stay in its caches (the qkv GEMM's
         * tiles then expanded by every thread: still faster) */
        const int *own = owner && omp_get_num_threads() == nth ? owner : NULL;
        pf_begin(PF_NORM1);
        rmsnorm_rows_bf16(h, t, k, attn_norm, eps, a, own);
        pf_phase = PF_QKV;
        fail |= amx_gemm(a, t, k, wqkv, n_qkv, EPI_BF16, qkv, n_qkv, AMX_A_TILES, own);
        _tile_release();
        FTZ_END
    }
    if (fail) return -1;
    if (attn_prefill_amx(qkv, t, kc, vc, pos, n_head, n_kv, d, max_seq, cos, sin, neox, q_from, y,
                         1, owner))
        return -1;
    const int m = t - q_from;
    float *hm = h + (size_t)q_from * k;
#pragma omp parallel reduction(| : fail)
    {
        FTZ_BEGIN
        amx_tiles_16x64();
        /* wo split by rows too where they are dealt (its A rows are the attention's output of
         * this thread's groups), so that the second RmsNorm reads residual rows this thread
         * wrote; gate/up and down split by columns (split by rows, each thread would expand
         * every one of their tiles) */
        const int *own = owner && q_from == 0 && omp_get_num_threads() == nth ? owner : NULL;
        pf_begin(PF_WO);
        fail |= amx_gemm(y, m, nd, wo, k, EPI_ADD, hm, k, AMX_A_TILES, own);
        pf_phase = PF_NORM2;
        rmsnorm_rows_bf16(hm, m, k, ffn_norm, eps, a, own);
        pf_phase = PF_W13;
        fail |= amx_gemm(a, m, k, w13, 2 * n_ff, EPI_SWIGLU, g, n_ff, AMX_A_TILES | AMX_OUT_TILES,
                         NULL);
        pf_phase = PF_W2;
        fail |= amx_gemm(g, m, n_ff, w2, k, EPI_ADD, hm, k, AMX_A_TILES, NULL);
        _tile_release();
        FTZ_END
    }
    return fail ? -1 : 0;
}

/* n_layers layers of prefill_layer in one call: layer l's norms at norms[2 l] (attention)
 * and norms[2 l + 1] (FFN), its weights at ws[l], its cache at kv[2 l] (keys) and kv[2 l + 1]
 * (values); rows q_from.. of the last layer only (0: all); the chunk's rows dealt to the
 * threads once (deal_rows) for every layer. Returns 0, or -1 at the first layer that fails. */
int qlib_prefill_layers(float *h, int t, int k, int n_layers, const float *const *norms,
                        float eps, const amx_weight *const *ws, int n_qkv, int n_ff, uint16_t *a,
                        uint16_t *qkv, uint16_t *y, uint16_t *g, float *const *kv, int pos,
                        int n_head, int n_kv, int d, int max_seq, const float *cos,
                        const float *sin, int neox, int q_from) {
    int *owner = deal_rows(t, pos, omp_get_max_threads()), fail = 0;
    for (int l = 0; l < n_layers && !fail; l++)
        fail = prefill_layer(h, t, k, norms[2 * l], norms[2 * l + 1], eps, ws[l], n_qkv, n_ff, a,
                             qkv, y, g, kv[2 * l], kv[2 * l + 1], pos, n_head, n_kv, d, max_seq,
                             cos, sin, neox, l == n_layers - 1 ? q_from : 0, owner);
    free(owner);
    return fail ? -1 : 0;
}
#else
int qlib_amx_init(void) { return -1; }
#endif

/* qlib_attn_prefill with AMX tiles when amx != 0, the build has them and d % 32 == 0;
 * otherwise the float32 kernel. */
int qlib_attn_prefill_ex(const uint16_t *qkv, int t, float *kc, float *vc, int pos, int n_head,
                         int n_kv, int d, int max_seq, const float *cos, const float *sin,
                         int neox, int q_from, uint16_t *out, int amx) {
#ifdef __AMX_BF16__
    if (amx && d % 32 == 0 && d <= 128 && n_head % n_kv == 0 && q_from >= 0 && q_from < t) {
        int *owner = q_from == 0 ? deal_rows(t, pos, omp_get_max_threads()) : NULL;
        const int r = attn_prefill_amx(qkv, t, kc, vc, pos, n_head, n_kv, d, max_seq, cos, sin,
                                       neox, q_from, out, 0, owner);
        free(owner);
        return r;
    }
#endif
    (void)amx;
    return qlib_attn_prefill(qkv, t, kc, vc, pos, n_head, n_kv, d, max_seq, cos, sin, neox,
                             q_from, out);
}

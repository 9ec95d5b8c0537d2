/* qlib CPU prefill kernels: the elementwise and attention work between the bf16 matmuls.
 *
 * FastModel's bf16 prefill runs its matmuls in oneDNN (AMX) on bfloat16 activations;
 * everything between them is here, one call each, parallel over OpenMP threads (torch's
 * pool: the library shares torch's libgomp):
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

static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void bf16x16_store(uint16_t *p, __m512 v) { /* round to nearest even */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* Denormals are slow (microcode assists on every vector op that makes or reads one):
 * each parallel region of these kernels runs with flush-to-zero and denormals-are-zero,
 * and restores the thread's MXCSR at its end. */
#define FTZ_BEGIN const unsigned int mxcsr_saved = _mm_getcsr(); _mm_setcsr(mxcsr_saved | 0x8040);
#define FTZ_END _mm_setcsr(mxcsr_saved);

/* e^x, float32, ~1 ulp on [-87, 88.7]; x clamped to that range (e^-87 = 1.6e-38 is still
 * a normal float): x = n ln2 + r, |r| <= ln2 / 2, degree-7 Taylor polynomial, times 2^n. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Test hook: y[i] = e^x[i] (n % 16 == 0). */
void qlib_exp(const float *x, int n, float *y) {
    for (int i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
}

/* For rows i < t of h [t, k] float32: h += delta (bf16 [t, k], when not NULL); then
 * out[i] = h[i] / sqrt(mean(h[i]^2) + eps) * w, stored as bf16 (out_bf16) or float32. */
void qlib_add_rmsnorm(float *h, const uint16_t *delta, int t, int k, const float *w, float eps,
                      void *out, int out_bf16) {
#pragma omp parallel
    {
    FTZ_BEGIN
#pragma omp for schedule(static)
    for (int i = 0; i < t; i++) {
        float *x = h + (size_t)i * k;
        __m512 ss = _mm512_setzero_ps();
        for (int e = 0; e < k; e += 16) {
            __m512 v = _mm512_loadu_ps(x + e);
            if (delta) {
                v = _mm512_add_ps(v, bf16x16_load(delta + (size_t)i * k + e));
                _mm512_storeu_ps(x + e, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)k + eps));
        for (int e = 0; e < k; e += 16) {
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + e), r),
                                     _mm512_loadu_ps(w + e));
            if (out_bf16)
                bf16x16_store((uint16_t *)out + (size_t)i * k + e, v);
            else
                _mm512_storeu_ps((float *)out + (size_t)i * k + e, v);
        }
    }
    FTZ_END
    }
}

/* gu [t, 2 n_ff] bf16 (gate | up) -> out [t, n_ff] bf16 = silu(gate) * up. */
void qlib_swiglu_bf16(const uint16_t *gu, int t, int n_ff, uint16_t *out) {
#pragma omp parallel
    {
    FTZ_BEGIN
#pragma omp for schedule(static)
    for (int i = 0; i < t; i++) {
        const uint16_t *g = gu + (size_t)i * 2 * n_ff, *u = g + n_ff;
        for (int e = 0; e < n_ff; e += 16) {
            const __m512 x = bf16x16_load(g + e);
            /* 1 / (1 + e^-x): rcp14 and one Newton step (~2^-23 relative), not a divide */
            const __m512 y = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                           exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
            __m512 r = _mm512_rcp14_ps(y);
            r = _mm512_mul_ps(r, _mm512_fnmadd_ps(y, r, _mm512_set1_ps(2.0f)));
            const __m512 s = _mm512_mul_ps(x, r);
            bf16x16_store(out + (size_t)i * n_ff + e, _mm512_mul_ps(s, bf16x16_load(u + e)));
        }
    }
    FTZ_END
    }
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
            rope_tables(cos + (size_t)(pos + i) * (d / 2), sin + (size_t)(pos + i) * (d / 2), d,
                        neox, c, s);
            for (int h = 0; h < n_head && i >= q_from; h++)
                head_in(x + (size_t)h * d, d, c, s, neox, scale, qf + ((size_t)i * n_head + h) * d);
            for (int g = 0; g < n_kv; g++) {
                const size_t at = ((size_t)g * max_seq + pos + i) * d;
                head_in(x + (size_t)(n_head + g) * d, d, c, s, neox, 1.0f, kc + at);
                head_in(x + (size_t)(n_head + n_kv + g) * d, d, NULL, NULL, 0, 1.0f, vc + at);
            }
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

/* qlib CPU decode attention: one query token against a float32 or float16 KV cache.
 *
 * qlib_attn_decode_kv(qkv, kc, vc, pos, ...): RoPE of the token's q and k heads (in place),
 * k and v written to position pos of the caches kc, vc [n_kv, max_seq, d] (float32, or IEEE
 * half with kv_f16: rounded to nearest even), then out[n_head, d] = softmax(q k^T / sqrt(d)) v
 * over positions 0..pos, GQA without copies (query head h reads KV head h / (n_head / n_kv)).
 *
 * Work split (flash-decoding): the positions of each KV head are cut into P pieces of a
 * multiple of 16 positions (P chosen so that n_kv * P tasks fill the OpenMP threads evenly,
 * or pieces of `split` positions when split > 0); a task reads its piece of K and of V once,
 * for all the query heads of its group, and leaves per query head the piece's max score m,
 * sum of e^(s - m) and unnormalized sum of e^(s - m) v. A combine step rescales the pieces
 * by e^(m_c - max m) (with P == 1: out = o / sum).
 * Within a piece (query heads x d / 16 <= 16 accumulators: `piece_1pass`) one pass over
 * blocks of 16 positions: the block's scores (16 vector dot products reduced together, a
 * transpose-add), an online softmax (the running max, accumulators rescaled by e^(m - m')
 * when it grows) and the block's v rows, so K and V stream side by side; with a float32
 * cache the rows ~1 KB ahead of each stream are prefetched (A/B, 30 layers, 2 threads:
 * 8.3 -> 6.5 ms at 2800 positions, 11.6 -> 8.8 at 4096; f16 6.0 -> 5.4 and 8.7 -> 7.3 with
 * the single pass, where prefetching gained nothing). With a float16 cache a block's scores
 * run keys outer (`block_scores_ko`): each k vector converted once in registers for all
 * the group's heads, instead of the block converted into kbuf and re-read per head (A/B,
 * same setting: 5.35 -> 4.52 ms at 2800, 7.21 -> 6.20 at 4096, 2.02 -> 1.61 at 1024;
 * bit-identical). Wider groups, and a float32 cache on AMD CPUs (two_pass_f32, below: their
 * prefetchers follow one stream at a time better than two side by side), take `attn_piece`:
 * three passes, scores of the piece into a buffer (a float32 cache's keys outer too), softmax,
 * then p v (a float32 cache's keys prefetched 16 rows ahead: pf_rows_f32; the values' pass
 * left to the hardware's prefetchers). e^x is the vector exp16 (~1 ulp).
 * d % 16 == 0, d <= 128. Returns 0, or -1 (out of memory). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"


/* The levels of hsum16x16's tree: level 1 pairs rows (2i, 2i + 1), level 2 the results of
 * rows 4i..4i+3, level 3 those of 8i..8i+7, level 4 all 16. Each node depends only on its
 * rows, so a block can be reduced 4 or 8 rows at a time with the same operations. */
static inline __m512 hs_l1(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 hs_l2(__m512 a, __m512 b) {
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline __m512 hs_l34(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

/* v[0..15] -> one vector whose element j is the sum of the 16 elements of v[j] */
static inline __m512 hsum16x16(const __m512 *v) {
    __m512 u[4];
    for (int g = 0; g < 4; g++)
        u[g] = hs_l2(hs_l1(v[4 * g], v[4 * g + 1]), hs_l1(v[4 * g + 2], v[4 * g + 3]));
    return hs_l34(hs_l34(u[0], u[1]), hs_l34(u[2], u[3]));
}

/* Rows b..b+nb-1 of K (one KV head, rows of d) as 16 float32 rows: the cache itself for a
 * whole float32 block, else converted into kbuf (16 d floats; missing rows zero). */
static inline __attribute__((always_inline)) const float *k_block(
        const void *K, int f16, int b, int nb, int d, int nd, float *kbuf) {
    if (!f16 && nb == 16) return (const float *)K + (size_t)b * d;
    for (int j = 0; j < 16; j++)
        for (int i = 0; i < nd; i++)
            _mm512_storeu_ps(kbuf + j * d + 16 * i,
                             j < nb ? load_kv(K, (size_t)(b + j) * d + 16 * i, f16)
                                    : _mm512_setzero_ps());
    return kbuf;
}

/* The 16 scores q_r . k_j * scale of one query head against a block from k_block. */
static inline __attribute__((always_inline)) __m512 block_scores(
        const float *qr, const float *kb, int d, int nd, __m512 vscale) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int i = 0; i < nd; i++) {
        const __m512 qv = _mm512_loadu_ps(qr + 16 * i);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kb + j * d + 16 * i), acc[j]);
    }
    return _mm512_mul_ps(hsum16x16(acc), vscale);
}

/* The 16 scores of each of REP query heads q [REP, d] against the 16 rows of K (float32,
 * or IEEE half with F16) from row b, keys outer: each k vector is loaded (and converted)
 * once, for all the heads, in sub-blocks of KB rows (REP * KB <= 24 accumulators, q's REP
 * vectors of the chunk in registers), each reduced by its levels of hsum16x16's tree as it
 * ends. The same products and sums in the same order as k_block + block_scores, so the
 * same scores bit for bit. */
static inline __attribute__((always_inline)) void block_scores_ko(
        const int REP, const int ND, const int F16, const float *q, const void *K, int b,
        __m512 vscale, __m512 *sv) {
    const int d = 16 * ND;
    enum { KB_MAX = 16 };
    const int KB = REP == 1 ? 16 : REP <= 3 ? 8 : 4;
    __m512 u[4][4]; /* per head: the level-2 nodes of rows 0-3, 4-7, 8-11, 12-15 */
    __m512 w[4][2]; /* per head: the level-3 nodes of rows 0-7, 8-15 */
    for (int s0 = 0; s0 < 16; s0 += KB) {
        __m512 acc[4][KB_MAX];
        for (int r = 0; r < REP; r++)
            for (int j = 0; j < KB; j++) acc[r][j] = _mm512_setzero_ps();
        for (int i = 0; i < ND; i++) {
            __m512 qv[4];
            for (int r = 0; r < REP; r++) qv[r] = _mm512_loadu_ps(q + (size_t)r * d + 16 * i);
            for (int j = 0; j < KB; j++) {
                const __m512 kv = load_kv(K, (size_t)(b + s0 + j) * d + 16 * i, F16);
                for (int r = 0; r < REP; r++) acc[r][j] = _mm512_fmadd_ps(qv[r], kv, acc[r][j]);
            }
        }
        for (int r = 0; r < REP; r++)
            for (int g = 0; g < KB / 4; g++)
                u[r][s0 / 4 + g] = hs_l2(hs_l1(acc[r][4 * g], acc[r][4 * g + 1]),
                                         hs_l1(acc[r][4 * g + 2], acc[r][4 * g + 3]));
        for (int h = s0 / 8; h < (s0 + KB) / 8; h++) /* rows 8h..8h+7 complete */
            for (int r = 0; r < REP; r++) w[r][h] = hs_l34(u[r][2 * h], u[r][2 * h + 1]);
    }
    for (int r = 0; r < REP; r++) sv[r] = _mm512_mul_ps(hs_l34(w[r][0], w[r][1]), vscale);
}

/* Rows ahead that the three passes' K stream of a float32 cache prefetches (software, a 4 KB
 * page = 16 rows of 64 ahead: the hardware's prefetchers stop at page ends). A/B at 2,800
 * positions, SmolLM2's heads, 2 threads, 8 rounds alternating: the 30 layers' attention calls
 * alone 4.97 / 6.66 ms min / median without, 3.55 / 5.16 with 16 rows, 3.69 / 5.55 with 32;
 * inside the whole decode step 8.48 / 9.74 against 8.45 / 9.48 ms (neutral). The A/B hook:
 * qlib_attn_set_prefetch (0: none). The values' pass (weighted_v) has none: its prefetch
 * through prefetch_rows had compiled to nothing, and written out (the thirty-second session,
 * one process alternating, the decode step at 64 / 256 / 1,024 / 2,800 / 4,096 positions) it
 * measured x1.011 / 1.002 / 1.006 / 1.017 / 1.008, slower. */
static int pf_rows_f32 = 16;
void qlib_attn_set_prefetch(int rows) { pf_rows_f32 = rows < 0 ? 16 : rows; }

/* Prefetch the bytes of rows [l, l + n) of a float32 K of rows of d (within l1) */
static inline void prefetch_rows(const void *X, int l, int n, int l1, int d) {
    if (l + n > l1) return;
    const char *p = (const char *)((const float *)X + (size_t)l * d);
    for (size_t off = 0; off < (size_t)n * d * 4; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* A/B hook (qlib_attn_set_keys_outer): 1 (default): a whole block's scores keys outer
 * (block_scores_ko), in a float16 cache's single pass and a float32 cache's three passes;
 * 0: the block converted into kbuf (float16) or read in place, then block_scores per query
 * head (the earlier kernel). Bit-identical either way. Float32, three passes (the AMD
 * default), SmolLM2's heads, in one process alternating: the decode step x0.99-1.00 at 256
 * positions, x0.93-0.98 at 1,024, x0.90-0.94 at 2,800, x0.89-0.91 at 4,096, in fast and slow
 * minutes alike (each k vector loaded once for the group's three heads instead of three
 * times); float32 in one pass keeps the earlier kernel (keys outer measured the same or
 * slower there). */
static int keys_outer = 1;
void qlib_attn_set_keys_outer(int on) { keys_outer = on; }

/* The shapes (R query heads a KV head, N = d / 16) the compile-time kernels are made for, as
 * X(R, N) (one_pass_shape says the same): block_scores_ko's and piece_1pass's dispatch. */
#define ONE_PASS_SHAPES(X)                                                                   \
    X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(1, 8) X(2, 8)

/* A whole block's float32 scores keys outer into s (rows of ld), for the shapes of
 * one_pass_shape: 1 done, 0 not (another shape). */
static int scores_ko(int rep, int nd, const float *q, const void *K, int b, __m512 vscale,
                     float *s, int ld) {
    __m512 sv[4];
#define KO(R, N)                                                                             \
    case N * 8 + R: block_scores_ko(R, N, 0, q, K, b, vscale, sv); break;
    switch (nd * 8 + rep) {
    ONE_PASS_SHAPES(KO)
    default: return 0;
    }
#undef KO
    for (int r = 0; r < rep; r++) _mm512_storeu_ps(s + (size_t)r * ld, sv[r]);
    return 1;
}

/* Scores of the rep query heads q [rep, d] against positions l0..l1-1 of K (one KV head,
 * rows of d): s[r * ld + l - l0] = q_r . k_l * scale. kbuf: 16 d floats. */
static void scores(const float *q, int rep, int d, const void *K, int f16, int l0, int l1,
                   float scale, float *s, int ld, float *kbuf) {
    const int nd = d / 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    const int pf = f16 ? 0 : pf_rows_f32;
    for (int b = l0; b < l1; b += 16) {
        const int nb = l1 - b < 16 ? l1 - b : 16;
        if (pf) prefetch_rows(K, b + pf, 16, l1, d);
        if (!f16 && keys_outer && nb == 16 && scores_ko(rep, nd, q, K, b, vscale, s + (b - l0), ld))
            continue;
        const float *kb = k_block(K, f16, b, nb, d, nd, kbuf);
        for (int r = 0; r < rep; r++)
            _mm512_storeu_ps(s + (size_t)r * ld + (b - l0),
                             block_scores(q + (size_t)r * d, kb, d, nd, vscale));
    }
}

/* o[r] = sum_l p[r * ld + l - l0] v_l for RG heads (compile-time RG, ND = d / 16). */
static inline __attribute__((always_inline)) void weighted_v(
    const int RG, const int ND, const float *p, int ld, const void *V, int f16, int l0, int l1,
    float *o) {
    const int d = 16 * ND;
    __m512 acc[4][8];
    for (int r = 0; r < RG; r++)
        for (int i = 0; i < ND; i++) acc[r][i] = _mm512_setzero_ps();
    for (int l = l0; l < l1; l++) {
        __m512 v[8];
        for (int i = 0; i < ND; i++) v[i] = load_kv(V, (size_t)l * d + 16 * i, f16);
        for (int r = 0; r < RG; r++) {
            const __m512 w = _mm512_set1_ps(p[(size_t)r * ld + (l - l0)]);
            for (int i = 0; i < ND; i++) acc[r][i] = _mm512_fmadd_ps(w, v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int i = 0; i < ND; i++) _mm512_storeu_ps(o + (size_t)r * d + 16 * i, acc[r][i]);
}

/* The same for any rg <= 4, d <= 128 (runtime sizes). */
static void weighted_v_any(int rg, int d, const float *p, int ld, const void *V, int f16, int l0,
                           int l1, float *o) {
    const int nd = d / 16;
    switch (nd * 8 + rg) {
    case 4 * 8 + 1: weighted_v(1, 4, p, ld, V, f16, l0, l1, o); return;
    case 4 * 8 + 2: weighted_v(2, 4, p, ld, V, f16, l0, l1, o); return;
    case 4 * 8 + 3: weighted_v(3, 4, p, ld, V, f16, l0, l1, o); return;
    case 4 * 8 + 4: weighted_v(4, 4, p, ld, V, f16, l0, l1, o); return;
    case 8 * 8 + 1: weighted_v(1, 8, p, ld, V, f16, l0, l1, o); return;
    case 8 * 8 + 2: weighted_v(2, 8, p, ld, V, f16, l0, l1, o); return;
    case 2 * 8 + 1: weighted_v(1, 2, p, ld, V, f16, l0, l1, o); return;
    case 2 * 8 + 2: weighted_v(2, 2, p, ld, V, f16, l0, l1, o); return;
    case 2 * 8 + 3: weighted_v(3, 2, p, ld, V, f16, l0, l1, o); return;
    case 2 * 8 + 4: weighted_v(4, 2, p, ld, V, f16, l0, l1, o); return;
    default: break;
    }
    for (int r = 0; r < rg; r++) { /* other head dims: one head at a time */
        __m512 acc[8];
        for (int i = 0; i < nd; i++) acc[i] = _mm512_setzero_ps();
        for (int l = l0; l < l1; l++) {
            const __m512 w = _mm512_set1_ps(p[(size_t)r * ld + (l - l0)]);
            for (int i = 0; i < nd; i++)
                acc[i] = _mm512_fmadd_ps(w, load_kv(V, (size_t)l * d + 16 * i, f16), acc[i]);
        }
        for (int i = 0; i < nd; i++) _mm512_storeu_ps(o + (size_t)r * d + 16 * i, acc[i]);
    }
}

/* One task: query heads q [rep, d] of one KV head over positions l0..l1-1. Leaves per head r
 * m[r] (max score), sum[r] (sum of e^(s - m)) and o[r * d..] (sum of e^(s - m) v). s: the
 * scores' buffer, rep rows of ld >= round16(l1 - l0) floats; kbuf: 16 d floats. */
static void attn_piece(const float *q, int rep, int d, const void *K, const void *V, int f16,
                       int l0, int l1, float scale, float *s, int ld, float *kbuf, float *m,
                       float *sum, float *o) {
    const int n = l1 - l0;
    scores(q, rep, d, K, f16, l0, l1, scale, s, ld, kbuf);
    for (int r = 0; r < rep; r++) {
        float *p = s + (size_t)r * ld;
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        for (int l = 0; l < n; l += 16) {
            const __mmask16 live = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1);
            vmx = _mm512_mask_max_ps(vmx, live, vmx, _mm512_loadu_ps(p + l));
        }
        const float mx = _mm512_reduce_max_ps(vmx);
        vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int l = 0; l < n; l += 16) { /* e^(s - max); exp16 clamps, so mask the tail */
            const __mmask16 live = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + l), vmx)));
            _mm512_storeu_ps(p + l, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        m[r] = mx;
        sum[r] = _mm512_reduce_add_ps(vsum);
    }
    const int rg_max = d <= 32 ? 4 : d <= 64 ? 4 : 2; /* accumulators: rg * d / 16 <= 16 */
    for (int r = 0; r < rep; r += rg_max) {
        const int rg = rep - r < rg_max ? rep - r : rg_max;
        weighted_v_any(rg, d, s + (size_t)r * ld, ld, V, f16, l0, l1, o + (size_t)r * d);
    }
}

/* Bytes ahead of the K and V streams prefetched by piece_1pass (float32 caches only). */
enum { PREFETCH_AHEAD = 1024 };

/* One task in a single pass (compile-time REP query heads, ND = d / 16, REP * ND <= 16): as
 * attn_piece, over blocks of 16 positions with an online softmax. kbuf: 16 d floats. */
static inline __attribute__((always_inline)) void piece_1pass(
    const int REP, const int ND, const int f16, const int KO, const float *q, const void *K,
    const void *V, int l0, int l1, float scale, float *kbuf, float *m_out, float *sum_out,
    float *o) {
    const int d = 16 * ND;
    __m512 acc[4][8];
    float m[4], sum[4];
    float p[4][16] __attribute__((aligned(64)));
    for (int r = 0; r < REP; r++) {
        m[r] = -INFINITY, sum[r] = 0.0f;
        for (int i = 0; i < ND; i++) acc[r][i] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int b = l0; b < l1; b += 16) {
        const int nb = l1 - b < 16 ? l1 - b : 16;
        const __mmask16 live = nb == 16 ? 0xFFFF : (__mmask16)((1u << nb) - 1);
        const float *kb;
        if (!f16) { /* written out here: GCC drops a helper of prefetches only as if pure */
            const char *pk = (const char *)((const float *)K + (size_t)b * d) + PREFETCH_AHEAD;
            const char *pv = (const char *)((const float *)V + (size_t)b * d) + PREFETCH_AHEAD;
            for (int off = 0; off < 16 * d * 4; off += 64) {
                _mm_prefetch(pk + off, _MM_HINT_T0);
                _mm_prefetch(pv + off, _MM_HINT_T0);
            }
        }
        __m512 svs[4];
        if (KO && nb == 16) {
            block_scores_ko(REP, ND, f16, q, K, b, vscale, svs);
        } else {
            kb = k_block(K, f16, b, nb, d, ND, kbuf);
            for (int r = 0; r < REP; r++)
                svs[r] = block_scores(q + (size_t)r * d, kb, d, ND, vscale);
        }
        for (int r = 0; r < REP; r++) {
            const __m512 sv = svs[r];
            const float mb = _mm512_mask_reduce_max_ps(live, sv);
            if (mb > m[r]) { /* a new running max: rescale what was accumulated */
                const float w = m[r] == -INFINITY ? 0.0f : expf(m[r] - mb);
                const __m512 vw = _mm512_set1_ps(w);
                for (int i = 0; i < ND; i++) acc[r][i] = _mm512_mul_ps(acc[r][i], vw);
                sum[r] *= w;
                m[r] = mb;
            }
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m[r]))));
            sum[r] += _mm512_reduce_add_ps(e);
            _mm512_store_ps(p[r], e);
        }
        for (int j = 0; j < nb; j++) {
            __m512 v[8];
            for (int i = 0; i < ND; i++) v[i] = load_kv(V, (size_t)(b + j) * d + 16 * i, f16);
            for (int r = 0; r < REP; r++) {
                const __m512 w = _mm512_set1_ps(p[r][j]);
                for (int i = 0; i < ND; i++) acc[r][i] = _mm512_fmadd_ps(w, v[i], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < REP; r++) {
        m_out[r] = m[r], sum_out[r] = sum[r];
        for (int i = 0; i < ND; i++) _mm512_storeu_ps(o + (size_t)r * d + 16 * i, acc[r][i]);
    }
}

/* The shapes piece_1pass is instantiated for (piece_any). */
static int one_pass_shape(int rep, int nd) {
    return ((nd == 2 || nd == 4) && rep <= 4) || (nd == 8 && rep <= 2);
}

/* piece_1pass for a shape of one_pass_shape (returns 1; 0 for others, never called so). */
static int piece_any(int rep, int d, const float *q, const void *K, const void *V, int f16,
                     int l0, int l1, float scale, float *kbuf, float *m, float *sum, float *o) {
#define P1(R, N)                                                                             \
    case N * 8 + R:                                                                          \
        if (f16 && keys_outer)                                                               \
            piece_1pass(R, N, 1, 1, q, K, V, l0, l1, scale, kbuf, m, sum, o);                \
        else if (f16)                                                                        \
            piece_1pass(R, N, 1, 0, q, K, V, l0, l1, scale, kbuf, m, sum, o);                \
        else                                                                                 \
            piece_1pass(R, N, 0, 0, q, K, V, l0, l1, scale, kbuf, m, sum, o);                \
        return 1;
    switch ((d / 16) * 8 + rep) {
    ONE_PASS_SHAPES(P1)
    default: return 0;
    }
#undef P1
}

static void rope_head(float *x, int d, const float *cos, const float *sin, int neox) {
    for (int i = 0; i < d / 2; i++) {
        const int i0 = neox ? i : 2 * i, i1 = neox ? i + d / 2 : 2 * i + 1;
        const float x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * cos[i] - x1 * sin[i];
        x[i1] = x0 * sin[i] + x1 * cos[i];
    }
}

static void store_row(void *cache, size_t at, const float *x, int d, int f16) {
    if (!f16) {
        memcpy((float *)cache + at, x, sizeof(float) * (size_t)d);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    for (int i = 0; i < d; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* Whether a float32 cache's pieces take the three passes of attn_piece (scores over the piece,
 * softmax, weighted values: the keys then the values, each one sequential stream) rather than
 * piece_1pass (blocks of 16 positions, keys and values side by side). Measured on two CPUs:
 * on an Intel VM the one pass was 14-24% faster at 2800-4096 positions; on an AMD Zen 4 VM,
 * whose prefetchers follow one sequential stream far better than two interleaved ones, the
 * three passes are 6-24% faster at 260-2800 positions. So by the CPU's vendor (AMD: three
 * passes), or as set by qlib_attn_set_two_pass (an A/B hook: 0, 1; -1 restores the vendor's);
 * float16 caches keep the one pass (keys outer: measured the same or faster). The two differ
 * by float rounding only. */
static int two_pass_f32 = -1;
__attribute__((constructor)) static void two_pass_init(void) { two_pass_f32 = qlib_amd_cpu(); }
void qlib_attn_set_two_pass(int on) { two_pass_f32 = on < 0 ? qlib_amd_cpu() : on; }

/* The pieces per KV head: a multiple of 16 positions each, n_kv * P a multiple of the
 * thread count where that leaves pieces of >= 64 positions (else one piece per head). */
static int pieces(int L, int n_kv, int nth, int split, int *len) {
    int P;
    if (split > 0) {
        P = (L + split - 1) / split;
    } else {
        int a = n_kv, b = nth;
        while (b) { const int t = a % b; a = b; b = t; } /* gcd(n_kv, nth) */
        P = nth / a;
        if (L / P < 64) P = 1;
    }
    int lp = ((L + P - 1) / P + 15) / 16 * 16;
    P = (L + lp - 1) / lp; /* rounding may leave fewer */
    *len = lp;
    return P;
}

/* The geometry of one decode attention step at position pos with nth threads (the
 * pieces, the buffer): shared by qlib_attn_decode_kv and qlib_attn_decode_region. */
typedef struct {
    int L, rep, P, lp, ntask, ld, one_pass;
    size_t task_floats;
} attn_geom;

static attn_geom attn_geometry(int pos, int n_head, int n_kv, int d, int nth, int split,
                                int kv_f16) {
    attn_geom g;
    g.L = pos + 1, g.rep = n_head / n_kv;
    g.P = pieces(g.L, n_kv, nth, split, &g.lp), g.ntask = n_kv * g.P;
    /* per task: scores rep x lp (attn_piece only), then m, sum (rep each), o (rep x d) */
    g.one_pass = one_pass_shape(g.rep, d / 16) && (kv_f16 || !two_pass_f32);
    g.ld = g.one_pass ? 0 : g.lp;
    g.task_floats = (size_t)g.rep * g.ld + 2 * (size_t)g.rep + (size_t)g.rep * d;
    return g;
}

/* Whether the step's tasks are spread over the threads (else the fork costs more than the
 * work): the pieces are then cut for omp_get_max_threads() threads, else for one. */
static int attn_parallel(int pos, int n_head) { return (pos + 1) * n_head >= 256; }

/* RoPE of the token's q and k heads, k and v into row pos of the caches. */
static void attn_write(float *qkv, void *kc, void *vc, int pos, int n_head, int n_kv, int d,
                       int max_seq, const float *cos, const float *sin, int neox, int kv_f16) {
    for (int h = 0; h < n_head + n_kv; h++) rope_head(qkv + (size_t)h * d, d, cos, sin, neox);
    for (int g = 0; g < n_kv; g++) {
        const size_t at = ((size_t)g * max_seq + pos) * d;
        store_row(kc, at, qkv + (size_t)(n_head + g) * d, d, kv_f16);
        store_row(vc, at, qkv + (size_t)(n_head + n_kv + g) * d, d, kv_f16);
    }
}

/* Task t (KV head t / P, piece t % P) into its part of buf; kbuf: 16 d floats. */
static inline void attn_task(const attn_geom *ge, int t, const float *qkv, const void *kc,
                             const void *vc, int d, int max_seq, int kv_f16, float *buf,
                             float *kbuf) {
    FTZ_BEGIN
    const int rep = ge->rep, P = ge->P, lp = ge->lp, ld = ge->ld;
    const int g = t / P, c = t % P;
    const int l0 = c * lp, l1 = l0 + lp < ge->L ? l0 + lp : ge->L;
    float *s = buf + ge->task_floats * t, *m = s + (size_t)rep * ld, *sum = m + rep,
          *o = sum + rep;
    const size_t head = (size_t)g * max_seq * d;
    const void *K = kv_f16 ? (const void *)((const uint16_t *)kc + head)
                           : (const void *)((const float *)kc + head);
    const void *V = kv_f16 ? (const void *)((const uint16_t *)vc + head)
                           : (const void *)((const float *)vc + head);
    const float *q = qkv + (size_t)g * rep * d;
    const float scale = 1.0f / sqrtf((float)d);
    if (ge->one_pass)
        piece_any(rep, d, q, K, V, kv_f16, l0, l1, scale, kbuf, m, sum, o);
    else
        attn_piece(q, rep, d, K, V, kv_f16, l0, l1, scale, s, lp, kbuf, m, sum, o);
    FTZ_END
}

/* Query head h's output from the pieces of its KV head. */
static inline void attn_combine(const attn_geom *ge, int h, int d, const float *buf,
                                float *out) {
    const int rep = ge->rep, P = ge->P, ld = ge->ld;
    const size_t task_floats = ge->task_floats;
    const int g = h / rep, r = h % rep;
    float *dst = out + (size_t)h * d;
    if (P == 1) {
        const float *pt = buf + task_floats * g, *o = pt + (size_t)rep * ld + 2 * rep;
        const __m512 inv = _mm512_set1_ps(1.0f / pt[(size_t)rep * ld + rep + r]);
        for (int i = 0; i < d; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)r * d + i), inv));
        return;
    }
    float mx = -INFINITY, total = 0.0f;
    for (int c = 0; c < P; c++) {
        const float mc = buf[task_floats * (g * P + c) + (size_t)rep * ld + r];
        mx = mc > mx ? mc : mx;
    }
    __m512 acc[8];
    for (int i = 0; i < d / 16; i++) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < P; c++) {
        const float *pt = buf + task_floats * (g * P + c);
        const float *o = pt + (size_t)rep * ld + 2 * rep;
        const float w = expf(pt[(size_t)rep * ld + r] - mx);
        total += w * pt[(size_t)rep * ld + rep + r];
        const __m512 vw = _mm512_set1_ps(w);
        for (int i = 0; i < d / 16; i++)
            acc[i] = _mm512_fmadd_ps(vw, _mm512_loadu_ps(o + (size_t)r * d + 16 * i), acc[i]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int i = 0; i < d / 16; i++) _mm512_storeu_ps(dst + 16 * i, _mm512_mul_ps(acc[i], inv));
}

int qlib_attn_decode_kv(float *qkv, void *kc, void *vc, int pos, int n_head, int n_kv, int d,
                        int max_seq, const float *cos, const float *sin, int neox, float *out,
                        int kv_f16, int split) {
    if (d % 16 || d > 128 || n_head % n_kv) return -1;
    attn_write(qkv, kc, vc, pos, n_head, n_kv, d, max_seq, cos, sin, neox, kv_f16);
    const int parallel = attn_parallel(pos, n_head);
    const int nth = parallel ? omp_get_max_threads() : 1;
    const attn_geom ge = attn_geometry(pos, n_head, n_kv, d, nth, split, kv_f16);
    /* per task: see attn_geometry; per thread: kbuf */
    float *buf = malloc(sizeof(float) * (ge.task_floats * ge.ntask + (size_t)16 * d * nth));
    if (!buf) return -1;
    float *kbufs = buf + ge.task_floats * ge.ntask;
#pragma omp parallel for schedule(static) num_threads(nth) if (parallel)
    for (int t = 0; t < ge.ntask; t++)
        attn_task(&ge, t, qkv, kc, vc, d, max_seq, kv_f16, buf,
                  kbufs + (size_t)16 * d * omp_get_thread_num());
    for (int h = 0; h < n_head; h++) attn_combine(&ge, h, d, buf, out); /* combine the pieces */
    free(buf);
    return 0;
}

/* -- the decode step in one parallel region (decode.c) ------------------------------------ */

/* Floats of the shared buffer qlib_attn_decode_region needs at position pos, for a region
 * of nth threads (max_threads: omp_get_max_threads() outside it). */
size_t qlib_attn_region_floats(int pos, int n_head, int n_kv, int d, int split, int nth,
                               int max_threads, int kv_f16) {
    const attn_geom ge = attn_geometry(pos, n_head, n_kv, d,
                                       attn_parallel(pos, n_head) ? max_threads : 1, split,
                                       kv_f16);
    return ge.task_floats * ge.ntask + (size_t)16 * d * nth;
}

/* qlib_attn_decode_kv (arguments already checked), called by every thread of an enclosing
 * parallel region (decode.c), bit for bit the same: one thread does RoPE and the KV write,
 * then the tasks (the same pieces, cut for max_threads threads as qlib_attn_decode_kv does)
 * and the heads' combine are shared out; ends with a barrier. buf: the region's shared
 * buffer of qlib_attn_region_floats(...) floats. */
void qlib_attn_decode_region(float *qkv, void *kc, void *vc, int pos, int n_head, int n_kv,
                             int d, int max_seq, const float *cos, const float *sin, int neox,
                             float *out, int kv_f16, int split, int max_threads, float *buf) {
#pragma omp single
    attn_write(qkv, kc, vc, pos, n_head, n_kv, d, max_seq, cos, sin, neox, kv_f16);
    const attn_geom ge = attn_geometry(pos, n_head, n_kv, d,
                                       attn_parallel(pos, n_head) ? max_threads : 1, split,
                                       kv_f16);
    float *kbufs = buf + ge.task_floats * ge.ntask;
#pragma omp for schedule(static)
    for (int t = 0; t < ge.ntask; t++)
        attn_task(&ge, t, qkv, kc, vc, d, max_seq, kv_f16, buf,
                  kbufs + (size_t)16 * d * omp_get_thread_num());
#pragma omp for schedule(static)
    for (int h = 0; h < n_head; h++) attn_combine(&ge, h, d, buf, out);
}

/* The float32 cache entry point of the earlier kernel (same arguments). */
int qlib_attn_decode(float *qkv, float *kc, float *vc, int pos, int n_head, int n_kv, int d,
                     int max_seq, const float *cos, const float *sin, int neox, float *out) {
    return qlib_attn_decode_kv(qkv, kc, vc, pos, n_head, n_kv, d, max_seq, cos, sin, neox, out,
                               0, 0);
}

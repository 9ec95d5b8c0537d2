/* qlib CPU kernels: y = x @ W.T for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights, ggml semantics.
 *
 * Every activation row is quantized as ggml's x86 backend does (Q8_0 for Q4_0, Q5_0 and
 * Q8_0 weights, Q8_1 for Q4_1 and Q5_1; blocks of 32, d = amax / 127 stored as f16, codes
 * rounded half to even with the multiplier 127 / amax). Each block of 32 gives an
 * exact integer dot (AVX-512 VNNI vpdpbusd: unsigned weight bytes x signed
 * activation bytes), scaled in float32 by d_w * d_a; Q4_1, Q5_1 add m_w * s_a per block.
 *
 * Weights are repacked by qlib.quants.cpu.packing into per-row planes:
 *   codes  Q4_*, Q5_*: k/2 bytes, per 64 elements 32 bytes, byte i = e[i] | e[i+32] << 4
 *                (the low 4 bits of the codes, as stored by ggml before the -8 of Q4_0);
 *          Q8_0: k bytes, code + 128 (unsigned);
 *   d      f16 bits, k/32 per row;
 *   m      Q4_1: f16 minimums, k/32 per row; Q5_0: the high bits, the blocks' qh words (bit
 *          i: element i), k/32 uint32 per row; Q5_1: its minimums, then its qh words.
 * The unsigned offset (8, 16 or 128) is removed exactly by starting each block's
 * integer accumulator at -offset * (sum of 4 activation codes) per lane.
 * Q4_0 / Q4_1 / Q8_0 weights whose rows come in multiples of 16 may instead be 16-row panels
 * (type | QLIB_PANELS; below, "panels"): what the fast engine uses for its decode GEMVs.
 * Rows are split over OpenMP threads; each output element is computed by one
 * thread in a fixed order, so a row's result never depends on the other rows.
 * Requires k % 64 == 0.
 * From qlib_gemm_min_rows rows (4; prefill) a tiled GEMM path (below) computes the same
 * exact integer block dots with weight tiles re-laid once per call: equal to the GEMV
 * loops to float rounding (the float32 order of the per-block terms), rows independent
 * within each path.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* ggml's type ids, and qlib's own blocks of 32 for three GGUF types (panels only; MXFP4's and
 * NVFP4's E2M1 codes as indices into ggml's kvalues_mxfp4, as IQ4_NL's into its levels):
 * MXFP4H (d:f16 qs[16], 18 bytes: an MXFP4 block's nibbles under its E8M0 scale as an f16,
 * IQ4_NL's layout) and NVFP4H (d0:f16 d1:f16 qs[16], 20 bytes: two NVFP4 groups of 16, element
 * j of the first under d0 in the low nibble of byte j, of the second under d1 in its high
 * nibble; each E4M3 scale exactly an f16); and Q1_0H (d:f16 qs[4], 6 bytes: a Q1_0 block's
 * 32 signs under its d, bit e of the little-endian word element e: +d set, -d clear) */
enum { QLIB_Q4_0 = 2, QLIB_Q4_1 = 3, QLIB_Q5_0 = 6, QLIB_Q5_1 = 7, QLIB_Q8_0 = 8, QLIB_IQ4_NL = 20,
       QLIB_MXFP4H = 61, QLIB_NVFP4H = 62, QLIB_Q1_0H = 63 };

/* -- panels: Q4_0 / Q4_1 / Q8_0 / IQ4_NL / qlib's blocks as 16-row panels (type | QLIB_PANELS) --
 * Per 16 weight rows (a panel) and block b of 32 elements, one record of panel_rec bytes:
 * the codes, 64-byte vectors whose lane r (row 16p + r) holds 4 consecutive codes, then the
 * 16 rows' d (f16), then (Q4_1) their m (f16) or (NVFP4H) their d1 (f16). Q1_0H: 8 masks of
 * 64 bits, mask s bit 4r + t = the sign of element 4s + t of row 16p + r, as codes 2 (+) and
 * 0 (-) with offset 1. Q4_*: 4 vectors, vector j lane r = bytes
 * 4j .. 4j + 3 of the row's GGUF block's qs (the codes of elements 4j .. 4j + 3 in the low
 * nibbles, of 4j + 16 .. in the high ones; IQ4_NL, MXFP4H and NVFP4H as Q4_0, their nibbles
 * indices into ggml's levels of the type, looked up as read); Q8_0: 8 vectors, vector j lane
 * r = the codes of elements 4j .. 4j + 3 (+ 128, as its planes). A block of 16 rows is then
 * 8 vpdpbusd with broadcast activation codes, one conversion and one FMA (lane = weight row),
 * where the planes take 16 x (unpack, vpdpbusd, conversion, permute, FMA); a thread's rows are
 * one sequential stream; the tiled GEMM's tiles are the same vectors. */
enum { QLIB_PANELS = 64 };
static inline int is_panels(int type) { return (type & QLIB_PANELS) != 0; }
static inline int base_type(int type) { return type & ~QLIB_PANELS; }
static inline size_t panel_codes(int type) {
    const int t = base_type(type);
    return t == QLIB_Q8_0 ? 512 : t == QLIB_Q1_0H ? 64 : 256;
}
/* Whether a type's blocks hold two f16 after the codes' d (Q4_1: m; NVFP4H: d1): 20 bytes */
static inline int two_halves(int type) { return type == QLIB_Q4_1 || type == QLIB_NVFP4H; }
static inline size_t panel_rec(int type) {
    return panel_codes(type) + (two_halves(base_type(type)) ? 64 : 32);
}
/* The exact offset corrections a block of 32 takes: NVFP4H's two groups of 16 each their own
 * (each under its own scale), else one */
static inline int corrections(int type) { return type == QLIB_NVFP4H ? 2 : 1; }

/* Whether a weight type's blocks have minimums (the m_w s_a term; no code offset). */
static inline int has_min(int type) { return type == QLIB_Q4_1 || type == QLIB_Q5_1; }

/* The m plane (module comment) per row, in uint16, and where a row's qh words begin in it */
static inline size_t m_stride(int type, int G) {
    return (size_t)G * (type == QLIB_Q5_1 ? 3 : type == QLIB_Q5_0 ? 2 : 1);
}
static inline const uint8_t *qh_words(int type, const uint16_t *m_row, int G) {
    return (const uint8_t *)(m_row + (type == QLIB_Q5_1 ? G : 0));
}
static inline int has_qh(int type) { return type == QLIB_Q5_0 || type == QLIB_Q5_1; }

/* The unsigned offset of a type's stored codes (Q4_0: 8, Q5_0: 16, Q8_0's planes and the
 * levels of IQ4_NL, MXFP4H and NVFP4H: 128, Q1_0H's signs: 1), removed exactly through the
 * activation codes' sums; 0 for the types with minimums. */
static inline int has_levels(int type) {
    return type == QLIB_IQ4_NL || type == QLIB_MXFP4H || type == QLIB_NVFP4H;
}
static inline int code_offset(int type) {
    return type == QLIB_Q1_0H ? 1
           : type == QLIB_Q8_0 || has_levels(type) ? 128
           : type == QLIB_Q5_0                      ? 16
           : type == QLIB_Q4_0                      ? 8
                                                    : 0;
}

/* The panels' types: Q4_0, Q4_1, Q8_0, and IQ4_NL, MXFP4H and NVFP4H (panels only: their
 * nibbles are indices into ggml's levels, looked up as they are read; Q4_0's layout otherwise,
 * NVFP4H Q4_1's record) */
static inline int panel_type(int type) {
    return type == QLIB_Q4_0 || type == QLIB_Q4_1 || type == QLIB_Q8_0 || has_levels(type) ||
           type == QLIB_Q1_0H;
}
/* The types that come as panels only */
static inline int panels_only(int type) { return has_levels(type) || type == QLIB_Q1_0H; }

/* Step s (elements 4s .. 4s + 3 of the 16 rows) of a Q1_0H panel record c: codes 2 and 0 */
static inline __m512i sign_step(const uint8_t *c, int s) {
    __mmask64 bits;
    memcpy(&bits, c + 8 * s, 8);
    return _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(2));
}

/* A panel vector's 64 low or high nibbles as unsigned codes (the level types: levels + 128) */
static inline __m512i panel_nibbles(int type, __m512i v, int high) {
    const __m512i q = _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    return type == QLIB_IQ4_NL   ? iq4_levels(q)
           : has_levels(type) ? levels_lookup(mxfp4_levels_u8, q)
                              : q;
}

/* Dots of R consecutive repacked weight rows with one quantized activation row
 * (R is a compile-time constant at each call: the loops unroll, the R chains overlap). */
static inline __attribute__((always_inline)) void dot_rows(
    const int R, int type, const uint8_t *codes, size_t row_bytes, const uint16_t *dw,
    const uint16_t *mw, int k, const int8_t *aq, const float *ad, const float *as,
    const int32_t *corr, const char *pf, float *y) {
    const int G = k / 32;
    const size_t ms = m_stride(type, G);
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
            if (has_min(type)) /* the offset term, sum over blocks of m_w * s_a */
                facc[r] = _mm512_fmadd_ps(
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mw + (size_t)r * ms + c)),
                    _mm512_maskz_loadu_ps(mask, as + c), facc[r]);
        }
        for (int p = 0; p < nb; p += 2) {
            const int e = (c + p) * 32; /* first element of this pair of blocks */
            if (pf && (type == QLIB_Q8_0 || p % 4 == 0)) { /* the lines of R rows ahead */
                const size_t off = type == QLIB_Q8_0 ? (size_t)e : (size_t)e / 2;
                for (int r = 0; r < R; r++) _mm_prefetch(pf + r * row_bytes + off, _MM_HINT_T1);
            }
            const __m512i a = _mm512_loadu_si512(aq + e);
            const __m512i init = has_min(type) ? _mm512_setzero_si512()
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
                    if (has_qh(type)) { /* + 16 where the block pair's qh bit is set */
                        uint64_t h;
                        memcpy(&h, qh_words(type, mw + (size_t)r * ms, G) + 4 * (c + p), 8);
                        w = _mm512_mask_add_epi8(w, (__mmask64)h, w, _mm512_set1_epi8(16));
                    }
                }
                __m512i acc = _mm512_dpbusd_epi32(init, w, a);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),
                                          _mm512_permutexvar_ps(idx, dd[r]), facc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(facc[r]);
}

/* -- the many-rows path (prefill): a tile of GT = 48 weight rows, re-laid once per call so
 * that a 64-byte vector holds 4 consecutive codes of 16 weight rows (lane = weight row),
 * times MR activation rows at a time (a broadcast of 4 activation codes per vpdpbusd).
 * Each lane of an int32 accumulator then holds the exact integer block dot of its weight row
 * with the activation row, started at the block's -offset * (sum of its 32 codes), and is
 * added per block as float(sum) * (d_w d_a) (Q4_1: + m_w s_a) into float32 accumulators,
 * in block order. So the outputs are ggml's sum over blocks, equal to the GEMV path above
 * (which sums 8 partial lanes per block) to float rounding. */
enum { GT = 48, GEMM_MR = 4 }; /* 12 int32 accumulators (4 x 3 vectors): 12 vpdpbusd chains
                                * (was 32 x 4: 8 chains; A/B on SmolLM2's shapes: +5-15%) */
/* rows of activations per pass over the weight tiles: their codes (GEMM_ROWS_BYTES) stay in L2
 * while every tile is multiplied with them (each tile re-laid once per pass) */
enum { GEMM_ROWS_BYTES = 512 * 1024 };
/* m from which qlib_qgemm_ex (and kquants.c's qlib_kgemm) take the tiled path */
int qlib_gemm_min_rows = 4;
void qlib_qgemm_set_min_rows(int rows) { qlib_gemm_min_rows = rows; }

/* gemm_tile's tile from panels: their code vectors are its steps (Q4_*: a vector's low
 * nibbles step 8b + j, its high ones step 8b + 4 + j), their d and m its scales. */
static void panel_tile(int layout, const uint8_t *panels, int j0, int n, int k, uint8_t *wt,
                       float *dt, float *mt) {
    const int type = base_type(layout), G = k / 32, np = n / 16;
    const size_t rec = panel_rec(type);
    for (int v = 0; v < GT / 16; v++) {
        const int p = j0 / 16 + v < np ? j0 / 16 + v : np - 1; /* past n: the last panel again */
        const uint8_t *c = panels + (size_t)p * G * rec;
        for (int b = 0; b < G; b++, c += rec) {
            for (int j = 0; j < 4 && type == QLIB_Q1_0H; j++) {
                _mm512_store_si512(wt + ((size_t)(8 * b + j) * GT + v * 16) * 4, sign_step(c, j));
                _mm512_store_si512(wt + ((size_t)(8 * b + 4 + j) * GT + v * 16) * 4,
                                   sign_step(c, j + 4));
            }
            for (int j = 0; j < 4 && type != QLIB_Q1_0H; j++) {
                const __m512i x = _mm512_loadu_si512(c + 64 * j);
                if (type == QLIB_Q8_0) { /* the tile's steps as they are */
                    _mm512_store_si512(wt + ((size_t)(8 * b + j) * GT + v * 16) * 4, x);
                    _mm512_store_si512(wt + ((size_t)(8 * b + 4 + j) * GT + v * 16) * 4,
                                       _mm512_loadu_si512(c + 64 * (j + 4)));
                    continue;
                }
                _mm512_store_si512(wt + ((size_t)(8 * b + j) * GT + v * 16) * 4,
                                   panel_nibbles(type, x, 0));
                _mm512_store_si512(wt + ((size_t)(8 * b + 4 + j) * GT + v * 16) * 4,
                                   panel_nibbles(type, x, 1));
            }
            const uint8_t *dm = c + panel_codes(type);
            _mm512_store_ps(dt + (size_t)b * GT + v * 16,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm)));
            if (mt)
                _mm512_store_ps(mt + (size_t)b * GT + v * 16,
                                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 32))));
        }
    }
}

/* The tile's codes as unsigned bytes in steps of 4 elements: wt[(s * GT + r) * 4 + t] = code
 * of element 4s + t of tile row r (rows past n repeat the last row); dt / mt: float d / m.
 * Q5_0 / Q5_1: the m plane holds their high bits (qh words). */
static void gemm_tile(int type, const uint8_t *codes, size_t row_bytes, const uint16_t *dw,
                      const uint16_t *mw, int j0, int n, int k, uint8_t *wt, float *dt,
                      float *mt) {
    if (is_panels(type)) { /* the panels' vectors are the tile's, unpacked */
        panel_tile(type, codes, j0, n, k, wt, dt, mt);
        return;
    }
    const int G = k / 32, last = n - 1 - j0;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int v = 0; v < GT / 16; v++) {
        const uint8_t *row[16], *qh[16];
        for (int l = 0; l < 16; l++) {
            const int r = v * 16 + l;
            const size_t jr = (size_t)(j0 + (r < last ? r : last));
            row[l] = codes + jr * row_bytes;
            qh[l] = has_qh(type) ? qh_words(type, mw + jr * m_stride(type, G), G) : NULL;
        }
        for (int c = 0; c < k / 64; c++) { /* 64 elements: 16 steps */
            __m512i x[16];
            for (int l = 0; l < 16; l++) {
                if (type == QLIB_Q8_0) {
                    x[l] = _mm512_loadu_si512(row[l] + 64 * c);
                } else {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(row[l] + 32 * c));
                    x[l] = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_and_si256(p, low4)),
                        _mm256_and_si256(_mm256_srli_epi16(p, 4), low4), 1);
                    if (has_qh(type)) {
                        uint64_t h;
                        memcpy(&h, qh[l] + 8 * c, 8);
                        x[l] = _mm512_mask_add_epi8(x[l], (__mmask64)h, x[l], _mm512_set1_epi8(16));
                    }
                }
            }
            transpose16(x);
            for (int t = 0; t < 16; t++)
                _mm512_store_si512(wt + ((size_t)(16 * c + t) * GT + v * 16) * 4, x[t]);
        }
    }
    for (int r = 0; r < GT; r++) {
        const size_t row = (size_t)(j0 + (r < last ? r : last)), jr = row * G;
        const uint16_t *mr = mw ? mw + row * m_stride(type, G) : NULL;
        for (int b = 0; b < G; b++) {
            dt[b * GT + r] = _cvtsh_ss(dw[jr + b]);
            if (mt) mt[b * GT + r] = _cvtsh_ss(mr[b]);
        }
    }
}

/* The 4 activation codes of step s (elements 4s .. 4s + 3 of ab) in every lane: a broadcast
 * from memory (a copy of the block's 32 codes into an array went through general registers:
 * a shift and a register-to-vector move a step) */
static inline __m512i act4(const int8_t *ab, int s) {
    int32_t v;
    memcpy(&v, ab + 4 * s, 4);
    return _mm512_set1_epi32(v);
}

/* MR activation rows (codes aq, stride k; d ad, s as, block corrections cb: stride G) times
 * the tile: y rows of stride n, cols j0 .. j0 + cols. */
static inline __attribute__((always_inline)) void gemm_rows(
    const int MR, int type, const uint8_t *wt, const float *dt, const float *mt, int k,
    const int8_t *aq, const float *ad, const float *as, const int32_t *cb, float *y, int n,
    int cols, int accumulate) {
    enum { NV = GT / 16 };
    const int G = k / 32;
    __m512 facc[GEMM_MR][NV]; /* MR <= GEMM_MR: no VLA */
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) facc[i][v] = _mm512_setzero_ps();
    const int nc = corrections(type), steps = 8 / nc; /* per correction: steps of 4 codes */
    for (int b = 0; b < G; b++) {
        for (int h = 0; h < nc; h++) { /* NVFP4H: its two groups of 16, each under its d */
            __m512i iacc[GEMM_MR][NV];
            for (int i = 0; i < MR; i++) {
                /* Q4_1 / Q5_1 have no offset: zeros (a zero idiom, not a register move per
                 * accumulator) */
                const __m512i c0 = has_min(type)
                                       ? _mm512_setzero_si512()
                                       : _mm512_set1_epi32(cb[((size_t)i * G + b) * nc + h]);
                for (int v = 0; v < NV; v++)
                    iacc[i][v] = has_min(type) ? _mm512_setzero_si512() : c0;
            }
            const uint8_t *wb = wt + (size_t)b * 8 * GT * 4;
            const int8_t *ab = aq + b * 32;
            for (int s = h * steps; s < (h + 1) * steps; s++) {
                __m512i w[NV];
                for (int v = 0; v < NV; v++)
                    w[v] = _mm512_loadu_si512(wb + (s * GT + v * 16) * 4);
                for (int i = 0; i < MR; i++) {
                    const __m512i a = act4(ab + (size_t)i * k, s);
                    for (int v = 0; v < NV; v++)
                        iacc[i][v] = _mm512_dpbusd_epi32(iacc[i][v], w[v], a);
                }
            }
            for (int v = 0; v < NV; v++) {
                const __m512 dwv = _mm512_loadu_ps((h ? mt : dt) + b * GT + v * 16);
                for (int i = 0; i < MR; i++) {
                    const __m512 dd = _mm512_mul_ps(dwv, _mm512_set1_ps(ad[(size_t)i * G + b]));
                    facc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][v]), dd, facc[i][v]);
                }
                if (has_min(type)) {
                    const __m512 mwv = _mm512_loadu_ps(mt + b * GT + v * 16);
                    for (int i = 0; i < MR; i++)
                        facc[i][v] = _mm512_fmadd_ps(mwv, _mm512_set1_ps(as[(size_t)i * G + b]),
                                                     facc[i][v]);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV && cols - v * 16 > 0; v++)
            store_lanes(y + (size_t)i * n + v * 16, facc[i][v], cols - v * 16, accumulate);
}


/* gemm_rows with MR and what the type changes there a constant: its minimums (Q4_1, Q5_1),
 * two corrections a block (NVFP4H) or neither. (With the type a variable, NVFP4H's loop over
 * the two groups left the compiler copying the 12 accumulators at every step: the SmolLM2
 * Q4_1 prefill's GEMMs 601 -> 493 GOP/s.) */
static void gemm_rows_typed(int MR, int type, const uint8_t *wt, const float *dt,
                            const float *mt, int k, const int8_t *aq, const float *ad,
                            const float *as, const int32_t *cb, float *y, int n, int cols,
                            int accumulate) {
    const int kind = has_min(type)             ? QLIB_Q4_1
                     : corrections(type) == 2 ? QLIB_NVFP4H
                                              : QLIB_Q4_0;
#define QLIB_GEMM_CASE(T)                                                                      \
    case T:                                                                                    \
        if (MR == GEMM_MR)                                                                     \
            gemm_rows(GEMM_MR, T, wt, dt, mt, k, aq, ad, as, cb, y, n, cols, accumulate);      \
        else                                                                                   \
            gemm_rows(1, T, wt, dt, mt, k, aq, ad, as, cb, y, n, cols, accumulate);            \
        break;
    switch (kind) {
        QLIB_GEMM_CASE(QLIB_Q4_0)
        QLIB_GEMM_CASE(QLIB_Q4_1)
        QLIB_GEMM_CASE(QLIB_NVFP4H)
    }
#undef QLIB_GEMM_CASE
}

/* Activation row i of the tiled path: the input row (x itself, or RmsNorm / SwiGLU of it into
 * the scratch ri), its Q8_0 / Q8_1 codes, d (and s), and the block corrections
 * cb = -offset * (sum of the block's codes) (Q4_0, Q5_0, Q8_0; Q4_1, Q5_1 have no offset).
 * The same codes, scales and (exact integer) corrections as act_row's. */
static void act_row_gemm(int type, const float *x, int k, int i, const float *norm_w, float eps,
                         int swiglu, float *ri, int8_t *aq, float *ad, float *as, int32_t *cb) {
    const int G = k / 32, offset = code_offset(type);
    int8_t *q = aq + (size_t)i * k;
    const float *src = x + (size_t)i * k * (swiglu ? 2 : 1);
    if (norm_w || swiglu) {
        input_row(src, k, norm_w, eps, swiglu, ri);
        src = ri;
    }
    quantize_row_q8(src, k, q, ad + (size_t)i * G, has_min(type) ? as + (size_t)i * G : NULL);
    if (!offset) return;
    const __m512i ones = _mm512_set1_epi8(1);
    const int nc = corrections(type); /* per 32 codes (NVFP4H: per 16) */
    for (int e = 0; e < k; e += 64) { /* lanes 4c .. 4c + 3 hold the 4-sums of codes 16c.. */
        const __m512i lane =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + e));
        for (int c = 0; c < 2 * nc; c++) {
            const __mmask16 part = (__mmask16)(((1u << (8 / nc)) - 1) << (c * 8 / nc));
            cb[(size_t)i * G * nc + e / 32 * nc + c] =
                -offset * _mm512_mask_reduce_add_epi32(part, lane);
        }
    }
}

/* Scratch of the tiled path (activation codes, scales, corrections), kept by the calling
 * thread between calls (scratch_grow: a fresh allocation per call cost ~1 us a row of 576
 * at 2800 rows in page faults). */
static __thread void *gemm_scratch;
static __thread size_t gemm_scratch_bytes;

/* The tiled path of qlib_qgemm_ex (m >= qlib_gemm_min_rows): one parallel region that
 * quantizes the m rows of f(x) (split over the threads) and then multiplies them with the
 * weight tiles. Returns 0 or -1 (memory). */
static int qgemm_tiled(int layout, const uint8_t *codes, size_t row_bytes, const uint16_t *dw,
                       const uint16_t *mw, int n, int k, const float *x, int m, float *y,
                       const float *norm_w, float eps, int swiglu, int accumulate) {
    const int type = base_type(layout), G = k / 32, ntiles = (n + GT - 1) / GT;
    const int nc = corrections(type); /* cb: nc G a row, in the last nc regions */
    const size_t aq_bytes = ((size_t)m * k + 63) / 64 * 64, g_bytes = sizeof(float) * m * G;
    char *buf = scratch_grow(&gemm_scratch, &gemm_scratch_bytes,
                             aq_bytes + (2 + nc) * ((g_bytes + 63) / 64 * 64));
    if (!buf) return -1;
    int8_t *aq = (int8_t *)buf;
    float *ad = (float *)(buf + aq_bytes);
    float *as = ad + ((g_bytes + 63) / 64 * 64) / sizeof(float);
    int32_t *cb = (int32_t *)(as + ((g_bytes + 63) / 64 * 64) / sizeof(float));
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *wt = aligned_alloc(64, (size_t)GT * k);
        float *dt = aligned_alloc(64, sizeof(float) * GT * (size_t)G * 2);
        float *ri = aligned_alloc(64, sizeof(float) * (size_t)k);
        if (!wt || !dt || !ri) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int i = 0; i < m; i++)
            if (ri) act_row_gemm(type, x, k, i, norm_w, eps, swiglu, ri, aq, ad, as, cb);
        /* passes over rows r0 .. r1 (a multiple of GEMM_MR rows, their codes fit L2): the same
         * static split of the tiles in each pass, so no barrier between passes */
        const int mc = (GEMM_ROWS_BYTES / k) / GEMM_MR * GEMM_MR > GEMM_MR
                           ? (GEMM_ROWS_BYTES / k) / GEMM_MR * GEMM_MR : GEMM_MR;
        for (int r0 = 0; r0 < m && !failed; r0 += mc) {
            const int r1 = m - r0 < mc ? m : r0 + mc;
#pragma omp for schedule(static) nowait
            for (int tj = 0; tj < ntiles; tj++) {
                const int j0 = tj * GT, cols = n - j0 < GT ? n - j0 : GT;
                float *mt = two_halves(type) || has_min(type) ? dt + GT * (size_t)G : NULL;
                gemm_tile(layout, codes, row_bytes, dw, mw, j0, n, k, wt, dt, mt);
                int i = r0;
                for (; i < r1; i += i + GEMM_MR <= r1 ? GEMM_MR : 1)
                    gemm_rows_typed(i + GEMM_MR <= r1 ? GEMM_MR : 1, type, wt, dt, mt, k,
                                    aq + (size_t)i * k, ad + (size_t)i * G, as + (size_t)i * G,
                                    cb + (size_t)i * G * nc, y + (size_t)i * n + j0, n, cols,
                                    accumulate);
            }
        }
        free(wt), free(dt), free(ri);
    }
    return failed ? -1 : 0;
}

/* Activation row i of qlib_qgemm_ex: the input row (scratch ri), its Q8_0 / Q8_1 codes,
 * d (and s), and -offset * (sum of each 4 codes) per int32 lane. */
static void act_row(int type, const float *x, int k, int i, const float *norm_w, float eps,
                    int swiglu, float *ri, int8_t *aq, float *ad, float *as, int32_t *corr) {
    const int G = k / 32, offset = code_offset(type);
    const __m512i ones = _mm512_set1_epi8(1);
    int8_t *q = aq + (size_t)i * k;
    input_row(x + (size_t)i * k * (swiglu ? 2 : 1), k, norm_w, eps, swiglu, ri);
    quantize_row_q8(ri, k, q, ad + (size_t)i * G, has_min(type) ? as + (size_t)i * G : NULL);
    for (int e = 0; e < k; e += 64) {
        __m512i lane = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + e));
        _mm512_storeu_si512(corr + (size_t)i * (k / 4) + e / 4,
                            _mm512_mullo_epi32(lane, _mm512_set1_epi32(-offset)));
    }
}

/* The GEMV's prefetch of the codes two groups ahead (an A/B hook, qlib_gemv_set_prefetch):
 * 1 (default) spread over the block steps, R lines per 64 bytes of a row, for rows of
 * k >= qlib_gemv_spread_k; 0 one burst of 4 rows per group (the earlier kernel). A/B in one
 * process, region decode, 2 threads: synthetic-1b Q8_0 (rows of 2-8 KB) 71.0 -> 52.3
 * ms/token, SmolLM2 Q4_1 5.97 -> 5.60, Q8_0 8.31 -> 7.65 (as kquants.c found for its rows) */
int qlib_gemv_prefetch = 1, qlib_gemv_spread_k = 0;
void qlib_gemv_set_prefetch(int mode, int spread_k) {
    qlib_gemv_prefetch = mode, qlib_gemv_spread_k = spread_k;
}

/* Q8_0 rows of k <= qlib_gemv_seq_k (0: none; by default every k) are taken one after the
 * other, with no software prefetch: a group's 4 rows side by side are 4 short interleaved
 * streams that the hardware prefetchers do not follow (a C harness: 15-16 GB/s as a plain read,
 * 31-33 with software prefetch, 35-41 as one sequential stream). Rows of k = 2048 and 8192
 * too since the twentieth session (the 1B-shape Q8_0 decode, in one process alternating, ms a
 * step min / median: up to 1536 only 27.51 / 29.95, 36.14 / 38.83, 35.12 / 38.50 against every
 * k 24.74 / 26.48 (up to 2048), 32.88 / 36.14, 32.77 / 36.21; the nineteenth session had
 * measured 2048 slower, before the next-GEMV prefetch of decode.c). The 4-row form keeps Q4_0 /
 * Q4_1, whose half-size codes lose more by not sharing the activation loads and block scales of
 * 4 rows. The same per-row arithmetic either way: the outputs are equal bit for bit (an A/B
 * hook: qlib_gemv_set_seq_k). */
int qlib_gemv_seq_k = 1 << 30;
void qlib_gemv_set_seq_k(int k) { qlib_gemv_seq_k = k; }

/* The GEMV path of qlib_qgemm_ex: group jb of 4 weight rows (of nblk) times the m quantized
 * activation rows (one thread computes the group's outputs, in a fixed order). */
static inline __attribute__((always_inline)) void gemv_group(
    int jb, int nblk, int type, const uint8_t *codes, size_t row_bytes, const uint16_t *dw,
    const uint16_t *mw, int n, int k, const int8_t *aq, const float *ad, const float *as,
    const int32_t *corr, int m, float *y, int accumulate) {
    const int G = k / 32;
    const int j = jb * 4, rows = n - j < 4 ? n - j : 4;
    const uint8_t *cj = codes + (size_t)j * row_bytes;
    const uint16_t *dj = dw + (size_t)j * G;
    const size_t ms = m_stride(type, G);
    const uint16_t *mj = mw ? mw + (size_t)j * ms : NULL;
    const char *pf = NULL;
    const int sequential = type == QLIB_Q8_0 && k <= qlib_gemv_seq_k;
    /* codes two groups ahead into L2 (rows are short: 288 bytes for Q4_1 at k = 576; the
     * hardware prefetcher alone left decode ~17% slower): spread over the block steps, or in
     * one burst */
    if (jb + 2 < nblk && !sequential) {
        const char *ahead = (const char *)(cj + 8 * row_bytes);
        if (qlib_gemv_prefetch == 0 || (size_t)k < (size_t)qlib_gemv_spread_k)
            for (size_t off = 0; off < 4 * row_bytes; off += 64)
                _mm_prefetch(ahead + off, _MM_HINT_T1);
        else
            pf = ahead;
    }
    for (int i = 0; i < m; i++) {
        float out[4];
        const int8_t *qi = aq + (size_t)i * k;
        const float *di = ad + (size_t)i * G, *si = as + (size_t)i * G;
        const int32_t *ci = corr + (size_t)i * (k / 4);
        if (rows == 4 && !sequential)
            dot_rows(4, type, cj, row_bytes, dj, mj, k, qi, di, si, ci, i ? NULL : pf, out);
        else
            for (int r = 0; r < rows; r++)
                dot_rows(1, type, cj + r * row_bytes, row_bytes, dj + (size_t)r * G,
                         mj ? mj + (size_t)r * ms : NULL, k, qi, di, si, ci, NULL, out + r);
        float *yi = y + (size_t)i * n + j;
        for (int r = 0; r < rows; r++) yi[r] = accumulate ? yi[r] + out[r] : out[r];
    }
}

/* Bytes ahead of each thread's stream that the panels' GEMV prefetches into L1: by the CPU's
 * vendor, or as set by qlib_gemv_set_panel_prefetch (an A/B hook; -1 restores the vendor's).
 * On an AMD Zen 4 VM none (the hardware's prefetch alone on the one sequential stream a
 * thread): 2 KB ahead was 0-15% slower (docs/performance.md, "The panels without software
 * prefetch"); on an Intel Xeon VM 4 KB ahead made the 1B shape's Q8_0 decode step 38.5 ->
 * 32.9 ms, alternating in one process ("Software prefetch by the CPU's vendor"). */
static int panel_prefetch_vendor(void) { return qlib_amd_cpu() ? 0 : 4096; }
int qlib_panel_prefetch = 0;
__attribute__((constructor)) static void panel_prefetch_init(void) {
    qlib_panel_prefetch = panel_prefetch_vendor();
}
void qlib_gemv_set_panel_prefetch(int bytes) {
    qlib_panel_prefetch = bytes >= 0 ? bytes : panel_prefetch_vendor();
}

/* Whether the panels' GEMVs (here and kquants.c's Q4_K panels) prefetch the activation row's
 * next codes and scales into L1 as they go (an A/B hook, qlib_gemv_set_act_prefetch; 1, the
 * default). A panel of a long row streams more than L1 holds between two reads of the same
 * activation bytes (a Q4_K panel of k = 8,192: 76 KB), so each super-block's codes came from
 * L2 on the loads' critical path: in a fast minute (plain read 61-65 GB/s) the 1B shape's
 * Q4_K ffn_down (2,048 x 8,192) ran at 43.7-45.1 GB/s against 60.6 with the prefetch
 * (tools/harness/q4k_panels.c), the decode step's Q4_K down GEMVs 46.2 -> 58.4 GB/s, 210 ->
 * 166 us a layer; k = 2,048 55-58 -> 59-60 GB/s; slow minutes and SmolLM2 (rows of 576 and
 * 1,536) unchanged (docs/performance.md, "The activation row prefetched in the panels"). */
int qlib_act_prefetch = 1;
void qlib_gemv_set_act_prefetch(int on) { qlib_act_prefetch = on; }

/* The exact offset term per block (Q4_0: -8, Q8_0: -128 x the sum of its 32 activation codes;
 * NVFP4H: per group of 16, two a block), from act_row's per-4-code corrections. */
static inline void block_corrections(int type, const int32_t *corr, int G, int32_t *cb) {
    if (corrections(type) == 2) {
        for (int g = 0; g < 2 * G; g++) {
            const __m128i s = _mm_loadu_si128((const __m128i *)(corr + 4 * g));
            const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            cb[g] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
        }
        return;
    }
    for (int b = 0; b < G; b++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + 8 * b));
        const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        cb[b] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    }
}

/* The 16 outputs of one panel (c: its first record) with one quantized activation row: per
 * block the exact integer dots of the 16 rows in the lanes (Q4_0, Q8_0: started at the
 * block's -offset * sum), times d_w d_a, plus (Q4_1) m_w s_a, summed over the blocks in order
 * (NVFP4H: its two groups' dots, each started at its own -offset * sum, times d0_w d_a and
 * d1_w d_a, in that order). */
static inline __attribute__((always_inline)) __m512 panel_dot(
    int type, const uint8_t *c, int G, const int8_t *aq, const float *ad, const float *as,
    const int32_t *cb, int pf) {
    const size_t rec = panel_rec(type);
    __m512 facc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int b = 0; b < G; b++, c += rec) {
        const int8_t *ab = aq + 32 * b; /* its 8 steps' codes, broadcast from memory */
        if (qlib_act_prefetch) { /* the activation codes two blocks on, the scales 16 on */
            if (b % 2 == 0 && b + 2 < G)
                _mm_prefetch((const char *)(aq + 32 * (b + 2)), _MM_HINT_T0);
            if (b % 16 == 0 && b + 16 < G) {
                _mm_prefetch((const char *)(ad + b + 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(as + b + 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(cb + b + 16), _MM_HINT_T0);
            }
        }
        if (pf)
            for (size_t o = 0; o < rec; o += 64) _mm_prefetch((const char *)c + pf + o, _MM_HINT_T0);
        const int split = corrections(type) == 2; /* (the low nibbles: the first 16) */
        __m512i lo = type == QLIB_Q4_1 ? _mm512_setzero_si512()
                                       : _mm512_set1_epi32(cb[split ? 2 * b : b]);
        __m512i hi = split ? _mm512_set1_epi32(cb[2 * b + 1]) : _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            if (type == QLIB_Q1_0H) { /* signs: 8 masks */
                lo = _mm512_dpbusd_epi32(lo, sign_step(c, j), act4(ab, j));
                hi = _mm512_dpbusd_epi32(hi, sign_step(c, j + 4), act4(ab, j + 4));
                continue;
            }
            const __m512i v = _mm512_loadu_si512(c + 64 * j);
            if (type == QLIB_Q8_0) { /* codes + 128: 8 vectors as they are */
                lo = _mm512_dpbusd_epi32(lo, v, act4(ab, j));
                hi = _mm512_dpbusd_epi32(hi, _mm512_loadu_si512(c + 64 * (j + 4)),
                                         act4(ab, j + 4));
                continue;
            }
            lo = _mm512_dpbusd_epi32(lo, panel_nibbles(type, v, 0), act4(ab, j));
            hi = _mm512_dpbusd_epi32(hi, panel_nibbles(type, v, 1), act4(ab, j + 4));
        }
        const uint8_t *dm = c + panel_codes(type);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm));
        if (split) {
            const __m512 dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 32)));
            facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dw, _mm512_set1_ps(ad[b])),
                                   facc);
            facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi),
                                   _mm512_mul_ps(dw1, _mm512_set1_ps(ad[b])), facc);
            continue;
        }
        facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)),
                               _mm512_mul_ps(dw, _mm512_set1_ps(ad[b])), facc);
        if (type == QLIB_Q4_1)
            macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 32))),
                                   _mm512_set1_ps(as[b]), macc);
    }
    return _mm512_add_ps(facc, macc);
}

/* Panel p times the m quantized activation rows (cb: their block corrections, stride G). */
static inline __attribute__((always_inline)) void panel_rows_t(
    int type, const uint8_t *panels, int p, int n, int k, const int8_t *aq, const float *ad,
    const float *as, const int32_t *cb, int m, float *y, int accumulate) {
    const int G = k / 32;
    const uint8_t *c = panels + (size_t)p * G * panel_rec(type);
    for (int i = 0; i < m; i++) {
        const __m512 r = panel_dot(type, c, G, aq + (size_t)i * k, ad + (size_t)i * G,
                                   as + (size_t)i * G, cb + (size_t)i * G * corrections(type),
                                   i ? 0 : qlib_panel_prefetch);
        float *yp = y + (size_t)i * n + 16 * (size_t)p;
        _mm512_storeu_ps(yp, accumulate ? _mm512_add_ps(_mm512_loadu_ps(yp), r) : r);
    }
}

/* panel_rows_t with the type as a constant: its branches and record sizes resolved at compile
 * time (the 1.5-bit Q1_0H panels' GEMV is bound by its instructions, not by the memory) */
static void panel_rows(int type, const uint8_t *panels, int p, int n, int k, const int8_t *aq,
                       const float *ad, const float *as, const int32_t *cb, int m, float *y,
                       int accumulate) {
#define QLIB_PANEL_CASE(T)                                                                    \
    case T: panel_rows_t(T, panels, p, n, k, aq, ad, as, cb, m, y, accumulate); break;
    switch (type) {
        QLIB_PANEL_CASE(QLIB_Q4_0)
        QLIB_PANEL_CASE(QLIB_Q4_1)
        QLIB_PANEL_CASE(QLIB_Q8_0)
        QLIB_PANEL_CASE(QLIB_IQ4_NL)
        QLIB_PANEL_CASE(QLIB_MXFP4H)
        QLIB_PANEL_CASE(QLIB_NVFP4H)
        QLIB_PANEL_CASE(QLIB_Q1_0H)
    }
#undef QLIB_PANEL_CASE
}

/* y[m, n] (+)= f(x)[m, k] @ W[n, k].T, where f is RmsNorm with weight norm_w (when not
 * NULL) or, with swiglu, silu(x[:, :k]) * x[:, k:] (x rows then hold 2k floats);
 * accumulate adds into y (a residual). Returns 0, or -1 (k % 64 != 0, out of memory). */
int qlib_qgemm_ex(int layout, const uint8_t *codes, const uint16_t *dw, const uint16_t *mw,
                  int n, int k, const float *x, int m, float *y, const float *norm_w,
                  float eps, int swiglu, int accumulate) {
    const int type = base_type(layout);
    if (k % 64 || (type != QLIB_Q4_0 && type != QLIB_Q4_1 && type != QLIB_Q5_0 &&
                   type != QLIB_Q5_1 && type != QLIB_Q8_0 && !panels_only(type)))
        return -1;
    if ((is_panels(layout) && (n % 16 || !panel_type(type))) ||
        (!is_panels(layout) && panels_only(type)))
        return -1;
    const int G = k / 32;
    const size_t row_bytes = type == QLIB_Q8_0 ? (size_t)k : (size_t)k / 2;
    if (m >= qlib_gemm_min_rows) /* many rows: the tiled path, on exact block corrections */
        return qgemm_tiled(layout, codes, row_bytes, dw, mw, n, k, x, m, y, norm_w, eps, swiglu,
                           accumulate);
    int8_t *aq = malloc((size_t)m * k);
    float *ad = malloc(sizeof(float) * (size_t)m * G);
    float *as = malloc(sizeof(float) * (size_t)m * G);
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)m * (k / 4));
    float *row = malloc(sizeof(float) * (size_t)k); /* few rows (decode): no parallel region */
    if (!aq || !ad || !as || !corr || !row) {
        free(aq), free(ad), free(as), free(corr), free(row);
        return -1;
    }
    for (int i = 0; i < m; i++) act_row(type, x, k, i, norm_w, eps, swiglu, row, aq, ad, as, corr);
    if (is_panels(layout)) {
        const int nc = corrections(type); /* the rows' block offsets (NVFP4H: per 16) */
        int32_t *cb = malloc(sizeof(int32_t) * (size_t)m * G * nc);
        if (cb) {
            for (int i = 0; i < m; i++)
                block_corrections(type, corr + (size_t)i * (k / 4), G, cb + (size_t)i * G * nc);
#pragma omp parallel for schedule(static)
            for (int p = 0; p < n / 16; p++)
                panel_rows(type, codes, p, n, k, aq, ad, as, cb, m, y, accumulate);
        }
        const int rc = cb ? 0 : -1;
        free(aq), free(ad), free(as), free(corr), free(row), free(cb);
        return rc;
    }
    const int nblk = (n + 3) / 4; /* groups of 4 weight rows */
#pragma omp parallel for schedule(static)
    for (int jb = 0; jb < nblk; jb++)
        gemv_group(jb, nblk, type, codes, row_bytes, dw, mw, n, k, aq, ad, as, corr, m, y,
                   accumulate);
    free(aq), free(ad), free(as), free(corr), free(row);
    return 0;
}

/* -- the decode step in one parallel region (decode.c) ------------------------------------ */

static inline size_t up64(size_t b) { return (b + 63) / 64 * 64; }

/* Bytes of a panel of 16 rows of k (decode.c's prefetch). */
size_t qlib_panel_bytes(int type, int k) { return (size_t)(k / 32) * panel_rec(type); }

/* Bytes of a row of k in the m plane of type (0: none; decode.c's prefetch). */
size_t qlib_qgemv_m_row_bytes(int type, int k) {
    return has_min(type) || has_qh(type) ? sizeof(uint16_t) * m_stride(type, k / 32) : 0;
}

/* Bytes of scratch qlib_qgemv_region needs per thread for rows of k. */
size_t qlib_qgemv_scratch(int k) {
    const size_t G = (size_t)k / 32;
    return up64((size_t)k) + 2 * up64(sizeof(float) * G) + up64(sizeof(int32_t) * (size_t)k / 4) +
           up64(sizeof(float) * (size_t)k);
}

/* qlib_qgemm_ex's GEMV for one row (m = 1), called by every thread of an enclosing parallel
 * region (decode.c): each thread quantizes the row into its own scratch (the same bytes as
 * the one serial quantization of qlib_qgemm_ex: no barrier before the loop), then the groups
 * of 4 weight rows are shared out by the same static schedule; ends with the loop's barrier.
 * Same arguments as qlib_qgemm_ex (already checked); scratch: qlib_qgemv_scratch(k) bytes
 * of this thread, 64-byte aligned. */
void qlib_qgemv_region(int layout, const uint8_t *codes, const uint16_t *dw, const uint16_t *mw,
                       int n, int k, const float *x, float *y, const float *norm_w, float eps,
                       int swiglu, int accumulate, uint8_t *scratch, float *shared) {
    const int type = base_type(layout), G = k / 32;
    const size_t row_bytes = type == QLIB_Q8_0 ? (size_t)k : (size_t)k / 2;
    int8_t *aq = (int8_t *)scratch;
    float *ad = (float *)(scratch + up64((size_t)k));
    float *as = (float *)((uint8_t *)ad + up64(sizeof(float) * G));
    int32_t *corr = (int32_t *)((uint8_t *)as + up64(sizeof(float) * G));
    float *row = (float *)((uint8_t *)corr + up64(sizeof(int32_t) * (size_t)k / 4));
    if (swiglu) { /* silu(gate) * up (scalar expf: ~8 us for k = 1536) split over the team */
        swiglu_shared(x, k, shared);
        x = shared;
    }
    act_row(type, x, k, 0, norm_w, eps, 0, row, aq, ad, as, corr);
    if (is_panels(layout)) {
        int32_t *cb = (int32_t *)row; /* the input row is quantized: its scratch holds them */
        if (type != QLIB_Q4_1) block_corrections(type, corr, G, cb);
#pragma omp for schedule(static)
        for (int p = 0; p < n / 16; p++)
            panel_rows(type, codes, p, n, k, aq, ad, as, cb, 1, y, accumulate);
        return;
    }
    const int nblk = (n + 3) / 4;
#pragma omp for schedule(static)
    for (int jb = 0; jb < nblk; jb++)
        gemv_group(jb, nblk, type, codes, row_bytes, dw, mw, n, k, aq, ad, as, corr, 1, y,
                   accumulate);
}

/* The decode attention step (qlib_attn_decode, qlib_attn_decode_kv) is in attn.c. */

/* GGUF blocks [n, k/32 blocks] -> the planes above (codes, d, m). */
void qlib_repack(int type, const uint8_t *blocks, int n, int k, uint8_t *codes, uint16_t *d,
                 uint16_t *m) {
    const int G = k / 32;
    if (type == (QLIB_Q1_0H | QLIB_PANELS)) { /* 6-byte blocks -> sign masks and d */
#pragma omp parallel for schedule(static)
        for (int p = 0; p < n / 16; p++)
            for (int b = 0; b < G; b++) {
                uint8_t *dst = codes + ((size_t)p * G + b) * panel_rec(type);
                memset(dst, 0, 64);
                for (int r = 0; r < 16; r++) {
                    const uint8_t *blk = blocks + (((size_t)16 * p + r) * G + b) * 6;
                    uint32_t signs;
                    memcpy(&signs, blk + 2, 4);
                    for (int e = 0; e < 32; e++) /* element e: step e / 4, bit 4r + e % 4 */
                        dst[8 * (e / 4) + (4 * r + e % 4) / 8] |=
                            (uint8_t)(((signs >> e) & 1) << ((4 * r + e % 4) % 8));
                    memcpy(dst + 64 + 2 * r, blk, 2);
                }
            }
        return;
    }
    if (is_panels(type)) { /* the panel types' blocks -> panels (n % 16) in codes */
        const int bt = base_type(type), q4_1 = two_halves(bt), q8 = bt == QLIB_Q8_0;
        const int bsize = q8 ? 34 : q4_1 ? 20 : 18, dm = q4_1 ? 4 : 2, vecs = q8 ? 8 : 4;
        const size_t rec = panel_rec(type), cbytes = panel_codes(type);
#pragma omp parallel for schedule(static)
        for (int p = 0; p < n / 16; p++)
            for (int b = 0; b < G; b++) {
                uint8_t *dst = codes + ((size_t)p * G + b) * rec;
                for (int r = 0; r < 16; r++) {
                    const uint8_t *blk = blocks + (((size_t)16 * p + r) * G + b) * bsize;
                    for (int j = 0; j < vecs; j++)
                        for (int t = 0; t < 4; t++) /* Q8_0: code + 128, as its planes */
                            dst[64 * j + 4 * r + t] = blk[dm + 4 * j + t] ^ (q8 ? 0x80 : 0);
                    memcpy(dst + cbytes + 2 * r, blk, 2);
                    if (q4_1) memcpy(dst + cbytes + 32 + 2 * r, blk + 2, 2);
                }
            }
        return;
    }
    const int bsize = type == QLIB_Q8_0   ? 34
                      : type == QLIB_Q5_1 ? 24
                      : type == QLIB_Q5_0 ? 22
                      : type == QLIB_Q4_1 ? 20
                                          : 18;
    const size_t ms = m_stride(type, G);
#pragma omp parallel for schedule(static)
    for (int j = 0; j < n; j++) {
        for (int b = 0; b < G; b++) {
            const uint8_t *blk = blocks + ((size_t)j * G + b) * bsize;
            memcpy(d + (size_t)j * G + b, blk, 2);
            if (type == QLIB_Q8_0) {
                for (int i = 0; i < 32; i++) codes[(size_t)j * k + b * 32 + i] = blk[2 + i] ^ 0x80;
                continue;
            }
            const int dm = has_min(type) ? 4 : 2; /* d (and m) */
            if (has_min(type)) memcpy(m + j * ms + b, blk + 2, 2);
            if (has_qh(type)) memcpy((uint8_t *)qh_words(type, m + j * ms, G) + 4 * b, blk + dm, 4);
            const uint8_t *qs = blk + dm + (has_qh(type) ? 4 : 0);
            uint8_t *out = codes + (size_t)j * (k / 2) + (b / 2) * 32;
            const int shift = (b % 2) * 4; /* even block: low nibbles, odd block: high */
            for (int i = 0; i < 16; i++) {
                out[i] = (uint8_t)((out[i] & ~(0x0F << shift)) | ((qs[i] & 0x0F) << shift));
                out[i + 16] = (uint8_t)((out[i + 16] & ~(0x0F << shift)) | ((qs[i] >> 4) << shift));
            }
        }
    }
}

/* The blocks of rows ids[0 .. count) of a panel weight (n rows) into out (count x k / 32
 * blocks): the inverse of qlib_repack's panels. Returns 0, or -1 (type, k, an id outside
 * 0..n-1). */
int qlib_panel_get(int type, const uint8_t *panels, int n, int k, const int64_t *ids,
                   int count, uint8_t *out) {
    if (!panel_type(type) || k % 32 || n % 16) return -1;
    const int G = k / 32, q4_1 = two_halves(type), q8 = type == QLIB_Q8_0;
    if (type == QLIB_Q1_0H) {
        for (int i = 0; i < count; i++) {
            if (ids[i] < 0 || ids[i] >= n) return -1;
            const int p = (int)(ids[i] / 16), r = (int)(ids[i] % 16);
            for (int b = 0; b < G; b++) {
                const uint8_t *src = panels + ((size_t)p * G + b) * panel_rec(type);
                uint8_t *blk = out + ((size_t)i * G + b) * 6;
                uint32_t signs = 0;
                for (int e = 0; e < 32; e++)
                    signs |= (uint32_t)((src[8 * (e / 4) + (4 * r + e % 4) / 8] >>
                                         ((4 * r + e % 4) % 8)) & 1) << e;
                memcpy(blk, src + 64 + 2 * r, 2);
                memcpy(blk + 2, &signs, 4);
            }
        }
        return 0;
    }
    const int bsize = q8 ? 34 : q4_1 ? 20 : 18, dm = q4_1 ? 4 : 2, vecs = q8 ? 8 : 4;
    const size_t rec = panel_rec(type), cbytes = panel_codes(type);
    for (int i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= n) return -1;
        const int p = (int)(ids[i] / 16), r = (int)(ids[i] % 16);
        for (int b = 0; b < G; b++) {
            const uint8_t *src = panels + ((size_t)p * G + b) * rec;
            uint8_t *blk = out + ((size_t)i * G + b) * bsize;
            memcpy(blk, src + cbytes + 2 * r, 2);
            if (q4_1) memcpy(blk + 2, src + cbytes + 32 + 2 * r, 2);
            for (int j = 0; j < vecs; j++)
                for (int t = 0; t < 4; t++)
                    blk[dm + 4 * j + t] = src[64 * j + 4 * r + t] ^ (q8 ? 0x80 : 0);
        }
    }
    return 0;
}

/* The planes -> bfloat16 bits [n, k]: ggml's dequantized float, rounded to nearest even. */
void qlib_dequant_bf16(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                       int n, int k, uint16_t *out) {
    const int G = k / 32;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < n; j++) {
        const uint16_t *mr = m ? m + j * m_stride(type, G) : NULL;
        for (int b = 0; b < G; b++) {
            const float dd = _cvtsh_ss(d[(size_t)j * G + b]);
            const float mm = has_min(type) ? _cvtsh_ss(mr[b]) : 0.0f;
            for (int i = 0; i < 32; i++) {
                int q;
                if (type == QLIB_Q8_0) {
                    q = (int)codes[(size_t)j * k + b * 32 + i] - code_offset(type);
                } else {
                    uint8_t byte = codes[(size_t)j * (k / 2) + (b / 2) * 32 + i];
                    q = (b % 2 ? byte >> 4 : byte & 0x0F) - code_offset(type);
                    if (has_qh(type)) {
                        uint32_t h;
                        memcpy(&h, qh_words(type, mr, G) + 4 * b, 4);
                        q += (int)((h >> i) & 1) * 16;
                    }
                }
                float v = has_min(type) ? dd * (float)q + mm : dd * (float)q;
                uint32_t u;
                memcpy(&u, &v, 4);
                out[(size_t)j * k + b * 32 + i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
            }
        }
    }
}

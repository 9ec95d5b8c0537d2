/* qlib CPU kernels: y = x @ W.T for K-quant (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), IQ4_XS and X4 weights,
 * with ggml semantics, reading the GGUF blocks as they are (no repacking), or Q4_K re-laid as
 * 16-row panels (below, "Q4_K as 16-row panels") where the fast engine packs it so.
 *
 * Activations are quantized as ggml's x86 backend does: Q8_K for the K-quants
 * (quantize_row_q8_K_ref: the signed value of largest magnitude max, first of equals;
 * iscale = -127 / max, codes min(127, nearest_int(iscale x)) with the 1.5 * 2^23 trick,
 * d = 1 / iscale as float32, sums of each 16 codes). The codes of each 256-block are stored
 * in the order in
 * which the weight's bit planes unpack (see act_order), so a 64-byte load of codes meets a
 * 64-byte vector of unpacked weight codes.
 *
 * K-quants: per super-block of 256 and weight row, the unpacked unsigned codes (Q3_K: q + 4,
 * Q6_K: q + 32) times the activation codes are summed in pairs (vpmaddubsw, exact: at most
 * 2 * 63 * 127), times the 16-bit sub-block scales and summed into int32 lanes (vpdpwssd):
 * the sum over the lanes is ggml's integer sumi = sum_s sc_s * isum_s, exact. The code offset
 * (Q3_K: -4, Q6_K: -32) is removed exactly with the activation sums of 16
 * (sum_s sc_s * off * bsum_s), and the mins of Q2_K / Q4_K / Q5_K give the integer
 * sum_s m_s * bsum_s. Each super-block then adds float(lanes) * (d_w d_a) (and
 * float(min sums) * (-dmin_w d_a)) into float32 lane accumulators, summed over the lanes
 * at the end of the row.
 * Rows are split over OpenMP threads; each output element is computed by one thread in a
 * fixed order, so a row's result never depends on the other rows.
 * X4 is qlib's own block, not a GGUF type: the grid i-quants (IQ1_*, IQ2_*, IQ3_*) and the
 * ternary types expanded at load to what their blocks mean (packing.py): qs[128] 4-bit indices
 * into levels[16] (the type's codes + 64), an int8 scale per 16 and a float32 d (value = d *
 * scale * code exactly as ggml dequantizes them); a vector of 64 codes is two 32-byte loads of
 * nibbles looked up by vpshufb, then run as Q6_K's codes are (offset 64 instead of 32).
 * X3 is X4 for the types of at most 8 levels (the IQ2 and IQ1 families, the ternary types):
 * 3-bit indices as a 2-bit plane (qs[64], Q2_K's: bits 2i of byte l are element 64i + l) and a
 * bit plane (hb[32]: bit e the third bit of element e), levels[8], scales:i8[16], d:f32: 124
 * bytes, 3.9 bits a weight (X4: 5.1).
 * Requires k % 256 == 0. F32 / F16 / BF16 rows, which the
 * Python side passes as one more kind of GGUF rows, go to floats.c.
 * From qlib_gemm_min_rows rows (4; prefill) the K-quants take a tiled GEMM path (below): the
 * same
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

/* floats.c: F32 / F16 / BF16 weights, handed over by the entry points below */
int qlib_float_type(int type);
int qlib_fgemm(int type, const uint8_t *w, int n, int k, const float *x, int m, float *y,
               const float *norm_w, float eps, int swiglu, int accumulate);
void qlib_fgemv_region(int type, const uint8_t *w, int n, int k, const float *x, float *y,
                       const float *norm_w, float eps, int swiglu, int accumulate,
                       float *scratch, float *shared);

/* ggml's type ids */
enum { QLIB_Q2_K = 10, QLIB_Q3_K = 11, QLIB_Q4_K = 12, QLIB_Q5_K = 13,
       QLIB_Q6_K = 14, QLIB_IQ4_XS = 23, QLIB_X3 = 59,
       QLIB_X4 = 60 /* X3, X4: qlib's (below 64: the PANELS bit) */ };


static int block_bytes(int type) {
    switch (type) {
    case QLIB_Q2_K: return 84;  /* scales[16] qs[64] d dmin */
    case QLIB_Q3_K: return 110; /* hmask[32] qs[64] scales[12] d */
    case QLIB_Q4_K: return 144; /* d dmin scales[12] qs[128] */
    case QLIB_Q5_K: return 176; /* d dmin scales[12] qh[32] qs[128] */
    case QLIB_Q6_K: return 210; /* ql[128] qh[64] scales:i8[16] d */
    case QLIB_IQ4_XS: return 136; /* d scales_h:u16 scales_l[4] qs[128] */
    case QLIB_X4: return 164;     /* qs[128] levels[16] (code + 64) scales:i8[16] d:f32 */
    case QLIB_X3: return 124;     /* qs[64] hb[32] levels[8] (code + 64) scales:i8[16] d:f32 */
    default: return 0;
    }
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The order of the 32-code chunks of an activation 256-block, as the weight unpacks:
 * Q4_K / Q5_K: the low nibbles of 64 bytes are elements 0..31 and 64..95, the high ones
 * 32..63 and 96..127 (then the same +128); Q2_K / Q3_K: bits 2j of 64 bytes are elements
 * 32j.. and 128 + 32j..; Q6_K, IQ4_XS, X4 and X3: natural order. */
static const int *act_order(int type) {
    static const int q45[8] = {0, 2, 1, 3, 4, 6, 5, 7}, q23[8] = {0, 4, 1, 5, 2, 6, 3, 7},
                     q6[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    return type == QLIB_Q4_K || type == QLIB_Q5_K       ? q45
           : type == QLIB_Q6_K || type == QLIB_IQ4_XS || type == QLIB_X4 || type == QLIB_X3
               ? q6
                                                      : q23;
}

/* One row of k floats -> Q8_K: codes (in act_order), d per 256 and, per 256, 16 int16 sums
 * for the kernels: the sums of each 16 codes (Q2_K, Q3_K, Q6_K), or for Q4_K / Q5_K zeros
 * in lanes 0..7 and the sums of each 32 codes in lanes 8..15 (the lanes of the mins). */
static void quantize_row_q8k(const float *x, int k, int type, int8_t *q, float *d,
                             int16_t *bs) {
    const int *order = act_order(type);
    const int by32 = type == QLIB_Q4_K || type == QLIB_Q5_K;
    for (int b = 0; b < k / 256; b++) {
        const float *xb = x + 256 * b;
        int8_t nat[256];
        int16_t sums[16];
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)));
        const float mx = _mm512_reduce_max_ps(amax);
        if (mx == 0.0f) {
            d[b] = 0.0f;
            memset(q + 256 * b, 0, 256);
            memset(bs + 16 * b, 0, 32);
            continue;
        }
        int first = 0; /* the first element of largest magnitude */
        for (int i = 0; i < 16; i++) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)),
                                                    _mm512_set1_ps(mx), _CMP_EQ_OQ);
            if (eq) {
                first = 16 * i + __builtin_ctz(eq);
                break;
            }
        }
        const float iscale = -127.f / xb[first];
        const __m512 vis = _mm512_set1_ps(iscale), magic = _mm512_set1_ps(12582912.f);
        for (int i = 0; i < 16; i++) { /* nearest_int: (v + 1.5 * 2^23) bits, & 2^23 - 1, - 2^22 */
            const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * i), vis), magic);
            __m512i qi = _mm512_sub_epi32(
                _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x007FFFFF)),
                _mm512_set1_epi32(0x00400000));
            qi = _mm512_min_epi32(qi, _mm512_set1_epi32(127));
            const __m128i q8 = _mm512_cvtepi32_epi8(qi); /* stored as int8 (wraps) */
            _mm_storeu_si128((__m128i *)(nat + 16 * i), q8);
            sums[i] = (int16_t)_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q8));
        }
        d[b] = 1.0f / iscale;
        for (int c = 0; c < 8; c++) memcpy(q + 256 * b + 32 * c, nat + 32 * order[c], 32);
        for (int s = 0; s < 16; s++)
            bs[16 * b + s] = !by32 ? sums[s]
                             : s < 8 ? 0
                                     : (int16_t)(sums[2 * (s - 8)] + sums[2 * (s - 8) + 1]);
    }
}

/* The 16-bit scale lanes of the 4 code vectors of a super-block: int16 lane l of vector i
 * multiplies the pair of codes 2l, 2l + 1; its value is the sub-block index into the
 * 16 int16 scales the type decodes. */
static void scale_index(int type, int16_t idx[4][32]) {
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 32; l++) {
            int s;
            if (type == QLIB_Q4_K || type == QLIB_Q5_K) /* sub-blocks (0,2) (1,3) (4,6) (5,7) */
                s = (i / 2) * 4 + i % 2 + (l < 16 ? 0 : 2);
            else if (type == QLIB_Q6_K || type == QLIB_X4 || type == QLIB_X3) /* natural, 16 each */
                s = 4 * i + l / 8;
            else if (type == QLIB_IQ4_XS) /* int32 lanes (l / 2): 32 codes a scale, 2 copies */
                s = l % 2 ? 0 : 2 * (2 * i + l / 16);
            else /* Q2_K / Q3_K: elements 32i.. and 128 + 32i.. */
                s = (l < 16 ? 2 * i : 8 + 2 * i) + (l % 16) / 8;
            idx[i][l] = (int16_t)s;
        }
}

/* 16-bit lanes: a in lanes 0..15, b in lanes 16..31 (per-half shift counts) */
static inline __m512i halves16(short a, short b) {
    return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One super-block of one weight row, unpacked: 4 vectors of 64 unsigned codes (in
 * act_order), their 16-bit scale lanes, the 16 scales (Q4_K / Q5_K: 8 scales, 8 mins) and
 * Q2_K's mins as int16, d and dmin. */
typedef struct {
    __m512i v[4], s[4];
    __m256i sc16, mn16;
    float d, dmin;
} kunpacked;

static inline __attribute__((always_inline)) void kunpack(const int type, const uint8_t *w,
                                                           const __m512i idx[4], kunpacked *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    __m512i *v = u->v;
    __m256i sc16, mn16 = _mm256_setzero_si256(); /* scales and (Q2_K) mins, int16 */
    float d, dmin = 0.0f;
    if (type == QLIB_Q4_K || type == QLIB_Q5_K) {
        d = f16_at(w), dmin = f16_at(w + 2);
        /* get_scale_min_k4 for all 8 sub-blocks: bytes 0..7 scales, 8..15 mins */
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + 4));
        const __m128i A = _mm_shuffle_epi8(
            raw, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
        const __m128i B = _mm_shuffle_epi8(
            raw, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
        const __m128i lo = _mm_and_si128(_mm_srlv_epi16(A, _mm_setr_epi16(0, 0, 0, 0, 0, 0, 4, 4)),
                                         _mm_set1_epi64x(0x0F0F0F0F3F3F3F3F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(B, 2), _mm_set1_epi64x(0x3030303000000000));
        sc16 = _mm256_cvtepu8_epi16(_mm_or_si128(lo, hi)); /* lanes 8..15: the mins */
        const uint8_t *qs = w + (type == QLIB_Q5_K ? 48 : 16);
        const __m512i q0 = _mm512_loadu_si512(qs), q1 = _mm512_loadu_si512(qs + 64);
        v[0] = _mm512_and_si512(q0, m4);
        v[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
        v[2] = _mm512_and_si512(q1, m4);
        v[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
        if (type == QLIB_Q5_K) { /* bit 2c + h of qh[l]: element 64c + 32h + l, moved to bit 4 */
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16)));
            const __m512i b4 = _mm512_set1_epi8(0x10);
            /* v0: bits 0 | 2 (left 4 | 2); v1: bits 1 | 3 (left 3 | 1); v2: bits 4 | 6 (right
             * 0 | 2); v3: bits 5 | 7 (right 1 | 3) */
            v[0] = _mm512_ternarylogic_epi32(v[0], _mm512_sllv_epi16(H, halves16(4, 2)), b4, 0xF8);
            v[1] = _mm512_ternarylogic_epi32(v[1], _mm512_sllv_epi16(H, halves16(3, 1)), b4, 0xF8);
            v[2] = _mm512_ternarylogic_epi32(v[2], _mm512_srlv_epi16(H, halves16(0, 2)), b4, 0xF8);
            v[3] = _mm512_ternarylogic_epi32(v[3], _mm512_srlv_epi16(H, halves16(1, 3)), b4, 0xF8);
        }
    } else if (type == QLIB_Q6_K) {
        d = f16_at(w + 208);
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        const __m512i ql0 = _mm512_loadu_si512(w), ql1 = _mm512_loadu_si512(w + 64);
        const __m512i qh = _mm512_loadu_si512(w + 128);
        const __m512i H0 = _mm512_shuffle_i64x2(qh, qh, 0x44); /* qh[0..31] twice */
        const __m512i H1 = _mm512_shuffle_i64x2(qh, qh, 0xEE); /* qh[32..63] twice */
        /* codes l, 32 + l: qh bits 0-1, 2-3 -> bits 4-5 (left 4 | 2); 64 + l, 96 + l: bits
         * 4-5, 6-7 (right 0 | 2) */
        const __m512i s_l = halves16(4, 2), s_r = halves16(0, 2);
        const __m512i b45 = _mm512_set1_epi8(0x30);
        v[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql0, m4), _mm512_sllv_epi16(H0, s_l),
                                         b45, 0xF8);
        v[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), m4),
                                         _mm512_srlv_epi16(H0, s_r), b45, 0xF8);
        v[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql1, m4), _mm512_sllv_epi16(H1, s_l),
                                         b45, 0xF8);
        v[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql1, 4), m4),
                                         _mm512_srlv_epi16(H1, s_r), b45, 0xF8);
    } else if (type == QLIB_Q3_K) {
        d = f16_at(w + 108);
        /* 16 signed 6-bit scales: low 4 bits from bytes 0..7 (low, then high nibbles), high
         * 2 bits of scale j from byte 8 + j % 4, bits 2 (j / 4) */
        const __m128i raw = _mm_maskz_loadu_epi8(0x0FFF, w + 96);
        const __m128i t = _mm_shuffle_epi8(raw, _mm_set1_epi64x(0x0706050403020100));
        const __m128i m4x = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_mask_blend_epi8(0xFF00, _mm_and_si128(t, m4x),
                                               _mm_and_si128(_mm_srli_epi16(t, 4), m4x));
        const __m128i u = _mm_shuffle_epi8(raw, _mm_set1_epi32(0x0B0A0908));
        const __m128i hi = _mm_and_si128(_mm_srlv_epi16(u, _mm_setr_epi16(0, 0, 2, 2, 4, 4, 6, 6)),
                                         _mm_set1_epi8(3));
        sc16 = _mm256_cvtepi8_epi16(
            _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32)));
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
        const __m512i qs = _mm512_loadu_si512(w + 32);
        const __m512i four = _mm512_set1_epi8(4);
        for (int j = 0; j < 4; j++) { /* high bit of element 128n + 32j + l: hmask[l] bit 4n + j */
            const __m512i low = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * j), m2);
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)),
                                                   _mm256_set1_epi8((char)(1 << (4 + j))), 1);
            v[j] = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bit), low, four);
        }
    } else if (type == QLIB_X4) { /* byte 32i + j: codes 64i + j (low), 64i + 32 + j (high) */
        memcpy(&d, w + 160, 4);
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 144)));
        const __m512i lv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(w + 128)));
        const __m256i m4y = _mm256_set1_epi8(0x0F);
        for (int i = 0; i < 4; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
            v[i] = _mm512_shuffle_epi8(
                lv, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(x, m4y)),
                                       _mm256_and_si256(_mm256_srli_epi16(x, 4), m4y), 1));
        }
    } else if (type == QLIB_X3) { /* vector i, byte l: element 64i + l; its index's low bits
                                   * at bits 2i of qs[l], its third bit at bit 64i + l of hb */
        memcpy(&d, w + 120, 4);
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 104)));
        const __m512i lv = _mm512_broadcast_i32x4(_mm_loadl_epi64((const __m128i *)(w + 96)));
        const __m512i qs = _mm512_loadu_si512(w), four = _mm512_set1_epi8(4);
        for (int i = 0; i < 4; i++) {
            uint64_t hb;
            memcpy(&hb, w + 64 + 8 * i, 8);
            const __m512i low = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * i), m2);
            v[i] = _mm512_shuffle_epi8(lv, _mm512_mask_add_epi8(low, (__mmask64)hb, low, four));
        }
    } else if (type == QLIB_IQ4_XS) {
        /* 8 scales ls - 32 of 32 codes (ls: a low nibble of scales_l, two bits of scales_h),
         * each twice (16 scale lanes, as the other types); a vector of 64 codes from 32 qs
         * bytes, natural order: their low nibbles are codes 0..15 and 32..47, their high ones
         * 16..31 and 48..63; each index made its level + 128 (vpshufb) */
        d = f16_at(w);
        uint16_t h;
        memcpy(&h, w + 2, 2);
        _Alignas(32) int16_t sc[16];
        for (int ib = 0; ib < 8; ib++)
            sc[2 * ib] = sc[2 * ib + 1] =
                (int16_t)((((w[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((h >> (2 * ib)) & 3) << 4)) - 32);
        sc16 = _mm256_load_si256((const __m256i *)sc);
        const __m256i m4y = _mm256_set1_epi8(0x0F);
        for (int i = 0; i < 4; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(w + 8 + 32 * i));
            const __m512i c = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(x, m4y)),
                _mm256_and_si256(_mm256_srli_epi16(x, 4), m4y), 1); /* lo 0-15 16-31, hi 0-15 16-31 */
            v[i] = iq4_levels(_mm512_shuffle_i64x2(c, c, 0xD8));
        }
    } else { /* Q2_K */
        d = f16_at(w + 80), dmin = f16_at(w + 82);
        const __m128i raw = _mm_loadu_si128((const __m128i *)w);
        sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
        mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        const __m512i qs = _mm512_loadu_si512(w + 16);
        v[0] = _mm512_and_si512(qs, m2);
        v[1] = _mm512_and_si512(_mm512_srli_epi16(qs, 2), m2);
        v[2] = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m2);
        v[3] = _mm512_and_si512(_mm512_srli_epi16(qs, 6), m2);
    }
    if (type == QLIB_IQ4_XS) { /* int32 scale lanes, for vpdpbusd's int32 sums of 4 */
        const __m512i s32 = _mm512_cvtepi16_epi32(sc16);
        for (int i = 0; i < 4; i++) u->s[i] = _mm512_permutexvar_epi32(idx[i], s32);
    } else {
        const __m512i s512 = _mm512_castsi256_si512(sc16); /* only lanes 0..15 are indexed */
        for (int i = 0; i < 4; i++) u->s[i] = _mm512_permutexvar_epi16(idx[i], s512);
    }
    u->sc16 = sc16, u->mn16 = mn16, u->d = d, u->dmin = dmin;
}

/* An unpacked super-block with the activation codes a[4] (act_order), the activation sums
 * bsv and scale da: acc += lanes of sumi * (d_w da), accm += min sums * -(dmin_w da). */
static inline __attribute__((always_inline)) void kdot(const int type, const kunpacked *u,
                                                        const __m512i a[4], __m256i bsv,
                                                        float da, __m512 *acc, __m256 *accm) {
    /* offset 32, 4, 128, 64 (X4: codes + 64 at most 126, so vpmaddubsw's pairs stay below
     * 2 * 126 * 127 < 2^15) */
    const int off_shift = type == QLIB_Q6_K     ? 5
                          : type == QLIB_Q3_K   ? 2
                          : type == QLIB_IQ4_XS ? 7
                          : type == QLIB_X4 || type == QLIB_X3 ? 6
                                                : 0;
    __m512i isum = _mm512_setzero_si512();
    if (type == QLIB_IQ4_XS) /* codes up to 241: sums of 4 in int32 (vpmaddubsw would saturate) */
        for (int i = 0; i < 4; i++)
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_dpbusd_epi32(
                                              _mm512_setzero_si512(), u->v[i], a[i]), u->s[i]));
    else
        for (int i = 0; i < 4; i++)
            isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(u->v[i], a[i]), u->s[i]);
    if (off_shift) { /* - off * sum_s sc_s bsum_s, exact */
        const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(u->sc16, bsv), off_shift);
        isum = _mm512_sub_epi32(isum, _mm512_inserti64x4(_mm512_setzero_si512(), off, 0));
    }
    if (type == QLIB_X4 || type == QLIB_X3) { /* lanes of (code + 64) sums that cancel only
                                               * across lanes (ternary codes are +-1 against
                                               * 64): their exact total, rounded once */
        const __m512 t = _mm512_set1_ps((float)_mm512_reduce_add_epi32(isum));
        *acc = _mm512_mask3_fmadd_ps(t, _mm512_set1_ps(u->d * da), *acc, 1);
        return;
    }
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(u->d * da), *acc);
    if (type == QLIB_Q4_K || type == QLIB_Q5_K || type == QLIB_Q2_K) {
        /* Q4_K / Q5_K: the mins are lanes 8..15 of sc16, bsv is 0 in lanes 0..7 */
        const __m256i im = _mm256_madd_epi16(type == QLIB_Q2_K ? u->mn16 : u->sc16, bsv);
        *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(-(u->dmin * da)), *accm);
    }
}

#ifndef QLIB_PF_GROUPS
#define QLIB_PF_GROUPS 2
#endif
#ifndef QLIB_PF_HINT
#define QLIB_PF_HINT _MM_HINT_T1
#endif

/* Dots of R consecutive weight rows (K-quant) with one Q8_K activation row. pf (or NULL):
 * R * row_bytes bytes to prefetch, spread over the super-blocks (R * bsize a step). */
static inline __attribute__((always_inline)) void krows(
    const int R, const int type, const uint8_t *w, size_t row_bytes, int nb, const int8_t *aq,
    const float *ad, const int16_t *abs_, const __m512i idx[4], const char *pf, float *y) {
    const int bsize = block_bytes(type);
    __m512 acc[4];
    __m256 accm[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm512_loadu_si512(aq + 256 * b + 64 * i);
        const __m256i bsv = _mm256_loadu_si256((const __m256i *)(abs_ + 16 * b));
        if (pf)
            for (int off = 0; off < R * bsize; off += 64)
                _mm_prefetch(pf + (size_t)b * R * bsize + off, QLIB_PF_HINT);
        for (int r = 0; r < R; r++) {
            kunpacked u;
            kunpack(type, w + r * row_bytes + (size_t)b * bsize, idx, &u);
            kdot(type, &u, a, bsv, ad[b], acc + r, accm + r);
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]) + hsum8(accm[r]);
}

/* Dots of one weight row (K-quant) with M activation rows (stride k codes, nb d, 16 nb sums),
 * each super-block unpacked once for the M: y[i] for row i. The same operations per
 * (weight row, activation row) as krows, in the same order: the same bits. */
static inline __attribute__((always_inline)) void kcols(
    const int M, const int type, const uint8_t *w, int nb, const int8_t *aq, const float *ad,
    const int16_t *abs_, const __m512i idx[4], float *y) {
    const int bsize = block_bytes(type), k = 256 * nb;
    __m512 acc[4];
    __m256 accm[4];
    for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps(), accm[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        kunpacked u;
        kunpack(type, w + (size_t)b * bsize, idx, &u);
        for (int i = 0; i < M; i++) {
            const int8_t *ai = aq + (size_t)i * k + 256 * b;
            __m512i a[4];
            for (int j = 0; j < 4; j++) a[j] = _mm512_loadu_si512(ai + 64 * j);
            const int16_t *bi = abs_ + (size_t)i * 16 * nb + 16 * b;
            const __m256i bsv = _mm256_loadu_si256((const __m256i *)bi);
            kdot(type, &u, a, bsv, ad[(size_t)i * nb + b], acc + i, accm + i);
        }
    }
    for (int i = 0; i < M; i++) y[i] = _mm512_reduce_add_ps(acc[i]) + hsum8(accm[i]);
}

/* rows (1 or 4) weight rows of one type: the type and row count as constants for the
 * inlined loops */
static void dot_rows_k(int rows, int type, const uint8_t *w, size_t row_bytes, int k,
                       const int8_t *aq, const float *ad, const int16_t *abs_,
                       const __m512i idx[4], const char *pf, float *y) {
#define QLIB_K_CASE(T)                                                                  \
    case T:                                                                             \
        if (rows == 4)                                                                  \
            krows(4, T, w, row_bytes, k / 256, aq, ad, abs_, idx, pf, y);               \
        else                                                                            \
            krows(1, T, w, row_bytes, k / 256, aq, ad, abs_, idx, NULL, y);             \
        break;
    switch (type) {
        QLIB_K_CASE(QLIB_Q2_K)
        QLIB_K_CASE(QLIB_Q3_K)
        QLIB_K_CASE(QLIB_Q4_K)
        QLIB_K_CASE(QLIB_Q5_K)
        QLIB_K_CASE(QLIB_Q6_K)
        QLIB_K_CASE(QLIB_IQ4_XS)
        QLIB_K_CASE(QLIB_X4)
        QLIB_K_CASE(QLIB_X3)
    }
#undef QLIB_K_CASE
}

/* kcols for M (1 or 4) activation rows: the type and M as constants */
static void dot_cols_k(int M, int type, const uint8_t *w, int k, const int8_t *aq,
                       const float *ad, const int16_t *abs_, const __m512i idx[4], float *y) {
#define QLIB_K_CASE(T)                                                  \
    case T:                                                             \
        if (M == 4)                                                     \
            kcols(4, T, w, k / 256, aq, ad, abs_, idx, y);              \
        else                                                            \
            kcols(1, T, w, k / 256, aq, ad, abs_, idx, y);              \
        break;
    switch (type) {
        QLIB_K_CASE(QLIB_Q2_K)
        QLIB_K_CASE(QLIB_Q3_K)
        QLIB_K_CASE(QLIB_Q4_K)
        QLIB_K_CASE(QLIB_Q5_K)
        QLIB_K_CASE(QLIB_Q6_K)
        QLIB_K_CASE(QLIB_IQ4_XS)
        QLIB_K_CASE(QLIB_X4)
        QLIB_K_CASE(QLIB_X3)
    }
#undef QLIB_K_CASE
}

/* -- the many-rows path (prefill) for Q2_K..Q6_K, as kernels.c's tiled path: a tile of KT = 32
 * weight rows unpacked once per call (kunpack) and re-laid so that a 64-byte vector holds 4
 * codes (act_order positions) of 16 weight rows (lane = weight row), times KMR activation
 * rows at a time (a broadcast of 4 activation codes per vpdpbusd). Per sub-block, a lane
 * holds the exact integer isum_s of its weight row (started at -off * bsum_s for Q3_K /
 * Q6_K); float(isum_s) * sc_s is exact in float32 (below 2^24 for every type: Q6_K at most
 * 16 * 32 * 128 * 128), and the 8 or 16 terms are summed in float32 into sumi (a vpmulld per
 * sub-block, the exact integer sum, cost 20-25% of the Q4_K / Q6_K time: p0 is the VNNI
 * port). The mins' sum_s m_s bsum_s is an exact integer (vpdpwssd on pairs of mins). Per
 * super-block: sumi * (d_w d_a) and float(min sums) * -(dmin_w d_a) in block order. The
 * integer sub-block dots are those of the GEMV path above; only the float32 combination
 * differs. */
enum { KT = 32, KMR = 4, KNV = KT / 16 };
extern int qlib_gemm_min_rows; /* kernels.c */

typedef struct {
    int nsb, ss;     /* sub-blocks per super-block, 4-code steps per sub-block */
    int sub[16];     /* natural sub-block of the p-th run of codes in act_order */
    int off, mins;   /* the code offset (Q3_K 4, Q6_K 32); whether the type has mins */
    int bs0;         /* the first lane of the activation sums of these sub-blocks */
} kgeom;

static inline __attribute__((always_inline)) kgeom kgeometry(int type) {
    kgeom g;
    const int *order = act_order(type);
    const int by32 = type == QLIB_Q4_K || type == QLIB_Q5_K;
    const int runs32 = by32 || type == QLIB_IQ4_XS; /* a scale per 32 codes (IQ4_XS: no mins) */
    g.nsb = runs32 ? 8 : 16, g.ss = runs32 ? 8 : 4;
    for (int p = 0; p < g.nsb; p++)
        g.sub[p] = runs32 ? order[p] : 2 * order[p / 2] + p % 2;
    g.off = type == QLIB_Q6_K     ? 32
            : type == QLIB_Q3_K   ? 4
            : type == QLIB_IQ4_XS ? 128
            : type == QLIB_X4 || type == QLIB_X3 ? 64
                                  : 0;
    g.mins = type == QLIB_Q2_K || by32;
    g.bs0 = by32 ? 8 : 0;
    return g;
}

/* The tile: wt codes [super-block][64 steps][KT rows][4], sc int32 [nb][16][KT], mn int32
 * pairs of int16 mins [nb][8][KT], dt / dmt float [nb][KT]. Rows past n repeat the last. */
static void ktile(int type, const kgeom *g, const uint8_t *w, size_t row_bytes, int j0, int n,
                  int nb, const __m512i idx[4], uint8_t *wt, float *sc, int32_t *mn, float *dt,
                  float *dmt) {
    const int bsize = block_bytes(type), last = n - 1 - j0;
    _Alignas(64) uint8_t tmp[KT][256];
    for (int b = 0; b < nb; b++) {
        for (int v = 0; v < KNV; v++) {
            __m512i S[16], M[16]; /* rows' scales (Q4_K / Q5_K: and mins) and Q2_K's mins */
            for (int l = 0; l < 16; l++) {
                const int r = v * 16 + l;
                const uint8_t *wr = w + (size_t)(j0 + (r < last ? r : last)) * row_bytes;
                kunpacked u;
                kunpack(type, wr + (size_t)b * bsize, idx, &u);
                for (int i = 0; i < 4; i++) _mm512_store_si512(tmp[r] + 64 * i, u.v[i]);
                S[l] = _mm512_cvtepi16_epi32(u.sc16), M[l] = _mm512_cvtepi16_epi32(u.mn16);
                dt[(size_t)b * KT + r] = u.d, dmt[(size_t)b * KT + r] = u.dmin;
            }
            transpose16(S); /* S[s]: scale s of the 16 rows */
            for (int t = 0; t < g->nsb; t++) /* (IQ4_XS: scale lanes 2t, 2t + 1 are the same) */
                _mm512_store_ps(sc + ((size_t)b * 16 + t) * KT + v * 16,
                                _mm512_cvtepi32_ps(S[type == QLIB_IQ4_XS ? 2 * t : t]));
            if (g->mins) { /* pairs of int16 mins (non-negative), low: the even one */
                const __m512i *mm = S + 8;
                if (type == QLIB_Q2_K) transpose16(M), mm = M;
                for (int p = 0; p < g->nsb / 2; p++)
                    _mm512_store_si512(mn + ((size_t)b * 8 + p) * KT + v * 16,
                                       _mm512_or_si512(mm[2 * p], _mm512_slli_epi32(mm[2 * p + 1], 16)));
            }
            for (int c = 0; c < 4; c++) {
                __m512i x[16];
                for (int l = 0; l < 16; l++) x[l] = _mm512_load_si512(tmp[v * 16 + l] + 64 * c);
                transpose16(x);
                for (int t = 0; t < 16; t++)
                    _mm512_store_si512(wt + (((size_t)b * 64 + 16 * c + t) * KT + v * 16) * 4, x[t]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void krows_tiled(
    const int MR, const int type, const uint8_t *wt, const float *sc, const int32_t *mn,
    const float *dt, const float *dmt, int nb, const int8_t *aq, const float *ad,
    const int16_t *abs_, float *y, int n, int cols, int accumulate) {
    const int k = 256 * nb;
    const kgeom geo = kgeometry(type), *g = &geo; /* constants with the type's */
    __m512 facc[KMR][KNV];
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < KNV; v++) facc[i][v] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 sumi[KMR][KNV]; /* sum_s sc_s isum_s: exact terms (< 2^24), float sums */
        for (int i = 0; i < MR; i++)
            for (int v = 0; v < KNV; v++) sumi[i][v] = _mm512_setzero_ps();
        const uint8_t *wb = wt + (size_t)b * 64 * KT * 4;
        const int8_t *ab = aq + 256 * b;
        for (int p = 0; p < g->nsb; p++) {
            const int s = g->sub[p];
            __m512i iacc[KMR][KNV];
            for (int i = 0; i < MR; i++) {
                const int16_t *bs = abs_ + ((size_t)i * nb + b) * 16; /* sums of 16 codes */
                const int c0 = !g->off ? 0
                               : type == QLIB_IQ4_XS ? -g->off * (bs[2 * s] + bs[2 * s + 1])
                                                     : -g->off * bs[s];
                for (int v = 0; v < KNV; v++) iacc[i][v] = _mm512_set1_epi32(c0);
            }
#pragma GCC unroll 8
            for (int t = p * g->ss; t < (p + 1) * g->ss; t++) {
                __m512i wv[KNV];
                for (int v = 0; v < KNV; v++) wv[v] = _mm512_load_si512(wb + (t * KT + v * 16) * 4);
                for (int i = 0; i < MR; i++) {
                    int32_t a4;
                    memcpy(&a4, ab + (size_t)i * k + 4 * t, 4);
                    const __m512i a = _mm512_set1_epi32(a4);
                    for (int v = 0; v < KNV; v++)
                        iacc[i][v] = _mm512_dpbusd_epi32(iacc[i][v], wv[v], a);
                }
            }
            for (int v = 0; v < KNV; v++) {
                const __m512 scv = _mm512_load_ps(sc + ((size_t)b * 16 + s) * KT + v * 16);
                for (int i = 0; i < MR; i++)
                    sumi[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][v]), scv, sumi[i][v]);
            }
        }
        for (int v = 0; v < KNV; v++) {
            const __m512 dwv = _mm512_load_ps(dt + (size_t)b * KT + v * 16);
            for (int i = 0; i < MR; i++) {
                const __m512 dd = _mm512_mul_ps(dwv, _mm512_set1_ps(ad[(size_t)i * nb + b]));
                facc[i][v] = _mm512_fmadd_ps(sumi[i][v], dd, facc[i][v]);
            }
        }
        if (g->mins) {
            for (int v = 0; v < KNV; v++) {
                const __m512 dmv = _mm512_load_ps(dmt + (size_t)b * KT + v * 16);
                for (int i = 0; i < MR; i++) {
                    const int16_t *bs = abs_ + ((size_t)i * nb + b) * 16 + g->bs0;
                    __m512i im = _mm512_setzero_si512();
                    for (int p = 0; p < g->nsb / 2; p++) {
                        int32_t pair;
                        memcpy(&pair, bs + 2 * p, 4);
                        im = _mm512_dpwssd_epi32(
                            im, _mm512_load_si512(mn + ((size_t)b * 8 + p) * KT + v * 16),
                            _mm512_set1_epi32(pair));
                    }
                    const __m512 dm = _mm512_mul_ps(dmv, _mm512_set1_ps(ad[(size_t)i * nb + b]));
                    facc[i][v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), dm, facc[i][v]);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < KNV && cols - v * 16 > 0; v++)
            store_lanes(y + (size_t)i * n + v * 16, facc[i][v], cols - v * 16, accumulate);
}

/* krows_tiled with the type as a constant (the geometry's loops unroll) */
static void krows_tiled_t(int MR, int type, const uint8_t *wt, const float *sc,
                          const int32_t *mn, const float *dt, const float *dmt, int nb,
                          const int8_t *aq, const float *ad, const int16_t *abs_, float *y, int n,
                          int cols, int accumulate) {
#define QLIB_KT_CASE(T)                                                                       \
    case T:                                                                                   \
        if (MR == KMR)                                                                        \
            krows_tiled(KMR, T, wt, sc, mn, dt, dmt, nb, aq, ad, abs_, y, n, cols, accumulate);  \
        else                                                                                  \
            krows_tiled(1, T, wt, sc, mn, dt, dmt, nb, aq, ad, abs_, y, n, cols, accumulate);    \
        break;
    switch (type) {
        QLIB_KT_CASE(QLIB_Q2_K)
        QLIB_KT_CASE(QLIB_Q3_K)
        QLIB_KT_CASE(QLIB_Q4_K)
        QLIB_KT_CASE(QLIB_Q5_K)
        QLIB_KT_CASE(QLIB_Q6_K)
        QLIB_KT_CASE(QLIB_IQ4_XS)
        QLIB_KT_CASE(QLIB_X4)
        QLIB_KT_CASE(QLIB_X3)
    }
#undef QLIB_KT_CASE
}

/* -- Q4_K as 16-row panels (type | QLIB_PANELS, as kernels.c's Q4_0 / Q4_1 / Q8_0 panels) -----
 * Per 16 weight rows (a panel; n % 16 == 0) and super-block, KP_SB bytes: 32 vectors of 64
 * bytes, vector 4q + i holding in its low nibbles the 4 codes of step 8q + i (act_order
 * positions 4s .. 4s + 3) and in its high nibbles those of step 8q + 4 + i, byte 4l + c for
 * row l (lane = weight row: the tiled GEMM's layout); the rows' 6-bit scales per run q of 32
 * act_order codes (u8 [8][16]); their mins in natural pairs (u8 [4][16][2]); d and dmin (f16
 * [16] each). A sub-block of 16 rows is then 8 vpdpbusd with broadcast activation codes and
 * one vpmulld by the rows' scales, where the blocks cost 16 scale decodes, 64 vpermw, 64
 * vpmaddubsw and 64 vpdpwssd: about 2.2x the blocks' rate on data in the caches
 * (tools/harness/q4k_panels.c). The integer sums are the blocks' (exact); per row
 * float(sumi) * (d_w d_a) - float(min sums) * (dmin_w d_a) per super-block in block order (the
 * blocks' GEMV sums 16 lanes of partial sums instead: the same to float rounding). 2.8% more
 * bytes than the blocks (the scales decoded). */
enum { QLIB_PANELS = 64 };
enum { KP = 16, KP_SC = 2048, KP_MN = 2176, KP_D = 2304, KP_DM = 2336, KP_SB = 2368 };
/* IQ4_XS as 16-row panels: per 16 rows and super-block XP_SB bytes: 32 vectors of 64 bytes,
 * vector 4q + i, lane l, byte c = qs[16q + 4i + c] of row l's block (its low nibble the index
 * of code 32q + 4i + c, its high one of code 32q + 16 + 4i + c: steps 8q + i and 8q + 4 + i in
 * natural order, as the Q4_K panels' nibbles), the rows' scales ls - 32 (i8 [8][16]), d (f16
 * [16]). A sub-block of 16 rows is then 8 vpshufb (index -> level + 128) and 8 vpdpbusd with
 * broadcast activation codes, less 128 x its activation sum, times the rows' scales (vpmulld):
 * the blocks' exact integer sums; the tiled GEMM's tiles are made from the panels directly
 * (ktile_xpanels: the same bytes as ktile's from the blocks). 1.5% more bytes than the blocks. */
enum { XP_SC = 2048, XP_D = 2176, XP_SB = 2208 };

/* A panel record's bytes per super-block (0: no panels of that type) */
static inline int panel_sb(int type) {
    return type == QLIB_Q4_K ? KP_SB : type == QLIB_IQ4_XS ? XP_SB : 0;
}

/* IQ4_XS rows of blocks -> panel records (qlib_kpanel_put) and back (qlib_kpanel_get) */
static void xpanel_put_row(const uint8_t *w, int nb, int j, uint8_t *panels) {
    const int l = j % KP;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * 136;
        uint8_t *o = panels + ((size_t)(j / KP) * nb + b) * XP_SB;
        const int h = blk[2] | blk[3] << 8;
        for (int q = 0; q < 8; q++) {
            const int ls = ((blk[4 + q / 2] >> (4 * (q % 2))) & 0xF) | ((h >> (2 * q)) & 3) << 4;
            o[XP_SC + 16 * q + l] = (uint8_t)(int8_t)(ls - 32);
            for (int i = 0; i < 4; i++) memcpy(o + 64 * (4 * q + i) + 4 * l, blk + 8 + 16 * q + 4 * i, 4);
        }
        memcpy(o + XP_D + 2 * l, blk, 2);
    }
}
static void xpanel_get_row(const uint8_t *panels, int nb, int j, uint8_t *w) {
    const int l = j % KP;
    for (int b = 0; b < nb; b++) {
        uint8_t *blk = w + (size_t)b * 136;
        const uint8_t *o = panels + ((size_t)(j / KP) * nb + b) * XP_SB;
        memcpy(blk, o + XP_D + 2 * l, 2);
        int h = 0;
        memset(blk + 4, 0, 4);
        for (int q = 0; q < 8; q++) {
            const int ls = (int8_t)o[XP_SC + 16 * q + l] + 32;
            blk[4 + q / 2] |= (uint8_t)((ls & 0xF) << (4 * (q % 2)));
            h |= (ls >> 4) << (2 * q);
            for (int i = 0; i < 4; i++) memcpy(blk + 8 + 16 * q + 4 * i, o + 64 * (4 * q + i) + 4 * l, 4);
        }
        blk[2] = (uint8_t)h, blk[3] = (uint8_t)(h >> 8);
    }
}

/* Bytes of the panels of an [n, k] Q4_K or IQ4_XS weight (n % 16 == 0) */
size_t qlib_kpanel_bytes(int type, int n, int k) {
    return (size_t)(n / KP) * (size_t)(k / 256) * (size_t)panel_sb(type);
}

/* Rows j0 .. j0 + rows of a panel weight from their GGUF Q4_K blocks w (rows x k / 256
 * blocks); a panel's rows may come in several calls. Returns 0, or -1 (type, k). */
int qlib_kpanel_put(int type, const uint8_t *w, int rows, int k, uint8_t *panels, int j0) {
    if (!panel_sb(type) || k % 256 || rows < 0 || j0 < 0) return -1;
    const int nb = k / 256, *order = act_order(type);
    if (type == QLIB_IQ4_XS) {
#pragma omp parallel for schedule(static)
        for (int r = 0; r < rows; r++) xpanel_put_row(w + (size_t)r * nb * 136, nb, j0 + r, panels);
        return 0;
    }
    int16_t idx_tab[4][32];
    scale_index(type, idx_tab);
    __m512i idx[4];
    for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
#pragma omp parallel for schedule(static) /* rows write disjoint bytes of their panels */
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
                    const int st = 8 * (v / 4) + v % 4;
                    o[64 * v + 4 * l + cc] = (uint8_t)(c[4 * st + cc] | c[4 * (st + 4) + cc] << 4);
                }
        }
    }
    return 0;
}

/* The GGUF Q4_K blocks of rows ids[0 .. count) of a panel weight (n rows) into out
 * (count x k / 256 blocks): the inverse of qlib_kpanel_put. Returns 0, or -1 (type, k, id). */
int qlib_kpanel_get(int type, const uint8_t *panels, int n, int k, const int64_t *ids,
                    int count, uint8_t *out) {
    if (!panel_sb(type) || k % 256) return -1;
    const int nb = k / 256, *order = act_order(type);
    for (int r = 0; r < count; r++) {
        if (ids[r] < 0 || ids[r] >= n) return -1;
        if (type == QLIB_IQ4_XS) {
            xpanel_get_row(panels, nb, (int)ids[r], out + (size_t)r * nb * 136);
            continue;
        }
        const int j = (int)ids[r], l = j % KP;
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = panels + ((size_t)(j / KP) * nb + b) * KP_SB;
            uint8_t *blk = out + ((size_t)r * nb + b) * 144, c[256], sc[8], mn[8];
            for (int v = 0; v < 32; v++)
                for (int cc = 0; cc < 4; cc++) {
                    const int st = 8 * (v / 4) + v % 4, byte = o[64 * v + 4 * l + cc];
                    c[4 * st + cc] = byte & 15, c[4 * (st + 4) + cc] = byte >> 4;
                }
            for (int q = 0; q < 8; q++) sc[order[q]] = o[KP_SC + 16 * q + l];
            for (int t = 0; t < 8; t++) mn[t] = o[KP_MN + 32 * (t / 2) + 2 * l + t % 2];
            memcpy(blk, o + KP_D + 2 * l, 2), memcpy(blk + 2, o + KP_DM + 2 * l, 2);
            for (int t = 0; t < 4; t++) { /* get_scale_min_k4's packing */
                blk[4 + t] = (uint8_t)(sc[t] | (sc[t + 4] >> 4) << 6);
                blk[8 + t] = (uint8_t)(mn[t] | (mn[t + 4] >> 4) << 6);
                blk[12 + t] = (uint8_t)((sc[t + 4] & 15) | (mn[t + 4] & 15) << 4);
            }
            for (int e = 0; e < 256; e += 32) { /* natural sub-block e / 32: its act_order run */
                int q = 0;
                while (order[q] != e / 32) q++;
                for (int i = 0; i < 32; i++) {
                    const int nat = e + i, byte = nat % 64 % 32 + 32 * (nat / 64) + 16;
                    blk[byte] = (uint8_t)(nat % 64 < 32 ? (blk[byte] & 0xF0) | c[32 * q + i]
                                                        : (blk[byte] & 0x0F) | c[32 * q + i] << 4);
                }
            }
        }
    }
    return 0;
}

/* Bytes ahead of a thread's stream that the Q4_K / IQ4_XS panels' GEMV prefetches into L2: by
 * the CPU's vendor, or as set by qlib_kpanel_set_prefetch (an A/B hook; -1 restores the
 * vendor's). On an AMD Zen 4 VM none (the hardware's prefetch alone on the one stream, as for
 * kernels.c's panels; the thirtieth session's harness: 54 against 40 GB/s); on an Intel Xeon
 * VM two Q4_K records ahead made the 1B shape's Q4_K_M decode step 31.0 -> 21.2 ms
 * (docs/performance.md, "Software prefetch by the CPU's vendor"). */
static int kpanel_prefetch_vendor(void) { return qlib_amd_cpu() ? 0 : 2 * KP_SB; }
static int qlib_kpanel_prefetch = 0;
__attribute__((constructor)) static void kpanel_prefetch_init(void) {
    qlib_kpanel_prefetch = kpanel_prefetch_vendor();
}
void qlib_kpanel_set_prefetch(int bytes) {
    qlib_kpanel_prefetch = bytes >= 0 ? bytes : kpanel_prefetch_vendor();
}

extern int qlib_act_prefetch; /* kernels.c's A/B hook, qlib_gemv_set_act_prefetch */

/* A panel GEMV's prefetches at super-block b of nb (record o of sb bytes): the record pf bytes
 * ahead (pf > 0) and the next super-block's activation codes and sums */
static inline __attribute__((always_inline)) void panel_prefetch(const uint8_t *o, int sb,
                                                                  int pf, const int8_t *aq,
                                                                  const int16_t *abs_, int b,
                                                                  int nb) {
    if (pf)
        for (int off = 0; off < sb; off += 64) _mm_prefetch((const char *)o + pf + off, _MM_HINT_T1);
    if (qlib_act_prefetch && b + 1 < nb) {
        const char *an = (const char *)(aq + 256 * (b + 1));
        _mm_prefetch(an, _MM_HINT_T0), _mm_prefetch(an + 64, _MM_HINT_T0);
        _mm_prefetch(an + 128, _MM_HINT_T0), _mm_prefetch(an + 192, _MM_HINT_T0);
        _mm_prefetch((const char *)(abs_ + 16 * (b + 1)), _MM_HINT_T0);
    }
}

/* The dots of one panel (16 rows, nb super-blocks; o: its first super-block) with one Q8_K
 * activation row (act_order codes, d, the Q4_K sums of 32 in lanes 8..15 of each 16). */
static inline __attribute__((always_inline)) __m512 kpanel_dot(const uint8_t *o, int nb,
                                                                const int8_t *aq,
                                                                const float *ad,
                                                                const int16_t *abs_, int pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, o += KP_SB) {
        panel_prefetch(o, KP_SB, pf, aq, abs_, b, nb);
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
    return acc;
}

/* The same for an IQ4_XS panel (activation sums of 16 in natural order) */
static inline __attribute__((always_inline)) __m512 xpanel_dot(const uint8_t *o, int nb,
                                                                const int8_t *aq,
                                                                const float *ad,
                                                                const int16_t *abs_, int pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, o += XP_SB) {
        panel_prefetch(o, XP_SB, pf, aq, abs_, b, nb);
        const int32_t *a32 = (const int32_t *)(aq + 256 * b);
        const int16_t *bs = abs_ + 16 * b;
        __m512i sumi = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) {
            __m512i lo = _mm512_set1_epi32(-128 * (bs[2 * q] + bs[2 * q + 1]));
            __m512i hi = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                const __m512i z = _mm512_loadu_si512(o + 64 * (4 * q + i));
                lo = _mm512_dpbusd_epi32(lo, iq4_levels(_mm512_and_si512(z, m4)),
                                         _mm512_set1_epi32(a32[8 * q + i]));
                hi = _mm512_dpbusd_epi32(hi, iq4_levels(_mm512_and_si512(_mm512_srli_epi16(z, 4), m4)),
                                         _mm512_set1_epi32(a32[8 * q + 4 + i]));
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + XP_SC + 16 * q)));
            sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), sc));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + XP_D)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, _mm512_set1_ps(ad[b])), acc);
    }
    return acc;
}

/* Panel p's 16 outputs (+)= into y + 16 p, for m activation rows (stride k codes) */
static inline void kpanel_rows(int type, const uint8_t *panels, int p, int n, int k,
                               const int8_t *aq, const float *ad, const int16_t *abs_, int m,
                               float *y, int accumulate) {
    const int nb = k / 256;
    const uint8_t *o = panels + (size_t)p * nb * panel_sb(type);
    for (int i = 0; i < m; i++) {
        const int pf = i ? 0 : qlib_kpanel_prefetch;
        const __m512 r = type == QLIB_IQ4_XS
                             ? xpanel_dot(o, nb, aq + (size_t)i * k, ad + (size_t)i * nb,
                                          abs_ + (size_t)i * 16 * nb, pf)
                             : kpanel_dot(o, nb, aq + (size_t)i * k, ad + (size_t)i * nb,
                                          abs_ + (size_t)i * 16 * nb, pf);
        float *yp = y + (size_t)i * n + KP * (size_t)p;
        _mm512_storeu_ps(yp, accumulate ? _mm512_add_ps(_mm512_loadu_ps(yp), r) : r);
    }
}

/* The tiled GEMM's tile (ktile's layout, the same bytes) of panels 2 tj and 2 tj + 1 (the
 * last one again past the end: rows whose results are not stored) */
static void ktile_panels(const uint8_t *panels, int np, int tj, int nb, uint8_t *wt, float *sc,
                         int32_t *mn, float *dt, float *dmt) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int *order = act_order(QLIB_Q4_K);
    for (int v = 0; v < KNV; v++) {
        const int p = 2 * tj + v < np ? 2 * tj + v : np - 1;
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = panels + ((size_t)p * nb + b) * KP_SB;
            for (int u = 0; u < 32; u++) {
                const int st = 8 * (u / 4) + u % 4;
                const __m512i z = _mm512_loadu_si512(o + 64 * u);
                _mm512_store_si512(wt + (((size_t)b * 64 + st) * KT + v * 16) * 4, _mm512_and_si512(z, m4));
                _mm512_store_si512(wt + (((size_t)b * 64 + st + 4) * KT + v * 16) * 4,
                                   _mm512_and_si512(_mm512_srli_epi16(z, 4), m4));
            }
            for (int q = 0; q < 8; q++)
                _mm512_store_ps(sc + ((size_t)b * 16 + order[q]) * KT + v * 16,
                                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                    _mm_loadu_si128((const __m128i *)(o + KP_SC + 16 * q)))));
            for (int q = 0; q < 4; q++)
                _mm512_store_si512(mn + ((size_t)b * 8 + q) * KT + v * 16,
                                   _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(o + KP_MN + 32 * q))));
            _mm512_store_ps(dt + (size_t)b * KT + v * 16,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + KP_D))));
            _mm512_store_ps(dmt + (size_t)b * KT + v * 16,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + KP_DM))));
        }
    }
}

/* The same for IQ4_XS panels: the indices looked up (levels + 128), the scales of the 8 runs
 * of 32 (natural order) and d */
static void ktile_xpanels(const uint8_t *panels, int np, int tj, int nb, uint8_t *wt, float *sc,
                          float *dt) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < KNV; v++) {
        const int p = 2 * tj + v < np ? 2 * tj + v : np - 1;
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = panels + ((size_t)p * nb + b) * XP_SB;
            for (int u = 0; u < 32; u++) {
                const int st = 8 * (u / 4) + u % 4;
                const __m512i z = _mm512_loadu_si512(o + 64 * u);
                _mm512_store_si512(wt + (((size_t)b * 64 + st) * KT + v * 16) * 4,
                                   iq4_levels(_mm512_and_si512(z, m4)));
                _mm512_store_si512(wt + (((size_t)b * 64 + st + 4) * KT + v * 16) * 4,
                                   iq4_levels(_mm512_and_si512(_mm512_srli_epi16(z, 4), m4)));
            }
            for (int q = 0; q < 8; q++)
                _mm512_store_ps(sc + ((size_t)b * 16 + q) * KT + v * 16,
                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128((const __m128i *)(o + XP_SC + 16 * q)))));
            _mm512_store_ps(dt + (size_t)b * KT + v * 16,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + XP_D))));
        }
    }
}

/* The tiled path of qlib_kgemm (K-quants), on the quantized activations: 0 or -1 (memory). */
static int kgemm_tiled(int type, int panels, const uint8_t *w, size_t row_bytes, int n,
                       int k, const int8_t *aq, const float *ad, const int16_t *abs_, int m,
                       float *y, int accumulate) {
    const int nb = k / 256, ntiles = (n + KT - 1) / KT;
    const kgeom g = kgeometry(type);
    int16_t idx_tab[4][32];
    scale_index(type, idx_tab);
    int failed = 0;
#pragma omp parallel
    {
        __m512i idx[4];
        for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
        uint8_t *wt = aligned_alloc(64, (size_t)KT * k);
        float *sc = aligned_alloc(64, sizeof(float) * (size_t)nb * 24 * KT);
        float *dt = aligned_alloc(64, sizeof(float) * (size_t)nb * 2 * KT);
        if (!wt || !sc || !dt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            int32_t *mn = (int32_t *)(sc + (size_t)nb * 16 * KT);
            float *dmt = dt + (size_t)nb * KT;
#pragma omp for schedule(static)
            for (int tj = 0; tj < ntiles; tj++) {
                const int j0 = tj * KT, cols = n - j0 < KT ? n - j0 : KT;
                if (panels && type == QLIB_IQ4_XS)
                    ktile_xpanels(w, n / KP, tj, nb, wt, sc, dt);
                else if (panels)
                    ktile_panels(w, n / KP, tj, nb, wt, sc, mn, dt, dmt);
                else
                    ktile(type, &g, w, row_bytes, j0, n, nb, idx, wt, sc, mn, dt, dmt);
                /* The next tile's rows (contiguous; a thread's tiles are consecutive under the
                 * static schedule) into L2 while this tile's products run, a slice of whole
                 * lines before each group of activation rows. ktile reads a super-block of
                 * each of 32 rows in turn, more streams than the hardware prefetchers follow:
                 * without this it waited on DRAM (1B-shape Q4_K_M, 128 rows, 2 threads: ~7%
                 * of the prefill; the same look-ahead in kernels.c's tiled path, whose tiles
                 * read 16 rows at a time, measured no gain) */
                const int next_rows = n - j0 - KT < KT ? n - j0 - KT : KT;
                /* a row's bytes: of its blocks, or its share of its panel (panels of 16 rows,
                 * in row order too) */
                const size_t rb = panels ? (size_t)nb * panel_sb(type) / KP : row_bytes;
                const char *next = (const char *)w + (size_t)(j0 + KT) * rb;
                const size_t next_bytes = next_rows > 0 ? (size_t)next_rows * rb : 0;
                const size_t slice = (next_bytes / ((m + KMR - 1) / KMR) + 127) & ~(size_t)63;
                size_t ahead = 0;
                for (int i = 0; i < m; i += KMR) {
                    for (const size_t end = ahead + slice < next_bytes ? ahead + slice : next_bytes;
                         ahead < end; ahead += 64)
                        _mm_prefetch(next + ahead, _MM_HINT_T1);
                    if (i + KMR <= m) {
                        krows_tiled_t(KMR, type, wt, sc, mn, dt, dmt, nb, aq + (size_t)i * k,
                                      ad + (size_t)i * nb, abs_ + (size_t)i * 16 * nb,
                                      y + (size_t)i * n + j0, n, cols, accumulate);
                        continue;
                    }
                    for (int r = i; r < m; r++) /* the last rows, one at a time */
                        krows_tiled_t(1, type, wt, sc, mn, dt, dmt, nb, aq + (size_t)r * k,
                                      ad + (size_t)r * nb, abs_ + (size_t)r * 16 * nb,
                                      y + (size_t)r * n + j0, n, cols, accumulate);
                }
            }
        }
        free(wt), free(sc), free(dt);
    }
    return failed ? -1 : 0;
}

/* Activation row i of qlib_kgemm: the input row (scratch ri), its Q8_K codes. */
static void kact_row(int type, const float *x, int k, int i, const float *norm_w, float eps,
                     int swiglu, float *ri, int8_t *aq, float *ad, int16_t *abs_) {
    const int NB = k / 256;
    input_row(x + (size_t)i * k * (swiglu ? 2 : 1), k, norm_w, eps, swiglu, ri);
    quantize_row_q8k(ri, k, type, aq + (size_t)i * k, ad + (size_t)i * NB,
                     abs_ + (size_t)i * 16 * NB);
}

/* The GEMV path of qlib_kgemm for one group of rows (<= 4) weight rows from row j (wj) times
 * the m quantized activation rows; pf: qlib_kgemm's prefetch (or NULL). */
static inline __attribute__((always_inline)) void kgemv_rows(
    int type, const uint8_t *wj, size_t row_bytes, int rows, int n, int j, int k,
    const int8_t *aq, const float *ad, const int16_t *abs_, const __m512i idx[4],
    const char *pf, int m, float *y, int accumulate) {
    const int NB = k / 256;
    for (int i = 0; i < m; i++) {
        float out[4];
        const int8_t *qi = aq + (size_t)i * k;
        const float *di = ad + (size_t)i * NB;
        const int16_t *bi = abs_ + (size_t)i * 16 * NB;
        if (rows == 4)
            dot_rows_k(4, type, wj, row_bytes, k, qi, di, bi, idx, i ? NULL : pf, out);
        else
            for (int r = 0; r < rows; r++)
                dot_rows_k(1, type, wj + r * row_bytes, row_bytes, k, qi, di, bi, idx, NULL,
                           out + r);
        float *yi = y + (size_t)i * n + j;
        for (int r = 0; r < rows; r++) yi[r] = accumulate ? yi[r] + out[r] : out[r];
    }
}

/* y[m, n] (+)= f(x)[m, k] @ W[n, k].T for W given as GGUF blocks ([n, k / 256] K-quant
 * blocks), f and the flags as in kernels.c's qlib_qgemm_ex.
 * Returns 0, or -1 (type, k % 256 != 0, out of memory). */
int qlib_kgemm(int type, const uint8_t *w, int n, int k, const float *x, int m, float *y,
               const float *norm_w, float eps, int swiglu, int accumulate) {
    if (qlib_float_type(type)) /* F32 / F16 / BF16 rows: floats.c */
        return qlib_fgemm(type, w, n, k, x, m, y, norm_w, eps, swiglu, accumulate);
    const int panels = (type & QLIB_PANELS) != 0;
    type &= ~QLIB_PANELS;
    const int bsize = block_bytes(type);
    if (!bsize || k % 256 || (panels && (!panel_sb(type) || n % KP))) return -1;
    const size_t row_bytes = (size_t)(k / 256) * bsize;
    const int NB = k / 256;
    int8_t *aq = malloc((size_t)m * k);
    float *ad = malloc(sizeof(float) * (size_t)m * NB);
    int16_t *abs_ = malloc(sizeof(int16_t) * 16 * (size_t)m * NB);
    const int par = m >= qlib_gemm_min_rows && omp_get_max_threads() > 1;
    float *row = malloc(sizeof(float) * (size_t)k * (par ? omp_get_max_threads() : 1));
    if (!aq || !ad || !abs_ || !row) {
        free(aq), free(ad), free(abs_), free(row);
        return -1;
    }
    if (par) { /* many rows: the rows' quantization split over the threads too */
#pragma omp parallel for schedule(static)
        for (int i = 0; i < m; i++)
            kact_row(type, x, k, i, norm_w, eps, swiglu, row + (size_t)omp_get_thread_num() * k,
                     aq, ad, abs_);
    } else { /* decode: no parallel region */
        for (int i = 0; i < m; i++)
            kact_row(type, x, k, i, norm_w, eps, swiglu, row, aq, ad, abs_);
    }
    if (m >= qlib_gemm_min_rows) { /* many rows: the tiled path */
        const int rc = kgemm_tiled(type, panels, w, row_bytes, n, k, aq, ad, abs_, m, y,
                                   accumulate);
        free(aq), free(ad), free(abs_), free(row);
        return rc;
    }
    if (panels) { /* a few rows: each panel's dots with each row */
#pragma omp parallel for schedule(static)
        for (int p = 0; p < n / KP; p++) kpanel_rows(type, w, p, n, k, aq, ad, abs_, m, y, accumulate);
        free(aq), free(ad), free(abs_), free(row);
        return 0;
    }
    int16_t idx_tab[4][32];
    scale_index(type, idx_tab);
    const int nblk = (n + 3) / 4; /* groups of 4 weight rows */
#pragma omp parallel for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        __m512i idx[4];
        for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
        const int j = jb * 4, rows = n - j < 4 ? n - j : 4;
        const uint8_t *wj = w + (size_t)j * row_bytes;
        /* the weights of the group QLIB_PF_GROUPS ahead into L2, a few lines per block step
         * (one burst per group, as kernels.c does, left K-quant decode 20-40% slower: rows of
         * 1-7 KB, 4 to a group) */
        const char *pf = jb + QLIB_PF_GROUPS < nblk
                             ? (const char *)(wj + 4 * QLIB_PF_GROUPS * row_bytes) : NULL;
        if (m > 1) { /* several rows (prefill): each super-block unpacked once for 4 */
            for (int i0 = 0; i0 < m; i0 += 4) {
                const int M = m - i0 < 4 ? m - i0 : 4;
                for (int r = 0; r < rows; r++) {
                    float out[4];
                    const uint8_t *wr = wj + r * row_bytes;
                    const int8_t *qi = aq + (size_t)i0 * k;
                    const float *di = ad + (size_t)i0 * NB;
                    const int16_t *bi = abs_ + (size_t)i0 * 16 * NB;
                    if (M == 4)
                        dot_cols_k(4, type, wr, k, qi, di, bi, idx, out);
                    else
                        for (int i = 0; i < M; i++)
                            dot_cols_k(1, type, wr, k, qi + (size_t)i * k, di + (size_t)i * NB,
                                       bi + (size_t)i * 16 * NB, idx, out + i);
                    for (int i = 0; i < M; i++) {
                        float *yi = y + (size_t)(i0 + i) * n + j + r;
                        *yi = accumulate ? *yi + out[i] : out[i];
                    }
                }
            }
            continue;
        }
        kgemv_rows(type, wj, row_bytes, rows, n, j, k, aq, ad, abs_, idx, pf, m, y, accumulate);
    }
    free(aq), free(ad), free(abs_), free(row);
    return 0;
}

/* -- the decode step in one parallel region (decode.c) ------------------------------------ */

static inline size_t kup64(size_t b) { return (b + 63) / 64 * 64; }

/* Bytes of scratch qlib_kgemv_region needs per thread for rows of k. */
size_t qlib_kgemv_scratch(int k) {
    const size_t NB = (size_t)k / 256;
    return kup64((size_t)k) + kup64(sizeof(float) * (NB ? NB : 1)) +
           kup64(sizeof(int16_t) * 16 * (NB ? NB : 1)) + kup64(sizeof(float) * (size_t)k);
}

/* Bytes of one weight row of k for qlib_kgemv_region's block types (0 for the float types,
 * whose rows floats.c reads) */
size_t qlib_kgemv_row_bytes(int type, int k) {
    return (size_t)(k / 256) * block_bytes(type);
}

/* Groups of 4 rows ahead that the decode region's K-quant GEMV prefetches (an A/B hook,
 * qlib_kgemv_set_prefetch; 0: none). */
static int qlib_kgemv_prefetch_groups = QLIB_PF_GROUPS;
void qlib_kgemv_set_prefetch(int groups) { qlib_kgemv_prefetch_groups = groups < 0 ? 0 : groups; }

/* qlib_kgemm's GEMV for one row (m = 1), called by every thread of an enclosing parallel
 * region (decode.c): each thread quantizes the row into its own scratch (the bytes of
 * qlib_kgemm's one serial quantization), then the groups of 4 weight rows are shared out by
 * the same static schedule; ends with the loop's barrier. Arguments as qlib_kgemm's (already
 * checked); scratch: qlib_kgemv_scratch(k) bytes of this thread, 64-byte aligned; shared: k
 * floats of the team (swiglu). */
void qlib_kgemv_region(int type, const uint8_t *w, int n, int k, const float *x, float *y,
                       const float *norm_w, float eps, int swiglu, int accumulate,
                       uint8_t *scratch, float *shared) {
    if (qlib_float_type(type)) { /* floats.c; the scratch (>= k floats) holds its row */
        qlib_fgemv_region(type, w, n, k, x, y, norm_w, eps, swiglu, accumulate,
                          (float *)scratch, shared);
        return;
    }
    const int panels = (type & QLIB_PANELS) != 0;
    type &= ~QLIB_PANELS;
    const int NB = k / 256;
    const size_t row_bytes = (size_t)NB * block_bytes(type);
    int8_t *aq = (int8_t *)scratch;
    float *ad = (float *)(scratch + kup64((size_t)k));
    int16_t *abs_ = (int16_t *)((uint8_t *)ad + kup64(sizeof(float) * (NB ? NB : 1)));
    float *row = (float *)((uint8_t *)abs_ + kup64(sizeof(int16_t) * 16 * (NB ? NB : 1)));
    if (swiglu) { /* split over the team, as qlib_qgemv_region */
        swiglu_shared(x, k, shared);
        x = shared;
    }
    kact_row(type, x, k, 0, norm_w, eps, 0, row, aq, ad, abs_);
    if (panels) { /* Q4_K panels: the static schedule's contiguous panels, one stream a thread */
#pragma omp for schedule(static)
        for (int p = 0; p < n / KP; p++) kpanel_rows(type, w, p, n, k, aq, ad, abs_, 1, y, accumulate);
        return;
    }
    int16_t idx_tab[4][32];
    scale_index(type, idx_tab);
    __m512i idx[4];
    for (int i = 0; i < 4; i++) idx[i] = _mm512_loadu_si512(idx_tab[i]);
    const int nblk = (n + 3) / 4, ahead = qlib_kgemv_prefetch_groups;
#pragma omp for schedule(static)
    for (int jb = 0; jb < nblk; jb++) {
        const int j = jb * 4, rows = n - j < 4 ? n - j : 4;
        const uint8_t *wj = w + (size_t)j * row_bytes;
        const char *pf = ahead && jb + ahead < nblk ? (const char *)(wj + 4 * ahead * row_bytes)
                                                    : NULL;
        kgemv_rows(type, wj, row_bytes, rows, n, j, k, aq, ad, abs_, idx, pf, 1, y, accumulate);
    }
}

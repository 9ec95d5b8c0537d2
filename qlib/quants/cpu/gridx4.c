/* qlib CPU load: the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), the
 * ternary types (TQ1_0, TQ2_0) and NVFP4 as qlib's X4 blocks, the bytes gridquants.as_x4 makes
 * in torch (the kernels' form of these types, kquants.c), MXFP4 / Q1_0 as the Q5_0 / Q4_0
 * blocks of fp4.as_legacy and MXFP4 / NVFP4 / Q1_0 as qlib's MXFP4H / NVFP4H / Q1_0H blocks
 * (kernels.c's panels), one block at a time over the threads: the torch conversions took
 * 5-9 s for a 1B-shape file (docs/performance.md).
 *
 * Each decoder follows ggml's dequantize_row_* (ggml-quants.c) as gridquants.py transcribes
 * it: a block's 256 integer codes (grid values with their signs; IQ1: 8 g +- 1; ternary:
 * t - 1) and, per 16 weights, its scale as a whole multiple of the block's unit (d x X4_UNIT:
 * IQ2: 2 ls + 1 of d / 8; IQ3_XXS: 2 ls + 1 of d / 4; IQ3_S: 1 + 2 ls of d; IQ1: 2 s + 1 of
 * d / 8; ternary: 1 of d). The X4 block: qs[128] (byte 32 c + j: the level index of element
 * 64 c + j low, of 64 c + 32 + j high), levels[16] (the type's codes + 64), an int8 scale per
 * 16, float32 d (the unit) at 160. The grids and the code -> level index table come from
 * Python (the gguf package's grids; gridquants.x4_levels). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ3_S = 21, T_IQ2_S = 22,
    T_IQ1_M = 29, T_TQ1_0 = 34, T_TQ2_0 = 35, T_MXFP4 = 39, T_NVFP4 = 40, T_Q1_0 = 41,
};
/* ggml's kvalues_mxfp4: E2M1 values doubled (MXFP4, NVFP4) */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
enum { X4_BYTES = 164 };

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint32_t u16_at(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ggml's ksigns_iq2xs: seven sign bits and an eighth that makes their count even */
static inline uint8_t ksigns(uint32_t i) { return (uint8_t)(i | (__builtin_popcount(i) & 1) << 7); }

/* w grid values of row `index` times the signs of byte `s` (bit j: element j negative) */
static inline void signed_row(int8_t *out, const int8_t *grid, int w, uint32_t index, uint8_t s) {
    const int8_t *row = grid + (size_t)index * w;
    for (int j = 0; j < w; j++) out[j] = (int8_t)((s >> j & 1) ? -row[j] : row[j]);
}

/* One block -> codes[256], sc[16] (scale / unit per 16 weights), and its unit's factor of d
 * (*unit_of_d) and d (*d); returns 0, or -1 for a type it does not know. */
static int decode(int type, const uint8_t *b, const int8_t *grid, int8_t *codes, int *sc,
                  float *d, float *unit_of_d) {
    switch (type) {
    case T_IQ2_XXS: /* d qs:u16[32]: per 32 four grid bytes, then a word of 4 sign indices
                       and the scale */
        *d = f16_at(b), *unit_of_d = 0.125f;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint32_t aux = u32_at(q + 4);
            for (int l = 0; l < 4; l++)
                signed_row(codes + 32 * ib + 8 * l, grid, 8, q[l], ksigns(aux >> 7 * l & 127));
            sc[2 * ib] = sc[2 * ib + 1] = 2 * (int)(aux >> 28) + 1;
        }
        return 0;
    case T_IQ2_XS: /* d qs:u16[32] scales[8]: 9-bit grid index, 7-bit sign index */
        *d = f16_at(b), *unit_of_d = 0.125f;
        for (int j = 0; j < 32; j++) {
            const uint32_t w = u16_at(b + 2 + 2 * j);
            signed_row(codes + 8 * j, grid, 8, w & 511, ksigns(w >> 9));
        }
        for (int g = 0; g < 16; g++) sc[g] = 2 * (b[66 + g / 2] >> 4 * (g % 2) & 15) + 1;
        return 0;
    case T_IQ2_S: /* d qs[32] signs[32] qh[8] scales[8]: 10-bit grid indices */
        *d = f16_at(b), *unit_of_d = 0.125f;
        for (int ib = 0; ib < 8; ib++)
            for (int l = 0; l < 4; l++) {
                const uint32_t index = b[2 + 4 * ib + l] | ((uint32_t)b[66 + ib] << (8 - 2 * l) & 0x300);
                signed_row(codes + 32 * ib + 8 * l, grid, 8, index, b[34 + 4 * ib + l]);
            }
        for (int g = 0; g < 16; g++) sc[g] = 2 * (b[74 + g / 2] >> 4 * (g % 2) & 15) + 1;
        return 0;
    case T_IQ3_XXS: /* d qs[64] scales_signs:u32[8]: grid rows of 4, a word per 32 */
        *d = f16_at(b), *unit_of_d = 0.25f;
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t aux = u32_at(b + 66 + 4 * ib);
            for (int l = 0; l < 4; l++) {
                const uint8_t s = ksigns(aux >> 7 * l & 127);
                signed_row(codes + 32 * ib + 8 * l, grid, 4, b[2 + 8 * ib + 2 * l], s);
                signed_row(codes + 32 * ib + 8 * l + 4, grid, 4, b[3 + 8 * ib + 2 * l], s >> 4);
            }
            sc[2 * ib] = sc[2 * ib + 1] = 2 * (int)(aux >> 28) + 1;
        }
        return 0;
    case T_IQ3_S: /* d qs[64] qh[8] signs[32] scales[4]: 9-bit grid indices, rows of 4 */
        *d = f16_at(b), *unit_of_d = 1.0f;
        for (int ib = 0; ib < 8; ib++) {
            for (int l = 0; l < 4; l++) {
                const uint8_t s = b[74 + 4 * ib + l];
                for (int h = 0; h < 2; h++) {
                    const int p = 2 * l + h;
                    const uint32_t index = b[2 + 8 * ib + p] | ((uint32_t)b[66 + ib] << (8 - p) & 256);
                    signed_row(codes + 32 * ib + 8 * l + 4 * h, grid, 4, index, s >> 4 * h);
                }
            }
            sc[2 * ib] = sc[2 * ib + 1] = 1 + 2 * (b[106 + ib / 2] >> 4 * (ib % 2) & 15);
        }
        return 0;
    case T_IQ1_S: /* d qs[32] qh:u16[8]: 11-bit grid indices of -1 / 0 / 1, a shift per 32 */
        *d = f16_at(b), *unit_of_d = 0.125f;
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t qh = u16_at(b + 34 + 2 * ib);
            const int shift = qh >> 15 & 1 ? -1 : 1;
            for (int l = 0; l < 4; l++) {
                const int8_t *row = grid + (size_t)(b[2 + 4 * ib + l] | (qh >> 3 * l & 7) << 8) * 8;
                for (int j = 0; j < 8; j++) codes[32 * ib + 8 * l + j] = (int8_t)(8 * row[j] + shift);
            }
            sc[2 * ib] = sc[2 * ib + 1] = 2 * (int)(qh >> 12 & 7) + 1;
        }
        return 0;
    case T_IQ1_M: { /* qs[32] qh[16] scales:u16[4]: d in the scales' top nibbles */
        uint32_t s[4];
        for (int i = 0; i < 4; i++) s[i] = u16_at(b + 48 + 2 * i);
        const uint16_t dbits = (uint16_t)(s[0] >> 12 | (s[1] >> 8 & 0xF0) | (s[2] >> 4 & 0xF00) |
                                          (s[3] & 0xF000));
        *d = _cvtsh_ss(dbits), *unit_of_d = 0.125f;
        for (int ib = 0; ib < 8; ib++)
            for (int h = 0; h < 2; h++) {
                const uint32_t qh = b[32 + 2 * ib + h];
                for (int l = 0; l < 2; l++) {
                    const uint32_t index = b[4 * ib + 2 * h + l] | (qh << (l ? 4 : 8) & 0x700);
                    const int shift = qh >> (l ? 7 : 3) & 1 ? -1 : 1;
                    const int8_t *row = grid + (size_t)index * 8;
                    for (int j = 0; j < 8; j++)
                        codes[32 * ib + 16 * h + 8 * l + j] = (int8_t)(8 * row[j] + shift);
                }
            }
        for (int g = 0; g < 16; g++) sc[g] = 2 * (int)(s[g / 4] >> 3 * (g % 4) & 7) + 1;
        return 0;
    }
    case T_TQ1_0: { /* qs[48] qh[4] d: five base-3 digits a byte (qs), four (qh) */
        static const int pow3[5] = {1, 3, 9, 27, 81};
        int at = 0;
        const int spans[3][3] = {{0, 32, 5}, {32, 16, 5}, {48, 4, 4}}; /* start, bytes, digits */
        for (int p = 0; p < 3; p++)
            for (int n = 0; n < spans[p][2]; n++)
                for (int m = 0; m < spans[p][1]; m++) {
                    const int q = b[spans[p][0] + m] * pow3[n] & 255;
                    codes[at++] = (int8_t)((q * 3 >> 8) - 1);
                }
        *d = f16_at(b + 52), *unit_of_d = 1.0f;
        for (int g = 0; g < 16; g++) sc[g] = 1;
        return 0;
    }
    case T_TQ2_0: /* qs[64] d: element 128 h + 32 l + m in bits 2 l of byte 32 h + m */
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 4; l++)
                for (int m = 0; m < 32; m++)
                    codes[128 * h + 32 * l + m] = (int8_t)((b[32 * h + m] >> 2 * l & 3) - 1);
        *d = f16_at(b + 64), *unit_of_d = 1.0f;
        for (int g = 0; g < 16; g++) sc[g] = 1;
        return 0;
    }
    return -1;
}

/* ggml's ggml_ue4m3_to_fp32: an unsigned E4M3 scale, halved (0 for 0 and 0x7F) */
static inline float ue4m3(uint8_t x) {
    if (x == 0 || x == 0x7F) return 0.0f;
    const int exp = x >> 3 & 0xF, man = x & 7;
    const float raw = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return raw * 0.5f;
}

/* Four NVFP4 blocks (64 weights each) -> codes[256] and sc[16] as whole multiples of *unit, the
 * finest power of two of their 16 scales (4 significant bits each: s = N 2^e, N < 16); -1
 * where a scale is not such a multiple <= 127 (scales more than 2^3 apart). */
static int decode_nvfp4(const uint8_t *b, int8_t *codes, int *sc, float *unit) {
    float s[16];
    int emin = 1 << 20;
    for (int blk = 0; blk < 4; blk++)
        for (int g = 0; g < 4; g++) {
            const uint8_t *x = b + 36 * blk;
            s[4 * blk + g] = ue4m3(x[g]);
            for (int j = 0; j < 8; j++) {
                codes[64 * blk + 16 * g + j] = KVALUES_MXFP4[x[4 + 8 * g + j] & 15];
                codes[64 * blk + 16 * g + 8 + j] = KVALUES_MXFP4[x[4 + 8 * g + j] >> 4];
            }
            if (s[4 * blk + g] > 0.0f) {
                int e;
                frexpf(s[4 * blk + g], &e);
                if (e - 4 < emin) emin = e - 4;
            }
        }
    *unit = ldexpf(1.0f, emin == 1 << 20 ? 0 : emin);
    for (int g = 0; g < 16; g++) {
        const float q = s[g] / *unit;
        if (q != rintf(q) || q > 127.0f || *unit * q != s[g]) return -1;
        sc[g] = (int)q;
    }
    return 0;
}

static int block_bytes(int type) {
    switch (type) {
    case T_IQ2_XXS: return 66;
    case T_IQ2_XS: return 74;
    case T_IQ2_S: return 82;
    case T_IQ3_XXS: return 98;
    case T_IQ3_S: return 110;
    case T_IQ1_S: return 50;
    case T_IQ1_M: return 56;
    case T_TQ1_0: return 54;
    case T_TQ2_0: return 66;
    }
    return 0;
}

/* X4 bytes of one super-block's codes, scales (whole multiples of unit) and levels; 0, or -3
 * for a code the levels lack */
static int emit_x4(const int8_t *codes, const int *sc, float unit, const uint8_t *index,
                   const uint8_t *levels, uint8_t *o) {
    int bad = 0;
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++) {
            const uint8_t lo = index[codes[64 * c + j] + 128], hi = index[codes[64 * c + 32 + j] + 128];
            bad |= lo > 15 || hi > 15;
            o[32 * c + j] = (uint8_t)(lo | hi << 4);
        }
    if (bad) return -3;
    memcpy(o + 128, levels, 16);
    for (int g = 0; g < 16; g++) o[144 + g] = (uint8_t)(int8_t)(unit == 0.0f ? 0 : sc[g]);
    memcpy(o + 160, &unit, 4);
    return 0;
}

/* One GGUF 256-weight block of `type` (NVFP4: four blocks) -> its X4 block at o: 0, or -2 (a
 * non-finite d), -3 (a code the levels lack), -4 (NVFP4 scales no one unit holds) */
static int x4_block(int type, const uint8_t *src, const int8_t *grid, const uint8_t *index,
                    const uint8_t *levels, uint8_t *o) {
    _Alignas(64) int8_t codes[256];
    int sc[16];
    float unit;
    if (type == T_NVFP4) {
        if (decode_nvfp4(src, codes, sc, &unit)) return -4;
    } else {
        float d, unit_of_d;
        decode(type, src, grid, codes, sc, &d, &unit_of_d);
        if (!isfinite(d)) return -2;
        unit = d * unit_of_d; /* exact: a power of 2 (or 1) times an f16 */
    }
    return emit_x4(codes, sc, unit, index, levels, o);
}

/* An X4 block -> its X3 block (qs[64]: the indices' low two bits, bits 2i of byte l for
 * element 64i + l; hb[32]: their third bits, bit e for element e; levels[8] scales[16] d),
 * kquants.c's: 0, or -5 for an index of 8 or more (a type of more than 8 levels) */
static int x3_of_x4(const uint8_t *x, uint8_t *o) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m512i low = _mm512_setzero_si512(), big = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) { /* elements 64c + l: byte l of the chunk's indices */
        const __m256i b = _mm256_loadu_si256((const __m256i *)(x + 32 * c));
        const __m512i index = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(b, m4)),
            _mm256_and_si256(_mm256_srli_epi16(b, 4), m4), 1);
        big = _mm512_or_si512(big, index);
        low = _mm512_or_si512(low, _mm512_sllv_epi16(_mm512_and_si512(index, _mm512_set1_epi8(3)),
                                                     _mm512_set1_epi16((short)(2 * c))));
        const uint64_t third = _mm512_test_epi8_mask(index, _mm512_set1_epi8(4));
        memcpy(o + 64 + 8 * c, &third, 8);
    }
    _mm512_storeu_si512(o, low);
    memcpy(o + 96, x + 128, 8);
    memcpy(o + 104, x + 144, 20);
    return _mm512_test_epi8_mask(big, _mm512_set1_epi8(8)) ? -5 : 0;
}

/* n GGUF blocks of `type` -> n X4 blocks at out (x3: X3 blocks, for the types of at most 8
 * levels). grid: the type's grid (int8 rows of 8 or 4), index[c + 128]: the level index of
 * code c (16: none), levels: the 16 level bytes. Returns 0; -1 (an unknown type), or a block's
 * status (x4_block, x3_of_x4). */
static int from_blocks(int type, const uint8_t *blocks, int64_t n, const int8_t *grid,
                       const uint8_t *index, const uint8_t *levels, uint8_t *out, int x3) {
    const int size = type == T_NVFP4 ? 4 * 36 : block_bytes(type); /* NVFP4: 4 blocks a 256 */
    if (!size) return -1;
    int status = 0;
#pragma omp parallel for schedule(static) reduction(min : status)
    for (int64_t i = 0; i < n; i++) {
        _Alignas(64) uint8_t x4[X4_BYTES];
        uint8_t *o = x3 ? x4 : out + i * X4_BYTES;
        int bad = x4_block(type, blocks + i * size, grid, index, levels, o);
        if (!bad && x3) bad = x3_of_x4(x4, out + i * 124);
        if (bad) status = bad;
    }
    return status;
}

int qlib_x4_from_blocks(int type, const uint8_t *blocks, int64_t n, const int8_t *grid,
                        const uint8_t *index, const uint8_t *levels, uint8_t *out) {
    return from_blocks(type, blocks, n, grid, index, levels, out, 0);
}

int qlib_x3_from_blocks(int type, const uint8_t *blocks, int64_t n, const int8_t *grid,
                        const uint8_t *index, const uint8_t *levels, uint8_t *out) {
    return from_blocks(type, blocks, n, grid, index, levels, out, 1);
}

/* An MXFP4 block's scale 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF: subnormal below e = 2) */
static inline float e8m0_half(uint32_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}

/* n MXFP4 blocks (e:u8 qs[16]) -> n MXFP4H blocks (d:f16 qs[16]: the same nibbles, the scale
 * as an f16; a block of zeros takes d = 0), kernels.c's panels' input. Returns 0, or -2 (a
 * scale that f16 does not hold under codes that are not all zero). */
int qlib_mxfp4h_from_blocks(const uint8_t *blocks, int64_t n, uint8_t *out) {
    int status = 0;
#pragma omp parallel for schedule(static) reduction(min : status)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *x = blocks + i * 17;
        uint8_t *o = out + i * 18;
        uint32_t any = 0;
        for (int j = 0; j < 16; j++) any |= (x[1 + j] & 7u) | (x[1 + j] & 0x70u);
        const float d = any ? e8m0_half(x[0]) : 0.0f;
        const uint16_t h = _cvtss_sh(d, 0);
        if (_cvtsh_ss(h) != d) status = -2;
        memcpy(o, &h, 2);
        memcpy(o + 2, x + 1, 16);
    }
    return status;
}

/* n NVFP4 blocks (d:u8[4] qs[32], 64 weights) -> 2n NVFP4H blocks (d0:f16 d1:f16 qs[16]: the
 * scales of groups 2h and 2h + 1 as f16, exact for every E4M3 byte; byte j holds element j of
 * group 2h low and of group 2h + 1 high), kernels.c's panels' input. Returns 0. */
int qlib_nvfp4h_from_blocks(const uint8_t *blocks, int64_t n, uint8_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *x = blocks + i * 36;
        for (int h = 0; h < 2; h++) {
            uint8_t *o = out + (2 * i + h) * 20;
            for (int g = 0; g < 2; g++) {
                const uint16_t d = _cvtss_sh(ue4m3(x[2 * h + g]), 0);
                memcpy(o + 2 * g, &d, 2);
            }
            const uint8_t *q0 = x + 4 + 8 * (2 * h), *q1 = q0 + 8; /* element j: byte j % 8 */
            for (int j = 0; j < 16; j++) {
                const int lo = j < 8 ? q0[j] & 15 : q0[j - 8] >> 4;
                const int hi = j < 8 ? q1[j] & 15 : q1[j - 8] >> 4;
                o[4 + j] = (uint8_t)(lo | hi << 4);
            }
        }
    }
    return 0;
}

/* n Q1_0 blocks (d:f16 qs[16], 128 weights) -> 4n Q1_0H blocks (d:f16 qs[4]: the same d, the
 * signs of weights 32s .. 32s + 31), kernels.c's panels' input. Returns 0, or -2 (a NaN d, as
 * qlib_legacy_from_blocks). */
int qlib_q1_0h_from_blocks(const uint8_t *blocks, int64_t n, uint8_t *out) {
    int status = 0;
#pragma omp parallel for schedule(static) reduction(min : status)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *x = blocks + i * 18;
        for (int s = 0; s < 4; s++) {
            memcpy(out + (4 * i + s) * 6, x, 2);
            memcpy(out + (4 * i + s) * 6 + 2, x + 2 + 4 * s, 4);
        }
        if (isnan(_cvtsh_ss((uint16_t)(x[0] | x[1] << 8)))) status = -2;
    }
    return status;
}

/* n MXFP4 blocks (32 weights) -> n Q5_0 blocks (d:f16 qh[4] qs[16]: code + 16), or n Q1_0
 * blocks (128 weights) -> 4n Q4_0 blocks (d:f16 qs[16]: code + 8), of the same values (a
 * block of zeros takes d = 0). Returns 0, -1 (another type), -2 (an MXFP4 scale that f16 does
 * not hold under codes that are not all zero). */
int qlib_legacy_from_blocks(int type, const uint8_t *blocks, int64_t n, uint8_t *out) {
    if (type != T_MXFP4 && type != T_Q1_0) return -1;
    int status = 0;
#pragma omp parallel for schedule(static) reduction(min : status)
    for (int64_t i = 0; i < n; i++) {
        if (type == T_MXFP4) {
            const uint8_t *x = blocks + i * 17;
            uint8_t *o = out + i * 22;
            float d = e8m0_half(x[0]);
            uint32_t qh = 0, any = 0;
            for (int j = 0; j < 16; j++) {
                const int lo = KVALUES_MXFP4[x[1 + j] & 15] + 16, hi = KVALUES_MXFP4[x[1 + j] >> 4] + 16;
                o[6 + j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                qh |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
                any |= (uint32_t)(lo != 16) | (uint32_t)(hi != 16);
            }
            if (!any) d = 0.0f;
            const uint16_t h = _cvtss_sh(d, 0);
            if (_cvtsh_ss(h) != d) status = -2;
            memcpy(o, &h, 2);
            memcpy(o + 2, &qh, 4);
        } else {
            const uint8_t *x = blocks + i * 18;
            for (int s = 0; s < 4; s++) {
                uint8_t *o = out + (4 * i + s) * 18;
                for (int j = 0; j < 16; j++) {
                    const int e0 = 32 * s + j, e1 = e0 + 16; /* +-1 -> 9 or 7 */
                    const int lo = (x[2 + e0 / 8] >> e0 % 8 & 1) ? 9 : 7;
                    const int hi = (x[2 + e1 / 8] >> e1 % 8 & 1) ? 9 : 7;
                    o[2 + j] = (uint8_t)(lo | hi << 4);
                }
                memcpy(o, x, 2); /* the same f16 d (no code of Q1_0 is zero) */
            }
            if (isnan(_cvtsh_ss((uint16_t)(x[0] | x[1] << 8)))) status = -2; /* (as torch's) */
        }
    }
    return status;
}

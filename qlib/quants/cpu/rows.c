/* qlib CPU rows: rows of a weight as float32, the values ggml's dequantize_row_* gives (the
 * same float32 products and differences in the same order; -ffp-contract=off keeps them
 * apart), for the embedding lookup of a decode step: one C call for the token's row where
 * the torch / numpy ops took 0.15-0.5 ms on the caches a step leaves (docs/performance.md,
 * "The embedding row in C").
 *
 * qlib_dequant_rows reads GGUF blocks of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q2_K..Q6_K, IQ4_NL, IQ4_XS (and qlib's X4, X3, MXFP4H, NVFP4H and Q1_0H blocks), row after
 * row, or 16-row panels (type | 64) of Q4_0 / Q4_1 / Q8_0 / IQ4_NL and qlib's (kernels.c's
 * qlib_panel_get) and Q4_K / IQ4_XS (kquants.c's qlib_kpanel_get), which give a row's blocks
 * back. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
    T_IQ4_XS = 23, T_BF16 = 30, T_X3 = 59, T_X4 = 60 /* qlib's expanded i-quants: kquants.c */,
    T_MXFP4H = 61, T_NVFP4H = 62, T_Q1_0H = 63 /* qlib's blocks of 32: kernels.c */,
    PANELS = 64,
};

int qlib_panel_get(int type, const uint8_t *panels, int n, int k, const int64_t *ids,
                   int count, uint8_t *out); /* kernels.c */
int qlib_kpanel_get(int type, const uint8_t *panels, int n, int k, const int64_t *ids,
                    int count, uint8_t *out); /* kquants.c */

/* (elements, bytes) of one block of a type; 0 elements: not read here */
static void block_shape(int type, int *qk, int *bytes) {
    static const struct { int type, qk, bytes; } shapes[] = {
        {T_F32, 1, 4}, {T_F16, 1, 2}, {T_BF16, 1, 2}, {T_Q4_0, 32, 18}, {T_Q4_1, 32, 20},
        {T_Q5_0, 32, 22}, {T_Q5_1, 32, 24}, {T_Q8_0, 32, 34}, {T_Q2_K, 256, 84},
        {T_Q3_K, 256, 110}, {T_Q4_K, 256, 144}, {T_Q5_K, 256, 176}, {T_Q6_K, 256, 210},
        {T_IQ4_NL, 32, 18}, {T_IQ4_XS, 256, 136}, {T_X4, 256, 164}, {T_X3, 256, 124},
        {T_MXFP4H, 32, 18}, {T_NVFP4H, 32, 20}, {T_Q1_0H, 32, 6},
    };
    *qk = *bytes = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (shapes[i].type == type) *qk = shapes[i].qk, *bytes = shapes[i].bytes;
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 24;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes q */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | (q[j - 4] >> 6) << 4;
        *m = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
    }
}

/* One block of the legacy types (32 elements) */
static void legacy_block(int type, const uint8_t *b, float *y) {
    const float d = f16(b);
    if (type == T_Q8_0) {
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
        return;
    }
    const int has_m = type == T_Q4_1 || type == T_Q5_1, has_h = type == T_Q5_0 || type == T_Q5_1;
    const float m = has_m ? f16(b + 2) : 0.0f;
    uint32_t qh = 0;
    if (has_h) memcpy(&qh, b + (has_m ? 4 : 2), 4);
    const uint8_t *qs = b + 2 + (has_m ? 2 : 0) + (has_h ? 4 : 0);
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
    for (int i = 0; i < 16; i++) {
        const int hi0 = has_h ? (int)((qh >> i) << 4 & 0x10) : 0;
        const int hi1 = has_h ? (int)(qh >> (i + 12) & 0x10) : 0;
        const int x0 = ((qs[i] & 0xF) | hi0) - offset, x1 = ((qs[i] >> 4) | hi1) - offset;
        if (has_m) {
            y[i] = (float)x0 * d + m, y[i + 16] = (float)x1 * d + m;
        } else {
            y[i] = (float)x0 * d, y[i + 16] = (float)x1 * d;
        }
    }
}

static void q2_k_block(const uint8_t *b, float *y) {
    const uint8_t *scales = b, *q = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    int is = 0;
    for (int half = 0; half < 2; half++, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int part = 0; part < 2; part++) {
                const int sc = scales[is++];
                const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)(q[l + 16 * part] >> shift & 3) - ml;
            }
}

static void q3_k_block(const uint8_t *b, float *y) {
    const uint8_t *hmask = b, *q = b + 32, *packed = b + 96;
    const float d = f16(b + 108);
    int8_t scales[16]; /* 6-bit: the low 4 bits from bytes 0-7, the high 2 from bytes 8-11 */
    for (int j = 0; j < 16; j++) {
        const int lo = j < 8 ? packed[j] & 0xF : packed[j - 8] >> 4;
        const int hi = packed[8 + j % 4] >> (2 * (j / 4)) & 3;
        scales[j] = (int8_t)(lo | hi << 4);
    }
    int is = 0;
    uint8_t m = 1;
    for (int half = 0; half < 2; half++, q += 32)
        for (int shift = 0; shift < 8; shift += 2, m <<= 1)
            for (int part = 0; part < 2; part++) {
                const float dl = d * (float)(scales[is++] - 32);
                for (int l = 16 * part; l < 16 * part + 16; l++)
                    *y++ = dl * (float)((q[l] >> shift & 3) - (hmask[l] & m ? 0 : 4));
            }
}

/* Q4_K (qh NULL) and Q5_K (qh: its high bits), the low 4 bits at ql */
static void q45_k_block(const uint8_t *b, const uint8_t *qh, const uint8_t *ql, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *packed = b + 4;
    for (int j = 0; j < 4; j++, ql += 32) {
        int sc, mn;
        scale_min_k4(2 * j, packed, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min_k4(2 * j + 1, packed, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 0xF) + (qh && qh[l] >> (2 * j) & 1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + (qh && qh[l] >> (2 * j + 1) & 1 ? 16 : 0)) - m2;
    }
}

static void q6_k_block(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int half = 0; half < 2; half++, y += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (qh[l] & 3) << 4) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (qh[l] >> 2 & 3) << 4) - 32;
            const int q3 = ((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
}

/* ggml's kvalues_iq4nl */
static const int8_t iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* ggml's kvalues_mxfp4 (E2M1 values doubled; the E8M0 scale halved as MXFP4H's d) */
static const int8_t mxfp4_levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* IQ4_NL, MXFP4H (levels): d times the level of each index (element j low nibble, j + 16
 * high) */
static void levels_block(const uint8_t *b, const int8_t *levels, float *y) {
    const float d = f16(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)levels[b[2 + j] & 0xF];
        y[j + 16] = d * (float)levels[b[2 + j] >> 4];
    }
}

/* NVFP4H: d0 times the level of each low nibble (elements 0..15), d1 of each high one */
static void nvfp4h_block(const uint8_t *b, float *y) {
    const float d0 = f16(b), d1 = f16(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d0 * (float)mxfp4_levels[b[4 + j] & 0xF];
        y[j + 16] = d1 * (float)mxfp4_levels[b[4 + j] >> 4];
    }
}

/* Q1_0H: +d where element e's bit is set, -d where clear */
static void q1_0h_block(const uint8_t *b, float *y) {
    const float d = f16(b);
    for (int e = 0; e < 32; e++) y[e] = (b[2 + e / 8] >> (e % 8) & 1) ? d : -d;
}

/* IQ4_XS: sub-block ib's scale d * (ls - 32) times the level of each index */
static void iq4_xs_block(const uint8_t *b, float *y) {
    const float d = f16(b);
    const int h = b[2] | b[3] << 8;
    for (int ib = 0; ib < 8; ib++, y += 32) {
        const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | ((h >> (2 * ib)) & 3) << 4;
        const float dl = d * (float)(ls - 32);
        const uint8_t *qs = b + 8 + 16 * ib;
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)iq4_levels[qs[j] & 0xF];
            y[j + 16] = dl * (float)iq4_levels[qs[j] >> 4];
        }
    }
}

/* X4: d * scale (per 16) times the level of each index, the levels stored + 64 (kquants.c) */
static void x4_block(const uint8_t *b, float *y) {
    float d;
    memcpy(&d, b + 160, 4);
    for (int i = 0; i < 256; i++) {
        const int j = i % 64, byte = b[32 * (i / 64) + j % 32];
        const int code = b[128 + (j < 32 ? byte & 0xF : byte >> 4)] - 64;
        y[i] = d * (float)(int8_t)b[144 + i / 16] * (float)code;
    }
}

/* X3: the same with 3-bit indices, their low bits at bits 2 (e / 64) of byte e % 64, their
 * third bit at bit e of hb (byte 64 on), 8 levels (kquants.c) */
static void x3_block(const uint8_t *b, float *y) {
    float d;
    memcpy(&d, b + 120, 4);
    for (int e = 0; e < 256; e++) {
        const int low = (b[e % 64] >> (2 * (e / 64))) & 3, high = (b[64 + e / 8] >> (e % 8)) & 1;
        const int index = low | high << 2;
        y[e] = d * (float)(int8_t)b[104 + e / 16] * (float)(b[96 + index] - 64);
    }
}

/* One row of k elements from its GGUF blocks */
static void dequant_row(int type, const uint8_t *row, int k, float *y) {
    int qk, bytes;
    block_shape(type, &qk, &bytes);
    for (int i = 0; i < k / qk; i++, row += bytes, y += qk) {
        switch (type) {
        case T_F32: memcpy(y, row, 4); break;
        case T_F16: *y = f16(row); break;
        case T_BF16: *y = bf16(row); break;
        case T_Q2_K: q2_k_block(row, y); break;
        case T_Q3_K: q3_k_block(row, y); break;
        case T_Q4_K: q45_k_block(row, NULL, row + 16, y); break;
        case T_Q5_K: q45_k_block(row, row + 16, row + 48, y); break;
        case T_Q6_K: q6_k_block(row, y); break;
        case T_IQ4_NL: levels_block(row, iq4_levels, y); break;
        case T_MXFP4H: levels_block(row, mxfp4_levels, y); break;
        case T_NVFP4H: nvfp4h_block(row, y); break;
        case T_Q1_0H: q1_0h_block(row, y); break;
        case T_IQ4_XS: iq4_xs_block(row, y); break;
        case T_X4: x4_block(row, y); break;
        case T_X3: x3_block(row, y); break;
        default: legacy_block(type, row, y);
        }
    }
}

/* Rows ids[0 .. count) of a weight of n rows of k elements, as float32 into out [count, k]:
 * w holds its GGUF blocks row after row (type), or its 16-row panels (type | PANELS: Q4_0,
 * Q4_1, Q8_0, Q4_K). Returns 0, or -1 (a type or layout not read here, k not a multiple of
 * the block, an id outside 0..n-1, out of memory); nothing is written then. */
int qlib_dequant_rows(int type, const uint8_t *w, int n, int k, const int64_t *ids, int count,
                      float *out) {
    const int base = type & ~PANELS, panels = (type & PANELS) != 0;
    int qk, bytes;
    block_shape(base, &qk, &bytes);
    if (!qk || k <= 0 || k % qk) return -1;
    if (panels && base != T_Q4_0 && base != T_Q4_1 && base != T_Q8_0 && base != T_IQ4_NL &&
        base != T_MXFP4H && base != T_NVFP4H && base != T_Q1_0H && base != T_Q4_K &&
        base != T_IQ4_XS)
        return -1;
    for (int r = 0; r < count; r++)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    const size_t row_bytes = (size_t)(k / qk) * bytes;
    uint8_t *blocks = panels ? malloc(row_bytes) : NULL;
    if (panels && !blocks) return -1;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (size_t)ids[r] * row_bytes;
        if (panels) {
            const int got = base == T_Q4_K || base == T_IQ4_XS
                                ? qlib_kpanel_get(base, w, n, k, ids + r, 1, blocks)
                                           : qlib_panel_get(base, w, n, k, ids + r, 1, blocks);
            if (got) {
                free(blocks);
                return -1;
            }
            row = blocks;
        }
        dequant_row(base, row, k, out + (size_t)r * k);
    }
    free(blocks);
    return 0;
}

/* Vector helpers shared by kernels.c, kquants.c and prefill.c (AVX-512): bf16 <-> float32,
 * the flush-to-zero bracket of a parallel region, e^x and SiLU; the input row of the GEMV
 * kernels (fused RmsNorm / SwiGLU) and its Q8_0 / Q8_1 quantization; a per-thread scratch. */
#ifndef QLIB_SIMD_H
#define QLIB_SIMD_H
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Whether the CPU is AMD's: some streaming choices go by the vendor (measured on one VM of
 * each: an AMD Zen 4 and an Intel Xeon with AMX; docs/performance.md) */
static inline int qlib_amd_cpu(void) {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u; /* "Auth"enticAMD */
}

/* ggml's kvalues_iq4nl + 128: the unsigned codes of IQ4_NL / IQ4_XS dot products */
static const uint8_t iq4_levels_u8[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                          129, 141, 153, 166, 181, 197, 217, 241};

/* ggml's kvalues_mxfp4 (E2M1 values doubled) + 128: the unsigned codes of MXFP4 dot products */
static const uint8_t mxfp4_levels_u8[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                            128, 127, 126, 125, 124, 122, 120, 116};

/* Four indices (0..15) a byte lane -> their levels + 128 from a 16-byte table (vpshufb in each
 * 128-bit lane) */
static inline __m512i levels_lookup(const uint8_t *table, __m512i idx) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)),
                               idx);
}
static inline __m512i iq4_levels(__m512i idx) { return levels_lookup(iq4_levels_u8, idx); }

static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* v + rounding bias: bf16 (nearest even) in the high halves of 16 uint32 */
static inline __m512i bf16x16_biased(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
}

/* 16 floats -> 16 bf16 in the low halves of 16 uint32 */
static inline __m512i bf16x16_u32(__m512 v) { return _mm512_srli_epi32(bf16x16_biased(v), 16); }

/* v rounded to bf16, as float32 */
static inline __m512 bf16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16x16_biased(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 16 floats -> 16 bf16 at p (round to nearest even) */
static inline void bf16x16_store(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16x16_u32(v)));
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

/* e^(s - m) for s <= m (a softmax's weights), float32 to ~3.5e-6 relative, for
 * attention weights rounded next (8-bit codes in the int8 attention, bf16 in AMX's): in base 2, t = s log2(e) - m log2(e)
 * (mlog2e: one FMA) = n + f with |f| <= 1/2, 2^f by its degree-5 Taylor polynomial, times
 * 2^n; t clamped below at -125 (2^-125 is still a normal float). */
static inline __m512 exp16_diff(__m512 s, __m512 mlog2e) {
    const __m512 t = _mm512_max_ps(_mm512_fmsub_ps(s, _mm512_set1_ps(1.44269504f), mlog2e),
                                   _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.33335581e-3f); /* ln2^k / k! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* silu(x) = x / (1 + e^-x), the division as rcp14 and one Newton step (~2^-23 relative). */
static inline __m512 silu16(__m512 x) {
    const __m512 y =
        _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    __m512 r = _mm512_rcp14_ps(y);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(y, r, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(x, r);
}

/* 16 float32 values of a KV cache of float32 or IEEE half elements, from element at. */
static inline __m512 load_kv(const void *base, size_t at, int f16) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at)));
    return _mm512_loadu_ps((const float *)base + at);
}

/* A buffer of at least ``bytes`` (64-byte aligned), kept by its caller between calls in
 * *buf / *have (thread-local there) and grown as needed: a fresh allocation of a few MB a
 * call is mapped anew each time (page faults). NULL when out of memory. */
static inline void *scratch_grow(void **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        free(*buf);
        bytes = (bytes + 4095) / 4096 * 4096;
        *buf = aligned_alloc(64, bytes);
        *have = *buf ? bytes : 0;
    }
    return *buf;
}

/* 16 x 16 int32 transpose: r[i] lane c -> r[c] lane i. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int p = 0; p < 8; p++) {
        t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) { /* u[4q + j], 128-bit lane L: rows 4q.. of column 4L + j */
        u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* -- the activation rows of the GEMV kernels (kernels.c, kquants.c) -- */

/* One row of k floats -> int8 codes, d (f16-rounded float) and s = f16(d * sum q). */
/* Store the first c (> 0) lanes of r at y (c >= 16: all 16), added to y's values when
 * accumulate: a tile's output columns, the last tile of a matrix partial. */
static inline void store_lanes(float *y, __m512 r, int c, int accumulate) {
    const __mmask16 mask = c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << c) - 1);
    if (accumulate) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, y));
    _mm512_mask_storeu_ps(y, mask, r);
}

static inline void quantize_row_q8(const float *x, int k, int8_t *q, float *d, float *s) {
    for (int b = 0; b < k / 32; b++) {
        __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        __m512 amax = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        float m = _mm512_reduce_max_ps(amax);
        float dd = m / 127.f;
        float id = m != 0.0f ? 127.f / m : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        /* round half to even, out-of-range -> INT_MIN, then saturate to int8 (as packs) */
        __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
        d[b] = _cvtsh_ss(_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT));
        if (s) {
            int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            s[b] = _cvtsh_ss(_cvtss_sh(dd * (float)sum, _MM_FROUND_TO_NEAREST_INT));
        }
    }
}

/* out[i] = silu(x[i]) * x[k + i] for i in [i0, i1) (x = [gate | up]): silu16 lane by lane, so
 * any split of the range gives the same values (input_row and swiglu_shared agree bit for
 * bit). Was scalar expf: the decode step 1-3.5% slower (SmolLM2 Q4_1, 2 threads). */
static inline void silu_mul(const float *x, int k, int i0, int i1, float *out) {
    for (int i = i0; i < i1; i += 16) {
        const __mmask16 live = i1 - i >= 16 ? 0xFFFF : (__mmask16)((1u << (i1 - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(live, x + i), u = _mm512_maskz_loadu_ps(live, x + k + i);
        _mm512_mask_storeu_ps(out + i, live, _mm512_mul_ps(silu16(g), u));
    }
}

/* The activation row a fed to the kernels, from an input row x (see qlib_qgemm_ex). */
static inline void input_row(const float *x, int k, const float *norm_w, float eps,
                             int swiglu, float *a) {
    if (swiglu) { /* x = [gate | up], 2k floats: a = silu(gate) * up */
        silu_mul(x, k, 0, k, a);
        x = a;
    }
    if (norm_w) { /* RmsNorm: x / sqrt(mean(x^2) + eps) * w */
        float ss = 0.0f;
        for (int i = 0; i < k; i++) ss += x[i] * x[i];
        const float r = 1.0f / sqrtf(ss / (float)k + eps);
        for (int i = 0; i < k; i++) a[i] = x[i] * r * norm_w[i];
    } else if (!swiglu) {
        memcpy(a, x, sizeof(float) * (size_t)k);
    }
}

/* Inside a parallel region (decode.c): out[0..k) = silu_mul of x = [gate | up], each thread
 * of the team a slice, then a barrier (the same values as input_row's loop). */
static inline void swiglu_shared(const float *x, int k, float *out) {
    const int nth = omp_get_num_threads(), t = omp_get_thread_num();
    const int per = ((k + nth - 1) / nth + 15) / 16 * 16, i0 = t * per;
    if (i0 < k) silu_mul(x, k, i0, i0 + per < k ? i0 + per : k, out);
#pragma omp barrier
}

#endif

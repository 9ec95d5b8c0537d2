/* Vector helpers shared by kernels.c and prefill.c (AVX-512): bf16 <-> float32, the
 * flush-to-zero bracket of a parallel region, e^x. */
#ifndef QLIB_SIMD_H
#define QLIB_SIMD_H
#include <immintrin.h>
#include <stdint.h>

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

#endif

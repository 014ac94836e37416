/* bfloat16 <-> float32 for 16 lanes, rounding to nearest even: what the C kernels
 * that read or write bfloat16 vectors share (HAVE_BF16 where this build has AVX-512 BF16). */
#ifndef PDDGW_CPU_BF16_H
#define PDDGW_CPU_BF16_H

#include <stdint.h>

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#define HAVE_BF16 1
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 widen(__m256i h) {                   /* exact */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m512 load16(const uint16_t *p) {
    return widen(_mm256_loadu_si256((const __m256i *)p));
}

static inline __attribute__((always_inline)) __m512 load_tail(const uint16_t *p, __mmask16 m) {      /* lanes outside m: 0 */
    return widen(_mm256_maskz_loadu_epi16(m, p));
}

static inline __attribute__((always_inline)) __m256i round16(__m512 v) {              /* the instruction: subnormals to zero */
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* torch's vectorized rounding (its float32 -> bfloat16 conversion): the instruction's but for
 * its lanes that differ, rare (NaN: torch writes 0xffff; subnormals: torch keeps them), done in
 * integers there. */
static inline __attribute__((always_inline)) __m256i round16_torch(__m512 v) {
    __m256i h = round16(v);
    __mmask16 odd = _mm512_fpclass_ps_mask(v, 0xA1);           /* quiet NaN | subnormal | signalling NaN */
    if (__builtin_expect(odd != 0, 0)) {
        __m512i b = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0xffff));
        h = _mm256_mask_blend_epi16(odd, h, _mm512_cvtepi32_epi16(r));
    }
    return h;
}
#endif

#endif

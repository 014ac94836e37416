/* bfloat16 <-> float32 for 16 lanes, rounding to nearest even as torch does: what the C kernels
 * that read or write bfloat16 vectors share (HAVE_BF16 where this build has AVX-512 BF16). */
#ifndef PDDGW_CPU_BF16_H
#define PDDGW_CPU_BF16_H

#include <stdint.h>

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define HAVE_BF16 1
#include <immintrin.h>

static inline __m512 widen(__m256i h) {                   /* exact */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16(const uint16_t *p) {
    return widen(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 load_tail(const uint16_t *p, __mmask16 m) {      /* lanes outside m: 0 */
    return widen(_mm256_maskz_loadu_epi16(m, p));
}

static inline __m256i round16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}
#endif

#endif

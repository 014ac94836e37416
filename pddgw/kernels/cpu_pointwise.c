/* bfloat16 RMSNorm in two passes around torch's own row mean, and RoPE in one pass, each the
 * bits of the torch ops they replace (cpu_pointwise.py says why).
 *
 * RMSNorm: transformers computes  w * bf16(xf * rsqrt(mean(xf * xf) + eps))  with xf =
 * float32(x).  `rms_squares` writes the squares xf * xf (the same float32 products torch's
 * pow(2) makes), torch reduces them (its own summation order, so the mean is the same bits),
 * and `rms_scale` does the rest: float32(x) * r[t] rounded to bfloat16, times float32(w) rounded
 * again (what torch's bfloat16 multiply does), rounding to nearest even as torch does.
 * RoPE (`rope_bf16`): each product and the sum rounded to bfloat16 as torch's ops round them.
 */
#include <stdint.h>

#include "cpu_bf16.h"

/* sq [T, N] (packed) = float32(x)^2 of x [T, N] (rows `x_stride` elements apart). -> 0, or -1
 * where this build has no AVX-512 BF16. */
int rms_squares(const uint16_t *x, int64_t x_stride, float *sq, int64_t T, int64_t N, int threads) {
#ifdef HAVE_BF16
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * N >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * x_stride;
        float *out = sq + t * N;
        int64_t i = 0;
        for (; i + 16 <= N; i += 16) {
            __m512 v = load16(row + i);
            _mm512_storeu_ps(out + i, _mm512_mul_ps(v, v));
        }
        if (i < N) {
            __mmask16 m = (__mmask16)((1u << (N - i)) - 1);
            __m512 v = load_tail(row + i, m);
            _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, v));
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)sq; (void)T; (void)N; (void)threads;
    return -1;
#endif
}

/* out [T, N] (packed) = bf16(float32(w) * float32(bf16(float32(x) * r[t]))), x as in `rms_squares`,
 * r [T] float32, w [N].  -> 0, or -1 where this build has no AVX-512 BF16. */
int rms_scale(const uint16_t *x, int64_t x_stride, const float *r, const uint16_t *w, uint16_t *out,
              int64_t T, int64_t N, int threads) {
#ifdef HAVE_BF16
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * N >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * x_stride;
        uint16_t *y = out + t * N;
        __m512 s = _mm512_set1_ps(r[t]);
        int64_t i = 0;
        for (; i + 16 <= N; i += 16) {
            __m512 n = load16(row + i);
            __m512 h = widen(round16(_mm512_mul_ps(n, s)));
            _mm256_storeu_si256((__m256i *)(y + i), round16(_mm512_mul_ps(load16(w + i), h)));
        }
        if (i < N) {
            __mmask16 m = (__mmask16)((1u << (N - i)) - 1);
            __m512 n = load_tail(row + i, m);
            __m512 h = widen(round16(_mm512_mul_ps(n, s)));
            _mm256_mask_storeu_epi16(y + i, m, round16(_mm512_mul_ps(load_tail(w + i, m), h)));
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)r; (void)w; (void)out; (void)T; (void)N; (void)threads;
    return -1;
#endif
}

/* out [T, H, D] (packed) = rotate-half RoPE of x [T, H, D] (tokens `x_stride` elements apart,
 * heads packed) with the full-width factors cos2 = [c, c] and sin2 = [-s, s] [T, D]:
 * bf16(bf16(x * cos2) + bf16(roll(x, D / 2) * sin2)), each product and the sum rounded as torch's
 * bfloat16 ops round them.  -> 0, or -1 where this build has no AVX-512 BF16. */
int rope_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos2, const uint16_t *sin2, uint16_t *out,
              int64_t T, int64_t H, int64_t D, int threads) {
#ifdef HAVE_BF16
    int64_t half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * H * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos2 + t * D, *s = sin2 + t * D;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *row = x + t * x_stride + h * D;
            uint16_t *y = out + (t * H + h) * D;
            for (int64_t i = 0; i < D; i += 16) {
                int64_t end = (i < half ? half : D), n = end - i < 16 ? end - i : 16;
                int64_t partner = i < half ? i + half : i - half;
                __mmask16 m = (__mmask16)((1u << n) - 1);
                __m512 a = widen(round16(_mm512_mul_ps(load_tail(row + i, m), load_tail(c + i, m))));
                __m512 b = widen(round16(_mm512_mul_ps(load_tail(row + partner, m), load_tail(s + i, m))));
                _mm256_mask_storeu_epi16(y + i, m, round16(_mm512_add_ps(a, b)));
                if (n < 16 && i < half)
                    i = half - 16;       /* the next step starts the second half */
            }
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)cos2; (void)sin2; (void)out; (void)T; (void)H; (void)D; (void)threads;
    return -1;
#endif
}

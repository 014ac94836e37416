/* bfloat16 RMSNorm, RoPE and SiLU x up, one pass each, the bits of the torch ops they replace
 * (cpu_pointwise.py says why).
 *
 * RMSNorm (`rms_norm_bf16`): transformers computes  w * bf16(xf * rsqrt(mean(xf * xf) + eps))
 * with xf = float32(x); the float32 sum of the squares is torch's, order included
 * (`row_squares_sum`), then / N, + eps, 1 / sqrt as torch's float32 ops compute them.
 * RoPE (`rope_bf16`): each product and the sum rounded to bfloat16 as torch's ops round them.
 * SiLU x up (`silu_mul_bf16`): SiLU read from torch's own values, the product rounded once.
 * Every rounding to bfloat16 is torch's (`round16_torch`: subnormals kept).
 */
#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

/* The build's -ffast-math would reassociate the sums and turn 1 / sqrt and / N into
 * approximations: the RMSNorm computes as written. */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#ifdef HAVE_BF16
/* Row vector v of a row's squares: float32(x[8 v + l])^2 in lane l. */
static inline __m256 squares8(const uint16_t *row, int64_t v) {
    __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
        _mm_loadu_si128((const __m128i *)(row + 8 * v))), 16));
    return _mm256_mul_ps(x, x);
}

/* The sum of a row's N squares as torch sums a contiguous float32 row (SumKernel.cpp's
 * `vectorized_inner_sum` -> `row_sum` -> `multi_row_sum`, whose AVX2 build torch runs on AVX-512
 * CPUs too: 8 lanes): vectors read as rows of 4, each of the 4 columns summed in a cascade of 4
 * levels of 2^p vectors, the columns then added in order; the scalar tail summed from 0, then
 * the 8 lanes added to it in order. */
static float row_squares_sum(const uint16_t *row, int64_t N) {
    int64_t vecs = N / 8, size = vecs / 4, i = 0;
    int64_t bits = size <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(size - 1));     /* CeilLog2 */
    int64_t power = bits / 4 > 4 ? bits / 4 : 4, step = (int64_t)1 << power, mask = step - 1;
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++)
            acc[j][k] = _mm256_setzero_ps();
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                acc[0][k] = _mm256_add_ps(acc[0][k], squares8(row, 4 * i + k));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & (mask << (j * power)))
                break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            acc[0][k] = _mm256_add_ps(acc[0][k], squares8(row, 4 * i + k));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = size * 4; v < vecs; v++)             /* vectors past the last row of 4 */
        acc[0][0] = _mm256_add_ps(acc[0][0], squares8(row, v));
    for (int k = 1; k < 4; k++)
        acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float lanes[8], total = 0.0f;
    for (int64_t n = vecs * 8; n < N; n++) {
        union { uint32_t u; float f; } x = {.u = (uint32_t)row[n] << 16};
        total += x.f * x.f;
    }
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int l = 0; l < 8; l++)
        total += lanes[l];
    return total;
}
#endif

/* out [T, N] (packed) = transformers' RMSNorm of x [T, N] (rows `x_stride` elements apart) with
 * weight w [N], as torch computes it: r = 1 / sqrt(sum(float32(x)^2) / N + eps) in float32 (the
 * sum in torch's order, `row_squares_sum`), then bf16(float32(w) * float32(bf16(float32(x) * r))).
 * -> 0, or -1 where this build has no AVX-512 BF16. */
int rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, float eps, uint16_t *out,
                  int64_t T, int64_t N, int threads) {
#ifdef HAVE_BF16
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * N >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * x_stride;
        uint16_t *y = out + t * N;
        __m512 s = _mm512_set1_ps(1.0f / sqrtf(row_squares_sum(row, N) / (float)N + eps));
        for (int64_t i = 0; i < N; i += 16) {
            __mmask16 m = N - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - i)) - 1);
            __m512 h = widen(round16_torch(_mm512_mul_ps(load_tail(row + i, m), s)));
            _mm256_mask_storeu_epi16(y + i, m, round16_torch(_mm512_mul_ps(load_tail(w + i, m), h)));
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)w; (void)eps; (void)out; (void)T; (void)N; (void)threads;
    return -1;
#endif
}
#pragma GCC pop_options

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
                __m512 a = widen(round16_torch(_mm512_mul_ps(load_tail(row + i, m), load_tail(c + i, m))));
                __m512 b = widen(round16_torch(_mm512_mul_ps(load_tail(row + partner, m), load_tail(s + i, m))));
                _mm256_mask_storeu_epi16(y + i, m, round16_torch(_mm512_add_ps(a, b)));
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

/* out [T, I] (packed) = bf16(float32(silu[g]) * float32(u)) for the gate g = gu[:, :I] and up
 * u = gu[:, I:] of gu [T, 2I] (rows `gu_stride` elements apart): torch's `F.silu(g).mul_(u)`.
 * `silu` is torch's own bfloat16 SiLU of every bit pattern, indexed by it (65536 values and one
 * spare: the gather reads 32 bits, the upper half shifted out).  -> 0, or -1 where this build
 * has no AVX-512 BF16. */
int silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, const uint16_t *silu, uint16_t *out,
                  int64_t T, int64_t I, int threads) {
#ifdef HAVE_BF16
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * gu_stride, *u = g + I;
        uint16_t *y = out + t * I;
        for (int64_t i = 0; i < I; i += 16) {
            __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
            __m512i idx = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, g + i));
            __m512i s = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, silu, 2);
            __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
            _mm256_mask_storeu_epi16(y + i, m, round16_torch(_mm512_mul_ps(a, load_tail(u + i, m))));
        }
    }
    return 0;
#else
    (void)gu; (void)gu_stride; (void)silu; (void)out; (void)T; (void)I; (void)threads;
    return -1;
#endif
}

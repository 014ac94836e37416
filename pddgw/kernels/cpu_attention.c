/* Paged decode attention on the CPU: one query token per sequence, read straight
 * from the KV pool's pages (no gathered copy); and the store of new tokens' K/V
 * into their slots.  Built and loaded by cpu_ops.py, which states why they exist.
 *
 * Shapes (elements; every tensor contiguous except the caches' block stride):
 *   q, out        [B, H, D]
 *   k/v caches    [num_blocks, BS, KVH, D], block stride `block_stride`
 *   block_tables  [B, >= ceil(len / BS)] int32, row stride `bt_stride`, width `bt_width`
 *   seq_lens      [B] int32, in 1 .. bt_width * BS
 * Math, as torch's CPU flash attention does it for 16-bit inputs: q.k in float32
 * times `scale`; keys taken in chunks of CHUNK, each chunk's probabilities
 * exp(score - the running max) summed in float32 and rounded to the element type
 * before they weight V; float32 accumulators rescaled online between chunks.
 * One sequence is one task, computed by one thread in a fixed order: its result
 * does not depend on the batch beside it or on the thread count.
 * Returns 0, or 1 when a length or a block id it would read was out of range
 * (nothing outside the caches is read; `out` is then undefined).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define CHUNK 512                 /* keys a chunk (rounded down to whole blocks) */
enum kind { F32, F16, BF16 };
#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } c = { .u = (uint32_t)x << 16 };
    return c.f;
}

INLINE uint16_t float_to_bf16(float f) {                  /* round to nearest even, as torch */
    union { uint32_t u; float f; } c = { .f = f };
    return (uint16_t)((c.u + 0x7fff + ((c.u >> 16) & 1)) >> 16);
}

INLINE float load(const void *p, int64_t i, enum kind k) {
    return k == F32 ? ((const float *)p)[i]
         : k == F16 ? (float)((const _Float16 *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}

INLINE void store(void *p, int64_t i, float x, enum kind k) {
    if (k == F32) ((float *)p)[i] = x;
    else if (k == F16) ((_Float16 *)p)[i] = (_Float16)x;
    else ((uint16_t *)p)[i] = float_to_bf16(x);
}

INLINE float rounded(float x, enum kind k) {             /* x at the element type's precision */
    return k == F32 ? x : k == F16 ? (float)(_Float16)x : bf16_to_float(float_to_bf16(x));
}

INLINE const char *at(const void *p, int64_t i, enum kind k) {
    return (const char *)p + i * (k == F32 ? 4 : 2);
}

#if defined(__AVX512F__)
/* r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once (a transposing add tree: 45
 * instructions where 16 horizontal sums take ~150). */
INLINE __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)            /* per 128-bit lane: [v2i(0+2), v2i+1(0+2), v2i(1+3), v2i+1(1+3)] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)            /* per lane: [v4i, v4i+1, v4i+2, v4i+3], that lane's part */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)            /* lanes pairwise summed */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

/* s[g * cw + t] = scale * q_g . k_t for the G query rows of one KV head (q, and qf widened to
 * float32) and the n keys of one block (key t at kb + t * stride). */
INLINE void scores(const void *q, const float *qf, const void *kb, int64_t stride, int64_t G, int64_t D,
                   int64_t n, float scale, float *s, int64_t cw, enum kind k) {
#if defined(__AVX512BF16__)
    if (k == BF16 && D % 32 == 0) {            /* bfloat16 pairs: exact products, float32 sums */
        const __m512 sc = _mm512_set1_ps(scale);
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int64_t m = n - t0 < 16 ? n - t0 : 16;
            for (int64_t g = 0; g < G; g++) {
                __m512 part[16];
                for (int64_t t = 0; t < 16; t++) {
                    part[t] = _mm512_setzero_ps();
                    if (t < m)
                        for (int64_t c = 0; c < D; c += 32)
                            part[t] = _mm512_dpbf16_ps(
                                part[t], (__m512bh)_mm512_loadu_si512(at(q, g * D + c, k)),
                                (__m512bh)_mm512_loadu_si512(at(kb, (t0 + t) * stride + c, k)));
                }
                _mm512_mask_storeu_ps(s + g * cw + t0, (__mmask16)((1u << m) - 1),
                                      _mm512_mul_ps(sum16(part), sc));
            }
        }
        return;
    }
#endif
    float kt[D];
    for (int64_t t = 0; t < n; t++) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) kt[d] = load(kb, t * stride + d, k);
        for (int64_t g = 0; g < G; g++) {
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int64_t d = 0; d < D; d++) a += qf[g * D + d] * kt[d];
            s[g * cw + t] = a * scale;
        }
    }
}

/* acc[g][d] += sum over the n values of one block (v_t at vb + t * stride) of p[g * cw + t] v_t[d]:
 * the block's values widened to float32 once (into vf [n, D]) for the G query rows, each
 * accumulator lane kept in a register across the block. */
INLINE void weigh(const float *p, int64_t cw, const void *vb, int64_t stride, int64_t G, int64_t D,
                  int64_t n, float *acc, float *vf, enum kind k) {
    for (int64_t t = 0; t < n; t++) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) vf[t * D + d] = load(vb, t * stride + d, k);
    }
#if defined(__AVX512F__)
    if (D % 64 == 0) {                  /* four independent FMA chains, so their latency overlaps */
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < D; c += 64) {
                float *o = acc + g * D + c;
                __m512 a0 = _mm512_loadu_ps(o), a1 = _mm512_loadu_ps(o + 16);
                __m512 a2 = _mm512_loadu_ps(o + 32), a3 = _mm512_loadu_ps(o + 48);
                for (int64_t t = 0; t < n; t++) {
                    const __m512 w = _mm512_set1_ps(p[g * cw + t]);
                    const float *x = vf + t * D + c;
                    a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), a0);
                    a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + 16), a1);
                    a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + 32), a2);
                    a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + 48), a3);
                }
                _mm512_storeu_ps(o, a0);
                _mm512_storeu_ps(o + 16, a1);
                _mm512_storeu_ps(o + 32, a2);
                _mm512_storeu_ps(o + 48, a3);
            }
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < G; g++) {
            const float w = p[g * cw + t];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += w * vf[t * D + d];
        }
}

/* Exponentiate one chunk's scores s[0..n) of a query row in place against the running max m
 * (updated), add their float32 sum into l after rescaling it, round them to the element type,
 * and return the factor that rescales the row's accumulator. */
INLINE float softmax_chunk(float *s, int64_t n, float *m, float *l, enum kind k) {
    float mx = *m;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    const float corr = expf(*m - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        const float e = expf(s[t] - mx);
        sum += e;
        s[t] = rounded(e, k);
    }
    *l = *l * corr + sum;
    *m = mx;
    return corr;
}

/* Pages are scattered, so the hardware prefetcher stalls at every block boundary. */
INLINE void prefetch(const void *k, const void *v, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch((const char *)k + o);
        __builtin_prefetch((const char *)v + o);
    }
}

INLINE int64_t chunk_width(int64_t BS) {                  /* whole blocks a chunk */
    return BS < CHUNK ? CHUNK / BS * BS : BS;
}

/* Bytes of float32 scratch `sequence` keeps on its thread's stack (its arrays below). */
int64_t scratch_bytes(int64_t H, int64_t D, int64_t BS) {
    return 4 * (2 * H * D + 2 * H + H * chunk_width(BS) + BS * D);
}

/* One sequence b into out; 1 when its length or a block id is out of range. */
INLINE int sequence(int64_t b, const void *q, const void *kc, const void *vc, int64_t block_stride,
                    int64_t num_blocks, const int32_t *bt, int64_t bt_stride, int64_t bt_width,
                    const int32_t *lens, void *out, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                    float scale, enum kind k) {
    const int64_t G = H / KVH, row = KVH * D, bytes = BS * row * (k == F32 ? 4 : 2);
    const int64_t cw = chunk_width(BS);
    const int64_t L = lens[b];
    const int32_t *table = bt + b * bt_stride;
    if (L < 1 || L > bt_width * BS) return 1;
    float qf[H * D], acc[H * D], m[H], l[H], s[H * cw], vf[BS * D];
    for (int64_t i = 0; i < H * D; i++) {
        qf[i] = load(q, b * H * D + i, k);
        acc[i] = 0.f;
    }
    for (int64_t h = 0; h < H; h++) { m[h] = -FLT_MAX; l[h] = 0.f; }
    for (int64_t c0 = 0; c0 < L; c0 += cw) {
        const int64_t cn = L - c0 < cw ? L - c0 : cw;
        for (int64_t t0 = c0; t0 < c0 + cn; t0 += BS) {                      /* q.k of the chunk */
            const int64_t blk = table[t0 / BS], next = t0 + BS < L ? table[t0 / BS + 1] : -1;
            if (blk < 0 || blk >= num_blocks) return 1;
            for (int64_t kh = 0; kh < KVH; kh++) {
                if (next >= 0 && next < num_blocks)
                    prefetch(at(kc, next * block_stride, k) + kh * bytes / KVH,
                             at(vc, next * block_stride, k) + kh * bytes / KVH, bytes / KVH);
                scores(at(q, (b * H + kh * G) * D, k), qf + kh * G * D, at(kc, blk * block_stride + kh * D, k),
                       row, G, D, L - t0 < BS ? L - t0 : BS, scale, s + kh * G * cw + (t0 - c0), cw, k);
            }
        }
        for (int64_t h = 0; h < H; h++) {
            const float corr = softmax_chunk(s + h * cw, cn, &m[h], &l[h], k);
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[h * D + d] *= corr;
        }
        for (int64_t t0 = c0; t0 < c0 + cn; t0 += BS)                         /* p.v of the chunk */
            for (int64_t kh = 0; kh < KVH; kh++)
                weigh(s + kh * G * cw + (t0 - c0), cw, at(vc, table[t0 / BS] * block_stride + kh * D, k),
                      row, G, D, L - t0 < BS ? L - t0 : BS, acc + kh * G * D, vf, k);
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) store(out, (b * H + h) * D + d, acc[h * D + d] / l[h], k);
    return 0;
}

/* The exported kernels: one task per sequence (the loop is written out per element type so
 * that each parallel region is compiled for its own type). */
#define EXPORT(NAME, KIND)                                                                           \
    int NAME(const void *q, const void *kc, const void *vc, int64_t block_stride, int64_t num_blocks, \
             const int32_t *bt, int64_t bt_stride, int64_t bt_width, const int32_t *lens, void *out,  \
             int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, int nthreads) {   \
        int bad = 0;                                                                                  \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : bad)")    \
        for (int64_t b = 0; b < B; b++)                                                               \
            bad |= sequence(b, q, kc, vc, block_stride, num_blocks, bt, bt_stride, bt_width, lens, out,  \
                            H, KVH, D, BS, scale, KIND);                                              \
        return bad;                                                                                   \
    }
EXPORT(decode_f32, F32)
EXPORT(decode_f16, F16)
EXPORT(decode_bf16, BF16)

/* K and V rows i < T (element stride k_row / v_row between rows, each row KVH * D contiguous
 * elements of `esize` bytes) into the caches at flat slots[i] (block * BS + offset; -1: skip).
 * Returns 0, or 1 when a slot's block is outside the pool (the rows before it are stored). */
int store_kv(const char *k, int64_t k_row, const char *v, int64_t v_row, char *kc, char *vc,
             int64_t block_stride, int64_t num_blocks, const int64_t *slots, int64_t T, int64_t BS,
             int64_t row, int64_t esize) {
    for (int64_t i = 0; i < T; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        if (slot / BS >= num_blocks) return 1;
        const int64_t at = (slot / BS * block_stride + slot % BS * row) * esize;
        memcpy(kc + at, k + i * k_row * esize, row * esize);
        memcpy(vc + at, v + i * v_row * esize, row * esize);
    }
    return 0;
}

/* bfloat16 linear layers on AMX tiles: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) (+ add [M, N]).
 *
 * Why not oneDNN (what torch's packed linear calls): at decode sizes (M <= 32) its inner
 * product streams the weights slower: a SmolLM2 forward's GEMMs take 1.38-1.44 x this loop's
 * time at 1-32 rows, Llama-3-8B's layers 1.15-1.22 x (2 cores, `python -m pddgw.bench.linear`);
 * and above M = 32 it changes its reduction (rows computed beside 32 others differ in the last
 * bit from the same rows alone).
 *
 * Numerics: every output is one chain over K in order, 32 values a tile step, through
 * TDPBF16PS (float32 accumulation of bfloat16 pairs), whatever M, the thread count or the row's
 * neighbours: bit-identical to oneDNN's result for M <= 32, and to itself for every M.  The
 * float32 sum (+ the bias in float32) is rounded to bfloat16 once; `add` is then added as torch
 * adds two bfloat16 tensors (float32 sum, rounded again), so `linear(x) + add` is the same bits.
 *
 * Layout: `linear_pack` stores w as [N / 16][K / 32] tiles of 16 K-pairs x 16 columns x 2, the
 * VNNI order TDPBF16PS reads, each 16-column block's tiles contiguous (one stream per block).
 * Work: OpenMP threads take pairs of 16-column blocks; each pair runs over the rows 32 at a time
 * with 2 x 2 accumulator tiles, so its weights come from memory once and from cache after.  A
 * block's sums are stashed from the tiles and rounded in slices inside the next block's K loop,
 * while its tile products are in flight (the rounding after each block had idled the tiles for
 * ~15 % of a 512-row GEMM's time).
 * Needs N % 32 == 0 and K % 32 == 0 (the caller checks); rows may be strided, columns packed.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_amx.h"

int linear_ready(void) {                  /* the loader's question: cpu_amx.h's amx_ready */
    return amx_ready();
}

/* w [N, K] (rows `w_stride` elements apart) -> out [N / 16][K / 32][16][16][2]. */
void linear_pack(const uint16_t *w, int64_t w_stride, uint16_t *out, int64_t N, int64_t K) {
    int64_t kb = K / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N / 16; b++)
        for (int64_t c = 0; c < kb; c++) {
            uint16_t *t = out + (b * kb + c) * 512;
            for (int p = 0; p < 16; p++)
                for (int n = 0; n < 16; n++) {
                    const uint16_t *src = w + (b * 16 + n) * w_stride + c * 32 + 2 * p;
                    t[p * 32 + n * 2] = src[0];
                    t[p * 32 + n * 2 + 1] = src[1];
                }
        }
}

#ifdef HAVE_AMX
/* Tiles: 0, 1 = x rows [0, r0) and [16, 16 + r1); 2, 3 = the two column blocks' weights;
 * 4, 5 = rows 0.. x blocks 0, 1; 6, 7 = rows 16.. x blocks 0, 1. */
static void configure(int r0, int r1) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    int low = r1 ? r1 : 1;
    const uint8_t rows[8] = {(uint8_t)r0, (uint8_t)low, 16, 16, (uint8_t)r0, (uint8_t)r0, (uint8_t)low, (uint8_t)low};
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = rows[i];
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 float32 sums (+ bias) -> bfloat16 (+ add, rounded again) at y. */
static inline void store16(const float *acc, const uint16_t *bias, const uint16_t *add, uint16_t *y) {
    __m512 v = _mm512_loadu_ps(acc);
    if (bias)
        v = _mm512_add_ps(v, load16(bias));
    __m256i h = round16(v);
    if (add)
        h = round16(_mm512_add_ps(widen(h), load16(add)));
    _mm256_storeu_si256((__m256i *)y, h);
}

/* One 32 x 32 output block's float32 sums, stashed from the accumulator tiles, and where they go. */
typedef struct {
    float acc[4][16 * 16] __attribute__((aligned(64)));    /* rows 0.. x blocks 0, 1; rows 16.. x 0, 1 */
    const uint16_t *bias, *add;
    uint16_t *y;
    int64_t add_stride, y_stride;
    int r0, r1;
} stashed;

/* Pieces [from, to) of a stashed block's 64 (row i / 2, column block i % 2) to y. */
static inline void finish(const stashed *s, int from, int to) {
    for (int i = from; i < to; i++) {
        int row = i >> 1, j = i & 1, half = row >= 16;
        if ((row & 15) >= (half ? s->r1 : s->r0))
            continue;
        store16(s->acc[2 * half + j] + (row & 15) * 16, s->bias ? s->bias + 16 * j : NULL,
                s->add ? s->add + row * s->add_stride + 16 * j : NULL, s->y + row * s->y_stride + 16 * j);
    }
}

/* Rows [m0, m0 + r0 + r1) of the column blocks 2p, 2p + 1 into the accumulator tiles; a slice of
 * the last block's rounding (`last`, or NULL) after each step's products. */
static void block(const uint16_t *x, int64_t x_stride, const uint16_t *b0, const uint16_t *b1, int r1, int64_t kb,
                  const stashed *last) {
    _tile_zero(4);
    _tile_zero(5);
    if (r1) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t c = 0; c < kb; c++) {
        _tile_loadd(0, x + c * 32, x_stride * 2);
        _tile_loadd(2, b0 + c * 512, 64);
        _tile_loadd(3, b1 + c * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (r1) {
            _tile_loadd(1, x + 16 * x_stride + c * 32, x_stride * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        if (last)
            finish(last, (int)(c * 64 / kb), (int)((c + 1) * 64 / kb));
    }
}

static void stash(stashed *s) {
    _tile_stored(4, s->acc[0], 64);
    _tile_stored(5, s->acc[1], 64);
    if (s->r1) {
        _tile_stored(6, s->acc[2], 64);
        _tile_stored(7, s->acc[3], 64);
    }
}
#endif

/* y [M, N] (rows `y_stride` apart) = x [M, K] (rows `x_stride` apart) @ w^T from `linear_pack`'s
 * `packed`, + bias [N] (or NULL), + add [M, N] (rows `add_stride` apart, or NULL); bfloat16
 * throughout.  -> 0, or -1 where this build or process has no AMX (`linear_ready`). */
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                const uint16_t *add, int64_t add_stride, uint16_t *y, int64_t y_stride,
                int64_t M, int64_t N, int64_t K, int threads) {
#ifdef HAVE_AMX
    int64_t kb = K / 32, pairs = N / 32;
    #pragma omp parallel num_threads(threads)
    {
        tile_config saved;        /* the thread's tile shapes, put back for another AMX user (oneDNN) */
        _tile_storeconfig(&saved);
        int cur0 = -1, cur1 = -1, slot = 0;
        stashed done[2] __attribute__((aligned(64)));
        const stashed *last = NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const uint16_t *b0 = packed + 2 * p * kb * 512, *b1 = b0 + kb * 512;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                int64_t left = M - m0;
                int r0 = left < 16 ? (int)left : 16, r1 = left <= 16 ? 0 : left >= 32 ? 16 : (int)(left - 16);
                if (r0 != cur0 || r1 != cur1) {
                    configure(r0, r1);
                    cur0 = r0;
                    cur1 = r1;
                }
                block(x + m0 * x_stride, x_stride, b0, b1, r1, kb, last);
                stashed *s = &done[slot];
                s->bias = bias ? bias + 32 * p : NULL;             /* field by field: not acc's 4 KB */
                s->add = add ? add + m0 * add_stride + 32 * p : NULL;
                s->y = y + m0 * y_stride + 32 * p;
                s->add_stride = add_stride;
                s->y_stride = y_stride;
                s->r0 = r0;
                s->r1 = r1;
                stash(s);
                last = s;
                slot ^= 1;
            }
        }
        if (last)
            finish(last, 0, 64);
        _tile_loadconfig(&saved);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)add; (void)add_stride; (void)y; (void)y_stride;
    (void)M; (void)N; (void)K; (void)threads;
    return -1;
#endif
}

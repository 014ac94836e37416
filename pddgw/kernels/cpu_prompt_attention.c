/* Causal attention of bfloat16 prompt rows on AMX tiles: chunks of prompts at any position,
 * every key read from the KV pool's pages.  Built and loaded by cpu_ops.py, which states why.
 *
 * Shapes (elements): q [T, H, D] (tokens q_stride apart, heads packed), out [T, H, D] packed;
 * k/v caches [num_blocks, BS, KVH, D] (block stride `block_stride`, rows packed); tables
 * [B, >= ceil(len / BS)] int32 (row stride `table_stride`, width `table_width`); sequence i has
 * q_lens[i] rows from q_starts[i], the last of its seq_lens[i] tokens (their K/V already
 * stored).  D % 16 == 0, D <= 128; q.k runs over D rounded up to 32 (DP), the rest zeros.
 *
 * Math, one (sequence, head, 16 rows) task per thread: scores q.k in float32 (one TDPBF16PS
 * chain over D), times `scale`; over the keys up to the row's position, exp(score - max) (a
 * polynomial, below) summed in float32 in 16 lanes in key order and rounded to bfloat16 to
 * weight V (one float32 chain over 32-key steps from key 0); that sum divides the result,
 * rounded to bfloat16.  Keys past a row's position add exact zeros, so a row's bits depend
 * only on its query and the keys up to it: not on the batch, the thread count, the other rows
 * of its task, or how its prompt was split into chunks.
 * The keys of a (sequence, KV head) are first packed in the tiles' order, zero past the end.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_amx.h"

#define Q_ROWS 16                /* queries a task */
#define DP ((D + 31) / 32 * 32)  /* D rounded up to a whole q.k step */

int prompt_ready(void) {                  /* the loader's question: cpu_amx.h's amx_ready */
    return amx_ready();
}

#ifdef HAVE_AMX
static void configure(void) {          /* every tile 16 rows of 64 bytes */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Keys [0, L) of KV head g from the pages -> kp [DP / 32][L32 / 16][16 pairs][16 keys][2], the B
 * operand of q.k; values -> vp [L32 / 32][D / 16][16 pairs][16 columns][2], the B operand of p.v;
 * both zero past L (L32: L rounded up to 32).  row(c, j): key j's row of head g in cache c. */
#define ROW(c, j) ((c) + (int64_t)table[(j) / bs] * block_stride + ((j) % bs) * row_elems)
static void pack(const uint16_t *kc, const uint16_t *vc, int64_t block_stride, int64_t bs, int64_t row_elems,
                 const int32_t *table, int64_t L, int64_t L32, int64_t D, uint16_t *kp, uint16_t *vp) {
    int64_t kblocks = L32 / 16, pairs = D / 2, padded = (D + 31) / 32 * 16;      /* pairs of DP */
    uint16_t rows[16 * 128] __attribute__((aligned(64)));          /* 16 keys' rows, D apart */
    /* A tile row: one pair of d for 16 keys, gathered from their rows (keys past L read as 0). */
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)(D * 2)));
    for (int64_t b = 0; b < kblocks; b++) {
        int64_t n = L - b * 16 >= 16 ? 16 : L > b * 16 ? L - b * 16 : 0;
        for (int64_t r = 0; r < n; r++)
            memcpy(rows + r * D, ROW(kc, b * 16 + r), (size_t)D * 2);
        __mmask16 m = (__mmask16)((1u << n) - 1);
        for (int64_t pr = 0; pr < padded; pr++) {
            __m512i g = pr < pairs ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, at, rows + 2 * pr, 1)
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(kp + (((pr / 16) * kblocks + b) * 16 + pr % 16) * 32, g);
        }
    }
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t j = 0; j < L32; j += 2) {                  /* keys j, j + 1 interleaved */
        const uint16_t *r0 = j < L ? ROW(vc, j) : NULL, *r1 = j + 1 < L ? ROW(vc, j + 1) : NULL;
        for (int64_t c = 0; c < D / 16; c++) {
            __m256i a = r0 ? _mm256_loadu_si256((const __m256i *)(r0 + c * 16)) : zero;
            __m256i b = r1 ? _mm256_loadu_si256((const __m256i *)(r1 + c * 16)) : zero;
            __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            _mm512_storeu_si512(vp + (((j / 32) * (D / 16) + c) * 16 + (j % 32) / 2) * 32, pair);
        }
    }
}
#undef ROW

/* e^x for x <= 0 (16 lanes): x log2(e) = n + f with |f| <= 1/2, 2^f = e^(f ln 2) by its Taylor
 * series to degree 7 (relative error below 2e-8, under float32's rounding), scaled by 2^n; below
 * -100 the result is 0 for every purpose here (2^-144).  Why not libm's vector expf: these
 * probabilities are most of the kernel's time, and with it the kernel took 1.2 x (4 prompts of
 * 256) to 1.5 x (one of 1024, one thread) as long. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));   /* f ln 2 */
    __m512 y = _mm512_set1_ps(1.0f / 5040.0f);
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(1.0f / 720.0f));
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* One query's scores sr [n] (of a row `width` wide, a multiple of 16) -> the unnormalised
 * probabilities exp(x - max) of x = score * scale, rounded to bfloat16 into pr [width] (zero past
 * n); -> their float32 sum (16 lanes in order, then the lanes). */
static float probabilities(const float *sr, uint16_t *pr, int64_t n, int64_t width, float scale) {
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 vmax = _mm512_set1_ps(-FLT_MAX), vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + j), vs));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    for (int64_t j = 0; j < width; j += 16) {
        __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : n > j ? (__mmask16)((1u << (n - j)) - 1) : 0;
        __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vs, mx)));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256((__m256i *)(pr + j), round16(e));
    }
    return _mm512_reduce_add_ps(vsum);
}

/* Rows [q0, q0 + rows) of one head's queries (`q_stride` apart; row i at position pos0 + i) over
 * the packed keys -> out rows (`o_stride` apart).  s: [16][L32] float32, p: [16][L32] bfloat16. */
static void task(const uint16_t *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vp, int64_t L32,
                 int64_t D, int64_t pos0, int64_t q0, int rows, float scale, uint16_t *out, int64_t o_stride,
                 float *s, uint16_t *p) {
    uint16_t qbuf[Q_ROWS * 128] __attribute__((aligned(64)));
    float obuf[Q_ROWS * 16] __attribute__((aligned(64))), sums[Q_ROWS];
    memset(qbuf, 0, sizeof qbuf);
    for (int r = 0; r < rows; r++)
        memcpy(qbuf + r * DP, q + (q0 + r) * q_stride, (size_t)D * 2);
    int64_t steps = DP / 32, kblocks = L32 / 16, end = pos0 + q0 + rows;   /* keys [0, end) */
    int64_t nk16 = (end + 15) / 16, nk32 = (end + 31) / 32;
    /* Scores: q tiles 0 .. steps - 1 stay loaded; tiles 4, 5 sum two key blocks, 6, 7 their keys. */
    _tile_loadd(0, qbuf, DP * 2);
    if (steps > 1)
        _tile_loadd(1, qbuf + 32, DP * 2);
    if (steps > 2)
        _tile_loadd(2, qbuf + 64, DP * 2);
    if (steps > 3)
        _tile_loadd(3, qbuf + 96, DP * 2);
    for (int64_t b = 0; b < nk16; b += 2) {
        int two = b + 1 < nk16;
        _tile_zero(4);
        if (two)
            _tile_zero(5);
        for (int64_t i = 0; i < steps; i++) {
            const uint16_t *t = kp + (i * kblocks + b) * 512;
            _tile_loadd(6, t, 64);
            switch (i) {               /* the tile number is an immediate */
            case 0: _tile_dpbf16ps(4, 0, 6); break;
            case 1: _tile_dpbf16ps(4, 1, 6); break;
            case 2: _tile_dpbf16ps(4, 2, 6); break;
            default: _tile_dpbf16ps(4, 3, 6); break;
            }
            if (two) {
                _tile_loadd(7, t + 512, 64);
                switch (i) {
                case 0: _tile_dpbf16ps(5, 0, 7); break;
                case 1: _tile_dpbf16ps(5, 1, 7); break;
                case 2: _tile_dpbf16ps(5, 2, 7); break;
                default: _tile_dpbf16ps(5, 3, 7); break;
                }
            }
        }
        _tile_stored(4, s + b * 16, L32 * 4);
        if (two)
            _tile_stored(5, s + (b + 1) * 16, L32 * 4);
    }
    /* Probabilities: row r sees keys [0, pos0 + q0 + r]; zero up to the last 32-key step. */
    for (int r = 0; r < Q_ROWS; r++) {
        int64_t n = r < rows ? pos0 + q0 + r + 1 : 0;
        float sum = probabilities(s + r * L32, p + r * L32, n, nk32 * 32, scale);
        sums[r] = n ? sum : 1.0f;
    }
    /* p.v: tile 0 the probabilities of a 32-key step, tiles 1..3 values, 4..7 four column blocks. */
    for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
        int64_t cols = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t ks = 0; ks < nk32; ks++) {
            const uint16_t *t = vp + (ks * (D / 16) + c0) * 512;
            _tile_loadd(0, p + ks * 32, L32 * 2);
            _tile_loadd(1, t, 64);
            _tile_dpbf16ps(4, 0, 1);
            if (cols > 1) {
                _tile_loadd(2, t + 512, 64);
                _tile_dpbf16ps(5, 0, 2);
            }
            if (cols > 2) {
                _tile_loadd(3, t + 1024, 64);
                _tile_dpbf16ps(6, 0, 3);
            }
            if (cols > 3) {
                _tile_loadd(1, t + 1536, 64);
                _tile_dpbf16ps(7, 0, 1);
            }
        }
        for (int64_t c = 0; c < cols; c++) {
            switch (c) {
            case 0: _tile_stored(4, obuf, 64); break;
            case 1: _tile_stored(5, obuf, 64); break;
            case 2: _tile_stored(6, obuf, 64); break;
            default: _tile_stored(7, obuf, 64); break;
            }
            for (int r = 0; r < rows; r++)
                _mm256_storeu_si256((__m256i *)(out + (q0 + r) * o_stride + (c0 + c) * 16), round16(
                    _mm512_div_ps(_mm512_loadu_ps(obuf + r * 16), _mm512_set1_ps(sums[r]))));
        }
    }
}
#endif

/* -> 0; 1 where a length or a block id it would read is out of range (nothing is computed);
 * -1 where this build or process has no AMX or D is not a multiple of 32 up to 128. */
int prompt_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                          int64_t block_stride, int64_t num_blocks, int64_t bs, const int32_t *tables,
                          int64_t table_stride, int64_t table_width, const int64_t *q_starts,
                          const int64_t *q_lens, const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, float scale, uint16_t *out, int threads) {
#ifdef HAVE_AMX
    if (D % 16 || D > 128 || D < 16 || H % KVH)
        return -1;
    for (int64_t i = 0; i < B; i++) {
        int64_t L = seq_lens[i];
        if (q_lens[i] < 0 || L < q_lens[i] || (L + bs - 1) / bs > table_width)
            return 1;
        for (int64_t j = 0; j < (L + bs - 1) / bs; j++) {
            int32_t id = tables[i * table_stride + j];
            if (id < 0 || id >= num_blocks)
                return 1;
        }
    }
    int64_t group = H / KVH, packed = 0, most = 0, tasks = 0;
    int64_t *base = malloc((size_t)(B + 1) * sizeof *base);      /* each sequence's first task */
    int64_t *off = malloc((size_t)(B + 1) * sizeof *off);        /* each sequence's packed keys */
    for (int64_t i = 0; i < B; i++) {
        int64_t L32 = (seq_lens[i] + 31) / 32 * 32;
        off[i] = packed;
        packed += L32 * KVH * (DP + D);
        most = L32 > most ? L32 : most;
        base[i] = tasks;
        tasks += H * ((q_lens[i] + Q_ROWS - 1) / Q_ROWS);
    }
    base[B] = tasks;
    uint16_t *kv = malloc((size_t)packed * 2);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < B * KVH; w++) {
            int64_t i = w / KVH, g = w % KVH, L32 = (seq_lens[i] + 31) / 32 * 32;
            uint16_t *kp = kv + off[i] + g * L32 * (DP + D);
            if (q_lens[i])
                pack(kc + g * D, vc + g * D, block_stride, bs, KVH * D, tables + i * table_stride, seq_lens[i],
                     L32, D, kp, kp + L32 * DP);
        }
        tile_config saved;        /* the thread's tile shapes, put back for another AMX user */
        _tile_storeconfig(&saved);
        configure();
        float *s = malloc((size_t)(Q_ROWS * most) * sizeof *s);
        uint16_t *p = malloc((size_t)(Q_ROWS * most) * 2);
        /* Tasks from the last (longest) row block of each sequence down, for balance. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t i = 0;
            while (base[i + 1] <= t)
                i++;
            int64_t blocks = (q_lens[i] + Q_ROWS - 1) / Q_ROWS, local = t - base[i];
            int64_t h = local % H, q0 = (blocks - 1 - local / H) * Q_ROWS;
            int64_t L32 = (seq_lens[i] + 31) / 32 * 32, g = h / group;
            int rows = q_lens[i] - q0 < Q_ROWS ? (int)(q_lens[i] - q0) : Q_ROWS;
            const uint16_t *kp = kv + off[i] + g * L32 * (DP + D);
            task(q + q_starts[i] * q_stride + h * D, q_stride, kp, kp + L32 * DP, L32, D, seq_lens[i] - q_lens[i],
                 q0, rows, scale, out + q_starts[i] * H * D + h * D, H * D, s, p);
        }
        free(s);
        free(p);
        _tile_loadconfig(&saved);
    }
    free(kv);
    free(off);
    free(base);
    return 0;
#else
    (void)q; (void)q_stride; (void)kc; (void)vc; (void)block_stride; (void)num_blocks; (void)bs; (void)tables;
    (void)table_stride; (void)table_width; (void)q_starts; (void)q_lens; (void)seq_lens; (void)B; (void)H;
    (void)KVH; (void)D; (void)scale; (void)out; (void)threads;
    return -1;
#endif
}

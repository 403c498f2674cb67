/*
 * y = x W^T (+ b) with W kept in GGUF blocks (Q4_1 or Q8_0), for the few-row matmuls of decode
 * steps. Such a step reads every weight once and does little arithmetic per weight, so it is
 * bound by memory: reading 5 (Q4_1) or 8.5 (Q8_0) bits a weight instead of 32 makes it faster,
 * while many-row steps (prefill) keep the dense fp32 weights and oneDNN.
 *
 * Layout: row n of W is `row_bytes` bytes of consecutive blocks of 32 weights along K.
 *   Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes qs; byte j holds weight j (low nibble) and
 *                          weight j + 16 (high nibble).
 *   Q8_0 block (34 bytes): fp16 d, 32 int8 q.
 *
 * Three forms; OpenMP threads split the rows of W in each, so every block is read from memory
 * once per call:
 *   any count with AVX2 and without AVX-512: x quantized to 16-bit blocks once, then integer
 *     dot products against W's blocks, one row of W at a time against tiles of up to 8 rows
 *     of x (quant_dot.h);
 *   few rows otherwise (fewer than GROUP_MIN_ROWS with AVX-512, any count without AVX2): one
 *     row of W at a time, each block's quants widened to four 8-float vectors once per tile
 *     of up to 8 rows of x, the block's scale factored out of its sum:
 *     sum_k (d q_k + m) x_k = d (sum_k q_k x_k) + m (sum_k x_k);
 *   more rows, AVX-512: groups of four rows of W dequantized (fma(d, q, m)) into an fp32
 *     buffer in L1, then 4 x 4 register tiles against the rows of x.
 * The float forms compute with the blocks' exact values (Q4_1: d * q + m, Q8_0: d * q; d and
 * m fp16) and round differently from a matmul over the dense fp32 copy only as two orders of
 * summation do; the integer form also rounds x to 16 bits a block (`shoal_quant_int_rows`
 * says up to how many rows it serves). It needs an x86 CPU with AVX and SSE4.1; elsewhere the
 * build fails and the engine keeps the dense weights.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>
#include <omp.h>

#define BLOCK 32
/* From this many rows of x on, the AVX-512 build multiplies by groups of dequantized rows. */
#ifndef GROUP_MIN_ROWS
#define GROUP_MIN_ROWS 4
#endif
/* How far ahead of the block being read to prefetch: one hardware stream per thread does not
 * keep enough reads in flight to reach the memory's bandwidth. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
#define TILE 8
#define Q4_1 0
#define Q8_0 1

static float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

#if !defined(__AVX2__)
/* 8 consecutive int32 lanes of 4-byte groups a and b, as floats (AVX without AVX2). */
static __m256 to_floats(__m128i a, __m128i b) {
    return _mm256_cvtepi32_ps(_mm256_insertf128_si256(_mm256_castsi128_si256(a), b, 1));
}
#endif

/* 8 bytes at p as 8 float lanes (unsigned or signed). */
static __m256 u8_floats(__m128i v) {
#if defined(__AVX2__)
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
#else
    return to_floats(_mm_cvtepu8_epi32(v), _mm_cvtepu8_epi32(_mm_srli_si128(v, 4)));
#endif
}

static __m256 i8_floats(__m128i v) {
#if defined(__AVX2__)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
#else
    return to_floats(_mm_cvtepi8_epi32(v), _mm_cvtepi8_epi32(_mm_srli_si128(v, 4)));
#endif
}

/* The 32 quants of one block as floats into q[0..3] (quants 0-7, 8-15, 16-23, 24-31). */
static void block_quants(int qtype, const uint8_t *block, __m256 q[4]) {
    if (qtype == Q4_1) {
        const __m128i qs = _mm_loadu_si128((const __m128i *)(block + 4));
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(qs, mask);                     /* quants 0-15 */
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);  /* quants 16-31 */
        q[0] = u8_floats(lo);
        q[1] = u8_floats(_mm_srli_si128(lo, 8));
        q[2] = u8_floats(hi);
        q[3] = u8_floats(_mm_srli_si128(hi, 8));
    } else {
        for (int i = 0; i < 4; i++)
            q[i] = i8_floats(_mm_loadl_epi64((const __m128i *)(block + 2 + 8 * i)));
    }
}

static __m256 multiply_add(__m256 a, __m256 b, __m256 acc) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, acc);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), acc);
#endif
}

static float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/*
 * One row of W against rows [m0, m0 + R) of x: per block,
 * sum_k (d q_k + m) x_k = d (sum_k q_k x_k) + m (sum_k x_k), the second sum precomputed per
 * block of x in x_sums (Q4_1 only). R is a constant in each instance, so the accumulators
 * stay in registers.
 */
#define DEFINE_ROW_TILE(R)                                                                     \
    static void row_tile_##R(int qtype, const uint8_t *w_row, int64_t block_bytes,             \
                             int64_t num_blocks, const float *x, int64_t x_stride,             \
                             const float *x_sums, int64_t m0, float *out) {                    \
        __m256 acc[R];                                                                         \
        float offset[R];                                                                       \
        for (int i = 0; i < R; i++) {                                                          \
            acc[i] = _mm256_setzero_ps();                                                      \
            offset[i] = 0.0f;                                                                  \
        }                                                                                      \
        for (int64_t kb = 0; kb < num_blocks; kb++) {                                          \
            const uint8_t *block = w_row + kb * block_bytes;                                   \
            _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);                   \
            const __m256 d = _mm256_set1_ps(fp16_to_fp32(load_u16(block)));                   \
            __m256 q[4];                                                                       \
            block_quants(qtype, block, q);                                                     \
            for (int i = 0; i < R; i++) {                                                      \
                const float *xb = x + (m0 + i) * x_stride + kb * BLOCK;                        \
                __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));                         \
                dot = multiply_add(q[1], _mm256_loadu_ps(xb + 8), dot);                        \
                dot = multiply_add(q[2], _mm256_loadu_ps(xb + 16), dot);                       \
                dot = multiply_add(q[3], _mm256_loadu_ps(xb + 24), dot);                       \
                acc[i] = multiply_add(d, dot, acc[i]);                                         \
            }                                                                                  \
            if (qtype == Q4_1) {                                                               \
                const float m = fp16_to_fp32(load_u16(block + 2));                             \
                for (int i = 0; i < R; i++)                                                    \
                    offset[i] += m * x_sums[(m0 + i) * num_blocks + kb];                       \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) out[i] = horizontal_sum(acc[i]) + offset[i];               \
    }

DEFINE_ROW_TILE(1)
DEFINE_ROW_TILE(2)
DEFINE_ROW_TILE(3)
DEFINE_ROW_TILE(4)
DEFINE_ROW_TILE(5)
DEFINE_ROW_TILE(6)
DEFINE_ROW_TILE(7)
DEFINE_ROW_TILE(8)

typedef void (*row_tile_fn)(int, const uint8_t *, int64_t, int64_t, const float *, int64_t,
                            const float *, int64_t, float *);
static const row_tile_fn ROW_TILES[TILE + 1] = {
    NULL, row_tile_1, row_tile_2, row_tile_3, row_tile_4,
    row_tile_5, row_tile_6, row_tile_7, row_tile_8,
};

#include "quant_dot.h"

#if defined(__AVX512F__)
/*
 * Many rows (AVX-512): a group of GROUP_ROWS rows of W is dequantized once into an fp32 buffer
 * that stays in L1 (each weight rounded once from its exact value, fma(d, q, m)), then every
 * tile of MR rows of x is multiplied against the whole group, GROUP_ROWS x MR accumulators in
 * registers: each weight loaded from L1 serves MR rows of x and each x load GROUP_ROWS rows of
 * W. Rows of a last, short group are zero in the buffer and never stored.
 */
#define GROUP_ROWS 4

static void dequant_row_512(int qtype, const uint8_t *w_row, int64_t block_bytes,
                            int64_t num_blocks, float *out) {
    for (int64_t kb = 0; kb < num_blocks; kb++) {
        const uint8_t *block = w_row + kb * block_bytes;
        _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);
        const __m512 d = _mm512_set1_ps(fp16_to_fp32(load_u16(block)));
        __m512 q0, q1;
        if (qtype == Q4_1) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(block + 4));
            const __m128i mask = _mm_set1_epi8(0x0f);
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)));
            q1 = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)));
            const __m512 m = _mm512_set1_ps(fp16_to_fp32(load_u16(block + 2)));
            q0 = _mm512_fmadd_ps(d, q0, m);
            q1 = _mm512_fmadd_ps(d, q1, m);
        } else {
            q0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(block + 2)))));
            q1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(block + 18)))));
        }
        _mm512_store_ps(out + kb * BLOCK, q0);
        _mm512_store_ps(out + kb * BLOCK + 16, q1);
    }
}

#define DEFINE_GROUP_TILE(MR)                                                                  \
    static void group_tile_##MR(const float *buf, int64_t K, const float *x, int64_t x_stride, \
                                int64_t m0, float out[MR][GROUP_ROWS]) {                       \
        __m512 acc[MR][GROUP_ROWS];                                                            \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < GROUP_ROWS; j++) acc[i][j] = _mm512_setzero_ps();              \
        for (int64_t k = 0; k < K; k += 16) {                                                  \
            __m512 w[GROUP_ROWS];                                                              \
            for (int j = 0; j < GROUP_ROWS; j++) w[j] = _mm512_load_ps(buf + j * K + k);       \
            for (int i = 0; i < MR; i++) {                                                     \
                const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * x_stride + k);                \
                for (int j = 0; j < GROUP_ROWS; j++)                                           \
                    acc[i][j] = _mm512_fmadd_ps(w[j], xv, acc[i][j]);                          \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < GROUP_ROWS; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);  \
    }

DEFINE_GROUP_TILE(1)
DEFINE_GROUP_TILE(2)
DEFINE_GROUP_TILE(3)
DEFINE_GROUP_TILE(4)

static void matmul_groups_512(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                              const uint8_t *w, int64_t row_bytes, int qtype, int64_t block_bytes,
                              const float *bias, int64_t M, int64_t N, int64_t K,
                              int num_threads) {
    const int64_t num_blocks = K / BLOCK, num_groups = (N + GROUP_ROWS - 1) / GROUP_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(64, (size_t)(GROUP_ROWS * K) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < num_groups; g++) {
            if (buf == NULL) continue; /* reported below */
            const int64_t n0 = g * GROUP_ROWS;
            const int rows = N - n0 < GROUP_ROWS ? (int)(N - n0) : GROUP_ROWS;
            for (int j = 0; j < GROUP_ROWS; j++) {
                if (j < rows)
                    dequant_row_512(qtype, w + (n0 + j) * row_bytes, block_bytes, num_blocks,
                                    buf + j * K);
                else
                    memset(buf + j * K, 0, (size_t)K * sizeof(float));
            }
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
                float out[4][GROUP_ROWS];
                switch (mr) {
                    case 1: group_tile_1(buf, K, x, x_stride, m0, out); break;
                    case 2: group_tile_2(buf, K, x, x_stride, m0, out); break;
                    case 3: group_tile_3(buf, K, x, x_stride, m0, out); break;
                    default: group_tile_4(buf, K, x, x_stride, m0, out); break;
                }
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < rows; j++)
                        y[(m0 + i) * y_stride + n0 + j] =
                            out[i][j] + (bias != NULL ? bias[n0 + j] : 0.0f);
            }
        }
        free(buf);
    }
}
#endif

/*
 * The most rows of x for which this build beats a dense fp32 matmul (oneDNN) on the reference
 * machine, cache-cold weights (bench/quant_matmul.py): the AVX-512 groups keep the blocks
 * ahead to about 96 rows, the 8-row tiles of the AVX2 path to about 12.
 */
int shoal_quant_max_rows(void) {
#if defined(__AVX512F__)
    return 64;
#else
    return 12;
#endif
}

/*
 * Steps of at most this many rows go through 16-bit activations (quant_dot.h); 0: none. An
 * AVX-512 build keeps its float forms: the integer form is measured against them only on CPUs
 * without AVX-512 so far (SHOAL_CPU_ISA=avx2 builds it on any AVX2 CPU).
 */
int shoal_quant_int_rows(void) {
#if defined(QUANT_DOT_INT16)
    return 1 << 30;
#else
    return 0;
#endif
}

/*
 * y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for m < M, n < N.
 * x: fp32 [M, K], rows `x_stride` floats apart, K contiguous; y: fp32 [M, N], rows `y_stride`
 * apart; w: N rows of `row_bytes`; bias: N floats or NULL. K must be a multiple of 32.
 * Returns 0, -1 for a bad argument, -2 out of memory.
 */
int shoal_quant_matmul(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                       const uint8_t *w, int64_t row_bytes, int qtype, const float *bias,
                       int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t block_bytes = qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
    if (block_bytes == 0 || K <= 0 || K % BLOCK != 0 || M < 0 || N < 0) return -1;
    const int64_t num_blocks = K / BLOCK;
    if (row_bytes != num_blocks * block_bytes || x_stride < K || (M > 1 && y_stride < N))
        return -1;
    if (num_threads < 1) num_threads = 1;
#if defined(__AVX512F__)
    if (M >= GROUP_MIN_ROWS) {
        matmul_groups_512(y, y_stride, x, x_stride, w, row_bytes, qtype, block_bytes, bias, M, N,
                          K, num_threads);
        return 0;
    }
#endif
#if defined(QUANT_DOT_INT16)
    if (M <= shoal_quant_int_rows())
        return matmul_int16(y, y_stride, x, x_stride, w, row_bytes, qtype, bias, M, N, K,
                           num_threads);
#endif
    float *x_sums = NULL;
    if (qtype == Q4_1 && M > 0) {
        x_sums = malloc((size_t)(M * num_blocks) * sizeof(float));
        if (x_sums == NULL) return -2;
        for (int64_t m = 0; m < M; m++)
            for (int64_t kb = 0; kb < num_blocks; kb++) {
                const float *xb = x + m * x_stride + kb * BLOCK;
                float sum = 0.0f;
                for (int j = 0; j < BLOCK; j++) sum += xb[j];
                x_sums[m * num_blocks + kb] = sum;
            }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w_row = w + n * row_bytes;
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int rows = M - m0 < TILE ? (int)(M - m0) : TILE;
            float sums[TILE];
            ROW_TILES[rows](qtype, w_row, block_bytes, num_blocks, x, x_stride, x_sums, m0, sums);
            for (int i = 0; i < rows; i++) y[(m0 + i) * y_stride + n] = sums[i] + b;
        }
    }
    free(x_sums);
    return 0;
}

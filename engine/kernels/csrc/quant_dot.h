/*
 * The integer path of quant_matmul.c (AVX2 without AVX-512; QUANT_DOT_INT16 is defined where
 * it is built): each row of x is quantized once per call to
 * 16-bit blocks of 32 (a step d = max|x| / 32767 and q = round(x / d), so x ~ d q), then every
 * block of W is multiplied with integer dot products:
 *   Q8_0 (d_w, q_w):        sum_k x_k w_k ~ d_w d_x sum_k q_w q_x
 *   Q4_1 (d_w, m_w, 4-bit): sum_k x_k w_k ~ d_w d_x sum_k q_w q_x + m_w (d_x sum_k q_x)
 * W's quants are widened to 16 bits once per block and `_mm256_madd_epi16` multiplies them
 * with q_x and adds pairs; two of those added give eight lanes of four products each, at most
 * 4 * 128 * 32767 < 2^24 in magnitude, so their int32 sums and float conversions are exact.
 * The block's steps then multiply them in float.
 *
 * So the only rounding beyond the float path's is x's own: each x_k becomes d_x q_x, off by at
 * most d_x / 2 = max|x over its block| / 65534, a relative 1.5e-5 (fp16 would be 4.9e-4).
 * 8-bit activations (llama.cpp's Q8 blocks, `_mm256_maddubs_epi16`) would save one add per
 * block but move x by up to 1/254 of its block's largest value: enough to change greedy
 * tokens against a float reference, which 16 bits do not.
 *
 * Included by quant_matmul.c only (static functions; needs BLOCK, Q4_1, Q8_0, TILE,
 * PREFETCH_BYTES, fp16_to_fp32, load_u16 and horizontal_sum from there).
 */
#define ACT_LEVELS 32767

#if defined(__AVX2__) && !defined(__AVX512F__)
#define QUANT_DOT_INT16 1

/* One block of a row of x: its step d, d * sum(q), and the 32 quants. */
typedef struct {
    float d;
    float s;
    int16_t q[BLOCK];
} act_block;

static int32_t horizontal_sum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static float horizontal_max(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Quantizes `num_blocks` blocks of x (fp32) into `out` (rounding to nearest, ties to even). */
static void quantize_row(const float *x, int64_t num_blocks, act_block *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t kb = 0; kb < num_blocks; kb++) {
        const float *xb = x + kb * BLOCK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float max_abs = horizontal_max(amax);
        const float d = max_abs / (float)ACT_LEVELS;
        const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? (float)ACT_LEVELS / max_abs : 0.0f);
        __m256i n[4];
        for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]),
                                             _mm256_add_epi32(n[2], n[3]));
        /* packs interleave 128-bit lanes; the permutation puts the 16 values back in order. */
        for (int i = 0; i < 2; i++) {
            const __m256i packed = _mm256_packs_epi32(n[2 * i], n[2 * i + 1]);
            _mm256_storeu_si256((__m256i *)(out[kb].q + 16 * i),
                                _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
        }
        out[kb].d = d;
        out[kb].s = d * (float)horizontal_sum_i32(sum);
    }
}

/*
 * One row of W against rows [m0, m0 + R) of the quantized x (`xq`, `num_blocks` a row): each
 * block of W is loaded and unpacked once for the R rows, each row keeps eight float partial
 * sums. Always inlined into instances with constant qtype and R, so that the branches on
 * qtype fold and the R accumulators stay in registers.
 */
static inline __attribute__((always_inline)) void dot_rows(
    const int qtype, const int R, const uint8_t *w_row, int64_t num_blocks,
    const act_block *xq, int64_t m0, float *out) {
    const int64_t block_bytes = qtype == Q4_1 ? 20 : 34;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc[TILE];
    float offset[TILE];
    for (int i = 0; i < R; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0.0f;
    }
    for (int64_t kb = 0; kb < num_blocks; kb++) {
        const uint8_t *block = w_row + kb * block_bytes;
        _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);
        const float dw = fp16_to_fp32(load_u16(block));
        __m256i w_lo, w_hi; /* weights 0-15 and 16-31 as 16-bit integers */
        if (qtype == Q4_1) { /* byte j: weight j low, weight j + 16 high */
            const __m128i qs = _mm_loadu_si128((const __m128i *)(block + 4));
            w_lo = _mm256_cvtepu8_epi16(_mm_and_si128(qs, low4));
            w_hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(qs, 4), low4));
        } else {
            w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
            w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        }
        for (int i = 0; i < R; i++) {
            const act_block *a = xq + (m0 + i) * num_blocks + kb;
            const __m256i lo = _mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)a->q));
            const __m256i hi =
                _mm256_madd_epi16(w_hi, _mm256_loadu_si256((const __m256i *)(a->q + 16)));
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a->d), sums, acc[i]);
        }
        if (qtype == Q4_1) {
            const float m = fp16_to_fp32(load_u16(block + 2));
            for (int i = 0; i < R; i++) offset[i] += m * xq[(m0 + i) * num_blocks + kb].s;
        }
    }
    for (int i = 0; i < R; i++) out[i] = horizontal_sum(acc[i]) + offset[i];
}

typedef void (*dot_tile_fn)(const uint8_t *, int64_t, const act_block *, int64_t, float *);

#define DOT_TILE(NAME, Q, R)                                                                   \
    static void NAME##_##R(const uint8_t *w_row, int64_t num_blocks, const act_block *xq,     \
                           int64_t m0, float *out) {                                           \
        dot_rows(Q, R, w_row, num_blocks, xq, m0, out);                                        \
    }
#define DOT_TILES_OF(NAME, Q)                                                                  \
    DOT_TILE(NAME, Q, 1) DOT_TILE(NAME, Q, 2) DOT_TILE(NAME, Q, 3) DOT_TILE(NAME, Q, 4)        \
    DOT_TILE(NAME, Q, 5) DOT_TILE(NAME, Q, 6) DOT_TILE(NAME, Q, 7) DOT_TILE(NAME, Q, 8)
DOT_TILES_OF(dot_q4_1, Q4_1)
DOT_TILES_OF(dot_q8_0, Q8_0)

/* [qtype][rows of x] */
static const dot_tile_fn DOT_TILES[2][TILE + 1] = {
    {NULL, dot_q4_1_1, dot_q4_1_2, dot_q4_1_3, dot_q4_1_4, dot_q4_1_5, dot_q4_1_6, dot_q4_1_7,
     dot_q4_1_8},
    {NULL, dot_q8_0_1, dot_q8_0_2, dot_q8_0_3, dot_q8_0_4, dot_q8_0_5, dot_q8_0_6, dot_q8_0_7,
     dot_q8_0_8},
};

/* y = x W^T (+ bias) through 16-bit activations; the arguments as shoal_quant_matmul's. */
static int matmul_int16(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                       const uint8_t *w, int64_t row_bytes, int qtype, const float *bias,
                       int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t num_blocks = K / BLOCK;
    act_block *xq = malloc((size_t)(M * num_blocks) * sizeof(act_block));
    if (xq == NULL) return -2;
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * x_stride, num_blocks, xq + m * num_blocks);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w_row = w + n * row_bytes;
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int rows = M - m0 < TILE ? (int)(M - m0) : TILE;
            float sums[TILE];
            DOT_TILES[qtype][rows](w_row, num_blocks, xq, m0, sums);
            for (int i = 0; i < rows; i++) y[(m0 + i) * y_stride + n] = sums[i] + b;
        }
    }
    free(xq);
    return 0;
}
#endif

/*
 * Paged decode attention on the CPU: one query token per sequence attends to its cached K/V,
 * read in place through the sequence's block table (no gather into a contiguous copy).
 *
 * Knows only raw pointers, element strides and sizes; the Python loader
 * (engine/kernels/paged_attention.py) builds it with -O3 -march=native -fopenmp and checks the
 * arguments. K/V are fp32 or bf16 (widened on load); queries, softmax and output are fp32.
 *
 * Work is split into (sequence partition, kv head) items so that a few long contexts still
 * spread over all threads: each partition covers `partition_blocks` blocks and keeps a running
 * max / sum (online softmax) over tiles of LANES positions. A sequence with one partition writes
 * its output directly; longer ones leave (max, sum, unnormalised accumulator) per partition and
 * a second pass merges them.
 *
 * Per layer the kernels also take: a sliding window (0: none; a query at position i sees keys
 * (i - window, i], and positions before it are never read, so their blocks may be gone), per
 * query head sink logits (NULL: none; an extra softmax term with no value, gpt-oss), and a value
 * width below the key width (latent attention: V is the first v_head_dim entries of each K row,
 * and value_cache may be key_cache itself).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SHOAL_KV_FLOAT32 0
#define SHOAL_KV_BFLOAT16 1

#define SHOAL_OK 0
#define SHOAL_BAD_ARGUMENT -1
#define SHOAL_OUT_OF_MEMORY -2

/* Per-thread buffers live on the stack; these bound them (a few hundred KiB at most). */
#define MAX_HEAD_DIM 576 /* latent attention: 512 + 64 */
#define MAX_GROUP 64

/* Vectors of LANES floats through GCC/Clang vector types, as wide as the target's registers
 * (AVX-512: 16, AVX / AVX2: 8, SSE / NEON: 4). A tile is LANES positions, so one vector holds
 * a tile's scores for one query head. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define TILE LANES
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Shuffles make the horizontal sums and maxima cheap; without them (old GCC, or
 * SHOAL_PORTABLE to test the fallback) plain loops do the same arithmetic. */
#if !defined(SHOAL_PORTABLE) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLEVECTOR 1
#endif
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE vfloat vload(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void vstore(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

static ALWAYS_INLINE vfloat vsplat(float c) {
    const vfloat zero = {0};
    return zero + c;
}

/* mask lanes (all ones / zero, from a comparison) pick a, the others b. */
static ALWAYS_INLINE vfloat vselect(vint mask, vfloat a, vfloat b) {
    return (vfloat)(((vint)a & mask) | ((vint)b & ~mask));
}

static ALWAYS_INLINE vfloat vmax(vfloat a, vfloat b) { return vselect(a > b, a, b); }

static ALWAYS_INLINE float vsum_lanes(vfloat v) {
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += v[j];
    return total;
}

/* exp(x) for x <= 0 without libm, so it stays in vector registers: Cephes' expf polynomial
 * after rounding x / ln 2 to the nearest integer n (the 1.5 * 2^23 shift leaves n in the low
 * mantissa bits); relative error ~2 ulp. x below -87 is clamped: exp(-87) ~ 1.6e-38 is as
 * good as zero next to the running max's exp(0) = 1. */
static ALWAYS_INLINE vfloat vexp_nonpositive(vfloat x) {
    const float shift = 12582912.0f;
    x = vselect(x < -87.0f, vsplat(-87.0f), x);
    const vfloat shifted = x * 1.44269504088896341f + shift;
    const vfloat n = shifted - shift;
    vfloat r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vfloat p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vint two_n = ((vint)shifted - 0x4B400000 + 127) << 23;
    return p * (vfloat)two_n;
}

static ALWAYS_INLINE float exp_nonpositive(float x) {
    vfloat v = {0};
    v[0] = x;
    return vexp_nonpositive(v)[0];
}

#ifdef HAVE_SHUFFLEVECTOR
/* FOLD_h pairs rows a and b: taking lanes h at a time alternately from a and b and adding
 * the two halves of each pair of chunks, every output chunk sums one input's lanes pairwise.
 * ROTATE_h turns the lanes by h. */
// clang-format off
#if LANES == 16
#define FOLD_8(a, b) \
    (__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
     __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define FOLD_4(a, b) \
    (__builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) + \
     __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
#define FOLD_2(a, b) \
    (__builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) + \
     __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define FOLD_1(a, b) \
    (__builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) + \
     __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define ROTATE_8(v) \
    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define ROTATE_4(v) \
    __builtin_shufflevector(v, v, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3)
#define ROTATE_2(v) \
    __builtin_shufflevector(v, v, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1)
#define ROTATE_1(v) \
    __builtin_shufflevector(v, v, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0)
#elif LANES == 8
#define FOLD_4(a, b) \
    (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + \
     __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
#define FOLD_2(a, b) \
    (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + \
     __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
#define FOLD_1(a, b) \
    (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + \
     __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define ROTATE_4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3)
#define ROTATE_2(v) __builtin_shufflevector(v, v, 2, 3, 4, 5, 6, 7, 0, 1)
#define ROTATE_1(v) __builtin_shufflevector(v, v, 1, 2, 3, 4, 5, 6, 7, 0)
#elif LANES == 4
#define FOLD_2(a, b) \
    (__builtin_shufflevector(a, b, 0, 1, 4, 5) + \
     __builtin_shufflevector(a, b, 2, 3, 6, 7))
#define FOLD_1(a, b) \
    (__builtin_shufflevector(a, b, 0, 4, 2, 6) + \
     __builtin_shufflevector(a, b, 1, 5, 3, 7))
#define ROTATE_2(v) __builtin_shufflevector(v, v, 2, 3, 0, 1)
#define ROTATE_1(v) __builtin_shufflevector(v, v, 1, 2, 3, 0)
#endif
// clang-format on
#endif

/* The largest lane (a tree of maxima, not a serial chain). */
static ALWAYS_INLINE float vmax_lanes(vfloat v) {
#ifdef HAVE_SHUFFLEVECTOR
#if LANES >= 16
    v = vmax(v, ROTATE_8(v));
#endif
#if LANES >= 8
    v = vmax(v, ROTATE_4(v));
#endif
    v = vmax(v, ROTATE_2(v));
    v = vmax(v, ROTATE_1(v));
    return v[0];
#else
    float m = v[0];
    for (int j = 1; j < LANES; j++) m = v[j] > m ? v[j] : m;
    return m;
#endif
}

/* Lane t of the result is the sum of the lanes of parts[BIT_REVERSE[t]]: log2(LANES) rounds
 * of pairwise folding put row i's total in lane bit_reverse(i), so callers store row t's
 * partial sums at parts[BIT_REVERSE[t]] (bit reversal is its own inverse). */
#if LANES == 16
static const int BIT_REVERSE[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#elif LANES == 8
static const int BIT_REVERSE[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#else
static const int BIT_REVERSE[4] = {0, 2, 1, 3};
#endif

static ALWAYS_INLINE vfloat sum_rows(const vfloat *parts) {
#ifdef HAVE_SHUFFLEVECTOR
    /* Each round halves the rows in place: row i reads only rows 2i and 2i + 1, not yet
     * overwritten. */
    vfloat rows[LANES];
    memcpy(rows, parts, sizeof rows);
#if LANES >= 16
    for (int i = 0; i < 8; i++) rows[i] = FOLD_8(rows[2 * i], rows[2 * i + 1]);
#endif
#if LANES >= 8
    for (int i = 0; i < 4; i++) rows[i] = FOLD_4(rows[2 * i], rows[2 * i + 1]);
#endif
    for (int i = 0; i < 2; i++) rows[i] = FOLD_2(rows[2 * i], rows[2 * i + 1]);
    return FOLD_1(rows[0], rows[1]);
#else
    vfloat out;
    for (int t = 0; t < LANES; t++) out[t] = vsum_lanes(parts[BIT_REVERSE[t]]);
    return out;
#endif
}

typedef struct {
    const char *key_cache; /* this kv head's first block */
    const char *value_cache;
    const int32_t *block_table; /* this sequence's row */
    int64_t block_bytes;
    int64_t token_bytes;
    int64_t block_size;
    int kv_dtype;
    int64_t group; /* query heads per kv head */
} kv_view;

/* Byte offsets in the pool (same for K and V) of positions [pos, pos + n): one division, then
 * a walk through the block table. */
static ALWAYS_INLINE void row_offsets(const kv_view *kv, int64_t pos, int64_t n,
                                      int64_t *offsets) {
    int64_t block = pos / kv->block_size, in_block = pos - block * kv->block_size;
    int64_t base = (int64_t)kv->block_table[block] * kv->block_bytes;
    for (int64_t t = 0; t < n; t++) {
        offsets[t] = base + in_block * kv->token_bytes;
        if (++in_block == kv->block_size && t + 1 < n) {
            in_block = 0;
            base = (int64_t)kv->block_table[++block] * kv->block_bytes;
        }
    }
}

/* Rows of the tile as fp32: pointers into the pool for fp32, else widened into `buf` (bf16
 * is the top half of an fp32, so widening is a shift). */
static ALWAYS_INLINE void tile_rows(const float **rows, const char *cache, const int64_t *offsets,
                                    int64_t n, int kv_dtype, float *buf, int64_t head_dim) {
    for (int64_t t = 0; t < n; t++) {
        if (kv_dtype == SHOAL_KV_FLOAT32) {
            rows[t] = (const float *)(cache + offsets[t]);
            continue;
        }
        const uint16_t *src = (const uint16_t *)(cache + offsets[t]);
        uint32_t *bits = (uint32_t *)(void *)(buf + t * head_dim);
        for (int64_t d = 0; d < head_dim; d++) bits[d] = (uint32_t)src[d] << 16;
        rows[t] = buf + t * head_dim;
    }
}

/* The tile's scores for query head qg: lane t = qg . rows[t], -inf past the n valid rows. */
static ALWAYS_INLINE vfloat score_tile(const float *qg, const float **rows, int64_t n,
                                       int64_t head_dim) {
    const int64_t num_vec = head_dim / LANES;
    vfloat parts[LANES];
    for (int64_t t = 0; t < LANES; t++) {
        vfloat even = {0}, odd = {0};
        if (t < n) {
            const float *row = rows[t];
            /* Two partial sums halve the dependent FMA chain. */
            int64_t c = 0;
            for (; c + 1 < num_vec; c += 2) {
                even += vload(qg + c * LANES) * vload(row + c * LANES);
                odd += vload(qg + (c + 1) * LANES) * vload(row + (c + 1) * LANES);
            }
            if (c < num_vec) even += vload(qg + c * LANES) * vload(row + c * LANES);
            for (int64_t d = num_vec * LANES; d < head_dim; d++) even[0] += qg[d] * row[d];
        }
        parts[BIT_REVERSE[t]] = even + odd;
    }
    vfloat scores = sum_rows(parts);
    if (n < LANES) {
        vint lane;
        for (int j = 0; j < LANES; j++) lane[j] = j;
        scores = vselect(lane < (int32_t)n, scores, vsplat(-INFINITY));
    }
    return scores;
}

/* acc += sum_t p[t] * rows[t]: each LANES-wide slice of acc stays in a register across the
 * tile, four slices at a time so their FMA chains overlap. */
static ALWAYS_INLINE void accumulate_tile(float *acc, const float *p, const float **rows,
                                          int64_t n, int64_t head_dim) {
    const int64_t num_vec = head_dim / LANES;
    int64_t c = 0;
    for (; c + 4 <= num_vec; c += 4) {
        float *a = acc + c * LANES;
        vfloat a0 = vload(a), a1 = vload(a + LANES);
        vfloat a2 = vload(a + 2 * LANES), a3 = vload(a + 3 * LANES);
        for (int64_t t = 0; t < n; t++) {
            const float *row = rows[t] + c * LANES;
            a0 += p[t] * vload(row);
            a1 += p[t] * vload(row + LANES);
            a2 += p[t] * vload(row + 2 * LANES);
            a3 += p[t] * vload(row + 3 * LANES);
        }
        vstore(a, a0);
        vstore(a + LANES, a1);
        vstore(a + 2 * LANES, a2);
        vstore(a + 3 * LANES, a3);
    }
    for (; c < num_vec; c++) {
        vfloat a0 = vload(acc + c * LANES);
        for (int64_t t = 0; t < n; t++) a0 += p[t] * vload(rows[t] + c * LANES);
        vstore(acc + c * LANES, a0);
    }
    for (int64_t d = num_vec * LANES; d < head_dim; d++)
        for (int64_t t = 0; t < n; t++) acc[d] += p[t] * rows[t][d];
}

/* Positions prefetched ahead of the tile being attended: blocks are scattered over the pool,
 * so the hardware prefetcher, which stops at page boundaries, cannot see the next one coming.
 * Into L2 (locality 2): the lines are read once, and the L2 has more room for misses in flight
 * than L1. */
#define PREFETCH_DISTANCE 32

static ALWAYS_INLINE void prefetch_rows(const kv_view *kv, const char *cache, int64_t pos,
                                        int64_t end, int64_t row_bytes) {
    if (pos >= end) return;
    int64_t offsets[TILE];
    const int64_t n = end - pos < TILE ? end - pos : TILE;
    row_offsets(kv, pos, n, offsets);
    for (int64_t t = 0; t < n; t++)
        for (int64_t line = 0; line < row_bytes; line += 64)
            __builtin_prefetch(cache + offsets[t] + line, 0, 2);
}

/* Attends positions [pos_lo, pos_hi) for the `group` query heads in q (already scaled);
 * leaves the unnormalised state in max / sum / acc. Inlined with a constant head_dim for the
 * common sizes so the head_dim loops unroll. */
static ALWAYS_INLINE void attend_range_impl(const kv_view *kv, int64_t pos_lo, int64_t pos_hi,
                                            const float *q, float *max, float *sum, float *acc,
                                            const int64_t head_dim, const int64_t v_dim) {
    const int64_t group = kv->group;
    const int64_t row_bytes = head_dim * (kv->kv_dtype == SHOAL_KV_FLOAT32 ? 4 : 2);
    float k_buf[TILE * head_dim], v_buf[TILE * v_dim], probs[group * TILE];
    const float *k_rows[TILE], *v_rows[TILE];
    int64_t offsets[TILE];
    /* Per-lane running sums: reduced once at the end instead of once per tile. */
    vfloat lane_sum[group];
    for (int64_t g = 0; g < group; g++) {
        max[g] = -INFINITY;
        lane_sum[g] = vsplat(0.0f);
    }
    memset(acc, 0, (size_t)(group * v_dim) * sizeof(float));
    for (int64_t pos = pos_lo; pos < pos_lo + PREFETCH_DISTANCE; pos += TILE) {
        prefetch_rows(kv, kv->key_cache, pos, pos_hi, row_bytes);
        prefetch_rows(kv, kv->value_cache, pos, pos_hi, row_bytes);
    }
    for (int64_t pos = pos_lo; pos < pos_hi; pos += TILE) {
        const int64_t n = pos_hi - pos < TILE ? pos_hi - pos : TILE;
        prefetch_rows(kv, kv->key_cache, pos + PREFETCH_DISTANCE, pos_hi, row_bytes);
        row_offsets(kv, pos, n, offsets);
        tile_rows(k_rows, kv->key_cache, offsets, n, kv->kv_dtype, k_buf, head_dim);
        /* All heads' scores first, then all heads' V sums: K and V are read in two passes
         * over the tile rather than interleaved per head. */
        for (int64_t g = 0; g < group; g++) {
            const vfloat scores = score_tile(q + g * head_dim, k_rows, n, head_dim);
            const float tile_max = vmax_lanes(scores);
            if (tile_max > max[g]) {
                /* The old max is -inf before the first tile: the clamped exp is ~0 and what it
                 * scales is still zero. */
                const float correction = exp_nonpositive(max[g] - tile_max);
                float *ag = acc + g * v_dim;
                for (int64_t d = 0; d < v_dim; d++) ag[d] *= correction;
                lane_sum[g] *= correction;
                max[g] = tile_max;
            }
            /* Lanes past n hold -inf: exp clamps them to ~1e-38, which the sum may take but
             * accumulate_tile never reads. */
            const vfloat p = vexp_nonpositive(scores - max[g]);
            lane_sum[g] += p;
            vstore(probs + g * TILE, p);
        }
        prefetch_rows(kv, kv->value_cache, pos + PREFETCH_DISTANCE, pos_hi, row_bytes);
        tile_rows(v_rows, kv->value_cache, offsets, n, kv->kv_dtype, v_buf, v_dim);
        for (int64_t g = 0; g < group; g++)
            accumulate_tile(acc + g * v_dim, probs + g * TILE, v_rows, n, v_dim);
    }
    for (int64_t g = 0; g < group; g++) sum[g] = vsum_lanes(lane_sum[g]);
}

static void attend_range(const kv_view *kv, int64_t pos_lo, int64_t pos_hi, const float *q,
                         float *max, float *sum, float *acc, int64_t head_dim, int64_t v_dim) {
    if (head_dim == 64 && v_dim == 64)
        attend_range_impl(kv, pos_lo, pos_hi, q, max, sum, acc, 64, 64);
    else if (head_dim == 128 && v_dim == 128)
        attend_range_impl(kv, pos_lo, pos_hi, q, max, sum, acc, 128, 128);
    else
        attend_range_impl(kv, pos_lo, pos_hi, q, max, sum, acc, head_dim, v_dim);
}

/* Folds a sink logit (an extra softmax term whose value is zero) into one head's state:
 * returns the factor that scales its accumulator and the new normaliser in *sum. */
static float fold_sink(float sink, float max, float *sum) {
    const float m = sink > max ? sink : max;
    const float correction = exp_nonpositive(max - m);
    *sum = *sum * correction + exp_nonpositive(sink - m);
    return correction;
}

/* Merges `num_parts` partition states (`state_stride` / `acc_stride` floats apart) into out. */
static void merge_partitions(const float *max, const float *sum, const float *acc,
                             int64_t num_parts, int64_t state_stride, int64_t acc_stride,
                             int64_t head_dim, const float *sink, float *out) {
    float global_max = sink != NULL ? *sink : -INFINITY;
    for (int64_t p = 0; p < num_parts; p++)
        global_max = max[p * state_stride] > global_max ? max[p * state_stride] : global_max;
    float total = sink != NULL ? exp_nonpositive(*sink - global_max) : 0.0f;
    for (int64_t d = 0; d < head_dim; d++) out[d] = 0.0f;
    for (int64_t p = 0; p < num_parts; p++) {
        const float w = exp_nonpositive(max[p * state_stride] - global_max);
        total += w * sum[p * state_stride];
        const float *ap = acc + p * acc_stride;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) out[d] += w * ap[d];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) out[d] *= inv;
}

/* The first position a decode of context `len` reads: all of them, or the last `window`. */
static ALWAYS_INLINE int64_t first_visible(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/*
 * out[s, h, :] = softmax(scale * q[s, h] . K[s, kvh, lo:len]) V[s, kvh, lo:len], kvh = h / group,
 * lo = first_visible(len, window); with sinks, the softmax has one more term exp(sinks[h]).
 *
 * out: fp32 [.., num_heads, v_head_dim], query: fp32 [.., num_heads, head_dim], element strides
 *   per sequence and per head; the last dim contiguous.
 * key_cache, value_cache: one layer's pool [num_kv_heads, num_blocks, block_size, head_dim]
 *   (fp32 or bf16 per kv_dtype), element strides per head / block / token; head_dim contiguous;
 *   values are the first v_head_dim (<= head_dim) entries of value_cache's rows.
 * block_tables: int32 [num_seqs, >= ceil(len / block_size)], row stride block_table_stride;
 *   entries before the window are never read.
 * context_lens: int32 [num_seqs], each >= 1.
 * partition_blocks: blocks per work item (>= 1); num_threads: OpenMP threads to use.
 * window: 0 or the sliding window; sinks: NULL or fp32 [num_heads].
 * Returns SHOAL_OK, SHOAL_BAD_ARGUMENT or SHOAL_OUT_OF_MEMORY.
 */
int shoal_paged_decode_attention(float *out, int64_t out_seq_stride, int64_t out_head_stride,
                                 const float *query, int64_t query_seq_stride,
                                 int64_t query_head_stride, const void *key_cache,
                                 const void *value_cache, int64_t kv_head_stride,
                                 int64_t kv_block_stride, int64_t kv_token_stride, int kv_dtype,
                                 const int32_t *block_tables, int64_t block_table_stride,
                                 const int32_t *context_lens, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
                                 int64_t block_size, int64_t partition_blocks, int64_t window,
                                 const float *sinks, float scale, int num_threads) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 ||
        head_dim > MAX_HEAD_DIM || v_head_dim < 1 || v_head_dim > head_dim ||
        num_heads / num_kv_heads > MAX_GROUP || block_size < 1 || partition_blocks < 1 ||
        window < 0 || num_threads < 1 ||
        (kv_dtype != SHOAL_KV_FLOAT32 && kv_dtype != SHOAL_KV_BFLOAT16))
        return SHOAL_BAD_ARGUMENT;
    if (num_seqs == 0) return SHOAL_OK;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t elem = kv_dtype == SHOAL_KV_FLOAT32 ? 4 : 2;

    /* part_start[s]: index of sequence s's first partition in the flat partition list;
     * partitions cover the blocks from the one holding its first visible position. */
    int64_t *part_start = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (part_start == NULL) return SHOAL_OUT_OF_MEMORY;
    part_start[0] = 0;
    int64_t num_split_parts = 0; /* partitions of sequences that need the merge pass */
    for (int64_t s = 0; s < num_seqs; s++) {
        if (context_lens[s] < 1) {
            free(part_start);
            return SHOAL_BAD_ARGUMENT;
        }
        const int64_t num_blocks = (context_lens[s] + block_size - 1) / block_size;
        const int64_t first_block = first_visible(context_lens[s], window) / block_size;
        const int64_t num_parts =
            (num_blocks - first_block + partition_blocks - 1) / partition_blocks;
        part_start[s + 1] = part_start[s] + num_parts;
        if (num_parts > 1) num_split_parts += num_parts;
    }
    const int64_t num_parts_total = part_start[num_seqs];
    /* Flat partition -> sequence, and each split partition's slot in the scratch state. */
    int64_t *part_seq = malloc((size_t)num_parts_total * sizeof(int64_t));
    int64_t *part_slot = malloc((size_t)num_parts_total * sizeof(int64_t));
    /* Per split partition and query head: max, sum, then v_head_dim accumulators. */
    const int64_t state_floats = v_head_dim + 2;
    float *state = num_split_parts == 0
                       ? NULL
                       : malloc((size_t)(num_split_parts * num_heads * state_floats) *
                                sizeof(float));
    if (part_seq == NULL || part_slot == NULL || (num_split_parts > 0 && state == NULL)) {
        free(part_start);
        free(part_seq);
        free(part_slot);
        free(state);
        return SHOAL_OUT_OF_MEMORY;
    }
    int64_t next_slot = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int is_split = part_start[s + 1] - part_start[s] > 1;
        for (int64_t p = part_start[s]; p < part_start[s + 1]; p++) {
            part_seq[p] = s;
            part_slot[p] = is_split ? next_slot++ : -1;
        }
    }

    const int64_t num_items = num_parts_total * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t part = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t s = part_seq[part];
        const int64_t len = context_lens[s], lo = first_visible(len, window);
        const int64_t block_lo = lo / block_size + (part - part_start[s]) * partition_blocks;
        const int64_t pos_lo = block_lo * block_size > lo ? block_lo * block_size : lo;
        const int64_t pos_end = (block_lo + partition_blocks) * block_size;
        const int64_t pos_hi = pos_end < len ? pos_end : len;
        float q[group * head_dim], acc[group * v_head_dim], max[group], sum[group];
        for (int64_t g = 0; g < group; g++) {
            const float *src =
                query + s * query_seq_stride + (kv_head * group + g) * query_head_stride;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) q[g * head_dim + d] = src[d] * scale;
        }
        const kv_view kv = {(const char *)key_cache + kv_head * kv_head_stride * elem,
                            (const char *)value_cache + kv_head * kv_head_stride * elem,
                            block_tables + s * block_table_stride,
                            kv_block_stride * elem,
                            kv_token_stride * elem,
                            block_size,
                            kv_dtype,
                            group};
        attend_range(&kv, pos_lo, pos_hi, q, max, sum, acc, head_dim, v_head_dim);
        for (int64_t g = 0; g < group; g++) {
            const int64_t head = kv_head * group + g;
            float *ag = acc + g * v_head_dim;
            if (part_slot[part] < 0) {
                float *dst = out + s * out_seq_stride + head * out_head_stride;
                const float kept = sinks != NULL ? fold_sink(sinks[head], max[g], &sum[g]) : 1.0f;
                const float inv = kept / sum[g];
#pragma omp simd
                for (int64_t d = 0; d < v_head_dim; d++) dst[d] = ag[d] * inv;
            } else {
                float *st = state + (part_slot[part] * num_heads + head) * state_floats;
                st[0] = max[g];
                st[1] = sum[g];
                memcpy(st + 2, ag, (size_t)v_head_dim * sizeof(float));
            }
        }
    }

    if (num_split_parts > 0) {
        const int64_t num_merges = num_seqs * num_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t item = 0; item < num_merges; item++) {
            const int64_t s = item / num_heads, head = item % num_heads;
            const int64_t first = part_start[s], num_parts = part_start[s + 1] - first;
            if (num_parts < 2) continue;
            const float *st = state + (part_slot[first] * num_heads + head) * state_floats;
            const int64_t stride = num_heads * state_floats;
            merge_partitions(st, st + 1, st + 2, num_parts, stride, stride, v_head_dim,
                             sinks != NULL ? sinks + head : NULL,
                             out + s * out_seq_stride + head * out_head_stride);
        }
    }
    free(part_start);
    free(part_seq);
    free(part_slot);
    free(state);
    return SHOAL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Paged prefill attention: every prefill chunk of a step in one call. Chunk s has q_lens[s]
 * query tokens at positions [start_pos[s], start_pos[s] + q_lens[s]) (rows q_starts[s]... of
 * query / out); query i attends positions [0, start_pos[s] + i] of its sequence, all read from
 * the pool in place (the chunk's own K/V are written there before the call).
 *
 * A work item is (chunk, tile of LANES queries, query head). The tile's queries are the vector
 * lanes: Q is transposed once per item into qt[d] (one vector per dimension), so a key row's
 * scores for all LANES queries are head_dim FMAs of qt[d] by the broadcast k[d], with no
 * horizontal sums, and the output accumulates the same way from broadcast v[d]. Keys are
 * visited in tiles of KEY_TILE rows with an online softmax per lane; tiles past the last
 * query's position are never read.
 * ------------------------------------------------------------------------------------------- */
#define KEY_TILE 16
/* Output dimensions accumulated together across a key tile: independent FMA chains enough to
 * cover the FMA latency, few enough to stay in registers beside the tile's probabilities. */
#define ACC_CHUNK 8

/* One prefill work item's keys: [lo, q_pos0 + num_q) for lanes at positions q_pos0 + t, each
 * seeing (its position - window, its position] (window 0: from key 0). Leaves the per-lane
 * accumulators, normaliser and running max for the caller to normalise. */
typedef struct {
    int64_t q_pos0, num_q, window, head_dim, v_dim;
} prefill_span;

static ALWAYS_INLINE void prefill_item_impl(const kv_view *kv, const float *qt, prefill_span sp,
                                            float *acc_out, float *l_out, float *m_out,
                                            const int64_t head_dim, const int64_t v_dim) {
    const int64_t q_pos0 = sp.q_pos0, window = sp.window;
    const int64_t key_end = q_pos0 + sp.num_q; /* keys [key_lo, key_end) */
    const int64_t key_lo = window > 0 && q_pos0 + 1 > window ? q_pos0 + 1 - window : 0;
    vfloat acc[v_dim];
    for (int64_t d = 0; d < v_dim; d++) acc[d] = vsplat(0.0f);
    vfloat m = vsplat(-INFINITY), l = vsplat(0.0f);
    vint lane;
    for (int j = 0; j < LANES; j++) lane[j] = j;
    float k_buf[KEY_TILE * head_dim], v_buf[KEY_TILE * v_dim];
    const float *k_rows[KEY_TILE], *v_rows[KEY_TILE];
    int64_t offsets[KEY_TILE];
    for (int64_t pos = key_lo; pos < key_end; pos += KEY_TILE) {
        const int64_t n = key_end - pos < KEY_TILE ? key_end - pos : KEY_TILE;
        row_offsets(kv, pos, n, offsets);
        tile_rows(k_rows, kv->key_cache, offsets, n, kv->kv_dtype, k_buf, head_dim);
        tile_rows(v_rows, kv->value_cache, offsets, n, kv->kv_dtype, v_buf, v_dim);
        /* A short last tile repeats row 0: its scores are masked and its weights are 0. */
        for (int64_t j = n; j < KEY_TILE; j++) {
            k_rows[j] = k_rows[0];
            v_rows[j] = v_rows[0];
        }
        vfloat s[KEY_TILE];
        for (int64_t j = 0; j < KEY_TILE; j++) s[j] = vsplat(0.0f);
        for (int64_t d = 0; d < head_dim; d++) {
            const vfloat q = vload(qt + d * LANES);
            for (int64_t j = 0; j < KEY_TILE; j++) s[j] += q * k_rows[j][d];
        }
        /* Causal mask: key pos + j is visible to lane t when pos + j <= q_pos0 + t (and, with a
         * window, q_pos0 + t - (pos + j) < window). */
        const int needs_mask = pos + KEY_TILE - 1 > q_pos0 || n < KEY_TILE || window > 0;
        vfloat tile_max = vsplat(-INFINITY);
        for (int64_t j = 0; j < KEY_TILE; j++) {
            if (needs_mask) {
                const vint ahead = lane + (int32_t)(q_pos0 - pos - j);
                vint visible = ahead >= 0;
                if (window > 0) visible &= ahead < (int32_t)window;
                s[j] = j < n ? vselect(visible, s[j], vsplat(-INFINITY)) : vsplat(-INFINITY);
            }
            tile_max = vmax(tile_max, s[j]);
        }
        const vfloat m_new = vmax(m, tile_max);
        /* m is -inf only before the first tile, which holds a key every real lane sees: the
         * first of lane 0's window, and lane t's first lies at most t < KEY_TILE keys later.
         * (A padding lane may see none; its NaNs stay in its lane and are never stored.) */
        const vfloat correction = vexp_nonpositive(m - m_new);
        m = m_new;
        vfloat tile_sum = vsplat(0.0f);
        for (int64_t j = 0; j < KEY_TILE; j++) {
            s[j] = j < n ? vexp_nonpositive(s[j] - m) : vsplat(0.0f);
            tile_sum += s[j];
        }
        l = l * correction + tile_sum;
        for (int64_t d0 = 0; d0 < v_dim; d0 += ACC_CHUNK) {
            const int64_t dn = v_dim - d0 < ACC_CHUNK ? v_dim - d0 : ACC_CHUNK;
            vfloat a[ACC_CHUNK];
            for (int64_t c = 0; c < ACC_CHUNK; c++)
                if (c < dn) a[c] = acc[d0 + c] * correction;
            for (int64_t j = 0; j < KEY_TILE; j++) {
                const float *row = v_rows[j] + d0;
                for (int64_t c = 0; c < ACC_CHUNK; c++)
                    if (c < dn) a[c] += s[j] * row[c];
            }
            for (int64_t c = 0; c < ACC_CHUNK; c++)
                if (c < dn) acc[d0 + c] = a[c];
        }
    }
    for (int64_t d = 0; d < v_dim; d++) vstore(acc_out + d * LANES, acc[d]);
    vstore(l_out, l);
    vstore(m_out, m);
}

static void prefill_item(const kv_view *kv, const float *qt, prefill_span sp, float *acc_out,
                         float *l_out, float *m_out) {
    if (sp.head_dim == 64 && sp.v_dim == 64)
        prefill_item_impl(kv, qt, sp, acc_out, l_out, m_out, 64, 64);
    else if (sp.head_dim == 128 && sp.v_dim == 128)
        prefill_item_impl(kv, qt, sp, acc_out, l_out, m_out, 128, 128);
    else
        prefill_item_impl(kv, qt, sp, acc_out, l_out, m_out, sp.head_dim, sp.v_dim);
}

/*
 * out[q_starts[s] + i, h, :] = softmax(scale * q . K[s, kvh, lo:p + 1]) V[...] at position
 * p = start_pos[s] + i, lo = max(0, p + 1 - window) (0 without a window), for every chunk s
 * and i < q_lens[s]; kvh = h / (num_heads / num_kv_heads); with sinks, the softmax has one more
 * term exp(sinks[h]).
 *
 * out: fp32 [.., num_heads, v_head_dim], query: fp32 [.., num_heads, head_dim], element strides
 *   per token and per head; the last dim contiguous.
 * key_cache, value_cache, kv strides, kv_dtype, v_head_dim, window, sinks: as for
 *   shoal_paged_decode_attention.
 * block_tables: int32 [num_seqs, >= ceil((start_pos + q_len) / block_size)].
 * q_starts, q_lens, start_pos: int32 [num_seqs]; q_lens >= 1, start_pos >= 0.
 * Returns SHOAL_OK or SHOAL_BAD_ARGUMENT.
 */
int shoal_paged_prefill_attention(float *out, int64_t out_tok_stride, int64_t out_head_stride,
                                  const float *query, int64_t query_tok_stride,
                                  int64_t query_head_stride, const void *key_cache,
                                  const void *value_cache, int64_t kv_head_stride,
                                  int64_t kv_block_stride, int64_t kv_token_stride, int kv_dtype,
                                  const int32_t *block_tables, int64_t block_table_stride,
                                  const int32_t *q_starts, const int32_t *q_lens,
                                  const int32_t *start_pos, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
                                  int64_t block_size, int64_t window, const float *sinks,
                                  float scale, int num_threads) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 ||
        head_dim > MAX_HEAD_DIM || v_head_dim < 1 || v_head_dim > head_dim || block_size < 1 ||
        window < 0 || num_threads < 1 ||
        (kv_dtype != SHOAL_KV_FLOAT32 && kv_dtype != SHOAL_KV_BFLOAT16))
        return SHOAL_BAD_ARGUMENT;
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (q_lens[s] < 1 || start_pos[s] < 0) return SHOAL_BAD_ARGUMENT;
        num_tiles += (q_lens[s] + LANES - 1) / LANES;
    }
    if (num_tiles == 0) return SHOAL_OK;
    /* Tile t -> (chunk, first query): a flat list so one parallel loop covers every chunk. */
    int64_t *tile_seq = malloc((size_t)num_tiles * 2 * sizeof(int64_t));
    if (tile_seq == NULL) return SHOAL_OUT_OF_MEMORY;
    int64_t t = 0;
    /* Longest-running tiles (the last of the longest contexts) first: dynamic scheduling
     * then ends with the short ones, and the threads finish together. */
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t i0 = ((q_lens[s] - 1) / LANES) * LANES; i0 >= 0; i0 -= LANES) {
            tile_seq[2 * t] = s;
            tile_seq[2 * t + 1] = i0;
            t++;
        }
    const int64_t group = num_heads / num_kv_heads;
    const int64_t elem = kv_dtype == SHOAL_KV_FLOAT32 ? 4 : 2;
    const int64_t num_items = num_tiles * num_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t tile = item / num_heads, head = item % num_heads;
        const int64_t s = tile_seq[2 * tile], i0 = tile_seq[2 * tile + 1];
        const int64_t num_q = q_lens[s] - i0 < LANES ? q_lens[s] - i0 : LANES;
        const int64_t kv_head = head / group;
        float qt[head_dim * LANES], acc[v_head_dim * LANES], l[LANES], m[LANES];
        for (int64_t lane_i = 0; lane_i < LANES; lane_i++) {
            if (lane_i < num_q) {
                const float *src = query + (q_starts[s] + i0 + lane_i) * query_tok_stride +
                                   head * query_head_stride;
                for (int64_t d = 0; d < head_dim; d++) qt[d * LANES + lane_i] = src[d] * scale;
            } else {
                for (int64_t d = 0; d < head_dim; d++) qt[d * LANES + lane_i] = 0.0f;
            }
        }
        const kv_view kv = {(const char *)key_cache + kv_head * kv_head_stride * elem,
                            (const char *)value_cache + kv_head * kv_head_stride * elem,
                            block_tables + s * block_table_stride,
                            kv_block_stride * elem,
                            kv_token_stride * elem,
                            block_size,
                            kv_dtype,
                            group};
        const prefill_span span = {start_pos[s] + i0, num_q, window, head_dim, v_head_dim};
        prefill_item(&kv, qt, span, acc, l, m);
        for (int64_t lane_i = 0; lane_i < num_q; lane_i++) {
            float *dst =
                out + (q_starts[s] + i0 + lane_i) * out_tok_stride + head * out_head_stride;
            const float kept = sinks != NULL ? fold_sink(sinks[head], m[lane_i], &l[lane_i]) : 1.0f;
            const float inv = kept / l[lane_i];
            for (int64_t d = 0; d < v_head_dim; d++) dst[d] = acc[d * LANES + lane_i] * inv;
        }
    }
    free(tile_seq);
    return SHOAL_OK;
}

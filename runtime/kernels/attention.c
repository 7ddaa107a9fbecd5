/* ai.kiln::GroupQueryAttention: the attention of com.microsoft::GroupQueryAttention over shared KV
   buffers, for the graphs Kiln writes (fusions/group_query_attention.py, rotary_in_attention.py), with
   the same inputs, outputs and attributes:

     query [b, s, (heads + 2 kv_heads) * d] (packed) or [b, s, heads * d] with key and value
     [b, s, kv_heads * d]; past_key, past_value [b, kv_heads, slots, d]; seqlens_k [b] (each row's
     last slot after this step); total_sequence_length (the mask's width); cos_cache, sin_cache
     [positions, rotary_dim / 2] where do_rotary = 1; attention_bias [b or 1, heads or 1, s, t] (added
     to the scaled scores: the mask's pad slots)
     -> output [b, s, heads * d]; present_key, present_value [b, kv_heads, max(t, slots), d]

   A row's new keys (rotated by slot, as ONNX Runtime rotates them) and values go to its slots
   past .. past + s - 1, where past = seqlens_k + 1 - s (0 in a first prompt, s = t), written in place
   where present is bound to past's buffer (ONNX Runtime hands the op the caller's buffer), else into a
   copy. Query i of a row attends to its slots 0 .. past + i: softmax(scale * q.k + bias) over them,
   times the values. Not taken (the compiler leaves such nodes to ONNX Runtime): softcap, local windows,
   smooth softmax or head sinks, position_ids, quantized caches, fp16.

   Why an op of Kiln's: ONNX Runtime's CPU kernel runs, per (row, head), a GEMM of one query row against
   the keys, a softmax and a second GEMM, each with MLAS's per-call setup, after copying the packed
   projections into a transposed buffer and rotating into another. At batch 32 on SmolLM2 that was a
   quarter of an int8 decode step for a few MFLOPs. Here one work item is (row, kv head, up to 16
   positions): its query heads share each block of 16 keys, transposed once in registers, and each
   value row while they are in L1, and the new keys are rotated straight into the cache.

   The numbers are ONNX Runtime 1.32's bit for bit (tests/runtime/test_cpu_attention.py): its rotary
   kernel's roundings; a decode step's scores as MLAS's decode GEMV sums them (eight lanes, no FMA), a
   prompt's as its SGEMM does (FMA chains in slices); MLAS's AVX-512 exponential and order of summing;
   the values times the unnormalized probabilities in the same GEMV or SGEMM order (a prompt's query
   block of one row through SGEMM's M = 1 kernel), then times 1 / sum; a prompt's keys in ONNX
   Runtime's KV blocks (L2-sized) with its running rescale. Each row's numbers come from the same
   instructions in the same order whatever the batch or the thread count (a work item never spans
   rows), so a sequence's logits do not depend on its neighbours. One departure, for that: in a first
   prompt of rows of different lengths (right-padded), ONNX Runtime sizes a row's blocks by the longest
   row, so its numbers change with the padding (a row of 129 tokens alone ends in a query block of one
   row, SGEMM's M = 1 kernel; padded to 140 it does not); here each row gets ONNX Runtime's numbers for
   it alone, and its pads' outputs are zeros.

   ai.kiln::GroupQueryAttentionFp16Cache is the same op over an fp16 cache (past and present fp16, the
   recipe's kv_cache: float16): the new keys, rotated in fp32, and values are rounded to nearest even as
   they are stored, and every key and value read is widened exactly, so the sums above run in fp32 in
   the same order: the fp32 op's numbers for the values the cache holds. A decode step reads the whole
   cache of every row, which at batch 32 and a few hundred tokens is more bytes than an int8 model's
   weights: half of them is the point.

   ai.kiln::GroupQueryAttentionInt8Cache is the same op over an 8-bit cache (the recipe's kv_cache: int8):
   past and present int8 [b, kv_heads, slots, d + d / 4], each slot of each head d codes, then a scale
   (fp32) for each block of 16 of them. A key (rotated in fp32) or value is stored a block at a time as
   scale = max|x| / 127 and codes round-to-nearest-even(x * (127 / max|x|)); every number read is
   code * scale in fp32, so the sums above run in fp32 in the same order over the values the cache
   holds (a prompt's). A decode step over it runs its own arithmetic instead (attend_int8_decode): the
   query as 15-bit codes a block of 16, multiplied by the keys' codes in integers (VNNI), then by both
   steps in fp32; the probabilities times each block of values in fused multiply-adds. Within 1e-4 of
   the fp32 op's numbers over the same cache (outputs up to 3 in the tests), and still the same
   instructions in the same order whatever the batch. Why: widening every code of a long cache to fp32
   and transposing the floats was most of an int8 step's time; attention at batch 8 over 1,500 tokens
   became 1.4x to 1.8x faster (bench/attention.py: 30 layers of SmolLM2's shapes, two threads).

   Why blocks of 16 within one token's head: a token's keys and values are written once, when it
   comes, so a scale over more tokens would have to be fixed before the numbers it covers are known, or
   rewritten; and a key's few large channels (rotary pairs of high magnitude) would set the step of all
   its d numbers under one scale: SmolLM2's fp32 with one scale a slot and head (d = 64) lost 1.4 points
   of top-1 against eager (0.986), its int8 variant missed its 0.98 gate (0.975). A decode step reads
   1.25 d bytes a slot and head where fp32 reads 4 d (3.2x fewer), fp16 2 d. */

/* Every multiply and add below must round as written (setup.py builds with -ffp-contract=off): a fused
   multiply-add where ONNX Runtime's kernels round twice would change the last bit. */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ort_api.h"

#define NAME "GroupQueryAttention"
#define HALF_NAME "GroupQueryAttentionFp16Cache"
#define INT8_NAME "GroupQueryAttentionInt8Cache"
#define LANES 16
#define MAX_HEAD_SIZE 256
#define POSITIONS_PER_ITEM 16
#define TRANSPOSED_KEYS 2048   /* a prompt's keys an item keeps transposed for its positions (attend) */
#define MAX_SHARDS 32          /* enough to balance any thread count up to 32 */
#define PARALLEL_SCORES 2048  /* fewer (query, key) pairs run on the calling thread: a decode step of
                                 8 rows of SmolLM2 ran 41 us on one thread, 31 on two; 4 rows broke even */

enum { QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE, SEQLENS_K, TOTAL_LENGTH, COS_CACHE, SIN_CACHE, POSITION_IDS,
       ATTENTION_BIAS, INPUT_COUNT };

/* How a KV cache holds its numbers: one op per format (the table a kernel is made from says which). */
enum { CACHE_FP32, CACHE_FP16, CACHE_INT8 };
#define INT8_BLOCK 16  /* an int8 cache's numbers a scale: each slot holds d codes, then d / 16 fp32 scales */
#define PREFETCH_AHEAD 64  /* slots a decode step over an int8 cache asks for before it reads them */

typedef struct {
    int64_t heads, kv_heads;
    float scale;  /* 0: 1 / sqrt(d) */
    int rotary, interleaved;
    long l2;      /* the L2 cache's bytes, which size ONNX Runtime's KV blocks */
    int format;   /* the KV cache's: CACHE_FP32, CACHE_FP16 (GroupQueryAttentionFp16Cache), CACHE_INT8 */
} Kernel;

typedef struct {
    int64_t batch, seq, heads, kv_heads, group, d;
    const float *q, *k, *v;        /* row 0, token 0: its first query head, key head, value head */
    int64_t q_stride, kv_stride;   /* floats from one token's to the next */
    void *keys, *values;           /* present [batch][kv_heads][slots][d], in `format` (int8: [d * 5 / 4] bytes) */
    int format;
    int64_t slots;
    const int32_t* seqlens;
    int first_prompt;
    const float *cos, *sin;        /* [positions][half]; NULL: no rotation */
    int64_t half;
    int interleaved;
    const float* bias;             /* [bias_rows][bias_heads][seq][bias_slots]; NULL: none */
    int64_t bias_rows, bias_heads, bias_slots;
    float scale;
    float* out;                    /* [batch][seq][heads * d] */
    int64_t chunks;                /* position chunks per (row, kv head) */
    float* scratch;                /* per shard: scratch_per_item floats */
    int64_t items, shards;         /* work items, and shards of them (run_shard) */
    int64_t padded_keys, scratch_per_item;
    int64_t transposed_keys;       /* keys from slot 0 an item keeps transposed (0 for a decode step, or
                                      where the KV blocks do not start on a block of 16) */
    int64_t q_block, kv_block;     /* ONNX Runtime's query rows and keys per block in a prompt */
} Job;

static int64_t past_of(const Job* job, int64_t row) {
    return job->first_prompt ? 0 : (int64_t)job->seqlens[row] + 1 - job->seq;
}

/* x rotated to `position` into y (rotate-half, or pairs where interleaved) with the roundings of
   ONNX Runtime's rotary kernel (MLAS, rotary_embedding_kernel_avx2_fp32.cpp): real * cos - (imag * sin)
   and real * sin + (imag * cos), each a fused multiply-add of a rounded product; the dimensions past the
   rotary ones copied. */
static void rotate(const Job* job, const float* x, float* y, int64_t position) {
    int64_t d = job->d, half = job->half;
    if (!job->cos) { memcpy(y, x, sizeof(float) * d); return; }
    const float* cos = job->cos + position * half;
    const float* sin = job->sin + position * half;
    for (int64_t t = 0; t < half; t++) {
        int64_t i = job->interleaved ? 2 * t : t, j = job->interleaved ? 2 * t + 1 : t + half;
        float real = x[i], imag = x[j];
        float imag_sin = imag * sin[t], imag_cos = imag * cos[t];
        y[i] = fmaf(real, cos[t], -imag_sin);
        y[j] = fmaf(real, sin[t], imag_cos);
    }
    memcpy(y + 2 * half, x + 2 * half, sizeof(float) * (d - 2 * half));
}

static inline __mmask16 first_lanes(int64_t count) {
    return count >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

/* The slice of the inner dimension MLAS's SGEMM sums at a time (sgemm.cpp: strides of 128 for N and K,
   traded against each other by the GEMM's shape); a product's sum is one chain of fused multiply-adds per
   slice, the slices added in order. */
static int64_t gemm_slice(int64_t columns, int64_t depth) {
    int64_t stride_n = 128, stride_k = 128;
    if (columns >= depth) {
        while (stride_k / 2 >= depth) { stride_n *= 2; stride_k /= 2; }
    } else {
        while (stride_n > 16 && stride_n / 2 >= columns) { stride_k *= 2; stride_n /= 2; }
    }
    return stride_k;
}

/* An int8 cache's bytes a slot of one head: d codes, then a 4-byte scale for each block of 16. */
static inline int64_t int8_width(int64_t d) { return d + 4 * (d / INT8_BLOCK); }

/* Bytes a KV cache's slot of one head takes: d numbers of 4 or 2 bytes, or int8_width(d). */
static inline size_t slot_size(int format, int64_t d) {
    return format == CACHE_INT8 ? (size_t)int8_width(d) : (format == CACHE_FP16 ? 2 : 4) * (size_t)d;
}

/* A head's slot `slot`, counted from `cache`, as an address. */
static inline const void* slot_at(const void* cache, int64_t slot, int format, int64_t d) {
    return (const char*)cache + slot * (int64_t)slot_size(format, d);
}

/* 16 of a KV cache's numbers, slot j's from dimension c (a multiple of 16; slots counted from `slots`):
   fp32 as they are, fp16 widened (exactly), int8 codes times their block's scale (one rounding, in fp32). */
static inline __attribute__((always_inline)) __m512 load_cached(const void* slots, int64_t j, int64_t c, int64_t d,
                                                                int format) {
    if (format == CACHE_FP16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)slots + j * d + c)));
    if (format == CACHE_INT8) {
        const int8_t* slot = (const int8_t*)slots + j * int8_width(d);
        float scale;
        memcpy(&scale, slot + d + 4 * (c / INT8_BLOCK), sizeof scale);
        __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(slot + c))));
        return _mm512_mul_ps(codes, _mm512_set1_ps(scale));
    }
    return _mm512_loadu_ps((const float*)slots + j * d + c);
}

/* 16 numbers as integer codes of `levels` steps a side (127 for the int8 cache, 32767 for a query):
   round-to-nearest-even(x * (levels / m)), m the block's max|x|, into *largest. A block with a NaN or an
   infinity gets zero codes and m NaN, so what its step scales reads as NaN, as the fp32 op would pass it
   on, not as numbers. A block below levels / FLT_MAX (about 1e-34 to 1e-36) gets zero codes and m 0: its
   inverse would be infinite. */
static inline __m512i block_codes(__m512 block, float levels, float* largest) {
    __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(block), _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ);
    float m = _mm512_reduce_max_ps(_mm512_abs_ps(block));
    if (finite != 0xFFFF) m = NAN;
    else if (m <= levels / FLT_MAX) m = 0.0f;
    *largest = m;
    __m512 inverse = _mm512_set1_ps(m > 0.0f ? levels / m : 0.0f);
    return _mm512_cvt_roundps_epi32(_mm512_mul_ps(block, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* x [d] into an int8 cache's slot, a block of 16 at a time (block_codes), after all of them the blocks'
   scales m / 127 (0 and zero codes where m is 0, NaN for a block with a NaN or an infinity). */
static void store_int8(const float* x, int64_t d, int8_t* slot) {
    for (int64_t c = 0; c < d; c += INT8_BLOCK) {
        float largest;
        __m512i codes = block_codes(_mm512_loadu_ps(x + c), 127.0f, &largest);
        float scale = largest / 127.0f;
        _mm_storeu_si128((__m128i*)(slot + c), _mm512_cvtsepi32_epi8(codes));
        memcpy(slot + d + 4 * (c / INT8_BLOCK), &scale, sizeof scale);
    }
}

/* 16 numbers as fp16 for an fp16 cache: rounded to nearest even, past fp16's largest finite number held
   at it (an inf would turn a masked slot's probability of 0 into NaN); a NaN stays NaN. */
static inline __m256i to_half(__m512 x) {
    const __m512 largest = _mm512_set1_ps(65504.0f);
    x = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), largest), _mm512_min_ps(largest, x));
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

/* r[j] <- r's column j: a 16 x 16 transpose in registers. */
static inline __attribute__((always_inline)) void transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

/* keys [count <= 16][d] -> columns [d][16] (columns past count zero): the 16 keys side by side, one
   vector per dimension, as MLAS packs the transposed B of Q K^T; fp16 and int8 keys widened. */
static void transpose_keys(const void* keys, int64_t count, int64_t d, float* columns, int format) {
    for (int64_t k0 = 0; k0 < d; k0 += LANES) {
        __m512 r[16];
        for (int64_t j = 0; j < LANES; j++) r[j] = j < count ? load_cached(keys, j, k0, d, format) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t t = 0; t < LANES; t++) _mm512_storeu_ps(columns + (k0 + t) * LANES, r[t]);
    }
}

/* scores[r][j0 .. j0 + 16) of rows r < rows (<= 4): alpha * (q_r . key j) as MLAS's SGEMM kernel sums it,
   one fused multiply-add per dimension in order from zero, a slice at a time (the first slice times alpha,
   each later one added as acc * alpha + sum). Inlined with a literal rows. */
static inline __attribute__((always_inline)) void score_block(const float* columns, int64_t d, int64_t slice,
                                                              float* const* q, int rows, float alpha, int64_t j0,
                                                              __mmask16 lanes, float* const* scores) {
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 scale = _mm512_set1_ps(alpha);
    for (int64_t k0 = 0; k0 < d; k0 += slice) {
        int64_t k1 = k0 + slice < d ? k0 + slice : d;
        __m512 acc[4];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __m512 column = _mm512_loadu_ps(columns + k * LANES);
            for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][k]), column, acc[r]);
        }
        for (int r = 0; r < rows; r++)
            sum[r] = k0 == 0 ? _mm512_mul_ps(acc[r], scale) : _mm512_fmadd_ps(acc[r], scale, sum[r]);
    }
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(scores[r] + j0, lanes, sum[r]);
}

static void score_blocks(const float* columns, int64_t d, int64_t slice, float* const* q, int rows, float alpha,
                         int64_t j0, __mmask16 lanes, float* const* scores) {
    switch (rows) {
        case 1: score_block(columns, d, slice, q, 1, alpha, j0, lanes, scores); break;
        case 2: score_block(columns, d, slice, q, 2, alpha, j0, lanes, scores); break;
        case 3: score_block(columns, d, slice, q, 3, alpha, j0, lanes, scores); break;
        default: score_block(columns, d, slice, q, 4, alpha, j0, lanes, scores); break;
    }
}

/* scores[r][j0 .. j0 + 16) for a decode step's query rows r < rows (<= 4), as ONNX Runtime's decode GEMV
   sums them (MLAS flashattn_gqa.cpp, MlasGQADecodeQK, built without FMA): eight running sums of rounded
   products, dimension h into sum h mod 8, added as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)),
   then times alpha. Inlined with a literal rows. */
static inline __attribute__((always_inline)) void decode_score_block(const float* columns, int64_t d, float* const* q,
                                                                     int rows, float alpha, int64_t j0,
                                                                     __mmask16 lanes, float* const* scores) {
    for (int r = 0; r < rows; r++) {
        __m512 acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t k = 0; k < d; k += 8)
            for (int t = 0; t < 8; t++)
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_set1_ps(q[r][k + t]), _mm512_loadu_ps(columns + (k + t) * LANES)));
        __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                                   _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
        _mm512_mask_storeu_ps(scores[r] + j0, lanes, _mm512_mul_ps(sum, _mm512_set1_ps(alpha)));
    }
}

static inline __attribute__((always_inline)) void decode_score_blocks(const float* columns, int64_t d,
                                                                      float* const* q, int rows, float alpha,
                                                                      int64_t j0, __mmask16 lanes,
                                                                      float* const* scores) {
    switch (rows) {
        case 1: decode_score_block(columns, d, q, 1, alpha, j0, lanes, scores); break;
        case 2: decode_score_block(columns, d, q, 2, alpha, j0, lanes, scores); break;
        case 3: decode_score_block(columns, d, q, 3, alpha, j0, lanes, scores); break;
        default: decode_score_block(columns, d, q, 4, alpha, j0, lanes, scores); break;
    }
}

/* e^(x + shift) of MLAS's AVX-512 softmax kernel (TransKernelAvx512F.S, MlasComputeSumExpF32KernelAvx512F):
   clamp at -103.97, x = m ln2 + r with m by the rounding bias, a degree-6 polynomial, scaled by 2^m. */
static inline __m512 mlas_exp(__m512 x, __m512 shift) {
    x = _mm512_max_ps(_mm512_set1_ps(-103.9720840454f), _mm512_add_ps(shift, x));
    const __m512 bias = _mm512_set1_ps(12582912.0f);
    __m512 m = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), bias), bias);
    x = _mm512_fmadd_ps(m, _mm512_set1_ps(-6.93145752e-1f), x);
    x = _mm512_fmadd_ps(m, _mm512_set1_ps(-1.42860677e-6f), x);
    __m512 p = _mm512_set1_ps(0x1.694000p-10f);
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(0x1.125edcp-7f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(0x1.555b5ap-5f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(0x1.555450p-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(0x1.fffff6p-2f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, m);
}

/* scores[0 .. n) += the attention bias of (row, head), query position i, from slot `start` (the mask's
   pad slots, as the compiler writes it). */
static void add_bias(const Job* job, int64_t row, int64_t head, int64_t i, int64_t start, int64_t n, float* scores) {
    const float* bias = job->bias + ((job->bias_rows == 1 ? 0 : row * job->bias_heads) +
                                     (job->bias_heads == 1 ? 0 : head)) * job->seq * job->bias_slots +
                        i * job->bias_slots + start;
    for (int64_t j = 0; j < n; j += LANES) {
        __mmask16 lanes = first_lanes(n - j);
        _mm512_mask_storeu_ps(scores + j, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, scores + j),
                                                               _mm512_maskz_loadu_ps(lanes, bias + j)));
    }
}

static float row_max(const float* scores, int64_t n) {
    __m512 most = _mm512_set1_ps(-FLT_MAX);
    for (int64_t j = 0; j < n; j += LANES)
        most = _mm512_max_ps(most, _mm512_mask_loadu_ps(_mm512_set1_ps(-FLT_MAX), first_lanes(n - j), scores + j));
    return _mm512_reduce_max_ps(most);
}

/* scores[0 .. n - 1] -> e^(score - most), in place; returns their sum. As MLAS computes a softmax's (compute.cpp,
   MlasComputeSumExpF32KernelAvx512F): summed in one vector 48 then 16 values at a time, the vector reduced
   in the kernel's order. */
static float exponentials(float* scores, int64_t n, float most) {
    __m512 shift = _mm512_set1_ps(-most);
    __m512 total = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 3 * LANES <= n; j += 3 * LANES) {
        __m512 e0 = mlas_exp(_mm512_loadu_ps(scores + j), shift);
        __m512 e1 = mlas_exp(_mm512_loadu_ps(scores + j + LANES), shift);
        __m512 e2 = mlas_exp(_mm512_loadu_ps(scores + j + 2 * LANES), shift);
        total = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(total, e0), e1), e2);
        _mm512_storeu_ps(scores + j, e0);
        _mm512_storeu_ps(scores + j + LANES, e1);
        _mm512_storeu_ps(scores + j + 2 * LANES, e2);
    }
    for (; j < n; j += LANES) {
        __mmask16 lanes = first_lanes(n - j);
        __m512 e = mlas_exp(_mm512_maskz_loadu_ps(lanes, scores + j), shift);
        total = _mm512_mask_add_ps(total, lanes, total, e);
        _mm512_mask_storeu_ps(scores + j, lanes, e);
    }
    __m256 halves = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(total), 1)),
                                  _mm512_castps512_ps256(total));
    halves = _mm256_hadd_ps(halves, halves);
    halves = _mm256_hadd_ps(halves, halves);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
}

/* How ONNX Runtime sums probs x V for a row (MLAS flashattn_gqa.cpp and sgemm.cpp). */
enum {
    DECODE_GEMV,  /* a decode step (MlasGQADecodeSV, no FMA): each key's rounded products added in order */
    SGEMM_M1,     /* a prompt's query block of one row (SGEMM's M = 1 kernel, SgemmKernelM1Avx.S): keys four at a
                     time, ((p0 v0 + p1 v1) + p2 v2) + p3 v3 added to the sum; the last two and the last one alike */
    SGEMM,        /* a prompt's block of rows (SGEMM): one FMA chain per slice of keys, the slices added in order */
};

/* outs[r][c .. c + 16 width) = sum over keys j < n of probs[r][j] * value j, for rows r < rows (<= 4), each
   value vector loaded once for all the rows, summed as `order` says; with `accumulate` the sum starts from
   outs (SGEMM's beta = 1); fp16 and int8 values widened. Inlined with literal rows, width, order and format. */
static inline __attribute__((always_inline)) void weighted_sum(float* const* probs, int rows, int64_t n,
                                                               const void* values, int64_t d, int64_t c, int width,
                                                               int order, int64_t slice, int accumulate,
                                                               float* const* outs, int format) {
    __m512 sum[4][4];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < width; t++)
            sum[r][t] = accumulate ? _mm512_loadu_ps(outs[r] + c + t * LANES) : _mm512_setzero_ps();
#define VALUE(J, T) load_cached(values, J, c + (T) * LANES, d, format)
#define TERM(R, J, V) _mm512_mul_ps(_mm512_set1_ps(probs[R][J]), V)
    if (order == DECODE_GEMV) {
        for (int64_t j = 0; j < n; j++)
            for (int t = 0; t < width; t++) {
                __m512 v = VALUE(j, t);
                for (int r = 0; r < rows; r++) sum[r][t] = _mm512_add_ps(sum[r][t], TERM(r, j, v));
            }
    } else if (order == SGEMM_M1) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4)
            for (int t = 0; t < width; t++) {
                __m512 v0 = VALUE(j, t), v1 = VALUE(j + 1, t), v2 = VALUE(j + 2, t), v3 = VALUE(j + 3, t);
                for (int r = 0; r < rows; r++) {
                    __m512 four = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(TERM(r, j, v0), TERM(r, j + 1, v1)),
                                                              TERM(r, j + 2, v2)), TERM(r, j + 3, v3));
                    sum[r][t] = _mm512_add_ps(four, sum[r][t]);
                }
            }
        if (n - j >= 2) {
            for (int t = 0; t < width; t++) {
                __m512 v0 = VALUE(j, t), v1 = VALUE(j + 1, t);
                for (int r = 0; r < rows; r++)
                    sum[r][t] = _mm512_add_ps(_mm512_add_ps(TERM(r, j, v0), TERM(r, j + 1, v1)), sum[r][t]);
            }
            j += 2;
        }
        if (n - j == 1)
            for (int t = 0; t < width; t++) {
                __m512 v0 = VALUE(j, t);
                for (int r = 0; r < rows; r++) sum[r][t] = _mm512_add_ps(TERM(r, j, v0), sum[r][t]);
            }
    } else {
        for (int64_t j0 = 0; j0 < n; j0 += slice) {
            int64_t j1 = j0 + slice < n ? j0 + slice : n;
            __m512 acc[4][4];
            for (int r = 0; r < rows; r++)
                for (int t = 0; t < width; t++) acc[r][t] = _mm512_setzero_ps();
            for (int64_t j = j0; j < j1; j++)
                for (int t = 0; t < width; t++) {
                    __m512 v = VALUE(j, t);
                    for (int r = 0; r < rows; r++) acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(probs[r][j]), v, acc[r][t]);
                }
            for (int r = 0; r < rows; r++)
                for (int t = 0; t < width; t++)
                    sum[r][t] = j0 == 0 && !accumulate ? acc[r][t] : _mm512_add_ps(acc[r][t], sum[r][t]);
        }
    }
#undef VALUE
#undef TERM
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < width; t++)
            _mm512_storeu_ps(outs[r] + c + t * LANES, sum[r][t]);
}

static void weighted_sums(float* const* probs, int rows, int64_t n, const void* values, int64_t d, int order,
                          int64_t slice, int accumulate, float* const* outs, int format) {
    for (int64_t c = 0; c < d; c += 4 * LANES) {
        int width = d - c >= 4 * LANES ? 4 : (int)((d - c) / LANES);
#define CASE(R, O, H) if (width == 4) weighted_sum(probs, R, n, values, d, c, 4, O, slice, accumulate, outs, H); \
                      else weighted_sum(probs, R, n, values, d, c, width, O, slice, accumulate, outs, H)
#define ORDERS(R, H) if (order == DECODE_GEMV) { CASE(R, DECODE_GEMV, H); } \
                     else if (order == SGEMM_M1) { CASE(R, SGEMM_M1, H); } else { CASE(R, SGEMM, H); }
#define ROWS(H) switch (rows) { case 1: ORDERS(1, H); break; case 2: ORDERS(2, H); break; \
                                case 3: ORDERS(3, H); break; default: ORDERS(4, H); break; }
        if (format == CACHE_FP16) { ROWS(CACHE_FP16) } else if (format == CACHE_INT8) { ROWS(CACHE_INT8) } else { ROWS(CACHE_FP32) }
#undef ROWS
#undef ORDERS
#undef CASE
    }
}

/* -- a decode step over an int8 cache ------------------------------------------------------------- */

/* A query's numbers as int16 codes for the int8 cache's keys, a block of 16 at a time (block_codes), and
   the block's step m / 32767 times alpha into steps (NaN for a block with a NaN or an infinity, so the
   scores are NaN as the fp32 op's would be). 15 bits: the query adds an error some 250 times below the
   keys' own 8-bit one. */
static void query_codes(const float* q, int64_t d, float alpha, int16_t* codes, float* steps) {
    /* in the order int8_score_chunk reads them: of each 4 dimensions, 0, 2, 1, 3 */
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (int64_t c = 0; c < d; c += INT8_BLOCK) {
        float largest;
        __m512i rounded = block_codes(_mm512_loadu_ps(q + c), 32767.0f, &largest);
        _mm256_storeu_si256((__m256i*)(codes + c), _mm512_cvtsepi32_epi16(_mm512_permutexvar_epi32(order, rounded)));
        steps[c / INT8_BLOCK] = largest / 32767.0f * alpha;
    }
}

/* The cache lines of `count` int8 slots from `slot` asked for ahead: a decode step streams a long cache
   from memory once, and the hardware's prefetcher alone left two threads at 13 GB/s of this machine's 34. */
static inline void prefetch_slots(const int8_t* slot, int64_t count, int64_t width, const int8_t* end) {
    const int8_t* last = slot + count * width;
    if (last > end) last = end;
    for (const int8_t* line = slot; line < last; line += 64) _mm_prefetch((const char*)line, _MM_HINT_T0);
}

/* Query codes 2 word and 2 word + 1, as one 32-bit word (memcpy: no int32 read of int16 storage). */
static inline int32_t code_pair(const int16_t* codes, int64_t word) {
    int32_t pair;
    memcpy(&pair, codes + 2 * word, sizeof pair);
    return pair;
}

/* Slots j0 .. j0 + 15's (from `slots`, `width` bytes apart) scales of block b, lanes past `lanes` zero. */
static inline __m512 block_scales(const int8_t* slots, int64_t j0, int64_t width, int64_t d, int64_t b, __mmask16 lanes) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)width)),
                                    slots + j0 * width + d + 4 * b, 1);
}

/* scores[h][j0 .. j0 + 16) for a kv head's query heads h < group over `count` int8 keys from slot j0, their
   dimensions c0 .. c0 + 16 blocks (<= 4): the keys' codes transposed in registers as 4-byte words (a lane a
   key, a register 4 dimensions), each word's bytes split into two int16 pairs (dimensions 4t, 4t + 2 and
   4t + 1, 4t + 3: shifts, not shuffles, which the transpose already keeps busy), each block summed exactly
   in int32 (then converted to fp32, rounding past 2^24) by VNNI's int16 dot products against the query's codes in that order (query_codes), then times
   the key's and the query's steps in fp32 and added to the scores of the blocks before it. Inlined with
   literal count and blocks. */
static inline __attribute__((always_inline)) void int8_score_chunk(const int8_t* keys, int64_t j0, int64_t count,
                                                                   int64_t d, int64_t c0, int blocks, int64_t group,
                                                                   const int16_t* codes, const float* steps,
                                                                   float* const* scores) {
    int64_t width = int8_width(d), b0 = c0 / INT8_BLOCK;
    __mmask16 lanes = first_lanes(count);
    __mmask64 bytes = blocks == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * blocks)) - 1);
    __m512 r[16];
    for (int64_t j = 0; j < LANES; j++)
        r[j] = j < count ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(bytes, keys + (j0 + j) * width + c0))
                         : _mm512_setzero_ps();
    transpose16(r);  /* r[t]: dimensions c0 + 4t .. c0 + 4t + 3 of the 16 keys */
    __m512 scale[4];
    for (int b = 0; b < blocks; b++) scale[b] = block_scales(keys, j0, width, d, b0 + b, lanes);
    __m512i even[16], odd[16];
#pragma GCC unroll 16
    for (int t = 0; t < 4 * blocks; t++) {
        __m512i word = _mm512_castps_si512(r[t]);
        even[t] = _mm512_srai_epi16(_mm512_slli_epi16(word, 8), 8);
        odd[t] = _mm512_srai_epi16(word, 8);
    }
    int64_t steps_per_row = d / INT8_BLOCK;
    for (int64_t h = 0; h < group; h++) {
        const int16_t* q = codes + h * d + c0;  /* word 2t: dims 4t, 4t + 2; 2t + 1: 4t + 1, 4t + 3 */
        __m512 score = c0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(scores[h] + j0);
#pragma GCC unroll 4
        for (int b = 0; b < blocks; b++) {
            __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int t = 4 * b; t < 4 * b + 4; t++) {
                low = _mm512_dpwssd_epi32(low, even[t], _mm512_set1_epi32(code_pair(q, 2 * t)));
                high = _mm512_dpwssd_epi32(high, odd[t], _mm512_set1_epi32(code_pair(q, 2 * t + 1)));
            }
            __m512 step = _mm512_mul_ps(scale[b], _mm512_set1_ps(steps[h * steps_per_row + b0 + b]));
            score = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(low, high)), step, score);
        }
        _mm512_storeu_ps(scores[h] + j0, score);  /* the rows have room for whole blocks of 16 */
    }
}

/* scores[h][0 .. n) = alpha * (q_h . key j) for a kv head's query heads over its int8 keys, 16 keys at a time
   (int8_score_chunk), the blocks of a key added in order. */
static void int8_scores(const int8_t* keys, int64_t n, int64_t d, int64_t group, const int16_t* codes,
                        const float* steps, float* const* scores) {
    int64_t width = int8_width(d);
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int64_t count = n - j0 < LANES ? n - j0 : LANES;
        prefetch_slots(keys + (j0 + PREFETCH_AHEAD) * width, LANES, width, keys + n * width);
        for (int64_t c0 = 0; c0 < d; c0 += 4 * INT8_BLOCK) {
            int blocks = d - c0 >= 4 * INT8_BLOCK ? 4 : (int)((d - c0) / INT8_BLOCK);
            /* literal counts and blocks, so that each chunk's loops unroll into registers */
            if (count == LANES && blocks == 4) int8_score_chunk(keys, j0, LANES, d, c0, 4, group, codes, steps, scores);
            else if (blocks == 4) int8_score_chunk(keys, j0, count, d, c0, 4, group, codes, steps, scores);
            else if (blocks == 3) int8_score_chunk(keys, j0, count, d, c0, 3, group, codes, steps, scores);
            else if (blocks == 2) int8_score_chunk(keys, j0, count, d, c0, 2, group, codes, steps, scores);
            else int8_score_chunk(keys, j0, count, d, c0, 1, group, codes, steps, scores);
        }
    }
}

/* outs[r][c .. c + 16 width) = sum over slots j < n of probs[r][j] * value j, for rows r < rows (<= 4), over
   an int8 cache's values: each block's codes widened once for all the rows, times coefficients probs[r][j]
   * the block's scale (16 slots at a time), fused multiply-adds in slot order, then times factor[r] (1 / the
   row's sum). Inlined with literal rows and width. */
static inline __attribute__((always_inline)) void int8_weighted_sum(float* const* probs, int rows, int64_t n,
                                                                    const int8_t* values, int64_t d, int64_t c,
                                                                    int width, const float* factor,
                                                                    float* const* outs) {
    int64_t slot_width = int8_width(d);
    __m512 sum[4][4];
    float coefficients[4][4][LANES];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < width; t++) sum[r][t] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int64_t count = n - j0 < LANES ? n - j0 : LANES;
        __mmask16 lanes = first_lanes(count);
        prefetch_slots(values + (j0 + PREFETCH_AHEAD) * slot_width, LANES, slot_width, values + n * slot_width);
        for (int t = 0; t < width; t++) {
            __m512 scale = block_scales(values, j0, slot_width, d, c / INT8_BLOCK + t, lanes);
            for (int r = 0; r < rows; r++)
                _mm512_storeu_ps(coefficients[r][t], _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, probs[r] + j0), scale));
        }
        for (int64_t j = 0; j < count; j++) {
            const int8_t* slot = values + (j0 + j) * slot_width + c;
            for (int t = 0; t < width; t++) {
                __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(slot + t * LANES))));
                for (int r = 0; r < rows; r++)
                    sum[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(coefficients[r][t][j]), v, sum[r][t]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < width; t++)
            _mm512_storeu_ps(outs[r] + c + t * LANES, _mm512_mul_ps(sum[r][t], _mm512_set1_ps(factor[r])));
}

static void int8_weighted_sums(float* const* probs, int rows, int64_t n, const int8_t* values, int64_t d,
                               const float* factor, float* const* outs) {
    for (int64_t c = 0; c < d; c += 4 * LANES) {
        int width = d - c >= 4 * LANES ? 4 : (int)((d - c) / LANES);
#define WIDTHS(R) if (width == 4) int8_weighted_sum(probs, R, n, values, d, c, 4, factor, outs); \
                  else int8_weighted_sum(probs, R, n, values, d, c, width, factor, outs)
        switch (rows) {
            case 1: WIDTHS(1); break;
            case 2: WIDTHS(2); break;
            case 3: WIDTHS(3); break;
            default: WIDTHS(4); break;
        }
#undef WIDTHS
    }
}

/* A decode step of (row, kv head) over an int8 cache. Its own arithmetic, not the fp32 op's over the values
   the cache holds: the keys' codes are multiplied in integers (VNNI) by the query's (query_codes), where
   the fp32 op would widen every code of every key to fp32 and transpose the floats, the most of an int8
   step's time at long contexts; the probabilities times the values are fused multiply-adds of each block
   of codes, widened once for every query head of the group. Still the same instructions in the same order
   whatever the batch, so a row's numbers do not depend on its neighbours. */
static void attend_int8_decode(const Job* job, int64_t row, int64_t g, float* scratch) {
    int64_t d = job->d, group = job->group, width = int8_width(d), blocks = d / INT8_BLOCK;
    int64_t past = past_of(job, row), n = past + 1;  /* the slots up to the new token's own */
    const int8_t* keys = (const int8_t*)job->keys + (row * job->kv_heads + g) * job->slots * width;
    const int8_t* values = (const int8_t*)job->values + (row * job->kv_heads + g) * job->slots * width;
    float* rotated = scratch + group * job->padded_keys;                /* [d] */
    int16_t* codes = (int16_t*)(rotated + group * d);                    /* [group][d] */
    float* steps = rotated + 2 * group * d;                              /* [group][blocks] */
    float* probs[64] = {0};
    float* outs[64];
    float factor[64];
    for (int64_t h = 0; h < group; h++) {
        int64_t head = g * group + h;
        rotate(job, job->q + row * job->q_stride + head * d, rotated, past);
        query_codes(rotated, d, job->scale, codes + h * d, steps + h * blocks);
        probs[h] = scratch + h * job->padded_keys;
        outs[h] = job->out + row * job->heads * d + head * d;
    }
    int8_scores(keys, n, d, group, codes, steps, probs);
    for (int64_t h = 0; h < group; h++) {
        if (job->bias) add_bias(job, row, g * group + h, 0, 0, n, probs[h]);
        float summed = exponentials(probs[h], n, row_max(probs[h], n));
        factor[h] = summed > 0.0f ? 1.0f / summed : 0.0f;
    }
    for (int64_t h = 0; h < group; h += 4)
        int8_weighted_sums(probs + h, group - h < 4 ? (int)(group - h) : 4, n, values, d, factor + h, outs + h);
}

/* Work item i: (row, kv head, chunk of POSITIONS_PER_ITEM positions), every query head of the kv head.
   A position's query heads share one pass over the keys: 16 keys transposed, then their scores for up to
   four heads at a time. The arithmetic is ONNX Runtime's (1.32, MLAS flashattn_gqa.cpp): scores, plus the
   bias, e^(score - max) and their sum, probs x V unnormalized, times 1 / sum; a prompt's keys a KV block
   at a time, each block's maximum rescaling what the blocks before it summed. */
static void attend(const Job* job, int64_t item, float* scratch) {
    int64_t chunk = item % job->chunks, g = item / job->chunks % job->kv_heads;
    int64_t row = item / job->chunks / job->kv_heads;
    int64_t d = job->d, group = job->group, past = past_of(job, row), total = (int64_t)job->seqlens[row] + 1;
    int64_t first = chunk * POSITIONS_PER_ITEM, last = first + POSITIONS_PER_ITEM < job->seq ? first + POSITIONS_PER_ITEM : job->seq;
    int format = job->format;
    if (format == CACHE_INT8 && job->seq == 1) { attend_int8_decode(job, row, g, scratch); return; }
    const void* keys = slot_at(job->keys, (row * job->kv_heads + g) * job->slots, format, d);
    const void* values = slot_at(job->values, (row * job->kv_heads + g) * job->slots, format, d);
    float* queries = scratch + group * job->padded_keys;
    float* unnormalized = queries + group * d;  /* a prompt row's outputs before 1 / sum, per query head */
    float* columns = unnormalized + group * d;  /* [d][16]: one block of keys transposed */
    /* A prompt's positions share its keys: blocks of 16 from slot 0, each [d][16], transposed once for all
       the item's positions (at 42 positions a row, 78 transposes of a block became 6), where the KV blocks
       start on a block of 16 (job->transposed_keys is 0 where they do not). Each block holds its 16 slots
       whatever the position: a key past a position's own only fills a lane its scores never store. */
    float* transposed = columns + d * LANES;
    int64_t kept = job->transposed_keys / LANES, held = 0;
    /* A first prompt's GEMMs span all its slots. A row shorter than the step (right-padded, its pads after
       its mask's end) is computed as ONNX Runtime computes it alone, over its own slots: its numbers do
       not depend on how far the longest row reaches. Its pads' outputs are zeros. */
    int64_t span = job->first_prompt && total < job->seq ? total : job->seq;
    if (job->first_prompt) total = span;
    int64_t q_block = job->q_block < span ? job->q_block : span;
    int decode = job->seq == 1;
    int64_t block = decode || job->kv_block >= total ? total : job->kv_block;
    for (int64_t i = first; i < last; i++) {
        if (i >= span) {
            for (int64_t h = 0; h < group; h++)
                memset(job->out + (row * job->seq + i) * job->heads * d + (g * group + h) * d, 0, sizeof(float) * d);
            continue;
        }
        int64_t n = past + i + 1;  /* causal: the slots up to this token's own */
        if (n > job->slots) n = job->slots;
        /* ONNX Runtime takes a prompt's queries q_block rows at a time; a block of one row goes through
           SGEMM's M = 1 kernel, over all the KV block's keys (the masked ones' probabilities 0). */
        int alone = !decode && i / q_block == (span - 1) / q_block && span % q_block == 1;
        int order = decode ? DECODE_GEMV : alone ? SGEMM_M1 : SGEMM;
        float* q[64];
        float* probs[64];
        float* outs[64];
        float* sums[64];
        float most[64], summed[64];
        for (int64_t h = 0; h < group; h++) {
            int64_t head = g * group + h;
            q[h] = queries + h * d;
            rotate(job, job->q + (row * job->seq + i) * job->q_stride + head * d, q[h], past + i);
            probs[h] = scratch + h * job->padded_keys;
            outs[h] = job->out + (row * job->seq + i) * job->heads * d + head * d;
            sums[h] = unnormalized + h * d;
        }
        for (int64_t start = 0; start < n; start += block) {
            int64_t in_block = block < total - start ? block : total - start;
            int64_t live = in_block < n - start ? in_block : n - start;
            int64_t score_slice = gemm_slice(in_block, d);
            for (int64_t j0 = 0; j0 < live; j0 += LANES) {
                int64_t key_block = (start + j0) / LANES;
                const float* block_columns = columns;
                if (key_block < kept) {
                    block_columns = transposed + key_block * d * LANES;
                    if (key_block == held) {  /* positions visit the blocks in order from slot 0 */
                        int64_t slot = key_block * LANES;
                        transpose_keys(slot_at(keys, slot, format, d), job->slots - slot < LANES ? job->slots - slot : LANES,
                                       d, transposed + key_block * d * LANES, format);
                        held++;
                    }
                } else {
                    transpose_keys(slot_at(keys, start + j0, format, d), live - j0 < LANES ? live - j0 : LANES, d,
                                   columns, format);
                }
                for (int64_t h = 0; h < group; h += 4) {
                    int rows = group - h < 4 ? (int)(group - h) : 4;
                    __mmask16 lanes = first_lanes(live - j0);
                    if (decode && d == 64) decode_score_blocks(block_columns, 64, q + h, rows, job->scale, j0, lanes, probs + h);
                    else if (decode) decode_score_blocks(block_columns, d, q + h, rows, job->scale, j0, lanes, probs + h);
                    else score_blocks(block_columns, d, score_slice, q + h, rows, job->scale, j0, lanes, probs + h);
                }
            }
            for (int64_t h = 0; h < group; h++) {
                if (job->bias) add_bias(job, row, g * group + h, i, start, live, probs[h]);
                float block_most = row_max(probs[h], live);
                if (start == 0) {
                    most[h] = block_most;
                    summed[h] = exponentials(probs[h], live, block_most);
                } else {  /* the running rescale, as ONNX Runtime's online softmax does it */
                    float before = most[h];
                    most[h] = before < block_most ? block_most : before;
                    float block_sum = exponentials(probs[h], live, most[h]);
                    float rescale = expf(before - most[h]);
                    summed[h] = rescale * summed[h] + block_sum;
                    for (int64_t c = 0; c < d; c++) sums[h][c] *= rescale;
                }
                if (order == SGEMM_M1)
                    for (int64_t j = live; j < in_block; j++) probs[h][j] = 0.0f;
            }
            int64_t count = order == SGEMM_M1 ? in_block : live;
            for (int64_t h = 0; h < group; h += 4)
                weighted_sums(probs + h, group - h < 4 ? (int)(group - h) : 4, count, slot_at(values, start, format, d),
                              d, order, gemm_slice(d, in_block), start > 0, sums + h, format);
        }
        for (int64_t h = 0; h < group; h++) {
            __m512 factor = _mm512_set1_ps(summed[h] > 0.0f ? 1.0f / summed[h] : 0.0f);
            for (int64_t c = 0; c < d; c += LANES)
                _mm512_storeu_ps(outs[h] + c, _mm512_mul_ps(_mm512_loadu_ps(sums[h] + c), factor));
        }
    }
}

/* Shard s of job->shards: items s, s + shards, ... with one scratch area (a prompt's later positions, the
   costlier ones, spread over the shards). */
static void run_shard(void* data, size_t shard) {
    const Job* job = data;
    for (int64_t item = (int64_t)shard; item < job->items; item += job->shards)
        attend(job, item, job->scratch + (int64_t)shard * job->scratch_per_item);
}

/* -- the op ---------------------------------------------------------------------------------------- */

static const char* op_name(const OrtCustomOp* op);

static int cache_format(const OrtCustomOp* op) {
    return op == &kiln_attention_fp16_cache_op ? CACHE_FP16 : op == &kiln_attention_int8_cache_op ? CACHE_INT8 : CACHE_FP32;
}

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api_, const OrtKernelInfo* info, void** out) {
    (void)api_;
    int64_t heads = kiln_attribute_int(info, "num_heads", 0), kv_heads = kiln_attribute_int(info, "kv_num_heads", 0);
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > 64)
        return kiln_op_error(ORT_INVALID_ARGUMENT, op_name(op),
                             "num_heads and kv_num_heads must be positive, num_heads a multiple of kv_num_heads "
                             "(at most 64 query heads a kv head)");
    if (kiln_attribute_float(info, "softcap", 0.0f) != 0.0f || kiln_attribute_int(info, "local_window_size", -1) != -1 ||
        kiln_attribute_int(info, "smooth_softmax", 0) != 0)
        return kiln_op_error(ORT_INVALID_ARGUMENT, op_name(op), "softcap, local_window_size and smooth_softmax are not taken "
                             "(leave such nodes to com.microsoft::GroupQueryAttention)");
    int64_t rotary = kiln_attribute_int(info, "do_rotary", 0), interleaved = kiln_attribute_int(info, "rotary_interleaved", 0);
    if ((rotary != 0 && rotary != 1) || (interleaved != 0 && interleaved != 1))
        return kiln_op_error(ORT_INVALID_ARGUMENT, op_name(op), "do_rotary and rotary_interleaved must be 0 or 1");
    Kernel* kernel = calloc(1, sizeof(Kernel));
    if (!kernel) return kiln_op_error(ORT_FAIL, op_name(op), "out of memory");
    *kernel = (Kernel){heads, kv_heads, kiln_attribute_float(info, "scale", 0.0f), (int)rotary, (int)interleaved,
                       sysconf(_SC_LEVEL2_CACHE_SIZE), cache_format(op)};
    *out = kernel;
    return NULL;
}

#define INVALID(what) kiln_op_error(ORT_INVALID_ARGUMENT, name, what)

static OrtStatus* compute(void* data, OrtKernelContext* context) {
    const Kernel* kernel = data;
    const char* name = kernel->format == CACHE_FP16 ? HALF_NAME : kernel->format == CACHE_INT8 ? INT8_NAME : NAME;
    const OrtValue* in[INPUT_COUNT];
    int64_t dims[INPUT_COUNT][4];
    size_t rank[INPUT_COUNT];
    OrtStatus* status;
    for (size_t i = 0; i < INPUT_COUNT; i++) {
        rank[i] = 0;
        if ((status = kiln_input(context, i, &in[i]))) return status;
        if (in[i] && (status = kiln_dims(in[i], dims[i], &rank[i], 4, name))) return status;
    }
    if (in[POSITION_IDS]) return INVALID("position_ids are not taken: it rotates each token by its slot");
    if (rank[QUERY] != 3) return INVALID("query must be [batch, seq, hidden]");
    int64_t batch = dims[QUERY][0], seq = dims[QUERY][1], heads = kernel->heads, kv_heads = kernel->kv_heads;
    if (batch > 0 && seq < 1) return INVALID("query must have at least one token a row");
    int packed = !in[KEY];
    if (packed != !in[VALUE]) return INVALID("key and value must be both given or both absent (packed query)");
    int64_t d = dims[QUERY][2] / (packed ? heads + 2 * kv_heads : heads);
    if (d * (packed ? heads + 2 * kv_heads : heads) != dims[QUERY][2] || d % LANES || d <= 0 || d > MAX_HEAD_SIZE)
        return INVALID("the head size must be a multiple of 16 up to 256, and query's last dimension that times the heads");
    if (!packed)
        for (int i = KEY; i <= VALUE; i++)
            if (rank[i] != 3 || dims[i][0] != batch || dims[i][1] != seq || dims[i][2] != kv_heads * d)
                return INVALID("key and value must be [batch, seq, kv_num_heads * head size]");
    if (!in[PAST_KEY] || !in[PAST_VALUE]) return INVALID("past_key and past_value are required");
    int64_t width = kernel->format == CACHE_INT8 ? int8_width(d) : d;  /* an int8 cache's slot: codes, scales */
    for (int i = PAST_KEY; i <= PAST_VALUE; i++)
        if (rank[i] != 4 || dims[i][0] != batch || dims[i][1] != kv_heads || dims[i][3] != width ||
            dims[i][2] != dims[PAST_KEY][2])
            return INVALID(kernel->format == CACHE_INT8
                           ? "past_key and past_value must be [batch, kv_num_heads, slots, head size * 5 / 4]"
                           : "past_key and past_value must be [batch, kv_num_heads, slots, head size]");
    if (rank[SEQLENS_K] != 1 || dims[SEQLENS_K][0] != batch) return INVALID("seqlens_k must be [batch]");
    if (rank[TOTAL_LENGTH] > 1 || (rank[TOTAL_LENGTH] == 1 && dims[TOTAL_LENGTH][0] != 1))
        return INVALID("total_sequence_length must be one number");
    const int32_t* seqlens = kiln_data_of(in[SEQLENS_K]);
    const int32_t* total_data = kiln_data_of(in[TOTAL_LENGTH]);
    if ((batch && !seqlens) || !total_data) return kiln_op_error(ORT_FAIL, name, "no tensor data");
    int64_t total = *total_data, past_slots = dims[PAST_KEY][2];
    int64_t slots = total > past_slots ? total : past_slots;
    int first_prompt = seq == total;
    int64_t longest = 0;
    for (int64_t r = 0; r < batch; r++) {
        int64_t length = (int64_t)seqlens[r] + 1;
        if (length < 1 || length > slots || (!first_prompt && length < seq))
            return INVALID("a row's seqlens_k + 1 must be at least the new tokens and at most the KV buffers' slots");
        if (length > longest) longest = length;
    }
    if (first_prompt && seq > longest) longest = seq;
    int64_t half = 0;
    if (kernel->rotary) {
        if (!in[COS_CACHE] || !in[SIN_CACHE] || rank[COS_CACHE] != 2 || rank[SIN_CACHE] != 2 ||
            dims[COS_CACHE][0] != dims[SIN_CACHE][0] || dims[COS_CACHE][1] != dims[SIN_CACHE][1] ||
            2 * dims[COS_CACHE][1] > d || dims[COS_CACHE][1] <= 0)
            return INVALID("do_rotary needs cos_cache and sin_cache, both [positions, rotary dimensions / 2 <= head size / 2]");
        if (dims[COS_CACHE][0] < longest) return INVALID("cos_cache and sin_cache have fewer positions than a row's slots");
        half = dims[COS_CACHE][1];
    }
    if (in[ATTENTION_BIAS] && (rank[ATTENTION_BIAS] != 4 || (dims[ATTENTION_BIAS][0] != 1 && dims[ATTENTION_BIAS][0] != batch) ||
                               (dims[ATTENTION_BIAS][1] != 1 && dims[ATTENTION_BIAS][1] != heads) ||
                               dims[ATTENTION_BIAS][2] != seq || dims[ATTENTION_BIAS][3] < longest))
        return INVALID("attention_bias must be [batch or 1, num_heads or 1, seq, at least a row's slots]");

    OrtValue *output, *present_key, *present_value;
    int64_t out_dims[3] = {batch, seq, heads * d}, present_dims[4] = {batch, kv_heads, slots, width};
    if ((status = kiln_output(context, 0, out_dims, 3, &output)) ||
        (status = kiln_output(context, 1, present_dims, 4, &present_key)) ||
        (status = kiln_output(context, 2, present_dims, 4, &present_value)))
        return status;
    if (batch == 0) return NULL;
    const float* query = kiln_data_of(in[QUERY]);
    const void* past_key = kiln_data_of(in[PAST_KEY]);
    const void* past_value = kiln_data_of(in[PAST_VALUE]);
    void* keys = kiln_data_of(present_key);
    void* values = kiln_data_of(present_value);
    float* out = kiln_data_of(output);
    if (!query || !keys || !values || !out || (past_slots && (!past_key || !past_value)))
        return kiln_op_error(ORT_FAIL, name, "no tensor data");

    Job job = {batch, seq, heads, kv_heads, heads / kv_heads, d,
               query, packed ? query + heads * d : kiln_data_of(in[KEY]),
               packed ? query + (heads + kv_heads) * d : kiln_data_of(in[VALUE]),
               packed ? (heads + 2 * kv_heads) * d : heads * d, packed ? (heads + 2 * kv_heads) * d : kv_heads * d,
               keys, values, kernel->format, slots, seqlens, first_prompt,
               kernel->rotary ? kiln_data_of(in[COS_CACHE]) : NULL, kernel->rotary ? kiln_data_of(in[SIN_CACHE]) : NULL,
               half, kernel->interleaved,
               in[ATTENTION_BIAS] ? kiln_data_of(in[ATTENTION_BIAS]) : NULL,
               in[ATTENTION_BIAS] ? dims[ATTENTION_BIAS][0] : 0, in[ATTENTION_BIAS] ? dims[ATTENTION_BIAS][1] : 0,
               in[ATTENTION_BIAS] ? dims[ATTENTION_BIAS][3] : 0,
               kernel->scale != 0.0f ? kernel->scale : 1.0f / sqrtf((float)d), out,
               (seq + POSITIONS_PER_ITEM - 1) / POSITIONS_PER_ITEM, NULL, 0, 0, (longest + LANES - 1) / LANES * LANES, 0, 1, 1};
    /* ONNX Runtime's query block (group_query_attention's flash path): KV blocks sized to the L2 cache, at
       most 2 * head size query rows a block. */
    int64_t kv_block = kernel->l2 > 0 ? (int64_t)kernel->l2 / (int64_t)(sizeof(float) * 4 * 2 * d) : 1;
    if (kv_block < 1) kv_block = 1;
    job.kv_block = kv_block;
    job.q_block = kv_block < 2 * d ? kv_block : 2 * d;
    if (job.q_block > seq) job.q_block = seq;
    /* a prompt's blocks of 16 keys kept transposed (attend), where its KV blocks start on one */
    job.transposed_keys = seq > 1 && kv_block % LANES == 0
        ? (job.padded_keys < TRANSPOSED_KEYS ? job.padded_keys : TRANSPOSED_KEYS) : 0;
    job.scratch_per_item = job.group * (job.padded_keys + 2 * d) + d * LANES + job.transposed_keys * d;
    if (!job.k || !job.v || (kernel->rotary && (!job.cos || !job.sin)) || (in[ATTENTION_BIAS] && !job.bias))
        return kiln_op_error(ORT_FAIL, name, "no tensor data");
    /* Shards of work items, each with one scratch area: enough to balance the threads, and the scratch
       grows with the longest row, not with the prompt's positions. Allocated before the cache is touched,
       so a failure leaves the cache as it was. */
    job.items = batch * kv_heads * job.chunks;
    job.shards = job.items < MAX_SHARDS ? job.items : MAX_SHARDS;
    job.scratch = malloc(sizeof(float) * (size_t)job.shards * (size_t)job.scratch_per_item);
    if (!job.scratch) return kiln_op_error(ORT_FAIL, name, "out of memory");

    /* The cache first: a copy of past where present is not its buffer (what ONNX Runtime's op writes:
       zeros, then each row's past slots), then every row's new keys, rotated, and values (an fp16 cache
       gets them rounded to nearest even, an int8 one codes and a scale a slot). */
    size_t slot_bytes = slot_size(kernel->format, d), head_bytes = slot_bytes * (size_t)slots;
    for (int kind = 0; kind < 2; kind++) {
        char* cache = kind ? values : keys;
        const char* past = kind ? past_value : past_key;
        if (cache == past) continue;
        memset(cache, 0, head_bytes * (size_t)(batch * kv_heads));
        for (int64_t r = 0; r < batch; r++) {
            int64_t kept = past_of(&job, r) < past_slots ? past_of(&job, r) : past_slots;
            for (int64_t g = 0; g < kv_heads; g++)
                memcpy(cache + slot_bytes * (size_t)((r * kv_heads + g) * slots),
                       past + slot_bytes * (size_t)((r * kv_heads + g) * past_slots), slot_bytes * (size_t)kept);
        }
    }
    float rotated[MAX_HEAD_SIZE];
    for (int64_t r = 0; r < batch; r++)
        for (int64_t i = 0; i < seq; i++)
            for (int64_t g = 0; g < kv_heads; g++) {
                int64_t slot = past_of(&job, r) + i;
                int64_t at = ((r * kv_heads + g) * slots + slot) * d, from = (r * seq + i) * job.kv_stride + g * d;
                if (kernel->format == CACHE_FP32) {
                    rotate(&job, job.k + from, (float*)keys + at, slot);
                    memcpy((float*)values + at, job.v + from, sizeof(float) * (size_t)d);
                    continue;
                }
                rotate(&job, job.k + from, rotated, slot);
                if (kernel->format == CACHE_INT8) {
                    size_t offset = slot_bytes * (size_t)((r * kv_heads + g) * slots + slot);
                    store_int8(rotated, d, (int8_t*)keys + offset);
                    store_int8(job.v + from, d, (int8_t*)values + offset);
                    continue;
                }
                for (int64_t c = 0; c < d; c += LANES) {
                    _mm256_storeu_si256((__m256i*)((uint16_t*)keys + at + c), to_half(_mm512_loadu_ps(rotated + c)));
                    _mm256_storeu_si256((__m256i*)((uint16_t*)values + at + c), to_half(_mm512_loadu_ps(job.v + from + c)));
                }
            }

    if (job.shards > 1 && batch * heads * seq * longest >= PARALLEL_SCORES)
        kiln_parallel(context, run_shard, (size_t)job.shards, &job);
    else
        for (int64_t item = 0; item < job.items; item++) attend(&job, item, job.scratch);
    free(job.scratch);
    return NULL;
}

static const char* op_name(const OrtCustomOp* op) {
    return cache_format(op) == CACHE_FP16 ? HALF_NAME : cache_format(op) == CACHE_INT8 ? INT8_NAME : NAME;
}
static int cache_type(const OrtCustomOp* op) {
    return cache_format(op) == CACHE_FP16 ? TYPE_FLOAT16 : cache_format(op) == CACHE_INT8 ? TYPE_INT8 : TYPE_FLOAT;
}
static int input_type(const OrtCustomOp* op, size_t i) {
    if (i == PAST_KEY || i == PAST_VALUE) return cache_type(op);
    return i == SEQLENS_K || i == TOTAL_LENGTH ? TYPE_INT32 : i == POSITION_IDS ? TYPE_INT64 : TYPE_FLOAT;
}
static int output_type(const OrtCustomOp* op, size_t i) { return i > 0 ? cache_type(op) : TYPE_FLOAT; }
static size_t input_count(const OrtCustomOp* op) { (void)op; return INPUT_COUNT; }
static size_t output_count(const OrtCustomOp* op) { (void)op; return 3; }
static int input_characteristic(const OrtCustomOp* op, size_t i) {
    (void)op;
    return i == QUERY || i == PAST_KEY || i == PAST_VALUE || i == SEQLENS_K || i == TOTAL_LENGTH ? REQUIRED : OPTIONAL;
}

/* Three tables, one op: the table a kernel is made from says which cache it reads (create_kernel), and
   the names and types differ by it. */
#define ATTENTION_TABLE KILN_OP_COMMON, .GetName = op_name, .GetInputType = input_type, .GetOutputType = output_type, \
    .GetInputTypeCount = input_count, .GetOutputTypeCount = output_count,                                          \
    .GetInputCharacteristic = input_characteristic, .CreateKernelV2 = create_kernel, .KernelComputeV2 = compute
OrtCustomOp kiln_attention_op = {ATTENTION_TABLE};
/* The same op over an fp16 KV cache: past and present fp16, the rest as above. */
OrtCustomOp kiln_attention_fp16_cache_op = {ATTENTION_TABLE};
/* The same over an 8-bit cache: past and present int8 [.., head size * 5 / 4], codes and their scales. */
OrtCustomOp kiln_attention_int8_cache_op = {ATTENTION_TABLE};

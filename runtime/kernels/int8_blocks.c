/* Kiln's CPU kernels for weight blocks times int8 activation blocks, as ONNX Runtime custom ops.

   ai.kiln::MatMulInt8Blocks(A, W) with attributes K and N computes what com.microsoft::MatMulNBits
   computes with bits 8, block_size 32 and accuracy_level 4 over the same weights: each row's
   activations are quantized per block of 32 to int8 with a scale of max|x| / 127, each block's integer
   dot product (less the zero point's term, in int32) is scaled by the product of the two scales, and
   the blocks are summed in fp32 in order. A is fp32 [..., K]; W is the weights in this kernel's layout
   (runtime/cpu_kernels.py, pack_int8_blocks, run by the compiler): 16 output columns side by side, so
   one AVX-512 VNNI instruction multiplies four activations into sixteen columns and no sum ever runs
   across a vector. Per tile of 16 columns and block of 32 rows: 512 bytes of codes (for each group of
   4 rows, 16 columns of 4 bytes), the 16 scales (fp32) and the 16 zero points (uint8), 592 bytes, as
   many as MatMulNBits stores; tiles one after another, each tile's blocks in order.

   ai.kiln::MatMulInt4Blocks(A, W) takes 4-bit weights w = d * (q - z) + m: per block of 32, a scale
   d, an integer zero point z and an offset m (pack_int4_blocks; m holds what an integer z cannot of a
   GGUF Q4_1 block's minimum). A block adds what MatMulInt8Blocks adds for d * (q - z), then m times
   the sum of its activations in fp32, not quantized. Per tile and block: 256 bytes of codes (the
   8-bit layout's groups j and j + 4 in the low and high nibbles of one vector), the 16 scales and 16
   offsets (fp16: a decode step reads a sixth fewer bytes than with fp32, and a GGUF block's own scale
   is fp16) and the 16 zero points, 336 bytes.

   ai.kiln::MatMulInt4BlocksBf16(A, W) takes MatMulInt4Blocks' weights with their codes in another order
   (bf16_layout) and its activations rounded to bf16 instead of in int8 blocks, on AVX-512 BF16's
   instructions or, on a CPU without them, fused multiply-adds that give the same bits (below, "4-bit
   weights times bf16 activations"). An op of its own, not an attribute: a library that does not
   know it refuses the graph instead of reading the codes in the other order.

   With the attribute gated = 1 either op writes silu(gate) * up, N / 2 columns, where W's tiles of 16
   columns alternate gate and up (a SwiGLU MLP's packed gate and up projections): what a Split, a
   SiLU (Sigmoid and Mul, QuickGelu to ONNX Runtime) and a Mul after the op would write, bit for bit,
   without three more nodes a layer.

   Each row is computed by the same instructions in the same order whatever the batch, the thread
   count or the CPU (MatMulInt4BlocksBf16 by one of two sequences with the same roundings), so a
   sequence's logits do not depend on what else is in the batch or on the host.

   The ops' tables are at the end; library.c registers them (the ai.kiln domain). */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "silu.h"

#define BLOCK 32
#define BF16_FMA 2  /* Weights.bf16 on a CPU without AVX-512 BF16 (or KILN_CPU_KERNELS_BF16=fma) */
#define TILE 16                                    /* output columns per vector */
#define TILE_BLOCK_BYTES_8 (BLOCK * TILE + TILE * 4 + TILE)      /* codes, scales, zero points: 592 */
#define TILE_BLOCK_BYTES_4 (BLOCK * TILE / 2 + TILE * 2 + TILE * 2 + TILE)  /* codes, scales, offsets, zero points: 336 */
#define LONE_ROWS 8                                /* fewer rows: 4 tiles (64 columns) a work item, else 2 */
#define ROWS_PER_CHUNK 64                          /* rows whose activations stay in L1/L2 together */
#define PAIR_ROWS 16                               /* rows from which tiles go two at a time (tiles_rows) */
#define AHEAD_TILES 2                              /* how far ahead a tile's first rows fetch weights (fetch_ahead) */

/* -- the kernel ------------------------------------------------------------------------------------ */

typedef struct {
    int64_t k, n, blocks, tiles;
    int64_t n_out;         /* n, or n / 2 where gated */
    int bits;              /* 8: MatMulInt8Blocks' layout; 4: MatMulInt4Blocks' */
    int gated;             /* tiles in pairs (gate, up): the output is silu(gate) * up */
    int bf16;              /* 4 bits: activations in bf16, codes in pairs of rows (bf16_layout), multiplied by
                              AVX-512 BF16's instructions or, BF16_FMA, by fused multiply-adds */
    size_t block_bytes;    /* TILE_BLOCK_BYTES_8 or _4 */
    const uint8_t* packed; /* [tiles][blocks][block_bytes] */
} Weights;

/* One row's activations: int8 codes, and per block the scale, the codes' sum (for the zero points'
   term: sum((q - z) * a) = sum(q * a) - z * sum(a), exact in int32) and, at 4 bits, the activations' own
   fp32 sum (for the blocks' offsets, which multiply it unquantized). */
static void quantize_row(int64_t k, const float* x, int8_t* codes, float* scale, int32_t* code_sum, float* x_sum, int bits) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * BLOCK), v1 = _mm512_loadu_ps(x + b * BLOCK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        if (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) amax = NAN;
        /* a NaN or infinite block: codes 0 and a scale that carries it into the output, as fp32 would;
           a block below the smallest normal float: all codes 0 */
        __m512 inverse = _mm512_set1_ps(amax >= FLT_MIN && amax <= FLT_MAX ? 127.0f / amax : 0.0f);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
        _mm_storeu_si128((__m128i*)(codes + b * BLOCK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(codes + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
        scale[b] = amax >= FLT_MIN || amax != amax ? amax / 127.0f : 0.0f;
        code_sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        if (bits == 4) x_sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
}

static inline int32_t four_codes(const int8_t* codes) {
    int32_t word;
    memcpy(&word, codes, 4);
    return word;
}

/* One tile's weights for one block of 32 rows, in registers: codes (4-bit ones unpacked to bytes),
   zero points and scales, and at 4 bits the offsets. */
typedef struct {
    __m512i weights[BLOCK / 4];
    __m512i zero;
    __m512 scale, offset;
} TileBlock;

/* A tile block's zero points, scales and, at 4 bits, offsets, after its codes. */
static inline __attribute__((always_inline)) void load_terms(TileBlock* block, const uint8_t* tile_block, int bits) {
    if (bits == 8) {
        block->zero = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(tile_block + BLOCK * TILE + TILE * 4)));
        block->scale = _mm512_loadu_ps((const float*)(tile_block + BLOCK * TILE));
        return;
    }
    block->scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tile_block + BLOCK * TILE / 2)));
    block->offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tile_block + BLOCK * TILE / 2 + TILE * 2)));
    block->zero = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(tile_block + BLOCK * TILE / 2 + TILE * 4)));
}

/* Half `half` of a tile block's codes in registers: groups 4 * half .. 4 * half + 3 of 4 rows. 4-bit
   blocks pack group j's codes in the low nibbles and group j + 4's in the high ones. */
static inline __attribute__((always_inline)) void load_half(__m512i* weights, const uint8_t* tile_block, int half, int bits) {
    if (bits == 8) {
        for (int j = 0; j < 4; j++) weights[j] = _mm512_loadu_si512(tile_block + (4 * half + j) * 64);
        return;
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        __m512i both = _mm512_loadu_si512(tile_block + j * 64);
        weights[j] = _mm512_and_si512(half ? _mm512_srli_epi16(both, 4) : both, nibble);
    }
}

static inline __attribute__((always_inline)) void load_block(TileBlock* block, const uint8_t* tile_block, int bits) {
    load_half(block->weights, tile_block, 0, bits);
    load_half(block->weights + BLOCK / 8, tile_block, 1, bits);
    load_terms(block, tile_block, bits);
}

/* Block b of tile t + AHEAD_TILES into L2 while the first rows of tile t compute (`ahead` = 0 for the
   rest): a decode step reads each weight from memory once, and the hardware's prefetcher does not run
   far enough ahead of a tile's blocks for the products not to wait. SmolLM2's int8 decode step ran
   10% (32 rows) to 17% (8 rows) faster, its int4 step 13% to 15%; a batch of 1 ran as fast as before
   (it reads at the memory's rate either way), and 1 or 4 tiles ahead as fast as 2. */
static inline __attribute__((always_inline)) void fetch_ahead(const Weights* w, int64_t t, int64_t b, int ahead) {
    if (!ahead || t + AHEAD_TILES >= w->tiles) return;
    const char* block = (const char*)w->packed + ((t + AHEAD_TILES) * w->blocks + b) * (int64_t)w->block_bytes;
    for (size_t line = 0; line < w->block_bytes; line += 64) _mm_prefetch(block + line, _MM_HINT_T1);
}

/* A block's products (the sum of its codes' products, in int32) into a tile's accumulator: the zero
   points' term in int32, then one fp32 multiply-add by the product of the two scales; at 4 bits then the
   offsets times the block's fp32 sum of activations. */
static inline __attribute__((always_inline)) __m512 block_sum(__m512 acc, __m512i products, const TileBlock* block,
                                                              float scale, int32_t code_sum, float x_sum, int bits) {
    __m512i dot = _mm512_sub_epi32(products, _mm512_mullo_epi32(block->zero, _mm512_set1_epi32(code_sum)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(block->scale, _mm512_set1_ps(scale)), acc);
    return bits == 8 ? acc : _mm512_fmadd_ps(block->offset, _mm512_set1_ps(x_sum), acc);
}

/* One block of one row into one tile's accumulator, the block's weights loaded: 8 VNNI products in
   two chains, then block_sum (through which every path below adds a row's blocks, in block order). */
static inline __attribute__((always_inline)) __m512 row_block(__m512 acc, const TileBlock* block, const int8_t* codes,
                                                              float scale, int32_t code_sum, float x_sum, int bits) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int j = 0; j < BLOCK / 4; j += 2) {
        even = _mm512_dpbusd_epi32(even, block->weights[j], _mm512_set1_epi32(four_codes(codes + 4 * j)));
        odd = _mm512_dpbusd_epi32(odd, block->weights[j + 1], _mm512_set1_epi32(four_codes(codes + 4 * j + 4)));
    }
    return block_sum(acc, _mm512_add_epi32(even, odd), block, scale, code_sum, x_sum, bits);
}

static inline void store_tile(float* y, int64_t n, int64_t tile, __m512 acc) {
    int64_t left = n - tile * TILE;
    if (left >= TILE) _mm512_storeu_ps(y + tile * TILE, acc);
    else _mm512_mask_storeu_ps(y + tile * TILE, (__mmask16)((1u << left) - 1), acc);
}

typedef struct {
    const Weights* w;
    int64_t rows, tiles_per_item, items_per_chunk, chunks, shards;
    const int8_t* codes;       /* [rows][k] */
    const float* scale;        /* [rows][blocks] */
    const int32_t* code_sum;   /* [rows][blocks] */
    const float* x_sum;        /* [rows][blocks] */
    const uint16_t* bf16;      /* [rows][k]: with bf16 activations, in place of the codes */
    float* y;                  /* [rows][n_out] */
} Job;

/* Rows [m, m + rows) of one tile, rows <= 8, into acc: the rows held in registers, each block's weights,
   zero points and scales loaded once for all of them. Inlined, a literal 8 unrolls the rows. */
static inline __attribute__((always_inline)) void tile_sums(const Job* job, int64_t t, int64_t m, int rows, int bits,
                                                            int ahead, __m512* acc) {
    const Weights* w = job->w;
    const uint8_t* base = w->packed + t * (size_t)w->blocks * w->block_bytes;
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        fetch_ahead(w, t, b, ahead);
        TileBlock block;
        load_block(&block, base + b * w->block_bytes, bits);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            int64_t row = m + r;
            acc[r] = row_block(acc[r], &block, job->codes + row * w->k + b * BLOCK, job->scale[row * w->blocks + b],
                               job->code_sum[row * w->blocks + b], job->x_sum[row * w->blocks + b], bits);
        }
    }
}

/* Rows [m, m + rows) of tile t into y, or where gated of the pair (t, t + 1) = (gate, up), as
   silu(gate) * up into output tile t / 2. */
static inline __attribute__((always_inline)) void rows_of_tile(const Job* job, int64_t t, int64_t m, int rows, int bits,
                                                               int ahead) {
    const Weights* w = job->w;
    __m512 acc[8];
    tile_sums(job, t, m, rows, bits, ahead, acc);
    if (!w->gated) {
        for (int r = 0; r < rows; r++) store_tile(job->y + (m + r) * w->n_out, w->n_out, t, acc[r]);
        return;
    }
    __m512 up[8];
    tile_sums(job, t + 1, m, rows, bits, ahead, up);
    for (int r = 0; r < rows; r++)
        store_tile(job->y + (m + r) * w->n_out, w->n_out, t / 2, _mm512_mul_ps(silu(acc[r]), up[r]));
}

/* Rows [m, m + rows) (rows <= 4) of the tiles t and t + 1 into acc0 and acc1: each broadcast of four
   activation codes feeds a product for both tiles, 5% faster than a tile at a time at 16 and 32 rows
   (not for the broadcasts: this AMD CPU issues one 512-bit VNNI product a cycle, 3.6 G a second a
   core, with a broadcast for every product or none). Each row's arithmetic is row_block's: a block's
   integer dot product (exact in int32, whatever the order of its terms), then the same fp32 steps in
   block order, so the two paths give the same numbers bit for bit. */
static inline __attribute__((always_inline)) void pair_sums(const Job* job, int64_t t, int64_t m, int rows, int bits,
                                                            int ahead, __m512* acc0, __m512* acc1) {
    const Weights* w = job->w;
    const uint8_t* base0 = w->packed + t * (size_t)w->blocks * w->block_bytes;
    const uint8_t* base1 = base0 + (size_t)w->blocks * w->block_bytes;
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        const uint8_t* block0 = base0 + b * w->block_bytes;
        const uint8_t* block1 = base1 + b * w->block_bytes;
        fetch_ahead(w, t, b, ahead);
        fetch_ahead(w, t + 1, b, ahead);
        __m512i dot0[4], dot1[4];
        for (int r = 0; r < rows; r++) dot0[r] = dot1[r] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            __m512i w0[4], w1[4];
            load_half(w0, block0, half, bits);
            load_half(w1, block1, half, bits);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
                for (int r = 0; r < rows; r++) {
                    __m512i codes = _mm512_set1_epi32(four_codes(job->codes + (m + r) * w->k + b * BLOCK + 4 * (4 * half + j)));
                    dot0[r] = _mm512_dpbusd_epi32(dot0[r], w0[j], codes);
                    dot1[r] = _mm512_dpbusd_epi32(dot1[r], w1[j], codes);
                }
        }
        TileBlock tb0, tb1;  /* the blocks' zero points, scales and offsets */
        load_terms(&tb0, block0, bits);
        load_terms(&tb1, block1, bits);
        for (int r = 0; r < rows; r++) {
            int64_t row = m + r;
            float scale = job->scale[row * w->blocks + b], x_sum = job->x_sum[row * w->blocks + b];
            int32_t code_sum = job->code_sum[row * w->blocks + b];
            acc0[r] = block_sum(acc0[r], dot0[r], &tb0, scale, code_sum, x_sum, bits);
            acc1[r] = block_sum(acc1[r], dot1[r], &tb1, scale, code_sum, x_sum, bits);
        }
    }
}

/* Rows [m, m + rows) of the tiles t and t + 1 into y, or where gated (gate, up) as silu(gate) * up into
   output tile t / 2. */
static inline __attribute__((always_inline)) void rows_of_pair(const Job* job, int64_t t, int64_t m, int rows, int bits,
                                                               int ahead) {
    const Weights* w = job->w;
    __m512 acc0[4], acc1[4];
    pair_sums(job, t, m, rows, bits, ahead, acc0, acc1);
    for (int r = 0; r < rows; r++) {
        float* y = job->y + (m + r) * w->n_out;
        if (w->gated) {
            store_tile(y, w->n_out, t / 2, _mm512_mul_ps(silu(acc0[r]), acc1[r]));
        } else {
            store_tile(y, w->n_out, t, acc0[r]);
            store_tile(y, w->n_out, t + 1, acc1[r]);
        }
    }
}

/* Tiles [t0, t1) for rows [r0, r1): from 16 rows up two tiles at a time, four rows at a time (pair_sums),
   else a tile at a time, eight rows at a time; the arithmetic per row is row_block's, in block order,
   whatever the number of rows or the path. On SmolLM2's int8 decode step two tiles at a time ran 5%
   faster at 16 and 32 rows, and 3% slower at 8 (it reads each block's weights twice as often). A lone
   row once ran four tiles side by side, four chains of loads and products: their 40-odd vectors spilled
   out of the 32 registers, and SmolLM2's batch-1 decode step ran 1.16x (8 bits) and 1.39x (4 bits)
   faster a tile at a time. */
static inline __attribute__((always_inline)) void tiles_rows(const Job* job, int64_t t0, int64_t t1, int64_t r0,
                                                             int64_t r1, int bits) {
    int64_t t = t0;
    if (r1 - r0 >= PAIR_ROWS)
        for (; t + 1 < t1; t += 2) {
            int64_t m = r0;
            for (; m + 4 <= r1; m += 4) rows_of_pair(job, t, m, 4, bits, m == r0);
            if (m < r1) rows_of_pair(job, t, m, (int)(r1 - m), bits, m == r0);
        }
    for (; t < t1; t += 1 + job->w->gated) {
        int64_t m = r0;
        for (; m + 8 <= r1; m += 8) rows_of_tile(job, t, m, 8, bits, m == r0);
        if (m < r1) rows_of_tile(job, t, m, (int)(r1 - m), bits, m == r0);
    }
}

/* Work item i of `items` = (row chunk, group of tiles_per_item tiles), chunk-major so that a thread's
   consecutive items reuse one chunk's activations. A shard is a contiguous run of items.

   Why the width depends on the rows: from 8 rows up the products bound the op, and a 576-column
   projection's 9 items of 4 tiles split 5 to 4 over two threads; items of 2 tiles ran SmolLM2's int8 and
   int4 decode steps 3% to 4% faster at 8 and 32 rows (int4 at 32: 4% and 8% in two runs). Under 8 rows the memory's rate
   bounds it, a thread that finishes first leaves the other the whole rate, and items of 2 tiles ran a
   lone row 1% (int8) and 6% (int4) slower: each shard starts where fetch_ahead has not run. */
typedef struct { int64_t t0, t1, r0, r1; } Item;  /* tiles [t0, t1) for rows [r0, r1) */

static inline Item item_of(const Job* job, int64_t i) {
    int64_t chunk = i / job->items_per_chunk, group = i % job->items_per_chunk;
    Item item = {group * job->tiles_per_item, (group + 1) * job->tiles_per_item, chunk * ROWS_PER_CHUNK,
                 (chunk + 1) * ROWS_PER_CHUNK};
    if (item.t1 > job->w->tiles) item.t1 = job->w->tiles;
    if (item.r1 > job->rows) item.r1 = job->rows;
    return item;
}

static inline int64_t shard_start(const Job* job, size_t shard) {
    return job->chunks * job->items_per_chunk * (int64_t)shard / job->shards;
}

static inline __attribute__((always_inline)) void run_shard(const Job* job, size_t shard, int bits) {
    for (int64_t i = shard_start(job, shard); i < shard_start(job, shard + 1); i++) {
        Item item = item_of(job, i);
        tiles_rows(job, item.t0, item.t1, item.r0, item.r1, bits);
    }
}


/* -- 4-bit weights times bf16 activations ------------------------------------------------------------

   MatMulInt4BlocksBf16 rounds the activations to bf16 (to nearest even)
   instead of quantizing them per block to int8, and multiplies them by the weights with AVX-512 BF16's
   VDPBF16PS (or its two FMAs, fma_tile_sums): two products a lane, summed in fp32. A 4-bit code q is exact in bf16 as 128 + q (the bits
   0x4300 | q), so a block adds d * sum(a (128 + q)) + (m - d (z + 128)) * sum(a), the second sum over
   the bf16 activations in fp32: what d (q - z) + m gives, with no rounding of the activations past
   bf16's. SmolLM2's int4 (Q4_1 weights kept exactly): 17 of 3,177 held-out next-token predictions off
   fp32's, against 99 with int8 activation blocks.

   The codes of a tile block for this path (runtime/cpu_kernels.py, bf16_layout): 8 vectors of 32
   bytes, vector p holding for each of the 16 columns the codes of rows 2p and 2p + 1 in its low
   nibbles and of rows 16 + 2p and 17 + 2p in its high ones, so a vector widened to 16-bit words is one
   VDPBF16PS operand; then the scales, offsets and zero points as at 4 bits. A row's half block is two
   chains of products (even and odd pairs of rows), a block the first half's (even + odd) plus the
   second's, then its two multiply-adds: the same instructions for a row whatever the batch. Four rows
   share each conversion of a tile's codes. Eight rows sharing it, a block one chain a row, or a lone
   row taking four tiles side by side ran SmolLM2's decode step 5% faster at 32 rows and 8% and 19%
   slower at 8 and 1. */

/* Half `half` of a tile block's codes as bf16 pairs 128 + q: w[p] holds rows 16 half + 2p and + 1. */
static inline __attribute__((always_inline)) void bf16_codes(__m512i* w, const uint8_t* tile_block, int half) {
    const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
    for (int p = 0; p < 8; p++) {
        __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(tile_block + 32 * p)));
        w[p] = half ? _mm512_or_si512(_mm512_srli_epi16(raw, 4), bias) : _mm512_ternarylogic_epi32(raw, low, bias, 0xEA);
    }
}

static inline __attribute__((always_inline, target("avx512bf16"))) __m512 pair_product(__m512 chain, __m512i w,
                                                                                      const uint16_t* a) {
    int32_t two;
    memcpy(&two, a, 4);
    return _mm512_dpbf16_ps(chain, (__m512bh)w, (__m512bh)_mm512_set1_epi32(two));
}

/* A block's products into a row's accumulator: d * products + (m - d (z + 128)) * the block's sum. */
static inline __attribute__((always_inline)) __m512 bf16_block_end(__m512 acc, __m512 products, const uint8_t* tile_block,
                                                                   float x_sum) {
    TileBlock terms;
    load_terms(&terms, tile_block, 4);
    __m512 offset = _mm512_fnmadd_ps(terms.scale, _mm512_add_ps(_mm512_cvtepi32_ps(terms.zero), _mm512_set1_ps(128.0f)),
                                     terms.offset);
    return _mm512_add_ps(acc, _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sum), _mm512_mul_ps(products, terms.scale)));
}

/* Rows [m, m + rows) (rows <= 4) of tile t into acc, each half block's codes converted once for them. */
static inline __attribute__((always_inline, target("avx512bf16"))) void bf16_tile_sums(const Job* job, int64_t t, int64_t m,
                                                                                       int rows, int ahead, __m512* acc) {
    const Weights* w = job->w;
    const uint8_t* base = w->packed + t * (size_t)w->blocks * w->block_bytes;
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        const uint8_t* tile_block = base + b * w->block_bytes;
        fetch_ahead(w, t, b, ahead);
        __m512 products[4];
        for (int half = 0; half < 2; half++) {
            __m512i codes[8];
            bf16_codes(codes, tile_block, half);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const uint16_t* a = job->bf16 + (m + r) * w->k + b * BLOCK + 16 * half;
                __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int p = 0; p < 8; p += 2) {
                    even = pair_product(even, codes[p], a + 2 * p);
                    odd = pair_product(odd, codes[p + 1], a + 2 * p + 2);
                }
                __m512 sum = _mm512_add_ps(even, odd);
                products[r] = half ? _mm512_add_ps(products[r], sum) : sum;
            }
        }
        for (int r = 0; r < rows; r++)
            acc[r] = bf16_block_end(acc[r], products[r], tile_block, job->x_sum[(m + r) * w->blocks + b]);
    }
}

/* VDPBF16PS without AVX-512 BF16: each of its pair products as two fused multiply-adds, the pair's high
   word first, as the instruction adds them (a product of two bf16 values is exact in fp32, so each add
   rounds once either way); its codes split into the pair's two fp32 values, its activations held in
   fp32 (bf16_row). With denormals flushed as the instruction flushes them (run_shard_bf16_with), the
   sums are the same bit for bit (Intel's definition of the instruction; checked on an AMD EPYC, on 32
   million random lanes, SmolLM2's logits and tests/runtime/test_cpu_kernels.py), but for a NaN's sign
   and payload where two NaNs meet in one sum: a NaN either way. */
static inline __attribute__((always_inline)) __m512 fma_pair_product(__m512 chain, __m512 low, __m512 high, const float* a) {
    return _mm512_fmadd_ps(low, _mm512_set1_ps(a[0]), _mm512_fmadd_ps(high, _mm512_set1_ps(a[1]), chain));
}

/* bf16_tile_sums' arithmetic with fma_pair_product for VDPBF16PS: the same sums in the same order. */
static inline __attribute__((always_inline)) void fma_tile_sums(const Job* job, int64_t t, int64_t m, int rows, int ahead,
                                                                __m512* acc) {
    const Weights* w = job->w;
    const uint8_t* base = w->packed + t * (size_t)w->blocks * w->block_bytes;
    const __m512i high_word = _mm512_set1_epi32((int32_t)0xFFFF0000u);
    const float* activations = (const float*)job->bf16;
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        const uint8_t* tile_block = base + b * w->block_bytes;
        fetch_ahead(w, t, b, ahead);
        __m512 products[4];
        for (int half = 0; half < 2; half++) {
            __m512i codes[8];
            __m512 low[8], high[8];
            bf16_codes(codes, tile_block, half);
            for (int p = 0; p < 8; p++) {
                low[p] = _mm512_castsi512_ps(_mm512_slli_epi32(codes[p], 16));
                high[p] = _mm512_castsi512_ps(_mm512_and_si512(codes[p], high_word));
            }
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const float* a = activations + (m + r) * w->k + b * BLOCK + 16 * half;
                __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int p = 0; p < 8; p += 2) {
                    even = fma_pair_product(even, low[p], high[p], a + 2 * p);
                    odd = fma_pair_product(odd, low[p + 1], high[p + 1], a + 2 * p + 2);
                }
                __m512 sum = _mm512_add_ps(even, odd);
                products[r] = half ? _mm512_add_ps(products[r], sum) : sum;
            }
        }
        for (int r = 0; r < rows; r++)
            acc[r] = bf16_block_end(acc[r], products[r], tile_block, job->x_sum[(m + r) * w->blocks + b]);
    }
}

/* Rows [m, m + rows) (rows 4 or 1) of tile t into acc, by one path's tile sums. */
typedef void (*Bf16Sums)(const Job* job, int64_t t, int64_t m, int rows, int ahead, __m512* acc);

static inline __attribute__((target("avx512bf16"))) void bf16_sums(const Job* job, int64_t t, int64_t m, int rows,
                                                                      int ahead, __m512* acc) {
    if (rows == 4) bf16_tile_sums(job, t, m, 4, ahead, acc);
    else bf16_tile_sums(job, t, m, 1, ahead, acc);
}

static inline void fma_sums(const Job* job, int64_t t, int64_t m, int rows, int ahead, __m512* acc) {
    if (rows == 4) fma_tile_sums(job, t, m, 4, ahead, acc);
    else fma_tile_sums(job, t, m, 1, ahead, acc);
}

/* Rows [m, m + rows) of tile t into y, or where gated of the pair (t, t + 1), as rows_of_tile does. */
static inline __attribute__((always_inline)) void bf16_rows_of_tile(const Job* job, int64_t t, int64_t m, int rows,
                                                                     int ahead, Bf16Sums sums) {
    const Weights* w = job->w;
    __m512 acc[4], up[4];
    sums(job, t, m, rows, ahead, acc);
    if (!w->gated) {
        for (int r = 0; r < rows; r++) store_tile(job->y + (m + r) * w->n_out, w->n_out, t, acc[r]);
        return;
    }
    sums(job, t + 1, m, rows, ahead, up);
    for (int r = 0; r < rows; r++)
        store_tile(job->y + (m + r) * w->n_out, w->n_out, t / 2, _mm512_mul_ps(silu(acc[r]), up[r]));
}

/* The shard's items with denormals flushed to zero, in and out (MXCSR's FTZ and DAZ), as VDPBF16PS
   flushes them: the FMA path then gives its sums bit for bit wherever they come near fp32's smallest
   normal, and both paths flush the silu and block ends alike. Rounding to nearest even and exceptions
   masked, as the instruction has them whatever the thread's MXCSR says; the thread's own comes back after. */
static inline __attribute__((always_inline)) void run_shard_bf16_with(const Job* job, size_t shard, Bf16Sums sums) {
    const unsigned int flush = 0x8040, masked = 0x1F80, rounding = 0x6000;
    unsigned int mxcsr = _mm_getcsr();
    _mm_setcsr((mxcsr & ~rounding) | flush | masked);
    for (int64_t i = shard_start(job, shard); i < shard_start(job, shard + 1); i++) {
        Item item = item_of(job, i);
        for (int64_t t = item.t0; t < item.t1; t += 1 + job->w->gated) {
            int64_t m = item.r0;
            for (; m + 4 <= item.r1; m += 4) bf16_rows_of_tile(job, t, m, 4, m == item.r0, sums);
            for (; m < item.r1; m++) bf16_rows_of_tile(job, t, m, 1, m == item.r0, sums);
        }
    }
    _mm_setcsr(mxcsr);
}

static __attribute__((target("avx512bf16"))) void run_shard_bf16(void* data, size_t shard) {
    run_shard_bf16_with(data, shard, bf16_sums);
}
static void run_shard_fma(void* data, size_t shard) { run_shard_bf16_with(data, shard, fma_sums); }

/* A row's activations in bf16 and, per block, their sum in fp32: rounded as VCVTNEPS2BF16 rounds them (to
   nearest even; a NaN stays a NaN, quieted; a denormal becomes a zero of its sign), in integer
   instructions so that both paths round alike on any CPU (checked against the instruction on 50 million
   random values and its edge cases). Written as bf16 words for the instructions' path, or as_fp32, each
   the fp32 it stands for, for the FMA path. */
static void bf16_row(int64_t k, const float* x, void* out, float* x_sum, int as_fp32) {
    const __m512i exponent = _mm512_set1_epi32(0x7F800000), sign = _mm512_set1_epi32((int32_t)0x80000000u);
    const __m512i high_word = _mm512_set1_epi32((int32_t)0xFFFF0000u), quiet = _mm512_set1_epi32(0x00400000);
    const __m512i half_less_one = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m512 sum = _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            int64_t at = b * BLOCK + 16 * h;
            __m512 v = _mm512_loadu_ps(x + at);
            __m512i bits = _mm512_castps_si512(v);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
            __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(half_less_one, odd)), high_word);
            __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            __mmask16 denormal = _mm512_testn_epi32_mask(bits, exponent);
            rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_and_si512(bits, high_word), quiet);
            rounded = _mm512_mask_and_epi32(rounded, denormal, bits, sign);
            if (as_fp32) _mm512_storeu_si512((float*)out + at, rounded);
            else _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(rounded));
        }
        x_sum[b] = _mm512_reduce_add_ps(sum);
    }
}

/* One copy of the loops per weight width, each with its own arithmetic inlined. */
static void run_shard_8(void* data, size_t shard) { run_shard(data, shard, 8); }
static void run_shard_4(void* data, size_t shard) { run_shard(data, shard, 4); }

typedef struct {
    const Job* job;
    const float* x;
    int8_t* codes;
    float* scale;
    int32_t* code_sum;
    float* x_sum;
    int64_t shards;
} QuantizeJob;

static void quantize_shard(void* data, size_t shard) {
    const QuantizeJob* q = data;
    const Weights* w = q->job->w;
    int64_t first = q->job->rows * (int64_t)shard / q->shards, last = q->job->rows * ((int64_t)shard + 1) / q->shards;
    for (int64_t r = first; r < last; r++) {
        if (w->bf16) bf16_row(w->k, q->x + r * w->k, q->codes + r * w->k * (w->bf16 == BF16_FMA ? 4 : 2),
                              q->x_sum + r * w->blocks, w->bf16 == BF16_FMA);
        else quantize_row(w->k, q->x + r * w->k, q->codes + r * w->k, q->scale + r * w->blocks, q->code_sum + r * w->blocks,
                          q->x_sum + r * w->blocks, w->bits);
    }
}

typedef void (*ParallelFor)(void* context, void (*fn)(void*, size_t), size_t total, void* data);

/* y[rows, n] = x[rows, k] @ W; `parallel` runs fn over [0, total) on the session's threads (or inline). */
static int matmul(const Weights* w, const float* x, float* y, int64_t rows, ParallelFor parallel, void* context) {
    /* int8 codes, or bf16 activations (as fp32 for the FMA path) */
    int8_t* codes = malloc((size_t)rows * w->k * (w->bf16 == BF16_FMA ? 4 : w->bf16 ? 2 : 1));
    float* scales = malloc(sizeof(float) * (size_t)rows * w->blocks);
    int32_t* sums = malloc(sizeof(int32_t) * (size_t)rows * w->blocks);
    float* x_sums = malloc(sizeof(float) * (size_t)rows * w->blocks);
    if (!codes || !scales || !sums || !x_sums) { free(codes); free(scales); free(sums); free(x_sums); return 0; }
    int64_t tiles_per_item = rows < LONE_ROWS ? 4 : 2;  /* even: a gated pair never splits */
    Job job = {w, rows, tiles_per_item, (w->tiles + tiles_per_item - 1) / tiles_per_item,
               (rows + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK, 0, codes, scales, sums, x_sums, (const uint16_t*)codes, y};
    QuantizeJob quantize = {&job, x, codes, scales, sums, x_sums, rows < 16 ? rows : 16};
    /* on the threads from 16 rows up: at 32 rows quantizing on one thread left the other idle for up to
       a tenth of the op (a 576 x 576 projection: 65 us, 59 with both threads) */
    if (rows >= 16) parallel(context, quantize_shard, (size_t)quantize.shards, &quantize);
    else for (int64_t s = 0; s < quantize.shards; s++) quantize_shard(&quantize, (size_t)s);
    int64_t items = job.chunks * job.items_per_chunk;
    job.shards = items < 32 ? items : 32;  /* enough to balance any thread count up to 32 */
    parallel(context, w->bf16 == BF16_FMA ? run_shard_fma : w->bf16 ? run_shard_bf16 : w->bits == 8 ? run_shard_8
             : run_shard_4, (size_t)job.shards, &job);
    free(codes); free(scales); free(sums); free(x_sums);
    return 1;
}

/* -- the ops --------------------------------------------------------------------------------------- */

typedef struct {
    Weights weights;
    void* chunk;  /* where the weights were copied (kiln_weights_copy), or NULL */
} Kernel;

static const char* name_for(int bits, int bf16) {
    return bf16 ? "MatMulInt4BlocksBf16" : bits == 4 ? "MatMulInt4Blocks" : "MatMulInt8Blocks";
}

static int op_bits(const OrtCustomOp* op) { return op == &kiln_int8_blocks_op ? 8 : 4; }
static int op_bf16(const OrtCustomOp* op) { return op == &kiln_int4_bf16_op; }

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api_, const OrtKernelInfo* info, void** out) {
    (void)api_;
    int bits = op_bits(op), bf16 = op_bf16(op);
    const char* name = name_for(bits, bf16);
    OrtStatus* status;
    int64_t k = kiln_attribute_int(info, "K", 0), n = kiln_attribute_int(info, "N", 0);
    if (k <= 0 || n <= 0 || k % BLOCK || k > (1 << 24) || n > (1 << 24))
        return kiln_op_error(ORT_INVALID_ARGUMENT, name, "K must be a multiple of 32, K and N from 1 to 2^24");
    int64_t gated = kiln_attribute_int(info, "gated", 0);
    if (gated != 0 && (gated != 1 || n % (2 * TILE)))
        return kiln_op_error(ORT_INVALID_ARGUMENT, name,
                             "gated must be 0 or 1, and 1 needs N a multiple of 32 (tiles in pairs)");
    if (bf16 && !kiln_cpu_kernels_bf16()) bf16 = BF16_FMA;
    int is_constant = 0;
    const OrtValue* packed = NULL;
    if ((status = CALL(API_KernelInfoGetConstantInput_tensor,
                       OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**))(info, 1, &is_constant, &packed)))
        return status;
    if (!is_constant || !packed) return kiln_op_error(ORT_INVALID_ARGUMENT, name, "W must be an initializer");
    OrtShapeInfo* shape = NULL;
    size_t size = 0;
    if ((status = CALL(API_GetTensorTypeAndShape, OrtStatus* (*)(const OrtValue*, OrtShapeInfo**))(packed, &shape))) return status;
    status = CALL(API_GetTensorShapeElementCount, OrtStatus* (*)(const OrtShapeInfo*, size_t*))(shape, &size);
    CALL(API_ReleaseTensorTypeAndShapeInfo, void (*)(OrtShapeInfo*))(shape);
    if (status) return status;
    Kernel* kernel = calloc(1, sizeof(Kernel));
    if (!kernel) return kiln_op_error(ORT_FAIL, name, "out of memory");
    size_t block_bytes = bits == 8 ? TILE_BLOCK_BYTES_8 : TILE_BLOCK_BYTES_4;
    kernel->weights = (Weights){k, n, k / BLOCK, (n + TILE - 1) / TILE, gated ? n / 2 : n, bits, (int)gated, (int)bf16,
                                block_bytes, kiln_data_of(packed)};
    if (!kernel->weights.packed || size != (size_t)(kernel->weights.tiles * kernel->weights.blocks) * block_bytes) {
        free(kernel);
        return kiln_op_error(ORT_INVALID_ARGUMENT, name, bits == 8
            ? "W is not K x N weights in this kernel's layout (runtime/cpu_kernels.py, pack_int8_blocks)"
            : bf16 ? "W is not K x N weights in this kernel's layout (runtime/cpu_kernels.py, bf16_layout)"
            : "W is not K x N weights in this kernel's layout (runtime/cpu_kernels.py, pack_int4_blocks)");
    }
    const void* copy = kiln_weights_copy(kernel->weights.packed, size, &kernel->chunk);
    if (copy) kernel->weights.packed = copy;
    *out = kernel;
    return NULL;
}

static void destroy_kernel(void* data) {
    Kernel* kernel = data;
    kiln_weights_release(kernel->chunk);
    free(kernel);
}

static OrtStatus* compute(void* data, OrtKernelContext* context) {
    const Kernel* kernel = data;
    const char* name = name_for(kernel->weights.bits, kernel->weights.bf16);
    const OrtValue* input;
    OrtValue* output;
    OrtStatus* status;
    size_t rank = 0;
    int64_t dims[8];
    if ((status = kiln_input(context, 0, &input)) || (status = kiln_dims(input, dims, &rank, 8, name))) return status;
    if (rank < 1) return kiln_op_error(ORT_INVALID_ARGUMENT, name, "A must have rank 1 to 8");
    if (dims[rank - 1] != kernel->weights.k) return kiln_op_error(ORT_INVALID_ARGUMENT, name, "A's last dimension is not K");
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    dims[rank - 1] = kernel->weights.n_out;
    if ((status = kiln_output(context, 0, dims, rank, &output))) return status;
    if (rows == 0) return NULL;
    const float* x = kiln_data_of(input);
    float* y = kiln_data_of(output);
    if (!x || !y) return kiln_op_error(ORT_FAIL, name, "no tensor data");
    if (!matmul(&kernel->weights, x, y, rows, kiln_parallel, context))
        return kiln_op_error(ORT_FAIL, name, "out of memory");
    return NULL;
}

static const char* op_name(const OrtCustomOp* op) { return name_for(op_bits(op), op_bf16(op)); }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_UINT8; }

/* The three ops differ only in what op_bits and op_bf16 return for them. */
#define BLOCKS_OP {                                  \
    KILN_OP_COMMON,                                  \
    .GetName = op_name,                              \
    .GetInputType = input_type,                      \
    .GetInputTypeCount = kiln_count_2,               \
    .GetOutputTypeCount = kiln_count_1,              \
    .GetInputCharacteristic = kiln_required_input,   \
    .CreateKernelV2 = create_kernel,                 \
    .KernelComputeV2 = compute,                      \
    .KernelDestroy = destroy_kernel,                 \
}
OrtCustomOp kiln_int8_blocks_op = BLOCKS_OP;
OrtCustomOp kiln_int4_blocks_op = BLOCKS_OP;
OrtCustomOp kiln_int4_bf16_op = BLOCKS_OP;

/* ai.kiln::MatMulFp32(A, W) -> Y: ONNX MatMul of fp32 activations A [..., K] by fp32 weights W [K, N]
   (an initializer), Y [..., N]; with transB = 1, W is [N, K] and the op multiplies by its transpose (a
   tied LM head: the exported graph transposes the embeddings' initializer). The op packs W into memory
   of its own and gives ONNX Runtime's pages of W back, also where another node reads W: the tied
   embeddings' Gather then reads a row's page from the file again, once; keeping them all cost
   SmolLM2's fp32 variant 90 MiB more resident (644 against 554 MiB of weights).

   The sums: each block of K_BLOCK rows of W in one chain of fused multiply-adds from zero, k in order, then
   added to the blocks before it. That order is fixed by K alone, whatever the rows, the tiles or the
   threads, so a row's outputs are the same bits alone as in any batch: an fp32 variant's kernels' graph
   gives a request the same greedy tokens in a batch as alone. Each work item runs under IEEE's default
   floating-point modes (no flushing of denormals, rounding to nearest), whatever its thread's MXCSR, and
   gives the thread its own back. The numbers are not MLAS's bit for bit (its
   blocks are other ones); against exact sums they are as close (tests/runtime/test_cpu_kernels.py).

   Why an op of Kiln's: a decode step at batch 1 reads every weight once, and how fast memory gives them
   up decides the step. Each thread here streams 3 panels at once, on 2 MB pages of the library's own
   (library.c). SmolLM2's fp32 decode step against MLAS's MatMuls (fresh processes alternating): 1.19x,
   1.26x and 1.08x as fast at batch 1, 8 and 32 (batch 1: 1.13x to 1.50x in five such runs, as the VM's
   memory moved); a 45-token prefill 1.08x, 32 of them 1.05x, where both run near the CPU's FMA peak.

   The layout, made from W when the session creates the kernel: panels of 16 columns, each K rows of 16
   floats, one after another (the last panel's columns past N zero). A tile of up to 4 rows and 3 panels
   keeps its 12 sums and their 12 totals in registers (6 x 4 tiles, their totals in y, were level at
   decode and 5% slower in a 32-prompt prefill). */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#define NAME "MatMulFp32"
#define LANES 16
#define TILE_ROWS 4
#define TILE_PANELS 3
#define BLOCK_ROWS 96  /* rows a work item: their activations stay in the core's cache while its panels pass */
#define MAX_ITEMS 32
#define IEEE_MODES 0x1F80  /* MXCSR: every exception masked, rounding to nearest, no FTZ or DAZ */
#define K_BLOCK 128  /* rows of W a chain of FMAs sums before it is added to the rest: a 1,536-long chain had
                        twice MLAS's error against exact sums, which adds blocks' sums too. The blocks' totals
                        stay in registers: added through y in memory, they cost a 1,440-row prefill 5% */

typedef struct {
    int64_t k, n, panels;
    const float* packed;
    void* chunk;  /* where the packed weights live (kiln_weights_place); NULL: aligned_alloc's */
} Kernel;

typedef struct {
    const Kernel* kernel;
    const float* x;
    float* y;
    int64_t rows, row_items, panel_items;
} Job;

/* y[r, 16 p + c] for MR rows and J panels: each block of K_BLOCK rows of W summed in registers from zero,
   then added to the blocks before it, also in registers. */
static inline __attribute__((always_inline)) void tile(int mr, int j_count, int64_t k_count, const float* x,
                                                       int64_t x_stride, const float* w, float* y, int64_t y_stride,
                                                       const __mmask16* lanes) {
    __m512 totals[TILE_ROWS][TILE_PANELS] = {{_mm512_setzero_ps()}};  /* each set by the first block (K >= 1) */
    for (int64_t first = 0; first < k_count; first += K_BLOCK) {
        int64_t last = first + K_BLOCK < k_count ? first + K_BLOCK : k_count;
        __m512 sums[TILE_ROWS][TILE_PANELS];
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < j_count; j++) sums[m][j] = _mm512_setzero_ps();
        for (int64_t k = first; k < last; k++) {
            __m512 weights[TILE_PANELS];
            for (int j = 0; j < j_count; j++) weights[j] = _mm512_load_ps(w + (j * k_count + k) * LANES);
            for (int m = 0; m < mr; m++) {
                __m512 a = _mm512_set1_ps(x[m * x_stride + k]);
                for (int j = 0; j < j_count; j++) sums[m][j] = _mm512_fmadd_ps(a, weights[j], sums[m][j]);
            }
        }
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < j_count; j++) totals[m][j] = first ? _mm512_add_ps(totals[m][j], sums[m][j]) : sums[m][j];
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < j_count; j++) _mm512_mask_storeu_ps(y + m * y_stride + j * LANES, lanes[j], totals[m][j]);
}

typedef void (*Tile)(int64_t, const float*, int64_t, const float*, float*, int64_t, const __mmask16*);
#define TILE_FN(MR, J)                                                                                        \
    static void tile_##MR##_##J(int64_t k, const float* x, int64_t xs, const float* w, float* y, int64_t ys, \
                                const __mmask16* lanes) { tile(MR, J, k, x, xs, w, y, ys, lanes); }
#define TILE_ROW(MR) TILE_FN(MR, 1) TILE_FN(MR, 2) TILE_FN(MR, 3)
TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4)
#define TILES(MR) {tile_##MR##_1, tile_##MR##_2, tile_##MR##_3}
static const Tile tiles[TILE_ROWS][TILE_PANELS] = {TILES(1), TILES(2), TILES(3), TILES(4)};

/* One work item: a block of rows by a range of panels. */
static void run_panels(const Job* job, size_t item) {
    const Kernel* kernel = job->kernel;
    int64_t row_item = (int64_t)item / job->panel_items, panel_item = (int64_t)item % job->panel_items;
    int64_t first_row = job->rows * row_item / job->row_items, last_row = job->rows * (row_item + 1) / job->row_items;
    int64_t first = kernel->panels * panel_item / job->panel_items;
    int64_t last = kernel->panels * (panel_item + 1) / job->panel_items;
    for (int64_t p = first; p < last; p += TILE_PANELS) {
        int j_count = (int)(last - p < TILE_PANELS ? last - p : TILE_PANELS);
        __mmask16 lanes[TILE_PANELS];
        for (int j = 0; j < j_count; j++) {
            int64_t columns = kernel->n - (p + j) * LANES;
            lanes[j] = columns >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << columns) - 1);
        }
        const float* w = kernel->packed + p * kernel->k * LANES;
        for (int64_t r = first_row; r < last_row; r += TILE_ROWS) {
            int mr = (int)(last_row - r < TILE_ROWS ? last_row - r : TILE_ROWS);
            tiles[mr - 1][j_count - 1](kernel->k, job->x + r * kernel->k, kernel->k, w, job->y + r * kernel->n + p * LANES,
                                       kernel->n, lanes);
        }
    }
}

static void run_item(void* data, size_t item) {
    unsigned int modes = _mm_getcsr();
    _mm_setcsr(IEEE_MODES);
    run_panels(data, item);
    _mm_setcsr(modes);
}

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api_, const OrtKernelInfo* info, void** out) {
    (void)op; (void)api_;
    int is_constant = 0;
    const OrtValue* weights = NULL;
    OrtStatus* status = CALL(API_KernelInfoGetConstantInput_tensor,
                             OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**))(info, 1, &is_constant, &weights);
    if (status) return status;
    if (!is_constant || !weights) return kiln_op_error(ORT_INVALID_ARGUMENT, NAME, "W must be an initializer");
    int64_t dims[8];
    size_t rank = 0;
    if ((status = kiln_dims(weights, dims, &rank, 8, NAME))) return status;
    int64_t transposed = kiln_attribute_int(info, "transB", 0);
    if (transposed != 0 && transposed != 1) return kiln_op_error(ORT_INVALID_ARGUMENT, NAME, "transB must be 0 or 1");
    if (rank != 2 || dims[0] < 1 || dims[1] < 1 || dims[0] > (1 << 24) || dims[1] > (1 << 24))
        return kiln_op_error(ORT_INVALID_ARGUMENT, NAME, "W must be K x N (N x K with transB), K and N from 1 to 2^24");
    const float* source = kiln_data_of(weights);
    if (!source) return kiln_op_error(ORT_FAIL, NAME, "no tensor data");
    Kernel* kernel = calloc(1, sizeof(Kernel));
    if (!kernel) return kiln_op_error(ORT_FAIL, NAME, "out of memory");
    kernel->k = dims[transposed];
    kernel->n = dims[1 - transposed];
    kernel->panels = (kernel->n + LANES - 1) / LANES;
    size_t bytes = sizeof(float) * (size_t)(kernel->panels * kernel->k * LANES);
    float* packed = kiln_weights_place(bytes, &kernel->chunk);
    if (!packed) packed = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!packed) {
        free(kernel);
        return kiln_op_error(ORT_FAIL, NAME, "out of memory");
    }
    for (int64_t p = 0; p < kernel->panels; p++) {
        int64_t columns = kernel->n - p * LANES < LANES ? kernel->n - p * LANES : LANES;
        float* panel = packed + p * kernel->k * LANES;
        if (transposed) {  /* W's rows are columns here: each read whole, written down the panel */
            memset(panel, 0, sizeof(float) * (size_t)(kernel->k * LANES));
            for (int64_t c = 0; c < columns; c++) {
                const float* column = source + (p * LANES + c) * kernel->k;
                for (int64_t k = 0; k < kernel->k; k++) panel[k * LANES + c] = column[k];
            }
        } else {
            for (int64_t k = 0; k < kernel->k; k++) {
                memcpy(panel + k * LANES, source + k * kernel->n + p * LANES, sizeof(float) * (size_t)columns);
                memset(panel + k * LANES + columns, 0, sizeof(float) * (size_t)(LANES - columns));
            }
        }
    }
    kiln_weights_drop(source, sizeof(float) * (size_t)(kernel->k * kernel->n));
    kernel->packed = packed;
    *out = kernel;
    return NULL;
}

static void destroy_kernel(void* data) {
    Kernel* kernel = data;
    if (kernel->chunk) kiln_weights_release(kernel->chunk);
    else free((void*)kernel->packed);
    free(kernel);
}

static OrtStatus* compute(void* data, OrtKernelContext* context) {
    const Kernel* kernel = data;
    const OrtValue* input;
    OrtValue* output;
    OrtStatus* status;
    size_t rank = 0;
    int64_t dims[8];
    if ((status = kiln_input(context, 0, &input)) || (status = kiln_dims(input, dims, &rank, 8, NAME))) return status;
    if (rank < 1 || dims[rank - 1] != kernel->k)
        return kiln_op_error(ORT_INVALID_ARGUMENT, NAME, "A's last dimension is not W's first (K)");
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    dims[rank - 1] = kernel->n;
    if ((status = kiln_output(context, 0, dims, rank, &output))) return status;
    if (rows == 0) return NULL;
    Job job = {kernel, kiln_data_of(input), kiln_data_of(output), rows, (rows + BLOCK_ROWS - 1) / BLOCK_ROWS, 0};
    if (!job.x || !job.y) return kiln_op_error(ORT_FAIL, NAME, "no tensor data");
    /* Enough items to balance two threads and more, each at least 2 panels wide; few rows: panels only. */
    int64_t panel_items = (kernel->panels + 1) / 2;
    int64_t cap = job.row_items >= MAX_ITEMS ? 1 : MAX_ITEMS / job.row_items;
    job.panel_items = panel_items < cap ? panel_items : cap;
    kiln_parallel(context, run_item, (size_t)(job.row_items * job.panel_items), &job);
    return NULL;
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return NAME; }

OrtCustomOp kiln_matmul_fp32_op = {
    KILN_OP_COMMON,
    .GetName = op_name,
    .GetInputType = kiln_float_input,
    .GetInputTypeCount = kiln_count_2,
    .GetOutputTypeCount = kiln_count_1,
    .GetInputCharacteristic = kiln_required_input,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
    .KernelDestroy = destroy_kernel,
};

/* ai.kiln::SwiGLU(X) -> Y: X [..., 2n] holds a SwiGLU MLP's gate and up projections side by side (an
   fp32 MatMul's packed output, compiler/fusions pack_matmuls); Y [..., n] = silu(gate) * up. Bit for
   bit what the Split into halves, the Sigmoid and Mul (QuickGelu to ONNX Runtime) and the Mul it
   replaces write (silu.h; tests/runtime/test_cpu_kernels.py), in one pass over X.

   Why an op of Kiln's: those three nodes copy the two halves, then read and write them twice more, each
   a node of its own. On SmolLM2's fp32 graph at batch 32 they took 4 to 5 ms of a 62 ms decode step.
   The quantized graphs need no such op: their gate/up kernel writes silu(gate) * up itself (gated). */

#include <immintrin.h>
#include <stdint.h>

#include "ort_api.h"
#include "silu.h"

#define NAME "SwiGLU"
#define LANES 16
#define COLUMNS_PER_ITEM 1024  /* one work item: a row's columns [c, c + 1024) */
#define PARALLEL_VALUES 16384  /* fewer outputs run on the calling thread: the threads' start costs more */

typedef struct {
    const float* x;
    float* y;
    int64_t n, chunks;  /* output columns, and work items a row */
} Job;

static void run_item(void* data, size_t item) {
    const Job* job = data;
    int64_t row = (int64_t)item / job->chunks, first = (int64_t)item % job->chunks * COLUMNS_PER_ITEM;
    int64_t last = first + COLUMNS_PER_ITEM < job->n ? first + COLUMNS_PER_ITEM : job->n;
    const float* gate = job->x + row * 2 * job->n;
    const float* up = gate + job->n;
    float* y = job->y + row * job->n;
    for (int64_t c = first; c < last; c += LANES) {
        __mmask16 lanes = last - c >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (last - c)) - 1);
        __m512 product = _mm512_mul_ps(silu(_mm512_maskz_loadu_ps(lanes, gate + c)), _mm512_maskz_loadu_ps(lanes, up + c));
        _mm512_mask_storeu_ps(y + c, lanes, product);
    }
}

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api_, const OrtKernelInfo* info, void** out) {
    (void)op; (void)api_; (void)info;
    *out = NULL;  /* nothing to keep: the op has no attributes or weights */
    return NULL;
}

static OrtStatus* compute(void* data, OrtKernelContext* context) {
    (void)data;
    const OrtValue* input;
    OrtValue* output;
    OrtStatus* status;
    size_t rank = 0;
    int64_t dims[8];
    if ((status = kiln_input(context, 0, &input)) || (status = kiln_dims(input, dims, &rank, 8, NAME))) return status;
    if (rank < 1 || dims[rank - 1] % 2)
        return kiln_op_error(ORT_INVALID_ARGUMENT, NAME, "X's last dimension must be even: the gate's columns, then up's");
    int64_t rows = 1, n = dims[rank - 1] / 2;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    dims[rank - 1] = n;
    if ((status = kiln_output(context, 0, dims, rank, &output))) return status;
    if (rows == 0 || n == 0) return NULL;
    Job job = {kiln_data_of(input), kiln_data_of(output), n, (n + COLUMNS_PER_ITEM - 1) / COLUMNS_PER_ITEM};
    if (!job.x || !job.y) return kiln_op_error(ORT_FAIL, NAME, "no tensor data");
    size_t items = (size_t)(rows * job.chunks);
    if (rows * n >= PARALLEL_VALUES) kiln_parallel(context, run_item, items, &job);
    else for (size_t i = 0; i < items; i++) run_item(&job, i);
    return NULL;
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return NAME; }

OrtCustomOp kiln_swiglu_op = {
    KILN_OP_COMMON,
    .GetName = op_name,
    .GetInputType = kiln_float_input,
    .GetInputTypeCount = kiln_count_1,
    .GetOutputTypeCount = kiln_count_1,
    .GetInputCharacteristic = kiln_required_input,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

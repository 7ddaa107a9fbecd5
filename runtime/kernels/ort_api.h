/* ONNX Runtime's C API, the parts Kiln's CPU kernels call, declared by hand, and the helpers the ops
   share (library.c).

   The function table is append-only across versions, so its indices hold for every release that has
   the functions used (API version 17, ONNX Runtime 1.17, and later). No header of ONNX Runtime's is
   needed to build the library, and it loads into whichever release the host has. */

#ifndef KILN_ORT_API_H
#define KILN_ORT_API_H

#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;  /* a table of function pointers, indexed below */
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtShapeInfo OrtShapeInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;

typedef struct {
    const OrtApi* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

/* Positions in the OrtApi table (append-only since 1.0; the last one used came with API version 17). */
enum {
    API_CreateStatus = 0,
    API_GetErrorMessage = 2,
    API_CreateCustomOpDomain = 26,
    API_CustomOpDomain_Add = 27,
    API_AddCustomOpDomain = 28,
    API_GetTensorMutableData = 51,
    API_GetDimensionsCount = 61,
    API_GetDimensions = 62,
    API_GetTensorShapeElementCount = 64,
    API_GetTensorTypeAndShape = 65,
    API_KernelInfoGetAttribute_float = 85,
    API_KernelInfoGetAttribute_int64 = 86,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99,
    API_ReleaseCustomOpDomain = 101,
    API_KernelInfoGetConstantInput_tensor = 249,
    API_KernelContext_ParallelFor = 274,
};
#define API_VERSION 17  /* the table asked for: KernelContext_ParallelFor came with 1.17 */
#define OP_VERSION 16   /* the OrtCustomOp fields filled: up to the V2 kernel callbacks */
#define ORT_FAIL 1
#define ORT_INVALID_ARGUMENT 2
#define TYPE_FLOAT 1
#define TYPE_UINT8 2
#define TYPE_INT8 3
#define TYPE_INT32 6
#define TYPE_INT64 7
#define TYPE_FLOAT16 10
#define REQUIRED 0
#define OPTIONAL 1

extern const OrtApi* kiln_api;  /* set once, before any op is registered (library.c) */
#define CALL(index, type) ((type)(((void* const*)kiln_api)[index]))

typedef struct OrtCustomOp {
    uint32_t version;
    void* (*CreateKernel)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
    const char* (*GetName)(const struct OrtCustomOp*);
    const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
    int (*GetInputType)(const struct OrtCustomOp*, size_t);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
    int (*GetOutputType)(const struct OrtCustomOp*, size_t);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
    void (*KernelCompute)(void*, OrtKernelContext*);
    void (*KernelDestroy)(void*);
    int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
    OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
    OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
    /* later fields (shape inference, version ranges, in-place maps) are not read at OP_VERSION */
} OrtCustomOp;

/* The ops, one table each (int8_blocks.c, attention.c, swiglu.c, matmul_fp32.c). */
int kiln_cpu_kernels_bf16(void);  /* MatMulInt4BlocksBf16 on AVX-512 BF16's instructions, else on FMA */
extern OrtCustomOp kiln_int8_blocks_op, kiln_int4_blocks_op, kiln_int4_bf16_op, kiln_attention_op,
    kiln_attention_fp16_cache_op, kiln_attention_int8_cache_op, kiln_swiglu_op, kiln_matmul_fp32_op;

/* -- shared by the ops (library.c) ----------------------------------------------------------------- */

/* An error status naming the op: "ai.kiln::<op>: <what>". */
OrtStatus* kiln_op_error(int code, const char* op, const char* what);
void kiln_release(OrtStatus* status);
/* A tensor's data, NULL where it has none. */
void* kiln_data_of(const OrtValue* value);
/* A tensor's dimensions (at most max_rank of them) into dims, its rank into rank. */
OrtStatus* kiln_dims(const OrtValue* value, int64_t* dims, size_t* rank, size_t max_rank, const char* op);
/* Input `index`, NULL where an optional one is absent. */
OrtStatus* kiln_input(const OrtKernelContext* context, size_t index, const OrtValue** value);
OrtStatus* kiln_output(OrtKernelContext* context, size_t index, const int64_t* dims, size_t rank, OrtValue** value);
/* An integer attribute, `absent` where the node has none. */
int64_t kiln_attribute_int(const OrtKernelInfo* info, const char* name, int64_t absent);
float kiln_attribute_float(const OrtKernelInfo* info, const char* name, float absent);
/* fn(data, i) for i in [0, total) on the session's intra-op threads, or here where it has none. */
void kiln_parallel(void* context, void (*fn)(void*, size_t), size_t total, void* data);

/* A copy of an op's constant weights in memory of the library's own, on 2 MB pages (library.c); NULL
   where none could be had (the op then reads ONNX Runtime's). `chunk` is what kiln_weights_release
   takes back when the kernel goes. */
const void* kiln_weights_copy(const void* weights, size_t bytes, void** chunk);
void kiln_weights_release(void* chunk);
/* Room for `bytes` of an op's weights in those chunks (64-byte aligned; NULL where none could be had),
   for an op that writes its own layout there; and the pages of ONNX Runtime's copy given back. */
void* kiln_weights_place(size_t bytes, void** chunk);
void kiln_weights_drop(const void* weights, size_t bytes);

/* What every Kiln op answers alike: it runs on the CPU provider, its inputs are in CPU memory, its
   outputs are fp32 and always written, and its kernel is one block from malloc. An op's table starts
   with KILN_OP_COMMON and adds the rest; an op whose kernel holds more (int8_blocks.c: the chunk its
   weights were copied into) sets its own KernelDestroy after it. */
const char* kiln_cpu_provider(const OrtCustomOp* op);
int kiln_cpu_memory(const OrtCustomOp* op, size_t i);
int kiln_float_output(const OrtCustomOp* op, size_t i);
int kiln_required_output(const OrtCustomOp* op, size_t i);
void kiln_free_kernel(void* kernel);
/* For the tables of ops whose inputs are all fp32, or all required, and for counts of 1 and 2. */
int kiln_float_input(const OrtCustomOp* op, size_t i);
int kiln_required_input(const OrtCustomOp* op, size_t i);
size_t kiln_count_1(const OrtCustomOp* op);
size_t kiln_count_2(const OrtCustomOp* op);
#define KILN_OP_COMMON .version = OP_VERSION, .GetExecutionProviderType = kiln_cpu_provider, \
    .GetInputMemoryType = kiln_cpu_memory, .GetOutputType = kiln_float_output,            \
    .GetOutputCharacteristic = kiln_required_output, .KernelDestroy = kiln_free_kernel

#endif

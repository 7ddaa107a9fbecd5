/* Kiln's CPU kernels as one ONNX Runtime custom-op library: the domain ai.kiln with its ops
   (int8_blocks.c: MatMulInt8Blocks, MatMulInt4Blocks; attention.c: GroupQueryAttention; swiglu.c:
   SwiGLU; matmul_fp32.c: MatMulFp32), and the helpers they share. runtime/cpu_kernels.py loads it, checks the CPU first (kiln_cpu_kernels_supported)
   and registers it with each session that runs a kernels' graph. */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ort_api.h"

const OrtApi* kiln_api;

/* -- what the runtime asks before registering the library (ctypes) ---------------------------------- */

/* What runtime/cpu_kernels.py checks the library against (LIBRARY_VERSION), raised whenever an op's
   numbers or contract change: a library built from older sources (an editable checkout not rebuilt)
   is then not run at all. 2: a right-padded first prompt's rows computed as alone (attention.c). 3: the
   op SwiGLU (swiglu.c). 4: GroupQueryAttentionFp16Cache, attention over an fp16 KV cache (attention.c). 5:
   MatMulInt4BlocksBf16 (int8_blocks.c). 6: MatMulInt4BlocksBf16 on CPUs without AVX-512 BF16 too. 7: the
   op MatMulFp32 (matmul_fp32.c). 8: GroupQueryAttentionInt8Cache, attention over an 8-bit KV cache. */
int kiln_cpu_kernels_version(void) { return 9; }

/* Whether MatMulInt4BlocksBf16 runs AVX-512 BF16's instructions here, or their numbers with fused
   multiply-adds (no AVX-512 BF16, or KILN_CPU_KERNELS_BF16=fma: to measure that path on a CPU with it). */
int kiln_cpu_kernels_bf16(void) {
    __builtin_cpu_init();
    const char* path = getenv("KILN_CPU_KERNELS_BF16");
    return __builtin_cpu_supports("avx512bf16") && !(path && strcmp(path, "fma") == 0);
}

int kiln_cpu_kernels_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* -- helpers --------------------------------------------------------------------------------------- */

OrtStatus* kiln_op_error(int code, const char* op, const char* what) {
    char message[512];
    snprintf(message, sizeof message, "ai.kiln::%s: %s", op, what);
    return CALL(API_CreateStatus, OrtStatus* (*)(int, const char*))(code, message);  /* it copies the message */
}

void kiln_release(OrtStatus* status) { CALL(API_ReleaseStatus, void (*)(OrtStatus*))(status); }

void* kiln_data_of(const OrtValue* value) {
    void* data = NULL;
    OrtStatus* status = CALL(API_GetTensorMutableData, OrtStatus* (*)(const OrtValue*, void**))(value, &data);
    if (status) { kiln_release(status); return NULL; }
    return data;
}

OrtStatus* kiln_dims(const OrtValue* value, int64_t* dims, size_t* rank, size_t max_rank, const char* op) {
    OrtShapeInfo* shape = NULL;
    OrtStatus* status = CALL(API_GetTensorTypeAndShape, OrtStatus* (*)(const OrtValue*, OrtShapeInfo**))(value, &shape);
    if (status) return status;
    status = CALL(API_GetDimensionsCount, OrtStatus* (*)(const OrtShapeInfo*, size_t*))(shape, rank);
    if (!status && *rank > max_rank) status = kiln_op_error(ORT_INVALID_ARGUMENT, op, "an input has too many dimensions");
    if (!status) status = CALL(API_GetDimensions, OrtStatus* (*)(const OrtShapeInfo*, int64_t*, size_t))(shape, dims, *rank);
    CALL(API_ReleaseTensorTypeAndShapeInfo, void (*)(OrtShapeInfo*))(shape);
    return status;
}

OrtStatus* kiln_input(const OrtKernelContext* context, size_t index, const OrtValue** value) {
    *value = NULL;
    return CALL(API_KernelContext_GetInput, OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**))(
        context, index, value);
}

OrtStatus* kiln_output(OrtKernelContext* context, size_t index, const int64_t* dims, size_t rank, OrtValue** value) {
    *value = NULL;
    return CALL(API_KernelContext_GetOutput, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(
        context, index, dims, rank, value);
}

int64_t kiln_attribute_int(const OrtKernelInfo* info, const char* name, int64_t absent) {
    int64_t value = absent;
    OrtStatus* status = CALL(API_KernelInfoGetAttribute_int64, OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*))(
        info, name, &value);
    if (status) { kiln_release(status); return absent; }
    return value;
}

float kiln_attribute_float(const OrtKernelInfo* info, const char* name, float absent) {
    float value = absent;
    OrtStatus* status = CALL(API_KernelInfoGetAttribute_float, OrtStatus* (*)(const OrtKernelInfo*, const char*, float*))(
        info, name, &value);
    if (status) { kiln_release(status); return absent; }
    return value;
}

void kiln_parallel(void* context, void (*fn)(void*, size_t), size_t total, void* data) {
    OrtStatus* status = CALL(API_KernelContext_ParallelFor,
                             OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*))(
        context, fn, total, 0, data);
    if (status) {  /* no thread pool to run on: run here */
        kiln_release(status);
        for (size_t i = 0; i < total; i++) fn(data, i);
    }
}

/* -- the weights' memory ------------------------------------------------------------------------------

   The 8-bit and 4-bit ops copy their weights into chunks of memory on 2 MB pages, one after another
   in the order the session creates its kernels (a model's layers in order). ONNX Runtime maps each
   initializer from the .data file on its own, in 4 KB pages: a decode step that streams 155 MB of
   SmolLM2's int8 weights through them ran 3% to 4% (batch 1) and 10% to 15% (batch 8) slower, on TLB
   misses and hardware prefetchers that stop at each page. ONNX Runtime's pages are then paged out
   (MADV_PAGEOUT: a mapping of the file reads the same bytes again if anything touches it), so the
   process holds the weights once. A chunk goes when the last kernel in it does. The cost: processes
   on one host no longer share the file's pages (ONNX Runtime's prepacked fp32 weights never did);
   KILN_KERNEL_WEIGHTS=mapped leaves the weights where ONNX Runtime mapped them, except MatMulFp32's,
   which the op packs into a layout of its own when the session starts (matmul_fp32.c). */

#define HUGE_PAGE ((size_t)2 << 20)
#define CHUNK_BYTES ((size_t)64 << 20)
#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

typedef struct Chunk {
    char *mapping, *base;   /* base: mapping rounded up to a huge page */
    size_t mapped, size, used;
    int kernels;
    struct Chunk* next;
} Chunk;

static Chunk* chunks;  /* newest first */
static pthread_mutex_t chunks_lock = PTHREAD_MUTEX_INITIALIZER;

static Chunk* new_chunk(size_t bytes) {
    size_t size = bytes > CHUNK_BYTES ? (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE : CHUNK_BYTES;
    Chunk* chunk = calloc(1, sizeof(Chunk));
    if (!chunk) return NULL;
    chunk->mapped = size + HUGE_PAGE;
    chunk->mapping = mmap(NULL, chunk->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (chunk->mapping == MAP_FAILED) { free(chunk); return NULL; }
    chunk->base = (char*)(((uintptr_t)chunk->mapping + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    chunk->size = size;
    madvise(chunk->base, size, MADV_HUGEPAGE);  /* a hint: without it (THP off) the copy still works */
    return chunk;
}

void* kiln_weights_place(size_t bytes, void** owner) {
    pthread_mutex_lock(&chunks_lock);
    Chunk* chunk = chunks && chunks->size - chunks->used >= bytes ? chunks : NULL;
    if (!chunk && (chunk = new_chunk(bytes))) {
        if (bytes > CHUNK_BYTES && chunks) {  /* a chunk of its own, full: the head keeps its room */
            chunk->next = chunks->next;
            chunks->next = chunk;
        } else {
            chunk->next = chunks;
            chunks = chunk;
        }
    }
    char* place = NULL;
    if (chunk) {
        place = chunk->base + chunk->used;
        chunk->used += (bytes + 63) / 64 * 64;
        chunk->kernels++;
    }
    pthread_mutex_unlock(&chunks_lock);
    *owner = chunk;
    return place;
}

void kiln_weights_drop(const void* weights, size_t bytes) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = ((uintptr_t)weights + page - 1) & ~(uintptr_t)(page - 1);
    uintptr_t last = ((uintptr_t)weights + bytes) & ~(uintptr_t)(page - 1);
    if (last > first) madvise((void*)first, last - first, MADV_PAGEOUT);  /* best effort: never loses data */
}

const void* kiln_weights_copy(const void* weights, size_t bytes, void** owner) {
    *owner = NULL;
    const char* choice = getenv("KILN_KERNEL_WEIGHTS");
    if (choice && strcmp(choice, "mapped") == 0) return NULL;  /* one copy for every process on the host */
    void* copy = kiln_weights_place(bytes, owner);
    if (!copy) return NULL;
    memcpy(copy, weights, bytes);
    kiln_weights_drop(weights, bytes);
    return copy;
}

void kiln_weights_release(void* owner) {
    Chunk* chunk = owner;
    if (!chunk) return;
    pthread_mutex_lock(&chunks_lock);
    if (--chunk->kernels == 0) {
        for (Chunk** at = &chunks; *at; at = &(*at)->next)
            if (*at == chunk) { *at = chunk->next; break; }
        munmap(chunk->mapping, chunk->mapped);
        free(chunk);
    }
    pthread_mutex_unlock(&chunks_lock);
}

const char* kiln_cpu_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
int kiln_cpu_memory(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
int kiln_float_output(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
int kiln_required_output(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return REQUIRED; }
int kiln_float_input(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
int kiln_required_input(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return REQUIRED; }
size_t kiln_count_1(const OrtCustomOp* op) { (void)op; return 1; }
size_t kiln_count_2(const OrtCustomOp* op) { (void)op; return 2; }
void kiln_free_kernel(void* kernel) { free(kernel); }

/* -- registration ---------------------------------------------------------------------------------- */

/* Set up once for every session in the process: the API table, the CPU check, the domain with its ops.
   The domain is published only whole; a failure is kept as a message and reported to each caller. */
static OrtCustomOpDomain* domain;
static const OrtApiBase* setup_base;
static char setup_error[256];
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

static void keep_error(OrtStatus* status) {
    const char* message = CALL(API_GetErrorMessage, const char* (*)(const OrtStatus*))(status);
    strncpy(setup_error, message ? message : "unknown error", sizeof setup_error - 1);
    kiln_release(status);
}

static void setup(void) {
    kiln_api = setup_base->GetApi(API_VERSION);
    if (!kiln_api) {
        strcpy(setup_error, "Kiln's CPU kernels need ONNX Runtime 1.17 or later");
        return;
    }
    if (!kiln_cpu_kernels_supported()) {
        strcpy(setup_error, "Kiln's CPU kernels need AVX-512 VNNI, which this CPU does not have");
        return;
    }
    OrtCustomOp* ops[] = {&kiln_int8_blocks_op, &kiln_int4_blocks_op, &kiln_int4_bf16_op, &kiln_attention_op,
                          &kiln_attention_fp16_cache_op, &kiln_attention_int8_cache_op, &kiln_swiglu_op,
                          &kiln_matmul_fp32_op};
    OrtCustomOpDomain* made = NULL;
    OrtStatus* status = CALL(API_CreateCustomOpDomain, OrtStatus* (*)(const char*, OrtCustomOpDomain**))("ai.kiln", &made);
    for (size_t i = 0; !status && i < sizeof ops / sizeof *ops; i++)
        status = CALL(API_CustomOpDomain_Add, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*))(made, ops[i]);
    if (status) {
        keep_error(status);
        if (made) CALL(API_ReleaseCustomOpDomain, void (*)(OrtCustomOpDomain*))(made);
        return;
    }
    domain = made;
}

/* What SessionOptions.register_custom_ops_library calls. */
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    setup_base = base;
    pthread_once(&setup_once, setup);
    if (!domain) {  /* reported with whichever table this ONNX Runtime has: CreateStatus is entry 0 of all */
        const OrtApi* table = kiln_api ? kiln_api : base->GetApi(1);
        return ((OrtStatus * (*)(int, const char*))((void* const*)table)[API_CreateStatus])(ORT_FAIL, setup_error);
    }
    return CALL(API_AddCustomOpDomain, OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*))(options, domain);
}

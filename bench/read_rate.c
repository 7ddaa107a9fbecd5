/* The memory's read rate as a kernel that streams several regions at once sees it (bench/generate.py
   read_streams_gbs compiles this with the host's C compiler): `threads` threads, each reading its part of
   1 GiB as 1, 2, 4, 8 or 16 streams side by side, on 2 MB pages where the kernel gives them; the fastest.
   numpy's max reads one stream a thread; on the AMD EPYC VMs this is run on, several streams a thread
   can read faster, and Kiln's fp32 MatMul reads 3 panels a thread at once, so a floor from numpy's rate
   alone would not be one. */

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define BYTES ((size_t)1 << 30)
#define HUGE_PAGE ((size_t)2 << 20)
#define STEP 64  /* 8-byte words a stream advances before the next stream's turn: 512 bytes */

typedef uint64_t Lanes __attribute__((vector_size(64)));  /* one 512-bit load, or two 256-bit ones */

typedef struct {
    const uint64_t* words;
    size_t count;
    int streams;
    uint64_t seen;
} Reader;

static void* read_part(void* data) {
    Reader* r = data;
    size_t length = r->count / (size_t)r->streams / STEP * STEP;
    Lanes a = {0}, b = {0}, c = {0}, d = {0};
    for (size_t i = 0; i < length; i += STEP)
        for (int s = 0; s < r->streams; s++) {
            const Lanes* p = (const Lanes*)(r->words + (size_t)s * length + i);
            a |= p[0] | p[4];
            b |= p[1] | p[5];
            c |= p[2] | p[6];
            d |= p[3] | p[7];
        }
    Lanes all = a | b | c | d;
    r->seen = all[0] | all[1] | all[2] | all[3] | all[4] | all[5] | all[6] | all[7];
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* GB/s, the best of `repeats` reads at each number of streams; 0 where the memory or threads could not
   be had. */
double read_streams_gbs(int threads, int repeats) {
    if (threads < 1 || threads > 256) return 0;
    char* mapping = mmap(NULL, BYTES + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) return 0;
    uint64_t* words = (uint64_t*)(((uintptr_t)mapping + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    madvise(words, BYTES, MADV_HUGEPAGE);
    size_t count = BYTES / sizeof(uint64_t);
    for (size_t i = 0; i < count; i++) words[i] = i;
    Reader readers[256];
    pthread_t ids[256];
    double best = 0;
    for (int repeat = 0; repeat < 5 * repeats; repeat++) {
        int streams = 1 << (repeat % 5);
        size_t part = count / (size_t)threads / 8 * 8;  /* whole 64-byte lines: each part starts aligned */
        size_t read = (size_t)threads * (size_t)streams * (part / (size_t)streams / STEP * STEP) * sizeof(uint64_t);
        double start = now();
        int started = 0;
        for (int t = 0; t < threads; t++) {
            readers[t] = (Reader){words + part * (size_t)t, part, streams, 0};
            if (pthread_create(&ids[t], NULL, read_part, &readers[t])) break;
            started++;
        }
        for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
        double seconds = now() - start;
        if (started < threads) { best = 0; break; }
        double rate = (double)read / seconds / 1e9;
        if (rate > best) best = rate;
    }
    munmap(mapping, BYTES + HUGE_PAGE);
    return best;
}

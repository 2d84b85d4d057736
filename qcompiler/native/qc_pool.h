/* The thread pool's interface (pool.c) and what every file of qcompiler's native library shares:
 * QC_API marks the functions the Python side binds (the library is built -fvisibility=hidden, so
 * everything else stays internal to it).  The BPU kernels (backends/bpu/native) include it. */
#ifndef QC_POOL_H
#define QC_POOL_H
#include <stdint.h>

#define QC_API __attribute__((visibility("default")))

/* qc_run_rows (pool.c): fn(ctx, r0, r1) over chunks of [m0, m1) on up to `parts` threads */
#define QC_MAX_PARTS 16
typedef int (*qc_rows_fn)(void *ctx, int64_t r0, int64_t r1);
/* The rows are cut into QC_CHUNKS_PER_PART chunks per part, taken one at a time from a shared
 * counter by every thread of the call: a helper that starts late, or shares its core with another
 * process (a runtime's spinning threads), leaves more chunks to the others, and the caller never
 * waits for more than the chunk a helper is in. */
#define QC_CHUNKS_PER_PART 2

/* torch's OpenMP entry point (GOMP_parallel, qcompiler/native/openmp.py) as the kernels call it */
typedef void (*qc_omp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

int qc_run_rows(qc_rows_fn fn, void *ctx, int64_t m0, int64_t m1, int parts, int64_t align);
int64_t qc_now_ns(void); /* CLOCK_MONOTONIC in nanoseconds */
#endif

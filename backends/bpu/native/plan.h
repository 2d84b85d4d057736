#ifndef QC_BPU_PLAN_H
#define QC_BPU_PLAN_H
#include <stdint.h>

#include "qc_pool.h"

/* ==== a program's native layers in one call (the simulator's plans) =========================
 * A step is one native kernel on fixed buffers: fn(ctx, r0, r1) computes output rows [r0, r1) of
 * [m0, m1) (disjoint rows, each computed as by the whole call, so any cut gives the same bits).  The
 * *_step builders below fill a step and its argument block (caller-owned memory of
 * qc_plan_sizes()[1] bytes) instead of running the kernel; the simulator builds a program's steps
 * once per input shape and then runs them all with one qc_run_plan call: no Python between layers.
 *
 * qc_run_plan(steps, n, parts, min_work, omp): the steps in order.  parts <= 1: each step whole, on
 * the calling thread.  parts > 1 with omp (torch's GOMP_parallel, qcompiler/native/openmp.py): one
 * parallel region of torch's own team for the whole plan.  A step of at least min_work units is cut
 * into up to 2 * parts chunks of rows (multiples of its align), taken from a shared counter by
 * whichever member comes; a smaller step is one chunk.  A member that finds no chunk left waits
 * (spinning, then yielding) until every chunk of the step is done before it starts the next, so a
 * step reads only finished inputs.  Nothing depends on the team's size (a smaller team than asked
 * for does more chunks each; a team of one runs them all).  parts > 1 without omp: each large step
 * through qc_run_rows (the native pool).  Returns the first nonzero step result (out of memory), else 0. */
typedef struct {
    qc_rows_fn fn;
    void *ctx;
    int64_t m0, m1, align, work;
} qc_step;

typedef union { /* room for the largest argument block a builder writes (each checks its own) */
    int64_t words[32];
    void *ptrs[32];
} qc_step_args;
#define QC_STEP_ARGS_FIT(T) _Static_assert(sizeof(T) <= sizeof(qc_step_args), #T " must fit a step's argument block")

/* The row functions of kernels over (N, Ho) output rows (b, oh): rows [r0, r1) cut at sample boundaries
 * into pieces b, oh0..oh1-1, each computed by BODY (an int expression of b, oh0, oh1: the kernel on sample
 * b's rows oh0..oh1-1; nonzero returns it). */
#define QC_EACH_SAMPLE_ROWS(r0, r1, Ho, BODY)                                                            \
    for (int64_t r_ = (r0); r_ < (r1);) {                                                                \
        const int64_t b = r_ / (Ho), oh0 = r_ % (Ho), oh1 = (r1) - b * (Ho) < (Ho) ? (r1) - b * (Ho) : (Ho); \
        const int rc_ = (BODY);                                                                           \
        if (rc_) return rc_;                                                                              \
        r_ = b * (Ho) + oh1;                                                                              \
    }
#endif

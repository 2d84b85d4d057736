/* The simulator's plans: a program's native layers run in one call (plan.h). */
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

#include "plan.h"

QC_API void qc_plan_sizes(int64_t *sizes) {
    sizes[0] = (int64_t)sizeof(qc_step);
    sizes[1] = (int64_t)((sizeof(qc_step_args) + 63) / 64 * 64);
}

typedef struct {
    const qc_step *steps;
    int64_t n, min_work;
    int parts, rc;
    int64_t *next, *done; /* per step: the next chunk to take, the chunks finished */
} plan_job;

static int64_t plan_chunks(const qc_step *st, int parts, int64_t min_work) {
    const int64_t units = (st->m1 - st->m0 + st->align - 1) / st->align;
    if (parts <= 1 || st->work < min_work || units <= 1) return units > 0 ? 1 : 0;
    const int64_t want = (int64_t)parts * QC_CHUNKS_PER_PART;
    return units < want ? units : want;
}

static void plan_member(void *ctx) {
    plan_job *j = ctx;
    for (int64_t s = 0; s < j->n; s++) {
        const qc_step *st = &j->steps[s];
        const int64_t nch = plan_chunks(st, j->parts, j->min_work);
        const int64_t units = (st->m1 - st->m0 + st->align - 1) / st->align;
        for (int64_t i; (i = __atomic_fetch_add(&j->next[s], 1, __ATOMIC_RELAXED)) < nch;) {
            int64_t a = st->m0 + units * i / nch * st->align, b = st->m0 + units * (i + 1) / nch * st->align;
            a = a < st->m1 ? a : st->m1;
            b = b < st->m1 ? b : st->m1;
            const int rc = b > a ? st->fn(st->ctx, a, b) : 0;
            if (rc) {
                int zero = 0;
                __atomic_compare_exchange_n(&j->rc, &zero, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            }
            __atomic_add_fetch(&j->done[s], 1, __ATOMIC_RELEASE);
        }
        for (int64_t spins = 0; __atomic_load_n(&j->done[s], __ATOMIC_ACQUIRE) < nch; spins++) {
            __builtin_ia32_pause();
            if (spins >= 4096) { /* a member descheduled mid-chunk: give its core back */
                sched_yield();
                spins = 0;
            }
        }
    }
}

QC_API int qc_run_plan(const qc_step *steps, int64_t n, int parts, int64_t min_work, void *omp) {
    if (parts > QC_MAX_PARTS) parts = QC_MAX_PARTS;
    if (parts <= 1 || n <= 0) {
        for (int64_t s = 0; s < n; s++) {
            const int rc = steps[s].m1 > steps[s].m0 ? steps[s].fn(steps[s].ctx, steps[s].m0, steps[s].m1) : 0;
            if (rc) return rc;
        }
        return 0;
    }
    if (!omp) {
        for (int64_t s = 0; s < n; s++) {
            const int rc = qc_run_rows(steps[s].fn, steps[s].ctx, steps[s].m0, steps[s].m1,
                                       steps[s].work >= min_work ? parts : 1, steps[s].align);
            if (rc) return rc;
        }
        return 0;
    }
    int64_t *counters = calloc((size_t)(2 * n), sizeof(int64_t));
    if (!counters) return -1;
    plan_job job = {steps, n, min_work, parts, 0, counters, counters + n};
    ((qc_omp_parallel_fn)omp)(plan_member, &job, (unsigned)parts, 0);
    free(counters);
    return job.rc;
}

/* qc_run_plan_timed: the steps in order on the calling thread, each whole, ns[s] = its nanoseconds
 * (a profile of a plan: where the time goes per layer).  Returns as qc_run_plan. */
QC_API int qc_run_plan_timed(const qc_step *steps, int64_t n, int64_t *ns) {
    for (int64_t s = 0; s < n; s++) {
        const int64_t t0 = qc_now_ns();
        const int rc = steps[s].m1 > steps[s].m0 ? steps[s].fn(steps[s].ctx, steps[s].m0, steps[s].m1) : 0;
        ns[s] = qc_now_ns() - t0;
        if (rc) return rc;
    }
    return 0;
}


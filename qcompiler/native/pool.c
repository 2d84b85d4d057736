/* qcompiler's native thread pool (qc_pool.h): one call's output rows split over threads. */
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "qc_pool.h"

/* ==== one call's output rows split over threads ===========================================
 * qc_run_rows: fn(ctx, r0, r1) over contiguous chunks of [m0, m1) (multiples of `align` rows but
 * the last) on up to `parts` threads: the caller's, and parts - 1 requests to a small process-wide
 * pool of helper threads (started on first use, sleeping on a condition variable between calls).
 * When no chunk is left the caller takes back every request no helper has started, so a call only
 * ever waits for chunks already running: several threads may call at once, however busy the pool,
 * without deadlock.  A kernel run on disjoint row ranges writes disjoint outputs and allocates its
 * own scratch per call, so the result is bit for bit the one-thread call's.  Helpers that cannot be
 * started leave their chunks to the caller (never an error).  A forked child starts with an empty
 * pool (pthread_atfork).  Returns the first nonzero chunk result, else 0. */
typedef struct {
    qc_rows_fn fn;
    void *ctx;
    int64_t m0, m1, units, align;
    int nchunks, next, rc;
} qc_rows_job;

static int qc_rows_work(qc_rows_job *j) {
    for (;;) {
        const int i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->nchunks) return 0;
        int64_t a = j->m0 + j->units * i / j->nchunks * j->align, b = j->m0 + j->units * (i + 1) / j->nchunks * j->align;
        a = a < j->m1 ? a : j->m1;
        b = b < j->m1 ? b : j->m1;
        const int rc = b > a ? j->fn(j->ctx, a, b) : 0;
        if (rc) {
            int zero = 0;
            __atomic_compare_exchange_n(&j->rc, &zero, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        }
    }
}

typedef struct qc_part {
    qc_rows_job *job;
    int state; /* 0 queued, 1 taken (running or done), 2 done */
    struct qc_part *next;
    int *pending; /* the caller's count of parts helpers took and have not finished */
} qc_part;

static pthread_mutex_t qc_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qc_pool_work = PTHREAD_COND_INITIALIZER, qc_pool_done = PTHREAD_COND_INITIALIZER;
static qc_part *qc_pool_head, *qc_pool_tail;
static int qc_pool_size, qc_pool_atfork;

static void qc_pool_child(void) { /* only the forking thread exists in the child */
    pthread_mutex_init(&qc_pool_mu, NULL);
    pthread_cond_init(&qc_pool_work, NULL);
    pthread_cond_init(&qc_pool_done, NULL);
    qc_pool_head = qc_pool_tail = NULL;
    qc_pool_size = 0;
}
static void qc_pool_prepare(void) { pthread_mutex_lock(&qc_pool_mu); }
static void qc_pool_parent(void) { pthread_mutex_unlock(&qc_pool_mu); }

/* Waking a thread from a condition variable costs tens of microseconds here, as much as a small
 * layer: a helper that finished a part, and a caller waiting for its parts, first spin (reading one
 * word, with pause) for up to QC_SPIN_NS before they sleep; consecutive layers hand off while spinning. */
#define QC_SPIN_NS 300000
int64_t qc_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin until *word (read atomically) is nonzero (want 1) / zero (want 0), or QC_SPIN_NS pass. */
static void qc_spin(void *const *ptr, const int *cnt, int want) {
    const int64_t end = qc_now_ns() + QC_SPIN_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            const int v = ptr ? __atomic_load_n(ptr, __ATOMIC_ACQUIRE) != NULL : __atomic_load_n(cnt, __ATOMIC_ACQUIRE) != 0;
            if (v == want) return;
            __builtin_ia32_pause();
        }
        if (qc_now_ns() > end) return;
    }
}

static void *qc_pool_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&qc_pool_mu);
    for (;;) {
        if (!qc_pool_head) {
            pthread_mutex_unlock(&qc_pool_mu);
            qc_spin((void *const *)&qc_pool_head, NULL, 1);
            pthread_mutex_lock(&qc_pool_mu);
        }
        while (!qc_pool_head) pthread_cond_wait(&qc_pool_work, &qc_pool_mu);
        qc_part *p = qc_pool_head;
        __atomic_store_n(&qc_pool_head, p->next, __ATOMIC_RELEASE);
        if (!qc_pool_head) qc_pool_tail = NULL;
        p->state = 1;
        __atomic_add_fetch(p->pending, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&qc_pool_mu);
        qc_rows_work(p->job);
        pthread_mutex_lock(&qc_pool_mu);
        p->state = 2;
        if (__atomic_sub_fetch(p->pending, 1, __ATOMIC_RELEASE) == 0) pthread_cond_broadcast(&qc_pool_done);
    }
    return NULL;
}

int qc_run_rows(qc_rows_fn fn, void *ctx, int64_t m0, int64_t m1, int parts, int64_t align) {
    const int64_t units = (m1 - m0 + align - 1) / align;
    if (parts > QC_MAX_PARTS) parts = QC_MAX_PARTS;
    if (parts > units) parts = (int)units;
    if (parts <= 1) return m1 > m0 ? fn(ctx, m0, m1) : 0;
    const int64_t nchunks = units < (int64_t)parts * QC_CHUNKS_PER_PART ? units : (int64_t)parts * QC_CHUNKS_PER_PART;
    qc_rows_job job = {fn, ctx, m0, m1, units, align, (int)nchunks, 0, 0};
    qc_part p[QC_MAX_PARTS];
    int pending = 0;
    for (int t = 0; t < parts; t++) p[t] = (qc_part){&job, 0, NULL, &pending};
    pthread_mutex_lock(&qc_pool_mu);
    if (!qc_pool_atfork) qc_pool_atfork = pthread_atfork(qc_pool_prepare, qc_pool_parent, qc_pool_child) == 0 ? 1 : -1;
    while (qc_pool_size < QC_MAX_PARTS - 1 && qc_pool_size < parts - 1) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&tid, &attr, qc_pool_main, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        qc_pool_size++;
    }
    for (int t = 1; t < parts && qc_pool_size > 0; t++) {
        if (qc_pool_tail) qc_pool_tail->next = &p[t];
        else __atomic_store_n(&qc_pool_head, &p[t], __ATOMIC_RELEASE);
        qc_pool_tail = &p[t];
    }
    if (qc_pool_size > 0) pthread_cond_broadcast(&qc_pool_work);
    pthread_mutex_unlock(&qc_pool_mu);
    qc_rows_work(&job); /* the caller's share: chunks until none is left */
    pthread_mutex_lock(&qc_pool_mu);
    /* take back the parts no helper has started (they would find no chunk left): unlink them */
    for (qc_part **q = &qc_pool_head, *prev = NULL; *q;) {
        if ((*q)->pending == &pending) {
            if (qc_pool_tail == *q) qc_pool_tail = prev;
            __atomic_store_n(q, (*q)->next, __ATOMIC_RELEASE);
        } else {
            prev = *q;
            q = &(*q)->next;
        }
    }
    pthread_mutex_unlock(&qc_pool_mu);
    qc_spin(NULL, &pending, 0);
    pthread_mutex_lock(&qc_pool_mu);
    while (__atomic_load_n(&pending, __ATOMIC_ACQUIRE) > 0) pthread_cond_wait(&qc_pool_done, &qc_pool_mu);
    pthread_mutex_unlock(&qc_pool_mu);
    return job.rc;
}

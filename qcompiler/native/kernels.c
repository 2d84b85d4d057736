/* qcompiler's calibration kernels (the observers': histograms of |x|, per-row min/max): plain C, no
 * Python or torch headers, called through ctypes (qcompiler/native/kernels.py checks dtypes,
 * contiguity and sizes).  build.py compiles them into one library with the thread pool (pool.c)
 * and the BPU simulator's kernels (backends/bpu/native).
 *
 * Every kernel keeps no state between calls and writes only to the buffers it is given, so it
 * may run on several threads at once (ctypes releases the GIL).  The *_mt calls split their work
 * over torch's OpenMP team or the native pool (qc_run_rows).
 *
 * Exactness: the histogram bins |x| with a float64 product that is exact (24-bit significand times
 * a power of two or a small integer over one).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qc_pool.h"

/* the interface version build.py's ABI_VERSION names (a library of another one is rebuilt) */
QC_API int qc_abi_version(void) { return 1; }

/* Histogram of |x| over [0, r): hist[floor(|x| * per_unit)] += 1 for the N float32 values x,
 * per_unit = nbins / r.  Exact floors: with f32 != 0, per_unit is a power of two in the normal
 * float32 range and the float32 product is exact (a product below 1 may round, but stays below
 * 1: bin 0); otherwise the float64 product of a 24-bit |x| and per_unit (an integer <= 2**21
 * over a power of two) is exact.  Truncation of a non-negative value is its floor.
 * Indices are computed a block at a time (vectorized), then counted in uint32 (added to hist,
 * float64 and exact below 2**53, every 2**30 elements and at the end).  Bin 0 (the zeros after a
 * ReLU, often half the values) is counted in the vector loop instead; its elements increment 16
 * scratch slots in rotation, so the scalar loop never waits on a chain of increments of one
 * counter, or (AVX-512, a block with at least 1/8 zeros) are dropped from the index list before the
 * scalar loop (a compress per 16 lanes: 20% less time on a ReLU's output, the same without zeros).
 * With AVX-512 and a float32 product (hist_bin_f32x16) the index pass itself leaves them out.  A
 * value whose index is not in [0, nbins) (|x| >= r, or NaN) is never counted: the call returns -2
 * and leaves hist unchanged (for N <= 2**30; beyond, earlier chunks are added).
 * With mm != NULL it also stores min(x), max(x) there (the same pass; meaningful when it
 * returns 0, i.e. no NaN).  Returns -1 if the counters cannot be allocated. */
#define HIST_BLOCK 512
#define HIST_FLUSH ((int64_t)1 << 30)
#define HIST_SPREAD 16 /* scratch slots for bin 0, one cache line apart */

#define HIST_INDEX(PRODUCT)                                                                          \
    _Pragma("omp simd reduction(min:mn) reduction(max:mx) reduction(+:z32) reduction(|:bad)")       \
    for (int32_t i = 0; i < (int32_t)m; i++) { /* int32 i and z32: 16 lanes, no int64 widening */    \
        float v = xb[i];                                                                             \
        mn = v < mn ? v : mn;                                                                        \
        mx = v > mx ? v : mx;                                                                        \
        PRODUCT_T p = PRODUCT;                                                                       \
        int ok = p < limit; /* false for NaN */                                                      \
        int32_t j = (int32_t)(ok ? p : (PRODUCT_T)0);                                                \
        z32 += (j == 0) & ok;                                                                        \
        bad |= !ok;                                                                                  \
        idx[i] = j == 0 ? spare + (int32_t)(i & (HIST_SPREAD - 1)) * 16 : j;                         \
    }

/* One thread's running counts: bins in uint32 (flushed into a float64 histogram before they could
 * wrap), bin 0 in an int64, the extremes and whether a value fell outside [0, nbins). */
typedef struct {
    uint32_t *counts; /* nbins + HIST_SPREAD * 16 (the bin-0 slots) */
    int64_t zeros;
    float mn, mx;
    int bad;
    uint16_t *sub;    /* HIST_SUBS x (nbins + HIST_SPREAD * 16) counters, drained into counts; or NULL */
    int64_t since;    /* values in sub since the last drain */
    int rot;          /* the copy the next value goes to */
} hist_acc;

/* Neighbouring activations of an image often fall in one bin (mobilenet_v2's: 1.6 values a run),
 * and counts[i]++ on one counter again and again waits on its own previous store.  A block whose
 * neighbours repeat that often (hist_runs: a third of the first 64 pairs or more) is counted in
 * HIST_SUBS uint16 copies of the counters in strict rotation (value g of the copies' stream into
 * copy g % HIST_SUBS), so a run does not chain; other blocks count into the uint32 counts directly,
 * which is faster there (the 35 KB of copies do not fit L1 beside the block).  Each copy holds at
 * most ceil(since / HIST_SUBS) counts, below 2**16 while since <= HIST_DRAIN_AT; hist_drain adds
 * them into counts before any read.  Past HIST_SUB_BINS bins there are no copies.  One batch of
 * mobilenet_v2's activations, 1 thread: 16.6 -> 14.3 ms; the same values shuffled and values
 * uniform over the range, where copies everywhere cost 35% and 45% more, within noise. */
#define HIST_SUBS 4
#define HIST_DRAIN_AT ((int64_t)HIST_SUBS * 65535 - HIST_SUBS)
#define HIST_SUB_BINS 8192
#define HIST_RUNS_PER 3

/* acc's counters, zeroed, for nbins bins; the copies come with the first block that needs them
 * (hist_count).  hist_acc_free releases both. */
static int hist_acc_alloc(hist_acc *acc, int64_t nbins) {
    acc->counts = calloc((size_t)(nbins + HIST_SPREAD * 16), sizeof(uint32_t));
    acc->sub = NULL;
    acc->since = 0;
    acc->rot = 0;
    return acc->counts != NULL;
}

static void hist_acc_free(hist_acc *acc) {
    free(acc->counts);
    free(acc->sub);
    acc->counts = NULL;
    acc->sub = NULL;
}

/* counts += the copies' counts; the copies restart at zero. */
static void hist_drain(hist_acc *acc, int64_t nbins) {
    if (!acc->since) return;
    const int64_t w = nbins + HIST_SPREAD * 16;
    uint32_t *restrict counts = acc->counts;
    uint16_t *restrict s = acc->sub;
    for (int64_t k = 0; k < w; k++)
        counts[k] += (uint32_t)s[k] + s[w + k] + s[2 * w + k] + s[3 * w + k];
    memset(s, 0, (size_t)(HIST_SUBS * w) * sizeof *s);
    acc->since = 0;
}

/* Do neighbours repeat in idx[0..k)?  At least one pair in HIST_RUNS_PER among the first 64. */
static int hist_runs(const int32_t *restrict idx, int64_t k) {
    const int64_t n = k < 65 ? k - 1 : 64;
    int64_t runs = 0, q = 0;
#ifdef __AVX512F__
    for (; q + 16 <= n; q += 16)
        runs += __builtin_popcount((unsigned)_mm512_cmpeq_epi32_mask(_mm512_loadu_si512(idx + q),
                                                                     _mm512_loadu_si512(idx + q + 1)));
#endif
    for (; q < n; q++) runs += idx[q] == idx[q + 1];
    return n > 0 && runs * HIST_RUNS_PER >= n;
}

/* counts[idx[q]] += 1 for q < k: directly, or through the copies when neighbours repeat (see above). */
static void hist_count(const int32_t *restrict idx, int64_t k, int64_t nbins, hist_acc *acc) {
    const int64_t w = nbins + HIST_SPREAD * 16;
    if (nbins > HIST_SUB_BINS || !hist_runs(idx, k)
        || (!acc->sub && !(acc->sub = calloc((size_t)(HIST_SUBS * w), sizeof(uint16_t))))) {
        uint32_t *restrict counts = acc->counts; /* (also when the copies cannot be allocated) */
        for (int64_t q = 0; q < k; q++) counts[idx[q]]++;
        return;
    }
    if (acc->since + k > HIST_DRAIN_AT) hist_drain(acc, nbins);
    uint16_t *restrict s = acc->sub;
    int64_t q = 0;
    int r = acc->rot;
    for (; q < k && r != 0; q++, r = (r + 1) % HIST_SUBS) s[r * w + idx[q]]++; /* to copy 0 first */
    for (; q + HIST_SUBS <= k; q += HIST_SUBS) {
        s[idx[q]]++;
        s[w + idx[q + 1]]++;
        s[2 * w + idx[q + 2]]++;
        s[3 * w + idx[q + 3]]++;
    }
    for (; q < k; q++, r++) s[r * w + idx[q]]++;
    acc->rot = r;
    acc->since += k;
}

#ifdef __AVX512F__
/* hist_bin with a float32 product, AVX-512: one pass over a block computes the extremes, the
 * indices and bin 0's count, and compresses the other indices into idx (the generic loop below
 * writes every index and drops bin 0's in a second pass over them).  The same counts, extremes
 * and bad flag: a lane counts only where p < nbins (false for NaN), min / max as v < mn ? v : mn
 * and v > mx ? v : mx lane by lane.  mobilenet_v2's activations, 1 thread: the index pass and the
 * compress 6.4-7.2 -> 4.6-6.1 ms a batch. */
static void hist_bin_f32x16(const float *restrict x, int64_t n, float pu32, int64_t nbins, hist_acc *acc) {
    int32_t idx[HIST_BLOCK + 16]; /* a store of 16 lanes at k <= i < HIST_BLOCK */
    __m512 mn = _mm512_set1_ps(acc->mn), mx = _mm512_set1_ps(acc->mx);
    const __m512 limit = _mm512_set1_ps((float)nbins), pu = _mm512_set1_ps(pu32);
    const __m512i zero = _mm512_setzero_si512();
    __mmask16 bad = 0;
    int64_t zeros = 0;
    for (int64_t b = 0; b < n; b += HIST_BLOCK) {
        const int32_t m = (int32_t)(n - b < HIST_BLOCK ? n - b : HIST_BLOCK);
        const float *restrict xb = x + b;
        int32_t k = 0, z = 0;
        for (int32_t i = 0; i < m; i += 16) {
            const __mmask16 in = m - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (m - i)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(in, xb + i);
            mn = _mm512_mask_min_ps(mn, in, v, mn);
            mx = _mm512_mask_max_ps(mx, in, v, mx);
            const __m512 p = _mm512_mul_ps(_mm512_abs_ps(v), pu);
            const __mmask16 ok = _mm512_mask_cmp_ps_mask(in, p, limit, _CMP_LT_OQ);
            const __m512i j = _mm512_cvttps_epi32(p); /* (meaningful in the ok lanes) */
            const __mmask16 nz = _mm512_mask_cmpneq_epi32_mask(ok, j, zero);
            bad |= in & ~ok;
            _mm512_storeu_si512(idx + k, _mm512_maskz_compress_epi32(nz, j));
            k += __builtin_popcount((unsigned)nz);
            z += __builtin_popcount((unsigned)(ok & ~nz));
        }
        zeros += z;
        hist_count(idx, k, nbins, acc);
    }
    acc->zeros += zeros;
    acc->mn = _mm512_reduce_min_ps(mn);
    acc->mx = _mm512_reduce_max_ps(mx);
    acc->bad |= bad != 0;
}
#endif

/* Bin the n (<= HIST_FLUSH) values x into acc (see qc_hist_abs_f32). */
static void hist_bin(const float *restrict x, int64_t n, double per_unit, int f32, int64_t nbins, hist_acc *acc) {
#ifdef __AVX512F__
    if (f32) {
        hist_bin_f32x16(x, n, (float)per_unit, nbins, acc);
        return;
    }
#endif
    int32_t idx[HIST_BLOCK];
    const float pu32 = (float)per_unit;
    const int32_t spare = (int32_t)nbins;
    float mn = acc->mn, mx = acc->mx;
    int64_t zeros = 0;
    int bad = 0;
    for (int64_t b = 0; b < n; b += HIST_BLOCK) {
        int64_t m = n - b < HIST_BLOCK ? n - b : HIST_BLOCK;
        const float *restrict xb = x + b;
        int32_t z32 = 0; /* this block's bin-0 count (int32 in the vector loop: ~30% faster) */
        if (f32) {
            const float limit = (float)nbins;
#define PRODUCT_T float
            HIST_INDEX(fabsf(v) * pu32)
#undef PRODUCT_T
        } else {
            const double limit = (double)nbins;
#define PRODUCT_T double
            HIST_INDEX((double)fabsf(v) * per_unit)
#undef PRODUCT_T
        }
        zeros += z32;
#ifdef __AVX512F__
        if (z32 * 8 >= m) { /* many zeros (after a ReLU about half): only the other bins are counted
                             * one by one.  In place: the store at k <= i ends at or before the 16
                             * lanes just read. */
            int64_t k = 0, i = 0;
            const __m512i first_spare = _mm512_set1_epi32(spare);
            for (; i + 16 <= m; i += 16) {
                const __m512i v = _mm512_loadu_si512(idx + i);
                const __mmask16 keep = _mm512_cmplt_epi32_mask(v, first_spare);
                _mm512_storeu_si512(idx + k, _mm512_maskz_compress_epi32(keep, v));
                k += __builtin_popcount((unsigned)keep);
            }
            for (; i < m; i++)
                if (idx[i] < spare) idx[k++] = idx[i];
            hist_count(idx, k, nbins, acc);
            continue;
        }
#endif
        hist_count(idx, m, nbins, acc);
    }
    acc->zeros += zeros;
    acc->mn = mn;
    acc->mx = mx;
    acc->bad |= bad;
}

/* hist += acc's counts (exact integers below 2**53); the counters restart at zero. */
static void hist_flush(hist_acc *acc, int64_t nbins, double *restrict hist) {
    hist_drain(acc, nbins);
    uint32_t *restrict counts = acc->counts;
    hist[0] += (double)acc->zeros; /* bin 0's elements went to the slots */
    for (int64_t k = 0; k < nbins; k++) {
        hist[k] += (double)counts[k];
        counts[k] = 0;
    }
    acc->zeros = 0;
}

QC_API int qc_hist_abs_f32(const float *restrict x, int64_t N, double per_unit, int f32, int64_t nbins,
                           double *restrict hist, float *restrict mm) {
    hist_acc acc = {NULL, 0, INFINITY, -INFINITY, 0, NULL, 0, 0};
    if (!hist_acc_alloc(&acc, nbins)) return -1;
    for (int64_t start = 0; start < N; start += HIST_FLUSH) {
        hist_bin(x + start, N - start < HIST_FLUSH ? N - start : HIST_FLUSH, per_unit, f32, nbins, &acc);
        if (acc.bad) {
            hist_acc_free(&acc);
            return -2;
        }
        hist_flush(&acc, nbins, hist);
    }
    hist_acc_free(&acc);
    if (mm) {
        mm[0] = acc.mn;
        mm[1] = acc.mx;
    }
    return 0;
}

/* ==== calibration kernels: histogram over threads, per-row min/max ==========================
 * qc_hist_abs_f32_mt: qc_hist_abs_f32 on up to `threads` threads.  The N values are cut into chunks
 * of `chunk` values and the work into `threads` parts; part p bins chunk p, then chunks taken one at
 * a time from a shared counter, into its own uint32 counters, flushed into its own zeroed float64
 * partial histogram, with its own min/max.  Every chunk is counted exactly once, into one partial;
 * the partials hold integer counts (< 2**53), so their sum is bit for bit one qc_hist_abs_f32 over
 * all N, whichever thread ran which part and took which chunk.
 *
 * Who runs the parts: with `omp` (torch's OpenMP GOMP_parallel, qcompiler/native/openmp.py) the
 * members of torch's own team, one part each (the caller runs any part no member took).  Right
 * after a torch op the team's workers are still spinning, so they start at once; the call returns
 * when every member has finished, as torch's parallel ops do.  With omp NULL the native pool
 * (qc_run_rows): a part no helper has started when the caller runs out of chunks is run by the
 * caller, so it waits only for parts already running.
 *
 * If any value is NaN or at or past the range, hist is left unchanged (whatever N) and the call
 * returns -2 (the other parts stop taking chunks); -1: out of memory (hist unchanged).  threads <= 1,
 * or a single chunk, is qc_hist_abs_f32 itself.  chunk outside [1, 2**30] means 2**30.  used (may be
 * NULL): how many threads binned values, the caller's included (tests and benchmarks: did the other
 * threads take part). */
typedef struct {
    const float *x;
    int64_t N, chunk, nchunks;
    double per_unit;
    int f32;
    int64_t nbins;
    double *partial;  /* parts x nbins, zeroed */
    float *mm;        /* parts x 2 */
    int64_t next;     /* the next chunk to take (parts..nchunks-1: chunk p is part p's first) */
    int parts, taken; /* team members take part indices from `taken` */
    int bad, nomem;
    pthread_t *ran;   /* parts: the thread that ran each part */
} hist_job;

/* Part `part`: run once, on one thread (qc_run_rows gives each call a disjoint [part, part_end)):
 * the partial histogram and min/max of index `part` belong to this call alone. */
static int hist_part(void *ctx, int64_t part, int64_t part_end) {
    (void)part_end;
    hist_job *j = ctx;
    double *hist = j->partial + part * j->nbins;
    hist_acc acc = {NULL, 0, INFINITY, -INFINITY, 0, NULL, 0, 0};
    int64_t unflushed = 0;
    for (int64_t i = part;; i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) {
        if (i >= j->nchunks || __atomic_load_n(&j->bad, __ATOMIC_RELAXED)) break;
        if (!acc.counts) {
            if (!hist_acc_alloc(&acc, j->nbins)) {
                __atomic_store_n(&j->nomem, 1, __ATOMIC_RELAXED);
                __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
                break;
            }
        }
        const int64_t lo = i * j->chunk, n = j->N - lo < j->chunk ? j->N - lo : j->chunk;
        if (unflushed + n > HIST_FLUSH) { /* the uint32 counters stay at most 2**30 */
            hist_flush(&acc, j->nbins, hist);
            unflushed = 0;
        }
        hist_bin(j->x + lo, n, j->per_unit, j->f32, j->nbins, &acc);
        unflushed += n;
        if (acc.bad) {
            __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    if (acc.counts) {
        hist_flush(&acc, j->nbins, hist);
        hist_acc_free(&acc);
    }
    j->ran[part] = pthread_self();
    j->mm[2 * part] = acc.mn;
    j->mm[2 * part + 1] = acc.mx;
    return 0;
}

/* A member of torch's OpenMP team (the caller included) takes parts until none is left. */
static void hist_omp_member(void *ctx) {
    hist_job *j = ctx;
    for (int p; (p = __atomic_fetch_add(&j->taken, 1, __ATOMIC_RELAXED)) < j->parts;) hist_part(j, p, p + 1);
}

QC_API int qc_hist_abs_f32_mt(const float *restrict x, int64_t N, double per_unit, int f32, int64_t nbins,
                              double *restrict hist, float *restrict mm, int threads, int64_t chunk, void *omp,
                              int32_t *used) {
    if (chunk < 1 || chunk > HIST_FLUSH) chunk = HIST_FLUSH;
    const int64_t nchunks = (N + chunk - 1) / chunk;
    if (threads > QC_MAX_PARTS) threads = QC_MAX_PARTS;
    if (threads > nchunks) threads = (int)nchunks;
    if (used) *used = 1;
    if (threads <= 1) return qc_hist_abs_f32(x, N, per_unit, f32, nbins, hist, mm);
    double *partial = calloc((size_t)threads * (size_t)nbins, sizeof(double));
    float pmm[2 * QC_MAX_PARTS];
    if (!partial) return -1;
    pthread_t ran[QC_MAX_PARTS];
    hist_job job = {x, N, chunk, nchunks, per_unit, f32, nbins, partial, pmm, threads, threads, 0, 0, 0, ran};
    if (omp) {
        ((qc_omp_parallel_fn)omp)(hist_omp_member, &job, (unsigned)threads, 0);
        hist_omp_member(&job); /* parts no member took (a smaller team than asked for) */
    } else {
        qc_run_rows(hist_part, &job, 0, threads, threads, 1);
    }
    int rc = job.nomem ? -1 : (job.bad ? -2 : 0);
    if (rc == 0) {
        float mn = INFINITY, mx = -INFINITY;
        for (int t = 0; t < threads; t++) {
            const double *pt = partial + (int64_t)t * nbins;
            for (int64_t k = 0; k < nbins; k++) hist[k] += pt[k];
            mn = pmm[2 * t] < mn ? pmm[2 * t] : mn;
            mx = pmm[2 * t + 1] > mx ? pmm[2 * t + 1] : mx;
        }
        if (mm) {
            mm[0] = mn;
            mm[1] = mx;
        }
    }
    if (used) { /* distinct threads among the parts' (every part bins at least its first chunk) */
        *used = 0;
        for (int t = 0; t < threads; t++) {
            int seen = 0;
            for (int u = 0; u < t && !seen; u++) seen = pthread_equal(ran[u], ran[t]);
            *used += !seen;
        }
    }
    free(partial);
    return rc;
}

/* Per-row min and max of a (rows, cols) float32 matrix, row-major (a weight's output channels):
 * lo[r] = min_c x[r, c], hi[r] = max_c x[r, c]; with old_lo / old_hi (non-NULL: a per-channel weight
 * observer's later batches) merged into those running ones, lo[r] = min(old_lo[r], ...), hi[r] =
 * max(old_hi[r], ...): the values torch.minimum / maximum give on the plain result (of two equal
 * extremes, i.e. +0 and -0, the old one is kept), in one call instead of the pass and two torch ops.
 * lo, hi are the caller's fresh buffers (not old_lo, old_hi).  Returns -2 when a value is NaN or an
 * extreme is infinite (the observer's NaN/Inf check; lo, hi are then meaningless), else 0. */
QC_API int qc_rows_minmax_f32(const float *restrict x, int64_t rows, int64_t cols, const float *restrict old_lo,
                              const float *restrict old_hi, float *restrict lo, float *restrict hi) {
    int bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * cols;
        float mn = INFINITY, mx = -INFINITY;
        int nan = 0;
        _Pragma("omp simd reduction(min:mn) reduction(max:mx) reduction(|:nan)")
        for (int64_t c = 0; c < cols; c++) {
            float v = xr[c];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            nan |= v != v;
        }
        bad |= nan | !isfinite(mn) | !isfinite(mx);
        lo[r] = old_lo && !(mn < old_lo[r]) ? old_lo[r] : mn;
        hi[r] = old_hi && !(mx > old_hi[r]) ? old_hi[r] : mx;
    }
    return bad ? -2 : 0;
}
/* qc_hist_abs_grow_f32: the histogram of a batch whose range is not known yet (an observer's first
 * batch, or one past its range), with the range found in the same pass instead of a min/max pass
 * over all N values first.  The grid is [0, 2**e) with nbins bins (per_unit = nbins * 2**-e); e0 is
 * the observer's grid on entry (QC_HIST_NO_RANGE: only zeros seen so far, which sit in bin 0 on any
 * grid).  Each chunk of `chunk` values is binned on the part's current grid (hist_bin: values at or
 * past 2**e are left out and flagged); a flagged chunk is read again from cache for its min/max (NaN /
 * Inf: -2), the part's counts are merged onto the grid 2**e' (e' = frexp's exponent of the chunk's
 * max |x|: max|x| < 2**e' <= 2 max|x|, what the observer's _grow picks) by bin i -> i >> (e' - e),
 * and the values left out are counted on it.  (A part with no grid yet reads its first chunk with a
 * non-zero value for the range first.)
 * floor(floor(y) / 2**k) = floor(y / 2**k), so a count merged
 * later equals the count binned on the final grid from the start: the result is the histogram of
 * all N values on the final grid, bit for bit, whatever the chunk order or split.  Parts as in
 * qc_hist_abs_f32_mt (each into its own partial, merged onto the widest part's grid at the end).
 * hist (nbins float64: the caller's counts on the grid 2**e0; with QC_HIST_NO_RANGE only bin 0 may
 * hold any) is moved onto the final grid the same way and gets the counts; *e_out is that grid's
 * exponent (QC_HIST_NO_RANGE if e0 is and every value is zero), mm[0..1] min(x), max(x).  Returns -2
 * if a value is NaN or infinite, -1 out of memory: hist is then unchanged (the parts count into
 * their own partials; hist is touched only at the end). */
#define QC_HIST_NO_RANGE INT32_MIN

typedef struct {
    const float *x;
    int64_t N, chunk, nchunks, nbins;
    int e0;
    double *partial; /* parts x nbins, zeroed */
    int *e;          /* parts: each part's grid */
    float *mm;       /* parts x 2 */
    int64_t next;
    int parts, taken;
    int bad, nomem;
    pthread_t *ran;
} hist_grow_job;

/* per_unit = nbins * 2**-e, and whether the float32 product is exact (as the Python side decides) */
static double hist_per_unit(int64_t nbins, int e, int *f32) {
    const double pu = ldexp((double)nbins, -e);
    int ex;
    *f32 = frexp(pu, &ex) == 0.5 && pu >= 0x1p-126 && pu <= 0x1p127;
    return pu;
}

/* the counts (nbins entries) moved from the grid 2**from onto 2**to (to > from): bin i -> i >> k */
#define HIST_COARSEN(T, c, nbins, k)                                                                 \
    do {                                                                                             \
        if ((k) >= 62) {                                                                             \
            for (int64_t i_ = 1; i_ < (nbins); i_++) { (c)[0] += (c)[i_]; (c)[i_] = 0; }             \
        } else {                                                                                     \
            for (int64_t i_ = 1; i_ < (nbins); i_++) {                                               \
                const T t_ = (c)[i_];                                                                \
                (c)[i_] = 0;                                                                         \
                (c)[i_ >> (k)] += t_;                                                                \
            }                                                                                        \
        }                                                                                            \
    } while (0)

/* min, max and NaN of n values (a chunk, read again right after from cache) */
static int hist_scan(const float *restrict x, int64_t n, float *mn_out, float *mx_out) {
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    _Pragma("omp simd reduction(min:mn) reduction(max:mx) reduction(|:nan)")
    for (int64_t c = 0; c < n; c++) {
        const float v = x[c];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        nan |= v != v;
    }
    *mn_out = mn;
    *mx_out = mx;
    return nan || !isfinite(mn) || !isfinite(mx);
}

/* frexp's exponent of max(-mn, mx): max|x| < 2**e <= 2 max|x| (what the observer's _grow picks);
 * QC_HIST_NO_RANGE when every value is zero */
static int hist_exponent(float mn, float mx) {
    const double amax = -(double)mn > (double)mx ? -(double)mn : (double)mx;
    int e = QC_HIST_NO_RANGE;
    if (amax > 0.0) frexp(amax, &e);
    return e;
}

static int hist_grow_part(void *ctx, int64_t part, int64_t part_end) {
    (void)part_end;
    hist_grow_job *j = ctx;
    const int64_t nbins = j->nbins;
    double *hist = j->partial + part * nbins;
    hist_acc acc = {NULL, 0, INFINITY, -INFINITY, 0, NULL, 0, 0};
    int e = j->e0, f32 = 0, flushed = 0;
    double per_unit = e == QC_HIST_NO_RANGE ? 0.0 : hist_per_unit(nbins, e, &f32);
    int64_t unflushed = 0;
    for (int64_t i = part;; i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) {
        if (i >= j->nchunks || __atomic_load_n(&j->bad, __ATOMIC_RELAXED)) break;
        if (!acc.counts) {
            if (!hist_acc_alloc(&acc, nbins)) {
                __atomic_store_n(&j->nomem, 1, __ATOMIC_RELAXED);
                __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
                break;
            }
        }
        const int64_t lo = i * j->chunk, n = j->N - lo < j->chunk ? j->N - lo : j->chunk;
        const float *restrict xc = j->x + lo;
        float mn, mx;
        if (unflushed + n > HIST_FLUSH) {
            hist_flush(&acc, nbins, hist);
            unflushed = 0;
            flushed = 1;
        }
        unflushed += n;
        if (e == QC_HIST_NO_RANGE) { /* no grid yet (only zeros so far): this chunk's range first */
            if (hist_scan(xc, n, &mn, &mx)) {
                __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
                break;
            }
            acc.mn = mn < acc.mn ? mn : acc.mn;
            acc.mx = mx > acc.mx ? mx : acc.mx;
            e = hist_exponent(mn, mx);
            if (e == QC_HIST_NO_RANGE) {
                acc.zeros += n;
                continue;
            }
            per_unit = hist_per_unit(nbins, e, &f32);
        }
        /* optimistic: bin on the current grid; values at or past 2**e (or NaN) are not counted and
         * set acc.bad, every other value is counted */
        hist_bin(xc, n, per_unit, f32, nbins, &acc);
        if (!acc.bad) continue;
        acc.bad = 0;
        if (hist_scan(xc, n, &mn, &mx)) { /* NaN or Inf: the caller's checked path */
            __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
            break;
        }
        const int ce = hist_exponent(mn, mx);
        if (ce == QC_HIST_NO_RANGE || ce <= e) { /* cannot happen: a value was out of range */
            __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
            break;
        }
        /* the counts so far onto the grid 2**ce (bin i -> i >> k), then the values hist_bin left
         * out (|v| >= 2**e), counted on it: the counts of the whole chunk on the new grid */
        hist_drain(&acc, nbins);
        HIST_COARSEN(uint32_t, acc.counts, nbins, ce - e);
        if (flushed) HIST_COARSEN(double, hist, nbins, ce - e);
        const double old_edge = ldexp(1.0, e);
        e = ce;
        per_unit = hist_per_unit(nbins, e, &f32);
        for (int64_t c = 0; c < n; c++) {
            const double a = (double)fabsf(xc[c]);
            if (a >= old_edge) acc.counts[(int64_t)(a * per_unit)]++; /* exact: 24 + 21 bits */
        }
    }
    if (acc.counts) {
        hist_flush(&acc, nbins, hist);
        hist_acc_free(&acc);
    }
    j->ran[part] = pthread_self();
    j->e[part] = e;
    j->mm[2 * part] = acc.mn;
    j->mm[2 * part + 1] = acc.mx;
    return 0;
}

static void hist_grow_omp_member(void *ctx) {
    hist_grow_job *j = ctx;
    for (int p; (p = __atomic_fetch_add(&j->taken, 1, __ATOMIC_RELAXED)) < j->parts;) hist_grow_part(j, p, p + 1);
}

QC_API int qc_hist_abs_grow_f32(const float *restrict x, int64_t N, int e0, int64_t nbins, double *restrict hist,
                                float *restrict mm, int32_t *e_out, int threads, int64_t chunk, void *omp,
                                int32_t *used) {
    if (chunk < 1 || chunk > HIST_FLUSH) chunk = HIST_FLUSH;
    const int64_t nchunks = (N + chunk - 1) / chunk;
    if (threads > QC_MAX_PARTS) threads = QC_MAX_PARTS;
    if (threads > nchunks) threads = (int)nchunks;
    if (threads < 1) threads = 1;
    double *partial = calloc((size_t)threads * (size_t)nbins, sizeof(double));
    if (!partial) return -1;
    float pmm[2 * QC_MAX_PARTS];
    int pe[QC_MAX_PARTS];
    pthread_t ran[QC_MAX_PARTS];
    hist_grow_job job = {x, N, chunk, nchunks, nbins, e0, partial, pe, pmm, threads, threads, 0, 0, 0, ran};
    if (threads == 1) {
        hist_grow_part(&job, 0, 1);
    } else if (omp) {
        ((qc_omp_parallel_fn)omp)(hist_grow_omp_member, &job, (unsigned)threads, 0);
        hist_grow_omp_member(&job);
    } else {
        qc_run_rows(hist_grow_part, &job, 0, threads, threads, 1);
    }
    int rc = job.nomem ? -1 : (job.bad ? -2 : 0);
    if (rc == 0) {
        int e = e0;
        float mn = INFINITY, mx = -INFINITY;
        for (int t = 0; t < threads; t++) {
            if (pe[t] != QC_HIST_NO_RANGE && (e == QC_HIST_NO_RANGE || pe[t] > e)) e = pe[t];
            mn = pmm[2 * t] < mn ? pmm[2 * t] : mn;
            mx = pmm[2 * t + 1] > mx ? pmm[2 * t + 1] : mx;
        }
        if (e0 != QC_HIST_NO_RANGE && e > e0) HIST_COARSEN(double, hist, nbins, e - e0);
        for (int t = 0; t < threads; t++) {
            double *pt = partial + (int64_t)t * nbins;
            if (pe[t] != QC_HIST_NO_RANGE && pe[t] < e) HIST_COARSEN(double, pt, nbins, e - pe[t]);
            for (int64_t k = 0; k < nbins; k++) hist[k] += pt[k];
        }
        mm[0] = mn;
        mm[1] = mx;
        *e_out = e;
    }
    if (used) {
        *used = 0;
        for (int t = 0; t < threads; t++) {
            int seen = 0;
            for (int u = 0; u < t && !seen; u++) seen = pthread_equal(ran[u], ran[t]);
            *used += !seen;
        }
    }
    free(partial);
    return rc;
}
/* qc_hist_observe_f32: one batch of a HistogramObserver (observer.py, _observe_native) as
 * qc_hist_abs_grow_f32, with the observer's state read and written through pointers instead of
 * passed as values, so the Python around the call makes no tensor calls (inside a model each cost
 * 5-10 us: the convs between two observers evict the interpreter's and torch's code and data).
 * The grid comes from *hist_max: 0 is QC_HIST_NO_RANGE, 2**E gives e0 = E; anything else, or E
 * outside [-200, 200], returns -3 with nothing else read and nothing changed (a state loaded from
 * elsewhere: the caller's checked path).  On success (0) hist holds the counts on the grid e_out[1]
 * (e_out[0] = e0; the caller records a wider grid), and *min_val / *max_val take the batch's min / max
 * where these are below / above them (a NaN held there stays).  -2 (a NaN or Inf in x) and -1 (out of
 * memory) leave everything unchanged. */
QC_API int qc_hist_observe_f32(const float *restrict x, int64_t N, int64_t nbins, double *restrict hist,
                               const double *hist_max, float *min_val, float *max_val, int threads, int64_t chunk,
                               void *omp, int32_t *e_out) {
    const double r = *hist_max;
    int e0 = QC_HIST_NO_RANGE;
    if (r != 0.0) {
        int ex;
        if (frexp(r, &ex) != 0.5 || ex - 1 < -200 || ex - 1 > 200) return -3;
        e0 = ex - 1;
    }
    float mm[2];
    int32_t e;
    const int rc = qc_hist_abs_grow_f32(x, N, e0, nbins, hist, mm, &e, threads, chunk, omp, NULL);
    if (rc) return rc;
    if (mm[0] < *min_val) *min_val = mm[0];
    if (mm[1] > *max_val) *max_val = mm[1];
    e_out[0] = e0;
    e_out[1] = e;
    return 0;
}
/* ==== end of calibration kernels =========================================================== */

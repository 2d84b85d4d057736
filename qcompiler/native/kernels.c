/* qcompiler's native kernels: plain C, no Python or torch headers, called through ctypes.
 *
 * Every kernel keeps no state between calls and writes only to the buffers it is given, so it
 * may run on several threads at once (ctypes releases the GIL).  All are single-threaded but the
 * *_mt calls, which split their work over a small pool of helper threads (qc_run_rows).
 * The Python side (qcompiler/native/kernels.py) checks dtypes, contiguity and sizes.
 *
 * Exactness: the requantization is integer arithmetic (int64, or __int128 where the caller
 * cannot prove int64 wide enough); the histogram bins |x| with a float64 product that is exact
 * (24-bit significand times a power of two or a small integer over one).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define QC_API __attribute__((visibility("default")))

QC_API int qc_abi_version(void) { return 1; }

/* round_half_even(x / 2**s) without branches, for the vectorizer: x + (2**(s-1) - 1) + (bit s of x),
 * shifted right by s (floor).  With x = q*2**s + r: r > half carries, r < half does not, r == half
 * carries exactly when q is odd.  s == 0 takes hm1 = 0, pm = 0 (x itself).  hm1[c], pm[c] are
 * precomputed per channel by round_consts(). */
static int round_consts(const int64_t *n, int64_t O, int64_t *hm1, int64_t *pm) {
    for (int64_t c = 0; c < O; c++) {
        hm1[c] = n[c] > 0 ? ((int64_t)1 << (n[c] - 1)) - 1 : 0;
        pm[c] = n[c] > 0 ? 1 : 0;
    }
    return 0;
}

/* clamp(round_half_even(x / 2**s), lo, hi), with hm1 = 2**(s-1) - 1 and pm = 1 (0 for s == 0) as
 * round_consts() makes them; inline, so the loops that call it still vectorize. */
static inline int64_t round_clamp(int64_t x, int64_t hm1, int64_t pm, int64_t s, int64_t lo, int64_t hi) {
    int64_t q = (x + hm1 + ((x >> s) & pm)) >> s;
    q = q < lo ? lo : q;
    return q > hi ? hi : q;
}

/* Requantize P rows of O channels (row-major, channels last):
 *   out[p, c] = clamp(round_half_even(acc[p, c] * M[c] / 2**n[c]), lo, hi)
 * acc holds exact integers (float32 or float64 storage); out is int8 or int16.
 * The caller proves |acc * M| < 2**62 (so the rounding addend cannot overflow either). */
#define REQ_FN(NAME, ACC_T, OUT_T)                                                                       \
    QC_API int NAME(const ACC_T *restrict acc, int64_t P, int64_t O, const int64_t *restrict M,           \
                    const int64_t *restrict n, int64_t lo, int64_t hi, OUT_T *restrict out) {             \
        int64_t *hm1 = malloc(sizeof(int64_t) * (size_t)(2 * O + 1));                                     \
        if (!hm1) return -1;                                                                              \
        int64_t *restrict pm = hm1 + O;                                                                   \
        round_consts(n, O, hm1, pm);                                                                      \
        for (int64_t p = 0; p < P; p++) {                                                                 \
            const ACC_T *restrict a = acc + p * O;                                                        \
            OUT_T *restrict o = out + p * O;                                                              \
            for (int64_t c = 0; c < O; c++) {                                                             \
                int64_t x = (int64_t)a[c] * M[c];                                                         \
                o[c] = (OUT_T)round_clamp(x, hm1[c], pm[c], n[c], lo, hi);                                \
            }                                                                                             \
        }                                                                                                 \
        free(hm1);                                                                                        \
        return 0;                                                                                         \
    }

REQ_FN(qc_requant_f32_i8, float, int8_t)
REQ_FN(qc_requant_f32_i16, float, int16_t)
REQ_FN(qc_requant_f64_i8, double, int8_t)
REQ_FN(qc_requant_f64_i16, double, int16_t)

/* With a fused add of an integer operand b (int8 or int16, same P x O layout):
 *   out = clamp(round_half_even(acc*M[c]/2**n[c] + b*Mb/2**nb), lo, hi), one rounding.
 * Both terms are brought to the denominator 2**s, s = max(n[c], nb): X = acc*M*2**(s-n) +
 * b*Mb*2**(s-nb).  wide == 0: the caller proved |X| < 2**62 (int64); else __int128 (the
 * caller keeps shifts <= 62 and |acc*M|, |b*Mb| < 2**62, so |X| < 2**126). */
#define REQ_ADD_FN(NAME, ACC_T, B_T, OUT_T)                                                              \
    QC_API int NAME(const ACC_T *restrict acc, int64_t P, int64_t O, const int64_t *restrict M,           \
                    const int64_t *restrict n, const B_T *restrict b, int64_t Mb, int64_t nb, int64_t lo,  \
                    int64_t hi, int wide, OUT_T *restrict out) {                                          \
        int64_t *sa = malloc(sizeof(int64_t) * (size_t)(4 * O + 1));                                      \
        if (!sa) return -1;                                                                               \
        int64_t *restrict sb = sa + O, *restrict ss = sa + 2 * O, *restrict hm1 = sa + 3 * O;             \
        for (int64_t c = 0; c < O; c++) {                                                                 \
            ss[c] = n[c] > nb ? n[c] : nb;                                                                \
            sa[c] = ss[c] - n[c];                                                                         \
            sb[c] = ss[c] - nb;                                                                           \
            hm1[c] = ss[c] > 0 ? ((int64_t)1 << (ss[c] - 1)) - 1 : 0;                                     \
        }                                                                                                 \
        for (int64_t p = 0; p < P && !wide; p++) {                                                        \
            const ACC_T *restrict a = acc + p * O;                                                        \
            const B_T *restrict bb = b + p * O;                                                           \
            OUT_T *restrict o = out + p * O;                                                              \
            for (int64_t c = 0; c < O; c++) {                                                             \
                int64_t x = (((int64_t)a[c] * M[c]) << sa[c]) + (((int64_t)bb[c] * Mb) << sb[c]);         \
                o[c] = (OUT_T)round_clamp(x, hm1[c], ss[c] > 0, ss[c], lo, hi);                           \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t p = 0; p < P && wide; p++) {                                                         \
            const ACC_T *a = acc + p * O;                                                                 \
            const B_T *bb = b + p * O;                                                                    \
            OUT_T *o = out + p * O;                                                                       \
            for (int64_t c = 0; c < O; c++) {                                                             \
                int s = (int)ss[c];                                                                       \
                __int128 x = ((__int128)((int64_t)a[c] * M[c]) << sa[c])                                  \
                           + ((__int128)((int64_t)bb[c] * Mb) << sb[c]);                                  \
                __int128 q = x >> s;                                                                      \
                __int128 r = x - (q << s);                                                                \
                __int128 half = ((__int128)1 << s) >> 1;                                                  \
                q += (r > half) || (r == half && half > 0 && (q & 1));                                    \
                o[c] = (OUT_T)(q < lo ? lo : (q > hi ? hi : (int64_t)q));                                 \
            }                                                                                             \
        }                                                                                                 \
        free(sa);                                                                                         \
        return 0;                                                                                         \
    }

REQ_ADD_FN(qc_requant_add_f32_i8_i8, float, int8_t, int8_t)
REQ_ADD_FN(qc_requant_add_f32_i16_i8, float, int16_t, int8_t)
REQ_ADD_FN(qc_requant_add_f32_i8_i16, float, int8_t, int16_t)
REQ_ADD_FN(qc_requant_add_f32_i16_i16, float, int16_t, int16_t)
REQ_ADD_FN(qc_requant_add_f64_i8_i8, double, int8_t, int8_t)
REQ_ADD_FN(qc_requant_add_f64_i16_i8, double, int16_t, int8_t)
REQ_ADD_FN(qc_requant_add_f64_i8_i16, double, int8_t, int16_t)
REQ_ADD_FN(qc_requant_add_f64_i16_i16, double, int16_t, int16_t)

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
#define QC_MAX_PARTS 16
typedef int (*qc_rows_fn)(void *ctx, int64_t r0, int64_t r1);
/* The rows are cut into QC_CHUNKS_PER_PART chunks per part, taken one at a time from a shared
 * counter by every thread of the call: a helper that starts late, or shares its core with another
 * process (a runtime's spinning threads), leaves more chunks to the others, and the caller never
 * waits for more than the chunk a helper is in. */
#define QC_CHUNKS_PER_PART 2
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
static int64_t qc_now_ns(void) {
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

static int qc_run_rows(qc_rows_fn fn, void *ctx, int64_t m0, int64_t m1, int parts, int64_t align) {
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

typedef void (*qc_omp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

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


/* Quantize on entering the BPU (fixed_point.quantize, per-tensor scale): out[i] =
 * clamp(round_half_even(x[i] / s), lo, hi) for N float32 values, int8 / int16 out.  The division is
 * the IEEE float32 one torch does; the clamp to the integers [lo, hi] commutes with rounding, and
 * nearbyintf rounds half to even (the default rounding mode); inf clamps to lo / hi as torch's clamp
 * does.  Returns 1 if some x is NaN (out is then unspecified: the caller raises), else 0. */
#define QUANT_FN(NAME, OUT_T)                                                                            \
    QC_API int NAME(const float *restrict x, int64_t N, float s, float lo, float hi, OUT_T *restrict out) { \
        int nan = 0;                                                                                      \
        _Pragma("omp simd reduction(|:nan)")                                                              \
        for (int64_t i = 0; i < N; i++) {                                                                 \
            float v = x[i] / s;                                                                           \
            nan |= v != v;                                                                                \
            v = v < lo ? lo : v;                                                                          \
            v = v > hi ? hi : v;                                                                          \
            out[i] = (OUT_T)(int32_t)nearbyintf(v);                                                       \
        }                                                                                                 \
        return nan;                                                                                       \
    }

QUANT_FN(qc_quantize_i8, int8_t)
QUANT_FN(qc_quantize_i16, int16_t)

/* The same per value, from an NCHW float32 input (N images of C planes of P = H * W values) into an
 * NHWC output, out[(n * P + p) * C + c] = q(x[(n * C + c) * P + p]): the model input quantized
 * straight into the layout the native convs read (no int8 transposition after it).  Per block of
 * QUANT_BLOCK positions, each plane is quantized by qc_quantize_* above into a small buffer,
 * then the planes are interleaved (the division stays vectorized; only the byte moves are strided). */
#define QUANT_BLOCK 256
#define QUANT_INTERLEAVE(CC)                                                                             \
    for (int64_t p = 0; p < len; p++)                                                                     \
        for (int64_t c = 0; c < (CC); c++) op[p * (CC) + c] = tmp[c * QUANT_BLOCK + p];
#define QUANT_NHWC_FN(NAME, OUT_T, PLANE_FN)                                                             \
    QC_API int NAME(const float *restrict x, int64_t N, int64_t C, int64_t P, float s, float lo, float hi, \
                    OUT_T *restrict out) {                                                                \
        OUT_T *tmp = malloc(sizeof(OUT_T) * (size_t)(C * QUANT_BLOCK + 1));                               \
        if (!tmp) return -1;                                                                              \
        int nan = 0;                                                                                      \
        for (int64_t n = 0; n < N; n++)                                                                   \
            for (int64_t p0 = 0; p0 < P; p0 += QUANT_BLOCK) {                                             \
                const int64_t len = P - p0 < QUANT_BLOCK ? P - p0 : QUANT_BLOCK;                          \
                for (int64_t c = 0; c < C; c++) /* the plane's block, as qc_quantize_* quantizes it */   \
                    nan |= PLANE_FN(x + (n * C + c) * P + p0, len, s, lo, hi, tmp + c * QUANT_BLOCK);    \
                OUT_T *restrict op = out + (n * P + p0) * C;                                              \
                switch (C) { /* image inputs: the channel count a compile-time constant */                \
                case 3: QUANT_INTERLEAVE(3) break;                                                        \
                case 4: QUANT_INTERLEAVE(4) break;                                                        \
                default: QUANT_INTERLEAVE(C) break;                                                       \
                }                                                                                         \
            }                                                                                             \
        free(tmp);                                                                                        \
        return nan;                                                                                       \
    }

QUANT_NHWC_FN(qc_quantize_nhwc_i8, int8_t, qc_quantize_i8)
QUANT_NHWC_FN(qc_quantize_nhwc_i16, int16_t, qc_quantize_i16)

/* Depthwise int8 convolution (one filter per channel), channels-last, with the requantization:
 *   acc[n, o, p, c] = bias[c] + sum_{i, j} x[n, o*sh - ph + i*dh, p*sw - pw + j*dw, c] * w[i, j, c]
 * (taps outside the input are zeros: the int8 zero point is 0), in int32 -- the caller proves
 * 128 * max_c sum |w[., ., c]| + max |bias| < 2**31, so no sum can wrap --, then per channel
 *   out = clamp(round_half_even(acc * M[c] / 2**n[c]), lo, hi)
 * in int64 as qc_requant_* (the caller proves |acc * M| < 2**62).  x: (N, H, W, C) int8;
 * w: (kh*kw, C) int32; bias: C int32 or NULL; out: (N, Ho, Wo, C) int8 or int16. */
#define DW_FN(NAME, OUT_T)                                                                               \
    QC_API int NAME(const int8_t *restrict x, int64_t N, int64_t H, int64_t W, int64_t C,                  \
                    const int32_t *restrict w, int64_t kh, int64_t kw, const int32_t *restrict bias,        \
                    int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t Ho,     \
                    int64_t Wo, const int64_t *restrict M, const int64_t *restrict n, int64_t lo,           \
                    int64_t hi, OUT_T *restrict out) {                                                    \
        int64_t *hm1 = malloc(sizeof(int64_t) * (size_t)(2 * C + 1));                                     \
        int32_t *acc = malloc(sizeof(int32_t) * (size_t)(C + 1));                                         \
        if (!hm1 || !acc) {                                                                               \
            free(hm1);                                                                                    \
            free(acc);                                                                                    \
            return -1;                                                                                    \
        }                                                                                                 \
        int64_t *restrict pm = hm1 + C;                                                                   \
        round_consts(n, C, hm1, pm);                                                                      \
        for (int64_t b = 0; b < N; b++)                                                                   \
            for (int64_t oh = 0; oh < Ho; oh++)                                                           \
                for (int64_t ow = 0; ow < Wo; ow++) {                                                     \
                    int32_t *restrict a = acc;                                                            \
                    if (bias)                                                                             \
                        for (int64_t c = 0; c < C; c++) a[c] = bias[c];                                   \
                    else                                                                                  \
                        for (int64_t c = 0; c < C; c++) a[c] = 0;                                         \
                    for (int64_t i = 0; i < kh; i++) {                                                    \
                        int64_t ih = oh * sh - ph + i * dh;                                               \
                        if (ih < 0 || ih >= H) continue;                                                  \
                        for (int64_t j = 0; j < kw; j++) {                                                \
                            int64_t iw = ow * sw - pw + j * dw;                                           \
                            if (iw < 0 || iw >= W) continue;                                              \
                            const int8_t *restrict xp = x + ((b * H + ih) * W + iw) * C;                  \
                            const int32_t *restrict wp = w + (i * kw + j) * C;                            \
                            for (int64_t c = 0; c < C; c++) a[c] += (int32_t)xp[c] * wp[c];               \
                        }                                                                                 \
                    }                                                                                     \
                    OUT_T *restrict o = out + ((b * Ho + oh) * Wo + ow) * C;                              \
                    for (int64_t c = 0; c < C; c++) {                                                     \
                        int64_t v = (int64_t)a[c] * M[c];                                                 \
                        o[c] = (OUT_T)round_clamp(v, hm1[c], pm[c], n[c], lo, hi);                        \
                    }                                                                                     \
                }                                                                                         \
        free(hm1);                                                                                        \
        free(acc);                                                                                        \
        return 0;                                                                                         \
    }

DW_FN(qc_dwconv_i8_i8, int8_t)
DW_FN(qc_dwconv_i8_i16, int16_t)

/* One input of a concatenation, requantized into its columns of the output:
 *   dst[r, col0 + c] = clamp(round_half_even(src[r, c] * M / 2**n), lo, hi)
 * src: (rows, cols) int8/int16 contiguous; dst: rows of dst_stride elements (int8/int16).
 * The caller keeps |src| * M below 2**62 and n in [0, 62]; M = 1, n = 0 copies. */
#define CAT_FN(NAME, IN_T, OUT_T)                                                                        \
    QC_API void NAME(const IN_T *restrict src, int64_t rows, int64_t cols, OUT_T *restrict dst,            \
                     int64_t dst_stride, int64_t M, int64_t n, int64_t lo, int64_t hi) {                  \
        const int64_t hm1 = n > 0 ? ((int64_t)1 << (n - 1)) - 1 : 0, pm = n > 0;                          \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const IN_T *restrict s = src + r * cols;                                                      \
            OUT_T *restrict d = dst + r * dst_stride;                                                     \
            for (int64_t c = 0; c < cols; c++) {                                                          \
                int64_t v = (int64_t)s[c] * M;                                                            \
                d[c] = (OUT_T)round_clamp(v, hm1, pm, n, lo, hi);                                         \
            }                                                                                             \
        }                                                                                                 \
    }

CAT_FN(qc_cat_i8_i8, int8_t, int8_t)
CAT_FN(qc_cat_i8_i16, int8_t, int16_t)
CAT_FN(qc_cat_i16_i8, int16_t, int8_t)
CAT_FN(qc_cat_i16_i16, int16_t, int16_t)

/* ==== bilinear resize (exact dyadic weights) ============================================== */
/* out = clamp(round_half_even(Y * rD), lo, hi) with
 *   Y = sum over the 2x2 taps of a[oh] * b[ow] * x[h, w]
 * in int32: row taps (h0[oh], h1[oh]) weigh a0[oh] + a1[oh] = 2**K, column taps (w0[ow], w1[ow])
 * weigh b0[ow] + b1[ow] = 2**K, so Y / 2**(2K) is the bilinear value exactly.  The caller
 * keeps |x| <= 2**15 and K <= 7 (|Y| <= 2**29, no wrap) and passes rD = ratio / 2**(2K), exact.
 * The one float operation is the product (double)Y * rD, correctly rounded, then clamped to
 * [lo, hi] (integers, so clamping before rounding is the same as after) and rounded half to
 * even by nearbyint (the default rounding mode): nothing to contract into an FMA.
 * Layouts: _nhwc takes x (N, H, W, C) contiguous and writes out (N, Ho, Wo, C); _planes takes
 * N*C planes of H x W contiguous elements at x + n*sn + c*sc and writes out (N, C, Ho, Wo).
 * Returns 0, or -1 when the row buffer cannot be allocated. */
static inline int32_t qc_rs_round(int32_t y, double rD, double lo, double hi) {
    double t = (double)y * rD;
    t = t < lo ? lo : t;
    t = t > hi ? hi : t;
    return (int32_t)nearbyint(t);
}

#define RESIZE_NHWC_FN(NAME, IN_T, OUT_T)                                                                \
    QC_API int NAME(const IN_T *restrict x, int64_t N, int64_t H, int64_t W, int64_t C, int64_t Ho,        \
                    int64_t Wo, const int32_t *restrict h0, const int32_t *restrict h1,                    \
                    const int32_t *restrict a0, const int32_t *restrict a1, const int32_t *restrict w0,    \
                    const int32_t *restrict w1, const int32_t *restrict b0, const int32_t *restrict b1,    \
                    double rD, int64_t lo, int64_t hi, OUT_T *restrict out) {                              \
        int32_t *restrict v = malloc(sizeof(int32_t) * (size_t)(W * C + 1));                               \
        if (!v) return -1;                                                                                \
        const double dlo = (double)lo, dhi = (double)hi;                                                  \
        const int64_t row = W * C;                                                                        \
        for (int64_t n = 0; n < N; n++)                                                                   \
            for (int64_t oh = 0; oh < Ho; oh++) {                                                         \
                const IN_T *restrict r0 = x + (n * H + h0[oh]) * row;                                     \
                const IN_T *restrict r1 = x + (n * H + h1[oh]) * row;                                     \
                const int32_t ca = a0[oh], cb = a1[oh];                                                   \
                for (int64_t i = 0; i < row; i++) v[i] = ca * (int32_t)r0[i] + cb * (int32_t)r1[i];       \
                OUT_T *restrict o = out + (n * Ho + oh) * Wo * C;                                         \
                for (int64_t ow = 0; ow < Wo; ow++) {                                                     \
                    const int32_t *restrict p = v + (int64_t)w0[ow] * C, *restrict q = v + (int64_t)w1[ow] * C; \
                    const int32_t fa = b0[ow], fb = b1[ow];                                               \
                    OUT_T *restrict oo = o + ow * C;                                                      \
                    for (int64_t c = 0; c < C; c++) oo[c] = (OUT_T)qc_rs_round(fa * p[c] + fb * q[c], rD, dlo, dhi); \
                }                                                                                         \
            }                                                                                             \
        free(v);                                                                                          \
        return 0;                                                                                         \
    }

#define RESIZE_PLANES_FN(NAME, IN_T, OUT_T)                                                              \
    QC_API int NAME(const IN_T *restrict x, int64_t N, int64_t C, int64_t sn, int64_t sc, int64_t H,       \
                    int64_t W, int64_t Ho, int64_t Wo, const int32_t *restrict h0, const int32_t *restrict h1, \
                    const int32_t *restrict a0, const int32_t *restrict a1, const int32_t *restrict w0,    \
                    const int32_t *restrict w1, const int32_t *restrict b0, const int32_t *restrict b1,    \
                    double rD, int64_t lo, int64_t hi, OUT_T *restrict out) {                              \
        int32_t *restrict v = malloc(sizeof(int32_t) * (size_t)(W + 1));                                   \
        if (!v) return -1;                                                                                \
        const double dlo = (double)lo, dhi = (double)hi;                                                  \
        for (int64_t n = 0; n < N; n++)                                                                   \
            for (int64_t c = 0; c < C; c++) {                                                             \
                const IN_T *restrict plane = x + n * sn + c * sc;                                         \
                OUT_T *restrict o = out + (n * C + c) * Ho * Wo;                                          \
                for (int64_t oh = 0; oh < Ho; oh++) {                                                     \
                    const IN_T *restrict r0 = plane + (int64_t)h0[oh] * W;                                \
                    const IN_T *restrict r1 = plane + (int64_t)h1[oh] * W;                                \
                    const int32_t ca = a0[oh], cb = a1[oh];                                               \
                    for (int64_t i = 0; i < W; i++) v[i] = ca * (int32_t)r0[i] + cb * (int32_t)r1[i];     \
                    OUT_T *restrict oo = o + oh * Wo;                                                     \
                    for (int64_t ow = 0; ow < Wo; ow++)                                                   \
                        oo[ow] = (OUT_T)qc_rs_round(b0[ow] * v[w0[ow]] + b1[ow] * v[w1[ow]], rD, dlo, dhi); \
                }                                                                                         \
            }                                                                                             \
        free(v);                                                                                          \
        return 0;                                                                                         \
    }

RESIZE_NHWC_FN(qc_resize_nhwc_i8_i8, int8_t, int8_t)
RESIZE_NHWC_FN(qc_resize_nhwc_i8_i16, int8_t, int16_t)
RESIZE_NHWC_FN(qc_resize_nhwc_i16_i8, int16_t, int8_t)
RESIZE_NHWC_FN(qc_resize_nhwc_i16_i16, int16_t, int16_t)
RESIZE_PLANES_FN(qc_resize_planes_i8_i8, int8_t, int8_t)
RESIZE_PLANES_FN(qc_resize_planes_i8_i16, int8_t, int16_t)
RESIZE_PLANES_FN(qc_resize_planes_i16_i8, int16_t, int8_t)
RESIZE_PLANES_FN(qc_resize_planes_i16_i16, int16_t, int16_t)

/* bilinear resize rows (the _nhwc kernel as a plan step): output rows (b, oh) of [r0, r1), each as
 * the whole call computes it (the row taps offset to the first row, the input and output to the sample) */
typedef struct {
    const void *x;
    int64_t H, W, C, Ho, Wo;
    const int32_t *h0, *h1, *a0, *a1, *w0, *w1, *b0, *b1;
    double rD;
    int64_t lo, hi;
    void *out;
} resize_args;
QC_STEP_ARGS_FIT(resize_args);

#define RESIZE_STEP_FN(NAME, IN_T, OUT_T)                                                                \
    static int NAME##_rows(void *ctx, int64_t r0, int64_t r1) {                                          \
        const resize_args *a = ctx;                                                                       \
        QC_EACH_SAMPLE_ROWS(r0, r1, a->Ho,                                                                \
            NAME((const IN_T *)a->x + b * a->H * a->W * a->C, 1, a->H, a->W, a->C, oh1 - oh0, a->Wo,       \
                 a->h0 + oh0, a->h1 + oh0, a->a0 + oh0, a->a1 + oh0, a->w0, a->w1, a->b0, a->b1, a->rD,    \
                 a->lo, a->hi, (OUT_T *)a->out + (b * a->Ho + oh0) * a->Wo * a->C))                        \
        return 0;                                                                                         \
    }                                                                                                     \
    QC_API int NAME##_step(qc_step *st, void *ctx, const IN_T *x, int64_t N, int64_t H, int64_t W, int64_t C, \
                           int64_t Ho, int64_t Wo, const int32_t *h0, const int32_t *h1, const int32_t *a0,  \
                           const int32_t *a1, const int32_t *w0, const int32_t *w1, const int32_t *b0,      \
                           const int32_t *b1, double rD, int64_t lo, int64_t hi, OUT_T *out) {             \
        resize_args *a = ctx;                                                                             \
        *a = (resize_args){x, H, W, C, Ho, Wo, h0, h1, a0, a1, w0, w1, b0, b1, rD, lo, hi, out};           \
        *st = (qc_step){NAME##_rows, ctx, 0, N * Ho, 1, N * Ho * Wo * C * 4};                             \
        return 0;                                                                                         \
    }

RESIZE_STEP_FN(qc_resize_nhwc_i8_i8, int8_t, int8_t)
RESIZE_STEP_FN(qc_resize_nhwc_i8_i16, int8_t, int16_t)
RESIZE_STEP_FN(qc_resize_nhwc_i16_i8, int16_t, int8_t)
RESIZE_STEP_FN(qc_resize_nhwc_i16_i16, int16_t, int16_t)
/* ==== end of bilinear resize ============================================================== */

/* ==== nearest resize, channels-last (a plan step) ========================================== */
/* out[n, oh, ow, c] = r(x[n, hs[oh], ws[ow], c]) with r the identity (copy != 0: same type in and out)
 * or clamp(round_half_even((double)q * ratio), lo, hi) (qc_rs_round: the simulator's requantization of
 * the input, one correctly rounded float64 product; a selection commutes with it).  x: (N, H, W, C),
 * out: (N, Ho, Wo, C), contiguous; hs / ws: the source row / column of each output row / column (torch's
 * nearest indices, from the caller).  Rows: output rows (b, oh), each independent of the others. */
typedef struct {
    const void *x;
    int64_t H, W, C, Ho, Wo;
    const int32_t *hs, *ws;
    int64_t copy;
    double ratio;
    int64_t lo, hi;
    void *out;
} nearest_args;
QC_STEP_ARGS_FIT(nearest_args);

#define NEAREST_STEP_FN(NAME, IN_T, OUT_T)                                                               \
    static int NAME##_rows(void *ctx, int64_t r0, int64_t r1) {                                          \
        const nearest_args *a = ctx;                                                                      \
        const int64_t C = a->C;                                                                           \
        const double dlo = (double)a->lo, dhi = (double)a->hi;                                            \
        for (int64_t r = r0; r < r1; r++) {                                                               \
            const int64_t b = r / a->Ho, oh = r % a->Ho;                                                  \
            const IN_T *restrict row = (const IN_T *)a->x + (b * a->H + a->hs[oh]) * a->W * C;            \
            OUT_T *restrict o = (OUT_T *)a->out + r * a->Wo * C;                                          \
            for (int64_t ow = 0; ow < a->Wo; ow++) {                                                      \
                const IN_T *restrict p = row + (int64_t)a->ws[ow] * C;                                    \
                OUT_T *restrict oo = o + ow * C;                                                          \
                if (a->copy)                                                                              \
                    memcpy(oo, p, sizeof(OUT_T) * (size_t)C);                                             \
                else                                                                                      \
                    for (int64_t c = 0; c < C; c++) oo[c] = (OUT_T)qc_rs_round((int32_t)p[c], a->ratio, dlo, dhi); \
            }                                                                                             \
        }                                                                                                 \
        return 0;                                                                                         \
    }                                                                                                     \
    QC_API int NAME##_step(qc_step *st, void *ctx, const IN_T *x, int64_t N, int64_t H, int64_t W, int64_t C, \
                           int64_t Ho, int64_t Wo, const int32_t *hs, const int32_t *ws, int64_t copy,      \
                           double ratio, int64_t lo, int64_t hi, OUT_T *out) {                            \
        if (copy && sizeof(IN_T) != sizeof(OUT_T)) return -1;                                             \
        nearest_args *a = ctx;                                                                            \
        *a = (nearest_args){x, H, W, C, Ho, Wo, hs, ws, copy, ratio, lo, hi, out};                        \
        *st = (qc_step){NAME##_rows, ctx, 0, N * Ho, 1, N * Ho * Wo * C};                                 \
        return 0;                                                                                         \
    }

NEAREST_STEP_FN(qc_nearest_nhwc_i8_i8, int8_t, int8_t)
NEAREST_STEP_FN(qc_nearest_nhwc_i8_i16, int8_t, int16_t)
NEAREST_STEP_FN(qc_nearest_nhwc_i16_i8, int16_t, int8_t)
NEAREST_STEP_FN(qc_nearest_nhwc_i16_i16, int16_t, int16_t)
/* ==== end of nearest resize ================================================================= */

/* ==== int32 requantization of concatenated inputs ========================================== */
/* As qc_cat_* (one input of a concatenation into its columns of the output), with int32
 * arithmetic: dst[r, col0 + c] = clamp(round_half_even(src[r, c] * M / 2**n), lo, hi).  The
 * caller keeps max|src| * |M| + 2**(n-1) < 2**31 and n in [0, 30] (so nothing wraps), having
 * checked on every value of the input type that (M, n) gives what its int64 (M, n) gives. */
static inline int32_t round_clamp32(int32_t x, int32_t hm1, int32_t pm, int32_t s, int32_t lo, int32_t hi) {
    int32_t q = (x + hm1 + ((x >> s) & pm)) >> s;
    q = q < lo ? lo : q;
    return q > hi ? hi : q;
}

/* one row; COLS is a compile-time constant in the common channel counts, so the loop is a few
 * whole vectors (a run-time count below one 64-byte vector of int8 would stay scalar) */
#define CAT32_ROWS(COLS)                                                                                 \
    for (int64_t r = 0; r < rows; r++) {                                                                  \
        const __typeof__(src[0]) *restrict a = src + r * (COLS);                                          \
        __typeof__(dst[0]) *restrict d = dst + r * dst_stride;                                            \
        for (int64_t c = 0; c < (COLS); c++)                                                              \
            d[c] = (__typeof__(dst[0]))round_clamp32((int32_t)a[c] * m, hm1, pm, s, l, h);                \
    }

#define CAT32_FN(NAME, IN_T, OUT_T)                                                                      \
    QC_API void NAME(const IN_T *restrict src, int64_t rows, int64_t cols, OUT_T *restrict dst,            \
                     int64_t dst_stride, int64_t M, int64_t n, int64_t lo, int64_t hi) {                  \
        const int32_t m = (int32_t)M, s = (int32_t)n, l = (int32_t)lo, h = (int32_t)hi;                   \
        const int32_t hm1 = s > 0 ? ((int32_t)1 << (s - 1)) - 1 : 0, pm = s > 0;                          \
        switch (cols) {                                                                                   \
        case 8: CAT32_ROWS(8) break;                                                                      \
        case 16: CAT32_ROWS(16) break;                                                                    \
        case 32: CAT32_ROWS(32) break;                                                                    \
        case 64: CAT32_ROWS(64) break;                                                                    \
        case 128: CAT32_ROWS(128) break;                                                                  \
        default: CAT32_ROWS(cols) break;                                                                  \
        }                                                                                                 \
    }

CAT32_FN(qc_cat32_i8_i8, int8_t, int8_t)
CAT32_FN(qc_cat32_i8_i16, int8_t, int16_t)
CAT32_FN(qc_cat32_i16_i8, int16_t, int8_t)
CAT32_FN(qc_cat32_i16_i16, int16_t, int16_t)

/* A whole concatenation as one plan step: rows [r0, r1) of every input, each by the call the
 * simulator makes for it (kind[i] = 2 * (input i is int16) + (its int32 pass, qc_cat32_*, else the
 * int64 qc_cat_*)) on those rows, into its columns of dst (rows of `stride` elements, the inputs'
 * columns side by side in order).  In blocks of rows (about CAT_STEP_BYTES of output), every input
 * per block, so a block's output lines are written while in cache.  Every element is computed alone,
 * as by the whole calls.  src[i]: (rows, cols[i]) contiguous. */
#define CAT_STEP_BYTES (16 << 10)
typedef struct {
    int64_t nin;
    const int64_t *src, *cols, *M, *n, *kind; /* per input; src holds the pointers */
    int64_t lo, hi, stride;
    void *dst;
} cat_args;
QC_STEP_ARGS_FIT(cat_args);

#define CAT_STEP_FN(OUT_N, OUT_T)                                                                        \
    static int qc_cat_##OUT_N##_rows(void *ctx, int64_t r0, int64_t r1) {                                \
        const cat_args *a = ctx;                                                                          \
        int64_t block = CAT_STEP_BYTES / ((int64_t)sizeof(OUT_T) * (a->stride > 0 ? a->stride : 1));      \
        block = block > 0 ? block : 1;                                                                    \
        for (int64_t b0 = r0; b0 < r1; b0 += block) {                                                     \
            const int64_t rows = r1 - b0 < block ? r1 - b0 : block;                                       \
            OUT_T *d = (OUT_T *)a->dst + b0 * a->stride;                                                  \
            for (int64_t i = 0; i < a->nin; i++) {                                                        \
                const int64_t cols = a->cols[i];                                                          \
                const void *s = (const void *)(intptr_t)a->src[i];                                        \
                switch (a->kind[i]) {                                                                     \
                case 0: qc_cat_i8_##OUT_N((const int8_t *)s + b0 * cols, rows, cols, d, a->stride, a->M[i], a->n[i], a->lo, a->hi); break; \
                case 1: qc_cat32_i8_##OUT_N((const int8_t *)s + b0 * cols, rows, cols, d, a->stride, a->M[i], a->n[i], a->lo, a->hi); break; \
                case 2: qc_cat_i16_##OUT_N((const int16_t *)s + b0 * cols, rows, cols, d, a->stride, a->M[i], a->n[i], a->lo, a->hi); break; \
                default: qc_cat32_i16_##OUT_N((const int16_t *)s + b0 * cols, rows, cols, d, a->stride, a->M[i], a->n[i], a->lo, a->hi); break; \
                }                                                                                         \
                d += cols;                                                                                \
            }                                                                                             \
        }                                                                                                 \
        return 0;                                                                                         \
    }                                                                                                     \
    QC_API int qc_cat_##OUT_N##_step(qc_step *st, void *ctx, int64_t nin, const int64_t *src, const int64_t *cols, \
                                     const int64_t *M, const int64_t *n, const int64_t *kind, int64_t rows,  \
                                     int64_t lo, int64_t hi, OUT_T *dst, int64_t stride) {                 \
        for (int64_t i = 0; i < nin; i++)                                                                 \
            if (kind[i] < 0 || kind[i] > 3) return -1;                                                    \
        cat_args *a = ctx;                                                                                \
        *a = (cat_args){nin, src, cols, M, n, kind, lo, hi, stride, dst};                                 \
        *st = (qc_step){qc_cat_##OUT_N##_rows, ctx, 0, rows, 1, rows * stride};                           \
        return 0;                                                                                         \
    }

CAT_STEP_FN(i8, int8_t)
CAT_STEP_FN(i16, int16_t)
/* ==== end of int32 requantization of concatenated inputs ==================================== */

/* ==== max pool, channels-last in and out ================================================== */
/* out[n, oh, ow, c] = max over the taps (i, j) inside the input of
 *   x[n, oh*sh - ph + i*dh, ow*sw - pw + j*dw, c]
 * starting from the type's minimum (what a window's padding holds).  x: (N, H, W, C) and
 * out: (N, Ho, Wo, C), both contiguous (channels-last, the layout the native GEMM convs read and
 * write, so no transposition on either side).  Integer maxima: exact.  Returns 0. */
/* the loops over channels with CC a compile-time constant in the common channel counts (a run-time
 * count below one 64-byte vector of int8 would stay scalar) */
#define MAXPOOL_ROWS(T, TMIN, CC)                                                                        \
    for (int64_t n = 0; n < N; n++)                                                                       \
        for (int64_t oh = 0; oh < Ho; oh++)                                                               \
            for (int64_t ow = 0; ow < Wo; ow++) {                                                         \
                T *restrict m = out + ((n * Ho + oh) * Wo + ow) * (CC);                                   \
                for (int64_t c = 0; c < (CC); c++) m[c] = TMIN;                                           \
                for (int64_t i = 0; i < kh; i++) {                                                        \
                    int64_t ih = oh * sh - ph + i * dh;                                                   \
                    if (ih < 0 || ih >= H) continue;                                                      \
                    for (int64_t j = 0; j < kw; j++) {                                                    \
                        int64_t iw = ow * sw - pw + j * dw;                                               \
                        if (iw < 0 || iw >= W) continue;                                                  \
                        const T *restrict p = x + ((n * H + ih) * W + iw) * (CC);                         \
                        for (int64_t c = 0; c < (CC); c++) m[c] = p[c] > m[c] ? p[c] : m[c];              \
                    }                                                                                     \
                }                                                                                         \
            }

/* C a multiple of CC: each block of CC channels of an output pixel gathered in a local (registers:
 * one or two vectors), stored once, so the taps do not chain through a store and a reload */
#define MAXPOOL_REG(T, TMIN, CC)                                                                         \
    for (int64_t n = 0; n < N; n++)                                                                       \
        for (int64_t oh = 0; oh < Ho; oh++) {                                                             \
            const int64_t ih0 = oh * sh - ph;                                                             \
            for (int64_t ow = 0; ow < Wo; ow++) {                                                         \
                const int64_t iw0 = ow * sw - pw;                                                         \
                for (int64_t c0 = 0; c0 < C; c0 += (CC)) {                                                \
                    T acc[CC];                                                                            \
                    for (int64_t c = 0; c < (CC); c++) acc[c] = TMIN;                                     \
                    for (int64_t i = 0; i < kh; i++) {                                                    \
                        const int64_t ih = ih0 + i * dh;                                                  \
                        if (ih < 0 || ih >= H) continue;                                                  \
                        const T *restrict row = x + ((n * H + ih) * W) * C + c0;                          \
                        for (int64_t j = 0; j < kw; j++) {                                                \
                            const int64_t iw = iw0 + j * dw;                                              \
                            if (iw < 0 || iw >= W) continue;                                              \
                            const T *restrict p = row + iw * C;                                           \
                            for (int64_t c = 0; c < (CC); c++) acc[c] = p[c] > acc[c] ? p[c] : acc[c];    \
                        }                                                                                 \
                    }                                                                                     \
                    T *restrict m = out + ((n * Ho + oh) * Wo + ow) * C + c0;                             \
                    for (int64_t c = 0; c < (CC); c++) m[c] = acc[c];                                     \
                }                                                                                         \
            }                                                                                             \
        }

#define MAXPOOL_FN(NAME, T, TMIN)                                                                        \
    QC_API int NAME(const T *restrict x, int64_t N, int64_t H, int64_t W, int64_t C, int64_t kh,          \
                    int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,    \
                    int64_t Ho, int64_t Wo, T *restrict out) {                                            \
        if (C % (64 / (int)sizeof(T)) == 0) {                                                             \
            MAXPOOL_REG(T, TMIN, 64 / (int)sizeof(T))                                                     \
            return 0;                                                                                     \
        }                                                                                                 \
        switch (C) {                                                                                      \
        case 8: MAXPOOL_ROWS(T, TMIN, 8) break;                                                           \
        case 16: MAXPOOL_ROWS(T, TMIN, 16) break;                                                         \
        case 32: MAXPOOL_ROWS(T, TMIN, 32) break;                                                         \
        case 64: MAXPOOL_ROWS(T, TMIN, 64) break;                                                         \
        default: MAXPOOL_ROWS(T, TMIN, C) break;                                                          \
        }                                                                                                 \
        return 0;                                                                                         \
    }

MAXPOOL_FN(qc_maxpool_nhwc_i8, int8_t, INT8_MIN)
MAXPOOL_FN(qc_maxpool_nhwc_i16, int16_t, INT16_MIN)

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

/* max pool rows: output rows (b, oh) of [r0, r1), as the dw4 rows do (the padding shifted by the
 * first row, the input and output offset to the sample) */
typedef struct {
    const void *x;
    int64_t H, W, C, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo;
    void *out;
} pool_args;

#define MAXPOOL_STEP_FN(NAME, T)                                                                         \
    static int NAME##_rows(void *ctx, int64_t r0, int64_t r1) {                                          \
        const pool_args *a = ctx;                                                                         \
        QC_EACH_SAMPLE_ROWS(r0, r1, a->Ho,                                                                \
            NAME((const T *)a->x + b * a->H * a->W * a->C, 1, a->H, a->W, a->C, a->kh, a->kw, a->sh, a->sw,  \
                 a->ph - oh0 * a->sh, a->pw, a->dh, a->dw, oh1 - oh0, a->Wo,                              \
                 (T *)a->out + (b * a->Ho + oh0) * a->Wo * a->C))                                          \
        return 0;                                                                                         \
    }                                                                                                     \
    QC_API int NAME##_step(qc_step *st, void *ctx, const T *x, int64_t N, int64_t H, int64_t W, int64_t C,  \
                           int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, \
                           int64_t dw, int64_t Ho, int64_t Wo, T *out) {                                 \
        pool_args *a = ctx;                                                                               \
        *a = (pool_args){x, H, W, C, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo, out};                        \
        *st = (qc_step){NAME##_rows, ctx, 0, N * Ho, 1, N * Ho * Wo * C * kh * kw};                       \
        return 0;                                                                                         \
    }
QC_STEP_ARGS_FIT(pool_args);

MAXPOOL_STEP_FN(qc_maxpool_nhwc_i8, int8_t)
MAXPOOL_STEP_FN(qc_maxpool_nhwc_i16, int16_t)
/* ==== end of max pool ======================================================================= */

/* ==== global average pool, channels-last in ================================================= */
/* out[b, c] = clamp(round_half_even(s[b, c] * M / 2**n), lo, hi), s[b, c] the sum of x[b, p, c] over
 * the P = H * W positions: x (N, P, C) contiguous (the channels-last memory the native convs write),
 * out (N, C) contiguous.  The requantization is qc_requant_*'s (round_clamp) with one (M, n) for
 * every channel.  The caller proves max|x| * P < 2**31 (the int32 sums are exact) and
 * max|x| * P * |M| < 2**62 (the product and the rounding addend fit int64).  Channels go in blocks
 * of GAP_CB whose sums stay on the stack; with AVX512-BW, 32 int8 channels at a time are summed in
 * int16 lanes over up to GAP_RB positions (|sum| <= 256 * 128 = 2**15: -32768 is the only sum that
 * reaches it, and it fits) before widening, the other channels (and int16 inputs) plainly.  Integer
 * sums in any order: exact.  Returns 0. */
#define GAP_CB 256
#define GAP_RB 256

#define GAP_SUMS(T)                                                                                      \
    static void gap_sums_##T(const T *restrict x, int64_t P, int64_t C, int64_t cn, int64_t done,         \
                             int32_t *restrict s) {                                                       \
        for (int64_t p = 0; p < P; p++) {                                                                 \
            const T *restrict r = x + p * C;                                                              \
            for (int64_t c = done; c < cn; c++) s[c] += r[c];                                             \
        }                                                                                                 \
    }
GAP_SUMS(int8_t)
GAP_SUMS(int16_t)

/* the first channels of the block (a multiple of 32) summed with AVX512-BW; returns how many */
static int64_t gap_sums_vec_i8(const int8_t *restrict x, int64_t P, int64_t C, int64_t cn, int32_t *restrict s) {
    int64_t c = 0;
#ifdef __AVX512BW__
    for (; c + 32 <= cn; c += 32)
        for (int64_t p0 = 0; p0 < P; p0 += GAP_RB) {
            const int64_t p1 = P - p0 < GAP_RB ? P : p0 + GAP_RB;
            __m512i h = _mm512_setzero_si512();
            for (int64_t p = p0; p < p1; p++)
                h = _mm512_add_epi16(h, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(x + p * C + c))));
            const __m512i lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(h));
            const __m512i hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(h, 1));
            _mm512_storeu_si512((void *)(s + c), _mm512_add_epi32(_mm512_loadu_si512((const void *)(s + c)), lo));
            _mm512_storeu_si512((void *)(s + c + 16),
                                _mm512_add_epi32(_mm512_loadu_si512((const void *)(s + c + 16)), hi));
        }
#else
    (void)x, (void)P, (void)C, (void)cn, (void)s;
#endif
    return c;
}
static int64_t gap_sums_vec_i16(const int16_t *x, int64_t P, int64_t C, int64_t cn, int32_t *s) {
    (void)x, (void)P, (void)C, (void)cn, (void)s;
    return 0;
}

#define GAP_FN(NAME, TI, SFX, TO)                                                                        \
    QC_API int NAME(const TI *restrict x, int64_t N, int64_t P, int64_t C, int64_t M, int64_t n, int64_t lo, \
                    int64_t hi, TO *restrict out) {                                                       \
        int64_t hm1, pm;                                                                                  \
        round_consts(&n, 1, &hm1, &pm);                                                                   \
        int32_t s[GAP_CB];                                                                                \
        for (int64_t b = 0; b < N; b++)                                                                   \
            for (int64_t c0 = 0; c0 < C; c0 += GAP_CB) {                                                  \
                const int64_t cn = C - c0 < GAP_CB ? C - c0 : GAP_CB;                                     \
                const TI *xb = x + b * P * C + c0;                                                        \
                memset(s, 0, sizeof(int32_t) * (size_t)cn);                                               \
                gap_sums_##TI(xb, P, C, cn, gap_sums_vec_##SFX(xb, P, C, cn, s), s);                      \
                TO *restrict o = out + b * C + c0;                                                        \
                for (int64_t c = 0; c < cn; c++) o[c] = (TO)round_clamp((int64_t)s[c] * M, hm1, pm, n, lo, hi); \
            }                                                                                             \
        return 0;                                                                                         \
    }

GAP_FN(qc_gap_nhwc_i8_i8, int8_t, i8, int8_t)
GAP_FN(qc_gap_nhwc_i8_i16, int8_t, i8, int16_t)
GAP_FN(qc_gap_nhwc_i16_i8, int16_t, i16, int8_t)
GAP_FN(qc_gap_nhwc_i16_i16, int16_t, i16, int16_t)

/* global average pool rows: the samples [r0, r1) */
typedef struct {
    const void *x;
    int64_t P, C, M, n, lo, hi;
    void *out;
} gap_args;
QC_STEP_ARGS_FIT(gap_args);

#define GAP_STEP_FN(NAME, TI, TO)                                                                        \
    static int NAME##_rows(void *ctx, int64_t r0, int64_t r1) {                                          \
        const gap_args *a = ctx;                                                                          \
        return NAME((const TI *)a->x + r0 * a->P * a->C, r1 - r0, a->P, a->C, a->M, a->n, a->lo, a->hi,   \
                    (TO *)a->out + r0 * a->C);                                                            \
    }                                                                                                     \
    QC_API int NAME##_step(qc_step *st, void *ctx, const TI *x, int64_t N, int64_t P, int64_t C, int64_t M, \
                           int64_t n, int64_t lo, int64_t hi, TO *out) {                                  \
        gap_args *a = ctx;                                                                                \
        *a = (gap_args){x, P, C, M, n, lo, hi, out};                                                      \
        *st = (qc_step){NAME##_rows, ctx, 0, N, 1, N * P * C};                                            \
        return 0;                                                                                         \
    }

GAP_STEP_FN(qc_gap_nhwc_i8_i8, int8_t, int8_t)
GAP_STEP_FN(qc_gap_nhwc_i8_i16, int8_t, int16_t)
GAP_STEP_FN(qc_gap_nhwc_i16_i8, int16_t, int8_t)
GAP_STEP_FN(qc_gap_nhwc_i16_i16, int16_t, int16_t)
/* ==== end of global average pool ============================================================ */

/* ================================================================================================
 * int8 GEMM with the requantization fused (qcompiler/native/gemm.py): 1x1 convs and linear layers.
 *
 *   acc[p, o]  = bias[o] + sum_k x[p, k] * w[o, k]                       (exact, int32)
 *   out[p, o]  = clamp(round_half_even(acc * M[o] / 2**n[o] [+ b[p, o] * Mb / 2**nb]), lo, hi)
 *
 * x: rows of int8 (row stride ldx), b and out: rows of O (int8 / int16).  Only rows m0..m1-1 are
 * computed, so callers may split the rows of one call over threads.  With geo != NULL, x is an NHWC
 * conv input and row p is the im2col row of output position p, K = kh * kw * C, read in place where
 * the kernel rows allow it (gemm_rows).
 *
 * AVX512-VNNI: vpdpbusd multiplies unsigned bytes by signed bytes and adds groups of four products
 * to int32 lanes, with wrap-around (not the saturating vpdpbusds).  The int8 activation x is fed as
 * the byte x ^ 0x80 = x + 128 (unsigned); the extra 128 * sum_k w[o, k] is removed exactly by the
 * per-channel int32 bias the caller packs: bias32[o] = bias[o] - 128 * sum_k w[o, k].  The caller
 * proves 128 * sum_k |w[o, k]| + |bias[o]| < 2**31, so bias32 and the true acc fit int32; every
 * step is exact modulo 2**32 (wrap-around), so the final int32 lane is the true acc.
 * Weights are prepacked (gemm.py): blocks of 16 output channels, K in groups of 4, i.e. byte
 * wp[((ob * Kq + kq) * 16 + j) * 4 + t] = w[16 * ob + j, 4 * kq + t], zero beyond O and K (a zero
 * weight adds nothing whatever the activation byte).  The epilogue is round_clamp() above, in int64;
 * the fused add brings both terms to the denominator 2**max(n, nb) as qc_requant_add_* does (the
 * caller proves that sum below 2**62; layers that need 128-bit sums stay on the other path).  Where
 * the caller proves the float64 bounds (f64 == 2 without, f64 == 3 with a fused add) the packed
 * float64 epilogue (gemm_epi_x16) runs instead.
 * ================================================================================================ */
/* (VBMI too: the depthwise kernel's byte permutations; without it, e.g. on Cascade Lake, the library still builds
 * and these layers keep their other paths) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#include <immintrin.h>

QC_API int qc_gemm_vnni(void) { return 1; }

#define GEMM_MR 6     /* rows per micro-tile */
#define GEMM_NR 4     /* zmm (16 output channels each) per micro-tile */
#define GEMM_ROWS_L1 (16 << 10) /* bytes of x rows per row block (stay in L1 across the channel groups) */

/* rows per row block for rows of Kq groups of 4 bytes: GEMM_ROWS_L1 of them, whole micro-tiles */
static int64_t gemm_block_rows(int64_t Kq) {
    const int64_t mb = GEMM_ROWS_L1 / (4 * Kq > 0 ? 4 * Kq : 1) / GEMM_MR * GEMM_MR;
    return mb < GEMM_MR ? GEMM_MR : mb;
}

/* One micro-tile: rows x (16 * NR) int32 accumulators (bias32 included) into tile[GEMM_MR][64].
 * Row r's 4 * (nseg * segq + tq) int8 values are nseg segments of 4 * segq bytes and, if tq > 0, one
 * of 4 * tq bytes, segment s at xp[r * (nseg + (tq > 0)) + s] (a row of x itself, a window row of a
 * conv input, a column of a tail plane, or a staged row: gemm_rows); each group of
 * 4 bytes enters vpdpbusd as x ^ 0x80 = x + 128 (unsigned), the xor applied to the broadcast (it runs
 * beside the vpdpbusd, measured free with 4 channel blocks).  XOR 0: the rows were staged as x ^ 0x80
 * already, one segment each, one after another (only xp[0] is read: 3-5% on the short-K GEMMs).
 * Rows beyond `rows` repeat the last row (computed, never stored).  Named accumulators (not an array),
 * so the compiler keeps all 6 * NR of them in registers. */
#define GT_PTR(r) const int8_t *x##r = XOR ? xp[(rows > r ? r : rows - 1) * rstride + s]                     \
                                          : xp[0] + (rows > r ? r : rows - 1) * 4 * segq;
#define GT_MAC(r)                                                                                        \
    {                                                                                                     \
        int32_t v;                                                                                        \
        memcpy(&v, x##r + 4 * kq, 4);                                                                     \
        const __m512i a = XOR ? _mm512_xor_si512(_mm512_set1_epi32(v), m80) : _mm512_set1_epi32(v);     \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, a, w0);                                                    \
        if (NR > 1) c##r##1 = _mm512_dpbusd_epi32(c##r##1, a, w1);                                        \
        if (NR > 2) c##r##2 = _mm512_dpbusd_epi32(c##r##2, a, w2);                                        \
        if (NR > 3) c##r##3 = _mm512_dpbusd_epi32(c##r##3, a, w3);                                        \
    }
#define GT_STORE(r)                                                                                      \
    {                                                                                                     \
        _mm512_storeu_si512((void *)(tile + r * 64), c##r##0);                                           \
        if (NR > 1) _mm512_storeu_si512((void *)(tile + r * 64 + 16), c##r##1);                          \
        if (NR > 2) _mm512_storeu_si512((void *)(tile + r * 64 + 32), c##r##2);                          \
        if (NR > 3) _mm512_storeu_si512((void *)(tile + r * 64 + 48), c##r##3);                          \
    }
#define GT_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)
#define GT_ACC(r) __m512i c##r##0 = b0, c##r##1 = b1, c##r##2 = b2, c##r##3 = b3;
#define GEMM_TILE_FN(NAME, NRV, SEGQ, XORV)                                                              \
    static void NAME(const int8_t *const *restrict xp, int64_t rows, int64_t nseg, int64_t segq, int64_t tq, \
                     const int8_t *restrict wp, int64_t wstride, const int32_t *restrict bias32,          \
                     int32_t *restrict tile) {                                                            \
        enum { NR = NRV, XOR = XORV };                                                                    \
        const __m512i zero = _mm512_setzero_si512(), m80 = _mm512_set1_epi32((int)0x80808080u);           \
        const __m512i b0 = _mm512_loadu_si512((const void *)bias32);                                      \
        const __m512i b1 = NR > 1 ? _mm512_loadu_si512((const void *)(bias32 + 16)) : zero;              \
        const __m512i b2 = NR > 2 ? _mm512_loadu_si512((const void *)(bias32 + 32)) : zero;              \
        const __m512i b3 = NR > 3 ? _mm512_loadu_si512((const void *)(bias32 + 48)) : zero;              \
        GT_ROWS(GT_ACC)                                                                                   \
        const int8_t *wk = wp;                                                                            \
        const int64_t rstride = XOR ? nseg + (tq > 0) : 1; /* pointers a row (staged rows: one segment) */ \
        for (int64_t s = 0; s < rstride; s++) {                                                           \
            GT_ROWS(GT_PTR)                                                                               \
            const int64_t nq = s < nseg ? (SEGQ ? SEGQ : segq) : tq;                                      \
            for (int64_t kq = 0; kq < nq; kq++, wk += 64) {                                               \
                const __m512i w0 = _mm512_loadu_si512((const void *)wk);                                  \
                const __m512i w1 = NR > 1 ? _mm512_loadu_si512((const void *)(wk + wstride)) : zero;      \
                const __m512i w2 = NR > 2 ? _mm512_loadu_si512((const void *)(wk + 2 * wstride)) : zero;  \
                const __m512i w3 = NR > 3 ? _mm512_loadu_si512((const void *)(wk + 3 * wstride)) : zero;  \
                GT_ROWS(GT_MAC)                                                                           \
            }                                                                                             \
        }                                                                                                 \
        GT_ROWS(GT_STORE)                                                                                 \
    }

GEMM_TILE_FN(gemm_tile1, 1, 0, 1)
GEMM_TILE_FN(gemm_tile2, 2, 0, 1)
GEMM_TILE_FN(gemm_tile3, 3, 0, 1)
GEMM_TILE_FN(gemm_tile4, 4, 0, 1)
/* rows staged already as x ^ 0x80 (gemm_src.xored), one after another (4 * segq bytes apart) */
GEMM_TILE_FN(gemm_tile1_u, 1, 0, 0)
GEMM_TILE_FN(gemm_tile2_u, 2, 0, 0)
GEMM_TILE_FN(gemm_tile3_u, 3, 0, 0)
GEMM_TILE_FN(gemm_tile4_u, 4, 0, 0)
GEMM_TILE_FN(gemm_tile4_q5, 4, 5, 1)
GEMM_TILE_FN(gemm_tile4_q2, 4, 2, 1)

static void gemm_tile_nr(const int8_t *const *xp, int64_t rows, int64_t nseg, int64_t segq, int64_t tq, int xored,
                         const int8_t *wp, int64_t wstride, int nr, const int32_t *bias32, int32_t *tile) {
    if (xored) { /* (one segment: rows staged by gemm_rows) */
        switch (nr) {
        case 1: gemm_tile1_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        case 2: gemm_tile2_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        case 3: gemm_tile3_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        default: gemm_tile4_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        }
        return;
    }
    switch (nr) {
    case 1: gemm_tile1(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
    case 2: gemm_tile2(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
    case 3: gemm_tile3(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
    default:
        if (segq == 5)
            gemm_tile4_q5(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile);
        else if (segq == 2)
            gemm_tile4_q2(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile);
        else
            gemm_tile4(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile);
        break;
    }
}

/* ---- AMX tiles (Intel AMX-INT8): the same GEMM, 32 rows x 32 channels per tdpbusd block -------------
 * tdpbusd is vpdpbusd on tiles: C[m][n] += sum_k A[m][k] * B[k / 4][4 n + k % 4], A unsigned bytes (here
 * x ^ 0x80, as the vector kernel reads them), B signed bytes, int32 lanes with wrap-around (no
 * saturation), so the arithmetic and its exactness argument are the vector kernel's: the same sums and
 * the same bias32 start (added by the epilogue to lanes that start from 0: the same int32 modulo 2**32),
 * the same final int32 per lane.  A B tile (16 groups of 4 k x 16 channels) is 16 consecutive
 * 64-byte groups of the packed weights as they are, wp + (ob * Kq + 16 * kc) * 64 with a stride of 64.
 * The last chunk of a block whose Kq is not a multiple of 16 comes from a copy padded with zero
 * weights (gemm_amx_wtail), so the A bytes it meets past K (the next row's, or the panel's padding)
 * add nothing.  A tiles are 16 rows of 64 bytes of a contiguous panel of rows lda bytes apart: the
 * rows gemm_rows staged as x ^ 0x80 already (GEMM_PLAIN staged, GEMM_IM2COL), or the row pointers'
 * bytes copied xored into a panel (gemm_amx_panel).  Tiles 0-3 accumulate (rows 0-15 / 16-31 x
 * channels 0-15 / 16-31), 4-5 hold A, 6-7 hold B.  Linux grants a process the tile state only on
 * request (arch_prctl ARCH_REQ_XCOMP_PERM), made once by qc_gemm_amx_set; each call loads its tile
 * configuration and releases the tiles when it returns. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define GEMM_AMX_BUILT 1
#define GEMM_AMX_MIN_ROWS 16 /* rows of a call from which it runs on tiles */
/* multiply-adds (rows * K * O) of a call from which it runs on tiles: below, the tile path's fixed costs
 * (its configuration, the copies' allocations, the switch between tile and vector code) outweigh its
 * speed.  Measured on mobilenet_v2 at batch 1, its layers cut over 2 threads: tiles on every call of 16
 * rows or more 2.40 ms against the vectors' 1.90; from 2**20 multiply-adds 2.35, 2**21 2.05, 3 * 2**20
 * 1.91, 2**22 1.91, 2**24 1.94 (docs/performance.md, "AMX tiles"). */
#define GEMM_AMX_MIN_WORK ((int64_t)1 << 22)
#define GEMM_AMX_PANEL (384 << 10) /* bytes of A rows per row block (kept in L2 across the channel groups) */
static int gemm_amx_on;
static int64_t gemm_amx_calls; /* calls that ran on tiles (tests check the path they name was taken) */
QC_API int64_t qc_gemm_amx_calls(void) { return __atomic_load_n(&gemm_amx_calls, __ATOMIC_RELAXED); }
static int gemm_amx_perm = -1; /* -1: not asked yet; 1: the kernel granted the tile data state */

/* qc_gemm_amx_set: GEMM calls run on AMX tiles (on = 1: those of GEMM_AMX_MIN_ROWS rows and GEMM_AMX_MIN_WORK
 * multiply-adds; on = 2: every call, for tests) where the OS grants them, or on the vector kernel (on = 0);
 * on < 0 changes nothing.  The result is bit for bit the same either way.  Returns the state now in force. */
QC_API int qc_gemm_amx_set(int on) {
    if (on < 0) return __atomic_load_n(&gemm_amx_on, __ATOMIC_RELAXED); /* (a query) */
    if (on && __atomic_load_n(&gemm_amx_perm, __ATOMIC_RELAXED) < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        __atomic_store_n(&gemm_amx_perm, syscall(SYS_arch_prctl, 0x1023, 18) == 0, __ATOMIC_RELAXED);
    __atomic_store_n(&gemm_amx_on, __atomic_load_n(&gemm_amx_perm, __ATOMIC_RELAXED) > 0 ? on : 0, __ATOMIC_RELAXED);
    return __atomic_load_n(&gemm_amx_on, __ATOMIC_RELAXED);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) gemm_amx_cfg;

static void gemm_amx_config(void) {
    __atomic_add_fetch(&gemm_amx_calls, 1, __ATOMIC_RELAXED);
    gemm_amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* rows per row block: a panel of about GEMM_AMX_PANEL bytes, whole 32-row blocks */
static int64_t gemm_amx_rows(int64_t lda) {
    const int64_t mb = GEMM_AMX_PANEL / (lda > 0 ? lda : 1) / 32 * 32;
    return mb < 32 ? 32 : mb;
}

#define AMX_STEP(AO, B0, B1)                                                                             \
    {                                                                                                     \
        _tile_loadd(4, a + (AO), lda);                                                                    \
        if (RA > 1) _tile_loadd(5, a + 16 * lda + (AO), lda);                                             \
        _tile_loadd(6, B0, 64);                                                                           \
        if (CB > 1) _tile_loadd(7, B1, 64);                                                               \
        _tile_dpbusd(0, 4, 6);                                                                            \
        if (CB > 1) _tile_dpbusd(1, 4, 7);                                                                \
        if (RA > 1) _tile_dpbusd(2, 5, 6);                                                                \
        if (RA > 1 && CB > 1) _tile_dpbusd(3, 5, 7);                                                      \
    }
/* RA x 16 rows of A (a, lda bytes apart) times CB blocks of 16 channels (w0, w1: their packed weights),
 * each lane starting from 0 (the epilogue adds the start value: a tile zeroed need not wait for the
 * previous block's store, as a tile loaded from memory does; 12-14% on the tile loop in a C
 * microbenchmark of resnet18's layer1 and layer2), the int32 results to tile[r * 64 + c].  K runs over nseg segments
 * segstep bytes apart in A, each of lc whole 64-byte chunks (a panel: one segment; GEMM_SLIDE: the
 * kernel rows), then, when tail, one more chunk after the last segment whose weights are t0, t1 (the
 * zero-padded last chunk). */
#define GEMM_AMX_FN(NAME, RAV, CBV)                                                                      \
    static void NAME(const uint8_t *restrict a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc,    \
                     int tail, const int8_t *w0, const int8_t *w1, const int8_t *t0, const int8_t *t1,    \
                     int32_t *tile) {                                                                     \
        enum { RA = RAV, CB = CBV };                                                                      \
        _tile_zero(0);                                                                                    \
        if (CB > 1) _tile_zero(1);                                                                        \
        if (RA > 1) _tile_zero(2);                                                                        \
        if (RA > 1 && CB > 1) _tile_zero(3);                                                              \
        for (int64_t i = 0; i < nseg; i++)                                                                \
            for (int64_t kc = 0; kc < lc; kc++, w0 += 1024, w1 += 1024) AMX_STEP(i * segstep + 64 * kc, w0, w1) \
        if (tail) AMX_STEP((nseg - 1) * segstep + 64 * lc, t0, t1)                                        \
        _tile_stored(0, tile, 256);                                                                       \
        if (CB > 1) _tile_stored(1, tile + 16, 256);                                                      \
        if (RA > 1) _tile_stored(2, tile + 16 * 64, 256);                                                 \
        if (RA > 1 && CB > 1) _tile_stored(3, tile + 16 * 64 + 16, 256);                                  \
    }
GEMM_AMX_FN(gemm_amx_11, 1, 1)
GEMM_AMX_FN(gemm_amx_12, 1, 2)
GEMM_AMX_FN(gemm_amx_21, 2, 1)
GEMM_AMX_FN(gemm_amx_22, 2, 2)

/* rows x 16 * nr channels (nr <= 4) of the tile, pairs of channel blocks on tdpbusd blocks: A as
 * GEMM_AMX_FN reads it (nseg segments of lc chunks), the blocks' weights Kq groups apart from wp, the
 * last partial chunk's from wt (NULL: none); the lanes start from 0 */
static void gemm_amx_tile(const uint8_t *a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc, int64_t rows,
                          int64_t Kq, const int8_t *wp, const int8_t *wt, int nr, int32_t *tile) {
    const int tail = wt != NULL;
    for (int p = 0; p < nr; p += 2) {
        const int8_t *w0 = wp + p * Kq * 64, *w1 = w0 + Kq * 64;
        const int8_t *t0 = tail ? wt + p * 1024 : NULL, *t1 = tail ? t0 + 1024 : NULL;
        if (nr - p >= 2) {
            if (rows > 16) gemm_amx_22(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
            else gemm_amx_12(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
        } else {
            if (rows > 16) gemm_amx_21(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
            else gemm_amx_11(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
        }
    }
}

/* The last, partial chunk (Kq % 16 groups) of each of nob blocks of the packed weights wp, padded
 * with zero weights to 16 groups: nob * 1024 bytes (NULL when Kq is a multiple of 16). */
static int8_t *gemm_amx_wtail(const int8_t *wp, int64_t nob, int64_t Kq) {
    const int64_t left = Kq % 16;
    if (!left) return NULL;
    int8_t *t = calloc((size_t)(nob * 1024), 1);
    if (t)
        for (int64_t ob = 0; ob < nob; ob++) memcpy(t + ob * 1024, wp + (ob * Kq + Kq - left) * 64, (size_t)(left * 64));
    return t;
}
#define GEMM_AMX_ON __atomic_load_n(&gemm_amx_on, __ATOMIC_RELAXED)
#else /* no AMX here: calls never take the tile path (GEMM_AMX_ON is 0), so these are never reached */
QC_API int qc_gemm_amx_set(int on) {
    (void)on;
    return 0;
}
#define GEMM_AMX_ON 0
#define GEMM_AMX_MIN_ROWS 0
#define GEMM_AMX_MIN_WORK 0
QC_API int64_t qc_gemm_amx_calls(void) { return 0; }
static void gemm_amx_config(void) {}
static void gemm_amx_tile(const uint8_t *a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc, int64_t rows,
                          int64_t Kq, const int8_t *wp, const int8_t *wt, int nr, int32_t *tile) {
    (void)a, (void)lda, (void)nseg, (void)segstep, (void)lc, (void)rows, (void)Kq, (void)wp, (void)wt, (void)nr;
    (void)tile;
}
static int8_t *gemm_amx_wtail(const int8_t *wp, int64_t nob, int64_t Kq) {
    (void)wp, (void)nob, (void)Kq;
    return NULL;
}
#define _tile_release() ((void)0)
#endif

/* Whether a call of `rows` rows of a K x O GEMM runs on tiles (the mode qc_gemm_amx_set put in force) */
static inline int gemm_amx_takes(int64_t rows, int64_t K, int64_t O) {
    const int on = GEMM_AMX_ON;
    return on == 2 || (on && rows >= GEMM_AMX_MIN_ROWS && rows * K * O >= GEMM_AMX_MIN_WORK);
}

/* d[0:len] = s[0:len] ^ 0x80 (staged rows as the unsigned bytes vpdpbusd reads), 64 bytes at a time, the tail
 * masked (nothing past len read or written); d == s xors in place */
static void gemm_xor80_copy(int8_t *d, const int8_t *s, int64_t len) {
    const __m512i m80 = _mm512_set1_epi8((char)0x80);
    int64_t k = 0;
    for (; k + 64 <= len; k += 64)
        _mm512_storeu_si512((void *)(d + k), _mm512_xor_si512(_mm512_loadu_si512((const void *)(s + k)), m80));
    if (k < len) {
        const __mmask64 mk = ((uint64_t)1 << (len - k)) - 1; /* len - k < 64 */
        _mm512_mask_storeu_epi8(d + k, mk, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, s + k), m80));
    }
}
static void gemm_xor80(int8_t *d, int64_t len) { gemm_xor80_copy(d, d, len); }

/* d[0:len] = s[0:len] when the caller allows an overshoot: up to 64 bytes past len may be read (below
 * s_end) and written (d's buffer has the slack and its later bytes are written again after this),
 * so a short piece is one unmasked 32- or 64-byte load and store. */
static inline void gemm_copy_over(int8_t *restrict d, const int8_t *restrict s, int64_t len, const int8_t *s_end) {
    if (len <= 32 && s + 32 <= s_end)
        _mm256_storeu_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
    else if (len <= 64 && s + 64 <= s_end)
        _mm512_storeu_si512((void *)d, _mm512_loadu_si512((const void *)s));
    else
        memcpy(d, s, (size_t)len);
}

/* Rows r0..r1-1 of x (row stride ldx) copied, each padded with zeros to 4 * Kq bytes (the padding
 * meets zero weights): a plain GEMM's staged rows (GEMM_INPLACE_MIN_K), xored after by the caller. */
static void gemm_stage(const int8_t *restrict x, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int64_t Kq,
                       int8_t *restrict xu) {
    for (int64_t r = r0; r < r1; r++) {
        int8_t *restrict d = xu + (r - r0) * 4 * Kq;
        memcpy(d, x + r * ldx, (size_t)K);
        for (int64_t k = K; k < 4 * Kq; k++) d[k] = 0;
    }
}

/* gemm_stage_row's general case: the kernel rows one by one, tap by tap where a row leaves the input. */
static void gemm_stage_taps(const int8_t *restrict xb, const int8_t *s_end, const int64_t *restrict g, int64_t ih0,
                            int64_t iw0, int8_t *restrict d) {
    const int64_t H = g[0], W = g[1], C = g[2], kh = g[3], kw = g[4], dh = g[9], dw = g[10], piece = kw * C;
    for (int64_t i = 0; i < kh; i++) {
        const int64_t ih = ih0 + i * dh;
        if (dw == 1 && ih >= 0 && ih < H && iw0 >= 0 && iw0 + kw <= W) { /* the kernel row's taps are contiguous */
            gemm_copy_over(d, xb + (ih * W + iw0) * C, piece, s_end);
            d += piece;
            continue;
        }
        for (int64_t j = 0; j < kw; j++, d += C) {
            const int64_t iw = iw0 + j * dw;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) {
                if (C <= 64)
                    _mm512_storeu_si512((void *)d, _mm512_setzero_si512());
                else
                    memset(d, 0, (size_t)C);
                continue;
            }
            gemm_copy_over(d, xb + (ih * W + iw) * C, C, s_end);
        }
    }
}

/* The im2col row of output position r = (b, oh, ow) of the NHWC int8 input x (geometry g = {H, W, C,
 * kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo}) into d: its taps (i, j) in order, C bytes each, a tap in the
 * padding 0 (the zero point), zeros up to 4 * Kq.  Pieces are written front to back and may overshoot
 * by up to 64 bytes (gemm_copy_over) into bytes written again later: its own later taps, its zero
 * padding, the next row; d has 64 bytes of slack after the row block's last row. */
static inline __attribute__((always_inline)) void gemm_stage_row(const int8_t *restrict x, const int64_t *restrict g,
                                                                 int64_t b, int64_t oh, int64_t ow, int64_t Kq,
                                                                 int8_t *restrict d) {
    const int64_t H = g[0], W = g[1], C = g[2], kh = g[3], kw = g[4], sh = g[5], sw = g[6], ph = g[7], pw = g[8];
    const int64_t dh = g[9], dw = g[10], K = kh * kw * C, HWC = H * W * C, piece = kw * C;
    const int8_t *xb = x + b * HWC, *s_end = xb + HWC; /* reads stay inside sample b */
    const int64_t ih0 = oh * sh - ph, iw0 = ow * sw - pw, rstride = dh * W * C;
    const int inside = dw == 1 && piece <= 32 && ih0 >= 0 && ih0 + (kh - 1) * dh < H && iw0 >= 0 && iw0 + kw <= W;
    const int8_t *base = inside ? xb + (ih0 * W + iw0) * C : NULL;
    if (inside && base + (kh - 1) * rstride + 32 <= s_end) {
        /* the window inside the input and short kernel rows (a stem): one 32-byte copy a kernel row */
        for (int64_t i = 0; i < kh; i++, d += piece)
            _mm256_storeu_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)(base + i * rstride)));
    } else {
        gemm_stage_taps(xb, s_end, g, ih0, iw0, d);
        d += K;
    }
    for (int64_t k = K; k < 4 * Kq; k++) d[k - K] = 0;
}

/* Where the micro-tile reads a call's rows (gemm_src_open picks the layout once per call, gemm_rows
 * fills a row block's pointers):
 *  - GEMM_PLAIN (geo NULL): the rows of x in place when K is a multiple of 4 and at least
 *    GEMM_INPLACE_MIN_K, else staged as x ^ 0x80 (the tile then does not xor), one segment of Kq groups;
 *  - GEMM_DIRECT, a conv whose kernel rows are contiguous in x (dilation 1 along W, or kw 1) and a
 *    multiple of 4 bytes (kw * C): kh segments of kw * C / 4 groups, in place: kernel row i of output
 *    (b, oh, ow) is the kw * C bytes of x from (b, oh * sh - ph + i * dh, ow * sw - pw); a kernel row in
 *    the vertical padding reads `zrow` (zero bytes, the zero point); a window that crosses the left or
 *    right edge is staged (its im2col row).  No other copy of x is made (im2col copies 9x the input's
 *    bytes for a 3x3);
 *  - GEMM_TAIL, the same for kernel rows of 4 * q + 1 bytes (a stem: 7 taps x 3 channels; dilation 1,
 *    or a kernel 1 wide / high) and weights within GEMM_TAIL_MAX_W (gemm_tail_open): the input rows the
 *    call reads copied with their left and right padding (zeros: every window then lies inside a row,
 *    none is staged), the first 4 * q bytes of each kernel row read in place there (kh segments of q
 *    groups), and the kernel rows' last bytes (channel C - 1 of tap kw - 1), which are kh bytes down one
 *    column of channel C - 1, from a tail plane: channel C - 1 of the padded rows transposed
 *    (T[pw + iw][ph + ih] = x[ih, iw, C - 1], zero in the padding), read as one segment of ceil(kh / 4)
 *    groups.  The weights in that order (qc_gemm_tail_weights, once per layer; the extra bytes of the
 *    last group meet zero weights), so K stays 4 * ceil(kh * kw * C / 4) (7x7x3: 148 either way);
 *  - GEMM_IM2COL, any other conv (dilation along W, other remainders, a kernel row of one byte, tail
 *    weights past GEMM_TAIL_MAX_W, or the tail layout's buffers not allocated): every im2col row staged,
 *    as x ^ 0x80. */
/*  - GEMM_SLIDE (AMX tiles only), a conv whose kernel rows are contiguous (dilation 1 along W, or kw 1):
 *    the input copied once as x ^ 0x80 with its padding (the byte 0x80: the zero point) into whole
 *    padded images (Hp x Wp); kernel row i of output (b, oh, ow) is then the kw * C bytes at padded
 *    (b, oh * sh + i * dh, ow * sw), and 16 outputs sw * C bytes apart are one A tile read in place (no
 *    row copied).  Each kernel row's weights are padded with zeros to L = 64 * ceil(kw * C / 64)
 *    (qc_gemm_slide_weights, once per layer; the packed weights as they are when kw * C is a multiple
 *    of 64), so a 64-byte chunk never spans two kernel rows and the bytes past one meet zeros.  Two ways
 *    to walk the outputs (gemm_slide_mode): at stride 1, the positions q = (b * Hp + oh) * Wp + ow of the
 *    padded grid, one after another (tiles cross output rows; the kw - 1 positions past a row's outputs
 *    and the rows between images are computed and dropped: gemm_slide_map); at any stride, the outputs
 *    of one output row at a time (a row's last tile may compute up to 15 rows it drops). */
enum { GEMM_PLAIN, GEMM_DIRECT, GEMM_TAIL, GEMM_IM2COL, GEMM_SLIDE };
/* K (bytes a row) from which a plain GEMM reads its rows in place; below it they are staged as x ^ 0x80 and
 * the tile does not xor: the xor on each broadcast costs where a tile has few vpdpbusd per broadcast
 * (one or two channel blocks) and a short K leaves the copy cheap (mobilenet_v2's K = 16-64 1x1 convs:
 * 3-10% slower in place, K = 144 10% faster) */
#define GEMM_INPLACE_MIN_K 128
#define GEMM_TAIL_MAX_W (256 << 10) /* bytes of repacked weights past which a tail-layout conv is staged */

typedef struct {
    const int8_t *x;
    int64_t ldx;
    const int64_t *g;
    int mode;
    int xored;                   /* every row staged, as x ^ 0x80 (the tile then does not xor) */
    int64_t K, Kq0;              /* K as given and its groups; */
    int64_t Kq, nseg, segq, tq;  /* a row's groups in this layout: nseg segments of segq, a tail of tq */
    const int8_t *wp;            /* the packed weights in this layout (the caller's, or wrep) */
    int8_t *xu, *zrow, *xpad, *tail, *wrep;
    int64_t *q;                  /* an in-place output's pointers and their steps (gemm_window) */
    const int8_t *win;           /* where windows are read: x, or (GEMM_TAIL) xpad */
    int64_t wrow, wpad, wb0;     /* its pixels a row, the padding left of its pixel 0, its first image */
    int64_t tlen;                /* a tail plane's column length */
    int64_t b, oh, ow;           /* the output position of the next row gemm_rows fills */
    int64_t mb;                  /* rows per row block (xu and the callers' pointer arrays hold that many) */
    int amx;                     /* the call runs on AMX tiles (row blocks of gemm_amx_rows, xu zeroed) */
    /* GEMM_SLIDE: the padded copy, its grid, the call's positions [qa, qb) in it, its first image, L / 64 */
    uint8_t *xs;
    int srows; /* walked by output rows (any stride), not by positions of the padded grid */
    int64_t Hp, Wp, qa, qb, sb0, lc;
} gemm_src;

static void gemm_src_close(gemm_src *s) {
    free(s->xs);
    free(s->q);
    free(s->xu);
    free(s->zrow);
    free(s->xpad);
    free(s->tail);
    free(s->wrep);
}

/* The tail layout's weights: per block of 16 channels, groups of 4 in the order of GEMM_TAIL (kernel
 * row i's first 4 * segq values, then the kh last values and zeros), from wpack's plain order. */
static void gemm_tail_weights(const int8_t *restrict wpack, int64_t nob, const gemm_src *s, int8_t *restrict wrep) {
    const int64_t kwc = s->g[4] * s->g[2], kh = s->g[3], main = kh * 4 * s->segq;
    for (int64_t ob = 0; ob < nob; ob++)
        for (int64_t kq = 0; kq < s->Kq; kq++)
            for (int64_t j = 0; j < 16; j++)
                for (int64_t t = 0; t < 4; t++) {
                    const int64_t k2 = 4 * kq + t;
                    int64_t k = -1; /* the plain K index of this value (-1: a zero weight) */
                    if (k2 < main)
                        k = k2 / (4 * s->segq) * kwc + k2 % (4 * s->segq);
                    else if (k2 - main < kh)
                        k = (k2 - main) * kwc + kwc - 1;
                    wrep[((ob * s->Kq + kq) * 16 + j) * 4 + t] =
                        k < 0 ? 0 : wpack[((ob * s->Kq0 + k / 4) * 16 + j) * 4 + k % 4];
                }
}

/* The layout of a conv of geometry g (GEMM_FN's geo) over nob blocks of 16 output channels. */
static int gemm_layout(const int64_t *g, int64_t nob) {
    const int64_t kh = g[3], kwc = g[4] * g[2];
    const int dw1 = g[10] == 1 || g[4] == 1, dh1 = g[9] == 1 || kh == 1; /* (a dilation over one tap is none) */
    if (dw1 && kwc % 4 == 0) return GEMM_DIRECT;
    if (dw1 && dh1 && kwc % 4 == 1 && kwc > 4 && nob * 64 * (kh * (kwc / 4) + (kh + 3) / 4) <= GEMM_TAIL_MAX_W)
        return GEMM_TAIL;
    return GEMM_IM2COL;
}

static int gemm_slide_walk(const int64_t *g, int64_t nob);

/* qc_gemm_conv_layout: which layout a call over `rows` output rows of a conv of geometry geo with O output
 * channels reads its input in (1 in place, 2 in place with a tail plane, 3 im2col rows staged, 4 the padded
 * copy read in place by AMX tiles, when the call takes them: GEMM_FN; gemm.py's Int8Gemm.conv_layout). */
QC_API int qc_gemm_conv_layout(const int64_t *geo, int64_t O, int64_t rows) {
    const int64_t nob = (O + 15) / 16;
    if (gemm_amx_takes(rows, geo[2] * geo[3] * geo[4], O) && gemm_slide_walk(geo, nob)) return 4;
    return gemm_layout(geo, nob);
}

/* qc_gemm_tail_weights: a layer's weights wpack (O channels) in the tail layout's order for geometry geo,
 * into out (16 * ceil(O / 16) * K bytes, K = 4 * ceil(kh * kw * C / 4)): once per layer, passed back in
 * geo[13] (gemm.py), so a call (and each part of a split one) does not repack them.  -1 if geo does
 * not take the tail layout. */
QC_API int qc_gemm_tail_weights(const int8_t *wpack, int64_t O, const int64_t *geo, int8_t *out) {
    const int64_t nob = (O + 15) / 16, kwc = geo[4] * geo[2], kh = geo[3];
    if (gemm_layout(geo, nob) != GEMM_TAIL) return -1;
    const int64_t K = kh * kwc;
    gemm_src s = {.g = geo, .Kq0 = (K + 3) / 4, .Kq = (K + 3) / 4, .nseg = kh, .segq = kwc / 4};
    gemm_tail_weights(wpack, nob, &s, out);
    return 0;
}

/* GEMM_TAIL's buffers for rows m0..m1-1 (m0 < m1): the input rows their windows read, copied with the
 * left and right padding (zeros: every window then lies inside a row, none is staged), and the same
 * rows of the tail planes (zero in the padding both ways); the weights in the layout's order (geo[13]
 * when the caller repacked them once, else here).  Only the rows the call reads are copied, so a call
 * split over parts copies about the input once in all.  0, or -1 (nothing left allocated). */
static int gemm_tail_open(gemm_src *s, const int8_t *x, const int64_t *g, int64_t m0, int64_t m1, int64_t nob,
                          const int8_t *wpack) {
    const int64_t H = g[0], W = g[1], C = g[2], kh = g[3], kw = g[4], sh = g[5], ph = g[7], pw = g[8];
    const int64_t Ho = g[11], Wo = g[12], kwc = kw * C, Wp = W + 2 * pw, tq = (kh + 3) / 4;
    const int64_t b0 = m0 / (Ho * Wo), b1 = (m1 - 1) / (Ho * Wo), nb = b1 - b0 + 1;
    const int64_t oh0 = m0 / Wo % Ho, oh1 = (m1 - 1) / Wo % Ho;
    const int64_t need = (Ho - 1) * sh + 4 * tq; /* the last output row's tail reads */
    s->nseg = kh, s->segq = kwc / 4, s->tq = tq;
    s->Kq = kh * s->segq + tq; /* == Kq0: kh * (kwc - 1) + 4 * ceil(kh / 4) is 4 * ceil(kh * kwc / 4) */
    s->tlen = need > H + ph ? need : H + ph;
    s->xpad = malloc((size_t)(nb * H * Wp * C));
    s->tail = calloc((size_t)(nb * Wp * s->tlen), 1);
    s->wrep = g[13] ? NULL : malloc((size_t)(nob * s->Kq * 64));
    if (!s->xpad || !s->tail || (!g[13] && !s->wrep)) {
        free(s->xpad), free(s->tail), free(s->wrep);
        s->xpad = s->tail = s->wrep = NULL;
        s->nseg = 1, s->tq = 0, s->Kq = s->Kq0;
        return -1;
    }
    s->win = s->xpad, s->wrow = Wp, s->wpad = 0, s->wb0 = b0;
    for (int64_t b = 0; b < nb; b++) {
        /* the input rows of output rows oh0.. (first image) ..oh1 (last image): dilation 1 (or kh 1) */
        const int64_t oa = b == 0 ? oh0 : 0, ob = b == nb - 1 ? oh1 : Ho - 1;
        const int64_t ia = oa * sh - ph > 0 ? oa * sh - ph : 0;
        const int64_t ib = ob * sh - ph + kh < H ? ob * sh - ph + kh : H;
        const int8_t *xb = x + (b0 + b) * H * W * C;
        int8_t *tb = s->tail + (b * Wp + pw) * s->tlen + ph;
        for (int64_t ih = ia; ih < ib; ih++) {
            int8_t *row = s->xpad + (b * H + ih) * Wp * C;
            memset(row, 0, (size_t)(pw * C));
            memcpy(row + pw * C, xb + ih * W * C, (size_t)(W * C));
            memset(row + (pw + W) * C, 0, (size_t)(pw * C));
            for (int64_t iw = 0; iw < W; iw++) tb[iw * s->tlen + ih] = xb[(ih * W + iw) * C + C - 1];
        }
    }
    if (g[13]) {
        s->wp = (const int8_t *)(intptr_t)g[13];
    } else {
        gemm_tail_weights(wpack, nob, s, s->wrep);
        s->wp = s->wrep;
    }
    return 0;
}

/* How a conv of geometry g over Op output channels walks GEMM_SLIDE (1: the padded grid, 2: output rows)
 * or 0 (not at all: a panel of copied rows instead), by a rough cost per output in cycles on this
 * machine's tiles (about 1000 multiply-adds a cycle): the panel computes 64 * ceil(K / 64) bytes of K
 * per row and copies its kh (+1) pieces (about 6 cycles each, plus K / 32); the grid walk computes
 * kh * L per position, of which the share Ho * Wo / (Hp * Wp) is kept; the row walk kh * L per row
 * plus the dropped rows of each output row's last 16-row tile.  (resnet18: its 56x56 3x3 convs walk the
 * grid, 7% dropped; its 7x7 ones keep the panel, 40% would be dropped at 512 channels; the 7x7 stem,
 * stride 2 on 3 channels, walks rows: 7 x 64 bytes a row against 8 copied pieces.) */
static int gemm_slide_mode(const int64_t *g, int64_t Op) {
    const int64_t H = g[0], W = g[1], C = g[2], kh = g[3], kw = g[4], sh = g[5], sw = g[6], ph = g[7], pw = g[8];
    const int64_t dw = g[10], Ho = g[11], Wo = g[12], K = kh * kw * C, L = (kw * C + 63) / 64 * 64;
    if (dw != 1 && kw != 1) return 0;
    const double per = (double)Op / 1000.0;
    const double panel = (double)((K + 63) / 64 * 64) * per + 6.0 * (double)(kh + ((kw * C) % 4 != 0)) + (double)K / 32.0;
    const double grid = sh == 1 && sw == 1 ? (double)(kh * L) * per * (double)((H + 2 * ph) * (W + 2 * pw)) /
                                                 (double)(Ho * Wo)
                                           : 1e300;
    const double rows = (double)(kh * L) * per * (double)((Wo + 15) / 16 * 16) / (double)Wo;
    if (panel <= grid && panel <= rows) return 0;
    return grid <= rows ? 1 : 2;
}

/* gemm_slide_mode over nob blocks of 16 channels where the layer's GEMM_SLIDE weights are at hand (repacked in
 * geo[14], or the packed weights themselves when kw * C is a multiple of 64), else 0 */
static int gemm_slide_walk(const int64_t *g, int64_t nob) {
    return g[14] || g[4] * g[2] % 64 == 0 ? gemm_slide_mode(g, 16 * nob) : 0;
}

/* L = 64 * ceil(kw * C / 64): the bytes of a kernel row in GEMM_SLIDE's weights */
static int64_t gemm_slide_len(const int64_t *g) { return (g[4] * g[2] + 63) / 64 * 64; }

/* qc_gemm_slide_weights: a layer's weights wpack (O channels, K = kh * kw * C) in GEMM_SLIDE's order for
 * geometry geo, into out (16 * ceil(O / 16) * kh * L bytes): per block of 16 channels, kernel row i's
 * kw * C values then zeros up to L, in groups of 4 as wpack has them.  Once per layer, passed back in
 * geo[14] (gemm.py).  -1 when the layer needs none (kw * C a multiple of 64: wpack is in that order
 * already) or the geometry can never slide. */
QC_API int qc_gemm_slide_weights(const int8_t *wpack, int64_t O, const int64_t *geo, int8_t *out) {
    const int64_t kwc = geo[4] * geo[2], kh = geo[3], L = gemm_slide_len(geo), nob = (O + 15) / 16;
    const int64_t Kq0 = (kh * kwc + 3) / 4, Kq = kh * L / 4;
    if (kwc % 64 == 0 || (geo[10] != 1 && geo[4] != 1)) return -1;
    for (int64_t ob = 0; ob < nob; ob++)
        for (int64_t kq = 0; kq < Kq; kq++)
            for (int64_t j = 0; j < 16; j++)
                for (int64_t t = 0; t < 4; t++) {
                    const int64_t k2 = 4 * kq + t, i = k2 / L, r = k2 % L, k = i * kwc + r;
                    out[((ob * Kq + kq) * 16 + j) * 4 + t] = r < kwc ? wpack[((ob * Kq0 + k / 4) * 16 + j) * 4 + k % 4] : 0;
                }
    return 0;
}

/* GEMM_SLIDE's source for output rows m0..m1-1, walked as `mode` says (gemm_slide_mode): the padded rows
 * those outputs read, of images b0..b1, copied as x ^ 0x80 (padding 0x80) into s->xs, laid out as whole
 * padded images (rows no output of the call reads are left unwritten: only dropped positions read them);
 * the positions [qa, qb) (mode 1: of the padded grid; mode 2: the rows m0..m1 themselves).  The slack
 * after the last image covers a tile's 32 rows past the last position and a chunk past its last kernel
 * row.  0, or -1 out of memory. */
static int gemm_slide_open(gemm_src *s, const int8_t *x, const int64_t *g, int64_t m0, int64_t m1, const int8_t *ws,
                           int mode) {
    const int64_t H = g[0], W = g[1], C = g[2], kh = g[3], sh = g[5], sw = g[6], ph = g[7], pw = g[8], dh = g[9];
    const int64_t Ho = g[11], Wo = g[12], Hp = H + 2 * ph, Wp = W + 2 * pw, L = gemm_slide_len(g);
    const int64_t b0 = m0 / (Ho * Wo), b1 = (m1 - 1) / (Ho * Wo), nb = b1 - b0 + 1;
    const int64_t oh0 = m0 / Wo % Ho, ow0 = m0 % Wo, oh1 = (m1 - 1) / Wo % Ho, ow1 = (m1 - 1) % Wo;
    const size_t bytes = (size_t)(nb * Hp * Wp * C + 32 * sw * C + L + 64);
    s->xs = malloc(bytes);
    if (!s->xs) return -1;
    memset(s->xs + nb * Hp * Wp * C, 0x80, bytes - (size_t)(nb * Hp * Wp * C));
    for (int64_t b = 0; b < nb; b++) {
        /* the padded rows the call's outputs of this image read */
        const int64_t ra = b == 0 ? oh0 * sh : 0, last = oh1 * sh + (kh - 1) * dh + 1;
        const int64_t rb = b == nb - 1 && last < Hp ? last : Hp;
        const int8_t *xb = x + (b0 + b) * H * W * C;
        for (int64_t r = ra; r < rb; r++) {
            uint8_t *d = s->xs + ((b * Hp + r) * Wp) * C;
            const int64_t ih = r - ph;
            if (ih < 0 || ih >= H) {
                memset(d, 0x80, (size_t)(Wp * C));
                continue;
            }
            memset(d, 0x80, (size_t)(pw * C));
            gemm_xor80_copy((int8_t *)d + pw * C, xb + ih * W * C, W * C);
            memset(d + (pw + W) * C, 0x80, (size_t)(pw * C));
        }
    }
    s->mode = GEMM_SLIDE, s->srows = mode == 2, s->Hp = Hp, s->Wp = Wp, s->sb0 = b0, s->lc = L / 64;
    s->qa = mode == 2 ? m0 : oh0 * Wp + ow0, s->qb = mode == 2 ? m1 : ((nb - 1) * Hp + oh1) * Wp + ow1 + 1;
    s->Kq = kh * L / 4, s->nseg = 1, s->segq = s->Kq, s->tq = 0, s->wp = ws;
    /* positions a block: the windows it reads (its positions and the kernel rows below) about 32 KiB */
    const int64_t mb = ((32 << 10) / (C > 0 ? C : 1) - (kh - 1) * dh * Wp) / 32 * 32;
    s->mb = mb < 64 ? 64 : mb;
    return 0;
}

/* The bytes of padded copy (GEMM_SLIDE) a call may make at once: a call whose images would need more
 * runs a few images at a time (gemm_slide_images), so the copy stays within this whatever the batch
 * (64 images of unet's 224x224 x 48 would copy 157 MB at once; the same bits either way).
 * qc_gemm_slide_cap changes it (tests: a small cap cuts small inputs). */
static int64_t gemm_slide_cap = (int64_t)32 << 20;
QC_API int64_t qc_gemm_slide_cap(int64_t bytes) {
    if (bytes > 0) __atomic_store_n(&gemm_slide_cap, bytes, __ATOMIC_RELAXED);
    return __atomic_load_n(&gemm_slide_cap, __ATOMIC_RELAXED);
}

/* Rows m0..m1-1 of a conv of geometry g on tiles: 0 when they read the input as one call, else the rows
 * of each piece to run them in (whole images, pieces starting at multiples of it), where GEMM_SLIDE's
 * padded copy of their images would pass gemm_slide_cap. */
static int64_t gemm_slide_images(const int64_t *g, int64_t m0, int64_t m1, int64_t nob) {
    const int64_t HoWo = g[11] * g[12], img = (g[0] + 2 * g[7]) * (g[1] + 2 * g[8]) * g[2];
    const int64_t nimg = (m1 - 1) / HoWo - m0 / HoWo + 1, cap = __atomic_load_n(&gemm_slide_cap, __ATOMIC_RELAXED);
    if (nimg <= 1 || nimg * img <= cap || !gemm_slide_walk(g, nob)) return 0;
    const int64_t k = cap / (img > 0 ? img : 1);
    return (k > 1 ? k : 1) * HoWo;
}

/* GEMM_SLIDE walked by output rows: where output row m's window starts in the padded copy */
static inline const uint8_t *gemm_slide_at(const gemm_src *s, int64_t m) {
    const int64_t *g = s->g, C = g[2], Ho = g[11], Wo = g[12];
    const int64_t lb = m / (Ho * Wo) - s->sb0, oh = m / Wo % Ho, ow = m % Wo;
    return s->xs + ((lb * s->Hp + oh * g[5]) * s->Wp + ow * g[6]) * C;
}

/* GEMM_SLIDE: the output row each position q0..q1-1 computes (-1: dropped, or outside the call's rows
 * m0..m1-1) into map[0..q1-q0); the number kept. */
static int64_t gemm_slide_map(const gemm_src *s, int64_t q0, int64_t q1, int64_t m0, int64_t m1, int64_t *map) {
    const int64_t Ho = s->g[11], Wo = s->g[12], Hp = s->Hp, Wp = s->Wp;
    int64_t lb = q0 / (Hp * Wp), rem = q0 % (Hp * Wp), oh = rem / Wp, ow = rem % Wp, kept = 0;
    for (int64_t q = q0; q < q1; q++) {
        const int64_t m = oh < Ho && ow < Wo ? ((s->sb0 + lb) * Ho + oh) * Wo + ow : -1;
        map[q - q0] = m >= m0 && m < m1 ? m : -1;
        kept += map[q - q0] >= 0;
        if (++ow == Wp) {
            ow = 0;
            if (++oh == Hp) oh = 0, lb++;
        }
    }
    return kept;
}

/* The layout of rows m0..m1-1 (rows of mb per block) and its buffers; 0, or -1 out of memory (nothing
 * left allocated). */
static int gemm_src_open(gemm_src *s, const int8_t *x, int64_t ldx, const int64_t *g, int64_t m0, int64_t m1,
                         int64_t K, int64_t nob, const int8_t *wpack, int amx) {
    *s = (gemm_src){.x = x, .ldx = ldx, .g = g, .mode = GEMM_PLAIN, .K = K, .Kq0 = (K + 3) / 4, .Kq = (K + 3) / 4,
                    .nseg = 1, .segq = (K + 3) / 4, .wp = wpack, .amx = amx};
    s->xored = !g && (K % 4 || K < GEMM_INPLACE_MIN_K);
    const int walk = amx && g ? gemm_slide_walk(g, nob) : 0;
    if (walk) return gemm_slide_open(s, x, g, m0, m1, g[14] ? (const int8_t *)(intptr_t)g[14] : wpack, walk);
    if (g) {
        const int64_t W = g[1], kh = g[3], Ho = g[11], Wo = g[12], kwc = g[4] * g[2];
        s->mode = gemm_layout(g, nob);
        if (s->mode == GEMM_DIRECT) {
            s->nseg = kh, s->segq = kwc / 4;
            s->win = x, s->wrow = W, s->wpad = g[8], s->wb0 = 0;
        } else if (s->mode == GEMM_TAIL && gemm_tail_open(s, x, g, m0, m1, nob, wpack)) {
            s->mode = GEMM_IM2COL; /* (its buffers could not be allocated: the rows are staged instead) */
        }
        if (s->mode == GEMM_IM2COL) s->segq = s->Kq0, s->xored = 1;
        s->b = m0 / (Ho * Wo), s->oh = m0 / Wo % Ho, s->ow = m0 % Wo;
    }
#ifdef GEMM_AMX_BUILT
    s->mb = amx ? gemm_amx_rows((4 * s->Kq + 63) / 64 * 64) : gemm_block_rows(s->Kq); /* (the panel's row) */
#else
    s->mb = gemm_block_rows(s->Kq);
#endif
    /* (AMX: zeroed, so a tile's rows past the call's last one read defined bytes) */
    s->xu = amx ? calloc((size_t)(s->mb * 4 * s->Kq + 64), 1) : malloc((size_t)(s->mb * 4 * s->Kq + 64));
    const int inplace = s->mode == GEMM_DIRECT || s->mode == GEMM_TAIL;
    s->zrow = inplace ? calloc((size_t)(g[4] * g[2]), 1) : NULL;
    s->q = inplace ? malloc(sizeof(int64_t) * (size_t)(2 * (s->nseg + 1))) : NULL;
    if (!s->xu || (inplace && (!s->zrow || !s->q))) {
        gemm_src_close(s);
        return -1;
    }
    return 0;
}

#define GEMM_PTRS_VEC 8 /* pointers a row up to which they are made in one vector (a 7x7 stem: 7 + 1) */

/* The pointers of the in-place output (b, oh, ow) (kernel row i at q[i], the tail at q[kh]) and their
 * steps to (b, oh, ow + 1): sw pixels along x (0 for a kernel row in the vertical padding, which
 * stays on zrow), sw columns along the tail plane. */
static void gemm_window(const gemm_src *s, int64_t b, int64_t oh, int64_t ow, int64_t *q, int64_t *d) {
    const int64_t *g = s->g;
    const int64_t H = g[0], C = g[2], kh = g[3], kw = g[4], sh = g[5], sw = g[6], ph = g[7], dh = g[9];
    const int64_t ih0 = oh * sh - ph, iw0 = ow * sw - s->wpad, rowb = s->wrow * C;
    const int8_t *xb = s->win + ((b - s->wb0) * H * s->wrow + iw0) * C;
    for (int64_t i = 0; i < kh; i++) {
        const int64_t ih = ih0 + i * dh, in = ih >= 0 && ih < H;
        q[i] = (int64_t)(intptr_t)(in ? xb + ih * rowb : s->zrow);
        d[i] = in ? sw * C : 0;
    }
    if (s->tq) {
        q[kh] = (int64_t)(intptr_t)(s->tail + ((b - s->wb0) * s->wrow + iw0 + kw - 1) * s->tlen + oh * sh);
        d[kh] = sw * s->tlen;
    }
}

/* Pointers to rows r0..r1-1 (the rows after the previous call's) into xp, nseg + (tq > 0) a row, rows
 * staged into s->xu from its start where the layout needs it. */
static void gemm_rows(gemm_src *restrict s, int64_t r0, int64_t r1, const int8_t **restrict xp) {
    const int8_t *x = s->x;
    const int64_t Kq = s->Kq;
    if (s->mode == GEMM_PLAIN) {
        if (!s->xored) {
            for (int64_t r = r0; r < r1; r++) xp[r - r0] = x + r * s->ldx;
        } else {
            if (s->ldx == s->K && s->K == 4 * Kq) { /* the rows follow each other: one pass */
                gemm_xor80_copy(s->xu, x + r0 * s->ldx, (r1 - r0) * s->K);
            } else {
                gemm_stage(x, s->ldx, r0, r1, s->K, Kq, s->xu);
                gemm_xor80(s->xu, (r1 - r0) * 4 * Kq);
            }
            /* (a tile of staged rows reads only its first row's pointer: GEMM_TILE_FN) */
            for (int64_t r = r0; r < r1; r += GEMM_MR) xp[r - r0] = s->xu + (r - r0) * 4 * Kq;
        }
        return;
    }
    const int64_t *g = s->g;
    const int64_t W = g[1], kw = g[4], sw = g[6], pw = g[8], Ho = g[11], Wo = g[12];
    const int64_t seg = 4 * s->segq, per = s->nseg + (s->tq > 0);
    /* outputs whose window lies inside the input along W: ow in [ow_lo, ow_hi) */
    const int64_t ow_lo = s->mode == GEMM_TAIL ? 0 : (pw + sw - 1) / sw; /* (GEMM_TAIL: its copy is padded) */
    const int64_t ow_hi = s->mode == GEMM_TAIL ? Wo : W - kw + pw >= 0 ? (W - kw + pw) / sw + 1 : 0;
    const int inplace = s->mode == GEMM_DIRECT || s->mode == GEMM_TAIL;
    int64_t b = s->b, oh = s->oh, ow = s->ow, *q = s->q, *d = s->q + per;
    for (int64_t r = r0; r < r1;) {
        const int64_t run = r1 - r < Wo - ow ? r1 - r : Wo - ow; /* rows left in this output row */
        for (int64_t k = 0; k < run;) {
            const int64_t o = ow + k;
            const int8_t **p = xp + (r + k - r0) * per;
            if (inplace && o >= ow_lo && o < ow_hi) {
                /* a stretch of inside outputs: the first one's pointers, then each a step further */
                const int64_t n = run - k < ow_hi - o ? run - k : ow_hi - o;
                gemm_window(s, b, oh, o, q, d);
                if (per <= GEMM_PTRS_VEC) {
                    const __mmask8 mk = (__mmask8)((1u << per) - 1);
                    __m512i vq = _mm512_maskz_loadu_epi64(mk, q);
                    const __m512i vd = _mm512_maskz_loadu_epi64(mk, d);
                    for (int64_t j = 0; j < n; j++, p += per, vq = _mm512_add_epi64(vq, vd))
                        _mm512_mask_storeu_epi64((void *)p, mk, vq);
                } else {
                    for (int64_t j = 0; j < n; j++, p += per)
                        for (int64_t i = 0; i < per; i++) {
                            p[i] = (const int8_t *)(intptr_t)q[i];
                            q[i] += d[i];
                        }
                }
                k += n;
                continue;
            }
            int8_t *dst = s->xu + (r + k - r0) * 4 * s->Kq; /* (not GEMM_TAIL: all its rows are in place) */
            gemm_stage_row(x, g, b, oh, o, s->Kq, dst);
            for (int64_t i = 0; i < s->nseg; i++) p[i] = dst + i * seg;
            k++;
        }
        r += run;
        if ((ow += run) == Wo) { /* the next output row */
            ow = 0;
            if (++oh == Ho) {
                oh = 0;
                b++;
            }
        }
    }
    s->b = b, s->oh = oh, s->ow = ow;
    if (s->xored) gemm_xor80(s->xu, (r1 - r0) * 4 * Kq); /* (GEMM_IM2COL: every row staged) */
}

/* AMX: rows 0..rows-1 of a row block from gemm_rows' pointers (a row: nseg segments of 4 * segq bytes,
 * then 4 * tq bytes if tq) copied as x ^ 0x80 into a panel of rows lda bytes apart (the bytes past
 * 4 * Kq are left as they are: they meet zero weights). */
static void gemm_amx_panel(const gemm_src *s, const int8_t *const *xp, int64_t rows, uint8_t *panel, int64_t lda) {
    const int64_t per = s->nseg + (s->tq > 0), seg = 4 * s->segq;
    for (int64_t r = 0; r < rows; r++) {
        int8_t *d = (int8_t *)panel + r * lda;
        const int8_t *const *p = xp + r * per;
        for (int64_t i = 0; i < s->nseg; i++, d += seg) gemm_xor80_copy(d, p[i], seg);
        if (s->tq) gemm_xor80_copy(d, p[s->nseg], 4 * s->tq);
    }
}

/* Per-channel constants of the epilogue, padded with zeros to Op = 16 * ceil(O / 16) channels, in one
 * allocation of 7 arrays: M, hm1(s), pm = (s > 0), s, s - n, s - nb, with s = n (no fused add) or
 * max(n, nb) (fused add; s - n and s - nb then bring both terms to the denominator 2**s), and the
 * float64 factors M * 2**-n (exact: M < 2**53, a power-of-two scaling in the normal range). */
static void gemm_consts_fill(const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb, int64_t *k) {
    const int64_t Op = (O + 15) / 16 * 16;
    double *f = (double *)(k + 6 * Op);
    for (int64_t c = 0; c < O; c++) {
        int64_t s = add && nb > n[c] ? nb : n[c];
        k[c] = M[c];
        k[Op + c] = s > 0 ? ((int64_t)1 << (s - 1)) - 1 : 0;
        k[2 * Op + c] = s > 0;
        k[3 * Op + c] = s;
        k[4 * Op + c] = s - n[c];
        k[5 * Op + c] = s - nb;
        f[c] = ldexp((double)M[c], (int)-n[c]);
    }
}

static int64_t *gemm_consts(const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb) {
    int64_t *k = calloc((size_t)(7 * ((O + 15) / 16 * 16) + 1), sizeof(int64_t));
    if (k) gemm_consts_fill(M, n, O, add, nb, k);
    return k;
}

/* round_clamp() on 8 int64 lanes (per-lane hm1, pm, s): the same operations, lane-wise. */
static inline __m512i round_clamp_x8(__m512i x, __m512i hm1, __m512i pm, __m512i s, __m512i lo, __m512i hi) {
    __m512i q = _mm512_add_epi64(_mm512_add_epi64(x, hm1), _mm512_and_si512(_mm512_srav_epi64(x, s), pm));
    q = _mm512_srav_epi64(q, s);
    q = _mm512_max_epi64(q, lo);
    return _mm512_min_epi64(q, hi);
}

#define GEMM_LD(P) _mm512_loadu_si512((const void *)(P))

/* 8 channels ch..ch+7 of the epilogue: int32 acc sign-extended to int64, times M (vpmuldq: |M| < 2**31,
 * exact 64-bit product), [+ the fused term b * Mb, both shifted to the denominator 2**s], rounded
 * and clamped; kc holds gemm_consts()'s 6 arrays of Op entries. */
static inline __m512i gemm_requant_x8(__m256i acc, const int64_t *kc, int64_t Op, int64_t ch, int add, __m512i bterm,
                                      __m512i lo, __m512i hi) {
    __m512i v = _mm512_mul_epi32(_mm512_cvtepi32_epi64(acc), GEMM_LD(kc + ch));
    if (add) v = _mm512_add_epi64(_mm512_sllv_epi64(v, GEMM_LD(kc + 4 * Op + ch)),
                                  _mm512_sllv_epi64(bterm, GEMM_LD(kc + 5 * Op + ch)));
    return round_clamp_x8(v, GEMM_LD(kc + Op + ch), GEMM_LD(kc + 2 * Op + ch), GEMM_LD(kc + 3 * Op + ch), lo, hi);
}

/* 16 channels of the epilogue without a fused add, in float64, when the caller proved |acc| * |M| < 2**53:
 * acc * (M * 2**-n) is then exact (an integer below 2**53 scaled by a power of two), the clamp to the
 * integers [lo, hi] commutes with rounding, and the conversion rounds half to even (embedded RNE):
 * clamp(round_half_even(acc * M / 2**n), lo, hi) exactly, as round_clamp gives it.  Int32 results. */
static inline __m512i gemm_requant_f64_x16(__m512i acc, const int64_t *kc, int64_t Op, int64_t ch, __m512d lo,
                                           __m512d hi) {
    const double *f = (const double *)(kc + 6 * Op) + ch;
    __m512d a = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(acc)), _mm512_loadu_pd(f));
    __m512d b = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc, 1)), _mm512_loadu_pd(f + 8));
    a = _mm512_min_pd(_mm512_max_pd(a, lo), hi);
    b = _mm512_min_pd(_mm512_max_pd(b, lo), hi);
    __m256i ia = _mm512_cvt_roundpd_epi32(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i ib = _mm512_cvt_roundpd_epi32(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_inserti64x4(_mm512_castsi256_si512(ia), ib, 1);
}

/* As gemm_requant_f64_x16 when the caller also proved |acc| * M / 2**n < 2**31 - 1 (f64 == 2): the
 * products then convert to int32 without overflow (rounded half to even), and the clamp to the
 * integers [lo, hi] runs on the int32 results (clamping commutes with rounding to integers). */
static inline __m512i gemm_requant_f64i_x16(__m512i acc, const int64_t *kc, int64_t Op, int64_t ch, __m512i lo,
                                            __m512i hi) {
    const double *f = (const double *)(kc + 6 * Op) + ch;
    __m512d a = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(acc)), _mm512_loadu_pd(f));
    __m512d b = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc, 1)), _mm512_loadu_pd(f + 8));
    __m256i ia = _mm512_cvt_roundpd_epi32(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i ib = _mm512_cvt_roundpd_epi32(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(ia), ib, 1);
    return _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
}

/* 16 fused operands (int8 / int16, masked load) and their int64 halves; 16 int32 results (in range
 * after the clamp) narrowed to int8 / int16 stores. */
#define GEMM_BLD_8(P, MK) _mm256_castsi128_si256(_mm_maskz_loadu_epi8(MK, P))
#define GEMM_BLO_8(V) _mm512_cvtepi8_epi64(_mm256_castsi256_si128(V))
#define GEMM_BHI_8(V) _mm512_cvtepi8_epi64(_mm_srli_si128(_mm256_castsi256_si128(V), 8))
#define GEMM_BLD_16(P, MK) _mm256_maskz_loadu_epi16(MK, P)
#define GEMM_BLO_16(V) _mm512_cvtepi16_epi64(_mm256_castsi256_si128(V))
#define GEMM_BHI_16(V) _mm512_cvtepi16_epi64(_mm256_extracti128_si256(V, 1))
#define GEMM_ST_8(P, MK, FULL, Q)                                                                        \
    ((FULL) ? _mm_storeu_si128((__m128i *)(P), _mm512_cvtepi32_epi8(Q)) : _mm512_mask_cvtepi32_storeu_epi8(P, MK, Q))
#define GEMM_ST_16(P, MK, FULL, Q)                                                                       \
    ((FULL) ? _mm256_storeu_si256((__m256i *)(P), _mm512_cvtepi32_epi16(Q))                            \
            : _mm512_mask_cvtepi32_storeu_epi16(P, MK, Q))

/* The packed epilogue (f64 == 2 without a fused add, [lo, hi] inside the output type's range), 7
 * instructions per 16 lanes and whole-vector packs instead of 9 and four narrowing stores:
 * the tile's accumulators start at bias32 ^ 2**31, so each lane ends as u = acc + 2**31 (mod 2**32;
 * acc is in [-2**31, 2**31), so u is exact in [0, 2**32)).  Interleaved with the high word
 * 0x43300000, u is the float64 2**52 + u; minus 2**52 + 2**31 that is acc exactly (integers below
 * 2**53).  fma(acc, M * 2**-n, 1.5 * 2**52) rounds once, half to even ({rn-sae}): acc * M * 2**-n is
 * exact and below 2**31 in magnitude (the f64 == 2 bound), so the sum lies in [2**52, 2**53), where
 * the unit in the last place is 1: the rounding is round_half_even() to an integer, held
 * two's-complement in the low 32 bits of the float64.  The unpacks work within 128-bit lanes, so
 * the factors come permuted (fq: per 16 channels 0,1,4,5,8,9,12,13 then 2,3,6,7,10,11,14,15) and
 * shufps {0, 2} puts the 16 results back in channel order.  The packs saturate to the output type,
 * and clamping after that equals clamping before it ([lo, hi] lies inside the type's range).
 * (cvtdq2pd + vpermt2d instead of the unpacks and subtractions measured 5-14% slower on Zen4.) */
#define GEMM_SET1_8(V) _mm512_set1_epi8((char)(V))
#define GEMM_SET1_16(V) _mm512_set1_epi16((short)(V))
typedef struct {
    __m512i hw, perm, lo, hi; /* 0x43300000 words, the pack's permutation, the clamp */
    __m512d off, mag;         /* 2**52 + 2**31, 1.5 * 2**52 */
    __m512d g, goff;          /* the fused operand's factor Mb * 2**-nb and -(2**52 + 2**31) * Mb * 2**-nb */
} gemm_epi_k;

static inline __attribute__((always_inline)) __m512i gemm_epi_x16(__m512i u, const double *fq, const gemm_epi_k *k) {
    __m512d a = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(u, k->hw)), k->off);
    __m512d b = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(u, k->hw)), k->off);
    a = _mm512_fmadd_round_pd(a, _mm512_loadu_pd(fq), k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm512_fmadd_round_pd(b, _mm512_loadu_pd(fq + 8), k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castpd_ps(a), _mm512_castpd_ps(b), 0x88));
}

/* With a fused add (f64 == 3): the operand b (16 lanes, sign-extended to int32) enters the same way,
 * u_b = b ^ 2**31 as 2**52 + u_b, and fma(2**52 + u_b, g, -(2**52 + 2**31) * g) = b * g exactly (g =
 * Mb * 2**-nb; (2**52 + 2**31) * g = Mb * (2**21 + 1) * 2**(31 - nb) has at most 53 significant bits, and
 * so has b * g).  Then fma(acc, M * 2**-n, b * g) is the exact sum: it is X * 2**-s for the integer X
 * over the common denominator 2**s (s = max(n, nb)), which the caller proved below 2**53 (and below
 * (2**31 - 1) * 2**s), so one rounding of the exact value changes nothing.  Adding 1.5 * 2**52 then
 * rounds it half to even as above (two roundings, the first exact). */
static inline __attribute__((always_inline)) __m512i gemm_epi_add_x16(__m512i u, __m512i b32, const double *fq,
                                                                      const gemm_epi_k *k) {
    const __m512i ub = _mm512_xor_si512(b32, _mm512_set1_epi32((int)0x80000000u));
    const __m512d tl = _mm512_fmadd_round_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(ub, k->hw)), k->g, k->goff,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d th = _mm512_fmadd_round_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(ub, k->hw)), k->g, k->goff,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d a = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(u, k->hw)), k->off);
    __m512d b = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(u, k->hw)), k->off);
    a = _mm512_fmadd_round_pd(a, _mm512_loadu_pd(fq), tl, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm512_fmadd_round_pd(b, _mm512_loadu_pd(fq + 8), th, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    a = _mm512_add_round_pd(a, k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm512_add_round_pd(b, k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castpd_ps(a), _mm512_castpd_ps(b), 0x88));
}

/* four vectors of 16 int32 results (channel order) to nc <= 64 int8 outputs: packs (int32 -> int16 ->
 * int8, within 128-bit lanes) and one dword permutation back to channel order */
static inline __attribute__((always_inline)) void gemm_epi_store_8(__m512i r0, __m512i r1, __m512i r2, __m512i r3,
                                                                   int8_t *o, int64_t nc, const gemm_epi_k *k) {
    __m512i q = _mm512_packs_epi16(_mm512_packs_epi32(r0, r1), _mm512_packs_epi32(r2, r3));
    q = _mm512_min_epi8(_mm512_max_epi8(_mm512_permutexvar_epi32(k->perm, q), k->lo), k->hi);
    if (nc >= 64)
        _mm512_storeu_si512((void *)o, q);
    else
        _mm512_mask_storeu_epi8(o, ((uint64_t)1 << nc) - 1, q);
}

/* the same to int16 outputs: 32 channels per pack and qword permutation */
static inline __attribute__((always_inline)) void gemm_epi_half_16(__m512i r0, __m512i r1, int16_t *o, int64_t nc,
                                                                   const gemm_epi_k *k) {
    __m512i q = _mm512_permutexvar_epi64(k->perm, _mm512_packs_epi32(r0, r1));
    q = _mm512_min_epi16(_mm512_max_epi16(q, k->lo), k->hi);
    if (nc >= 32)
        _mm512_storeu_si512((void *)o, q);
    else
        _mm512_mask_storeu_epi16(o, ((uint32_t)1 << nc) - 1, q);
}
static inline __attribute__((always_inline)) void gemm_epi_store_16(__m512i r0, __m512i r1, __m512i r2, __m512i r3,
                                                                    int16_t *o, int64_t nc, const gemm_epi_k *k) {
    gemm_epi_half_16(r0, r1, o, nc, k);
    if (nc > 32) gemm_epi_half_16(r2, r3, o + 32, nc - 32, k);
}

/* 16 fused operands of a row from channel c on (nc of the tile's channels valid) as int32 */
#define GEMM_B32_8(P, MK) _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(MK, P))
#define GEMM_B32_16(P, MK) _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(MK, P))
static inline __mmask16 gemm_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

#define GEMM_PERM_8 _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0)
#define GEMM_PERM_16 _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0)
/* a tile row's 16 lanes j: as stored, or plus the start value bi (tiles that start from 0: AMX) */
#define GEMM_LDT(T, BI, J) ((BI) ? _mm512_add_epi32(GEMM_LD((T) + 16 * (J)), GEMM_LD((BI) + 16 * (J))) : GEMM_LD((T) + 16 * (J)))
/* one row of a tile (tile + r * 64, nr zmm; [+ bi]) through the packed epilogue, [b: its row of fused operands] */
#define GEMM_EPI_TILE_FN(OUT_T, OBITS)                                                                   \
    static inline __attribute__((always_inline)) void gemm_epi_tile_##OBITS(int nr, const int32_t *t,      \
                                                                           const int32_t *bi,             \
                                                                           const double *fq, OUT_T *o,    \
                                                                           int64_t nc, const gemm_epi_k *k) { \
        const __m512i z = _mm512_setzero_si512();                                                         \
        gemm_epi_store_##OBITS(gemm_epi_x16(GEMM_LDT(t, bi, 0), fq, k),                                   \
                               nr > 1 ? gemm_epi_x16(GEMM_LDT(t, bi, 1), fq + 16, k) : z,                \
                               nr > 2 ? gemm_epi_x16(GEMM_LDT(t, bi, 2), fq + 32, k) : z,                \
                               nr > 3 ? gemm_epi_x16(GEMM_LDT(t, bi, 3), fq + 48, k) : z, o, nc, k);     \
    }
#define GEMM_EPI_ADD_FN(B_T, BBITS, OUT_T, OBITS)                                                        \
    static inline __attribute__((always_inline)) void gemm_epi_add_##BBITS##_##OBITS(                    \
        int nr, const int32_t *t, const int32_t *bi, const B_T *b, const double *fq, OUT_T *o, int64_t nc,   \
        const gemm_epi_k *k) {                                                                            \
        const __m512i z = _mm512_setzero_si512();                                                         \
        __m512i r[4] = {z, z, z, z};                                                                      \
        for (int j = 0; j < 4; j++)                                                                       \
            if (j < nr)                                                                                   \
                r[j] = gemm_epi_add_x16(GEMM_LDT(t, bi, j), GEMM_B32_##BBITS(b + 16 * j, gemm_lanes(nc - 16 * j)), \
                                        fq + 16 * j, k);                                                  \
        gemm_epi_store_##OBITS(r[0], r[1], r[2], r[3], o, nc, k);                                         \
    }
GEMM_EPI_TILE_FN(int8_t, 8)
GEMM_EPI_TILE_FN(int16_t, 16)
GEMM_EPI_ADD_FN(int8_t, 8, int8_t, 8)
GEMM_EPI_ADD_FN(int8_t, 8, int16_t, 16)
GEMM_EPI_ADD_FN(int16_t, 16, int8_t, 8)
GEMM_EPI_ADD_FN(int16_t, 16, int16_t, 16)

/* The packed epilogue's constants for Op channels, in one allocation: the accumulators' start
 * bias32 ^ 2**31 (int32, Op entries) and the permuted float64 factors (Op entries) that follow. */
static void gemm_epi_fill(const int32_t *bias32, const int64_t *kc, int64_t Op, int32_t *bx) {
    const double *f = (const double *)(kc + 6 * Op);
    double *fq = (double *)(bx + Op); /* (Op is a multiple of 16: aligned) */
    for (int64_t c = 0; c < Op; c++) bx[c] = (int32_t)((uint32_t)bias32[c] ^ 0x80000000u);
    for (int64_t c = 0; c < Op; c += 16)
        for (int l = 0; l < 4; l++)
            for (int t = 0; t < 2; t++) {
                fq[c + 2 * l + t] = f[c + 4 * l + t];
                fq[c + 8 + 2 * l + t] = f[c + 4 * l + 2 + t];
            }
}

static int32_t *gemm_epi_consts(const int32_t *bias32, const int64_t *kc, int64_t Op) {
    int32_t *bx = malloc(sizeof(int32_t) * (size_t)Op + sizeof(double) * (size_t)Op + 64);
    if (bx) gemm_epi_fill(bias32, kc, Op, bx);
    return bx;
}

/* A layer's constants prepared once (gemm.py, DepthwiseConv), instead of on every call (and in every part
 * of a split one): gemm_consts' arrays, then the packed epilogue's (used where a call's f64, lo and hi take
 * it; not filled for bias32 NULL, the depthwise kernel's use), qc_gemm_prep_bytes(O) bytes from
 * qc_gemm_prep.  Building them cost 2-18 us a call (O = 96-1280), against a few us of work for a small
 * layer's part. */
#define GEMM_KC_BYTES(Op) ((size_t)(7 * (Op) + 1) * sizeof(int64_t))
QC_API int64_t qc_gemm_prep_bytes(int64_t O) {
    const int64_t Op = (O + 15) / 16 * 16;
    return (int64_t)(GEMM_KC_BYTES(Op) + sizeof(int32_t) * (size_t)Op + sizeof(double) * (size_t)Op);
}
QC_API int qc_gemm_prep(const int32_t *bias32, const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb,
                        void *pre) {
    const int64_t Op = (O + 15) / 16 * 16;
    memset(pre, 0, (size_t)qc_gemm_prep_bytes(O));
    gemm_consts_fill(M, n, O, add, nb, (int64_t *)pre);
    if (bias32) gemm_epi_fill(bias32, (const int64_t *)pre, Op, (int32_t *)((char *)pre + GEMM_KC_BYTES(Op)));
    return 0;
}

/* The epilogue of one row of a tile, 8 channels at a time (the last group masked): int32 acc
 * sign-extended to int64, times M (vpmuldq: |M| < 2**31, exact 64-bit product), [+ the fused term,
 * both shifted to 2**s], rounded and clamped, narrowed to BITS-wide stores. */
#define GEMM_FN(NAME, B_T, BBITS, OUT_T, OBITS, ADD)                                                     \
    QC_API int NAME(const int8_t *restrict x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t O,   \
                    const int8_t *restrict wpack, const int32_t *restrict bias32, const int64_t *restrict M,  \
                    const int64_t *restrict n, const B_T *restrict b, int64_t Mb, int64_t nb, int64_t lo,  \
                    int64_t hi, int f64, const int64_t *restrict geo, OUT_T *restrict out, const void *pre) { \
        if (m1 <= m0) return 0;                                                                           \
        const int64_t nob = (O + 15) / 16, Op = nob * 16;                                                  \
        const __m512d dlo = _mm512_set1_pd((double)lo), dhi = _mm512_set1_pd((double)hi);                 \
        const __m512i ilo = _mm512_set1_epi32((int32_t)lo), ihi = _mm512_set1_epi32((int32_t)hi);         \
        /* tiles (32 rows) or vectors (GEMM_MR) */                                                        \
        const int amx = gemm_amx_takes(m1 - m0, K, O);                                                    \
        /* a padded copy (GEMM_SLIDE) of more than gemm_slide_cap bytes: a few images at a time */        \
        const int64_t step = amx && geo ? gemm_slide_images(geo, m0, m1, nob) : 0;                        \
        for (int64_t a0 = m0; step && a0 < m1;) {                                                         \
            const int64_t a1 = (a0 / step + 1) * step < m1 ? (a0 / step + 1) * step : m1;                 \
            if (NAME(x, ldx, a0, a1, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre)) return -1; \
            if ((a0 = a1) == m1) return 0;                                                                \
        }                                                                                                 \
        gemm_src src;                                                                                     \
        if (gemm_src_open(&src, x, ldx, geo, m0, m1, K, nob, wpack, amx)) return -1;                      \
        /* GEMM_SLIDE: rows are positions of the padded grid (slide), or output rows walked row by row */ \
        const int inplace_a = src.mode == GEMM_SLIDE; /* (A read from the padded copy) */                  \
        const int slide = inplace_a && !src.srows, srows = inplace_a && src.srows;                        \
        const int64_t Kq = src.Kq, wstride = Kq * 64, mb = src.mb, per = src.nseg + (src.tq > 0);         \
        const int64_t MR = amx ? 32 : GEMM_MR;                                                            \
        /* AMX: A rows from the padded copy in place (GEMM_SLIDE), from xu as staged (x ^ 0x80 already), or   \
         * copied into a panel; the weights' zero-padded last chunks */                                  \
        const int64_t lda = inplace_a ? geo[6] * geo[2] : !amx || src.xored ? 4 * Kq : (4 * Kq + 63) / 64 * 64; \
        uint8_t *panel = amx && !inplace_a && !src.xored ? calloc((size_t)(mb * lda + 64), 1) : NULL;     \
        int8_t *wt = amx && !inplace_a ? gemm_amx_wtail(src.wp, nob, Kq) : NULL;                          \
        /* the layer's constants: prepared once (qc_gemm_prep), or built for this call */                 \
        int64_t *kc = pre ? (int64_t *)pre : gemm_consts(M, n, O, ADD, nb);                               \
        const int8_t **xp = inplace_a ? NULL : malloc(sizeof(*xp) * (size_t)(mb * per));                 \
        int64_t *map = slide ? malloc(sizeof(int64_t) * (size_t)mb) : NULL;                               \
        if (!kc || (!inplace_a && !xp) || (slide && !map) || (amx && !inplace_a && !src.xored && !panel) || \
            (amx && !inplace_a && Kq % 16 && !wt)) {                                                      \
            if (!pre) free(kc);                                                                           \
            free(xp);                                                                                     \
            free(map);                                                                                    \
            free(panel);                                                                                  \
            free(wt);                                                                                     \
            gemm_src_close(&src);                                                                         \
            return -1;                                                                                    \
        }                                                                                                 \
        const uint8_t *arows = !amx ? NULL : inplace_a ? src.xs : src.xored ? (const uint8_t *)src.xu : panel; \
        /* A as the tile kernel reads it: the kernel rows dh * Wp pixels apart (GEMM_SLIDE), else one segment */ \
        const int64_t nseg = inplace_a ? geo[3] : 1, segstep = inplace_a ? geo[9] * src.Wp * geo[2] : 0;  \
        const int64_t lc = inplace_a ? src.lc : Kq / 16;                                                  \
        if (amx) gemm_amx_config();                                                                       \
        const __m512i vlo = _mm512_set1_epi64(lo), vhi = _mm512_set1_epi64(hi), vMb = _mm512_set1_epi64(Mb); \
        int32_t tile[32 * 64] __attribute__((aligned(64))); /* (GEMM_MR or 32 rows of 64 channels) */    \
        const int64_t tmax = OBITS == 8 ? 127 : 32767;                                                    \
        /* the packed epilogue when it applies (and its tables could be allocated), else the one below */ \
        int32_t *bx = f64 == (ADD ? 3 : 2) && lo >= -tmax - 1 && hi <= tmax                              \
                          ? pre ? (int32_t *)((char *)pre + GEMM_KC_BYTES(Op)) : gemm_epi_consts(bias32, kc, Op) \
                          : NULL;                                                                         \
        const double *fq = bx ? (const double *)(bx + Op) : NULL;                                          \
        const double gb = ldexp((double)Mb, (int)-nb);                                                    \
        const gemm_epi_k ek = {_mm512_set1_epi32(0x43300000), GEMM_PERM_##OBITS, GEMM_SET1_##OBITS(lo),   \
                               GEMM_SET1_##OBITS(hi), _mm512_set1_pd(0x1.000008p52), _mm512_set1_pd(0x1.8p52), \
                               _mm512_set1_pd(gb), _mm512_set1_pd(-0x1.000008p52 * gb)};                  \
        const int64_t rbeg = slide ? src.qa : m0, rend = slide ? src.qb : m1;                             \
        for (int64_t r0 = rbeg; r0 < rend; r0 += mb) {                                                    \
            const int64_t r1 = r0 + mb < rend ? r0 + mb : rend;                                           \
            if (slide) {                                                                                  \
                if (!gemm_slide_map(&src, r0, r1, m0, m1, map)) continue;                                 \
            } else if (!srows) {                                                                          \
                gemm_rows(&src, r0, r1, xp);                                                              \
                if (panel) gemm_amx_panel(&src, xp, r1 - r0, panel, lda);                                 \
            }                                                                                             \
            for (int64_t ob = 0; ob < nob; ob += GEMM_NR) {                                               \
                const int nr = (int)(nob - ob < GEMM_NR ? nob - ob : GEMM_NR);                            \
                const int64_t c0 = 16 * ob, nc = 16 * nr < O - c0 ? 16 * nr : O - c0;                     \
                for (int64_t m = r0, rows; m < r1; m += rows) {                                           \
                    rows = r1 - m < MR ? r1 - m : MR;                                                     \
                    if (srows && geo[12] - m % geo[12] < rows) rows = geo[12] - m % geo[12]; /* (one output row) */ \
                    const int64_t *mp = slide ? map + (m - r0) : NULL; /* each tile row's output row */   \
                    if (mp) {                                                                             \
                        int64_t any = 0;                                                                  \
                        for (int64_t r = 0; r < rows; r++) any |= mp[r] >= 0;                            \
                        if (!any) continue;                                                               \
                    }                                                                                     \
                    const int32_t *init = bx ? bx : bias32; /* the accumulators' start (bias32 ^ 2**31 packed) */ \
                    /* (tiles start from 0 and the epilogue adds init; the vector kernel starts from init) */  \
                    const int32_t *bi = amx ? init + c0 : NULL;                                           \
                    if (amx)                                                                              \
                        gemm_amx_tile(srows ? gemm_slide_at(&src, m) : arows + (slide ? m : m - r0) * lda, lda, \
                                      nseg, segstep, lc, rows, Kq,                                        \
                                      src.wp + ob * wstride, wt ? wt + ob * 1024 : NULL, nr, tile);       \
                    else                                                                                  \
                        gemm_tile_nr(xp + (m - r0) * per, rows, src.nseg, src.segq, src.tq, src.xored,    \
                                     src.wp + ob * wstride, wstride, nr, init + c0, tile);                \
                    for (int64_t r = 0; r < rows; r++) {                                                  \
                        const int64_t mr = mp ? mp[r] : m + r;                                            \
                        if (mr < 0) continue;                                                             \
                        OUT_T *o = out + mr * O + c0;                                                     \
                        const B_T *bb = ADD ? b + mr * O + c0 : NULL;                                     \
                        if (bx) {                                                                         \
                            if (ADD)                                                                      \
                                gemm_epi_add_##BBITS##_##OBITS(nr, tile + r * 64, bi, bb, fq + c0, o, nc, &ek); \
                            else                                                                          \
                                gemm_epi_tile_##OBITS(nr, tile + r * 64, bi, fq + c0, o, nc, &ek);        \
                            continue;                                                                     \
                        }                                                                                 \
                        if (bi) /* (the other epilogues read the tile row with its start value added) */    \
                            for (int64_t c = 0; c < 16 * nr; c += 16)                                     \
                                _mm512_store_si512((void *)(tile + r * 64 + c),                           \
                                                   _mm512_add_epi32(_mm512_load_si512((const void *)(tile + r * 64 + c)), \
                                                                    GEMM_LD(bi + c)));                    \
                        for (int64_t c = 0; c < nc; c += 16) {                                            \
                            const int full = nc - c >= 16;                                                \
                            const __mmask16 mk = full ? (__mmask16)0xFFFF : (__mmask16)((1u << (nc - c)) - 1); \
                            const int64_t ch = c0 + c;                                                    \
                            __m512i blo = _mm512_setzero_si512(), bhi = blo;                              \
                            if (ADD) {                                                                    \
                                const __m256i bv = GEMM_BLD_##BBITS(bb + c, mk);                          \
                                blo = _mm512_mul_epi32(GEMM_BLO_##BBITS(bv), vMb);                        \
                                bhi = _mm512_mul_epi32(GEMM_BHI_##BBITS(bv), vMb);                        \
                            }                                                                             \
                            const int32_t *t = tile + r * 64 + c;                                         \
                            if (!ADD && f64 == 2) {                                                       \
                                const __m512i q = gemm_requant_f64i_x16(_mm512_load_si512((const void *)t), kc, Op, \
                                                                        ch, ilo, ihi);                    \
                                GEMM_ST_##OBITS(o + c, mk, full, q);                                      \
                                continue;                                                                 \
                            }                                                                             \
                            if (!ADD && f64) {                                                            \
                                const __m512i q = gemm_requant_f64_x16(_mm512_load_si512((const void *)t), kc, Op, \
                                                                       ch, dlo, dhi);                     \
                                GEMM_ST_##OBITS(o + c, mk, full, q);                                      \
                                continue;                                                                 \
                            }                                                                             \
                            __m512i qlo = gemm_requant_x8(_mm256_load_si256((const __m256i *)t), kc, Op, ch, ADD, \
                                                          blo, vlo, vhi);                                 \
                            __m512i qhi = gemm_requant_x8(_mm256_load_si256((const __m256i *)(t + 8)), kc, Op, \
                                                          ch + 8, ADD, bhi, vlo, vhi);                    \
                            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(qlo)), \
                                                           _mm512_cvtepi64_epi32(qhi), 1);                \
                            GEMM_ST_##OBITS(o + c, mk, full, q);                                          \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        if (amx) _tile_release();                                                                         \
        if (!pre) {                                                                                       \
            free(kc);                                                                                     \
            free(bx);                                                                                     \
        }                                                                                                 \
        free(xp);                                                                                         \
        free(map);                                                                                        \
        free(panel);                                                                                      \
        free(wt);                                                                                         \
        gemm_src_close(&src);                                                                             \
        return 0;                                                                                         \
    }

GEMM_FN(qc_gemm_i8, int8_t, 8, int8_t, 8, 0)
GEMM_FN(qc_gemm_i16, int8_t, 8, int16_t, 16, 0)
GEMM_FN(qc_gemm_add_i8_i8, int8_t, 8, int8_t, 8, 1)
GEMM_FN(qc_gemm_add_i16_i8, int16_t, 16, int8_t, 8, 1)
GEMM_FN(qc_gemm_add_i8_i16, int8_t, 8, int16_t, 16, 1)
GEMM_FN(qc_gemm_add_i16_i16, int16_t, 16, int16_t, 16, 1)

/* qc_gemm_*_mt: the same call with its rows m0..m1 split over `parts` threads (qc_run_rows): each
 * part is one call of the kernel above on its own rows, with its own constants and staging panel. */
typedef struct {
    const int8_t *x;
    int64_t ldx, K, O;
    const int8_t *wpack;
    const int32_t *bias32;
    const int64_t *M, *n;
    const void *b;
    int64_t Mb, nb, lo, hi;
    int f64;
    const int64_t *geo;
    void *out;
    const void *pre;
} gemm_args;

#define GEMM_MT_FN(NAME, B_T, OUT_T)                                                                     \
    static int NAME##_rows(void *ctx, int64_t r0, int64_t r1) {                                          \
        const gemm_args *a = ctx;                                                                         \
        return NAME(a->x, a->ldx, r0, r1, a->K, a->O, a->wpack, a->bias32, a->M, a->n, (const B_T *)a->b, \
                    a->Mb, a->nb, a->lo, a->hi, a->f64, a->geo, (OUT_T *)a->out, a->pre);                 \
    }                                                                                                     \
    QC_API int NAME##_mt(const int8_t *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t O,      \
                         const int8_t *wpack, const int32_t *bias32, const int64_t *M, const int64_t *n,   \
                         const B_T *b, int64_t Mb, int64_t nb, int64_t lo, int64_t hi, int f64,             \
                         const int64_t *geo, OUT_T *out, const void *pre, int parts) {                    \
        gemm_args a = {x, ldx, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre};         \
        return qc_run_rows(NAME##_rows, &a, m0, m1, parts, GEMM_MR);                                     \
    }

GEMM_MT_FN(qc_gemm_i8, int8_t, int8_t)
GEMM_MT_FN(qc_gemm_i16, int8_t, int16_t)
GEMM_MT_FN(qc_gemm_add_i8_i8, int8_t, int8_t)
GEMM_MT_FN(qc_gemm_add_i16_i8, int16_t, int8_t)
GEMM_MT_FN(qc_gemm_add_i8_i16, int8_t, int16_t)
GEMM_MT_FN(qc_gemm_add_i16_i16, int16_t, int16_t)
QC_STEP_ARGS_FIT(gemm_args);

/* qc_gemm_*_step: the same call as a plan step (qc_run_plan), rows m0..m1 */
#define GEMM_STEP_FN(NAME, B_T, OUT_T)                                                                   \
    QC_API int NAME##_step(qc_step *st, void *ctx, const int8_t *x, int64_t ldx, int64_t m0, int64_t m1,  \
                           int64_t K, int64_t O, const int8_t *wpack, const int32_t *bias32, const int64_t *M, \
                           const int64_t *n, const B_T *b, int64_t Mb, int64_t nb, int64_t lo, int64_t hi,  \
                           int f64, const int64_t *geo, OUT_T *out, const void *pre) {                    \
        gemm_args *a = ctx;                                                                               \
        *a = (gemm_args){x, ldx, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre};       \
        *st = (qc_step){NAME##_rows, ctx, m0, m1, GEMM_MR, (m1 - m0) * K * O};                           \
        return 0;                                                                                         \
    }

GEMM_STEP_FN(qc_gemm_i8, int8_t, int8_t)
GEMM_STEP_FN(qc_gemm_i16, int8_t, int16_t)
GEMM_STEP_FN(qc_gemm_add_i8_i8, int8_t, int8_t)
GEMM_STEP_FN(qc_gemm_add_i16_i8, int16_t, int8_t)
GEMM_STEP_FN(qc_gemm_add_i8_i16, int8_t, int16_t)
GEMM_STEP_FN(qc_gemm_add_i16_i16, int16_t, int16_t)

/* Depthwise int8 conv (as qc_dwconv_* above: same geometry, same results) with AVX512-VNNI, four
 * horizontal taps per int32 lane (vpdpbusd, u8 x s8 -> int32, wrap-around, not the saturating form).
 *
 * Per block of 16 channels and input row ih, the row is widened once into Z: entry q holds, for each
 * channel c of the block, the 4 bytes x[ih, p + t*dw, c] ^ 0x80 (t = 0..3, p = q - pw; taps outside
 * the input are the zero point 0, so the byte 0x80), i.e. 64 bytes = one vpdpbusd operand.  Output
 * (oh, ow) is then bias32 + sum over rows i and tap groups g of vpdpbusd(Z_i[ow*sw + 4g*dw], w4[i, g]):
 * kh * ceil(kw / 4) instructions per 16 outputs (3 for a 3x3) with no bounds checks, the weights in
 * registers, and each widened entry reused by every output row and column that reads it.  A ring of
 * kh widened rows (tagged by ih) carries rows over from one output row to the next; rows outside the
 * input read a constant row of 0x80.  w4: int8 (kh, G, Cp, 4), G = ceil(kw / 4), Cp = 16 * ceil(C / 16),
 * w4[i, g, c, t] = w[c, i, 4g + t] (zero beyond kw and C: a zero weight adds nothing whatever the byte).
 *
 * Exactness, as the GEMM's: each byte is x + 128 (unsigned), and the caller packs
 * b32[c] = bias[c] - 128 * sum_{i,j} w[c, i, j].  It proves 128 * max_c sum |w_c| + max |bias| < 2**31,
 * so b32 and the true sum fit int32; every vpdpbusd step is exact modulo 2**32 (each product fits
 * |255 * 128| < 2**15, four of them int32), so the final lane is bias + sum x * w, the true accumulator.
 * Weights must be int8 (-128..127; a +128 stays on the scalar kernel).  The epilogue, chosen by the
 * caller's proofs (f64_epilogue in qcompiler/native/kernels.py): epi == 0 gemm_requant_x8 (int64,
 * |M| < 2**31); 1 gemm_requant_f64_x16 (|acc| * |M| < 2**53); 2 (|acc| * |M| / 2**n < 2**31 - 1 on every
 * channel) float64 without conversion instructions:
 *  - the bias starts 2**31 higher (modulo 2**32), so a lane ends as u = acc + 2**31 in [1, 2**32) read
 *    unsigned; pairing it with the high word 0x43300000 (vpunpck{l,h}dq) gives the double 2**52 + u
 *    exactly, minus 2**52 + 2**31 (exact: both and the result are integers below 2**53): acc, exact;
 *  - fma(acc, f, 1.5 * 2**52) with f = M * 2**-n (exact) rounds the exact acc * M / 2**n + 1.5 * 2**52
 *    once, half to even (embedded {rn-sae}, whatever MXCSR says), to a double in [2**52, 2**53) (|acc * f| < 2**31 < 2**51), whose spacing is 1:
 *    1.5 * 2**52 + round_half_even(acc * M / 2**n) (1.5 * 2**52 is even, so ties keep their parity);
 *  - its low 32 bits are that rounded value modulo 2**32, i.e. the value itself (|.| < 2**31): gathered
 *    back into channel order (vpermt2d) and clamped to [lo, hi] in int32.
 * 11 instructions per 16 outputs, none on the conversion units (gemm_requant_f64i_x16 takes 4 converts).
 * pre: the layer's per-channel constants from qc_gemm_prep (bias32 NULL, add 0), or NULL to build them in
 * the call from M and n (a split call builds them in every part and for every sample). */
#define DW4_BAND (192 << 10)
#define DW4_FN(NAME, OUT_T, OBITS)                                                                       \
    QC_API int NAME(const int8_t *restrict x, int64_t N, int64_t H, int64_t W, int64_t C,                  \
                    const int8_t *restrict w4, int64_t kh, int64_t kw, const int32_t *restrict b32,         \
                    int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t Ho,     \
                    int64_t Wo, const int64_t *restrict M, const int64_t *restrict n, int64_t lo,           \
                    int64_t hi, int epi, OUT_T *restrict out, const void *pre) {                          \
        const int64_t G = (kw + 3) / 4, KT = kh * G, Cp = (C + 15) / 16 * 16;                             \
        const int64_t Wq = (Wo - 1) * sw + 4 * (G - 1) * dw + 1, Wx = Wq + 3 * dw;                        \
        const int64_t qs = (4 * dw) % sw == 0 ? sw : 1; /* every Z entry read is a multiple of qs */      \
        /* gcd(dh, kh) == 1: the rows ih0 + i * dh (i < kh) of one output row differ modulo kh (kh divides  \
         * (i - j) * dh only if it divides i - j), so row ih can live in slot ih % kh without a search */ \
        int64_t gd = dh, gk = kh;                                                                         \
        while (gk) {                                                                                      \
            const int64_t t = gd % gk;                                                                    \
            gd = gk;                                                                                      \
            gk = t;                                                                                       \
        }                                                                                                 \
        const int direct = gd == 1;                                                                       \
        const int sat = hi == (OBITS == 8 ? INT8_MAX : INT16_MAX); /* DW4_ST_* clamps at hi */             \
        /* the layer's constants: prepared once (qc_gemm_prep, bias32 NULL), or built for this call */     \
        int64_t *kc = pre ? (int64_t *)pre : gemm_consts(M, n, C, 0, 0);                                  \
        uint8_t *zb = aligned_alloc(64, (size_t)(64 * ((kh + 1) * Wq + Wx / 4 + 1)));                     \
        int64_t *tag = malloc(sizeof(int64_t) * (size_t)kh);                                              \
        const uint8_t **rp = malloc(sizeof(uint8_t *) * (size_t)kh);                                      \
        __m512i *wv = aligned_alloc(64, 64 * (size_t)KT);                                                 \
        if (!kc || !zb || !tag || !rp || !wv) {                                                           \
            if (!pre) free(kc);                                                                           \
            free(zb);                                                                                     \
            free(tag);                                                                                    \
            free(rp);                                                                                     \
            free(wv);                                                                                     \
            return -1;                                                                                    \
        }                                                                                                 \
        uint8_t *zrow = zb + 64 * kh * Wq, *xp = zrow + 64 * Wq; /* the row outside the input; padded row */ \
        memset(zrow, 0x80, (size_t)(64 * Wq));                                                            \
        const __m512i vlo = _mm512_set1_epi64(lo), vhi = _mm512_set1_epi64(hi), zero = _mm512_setzero_si512(); \
        const __m512i vlo32 = _mm512_set1_epi32((int32_t)lo), vhi32 = _mm512_set1_epi32((int32_t)hi);    \
        const __m512d dlo = _mm512_set1_pd((double)lo), dhi = _mm512_set1_pd((double)hi);                 \
        const __m512i e52 = _mm512_set1_epi32(0x43300000); /* the high word of 2**52 */                   \
        const __m512d m1 = _mm512_set1_pd(4503601774854144.0), m2 = _mm512_set1_pd(6755399441055744.0); \
        __m512i pidx; /* result lane e <- the low word of ya / yb's 64-bit lane holding channel e */         \
        {                                                                                                 \
            int32_t pb[16];                                                                               \
            for (int e = 0; e < 16; e++) pb[e] = 2 * (2 * (e / 4) + e % 2) + (e % 4 >= 2 ? 16 : 0);      \
            pidx = _mm512_loadu_si512((const void *)pb);                                                  \
        }                                                                                                 \
        const __m128i flip = _mm_set1_epi8((char)0x80);                                                   \
        /* byte 4c + t of a Z entry <- byte 16t + c of the 4 padded-row entries (tap t, channel c) */     \
        __m512i idx;                                                                                      \
        {                                                                                                 \
            int8_t ib[64];                                                                                \
            for (int k = 0; k < 64; k++) ib[k] = (int8_t)(16 * (k % 4) + k / 4);                          \
            idx = _mm512_loadu_si512((const void *)ib);                                                   \
        }                                                                                                 \
        /* bands of output rows whose input rows stay in L2 (DW4_BAND bytes) while the channel blocks pass */ \
        const int64_t band = DW4_BAND / (sh * W * C + 1) + 1;                                             \
        for (int64_t b = 0; b < N; b++)                                                                   \
            for (int64_t oh0 = 0; oh0 < Ho; oh0 += band)                                                  \
            for (int64_t c0 = 0; c0 < C; c0 += 16) {                                                      \
                const int full = C - c0 >= 16;                                                            \
                const __mmask16 mk = full ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c0)) - 1);        \
                for (int64_t t = 0; t < KT; t++) wv[t] = GEMM_LD(w4 + (t * Cp + c0) * 4);                 \
                /* epi == 2: the factors M * 2**-n of the lanes unpacklo / unpackhi pair with 2**52 */  \
                double fab[16];                                                                           \
                for (int j = 0; j < 16; j++)                                                              \
                    fab[j] = ((const double *)(kc + 6 * Cp))[c0 + 4 * (j % 8 / 2) + 2 * (j / 8) + j % 2];  \
                const __m512d fa = _mm512_loadu_pd(fab), fb = _mm512_loadu_pd(fab + 8);                   \
                const __m512i bv = epi == 2 ? _mm512_xor_si512(GEMM_LD(b32 + c0), _mm512_set1_epi32(INT32_MIN)) \
                                            : GEMM_LD(b32 + c0);                                          \
                for (int64_t s = 0; s < kh; s++) tag[s] = -1;                                             \
                for (int64_t oh = oh0; oh < Ho && oh < oh0 + band; oh++) {                                \
                    for (int64_t i = 0; i < kh; i++) {                                                    \
                        const int64_t ih = oh * sh - ph + i * dh;                                         \
                        if (ih < 0 || ih >= H) {                                                          \
                            rp[i] = zrow;                                                                 \
                            continue;                                                                     \
                        }                                                                                 \
                        int64_t s = direct ? ih % kh : 0;                                                 \
                        while (!direct && s < kh && tag[s] != ih) s++;                                    \
                        if (direct ? tag[s] != ih : s == kh) { /* widen row ih into its slot, or one empty or */ \
                            for (s = direct ? s : 0; !direct && tag[s] >= 0; s++) { /* holding no row needed */ \
                                int64_t u = 0;                                                            \
                                while (u < kh && tag[s] != oh * sh - ph + u * dh) u++;                    \
                                if (u == kh) break;                                                       \
                            }                                                                             \
                            tag[s] = ih;                                                                  \
                            const int8_t *xr = x + ((b * H + ih) * W) * C + c0;                           \
                            uint8_t *z = zb + 64 * s * Wq;                                                \
                            if (dw == 1 && qs == 1) { /* the 4 chunks q..q+3 slide along the row in a register */ \
                                __m512i win = _mm512_setzero_si512();                                     \
                                for (int64_t q = -3; q < Wq; q++) { /* chunk q + 3 shifts in */   \
                                    const int64_t p = q + 3 - pw;                                         \
                                    const __m128i v = p >= 0 && p < W                                     \
                                        ? _mm_xor_si128(_mm_maskz_loadu_epi8(mk, xr + p * C), flip) : flip; \
                                    win = _mm512_alignr_epi64(_mm512_castsi128_si512(v), win, 2);         \
                                    if (q >= 0)                                                           \
                                        _mm512_store_si512((void *)(z + 64 * q), _mm512_permutexvar_epi8(idx, win)); \
                                }                                                                         \
                            } else if (dw == 1 && qs == 2) { /* stride 2: two chunks shift in per entry */ \
                                __m512i win = _mm512_setzero_si512();                                     \
                                for (int64_t q = -2; q < Wq; q += 2) { /* chunks q + 2, q + 3 shift in */  \
                                    const int64_t p = q + 2 - pw;                                         \
                                    const __m128i v0 = p >= 0 && p < W                                    \
                                        ? _mm_xor_si128(_mm_maskz_loadu_epi8(mk, xr + p * C), flip) : flip; \
                                    const __m128i v1 = p + 1 >= 0 && p + 1 < W                            \
                                        ? _mm_xor_si128(_mm_maskz_loadu_epi8(mk, xr + (p + 1) * C), flip) : flip; \
                                    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(v0), v1, 1); \
                                    win = _mm512_alignr_epi64(_mm512_castsi256_si512(v), win, 4);         \
                                    if (q >= 0)                                                           \
                                        _mm512_store_si512((void *)(z + 64 * q), _mm512_permutexvar_epi8(idx, win)); \
                                }                                                                         \
                            } else { /* dilated or stride > 2: the padded row, then 4 chunks dw apart per entry */ \
                                for (int64_t q = 0; q < Wx; q++) {                                        \
                                    const int64_t p = q - pw;                                             \
                                    __m128i v = p >= 0 && p < W ? _mm_maskz_loadu_epi8(mk, xr + p * C)    \
                                                                : _mm_setzero_si128();                    \
                                    _mm_store_si128((__m128i *)(xp + 16 * q), _mm_xor_si128(v, flip));    \
                                }                                                                         \
                                for (int64_t q = 0; q < Wq; q += qs) {                                    \
                                    const __m128i *e = (const __m128i *)(xp + 16 * q);                    \
                                    __m512i v = _mm512_castsi128_si512(_mm_load_si128(e));               \
                                    v = _mm512_inserti32x4(v, _mm_load_si128(e + dw), 1);                \
                                    v = _mm512_inserti32x4(v, _mm_load_si128(e + 2 * dw), 2);            \
                                    v = _mm512_inserti32x4(v, _mm_load_si128(e + 3 * dw), 3);            \
                                    _mm512_store_si512((void *)(z + 64 * q), _mm512_permutexvar_epi8(idx, v)); \
                                }                                                                         \
                            }                                                                             \
                        }                                                                                 \
                        rp[i] = zb + 64 * s * Wq;                                                         \
                    }                                                                                     \
                    OUT_T *o = out + ((b * Ho + oh) * Wo) * C + c0;                                       \
                    if (KT == 3)                                                                          \
                        DW4_ROW(OBITS, 3)                                                                 \
                    else if (KT == 1)                                                                     \
                        DW4_ROW(OBITS, 1)                                                                 \
                    else                                                                                  \
                        DW4_ROW(OBITS, KT)                                                                \
                }                                                                                         \
            }                                                                                             \
        if (!pre) free(kc);                                                                               \
        free(zb);                                                                                         \
        free(tag);                                                                                        \
        free(rp);                                                                                         \
        free(wv);                                                                                         \
        return 0;                                                                                         \
    }

/* 16 int32 results narrowed with signed saturation (vpmovsdb / vpmovsdw) and stored, the last block of
 * channels masked: results already in [lo, hi] are unchanged, and an upper clamp at the type's maximum
 * (hi == 127 / 32767, every relu6 layer of int8 out) is the saturation itself. */
#define DW4_ST_8(P, MK, FULL, R)                                                                         \
    ((FULL) ? _mm_storeu_si128((__m128i *)(P), _mm512_cvtsepi32_epi8(R)) : _mm512_mask_cvtsepi32_storeu_epi8(P, MK, R))
#define DW4_ST_16(P, MK, FULL, R)                                                                        \
    ((FULL) ? _mm256_storeu_si256((__m256i *)(P), _mm512_cvtsepi32_epi16(R))                            \
            : _mm512_mask_cvtsepi32_storeu_epi16(P, MK, R))

/* One output row of one channel block: NT = kh * G taps of 4 (a constant in the common cases, so the
 * loop unrolls and the weights stay in registers), then the epilogue chosen by epi. */
#define DW4_ROW(OBITS, NT)                                                                               \
    {                                                                                                     \
        const uint8_t *tp[NT]; /* tap group t's entry for ow = 0 */                                       \
        __m512i tw[NT];                                                                                   \
        for (int64_t t = 0; t < (NT); t++) {                                                              \
            tp[t] = rp[t / G] + 256 * (t % G) * dw;                                                       \
            tw[t] = wv[t];                                                                                \
        }                                                                                                 \
        const int64_t st = 64 * sw;                                                                       \
        for (int64_t ow = 0; ow < Wo; ow++) {                                                             \
            __m512i acc = bv;                                                                             \
            for (int64_t t = 0; t < (NT); t++) acc = _mm512_dpbusd_epi32(acc, GEMM_LD(tp[t] + st * ow), tw[t]); \
            __m512i r;                                                                                    \
            if (epi == 2) { /* lanes hold acc + 2**31 (the bias's offset): see DW4_FN */              \
                __m512d ya = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(acc, e52)), m1);     \
                __m512d yb = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(acc, e52)), m1);     \
                ya = _mm512_fmadd_round_pd(ya, fa, m2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);    \
                yb = _mm512_fmadd_round_pd(yb, fb, m2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);    \
                r = _mm512_permutex2var_epi32(_mm512_castpd_si512(ya), pidx, _mm512_castpd_si512(yb));    \
                r = _mm512_max_epi32(r, vlo32);                                                           \
                if (!sat) r = _mm512_min_epi32(r, vhi32);                                                 \
            }                                                                                             \
            else if (epi)                                                                                 \
                r = gemm_requant_f64_x16(acc, kc, Cp, c0, dlo, dhi);                                      \
            else {                                                                                        \
                __m512i qlo = gemm_requant_x8(_mm512_castsi512_si256(acc), kc, Cp, c0, 0, zero, vlo, vhi); \
                __m512i qhi = gemm_requant_x8(_mm512_extracti64x4_epi64(acc, 1), kc, Cp, c0 + 8, 0, zero, vlo, vhi); \
                r = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(qlo)),                \
                                       _mm512_cvtepi64_epi32(qhi), 1);                                    \
            }                                                                                             \
            DW4_ST_##OBITS(o + ow * C, mk, full, r);                                                      \
        }                                                                                                 \
    }

DW4_FN(qc_dwconv4_i8_i8, int8_t, 8)
DW4_FN(qc_dwconv4_i8_i16, int16_t, 16)

/* qc_dwconv4_*_mt: the same call with its N * Ho output rows (b, oh) split over `parts` threads
 * (qc_run_rows).  Output rows oh0..oh1-1 of sample b are the call on that sample with Ho = oh1 - oh0
 * and the padding ph - oh0 * sh (row oh of the part reads input row (oh0 + oh) * sh - ph + i * dh,
 * the whole call's; rows outside [0, H) are still padding), writing from output row oh0 on. */
typedef struct {
    const int8_t *x;
    int64_t H, W, C;
    const int8_t *w4;
    int64_t kh, kw;
    const int32_t *b32;
    int64_t sh, sw, ph, pw, dh, dw, Ho, Wo;
    const int64_t *M, *n;
    int64_t lo, hi;
    int epi;
    void *out;
    const void *pre;
} dw4_args;

#define DW4_MT_FN(NAME, OUT_T)                                                                           \
    static int NAME##_rows(void *ctx, int64_t r0, int64_t r1) {                                          \
        const dw4_args *a = ctx;                                                                          \
        QC_EACH_SAMPLE_ROWS(r0, r1, a->Ho,                                                                \
            NAME(a->x + b * a->H * a->W * a->C, 1, a->H, a->W, a->C, a->w4, a->kh, a->kw, a->b32, a->sh,     \
                 a->sw, a->ph - oh0 * a->sh, a->pw, a->dh, a->dw, oh1 - oh0, a->Wo, a->M, a->n, a->lo, a->hi, \
                 a->epi, (OUT_T *)a->out + (b * a->Ho + oh0) * a->Wo * a->C, a->pre))                      \
        return 0;                                                                                         \
    }                                                                                                     \
    QC_API int NAME##_mt(const int8_t *x, int64_t N, int64_t H, int64_t W, int64_t C, const int8_t *w4,    \
                         int64_t kh, int64_t kw, const int32_t *b32, int64_t sh, int64_t sw, int64_t ph,    \
                         int64_t pw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo, const int64_t *M,      \
                         const int64_t *n, int64_t lo, int64_t hi, int epi, OUT_T *out, const void *pre,   \
                         int parts) {                                                                      \
        if (parts <= 1)                                                                                   \
            return NAME(x, N, H, W, C, w4, kh, kw, b32, sh, sw, ph, pw, dh, dw, Ho, Wo, M, n, lo, hi, epi, out, \
                        pre);                                                                             \
        dw4_args a = {x, H, W, C, w4, kh, kw, b32, sh, sw, ph, pw, dh, dw, Ho, Wo, M, n, lo, hi, epi, out, pre}; \
        return qc_run_rows(NAME##_rows, &a, 0, N * Ho, parts, 1);                                         \
    }

DW4_MT_FN(qc_dwconv4_i8_i8, int8_t)
DW4_MT_FN(qc_dwconv4_i8_i16, int16_t)
QC_STEP_ARGS_FIT(dw4_args);

/* qc_dwconv4_*_step: the same call as a plan step (qc_run_plan), its N * Ho output rows */
#define DW4_STEP_FN(NAME, OUT_T)                                                                         \
    QC_API int NAME##_step(qc_step *st, void *ctx, const int8_t *x, int64_t N, int64_t H, int64_t W, int64_t C, \
                           const int8_t *w4, int64_t kh, int64_t kw, const int32_t *b32, int64_t sh, int64_t sw, \
                           int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo, const int64_t *M, \
                           const int64_t *n, int64_t lo, int64_t hi, int epi, OUT_T *out, const void *pre) { \
        dw4_args *a = ctx;                                                                                \
        *a = (dw4_args){x, H, W, C, w4, kh, kw, b32, sh, sw, ph, pw, dh, dw, Ho, Wo, M, n, lo, hi, epi, out, pre}; \
        *st = (qc_step){NAME##_rows, ctx, 0, N * Ho, 1, N * Ho * Wo * C * kh * kw};                       \
        return 0;                                                                                         \
    }

DW4_STEP_FN(qc_dwconv4_i8_i8, int8_t)
DW4_STEP_FN(qc_dwconv4_i8_i16, int16_t)

#else
QC_API int qc_gemm_vnni(void) { return 0; }
QC_API int qc_gemm_amx_set(int on) {
    (void)on;
    return 0;
}
QC_API int64_t qc_gemm_amx_calls(void) { return 0; }
#endif
/* ===================================== end of the int8 GEMM ===================================== */

/* qcompiler's native kernels: plain C, no Python or torch headers, called through ctypes.
 *
 * Every kernel keeps no state between calls and writes only to the buffers it is given, so it
 * may run on several threads at once (ctypes releases the GIL).  All are single-threaded but
 * qc_hist_abs_f32_mt, which splits its values over pthreads it joins before returning.
 * The Python side (qcompiler/native/kernels.py) checks dtypes, contiguity and sizes.
 *
 * Exactness: the requantization is integer arithmetic (int64, or __int128 where the caller
 * cannot prove int64 wide enough); the histogram bins |x| with a float64 product that is exact
 * (24-bit significand times a power of two or a small integer over one).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
 * counter.  A value whose index is not in [0, nbins) (|x| >= r, or NaN) is never counted: the
 * call returns -2 and leaves hist unchanged (for N <= 2**30; beyond, earlier chunks are added).
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

QC_API int qc_hist_abs_f32(const float *restrict x, int64_t N, double per_unit, int f32, int64_t nbins,
                           double *restrict hist, float *restrict mm) {
    uint32_t *counts = calloc((size_t)(nbins + HIST_SPREAD * 16), sizeof(uint32_t));
    if (!counts) return -1;
    int32_t idx[HIST_BLOCK];
    const float pu32 = (float)per_unit;
    const int32_t spare = (int32_t)nbins;
    float mn = INFINITY, mx = -INFINITY;
    for (int64_t start = 0; start < N; start += HIST_FLUSH) {
        int64_t stop = N - start < HIST_FLUSH ? N : start + HIST_FLUSH;
        int64_t zeros = 0;
        int bad = 0;
        for (int64_t b = start; b < stop; b += HIST_BLOCK) {
            int64_t m = stop - b < HIST_BLOCK ? stop - b : HIST_BLOCK;
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
            for (int64_t i = 0; i < m; i++) counts[idx[i]]++;
        }
        if (bad) {
            free(counts);
            return -2;
        }
        counts[0] += (uint32_t)zeros; /* bin 0's elements went to the slots */
        for (int64_t k = 0; k < nbins; k++) {
            hist[k] += (double)counts[k];
            counts[k] = 0;
        }
    }
    free(counts);
    if (mm) {
        mm[0] = mn;
        mm[1] = mx;
    }
    return 0;
}

/* ==== calibration kernels: histogram over threads, per-row min/max ==========================
 * qc_hist_abs_f32_mt: qc_hist_abs_f32 with the N values split into `threads` contiguous parts,
 * each binned by qc_hist_abs_f32 on its own thread (the caller's thread takes part 0) into its
 * own zeroed float64 partial histogram and min/max.  The partials hold integer counts (< 2**53),
 * so adding them is exact in any order: hist and mm come out bit for bit as one
 * qc_hist_abs_f32 over all N.  If any part returns -2 (NaN, or a value at or past the range)
 * hist is left unchanged (whatever N) and the call returns -2; -1: out of memory, or a thread
 * could not be started (hist unchanged).  threads <= 1 is qc_hist_abs_f32 itself. */
#define HIST_MAX_THREADS 64

typedef struct {
    const float *x;
    int64_t n;
    double per_unit;
    int f32;
    int64_t nbins;
    double *hist;
    float mm[2];
    int rc;
} hist_part;

static void *hist_part_run(void *arg) {
    hist_part *p = arg;
    p->rc = qc_hist_abs_f32(p->x, p->n, p->per_unit, p->f32, p->nbins, p->hist, p->mm);
    return NULL;
}

QC_API int qc_hist_abs_f32_mt(const float *restrict x, int64_t N, double per_unit, int f32, int64_t nbins,
                              double *restrict hist, float *restrict mm, int threads) {
    if (threads > N) threads = (int)N;
    if (threads > HIST_MAX_THREADS) threads = HIST_MAX_THREADS;
    if (threads <= 1) return qc_hist_abs_f32(x, N, per_unit, f32, nbins, hist, mm);
    hist_part parts[HIST_MAX_THREADS];
    pthread_t tid[HIST_MAX_THREADS];
    double *partial = calloc((size_t)threads * (size_t)nbins, sizeof(double));
    if (!partial) return -1;
    for (int t = 0; t < threads; t++) {
        int64_t lo = N * t / threads, hi = N * (t + 1) / threads;
        parts[t] = (hist_part){x + lo, hi - lo, per_unit, f32, nbins, partial + (int64_t)t * nbins, {0, 0}, 0};
    }
    int started = 1; /* threads running a part, the caller's included */
    while (started < threads && pthread_create(&tid[started], NULL, hist_part_run, &parts[started]) == 0) started++;
    hist_part_run(&parts[0]);
    for (int t = 1; t < started; t++) pthread_join(tid[t], NULL);
    int rc = started < threads ? -1 : 0;
    for (int t = 0; t < threads && rc == 0; t++)
        if (parts[t].rc == -1) rc = -1;
    for (int t = 0; t < threads && rc == 0; t++)
        if (parts[t].rc == -2) rc = -2;
    if (rc == 0) {
        float mn = INFINITY, mx = -INFINITY;
        for (int t = 0; t < threads; t++) {
            const double *pt = parts[t].hist;
            for (int64_t k = 0; k < nbins; k++) hist[k] += pt[k];
            mn = parts[t].mm[0] < mn ? parts[t].mm[0] : mn;
            mx = parts[t].mm[1] > mx ? parts[t].mm[1] : mx;
        }
        if (mm) {
            mm[0] = mn;
            mm[1] = mx;
        }
    }
    free(partial);
    return rc;
}
/* Per-row min and max of a (rows, cols) float32 matrix, row-major (a weight's output channels):
 * lo[r] = min_c x[r, c], hi[r] = max_c x[r, c].  Returns -2 when a value is NaN or an extreme is
 * infinite (the observer's NaN/Inf check; lo, hi are then meaningless), else 0. */
QC_API int qc_rows_minmax_f32(const float *restrict x, int64_t rows, int64_t cols, float *restrict lo,
                              float *restrict hi) {
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
        lo[r] = mn;
        hi[r] = mx;
    }
    return bad ? -2 : 0;
}
/* ==== end of calibration kernels =========================================================== */

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

/* qcompiler's native kernels: plain C, no Python or torch headers, called through ctypes.
 *
 * Every kernel is single-threaded, keeps no state between calls and writes only to the
 * buffers it is given, so it may run on several threads at once (ctypes releases the GIL).
 * The Python side (qcompiler/native/kernels.py) checks dtypes, contiguity and sizes.
 *
 * Exactness: the requantization is integer arithmetic (int64, or __int128 where the caller
 * cannot prove int64 wide enough); the histogram bins |x| with a float64 product that is exact
 * (24-bit significand times a power of two or a small integer over one).
 */
#include <math.h>
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
                int64_t q = (x + hm1[c] + ((x >> n[c]) & pm[c])) >> n[c];                                 \
                q = q < lo ? lo : q;                                                                      \
                q = q > hi ? hi : q;                                                                      \
                o[c] = (OUT_T)q;                                                                          \
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
                int64_t q = (x + hm1[c] + ((x >> ss[c]) & (ss[c] > 0))) >> ss[c];                         \
                q = q < lo ? lo : q;                                                                      \
                q = q > hi ? hi : q;                                                                      \
                o[c] = (OUT_T)q;                                                                          \
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

/* Histogram of |x| over [0, r): counts[floor(|x| * per_unit)] += 1 for the N float32 values x,
 * per_unit = nbins / r.  The caller guarantees every |x| < r and no NaN, so every index is in
 * [0, nbins).  The float64 product of a float32 |x| (24 bits) and per_unit (a power of two, or
 * an integer <= 2**21 over a power of two) is exact, so truncation is the exact floor.
 * counts: `ways` zeroed int64 arrays of nbins each (independent sub-histograms, so consecutive
 * equal indices do not wait on one another); they are summed into hist (float64) at the end. */
QC_API void qc_hist_abs_f32(const float *x, int64_t N, double per_unit, int64_t nbins, int64_t ways,
                            int64_t *counts, double *hist) {
    memset(counts, 0, sizeof(int64_t) * (size_t)(nbins * ways));
    int64_t i = 0;
    if (ways == 4) {
        int64_t *c0 = counts, *c1 = counts + nbins, *c2 = counts + 2 * nbins, *c3 = counts + 3 * nbins;
        for (; i + 4 <= N; i += 4) {
            c0[(int64_t)((double)fabsf(x[i]) * per_unit)]++;
            c1[(int64_t)((double)fabsf(x[i + 1]) * per_unit)]++;
            c2[(int64_t)((double)fabsf(x[i + 2]) * per_unit)]++;
            c3[(int64_t)((double)fabsf(x[i + 3]) * per_unit)]++;
        }
    }
    for (; i < N; i++) counts[(int64_t)((double)fabsf(x[i]) * per_unit)]++;
    for (int64_t w = 1; w < ways; w++)
        for (int64_t k = 0; k < nbins; k++) counts[k] += counts[w * nbins + k];
    if (hist)
        for (int64_t k = 0; k < nbins; k++) hist[k] += (double)counts[k];
}

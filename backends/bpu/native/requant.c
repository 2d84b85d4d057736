/* Requantization of exact accumulators (qc_requant_*), with a fused add (qc_requant_add_*). */
#include <stdint.h>
#include <stdlib.h>

#include "qc_pool.h"
#include "requant.h"

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

/* Concatenation: each input requantized into its columns of the output, in int64 or int32. */
#include <stdint.h>
#include <stdlib.h>

#include "plan.h"
#include "requant.h"

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

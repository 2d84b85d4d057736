/* Resize: bilinear with exact dyadic weights, and nearest, as plan steps too. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"

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

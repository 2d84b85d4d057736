/* Max pool, channels-last in and out, as a plan step too. */
#include <stdint.h>

#include "plan.h"

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

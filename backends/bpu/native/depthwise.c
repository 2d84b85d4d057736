/* Depthwise int8 convolution with the requantization, portable C (the VNNI one: gemm_vnni.c, qc_dwconv4_*). */
#include <stdint.h>
#include <stdlib.h>

#include "qc_pool.h"
#include "requant.h"

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

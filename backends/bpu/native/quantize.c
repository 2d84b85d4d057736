/* Quantize float32 on entering the BPU (qc_quantize_*), optionally straight into NHWC. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "qc_pool.h"

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

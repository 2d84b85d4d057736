/* Global average pool, channels-last in, with the requantization; a plan step too. */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "plan.h"
#include "requant.h"

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

/* The int8 GEMM's driver: the entry points of the GEMM and of the VNNI depthwise conv (what gemm.py and
 * kernels.py bind), each calling the kernel table picked once from the CPU's features (gemm.h); the
 * calls split over threads (*_mt) or built as plan steps (*_step); and the AMX mode, with the OS
 * permission the tiles need.  Portable C: it runs on any CPU and reaches the instruction-set files only
 * through what it picked, as onnxruntime's MLAS drivers reach their kernels. */
#include <cpuid.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gemm.h"

/* ================================================================================================
 * int8 GEMM with the requantization fused (qcompiler/native/gemm.py): 1x1 convs and linear layers.
 *
 *   acc[p, o]  = bias[o] + sum_k x[p, k] * w[o, k]                       (exact, int32)
 *   out[p, o]  = clamp(round_half_even(acc * M[o] / 2**n[o] [+ b[p, o] * Mb / 2**nb]), lo, hi)
 *
 * x: rows of int8 (row stride ldx), b and out: rows of O (int8 / int16).  Only rows m0..m1-1 are
 * computed, so callers may split the rows of one call over threads.  With geo != NULL (conv_geometry.h),
 * x is an NHWC conv input and row p is the im2col row of output position p, K = kh * kw * C, read in place where
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
 * weight adds nothing whatever the activation byte).  The epilogue is round_clamp() (requant.h), in int64;
 * the fused add brings both terms to the denominator 2**max(n, nb) as qc_requant_add_* does (the
 * caller proves that sum below 2**62; layers that need 128-bit sums stay on the other path).  Where
 * the caller proves the float64 bounds (f64 == 2 without, f64 == 3 with a fused add) the packed
 * float64 epilogue (gemm_epi_x16) runs instead.
 * ================================================================================================ */
/* qc_conv_geometry_layout: out[0] = sizeof(qc_conv_geometry), out[1] its number of fields, out[2..] their
 * offsets in order (at most 30): what gemm.py's ConvGeometry must mirror (tests compare the two). */
QC_API void qc_conv_geometry_layout(int64_t *out) {
    static const size_t at[] = {offsetof(qc_conv_geometry, H),  offsetof(qc_conv_geometry, W),
                                offsetof(qc_conv_geometry, C),  offsetof(qc_conv_geometry, kh),
                                offsetof(qc_conv_geometry, kw), offsetof(qc_conv_geometry, sh),
                                offsetof(qc_conv_geometry, sw), offsetof(qc_conv_geometry, ph),
                                offsetof(qc_conv_geometry, pw), offsetof(qc_conv_geometry, dh),
                                offsetof(qc_conv_geometry, dw), offsetof(qc_conv_geometry, Ho),
                                offsetof(qc_conv_geometry, Wo), offsetof(qc_conv_geometry, tail_w),
                                offsetof(qc_conv_geometry, slide_w)};
    out[0] = (int64_t)sizeof(qc_conv_geometry);
    out[1] = (int64_t)(sizeof at / sizeof at[0]);
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) out[2 + i] = (int64_t)at[i];
}

/* ---- the kernel table, picked once from CPUID ----------------------------------------------------------- */
/* A feature bit of CPUID leaf 7 (subleaf 0): its register (0 EBX, 1 ECX, 2 EDX) and bit */
typedef struct {
    int reg, bit;
} gemm_cpu_bit;
/* what each instruction set needs: AVX512F, BW, VL (EBX), VBMI, VNNI (ECX); AMX-TILE, AMX-INT8 (EDX) */
static const gemm_cpu_bit GEMM_VNNI_NEEDS[] = {{0, 16}, {0, 30}, {0, 31}, {1, 1}, {1, 11}};
static const gemm_cpu_bit GEMM_AMX_NEEDS[] = {{2, 24}, {2, 25}};
#define GEMM_XCR0_AVX512 0xe6u /* the state the OS must save: SSE, AVX, the opmasks, ZMM_Hi256, Hi16_ZMM */
#define GEMM_XCR0_AMX 0x60000u /* and XTILECFG, XTILEDATA */

/* Whether the CPU has needs[0..n) and the OS saves the registers' state (XCR0 holds xcr0) */
static int gemm_cpu_has(const gemm_cpu_bit *needs, size_t n, uint64_t xcr0) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return 0; /* OSXSAVE: XCR0 can be read */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((((uint64_t)hi << 32 | lo) & xcr0) != xcr0 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned regs[3] = {b, c, d};
    for (size_t i = 0; i < n; i++)
        if (!(regs[needs[i].reg] >> needs[i].bit & 1)) return 0;
    return 1;
}

/* The instruction sets in order of preference: the first the CPU has (and the compiler built) is used */
static const struct {
    const qc_gemm_kernels *const *kernels;
    const gemm_cpu_bit *needs;
    size_t n;
} GEMM_ISAS[] = {
    {&qc_gemm_vnni_kernels, GEMM_VNNI_NEEDS, sizeof GEMM_VNNI_NEEDS / sizeof GEMM_VNNI_NEEDS[0]},
};

static const qc_gemm_kernels *gemm_table;
static pthread_once_t gemm_picked = PTHREAD_ONCE_INIT;
static void gemm_pick(void) {
    for (size_t i = 0; i < sizeof GEMM_ISAS / sizeof GEMM_ISAS[0] && !gemm_table; i++)
        if (*GEMM_ISAS[i].kernels && gemm_cpu_has(GEMM_ISAS[i].needs, GEMM_ISAS[i].n, GEMM_XCR0_AVX512))
            gemm_table = *GEMM_ISAS[i].kernels;
}
static const qc_gemm_kernels *gemm_kernels(void) {
    pthread_once(&gemm_picked, gemm_pick);
    return gemm_table;
}

/* qc_gemm_vnni: 1 where the entry points below have kernels (the CPU has AVX512-VNNI with BW, VL and VBMI,
 * and the compiler could build them), else 0, and then the Python side calls none of them */
QC_API int qc_gemm_vnni(void) { return gemm_kernels() != NULL; }

/* ---- AMX tiles: the mode, and the permission the OS grants ------------------------------------------------ */
static int gemm_amx_on;
static int gemm_amx_perm = -1; /* -1: not asked yet; 1: the CPU has AMX-INT8 and the OS granted the tile state */
int gemm_amx_mode(void) { return __atomic_load_n(&gemm_amx_on, __ATOMIC_RELAXED); }
QC_API int64_t qc_gemm_amx_calls(void) { return gemm_amx_call_count(); }

/* Whether the VNNI kernels may hand calls to the tiles: built, on a CPU (and OS) with AMX-INT8 */
static int gemm_amx_usable(void) {
    const size_t n = sizeof GEMM_AMX_NEEDS / sizeof GEMM_AMX_NEEDS[0];
    return qc_gemm_amx_built && gemm_kernels() != NULL && gemm_kernels() == qc_gemm_vnni_kernels &&
           gemm_cpu_has(GEMM_AMX_NEEDS, n, GEMM_XCR0_AVX512 | GEMM_XCR0_AMX);
}

/* qc_gemm_amx_set: GEMM calls run on AMX tiles (on = 1: those of GEMM_AMX_MIN_ROWS rows and GEMM_AMX_MIN_WORK
 * multiply-adds; on = 2: every call, for tests) where the OS grants them, or on the vector kernel (on = 0);
 * on < 0 changes nothing.  The result is bit for bit the same either way.  Returns the state now in force. */
QC_API int qc_gemm_amx_set(int on) {
    if (on < 0) return __atomic_load_n(&gemm_amx_on, __ATOMIC_RELAXED); /* (a query) */
    if (on && __atomic_load_n(&gemm_amx_perm, __ATOMIC_RELAXED) < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        __atomic_store_n(&gemm_amx_perm, gemm_amx_usable() && syscall(SYS_arch_prctl, 0x1023, 18) == 0,
                         __ATOMIC_RELAXED);
    __atomic_store_n(&gemm_amx_on, __atomic_load_n(&gemm_amx_perm, __ATOMIC_RELAXED) > 0 ? on : 0, __ATOMIC_RELAXED);
    return __atomic_load_n(&gemm_amx_on, __ATOMIC_RELAXED);
}

/* ---- the entry points: each calls its kernel in the table (-1 where there is none) ------------------------ */
#define GEMM_ENTRY(NAME, B_T, OUT_T)                                                                      \
    QC_API int qc_##NAME(QC_GEMM_PARAMS(B_T, OUT_T)) {                                                    \
        const qc_gemm_kernels *k = gemm_kernels();                                                        \
        return k ? k->NAME(x, ldx, m0, m1, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre) \
                 : -1;                                                                                    \
    }

#define DW4_ENTRY(NAME, OUT_T)                                                                            \
    QC_API int qc_##NAME(QC_DW4_PARAMS(OUT_T)) {                                                          \
        const qc_gemm_kernels *k = gemm_kernels();                                                        \
        return k ? k->NAME(x, N, H, W, C, w4, kh, kw, b32, sh, sw, ph, pw, dh, dw, Ho, Wo, M, n, lo, hi, epi, out, \
                           pre)                                                                           \
                 : -1;                                                                                    \
    }

QC_API int qc_gemm_conv_layout(const qc_conv_geometry *geo, int64_t O, int64_t rows) {
    const qc_gemm_kernels *k = gemm_kernels();
    return k ? k->gemm_conv_layout(geo, O, rows) : -1;
}
QC_API int qc_gemm_tail_weights(const int8_t *wpack, int64_t O, const qc_conv_geometry *geo, int8_t *out) {
    const qc_gemm_kernels *k = gemm_kernels();
    return k ? k->gemm_tail_weights(wpack, O, geo, out) : -1;
}
QC_API int qc_gemm_slide_weights(const int8_t *wpack, int64_t O, const qc_conv_geometry *geo, int8_t *out) {
    const qc_gemm_kernels *k = gemm_kernels();
    return k ? k->gemm_slide_weights(wpack, O, geo, out) : -1;
}
QC_API int64_t qc_gemm_slide_cap(int64_t bytes) {
    const qc_gemm_kernels *k = gemm_kernels();
    return k ? k->gemm_slide_cap(bytes) : -1;
}
QC_API int64_t qc_gemm_prep_bytes(int64_t O) {
    const qc_gemm_kernels *k = gemm_kernels();
    return k ? k->gemm_prep_bytes(O) : -1;
}
QC_API int qc_gemm_prep(const int32_t *bias32, const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb,
                        void *pre) {
    const qc_gemm_kernels *k = gemm_kernels();
    return k ? k->gemm_prep(bias32, M, n, O, add, nb, pre) : -1;
}

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
    const qc_conv_geometry *geo;
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
                         const qc_conv_geometry *geo, OUT_T *out, const void *pre, int parts) {           \
        gemm_args a = {x, ldx, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre};         \
        return qc_run_rows(NAME##_rows, &a, m0, m1, parts, GEMM_MR);                                     \
    }
QC_STEP_ARGS_FIT(gemm_args);

/* qc_gemm_*_step: the same call as a plan step (qc_run_plan), rows m0..m1 */
#define GEMM_STEP_FN(NAME, B_T, OUT_T)                                                                   \
    QC_API int NAME##_step(qc_step *st, void *ctx, const int8_t *x, int64_t ldx, int64_t m0, int64_t m1,  \
                           int64_t K, int64_t O, const int8_t *wpack, const int32_t *bias32, const int64_t *M, \
                           const int64_t *n, const B_T *b, int64_t Mb, int64_t nb, int64_t lo, int64_t hi,  \
                           int f64, const qc_conv_geometry *geo, OUT_T *out, const void *pre) {           \
        gemm_args *a = ctx;                                                                               \
        *a = (gemm_args){x, ldx, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre};       \
        *st = (qc_step){NAME##_rows, ctx, m0, m1, GEMM_MR, (m1 - m0) * K * O};                           \
        return 0;                                                                                         \
    }

/* each variant's entry point, its *_mt and its *_step */
#define GEMM_API(NAME, B_T, OUT_T) GEMM_ENTRY(NAME, B_T, OUT_T) GEMM_MT_FN(qc_##NAME, B_T, OUT_T) \
    GEMM_STEP_FN(qc_##NAME, B_T, OUT_T)
QC_GEMM_VARIANTS(GEMM_API)

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

#define DW4_API(NAME, OUT_T) DW4_ENTRY(NAME, OUT_T) DW4_MT_FN(qc_##NAME, OUT_T) DW4_STEP_FN(qc_##NAME, OUT_T)
QC_DW4_VARIANTS(DW4_API)


/* The int8 GEMM's parts and how they find each other: the driver (gemm.c) exports the entry points and
 * picks, once, the kernel table of the instruction set the CPU has (gemm_vnni.c); the VNNI kernels run a
 * call on AMX tiles (gemm_amx.c) where the driver turned them on.  Each ISA file is compiled for its
 * instruction set by a target pragma, whatever -march the library has, so nothing in it may run before
 * the driver has checked the CPU: its functions are reached through the table (VNNI) or from the VNNI
 * kernels on the calls gemm_amx_mode() gives the tiles (AMX). */
#ifndef QC_BPU_GEMM_H
#define QC_BPU_GEMM_H
#include <stdint.h>

#include "conv_geometry.h"
#include "plan.h"

/* Whether this compiler can compile a file for AVX512-VNNI (GCC 8, clang 6) and AMX-INT8 (GCC 11, clang 12):
 * without, that file defines no kernels and the library still builds */
#if defined(__clang__)
#define QC_CC_VNNI (__clang_major__ >= 6)
#define QC_CC_AMX (__clang_major__ >= 12)
#else
#define QC_CC_VNNI (__GNUC__ >= 8)
#define QC_CC_AMX (__GNUC__ >= 11)
#endif

#define GEMM_MR 6 /* rows per micro-tile of the vector kernel (a split call's parts are multiples of it) */

/* The arguments of a GEMM kernel (B_T the fused operand's type, OUT_T the output's; gemm.c) and of a
 * depthwise one (qc_dwconv4_*) */
#define QC_GEMM_PARAMS(B_T, OUT_T)                                                                        \
    const int8_t *restrict x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t O,                 \
        const int8_t *restrict wpack, const int32_t *restrict bias32, const int64_t *restrict M,         \
        const int64_t *restrict n, const B_T *restrict b, int64_t Mb, int64_t nb, int64_t lo, int64_t hi, \
        int f64, const qc_conv_geometry *restrict geo, OUT_T *restrict out, const void *pre
#define QC_DW4_PARAMS(OUT_T)                                                                              \
    const int8_t *restrict x, int64_t N, int64_t H, int64_t W, int64_t C, const int8_t *restrict w4,     \
        int64_t kh, int64_t kw, const int32_t *restrict b32, int64_t sh, int64_t sw, int64_t ph,          \
        int64_t pw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo, const int64_t *restrict M,            \
        const int64_t *restrict n, int64_t lo, int64_t hi, int epi, OUT_T *restrict out, const void *pre

/* The GEMM's variants F(name, the fused operand's type, the output's) and the depthwise conv's
 * F(name, the output's type): the table's fields, the ISA files' entries, the driver's entry points */
#define QC_GEMM_VARIANTS(F)                                                                               \
    F(gemm_i8, int8_t, int8_t)                                                                            \
    F(gemm_i16, int8_t, int16_t)                                                                          \
    F(gemm_add_i8_i8, int8_t, int8_t)                                                                     \
    F(gemm_add_i16_i8, int16_t, int8_t)                                                                   \
    F(gemm_add_i8_i16, int8_t, int16_t)                                                                   \
    F(gemm_add_i16_i16, int16_t, int16_t)
#define QC_DW4_VARIANTS(F) F(dwconv4_i8_i8, int8_t) F(dwconv4_i8_i16, int16_t)

/* One instruction set's kernels: each entry point qc_<name> of gemm.c calls the table's <name> */
#define QC_GEMM_FIELD(NAME, B_T, OUT_T) int (*NAME)(QC_GEMM_PARAMS(B_T, OUT_T));
#define QC_DW4_FIELD(NAME, OUT_T) int (*NAME)(QC_DW4_PARAMS(OUT_T));
typedef struct {
    QC_GEMM_VARIANTS(QC_GEMM_FIELD)
    QC_DW4_VARIANTS(QC_DW4_FIELD)
    int (*gemm_conv_layout)(const qc_conv_geometry *geo, int64_t O, int64_t rows);
    int (*gemm_tail_weights)(const int8_t *wpack, int64_t O, const qc_conv_geometry *geo, int8_t *out);
    int (*gemm_slide_weights)(const int8_t *wpack, int64_t O, const qc_conv_geometry *geo, int8_t *out);
    int64_t (*gemm_slide_cap)(int64_t bytes);
    int64_t (*gemm_prep_bytes)(int64_t O);
    int (*gemm_prep)(const int32_t *bias32, const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb,
                     void *pre);
} qc_gemm_kernels;

extern const qc_gemm_kernels *const qc_gemm_vnni_kernels; /* gemm_vnni.c (NULL: the compiler cannot target it) */

/* gemm.c: the tile mode qc_gemm_amx_set put in force (0: vectors; 1: tiles for large calls; 2: every call) */
int gemm_amx_mode(void);

/* gemm_amx.c: AMX tiles, as the VNNI kernels use them (gemm_vnni.c, GEMM_FN) */
extern const int qc_gemm_amx_built;    /* 0: the compiler cannot target AMX (the mode then stays 0) */
int64_t gemm_amx_call_count(void);     /* calls that ran on tiles (qc_gemm_amx_calls) */
void gemm_amx_config(void);            /* load the tile configuration (and count the call) */
void gemm_amx_release(void);
void gemm_amx_tile(const uint8_t *a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc, int64_t rows,
                   int64_t Kq, const int8_t *wp, const int8_t *wt, int nr, int32_t *tile);
int64_t gemm_amx_rows(int64_t lda);    /* rows per row block of a panel of rows lda bytes apart */
int8_t *gemm_amx_wtail(const int8_t *wp, int64_t nob, int64_t Kq);
#endif

/* A conv's geometry as the int8 GEMM reads it (gemm_vnni.c), filled by the Python side: gemm.py's
 * ConvGeometry is a ctypes.Structure of the same fields in the same order, and
 * qc_conv_geometry_layout reports this side's offsets so a test can compare the two. */
#ifndef QC_BPU_CONV_GEOMETRY_H
#define QC_BPU_CONV_GEOMETRY_H
#include <stdint.h>

typedef struct {
    int64_t H, W, C;       /* the NHWC input (per sample) */
    int64_t kh, kw;        /* the kernel */
    int64_t sh, sw;        /* stride */
    int64_t ph, pw;        /* zero padding, each side */
    int64_t dh, dw;        /* dilation */
    int64_t Ho, Wo;        /* the output */
    const int8_t *tail_w;  /* the weights repacked for GEMM_TAIL once per layer (qc_gemm_tail_weights), or NULL */
    const int8_t *slide_w; /* the weights in GEMM_SLIDE's order once per layer (qc_gemm_slide_weights), or NULL */
} qc_conv_geometry;
#endif

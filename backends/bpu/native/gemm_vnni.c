/* The int8 GEMM and the depthwise conv on AVX512-VNNI (with BW, VL and VBMI): the kernels the driver
 * (gemm.c) calls through qc_gemm_vnni_kernels where the CPU has them.  The file is compiled for that
 * instruction set whatever -march the library has (its target pragma), so nothing in it may run on
 * another CPU: every entry is reached through the table only.  The kernels' arithmetic and its
 * exactness: gemm.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "requant.h"

#if QC_CC_VNNI
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#endif

#define GEMM_NR 4     /* zmm (16 output channels each) per micro-tile */
#define GEMM_ROWS_L1 (16 << 10) /* bytes of x rows per row block (stay in L1 across the channel groups) */

/* rows per row block for rows of Kq groups of 4 bytes: GEMM_ROWS_L1 of them, whole micro-tiles */
static int64_t gemm_block_rows(int64_t Kq) {
    const int64_t mb = GEMM_ROWS_L1 / (4 * Kq > 0 ? 4 * Kq : 1) / GEMM_MR * GEMM_MR;
    return mb < GEMM_MR ? GEMM_MR : mb;
}

/* One micro-tile: rows x (16 * NR) int32 accumulators (bias32 included) into tile[GEMM_MR][64].
 * Row r's 4 * (nseg * segq + tq) int8 values are nseg segments of 4 * segq bytes and, if tq > 0, one
 * of 4 * tq bytes, segment s at xp[r * (nseg + (tq > 0)) + s] (a row of x itself, a window row of a
 * conv input, a column of a tail plane, or a staged row: gemm_rows); each group of
 * 4 bytes enters vpdpbusd as x ^ 0x80 = x + 128 (unsigned), the xor applied to the broadcast (it runs
 * beside the vpdpbusd, measured free with 4 channel blocks).  XOR 0: the rows were staged as x ^ 0x80
 * already, one segment each, one after another (only xp[0] is read: 3-5% on the short-K GEMMs).
 * Rows beyond `rows` repeat the last row (computed, never stored).  Named accumulators (not an array),
 * so the compiler keeps all 6 * NR of them in registers. */
#define GT_PTR(r) const int8_t *x##r = XOR ? xp[(rows > r ? r : rows - 1) * rstride + s]                     \
                                          : xp[0] + (rows > r ? r : rows - 1) * 4 * segq;
#define GT_MAC(r)                                                                                        \
    {                                                                                                     \
        int32_t v;                                                                                        \
        memcpy(&v, x##r + 4 * kq, 4);                                                                     \
        const __m512i a = XOR ? _mm512_xor_si512(_mm512_set1_epi32(v), m80) : _mm512_set1_epi32(v);     \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, a, w0);                                                    \
        if (NR > 1) c##r##1 = _mm512_dpbusd_epi32(c##r##1, a, w1);                                        \
        if (NR > 2) c##r##2 = _mm512_dpbusd_epi32(c##r##2, a, w2);                                        \
        if (NR > 3) c##r##3 = _mm512_dpbusd_epi32(c##r##3, a, w3);                                        \
    }
#define GT_STORE(r)                                                                                      \
    {                                                                                                     \
        _mm512_storeu_si512((void *)(tile + r * 64), c##r##0);                                           \
        if (NR > 1) _mm512_storeu_si512((void *)(tile + r * 64 + 16), c##r##1);                          \
        if (NR > 2) _mm512_storeu_si512((void *)(tile + r * 64 + 32), c##r##2);                          \
        if (NR > 3) _mm512_storeu_si512((void *)(tile + r * 64 + 48), c##r##3);                          \
    }
#define GT_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)
#define GT_ACC(r) __m512i c##r##0 = b0, c##r##1 = b1, c##r##2 = b2, c##r##3 = b3;
#define GEMM_TILE_FN(NAME, NRV, SEGQ, XORV)                                                              \
    static void NAME(const int8_t *const *restrict xp, int64_t rows, int64_t nseg, int64_t segq, int64_t tq, \
                     const int8_t *restrict wp, int64_t wstride, const int32_t *restrict bias32,          \
                     int32_t *restrict tile) {                                                            \
        enum { NR = NRV, XOR = XORV };                                                                    \
        const __m512i zero = _mm512_setzero_si512(), m80 = _mm512_set1_epi32((int)0x80808080u);           \
        const __m512i b0 = _mm512_loadu_si512((const void *)bias32);                                      \
        const __m512i b1 = NR > 1 ? _mm512_loadu_si512((const void *)(bias32 + 16)) : zero;              \
        const __m512i b2 = NR > 2 ? _mm512_loadu_si512((const void *)(bias32 + 32)) : zero;              \
        const __m512i b3 = NR > 3 ? _mm512_loadu_si512((const void *)(bias32 + 48)) : zero;              \
        GT_ROWS(GT_ACC)                                                                                   \
        const int8_t *wk = wp;                                                                            \
        const int64_t rstride = XOR ? nseg + (tq > 0) : 1; /* pointers a row (staged rows: one segment) */ \
        for (int64_t s = 0; s < rstride; s++) {                                                           \
            GT_ROWS(GT_PTR)                                                                               \
            const int64_t nq = s < nseg ? (SEGQ ? SEGQ : segq) : tq;                                      \
            for (int64_t kq = 0; kq < nq; kq++, wk += 64) {                                               \
                const __m512i w0 = _mm512_loadu_si512((const void *)wk);                                  \
                const __m512i w1 = NR > 1 ? _mm512_loadu_si512((const void *)(wk + wstride)) : zero;      \
                const __m512i w2 = NR > 2 ? _mm512_loadu_si512((const void *)(wk + 2 * wstride)) : zero;  \
                const __m512i w3 = NR > 3 ? _mm512_loadu_si512((const void *)(wk + 3 * wstride)) : zero;  \
                GT_ROWS(GT_MAC)                                                                           \
            }                                                                                             \
        }                                                                                                 \
        GT_ROWS(GT_STORE)                                                                                 \
    }

GEMM_TILE_FN(gemm_tile1, 1, 0, 1)
GEMM_TILE_FN(gemm_tile2, 2, 0, 1)
GEMM_TILE_FN(gemm_tile3, 3, 0, 1)
GEMM_TILE_FN(gemm_tile4, 4, 0, 1)
/* rows staged already as x ^ 0x80 (gemm_src.xored), one after another (4 * segq bytes apart) */
GEMM_TILE_FN(gemm_tile1_u, 1, 0, 0)
GEMM_TILE_FN(gemm_tile2_u, 2, 0, 0)
GEMM_TILE_FN(gemm_tile3_u, 3, 0, 0)
GEMM_TILE_FN(gemm_tile4_u, 4, 0, 0)
GEMM_TILE_FN(gemm_tile4_q5, 4, 5, 1)
GEMM_TILE_FN(gemm_tile4_q2, 4, 2, 1)

static void gemm_tile_nr(const int8_t *const *xp, int64_t rows, int64_t nseg, int64_t segq, int64_t tq, int xored,
                         const int8_t *wp, int64_t wstride, int nr, const int32_t *bias32, int32_t *tile) {
    if (xored) { /* (one segment: rows staged by gemm_rows) */
        switch (nr) {
        case 1: gemm_tile1_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        case 2: gemm_tile2_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        case 3: gemm_tile3_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        default: gemm_tile4_u(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
        }
        return;
    }
    switch (nr) {
    case 1: gemm_tile1(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
    case 2: gemm_tile2(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
    case 3: gemm_tile3(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile); break;
    default:
        if (segq == 5)
            gemm_tile4_q5(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile);
        else if (segq == 2)
            gemm_tile4_q2(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile);
        else
            gemm_tile4(xp, rows, nseg, segq, tq, wp, wstride, bias32, tile);
        break;
    }
}

#define GEMM_AMX_MIN_ROWS 16 /* rows of a call from which it runs on tiles */
/* multiply-adds (rows * K * O) of a call from which it runs on tiles: below, the tile path's fixed costs
 * (its configuration, the copies' allocations, the switch between tile and vector code) outweigh its
 * speed.  Measured on mobilenet_v2 at batch 1, its layers cut over 2 threads: tiles on every call of 16
 * rows or more 2.40 ms against the vectors' 1.90; from 2**20 multiply-adds 2.35, 2**21 2.05, 3 * 2**20
 * 1.91, 2**22 1.91, 2**24 1.94 (docs/performance.md, "AMX tiles"). */
#define GEMM_AMX_MIN_WORK ((int64_t)1 << 22)
#define GEMM_AMX_ON gemm_amx_mode()

/* Whether a call of `rows` rows of a K x O GEMM runs on tiles (the mode qc_gemm_amx_set put in force) */
static inline int gemm_amx_takes(int64_t rows, int64_t K, int64_t O) {
    const int on = GEMM_AMX_ON;
    return on == 2 || (on && rows >= GEMM_AMX_MIN_ROWS && rows * K * O >= GEMM_AMX_MIN_WORK);
}

/* d[0:len] = s[0:len] ^ 0x80 (staged rows as the unsigned bytes vpdpbusd reads), 64 bytes at a time, the tail
 * masked (nothing past len read or written); d == s xors in place */
static void gemm_xor80_copy(int8_t *d, const int8_t *s, int64_t len) {
    const __m512i m80 = _mm512_set1_epi8((char)0x80);
    int64_t k = 0;
    for (; k + 64 <= len; k += 64)
        _mm512_storeu_si512((void *)(d + k), _mm512_xor_si512(_mm512_loadu_si512((const void *)(s + k)), m80));
    if (k < len) {
        const __mmask64 mk = ((uint64_t)1 << (len - k)) - 1; /* len - k < 64 */
        _mm512_mask_storeu_epi8(d + k, mk, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, s + k), m80));
    }
}
static void gemm_xor80(int8_t *d, int64_t len) { gemm_xor80_copy(d, d, len); }

/* d[0:len] = s[0:len] when the caller allows an overshoot: up to 64 bytes past len may be read (below
 * s_end) and written (d's buffer has the slack and its later bytes are written again after this),
 * so a short piece is one unmasked 32- or 64-byte load and store. */
static inline void gemm_copy_over(int8_t *restrict d, const int8_t *restrict s, int64_t len, const int8_t *s_end) {
    if (len <= 32 && s + 32 <= s_end)
        _mm256_storeu_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
    else if (len <= 64 && s + 64 <= s_end)
        _mm512_storeu_si512((void *)d, _mm512_loadu_si512((const void *)s));
    else
        memcpy(d, s, (size_t)len);
}

/* Rows r0..r1-1 of x (row stride ldx) copied, each padded with zeros to 4 * Kq bytes (the padding
 * meets zero weights): a plain GEMM's staged rows (GEMM_INPLACE_MIN_K), xored after by the caller. */
static void gemm_stage(const int8_t *restrict x, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int64_t Kq,
                       int8_t *restrict xu) {
    for (int64_t r = r0; r < r1; r++) {
        int8_t *restrict d = xu + (r - r0) * 4 * Kq;
        memcpy(d, x + r * ldx, (size_t)K);
        for (int64_t k = K; k < 4 * Kq; k++) d[k] = 0;
    }
}

/* gemm_stage_row's general case: the kernel rows one by one, tap by tap where a row leaves the input. */
static void gemm_stage_taps(const int8_t *restrict xb, const int8_t *s_end, const qc_conv_geometry *restrict g,
                            int64_t ih0, int64_t iw0, int8_t *restrict d) {
    const int64_t H = g->H, W = g->W, C = g->C, kh = g->kh, kw = g->kw, dh = g->dh, dw = g->dw, piece = kw * C;
    for (int64_t i = 0; i < kh; i++) {
        const int64_t ih = ih0 + i * dh;
        if (dw == 1 && ih >= 0 && ih < H && iw0 >= 0 && iw0 + kw <= W) { /* the kernel row's taps are contiguous */
            gemm_copy_over(d, xb + (ih * W + iw0) * C, piece, s_end);
            d += piece;
            continue;
        }
        for (int64_t j = 0; j < kw; j++, d += C) {
            const int64_t iw = iw0 + j * dw;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) {
                if (C <= 64)
                    _mm512_storeu_si512((void *)d, _mm512_setzero_si512());
                else
                    memset(d, 0, (size_t)C);
                continue;
            }
            gemm_copy_over(d, xb + (ih * W + iw) * C, C, s_end);
        }
    }
}

/* The im2col row of output position r = (b, oh, ow) of the NHWC int8 input x (geometry g) into d: its taps (i, j) in order, C bytes each, a tap in the
 * padding 0 (the zero point), zeros up to 4 * Kq.  Pieces are written front to back and may overshoot
 * by up to 64 bytes (gemm_copy_over) into bytes written again later: its own later taps, its zero
 * padding, the next row; d has 64 bytes of slack after the row block's last row. */
static inline __attribute__((always_inline)) void gemm_stage_row(const int8_t *restrict x,
                                                                 const qc_conv_geometry *restrict g, int64_t b,
                                                                 int64_t oh, int64_t ow, int64_t Kq,
                                                                 int8_t *restrict d) {
    const int64_t H = g->H, W = g->W, C = g->C, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw;
    const int64_t dh = g->dh, dw = g->dw, K = kh * kw * C, HWC = H * W * C, piece = kw * C;
    const int8_t *xb = x + b * HWC, *s_end = xb + HWC; /* reads stay inside sample b */
    const int64_t ih0 = oh * sh - ph, iw0 = ow * sw - pw, rstride = dh * W * C;
    const int inside = dw == 1 && piece <= 32 && ih0 >= 0 && ih0 + (kh - 1) * dh < H && iw0 >= 0 && iw0 + kw <= W;
    const int8_t *base = inside ? xb + (ih0 * W + iw0) * C : NULL;
    if (inside && base + (kh - 1) * rstride + 32 <= s_end) {
        /* the window inside the input and short kernel rows (a stem): one 32-byte copy a kernel row */
        for (int64_t i = 0; i < kh; i++, d += piece)
            _mm256_storeu_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)(base + i * rstride)));
    } else {
        gemm_stage_taps(xb, s_end, g, ih0, iw0, d);
        d += K;
    }
    for (int64_t k = K; k < 4 * Kq; k++) d[k - K] = 0;
}

/* Where the micro-tile reads a call's rows (gemm_src_open picks the layout once per call, gemm_rows
 * fills a row block's pointers):
 *  - GEMM_PLAIN (geo NULL): the rows of x in place when K is a multiple of 4 and at least
 *    GEMM_INPLACE_MIN_K, else staged as x ^ 0x80 (the tile then does not xor), one segment of Kq groups;
 *  - GEMM_DIRECT, a conv whose kernel rows are contiguous in x (dilation 1 along W, or kw 1) and a
 *    multiple of 4 bytes (kw * C): kh segments of kw * C / 4 groups, in place: kernel row i of output
 *    (b, oh, ow) is the kw * C bytes of x from (b, oh * sh - ph + i * dh, ow * sw - pw); a kernel row in
 *    the vertical padding reads `zrow` (zero bytes, the zero point); a window that crosses the left or
 *    right edge is staged (its im2col row).  No other copy of x is made (im2col copies 9x the input's
 *    bytes for a 3x3);
 *  - GEMM_TAIL, the same for kernel rows of 4 * q + 1 bytes (a stem: 7 taps x 3 channels; dilation 1,
 *    or a kernel 1 wide / high) and weights within GEMM_TAIL_MAX_W (gemm_tail_open): the input rows the
 *    call reads copied with their left and right padding (zeros: every window then lies inside a row,
 *    none is staged), the first 4 * q bytes of each kernel row read in place there (kh segments of q
 *    groups), and the kernel rows' last bytes (channel C - 1 of tap kw - 1), which are kh bytes down one
 *    column of channel C - 1, from a tail plane: channel C - 1 of the padded rows transposed
 *    (T[pw + iw][ph + ih] = x[ih, iw, C - 1], zero in the padding), read as one segment of ceil(kh / 4)
 *    groups.  The weights in that order (qc_gemm_tail_weights, once per layer; the extra bytes of the
 *    last group meet zero weights), so K stays 4 * ceil(kh * kw * C / 4) (7x7x3: 148 either way);
 *  - GEMM_IM2COL, any other conv (dilation along W, other remainders, a kernel row of one byte, tail
 *    weights past GEMM_TAIL_MAX_W, or the tail layout's buffers not allocated): every im2col row staged,
 *    as x ^ 0x80. */
/*  - GEMM_SLIDE (AMX tiles only), a conv whose kernel rows are contiguous (dilation 1 along W, or kw 1):
 *    the input copied once as x ^ 0x80 with its padding (the byte 0x80: the zero point) into whole
 *    padded images (Hp x Wp); kernel row i of output (b, oh, ow) is then the kw * C bytes at padded
 *    (b, oh * sh + i * dh, ow * sw), and 16 outputs sw * C bytes apart are one A tile read in place (no
 *    row copied).  Each kernel row's weights are padded with zeros to L = 64 * ceil(kw * C / 64)
 *    (qc_gemm_slide_weights, once per layer; the packed weights as they are when kw * C is a multiple
 *    of 64), so a 64-byte chunk never spans two kernel rows and the bytes past one meet zeros.  Two ways
 *    to walk the outputs (gemm_slide_mode): at stride 1, the positions q = (b * Hp + oh) * Wp + ow of the
 *    padded grid, one after another (tiles cross output rows; the kw - 1 positions past a row's outputs
 *    and the rows between images are computed and dropped: gemm_slide_map); at any stride, the outputs
 *    of one output row at a time (a row's last tile may compute up to 15 rows it drops). */
enum { GEMM_PLAIN, GEMM_DIRECT, GEMM_TAIL, GEMM_IM2COL, GEMM_SLIDE };
/* K (bytes a row) from which a plain GEMM reads its rows in place; below it they are staged as x ^ 0x80 and
 * the tile does not xor: the xor on each broadcast costs where a tile has few vpdpbusd per broadcast
 * (one or two channel blocks) and a short K leaves the copy cheap (mobilenet_v2's K = 16-64 1x1 convs:
 * 3-10% slower in place, K = 144 10% faster) */
#define GEMM_INPLACE_MIN_K 128
#define GEMM_TAIL_MAX_W (256 << 10) /* bytes of repacked weights past which a tail-layout conv is staged */

typedef struct {
    const int8_t *x;
    int64_t ldx;
    const qc_conv_geometry *g;
    int mode;
    int xored;                   /* every row staged, as x ^ 0x80 (the tile then does not xor) */
    int64_t K, Kq0;              /* K as given and its groups; */
    int64_t Kq, nseg, segq, tq;  /* a row's groups in this layout: nseg segments of segq, a tail of tq */
    const int8_t *wp;            /* the packed weights in this layout (the caller's, or wrep) */
    int8_t *xu, *zrow, *xpad, *tail, *wrep;
    int64_t *q;                  /* an in-place output's pointers and their steps (gemm_window) */
    const int8_t *win;           /* where windows are read: x, or (GEMM_TAIL) xpad */
    int64_t wrow, wpad, wb0;     /* its pixels a row, the padding left of its pixel 0, its first image */
    int64_t tlen;                /* a tail plane's column length */
    int64_t b, oh, ow;           /* the output position of the next row gemm_rows fills */
    int64_t mb;                  /* rows per row block (xu and the callers' pointer arrays hold that many) */
    int amx;                     /* the call runs on AMX tiles (row blocks of gemm_amx_rows, xu zeroed) */
    /* GEMM_SLIDE: the padded copy, its grid, the call's positions [qa, qb) in it, its first image, L / 64 */
    uint8_t *xs;
    int srows; /* walked by output rows (any stride), not by positions of the padded grid */
    int64_t Hp, Wp, qa, qb, sb0, lc;
} gemm_src;

static void gemm_src_close(gemm_src *s) {
    free(s->xs);
    free(s->q);
    free(s->xu);
    free(s->zrow);
    free(s->xpad);
    free(s->tail);
    free(s->wrep);
}

/* The tail layout's weights: per block of 16 channels, groups of 4 in the order of GEMM_TAIL (kernel
 * row i's first 4 * segq values, then the kh last values and zeros), from wpack's plain order. */
static void gemm_tail_weights(const int8_t *restrict wpack, int64_t nob, const gemm_src *s, int8_t *restrict wrep) {
    const int64_t kwc = s->g->kw * s->g->C, kh = s->g->kh, main = kh * 4 * s->segq;
    for (int64_t ob = 0; ob < nob; ob++)
        for (int64_t kq = 0; kq < s->Kq; kq++)
            for (int64_t j = 0; j < 16; j++)
                for (int64_t t = 0; t < 4; t++) {
                    const int64_t k2 = 4 * kq + t;
                    int64_t k = -1; /* the plain K index of this value (-1: a zero weight) */
                    if (k2 < main)
                        k = k2 / (4 * s->segq) * kwc + k2 % (4 * s->segq);
                    else if (k2 - main < kh)
                        k = (k2 - main) * kwc + kwc - 1;
                    wrep[((ob * s->Kq + kq) * 16 + j) * 4 + t] =
                        k < 0 ? 0 : wpack[((ob * s->Kq0 + k / 4) * 16 + j) * 4 + k % 4];
                }
}

/* The layout of a conv of geometry g (GEMM_FN's geo) over nob blocks of 16 output channels. */
static int gemm_layout(const qc_conv_geometry *g, int64_t nob) {
    const int64_t kh = g->kh, kwc = g->kw * g->C;
    const int dw1 = g->dw == 1 || g->kw == 1, dh1 = g->dh == 1 || kh == 1; /* (a dilation over one tap is none) */
    if (dw1 && kwc % 4 == 0) return GEMM_DIRECT;
    if (dw1 && dh1 && kwc % 4 == 1 && kwc > 4 && nob * 64 * (kh * (kwc / 4) + (kh + 3) / 4) <= GEMM_TAIL_MAX_W)
        return GEMM_TAIL;
    return GEMM_IM2COL;
}

static int gemm_slide_walk(const qc_conv_geometry *g, int64_t nob);

/* qc_gemm_conv_layout: which layout a call over `rows` output rows of a conv of geometry geo with O output
 * channels reads its input in (1 in place, 2 in place with a tail plane, 3 im2col rows staged, 4 the padded
 * copy read in place by AMX tiles, when the call takes them: GEMM_FN; gemm.py's Int8Gemm.conv_layout). */
static int vnni_gemm_conv_layout(const qc_conv_geometry *geo, int64_t O, int64_t rows) {
    const int64_t nob = (O + 15) / 16;
    if (gemm_amx_takes(rows, geo->C * geo->kh * geo->kw, O) && gemm_slide_walk(geo, nob)) return 4;
    return gemm_layout(geo, nob);
}

/* qc_gemm_tail_weights: a layer's weights wpack (O channels) in the tail layout's order for geometry geo,
 * into out (16 * ceil(O / 16) * K bytes, K = 4 * ceil(kh * kw * C / 4)): once per layer, passed back in
 * geo->tail_w (gemm.py), so a call (and each part of a split one) does not repack them.  -1 if geo does
 * not take the tail layout. */
static int vnni_gemm_tail_weights(const int8_t *wpack, int64_t O, const qc_conv_geometry *geo, int8_t *out) {
    const int64_t nob = (O + 15) / 16, kwc = geo->kw * geo->C, kh = geo->kh;
    if (gemm_layout(geo, nob) != GEMM_TAIL) return -1;
    const int64_t K = kh * kwc;
    gemm_src s = {.g = geo, .Kq0 = (K + 3) / 4, .Kq = (K + 3) / 4, .nseg = kh, .segq = kwc / 4};
    gemm_tail_weights(wpack, nob, &s, out);
    return 0;
}

/* GEMM_TAIL's buffers for rows m0..m1-1 (m0 < m1): the input rows their windows read, copied with the
 * left and right padding (zeros: every window then lies inside a row, none is staged), and the same
 * rows of the tail planes (zero in the padding both ways); the weights in the layout's order (geo->tail_w
 * when the caller repacked them once, else here).  Only the rows the call reads are copied, so a call
 * split over parts copies about the input once in all.  0, or -1 (nothing left allocated). */
static int gemm_tail_open(gemm_src *s, const int8_t *x, const qc_conv_geometry *g, int64_t m0, int64_t m1, int64_t nob,
                          const int8_t *wpack) {
    const int64_t H = g->H, W = g->W, C = g->C, kh = g->kh, kw = g->kw, sh = g->sh, ph = g->ph, pw = g->pw;
    const int64_t Ho = g->Ho, Wo = g->Wo, kwc = kw * C, Wp = W + 2 * pw, tq = (kh + 3) / 4;
    const int64_t b0 = m0 / (Ho * Wo), b1 = (m1 - 1) / (Ho * Wo), nb = b1 - b0 + 1;
    const int64_t oh0 = m0 / Wo % Ho, oh1 = (m1 - 1) / Wo % Ho;
    const int64_t need = (Ho - 1) * sh + 4 * tq; /* the last output row's tail reads */
    s->nseg = kh, s->segq = kwc / 4, s->tq = tq;
    s->Kq = kh * s->segq + tq; /* == Kq0: kh * (kwc - 1) + 4 * ceil(kh / 4) is 4 * ceil(kh * kwc / 4) */
    s->tlen = need > H + ph ? need : H + ph;
    s->xpad = malloc((size_t)(nb * H * Wp * C));
    s->tail = calloc((size_t)(nb * Wp * s->tlen), 1);
    s->wrep = g->tail_w ? NULL : malloc((size_t)(nob * s->Kq * 64));
    if (!s->xpad || !s->tail || (!g->tail_w && !s->wrep)) {
        free(s->xpad), free(s->tail), free(s->wrep);
        s->xpad = s->tail = s->wrep = NULL;
        s->nseg = 1, s->tq = 0, s->Kq = s->Kq0;
        return -1;
    }
    s->win = s->xpad, s->wrow = Wp, s->wpad = 0, s->wb0 = b0;
    for (int64_t b = 0; b < nb; b++) {
        /* the input rows of output rows oh0.. (first image) ..oh1 (last image): dilation 1 (or kh 1) */
        const int64_t oa = b == 0 ? oh0 : 0, ob = b == nb - 1 ? oh1 : Ho - 1;
        const int64_t ia = oa * sh - ph > 0 ? oa * sh - ph : 0;
        const int64_t ib = ob * sh - ph + kh < H ? ob * sh - ph + kh : H;
        const int8_t *xb = x + (b0 + b) * H * W * C;
        int8_t *tb = s->tail + (b * Wp + pw) * s->tlen + ph;
        for (int64_t ih = ia; ih < ib; ih++) {
            int8_t *row = s->xpad + (b * H + ih) * Wp * C;
            memset(row, 0, (size_t)(pw * C));
            memcpy(row + pw * C, xb + ih * W * C, (size_t)(W * C));
            memset(row + (pw + W) * C, 0, (size_t)(pw * C));
            for (int64_t iw = 0; iw < W; iw++) tb[iw * s->tlen + ih] = xb[(ih * W + iw) * C + C - 1];
        }
    }
    if (g->tail_w) {
        s->wp = g->tail_w;
    } else {
        gemm_tail_weights(wpack, nob, s, s->wrep);
        s->wp = s->wrep;
    }
    return 0;
}

/* How a conv of geometry g over Op output channels walks GEMM_SLIDE (1: the padded grid, 2: output rows)
 * or 0 (not at all: a panel of copied rows instead), by a rough cost per output in cycles on this
 * machine's tiles (about 1000 multiply-adds a cycle): the panel computes 64 * ceil(K / 64) bytes of K
 * per row and copies its kh (+1) pieces (about 6 cycles each, plus K / 32); the grid walk computes
 * kh * L per position, of which the share Ho * Wo / (Hp * Wp) is kept; the row walk kh * L per row
 * plus the dropped rows of each output row's last 16-row tile.  (resnet18: its 56x56 3x3 convs walk the
 * grid, 7% dropped; its 7x7 ones keep the panel, 40% would be dropped at 512 channels; the 7x7 stem,
 * stride 2 on 3 channels, walks rows: 7 x 64 bytes a row against 8 copied pieces.) */
static int gemm_slide_mode(const qc_conv_geometry *g, int64_t Op) {
    const int64_t H = g->H, W = g->W, C = g->C, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw;
    const int64_t dw = g->dw, Ho = g->Ho, Wo = g->Wo, K = kh * kw * C, L = (kw * C + 63) / 64 * 64;
    if (dw != 1 && kw != 1) return 0;
    const double per = (double)Op / 1000.0;
    const double panel = (double)((K + 63) / 64 * 64) * per + 6.0 * (double)(kh + ((kw * C) % 4 != 0)) + (double)K / 32.0;
    const double grid = sh == 1 && sw == 1 ? (double)(kh * L) * per * (double)((H + 2 * ph) * (W + 2 * pw)) /
                                                 (double)(Ho * Wo)
                                           : 1e300;
    const double rows = (double)(kh * L) * per * (double)((Wo + 15) / 16 * 16) / (double)Wo;
    if (panel <= grid && panel <= rows) return 0;
    return grid <= rows ? 1 : 2;
}

/* gemm_slide_mode over nob blocks of 16 channels where the layer's GEMM_SLIDE weights are at hand (repacked in
 * geo->slide_w, or the packed weights themselves when kw * C is a multiple of 64), else 0 */
static int gemm_slide_walk(const qc_conv_geometry *g, int64_t nob) {
    return g->slide_w || g->kw * g->C % 64 == 0 ? gemm_slide_mode(g, 16 * nob) : 0;
}

/* L = 64 * ceil(kw * C / 64): the bytes of a kernel row in GEMM_SLIDE's weights */
static int64_t gemm_slide_len(const qc_conv_geometry *g) { return (g->kw * g->C + 63) / 64 * 64; }

/* qc_gemm_slide_weights: a layer's weights wpack (O channels, K = kh * kw * C) in GEMM_SLIDE's order for
 * geometry geo, into out (16 * ceil(O / 16) * kh * L bytes): per block of 16 channels, kernel row i's
 * kw * C values then zeros up to L, in groups of 4 as wpack has them.  Once per layer, passed back in
 * geo->slide_w (gemm.py).  -1 when the layer needs none (kw * C a multiple of 64: wpack is in that order
 * already) or the geometry can never slide. */
static int vnni_gemm_slide_weights(const int8_t *wpack, int64_t O, const qc_conv_geometry *geo, int8_t *out) {
    const int64_t kwc = geo->kw * geo->C, kh = geo->kh, L = gemm_slide_len(geo), nob = (O + 15) / 16;
    const int64_t Kq0 = (kh * kwc + 3) / 4, Kq = kh * L / 4;
    if (kwc % 64 == 0 || (geo->dw != 1 && geo->kw != 1)) return -1;
    for (int64_t ob = 0; ob < nob; ob++)
        for (int64_t kq = 0; kq < Kq; kq++)
            for (int64_t j = 0; j < 16; j++)
                for (int64_t t = 0; t < 4; t++) {
                    const int64_t k2 = 4 * kq + t, i = k2 / L, r = k2 % L, k = i * kwc + r;
                    out[((ob * Kq + kq) * 16 + j) * 4 + t] = r < kwc ? wpack[((ob * Kq0 + k / 4) * 16 + j) * 4 + k % 4] : 0;
                }
    return 0;
}

/* GEMM_SLIDE's source for output rows m0..m1-1, walked as `mode` says (gemm_slide_mode): the padded rows
 * those outputs read, of images b0..b1, copied as x ^ 0x80 (padding 0x80) into s->xs, laid out as whole
 * padded images (rows no output of the call reads are left unwritten: only dropped positions read them);
 * the positions [qa, qb) (mode 1: of the padded grid; mode 2: the rows m0..m1 themselves).  The slack
 * after the last image covers a tile's 32 rows past the last position and a chunk past its last kernel
 * row.  0, or -1 out of memory. */
static int gemm_slide_open(gemm_src *s, const int8_t *x, const qc_conv_geometry *g, int64_t m0, int64_t m1,
                           const int8_t *ws, int mode) {
    const int64_t H = g->H, W = g->W, C = g->C, kh = g->kh, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw, dh = g->dh;
    const int64_t Ho = g->Ho, Wo = g->Wo, Hp = H + 2 * ph, Wp = W + 2 * pw, L = gemm_slide_len(g);
    const int64_t b0 = m0 / (Ho * Wo), b1 = (m1 - 1) / (Ho * Wo), nb = b1 - b0 + 1;
    const int64_t oh0 = m0 / Wo % Ho, ow0 = m0 % Wo, oh1 = (m1 - 1) / Wo % Ho, ow1 = (m1 - 1) % Wo;
    const size_t bytes = (size_t)(nb * Hp * Wp * C + 32 * sw * C + L + 64);
    s->xs = malloc(bytes);
    if (!s->xs) return -1;
    memset(s->xs + nb * Hp * Wp * C, 0x80, bytes - (size_t)(nb * Hp * Wp * C));
    for (int64_t b = 0; b < nb; b++) {
        /* the padded rows the call's outputs of this image read */
        const int64_t ra = b == 0 ? oh0 * sh : 0, last = oh1 * sh + (kh - 1) * dh + 1;
        const int64_t rb = b == nb - 1 && last < Hp ? last : Hp;
        const int8_t *xb = x + (b0 + b) * H * W * C;
        for (int64_t r = ra; r < rb; r++) {
            uint8_t *d = s->xs + ((b * Hp + r) * Wp) * C;
            const int64_t ih = r - ph;
            if (ih < 0 || ih >= H) {
                memset(d, 0x80, (size_t)(Wp * C));
                continue;
            }
            memset(d, 0x80, (size_t)(pw * C));
            gemm_xor80_copy((int8_t *)d + pw * C, xb + ih * W * C, W * C);
            memset(d + (pw + W) * C, 0x80, (size_t)(pw * C));
        }
    }
    s->mode = GEMM_SLIDE, s->srows = mode == 2, s->Hp = Hp, s->Wp = Wp, s->sb0 = b0, s->lc = L / 64;
    s->qa = mode == 2 ? m0 : oh0 * Wp + ow0, s->qb = mode == 2 ? m1 : ((nb - 1) * Hp + oh1) * Wp + ow1 + 1;
    s->Kq = kh * L / 4, s->nseg = 1, s->segq = s->Kq, s->tq = 0, s->wp = ws;
    /* positions a block: the windows it reads (its positions and the kernel rows below) about 32 KiB */
    const int64_t mb = ((32 << 10) / (C > 0 ? C : 1) - (kh - 1) * dh * Wp) / 32 * 32;
    s->mb = mb < 64 ? 64 : mb;
    return 0;
}

/* The bytes of padded copy (GEMM_SLIDE) a call may make at once: a call whose images would need more
 * runs a few images at a time (gemm_slide_images), so the copy stays within this whatever the batch
 * (64 images of unet's 224x224 x 48 would copy 157 MB at once; the same bits either way).
 * qc_gemm_slide_cap changes it (tests: a small cap cuts small inputs). */
static int64_t gemm_slide_cap = (int64_t)32 << 20;
static int64_t vnni_gemm_slide_cap(int64_t bytes) {
    if (bytes > 0) __atomic_store_n(&gemm_slide_cap, bytes, __ATOMIC_RELAXED);
    return __atomic_load_n(&gemm_slide_cap, __ATOMIC_RELAXED);
}

/* Rows m0..m1-1 of a conv of geometry g on tiles: 0 when they read the input as one call, else the rows
 * of each piece to run them in (whole images, pieces starting at multiples of it), where GEMM_SLIDE's
 * padded copy of their images would pass gemm_slide_cap. */
static int64_t gemm_slide_images(const qc_conv_geometry *g, int64_t m0, int64_t m1, int64_t nob) {
    const int64_t HoWo = g->Ho * g->Wo, img = (g->H + 2 * g->ph) * (g->W + 2 * g->pw) * g->C;
    const int64_t nimg = (m1 - 1) / HoWo - m0 / HoWo + 1, cap = __atomic_load_n(&gemm_slide_cap, __ATOMIC_RELAXED);
    if (nimg <= 1 || nimg * img <= cap || !gemm_slide_walk(g, nob)) return 0;
    const int64_t k = cap / (img > 0 ? img : 1);
    return (k > 1 ? k : 1) * HoWo;
}

/* GEMM_SLIDE walked by output rows: where output row m's window starts in the padded copy */
static inline const uint8_t *gemm_slide_at(const gemm_src *s, int64_t m) {
    const qc_conv_geometry *g = s->g;
    const int64_t C = g->C, Ho = g->Ho, Wo = g->Wo;
    const int64_t lb = m / (Ho * Wo) - s->sb0, oh = m / Wo % Ho, ow = m % Wo;
    return s->xs + ((lb * s->Hp + oh * g->sh) * s->Wp + ow * g->sw) * C;
}

/* GEMM_SLIDE: the output row each position q0..q1-1 computes (-1: dropped, or outside the call's rows
 * m0..m1-1) into map[0..q1-q0); the number kept. */
static int64_t gemm_slide_map(const gemm_src *s, int64_t q0, int64_t q1, int64_t m0, int64_t m1, int64_t *map) {
    const int64_t Ho = s->g->Ho, Wo = s->g->Wo, Hp = s->Hp, Wp = s->Wp;
    int64_t lb = q0 / (Hp * Wp), rem = q0 % (Hp * Wp), oh = rem / Wp, ow = rem % Wp, kept = 0;
    for (int64_t q = q0; q < q1; q++) {
        const int64_t m = oh < Ho && ow < Wo ? ((s->sb0 + lb) * Ho + oh) * Wo + ow : -1;
        map[q - q0] = m >= m0 && m < m1 ? m : -1;
        kept += map[q - q0] >= 0;
        if (++ow == Wp) {
            ow = 0;
            if (++oh == Hp) oh = 0, lb++;
        }
    }
    return kept;
}

/* The layout of rows m0..m1-1 (rows of mb per block) and its buffers; 0, or -1 out of memory (nothing
 * left allocated). */
static int gemm_src_open(gemm_src *s, const int8_t *x, int64_t ldx, const qc_conv_geometry *g, int64_t m0, int64_t m1,
                         int64_t K, int64_t nob, const int8_t *wpack, int amx) {
    *s = (gemm_src){.x = x, .ldx = ldx, .g = g, .mode = GEMM_PLAIN, .K = K, .Kq0 = (K + 3) / 4, .Kq = (K + 3) / 4,
                    .nseg = 1, .segq = (K + 3) / 4, .wp = wpack, .amx = amx};
    s->xored = !g && (K % 4 || K < GEMM_INPLACE_MIN_K);
    const int walk = amx && g ? gemm_slide_walk(g, nob) : 0;
    if (walk) return gemm_slide_open(s, x, g, m0, m1, g->slide_w ? g->slide_w : wpack, walk);
    if (g) {
        const int64_t W = g->W, kh = g->kh, Ho = g->Ho, Wo = g->Wo, kwc = g->kw * g->C;
        s->mode = gemm_layout(g, nob);
        if (s->mode == GEMM_DIRECT) {
            s->nseg = kh, s->segq = kwc / 4;
            s->win = x, s->wrow = W, s->wpad = g->pw, s->wb0 = 0;
        } else if (s->mode == GEMM_TAIL && gemm_tail_open(s, x, g, m0, m1, nob, wpack)) {
            s->mode = GEMM_IM2COL; /* (its buffers could not be allocated: the rows are staged instead) */
        }
        if (s->mode == GEMM_IM2COL) s->segq = s->Kq0, s->xored = 1;
        s->b = m0 / (Ho * Wo), s->oh = m0 / Wo % Ho, s->ow = m0 % Wo;
    }
    s->mb = amx ? gemm_amx_rows((4 * s->Kq + 63) / 64 * 64) : gemm_block_rows(s->Kq); /* (the panel's row) */
    /* (AMX: zeroed, so a tile's rows past the call's last one read defined bytes) */
    s->xu = amx ? calloc((size_t)(s->mb * 4 * s->Kq + 64), 1) : malloc((size_t)(s->mb * 4 * s->Kq + 64));
    const int inplace = s->mode == GEMM_DIRECT || s->mode == GEMM_TAIL;
    s->zrow = inplace ? calloc((size_t)(g->kw * g->C), 1) : NULL;
    s->q = inplace ? malloc(sizeof(int64_t) * (size_t)(2 * (s->nseg + 1))) : NULL;
    if (!s->xu || (inplace && (!s->zrow || !s->q))) {
        gemm_src_close(s);
        return -1;
    }
    return 0;
}

#define GEMM_PTRS_VEC 8 /* pointers a row up to which they are made in one vector (a 7x7 stem: 7 + 1) */

/* The pointers of the in-place output (b, oh, ow) (kernel row i at q[i], the tail at q[kh]) and their
 * steps to (b, oh, ow + 1): sw pixels along x (0 for a kernel row in the vertical padding, which
 * stays on zrow), sw columns along the tail plane. */
static void gemm_window(const gemm_src *s, int64_t b, int64_t oh, int64_t ow, int64_t *q, int64_t *d) {
    const qc_conv_geometry *g = s->g;
    const int64_t H = g->H, C = g->C, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, dh = g->dh;
    const int64_t ih0 = oh * sh - ph, iw0 = ow * sw - s->wpad, rowb = s->wrow * C;
    const int8_t *xb = s->win + ((b - s->wb0) * H * s->wrow + iw0) * C;
    for (int64_t i = 0; i < kh; i++) {
        const int64_t ih = ih0 + i * dh, in = ih >= 0 && ih < H;
        q[i] = (int64_t)(intptr_t)(in ? xb + ih * rowb : s->zrow);
        d[i] = in ? sw * C : 0;
    }
    if (s->tq) {
        q[kh] = (int64_t)(intptr_t)(s->tail + ((b - s->wb0) * s->wrow + iw0 + kw - 1) * s->tlen + oh * sh);
        d[kh] = sw * s->tlen;
    }
}

/* Pointers to rows r0..r1-1 (the rows after the previous call's) into xp, nseg + (tq > 0) a row, rows
 * staged into s->xu from its start where the layout needs it. */
static void gemm_rows(gemm_src *restrict s, int64_t r0, int64_t r1, const int8_t **restrict xp) {
    const int8_t *x = s->x;
    const int64_t Kq = s->Kq;
    if (s->mode == GEMM_PLAIN) {
        if (!s->xored) {
            for (int64_t r = r0; r < r1; r++) xp[r - r0] = x + r * s->ldx;
        } else {
            if (s->ldx == s->K && s->K == 4 * Kq) { /* the rows follow each other: one pass */
                gemm_xor80_copy(s->xu, x + r0 * s->ldx, (r1 - r0) * s->K);
            } else {
                gemm_stage(x, s->ldx, r0, r1, s->K, Kq, s->xu);
                gemm_xor80(s->xu, (r1 - r0) * 4 * Kq);
            }
            /* (a tile of staged rows reads only its first row's pointer: GEMM_TILE_FN) */
            for (int64_t r = r0; r < r1; r += GEMM_MR) xp[r - r0] = s->xu + (r - r0) * 4 * Kq;
        }
        return;
    }
    const qc_conv_geometry *g = s->g;
    const int64_t W = g->W, kw = g->kw, sw = g->sw, pw = g->pw, Ho = g->Ho, Wo = g->Wo;
    const int64_t seg = 4 * s->segq, per = s->nseg + (s->tq > 0);
    /* outputs whose window lies inside the input along W: ow in [ow_lo, ow_hi) */
    const int64_t ow_lo = s->mode == GEMM_TAIL ? 0 : (pw + sw - 1) / sw; /* (GEMM_TAIL: its copy is padded) */
    const int64_t ow_hi = s->mode == GEMM_TAIL ? Wo : W - kw + pw >= 0 ? (W - kw + pw) / sw + 1 : 0;
    const int inplace = s->mode == GEMM_DIRECT || s->mode == GEMM_TAIL;
    int64_t b = s->b, oh = s->oh, ow = s->ow, *q = s->q, *d = s->q + per;
    for (int64_t r = r0; r < r1;) {
        const int64_t run = r1 - r < Wo - ow ? r1 - r : Wo - ow; /* rows left in this output row */
        for (int64_t k = 0; k < run;) {
            const int64_t o = ow + k;
            const int8_t **p = xp + (r + k - r0) * per;
            if (inplace && o >= ow_lo && o < ow_hi) {
                /* a stretch of inside outputs: the first one's pointers, then each a step further */
                const int64_t n = run - k < ow_hi - o ? run - k : ow_hi - o;
                gemm_window(s, b, oh, o, q, d);
                if (per <= GEMM_PTRS_VEC) {
                    const __mmask8 mk = (__mmask8)((1u << per) - 1);
                    __m512i vq = _mm512_maskz_loadu_epi64(mk, q);
                    const __m512i vd = _mm512_maskz_loadu_epi64(mk, d);
                    for (int64_t j = 0; j < n; j++, p += per, vq = _mm512_add_epi64(vq, vd))
                        _mm512_mask_storeu_epi64((void *)p, mk, vq);
                } else {
                    for (int64_t j = 0; j < n; j++, p += per)
                        for (int64_t i = 0; i < per; i++) {
                            p[i] = (const int8_t *)(intptr_t)q[i];
                            q[i] += d[i];
                        }
                }
                k += n;
                continue;
            }
            int8_t *dst = s->xu + (r + k - r0) * 4 * s->Kq; /* (not GEMM_TAIL: all its rows are in place) */
            gemm_stage_row(x, g, b, oh, o, s->Kq, dst);
            for (int64_t i = 0; i < s->nseg; i++) p[i] = dst + i * seg;
            k++;
        }
        r += run;
        if ((ow += run) == Wo) { /* the next output row */
            ow = 0;
            if (++oh == Ho) {
                oh = 0;
                b++;
            }
        }
    }
    s->b = b, s->oh = oh, s->ow = ow;
    if (s->xored) gemm_xor80(s->xu, (r1 - r0) * 4 * Kq); /* (GEMM_IM2COL: every row staged) */
}

/* AMX: rows 0..rows-1 of a row block from gemm_rows' pointers (a row: nseg segments of 4 * segq bytes,
 * then 4 * tq bytes if tq) copied as x ^ 0x80 into a panel of rows lda bytes apart (the bytes past
 * 4 * Kq are left as they are: they meet zero weights). */
static void gemm_amx_panel(const gemm_src *s, const int8_t *const *xp, int64_t rows, uint8_t *panel, int64_t lda) {
    const int64_t per = s->nseg + (s->tq > 0), seg = 4 * s->segq;
    for (int64_t r = 0; r < rows; r++) {
        int8_t *d = (int8_t *)panel + r * lda;
        const int8_t *const *p = xp + r * per;
        for (int64_t i = 0; i < s->nseg; i++, d += seg) gemm_xor80_copy(d, p[i], seg);
        if (s->tq) gemm_xor80_copy(d, p[s->nseg], 4 * s->tq);
    }
}

/* Per-channel constants of the epilogue, padded with zeros to Op = 16 * ceil(O / 16) channels, in one
 * allocation of 7 arrays: M, hm1(s), pm = (s > 0), s, s - n, s - nb, with s = n (no fused add) or
 * max(n, nb) (fused add; s - n and s - nb then bring both terms to the denominator 2**s), and the
 * float64 factors M * 2**-n (exact: M < 2**53, a power-of-two scaling in the normal range). */
static void gemm_consts_fill(const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb, int64_t *k) {
    const int64_t Op = (O + 15) / 16 * 16;
    double *f = (double *)(k + 6 * Op);
    for (int64_t c = 0; c < O; c++) {
        int64_t s = add && nb > n[c] ? nb : n[c];
        k[c] = M[c];
        k[Op + c] = s > 0 ? ((int64_t)1 << (s - 1)) - 1 : 0;
        k[2 * Op + c] = s > 0;
        k[3 * Op + c] = s;
        k[4 * Op + c] = s - n[c];
        k[5 * Op + c] = s - nb;
        f[c] = ldexp((double)M[c], (int)-n[c]);
    }
}

static int64_t *gemm_consts(const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb) {
    int64_t *k = calloc((size_t)(7 * ((O + 15) / 16 * 16) + 1), sizeof(int64_t));
    if (k) gemm_consts_fill(M, n, O, add, nb, k);
    return k;
}

/* round_clamp() on 8 int64 lanes (per-lane hm1, pm, s): the same operations, lane-wise. */
static inline __m512i round_clamp_x8(__m512i x, __m512i hm1, __m512i pm, __m512i s, __m512i lo, __m512i hi) {
    __m512i q = _mm512_add_epi64(_mm512_add_epi64(x, hm1), _mm512_and_si512(_mm512_srav_epi64(x, s), pm));
    q = _mm512_srav_epi64(q, s);
    q = _mm512_max_epi64(q, lo);
    return _mm512_min_epi64(q, hi);
}

#define GEMM_LD(P) _mm512_loadu_si512((const void *)(P))

/* 8 channels ch..ch+7 of the epilogue: int32 acc sign-extended to int64, times M (vpmuldq: |M| < 2**31,
 * exact 64-bit product), [+ the fused term b * Mb, both shifted to the denominator 2**s], rounded
 * and clamped; kc holds gemm_consts()'s 6 arrays of Op entries. */
static inline __m512i gemm_requant_x8(__m256i acc, const int64_t *kc, int64_t Op, int64_t ch, int add, __m512i bterm,
                                      __m512i lo, __m512i hi) {
    __m512i v = _mm512_mul_epi32(_mm512_cvtepi32_epi64(acc), GEMM_LD(kc + ch));
    if (add) v = _mm512_add_epi64(_mm512_sllv_epi64(v, GEMM_LD(kc + 4 * Op + ch)),
                                  _mm512_sllv_epi64(bterm, GEMM_LD(kc + 5 * Op + ch)));
    return round_clamp_x8(v, GEMM_LD(kc + Op + ch), GEMM_LD(kc + 2 * Op + ch), GEMM_LD(kc + 3 * Op + ch), lo, hi);
}

/* 16 channels of the epilogue without a fused add, in float64, when the caller proved |acc| * |M| < 2**53:
 * acc * (M * 2**-n) is then exact (an integer below 2**53 scaled by a power of two), the clamp to the
 * integers [lo, hi] commutes with rounding, and the conversion rounds half to even (embedded RNE):
 * clamp(round_half_even(acc * M / 2**n), lo, hi) exactly, as round_clamp gives it.  Int32 results. */
static inline __m512i gemm_requant_f64_x16(__m512i acc, const int64_t *kc, int64_t Op, int64_t ch, __m512d lo,
                                           __m512d hi) {
    const double *f = (const double *)(kc + 6 * Op) + ch;
    __m512d a = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(acc)), _mm512_loadu_pd(f));
    __m512d b = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc, 1)), _mm512_loadu_pd(f + 8));
    a = _mm512_min_pd(_mm512_max_pd(a, lo), hi);
    b = _mm512_min_pd(_mm512_max_pd(b, lo), hi);
    __m256i ia = _mm512_cvt_roundpd_epi32(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i ib = _mm512_cvt_roundpd_epi32(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_inserti64x4(_mm512_castsi256_si512(ia), ib, 1);
}

/* As gemm_requant_f64_x16 when the caller also proved |acc| * M / 2**n < 2**31 - 1 (f64 == 2): the
 * products then convert to int32 without overflow (rounded half to even), and the clamp to the
 * integers [lo, hi] runs on the int32 results (clamping commutes with rounding to integers). */
static inline __m512i gemm_requant_f64i_x16(__m512i acc, const int64_t *kc, int64_t Op, int64_t ch, __m512i lo,
                                            __m512i hi) {
    const double *f = (const double *)(kc + 6 * Op) + ch;
    __m512d a = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(acc)), _mm512_loadu_pd(f));
    __m512d b = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc, 1)), _mm512_loadu_pd(f + 8));
    __m256i ia = _mm512_cvt_roundpd_epi32(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i ib = _mm512_cvt_roundpd_epi32(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(ia), ib, 1);
    return _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
}

/* 16 fused operands (int8 / int16, masked load) and their int64 halves; 16 int32 results (in range
 * after the clamp) narrowed to int8 / int16 stores. */
#define GEMM_BLD_8(P, MK) _mm256_castsi128_si256(_mm_maskz_loadu_epi8(MK, P))
#define GEMM_BLO_8(V) _mm512_cvtepi8_epi64(_mm256_castsi256_si128(V))
#define GEMM_BHI_8(V) _mm512_cvtepi8_epi64(_mm_srli_si128(_mm256_castsi256_si128(V), 8))
#define GEMM_BLD_16(P, MK) _mm256_maskz_loadu_epi16(MK, P)
#define GEMM_BLO_16(V) _mm512_cvtepi16_epi64(_mm256_castsi256_si128(V))
#define GEMM_BHI_16(V) _mm512_cvtepi16_epi64(_mm256_extracti128_si256(V, 1))
#define GEMM_ST_8(P, MK, FULL, Q)                                                                        \
    ((FULL) ? _mm_storeu_si128((__m128i *)(P), _mm512_cvtepi32_epi8(Q)) : _mm512_mask_cvtepi32_storeu_epi8(P, MK, Q))
#define GEMM_ST_16(P, MK, FULL, Q)                                                                       \
    ((FULL) ? _mm256_storeu_si256((__m256i *)(P), _mm512_cvtepi32_epi16(Q))                            \
            : _mm512_mask_cvtepi32_storeu_epi16(P, MK, Q))

/* The packed epilogue (f64 == 2 without a fused add, [lo, hi] inside the output type's range), 7
 * instructions per 16 lanes and whole-vector packs instead of 9 and four narrowing stores:
 * the tile's accumulators start at bias32 ^ 2**31, so each lane ends as u = acc + 2**31 (mod 2**32;
 * acc is in [-2**31, 2**31), so u is exact in [0, 2**32)).  Interleaved with the high word
 * 0x43300000, u is the float64 2**52 + u; minus 2**52 + 2**31 that is acc exactly (integers below
 * 2**53).  fma(acc, M * 2**-n, 1.5 * 2**52) rounds once, half to even ({rn-sae}): acc * M * 2**-n is
 * exact and below 2**31 in magnitude (the f64 == 2 bound), so the sum lies in [2**52, 2**53), where
 * the unit in the last place is 1: the rounding is round_half_even() to an integer, held
 * two's-complement in the low 32 bits of the float64.  The unpacks work within 128-bit lanes, so
 * the factors come permuted (fq: per 16 channels 0,1,4,5,8,9,12,13 then 2,3,6,7,10,11,14,15) and
 * shufps {0, 2} puts the 16 results back in channel order.  The packs saturate to the output type,
 * and clamping after that equals clamping before it ([lo, hi] lies inside the type's range).
 * (cvtdq2pd + vpermt2d instead of the unpacks and subtractions measured 5-14% slower on Zen4.) */
#define GEMM_SET1_8(V) _mm512_set1_epi8((char)(V))
#define GEMM_SET1_16(V) _mm512_set1_epi16((short)(V))
typedef struct {
    __m512i hw, perm, lo, hi; /* 0x43300000 words, the pack's permutation, the clamp */
    __m512d off, mag;         /* 2**52 + 2**31, 1.5 * 2**52 */
    __m512d g, goff;          /* the fused operand's factor Mb * 2**-nb and -(2**52 + 2**31) * Mb * 2**-nb */
} gemm_epi_k;

static inline __attribute__((always_inline)) __m512i gemm_epi_x16(__m512i u, const double *fq, const gemm_epi_k *k) {
    __m512d a = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(u, k->hw)), k->off);
    __m512d b = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(u, k->hw)), k->off);
    a = _mm512_fmadd_round_pd(a, _mm512_loadu_pd(fq), k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm512_fmadd_round_pd(b, _mm512_loadu_pd(fq + 8), k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castpd_ps(a), _mm512_castpd_ps(b), 0x88));
}

/* With a fused add (f64 == 3): the operand b (16 lanes, sign-extended to int32) enters the same way,
 * u_b = b ^ 2**31 as 2**52 + u_b, and fma(2**52 + u_b, g, -(2**52 + 2**31) * g) = b * g exactly (g =
 * Mb * 2**-nb; (2**52 + 2**31) * g = Mb * (2**21 + 1) * 2**(31 - nb) has at most 53 significant bits, and
 * so has b * g).  Then fma(acc, M * 2**-n, b * g) is the exact sum: it is X * 2**-s for the integer X
 * over the common denominator 2**s (s = max(n, nb)), which the caller proved below 2**53 (and below
 * (2**31 - 1) * 2**s), so one rounding of the exact value changes nothing.  Adding 1.5 * 2**52 then
 * rounds it half to even as above (two roundings, the first exact). */
static inline __attribute__((always_inline)) __m512i gemm_epi_add_x16(__m512i u, __m512i b32, const double *fq,
                                                                      const gemm_epi_k *k) {
    const __m512i ub = _mm512_xor_si512(b32, _mm512_set1_epi32((int)0x80000000u));
    const __m512d tl = _mm512_fmadd_round_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(ub, k->hw)), k->g, k->goff,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d th = _mm512_fmadd_round_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(ub, k->hw)), k->g, k->goff,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d a = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(u, k->hw)), k->off);
    __m512d b = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(u, k->hw)), k->off);
    a = _mm512_fmadd_round_pd(a, _mm512_loadu_pd(fq), tl, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm512_fmadd_round_pd(b, _mm512_loadu_pd(fq + 8), th, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    a = _mm512_add_round_pd(a, k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm512_add_round_pd(b, k->mag, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castpd_ps(a), _mm512_castpd_ps(b), 0x88));
}

/* four vectors of 16 int32 results (channel order) to nc <= 64 int8 outputs: packs (int32 -> int16 ->
 * int8, within 128-bit lanes) and one dword permutation back to channel order */
static inline __attribute__((always_inline)) void gemm_epi_store_8(__m512i r0, __m512i r1, __m512i r2, __m512i r3,
                                                                   int8_t *o, int64_t nc, const gemm_epi_k *k) {
    __m512i q = _mm512_packs_epi16(_mm512_packs_epi32(r0, r1), _mm512_packs_epi32(r2, r3));
    q = _mm512_min_epi8(_mm512_max_epi8(_mm512_permutexvar_epi32(k->perm, q), k->lo), k->hi);
    if (nc >= 64)
        _mm512_storeu_si512((void *)o, q);
    else
        _mm512_mask_storeu_epi8(o, ((uint64_t)1 << nc) - 1, q);
}

/* the same to int16 outputs: 32 channels per pack and qword permutation */
static inline __attribute__((always_inline)) void gemm_epi_half_16(__m512i r0, __m512i r1, int16_t *o, int64_t nc,
                                                                   const gemm_epi_k *k) {
    __m512i q = _mm512_permutexvar_epi64(k->perm, _mm512_packs_epi32(r0, r1));
    q = _mm512_min_epi16(_mm512_max_epi16(q, k->lo), k->hi);
    if (nc >= 32)
        _mm512_storeu_si512((void *)o, q);
    else
        _mm512_mask_storeu_epi16(o, ((uint32_t)1 << nc) - 1, q);
}
static inline __attribute__((always_inline)) void gemm_epi_store_16(__m512i r0, __m512i r1, __m512i r2, __m512i r3,
                                                                    int16_t *o, int64_t nc, const gemm_epi_k *k) {
    gemm_epi_half_16(r0, r1, o, nc, k);
    if (nc > 32) gemm_epi_half_16(r2, r3, o + 32, nc - 32, k);
}

/* 16 fused operands of a row from channel c on (nc of the tile's channels valid) as int32 */
#define GEMM_B32_8(P, MK) _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(MK, P))
#define GEMM_B32_16(P, MK) _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(MK, P))
static inline __mmask16 gemm_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

#define GEMM_PERM_8 _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0)
#define GEMM_PERM_16 _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0)
/* a tile row's 16 lanes j: as stored, or plus the start value bi (tiles that start from 0: AMX) */
#define GEMM_LDT(T, BI, J) ((BI) ? _mm512_add_epi32(GEMM_LD((T) + 16 * (J)), GEMM_LD((BI) + 16 * (J))) : GEMM_LD((T) + 16 * (J)))
/* one row of a tile (tile + r * 64, nr zmm; [+ bi]) through the packed epilogue, [b: its row of fused operands] */
#define GEMM_EPI_TILE_FN(OUT_T, OBITS)                                                                   \
    static inline __attribute__((always_inline)) void gemm_epi_tile_##OBITS(int nr, const int32_t *t,      \
                                                                           const int32_t *bi,             \
                                                                           const double *fq, OUT_T *o,    \
                                                                           int64_t nc, const gemm_epi_k *k) { \
        const __m512i z = _mm512_setzero_si512();                                                         \
        gemm_epi_store_##OBITS(gemm_epi_x16(GEMM_LDT(t, bi, 0), fq, k),                                   \
                               nr > 1 ? gemm_epi_x16(GEMM_LDT(t, bi, 1), fq + 16, k) : z,                \
                               nr > 2 ? gemm_epi_x16(GEMM_LDT(t, bi, 2), fq + 32, k) : z,                \
                               nr > 3 ? gemm_epi_x16(GEMM_LDT(t, bi, 3), fq + 48, k) : z, o, nc, k);     \
    }
#define GEMM_EPI_ADD_FN(B_T, BBITS, OUT_T, OBITS)                                                        \
    static inline __attribute__((always_inline)) void gemm_epi_add_##BBITS##_##OBITS(                    \
        int nr, const int32_t *t, const int32_t *bi, const B_T *b, const double *fq, OUT_T *o, int64_t nc,   \
        const gemm_epi_k *k) {                                                                            \
        const __m512i z = _mm512_setzero_si512();                                                         \
        __m512i r[4] = {z, z, z, z};                                                                      \
        for (int j = 0; j < 4; j++)                                                                       \
            if (j < nr)                                                                                   \
                r[j] = gemm_epi_add_x16(GEMM_LDT(t, bi, j), GEMM_B32_##BBITS(b + 16 * j, gemm_lanes(nc - 16 * j)), \
                                        fq + 16 * j, k);                                                  \
        gemm_epi_store_##OBITS(r[0], r[1], r[2], r[3], o, nc, k);                                         \
    }
GEMM_EPI_TILE_FN(int8_t, 8)
GEMM_EPI_TILE_FN(int16_t, 16)
GEMM_EPI_ADD_FN(int8_t, 8, int8_t, 8)
GEMM_EPI_ADD_FN(int8_t, 8, int16_t, 16)
GEMM_EPI_ADD_FN(int16_t, 16, int8_t, 8)
GEMM_EPI_ADD_FN(int16_t, 16, int16_t, 16)

/* The packed epilogue's constants for Op channels, in one allocation: the accumulators' start
 * bias32 ^ 2**31 (int32, Op entries) and the permuted float64 factors (Op entries) that follow. */
static void gemm_epi_fill(const int32_t *bias32, const int64_t *kc, int64_t Op, int32_t *bx) {
    const double *f = (const double *)(kc + 6 * Op);
    double *fq = (double *)(bx + Op); /* (Op is a multiple of 16: aligned) */
    for (int64_t c = 0; c < Op; c++) bx[c] = (int32_t)((uint32_t)bias32[c] ^ 0x80000000u);
    for (int64_t c = 0; c < Op; c += 16)
        for (int l = 0; l < 4; l++)
            for (int t = 0; t < 2; t++) {
                fq[c + 2 * l + t] = f[c + 4 * l + t];
                fq[c + 8 + 2 * l + t] = f[c + 4 * l + 2 + t];
            }
}

static int32_t *gemm_epi_consts(const int32_t *bias32, const int64_t *kc, int64_t Op) {
    int32_t *bx = malloc(sizeof(int32_t) * (size_t)Op + sizeof(double) * (size_t)Op + 64);
    if (bx) gemm_epi_fill(bias32, kc, Op, bx);
    return bx;
}

/* A layer's constants prepared once (gemm.py, DepthwiseConv), instead of on every call (and in every part
 * of a split one): gemm_consts' arrays, then the packed epilogue's (used where a call's f64, lo and hi take
 * it; not filled for bias32 NULL, the depthwise kernel's use), qc_gemm_prep_bytes(O) bytes from
 * qc_gemm_prep.  Building them cost 2-18 us a call (O = 96-1280), against a few us of work for a small
 * layer's part. */
#define GEMM_KC_BYTES(Op) ((size_t)(7 * (Op) + 1) * sizeof(int64_t))
static int64_t vnni_gemm_prep_bytes(int64_t O) {
    const int64_t Op = (O + 15) / 16 * 16;
    return (int64_t)(GEMM_KC_BYTES(Op) + sizeof(int32_t) * (size_t)Op + sizeof(double) * (size_t)Op);
}
static int vnni_gemm_prep(const int32_t *bias32, const int64_t *M, const int64_t *n, int64_t O, int add, int64_t nb,
                          void *pre) {
    const int64_t Op = (O + 15) / 16 * 16;
    memset(pre, 0, (size_t)vnni_gemm_prep_bytes(O));
    gemm_consts_fill(M, n, O, add, nb, (int64_t *)pre);
    if (bias32) gemm_epi_fill(bias32, (const int64_t *)pre, Op, (int32_t *)((char *)pre + GEMM_KC_BYTES(Op)));
    return 0;
}

/* The epilogue of one row of a tile, 8 channels at a time (the last group masked): int32 acc
 * sign-extended to int64, times M (vpmuldq: |M| < 2**31, exact 64-bit product), [+ the fused term,
 * both shifted to 2**s], rounded and clamped, narrowed to BITS-wide stores. */
#define GEMM_FN(NAME, B_T, BBITS, OUT_T, OBITS, ADD)                                                     \
    static int NAME(const int8_t *restrict x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t O,   \
                    const int8_t *restrict wpack, const int32_t *restrict bias32, const int64_t *restrict M,  \
                    const int64_t *restrict n, const B_T *restrict b, int64_t Mb, int64_t nb, int64_t lo,  \
                    int64_t hi, int f64, const qc_conv_geometry *restrict geo, OUT_T *restrict out, const void *pre) { \
        if (m1 <= m0) return 0;                                                                           \
        const int64_t nob = (O + 15) / 16, Op = nob * 16;                                                  \
        const __m512d dlo = _mm512_set1_pd((double)lo), dhi = _mm512_set1_pd((double)hi);                 \
        const __m512i ilo = _mm512_set1_epi32((int32_t)lo), ihi = _mm512_set1_epi32((int32_t)hi);         \
        /* tiles (32 rows) or vectors (GEMM_MR) */                                                        \
        const int amx = gemm_amx_takes(m1 - m0, K, O);                                                    \
        /* a padded copy (GEMM_SLIDE) of more than gemm_slide_cap bytes: a few images at a time */        \
        const int64_t step = amx && geo ? gemm_slide_images(geo, m0, m1, nob) : 0;                        \
        for (int64_t a0 = m0; step && a0 < m1;) {                                                         \
            const int64_t a1 = (a0 / step + 1) * step < m1 ? (a0 / step + 1) * step : m1;                 \
            if (NAME(x, ldx, a0, a1, K, O, wpack, bias32, M, n, b, Mb, nb, lo, hi, f64, geo, out, pre)) return -1; \
            if ((a0 = a1) == m1) return 0;                                                                \
        }                                                                                                 \
        gemm_src src;                                                                                     \
        if (gemm_src_open(&src, x, ldx, geo, m0, m1, K, nob, wpack, amx)) return -1;                      \
        /* GEMM_SLIDE: rows are positions of the padded grid (slide), or output rows walked row by row */ \
        const int inplace_a = src.mode == GEMM_SLIDE; /* (A read from the padded copy) */                  \
        const int slide = inplace_a && !src.srows, srows = inplace_a && src.srows;                        \
        const int64_t Kq = src.Kq, wstride = Kq * 64, mb = src.mb, per = src.nseg + (src.tq > 0);         \
        const int64_t MR = amx ? 32 : GEMM_MR;                                                            \
        /* AMX: A rows from the padded copy in place (GEMM_SLIDE), from xu as staged (x ^ 0x80 already), or   \
         * copied into a panel; the weights' zero-padded last chunks */                                  \
        const int64_t lda = inplace_a ? geo->sw * geo->C : !amx || src.xored ? 4 * Kq : (4 * Kq + 63) / 64 * 64; \
        uint8_t *panel = amx && !inplace_a && !src.xored ? calloc((size_t)(mb * lda + 64), 1) : NULL;     \
        int8_t *wt = amx && !inplace_a ? gemm_amx_wtail(src.wp, nob, Kq) : NULL;                          \
        /* the layer's constants: prepared once (qc_gemm_prep), or built for this call */                 \
        int64_t *kc = pre ? (int64_t *)pre : gemm_consts(M, n, O, ADD, nb);                               \
        const int8_t **xp = inplace_a ? NULL : malloc(sizeof(*xp) * (size_t)(mb * per));                 \
        int64_t *map = slide ? malloc(sizeof(int64_t) * (size_t)mb) : NULL;                               \
        if (!kc || (!inplace_a && !xp) || (slide && !map) || (amx && !inplace_a && !src.xored && !panel) || \
            (amx && !inplace_a && Kq % 16 && !wt)) {                                                      \
            if (!pre) free(kc);                                                                           \
            free(xp);                                                                                     \
            free(map);                                                                                    \
            free(panel);                                                                                  \
            free(wt);                                                                                     \
            gemm_src_close(&src);                                                                         \
            return -1;                                                                                    \
        }                                                                                                 \
        const uint8_t *arows = !amx ? NULL : inplace_a ? src.xs : src.xored ? (const uint8_t *)src.xu : panel; \
        /* A as the tile kernel reads it: the kernel rows dh * Wp pixels apart (GEMM_SLIDE), else one segment */ \
        const int64_t nseg = inplace_a ? geo->kh : 1, segstep = inplace_a ? geo->dh * src.Wp * geo->C : 0; \
        const int64_t lc = inplace_a ? src.lc : Kq / 16;                                                  \
        if (amx) gemm_amx_config();                                                                       \
        const __m512i vlo = _mm512_set1_epi64(lo), vhi = _mm512_set1_epi64(hi), vMb = _mm512_set1_epi64(Mb); \
        int32_t tile[32 * 64] __attribute__((aligned(64))); /* (GEMM_MR or 32 rows of 64 channels) */    \
        const int64_t tmax = OBITS == 8 ? 127 : 32767;                                                    \
        /* the packed epilogue when it applies (and its tables could be allocated), else the one below */ \
        int32_t *bx = f64 == (ADD ? 3 : 2) && lo >= -tmax - 1 && hi <= tmax                              \
                          ? pre ? (int32_t *)((char *)pre + GEMM_KC_BYTES(Op)) : gemm_epi_consts(bias32, kc, Op) \
                          : NULL;                                                                         \
        const double *fq = bx ? (const double *)(bx + Op) : NULL;                                          \
        const double gb = ldexp((double)Mb, (int)-nb);                                                    \
        const gemm_epi_k ek = {_mm512_set1_epi32(0x43300000), GEMM_PERM_##OBITS, GEMM_SET1_##OBITS(lo),   \
                               GEMM_SET1_##OBITS(hi), _mm512_set1_pd(0x1.000008p52), _mm512_set1_pd(0x1.8p52), \
                               _mm512_set1_pd(gb), _mm512_set1_pd(-0x1.000008p52 * gb)};                  \
        const int64_t rbeg = slide ? src.qa : m0, rend = slide ? src.qb : m1;                             \
        for (int64_t r0 = rbeg; r0 < rend; r0 += mb) {                                                    \
            const int64_t r1 = r0 + mb < rend ? r0 + mb : rend;                                           \
            if (slide) {                                                                                  \
                if (!gemm_slide_map(&src, r0, r1, m0, m1, map)) continue;                                 \
            } else if (!srows) {                                                                          \
                gemm_rows(&src, r0, r1, xp);                                                              \
                if (panel) gemm_amx_panel(&src, xp, r1 - r0, panel, lda);                                 \
            }                                                                                             \
            for (int64_t ob = 0; ob < nob; ob += GEMM_NR) {                                               \
                const int nr = (int)(nob - ob < GEMM_NR ? nob - ob : GEMM_NR);                            \
                const int64_t c0 = 16 * ob, nc = 16 * nr < O - c0 ? 16 * nr : O - c0;                     \
                for (int64_t m = r0, rows; m < r1; m += rows) {                                           \
                    rows = r1 - m < MR ? r1 - m : MR;                                                     \
                    if (srows && geo->Wo - m % geo->Wo < rows) rows = geo->Wo - m % geo->Wo; /* (one output row) */ \
                    const int64_t *mp = slide ? map + (m - r0) : NULL; /* each tile row's output row */   \
                    if (mp) {                                                                             \
                        int64_t any = 0;                                                                  \
                        for (int64_t r = 0; r < rows; r++) any |= mp[r] >= 0;                            \
                        if (!any) continue;                                                               \
                    }                                                                                     \
                    const int32_t *init = bx ? bx : bias32; /* the accumulators' start (bias32 ^ 2**31 packed) */ \
                    /* (tiles start from 0 and the epilogue adds init; the vector kernel starts from init) */  \
                    const int32_t *bi = amx ? init + c0 : NULL;                                           \
                    if (amx)                                                                              \
                        gemm_amx_tile(srows ? gemm_slide_at(&src, m) : arows + (slide ? m : m - r0) * lda, lda, \
                                      nseg, segstep, lc, rows, Kq,                                        \
                                      src.wp + ob * wstride, wt ? wt + ob * 1024 : NULL, nr, tile);       \
                    else                                                                                  \
                        gemm_tile_nr(xp + (m - r0) * per, rows, src.nseg, src.segq, src.tq, src.xored,    \
                                     src.wp + ob * wstride, wstride, nr, init + c0, tile);                \
                    for (int64_t r = 0; r < rows; r++) {                                                  \
                        const int64_t mr = mp ? mp[r] : m + r;                                            \
                        if (mr < 0) continue;                                                             \
                        OUT_T *o = out + mr * O + c0;                                                     \
                        const B_T *bb = ADD ? b + mr * O + c0 : NULL;                                     \
                        if (bx) {                                                                         \
                            if (ADD)                                                                      \
                                gemm_epi_add_##BBITS##_##OBITS(nr, tile + r * 64, bi, bb, fq + c0, o, nc, &ek); \
                            else                                                                          \
                                gemm_epi_tile_##OBITS(nr, tile + r * 64, bi, fq + c0, o, nc, &ek);        \
                            continue;                                                                     \
                        }                                                                                 \
                        if (bi) /* (the other epilogues read the tile row with its start value added) */    \
                            for (int64_t c = 0; c < 16 * nr; c += 16)                                     \
                                _mm512_store_si512((void *)(tile + r * 64 + c),                           \
                                                   _mm512_add_epi32(_mm512_load_si512((const void *)(tile + r * 64 + c)), \
                                                                    GEMM_LD(bi + c)));                    \
                        for (int64_t c = 0; c < nc; c += 16) {                                            \
                            const int full = nc - c >= 16;                                                \
                            const __mmask16 mk = full ? (__mmask16)0xFFFF : (__mmask16)((1u << (nc - c)) - 1); \
                            const int64_t ch = c0 + c;                                                    \
                            __m512i blo = _mm512_setzero_si512(), bhi = blo;                              \
                            if (ADD) {                                                                    \
                                const __m256i bv = GEMM_BLD_##BBITS(bb + c, mk);                          \
                                blo = _mm512_mul_epi32(GEMM_BLO_##BBITS(bv), vMb);                        \
                                bhi = _mm512_mul_epi32(GEMM_BHI_##BBITS(bv), vMb);                        \
                            }                                                                             \
                            const int32_t *t = tile + r * 64 + c;                                         \
                            if (!ADD && f64 == 2) {                                                       \
                                const __m512i q = gemm_requant_f64i_x16(_mm512_load_si512((const void *)t), kc, Op, \
                                                                        ch, ilo, ihi);                    \
                                GEMM_ST_##OBITS(o + c, mk, full, q);                                      \
                                continue;                                                                 \
                            }                                                                             \
                            if (!ADD && f64) {                                                            \
                                const __m512i q = gemm_requant_f64_x16(_mm512_load_si512((const void *)t), kc, Op, \
                                                                       ch, dlo, dhi);                     \
                                GEMM_ST_##OBITS(o + c, mk, full, q);                                      \
                                continue;                                                                 \
                            }                                                                             \
                            __m512i qlo = gemm_requant_x8(_mm256_load_si256((const __m256i *)t), kc, Op, ch, ADD, \
                                                          blo, vlo, vhi);                                 \
                            __m512i qhi = gemm_requant_x8(_mm256_load_si256((const __m256i *)(t + 8)), kc, Op, \
                                                          ch + 8, ADD, bhi, vlo, vhi);                    \
                            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(qlo)), \
                                                           _mm512_cvtepi64_epi32(qhi), 1);                \
                            GEMM_ST_##OBITS(o + c, mk, full, q);                                          \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        if (amx) gemm_amx_release();                                                                      \
        if (!pre) {                                                                                       \
            free(kc);                                                                                     \
            free(bx);                                                                                     \
        }                                                                                                 \
        free(xp);                                                                                         \
        free(map);                                                                                        \
        free(panel);                                                                                      \
        free(wt);                                                                                         \
        gemm_src_close(&src);                                                                             \
        return 0;                                                                                         \
    }

GEMM_FN(vnni_gemm_i8, int8_t, 8, int8_t, 8, 0)
GEMM_FN(vnni_gemm_i16, int8_t, 8, int16_t, 16, 0)
GEMM_FN(vnni_gemm_add_i8_i8, int8_t, 8, int8_t, 8, 1)
GEMM_FN(vnni_gemm_add_i16_i8, int16_t, 16, int8_t, 8, 1)
GEMM_FN(vnni_gemm_add_i8_i16, int8_t, 8, int16_t, 16, 1)
GEMM_FN(vnni_gemm_add_i16_i16, int16_t, 16, int16_t, 16, 1)

/* Depthwise int8 conv (as qc_dwconv_* of depthwise.c: same geometry, same results) with AVX512-VNNI, four
 * horizontal taps per int32 lane (vpdpbusd, u8 x s8 -> int32, wrap-around, not the saturating form).
 *
 * Per block of 16 channels and input row ih, the row is widened once into Z: entry q holds, for each
 * channel c of the block, the 4 bytes x[ih, p + t*dw, c] ^ 0x80 (t = 0..3, p = q - pw; taps outside
 * the input are the zero point 0, so the byte 0x80), i.e. 64 bytes = one vpdpbusd operand.  Output
 * (oh, ow) is then bias32 + sum over rows i and tap groups g of vpdpbusd(Z_i[ow*sw + 4g*dw], w4[i, g]):
 * kh * ceil(kw / 4) instructions per 16 outputs (3 for a 3x3) with no bounds checks, the weights in
 * registers, and each widened entry reused by every output row and column that reads it.  A ring of
 * kh widened rows (tagged by ih) carries rows over from one output row to the next; rows outside the
 * input read a constant row of 0x80.  w4: int8 (kh, G, Cp, 4), G = ceil(kw / 4), Cp = 16 * ceil(C / 16),
 * w4[i, g, c, t] = w[c, i, 4g + t] (zero beyond kw and C: a zero weight adds nothing whatever the byte).
 *
 * Exactness, as the GEMM's: each byte is x + 128 (unsigned), and the caller packs
 * b32[c] = bias[c] - 128 * sum_{i,j} w[c, i, j].  It proves 128 * max_c sum |w_c| + max |bias| < 2**31,
 * so b32 and the true sum fit int32; every vpdpbusd step is exact modulo 2**32 (each product fits
 * |255 * 128| < 2**15, four of them int32), so the final lane is bias + sum x * w, the true accumulator.
 * Weights must be int8 (-128..127; a +128 stays on the scalar kernel).  The epilogue, chosen by the
 * caller's proofs (f64_epilogue in qcompiler/native/kernels.py): epi == 0 gemm_requant_x8 (int64,
 * |M| < 2**31); 1 gemm_requant_f64_x16 (|acc| * |M| < 2**53); 2 (|acc| * |M| / 2**n < 2**31 - 1 on every
 * channel) float64 without conversion instructions:
 *  - the bias starts 2**31 higher (modulo 2**32), so a lane ends as u = acc + 2**31 in [1, 2**32) read
 *    unsigned; pairing it with the high word 0x43300000 (vpunpck{l,h}dq) gives the double 2**52 + u
 *    exactly, minus 2**52 + 2**31 (exact: both and the result are integers below 2**53): acc, exact;
 *  - fma(acc, f, 1.5 * 2**52) with f = M * 2**-n (exact) rounds the exact acc * M / 2**n + 1.5 * 2**52
 *    once, half to even (embedded {rn-sae}, whatever MXCSR says), to a double in [2**52, 2**53) (|acc * f| < 2**31 < 2**51), whose spacing is 1:
 *    1.5 * 2**52 + round_half_even(acc * M / 2**n) (1.5 * 2**52 is even, so ties keep their parity);
 *  - its low 32 bits are that rounded value modulo 2**32, i.e. the value itself (|.| < 2**31): gathered
 *    back into channel order (vpermt2d) and clamped to [lo, hi] in int32.
 * 11 instructions per 16 outputs, none on the conversion units (gemm_requant_f64i_x16 takes 4 converts).
 * pre: the layer's per-channel constants from qc_gemm_prep (bias32 NULL, add 0), or NULL to build them in
 * the call from M and n (a split call builds them in every part and for every sample). */
#define DW4_BAND (192 << 10)
#define DW4_FN(NAME, OUT_T, OBITS)                                                                       \
    static int NAME(const int8_t *restrict x, int64_t N, int64_t H, int64_t W, int64_t C,                  \
                    const int8_t *restrict w4, int64_t kh, int64_t kw, const int32_t *restrict b32,         \
                    int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t Ho,     \
                    int64_t Wo, const int64_t *restrict M, const int64_t *restrict n, int64_t lo,           \
                    int64_t hi, int epi, OUT_T *restrict out, const void *pre) {                          \
        const int64_t G = (kw + 3) / 4, KT = kh * G, Cp = (C + 15) / 16 * 16;                             \
        const int64_t Wq = (Wo - 1) * sw + 4 * (G - 1) * dw + 1, Wx = Wq + 3 * dw;                        \
        const int64_t qs = (4 * dw) % sw == 0 ? sw : 1; /* every Z entry read is a multiple of qs */      \
        /* gcd(dh, kh) == 1: the rows ih0 + i * dh (i < kh) of one output row differ modulo kh (kh divides  \
         * (i - j) * dh only if it divides i - j), so row ih can live in slot ih % kh without a search */ \
        int64_t gd = dh, gk = kh;                                                                         \
        while (gk) {                                                                                      \
            const int64_t t = gd % gk;                                                                    \
            gd = gk;                                                                                      \
            gk = t;                                                                                       \
        }                                                                                                 \
        const int direct = gd == 1;                                                                       \
        const int sat = hi == (OBITS == 8 ? INT8_MAX : INT16_MAX); /* DW4_ST_* clamps at hi */             \
        /* the layer's constants: prepared once (qc_gemm_prep, bias32 NULL), or built for this call */     \
        int64_t *kc = pre ? (int64_t *)pre : gemm_consts(M, n, C, 0, 0);                                  \
        uint8_t *zb = aligned_alloc(64, (size_t)(64 * ((kh + 1) * Wq + Wx / 4 + 1)));                     \
        int64_t *tag = malloc(sizeof(int64_t) * (size_t)kh);                                              \
        const uint8_t **rp = malloc(sizeof(uint8_t *) * (size_t)kh);                                      \
        __m512i *wv = aligned_alloc(64, 64 * (size_t)KT);                                                 \
        if (!kc || !zb || !tag || !rp || !wv) {                                                           \
            if (!pre) free(kc);                                                                           \
            free(zb);                                                                                     \
            free(tag);                                                                                    \
            free(rp);                                                                                     \
            free(wv);                                                                                     \
            return -1;                                                                                    \
        }                                                                                                 \
        uint8_t *zrow = zb + 64 * kh * Wq, *xp = zrow + 64 * Wq; /* the row outside the input; padded row */ \
        memset(zrow, 0x80, (size_t)(64 * Wq));                                                            \
        const __m512i vlo = _mm512_set1_epi64(lo), vhi = _mm512_set1_epi64(hi), zero = _mm512_setzero_si512(); \
        const __m512i vlo32 = _mm512_set1_epi32((int32_t)lo), vhi32 = _mm512_set1_epi32((int32_t)hi);    \
        const __m512d dlo = _mm512_set1_pd((double)lo), dhi = _mm512_set1_pd((double)hi);                 \
        const __m512i e52 = _mm512_set1_epi32(0x43300000); /* the high word of 2**52 */                   \
        const __m512d m1 = _mm512_set1_pd(4503601774854144.0), m2 = _mm512_set1_pd(6755399441055744.0); \
        __m512i pidx; /* result lane e <- the low word of ya / yb's 64-bit lane holding channel e */         \
        {                                                                                                 \
            int32_t pb[16];                                                                               \
            for (int e = 0; e < 16; e++) pb[e] = 2 * (2 * (e / 4) + e % 2) + (e % 4 >= 2 ? 16 : 0);      \
            pidx = _mm512_loadu_si512((const void *)pb);                                                  \
        }                                                                                                 \
        const __m128i flip = _mm_set1_epi8((char)0x80);                                                   \
        /* byte 4c + t of a Z entry <- byte 16t + c of the 4 padded-row entries (tap t, channel c) */     \
        __m512i idx;                                                                                      \
        {                                                                                                 \
            int8_t ib[64];                                                                                \
            for (int k = 0; k < 64; k++) ib[k] = (int8_t)(16 * (k % 4) + k / 4);                          \
            idx = _mm512_loadu_si512((const void *)ib);                                                   \
        }                                                                                                 \
        /* bands of output rows whose input rows stay in L2 (DW4_BAND bytes) while the channel blocks pass */ \
        const int64_t band = DW4_BAND / (sh * W * C + 1) + 1;                                             \
        for (int64_t b = 0; b < N; b++)                                                                   \
            for (int64_t oh0 = 0; oh0 < Ho; oh0 += band)                                                  \
            for (int64_t c0 = 0; c0 < C; c0 += 16) {                                                      \
                const int full = C - c0 >= 16;                                                            \
                const __mmask16 mk = full ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c0)) - 1);        \
                for (int64_t t = 0; t < KT; t++) wv[t] = GEMM_LD(w4 + (t * Cp + c0) * 4);                 \
                /* epi == 2: the factors M * 2**-n of the lanes unpacklo / unpackhi pair with 2**52 */  \
                double fab[16];                                                                           \
                for (int j = 0; j < 16; j++)                                                              \
                    fab[j] = ((const double *)(kc + 6 * Cp))[c0 + 4 * (j % 8 / 2) + 2 * (j / 8) + j % 2];  \
                const __m512d fa = _mm512_loadu_pd(fab), fb = _mm512_loadu_pd(fab + 8);                   \
                const __m512i bv = epi == 2 ? _mm512_xor_si512(GEMM_LD(b32 + c0), _mm512_set1_epi32(INT32_MIN)) \
                                            : GEMM_LD(b32 + c0);                                          \
                for (int64_t s = 0; s < kh; s++) tag[s] = -1;                                             \
                for (int64_t oh = oh0; oh < Ho && oh < oh0 + band; oh++) {                                \
                    for (int64_t i = 0; i < kh; i++) {                                                    \
                        const int64_t ih = oh * sh - ph + i * dh;                                         \
                        if (ih < 0 || ih >= H) {                                                          \
                            rp[i] = zrow;                                                                 \
                            continue;                                                                     \
                        }                                                                                 \
                        int64_t s = direct ? ih % kh : 0;                                                 \
                        while (!direct && s < kh && tag[s] != ih) s++;                                    \
                        if (direct ? tag[s] != ih : s == kh) { /* widen row ih into its slot, or one empty or */ \
                            for (s = direct ? s : 0; !direct && tag[s] >= 0; s++) { /* holding no row needed */ \
                                int64_t u = 0;                                                            \
                                while (u < kh && tag[s] != oh * sh - ph + u * dh) u++;                    \
                                if (u == kh) break;                                                       \
                            }                                                                             \
                            tag[s] = ih;                                                                  \
                            const int8_t *xr = x + ((b * H + ih) * W) * C + c0;                           \
                            uint8_t *z = zb + 64 * s * Wq;                                                \
                            if (dw == 1 && qs == 1) { /* the 4 chunks q..q+3 slide along the row in a register */ \
                                __m512i win = _mm512_setzero_si512();                                     \
                                for (int64_t q = -3; q < Wq; q++) { /* chunk q + 3 shifts in */   \
                                    const int64_t p = q + 3 - pw;                                         \
                                    const __m128i v = p >= 0 && p < W                                     \
                                        ? _mm_xor_si128(_mm_maskz_loadu_epi8(mk, xr + p * C), flip) : flip; \
                                    win = _mm512_alignr_epi64(_mm512_castsi128_si512(v), win, 2);         \
                                    if (q >= 0)                                                           \
                                        _mm512_store_si512((void *)(z + 64 * q), _mm512_permutexvar_epi8(idx, win)); \
                                }                                                                         \
                            } else if (dw == 1 && qs == 2) { /* stride 2: two chunks shift in per entry */ \
                                __m512i win = _mm512_setzero_si512();                                     \
                                for (int64_t q = -2; q < Wq; q += 2) { /* chunks q + 2, q + 3 shift in */  \
                                    const int64_t p = q + 2 - pw;                                         \
                                    const __m128i v0 = p >= 0 && p < W                                    \
                                        ? _mm_xor_si128(_mm_maskz_loadu_epi8(mk, xr + p * C), flip) : flip; \
                                    const __m128i v1 = p + 1 >= 0 && p + 1 < W                            \
                                        ? _mm_xor_si128(_mm_maskz_loadu_epi8(mk, xr + (p + 1) * C), flip) : flip; \
                                    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(v0), v1, 1); \
                                    win = _mm512_alignr_epi64(_mm512_castsi256_si512(v), win, 4);         \
                                    if (q >= 0)                                                           \
                                        _mm512_store_si512((void *)(z + 64 * q), _mm512_permutexvar_epi8(idx, win)); \
                                }                                                                         \
                            } else { /* dilated or stride > 2: the padded row, then 4 chunks dw apart per entry */ \
                                for (int64_t q = 0; q < Wx; q++) {                                        \
                                    const int64_t p = q - pw;                                             \
                                    __m128i v = p >= 0 && p < W ? _mm_maskz_loadu_epi8(mk, xr + p * C)    \
                                                                : _mm_setzero_si128();                    \
                                    _mm_store_si128((__m128i *)(xp + 16 * q), _mm_xor_si128(v, flip));    \
                                }                                                                         \
                                for (int64_t q = 0; q < Wq; q += qs) {                                    \
                                    const __m128i *e = (const __m128i *)(xp + 16 * q);                    \
                                    __m512i v = _mm512_castsi128_si512(_mm_load_si128(e));               \
                                    v = _mm512_inserti32x4(v, _mm_load_si128(e + dw), 1);                \
                                    v = _mm512_inserti32x4(v, _mm_load_si128(e + 2 * dw), 2);            \
                                    v = _mm512_inserti32x4(v, _mm_load_si128(e + 3 * dw), 3);            \
                                    _mm512_store_si512((void *)(z + 64 * q), _mm512_permutexvar_epi8(idx, v)); \
                                }                                                                         \
                            }                                                                             \
                        }                                                                                 \
                        rp[i] = zb + 64 * s * Wq;                                                         \
                    }                                                                                     \
                    OUT_T *o = out + ((b * Ho + oh) * Wo) * C + c0;                                       \
                    if (KT == 3)                                                                          \
                        DW4_ROW(OBITS, 3)                                                                 \
                    else if (KT == 1)                                                                     \
                        DW4_ROW(OBITS, 1)                                                                 \
                    else                                                                                  \
                        DW4_ROW(OBITS, KT)                                                                \
                }                                                                                         \
            }                                                                                             \
        if (!pre) free(kc);                                                                               \
        free(zb);                                                                                         \
        free(tag);                                                                                        \
        free(rp);                                                                                         \
        free(wv);                                                                                         \
        return 0;                                                                                         \
    }

/* 16 int32 results narrowed with signed saturation (vpmovsdb / vpmovsdw) and stored, the last block of
 * channels masked: results already in [lo, hi] are unchanged, and an upper clamp at the type's maximum
 * (hi == 127 / 32767, every relu6 layer of int8 out) is the saturation itself. */
#define DW4_ST_8(P, MK, FULL, R)                                                                         \
    ((FULL) ? _mm_storeu_si128((__m128i *)(P), _mm512_cvtsepi32_epi8(R)) : _mm512_mask_cvtsepi32_storeu_epi8(P, MK, R))
#define DW4_ST_16(P, MK, FULL, R)                                                                        \
    ((FULL) ? _mm256_storeu_si256((__m256i *)(P), _mm512_cvtsepi32_epi16(R))                            \
            : _mm512_mask_cvtsepi32_storeu_epi16(P, MK, R))

/* One output row of one channel block: NT = kh * G taps of 4 (a constant in the common cases, so the
 * loop unrolls and the weights stay in registers), then the epilogue chosen by epi. */
#define DW4_ROW(OBITS, NT)                                                                               \
    {                                                                                                     \
        const uint8_t *tp[NT]; /* tap group t's entry for ow = 0 */                                       \
        __m512i tw[NT];                                                                                   \
        for (int64_t t = 0; t < (NT); t++) {                                                              \
            tp[t] = rp[t / G] + 256 * (t % G) * dw;                                                       \
            tw[t] = wv[t];                                                                                \
        }                                                                                                 \
        const int64_t st = 64 * sw;                                                                       \
        for (int64_t ow = 0; ow < Wo; ow++) {                                                             \
            __m512i acc = bv;                                                                             \
            for (int64_t t = 0; t < (NT); t++) acc = _mm512_dpbusd_epi32(acc, GEMM_LD(tp[t] + st * ow), tw[t]); \
            __m512i r;                                                                                    \
            if (epi == 2) { /* lanes hold acc + 2**31 (the bias's offset): see DW4_FN */              \
                __m512d ya = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpacklo_epi32(acc, e52)), m1);     \
                __m512d yb = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_unpackhi_epi32(acc, e52)), m1);     \
                ya = _mm512_fmadd_round_pd(ya, fa, m2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);    \
                yb = _mm512_fmadd_round_pd(yb, fb, m2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);    \
                r = _mm512_permutex2var_epi32(_mm512_castpd_si512(ya), pidx, _mm512_castpd_si512(yb));    \
                r = _mm512_max_epi32(r, vlo32);                                                           \
                if (!sat) r = _mm512_min_epi32(r, vhi32);                                                 \
            }                                                                                             \
            else if (epi)                                                                                 \
                r = gemm_requant_f64_x16(acc, kc, Cp, c0, dlo, dhi);                                      \
            else {                                                                                        \
                __m512i qlo = gemm_requant_x8(_mm512_castsi512_si256(acc), kc, Cp, c0, 0, zero, vlo, vhi); \
                __m512i qhi = gemm_requant_x8(_mm512_extracti64x4_epi64(acc, 1), kc, Cp, c0 + 8, 0, zero, vlo, vhi); \
                r = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(qlo)),                \
                                       _mm512_cvtepi64_epi32(qhi), 1);                                    \
            }                                                                                             \
            DW4_ST_##OBITS(o + ow * C, mk, full, r);                                                      \
        }                                                                                                 \
    }

DW4_FN(vnni_dwconv4_i8_i8, int8_t, 8)
DW4_FN(vnni_dwconv4_i8_i16, int16_t, 16)

#define VNNI_GEMM_ENTRY(NAME, B_T, OUT_T) .NAME = vnni_##NAME,
#define VNNI_DW4_ENTRY(NAME, OUT_T) .NAME = vnni_##NAME,
static const qc_gemm_kernels vnni_kernels = {
    QC_GEMM_VARIANTS(VNNI_GEMM_ENTRY) QC_DW4_VARIANTS(VNNI_DW4_ENTRY)
    .gemm_conv_layout = vnni_gemm_conv_layout, .gemm_tail_weights = vnni_gemm_tail_weights,
    .gemm_slide_weights = vnni_gemm_slide_weights, .gemm_slide_cap = vnni_gemm_slide_cap,
    .gemm_prep_bytes = vnni_gemm_prep_bytes, .gemm_prep = vnni_gemm_prep};
const qc_gemm_kernels *const qc_gemm_vnni_kernels = &vnni_kernels;
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else /* a compiler that cannot target AVX512-VNNI: no kernels (the simulator keeps its other paths) */
const qc_gemm_kernels *const qc_gemm_vnni_kernels = NULL;
#endif

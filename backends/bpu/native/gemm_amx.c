/* The int8 GEMM on AMX tiles (Intel AMX-INT8), 32 rows x 32 channels per tdpbusd block, called by the
 * VNNI kernels (gemm_vnni.c) on the calls gemm_amx_mode() gives them.
 *
 * tdpbusd is vpdpbusd on tiles: C[m][n] += sum_k A[m][k] * B[k / 4][4 n + k % 4], A unsigned bytes (here
 * x ^ 0x80, as the vector kernel reads them), B signed bytes, int32 lanes with wrap-around (no
 * saturation), so the arithmetic and its exactness argument are the vector kernel's: the same sums and
 * the same bias32 start (added by the epilogue to lanes that start from 0: the same int32 modulo 2**32),
 * the same final int32 per lane.  A B tile (16 groups of 4 k x 16 channels) is 16 consecutive
 * 64-byte groups of the packed weights as they are, wp + (ob * Kq + 16 * kc) * 64 with a stride of 64.
 * The last chunk of a block whose Kq is not a multiple of 16 comes from a copy padded with zero
 * weights (gemm_amx_wtail), so the A bytes it meets past K (the next row's, or the panel's padding)
 * add nothing.  A tiles are 16 rows of 64 bytes of a contiguous panel of rows lda bytes apart: the
 * rows gemm_rows staged as x ^ 0x80 already (GEMM_PLAIN staged, GEMM_IM2COL), or the row pointers'
 * bytes copied xored into a panel (gemm_amx_panel).  Tiles 0-3 accumulate (rows 0-15 / 16-31 x
 * channels 0-15 / 16-31), 4-5 hold A, 6-7 hold B.  Linux grants a process the tile state only on
 * request (arch_prctl ARCH_REQ_XCOMP_PERM), made once by qc_gemm_amx_set; each call loads its tile
 * configuration and releases the tiles when it returns. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"

#define GEMM_AMX_PANEL (384 << 10) /* bytes of A rows per row block (kept in L2 across the channel groups) */

/* rows per row block: a panel of about GEMM_AMX_PANEL bytes, whole 32-row blocks */
int64_t gemm_amx_rows(int64_t lda) {
    const int64_t mb = GEMM_AMX_PANEL / (lda > 0 ? lda : 1) / 32 * 32;
    return mb < 32 ? 32 : mb;
}

/* The last, partial chunk (Kq % 16 groups) of each of nob blocks of the packed weights wp, padded
 * with zero weights to 16 groups: nob * 1024 bytes (NULL when Kq is a multiple of 16). */
int8_t *gemm_amx_wtail(const int8_t *wp, int64_t nob, int64_t Kq) {
    const int64_t left = Kq % 16;
    if (!left) return NULL;
    int8_t *t = calloc((size_t)(nob * 1024), 1);
    if (t)
        for (int64_t ob = 0; ob < nob; ob++) memcpy(t + ob * 1024, wp + (ob * Kq + Kq - left) * 64, (size_t)(left * 64));
    return t;
}

#if QC_CC_AMX
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-int8"))), apply_to = function)
#else
#pragma GCC target("amx-tile,amx-int8")
#endif
const int qc_gemm_amx_built = 1;
static int64_t gemm_amx_calls; /* calls that ran on tiles (tests check the path they name was taken) */
int64_t gemm_amx_call_count(void) { return __atomic_load_n(&gemm_amx_calls, __ATOMIC_RELAXED); }
void gemm_amx_release(void) { _tile_release(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) gemm_amx_cfg;

void gemm_amx_config(void) {
    __atomic_add_fetch(&gemm_amx_calls, 1, __ATOMIC_RELAXED);
    gemm_amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    /* GCC 12 does not count ldtilecfg's 64-byte operand as read and drops the stores above as dead
     * (leaving palette 1 with stack garbage or zero rows: #GP or #UD at the next tile instruction);
     * the empty asm makes the whole struct observed */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

#define AMX_STEP(AO, B0, B1)                                                                             \
    {                                                                                                     \
        _tile_loadd(4, a + (AO), lda);                                                                    \
        if (RA > 1) _tile_loadd(5, a + 16 * lda + (AO), lda);                                             \
        _tile_loadd(6, B0, 64);                                                                           \
        if (CB > 1) _tile_loadd(7, B1, 64);                                                               \
        _tile_dpbusd(0, 4, 6);                                                                            \
        if (CB > 1) _tile_dpbusd(1, 4, 7);                                                                \
        if (RA > 1) _tile_dpbusd(2, 5, 6);                                                                \
        if (RA > 1 && CB > 1) _tile_dpbusd(3, 5, 7);                                                      \
    }
/* RA x 16 rows of A (a, lda bytes apart) times CB blocks of 16 channels (w0, w1: their packed weights),
 * each lane starting from 0 (the epilogue adds the start value: a tile zeroed need not wait for the
 * previous block's store, as a tile loaded from memory does; 12-14% on the tile loop in a C
 * microbenchmark of resnet18's layer1 and layer2), the int32 results to tile[r * 64 + c].  K runs over nseg segments
 * segstep bytes apart in A, each of lc whole 64-byte chunks (a panel: one segment; GEMM_SLIDE: the
 * kernel rows), then, when tail, one more chunk after the last segment whose weights are t0, t1 (the
 * zero-padded last chunk). */
#define GEMM_AMX_FN(NAME, RAV, CBV)                                                                      \
    static void NAME(const uint8_t *restrict a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc,    \
                     int tail, const int8_t *w0, const int8_t *w1, const int8_t *t0, const int8_t *t1,    \
                     int32_t *tile) {                                                                     \
        enum { RA = RAV, CB = CBV };                                                                      \
        _tile_zero(0);                                                                                    \
        if (CB > 1) _tile_zero(1);                                                                        \
        if (RA > 1) _tile_zero(2);                                                                        \
        if (RA > 1 && CB > 1) _tile_zero(3);                                                              \
        for (int64_t i = 0; i < nseg; i++)                                                                \
            for (int64_t kc = 0; kc < lc; kc++, w0 += 1024, w1 += 1024) AMX_STEP(i * segstep + 64 * kc, w0, w1) \
        if (tail) AMX_STEP((nseg - 1) * segstep + 64 * lc, t0, t1)                                        \
        _tile_stored(0, tile, 256);                                                                       \
        if (CB > 1) _tile_stored(1, tile + 16, 256);                                                      \
        if (RA > 1) _tile_stored(2, tile + 16 * 64, 256);                                                 \
        if (RA > 1 && CB > 1) _tile_stored(3, tile + 16 * 64 + 16, 256);                                  \
    }
GEMM_AMX_FN(gemm_amx_11, 1, 1)
GEMM_AMX_FN(gemm_amx_12, 1, 2)
GEMM_AMX_FN(gemm_amx_21, 2, 1)
GEMM_AMX_FN(gemm_amx_22, 2, 2)

/* rows x 16 * nr channels (nr <= 4) of the tile, pairs of channel blocks on tdpbusd blocks: A as
 * GEMM_AMX_FN reads it (nseg segments of lc chunks), the blocks' weights Kq groups apart from wp, the
 * last partial chunk's from wt (NULL: none); the lanes start from 0 */
void gemm_amx_tile(const uint8_t *a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc, int64_t rows,
                   int64_t Kq, const int8_t *wp, const int8_t *wt, int nr, int32_t *tile) {
    const int tail = wt != NULL;
    for (int p = 0; p < nr; p += 2) {
        const int8_t *w0 = wp + p * Kq * 64, *w1 = w0 + Kq * 64;
        const int8_t *t0 = tail ? wt + p * 1024 : NULL, *t1 = tail ? t0 + 1024 : NULL;
        if (nr - p >= 2) {
            if (rows > 16) gemm_amx_22(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
            else gemm_amx_12(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
        } else {
            if (rows > 16) gemm_amx_21(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
            else gemm_amx_11(a, lda, nseg, segstep, lc, tail, w0, w1, t0, t1, tile + 16 * p);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else /* a compiler without AMX: gemm_amx_mode() is always 0, so none of these is reached */
const int qc_gemm_amx_built = 0;
int64_t gemm_amx_call_count(void) { return 0; }
void gemm_amx_release(void) {}
void gemm_amx_config(void) {}
void gemm_amx_tile(const uint8_t *a, int64_t lda, int64_t nseg, int64_t segstep, int64_t lc, int64_t rows,
                   int64_t Kq, const int8_t *wp, const int8_t *wt, int nr, int32_t *tile) {
    (void)a, (void)lda, (void)nseg, (void)segstep, (void)lc, (void)rows, (void)Kq, (void)wp, (void)wt, (void)nr;
    (void)tile;
}
#endif

/* The integer requantization every BPU kernel ends with: round half to even, then clamp. */
#ifndef QC_BPU_REQUANT_H
#define QC_BPU_REQUANT_H
#include <stdint.h>

/* round_half_even(x / 2**s) without branches, for the vectorizer: x + (2**(s-1) - 1) + (bit s of x),
 * shifted right by s (floor).  With x = q*2**s + r: r > half carries, r < half does not, r == half
 * carries exactly when q is odd.  s == 0 takes hm1 = 0, pm = 0 (x itself).  hm1[c], pm[c] are
 * precomputed per channel by round_consts(). */
static inline int round_consts(const int64_t *n, int64_t O, int64_t *hm1, int64_t *pm) {
    for (int64_t c = 0; c < O; c++) {
        hm1[c] = n[c] > 0 ? ((int64_t)1 << (n[c] - 1)) - 1 : 0;
        pm[c] = n[c] > 0 ? 1 : 0;
    }
    return 0;
}

/* clamp(round_half_even(x / 2**s), lo, hi), with hm1 = 2**(s-1) - 1 and pm = 1 (0 for s == 0) as
 * round_consts() makes them; inline, so the loops that call it still vectorize. */
static inline int64_t round_clamp(int64_t x, int64_t hm1, int64_t pm, int64_t s, int64_t lo, int64_t hi) {
    int64_t q = (x + hm1 + ((x >> s) & pm)) >> s;
    q = q < lo ? lo : q;
    return q > hi ? hi : q;
}
#endif

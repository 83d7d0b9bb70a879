/* SPDX-License-Identifier: MIT */
/* alibi.c: the ALiBi slopes of Press et al. (arXiv:2108.12409), with BLOOM's interpolation for
 * head counts that are not powers of two. */
#include "base/internal.h"

void mha__alibi_slopes(int64_t h, float *slopes) {
    /* Press et al. (ALiBi): for h a power of two, slope_k = 2^(-8(k+1)/h). Otherwise (BLOOM):
     * the c = 2^floor(log2 h) slopes of c heads, then the first h - c odd-indexed slopes of the
     * 2c-head sequence, 2^(-8(2k+1)/(2c)). */
    int64_t c = 1;
    while (c * 2 <= h)
        c *= 2;
    for (int64_t k = 0; k < c && k < h; k++)
        slopes[k] = (float)pow(2.0, -8.0 * (double)(k + 1) / (double)c);
    for (int64_t k = 0; k < h - c; k++)
        slopes[c + k] = (float)pow(2.0, -8.0 * (double)(2 * k + 1) / (double)(2 * c));
}

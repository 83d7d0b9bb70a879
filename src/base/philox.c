/* SPDX-License-Identifier: MIT */
/* philox.c: the counter-based generator behind dropout (Salmon et al., "Parallel random numbers:
 * as easy as 1, 2, 3", SC'11): Philox4x32 with 10 rounds. A counter-based generator gives every
 * attention element its own random number from its (b, h, i, j) index, so results never depend
 * on the thread count, the blocking or the order of work. */
#include "base/internal.h"

/* Round multipliers and Weyl key increments of Philox4x32 (from the paper). */
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void mha__philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        const uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        const uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* Keep element (b, h, i, j) iff u >= p, u = (word0 >> 8) * 2^-24 uniform on [0, 1) with 24 bits
 * (exactly representable in float, so the comparison has no rounding ambiguity). Indices are
 * below 2^31 (MHA_MAX_DIM), so each fits one counter word. */
int mha__dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j) {
    const uint32_t counter[4] = {(uint32_t)j, (uint32_t)i, (uint32_t)h, (uint32_t)b};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t r[4];
    mha__philox4x32_10(counter, key, r);
    const float u = (float)(r[0] >> 8) * 0x1.0p-24f;
    return u >= p;
}

/* SPDX-License-Identifier: MIT */
/* half_rows.c: the kernels' conversions of half-precision rows (flash_fwd.c and the backward
 * driver widen Q, K, V, O and dO while they pack them, and round their outputs): the best vector
 * form this CPU allows under MHA_MAX_ISA, else the portable loop. Every form gives the portable
 * loop's bits (widening is exact; narrowing rounds to nearest even and NaNs take the portable
 * path), so the choice changes no result. */
#include "kernels/kernels.h"

void mha__widen_rows(mha_dtype dt, const void *src, float *dst, int64_t count) {
#if defined(__x86_64__) || defined(__i386__)
    if (dt != MHA_DTYPE_F32 && (mha__cpu_isa() & MHA_ISA_AVX2)) {
        mha__widen_avx2(dt, src, dst, count);
        return;
    }
#elif defined(__aarch64__)
    if (dt != MHA_DTYPE_F32 && (mha__cpu_isa() & MHA_ISA_NEON)) {
        mha__widen_neon(dt, src, dst, count);
        return;
    }
#endif
    mha__widen(dt, src, dst, count);
}

void mha__narrow_rows(mha_dtype dt, const float *src, void *dst, int64_t count) {
#if defined(__x86_64__) || defined(__i386__)
    if (dt != MHA_DTYPE_F32 && (mha__cpu_isa() & MHA_ISA_AVX2)) {
        mha__narrow_avx2(dt, src, dst, count);
        return;
    }
#elif defined(__aarch64__)
    if (dt != MHA_DTYPE_F32 && (mha__cpu_isa() & MHA_ISA_NEON)) {
        mha__narrow_neon(dt, src, dst, count);
        return;
    }
#endif
    mha__narrow(dt, src, dst, count);
}

/* SPDX-License-Identifier: MIT */
/* half_rows_neon.c: float16 / bfloat16 -> float32 with NEON, 4 values per instruction (FCVTL for
 * float16, USHLL #16 for bfloat16: its bits are the high half of a float32). Exact, as the
 * portable mha__widen, which does the tail. */
#if defined(__aarch64__)
#    include "kernels/kernels.h"

#    include <arm_neon.h>

void mha__widen_neon(mha_dtype dt, const void *src, float *dst, int64_t count) {
    const uint16_t *h = src;
    int64_t i = 0;
    if (dt == MHA_DTYPE_F16)
        for (; i + 4 <= count; i += 4) {
            const uint16x4_t x = vld1_u16(h + i);
            /* FCVTL quiets a signalling NaN; the portable form keeps its bits: a chunk with a NaN
             * ((x & 0x7fff) > 0x7c00) goes the portable way. */
            if (vmaxv_u16(vcgt_u16(vand_u16(x, vdup_n_u16(0x7fff)), vdup_n_u16(0x7c00))))
                mha__widen(dt, h + i, dst + i, 4);
            else
                vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(x)));
        }
    else
        for (; i + 4 <= count; i += 4)
            vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(h + i), 16)));
    mha__widen(dt, h + i, dst + i, count - i);
}

/* float32 -> float16 (FCVTN, round to nearest even) 4 at a time; a chunk holding a NaN, and
 * bfloat16, go the portable way (bit-identical to mha__narrow: FCVTN quiets NaNs its own way). */
void mha__narrow_neon(mha_dtype dt, const float *src, void *dst, int64_t count) {
    uint16_t *h = dst;
    int64_t i = 0;
    if (dt == MHA_DTYPE_F16)
        for (; i + 4 <= count; i += 4) {
            const float32x4_t x = vld1q_f32(src + i);
            if (vminvq_u32(vceqq_f32(x, x)) == 0)
                mha__narrow(dt, src + i, h + i, 4);
            else
                vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(x)));
        }
    mha__narrow(dt, src + i, h + i, count - i);
}
#endif

/* SPDX-License-Identifier: MIT */
/* half_rows_avx2.c: half-precision rows with AVX2 + F16C, 8 values per instruction (kernels/
 * half_rows.c). Widening: VCVTPH2PS for float16, a zero-extension and a 16-bit shift for bfloat16
 * (its bits are the high half of a float32); exact, as the portable mha__widen, which does the
 * tail. Narrowing: below. */
#if defined(__x86_64__) || defined(__i386__)
#    include "kernels/kernels.h"

#    include <immintrin.h>

void mha__widen_avx2(mha_dtype dt, const void *src, float *dst, int64_t count) {
    const uint16_t *h = src;
    int64_t i = 0;
    if (dt == MHA_DTYPE_F16)
        for (; i + 8 <= count; i += 8) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(h + i));
            /* VCVTPH2PS quiets a signalling NaN; the portable form keeps its bits: a chunk with a
             * NaN ((x & 0x7fff) > 0x7c00) goes the portable way. */
            const __m128i a = _mm_and_si128(x, _mm_set1_epi16(0x7fff));
            if (_mm_movemask_epi8(_mm_cmpgt_epi16(a, _mm_set1_epi16(0x7c00))))
                mha__widen(dt, h + i, dst + i, 8);
            else
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(x));
        }
    else
        for (; i + 8 <= count; i += 8) {
            const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
    mha__widen(dt, h + i, dst + i, count - i);
}

/* float32 -> bfloat16, round to nearest even, 8 at a time with the integer form of the portable
 * mha__f32_to_bf16 (u + 0x7fff + ((u >> 16) & 1)) >> 16; a NaN lane takes the portable path's
 * quiet NaN (sign and top payload bits kept, payload made nonzero), so results are bit-identical
 * to mha__narrow. */
static __m128i bf16x8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i payload0 =
        _mm256_cmpeq_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(0x7f)), _mm256_setzero_si256());
    hi = _mm256_or_si256(hi, _mm256_and_si256(payload0, _mm256_set1_epi32(0x40)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, hi, nan);
    /* 32-bit lanes hold 16-bit results: pack (unsigned saturation is exact, r < 2^16). */
    const __m256i packed = _mm256_packus_epi32(r, r);
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
}

void mha__narrow_avx2(mha_dtype dt, const float *src, void *dst, int64_t count) {
    uint16_t *h = dst;
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256 x = _mm256_loadu_ps(src + i);
        if (dt == MHA_DTYPE_BF16) {
            _mm_storeu_si128((__m128i *)(h + i), bf16x8(x));
        } else {
            /* VCVTPS2PH rounds to nearest even like mha__f32_to_f16 but quiets NaNs its own way:
             * a chunk holding a NaN goes the portable way. */
            if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)))
                mha__narrow(dt, src + i, h + i, 8);
            else
                _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    mha__narrow(dt, src + i, h + i, count - i);
}
#endif

/* SPDX-License-Identifier: MIT */
/* decode_floor_avx512.c: the AVX-512 decode kernel's widening and FMAs alone (decode_floor.h),
 * with the kernel's own widening helpers (src/kernels/x86/simd_avx512.h): float32 as loaded,
 * bfloat16 even/odd (v16_bf16_half), q8_0 by v16_q8_widen in pass 1 (the scale multiplied into
 * the key, broadcast from float32 scales in memory as the contiguous path's q8_scales16 leaves
 * them; their conversion is left out) and q8_ints' VPMOVSXBD + VCVTDQ2PS in pass 3 (the scale in
 * the weight), fp8 by v16_fp8_widen_finite in pass 1 and v16_fp8_half in pass 3. */
#include "decode_floor.h"
#include "kernels/x86/simd_avx512.h"

/* elements [c, c + 16) of key row `row` as float32, in the order pass 1 reads them (ks: its
 * q8_0 scales) */
MHA_INLINE v16 key16(const int DT, const char *row, const float *ks, int c) {
    switch (DT) {
    case FLOOR_F32:
        return _mm512_loadu_ps((const float *)row + c);
    case FLOOR_BF16:
        return v16_bf16_half(row, c & ~31, c >> 4 & 1);
    case FLOOR_Q8_0:
        return v16_q8_widen(row, c, v16_set1(ks[c / 32]));
    default:
        return v16_fp8_widen_finite(_mm_loadu_si128((const __m128i *)(row + c)));
    }
}

/* elements [c, c + 16) of value row `row` as pass 3 widens them (q8_0: without the scale) */
MHA_INLINE v16 value16(const int DT, const char *row, int c) {
    switch (DT) {
    case FLOOR_F32:
        return _mm512_loadu_ps((const float *)row + c);
    case FLOOR_BF16:
        return v16_bf16_half(row, c & ~31, c >> 4 & 1);
    case FLOOR_Q8_0: {
        const char *q = row + (c >> 5) * MHA__Q8_BYTES + 2 + (c & 31);
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    }
    default:
        return v16_fp8_half(1, row, c & ~31, c >> 4 & 1);
    }
}

MHA_INLINE float pass1(const int DT, const floor_data *fd, int reps) {
    v16 acc[FLOOR_ROWS][2];
    for (int x = 0; x < FLOOR_ROWS; x++)
        acc[x][0] = acc[x][1] = v16_zero();
    const char *k = fd->k[DT];
    for (int r = 0; r < reps; r++)
        for (int y = 0; y < FLOOR_KEYS; y++) {
            const char *row = k + y * row_bytes(DT);
#pragma GCC unroll 8
            for (int c = 0; c < FLOOR_D; c += 16) {
                const v16 kv = key16(DT, row, fd->ks + 4 * y, c);
#pragma GCC unroll 4
                for (int x = 0; x < FLOOR_ROWS; x++)
                    acc[x][c >> 4 & 1] =
                        v16_fma(_mm512_loadu_ps(fd->q + x * FLOOR_D + c), kv, acc[x][c >> 4 & 1]);
            }
        }
    v16 s = v16_zero();
    for (int x = 0; x < FLOOR_ROWS; x++)
        s = _mm512_add_ps(s, _mm512_add_ps(acc[x][0], acc[x][1]));
    return _mm512_reduce_add_ps(s);
}

MHA_INLINE float pass3(const int DT, const floor_data *fd, int reps) {
    const char *v = fd->k[DT];
    for (int r = 0; r < reps; r++)
        for (int c0 = 0; c0 < FLOOR_D; c0 += 64) {
            v16 acc[FLOOR_ROWS][4];
            for (int x = 0; x < FLOOR_ROWS; x++)
                for (int c = 0; c < 4; c++)
                    acc[x][c] = _mm512_loadu_ps(fd->o + x * FLOOR_D + c0 + 16 * c);
            for (int y = 0; y < FLOOR_KEYS; y++) {
                const char *row = v + y * row_bytes(DT);
                const float *w = fd->w + (y * FLOOR_ROWS) * 4 + c0 / 32;
                v16 vv[4];
                for (int c = 0; c < 4; c++)
                    vv[c] = value16(DT, row, c0 + 16 * c);
#pragma GCC unroll 4
                for (int x = 0; x < FLOOR_ROWS; x++)
                    for (int c = 0; c < 4; c++) /* q8_0: a weight per block (e d), else per key */
                        acc[x][c] = v16_fma(v16_set1(w[4 * x + (DT == FLOOR_Q8_0 ? c >> 1 : 0)]),
                                            vv[c], acc[x][c]);
            }
            for (int x = 0; x < FLOOR_ROWS; x++)
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(fd->o + x * FLOOR_D + c0 + 16 * c, acc[x][c]);
        }
    return fd->o[0];
}

FLOOR_ENTRY_(bench_floor_avx512)

/* SPDX-License-Identifier: MIT */
/* decode_floor_avx2.c: the AVX2 decode kernel's widening and FMAs alone (decode_floor.h), with
 * its widening helpers (src/kernels/x86/simd_avx2.h) as its load16 uses them in both passes:
 * float32 as loaded, bfloat16 even/odd (a shift, an AND), q8_0 by v8_q8_widen (scale included;
 * broadcast from float32 scales in memory, cheaper than the kernel's v8_q8_scale), fp8 by
 * v8_fp8_widen16 (with the NaN fix-up, as the kernel). 8 lanes: pass 3 keeps 4 rows x 32 columns
 * in registers. */
#include "decode_floor.h"
#include "kernels/x86/simd_avx2.h"

/* elements [c, c + 16) of a row as two float32 vectors (bfloat16: even, odd; ks: the row's q8_0
 * scales) */
MHA_INLINE void widen16(const int DT, const char *row, const float *ks, int c, v8 *a, v8 *b) {
    switch (DT) {
    case FLOOR_F32:
        *a = _mm256_loadu_ps((const float *)row + c);
        *b = _mm256_loadu_ps((const float *)row + c + 8);
        return;
    case FLOOR_BF16: {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c));
        *a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
        return;
    }
    case FLOOR_Q8_0: {
        const v8 s = _mm256_broadcast_ss(ks + c / 32);
        *a = v8_q8_widen(row, c, s);
        *b = v8_q8_widen(row, c + 8, s);
        return;
    }
    default:
        v8_fp8_widen16(row + c, a, b);
    }
}

MHA_INLINE float pass1(const int DT, const floor_data *fd, int reps) {
    v8 acc[FLOOR_ROWS][2];
    for (int x = 0; x < FLOOR_ROWS; x++)
        acc[x][0] = acc[x][1] = _mm256_setzero_ps();
    const char *k = fd->k[DT];
    for (int r = 0; r < reps; r++)
        for (int y = 0; y < FLOOR_KEYS; y++) {
            const char *row = k + y * row_bytes(DT);
#pragma GCC unroll 8
            for (int c = 0; c < FLOOR_D; c += 16) {
                v8 ka, kb;
                widen16(DT, row, fd->ks + 4 * y, c, &ka, &kb);
#pragma GCC unroll 4
                for (int x = 0; x < FLOOR_ROWS; x++) {
                    const float *q = fd->q + x * FLOOR_D + c;
                    acc[x][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q), ka, acc[x][0]);
                    acc[x][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), kb, acc[x][1]);
                }
            }
        }
    v8 s = _mm256_setzero_ps();
    for (int x = 0; x < FLOOR_ROWS; x++)
        s = _mm256_add_ps(s, _mm256_add_ps(acc[x][0], acc[x][1]));
    float t[8];
    _mm256_storeu_ps(t, s);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

MHA_INLINE float pass3(const int DT, const floor_data *fd, int reps) {
    const char *v = fd->k[DT];
    for (int r = 0; r < reps; r++)
        for (int c0 = 0; c0 < FLOOR_D; c0 += 32) {
            v8 acc[FLOOR_ROWS][4];
            for (int x = 0; x < FLOOR_ROWS; x++)
                for (int c = 0; c < 4; c++)
                    acc[x][c] = _mm256_loadu_ps(fd->o + x * FLOOR_D + c0 + 8 * c);
            for (int y = 0; y < FLOOR_KEYS; y++) {
                const char *row = v + y * row_bytes(DT);
                const float *w = fd->w + (y * FLOOR_ROWS) * 4;
                v8 vv[4];
                widen16(DT, row, fd->ks + 4 * y, c0, &vv[0], &vv[1]);
                widen16(DT, row, fd->ks + 4 * y, c0 + 16, &vv[2], &vv[3]);
#pragma GCC unroll 4
                for (int x = 0; x < FLOOR_ROWS; x++) {
                    const v8 e = _mm256_broadcast_ss(w + 4 * x);
                    for (int c = 0; c < 4; c++)
                        acc[x][c] = _mm256_fmadd_ps(e, vv[c], acc[x][c]);
                }
            }
            for (int x = 0; x < FLOOR_ROWS; x++)
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_ps(fd->o + x * FLOOR_D + c0 + 8 * c, acc[x][c]);
        }
    return fd->o[0];
}

FLOOR_ENTRY_(bench_floor_avx2)

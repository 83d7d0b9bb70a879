/* SPDX-License-Identifier: MIT */
/* gemm_neon.c: AArch64 Advanced SIMD (NEON) micro-kernel of the projection GEMM (compiled only
 * for aarch64, where NEON is baseline; selected through MHA_ISA_NEON in the registry).
 *
 * Tile 8 x 12: 24 accumulators (8 rows x 3 vectors of 4 columns), 2 registers for the 8 packed x
 * values of the current k and 3 for the packed W row: 29 of the 32 vector registers. The by-element
 * FMLA (v4_fma_lane: acc += b * a[lane]) takes the x value from a lane of a loaded vector, so no
 * register and no instruction is spent on broadcasts (the x86 kernels need one per row). Per k:
 * 5 vector loads for 24 FMLAs.
 * Why 8 x 12: the largest tile whose accumulators plus operands fit in 32 registers with the
 * by-element form (8 x 16 needs 32 accumulators; 4 x 16 loads 1.8x as much per FMA). 12 x 8 has
 * the same counts; 8 rows waste less on short calls (prompts of 5-16 tokens: M just above the dot
 * path), and a 12-column panel wastes 4 columns once per W row block (0.4% at N = 1024). What
 * limits it, by design (not measured: the aarch64 build runs under emulation here):
 *   Neoverse N1 / Cortex-A76: 2 x 128-bit FMA pipes of 4-cycle latency need >= 8 chains (24 here);
 *     24 FMLAs take 12 cycles against 5 loads on 2 load pipes: FMA-bound, the peak is within reach.
 *   Neoverse V1 / V2, Apple M1-M3: 4 x 128-bit FMA pipes need >= 16 chains (24 here); 24 FMLAs
 *     take 6 cycles against 5 loads on 3 load pipes (2 cycles): still FMA-bound.
 * Blocking: the 8 x KC micro-panel of x (8 x 256 x 4 B = 8 KiB) stays in L1 (64 KiB on N1 / V1,
 * 128 KiB on Apple); a KC x NC block of packed W (256 x 480 x 4 B = 480 KiB) in the 1 MiB L2 of
 * N1 (Graviton2, Altra) and V1 (Graviton3), leaving half of it to the x panels, C and the other
 * streams. Each element of C is one FMA chain in increasing k per K block, and blocks are added
 * in order: bit-identical for any thread count.
 */
#if defined(__aarch64__)

#    include "kernels/arm/simd_neon.h"
#    include "kernels/registry.h"

#    include <string.h>

#    define MR 8
#    define NV 3 /* vectors of 4 floats per tile row */
#    define NR (4 * NV)

/* acc[row][0..3) += b[0..3) * a[lane] for one row of the tile; the lane is a literal (the
 * by-element FMLA takes an immediate, also at -O0). */
#    define ROW_FMA(row, av, lane)                                                                 \
        do {                                                                                       \
            acc[row][0] = v4_fma_lane(b0, av, lane, acc[row][0]);                                  \
            acc[row][1] = v4_fma_lane(b1, av, lane, acc[row][1]);                                  \
            acc[row][2] = v4_fma_lane(b2, av, lane, acc[row][2]);                                  \
        } while (0)

static void ukr_8x12(int64_t kc,
                     const float *ap,
                     const float *bp,
                     float *c,
                     int64_t ldc,
                     int m,
                     int n,
                     const float *bias,
                     int first) {
    v4 acc[MR][NV];
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            acc[i][j] = v4_zero();
    }
    if (!first)
        for (int i = 0; i < m; i++)
            __builtin_prefetch(c + i * ldc, 0, 3);
    for (int64_t k = 0; k < kc; k++) {
        const v4 a0 = v4_load(ap), a1 = v4_load(ap + 4);
        const v4 b0 = v4_load(bp), b1 = v4_load(bp + 4), b2 = v4_load(bp + 8);
        ROW_FMA(0, a0, 0);
        ROW_FMA(1, a0, 1);
        ROW_FMA(2, a0, 2);
        ROW_FMA(3, a0, 3);
        ROW_FMA(4, a1, 0);
        ROW_FMA(5, a1, 1);
        ROW_FMA(6, a1, 2);
        ROW_FMA(7, a1, 3);
        ap += MR;
        bp += NR;
    }
    if (m == MR && n == NR) {
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            MHA_UNROLL
            for (int j = 0; j < NV; j++) {
                float *cp = c + i * ldc + 4 * j;
                v4 v = acc[i][j];
                if (!first)
                    v = v4_add(v4_loadu(cp), v);
                else if (bias)
                    v = v4_add(v, v4_loadu(bias + 4 * j));
                v4_store(cp, v);
            }
        }
        return;
    }
    /* Edge tile: the same sums (one float addition each, as above), stored lane by lane through a
     * buffer; only rows < m and columns < n of C and bias are touched. */
    float t[MR][NR];
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            v4_store(&t[i][4 * j], acc[i][j]);
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float *cp = c + i * ldc + j;
            if (!first)
                *cp = *cp + t[i][j];
            else
                *cp = bias ? t[i][j] + bias[j] : t[i][j];
        }
}

#    undef ROW_FMA

/* dst[k][j] = src[j][k] for j < n, 0 for n <= j < width (a multiple of 4); k < kc. Both the W
 * panels (width NR) and the x micro-panels (width MR) are such transposes; in 4 x 4 blocks it is
 * 4 loads, 8 permutes and 4 stores per 16 floats instead of 16 scalar moves (the x86 kernels
 * measured the scalar packing of x at ~10% of a GEMM, as it is redone for every NC block). */
static void pack_rows(const float *src, int64_t ld, int n, int64_t kc, float *dst, int width) {
    const int64_t kc4 = kc & ~(int64_t)3;
    for (int j = 0; j < width; j += 4) {
        const int rows = n - j < 0 ? 0 : (n - j < 4 ? n - j : 4);
        const float *s = src + (int64_t)j * ld;
        for (int64_t k = 0; k < kc4; k += 4) {
            v4 r[4];
            for (int i = 0; i < 4; i++)
                r[i] = i < rows ? v4_loadu(s + i * ld + k) : v4_zero();
            v4_transpose4(r);
            for (int i = 0; i < 4; i++)
                v4_store(dst + (k + i) * width + j, r[i]);
        }
        for (int64_t k = kc4; k < kc; k++)
            for (int i = 0; i < 4; i++)
                dst[k * width + j + i] = i < rows ? s[i * ld + k] : 0.0f;
    }
}

static void pack_b_12(const float *w, int64_t ldw, int n, int64_t kc, float *dst) {
    pack_rows(w, ldw, n, kc, dst, NR);
}

static void pack_a_8(const float *x, int64_t ldx, int m, int64_t kc, float *dst) {
    pack_rows(x, ldx, m, kc, dst, MR);
}

/* Four W values of storage wdt (F32, or bf16 / f16 widened exactly in registers: USHLL #16 /
 * FCVTL), the first `left` of them (1..4) when left < 4, the rest zero. */
MHA_INLINE v4 load_w4(const void *w, int64_t k, const mha_dtype wdt, int left) {
    if (wdt == MHA_DTYPE_F32)
        return left >= 4 ? v4_loadu((const float *)w + k)
                         : v4_loadu_first((const float *)w + k, left);
    uint16_t t[4] = {0, 0, 0, 0};
    const uint16_t *h = (const uint16_t *)w + k;
    uint16x4_t x;
    if (left >= 4) {
        x = vld1_u16(h);
    } else {
        memcpy(t, h, sizeof(uint16_t) * (size_t)left);
        x = vld1_u16(t);
    }
    return wdt == MHA_DTYPE_BF16 ? vreinterpretq_f32_u32(vshll_n_u16(x, 16))
                                 : vcvt_f32_f16(vreinterpret_f16_u16(x));
}

/* 8 q8_0 values (int8) widened exactly to two float32 vectors, times the block's scale d (exact:
 * 8 bits times 11 fit float32's 24). */
MHA_INLINE void load_q8x8(const int8_t *q, v4 d, v4 *lo, v4 *hi) {
    const int16x8_t h = vmovl_s8(vld1_s8(q));
    *lo = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), d);
    *hi = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(h))), d);
}

/* Values k .. k+7 (k mod 32 in {0, 8, 16, 24}) of the q4_0 block whose 16 nibble bytes are at q:
 * the int8 q - 8 (the values of the q8_0 block with the same scale), widened as load_q8x8. Low
 * nibbles of bytes k .. k+7 below 16, high nibbles of bytes k-16 .. k-9 from 16. */
MHA_INLINE void load_q4x8(const uint8_t *q, int64_t k, v4 d, v4 *lo, v4 *hi) {
    uint8x8_t b = vld1_u8(q + k % 16);
    b = k % MHA__Q8_BLOCK >= 16 ? vshr_n_u8(b, 4) : vand_u8(b, vdup_n_u8(15));
    const int8x8_t s = vsub_s8(vreinterpret_s8_u8(b), vdup_n_s8(8));
    const int16x8_t h = vmovl_s8(s);
    *lo = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), d);
    *hi = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(h))), d);
}

/* Dot path (few rows): m x n (<= 2 x 4) dot products, 4 lanes each, 2 accumulators per dot (k in
 * steps of 8): 16 independent FMA chains, enough for 4 pipes of 4-cycle latency; 16 accumulators,
 * 4 x values and 2 W values live at a time (22 registers). The K tail (K % 4) is loaded into
 * zero-filled vectors. Memory-bound on W, as a matrix-vector product is. Sums: lanes of the two
 * accumulators added, then pairwise across lanes, in a fixed order. W is float32 or, for the
 * decode step with half or q8_0 weights (dot_h, dot_q8), bf16 / f16 widened in registers or q8_0
 * (or q4_0) blocks dequantised in registers (K a multiple of 32; each block's scale read once, at
 * its first step): the same chains, so the result is the float32 dot's on the widened W, bit for
 * bit. wdt is a constant at each caller; ldw counts W's elements (q8_0, q4_0: bytes). */
MHA_INLINE void dot_body(int64_t K,
                         const float *x,
                         int64_t ldx,
                         int m,
                         const void *w,
                         const mha_dtype wdt,
                         int64_t ldw,
                         int n,
                         const float *bias,
                         float *y,
                         int64_t ldy) {
    v4 acc0[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N], acc1[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            acc0[i][j] = acc1[i][j] = v4_zero();
    }
    /* Rows / columns beyond m / n re-read row 0 / column 0 (valid memory) and are not stored. */
    const int blocks = wdt == MHA_DTYPE_Q8_0 || wdt == MHA_DTYPE_Q4_0;
    const size_t wsize = wdt == MHA_DTYPE_F32 ? sizeof(float) : blocks ? 1 : sizeof(uint16_t);
    const float *xr[MHA_GEMM_DOT_M];
    const void *wr[MHA_GEMM_DOT_N];
    for (int i = 0; i < MHA_GEMM_DOT_M; i++)
        xr[i] = x + (i < m ? i : 0) * ldx;
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        wr[j] = (const char *)w + (size_t)((j < n ? j : 0) * ldw) * wsize;
    v4 d[MHA_GEMM_DOT_N]; /* blocks: the current block's scale per W row */
    MHA_UNROLL
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        d[j] = v4_zero();
    int64_t k = 0, blk = 0; /* blk: blocks, the byte offset of the current block in a row */
    for (; k + 8 <= K; k += 8) {
        v4 a0[MHA_GEMM_DOT_M], a1[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
            a0[i] = v4_loadu(xr[i] + k);
            a1[i] = v4_loadu(xr[i] + k + 4);
        }
        if (blocks && k % MHA__Q8_BLOCK == 0) { /* a new block: its scales */
            blk = k / MHA__Q8_BLOCK * (wdt == MHA_DTYPE_Q4_0 ? MHA__Q4_BYTES : MHA__Q8_BYTES);
            MHA_UNROLL
            for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
                uint16_t dh;
                memcpy(&dh, (const unsigned char *)wr[j] + blk, 2);
                d[j] = vdupq_n_f32(
                    vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(dh))), 0));
            }
        }
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            v4 b0, b1;
            if (wdt == MHA_DTYPE_Q4_0) {
                load_q4x8((const uint8_t *)wr[j] + blk + 2, k, d[j], &b0, &b1);
            } else if (wdt == MHA_DTYPE_Q8_0) {
                load_q8x8((const int8_t *)wr[j] + blk + 2 + k % MHA__Q8_BLOCK, d[j], &b0, &b1);
            } else {
                b0 = load_w4(wr[j], k, wdt, 4);
                b1 = load_w4(wr[j], k + 4, wdt, 4);
            }
            MHA_UNROLL
            for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
                acc0[i][j] = v4_fma(a0[i], b0, acc0[i][j]);
                acc1[i][j] = v4_fma(a1[i], b1, acc1[i][j]);
            }
        }
    }
    for (; !blocks && k < K; k += 4) { /* the K tail (blocks: none) */
        const int left = K - k >= 4 ? 4 : (int)(K - k);
        v4 a0[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < MHA_GEMM_DOT_M; i++)
            a0[i] = v4_loadu_first(xr[i] + k, left);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const v4 b0 = load_w4(wr[j], k, wdt, left);
            MHA_UNROLL
            for (int i = 0; i < MHA_GEMM_DOT_M; i++)
                acc0[i][j] = v4_fma(a0[i], b0, acc0[i][j]);
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float s = v4_hsum(v4_add(acc0[i][j], acc1[i][j]));
            y[i * ldy + j] = bias ? s + bias[j] : s;
        }
}

static void dot_neon(int64_t K,
                     const float *x,
                     int64_t ldx,
                     int m,
                     const float *w,
                     int64_t ldw,
                     int n,
                     const float *bias,
                     float *y,
                     int64_t ldy) {
    dot_body(K, x, ldx, m, w, MHA_DTYPE_F32, ldw, n, bias, y, ldy);
}

static void dot_h_neon(int64_t K,
                       const float *x,
                       int64_t ldx,
                       int m,
                       const uint16_t *w,
                       int bf16,
                       int64_t ldw,
                       int n,
                       const float *bias,
                       float *y,
                       int64_t ldy) {
    if (bf16)
        dot_body(K, x, ldx, m, w, MHA_DTYPE_BF16, ldw, n, bias, y, ldy);
    else
        dot_body(K, x, ldx, m, w, MHA_DTYPE_F16, ldw, n, bias, y, ldy);
}

/* dot_neon over q8_0 W (mha__gemm_dot_q8_fn): dot_body's lanes and chains (acc0 adds k mod 8 in
 * [0, 4), acc1 [4, 8), in increasing k), each block dequantised in registers: bit-identical to the
 * float32 dot over the dequantised rows. */
static void dot_q8_neon(int64_t K,
                        const float *x,
                        int64_t ldx,
                        int m,
                        const void *w,
                        int64_t ldw_bytes,
                        int n,
                        const float *bias,
                        float *y,
                        int64_t ldy) {
    dot_body(K, x, ldx, m, w, MHA_DTYPE_Q8_0, ldw_bytes, n, bias, y, ldy);
}

/* dot_q8_neon over q4_0 W: the same chains over the values (q - 8) d. */
static void dot_q4_neon(int64_t K,
                        const float *x,
                        int64_t ldx,
                        int m,
                        const void *w,
                        int64_t ldw_bytes,
                        int n,
                        const float *bias,
                        float *y,
                        int64_t ldy) {
    dot_body(K, x, ldx, m, w, MHA_DTYPE_Q4_0, ldw_bytes, n, bias, y, ldy);
}

/* MR and NR are also this kernel's registry line (p1, p2; tests/test_gemm.c checks them). */
const mha__gemm_kernel mha_gemm_f32_8x12__neon = {
    MR,          NR,          256,      480,        ukr_8x12,
    pack_b_12,   dot_neon,    pack_a_8, dot_h_neon, NULL, /* pack_pairs: not a bf16 pair kernel */
    dot_q8_neon, dot_q4_neon,
};

#endif

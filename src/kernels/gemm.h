/* SPDX-License-Identifier: MIT */
/* gemm.h: the library's packed single-precision GEMM for the projections (internal).
 *
 *   y[M, N] = x[M, K] W[N, K]^T (+ bias[N])      x, y row-major; W in nn.Linear layout
 *
 * BLIS-style: W is packed once per call into K-blocks of NR-column panels, x into MR-row
 * micro-panels; a register-blocked micro-kernel per ISA (AVX-512, AVX2+FMA, portable C) does the
 * FMAs. Threads split rows (or, for few rows, column panels) and never the K dimension, and the
 * K blocking does not depend on the thread count, so the result is bit-identical for any number
 * of threads. Different ISAs may round differently (the portable kernel does not fuse mul+add).
 * Calls with at most MHA_GEMM_SMALL_M rows (decoding) skip packing and run dot products.
 */
#ifndef MHA_GEMM_H
#define MHA_GEMM_H

#include "base/internal.h"

/* Full unrolling of the micro-kernels' short fixed-trip loops, so that the accumulator arrays
 * live in registers at -O2 too (gcc 12 -O2 otherwise keeps them on the stack: 8x slower). */
#if defined(__clang__)
#    define MHA_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#    define MHA_UNROLL _Pragma("GCC unroll 16")
#else
#    define MHA_UNROLL
#endif

/* A GEMM tier is a gemm line of the kernel registry (kernels/registry.def, whose p1, p2 are the
 * kernel's MR, NR); MHA__GEMM_AUTO picks the best one this CPU runs under MHA_MAX_ISA. */
typedef const struct mha__kernel_info *mha__gemm_isa;
#define MHA__GEMM_AUTO ((mha__gemm_isa)NULL)

/* Micro-kernel: C[0:m, 0:n] (row stride ldc) gets the MR x NR tile product of an MR x kc packed
 * micro-panel `ap` (layout [kc][MR]) and a kc x NR packed panel `bp` (layout [kc][NR]), computed
 * as one FMA (or mul+add) chain per element in increasing k:
 *   first != 0: C = AB (+ bias[0:n] when bias != NULL)
 *   first == 0: C = C + AB
 * Only rows < m and columns < n are read or written (m <= MR, n <= NR); the panels are
 * zero-padded, so edge tiles compute exactly the same chains as full ones. */
typedef void (*mha__gemm_ukr_fn)(int64_t kc,
                                 const float *ap,
                                 const float *bp,
                                 float *c,
                                 int64_t ldc,
                                 int m,
                                 int n,
                                 const float *bias,
                                 int first);
/* Packs W rows [0, n) (n <= NR, row stride ldw), columns [0, kc) into dst [kc][NR], zero-padding
 * columns n .. NR-1 of every row of dst. */
typedef void (*mha__gemm_pack_b_fn)(const float *w, int64_t ldw, int n, int64_t kc, float *dst);

/* Few-rows path (decoding: one or a few tokens), no packing: y[0:m, 0:n] = x[0:m] W[0:n]^T (+
 * bias) as m x n dot products of length K, each over vector lanes then reduced, m <= 2, n <= 4.
 * Packing W would triple the memory traffic of what is a matrix-vector product. */
#define MHA_GEMM_DOT_M 2
#define MHA_GEMM_DOT_N 4
typedef void (*mha__gemm_dot_fn)(int64_t K,
                                 const float *x,
                                 int64_t ldx,
                                 int m,
                                 const float *w,
                                 int64_t ldw,
                                 int n,
                                 const float *bias,
                                 float *y,
                                 int64_t ldy);

/* The few-rows path with W stored as halves (the decode step with bf16/f16 weights: reading half
 * the bytes of a bandwidth-bound matrix-vector product): the same m x n dot products, each W
 * element widened exactly in registers (bf16: a 16-bit shift; f16: the hardware conversion where
 * the tier has one) before its FMA. bf16 != 0: W is bfloat16, else float16. */
typedef void (*mha__gemm_dot_h_fn)(int64_t K,
                                   const float *x,
                                   int64_t ldx,
                                   int m,
                                   const uint16_t *w,
                                   int bf16,
                                   int64_t ldw,
                                   int n,
                                   const float *bias,
                                   float *y,
                                   int64_t ldy);

/* The few-rows path with W stored as q8_0 rows (mha_config.weight_dtype = MHA_DTYPE_Q8_0): the
 * same m x n dot products over K (a multiple of 32) values, W row j at w + j * ldw_bytes (K / 32
 * blocks of 34 bytes: an f16 scale d, 32 int8 q). Either each element dequantised in registers to
 * the float32 q * d (exact) before its FMA, in the tier's dot chains: the result is bit-identical
 * to the tier's float32 dot over the dequantised rows; or, for a kernel where
 * mha__gemm_dot_q8_block_sums is nonzero, each block's products x q summed before one FMA by the
 * block's d, in the order docs/SEMANTICS.md "q8_0 weights" states (AVX2: fewer instructions per
 * weight). */
typedef void (*mha__gemm_dot_q8_fn)(int64_t K,
                                    const float *x,
                                    int64_t ldx,
                                    int m,
                                    const void *w,
                                    int64_t ldw_bytes,
                                    int n,
                                    const float *bias,
                                    float *y,
                                    int64_t ldy);

/* Packs rows [0, n) (n <= width, row stride ld elements) of a row-major bf16 operand, columns
 * [0, kc), into dst as [ceil(kc/2)][width] 32-bit slots, each the bf16 pair (k even in the low
 * half, k odd in the high half; an odd kc's last pair has a zero high half), rows n .. width-1
 * zero. Both the W panels (width NR) and the x micro-panels (width MR) of a pair kernel. */
typedef void (*mha__gemm_pack_pairs_fn)(
    const uint16_t *src, int64_t ld, int n, int64_t kc, float *dst, int width);

typedef struct mha__gemm_kernel {
    int mr, nr;
    int64_t kc; /* K block: keeps an MR x kc micro-panel of x in L1 (see the kernel file) */
    int64_t nc; /* columns per block: keeps a kc x nc block of packed W in L2 */
    mha__gemm_ukr_fn ukr;
    mha__gemm_pack_b_fn pack_b;
    mha__gemm_dot_fn dot; /* the few-rows path (M <= MHA_GEMM_SMALL_M) */
    /* Packs x rows [0, m) (m <= MR, row stride ldx), columns [0, kc) into dst [kc][MR], rows m ..
     * MR-1 zero. */
    mha__gemm_pack_b_fn pack_a;
    /* The few-rows path over half W; NULL = the portable mha__gemm_dot_h_ref. */
    mha__gemm_dot_h_fn dot_h;
    /* Non-NULL: a pair kernel (bf16 x and bf16 W, vdpbf16ps): both operands are packed by this
     * function into bf16-pair panels (a K block of kc k then takes ceil(kc/2) panel rows; kc is
     * even), ukr reads the 32-bit slots of ap and bp as pairs, and pack_b, pack_a, dot, dot_h are
     * NULL. Row-major operands only (no MHA__GEMM_X_T / W_T), no pre-packed W. */
    mha__gemm_pack_pairs_fn pack_pairs;
    /* The few-rows path over q8_0 W; NULL = the portable mha__gemm_dot_q8_ref (NULL too for a
     * pair kernel, which q8_0 W never reaches). */
    mha__gemm_dot_q8_fn dot_q8;
    /* The few-rows path over q4_0 W (same signature, 18-byte blocks); NULL = the portable
     * mha__gemm_dot_q4_ref. Its result must be dot_q8's bits on the q8_0 blocks holding the same
     * values (d, q - 8): docs/SEMANTICS.md "q4_0 weights". */
    mha__gemm_dot_q8_fn dot_q4;
} mha__gemm_kernel;

/* Nonzero when kr's dot_q8 scales each block's partial sums (docs/SEMANTICS.md "q8_0 weights":
 * the block-sum order, the AVX2 tier), so that its results are not the float32 dot's bits over
 * the dequantised W. */
int mha__gemm_dot_q8_block_sums(const mha__gemm_kernel *kr);

/* Calls with at most this many rows take the dot path (measured: see gemm.c). */
#define MHA_GEMM_SMALL_M 4

/* y = x W^T (+ bias). x: [M, K] with row stride ldx; w: [N, K] row stride ldw; y: [M, N] row
 * stride ldy; bias: [N] or NULL. y must not overlap x, w or bias. Any M, N, K >= 0 (K = 0 gives
 * y = bias or 0). `isa` picks a tier (MHA__GEMM_AUTO = best usable); a tier the CPU cannot run
 * is refused with MHA_STATUS_UNSUPPORTED. Packing buffers come from `alloc` (NULL = malloc). */
mha_status mha__gemm_xwt(int64_t M,
                         int64_t N,
                         int64_t K,
                         const float *x,
                         int64_t ldx,
                         const float *w,
                         int64_t ldw,
                         const float *bias,
                         float *y,
                         int64_t ldy,
                         mha__team team,
                         mha__gemm_isa isa,
                         const mha_allocator *alloc,
                         mha_error *err);

/* Bytes of packing buffer mha__gemm_xwt_ws needs for this call (0 when nothing is packed):
 * the packed copy of W. It does not depend on M or on the thread count. */
mha_status mha__gemm_workspace_size(
    mha__gemm_isa isa, int64_t M, int64_t N, int64_t K, size_t *bytes, mha_error *err);
/* mha__gemm_workspace_size for an x stored in xdt (a half x on the few-rows path: its rows
 * widened, M K floats). */
mha_status mha__gemm_workspace_size_dt(mha__gemm_isa isa,
                                       int64_t M,
                                       int64_t N,
                                       int64_t K,
                                       mha_dtype xdt,
                                       size_t *bytes,
                                       mha_error *err);
/* mha__gemm_xwt with a caller-provided packing buffer (any alignment) of workspace_bytes >=
 * mha__gemm_workspace_size() for the same isa and sizes; NULL = allocate from `alloc`. */
mha_status mha__gemm_xwt_ws(int64_t M,
                            int64_t N,
                            int64_t K,
                            const float *x,
                            int64_t ldx,
                            const float *w,
                            int64_t ldw,
                            const float *bias,
                            float *y,
                            int64_t ldy,
                            mha__team team,
                            mha__gemm_isa isa,
                            void *workspace,
                            size_t workspace_bytes,
                            const mha_allocator *alloc,
                            mha_error *err);

/* W packed once for many calls (constant weights): the packing step of every call is skipped
 * and the call allocates nothing. `data` points into the caller's buffer. */
typedef struct mha__gemm_packed_w {
    const mha__gemm_kernel *kr;
    int64_t N, K;
    const float *data;
} mha__gemm_packed_w;
/* Buffer bytes (any alignment) for packing an N x K W for tier isa. */
mha_status
mha__gemm_pack_w_size(mha__gemm_isa isa, int64_t N, int64_t K, size_t *bytes, mha_error *err);
/* Packs w [N, K] (row stride ldw) into buffer and describes it in *out. */
mha_status mha__gemm_pack_w(mha__gemm_isa isa,
                            int64_t N,
                            int64_t K,
                            const float *w,
                            int64_t ldw,
                            void *buffer,
                            size_t bytes,
                            mha__team team,
                            mha__gemm_packed_w *out,
                            mha_error *err);
/* y[M, N] = x[M, K] W^T (+ bias) with a pre-packed W: bit-identical to mha__gemm_xwt on the
 * same tier. */
mha_status mha__gemm_xwt_packed(int64_t M,
                                const float *x,
                                int64_t ldx,
                                const mha__gemm_packed_w *pw,
                                const float *bias,
                                float *y,
                                int64_t ldy,
                                mha__team team,
                                mha_error *err);

/* Operand layouts for mha__gemm_op_run: y = op(x) op(W)^T with
 *   x:  [M, K] row stride ldx, or with MHA__GEMM_X_T stored transposed [K, M] (row stride ldx);
 *   W:  [N, K] row stride ldw, or with MHA__GEMM_W_T stored transposed [K, N] (row stride ldw).
 * The backward's products dx = dP W (W_T) and dW = dP^T x (X_T | W_T) then read their operands
 * in place: packing copies contiguous runs instead of transposing, and no transposed copy of an
 * activation is made. The sums are the same chains in the same order as the plain layout. */
typedef enum mha__gemm_op {
    MHA__GEMM_OP_N = 0,
    MHA__GEMM_X_T = 1,
    MHA__GEMM_W_T = 2,
} mha__gemm_op;
/* y[M, N] = op(x) op(W)^T, no bias, packing buffer from `alloc`; no few-rows dot path for
 * transposed operands (the packed path handles any M). */
mha_status mha__gemm_op_run(mha__gemm_op op,
                            int64_t M,
                            int64_t N,
                            int64_t K,
                            const float *x,
                            int64_t ldx,
                            const float *w,
                            int64_t ldw,
                            float *y,
                            int64_t ldy,
                            mha__team team,
                            mha__gemm_isa isa,
                            const mha_allocator *alloc,
                            mha_error *err);

/* Half-precision operands (docs/SEMANTICS.md "Half precision"). y = op(x) op(W)^T (+ bias) as
 * mha__gemm_op_run / mha__gemm_xwt_ws, with x stored in xdt and W in wdt (each F32, BF16 or F16;
 * strides in elements). The arithmetic is the float32 GEMM's: halves are widened exactly while
 * they are PACKED into the float32 panels (the micro-kernels are unchanged), so the result is
 * bit-identical to the float32 GEMM on the widened operands. The few-rows path reads half W in
 * place (kernel dot_h, widening in registers) and a half x through a widened copy of its <=
 * MHA_GEMM_SMALL_M rows (in the workspace: M K floats, mha__gemm_workspace_size_dt).
 * bias and y are float32. With xdt = wdt = F32 this is exactly the float32 call.
 * wdt may also be Q8_0 (op MHA__GEMM_OP_N only, K a multiple of 32, ldw = K: contiguous q8_0
 * rows): the rows are dequantised while packed (kernel kc a multiple of 32) and the few-rows path
 * reads them in place (kernel dot_q8); again bit-identical to the float32 GEMM on the dequantised
 * W. Q4_0 likewise (kernel dot_q4: the bits of dot_q8 on the same values). */
mha_status mha__gemm_run_dt(mha__gemm_op op,
                            int64_t M,
                            int64_t N,
                            int64_t K,
                            const void *x,
                            mha_dtype xdt,
                            int64_t ldx,
                            const void *w,
                            mha_dtype wdt,
                            int64_t ldw,
                            const float *bias,
                            float *y,
                            int64_t ldy,
                            mha__team team,
                            mha__gemm_isa isa,
                            void *workspace,
                            size_t workspace_bytes,
                            const mha_allocator *alloc,
                            mha_error *err);

/* Portable few-rows path over q8_0 W (the generic tier's dot_q8, and every tier's without one):
 * the chains of mha__gemm_dot_h_ref (8 partial sums per dot, k mod 8). */
void mha__gemm_dot_q8_ref(int64_t K,
                          const float *x,
                          int64_t ldx,
                          int m,
                          const void *w,
                          int64_t ldw_bytes,
                          int n,
                          const float *bias,
                          float *y,
                          int64_t ldy);

/* Portable few-rows path over q4_0 W: mha__gemm_dot_q8_ref's chains over the values (q - 8) d. */
void mha__gemm_dot_q4_ref(int64_t K,
                          const float *x,
                          int64_t ldx,
                          int m,
                          const void *w,
                          int64_t ldw_bytes,
                          int n,
                          const float *bias,
                          float *y,
                          int64_t ldy);

/* Portable few-rows path over half W (the generic tier's dot_h, and every tier's without one):
 * the chains of the generic dot (8 partial sums per dot, k mod 8). */
void mha__gemm_dot_h_ref(int64_t K,
                         const float *x,
                         int64_t ldx,
                         int m,
                         const uint16_t *w,
                         int bf16,
                         int64_t ldw,
                         int n,
                         const float *bias,
                         float *y,
                         int64_t ldy);

/* Portable packer of rows [0, n) of any operand (W panels, NR; x micro-panels, MR) into
 * [kc][nr], rows n .. nr-1 zero: the generic tier's pack_b and pack_a. */
void mha__gemm_pack_b_ref(const float *w, int64_t ldw, int n, int64_t kc, float *dst, int nr);

#endif /* MHA_GEMM_H */

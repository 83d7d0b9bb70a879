/* SPDX-License-Identifier: MIT */
/* gemm.c: driver of the packed projection GEMM  y[M, N] = x[M, K] W[N, K]^T (+ bias).
 *
 * Loop nest (BLIS, with the roles of the operands chosen for a row-major y and nn.Linear W):
 *   phase 1 (threads split the NR-column panels):
 *     pack all of W: for every K block of KC columns, ceil(N/NR) panels [kc][NR], zero-padded
 *   phase 2 (threads split the MR-row tiles of y, or the panels when there are few rows):
 *     for each K block (k0, kc)                       in increasing k: blocks are added in order
 *       for each block of NC columns (L2-resident packed W)
 *         for each MR-row tile: pack x[rows, k0:k0+kc] as [kc][MR] (L1-resident)
 *           for each NR panel of the block: micro-kernel (first block writes AB + bias)
 * Every element of y is the same sequence of operations whatever the thread count and whatever
 * tile it falls in (edge tiles are zero-padded, not special-cased), hence bit-identical results.
 * Packing W costs K*N copies against 2*M*N*K flops; see docs/performance.md for the measured
 * split and the comparison with OpenBLAS. With at most MHA_GEMM_SMALL_M rows (decoding one or a
 * few tokens) nothing is packed: each output is a dot product read straight from x and W, since
 * packing would triple the memory traffic of what is then a matrix-vector product.
 */
#include "kernels/gemm.h"

#include "kernels/registry.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Packing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

void mha__gemm_pack_b_ref(const float *w, int64_t ldw, int n, int64_t kc, float *dst, int nr) {
    for (int j = 0; j < nr; j++) {
        if (j < n) {
            const float *src = w + (int64_t)j * ldw;
            for (int64_t k = 0; k < kc; k++)
                dst[k * nr + j] = src[k];
        } else {
            for (int64_t k = 0; k < kc; k++)
                dst[k * nr + j] = 0.0f;
        }
    }
}

/* mha__gemm_pack_b_ref from a transposed operand, stored [K, rows] (element (i, k) at x[k * ldx +
 * i]): each k is a run of m contiguous floats. Packs both x (MHA__GEMM_X_T) and W (MHA__GEMM_W_T,
 * nr). */
static void pack_t(const float *x, int64_t ldx, int m, int64_t kc, float *dst, int mr) {
    for (int64_t k = 0; k < kc; k++) {
        memcpy(dst + k * mr, x + k * ldx, sizeof(float) * (size_t)m);
        for (int i = m; i < mr; i++)
            dst[k * mr + i] = 0.0f;
    }
}

/* Half operands (bf16/f16) are widened while they are packed: the panels are float32 either way
 * and the micro-kernels do not change. */

/* pack_t from a half operand: each k's run of m elements widened into the panel. */
static void
pack_t_half(const void *x, mha_dtype dt, int64_t ldx, int m, int64_t kc, float *dst, int mr) {
    for (int64_t k = 0; k < kc; k++) {
        mha__widen(dt, mha__elem(dt, x, k * ldx), dst + k * mr, m);
        for (int i = m; i < mr; i++)
            dst[k * mr + i] = 0.0f;
    }
}

/* A tier packer (pack_b or pack_a: rows [0, n) of a row-major operand into [kc][nr]) over a half
 * operand: its n rows are widened into a contiguous [n][kc] float block first (contiguous runs:
 * the bf16 shift vectorises), then the tier's own packer transposes that block. n * kc <=
 * GEMM_MAX_APANEL (checked by the driver). */
static void pack_rows_half(mha__gemm_pack_b_fn pack,
                           const void *src,
                           mha_dtype dt,
                           int64_t ld,
                           int n,
                           int64_t kc,
                           float *dst);

/* ---------------------------------------------------------------------------------------------- */
/* Driver                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/* Largest MR x KC micro-panel of x a kernel may use: it lives on the stack of each part (no
 * allocation), 32 KB. */
#define GEMM_MAX_APANEL (16 * 512)

static void pack_rows_half(mha__gemm_pack_b_fn pack,
                           const void *src,
                           mha_dtype dt,
                           int64_t ld,
                           int n,
                           int64_t kc,
                           float *dst) {
    _Alignas(64) float tmp[GEMM_MAX_APANEL];
    MHA_ASSERT((int64_t)n * kc <= GEMM_MAX_APANEL);
    for (int r = 0; r < n; r++)
        mha__widen(dt, mha__elem(dt, src, r * ld), tmp + r * kc, kc);
    pack(tmp, kc, n, kc, dst);
}

/* pack_rows_half over q8_0 rows: src is the block holding column k0 of row 0, rows ld_bytes
 * apart, kc a multiple of 32 (or K's tail, which is one too); each row dequantised (exact) into
 * the float block, then the tier's packer. */
static void pack_rows_blocks(mha__gemm_pack_b_fn pack,
                             mha_dtype wdt,
                             const void *src,
                             int64_t ld_bytes,
                             int n,
                             int64_t kc,
                             float *dst) {
    _Alignas(64) float tmp[GEMM_MAX_APANEL];
    MHA_ASSERT((int64_t)n * kc <= GEMM_MAX_APANEL && kc % MHA__Q8_BLOCK == 0);
    for (int r = 0; r < n; r++)
        (wdt == MHA_DTYPE_Q4_0 ? mha__q4_dequantize : mha__q8_dequantize)(
            (const char *)src + r * ld_bytes, kc, tmp + r * kc);
    pack(tmp, kc, n, kc, dst);
}

/* Rows of a packed panel holding kc values of k: kc, or ceil(kc/2) pairs for a pair kernel. */
static int64_t panel_rows(const mha__gemm_kernel *kr, int64_t kc) {
    return kr->pack_pairs ? (kc + 1) / 2 : kc;
}

typedef struct gemm_job {
    const mha__gemm_kernel *kr;
    int64_t M, N, K;
    const void *x, *w; /* of dtypes xdt, wdt (F32, BF16 or F16) */
    mha_dtype xdt, wdt;
    const float *bias;
    int64_t ldx, ldw, ldy;
    int x_t, w_t; /* operands stored transposed (mha__gemm_op) */
    float *y;
    float *bpack_w;     /* phase 1 writes here (NULL when W comes pre-packed) */
    const float *bpack; /* K * npan * NR floats: K block at k0 starts at k0 * npan * NR */
    int64_t npan, mtiles;
    int grid_m, grid_n; /* parts = grid_m * grid_n */
} gemm_job;

static int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}

/* Even split of [0, count) into `parts`, piece `i`. */
static void split(int64_t count, int parts, int i, int64_t *begin, int64_t *end) {
    const int64_t base = count / parts, extra = count % parts;
    *begin = base * i + (i < extra ? i : extra);
    *end = *begin + base + (i < extra ? 1 : 0);
}

static void pack_w_range(void *ctx, int part, int64_t p0, int64_t p1) {
    (void)part;
    const gemm_job *j = ctx;
    const mha__gemm_kernel *kr = j->kr;
    const int64_t nr = kr->nr;
    /* Panel-major: the NR rows of W of a panel are read start to end (NR sequential streams)
     * rather than as K-block column strips, which touch every page of W once per K block (TLB
     * misses, no prefetch across pages; measured 1.3-4x slower on 1024^2 and 4096^2 W). */
    for (int64_t p = p0; p < p1; p++)
        for (int64_t k0 = 0; k0 < j->K; k0 += kr->kc) {
            const int64_t kc = min64(kr->kc, j->K - k0);
            const int n = (int)min64(nr, j->N - p * nr);
            float *dst =
                j->bpack_w + panel_rows(kr, k0) * j->npan * nr + p * panel_rows(kr, kc) * nr;
            const int64_t off = j->w_t ? k0 * j->ldw + p * nr : p * nr * j->ldw + k0;
            if (mha__is_block_weight(j->wdt)) { /* row-major, whole blocks (run_dt checked) */
                const int64_t rb = (int64_t)mha__weight_bytes(j->wdt, j->ldw);
                pack_rows_blocks(kr->pack_b, j->wdt,
                                 (const char *)j->w + p * nr * rb +
                                     (int64_t)mha__weight_bytes(j->wdt, k0),
                                 rb, n, kc, dst);
                continue;
            }
            const void *src = mha__elem(j->wdt, j->w, off);
            if (kr->pack_pairs)
                kr->pack_pairs(src, j->ldw, n, kc, dst, (int)nr);
            else if (j->wdt != MHA_DTYPE_F32 && j->w_t)
                pack_t_half(src, j->wdt, j->ldw, n, kc, dst, (int)nr);
            else if (j->wdt != MHA_DTYPE_F32)
                pack_rows_half(kr->pack_b, src, j->wdt, j->ldw, n, kc, dst);
            else if (j->w_t)
                pack_t(src, j->ldw, n, kc, dst, (int)nr);
            else
                kr->pack_b(src, j->ldw, n, kc, dst);
        }
}

static void compute_part(void *ctx, int part_lo, int64_t q0, int64_t q1) {
    (void)part_lo;
    const gemm_job *j = ctx;
    const mha__gemm_kernel *kr = j->kr;
    const int64_t mr = kr->mr, nr = kr->nr;
    const int64_t ncp = kr->nc / nr > 0 ? kr->nc / nr : 1; /* panels per NC block */
    _Alignas(64) float abuf[GEMM_MAX_APANEL];
    MHA_ASSERT(mr * kr->kc <= GEMM_MAX_APANEL);
    for (int64_t q = q0; q < q1; q++) {
        const int gi = (int)(q / j->grid_n), gj = (int)(q % j->grid_n);
        int64_t t0, t1, p0, p1;
        split(j->mtiles, j->grid_m, gi, &t0, &t1);
        split(j->npan, j->grid_n, gj, &p0, &p1);
        for (int64_t k0 = 0; k0 < j->K; k0 += kr->kc) {
            const int64_t kc = min64(kr->kc, j->K - k0);
            const int first = k0 == 0;
            const float *blk = j->bpack + panel_rows(kr, k0) * j->npan * nr;
            const int64_t pstride = panel_rows(kr, kc) * nr; /* floats per packed W panel */
            for (int64_t jc = p0; jc < p1; jc += ncp) {
                const int64_t jend = min64(jc + ncp, p1);
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t i0 = t * mr;
                    const int m = (int)min64(mr, j->M - i0);
                    const int64_t off = j->x_t ? k0 * j->ldx + i0 : i0 * j->ldx + k0;
                    const void *src = mha__elem(j->xdt, j->x, off);
                    if (kr->pack_pairs)
                        kr->pack_pairs(src, j->ldx, m, kc, abuf, (int)mr);
                    else if (j->xdt != MHA_DTYPE_F32 && j->x_t)
                        pack_t_half(src, j->xdt, j->ldx, m, kc, abuf, (int)mr);
                    else if (j->xdt != MHA_DTYPE_F32)
                        pack_rows_half(kr->pack_a, src, j->xdt, j->ldx, m, kc, abuf);
                    else if (j->x_t)
                        pack_t(src, j->ldx, m, kc, abuf, (int)mr);
                    else
                        kr->pack_a(src, j->ldx, m, kc, abuf);
                    float *yrow = j->y + i0 * j->ldy;
                    for (int64_t p = jc; p < jend; p++)
                        kr->ukr(kc, abuf, blk + p * pstride, yrow + p * nr, j->ldy, m,
                                (int)min64(nr, j->N - p * nr), j->bias ? j->bias + p * nr : NULL,
                                first);
                }
            }
        }
    }
}

/* The few-rows path: column chunks of MHA_GEMM_DOT_N, row pairs inside (the chunk of W stays in
 * L1 while the rows pass over it). */
typedef struct dot_job {
    const mha__gemm_kernel *kr;
    int64_t M, N, K;
    const float *x;
    const void *w; /* of dtype wdt */
    const float *bias;
    int64_t ldx, ldw, ldy;
    float *y;
    mha_dtype wdt;
} dot_job;

static void dot_range(void *ctx, int part, int64_t c0, int64_t c1) {
    (void)part;
    const dot_job *j = ctx;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t o = c * MHA_GEMM_DOT_N;
        const int n = (int)(j->N - o < MHA_GEMM_DOT_N ? j->N - o : MHA_GEMM_DOT_N);
        for (int64_t i = 0; i < j->M; i += MHA_GEMM_DOT_M) {
            const int m = (int)(j->M - i < MHA_GEMM_DOT_M ? j->M - i : MHA_GEMM_DOT_M);
            const float *bias = j->bias ? j->bias + o : NULL;
            if (j->wdt == MHA_DTYPE_F32) {
                j->kr->dot(j->K, j->x + i * j->ldx, j->ldx, m, (const float *)j->w + o * j->ldw,
                           j->ldw, n, bias, j->y + i * j->ldy + o, j->ldy);
            } else if (mha__is_block_weight(j->wdt)) {
                const int q4 = j->wdt == MHA_DTYPE_Q4_0;
                const mha__gemm_dot_q8_fn dot =
                    q4 ? (j->kr->dot_q4 ? j->kr->dot_q4 : mha__gemm_dot_q4_ref)
                       : (j->kr->dot_q8 ? j->kr->dot_q8 : mha__gemm_dot_q8_ref);
                const int64_t rb = (int64_t)mha__weight_bytes(j->wdt, j->ldw);
                dot(j->K, j->x + i * j->ldx, j->ldx, m, (const char *)j->w + o * rb, rb, n, bias,
                    j->y + i * j->ldy + o, j->ldy);
            } else {
                const mha__gemm_dot_h_fn dot = j->kr->dot_h ? j->kr->dot_h : mha__gemm_dot_h_ref;
                dot(j->K, j->x + i * j->ldx, j->ldx, m, (const uint16_t *)j->w + o * j->ldw,
                    j->wdt == MHA_DTYPE_BF16, j->ldw, n, bias, j->y + i * j->ldy + o, j->ldy);
            }
        }
    }
}

/* Bytes of packed W for kernel kr (plus 64 for aligning any caller buffer). */
static mha_status
packed_w_bytes(const mha__gemm_kernel *kr, int64_t N, int64_t K, size_t *bytes, mha_error *err) {
    const int64_t npan = (N + kr->nr - 1) / kr->nr;
    int64_t floats;
    MHA_RETURN_IF(!mha__mul_i64(K, npan * kr->nr, &floats) || floats > INT64_MAX - 16 ||
                      !mha__bytes(floats + 16, sizeof(float), bytes),
                  err, OVERFLOW, "gemm: packed W of %lld x %lld overflows", (long long)N,
                  (long long)K);
    return MHA_STATUS_OK;
}

static float *align_up(void *p) {
    return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* The tier's micro-kernels. CPU features come from cpu_features.c, as for every op, so the
 * projections and the attention core agree on the tier and on MHA_MAX_ISA. An explicit tier
 * (tests, benchmarks) needs only the CPU to have it, whatever the cap. `dts` (MHA_DTS_*) is what
 * the panels must hold: MHA_DTS_BF16 for bf16 pairs (see pick_dts), else MHA_DTS_F32 (float32
 * panels, half operands widened while packing); a pair kernel never takes float32 panels. */
static mha_status
resolve_kernel_dt(mha__gemm_isa isa, unsigned dts, const mha__gemm_kernel **kr, mha_error *err) {
    /* AUTO: a CPU (or MHA_MAX_ISA cap) without a pair kernel runs bf16 on float32 panels. */
    if (isa == MHA__GEMM_AUTO)
        isa = mha__registry_best_dt(MHA__OP_gemm, dts);
    if (!isa && dts == MHA_DTS_BF16)
        isa = mha__registry_best_dt(MHA__OP_gemm, dts = MHA_DTS_F32);
    MHA_RETURN_IF(!isa || isa->op != MHA__OP_gemm, err, INVALID_ARG,
                  "gemm: %s is not a GEMM kernel", isa ? isa->name : "(none)");
    MHA_RETURN_IF(!mha__kernel_usable(isa, 1), err, UNSUPPORTED,
                  "gemm: the %s kernel cannot run on this CPU", isa->name);
    MHA_RETURN_IF(isa->run.gemm->pack_pairs && dts != MHA_DTS_BF16, err, INVALID_ARG,
                  "gemm: the %s kernel takes row-major bf16 x and bf16 W only", isa->name);
    *kr = isa->run.gemm;
    return MHA_STATUS_OK;
}

static mha_status resolve_kernel(mha__gemm_isa isa, const mha__gemm_kernel **kr, mha_error *err) {
    return resolve_kernel_dt(isa, MHA_DTS_F32, kr, err);
}

/* The panels' dtype for operands x (xdt), W (wdt) in layout op with M rows: bf16 pairs when both
 * are bf16, row-major and M is above the few-rows path's (decode-sized calls keep the float32
 * tier's dot_h, which reads half W in place); else float32. Rounding an f32 or f16 operand to
 * bf16 would change results, so nothing else goes to a pair kernel. */
static unsigned pick_dts(mha__gemm_op op, int64_t M, mha_dtype xdt, mha_dtype wdt) {
    return xdt == MHA_DTYPE_BF16 && wdt == MHA_DTYPE_BF16 && op == MHA__GEMM_OP_N &&
                   M > MHA_GEMM_SMALL_M
               ? MHA_DTS_BF16
               : MHA_DTS_F32;
}

/* Phase 2 (and phase 1 when pw == NULL: W is packed into `workspace`). */
static mha_status run(const mha__gemm_kernel *kr,
                      int64_t M,
                      int64_t N,
                      int64_t K,
                      const void *x,
                      mha_dtype xdt,
                      int64_t ldx,
                      const void *w,
                      mha_dtype wdt,
                      int64_t ldw,
                      mha__gemm_op op,
                      const mha__gemm_packed_w *pw,
                      const float *bias,
                      float *y,
                      int64_t ldy,
                      mha__team team,
                      void *workspace,
                      size_t workspace_bytes,
                      const mha_allocator *alloc,
                      mha_error *err) {
    MHA_RETURN_IF(M < 0 || N < 0 || K < 0, err, INVALID_ARG,
                  "gemm: negative size %lld x %lld x %lld", (long long)M, (long long)N,
                  (long long)K);
    if (M == 0 || N == 0)
        return MHA_STATUS_OK;
    const int x_t = (op & MHA__GEMM_X_T) != 0, w_t = (op & MHA__GEMM_W_T) != 0;
    MHA_ASSERT(ldy >= N && (K == 0 || ldx >= (x_t ? M : K)) &&
               (pw || K == 0 || ldw >= (w_t ? N : K)));
    MHA_RETURN_IF((int64_t)kr->mr * kr->kc > GEMM_MAX_APANEL || kr->kc < 1 || kr->nc < 1, err,
                  INVALID_ARG, "gemm: kernel blocking mr=%d kc=%lld exceeds the %d-float panel",
                  kr->mr, (long long)kr->kc, GEMM_MAX_APANEL);
    MHA_RETURN_IF(kr->pack_pairs && kr->kc % 2 != 0, err, INVALID_ARG,
                  "gemm: a pair kernel needs an even kc, not %lld", (long long)kr->kc);
    MHA_RETURN_IF(wdt != MHA_DTYPE_F32 && (int64_t)kr->nr * kr->kc > GEMM_MAX_APANEL, err,
                  INVALID_ARG, "gemm: half W needs nr=%d x kc=%lld <= %d floats of widening space",
                  kr->nr, (long long)kr->kc, GEMM_MAX_APANEL);
    if (K == 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t o = 0; o < N; o++)
                y[i * ldy + o] = bias ? bias[o] : 0.0f;
        return MHA_STATUS_OK;
    }
    const mha__team crew = mha__team_for_flops(team, 2.0 * (double)M * (double)N * (double)K);
    const int threads = crew.n;
    if (!pw && !x_t && !w_t && M <= MHA_GEMM_SMALL_M && kr->dot) {
        /* A half x: its <= MHA_GEMM_SMALL_M rows widened into the workspace first (M K floats),
         * so that the dot products are the float32 path's chains. */
        float *xw = NULL, *owned_x = NULL;
        if (xdt != MHA_DTYPE_F32) {
            const size_t need = sizeof(float) * (size_t)(M * K) + 64;
            MHA_RETURN_IF(workspace && workspace_bytes < need, err, WORKSPACE_TOO_SMALL,
                          "gemm: workspace of %zu bytes, %zu needed", workspace_bytes, need);
            if (!workspace)
                workspace = owned_x = mha__alloc(alloc, need);
            MHA_RETURN_IF(!workspace, err, NO_MEMORY,
                          "gemm: cannot allocate %zu bytes for the rows of x", need);
            xw = align_up(workspace);
            for (int64_t i = 0; i < M; i++)
                mha__widen(xdt, mha__elem(xdt, x, i * ldx), xw + i * K, K);
        }
        dot_job dj = {kr, M, N, K, xw ? xw : x, w, bias, xw ? K : ldx, ldw, ldy, y, wdt};
        const mha_status st =
            mha__parallel_for(crew, (N + MHA_GEMM_DOT_N - 1) / MHA_GEMM_DOT_N, dot_range, &dj, err);
        mha__free(alloc, owned_x);
        return st;
    }
    gemm_job job;
    memset(&job, 0, sizeof job);
    job.kr = kr;
    job.M = M;
    job.N = N;
    job.K = K;
    job.x = x;
    job.w = w;
    job.xdt = xdt;
    job.wdt = wdt;
    job.bias = bias;
    job.y = y;
    job.ldx = ldx;
    job.ldw = ldw;
    job.ldy = ldy;
    job.x_t = x_t;
    job.w_t = w_t;
    job.npan = (N + kr->nr - 1) / kr->nr;
    job.mtiles = (M + kr->mr - 1) / kr->mr;
    /* Rows if there are plenty of row tiles, else column panels. */
    if (job.mtiles >= 4 * (int64_t)threads || job.npan < 2 * (int64_t)threads) {
        job.grid_m = (int)min64(threads, job.mtiles);
        job.grid_n = 1;
    } else {
        job.grid_m = 1;
        job.grid_n = (int)min64(threads, job.npan);
    }

    void *owned = NULL;
    mha_status st = MHA_STATUS_OK;
    if (pw) {
        job.bpack = pw->data;
    } else {
        size_t bytes;
        st = packed_w_bytes(kr, N, K, &bytes, err);
        if (st)
            return st;
        if (workspace) {
            MHA_RETURN_IF(workspace_bytes < bytes, err, WORKSPACE_TOO_SMALL,
                          "gemm: workspace of %zu bytes, %zu needed", workspace_bytes, bytes);
        } else {
            workspace = owned = mha__alloc_large(alloc, bytes);
            MHA_RETURN_IF(!owned, err, NO_MEMORY, "gemm: cannot allocate %zu bytes for packing W",
                          bytes);
        }
        job.bpack_w = align_up(workspace);
        job.bpack = job.bpack_w;
        st = mha__parallel_for(crew, job.npan, pack_w_range, &job, err);
    }
    if (st == MHA_STATUS_OK)
        st = mha__parallel_for(crew, (int64_t)job.grid_m * job.grid_n, compute_part, &job, err);
    mha__free(alloc, owned);
    return st;
}

/* The few-rows path packs nothing; a half x there needs its M rows widened (M K floats). */
static mha_status workspace_size_dt(mha__gemm_isa isa,
                                    int64_t M,
                                    int64_t N,
                                    int64_t K,
                                    mha_dtype xdt,
                                    size_t *bytes,
                                    mha_error *err) {
    MHA_RETURN_IF(M < 0 || N < 0 || K < 0, err, INVALID_ARG,
                  "gemm: negative size %lld x %lld x %lld", (long long)M, (long long)N,
                  (long long)K);
    *bytes = 0;
    if (M == 0 || N == 0 || K == 0)
        return MHA_STATUS_OK;
    /* W's dtype is not known here: a bf16 x may run on a pair kernel (with a bf16 W), whose
     * packed W then must fit too (it needs at most the float32 panels' bytes at equal NR). */
    if (isa == MHA__GEMM_AUTO && pick_dts(MHA__GEMM_OP_N, M, xdt, xdt) == MHA_DTS_BF16) {
        const mha__gemm_kernel *kp = NULL;
        size_t pair_bytes = 0;
        if (resolve_kernel_dt(isa, MHA_DTS_BF16, &kp, NULL) == MHA_STATUS_OK) {
            mha_status st = packed_w_bytes(kp, N, K, &pair_bytes, err);
            if (st)
                return st;
        }
        mha_status st = workspace_size_dt(isa, M, N, K, MHA_DTYPE_F32, bytes, err);
        *bytes = *bytes > pair_bytes ? *bytes : pair_bytes;
        return st;
    }
    const mha__gemm_kernel *kr = NULL;
    mha_status st = resolve_kernel(isa, &kr, err);
    if (!st && M <= MHA_GEMM_SMALL_M && kr->dot && xdt != MHA_DTYPE_F32)
        *bytes = sizeof(float) * (size_t)(M * K) + 64;
    if (st || (M <= MHA_GEMM_SMALL_M && kr->dot))
        return st;
    return packed_w_bytes(kr, N, K, bytes, err);
}

mha_status mha__gemm_workspace_size(
    mha__gemm_isa isa, int64_t M, int64_t N, int64_t K, size_t *bytes, mha_error *err) {
    return workspace_size_dt(isa, M, N, K, MHA_DTYPE_F32, bytes, err);
}

mha_status mha__gemm_workspace_size_dt(mha__gemm_isa isa,
                                       int64_t M,
                                       int64_t N,
                                       int64_t K,
                                       mha_dtype xdt,
                                       size_t *bytes,
                                       mha_error *err) {
    return workspace_size_dt(isa, M, N, K, xdt, bytes, err);
}

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
                            mha_error *err) {
    const mha__gemm_kernel *kr = NULL;
    mha_status st = resolve_kernel(isa, &kr, err);
    return st ? st
              : run(kr, M, N, K, x, MHA_DTYPE_F32, ldx, w, MHA_DTYPE_F32, ldw, MHA__GEMM_OP_N, NULL,
                    bias, y, ldy, team, workspace, workspace_bytes, alloc, err);
}

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
                         mha_error *err) {
    return mha__gemm_xwt_ws(M, N, K, x, ldx, w, ldw, bias, y, ldy, team, isa, NULL, 0, alloc, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* Pre-packed W                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

mha_status
mha__gemm_pack_w_size(mha__gemm_isa isa, int64_t N, int64_t K, size_t *bytes, mha_error *err) {
    MHA_RETURN_IF(N < 0 || K < 0, err, INVALID_ARG, "gemm: negative W size %lld x %lld",
                  (long long)N, (long long)K);
    const mha__gemm_kernel *kr = NULL;
    mha_status st = resolve_kernel(isa, &kr, err);
    return st ? st : packed_w_bytes(kr, N, K, bytes, err);
}

mha_status mha__gemm_pack_w(mha__gemm_isa isa,
                            int64_t N,
                            int64_t K,
                            const float *w,
                            int64_t ldw,
                            void *buffer,
                            size_t bytes,
                            mha__team team,
                            mha__gemm_packed_w *out,
                            mha_error *err) {
    size_t need;
    mha_status st = mha__gemm_pack_w_size(isa, N, K, &need, err);
    if (st)
        return st;
    MHA_RETURN_IF(!buffer || bytes < need, err, WORKSPACE_TOO_SMALL,
                  "gemm: packed-W buffer of %zu bytes, %zu needed", buffer ? bytes : 0, need);
    gemm_job job;
    memset(&job, 0, sizeof job);
    resolve_kernel(isa, &job.kr, err);
    job.N = N;
    job.K = K;
    job.w = w;
    job.ldw = ldw;
    job.npan = (N + job.kr->nr - 1) / job.kr->nr;
    job.bpack_w = align_up(buffer);
    const mha__team crew = mha__team_for_flops(team, (double)N * (double)K);
    if (N > 0 && K > 0)
        st = mha__parallel_for(crew, job.npan, pack_w_range, &job, err);
    out->kr = job.kr;
    out->N = N;
    out->K = K;
    out->data = job.bpack_w;
    return st;
}

mha_status mha__gemm_xwt_packed(int64_t M,
                                const float *x,
                                int64_t ldx,
                                const mha__gemm_packed_w *pw,
                                const float *bias,
                                float *y,
                                int64_t ldy,
                                mha__team team,
                                mha_error *err) {
    MHA_RETURN_IF(!pw || !pw->kr, err, INVALID_ARG, "gemm: no packed W");
    return run(pw->kr, M, pw->N, pw->K, x, MHA_DTYPE_F32, ldx, NULL, MHA_DTYPE_F32, 0,
               MHA__GEMM_OP_N, pw, bias, y, ldy, team, NULL, 0, NULL, err);
}

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
                            mha_error *err) {
    const mha__gemm_kernel *kr = NULL;
    mha_status st = resolve_kernel(isa, &kr, err);
    return st ? st
              : run(kr, M, N, K, x, MHA_DTYPE_F32, ldx, w, MHA_DTYPE_F32, ldw, op, NULL, NULL, y,
                    ldy, team, NULL, 0, alloc, err);
}

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
                            mha_error *err) {
    MHA_RETURN_IF(
        !mha__is_float_storage(xdt) || (!mha__is_float_storage(wdt) && !mha__is_block_weight(wdt)),
        err, INVALID_ARG, "gemm: operand dtypes %d, %d are not F32, BF16 or F16 (W: or Q8_0, Q4_0)",
        (int)xdt, (int)wdt);
    MHA_RETURN_IF(mha__is_block_weight(wdt) &&
                      (op != MHA__GEMM_OP_N || K % MHA__Q8_BLOCK != 0 || ldw != K),
                  err, INVALID_ARG,
                  "gemm: block W takes op N, K a multiple of 32 and ldw = K (K=%lld, ldw=%lld)",
                  (long long)K, (long long)ldw);
    const mha__gemm_kernel *kr = NULL;
    unsigned dts = pick_dts(op, M, xdt, wdt);
    /* An explicit pair kernel (tests, benchmarks) also takes few rows (packed path). */
    if (isa && isa->op == MHA__OP_gemm && isa->run.gemm->pack_pairs && xdt == MHA_DTYPE_BF16 &&
        wdt == MHA_DTYPE_BF16 && op == MHA__GEMM_OP_N)
        dts = MHA_DTS_BF16;
    mha_status st = resolve_kernel_dt(isa, dts, &kr, err);
    MHA_RETURN_IF(!st && mha__is_block_weight(wdt) && kr->kc % MHA__Q8_BLOCK != 0, err, INVALID_ARG,
                  "gemm: block W needs a kernel kc multiple of 32, not %lld", (long long)kr->kc);
    return st ? st
              : run(kr, M, N, K, x, xdt, ldx, w, wdt, ldw, op, NULL, bias, y, ldy, team, workspace,
                    workspace_bytes, alloc, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* Portable few-rows path over half W                                                             */
/* ---------------------------------------------------------------------------------------------- */

int mha__gemm_dot_q8_block_sums(const mha__gemm_kernel *kr) {
#if defined(__x86_64__) || defined(__i386__)
    return kr == &mha_gemm_f32_6x16__avx2;
#else
    (void)kr;
    return 0;
#endif
}

/* The portable few-rows path over block W of type wdt (Q8_0 or Q4_0): 8 partial sums per dot
 * (k mod 8), each element dequantised (mha__block_load: q d or (q - 8) d, exact). */
static void dot_blocks_ref(mha_dtype wdt,
                           int64_t K,
                           const float *x,
                           int64_t ldx,
                           int m,
                           const void *w,
                           int64_t ldw_bytes,
                           int n,
                           const float *bias,
                           float *y,
                           int64_t ldy) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float *a = x + i * ldx;
            const void *b = (const char *)w + j * ldw_bytes;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t k = 0; k < K; k++) /* K is a multiple of 32 */
                acc[k % 8] += a[k] * mha__block_load(wdt, b, k);
            const float s =
                ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
            y[i * ldy + j] = bias ? s + bias[j] : s;
        }
}

void mha__gemm_dot_q8_ref(int64_t K,
                          const float *x,
                          int64_t ldx,
                          int m,
                          const void *w,
                          int64_t ldw_bytes,
                          int n,
                          const float *bias,
                          float *y,
                          int64_t ldy) {
    dot_blocks_ref(MHA_DTYPE_Q8_0, K, x, ldx, m, w, ldw_bytes, n, bias, y, ldy);
}

void mha__gemm_dot_q4_ref(int64_t K,
                          const float *x,
                          int64_t ldx,
                          int m,
                          const void *w,
                          int64_t ldw_bytes,
                          int n,
                          const float *bias,
                          float *y,
                          int64_t ldy) {
    dot_blocks_ref(MHA_DTYPE_Q4_0, K, x, ldx, m, w, ldw_bytes, n, bias, y, ldy);
}

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
                         int64_t ldy) {
    const mha_dtype dt = bf16 ? MHA_DTYPE_BF16 : MHA_DTYPE_F16;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float *a = x + i * ldx;
            const uint16_t *b = w + j * ldw;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int l = 0; l < 8; l++)
                    acc[l] += a[k + l] * mha__load(dt, b, k + l);
            for (int l = 0; k < K; k++, l++)
                acc[l] += a[k] * mha__load(dt, b, k);
            const float s =
                ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
            y[i * ldy + j] = bias ? s + bias[j] : s;
        }
}

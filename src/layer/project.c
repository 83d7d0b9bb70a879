/* SPDX-License-Identifier: MIT */
/* project.c: mha_layer_project, one of the layer's four linear maps on its own (mha.h). The
 * distributed layer (src/dist/ring_layer.c) projects each rank's rows with it, so that it stands
 * on the public API and runs the same arithmetic as mha_layer_forward (mha__plan_project: the
 * packed GEMM, or the plain loops for impl=reference). */
#include "check/check.h"
#include "kernels/gemm.h"
#include "layer/plan.h"

mha_status mha_layer_project(const mha_layer *layer,
                             mha_projection which,
                             int64_t rows,
                             const float *x,
                             float *y,
                             const mha_exec *exec,
                             mha_error *err) {
    mha__projection p;
    mha_status st = mha__check_layer_project(layer ? mha_layer_config(layer) : NULL,
                                             layer ? mha__layer_compute_weights(layer) : NULL,
                                             which, rows, x, y, exec, &p, err);
    mha__team team;
    if (!st)
        st = mha__exec_team(exec, &team, err);
    if (!st && rows > 0)
        st = mha__plan_project(exec ? exec->impl : MHA_IMPL_AUTO, exec ? exec->allocator : NULL,
                               team, x, MHA_DTYPE_F32, p.w, p.wdt, p.bias, y, rows, p.in, p.out,
                               NULL, 0, err);
    if (!st)
        mha__ok(err);
    return st;
}

/* Writes (or adds) src[0..count) into dst. */
static void deliver(float *dst, const float *src, int64_t count, int accumulate) {
    for (int64_t i = 0; i < count; i++)
        dst[i] = accumulate ? dst[i] + src[i] : src[i];
}

/* impl=reference: y[M, N] = A^T B (at = 1: A [K, M]) or A B (at = 0: A [M, K]), B [K, N] of
 * dtype bdt (widened per element), one float chain per element in increasing k. */
static void plain_product(const float *A,
                          const void *Bm,
                          mha_dtype bdt,
                          float *y,
                          int64_t M,
                          int64_t N,
                          int64_t K,
                          int at) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++)
                acc += (at ? A[k * M + i] : A[i * K + k]) * mha__load(bdt, Bm, k * N + j);
            y[i * N + j] = acc;
        }
}

mha_status mha_layer_project_backward(const mha_layer *layer,
                                      mha_projection which,
                                      int64_t rows,
                                      const float *x,
                                      const float *dy,
                                      float *dx,
                                      float *dw,
                                      float *db,
                                      int32_t accumulate,
                                      const mha_exec *exec,
                                      mha_error *err) {
    mha__projection p;
    mha_status st = mha__check_layer_project_backward(
        layer ? mha_layer_config(layer) : NULL, layer ? mha__layer_compute_weights(layer) : NULL,
        which, rows, x, dy, dx, dw, db, exec, &p, err);
    mha__team team;
    if (!st)
        st = mha__exec_team(exec, &team, err);
    if (st)
        return st;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    const int ref = exec && exec->impl == MHA_IMPL_REFERENCE;
    /* Scratch: dW [out, in] and dx [rows, in], so that an error leaves the outputs untouched. */
    const int64_t nw = dw ? p.out * p.in : 0, nx = dx ? rows * p.in : 0;
    float *sw = nw ? mha__alloc_large(alloc, sizeof(float) * (size_t)nw) : NULL;
    float *sx = nx ? mha__alloc_large(alloc, sizeof(float) * (size_t)nx) : NULL;
    if ((nw && !sw) || (nx && !sx))
        st = mha__fail(err, MHA_STATUS_NO_MEMORY, "out of memory (%lld floats of scratch)",
                       (long long)(nw + nx));
    /* dW[out, in] = dy^T x: dy [rows, out] read transposed, x [rows, in] as W^T. */
    if (!st && nw && !ref)
        st = mha__gemm_op_run((mha__gemm_op)(MHA__GEMM_X_T | MHA__GEMM_W_T), p.out, p.in, rows, dy,
                              p.out, x, p.in, sw, p.in, team, MHA__GEMM_AUTO, alloc, err);
    else if (!st && nw)
        plain_product(dy, x, MHA_DTYPE_F32, sw, p.out, p.in, rows, 1);
    /* dx[rows, in] = dy W: W [out, in] read as W^T of an x W^T product. */
    if (!st && nx && !ref)
        st =
            mha__gemm_run_dt(MHA__GEMM_W_T, rows, p.in, p.out, dy, MHA_DTYPE_F32, p.out, p.w, p.wdt,
                             p.in, NULL, sx, p.in, team, MHA__GEMM_AUTO, NULL, 0, alloc, err);
    else if (!st && nx)
        plain_product(dy, p.w, p.wdt, sx, rows, p.in, p.out, 0);
    if (!st) {
        if (sw)
            deliver(dw, sw, nw, accumulate);
        if (sx)
            deliver(dx, sx, nx, accumulate);
        for (int64_t o = 0; db && o < p.out; o++) {
            float s = 0.0f;
            for (int64_t r = 0; r < rows; r++)
                s += dy[r * p.out + o];
            db[o] = accumulate ? db[o] + s : s;
        }
        mha__ok(err);
    }
    mha__free(alloc, sw);
    mha__free(alloc, sx);
    return st;
}

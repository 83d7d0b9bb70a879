/* SPDX-License-Identifier: MIT */
/* project.c: mha_layer_project, one of the layer's four linear maps on its own (mha.h). The
 * distributed layer (src/dist/ring_layer.c) projects each rank's rows with it, so that it stands
 * on the public API and runs the same arithmetic as mha_layer_forward (mha__plan_project: the
 * packed GEMM, or the plain loops for impl=reference). */
#include "check/check.h"
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
                                             layer ? mha_layer_weights(layer) : NULL, which, rows,
                                             x, y, exec, &p, err);
    mha__team team;
    if (!st)
        st = mha__exec_team(exec, &team, err);
    if (!st && rows > 0)
        st = mha__plan_project(exec ? exec->impl : MHA_IMPL_AUTO, exec ? exec->allocator : NULL,
                               team, x, p.w, p.bias, y, rows, p.in, p.out, NULL, 0, err);
    if (!st)
        mha__ok(err);
    return st;
}

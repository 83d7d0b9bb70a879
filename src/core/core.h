/* SPDX-License-Identifier: MIT */
/* core.h: the attention core's internal entry points for the parts above it (api/, layer/):
 * the public core with an explicit forward kernel (a registry line; NULL = choose by exec->impl),
 * and the core validated once and run later (the layer forward).
 */
#ifndef MHA_CORE_H
#define MHA_CORE_H

#include "kernels/kernels.h"

/* The public core with an explicit kernel (attention.c); k == NULL: choose by exec->impl. */
mha_status mha__attention_run(const mha_attention_args *args,
                              const mha_exec *exec,
                              const mha__kernel_info *k,
                              mha_error *err);
mha_status mha__attention_workspace(const mha_attention_args *args,
                                    const mha_exec *exec,
                                    const mha__kernel_info *k,
                                    size_t *bytes,
                                    mha_error *err);

/* The core in two steps, so that a caller validates once and runs later (the layer forward:
 * validate, project, then run). prepare: every check of mha_attention (sizes, masks, the
 * implementation, the workspace), the problem built with args' pointers (their data is read only
 * by finish); finish: runs the kernel (run != 0) and gives back the workspace (always call it
 * after a successful prepare). */
typedef struct mha__core_call {
    mha__problem p;
    const mha__kernel_info *k;
    mha__team team;
    char *scratch; /* team.n blocks of `stride` bytes */
    size_t stride;
    char *owned; /* the workspace when the library allocated it */
    const mha_allocator *alloc;
} mha__core_call;
/* mha_attention_supported without the aliasing rule: q, k, v and out are placeholders (the
 * layer's support query, before its scratch exists). */
mha_status mha__attention_supported_layout(const mha_attention_args *args,
                                           const mha_exec *exec,
                                           mha_error *err);
/* built: NULL, or a block mask of the caller's (mha_block_mask_create on args with the same
 * element rules), used instead of building one in the workspace. */
mha_status mha__core_prepare(const mha_attention_args *args,
                             const mha_exec *exec,
                             const mha__kernel_info *forced,
                             const mha_block_mask *built,
                             mha__core_call *call,
                             mha_error *err);
mha_status mha__core_finish(mha__core_call *call, int run, mha_error *err);

/* mha_attention_statistics on a problem its check (mha__check_attention_stats) resolved: the
 * threads of exec, scratch from exec->allocator (core/stats.c). */
mha_status mha__attention_stats_run(const mha__problem *p,
                                    const mha_attention_stats *stats,
                                    const mha_exec *exec,
                                    mha_error *err);

/* The backward kernels (core/attention_bwd.c: the registry's bwd lines), in priority order, the
 * reference last: index -> name (NULL past the end) and whether this CPU (capped by MHA_MAX_ISA)
 * can run it. */
const char *mha__bwd_kernel_name(int index);
int mha__bwd_kernel_usable(int index);

/* The core backward; kernel >= 0 forces that kernel (tests), -1 chooses by exec->impl.
 * `name_out` (may be NULL) receives the name of the kernel that ran. */
/* p->map from a caller's block mask, after checking that it was built for args' sizes and
 * element rules (INVALID_ARG otherwise). */
mha_status mha__block_mask_use(const mha_block_mask *bm,
                               const mha_attention_args *args,
                               mha__problem *p,
                               mha_error *err);

mha_status mha__attention_backward_run(const mha_attention_args *fwd,
                                       const mha_attention_grads *grads,
                                       const mha_exec *exec,
                                       int kernel,
                                       const char **name_out,
                                       mha_error *err);

#endif /* MHA_CORE_H */

/* SPDX-License-Identifier: MIT */
/* core.h: the attention core's internal entry points for the parts above it (api/experimental.c):
 * the public core with an explicit forward kernel (a registry line; NULL = choose by exec->impl).
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

#endif /* MHA_CORE_H */

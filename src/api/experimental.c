/* SPDX-License-Identifier: MIT */
/* experimental.c: mha_experimental.h, the registry seen from outside (every op's kernels, which
 * one each op runs here, the CPU's tiers) and the forward run with a chosen kernel. It sits above
 * the attention core and the registry and calls down into both (nothing calls back into it). */
#include "core/core.h"
#include "kernels/registry.h"
#include "mha_experimental.h"

#include <string.h>

int32_t mha_experimental_kernel_count(void) {
    return mha__registry_count();
}

mha_status mha_experimental_kernel_describe(int32_t index, mha_kernel_desc *desc, mha_error *err) {
    MHA_RETURN_IF(!desc, err, INVALID_ARG, "desc is NULL");
    const mha__kernel_info *k = mha__registry_at(index);
    MHA_RETURN_IF(!k, err, INVALID_ARG, "kernel index %d outside [0, %d)", (int)index,
                  mha__registry_count());
    desc->name = k->name;
    desc->isa = mha__kernel_tier(k);
    desc->block_q = k->bq;
    desc->block_k = k->bk;
    desc->max_head_dim = k->max_d;
    desc->usable = mha__kernel_usable(k, 0);
    desc->preferred = mha__kernel_preferred(k);
    desc->reference = k->reference;
    desc->op = mha__op_name(k->op);
    desc->dtypes = mha__dts_name(k->dtypes);
    mha__ok(err);
    return MHA_STATUS_OK;
}

int32_t mha_experimental_kernel_find(const char *name) {
    const mha__kernel_info *k = mha__registry_find(name);
    return k ? mha__registry_index(k) : -1;
}

int32_t mha_experimental_kernel_active(const char *op) {
    for (int i = 0; op && i < mha__registry_count(); i++) {
        const mha__kernel_info *k = mha__registry_at(i);
        if (strcmp(mha__op_name(k->op), op) == 0) {
            const mha__kernel_info *best = mha__registry_best(k->op);
            return best ? mha__registry_index(best) : -1;
        }
    }
    return -1;
}

const char *mha_experimental_cpu_isas(int32_t capped) {
    return mha__cpu_isa_list(capped ? mha__cpu_isa() : mha__cpu_isa_detected());
}

int32_t mha_experimental_cpu_bf16_tiles(void) {
    return mha__cpu_bf16_tiles_fast() && (mha__cpu_isa() & MHA_ISA_AVX512BF16) != 0;
}

int32_t mha_experimental_cpu_q8x16(void) {
    const mha__kernel_info *k = mha__registry_best_dt(MHA__OP_decode, MHA_DTS_Q8X16);
    return k && k->isa != 0 && mha__cpu_q8x16_preferred();
}

int32_t mha_experimental_cpu_prefetch_level(void) {
    return mha__cpu_decode_prefetch_to_l2() ? 2 : 1;
}

int32_t mha_experimental_cpu_gemm_prefetch_level(void) {
    return mha__cpu_prefetch_to_l2() ? 2 : 1;
}

int32_t mha_experimental_cpu_amx_bf16(void) {
    return mha__cpu_has_amx_bf16();
}

mha_status mha_experimental_attention_select(const mha_attention_args *args,
                                             const mha_exec *exec,
                                             int32_t *index,
                                             mha_error *err) {
    MHA_RETURN_IF(!index, err, INVALID_ARG, "index is NULL");
    mha_status st = mha_attention_supported(args, exec, err);
    if (st)
        return st;
    mha__fwd_shape s;
    mha__fwd_shape_from_args(args, &s);
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    const mha__kernel_info *k = mha__registry_reference(MHA__OP_fwd);
    if (impl != MHA_IMPL_REFERENCE) {
        st = mha__kernel_select(&s, impl, &k, err);
        if (st)
            return st;
    }
    *index = mha__registry_index(k);
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* The forward kernel at `index`, or an error naming why there is none. */
static mha_status forward_kernel(int32_t index, const mha__kernel_info **k, mha_error *err) {
    *k = mha__registry_at(index);
    MHA_RETURN_IF(!*k, err, INVALID_ARG, "kernel index %d outside [0, %d)", (int)index,
                  mha__registry_count());
    MHA_RETURN_IF((*k)->op != MHA__OP_fwd, err, INVALID_ARG,
                  "kernel %s is a %s kernel, not an attention forward kernel", (*k)->name,
                  mha__op_name((*k)->op));
    return MHA_STATUS_OK;
}

mha_status mha_experimental_attention_with_kernel(int32_t index,
                                                  const mha_attention_args *args,
                                                  const mha_exec *exec,
                                                  mha_error *err) {
    const mha__kernel_info *k;
    mha_status st = forward_kernel(index, &k, err);
    return st ? st : mha__attention_run(args, exec, k, err);
}

mha_status mha_experimental_attention_workspace_size_with_kernel(int32_t index,
                                                                 const mha_attention_args *args,
                                                                 const mha_exec *exec,
                                                                 size_t *bytes,
                                                                 mha_error *err) {
    const mha__kernel_info *k;
    mha_status st = forward_kernel(index, &k, err);
    return st ? st : mha__attention_workspace(args, exec, k, bytes, err);
}

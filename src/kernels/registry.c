/* SPDX-License-Identifier: MIT */
/* registry.c: the table of every kernel (registry.def), and the queries the ops' drivers share. */
#include "kernels/registry.h"

#include "kernels/flash_fwd.h"

#include <string.h>

#define MHA_RUN_fwd(name)    .fwd = name
#define MHA_RUN_bwd(name)    .bwd = name
#define MHA_RUN_decode(name) .decode = name
#define MHA_RUN_gemm(name)   .gemm = &name

static const mha__kernel_info registry[] = {
#define MHA_KERNEL(op_, dts_, name_, isa_, p1_, p2_, maxd_)                                        \
    {.op = MHA__OP_##op_,                                                                          \
     .dtypes = (dts_),                                                                             \
     .name = #name_,                                                                               \
     .isa = (isa_),                                                                                \
     .bq = (p1_),                                                                                  \
     .bk = (p2_),                                                                                  \
     .max_d = (maxd_),                                                                             \
     .reference = (p1_) == 0,                                                                      \
     .run = {MHA_RUN_##op_(name_)}},
#include "kernels/registry.def"
#undef MHA_KERNEL
};
#define REGISTRY_SIZE ((int)(sizeof registry / sizeof registry[0]))

/* The blocking the backward and decode code is written for is the registry's (one value each). */
#define MHA_CHECK_fwd(name, p1, p2)                                                                \
    _Static_assert((p1) <= MHA_FLASH_MAX_BQ, #name ": Bq above MHA_FLASH_MAX_BQ");
#define MHA_CHECK_gemm(name, p1, p2)
#define MHA_CHECK_bwd(name, p1, p2)                                                                \
    _Static_assert((p1) == 0 || ((p1) == MHA__BWD_BQ && (p2) == MHA__BWD_BK),                      \
                   #name ": registry blocking differs from MHA__BWD_BQ/BK");
#define MHA_CHECK_decode(name, p1, p2)                                                             \
    _Static_assert((p1) == MHA_DEC_BLOCK, #name ": registry blocking differs from MHA_DEC_BLOCK");
#define MHA_KERNEL(op, dts, name, isa, p1, p2, maxd) MHA_CHECK_##op(name, p1, p2)
#include "kernels/registry.def"
#undef MHA_KERNEL

int mha__registry_count(void) {
    return REGISTRY_SIZE;
}

const mha__kernel_info *mha__registry_at(int index) {
    return index >= 0 && index < REGISTRY_SIZE ? &registry[index] : NULL;
}

int mha__registry_index(const mha__kernel_info *k) {
    return (int)(k - registry);
}

const mha__kernel_info *mha__registry_find(const char *name) {
    if (name)
        for (int i = 0; i < REGISTRY_SIZE; i++)
            if (strcmp(registry[i].name, name) == 0)
                return &registry[i];
    return NULL;
}

const char *mha__op_name(mha__op op) {
    static const char *const names[] = {"fwd", "bwd", "decode", "gemm"};
    return (unsigned)op < sizeof names / sizeof names[0] ? names[op] : "?";
}

const char *mha__dts_name(unsigned dtypes) {
    /* Every subset of the three bits, in the order f32, bf16, f16; then q8_0 and fp8_e4m3
     * (decode lines take both or neither: MHA_DTS_KVQ; a lone bit names a cache's dtype). */
    static const char *const names[8] = {"none", "f32",     "bf16",     "f32,bf16",
                                         "f16",  "f32,f16", "bf16,f16", "f32,bf16,f16"};
    static const char *const q8[8] = {"q8_0",          "f32,q8_0",         "bf16,q8_0",
                                      "f32,bf16,q8_0", "f16,q8_0",         "f32,f16,q8_0",
                                      "bf16,f16,q8_0", "f32,bf16,f16,q8_0"};
    if (dtypes & MHA_DTS_Q8X16) /* a decode line that also reads the interleaved q8_0 order */
        return dtypes == (MHA_DTS_KVQ | MHA_DTS_Q8X16) ? "f32,bf16,f16,q8_0,fp8_e4m3,q8_0x16"
               : dtypes == MHA_DTS_Q8X16               ? "q8_0x16"
                                                       : "?";
    if ((dtypes & (MHA_DTS_Q8_0 | MHA_DTS_FP8)) == (MHA_DTS_Q8_0 | MHA_DTS_FP8))
        return (dtypes & MHA_DTS_ALL) == MHA_DTS_ALL ? "f32,bf16,f16,q8_0,fp8_e4m3" : "?";
    if (dtypes & MHA_DTS_FP8)
        return (dtypes & MHA_DTS_ALL) == 0 ? "fp8_e4m3" : "?";
    return (dtypes & MHA_DTS_Q8_0 ? q8 : names)[dtypes & MHA_DTS_ALL];
}

const char *mha__kernel_tier(const mha__kernel_info *k) {
    const char *s = strstr(k->name, "__");
    return s ? s + 2 : k->name;
}

int mha__kernel_usable(const mha__kernel_info *k, int detected) {
    const unsigned have = detected ? mha__cpu_isa_detected() : mha__cpu_isa();
    return (k->isa & ~have) == 0;
}

int mha__kernel_preferred(const mha__kernel_info *k) {
    return mha__kernel_usable(k, 0) &&
           (!(k->isa & MHA_ISA_AVX512BF16) || mha__cpu_bf16_tiles_fast());
}

const mha__kernel_info *mha__registry_reference(mha__op op) {
    for (int i = 0; i < REGISTRY_SIZE; i++)
        if (registry[i].op == op && registry[i].reference)
            return &registry[i];
    return NULL;
}

const mha__kernel_info *mha__registry_best_dt(mha__op op, unsigned dts) {
    for (int i = 0; i < REGISTRY_SIZE; i++)
        if (registry[i].op == op && !registry[i].reference && (registry[i].dtypes & dts) == dts &&
            mha__kernel_preferred(&registry[i]))
            return &registry[i];
    return NULL;
}

const mha__kernel_info *mha__registry_best(mha__op op) {
    for (int i = 0; i < REGISTRY_SIZE; i++)
        if (registry[i].op == op && !registry[i].reference && mha__kernel_preferred(&registry[i]))
            return &registry[i];
    return NULL;
}

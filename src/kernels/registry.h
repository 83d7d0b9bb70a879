/* SPDX-License-Identifier: MIT */
/* registry.h: the one kernel registry (registry.def) as a table, with the prototypes of every
 * kernel of every op generated from it. Each op's driver selects from the table (dispatch.c for
 * the forward, attention_bwd.c, decode.c, gemm.c); `mha info`, mha_experimental.h and the tests
 * list it. */
#ifndef MHA_REGISTRY_H
#define MHA_REGISTRY_H

#include "base/cpu_features.h"
#include "cache/kv_cache.h"
#include "kernels/attention_bwd.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"

/* The ops; the enumerator's suffix is the op token of registry.def. */
typedef enum mha__op {
    MHA__OP_fwd,
    MHA__OP_bwd,
    MHA__OP_decode,
    MHA__OP_gemm,
} mha__op;

/* Storage dtype sets of the registry's dtypes column: one bit per storage dtype. */
#define MHA_DTS_F32   (1u << 0)
#define MHA_DTS_BF16  (1u << 1)
#define MHA_DTS_F16   (1u << 2)
#define MHA_DTS_ALL   (MHA_DTS_F32 | MHA_DTS_BF16 | MHA_DTS_F16)
/* q8_0 blocks: a KV cache dtype only (op decode), never an activation; not in MHA_DTS_ALL */
#define MHA_DTS_Q8_0  (1u << 3)
/* fp8 e4m3 with per-kv-head scales: a KV cache dtype only, like q8_0 */
#define MHA_DTS_FP8   (1u << 4)
/* A decode kernel that also reads the 8-bit caches (q8_0, fp8 e4m3) */
#define MHA_DTS_KVQ   (MHA_DTS_ALL | MHA_DTS_Q8_0 | MHA_DTS_FP8)
/* q8_0 caches in the key-interleaved order (cache/kv_cache.h): the decode lines that read it */
#define MHA_DTS_Q8X16 (1u << 5)

/* The MHA_DTS_* bit of a storage dtype (0 for a dtype no tensor role stores: F64, ints...). */
static inline unsigned mha__dts_bit(mha_dtype dt) {
    return dt == MHA_DTYPE_F32        ? MHA_DTS_F32
           : dt == MHA_DTYPE_BF16     ? MHA_DTS_BF16
           : dt == MHA_DTYPE_F16      ? MHA_DTS_F16
           : dt == MHA_DTYPE_Q8_0     ? MHA_DTS_Q8_0
           : dt == MHA_DTYPE_FP8_E4M3 ? MHA_DTS_FP8
                                      : 0u;
}

/* One registry line. */
struct mha__kernel_info {
    mha__op op;
    unsigned dtypes;  /* MHA_DTS_* bits: the storage dtypes of the activations it takes */
    const char *name; /* the tier is the suffix after "__" ("ref" for the references) */
    unsigned isa;     /* MHA_ISA_* bits required */
    int bq, bk;       /* p1, p2 of the line (registry.def says what they are per op) */
    int64_t max_d;    /* 0 = unlimited */
    int reference;    /* the plain reference of its op (suffix "__ref", p1 = 0) */
    union {
        mha__fwd_fn fwd;
        mha__bwd_fn bwd;
        mha__dec_kernel_fn decode;
        const mha__gemm_kernel *gemm;
    } run;
};

/* Prototypes of every kernel: one per op shape. */
#define MHA_PROTO_fwd(name)                                                                        \
    void name(const mha__kernel_info *k, const mha__problem *p, const mha__fwd_unit *u,            \
              void *scratch);
#define MHA_PROTO_bwd(name)                                                                        \
    void name(const mha__bwd_problem *bp, int64_t b, int64_t g, void *scratch);
#define MHA_PROTO_decode(name)                                                                     \
    void name(const mha__dec_problem *p, const mha__dec_unit *u, float *o, float *m, float *l,     \
              float *scratch);
#define MHA_PROTO_gemm(name)                         extern const mha__gemm_kernel name;
#define MHA_KERNEL(op, dts, name, isa, p1, p2, maxd) MHA_PROTO_##op(name)
#include "kernels/registry.def"
#undef MHA_KERNEL

/* The whole table, every op, in registry order. */
int mha__registry_count(void);
const mha__kernel_info *mha__registry_at(int index); /* NULL when out of range */
int mha__registry_index(const mha__kernel_info *k);
const mha__kernel_info *mha__registry_find(const char *name); /* NULL when unknown */
/* The dtype set as text, e.g. "f32,bf16,f16" or "bf16" (static string). */
const char *mha__dts_name(unsigned dtypes);
/* "fwd", "bwd", "decode", "gemm". */
const char *mha__op_name(mha__op op);
/* The tier of a kernel: "avx512", "avx2", "neon", "generic" or "ref". */
const char *mha__kernel_tier(const mha__kernel_info *k);
/* Nonzero when this CPU has k's ISA under MHA_MAX_ISA (detected = 1: without the cap). */
int mha__kernel_usable(const mha__kernel_info *k, int detected);
/* Nonzero when AUTO selection may take k: usable, and not a bf16-tile line (tier avx512bf16) on a
 * CPU where those run slower than the float32 kernels (mha__cpu_bf16_tiles_fast). A usable line
 * that is not preferred still runs by name (MHA_KERNEL, mha_experimental_attention_with_kernel). */
int mha__kernel_preferred(const mha__kernel_info *k);
/* The reference of an op, or its best preferred non-reference kernel (NULL if none). */
const mha__kernel_info *mha__registry_reference(mha__op op);
const mha__kernel_info *mha__registry_best(mha__op op);
/* mha__registry_best among the lines whose dtypes hold every bit of dts (MHA_DTS_*): the gemm
 * driver's pick for its operands' dtypes (a bf16-only line never takes a float32 operand). */
const mha__kernel_info *mha__registry_best_dt(mha__op op, unsigned dts);

#endif /* MHA_REGISTRY_H */

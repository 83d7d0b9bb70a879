/* SPDX-License-Identifier: MIT */
/* mha_experimental.h: UNSTABLE interfaces of libmha (they may change in any release): the
 * registry of every op's kernels (attention forward and backward, decode, GEMM), which one each op
 * runs on this CPU, and running a chosen attention forward kernel. Used by tests/test_kernels.c,
 * tests/test_grad.c, `mha info`, the CLI's decode-bench and tools/output_hash.c. Include after
 * mha.h.
 *
 * Kernels are named mha_<op>_<types>_<algo>[_<blocks>]__<isa> (docs/KERNELS.md). Selection for
 * impl=AUTO/FAST takes the first kernel of the op, in registry order, that this CPU can run,
 * whose limits accept the problem and whose dtypes take its q, k and v. Two environment variables
 * exist for debugging and CI (the only ones the library reads, once, at the first call):
 * MHA_MAX_ISA=generic|avx2|avx512|avx512bf16 pretend the CPU has at most this ISA;
 * MHA_KERNEL=<name> the attention forward with impl=AUTO/FAST runs exactly this kernel, or fails
 * with MHA_STATUS_UNSUPPORTED when it cannot run the problem here.
 */
#ifndef MHA_EXPERIMENTAL_H
#define MHA_EXPERIMENTAL_H

#include "mha.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mha_kernel_desc {
    const char *name;     /* static string, e.g. "mha_fwd_f32_flash_q64k64__avx512" */
    const char *isa;      /* "avx512", "avx2", "generic" or "ref" */
    int32_t block_q;      /* fwd/bwd: query rows per block (positions x heads of a kv group);
                             decode: keys per work unit; gemm: MR rows of the register tile;
                             0 = ref */
    int32_t block_k;      /* fwd/bwd: keys per tile; gemm: NR columns; otherwise 0 */
    int64_t max_head_dim; /* largest head_dim / v_head_dim accepted; 0 = unlimited */
    int32_t usable;       /* nonzero: this CPU (under MHA_MAX_ISA) can run it */
    int32_t reference;    /* nonzero: the reference implementation (impl=REFERENCE) */
    const char *op;       /* "fwd", "bwd", "decode" or "gemm" */
    const char *dtypes;   /* storage dtypes of the activations it takes, comma separated, from
                             "f32,bf16,f16" (fwd/bwd: q, k and v each; decode: the KV cache;
                             gemm: its operands); a forward kernel runs a problem only when
                             q, k and v are all in it */
    int32_t preferred;    /* nonzero: usable, and impl=AUTO/FAST may select it here (0 for a
                             usable bf16-tile line on a CPU where the float32 kernels run bf16
                             faster: mha_experimental_cpu_bf16_tiles) */
} mha_kernel_desc;

/** Number of kernels in the registry (all built kernels of every op, usable here or not). */
MHA_API int32_t mha_experimental_kernel_count(void);
/** Describes kernel `index` (0 .. count-1, registry order = priority). */
MHA_API mha_status mha_experimental_kernel_describe(int32_t index,
                                                    mha_kernel_desc *desc,
                                                    mha_error *err);
/** Index of the kernel called `name`, or -1. */
MHA_API int32_t mha_experimental_kernel_find(const char *name);
/** Index of the kernel op "bwd", "decode" or "gemm" runs on this CPU (under MHA_MAX_ISA) with
 *  impl=AUTO/FAST, or -1 for an unknown op. For "fwd" the choice depends on the problem: this
 *  gives the best usable forward kernel; mha_experimental_attention_select() gives the one a
 *  problem runs. */
MHA_API int32_t mha_experimental_kernel_active(const char *op);
/** The ISAs this CPU has, best first, space separated ("avx512 avx2 generic"), as detected by
 *  cpuid/XGETBV when capped == 0, or after the MHA_MAX_ISA cap when capped != 0. Static string. */
MHA_API const char *mha_experimental_cpu_isas(int32_t capped);
/** The cache level (1 or 2) the split-KV decode kernels' software prefetches of K and V fill on
 *  this CPU: 2 on AMD Zen 4 (family 0x19 with AVX-512), 1 elsewhere: AMD Zen 5 (family 0x1A) and
 *  later, Intel, aarch64 (docs/INFERENCE.md "Paged vs contiguous, measured"). Detected, not capped
 *  by MHA_MAX_ISA. Changes no result. */
MHA_API int32_t mha_experimental_cpu_prefetch_level(void);
/** The same for the projection GEMMs' few-rows path (the layer step's weights): 2 on AMD with
 *  AVX-512 (Zen 4 and later), 1 elsewhere (docs/performance.md). Changes no result. */
MHA_API int32_t mha_experimental_cpu_gemm_prefetch_level(void);
/** 1 when impl=AUTO/FAST runs the bf16-tile kernels (AVX512-BF16 `vdpbf16ps`: the forward's
 *  and the projection GEMM's; docs/SEMANTICS.md "bf16 tile products") for bf16 operands: AMD CPUs
 *  with AVX512-BF16 (Zen 4 and later) under MHA_MAX_ISA. 0 elsewhere, Intel included, where the
 *  float32 kernels (bf16 widened exactly) were measured faster: bf16 operands then give the
 *  float32 kernels' results. */
MHA_API int32_t mha_experimental_cpu_bf16_tiles(void);
/** 1 when this CPU has AMX-BF16 tiles (cpuid) and the OS saves tile state (XCR0), else 0. No
 *  AMX kernel is registered yet (docs/KERNELS.md, "Waiting for hardware"): `mha info` says so. */
MHA_API int32_t mha_experimental_cpu_amx_bf16(void);

/** The kernel mha_attention() would run for (args, exec): *index receives its registry index.
 *  Fails like mha_attention_supported() when nothing can run it. Does no work. */
MHA_API mha_status mha_experimental_attention_select(const mha_attention_args *args,
                                                     const mha_exec *exec,
                                                     int32_t *index,
                                                     mha_error *err);
/** mha_attention() with kernel `index` forced (exec->impl and MHA_KERNEL are ignored). Fails with
 *  MHA_STATUS_UNSUPPORTED and a message when that kernel cannot run the problem on this CPU, and
 *  with MHA_STATUS_INVALID_ARG when `index` is not an attention forward kernel. */
MHA_API mha_status mha_experimental_attention_with_kernel(int32_t index,
                                                          const mha_attention_args *args,
                                                          const mha_exec *exec,
                                                          mha_error *err);
/** Workspace mha_experimental_attention_with_kernel() needs. */
MHA_API mha_status
mha_experimental_attention_workspace_size_with_kernel(int32_t index,
                                                      const mha_attention_args *args,
                                                      const mha_exec *exec,
                                                      size_t *bytes,
                                                      mha_error *err);

/** The pool block of table entry `entry` of sequence `seq` of a paged cache (positions' slots
 *  [entry B, entry B + B) of the sequence, B = block_size): its block id in [0, num_blocks), or
 *  -1 when the entry holds none, the arguments are out of range or the cache is contiguous or
 *  NULL. Shows where the placement policy put a sequence's blocks (docs/INFERENCE.md "Block
 *  placement"); the ids change no result. */
MHA_API int64_t mha_experimental_kv_cache_block(const mha_kv_cache *cache,
                                                int64_t seq,
                                                int64_t entry);

/** mha_kv_cache_create with the order of a q8_0 cache chosen instead of taken by itself:
 *  interleaved = 1 asks for the KEY-INTERLEAVED order (groups of 16 positions whose bytes are
 *  reordered for AVX512-VNNI's VPDPBUSD; docs/INFERENCE.md, "A key-interleaved q8_0 layout with
 *  VNNI"), 0 for ggml's rows. mha_kv_cache_create takes the interleaved order where the decode
 *  kernel selected for this CPU reads it (AVX-512 with VNNI and VBMI, unless MHA_MAX_ISA caps it
 *  away) and the cache is contiguous or its block_size a multiple of 16. The values, scales and
 *  rounding are the same in both orders; every kernel reads both (the generic one dequantising),
 *  and results differ only by float32 rounding. INVALID_ARG for interleaved = 1 unless dtype is
 *  MHA_DTYPE_Q8_0 and the cache is contiguous or its block_size a multiple of 16; otherwise as
 *  mha_kv_cache_create. For tests and benchmarks that compare the orders. */
MHA_API mha_status mha_experimental_kv_cache_create_q8_order(const mha_kv_cache_config *config,
                                                             const mha_layer *layer,
                                                             const mha_allocator *allocator,
                                                             int32_t interleaved,
                                                             mha_kv_cache **out,
                                                             mha_error *err);
/** 1 when q8_0 caches created now (contiguous, or block_size a multiple of 16) take the
 *  key-interleaved order by themselves: its kernel runs on this CPU under MHA_MAX_ISA (AVX-512
 *  with VNNI and VBMI) and was measured faster than the rows kernel here (AMD Zen 5 and later). */
MHA_API int32_t mha_experimental_cpu_q8x16(void);
/** 1 when the cache holds q8_0 in the key-interleaved order, 0 otherwise, -1 for NULL. */
MHA_API int32_t mha_experimental_kv_cache_q8x16(const mha_kv_cache *cache);

#ifdef __cplusplus
}
#endif
#endif /* MHA_EXPERIMENTAL_H */

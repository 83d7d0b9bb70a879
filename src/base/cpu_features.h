/* SPDX-License-Identifier: MIT */
/* cpu_features.h: what this CPU (and its OS) can run, as MHA_ISA_* bits, detected once, and the
 * two debug overrides of the environment (read once, at the first call that needs them):
 *   MHA_MAX_ISA=generic|avx2|avx512|avx512bf16 (x86), generic|neon (aarch64)
 *                                         pretend the CPU has at most this ISA (unknown values,
 *                                         another architecture's tiers too: no cap)
 *   MHA_KERNEL=<name>                     the forward dispatch runs exactly this kernel
 *                                         (dispatch.c)
 * Nothing else in the environment changes what the library does.
 */
#ifndef MHA_CPU_FEATURES_H
#define MHA_CPU_FEATURES_H

/* ISA feature sets. A set includes what the files of its tier are compiled with (CMakeLists.txt,
 * by file name suffix) and is detected by cpu_features.c: */
#define MHA_ISA_AVX2       (1u << 0) /* AVX, AVX2, FMA, F16C; the OS saves YMM state */
#define MHA_ISA_AVX512     (1u << 1) /* MHA_ISA_AVX2 + AVX-512 F/DQ/BW/VL; the OS saves ZMM/opmask */
#define MHA_ISA_NEON       (1u << 2) /* AArch64 Advanced SIMD with FP (HWCAP_ASIMD; baseline) */
/* MHA_ISA_AVX512 + AVX512_BF16 (CPUID.(EAX=7, ECX=1):EAX[5]: vcvtne2ps2bf16, vdpbf16ps; Zen 4/5,
 * Cooper Lake, Sapphire Rapids and later) */
#define MHA_ISA_AVX512BF16 (1u << 3)
/* MHA_ISA_AVX512 + AVX512_VNNI and AVX512_VBMI (CPUID.(EAX=7, ECX=0):ECX[11] and [1]: vpdpbusd,
 * vpermb; Intel Ice Lake servers and later, AMD Zen 4/5). An add-on of the avx512 tier, not a
 * tier: a cap that keeps MHA_ISA_AVX512 keeps it (MHA_ISA_WITH_ADDONS). Only the interleaved
 * q8_0 decode kernel needs it. */
#define MHA_ISA_AVX512VNNI (1u << 4)

/* The bits a cap to a tier's bits keeps: the tier's and its add-ons'. */
#define MHA_ISA_WITH_ADDONS(bits) ((bits) | ((bits)&MHA_ISA_AVX512 ? MHA_ISA_AVX512VNNI : 0u))

/* The tiers of the target architecture, best first: the bits a tier's kernels may use (its own
 * and those below it) and its name (the suffix of its kernels' names after "__";
 * MHA_MAX_ISA=<name> caps to those bits). The generic tier uses none and is always last. */
#if defined(__x86_64__) || defined(__i386__)
#    define MHA_ISA_TIERS(X)                                                                       \
        X(MHA_ISA_AVX512BF16 | MHA_ISA_AVX512 | MHA_ISA_AVX2, "avx512bf16")                        \
        X(MHA_ISA_AVX512 | MHA_ISA_AVX2, "avx512")                                                 \
        X(MHA_ISA_AVX2, "avx2")                                                                    \
        X(0u, "generic")
#elif defined(__aarch64__)
#    define MHA_ISA_TIERS(X)                                                                       \
        X(MHA_ISA_NEON, "neon")                                                                    \
        X(0u, "generic")
#else
#    define MHA_ISA_TIERS(X) X(0u, "generic")
#endif

/* MHA_ISA_* bits of this CPU, capped by MHA_MAX_ISA. */
unsigned mha__cpu_isa(void);
/* MHA_ISA_* bits of this CPU, without the cap. */
unsigned mha__cpu_isa_detected(void);
/* The tier names a set of bits allows, best first, space separated ("avx2 generic"). */
const char *mha__cpu_isa_list(unsigned isa);
/* 1 when software prefetches of data streamed from memory (the decode kernels' K and V rows) should
 * fill the L2 (PREFETCHT1) rather than the L1 (PREFETCHT0): AMD CPUs with AVX-512 (Zen 4 and
 * later; detected, not capped by MHA_MAX_ISA: a property of the memory system). On Zen 4 the
 * L1-filling hint ran the decode step at 35-55% of the read bandwidth, the L2 one at 50-75%
 * (docs/performance.md). 0 elsewhere: Intel, where the L1 hint was tuned, and AMD Zen 1, where it
 * measured 79-85%. Prefetch hints change no result. */
int mha__cpu_prefetch_to_l2(void);
/* The same for the split-KV decode kernels' K and V rows: mha__cpu_prefetch_to_l2, except on AMD
 * Zen 5 (family 0x1A) and later: 0 there. On Zen 5 (1 thread, AVX-512, L = 32768) the L1 hint
 * ran the paged cache's decode (blocks of 16-64 rows scattered over the pool, a new stream for
 * the L1's hardware prefetcher at each block) 7-15% faster and the contiguous cache's no slower
 * (docs/INFERENCE.md "Paged vs contiguous, measured"); the GEMMs keep the L2 hint. */
int mha__cpu_decode_prefetch_to_l2(void);
/* 1 when the AVX-512 decode kernel may add a second software prefetch of its K and V rows, a
 * longer distance ahead with the non-temporal hint (PREFETCHNTA), to its MHA_DEC_PREFETCH one
 * (float32 and bfloat16 caches, calls that read more than the L3: decode.c far_prefetch): AMD
 * Zen 5 (family 0x1A) and later (detected, not capped by MHA_MAX_ISA), where it ran the paged
 * cache's decode (blocks of 16 rows, shuffled) 10-20% faster and the contiguous cache's up to 8%
 * faster (docs/INFERENCE.md "Paged vs contiguous, measured"). 0 elsewhere (not measured). */
int mha__cpu_decode_prefetch_far(void);
/* 1 when AUTO selection takes the avx512bf16 tier's bf16-tile kernels (the forward's and the
 * projection GEMM's, VDPBF16PS) for bf16 operands: AMD CPUs with AVX512-BF16 (Zen 4 and later),
 * where they ran 1.4-2.0x their float32 kernels (Zen 5, docs/performance.md). 0 on Intel: on the
 * Emerald Rapids host a 512-bit VDPBF16PS issues every 2.2 cycles against an FMA's 0.55 (half the
 * multiply-adds per cycle), and the float32 kernels, which widen bf16 exactly, ran the same bf16
 * problems faster (docs/performance.md, session 45). Detected, not capped by MHA_MAX_ISA (the
 * tier itself is); the bf16-tile kernels stay usable there (MHA_KERNEL, the tests run them). */
int mha__cpu_bf16_tiles_fast(void);
/* 1 when q8_0 KV caches take the key-interleaved order by themselves (mha_kv_cache_create; its
 * kernel, decode_q8x16_avx512vnni.c, still needs MHA_ISA_AVX512VNNI under MHA_MAX_ISA): AMD Zen 5
 * (family 0x1A) and later, where its decode step ran 1.4x the rows kernel's from memory on one
 * thread and 1.3-1.5x on two (docs/INFERENCE.md). 0 elsewhere: Intel, where an earlier version ran
 * slower than the rows kernel from memory (session 49), and AMD Zen 4 (not measured). Detected,
 * not capped. */
int mha__cpu_q8x16_preferred(void);
/* 1 when this CPU has AMX-BF16 tiles and the OS saves their state. Reported by `mha info` only:
 * no AMX kernel is registered yet (none has passed its tests on an AMX host; docs/KERNELS.md). */
int mha__cpu_has_amx_bf16(void);
/* MHA_KERNEL, or NULL when unset or empty. */
const char *mha__cpu_forced_kernel(void);

#endif /* MHA_CPU_FEATURES_H */

/* SPDX-License-Identifier: MIT */
/* cpu_features.c: CPU feature detection (cpuid + XGETBV on x86, getauxval(AT_HWCAP) on aarch64;
 * other architectures have the generic tier only) and the debug overrides, read once
 * (pthread_once): the only process-wide state of the library, written once and read-only
 * afterwards. */
#include "base/cpu_features.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#    include <cpuid.h>
#elif defined(__aarch64__)
#    include <sys/auxv.h>
#    ifndef HWCAP_ASIMD
#        define HWCAP_ASIMD (1ul << 1) /* asm/hwcap.h */
#    endif
#endif

static unsigned g_detected, g_capped;
static int g_prefetch_l2, g_decode_prefetch_l2;
static int g_decode_prefetch_far;
static int g_bf16_tiles_fast;     /* AUTO takes the bf16-tile kernels (cpu_features.h) */
static int g_q8x16_preferred;     /* q8_0 caches take the interleaved order (cpu_features.h) */
static int g_amx_bf16;            /* detected only: no AMX kernel is registered (docs/KERNELS.md) */
static const char *g_forced_name; /* MHA_KERNEL, or NULL */
static char g_forced_buf[128];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__) || defined(__i386__)
static uint64_t read_xcr0(void) {
    uint32_t eax, edx;
    /* XGETBV with ECX = 0 (only executed when CPUID reports OSXSAVE). */
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static unsigned detect_isa(void) {
    unsigned a, b, c, d, isa = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1;
    const int f16c = (c >> 29) & 1;
    if (!osxsave || !avx)
        return 0;
    const uint64_t xcr0 = read_xcr0();
    const int ymm_state = (xcr0 & 0x6) == 0x6;   /* SSE and AVX state */
    const int zmm_state = (xcr0 & 0xe6) == 0xe6; /* + opmask, ZMM_Hi256, Hi16_ZMM */
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1;
    const int avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    if (ymm_state && avx2 && fma && f16c)
        isa |= MHA_ISA_AVX2;
    if ((isa & MHA_ISA_AVX2) && zmm_state && avx512f && avx512dq && avx512bw && avx512vl)
        isa |= MHA_ISA_AVX512;
    if ((isa & MHA_ISA_AVX512) && ((c >> 11) & 1) && ((c >> 1) & 1)) /* AVX512_VNNI, _VBMI */
        isa |= MHA_ISA_AVX512VNNI;
    /* Leaf 7's subleaf count is EAX of subleaf 0; AVX512_BF16 is subleaf 1's EAX bit 5. */
    if ((isa & MHA_ISA_AVX512) && a >= 1) {
        unsigned a1, b1, c1, d1;
        __cpuid_count(7, 1, a1, b1, c1, d1);
        if ((a1 >> 5) & 1)
            isa |= MHA_ISA_AVX512BF16;
    }
    return isa;
}

/* CPUID leaf 0's vendor string is "AuthenticAMD" (EBX, EDX, ECX = "Auth", "enti", "cAMD"). */
static int vendor_is_amd(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u &&
           c == 0x444d4163u;
}

static int detect_prefetch_l2(unsigned isa) {
    return (isa & MHA_ISA_AVX512) && vendor_is_amd();
}

/* CPUID leaf 1's family: the base family (EAX bits 8-11) plus the extended one (bits 20-27) when
 * the base is 15 (AMD Zen 4: 0x19, Zen 5: 0x1A). */
static unsigned cpu_family(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const unsigned base = (a >> 8) & 0xF;
    return base == 0xF ? base + ((a >> 20) & 0xFF) : base;
}

static int detect_decode_prefetch_l2(int prefetch_l2) {
    return prefetch_l2 && cpu_family() < 0x1A;
}

/* A second, longer decode prefetch distance: AMD Zen 5 (family 0x1A) and later, where it was
 * measured (cpu_features.h). */
static int detect_decode_prefetch_far(void) {
    return vendor_is_amd() && cpu_family() >= 0x1A;
}

/* bf16-tile kernels preferred: AMD with AVX512-BF16, where they were measured faster
 * (cpu_features.h) */
static int detect_bf16_tiles_fast(unsigned isa) {
    return (isa & MHA_ISA_AVX512BF16) && vendor_is_amd();
}

/* q8_0 caches interleaved by themselves: AMD Zen 5 and later, where it was measured faster
 * (cpu_features.h) */
static int detect_q8x16_preferred(void) {
    return vendor_is_amd() && cpu_family() >= 0x1A;
}

/* AMX-TILE and AMX-BF16: CPUID leaf 7 subleaf 0 EDX bits 24 and 22, and the OS saving tile state
 * (XCR0 bits 17, 18). Linux still grants the tiles per process (arch_prctl); nothing asks yet. */
static int detect_amx_bf16(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7 || !__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1))
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return ((d >> 24) & 1) && ((d >> 22) & 1) && (read_xcr0() & 0x60000) == 0x60000;
}
#elif defined(__aarch64__)
/* Advanced SIMD is architecturally required on Linux/aarch64; the kernel still reports it, and
 * a kernel built without it (never seen) would leave the generic tier. */
static unsigned detect_isa(void) {
    return (getauxval(AT_HWCAP) & HWCAP_ASIMD) ? MHA_ISA_NEON : 0u;
}
#else
static unsigned detect_isa(void) {
    return 0;
}
#endif
#if !defined(__x86_64__) && !defined(__i386__)
static int detect_prefetch_l2(unsigned isa) {
    (void)isa;
    return 0;
}
static int detect_decode_prefetch_l2(int prefetch_l2) {
    return prefetch_l2;
}
static int detect_decode_prefetch_far(void) {
    return 0;
}
static int detect_bf16_tiles_fast(unsigned isa) {
    (void)isa;
    return 0;
}
static int detect_q8x16_preferred(void) {
    return 0;
}
static int detect_amx_bf16(void) {
    return 0;
}
#endif

static void init_once(void) {
    g_detected = detect_isa();
    g_capped = g_detected;
    g_prefetch_l2 = detect_prefetch_l2(g_detected);
    g_decode_prefetch_l2 = detect_decode_prefetch_l2(g_prefetch_l2);
    g_decode_prefetch_far = detect_decode_prefetch_far();
    g_amx_bf16 = detect_amx_bf16();
    g_bf16_tiles_fast = detect_bf16_tiles_fast(g_detected);
    g_q8x16_preferred = detect_q8x16_preferred();
    const char *cap = getenv("MHA_MAX_ISA");
    /* A tier name caps the bits to those of that tier; unknown values leave the detection. */
#define MHA_CAP_TO(bits, name)                                                                     \
    if (cap && strcmp(cap, name) == 0)                                                             \
        g_capped &= MHA_ISA_WITH_ADDONS(bits);
    MHA_ISA_TIERS(MHA_CAP_TO)
#undef MHA_CAP_TO
    const char *forced = getenv("MHA_KERNEL");
    if (forced && forced[0]) {
        strncpy(g_forced_buf, forced, sizeof g_forced_buf - 1);
        g_forced_name = g_forced_buf;
    }
}

unsigned mha__cpu_isa(void) {
    pthread_once(&g_once, init_once);
    return g_capped;
}

unsigned mha__cpu_isa_detected(void) {
    pthread_once(&g_once, init_once);
    return g_detected;
}

int mha__cpu_has_amx_bf16(void) {
    pthread_once(&g_once, init_once);
    return g_amx_bf16;
}

int mha__cpu_bf16_tiles_fast(void) {
    pthread_once(&g_once, init_once);
    return g_bf16_tiles_fast;
}

int mha__cpu_q8x16_preferred(void) {
    pthread_once(&g_once, init_once);
    return g_q8x16_preferred;
}

int mha__cpu_prefetch_to_l2(void) {
    pthread_once(&g_once, init_once);
    return g_prefetch_l2;
}

int mha__cpu_decode_prefetch_to_l2(void) {
    pthread_once(&g_once, init_once);
    return g_decode_prefetch_l2;
}

int mha__cpu_decode_prefetch_far(void) {
    pthread_once(&g_once, init_once);
    return g_decode_prefetch_far;
}

const char *mha__cpu_forced_kernel(void) {
    pthread_once(&g_once, init_once);
    return g_forced_name;
}

const char *mha__cpu_isa_list(unsigned isa) {
    /* " avx512bf16 avx512 avx2 generic": the answer is its tail from the best tier whose bits isa
     * has, found by offset (a name may be a prefix of another's: avx512, avx512bf16). */
    static const char all[] = ""
#define MHA_TIER_NAME(bits, name) " " name
        MHA_ISA_TIERS(MHA_TIER_NAME)
#undef MHA_TIER_NAME
        ;
    size_t at = 0;
#define MHA_TIER_PICK(bits, name)                                                                  \
    if (((bits)&isa) == (bits))                                                                    \
        return all + at + 1;                                                                       \
    at += sizeof(name); /* the name and its leading space */
    MHA_ISA_TIERS(MHA_TIER_PICK)
#undef MHA_TIER_PICK
    return all + 1;
}

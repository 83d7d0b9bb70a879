/* SPDX-License-Identifier: MIT */
/* dispatch.c: the kernel registry (built from kernels/kernels.def), CPU feature detection,
 * kernel selection with its two debug overrides, and the threaded driver that cuts a problem into
 * work units and hands them to threads. Also the experimental registry API (mha_experimental.h).
 *
 * Feature detection and the environment are read once (pthread_once). MHA_MAX_ISA and MHA_KERNEL
 * are documented debug overrides (mha_experimental.h, docs/KERNELS.md); nothing else in the
 * environment changes what the library does.
 */
#include "kernels/flash_fwd.h"
#include "kernels/kernels.h"
#include "mha_experimental.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#    include <cpuid.h>
#endif

/* ---------------------------------------------------------------------------------------------- */
/* The registry.                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

static const mha__kernel_info registry[] = {
#define MHA_KERNEL(name_, isa_, bq_, bk_, maxd_)                                                   \
    {.name = #name_, .isa = (isa_), .bq = (bq_), .bk = (bk_), .max_d = (maxd_), .fn = name_},
#include "kernels/kernels.def"
#undef MHA_KERNEL
};
#define REGISTRY_SIZE ((int)(sizeof registry / sizeof registry[0]))

/* The reference as a registry entry: one unit is whole heads [h0, h1) of batch row b. */
void mha_fwd_f32_naive__ref(const mha__problem *p, const mha__fwd_unit *u, void *scratch) {
    MHA_ASSERT(u->i0 == 0 && u->i1 == p->n);
    mha__attention_ref(p, u->b * p->H + u->h0, u->b * p->H + u->h1, scratch);
}

static const char *isa_suffix(const mha__kernel_info *k) {
    const char *s = strstr(k->name, "__");
    return s ? s + 2 : k->name;
}

static bool is_reference(const mha__kernel_info *k) {
    return k->bq == 0;
}

int mha__kernel_count(void) {
    return REGISTRY_SIZE;
}

const mha__kernel_info *mha__kernel_at(int index) {
    return index >= 0 && index < REGISTRY_SIZE ? &registry[index] : NULL;
}

int mha__kernel_index(const mha__kernel_info *k) {
    return (int)(k - registry);
}

const mha__kernel_info *mha__kernel_reference(void) {
    for (int i = 0; i < REGISTRY_SIZE; i++)
        if (is_reference(&registry[i]))
            return &registry[i];
    MHA_ASSERT(0);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* CPU features and the environment, once.                                                        */
/* ---------------------------------------------------------------------------------------------- */

static unsigned g_detected, g_capped;
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
    return isa;
}
#else
static unsigned detect_isa(void) {
    return 0;
}
#endif

static void init_once(void) {
    g_detected = detect_isa();
    g_capped = g_detected;
    const char *cap = getenv("MHA_MAX_ISA");
    if (cap) {
        if (strcmp(cap, "generic") == 0)
            g_capped = 0;
        else if (strcmp(cap, "avx2") == 0)
            g_capped &= MHA_ISA_AVX2;
        /* "avx512" and unknown values leave the detection as it is. */
    }
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

static const char *isa_list(unsigned isa) {
    if (isa & MHA_ISA_AVX512)
        return "avx512 avx2 generic";
    if (isa & MHA_ISA_AVX2)
        return "avx2 generic";
    return "generic";
}

/* ---------------------------------------------------------------------------------------------- */
/* Selection.                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

void mha__fwd_shape_from_args(const mha_attention_args *a, mha__fwd_shape *s) {
    /* Unvalidated: clamp to >= 1 so sizes stay meaningful; validation reports the real error. */
    const int64_t H = a->num_heads > 0 ? a->num_heads : 1;
    const int64_t G = a->num_kv_heads > 0 ? a->num_kv_heads : H;
    s->H = H;
    s->G = G;
    s->group = (G <= H && H % G == 0) ? H / G : 1;
    s->n = a->q_len > 0 ? a->q_len : 1;
    s->m = a->kv_len > 0 ? a->kv_len : 1;
    s->dk = a->head_dim > 0 ? a->head_dim : 1;
    s->dv = a->v_head_dim > 0 ? a->v_head_dim : s->dk;
}

mha_status mha__kernel_check(const mha__kernel_info *k, const mha__fwd_shape *s, mha_error *err) {
    const unsigned have = mha__cpu_isa();
    if (k->isa & ~have)
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "kernel %s needs the %s instruction set, which this CPU %s", k->name,
                         isa_suffix(k),
                         (k->isa & ~g_detected) ? "does not have" : "has but MHA_MAX_ISA caps");
    if (k->max_d && (s->dk > k->max_d || s->dv > k->max_d))
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "head_dim=%lld, v_head_dim=%lld: kernel %s takes head sizes up to %lld",
                         (long long)s->dk, (long long)s->dv, k->name, (long long)k->max_d);
    size_t bytes;
    if (!mha__kernel_scratch_bytes(k, s, &bytes))
        return mha__fail(err, MHA_STATUS_OVERFLOW, "kernel %s: scratch size overflows", k->name);
    return MHA_STATUS_OK;
}

mha_status mha__kernel_select(const mha__fwd_shape *s,
                              mha_impl impl,
                              const mha__kernel_info **out,
                              mha_error *err) {
    pthread_once(&g_once, init_once);
    if (g_forced_name) {
        for (int i = 0; i < REGISTRY_SIZE; i++)
            if (strcmp(registry[i].name, g_forced_name) == 0) {
                *out = &registry[i];
                mha_status st = mha__kernel_check(&registry[i], s, err);
                if (st && err) {
                    char msg[MHA_ERROR_MESSAGE_SIZE];
                    memcpy(msg, err->message, sizeof msg);
                    mha__fail(err, st, "MHA_KERNEL=%s: %.400s", g_forced_name, msg);
                }
                return st;
            }
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "MHA_KERNEL=%.100s is not a kernel of this build (`mha info` lists them)",
                         g_forced_name);
    }
    mha_status last = MHA_STATUS_UNSUPPORTED;
    for (int i = 0; i < REGISTRY_SIZE; i++) {
        const mha__kernel_info *k = &registry[i];
        if (is_reference(k)) {
            if (impl == MHA_IMPL_AUTO) {
                *out = k;
                return MHA_STATUS_OK;
            }
            continue;
        }
        if (k->isa & ~mha__cpu_isa())
            continue;
        last = mha__kernel_check(k, s, err);
        if (last == MHA_STATUS_OK) {
            *out = k;
            return MHA_STATUS_OK;
        }
    }
    /* impl=fast and no fast kernel takes the problem: the last check's message names why. */
    if (err && last != MHA_STATUS_UNSUPPORTED) /* e.g. OVERFLOW */
        return last;
    if (err) {
        char msg[MHA_ERROR_MESSAGE_SIZE];
        memcpy(msg, err->message, sizeof msg);
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "impl=fast: no fast kernel runs this problem (%.400s); use impl=auto or "
                         "reference",
                         msg);
    }
    return MHA_STATUS_UNSUPPORTED;
}

bool mha__kernel_scratch_bytes(const mha__kernel_info *k, const mha__fwd_shape *s, size_t *bytes) {
    if (is_reference(k)) /* the row's scores and one block sum of O (attention_ref.c) */
        return s->dv <= INT64_MAX - s->m && mha__bytes(s->m + s->dv, sizeof(float), bytes);
    return mha__flash_scratch_bytes(k->bq, k->bk, s->dk, s->dv, s->m, bytes);
}

/* ---------------------------------------------------------------------------------------------- */
/* Work units and threads.                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* Units in order b, kv group, head block, query block (consecutive units share K/V in cache).
 * With averaged probabilities one unit takes every head of its query block, so that each
 * element of the [B, n, m] map is summed by one thread, over heads in order. */
typedef struct unit_space {
    const mha__kernel_info *k;
    const mha__problem *p;
    int64_t hpb, nq;     /* heads per block, query rows per block */
    int64_t head_blocks; /* per batch row: G * ceil(group / hpb), or 1 */
    int64_t q_blocks;    /* ceil(n / nq) */
    int64_t count;
    int averaged;
    char *scratch;
    size_t scratch_stride;
    int parts;
    double total;
} unit_space;

static void unit_at(const unit_space *us, int64_t u, mha__fwd_unit *out) {
    const mha__problem *p = us->p;
    const int64_t qb = u % us->q_blocks, hb = (u / us->q_blocks) % us->head_blocks;
    out->b = u / (us->q_blocks * us->head_blocks);
    out->fresh = 0;
    out->i0 = qb * us->nq;
    out->i1 = out->i0 + us->nq < p->n ? out->i0 + us->nq : p->n;
    if (us->averaged) {
        out->h0 = 0;
        out->h1 = p->H;
        return;
    }
    const int64_t per_group = (p->group + us->hpb - 1) / us->hpb;
    const int64_t g = hb / per_group, c = hb % per_group;
    out->h0 = g * p->group + c * us->hpb;
    out->h1 = out->h0 + us->hpb < (g + 1) * p->group ? out->h0 + us->hpb : (g + 1) * p->group;
}

/* Relative cost of a unit: rows x key tiles visited (+1 tile of per-row overhead). */
static double unit_cost(const unit_space *us, const mha__fwd_unit *u) {
    const double rows = (double)(u->h1 - u->h0) * (double)(u->i1 - u->i0);
    if (is_reference(us->k))
        return rows * (double)us->p->m;
    return rows * (double)(mha__flash_visible_tiles(us->p, u->b, u->i0, u->i1, us->k->bk) + 1);
}

/* Part t runs the units whose cost midpoint falls in its share [t/T, (t+1)/T) of the total:
 * contiguous ranges with balanced cost (causal blocks late in the sequence cost more). */
static void run_part(void *ctx, int part, int64_t begin, int64_t end) {
    const unit_space *us = ctx;
    (void)begin, (void)end;
    void *scratch = us->scratch + (size_t)part * us->scratch_stride;
    double prefix = 0.0;
    int fresh = 1;
    for (int64_t u = 0; u < us->count; u++) {
        mha__fwd_unit unit;
        unit_at(us, u, &unit);
        const double c = unit_cost(us, &unit);
        int owner = (int)((prefix + 0.5 * c) / us->total * (double)us->parts);
        if (owner >= us->parts)
            owner = us->parts - 1;
        prefix += c;
        if (owner == part) {
            unit.fresh = fresh;
            fresh = 0;
            us->k->fn(us->p, &unit, scratch);
        } else if (owner > part) {
            break;
        }
    }
}

mha_status mha__kernel_run(const mha__kernel_info *k,
                           const mha__problem *p,
                           int n_threads,
                           char *scratch,
                           size_t scratch_stride,
                           mha_error *err) {
    unit_space us;
    memset(&us, 0, sizeof us);
    us.k = k;
    us.p = p;
    us.averaged = p->probs && p->average_probs;
    if (is_reference(k)) {
        us.hpb = 1;
        us.nq = p->n;
        us.head_blocks = us.averaged ? 1 : p->H;
    } else {
        us.hpb = mha__flash_heads_per_block(k->bq, p->group);
        us.nq = mha__flash_rows_per_block(k->bq, p->group);
        us.head_blocks = us.averaged ? 1 : p->G * ((p->group + us.hpb - 1) / us.hpb);
    }
    us.q_blocks = (p->n + us.nq - 1) / us.nq;
    us.count = p->B * us.head_blocks * us.q_blocks;
    us.scratch = scratch;
    us.scratch_stride = scratch_stride;
    if (n_threads < 1)
        n_threads = 1;
    us.parts = (int64_t)n_threads < us.count ? n_threads : (int)us.count;
    for (int64_t u = 0; u < us.count; u++) {
        mha__fwd_unit unit;
        unit_at(&us, u, &unit);
        us.total += unit_cost(&us, &unit);
    }
    if (us.parts <= 1) {
        us.parts = 1;
        for (int64_t u = 0; u < us.count; u++) {
            mha__fwd_unit unit;
            unit_at(&us, u, &unit);
            unit.fresh = u == 0;
            k->fn(p, &unit, scratch);
        }
        return MHA_STATUS_OK;
    }
    return mha__parallel_for(us.parts, us.parts, run_part, &us, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* mha_experimental.h                                                                             */
/* ---------------------------------------------------------------------------------------------- */

int32_t mha_experimental_kernel_count(void) {
    return REGISTRY_SIZE;
}

mha_status mha_experimental_kernel_describe(int32_t index, mha_kernel_desc *desc, mha_error *err) {
    MHA_RETURN_IF(!desc, err, INVALID_ARG, "desc is NULL");
    MHA_RETURN_IF(index < 0 || index >= REGISTRY_SIZE, err, INVALID_ARG,
                  "kernel index %d outside [0, %d)", (int)index, REGISTRY_SIZE);
    const mha__kernel_info *k = &registry[index];
    desc->name = k->name;
    desc->isa = isa_suffix(k);
    desc->block_q = k->bq;
    desc->block_k = k->bk;
    desc->max_head_dim = k->max_d;
    desc->usable = (k->isa & ~mha__cpu_isa()) == 0;
    desc->reference = is_reference(k);
    mha__ok(err);
    return MHA_STATUS_OK;
}

int32_t mha_experimental_kernel_find(const char *name) {
    if (name)
        for (int i = 0; i < REGISTRY_SIZE; i++)
            if (strcmp(registry[i].name, name) == 0)
                return i;
    return -1;
}

const char *mha_experimental_cpu_isas(int32_t capped) {
    return isa_list(capped ? mha__cpu_isa() : mha__cpu_isa_detected());
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
    const mha__kernel_info *k = mha__kernel_reference();
    if (impl != MHA_IMPL_REFERENCE) {
        st = mha__kernel_select(&s, impl, &k, err);
        if (st)
            return st;
    }
    *index = mha__kernel_index(k);
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_experimental_attention_with_kernel(int32_t index,
                                                  const mha_attention_args *args,
                                                  const mha_exec *exec,
                                                  mha_error *err) {
    MHA_RETURN_IF(index < 0 || index >= REGISTRY_SIZE, err, INVALID_ARG,
                  "kernel index %d outside [0, %d)", (int)index, REGISTRY_SIZE);
    return mha__attention_run(args, exec, &registry[index], err);
}

mha_status mha_experimental_attention_workspace_size_with_kernel(int32_t index,
                                                                 const mha_attention_args *args,
                                                                 const mha_exec *exec,
                                                                 size_t *bytes,
                                                                 mha_error *err) {
    MHA_RETURN_IF(index < 0 || index >= REGISTRY_SIZE, err, INVALID_ARG,
                  "kernel index %d outside [0, %d)", (int)index, REGISTRY_SIZE);
    return mha__attention_workspace(args, exec, &registry[index], bytes, err);
}

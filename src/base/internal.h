/* SPDX-License-Identifier: MIT */
/* internal.h: declarations shared by the library's own files (never installed).
 *
 * The public structs are checked once per call, by the checks of src/check/ (check/check.h), and
 * turned into an mha__problem whose every field is resolved (defaults filled, masks turned into
 * broadcast strides), so the parts below the entry points never re-check user input.
 */
#ifndef MHA_INTERNAL_H
#define MHA_INTERNAL_H

#include "mha.h"

#include <assert.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MHA_ASSERT(cond) assert(cond)

/* Fills err (if not NULL) with status and a printf-style message; returns status. */
mha_status mha__fail(mha_error *err, mha_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* Sets err to OK with an empty message. */
void mha__ok(mha_error *err);

/* Returns `status` with a formatted message from the enclosing function when cond holds
 * (zstd RETURN_ERROR_IF style). */
#define MHA_RETURN_IF(cond, err, status, ...)                                                      \
    do {                                                                                           \
        if (cond)                                                                                  \
            return mha__fail((err), MHA_STATUS_##status, __VA_ARGS__);                             \
    } while (0)

/* Returns the status of expr from the enclosing function unless it is OK (err already says why). */
#define MHA_TRY(expr)                                                                              \
    do {                                                                                           \
        const mha_status st_ = (expr);                                                             \
        if (st_ != MHA_STATUS_OK)                                                                  \
            return st_;                                                                            \
    } while (0)

/* Overflow-checked size arithmetic: return false on overflow or negative operands. */
bool mha__mul_i64(int64_t a, int64_t b, int64_t *out);
bool mha__add_i64(int64_t a, int64_t b, int64_t *out);
/* Product of n non-negative factors; false on overflow. */
bool mha__prod_i64(const int64_t *factors, int n, int64_t *out);
/* Bytes for `count` elements of `elem_size`, false if it does not fit in size_t / PTRDIFF_MAX. */
bool mha__bytes(int64_t count, size_t elem_size, size_t *out);

/* Allocation through an optional mha_allocator (NULL = malloc/free), 64-byte aligned. */
void *mha__alloc(const mha_allocator *a, size_t bytes);
/* mha__alloc for a large buffer the library streams through. When the memory is the library's
 * own (no caller allocator: a caller's memory is the caller's to advise), its 2 MiB-aligned
 * extents are advised to the OS as huge pages (Linux transparent huge pages, MADV_HUGEPAGE, which
 * Debian's default THP mode "madvise" honours; a no-op elsewhere; failures ignored). Used for KV
 * caches and copied weights, streamed from memory (a 4 KiB page holds only 8-16 rows of a KV
 * cache, and the prefetches run ahead into pages whose translations are not cached yet: a decode
 * step over a 32768-key cache ran 1.13-1.35x faster on AMD Zen 4), and for per-call buffers
 * (workspaces, the GEMM's packed W, backward scratch): 1/512 of the first-touch page faults (the
 * layer forward at (2048, 1024, 16) 1.06x there, a projection GEMM 1.04-1.05x).
 * docs/performance.md. Changes no result. */
void *mha__alloc_large(const mha_allocator *a, size_t bytes);
void mha__free(const mha_allocator *a, void *ptr);

/* x rounded up to a multiple of 64 (workspace layouts put every part on a cache line). The
 * callers keep x far below SIZE_MAX - 63 (sizes are overflow-checked first). */
static inline size_t mha__align64(size_t x) {
    return (x + 63) & ~(size_t)63;
}

/* Caller workspaces may have any alignment: the size a *_workspace_size query reports is the
 * `need` of its 64-byte aligned layout plus MHA_WORKSPACE_SLACK, and the call rounds the caller's
 * pointer up to 64 bytes before carving it. */
#define MHA_WORKSPACE_SLACK ((size_t)63)
/* Reported workspace size for a layout of `need` bytes; false on overflow. */
bool mha__workspace_bytes(size_t need, size_t *out);
/* The 64-byte aligned start of a workspace of `need` bytes: exec->workspace rounded up when the
 * caller gave one (WORKSPACE_TOO_SMALL naming `what` if it is too small for that), else a block
 * from exec->allocator returned in *owned too (free it with mha__free). */
mha_status mha__workspace_take(
    const mha_exec *exec, size_t need, const char *what, char **ws, char **owned, mha_error *err);

/* Largest single dimension accepted anywhere (keeps every index product far from overflow and
 * lets dropout pack indices into 32-bit Philox counter words). */
#define MHA_MAX_DIM ((int64_t)1 << 31)

/* ---------------------------------------------------------------------------------------------- */
/* A broadcast view of a mask: element (b, h, i, j) at data[b*s[0] + h*s[1] + i*s[2] + j*s[3]].   */
/* ---------------------------------------------------------------------------------------------- */
typedef struct mha__mask_view {
    const void *data; /* NULL = absent */
    mha_dtype dtype;
    int64_t strides[4];
} mha__mask_view;

/* The block mask of a call (core/mask_map.c): every ELEMENT rule (bool mask, key padding, segment
 * ids, an additive mask's -inf, the mask function) resolved once per call into a bit per score,
 *   bit (j % 64) of vis[b plane_b + h plane_h + i row_i + (j / 64) word_k] = row i of (b, h) sees
 *   key j,
 * with shared planes and rows wherever no rule varies along b, h or i (stride 0), so a [n, m]
 * mask broadcast over batch and heads costs n m / 8 bytes once. Words are stored column-major in
 * a plane (row_i = 1, word_k = rows): the 64 rows of a tile against one word of keys are 512
 * contiguous bytes, 8 cache lines, where a row-major map would touch 64. need_bias (same offsets,
 * a byte per 64 keys; NULL without an additive mask) is 1 where the additive mask is nonzero (and
 * not -inf) for some key of the word: a tile whose words are all 0 there needs no bias. The causal
 * and window bands stay rules (mha__flash_key_range): a tile's class is the band's AND the map's.
 * Kernels read only this, never the element masks (the additive values excepted, in tiles whose
 * need_bias says so), so a tile is hidden (skipped), visible (the unmasked kernel) or mixed (its
 * bits) at the cost of a word per row. */
typedef struct mha__mask_map {
    int64_t words;                           /* per row: ceil(m / 64) */
    int64_t plane_b, plane_h, row_i, word_k; /* element offsets (0: shared along that dimension) */
    uint64_t *vis;
    uint8_t *need_bias;
    int64_t *span; /* per map row: first and last key it sees (first > last: none), at
                      2 (b span_b + h span_h + i span_i): a unit's tiles outside every row's span
                      are never visited */
    int64_t span_b, span_h, span_i;
} mha__mask_map;

/* The span of row i of (b, h) in the map: [*lo, *hi], empty when *lo > *hi. */
static inline void
mha__map_span(const mha__mask_map *mm, int64_t b, int64_t h, int64_t i, int64_t *lo, int64_t *hi) {
    const int64_t row = b * mm->span_b + h * mm->span_h + i * mm->span_i;
    *lo = mm->span[2 * row];
    *hi = mm->span[2 * row + 1];
}

/* The offset of row i of (b, h) (its word 0). */
static inline int64_t mha__map_at(const mha__mask_map *mm, int64_t b, int64_t h, int64_t i) {
    return b * mm->plane_b + h * mm->plane_h + i * mm->row_i;
}

/* Keys [j0, j0 + 64) of the map row at `at` as one word (bit t = key j0 + t; 0 past the row). */
static inline uint64_t mha__map_word(const mha__mask_map *mm, int64_t at, int64_t j0) {
    const int64_t k = j0 / 64;
    const int sh = (int)(j0 % 64);
    const uint64_t lo = k < mm->words ? mm->vis[at + k * mm->word_k] : 0;
    const uint64_t hi = sh && k + 1 < mm->words ? mm->vis[at + (k + 1) * mm->word_k] : 0;
    return sh ? (lo >> sh) | (hi << (64 - sh)) : lo;
}

/* need_bias of the words that keys [j0, j0 + nk) of the map row at `at` touch. */
static inline int mha__map_bias(const mha__mask_map *mm, int64_t at, int64_t j0, int nk) {
    return mm->need_bias[at + (j0 / 64) * mm->word_k] |
           mm->need_bias[at + ((j0 + nk - 1) / 64) * mm->word_k];
}

/* The map's part of the class of keys [j0, j0 + nk) (nk <= 64 nwords) for row i of (b, h):
 * w[0 .. nwords) comes in with the band's bits (causal / window, or all ones) and leaves ANDed
 * with the map's; *bias is set (never cleared) when the additive mask must be added somewhere
 * there. HIDDEN: no bit; VISIBLE: all nk bits. */
static inline mha_tile_class mha__map_row_words(const mha__mask_map *mm,
                                                int64_t b,
                                                int64_t h,
                                                int64_t i,
                                                int64_t j0,
                                                int nk,
                                                int nwords,
                                                uint64_t *w,
                                                int *bias) {
    const int64_t at = mha__map_at(mm, b, h, i);
    uint64_t any = 0;
    int all = 1;
    for (int k = 0; k < nwords; k++) {
        const int rem = nk - 64 * k;
        const uint64_t full = rem >= 64 ? ~(uint64_t)0 : rem > 0 ? (((uint64_t)1 << rem) - 1) : 0;
        const uint64_t x = mha__map_word(mm, at, j0 + 64 * k) & w[k] & full;
        w[k] = x;
        any |= x;
        all &= x == full;
        if (mm->need_bias && rem > 0)
            *bias |= mha__map_bias(mm, at, j0 + 64 * k, rem < 64 ? rem : 64);
    }
    return !any ? MHA_TILE_HIDDEN : all ? MHA_TILE_VISIBLE : MHA_TILE_MIXED;
}

/* The resolved attention problem. Tensors are [B, heads, L, d] with strides {b, head, row}. */
typedef struct mha__problem {
    int64_t B, H, G, n, m, dk, dv;
    int64_t group; /* H / G: query head h reads kv head h / group */
    float scale;
    float softcap;             /* 0 = off */
    const float *alibi_slopes; /* [H] or NULL */
    const float *sinks;        /* [H] or NULL */

    const void *q, *k, *v; /* each of its storage dtype (F32, BF16 or F16) */
    int64_t qs[3], ks[3], vs[3];
    void *out;
    int64_t os[3];
    mha_dtype q_dt, k_dt, v_dt, o_dt;
    float *lse;
    float *probs;
    int average_probs;

    /* Masking, resolved. */
    int causal;
    const int64_t *delta; /* [B]: row i's diagonal is i + delta[b] */
    int use_window;
    int64_t window_left, window_right; /* -1 = unbounded */
    int64_t chunk;                     /* 0 = none; C > 0: floor(j / C) == floor(pos / C) */
    mha__mask_view bool_mask;          /* strides over (b, h, i, j) */
    mha_mask_polarity bool_polarity;
    mha__mask_view additive;    /* F32 */
    mha__mask_view key_padding; /* strides over (b, -, -, j): only [0] and [3] used */
    const int32_t *q_seg, *kv_seg;
    mha_mask_fn mask_fn;      /* visible == NULL: none */
    const mha__mask_map *map; /* NULL: no element rule (or not built: the reference) */

    float dropout_p;
    uint64_t dropout_seed;
    int dropout_on;
    int64_t dropout_row0, dropout_col0; /* mha_dropout.row_offset, col_offset */
} mha__problem;

/* Nonzero test of one element of an integer/bool mask. */
static inline int mha__mask_nonzero(const mha__mask_view *m, int64_t off) {
    switch (m->dtype) {
    case MHA_DTYPE_BOOL:
    case MHA_DTYPE_U8:
        return ((const uint8_t *)m->data)[off] != 0;
    case MHA_DTYPE_I32:
        return ((const int32_t *)m->data)[off] != 0;
    case MHA_DTYPE_I64:
        return ((const int64_t *)m->data)[off] != 0;
    default:
        return 0;
    }
}

/* floor(a / c) for c > 0 (C's / truncates toward zero; a row's position may be negative). */
static inline int64_t mha__floor_div(int64_t a, int64_t c) {
    const int64_t q = a / c;
    return q - (a % c < 0);
}

/* First key of the chunk of position pos (chunked attention, chunk size c > 0): c floor(pos/c). */
static inline int64_t mha__chunk_start(int64_t pos, int64_t c) {
    return c * mha__floor_div(pos, c);
}

/* True when every boolean rule lets query row i of (b, h) see key j. */
static inline int mha__visible(const mha__problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    const int64_t pos = i + p->delta[b];
    if (p->causal && j > pos)
        return 0;
    if (p->use_window) {
        if (p->window_left >= 0 && j < pos - p->window_left)
            return 0;
        if (p->window_right >= 0 && j > pos + p->window_right)
            return 0;
    }
    if (p->chunk && mha__floor_div(j, p->chunk) != mha__floor_div(pos, p->chunk))
        return 0;
    if (p->bool_mask.data) {
        const int64_t *s = p->bool_mask.strides;
        int nz = mha__mask_nonzero(&p->bool_mask, b * s[0] + h * s[1] + i * s[2] + j * s[3]);
        if ((p->bool_polarity == MHA_MASK_ATTEND) ? !nz : nz)
            return 0;
    }
    if (p->key_padding.data) {
        const int64_t *s = p->key_padding.strides;
        if (!mha__mask_nonzero(&p->key_padding, b * s[0] + j * s[3]))
            return 0;
    }
    if (p->q_seg && p->q_seg[b * p->n + i] != p->kv_seg[b * p->m + j])
        return 0;
    if (p->additive.data) { /* -inf hides the key like a boolean rule (docs/SEMANTICS.md) */
        const int64_t *s = p->additive.strides;
        if (((const float *)p->additive.data)[b * s[0] + h * s[1] + i * s[2] + j * s[3]] ==
            -INFINITY)
            return 0;
    }
    if (p->mask_fn.visible && !p->mask_fn.visible(p->mask_fn.ctx, p->mask_fn.per_batch ? b : 0,
                                                  p->mask_fn.per_head ? h : 0, i, j))
        return 0;
    return 1;
}

/* Nonzero when the problem has an element rule (one the block mask holds). */
static inline int mha__has_element_rules(const mha__problem *p) {
    return p->bool_mask.data || p->key_padding.data || p->q_seg || p->additive.data ||
           p->mask_fn.visible;
}

/* Additive bias on the (soft-capped) score: float mask + ALiBi. */
static inline float
mha__score_bias(const mha__problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    float bias = 0.0f;
    if (p->additive.data) {
        const int64_t *s = p->additive.strides;
        bias += ((const float *)p->additive.data)[b * s[0] + h * s[1] + i * s[2] + j * s[3]];
    }
    if (p->alibi_slopes) {
        int64_t dist = i + p->delta[b] - j;
        if (dist < 0)
            dist = -dist;
        bias -= p->alibi_slopes[h] * (float)dist;
    }
    return bias;
}

/* Dropout keep-test for element (b, h, i, j): Philox4x32-10, see mha_dropout in mha.h. */
int mha__dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j);

/* The dropout keep test of element (b, h, i, j) of the call: at its place (I, J) in the whole. */
static inline int
mha__problem_keep(const mha__problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    return mha__dropout_keep(p->dropout_seed, p->dropout_p, b, h, i + p->dropout_row0,
                             j + p->dropout_col0);
}
void mha__philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

/* ALiBi slopes for h heads (2^(-8(k+1)/h) for powers of two, BLOOM interpolation otherwise). */
void mha__alibi_slopes(int64_t h, float *slopes);

/* The threads a call may use (threads.c): up to n (>= 1), from `pool` when it is not NULL,
 * otherwise started per parallel region. */
typedef struct mha__team {
    int n;
    mha_threadpool *pool;
} mha__team;
/* Most threads a call uses and a pool holds (mha_threadpool_create's limit). */
#define MHA__MAX_THREADS 1024
/* The one resolution of exec's threads: exec->n_threads (0 = the pool's size, or every online
 * CPU without a pool), at most the pool's size and MHA__MAX_THREADS; negative n_threads is
 * INVALID_ARG. */
mha_status mha__exec_team(const mha_exec *exec, mha__team *team, mha_error *err);
/* n threads started per region, no pool (tests, benchmarks). */
static inline mha__team mha__team_of(int n) {
    mha__team t = {n < 1 ? 1 : n, NULL};
    return t;
}
/* The same team limited to n threads (at least 1). */
mha__team mha__team_at_most(mha__team team, int64_t n);
/* Below this many flops per thread a region uses fewer threads: waking or starting one (~20-50
 * us) would cost more than its share of the work. */
#define MHA__MIN_FLOPS_PER_THREAD (1 << 22)
/* The team limited so that each thread gets at least MHA__MIN_FLOPS_PER_THREAD of `flops`. */
mha__team mha__team_for_flops(mha__team team, double flops);
/* Fork-join over [0, count): fn(ctx, part, begin, end) on up to team.n threads; part
 * (0 .. parts-1) identifies the contiguous sub-range, e.g. to pick per-thread scratch. The split
 * depends only on count and the number of parts. */
typedef void (*mha__range_fn)(void *ctx, int part, int64_t begin, int64_t end);
mha_status
mha__parallel_for(mha__team team, int64_t count, mha__range_fn fn, void *ctx, mha_error *err);
int mha__default_threads(void);

/* float16 / bfloat16 <-> float32, round to nearest even. */
float mha__f16_to_f32(uint16_t h);
float mha__bf16_to_f32(uint16_t h);
uint16_t mha__f32_to_f16(float f);
uint16_t mha__f32_to_bf16(float f);

/* q8_0 blocks (ggml's layout, docs/SEMANTICS.md "q8_0 KV cache"): per 32 values a float16 scale
 * d = f16(max|x| / 127) (clamped to 65504) then 32 int8 q = clamp(rne(x / d), -127, 127)
 * (q = 0 when d = 0); value = q * d. A block holding a non-finite value stores d = NaN, q = 0. */
#define MHA__Q8_BLOCK 32
#define MHA__Q8_BYTES 34
/* n values (a multiple of 32) of src into n / 32 blocks at dst, and back. */
void mha__q8_quantize(const float *src, int64_t n, void *dst);
void mha__q8_dequantize(const void *src, int64_t n, float *dst);

/* q4_0 blocks (ggml's layout, docs/SEMANTICS.md "q4_0 weights"): per 32 values a float16 scale
 * d = f16(m / -8) (m the value of largest |x|, clamped to +-65504) then 16 bytes of nibbles,
 * q = clamp(rne(x / d) + 8, 0, 15) (q = 8 when d = 0), value i = (q_i - 8) d with q_i the low
 * nibble of byte i (i < 16) or the high nibble of byte i - 16. A non-finite block: d = NaN. */
#define MHA__Q4_BYTES 18
void mha__q4_quantize(const float *src, int64_t n, void *dst);
void mha__q4_dequantize(const void *src, int64_t n, float *dst);

/* Weights stored as q8_0 or q4_0 (mha_config.weight_dtype = MHA_DTYPE_Q8_0 / Q4_0,
 * docs/SEMANTICS.md "q8_0 weights", "q4_0 weights"): each row of a projection matrix [out][in]
 * is in / 32 blocks, so element (o, c) is in block (o in + c) / 32. Both blocks start with the
 * float16 scale. One element, dequantised (q d, (q - 8) d: exact in float32). */
static inline float mha__q8_scale(const void *base, int64_t block) {
    const unsigned char *blk = (const unsigned char *)base + block * (int64_t)MHA__Q8_BYTES;
    return mha__f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8)));
}
static inline float mha__q8_load(const void *base, int64_t off) {
    const unsigned char *blk =
        (const unsigned char *)base + (off / MHA__Q8_BLOCK) * (int64_t)MHA__Q8_BYTES;
    return (float)(signed char)blk[2 + off % MHA__Q8_BLOCK] * mha__q8_scale(blk, 0);
}
static inline float mha__q4_load(const void *base, int64_t off) {
    const unsigned char *blk =
        (const unsigned char *)base + (off / MHA__Q8_BLOCK) * (int64_t)MHA__Q4_BYTES;
    const int i = (int)(off % MHA__Q8_BLOCK);
    const int q = i < 16 ? blk[2 + i] & 15 : blk[2 + i - 16] >> 4;
    return (float)(q - 8) * mha__q8_scale(blk, 0);
}
/* The block types a layer's projections may have (mha_config.weight_dtype). */
static inline int mha__is_block_weight(mha_dtype dt) {
    return dt == MHA_DTYPE_Q8_0 || dt == MHA_DTYPE_Q4_0;
}
/* Bytes of one block of 32 weights of block type dt. */
static inline size_t mha__block_bytes(mha_dtype dt) {
    return dt == MHA_DTYPE_Q4_0 ? MHA__Q4_BYTES : MHA__Q8_BYTES;
}
/* Element off of weights stored as dt (a block type), dequantised. */
static inline float mha__block_load(mha_dtype dt, const void *base, int64_t off) {
    return dt == MHA_DTYPE_Q4_0 ? mha__q4_load(base, off) : mha__q8_load(base, off);
}
/* Bytes of `count` weights of dtype dt (F32, BF16, F16, or Q8_0 / Q4_0 with count a multiple of
 * 32). */
static inline size_t mha__weight_bytes(mha_dtype dt, int64_t count) {
    return mha__is_block_weight(dt) ? (size_t)(count / MHA__Q8_BLOCK) * mha__block_bytes(dt)
                                    : (size_t)count * (dt == MHA_DTYPE_F32 ? 4u : 2u);
}

/* fp8 e4m3 (docs/SEMANTICS.md "fp8 KV cache"): byte S.EEEE.MMM, bias 7, largest 448, no
 * infinities, NaN = S.1111.111. mha__fp8_from_f32 rounds x to nearest even, saturating to +-448
 * (an infinity too); NaN gives 0x7F (with x's sign). */
uint8_t mha__fp8_from_f32(float x);
float mha__fp8_to_f32(uint8_t b);

/* The storage dtypes of the KV cache, one row each (DESIGN-NOTES item 3): a row of d values
 * (d a multiple of block) takes d / block * block_bytes bytes; to_f32 / from_f32 convert n
 * values (a multiple of block) of a row, with scale the per-kv-head scale of scaled types
 * (fp8: stored = e4m3(x / scale), read = e4m3 * scale; 1 and ignored elsewhere). */
typedef struct mha__kv_dtype_traits {
    mha_dtype dtype;
    const char *name; /* "f32", "f16", "bf16", "q8_0", "fp8_e4m3" */
    int64_t block;    /* values per block (1: an element type) */
    size_t block_bytes;
    int scaled; /* takes per-kv-head scales */
    void (*to_f32)(const void *src, int64_t n, float *dst, float scale);
    void (*from_f32)(const float *src, int64_t n, void *dst, float scale);
} mha__kv_dtype_traits;
/* The row of a cache dtype, NULL for a dtype the KV cache does not store. */
const mha__kv_dtype_traits *mha__kv_dtype(mha_dtype dtype);

/* Storage of activations (docs/SEMANTICS.md "Half precision"): F32, BF16 or F16. The arithmetic
 * is float32: a tensor is widened exactly where it is read (copied, packed) and rounded once to
 * nearest even where it is written. */
static inline int mha__is_float_storage(mha_dtype dt) {
    return dt == MHA_DTYPE_F32 || dt == MHA_DTYPE_BF16 || dt == MHA_DTYPE_F16;
}
static inline size_t mha__storage_size(mha_dtype dt) {
    return dt == MHA_DTYPE_F32 ? 4 : 2;
}
/* Element `off` of a tensor of dtype dt at base (pointer arithmetic in elements). */
static inline const void *mha__elem(mha_dtype dt, const void *base, int64_t off) {
    return (const char *)base + off * (int64_t)mha__storage_size(dt);
}
static inline void *mha__elem_mut(mha_dtype dt, void *base, int64_t off) {
    return (char *)base + off * (int64_t)mha__storage_size(dt);
}
/* One element, widened. */
static inline float mha__load(mha_dtype dt, const void *base, int64_t off) {
    if (dt == MHA_DTYPE_F32)
        return ((const float *)base)[off];
    const uint16_t h = ((const uint16_t *)base)[off];
    return dt == MHA_DTYPE_BF16 ? mha__bf16_to_f32(h) : mha__f16_to_f32(h);
}
/* One element, rounded to dt. */
static inline void mha__store(mha_dtype dt, void *base, int64_t off, float x) {
    if (dt == MHA_DTYPE_F32)
        ((float *)base)[off] = x;
    else
        ((uint16_t *)base)[off] = dt == MHA_DTYPE_BF16 ? mha__f32_to_bf16(x) : mha__f32_to_f16(x);
}
/* dst[i] = src[i] widened, i < count (a memcpy for F32). */
void mha__widen(mha_dtype dt, const void *src, float *dst, int64_t count);
/* dst[i] = src[i] rounded to dt, i < count (a memcpy for F32). */
void mha__narrow(mha_dtype dt, const float *src, void *dst, int64_t count);

/* The layer's weights as the arithmetic reads them (layer.c): the four projections in their
 * storage dtype wdt (the caller's or the layer's copy, never widened: half the bytes; Q8_0: the
 * q8_0 rows, dequantised where read), the
 * biases and sinks widened once to float32 at creation (O(h d) floats; the GEMM adds a float32
 * bias and the core takes float32 sinks). */
typedef struct mha__layer_w {
    const void *w_q, *w_k, *w_v, *w_o;
    mha_dtype wdt;
    const float *b_q, *b_k, *b_v, *b_o, *sinks;
    const float *q_norm, *k_norm; /* QK-norm weights (NULL when the kind has none) */
} mha__layer_w;
const mha__layer_w *mha__layer_compute_weights(const mha_layer *layer);

#endif /* MHA_INTERNAL_H */

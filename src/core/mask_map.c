/* SPDX-License-Identifier: MIT */
/* mask_map.c: the block mask of a call (mha__mask_map, base/internal.h), built once from every
 * element rule so that the kernels classify a tile by reading a few words per row.
 *
 * Layout (in the memory the caller sizes with mha__mask_map_bytes):
 *   [mha__mask_map header][vis: planes x rows x words uint64][need_bias: the same count of bytes]
 *   [span: 2 int64 per row]
 * planes = (B if a rule varies along b, else 1) x (H if one varies along h, else 1), rows = n if
 * a rule varies along the query row, else 1. A rule varies along a dimension when its tensor is
 * not broadcast there (segment ids vary along b and i; key padding along b; a mask function along
 * i, and along b / h when it says so).
 *
 * Cost: one pass over the distinct elements of every element rule (n m per plane), a bit per
 * score of memory, rows split over the call's threads. A mask function with classify() is asked
 * per 64 x 64 tile and visible() only inside MIXED tiles.
 */
#include "core/mask_map.h"
#include "kernels/flash_fwd.h"

#include <string.h>

#define MAP_TILE_ROWS 64 /* rows per classify() call and per parallel unit */
#define MAP_HEADER    mha__align64(sizeof(mha__mask_map))

typedef struct map_dims {
    int vary_b, vary_h, vary_i;
    int64_t planes, rows, words;
} map_dims;

/* Whether target dim k (0 = b, 1 = h, 2 = i) of a [.., n, m]-broadcast tensor is not broadcast. */
static int tensor_varies(const mha_mask_tensor *t, int k) {
    if (t->ndim < 1 || t->ndim > 4)
        return 1; /* refused by the checks; any answer is safe for sizing */
    const int d = t->ndim - 4 + k;
    return d >= 0 && t->shape[d] > 1;
}

static int args_have_rules(const mha_masking *mk) {
    return mk->bool_mask.data || mk->additive_mask.data || mk->key_padding.data ||
           mk->q_segment_ids || mk->mask_fn.visible;
}

/* The dims from public args (sizing, before the masks are checked) ... */
static void dims_from_args(const mha_attention_args *a, map_dims *d) {
    const mha_masking *mk = &a->mask;
    memset(d, 0, sizeof *d);
    for (int k = 0; k < 3; k++) {
        int v = mk->q_segment_ids ? k != 1 : 0;
        if (mk->bool_mask.data)
            v |= tensor_varies(&mk->bool_mask, k);
        if (mk->additive_mask.data)
            v |= tensor_varies(&mk->additive_mask, k);
        if (mk->mask_fn.visible)
            v |= k == 0 ? mk->mask_fn.per_batch != 0 : k == 1 ? mk->mask_fn.per_head != 0 : 1;
        if (k == 0 && mk->key_padding.data)
            v |= mk->key_padding.ndim != 1 && mk->key_padding.shape[0] > 1;
        *(k == 0 ? &d->vary_b : k == 1 ? &d->vary_h : &d->vary_i) = v;
    }
}

/* ... and from the resolved problem (the build): the same answers, from the broadcast strides. */
static void dims_from_problem(const mha__problem *p, map_dims *d) {
    const int64_t *bs = p->bool_mask.strides, *as = p->additive.strides;
    memset(d, 0, sizeof *d);
    d->vary_b = (p->bool_mask.data && bs[0]) || (p->additive.data && as[0]) ||
                (p->key_padding.data && p->key_padding.strides[0]) || p->q_seg ||
                (p->mask_fn.visible && p->mask_fn.per_batch);
    d->vary_h = (p->bool_mask.data && bs[1]) || (p->additive.data && as[1]) ||
                (p->mask_fn.visible && p->mask_fn.per_head);
    d->vary_i = (p->bool_mask.data && bs[2]) || (p->additive.data && as[2]) || p->q_seg ||
                p->mask_fn.visible;
}

/* Counts and bytes for dims d of a (B, H, n, m) problem; false on overflow. */
static bool
dims_size(map_dims *d, int64_t B, int64_t H, int64_t n, int64_t m, int additive, size_t *bytes) {
    int64_t count;
    size_t vis, bias = 0;
    d->words = (m + 63) / 64;
    d->rows = d->vary_i ? n : 1;
    if (!mha__mul_i64(d->vary_b ? B : 1, d->vary_h ? H : 1, &d->planes) ||
        !mha__mul_i64(d->planes, d->rows, &count) || !mha__mul_i64(count, d->words, &count) ||
        !mha__bytes(count, sizeof(uint64_t), &vis) || (additive && !mha__bytes(count, 1, &bias)))
        return false;
    if (vis > SIZE_MAX / 2 || bias > SIZE_MAX / 4)
        return false;
    *bytes = MAP_HEADER + mha__align64(vis) + mha__align64(bias) + mha__align64(vis / d->words * 2);
    return true;
}

bool mha__mask_map_problem_bytes(const mha__problem *p, size_t *bytes) {
    *bytes = 0;
    if (!mha__has_element_rules(p))
        return true;
    map_dims d;
    dims_from_problem(p, &d);
    return dims_size(&d, p->B, p->H, p->n, p->m, p->additive.data != NULL, bytes);
}

bool mha__mask_map_bytes(const mha_attention_args *a, size_t *bytes) {
    *bytes = 0;
    if (!args_have_rules(&a->mask))
        return true;
    map_dims d;
    dims_from_args(a, &d);
    const int64_t H = a->num_heads, n = a->q_len, m = a->kv_len;
    return dims_size(&d, a->batch, H, n, m, a->mask.additive_mask.data != NULL, bytes);
}

/* ---------------------------------------------------------------------------------------------- */
/* Building.                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* Bit t of the result = byte t of flags (each 0 or 1), t < nk: eight bytes at a time, the
 * multiply gathering byte t's low bit into bit 56 + t (byte t is bits 8t.. of the little-endian
 * word, as on every target of the library). */
static uint64_t pack_flags(const uint8_t *flags, int nk) {
    uint64_t bits = 0;
    for (int t = 0; t < nk; t += 8) {
        uint64_t x = 0;
        memcpy(&x, flags + t, 8); /* flags holds 64 bytes; bytes past nk are 0 */
        bits |= ((x * 0x0102040810204080ull) >> 56) << t;
    }
    return bits;
}

/* Bits j < nk: element off + j s3 of an integer mask is nonzero. The byte flags first (a loop
 * the compiler vectorises), then packed. */
static uint64_t nonzero_bits(const mha__mask_view *v, int64_t off, int64_t s3, int nk) {
    if ((v->dtype == MHA_DTYPE_BOOL || v->dtype == MHA_DTYPE_U8) && s3 == 1 && nk == 64) {
        /* Contiguous bytes, eight at a time: bit 7 of ((x & 0x7f..) + 0x7f..) | x is set exactly
         * for the nonzero bytes of x; shifted down, each byte is 0 or 1. */
        const uint8_t *x = (const uint8_t *)v->data + off;
        uint64_t bits = 0;
        for (int t = 0; t < 64; t += 8) {
            uint64_t w;
            memcpy(&w, x + t, 8);
            const uint64_t low7 = 0x7f7f7f7f7f7f7f7full;
            w = ((((w & low7) + low7) | w) >> 7) & 0x0101010101010101ull;
            bits |= ((w * 0x0102040810204080ull) >> 56) << t;
        }
        return bits;
    }
    uint8_t flags[64] = {0};
    switch (v->dtype) {
    case MHA_DTYPE_BOOL:
    case MHA_DTYPE_U8: {
        const uint8_t *x = (const uint8_t *)v->data + off;
        for (int j = 0; j < nk; j++)
            flags[j] = x[j * s3] != 0;
        break;
    }
    case MHA_DTYPE_I32: {
        const int32_t *x = (const int32_t *)v->data + off;
        for (int j = 0; j < nk; j++)
            flags[j] = x[j * s3] != 0;
        break;
    }
    case MHA_DTYPE_I64: {
        const int64_t *x = (const int64_t *)v->data + off;
        for (int j = 0; j < nk; j++)
            flags[j] = x[j * s3] != 0;
        break;
    }
    default:
        break;
    }
    return pack_flags(flags, nk);
}

/* Keys j0 .. j0 + nk - 1 of row i of (b, h) under the tensor rules: the visible bits, and in
 * *bias whether the additive mask needs adding there (a value other than +-0 and -inf). */
static uint64_t tensor_bits(
    const mha__problem *p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint8_t *bias) {
    uint64_t bits = nk == 64 ? ~(uint64_t)0 : (((uint64_t)1 << nk) - 1);
    if (p->bool_mask.data) {
        const int64_t *s = p->bool_mask.strides;
        const uint64_t nz =
            nonzero_bits(&p->bool_mask, b * s[0] + h * s[1] + i * s[2] + j0 * s[3], s[3], nk);
        bits &= p->bool_polarity == MHA_MASK_ATTEND ? nz : ~nz;
    }
    if (p->key_padding.data) {
        const int64_t *s = p->key_padding.strides;
        bits &= nonzero_bits(&p->key_padding, b * s[0] + j0 * s[3], s[3], nk);
    }
    if (p->q_seg) {
        const int32_t qs = p->q_seg[b * p->n + i], *ks = p->kv_seg + b * p->m + j0;
        uint8_t eq[64] = {0};
        for (int j = 0; j < nk; j++)
            eq[j] = ks[j] == qs;
        bits &= pack_flags(eq, nk);
    }
    *bias = 0;
    if (p->additive.data) {
        const int64_t *s = p->additive.strides;
        const float *x =
            (const float *)p->additive.data + b * s[0] + h * s[1] + i * s[2] + j0 * s[3];
        uint8_t hidden[64] = {0}, add[64] = {0}, any = 0;
        for (int j = 0; j < nk; j++) {
            const float v = x[j * s[3]];
            hidden[j] = v == -INFINITY;
            add[j] = v != 0.0f && v != -INFINITY; /* NaN and +inf need adding too */
        }
        for (int j = 0; j < nk; j++)
            any |= add[j];
        bits &= ~pack_flags(hidden, nk);
        *bias = any;
    }
    return bits;
}

/* The mask function's bits for keys j0 .. j0 + nk - 1 of row i, under the tile class cls of the
 * 64 x 64 tile holding them. */
static uint64_t fn_bits(const mha__problem *p,
                        int64_t b,
                        int64_t h,
                        int64_t i,
                        int64_t j0,
                        int nk,
                        mha_tile_class cls) {
    if (cls == MHA_TILE_HIDDEN)
        return 0;
    if (cls == MHA_TILE_VISIBLE)
        return nk == 64 ? ~(uint64_t)0 : (((uint64_t)1 << nk) - 1);
    uint64_t bits = 0;
    for (int j = 0; j < nk; j++)
        bits |= (uint64_t)(p->mask_fn.visible(p->mask_fn.ctx, b, h, i, j0 + j) != 0) << j;
    return bits;
}

typedef struct build_job {
    const mha__problem *p;
    mha__mask_map *mm;
    map_dims d;
    int64_t row_blocks; /* per plane */
} build_job;

/* The span of row i of (b, h): the first and last set bit of its words. */
static void row_span(mha__mask_map *mm, int64_t b, int64_t h, int64_t i) {
    const int64_t at = mha__map_at(mm, b, h, i),
                  row = b * mm->span_b + h * mm->span_h + i * mm->span_i;
    int64_t first = 1, last = 0;
    for (int64_t k = 0; k < mm->words; k++)
        if (mm->vis[at + k * mm->word_k]) {
            first = 64 * k + __builtin_ctzll(mm->vis[at + k * mm->word_k]);
            break;
        }
    for (int64_t k = mm->words - 1; k >= 0; k--)
        if (mm->vis[at + k * mm->word_k]) {
            last = 64 * k + 63 - __builtin_clzll(mm->vis[at + k * mm->word_k]);
            break;
        }
    mm->span[2 * row] = first;
    mm->span[2 * row + 1] = last;
}

/* Rows [i0, i1) of plane (b, h): the representative b, h (0 where shared) are the ones the rules
 * and the mask function are read at. */
static void build_rows(const build_job *job, int64_t b, int64_t h, int64_t i0, int64_t i1) {
    const mha__problem *p = job->p;
    mha__mask_map *mm = job->mm;
    const int fn = p->mask_fn.visible != NULL;
    /* Chunks of 64 words: their tile classes first (one classify() per 64 x 64 tile), then row
     * by row, so that a mask tensor is read in its own order (each row's keys contiguous). */
    for (int64_t k0 = 0; k0 < mm->words; k0 += 64) {
        const int64_t k1 = k0 + 64 < mm->words ? k0 + 64 : mm->words;
        mha_tile_class cls[64];
        for (int64_t k = k0; k < k1; k++) {
            const int64_t j0 = 64 * k, j1 = j0 + 64 < p->m ? j0 + 64 : p->m;
            cls[k - k0] = fn && p->mask_fn.classify
                              ? p->mask_fn.classify(p->mask_fn.ctx, b, h, i0, i1, j0, j1)
                              : MHA_TILE_MIXED;
            if (cls[k - k0] != MHA_TILE_HIDDEN && cls[k - k0] != MHA_TILE_VISIBLE)
                cls[k - k0] = MHA_TILE_MIXED; /* anything else is read as "ask per element" */
        }
        for (int64_t i = i0; i < i1; i++) {
            const int64_t row = mha__map_at(mm, b, h, i);
            for (int64_t k = k0; k < k1; k++) {
                const int64_t j0 = 64 * k, at = row + k * mm->word_k;
                const int nk = (int)(p->m - j0 < 64 ? p->m - j0 : 64);
                uint8_t bias;
                uint64_t bits = tensor_bits(p, b, h, i, j0, nk, &bias);
                if (fn && bits)
                    bits &= fn_bits(p, b, h, i, j0, nk, cls[k - k0]);
                mm->vis[at] = bits;
                if (mm->need_bias)
                    mm->need_bias[at] = bias;
            }
        }
    }
    for (int64_t i = i0; i < i1; i++)
        row_span(mm, b, h, i);
}

static void build_range(void *ctx, int part, int64_t begin, int64_t end) {
    (void)part;
    const build_job *job = ctx;
    const int64_t planes_h = job->d.vary_h ? job->p->H : 1;
    for (int64_t u = begin; u < end; u++) {
        const int64_t plane = u / job->row_blocks, rb = u % job->row_blocks;
        const int64_t b = plane / planes_h, h = plane % planes_h;
        const int64_t i0 = rb * MAP_TILE_ROWS;
        const int64_t i1 = i0 + MAP_TILE_ROWS < job->d.rows ? i0 + MAP_TILE_ROWS : job->d.rows;
        build_rows(job, b, h, i0, i1);
    }
}

mha_status mha__mask_map_build(mha__problem *p, void *mem, mha__team team, mha_error *err) {
    p->map = NULL;
    if (!mha__has_element_rules(p))
        return MHA_STATUS_OK;
    build_job job = {.p = p};
    size_t bytes;
    dims_from_problem(p, &job.d);
    MHA_RETURN_IF(!dims_size(&job.d, p->B, p->H, p->n, p->m, p->additive.data != NULL, &bytes), err,
                  OVERFLOW, "block mask size overflows");
    mha__mask_map *mm = mem;
    const int64_t count = job.d.planes * job.d.rows * job.d.words;
    /* Column-major planes: word k of row i at i + k rows (internal.h). */
    mm->words = job.d.words;
    mm->row_i = job.d.vary_i ? 1 : 0;
    mm->word_k = job.d.rows;
    mm->plane_h = job.d.vary_h ? job.d.rows * mm->words : 0;
    mm->plane_b = job.d.vary_b ? (job.d.vary_h ? p->H : 1) * job.d.rows * mm->words : 0;
    mm->span_i = mm->row_i;
    mm->span_h = job.d.vary_h ? job.d.rows : 0;
    mm->span_b = job.d.vary_b ? (job.d.vary_h ? p->H : 1) * job.d.rows : 0;
    mm->vis = (uint64_t *)((char *)mem + MAP_HEADER);
    char *after_vis = (char *)mm->vis + mha__align64(sizeof(uint64_t) * (size_t)count);
    mm->need_bias = p->additive.data ? (uint8_t *)after_vis : NULL;
    mm->span = (int64_t *)(after_vis + (p->additive.data ? mha__align64((size_t)count) : 0));
    job.mm = mm;
    job.row_blocks = (job.d.rows + MAP_TILE_ROWS - 1) / MAP_TILE_ROWS;
    /* ~m element reads per row: a thread per 2^16 rows' worth of reads at least. */
    const double reads = (double)count * 64.0;
    mha_status st = mha__parallel_for(mha__team_for_flops(team, reads * 4.0),
                                      job.d.planes * job.row_blocks, build_range, &job, err);
    if (st)
        return st;
    p->map = mm;
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Classification of a tile (the summary; the kernels ask mha__rows_class themselves). */
/* ---------------------------------------------------------------------------------------------- */

mha_tile_class mha__tile_class(
    const mha__problem *p, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int nk) {
    int bias = 0;
    return mha__rows_class(p, b, h, i0, i1 - i0, j0, nk, NULL, &bias);
}

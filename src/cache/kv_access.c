/* SPDX-License-Identifier: MIT */
/* kv_access.c: one position's K or V of a cache read, written or moved, in either q8_0 order
 * (kv_cache.h: ggml's rows, or the key-interleaved groups of 16 slots). The vector decode kernels
 * read the storage directly; everything else goes through here. */
#include "cache/kv_cache.h"

#include <string.h>

/* Bytes of one group's quants before its scales: d per lane, 16 lanes. */
static size_t group_quant_bytes(int64_t d) {
    return (size_t)d * MHA__Q8X16_LANES;
}

/* q8_0 block b (34 bytes: float16 scale, 32 int8) of lane `lane` of a K (v = 0) or V group of
 * d-element rows, out of the interleaved order into ggml's. */
static void group_get_block(
    const char *grp, int v, int64_t d, int lane, int64_t b, unsigned char blk[MHA__Q8_BYTES]) {
    memcpy(blk, grp + group_quant_bytes(d) + 2 * (size_t)(b * MHA__Q8X16_LANES + lane), 2);
    for (int i = 0; i < MHA__Q8_BLOCK; i++) {
        const int64_t e = b * MHA__Q8_BLOCK + i; /* the element */
        if (v)
            blk[2 + i] = (unsigned char)grp[(size_t)(lane / 4) * 4 * d + 4 * e + lane % 4];
        else
            blk[2 + i] = (unsigned char)grp[b * 512 + (i / 4) * 64 + 4 * lane + i % 4] ^ 0x80u;
    }
}

/* The inverse: ggml's block into lane `lane` of the group. */
static void group_put_block(
    char *grp, int v, int64_t d, int lane, int64_t b, const unsigned char blk[MHA__Q8_BYTES]) {
    memcpy(grp + group_quant_bytes(d) + 2 * (size_t)(b * MHA__Q8X16_LANES + lane), blk, 2);
    for (int i = 0; i < MHA__Q8_BLOCK; i++) {
        const int64_t e = b * MHA__Q8_BLOCK + i;
        if (v)
            grp[(size_t)(lane / 4) * 4 * d + 4 * e + lane % 4] = (char)blk[2 + i];
        else
            grp[b * 512 + (i / 4) * 64 + 4 * lane + i % 4] = (char)(blk[2 + i] ^ 0x80u);
    }
}

static int64_t dim(const struct mha_kv_cache *c, int v) {
    return v ? c->cfg.v_head_dim : c->cfg.head_dim;
}

static float scale_of(const struct mha_kv_cache *c, int v, int64_t g) {
    return v ? mha__kv_v_scale(c, g) : mha__kv_k_scale(c, g);
}

static const void *row_of(const struct mha_kv_cache *c, int v, int64_t s, int64_t g, int64_t p) {
    return v ? mha__kv_v_row(c, s, g, p) : mha__kv_k_row(c, s, g, p);
}

void mha__kv_get(const struct mha_kv_cache *c, int v, int64_t s, int64_t g, int64_t p, float *dst) {
    const int64_t d = dim(c, v);
    if (!c->q8x16) {
        mha__kv_load_row(c, row_of(c, v, s, g, p), d, dst, scale_of(c, v, g));
        return;
    }
    const int64_t q = p % c->slots;
    const char *grp = mha__kv_q8x16_group(c, v, s, g, q);
    unsigned char blk[MHA__Q8_BYTES];
    for (int64_t b = 0; b < d / MHA__Q8_BLOCK; b++) {
        group_get_block(grp, v, d, (int)(q % MHA__Q8X16_LANES), b, blk);
        c->dt->to_f32(blk, MHA__Q8_BLOCK, dst + b * MHA__Q8_BLOCK, scale_of(c, v, g));
    }
}

void mha__kv_put(struct mha_kv_cache *c, int v, int64_t s, int64_t g, int64_t p, const float *src) {
    const int64_t d = dim(c, v);
    if (!c->q8x16) {
        c->dt->from_f32(src, d, (void *)row_of(c, v, s, g, p), scale_of(c, v, g));
        return;
    }
    const int64_t q = p % c->slots;
    char *grp = mha__kv_q8x16_group(c, v, s, g, q);
    unsigned char blk[MHA__Q8_BYTES];
    for (int64_t b = 0; b < d / MHA__Q8_BLOCK; b++) { /* blocks are quantised independently */
        c->dt->from_f32(src + b * MHA__Q8_BLOCK, MHA__Q8_BLOCK, blk, scale_of(c, v, g));
        group_put_block(grp, v, d, (int)(q % MHA__Q8X16_LANES), b, blk);
    }
}

void mha__kv_move(struct mha_kv_cache *c, int64_t s, int64_t g, int64_t from, int64_t to) {
    for (int v = 0; v < 2; v++) {
        if (!c->q8x16) {
            memcpy((void *)row_of(c, v, s, g, to), row_of(c, v, s, g, from),
                   v ? c->v_row_bytes : c->k_row_bytes);
            continue;
        }
        const int64_t d = dim(c, v), qf = from % c->slots, qt = to % c->slots;
        const char *gf = mha__kv_q8x16_group(c, v, s, g, qf);
        char *gt = mha__kv_q8x16_group(c, v, s, g, qt);
        unsigned char blk[MHA__Q8_BYTES];
        for (int64_t b = 0; b < d / MHA__Q8_BLOCK; b++) {
            group_get_block(gf, v, d, (int)(qf % MHA__Q8X16_LANES), b, blk);
            group_put_block(gt, v, d, (int)(qt % MHA__Q8X16_LANES), b, blk);
        }
    }
}

/* SPDX-License-Identifier: MIT */
/* kv_cache.c: the KV cache object of mha.h's "Inference: KV cache" section: creation, lengths,
 * reset / truncate / copy of sequences, raw append and read-back. The attention over a cache and
 * the layer calls are in decode.c.
 *
 * Every call checks all of its arguments (check/cache.c) before changing anything, so a failing
 * call leaves the cache exactly as it was. Storage is allocated once at creation; appends never
 * allocate.
 */
#include "cache/kv_cache.h"

#include <string.h>

mha_status mha_kv_cache_create(const mha_kv_cache_config *config,
                               const mha_layer *layer,
                               const mha_allocator *allocator,
                               mha_kv_cache **out,
                               mha_error *err) {
    if (out)
        *out = NULL;
    mha_kv_cache_config c;
    mha_status st =
        mha__check_kv_create(config, layer ? mha_layer_config(layer) : NULL, out, &c, err);
    if (st)
        return st;
    int64_t slots = c.max_seq;
    /* A ring of span W (window, or chunk size C: a token sees at most C keys) and steps of at
     * most T tokens: the first token of a step at p needs keys >= p - W + 1, the ring holds the
     * last W + T - 1 positions after the step's append. */
    const int64_t span = mha__kv_ring_span(&c);
    if (span > 0 && span + c.max_step_tokens - 1 < slots)
        slots = span + c.max_step_tokens - 1;
    /* Q8_0 rows are dk / 32 blocks of 34 bytes: counted in blocks, at 34 bytes per "element" */
    const int q8 = c.dtype == MHA_DTYPE_Q8_0;
    const size_t elem = q8 ? 0 : mha_dtype_size(c.dtype), unit = q8 ? MHA__Q8_BYTES : elem;
    const int64_t per = q8 ? MHA__Q8_BLOCK : 1;
    const int64_t kf[4] = {c.batch, c.num_kv_heads, slots, c.head_dim / per};
    const int64_t vf[4] = {c.batch, c.num_kv_heads, slots, c.v_head_dim / per};
    int64_t kn, vn;
    size_t kb, vb, lb;
    MHA_RETURN_IF(!mha__prod_i64(kf, 4, &kn) || !mha__prod_i64(vf, 4, &vn) ||
                      !mha__bytes(kn, unit, &kb) || !mha__bytes(vn, unit, &vb) ||
                      !mha__bytes(2 * c.batch, sizeof(int64_t), &lb),
                  err, OVERFLOW,
                  "kv cache of batch=%lld x g=%lld x slots=%lld x (d_k=%lld + d_v=%lld) "
                  "overflows",
                  (long long)c.batch, (long long)c.num_kv_heads, (long long)slots,
                  (long long)c.head_dim, (long long)c.v_head_dim);
    mha_kv_cache *kc = mha__alloc(allocator, sizeof *kc);
    MHA_RETURN_IF(!kc, err, NO_MEMORY, "cannot allocate the kv cache");
    memset(kc, 0, sizeof *kc);
    kc->cfg = c;
    kc->slots = slots;
    kc->elem = elem;
    kc->k_row_bytes = (size_t)(c.head_dim / per) * unit;
    kc->v_row_bytes = (size_t)(c.v_head_dim / per) * unit;
    if (allocator) {
        kc->allocator = *allocator;
        kc->has_allocator = 1;
    }
    kc->k = mha__alloc_large(allocator, kb);
    kc->v = mha__alloc_large(allocator, vb);
    kc->len = mha__alloc(allocator, lb);
    if (!kc->k || !kc->v || !kc->len) {
        mha_kv_cache_destroy(kc);
        return mha__fail(err, MHA_STATUS_NO_MEMORY,
                         "cannot allocate the kv cache storage (%zu "
                         "bytes)",
                         kb + vb);
    }
    memset(kc->len, 0, lb);
    kc->lo = kc->len + c.batch;
    *out = kc;
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha_kv_cache_destroy(mha_kv_cache *cache) {
    if (!cache)
        return;
    const mha_allocator copy = cache->allocator;
    const mha_allocator *a = cache->has_allocator ? &copy : NULL;
    mha__free(a, cache->k);
    mha__free(a, cache->v);
    mha__free(a, cache->len);
    mha__free(a, cache);
}

const mha_kv_cache_config *mha_kv_cache_get_config(const mha_kv_cache *cache) {
    return cache ? &cache->cfg : NULL;
}

int64_t mha_kv_cache_slots(const mha_kv_cache *cache) {
    return cache ? cache->slots : -1;
}

int64_t mha_kv_cache_length(const mha_kv_cache *cache, int64_t seq) {
    if (!cache || seq < 0 || seq >= cache->cfg.batch)
        return -1;
    return cache->len[seq];
}

mha_status mha_kv_cache_reset(mha_kv_cache *cache, int64_t seq, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_seq(&view, seq, "seq", err);
    if (st)
        return st;
    cache->len[seq] = 0;
    cache->lo[seq] = 0;
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status
mha_kv_cache_truncate(mha_kv_cache *cache, int64_t seq, int64_t new_len, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_truncate(&view, seq, new_len, err);
    if (st)
        return st;
    cache->len[seq] = new_len;
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_kv_cache_accept(mha_kv_cache *cache,
                               int64_t seq,
                               int64_t base_len,
                               int64_t n,
                               const int64_t *draft_idx,
                               mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_accept(&view, seq, base_len, n, draft_idx, err);
    if (st)
        return st;
    /* Row k moves from base_len + draft_idx[k] >= base_len + k (strictly increasing indices), so
     * in increasing k no move overwrites a row still to be moved. */
    for (int64_t g = 0; g < cache->cfg.num_kv_heads; g++)
        for (int64_t k = 0; k < n; k++) {
            const int64_t from = base_len + draft_idx[k], to = base_len + k;
            if (from == to)
                continue;
            memcpy((void *)mha__kv_k_row(cache, seq, g, to), mha__kv_k_row(cache, seq, g, from),
                   cache->k_row_bytes);
            memcpy((void *)mha__kv_v_row(cache, seq, g, to), mha__kv_v_row(cache, seq, g, from),
                   cache->v_row_bytes);
        }
    cache->len[seq] = base_len + n;
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status
mha_kv_cache_copy(mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_seq(&view, src_seq, "src_seq", err);
    if (!st)
        st = mha__check_kv_seq(&view, dst_seq, "dst_seq", err);
    if (st)
        return st;
    if (src_seq != dst_seq) {
        const int64_t G = cache->cfg.num_kv_heads, slots = cache->slots;
        const int64_t L = cache->len[src_seq];
        const int64_t n = L < slots ? L : slots; /* slots in use */
        for (int64_t g = 0; g < G; g++) {
            /* Copying slots [0, n) covers every stored position, ring or not. */
            const size_t kb = (size_t)n * cache->k_row_bytes;
            const size_t vb = (size_t)n * cache->v_row_bytes;
            memcpy((void *)mha__kv_k_row(cache, dst_seq, g, 0), mha__kv_k_row(cache, src_seq, g, 0),
                   kb);
            memcpy((void *)mha__kv_v_row(cache, dst_seq, g, 0), mha__kv_v_row(cache, src_seq, g, 0),
                   vb);
        }
        cache->len[dst_seq] = L;
        cache->lo[dst_seq] = cache->lo[src_seq];
    }
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha__kv_load_row(const mha_kv_cache *c, const void *src, int64_t d, float *dst) {
    switch (c->cfg.dtype) {
    case MHA_DTYPE_Q8_0:
        mha__q8_dequantize(src, d, dst);
        break;
    case MHA_DTYPE_F16:
        for (int64_t i = 0; i < d; i++)
            dst[i] = mha__f16_to_f32(((const uint16_t *)src)[i]);
        break;
    case MHA_DTYPE_BF16:
        for (int64_t i = 0; i < d; i++)
            dst[i] = mha__bf16_to_f32(((const uint16_t *)src)[i]);
        break;
    default:
        memcpy(dst, src, sizeof(float) * (size_t)d);
        break;
    }
}

static void store_row(const mha_kv_cache *c, const float *src, int64_t d, void *dst) {
    switch (c->cfg.dtype) {
    case MHA_DTYPE_Q8_0:
        mha__q8_quantize(src, d, dst);
        break;
    case MHA_DTYPE_F16:
        for (int64_t i = 0; i < d; i++)
            ((uint16_t *)dst)[i] = mha__f32_to_f16(src[i]);
        break;
    case MHA_DTYPE_BF16:
        for (int64_t i = 0; i < d; i++)
            ((uint16_t *)dst)[i] = mha__f32_to_bf16(src[i]);
        break;
    default:
        memcpy(dst, src, sizeof(float) * (size_t)d);
        break;
    }
}

mha_status mha_kv_cache_read(
    const mha_kv_cache *cache, int64_t seq, int64_t pos, float *k, float *v, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_read(&view, seq, pos, k, v, err);
    if (st)
        return st;
    const int64_t G = cache->cfg.num_kv_heads, dk = cache->cfg.head_dim;
    const int64_t dv = cache->cfg.v_head_dim;
    for (int64_t g = 0; g < G; g++) {
        if (k)
            mha__kv_load_row(cache, mha__kv_k_row(cache, seq, g, pos), dk, k + g * dk);
        if (v)
            mha__kv_load_row(cache, mha__kv_v_row(cache, seq, g, pos), dv, v + g * dv);
    }
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha__kv_append_raw(mha_kv_cache *c,
                        int64_t S,
                        const int64_t *seq_ids,
                        int64_t t,
                        const float *k,
                        int64_t k_seq_stride,
                        int64_t k_tok_stride,
                        const float *v,
                        int64_t v_seq_stride,
                        int64_t v_tok_stride) {
    const int64_t G = c->cfg.num_kv_heads, dk = c->cfg.head_dim, dv = c->cfg.v_head_dim;
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = seq_ids ? seq_ids[i] : i;
        for (int64_t tok = 0; tok < t; tok++) {
            const int64_t p = c->len[s] + tok;
            for (int64_t g = 0; g < G; g++) {
                store_row(c, k + i * k_seq_stride + tok * k_tok_stride + g * dk, dk,
                          (void *)mha__kv_k_row(c, s, g, p));
                store_row(c, v + i * v_seq_stride + tok * v_tok_stride + g * dv, dv,
                          (void *)mha__kv_v_row(c, s, g, p));
            }
        }
        c->len[s] += t;
        if (c->len[s] - c->slots > c->lo[s])
            c->lo[s] = c->len[s] - c->slots;
    }
}

mha_status mha_kv_cache_append(mha_kv_cache *cache,
                               int64_t num_seqs,
                               const int64_t *seq_ids,
                               int64_t t,
                               const float *k,
                               const float *v,
                               mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_append(&view, num_seqs, seq_ids, t, k, v, err);
    if (st)
        return st;
    const int64_t G = cache->cfg.num_kv_heads;
    const int64_t kt = G * cache->cfg.head_dim, vt = G * cache->cfg.v_head_dim;
    mha__kv_append_raw(cache, num_seqs, seq_ids, t, k, t * kt, kt, v, t * vt, vt);
    mha__ok(err);
    return MHA_STATUS_OK;
}

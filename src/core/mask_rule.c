/* SPDX-License-Identifier: MIT */
/* core/mask_rule.c: mha_mask_recognize, which decides EXACTLY whether a mask tensor equals a
 * built-in rule (a causal / sliding-window band with one delta, key padding, both, or nothing
 * hidden) in one pass over its distinct elements, and mha_mask_rule_apply / _describe.
 *
 * Model (docs/SEMANTICS.md, "Recognised masks"): the tensor's visibility is
 *     V[b, h, i, j] = [i + lo <= j <= i + hi] AND K_b[j],   lo in Z or -inf, hi in Z or +inf.
 * Read column by column, a real key j (K_b[j] = 1) is then visible in exactly the rows
 *     [max(0, j - hi), min(n - 1, j - lo)]                  (an interval, possibly empty)
 * and a padded key in none. The pass records for every column the first and last row it is
 * visible in (reading only the columns where a row differs from the row before: a band changes
 * a few per row), refusing a column that becomes visible again after a gap. A column first visible
 * at row r > 0 fixes hi = j - r; one visible from row 0 only bounds hi >= j. A column last visible
 * at row r < n - 1 fixes lo = j - r; one visible down to row n - 1 only bounds lo <= j - (n - 1).
 * Two different values for an edge, or a value against a bound, or two heads of one batch row
 * with different visible columns, mean "no rule". Otherwise every column's visible rows are the
 * band's rows for that column (and its K is "visible somewhere"), which is V = band AND K
 * element for element: no sampling, no tolerance.
 *
 * Chunked causal (a second hypothesis checked in the same pass, on the same column intervals,
 * and taken when the band fails at its lower edge): the model is
 *     V[b, h, i, j] = [j <= i + hi] AND [floor(j / C) == floor((i + hi) / C)] AND K_b[j],
 * under which a real key j is visible in exactly the rows [max(0, j - hi), min(n - 1, E_j - hi)],
 * E_j = C floor(j / C) + C - 1 its chunk's last position: the same first rows as the band, and a
 * last row set by the chunk instead of lo. A column last visible at row r < n - 1 so says
 * C (floor(j / C) + 1) = r + hi + 1 =: v; the first such column j0 leaves the divisors C of v0
 * with C >= v0 - j0 (its chunk holds j0) as candidates, and every further column removes those
 * that contradict it. A column visible down to row n - 1 needs E_j - hi >= n - 1, which E_j's
 * growth in j reduces to the smallest such column. A candidate left at the end satisfies every
 * column's interval, so again V = chunked band AND K element for element.
 */
#include "check/check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The most divisors an int64 v <= 2^33 has is below 2048 (1536 under 2^32, 2304 is beyond). */
#define MAX_CANDS 2048

/* The state of one recognition: the resolved tensor and the band's edges found so far. */
typedef struct scan {
    const void *data;
    mha_dtype dtype;
    int additive;
    mha_mask_polarity polarity;
    int64_t strides[4]; /* element strides over (b, h, i, j); 0 = broadcast */
    int64_t n, m;
    int64_t *first, *last; /* [m]: first / last row column j is visible in; -1 = none yet */
    uint8_t *row;          /* [m]: visibility of the row being read (0 / 1) */
    uint8_t *prev;         /* [m]: the previous row's (all 0 before a slice's row 0) */
    uint8_t *keys;         /* [distinct batch rows, m]: K_b[j] = column j visible somewhere */
    bool hi_known, lo_known;
    int64_t hi, lo;   /* the edges, when known */
    int64_t hi_min;   /* hi >= hi_min (INT64_MIN: no bound yet) */
    int64_t lo_max;   /* lo <= lo_max (INT64_MAX: no bound yet) */
    bool band_alive;  /* the band's lower edge still fits every column read */
    bool chunk_alive; /* the chunked causal model still fits every column read */
    int64_t ncands;   /* -1: no chunk edge seen yet; else the candidate chunk sizes left */
    int64_t cands[MAX_CANDS];
    int64_t full_min; /* the smallest column visible down to row n - 1 (INT64_MAX: none) */
} scan;

/* row[j] = whether element j of the row at `off` is visible, j < m (the last dimension is
 * contiguous, or broadcast: one element for the whole row). An additive value other than +-0 or
 * -inf makes the tensor no rule: false. */
static bool read_row(scan *S, int64_t off) {
    const int64_t count = S->strides[3] ? S->m : 1;
    uint8_t *row = S->row;
    switch (S->dtype) {
    case MHA_DTYPE_F32: {
        const float *x = (const float *)S->data + off;
        /* Branch-free (vectorised): other != 0 when some value is neither 0 nor -inf. */
        int32_t other = 0; /* a finite bias or NaN is not a visibility rule */
        for (int64_t j = 0; j < count; j++) {
            const int32_t visible = x[j] == 0.0f, hidden = x[j] == -INFINITY;
            row[j] = (uint8_t)visible;
            other |= 1 - (visible | hidden);
        }
        if (other)
            return false;
        break;
    }
    case MHA_DTYPE_I32: {
        const int32_t *x = (const int32_t *)S->data + off;
        for (int64_t j = 0; j < count; j++)
            row[j] = x[j] != 0;
        break;
    }
    case MHA_DTYPE_I64: {
        const int64_t *x = (const int64_t *)S->data + off;
        for (int64_t j = 0; j < count; j++)
            row[j] = x[j] != 0;
        break;
    }
    default: { /* BOOL, U8: one byte */
        const uint8_t *x = (const uint8_t *)S->data + off;
        for (int64_t j = 0; j < count; j++)
            row[j] = x[j] != 0;
        break;
    }
    }
    if (!S->additive && S->polarity == MHA_MASK_BLOCK)
        for (int64_t j = 0; j < count; j++)
            row[j] ^= 1; /* BLOCK: nonzero = hidden */
    if (count == 1)
        memset(row + 1, row[0], (size_t)(S->m - 1));
    return true;
}

/* hi = value (a column first visible at row r > 0: value = j - r); false on a contradiction. */
static bool fix_hi(scan *S, int64_t value) {
    if (S->hi_known && S->hi != value)
        return false;
    S->hi_known = true;
    S->hi = value;
    return value >= S->hi_min;
}

/* hi >= bound (a column visible from row 0: bound = j). */
static bool bound_hi(scan *S, int64_t bound) {
    if (bound > S->hi_min)
        S->hi_min = bound;
    return !S->hi_known || S->hi >= S->hi_min;
}

/* lo = value (a column last visible at row r < n - 1: value = j - r). */
static bool fix_lo(scan *S, int64_t value) {
    if (S->lo_known && S->lo != value)
        return false;
    S->lo_known = true;
    S->lo = value;
    return value <= S->lo_max;
}

/* lo <= bound (a column visible down to row n - 1: bound = j - (n - 1)). */
static bool bound_lo(scan *S, int64_t bound) {
    if (bound < S->lo_max)
        S->lo_max = bound;
    return !S->lo_known || S->lo <= S->lo_max;
}

/* The candidates of a first chunk edge: the divisors C of v = C (floor(j / C) + 1) whose chunk
 * [v - C, v) holds j, i.e. C >= v - j; largest first. */
static void chunk_candidates(scan *S, int64_t j, int64_t v) {
    S->ncands = 0;
    for (int64_t d = 1; d * d <= v; d++) {
        if (v % d)
            continue;
        const int64_t pair[2] = {v / d, d};
        for (int k = 0; k < (d * d == v ? 1 : 2); k++)
            if (pair[k] >= v - j && S->ncands < MAX_CANDS)
                S->cands[S->ncands++] = pair[k];
    }
}

/* Column j of a slice, visible in rows [first, last], under the chunked causal model (a chunk
 * edge needs hi known): the candidates that put its last row at min(n - 1, E_j - hi) are kept;
 * false when none is left. */
static bool chunk_column(scan *S, int64_t j, int64_t last) {
    if (last == S->n - 1) { /* needs E_j - hi >= n - 1: checked at the end, smallest j */
        if (j < S->full_min)
            S->full_min = j;
        return true;
    }
    if (!S->hi_known)
        return false;
    const int64_t v = last + S->hi + 1; /* = C (floor(j / C) + 1) */
    if (S->ncands < 0)
        chunk_candidates(S, j, v);
    int64_t kept = 0;
    for (int64_t k = 0; k < S->ncands; k++) {
        const int64_t C = S->cands[k];
        if (C * (j / C + 1) == v)
            S->cands[kept++] = C;
    }
    S->ncands = kept;
    return kept > 0;
}

/* The chunk size the whole tensor agrees on, or 0 when none: the smallest candidate left whose
 * chunks reach row n - 1 for the smallest full column (the smallest C reaches the fewest keys, so
 * a key is padded only where a row would see it: canonical, like the band's edges). */
static int64_t chunk_found(const scan *S) {
    if (!S->hi_known || S->ncands <= 0)
        return 0;
    int64_t best = 0;
    for (int64_t k = 0; k < S->ncands; k++) {
        const int64_t C = S->cands[k], j = S->full_min;
        const bool fits = j == INT64_MAX || C * (j / C) + C - 1 - S->hi >= S->n - 1;
        if (fits && (best == 0 || C < best))
            best = C;
    }
    return best;
}

/* Column j changes at row i: now visible (its interval opens at i, and it must never have been
 * visible before: else it is visible again after hidden rows, not an interval) or now hidden
 * (its interval closes at i - 1). */
static bool toggle(scan *S, int64_t j, int64_t i, uint8_t visible) {
    if (!visible) {
        S->last[j] = i - 1;
        return true;
    }
    if (S->first[j] >= 0)
        return false;
    S->first[j] = i;
    return i > 0 ? fix_hi(S, j - i) : bound_hi(S, j);
}

/* Row i's visibility (S->row) into the column intervals, through the columns where it differs
 * from the previous row (S->prev): compared 8 bytes at a time, so a band row (a few columns
 * change per row) costs about m / 8 word compares. Then the row becomes the previous one. */
static bool add_row(scan *S, int64_t i) {
    const uint8_t *row = S->row, *prev = S->prev;
    for (int64_t j = 0; j < S->m; j += 8) {
        if (j + 8 <= S->m) {
            uint64_t a, b;
            memcpy(&a, row + j, 8);
            memcpy(&b, prev + j, 8);
            if (a == b)
                continue;
        }
        const int64_t end = j + 8 < S->m ? j + 8 : S->m;
        for (int64_t c = j; c < end; c++)
            if (row[c] != prev[c] && !toggle(S, c, i, row[c]))
                return false;
    }
    S->prev = S->row;
    S->row = (uint8_t *)prev;
    return true;
}

/* One (b, h) slice [n, m] at element offset `base`: its column intervals, then the lower edge
 * they give (the upper one is checked as columns appear). A row-broadcast slice is read once: its
 * visible columns are visible in every row. */
static bool scan_slice(scan *S, int64_t base) {
    for (int64_t j = 0; j < S->m; j++)
        S->first[j] = S->last[j] = -1;
    memset(S->prev, 0, (size_t)S->m);
    const int64_t rows = S->strides[2] ? S->n : 1;
    for (int64_t i = 0; i < rows; i++)
        if (!read_row(S, base + i * S->strides[2]) || !add_row(S, i))
            return false;
    for (int64_t j = 0; j < S->m; j++) {
        if (S->first[j] < 0)
            continue;
        if (S->prev[j]) /* still open after the last row read (all rows, or the broadcast one) */
            S->last[j] = S->n - 1;
        const int64_t last = S->last[j];
        if (S->band_alive)
            S->band_alive = last < S->n - 1 ? fix_lo(S, j - last) : bound_lo(S, j - (S->n - 1));
        if (S->chunk_alive)
            S->chunk_alive = chunk_column(S, j, last);
        if (!S->band_alive && !S->chunk_alive)
            return false;
    }
    return true;
}

/* Every distinct (b, h) slice; the heads of one batch row must see the same columns (the key
 * padding is per batch row). keys[b, j] = column j visible somewhere in batch row b. */
static bool scan_all(scan *S, int64_t batches, int64_t heads) {
    for (int64_t b = 0; b < batches; b++) {
        uint8_t *keys = S->keys + b * S->m;
        for (int64_t h = 0; h < heads; h++) {
            if (!scan_slice(S, b * S->strides[0] + h * S->strides[1]))
                return false;
            for (int64_t j = 0; j < S->m; j++) {
                const uint8_t seen = S->first[j] >= 0;
                if (h == 0)
                    keys[j] = seen;
                else if (keys[j] != seen)
                    return false;
            }
        }
    }
    return true;
}

/* The rule of the edges found (canonical form, mha.h) and the key vectors: a column that no row
 * of the band reaches (j - hi > n - 1 or j - lo < 0) is hidden whatever K says, so its K is set
 * to 1 (real), keeping padding only where it matters. */
static void finish_rule(scan *S, int64_t batches, int64_t chunk, mha_mask_rule *rule) {
    bool all_real = true;
    for (int64_t j = 0; j < S->m; j++) {
        /* chunk: j's chunk ends before row 0's position hi */
        const bool unreached = (S->hi_known && j - S->hi > S->n - 1) ||
                               (S->lo_known && j < S->lo) ||
                               (chunk > 0 && chunk * (j / chunk) + chunk - 1 < S->hi);
        for (int64_t b = 0; b < batches; b++) {
            if (unreached)
                S->keys[b * S->m + j] = 1;
            all_real = all_real && S->keys[b * S->m + j];
        }
    }
    const bool band = S->hi_known || S->lo_known;
    memset(rule, 0, sizeof *rule);
    rule->window_left = rule->window_right = -1;
    rule->chunk_size = chunk;
    if (S->hi_known) { /* j <= i + hi: causal at delta = hi; a lower edge adds (hi - lo, 0) */
        rule->causal = 1;
        rule->delta = S->hi;
        if (S->lo_known) {
            rule->use_window = 1;
            rule->window_left = S->hi - S->lo;
            rule->window_right = 0;
        }
    } else if (S->lo_known) { /* j >= i + lo only: the window (0, -1) at delta = lo */
        rule->delta = S->lo;
        rule->use_window = 1;
        rule->window_left = 0;
    }
    if (band)
        rule->kind = all_real ? MHA_MASK_RULE_BAND : MHA_MASK_RULE_BAND_AND_KEY_PADDING;
    else
        rule->kind = all_real ? MHA_MASK_RULE_ALL_VISIBLE : MHA_MASK_RULE_KEY_PADDING;
}

static bool is_mask_dtype(mha_dtype t) {
    return t == MHA_DTYPE_BOOL || t == MHA_DTYPE_U8 || t == MHA_DTYPE_I32 || t == MHA_DTYPE_I64;
}

/* Every argument of mha_mask_recognize; S gets the resolved tensor. */
static mha_status check_recognize(const mha_mask_tensor *mask,
                                  int32_t is_additive,
                                  mha_mask_polarity polarity,
                                  const int64_t target[4],
                                  const mha_mask_rule *rule,
                                  const uint8_t *key_padding_out,
                                  scan *S,
                                  mha_error *err) {
    static const char *const names[4] = {"batch", "num_heads", "q_len", "kv_len"};
    MHA_RETURN_IF(!mask || !rule, err, INVALID_ARG, "mask and rule must not be NULL");
    MHA_RETURN_IF(!mask->data, err, INVALID_ARG, "mask.data is NULL (no tensor to recognise)");
    for (int d = 0; d < 4; d++)
        MHA_RETURN_IF(target[d] < 1 || target[d] > MHA_MAX_DIM, err, INVALID_ARG,
                      "%s=%lld must be in [1, 2^31]", names[d], (long long)target[d]);
    if (is_additive)
        MHA_RETURN_IF(mask->dtype != MHA_DTYPE_F32, err, INVALID_ARG,
                      "mask.dtype=%d: an additive mask must be F32", (int)mask->dtype);
    else
        MHA_RETURN_IF(!is_mask_dtype(mask->dtype), err, INVALID_ARG,
                      "mask.dtype=%d must be BOOL, U8, I32 or I64 (an F32 mask is additive: "
                      "is_additive=1)",
                      (int)mask->dtype);
    MHA_RETURN_IF(!is_additive && polarity != MHA_MASK_ATTEND && polarity != MHA_MASK_BLOCK, err,
                  INVALID_ARG, "polarity=%d is not ATTEND or BLOCK", (int)polarity);
    mha_status st = mha__check_mask_broadcast(mask, "mask", target, S->strides, err);
    if (st)
        return st;
    int64_t kp_count, mask_count = 1;
    MHA_RETURN_IF(!mha__mul_i64(target[0], target[3], &kp_count), err, OVERFLOW,
                  "batch * kv_len overflows int64");
    for (int d = 0; d < mask->ndim; d++)
        mask_count *= mask->shape[d]; /* checked by mha__check_mask_broadcast */
    const mha__span out = mha__span_of("key_padding_out", key_padding_out, kp_count, 1);
    const mha__span in =
        mha__span_of("mask.data", mask->data, mask_count, mha_dtype_size(mask->dtype));
    return mha__check_no_overlap(&out, 1, &in, 1, err);
}

mha_status mha_mask_recognize(const mha_mask_tensor *mask,
                              int32_t is_additive,
                              mha_mask_polarity polarity,
                              int64_t batch,
                              int64_t num_heads,
                              int64_t q_len,
                              int64_t kv_len,
                              mha_mask_rule *rule,
                              uint8_t *key_padding_out,
                              mha_error *err) {
    const int64_t target[4] = {batch, num_heads, q_len, kv_len};
    scan S;
    memset(&S, 0, sizeof S);
    mha_status st =
        check_recognize(mask, is_additive, polarity, target, rule, key_padding_out, &S, err);
    if (st)
        return st;
    /* Distinct slices: a broadcast batch or head dimension is read once. */
    const int64_t batches = S.strides[0] ? batch : 1, heads = S.strides[1] ? num_heads : 1;
    /* Scratch: first and last [m] int64, the row and the previous one [m] and the key vectors
     * [batches, m] bytes. */
    int64_t per_col = 2 * (int64_t)sizeof(int64_t) + 2 + batches, total;
    size_t bytes;
    MHA_RETURN_IF(!mha__mul_i64(per_col, kv_len, &total) || !mha__bytes(total, 1, &bytes), err,
                  OVERFLOW, "mask recognition scratch (%lld bytes per key) overflows",
                  (long long)per_col);
    void *scratch = malloc(bytes);
    MHA_RETURN_IF(!scratch, err, NO_MEMORY, "cannot allocate %zu bytes for mask recognition",
                  bytes);
    S.data = mask->data;
    S.dtype = mask->dtype;
    S.additive = is_additive != 0;
    S.polarity = polarity;
    S.n = q_len;
    S.m = kv_len;
    S.first = scratch;
    S.last = S.first + kv_len;
    S.row = (uint8_t *)(S.last + kv_len);
    S.prev = S.row + kv_len;
    S.keys = S.prev + kv_len;
    S.hi_min = INT64_MIN;
    S.lo_max = INT64_MAX;
    S.band_alive = S.chunk_alive = true;
    S.ncands = -1;
    S.full_min = INT64_MAX;

    mha_mask_rule found;
    bool ok = scan_all(&S, batches, heads);
    int64_t chunk = 0;
    if (ok && !S.band_alive) { /* a chunked causal mask fails the band at its chunk ends */
        chunk = chunk_found(&S);
        ok = chunk > 0;
        S.lo_known = false; /* the chunks end the columns, not a lower edge */
    }
    if (ok) {
        finish_rule(&S, batches, chunk, &found);
    } else {
        memset(&found, 0, sizeof found);
        found.kind = MHA_MASK_RULE_NONE;
        found.window_left = found.window_right = -1;
        memset(S.keys, 1, (size_t)(batches * kv_len));
    }
    if (key_padding_out) /* a broadcast batch dimension: the same keys in every batch row */
        for (int64_t b = 0; b < batch; b++)
            memcpy(key_padding_out + b * kv_len, S.keys + (batches == 1 ? 0 : b) * kv_len,
                   (size_t)kv_len);
    free(scratch);
    *rule = found;
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_mask_rule_apply(const mha_mask_rule *rule,
                               int64_t batch,
                               int64_t q_len,
                               int64_t kv_len,
                               const uint8_t *key_padding,
                               int64_t *align_offsets,
                               mha_masking *mask,
                               mha_error *err) {
    MHA_RETURN_IF(!rule || !mask, err, INVALID_ARG, "rule and mask must not be NULL");
    MHA_RETURN_IF(rule->kind < MHA_MASK_RULE_ALL_VISIBLE ||
                      rule->kind > MHA_MASK_RULE_BAND_AND_KEY_PADDING,
                  err, INVALID_ARG, "rule.kind=%d is not a recognised rule (NONE: keep the tensor)",
                  (int)rule->kind);
    MHA_RETURN_IF(batch < 1 || batch > MHA_MAX_DIM || q_len < 1 || q_len > MHA_MAX_DIM ||
                      kv_len < 1 || kv_len > MHA_MAX_DIM,
                  err, INVALID_ARG, "batch=%lld, q_len=%lld, kv_len=%lld must be in [1, 2^31]",
                  (long long)batch, (long long)q_len, (long long)kv_len);
    MHA_RETURN_IF(mask->causal || mask->use_window || mask->key_padding.data, err, INVALID_ARG,
                  "mask already has causal, a window or key padding: a rule replaces a tensor "
                  "only in a masking without them");
    const bool band =
        rule->kind == MHA_MASK_RULE_BAND || rule->kind == MHA_MASK_RULE_BAND_AND_KEY_PADDING;
    const bool padded =
        rule->kind == MHA_MASK_RULE_KEY_PADDING || rule->kind == MHA_MASK_RULE_BAND_AND_KEY_PADDING;
    MHA_RETURN_IF(padded && !key_padding, err, INVALID_ARG,
                  "rule.kind=%d has key padding but key_padding is NULL", (int)rule->kind);
    /* The C API's alignment limit for a delta (mha_masking.align_offsets). */
    MHA_RETURN_IF(band && (rule->delta < -MHA_MAX_DIM || rule->delta > MHA_MAX_DIM), err,
                  INVALID_ARG, "rule.delta=%lld outside [-2^31, 2^31]", (long long)rule->delta);
    MHA_RETURN_IF(rule->chunk_size < 0 || (rule->chunk_size > 0 && (!band || !rule->causal)), err,
                  INVALID_ARG, "rule.chunk_size=%lld: a chunk is >= 0 and only on a causal band",
                  (long long)rule->chunk_size);
    MHA_RETURN_IF(rule->chunk_size > 0 && mask->chunk_size != 0, err, INVALID_ARG,
                  "mask already has chunk_size=%lld: a rule with a chunk replaces a tensor only in "
                  "a masking without one",
                  (long long)mask->chunk_size);
    const bool explicit_delta = band && rule->delta != kv_len - q_len && rule->delta != 0;
    MHA_RETURN_IF(explicit_delta && !align_offsets, err, INVALID_ARG,
                  "rule.delta=%lld is neither 0 nor kv_len - q_len: align_offsets [batch] needed",
                  (long long)rule->delta);
    if (band) {
        mask->causal = rule->causal;
        mask->use_window = rule->use_window;
        mask->window_left = rule->window_left;
        mask->window_right = rule->window_right;
        if (rule->chunk_size > 0)
            mask->chunk_size = rule->chunk_size;
        if (explicit_delta) {
            for (int64_t b = 0; b < batch; b++)
                align_offsets[b] = rule->delta;
            mask->alignment = MHA_ALIGN_EXPLICIT;
            mask->align_offsets = align_offsets;
        } else {
            mask->alignment =
                rule->delta == kv_len - q_len ? MHA_ALIGN_BOTTOM_RIGHT : MHA_ALIGN_TOP_LEFT;
        }
    }
    if (padded)
        mask->key_padding = (mha_mask_tensor){key_padding, MHA_DTYPE_U8, 2, {batch, kv_len, 0, 0}};
    mha__ok(err);
    return MHA_STATUS_OK;
}

const char *mha_mask_rule_describe(const mha_mask_rule *rule, char *buf, size_t size) {
    if (!buf || size == 0)
        return "";
    if (!rule || rule->kind == MHA_MASK_RULE_NONE ||
        rule->kind > MHA_MASK_RULE_BAND_AND_KEY_PADDING) {
        snprintf(buf, size, "no built-in rule");
        return buf;
    }
    if (rule->kind == MHA_MASK_RULE_ALL_VISIBLE) {
        snprintf(buf, size, "all keys visible");
        return buf;
    }
    size_t used = 0;
    const bool band =
        rule->kind == MHA_MASK_RULE_BAND || rule->kind == MHA_MASK_RULE_BAND_AND_KEY_PADDING;
    if (band && rule->causal)
        used += (size_t)snprintf(buf, size, "causal (delta %lld)", (long long)rule->delta);
    if (band && rule->use_window && used < size)
        used += (size_t)snprintf(buf + used, size - used, "%swindow (%lld, %lld)",
                                 rule->causal ? " + " : "", (long long)rule->window_left,
                                 (long long)rule->window_right);
    if (band && rule->chunk_size > 0 && used < size)
        used +=
            (size_t)snprintf(buf + used, size - used, " + chunk %lld", (long long)rule->chunk_size);
    if (band && !rule->causal && used < size)
        used += (size_t)snprintf(buf + used, size - used, " at delta %lld", (long long)rule->delta);
    if (rule->kind != MHA_MASK_RULE_BAND && used < size)
        snprintf(buf + used, size - used, "%skey padding", band ? " + " : "");
    return buf;
}

/* SPDX-License-Identifier: MIT */
/* gguf.c: GGUF files (llama.cpp's format): the reader and one attention layer of a llama-family
 * model (mha_gguf_layer_info_read, mha_layer_load_gguf). docs/MODELS.md "GGUF" has the keys read,
 * the tensor names, the Q/K row permutation that is undone and the types accepted.
 *
 * Layout (little-endian, versions 2 and 3):
 *   "GGUF" u32 version, u64 tensor_count, u64 kv_count,
 *   kv_count x (string key, u32 type, value), string = u64 length + bytes (no NUL),
 *   tensor_count x (string name, u32 n_dims, n_dims x u64 ne, u32 ggml type, u64 offset),
 *   padding to general.alignment (u32, default 32), then the data section; each tensor's data at
 *   data_start + offset (offset a multiple of the alignment). ne[0] varies fastest: an nn.Linear
 *   weight [out, in] is ne = {in, out}.
 *
 * The file is untrusted. Only the header, the keys, scalar values and the tensor infos are kept
 * in memory (string and array values are located and skipped; every length is checked against
 * the bytes left in the file before it is skipped or allocated), so memory stays proportional to
 * the number of keys and tensors (each capped), never to a length the file claims.
 */
#define _POSIX_C_SOURCE 200809L

#include "io/gguf.h"

#include "io/file.h"
#include "io/ggml_quants.h"

#include "base/internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#define GGUF_MAX_KEY       65535u     /* the spec's limit on a key's length */
#define GGUF_MAX_NAME      64u        /* the spec's limit on a tensor name's length */
#define GGUF_MAX_COUNT     (1u << 20) /* keys, tensors: real models have thousands at most */
#define GGUF_MAX_DEPTH     4          /* arrays of arrays */
#define GGUF_MAX_DIMS      4u
#define GGUF_MAX_ALIGNMENT (1u << 30)
#define GGUF_MAX_HEADS     ((int64_t)1 << 20)
#define GGUF_MAX_SIZE      ((int64_t)1 << 24) /* hidden size, head_dim */
#define GGUF_TEXT          256
#define GGUF_PI            3.14159265358979323846

typedef struct gguf_kv {
    char *key;
    uint32_t type;
    union {
        uint64_t u;
        int64_t i;
        double f;
    } v;                /* scalars (BOOL in u) */
    uint64_t off;       /* STRING: its bytes; ARRAY: its first element */
    uint64_t len;       /* STRING: byte length; ARRAY: element count */
    uint32_t elem_type; /* ARRAY */
} gguf_kv;

typedef struct gguf_tensor {
    char *name;
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* 1 beyond n_dims */
    uint32_t type;
    uint64_t offset; /* from data_start */
    uint64_t bytes;  /* of its data (0: a type whose size is not known, never read) */
} gguf_tensor;

struct mha__gguf {
    FILE *f;
    char path[4096];
    uint64_t size, pos;
    uint32_t version;
    uint64_t n_kv, n_tensors;
    gguf_kv *kv;    /* sorted by key */
    gguf_tensor *t; /* sorted by name */
    uint64_t alignment;
    uint64_t data_start;
};

/* ---------------------------------------------------------------------------------------------- */
/* Types                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

static const char *value_type_name(uint32_t t) {
    static const char *const names[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                        "int32",  "float32", "bool",   "string", "array",
                                        "uint64", "int64",   "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* What a value is, for messages: "a uint32", "an int8", "an array of 3 float32 values". */
static const char *kv_type_text(const gguf_kv *kv, char *buf, size_t cap) {
    const uint32_t t = kv->type;
    const char *an = t == MHA__GGUF_I8 || t == MHA__GGUF_I16 || t == MHA__GGUF_I32 ||
                             t == MHA__GGUF_I64 || t == MHA__GGUF_ARRAY
                         ? "an"
                         : "a";
    if (t == MHA__GGUF_ARRAY)
        snprintf(buf, cap, "an array of %llu %s values", (unsigned long long)kv->len,
                 value_type_name(kv->elem_type));
    else
        snprintf(buf, cap, "%s %s", an, value_type_name(t));
    return buf;
}

/* Bytes of a scalar value type; 0 for STRING, ARRAY and unknown types. */
static uint64_t scalar_size(uint32_t t) {
    static const uint8_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < sizeof sizes ? sizes[t] : 0;
}

/* ggml tensor type names, for messages (the numbers of ggml's enum ggml_type). */
static const char *ggml_type_name(uint32_t t) {
    static const char *const names[] = {
        [0] = "F32",     [1] = "F16",      [2] = "Q4_0",   [3] = "Q4_1",    [6] = "Q5_0",
        [7] = "Q5_1",    [8] = "Q8_0",     [9] = "Q8_1",   [10] = "Q2_K",   [11] = "Q3_K",
        [12] = "Q4_K",   [13] = "Q5_K",    [14] = "Q6_K",  [15] = "Q8_K",   [16] = "IQ2_XXS",
        [17] = "IQ2_XS", [18] = "IQ3_XXS", [19] = "IQ1_S", [20] = "IQ4_NL", [21] = "IQ3_S",
        [22] = "IQ2_S",  [23] = "IQ4_XS",  [24] = "I8",    [25] = "I16",    [26] = "I32",
        [27] = "I64",    [28] = "F64",     [29] = "IQ1_M", [30] = "BF16",   [34] = "TQ1_0",
        [35] = "TQ2_0",  [39] = "MXFP4"};
    return t < sizeof names / sizeof names[0] && names[t] ? names[t] : "unknown";
}

/* ---------------------------------------------------------------------------------------------- */
/* Reading                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static uint64_t left(const mha__gguf *g) {
    return g->size - g->pos;
}

static mha_status truncated(const mha__gguf *g, uint64_t need, const char *what, mha_error *err) {
    return mha__fail(err, MHA_STATUS_BAD_FILE,
                     "%s: truncated: %s at byte %llu needs %llu bytes, the file has %llu left",
                     g->path, what, (unsigned long long)g->pos, (unsigned long long)need,
                     (unsigned long long)left(g));
}

static mha_status rd(mha__gguf *g, void *buf, uint64_t n, const char *what, mha_error *err) {
    if (n > left(g))
        return truncated(g, n, what, err);
    MHA_RETURN_IF(n && fread(buf, 1, (size_t)n, g->f) != (size_t)n, err, IO,
                  "%s: read error at byte %llu (%s)", g->path, (unsigned long long)g->pos, what);
    g->pos += n;
    return MHA_STATUS_OK;
}

static mha_status seek(mha__gguf *g, uint64_t to, const char *what, mha_error *err) {
    MHA_RETURN_IF(
        to > g->size || to > (uint64_t)INT64_MAX || fseeko(g->f, (off_t)to, SEEK_SET) != 0, err, IO,
        "%s: cannot seek to byte %llu (%s)", g->path, (unsigned long long)to, what);
    g->pos = to;
    return MHA_STATUS_OK;
}

static mha_status skip(mha__gguf *g, uint64_t n, const char *what, mha_error *err) {
    if (n > left(g))
        return truncated(g, n, what, err);
    return seek(g, g->pos + n, what, err);
}

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int b = n - 1; b >= 0; b--)
        v = v << 8 | p[b];
    return v;
}

static mha_status rd_u32(mha__gguf *g, uint32_t *out, const char *what, mha_error *err) {
    unsigned char b[4];
    MHA_TRY(rd(g, b, 4, what, err));
    *out = (uint32_t)le(b, 4);
    return MHA_STATUS_OK;
}

static mha_status rd_u64(mha__gguf *g, uint64_t *out, const char *what, mha_error *err) {
    unsigned char b[8];
    MHA_TRY(rd(g, b, 8, what, err));
    *out = le(b, 8);
    return MHA_STATUS_OK;
}

/* A key or tensor name: at most `cap` bytes, no NUL inside; *out malloc'd and NUL-terminated. */
static mha_status
rd_name(mha__gguf *g, uint64_t cap, const char *what, char **out, mha_error *err) {
    uint64_t len;
    MHA_TRY(rd_u64(g, &len, what, err));
    MHA_RETURN_IF(
        len > cap, err, BAD_FILE, "%s: %s at byte %llu is %llu bytes long, more than %llu", g->path,
        what, (unsigned long long)(g->pos - 8), (unsigned long long)len, (unsigned long long)cap);
    if (len > left(g))
        return truncated(g, len, what, err);
    char *s = malloc((size_t)len + 1);
    MHA_RETURN_IF(!s, err, NO_MEMORY, "%s: out of memory", g->path);
    mha_status st = rd(g, s, len, what, err);
    s[len] = '\0';
    if (st == MHA_STATUS_OK && strlen(s) != len)
        st = mha__fail(err, MHA_STATUS_BAD_FILE, "%s: %s '%s...' contains a NUL byte", g->path,
                       what, s);
    if (st != MHA_STATUS_OK) {
        free(s);
        return st;
    }
    *out = s;
    return MHA_STATUS_OK;
}

/* A value of `type` (kv: where to record it; NULL inside arrays), skipping strings and arrays. */
static mha_status
rd_value(mha__gguf *g, uint32_t type, gguf_kv *kv, const char *key, int depth, mha_error *err) {
    const uint64_t sz = scalar_size(type);
    if (sz) {
        unsigned char b[8];
        MHA_TRY(rd(g, b, sz, key, err));
        if (!kv)
            return MHA_STATUS_OK;
        const uint64_t u = le(b, (int)sz);
        switch (type) {
        case MHA__GGUF_I8:
            kv->v.i = (int8_t)u;
            break;
        case MHA__GGUF_I16:
            kv->v.i = (int16_t)u;
            break;
        case MHA__GGUF_I32:
            kv->v.i = (int32_t)u;
            break;
        case MHA__GGUF_I64:
            memcpy(&kv->v.i, &u, 8);
            break;
        case MHA__GGUF_F32: {
            float f;
            const uint32_t w = (uint32_t)u;
            memcpy(&f, &w, 4);
            kv->v.f = (double)f;
            break;
        }
        case MHA__GGUF_F64:
            memcpy(&kv->v.f, &u, 8);
            break;
        case MHA__GGUF_BOOL:
            MHA_RETURN_IF(u > 1, err, BAD_FILE, "%s: key '%s': bool value %llu is not 0 or 1",
                          g->path, key, (unsigned long long)u);
            kv->v.u = u;
            break;
        default:
            kv->v.u = u;
            break;
        }
        return MHA_STATUS_OK;
    }
    if (type == MHA__GGUF_STRING) {
        uint64_t len;
        MHA_TRY(rd_u64(g, &len, key, err));
        if (kv)
            kv->off = g->pos, kv->len = len;
        return skip(g, len, key, err);
    }
    MHA_RETURN_IF(type != MHA__GGUF_ARRAY, err, BAD_FILE,
                  "%s: key '%s': unknown value type %u at byte %llu", g->path, key, type,
                  (unsigned long long)(g->pos - 4));
    MHA_RETURN_IF(depth >= GGUF_MAX_DEPTH, err, BAD_FILE,
                  "%s: key '%s': arrays nested more than %d deep", g->path, key, GGUF_MAX_DEPTH);
    uint32_t et;
    uint64_t n;
    MHA_TRY(rd_u32(g, &et, key, err));
    MHA_TRY(rd_u64(g, &n, key, err));
    if (kv)
        kv->elem_type = et, kv->len = n, kv->off = g->pos;
    const uint64_t esz = scalar_size(et);
    if (esz) {
        MHA_RETURN_IF(n > left(g) / esz, err, BAD_FILE,
                      "%s: key '%s': an array of %llu %s values at byte %llu does not fit in the "
                      "%llu bytes left",
                      g->path, key, (unsigned long long)n, value_type_name(et),
                      (unsigned long long)g->pos, (unsigned long long)left(g));
        return skip(g, n * esz, key, err);
    }
    MHA_RETURN_IF(et != MHA__GGUF_STRING && et != MHA__GGUF_ARRAY, err, BAD_FILE,
                  "%s: key '%s': unknown array element type %u", g->path, key, et);
    /* each element takes at least 8 (string) or 12 (array) bytes */
    const uint64_t min = et == MHA__GGUF_STRING ? 8 : 12;
    MHA_RETURN_IF(n > left(g) / min, err, BAD_FILE,
                  "%s: key '%s': an array of %llu %ss at byte %llu does not fit in the %llu bytes "
                  "left",
                  g->path, key, (unsigned long long)n, value_type_name(et),
                  (unsigned long long)g->pos, (unsigned long long)left(g));
    for (uint64_t i = 0; i < n; i++)
        MHA_TRY(rd_value(g, et, NULL, key, depth + 1, err));
    return MHA_STATUS_OK;
}

static int cmp_kv(const void *a, const void *b) {
    return strcmp(((const gguf_kv *)a)->key, ((const gguf_kv *)b)->key);
}
static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const gguf_tensor *)a)->name, ((const gguf_tensor *)b)->name);
}

static const gguf_kv *kv_find(const mha__gguf *g, const char *key) {
    gguf_kv probe;
    memset(&probe, 0, sizeof probe);
    probe.key = (char *)(uintptr_t)key;
    return g->n_kv ? bsearch(&probe, g->kv, (size_t)g->n_kv, sizeof probe, cmp_kv) : NULL;
}

static const gguf_tensor *tensor_find(const mha__gguf *g, const char *name) {
    gguf_tensor probe;
    memset(&probe, 0, sizeof probe);
    probe.name = (char *)(uintptr_t)name;
    return g->n_tensors ? bsearch(&probe, g->t, (size_t)g->n_tensors, sizeof probe, cmp_tensor)
                        : NULL;
}

static mha_status parse_header(mha__gguf *g, mha_error *err) {
    unsigned char magic[4];
    MHA_RETURN_IF(g->size < 24, err, BAD_FILE,
                  "%s: the file is %llu bytes, too short for a GGUF header (24)", g->path,
                  (unsigned long long)g->size);
    MHA_TRY(rd(g, magic, 4, "the magic", err));
    MHA_RETURN_IF(memcmp(magic, "GGUF", 4) != 0, err, BAD_FILE,
                  "%s: not a GGUF file (the first 4 bytes are not \"GGUF\")", g->path);
    MHA_TRY(rd_u32(g, &g->version, "the version", err));
    const uint32_t swapped = (g->version >> 24) | ((g->version >> 8) & 0xff00u);
    MHA_RETURN_IF((g->version & 0xffffu) == 0 && (swapped == 2 || swapped == 3), err, BAD_FILE,
                  "%s: a big-endian GGUF file (version %u): only little-endian files are read",
                  g->path, swapped);
    MHA_RETURN_IF(g->version == 1, err, BAD_FILE,
                  "%s: GGUF version 1 (32-bit counts) is not supported: versions 2 and 3 are",
                  g->path);
    MHA_RETURN_IF(g->version != 2 && g->version != 3, err, BAD_FILE,
                  "%s: GGUF version %u is not supported: versions 2 and 3 are", g->path,
                  g->version);
    MHA_TRY(rd_u64(g, &g->n_tensors, "the tensor count", err));
    MHA_TRY(rd_u64(g, &g->n_kv, "the metadata count", err));
    MHA_RETURN_IF(g->n_kv > GGUF_MAX_COUNT || g->n_kv > left(g) / 13, err, BAD_FILE,
                  "%s: %llu metadata keys: more than the limit (%u) or than %llu bytes can hold",
                  g->path, (unsigned long long)g->n_kv, GGUF_MAX_COUNT,
                  (unsigned long long)left(g));
    MHA_RETURN_IF(g->n_tensors > GGUF_MAX_COUNT || g->n_tensors > left(g) / 24, err, BAD_FILE,
                  "%s: %llu tensors: more than the limit (%u) or than %llu bytes can hold", g->path,
                  (unsigned long long)g->n_tensors, GGUF_MAX_COUNT, (unsigned long long)left(g));
    return MHA_STATUS_OK;
}

static mha_status parse_kvs(mha__gguf *g, mha_error *err) {
    if (g->n_kv) {
        g->kv = calloc((size_t)g->n_kv, sizeof *g->kv);
        MHA_RETURN_IF(!g->kv, err, NO_MEMORY, "%s: out of memory", g->path);
    }
    char what[64];
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kv[i];
        snprintf(what, sizeof what, "the key of metadata entry %llu", (unsigned long long)i);
        MHA_TRY(rd_name(g, GGUF_MAX_KEY, what, &kv->key, err));
        MHA_TRY(rd_u32(g, &kv->type, kv->key, err));
        MHA_TRY(rd_value(g, kv->type, kv, kv->key, 0, err));
    }
    if (g->n_kv)
        qsort(g->kv, (size_t)g->n_kv, sizeof *g->kv, cmp_kv);
    for (uint64_t i = 1; i < g->n_kv; i++)
        MHA_RETURN_IF(strcmp(g->kv[i - 1].key, g->kv[i].key) == 0, err, BAD_FILE,
                      "%s: metadata key '%s' appears twice", g->path, g->kv[i].key);
    g->alignment = 32;
    const gguf_kv *a = kv_find(g, "general.alignment");
    if (a) {
        char tt[96];
        MHA_RETURN_IF(a->type != MHA__GGUF_U32, err, BAD_FILE,
                      "%s: general.alignment is %s, not a uint32", g->path,
                      kv_type_text(a, tt, sizeof tt));
        MHA_RETURN_IF(a->v.u == 0 || (a->v.u & (a->v.u - 1)) != 0 || a->v.u > GGUF_MAX_ALIGNMENT,
                      err, BAD_FILE, "%s: general.alignment %llu is not a power of two <= 2^30",
                      g->path, (unsigned long long)a->v.u);
        g->alignment = a->v.u;
    }
    return MHA_STATUS_OK;
}

/* Bytes of a tensor of a sizable type (0 when its type is not one: never read). */
static mha_status
tensor_bytes(const mha__gguf *g, const gguf_tensor *t, uint64_t *bytes, mha_error *err) {
    uint64_t bv, bb;
    mha__ggml_type_block(t->type, &bv, &bb);
    *bytes = 0;
    if (!bb)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(t->ne[0] % bv != 0, err, BAD_FILE,
                  "%s: tensor '%s': its first dimension %llu is not a multiple of %s's block of "
                  "%llu values",
                  g->path, t->name, (unsigned long long)t->ne[0], ggml_type_name(t->type),
                  (unsigned long long)bv);
    uint64_t n = t->ne[0] / bv * bb; /* < 2^63 / 32 * 34: no overflow */
    for (uint32_t d = 1; d < GGUF_MAX_DIMS; d++) {
        MHA_RETURN_IF(t->ne[d] && n > (uint64_t)INT64_MAX / t->ne[d], err, BAD_FILE,
                      "%s: tensor '%s': its size overflows", g->path, t->name);
        n *= t->ne[d];
    }
    *bytes = n;
    return MHA_STATUS_OK;
}

static int cmp_offset(const void *a, const void *b) {
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* No two tensors' data overlap (llama.cpp's reader refuses such a file too: one tensor's bytes
 * would be read as another's). Tensors of a type whose size is not known are not placed. */
static mha_status check_overlaps(const mha__gguf *g, mha_error *err) {
    if (g->n_tensors < 2)
        return MHA_STATUS_OK;
    const gguf_tensor **by = malloc((size_t)g->n_tensors * sizeof *by);
    MHA_RETURN_IF(!by, err, NO_MEMORY, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_tensors; i++)
        by[i] = &g->t[i];
    qsort(by, (size_t)g->n_tensors, sizeof *by, cmp_offset);
    const gguf_tensor *last = NULL; /* the sized tensor whose data ends last so far */
    mha_status st = MHA_STATUS_OK;
    for (uint64_t i = 0; i < g->n_tensors && st == MHA_STATUS_OK; i++) {
        const gguf_tensor *t = by[i];
        if (!t->bytes)
            continue;
        if (last && t->offset < last->offset + last->bytes) /* both inside the file: no overflow */
            st =
                mha__fail(err, MHA_STATUS_BAD_FILE,
                          "%s: tensors '%s' (%llu bytes at offset %llu) and '%s' (at offset "
                          "%llu) overlap in the data section",
                          g->path, last->name, (unsigned long long)last->bytes,
                          (unsigned long long)last->offset, t->name, (unsigned long long)t->offset);
        if (!last || t->offset + t->bytes > last->offset + last->bytes)
            last = t;
    }
    free(by);
    return st;
}

static mha_status parse_tensors(mha__gguf *g, mha_error *err) {
    if (g->n_tensors) {
        g->t = calloc((size_t)g->n_tensors, sizeof *g->t);
        MHA_RETURN_IF(!g->t, err, NO_MEMORY, "%s: out of memory", g->path);
    }
    char what[64];
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        gguf_tensor *t = &g->t[i];
        snprintf(what, sizeof what, "the name of tensor %llu", (unsigned long long)i);
        MHA_TRY(rd_name(g, GGUF_MAX_NAME, what, &t->name, err));
        MHA_TRY(rd_u32(g, &t->n_dims, t->name, err));
        MHA_RETURN_IF(t->n_dims > GGUF_MAX_DIMS, err, BAD_FILE,
                      "%s: tensor '%s' has %u dimensions, more than %u", g->path, t->name,
                      t->n_dims, GGUF_MAX_DIMS);
        uint64_t elems = 1;
        for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
            t->ne[d] = 1;
            if (d < t->n_dims)
                MHA_TRY(rd_u64(g, &t->ne[d], t->name, err));
            MHA_RETURN_IF(t->ne[d] > (uint64_t)INT64_MAX ||
                              (t->ne[d] && elems > (uint64_t)INT64_MAX / t->ne[d]),
                          err, BAD_FILE, "%s: tensor '%s': its element count overflows", g->path,
                          t->name);
            elems *= t->ne[d];
        }
        MHA_TRY(rd_u32(g, &t->type, t->name, err));
        MHA_TRY(rd_u64(g, &t->offset, t->name, err));
        MHA_RETURN_IF(t->offset % g->alignment != 0, err, BAD_FILE,
                      "%s: tensor '%s': offset %llu is not a multiple of the alignment %llu",
                      g->path, t->name, (unsigned long long)t->offset,
                      (unsigned long long)g->alignment);
    }
    if (g->n_tensors)
        qsort(g->t, (size_t)g->n_tensors, sizeof *g->t, cmp_tensor);
    for (uint64_t i = 1; i < g->n_tensors; i++)
        MHA_RETURN_IF(strcmp(g->t[i - 1].name, g->t[i].name) == 0, err, BAD_FILE,
                      "%s: tensor '%s' appears twice", g->path, g->t[i].name);
    /* the data section: the end of the infos rounded up to the alignment */
    const uint64_t pad = (g->alignment - g->pos % g->alignment) % g->alignment;
    g->data_start = g->pos + pad; /* pos <= size < 2^63, pad < 2^30 */
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        gguf_tensor *t = &g->t[i];
        uint64_t bytes;
        MHA_TRY(tensor_bytes(g, t, &bytes, err));
        t->bytes = bytes;
        const uint64_t avail = g->size > g->data_start ? g->size - g->data_start : 0;
        MHA_RETURN_IF(t->offset > avail || bytes > avail - t->offset, err, BAD_FILE,
                      "%s: tensor '%s': its data (%llu bytes at offset %llu of the data section "
                      "at byte %llu) runs past the end of the file (%llu bytes)",
                      g->path, t->name, (unsigned long long)bytes, (unsigned long long)t->offset,
                      (unsigned long long)g->data_start, (unsigned long long)g->size);
    }
    return check_overlaps(g, err);
}

void mha__gguf_close(mha__gguf *g) {
    if (!g)
        return;
    if (g->f)
        fclose(g->f);
    for (uint64_t i = 0; g->kv && i < g->n_kv; i++)
        free(g->kv[i].key);
    for (uint64_t i = 0; g->t && i < g->n_tensors; i++)
        free(g->t[i].name);
    free(g->kv);
    free(g->t);
    free(g);
}

static mha_status
parse(mha__gguf *g, FILE *f, uint64_t size, const char *name, mha__gguf **out, mha_error *err) {
    g->f = f;
    g->size = size;
    snprintf(g->path, sizeof g->path, "%s", name);
    mha_status st = MHA_STATUS_OK;
    if (size > (uint64_t)INT64_MAX)
        st = mha__fail(err, MHA_STATUS_BAD_FILE, "%s: too large", g->path);
    if (st == MHA_STATUS_OK)
        st = parse_header(g, err);
    if (st == MHA_STATUS_OK)
        st = parse_kvs(g, err);
    if (st == MHA_STATUS_OK)
        st = parse_tensors(g, err);
    if (st != MHA_STATUS_OK) {
        mha__gguf_close(g);
        return st;
    }
    *out = g;
    return MHA_STATUS_OK;
}

mha_status mha__gguf_open(const char *path, mha__gguf **out, mha_error *err) {
    *out = NULL;
    mha__gguf *g = calloc(1, sizeof *g);
    MHA_RETURN_IF(!g, err, NO_MEMORY, "%s: out of memory", path);
    FILE *f = NULL;
    uint64_t size = 0;
    mha_status st = mha__open_regular(path, &f, &size, NULL, err);
    if (st != MHA_STATUS_OK) {
        free(g);
        return st;
    }
    return parse(g, f, size, path, out, err);
}

mha_status
mha__gguf_open_mem(const void *buf, size_t len, const char *name, mha__gguf **out, mha_error *err) {
    *out = NULL;
    if (!name)
        name = "<memory>";
    MHA_RETURN_IF(len < 24, err, BAD_FILE,
                  "%s: the file is %llu bytes, too short for a GGUF header (24)", name,
                  (unsigned long long)len);
    mha__gguf *g = calloc(1, sizeof *g);
    MHA_RETURN_IF(!g, err, NO_MEMORY, "%s: out of memory", name);
    FILE *f = fmemopen((void *)(uintptr_t)buf, len, "rb");
    if (!f) {
        free(g);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "%s: cannot open the memory image: %s", name,
                         strerror(errno));
    }
    return parse(g, f, (uint64_t)len, name, out, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* Metadata values                                                                                */
/* ---------------------------------------------------------------------------------------------- */

static int is_int_type(uint32_t t) {
    return t <= MHA__GGUF_I32 || t == MHA__GGUF_U64 || t == MHA__GGUF_I64;
}
static int is_signed_type(uint32_t t) {
    return t == MHA__GGUF_I8 || t == MHA__GGUF_I16 || t == MHA__GGUF_I32 || t == MHA__GGUF_I64;
}

/* An integer of any width in [lo, hi]: a scalar, or (per_layer) an array of n_layers integers of
 * which element `layer` is taken (llama.cpp writes per-layer head counts so). *found = 0 and OK
 * when absent. */
static mha_status get_int(mha__gguf *g,
                          const char *key,
                          int64_t layer,
                          int64_t n_layers,
                          int64_t lo,
                          int64_t hi,
                          int64_t *out,
                          int *found,
                          mha_error *err) {
    const gguf_kv *kv = kv_find(g, key);
    *found = kv != NULL;
    if (!kv)
        return MHA_STATUS_OK;
    int64_t v;
    if (kv->type == MHA__GGUF_ARRAY && n_layers > 0 && is_int_type(kv->elem_type)) {
        MHA_RETURN_IF(kv->len != (uint64_t)n_layers, err, BAD_FILE,
                      "%s: '%s' is an array of %llu values, not one per layer (%lld)", g->path, key,
                      (unsigned long long)kv->len, (long long)n_layers);
        const uint64_t esz = scalar_size(kv->elem_type);
        unsigned char b[8];
        MHA_TRY(seek(g, kv->off + (uint64_t)layer * esz, key, err));
        MHA_TRY(rd(g, b, esz, key, err));
        const uint64_t u = le(b, (int)esz);
        if (is_signed_type(kv->elem_type)) {
            const int sh = 64 - 8 * (int)esz;
            v = (int64_t)(u << sh) >> sh;
        } else {
            MHA_RETURN_IF(u > (uint64_t)INT64_MAX, err, BAD_FILE, "%s: '%s'[%lld] is too large",
                          g->path, key, (long long)layer);
            v = (int64_t)u;
        }
    } else {
        char tt[96];
        MHA_RETURN_IF(!is_int_type(kv->type), err, BAD_FILE, "%s: '%s' is %s, not an integer%s",
                      g->path, key, kv_type_text(kv, tt, sizeof tt),
                      n_layers > 0 ? " or an array of one integer per layer" : "");
        MHA_RETURN_IF(!is_signed_type(kv->type) && kv->v.u > (uint64_t)INT64_MAX, err, BAD_FILE,
                      "%s: '%s' = %llu is too large", g->path, key, (unsigned long long)kv->v.u);
        v = kv->v.i;
    }
    MHA_RETURN_IF(v < lo || v > hi, err, BAD_FILE, "%s: '%s' = %lld is not in [%lld, %lld]",
                  g->path, key, (long long)v, (long long)lo, (long long)hi);
    *out = v;
    return MHA_STATUS_OK;
}

/* A finite number (float32, float64 or an integer) > 0 when `positive`. */
static mha_status
get_num(mha__gguf *g, const char *key, int positive, double *out, int *found, mha_error *err) {
    const gguf_kv *kv = kv_find(g, key);
    *found = kv != NULL;
    if (!kv)
        return MHA_STATUS_OK;
    double v;
    if (kv->type == MHA__GGUF_F32 || kv->type == MHA__GGUF_F64)
        v = kv->v.f;
    else if (is_int_type(kv->type))
        v = is_signed_type(kv->type) ? (double)kv->v.i : (double)kv->v.u;
    else {
        char tt[96];
        return mha__fail(err, MHA_STATUS_BAD_FILE, "%s: '%s' is %s, not a number", g->path, key,
                         kv_type_text(kv, tt, sizeof tt));
    }
    MHA_RETURN_IF(!isfinite(v) || (positive && !(v > 0)), err, BAD_FILE,
                  "%s: '%s' = %g is not a finite number%s", g->path, key, v,
                  positive ? " > 0" : "");
    *out = v;
    return MHA_STATUS_OK;
}

/* A string value (shorter than `cap`, no NUL) into buf. */
static mha_status
get_str(mha__gguf *g, const char *key, char *buf, size_t cap, int *found, mha_error *err) {
    const gguf_kv *kv = kv_find(g, key);
    *found = kv != NULL;
    if (!kv)
        return MHA_STATUS_OK;
    char tt[96];
    MHA_RETURN_IF(kv->type != MHA__GGUF_STRING, err, BAD_FILE, "%s: '%s' is %s, not a string",
                  g->path, key, kv_type_text(kv, tt, sizeof tt));
    MHA_RETURN_IF(kv->len >= cap, err, BAD_FILE, "%s: '%s' is %llu bytes long, more than %zu",
                  g->path, key, (unsigned long long)kv->len, cap - 1);
    MHA_TRY(seek(g, kv->off, key, err));
    MHA_TRY(rd(g, buf, kv->len, key, err));
    buf[kv->len] = '\0';
    MHA_RETURN_IF(strlen(buf) != kv->len, err, BAD_FILE, "%s: '%s' contains a NUL byte", g->path,
                  key);
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* The layer's options                                                                            */
/* ---------------------------------------------------------------------------------------------- */

/* The architectures read (general.architecture) and whether llama.cpp's converter permuted the
 * rows of Q and K (llama, mistral: yes; qwen2, qwen3, phi3: no, they keep HF's rotate_half
 * layout). */
typedef struct gguf_arch {
    const char *name;
    int permuted;
    int qk_norm; /* blk.L.attn_q_norm / attn_k_norm required */
    int phi3; /* fused attn_qkv (or separate q, k, v), LongRoPE factor tensors, window 0 = none */
} gguf_arch;
static const gguf_arch GGUF_ARCHS[] = {
    {"llama", 1, 0, 0}, {"mistral", 1, 0, 0}, {"qwen2", 0, 0, 0},
    {"qwen3", 0, 1, 0}, {"phi3", 0, 0, 1},
};

static mha_status
find_arch(mha__gguf *g, const gguf_arch **out, char *name, size_t cap, mha_error *err) {
    int found;
    MHA_TRY(get_str(g, "general.architecture", name, cap, &found, err));
    MHA_RETURN_IF(!found, err, BAD_FILE, "%s: no general.architecture", g->path);
    for (size_t i = 0; i < sizeof GGUF_ARCHS / sizeof GGUF_ARCHS[0]; i++)
        if (strcmp(name, GGUF_ARCHS[i].name) == 0) {
            *out = &GGUF_ARCHS[i];
            return MHA_STATUS_OK;
        }
    return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                     "%s: general.architecture '%s' is not supported (llama, mistral, qwen2, qwen3 "
                     "and phi3 are)",
                     g->path, name);
}

/* (Both fit: an architecture name is under 64 bytes, a stem under 32.) */
static int key_of(char *buf, const char *arch, const char *rest) {
    return snprintf(buf, GGUF_TEXT, "%s.%s", arch, rest);
}

static int tensor_name(char *buf, int64_t layer, const char *stem) {
    return snprintf(buf, GGUF_TEXT, "blk.%lld.%s", (long long)layer, stem);
}

/* YaRN as llama.cpp runs it (docs/MODELS.md "GGUF files"): the ramp between beta_fast and
 * beta_slow rotations over rope.scaling.original_context_length (else context_length), ends
 * floored/ceiled (transformers' truncate), cos and sin times mscale(factor) = 0.1 ln(factor) + 1
 * (1 if factor <= 1) — or mscale(factor, 1) / mscale(factor, yarn_log_multiplier) when that key
 * is nonzero — times rope.scaling.attn_factor. */
static double gguf_mscale(double factor, double m) {
    return factor <= 1.0 ? 1.0 : 0.1 * m * log(factor) + 1.0;
}

static mha_status
read_yarn(mha__gguf *g, const char *arch, double factor, mha_rope *r, mha_error *err) {
    char key[GGUF_TEXT];
    int found;
    MHA_RETURN_IF(factor <= 0.0, err, BAD_FILE, "%s: yarn rope scaling without %s.%s", g->path,
                  arch, "rope.scaling.factor");
    int64_t orig = 0;
    key_of(key, arch, "rope.scaling.original_context_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, INT32_MAX, &orig, &found, err));
    if (!found) {
        key_of(key, arch, "context_length");
        MHA_TRY(get_int(g, key, 0, 0, 1, INT32_MAX, &orig, &found, err));
        MHA_RETURN_IF(!found, err, BAD_FILE,
                      "%s: yarn rope scaling without %s.rope.scaling.original_context_length or "
                      "%s.context_length",
                      g->path, arch, arch);
    }
    /* ext_factor: llama.cpp's weight of the ramp (1 for YaRN); another mixes what mha cannot */
    double ext = 1.0;
    key_of(key, arch, "rope.scaling.yarn_ext_factor");
    MHA_TRY(get_num(g, key, 0, &ext, &found, err));
    MHA_RETURN_IF(found && ext != 1.0 && ext >= 0.0, err, UNSUPPORTED,
                  "%s: '%s' = %g: only 1 (the full YaRN ramp, as transformers') is supported",
                  g->path, key, ext);
    double v = 0.0;
    key_of(key, arch, "rope.scaling.yarn_attn_factor");
    MHA_TRY(get_num(g, key, 0, &v, &found, err));
    MHA_RETURN_IF(found && v != 1.0, err, UNSUPPORTED,
                  "%s: '%s' = %g is not mapped (only 1 is supported)", g->path, key, v);
    double log_mul = 0.0, attn = 1.0;
    key_of(key, arch, "rope.scaling.yarn_log_multiplier");
    MHA_TRY(get_num(g, key, 0, &log_mul, &found, err));
    key_of(key, arch, "rope.scaling.attn_factor");
    MHA_TRY(get_num(g, key, 1, &attn, &found, err));
    r->beta_fast = 32.0;
    r->beta_slow = 1.0;
    key_of(key, arch, "rope.scaling.yarn_beta_fast");
    MHA_TRY(get_num(g, key, 1, &r->beta_fast, &found, err));
    key_of(key, arch, "rope.scaling.yarn_beta_slow");
    MHA_TRY(get_num(g, key, 1, &r->beta_slow, &found, err));
    /* the ramp's ends as ggml computes them (ggml_rope_yarn_corr_dims): when the low end passes
     * the high one, ggml's ramp is a step (it divides by MAX(0.001, high - low)) where mha's, as
     * transformers', is reversed (docs/SEMANTICS.md, yarn): not the same layer, refused (a
     * theta <= 1 is refused by mha_layer_create) */
    const double R = (double)r->rotary_dim, lt = 2.0 * log(r->theta);
    const double lo = fmax(0.0, floor(R * log((double)orig / (r->beta_fast * 2.0 * GGUF_PI)) / lt));
    const double hi =
        fmin(R - 1.0, ceil(R * log((double)orig / (r->beta_slow * 2.0 * GGUF_PI)) / lt));
    MHA_RETURN_IF(
        r->theta > 1.0 && lo > hi, err, UNSUPPORTED,
        "%s: yarn rope scaling: the ramp's low end %g (from %s.rope.scaling.yarn_beta_fast "
        "= %g) is past its high end %g (yarn_beta_slow = %g): llama.cpp's ramp is then a "
        "step, mha's reversed; not supported",
        g->path, lo, arch, r->beta_fast, hi + 0.0, r->beta_slow);
    const double af = (log_mul != 0.0 ? gguf_mscale(factor, 1.0) / gguf_mscale(factor, log_mul)
                                      : gguf_mscale(factor, 1.0)) *
                      attn;
    MHA_RETURN_IF(!isfinite(af) || !(af > 0.0), err, BAD_FILE,
                  "%s: yarn rope scaling: the attention factor %g (from %s.rope.scaling.factor, "
                  "attn_factor and yarn_log_multiplier) is not a finite number > 0",
                  g->path, af, arch);
    r->scaling = MHA_ROPE_SCALING_YARN;
    r->factor = factor;
    r->original_max_position = (double)orig;
    r->yarn_no_truncate = 0;
    r->attention_factor = af;
    return MHA_STATUS_OK;
}

static mha_status
read_rope(mha__gguf *g, const char *arch, int64_t head_dim, mha_rope *r, mha_error *err) {
    char key[GGUF_TEXT];
    int found;
    memset(r, 0, sizeof *r);
    r->style = MHA_ROPE_HALF; /* after the un-permutation of llama's Q and K rows */
    r->theta = 10000.0;
    key_of(key, arch, "rope.freq_base");
    MHA_TRY(get_num(g, key, 1, &r->theta, &found, err));
    int64_t rd_ = head_dim;
    key_of(key, arch, "rope.dimension_count");
    MHA_TRY(get_int(g, key, 0, 0, 2, head_dim, &rd_, &found, err));
    MHA_RETURN_IF(rd_ % 2 != 0, err, BAD_FILE, "%s: '%s' = %lld is odd", g->path, key,
                  (long long)rd_);
    r->rotary_dim = rd_;
    /* the scaling: rope.scaling.type (or the older rope.scale_linear) */
    char type[GGUF_TEXT] = "none";
    key_of(key, arch, "rope.scaling.type");
    MHA_TRY(get_str(g, key, type, sizeof type, &found, err));
    /* the factor as llama.cpp reads it: rope.scaling.factor, else the older rope.scale_linear;
     * without rope.scaling.type, a factor other than 1 is linear scaling (llama.cpp's default
     * type is "linear") */
    double factor = 1.0;
    int has_factor;
    key_of(key, arch, "rope.scaling.factor");
    MHA_TRY(get_num(g, key, 1, &factor, &has_factor, err));
    if (!has_factor) {
        key_of(key, arch, "rope.scale_linear");
        MHA_TRY(get_num(g, key, 1, &factor, &has_factor, err));
    }
    if (!found && has_factor && factor != 1.0)
        snprintf(type, sizeof type, "linear");
    if (strcmp(type, "none") == 0)
        return MHA_STATUS_OK;
    if (strcmp(type, "linear") == 0) {
        MHA_RETURN_IF(!has_factor, err, BAD_FILE,
                      "%s: linear rope scaling without %s.rope.scaling.factor (or "
                      "rope.scale_linear)",
                      g->path, arch);
        r->scaling = MHA_ROPE_SCALING_LINEAR;
        r->factor = factor;
        return MHA_STATUS_OK;
    }
    if (strcmp(type, "yarn") == 0)
        return read_yarn(g, arch, has_factor ? factor : 0.0, r, err);
    return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                     "%s: %s.rope.scaling.type '%s' is not supported (none, linear and yarn are)",
                     g->path, arch, type);
}

/* The tensor types the loader reads (docs/MODELS.md "GGUF files", Types): every type
 * mha__ggml_type_block sizes. */
static mha_status check_type(const mha__gguf *g, const gguf_tensor *t, mha_error *err) {
    uint64_t bv, bb;
    mha__ggml_type_block(t->type, &bv, &bb);
    if (bb)
        return MHA_STATUS_OK;
    return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                     "%s: tensor '%s' has type %s (%u): only F32, F16, BF16, Q8_0, Q4_0, Q5_0 "
                     "(exact), Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (dequantised to "
                     "float32 as ggml does) are supported",
                     g->path, t->name, ggml_type_name(t->type), t->type);
}

/* A global per-rotary-pair factor tensor (rope_freqs.weight, rope_factors_long / _short.weight):
 * F32, 1 dimension {rotary_dim / 2} (<= MHA_ROPE_MAX_PAIRS), every value finite and > 0. */
static mha_status
read_pair_factors(mha__gguf *g, const gguf_tensor *t, int64_t pairs, double *out, mha_error *err) {
    MHA_RETURN_IF(pairs > MHA_ROPE_MAX_PAIRS, err, UNSUPPORTED,
                  "%s: %s: %lld rotary pairs, more than %d", g->path, t->name, (long long)pairs,
                  MHA_ROPE_MAX_PAIRS);
    MHA_RETURN_IF(t->n_dims != 1 || t->ne[0] != (uint64_t)pairs || t->type != MHA__GGML_F32, err,
                  BAD_FILE,
                  "%s: %s must be F32 with 1 dimension {%lld} (rotary pairs), not %s with %u "
                  "dimensions {%llu, ...}",
                  g->path, t->name, (long long)pairs, ggml_type_name(t->type), t->n_dims,
                  (unsigned long long)t->ne[0]);
    MHA_TRY(seek(g, g->data_start + t->offset, t->name, err));
    for (int64_t k = 0; k < pairs; k++) {
        unsigned char b[4];
        MHA_TRY(rd(g, b, 4, t->name, err));
        const uint32_t u = (uint32_t)le(b, 4);
        float f;
        memcpy(&f, &u, 4);
        MHA_RETURN_IF(!isfinite(f) || !(f > 0), err, BAD_FILE,
                      "%s: %s[%lld] = %g is not a finite number > 0", g->path, t->name,
                      (long long)k, (double)f);
        out[k] = (double)f;
    }
    return MHA_STATUS_OK;
}

/* rope_freqs.weight: llama.cpp's form of Llama 3 RoPE scaling (its converter turns HF's llama3
 * parameters into one divisor per rotary pair, f_k / rope_freqs[k]). mha expresses exactly that
 * as LONGROPE with the same list for short and long calls, factor 1 (attention factor 1). */
static mha_status read_rope_freqs(mha__gguf *g, const char *arch, mha_rope *r, mha_error *err) {
    const gguf_tensor *t = tensor_find(g, "rope_freqs.weight");
    if (!t)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(r->scaling != MHA_ROPE_SCALING_NONE, err, UNSUPPORTED,
                  "%s: rope_freqs.weight together with %s.rope.scaling.type: not supported",
                  g->path, arch);
    const int64_t pairs = r->rotary_dim / 2;
    MHA_TRY(read_pair_factors(g, t, pairs, r->short_factor, err));
    memcpy(r->long_factor, r->short_factor, sizeof(double) * (size_t)pairs);
    r->scaling = MHA_ROPE_SCALING_LONGROPE;
    r->factor = 1.0;
    /* the lists are equal: the length never picks another; any valid original length does */
    char key[GGUF_TEXT];
    int64_t ctx = 0;
    int found;
    key_of(key, arch, "context_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, INT32_MAX, &ctx, &found, err));
    r->original_max_position = found ? (double)ctx : 8192.0;
    return MHA_STATUS_OK;
}

/* LongRoPE as llama.cpp's converter writes Phi-3's (docs/MODELS.md "GGUF files"): the global
 * tensors rope_factors_short.weight and rope_factors_long.weight (both, or neither), the original
 * context rope.scaling.original_context_length (else context_length), the factor context_length
 * / original (1 without context_length), and the factor on cos and sin rope.scaling.attn_factor
 * — absent, or equal in float32 to transformers' default sqrt(1 + ln(factor) / ln(original)) (1
 * if factor <= 1): that default, computed in double as from the HF directory. Which list a call
 * takes is mha's rule (the call's length against the original context, as transformers), not
 * llama.cpp's (its context size). */
static mha_status read_longrope(mha__gguf *g, const char *arch, mha_rope *r, mha_error *err) {
    const gguf_tensor *ts = tensor_find(g, "rope_factors_short.weight");
    const gguf_tensor *tl = tensor_find(g, "rope_factors_long.weight");
    char key[GGUF_TEXT];
    int found;
    double af = 1.0;
    int has_af;
    key_of(key, arch, "rope.scaling.attn_factor");
    MHA_TRY(get_num(g, key, 1, &af, &has_af, err));
    if (!ts && !tl) {
        /* llama.cpp multiplies cos and sin by attn_factor whatever the scaling; mha has that
         * factor for yarn and LongRoPE only (the converter writes it for those only) */
        MHA_RETURN_IF(has_af && af != 1.0 && r->scaling != MHA_ROPE_SCALING_YARN, err, UNSUPPORTED,
                      "%s: '%s' = %g without rope_factors_short/long.weight or yarn scaling: not "
                      "supported (only 1)",
                      g->path, key, af);
        return MHA_STATUS_OK;
    }
    MHA_RETURN_IF(!ts || !tl, err, BAD_FILE, "%s: %s without %s: LongRoPE needs both factor lists",
                  g->path, ts ? ts->name : tl->name,
                  ts ? "rope_factors_long.weight" : "rope_factors_short.weight");
    MHA_RETURN_IF(r->scaling != MHA_ROPE_SCALING_NONE, err, UNSUPPORTED,
                  "%s: rope_factors_short/long.weight together with %s.rope.scaling.type or "
                  "rope_freqs.weight: not supported",
                  g->path, arch);
    const int64_t pairs = r->rotary_dim / 2;
    MHA_TRY(read_pair_factors(g, ts, pairs, r->short_factor, err));
    MHA_TRY(read_pair_factors(g, tl, pairs, r->long_factor, err));
    int64_t orig = 0, ctx = 0;
    int has_ctx;
    key_of(key, arch, "context_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, INT32_MAX, &ctx, &has_ctx, err));
    key_of(key, arch, "rope.scaling.original_context_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, INT32_MAX, &orig, &found, err));
    if (!found)
        orig = ctx;
    MHA_RETURN_IF(orig < 2, err, BAD_FILE,
                  "%s: LongRoPE needs %s.rope.scaling.original_context_length (or "
                  "context_length) > 1: ln of it divides the attention factor",
                  g->path, arch);
    const double factor = has_ctx ? (double)ctx / (double)orig : 1.0;
    const double def = factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log((double)orig));
    r->scaling = MHA_ROPE_SCALING_LONGROPE;
    r->factor = factor;
    r->original_max_position = (double)orig;
    r->attention_factor = !has_af || (float)af == (float)def ? def : af;
    return MHA_STATUS_OK;
}

/* phi3's fused blk.L.attn_qkv.weight: llama.cpp's converter keeps HF's qkv_proj, rows [q (h d);
 * k (g d); v (g d)] (not permuted), ne = {hidden, (h + 2g) d}. *fused = 1 when the layer has it;
 * it and any separate attn_q / attn_k / attn_v tensor (weight or bias) together are refused, as
 * is attn_qkv.bias without attn_qkv.weight. Other architectures: never fused. */
static mha_status check_fused(mha__gguf *g,
                              const gguf_arch *arch,
                              int64_t layer,
                              int64_t h,
                              int64_t kv,
                              int64_t d,
                              int64_t hidden,
                              int *fused,
                              mha_error *err) {
    char tn[GGUF_TEXT], bn[GGUF_TEXT];
    tensor_name(tn, layer, "attn_qkv.weight");
    tensor_name(bn, layer, "attn_qkv.bias");
    const gguf_tensor *t = tensor_find(g, tn);
    *fused = 0;
    if (!arch->phi3 || (!t && !tensor_find(g, bn)))
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!t, err, BAD_FILE, "%s: %s without %s", g->path, bn, tn);
    static const char *const sep[6] = {"attn_q.weight", "attn_k.weight", "attn_v.weight",
                                       "attn_q.bias",   "attn_k.bias",   "attn_v.bias"};
    for (int i = 0; i < 6; i++) {
        char sn[GGUF_TEXT];
        tensor_name(sn, layer, sep[i]);
        MHA_RETURN_IF(tensor_find(g, sn) != NULL, err, BAD_FILE,
                      "%s: both the fused %s and the separate %s: which one is the layer's is "
                      "ambiguous",
                      g->path, tn, sn);
    }
    const int64_t rows = (h + 2 * kv) * d; /* <= 3 * 2^20 * 2^24 */
    MHA_RETURN_IF(
        t->n_dims != 2 || t->ne[0] != (uint64_t)hidden || t->ne[1] != (uint64_t)rows, err, BAD_FILE,
        "%s: tensor '%s' has %u dimensions {%llu, %llu, ...}, expected 2 dimensions "
        "{%lld, %lld}: embedding_length, and (%lld heads + 2 x %lld key/value heads) x "
        "head size %lld rows",
        g->path, tn, t->n_dims, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
        (long long)hidden, (long long)rows, (long long)h, (long long)kv, (long long)d);
    MHA_TRY(check_type(g, t, err));
    *fused = 1;
    return MHA_STATUS_OK;
}

static mha_status info_read(mha__gguf *g, int64_t layer, mha_hf_layer_info *info, mha_error *err) {
    memset(info, 0, sizeof *info);
    info->layer = layer;
    info->window_left = info->window_right = -1;
    const gguf_arch *arch = NULL;
    char name[64];
    MHA_TRY(find_arch(g, &arch, name, sizeof name, err));
    snprintf(info->model_type, sizeof info->model_type, "%s", name);
    char key[GGUF_TEXT];
    int found;
    key_of(key, name, "block_count");
    MHA_TRY(get_int(g, key, 0, 0, 1, INT32_MAX, &info->num_layers, &found, err));
    MHA_RETURN_IF(!found, err, BAD_FILE, "%s: no %s", g->path, key);
    MHA_RETURN_IF(layer < 0 || layer >= info->num_layers, err, INVALID_ARG,
                  "%s: layer %lld: the model has %lld layers (%s)", g->path, (long long)layer,
                  (long long)info->num_layers, key);
    mha_config *c = &info->config;
    int64_t hidden, h, kv, d, dv;
    key_of(key, name, "embedding_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, GGUF_MAX_SIZE, &hidden, &found, err));
    MHA_RETURN_IF(!found, err, BAD_FILE, "%s: no %s", g->path, key);
    key_of(key, name, "attention.head_count");
    MHA_TRY(get_int(g, key, layer, info->num_layers, 1, GGUF_MAX_HEADS, &h, &found, err));
    MHA_RETURN_IF(!found, err, BAD_FILE, "%s: no %s", g->path, key);
    key_of(key, name, "attention.head_count_kv");
    kv = h;
    MHA_TRY(get_int(g, key, layer, info->num_layers, 1, GGUF_MAX_HEADS, &kv, &found, err));
    MHA_RETURN_IF(h % kv != 0, err, BAD_FILE, "%s: %lld heads are not a multiple of %s = %lld",
                  g->path, (long long)h, key, (long long)kv);
    key_of(key, name, "attention.key_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, GGUF_MAX_SIZE, &d, &found, err));
    if (!found) {
        MHA_RETURN_IF(hidden % h != 0, err, BAD_FILE,
                      "%s: no %s, and embedding_length %lld is not a multiple of %lld heads",
                      g->path, key, (long long)hidden, (long long)h);
        d = hidden / h;
    }
    dv = d;
    key_of(key, name, "attention.value_length");
    MHA_TRY(get_int(g, key, 0, 0, 1, GGUF_MAX_SIZE, &dv, &found, err));
    MHA_RETURN_IF(dv != d, err, UNSUPPORTED,
                  "%s: %s = %lld differs from the key length %lld: not supported", g->path, key,
                  (long long)dv, (long long)d);
    MHA_RETURN_IF(arch->permuted && d % 2 != 0, err, BAD_FILE,
                  "%s: head size %lld is odd: the rotary row permutation needs it even", g->path,
                  (long long)d);
    c->q_dim = c->k_dim = c->v_dim = c->out_dim = hidden;
    c->num_heads = h;
    c->num_kv_heads = kv;
    c->head_dim = c->v_head_dim = d;
    c->scale = 1.0 / sqrt((double)d);
    MHA_TRY(read_rope(g, name, d, &c->rope, err));
    /* llama.cpp's converter permuted whole heads of Q and K, and llama.cpp refuses a llama file
     * whose rotary dimensions are not the head size ("invalid n_rot"): partial rotary over the
     * permuted rows is not HF's rotate_half of the first dimensions, so it is not read as one */
    MHA_RETURN_IF(arch->permuted && c->rope.rotary_dim != d, err, BAD_FILE,
                  "%s: %s.rope.dimension_count = %lld differs from the head size %lld: partial "
                  "rotary is not defined for the permuted Q and K rows of architecture %s "
                  "(llama.cpp refuses it too)",
                  g->path, name, (long long)c->rope.rotary_dim, (long long)d, name);
    MHA_TRY(read_rope_freqs(g, name, &c->rope, err));
    MHA_TRY(read_longrope(g, name, &c->rope, err));
    /* biases and QK-norm: from the tensors present */
    static const char *const bias_stems[4] = {"attn_q.bias", "attn_k.bias", "attn_v.bias",
                                              "attn_output.bias"};
    int32_t *bias[4] = {&c->bias_q, &c->bias_k, &c->bias_v, &c->bias_o};
    char tn[GGUF_TEXT];
    for (int i = 0; i < 4; i++) {
        tensor_name(tn, layer, bias_stems[i]);
        *bias[i] = tensor_find(g, tn) != NULL;
    }
    int fused = 0;
    MHA_TRY(check_fused(g, arch, layer, h, kv, d, hidden, &fused, err));
    if (fused) {
        tensor_name(tn, layer, "attn_qkv.bias");
        c->bias_q = c->bias_k = c->bias_v = tensor_find(g, tn) != NULL;
    }
    char qn[GGUF_TEXT];
    tensor_name(qn, layer, "attn_q_norm.weight");
    tensor_name(tn, layer, "attn_k_norm.weight");
    const int has_qn = tensor_find(g, qn) != NULL, has_kn = tensor_find(g, tn) != NULL;
    MHA_RETURN_IF(has_qn != has_kn, err, BAD_FILE, "%s: %s without %s", g->path, has_qn ? qn : tn,
                  has_qn ? tn : qn);
    MHA_RETURN_IF(arch->qk_norm && !has_qn, err, BAD_FILE, "%s: architecture %s without %s",
                  g->path, name, qn);
    if (has_qn) {
        key_of(key, name, "attention.layer_norm_rms_epsilon");
        double eps = 0;
        MHA_TRY(get_num(g, key, 1, &eps, &found, err));
        MHA_RETURN_IF(!found, err, BAD_FILE, "%s: %s without %s", g->path, qn, key);
        c->qk_norm.kind = MHA_QK_NORM_RMS_HEAD;
        c->qk_norm.eps = eps;
    }
    /* the projections must be there, in a type the loader reads */
    static const char *const weight_stems[4] = {"attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                "attn_output.weight"};
    for (int i = fused ? 3 : 0; i < 4; i++) {
        tensor_name(tn, layer, weight_stems[i]);
        const gguf_tensor *t = tensor_find(g, tn);
        MHA_RETURN_IF(!t, err, NOT_FOUND, "%s: no tensor '%s'", g->path, tn);
        MHA_TRY(check_type(g, t, err));
    }
    info->causal = 1;
    int64_t sw = 0;
    key_of(key, name, "attention.sliding_window");
    /* phi3: the converter writes 0 for a model without sliding_window */
    MHA_TRY(get_int(g, key, 0, 0, arch->phi3 ? 0 : 1, INT32_MAX, &sw, &found, err));
    if (found && sw > 0) {
        info->use_window = 1;
        info->window_left = sw - 1;
        info->window_right = 0;
    }
    snprintf(info->prefix, sizeof info->prefix, "blk.%lld.", (long long)layer);
    snprintf(info->layout, sizeof info->layout, "GGUF %s, attn_output%s%s",
             fused ? "attn_qkv (fused [q; k; v] rows)" : "attn_q, attn_k, attn_v",
             has_qn ? ", attn_q_norm, attn_k_norm" : "",
             arch->permuted ? " (Q and K rows un-permuted)" : "");
    return MHA_STATUS_OK;
}

mha_status mha__gguf_info(mha__gguf *g, int64_t layer, mha_hf_layer_info *info, mha_error *err) {
    return info_read(g, layer, info, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* Tensors                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static mha_status nonfinite(const mha__gguf *g,
                            const gguf_tensor *t,
                            int64_t row,
                            int64_t col,
                            float v,
                            mha_dtype to,
                            mha_error *err) {
    if (isfinite(v))
        return mha__fail(err, MHA_STATUS_BAD_FILE,
                         "%s: tensor '%s' element [%lld, %lld] = %g is beyond %s's range (the "
                         "layer's weight_dtype): weights must be finite",
                         g->path, t->name, (long long)row, (long long)col, (double)v,
                         to == MHA_DTYPE_F16 ? "float16" : "bfloat16");
    return mha__fail(err, MHA_STATUS_BAD_FILE,
                     "%s: tensor '%s' element [%lld, %lld] is %s: weights must be finite", g->path,
                     t->name, (long long)row, (long long)col, isnan(v) ? "NaN" : "infinite");
}

/* One row of `cols` elements of t (raw, at src) into float32 at tmp; 0 on a block-quantised
 * type's non-finite scale. The quantised types are computed as ggml's CPU dequantiser computes
 * them (src/io/ggml_quants.c; exact for Q8_0, Q4_0, Q5_0, Q3_K and Q6_K). */
static int decode_row(const gguf_tensor *t, const unsigned char *src, int64_t cols, float *tmp) {
    switch (t->type) {
    case MHA__GGML_F32:
        for (int64_t i = 0; i < cols; i++) {
            const uint32_t u = (uint32_t)le(src + 4 * i, 4);
            memcpy(&tmp[i], &u, 4);
        }
        return 1;
    case MHA__GGML_F16:
        for (int64_t i = 0; i < cols; i++)
            tmp[i] = mha__f16_to_f32((uint16_t)(src[2 * i] | src[2 * i + 1] << 8));
        return 1;
    case MHA__GGML_BF16:
        for (int64_t i = 0; i < cols; i++)
            tmp[i] = mha__bf16_to_f32((uint16_t)(src[2 * i] | src[2 * i + 1] << 8));
        return 1;
    default:
        return mha__ggml_dequantize_row(t->type, src, cols, tmp);
    }
}

/* Row r of t (raw bytes at raw, decoded to float32 at tmp) into a q8_0 or q4_0 (to) layer's row
 * at dst. A q8_0 layer: a Q8_0, Q4_0 or Q5_0 row becomes q8_0 blocks holding exactly its values
 * (Q8_0's bit for bit what the file holds; Q4_0/Q5_0's scale kept and q - 8 / q - 16 as int8). A
 * q4_0 layer: a Q4_0 row keeps its bytes. Any other row is quantised from its float32 values
 * (mha__q8_quantize, mha__q4_quantize; docs/SEMANTICS.md "q8_0 weights", "q4_0 weights").
 * Non-finite values are refused. */
static mha_status store_block_row(mha__gguf *g,
                                  const gguf_tensor *t,
                                  mha_dtype to,
                                  const unsigned char *raw,
                                  const float *tmp,
                                  int64_t r,
                                  int64_t cols,
                                  unsigned char *dst,
                                  mha_error *err) {
    for (int64_t c = 0; c < cols; c++)
        if (!isfinite(tmp[c]))
            return nonfinite(g, t, r, c, tmp[c], MHA_DTYPE_F32, err);
    if (to == MHA_DTYPE_Q4_0 && t->type == MHA__GGML_Q4_0)
        memcpy(dst, raw, mha__weight_bytes(MHA_DTYPE_Q4_0, cols));
    else if (to == MHA_DTYPE_Q4_0)
        mha__q4_quantize(tmp, cols, dst);
    else if (!mha__ggml_to_q8_0_row(t->type, raw, cols, dst))
        mha__q8_quantize(tmp, cols, dst);
    return MHA_STATUS_OK;
}

/* Where row (or, in a bias, element) i of a permuted Q or K goes back to: llama.cpp's converter
 * wrote element 2j + s of each head of `head` from HF's element s * head/2 + j (s in {0, 1}, j <
 * head/2), pairing the rotary dimensions (j, j + head/2) of HF's rotate_half as adjacent ones. */
static int64_t unpermute(int64_t i, int64_t head) {
    const int64_t in = i % head;
    return i - in + (in % 2) * (head / 2) + in / 2;
}

/* Part of tensor `stem` into a new buffer from `a` in the storage dtype `to`: rows [first, first +
 * rows) of a [total, cols] tensor (ne = {cols, total}), or (rows 0) elements [first, first + cols)
 * of a 1-d [total] one. F32/F16/BF16 tensors already in `to` keep their bytes, others are rounded
 * once to nearest even; the block types are dequantised (decode_row). `head` > 0: the rows of each
 * block of `head` rows are un-permuted (llama.cpp's converter wrote row 2i + s of a head from HF's
 * row s * head/2 + i, s in {0, 1}: it is put back there). */
static mha_status read_part(mha__gguf *g,
                            int64_t layer,
                            const char *stem,
                            int64_t first,
                            int64_t total,
                            int64_t rows,
                            int64_t cols,
                            int64_t head,
                            mha_dtype to,
                            const mha_allocator *a,
                            void **out,
                            mha_error *err) {
    char tn[GGUF_TEXT];
    tensor_name(tn, layer, stem);
    const gguf_tensor *t = tensor_find(g, tn);
    MHA_RETURN_IF(!t, err, NOT_FOUND, "%s: no tensor '%s'", g->path, tn);
    const uint32_t want_dims = rows ? 2 : 1;
    const uint64_t want0 = rows ? (uint64_t)cols : (uint64_t)total;
    const uint64_t want1 = rows ? (uint64_t)total : 1;
    if (t->n_dims != want_dims || t->ne[0] != want0 || t->ne[1] != want1) {
        char want[64];
        if (rows)
            snprintf(want, sizeof want, "2 dimensions {%lld, %lld}", (long long)cols,
                     (long long)total);
        else
            snprintf(want, sizeof want, "1 dimension {%lld}", (long long)total);
        return mha__fail(err, MHA_STATUS_BAD_FILE,
                         "%s: tensor '%s' has %u dimensions {%llu, %llu, ...}, expected %s (ne[0] "
                         "the input features)",
                         g->path, tn, t->n_dims, (unsigned long long)t->ne[0],
                         (unsigned long long)t->ne[1], want);
    }
    MHA_TRY(check_type(g, t, err));
    /* the un-permutation moves elements within heads of `head`: only whole ones (a config whose
     * head size differs from the file's could size a tensor in parts of a head, and row i of a
     * part would go past its end) */
    const int64_t span = rows ? rows : cols;
    MHA_RETURN_IF(head > 0 && span % head != 0, err, BAD_FILE,
                  "%s: tensor '%s': %lld %s are not whole heads of the file's head size %lld (its "
                  "rows were permuted per head by llama.cpp's converter)",
                  g->path, tn, (long long)span, rows ? "rows" : "values", (long long)head);
    uint64_t bv, bb;
    mha__ggml_type_block(t->type, &bv, &bb);
    /* a part of a 1-d tensor starts and ends at its type's blocks (the parts of attn_qkv.bias:
     * F32 as the converter writes 1-d tensors, or whole blocks) */
    MHA_RETURN_IF(!rows && ((uint64_t)first % bv != 0 || (uint64_t)cols % bv != 0), err,
                  UNSUPPORTED,
                  "%s: tensor '%s': a %s vector split at values %lld and %lld, not at its blocks "
                  "of %llu",
                  g->path, tn, ggml_type_name(t->type), (long long)first, (long long)(first + cols),
                  (unsigned long long)bv);
    /* cols % bv == 0 for 2-d tensors: checked at open; first + rows <= total, first + cols <=
     * total: the callers' parts */
    const uint64_t row_bytes = (uint64_t)cols / bv * bb;
    const uint64_t skip_bytes = rows ? (uint64_t)first * row_bytes : (uint64_t)first / bv * bb;
    const int64_t n_rows = rows ? rows : 1;
    /* a q8_0 / q4_0 layer (weight matrices only: load_layer reads vectors in float32) */
    const int q8 = mha__is_block_weight(to);
    MHA_RETURN_IF(q8 && (!rows || cols % MHA__Q8_BLOCK != 0), err, INVALID_ARG,
                  "%s: tensor '%s': %s weights need rows of a multiple of 32 values, not %lld",
                  g->path, tn, to == MHA_DTYPE_Q4_0 ? "q4_0" : "q8_0", (long long)cols);
    const size_t q8_row = q8 ? mha__weight_bytes(to, cols) : 0;
    size_t out_bytes;
    MHA_RETURN_IF(q8 ? !mha__bytes(n_rows, q8_row, &out_bytes)
                     : !mha__bytes(n_rows * cols, mha__storage_size(to), &out_bytes),
                  err, OVERFLOW, "%s: tensor '%s' is too large", g->path, tn);
    unsigned char *raw = malloc((size_t)row_bytes);
    float *tmp = malloc((size_t)cols * sizeof *tmp);
    void *dst = mha__alloc_large(a, out_bytes);
    mha_status st = MHA_STATUS_OK;
    if (!raw || !tmp || !dst)
        st = mha__fail(err, MHA_STATUS_NO_MEMORY, "%s: tensor '%s': out of memory", g->path, tn);
    if (st == MHA_STATUS_OK)
        st = seek(g, g->data_start + t->offset + skip_bytes, tn, err);
    const uint16_t inf = to == MHA_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
    for (int64_t r = 0; st == MHA_STATUS_OK && r < n_rows; r++) {
        st = rd(g, raw, row_bytes, tn, err);
        if (st != MHA_STATUS_OK)
            break;
        const int64_t dr = rows && head > 0 ? unpermute(r, head) : r;
        if (!decode_row(t, raw, cols, tmp)) {
            st = mha__fail(err, MHA_STATUS_BAD_FILE,
                           "%s: tensor '%s' row %lld: a %s block's scale is not finite", g->path,
                           tn, (long long)r, ggml_type_name(t->type));
            break;
        }
        if (q8) {
            st = store_block_row(g, t, to, raw, tmp, r, cols,
                                 (unsigned char *)dst + (size_t)dr * q8_row, err);
            continue;
        }
        const int same = (t->type == MHA__GGML_F16 && to == MHA_DTYPE_F16) ||
                         (t->type == MHA__GGML_BF16 && to == MHA_DTYPE_BF16);
        for (int64_t c = 0; c < cols; c++) {
            const float v = tmp[c];
            if (!isfinite(v)) {
                st = nonfinite(g, t, r, c, v, to, err);
                break;
            }
            const int64_t at = dr * cols + (!rows && head > 0 ? unpermute(c, head) : c);
            if (to == MHA_DTYPE_F32) {
                ((float *)dst)[at] = v;
                continue;
            }
            const uint16_t hv = same ? (uint16_t)(raw[2 * c] | raw[2 * c + 1] << 8)
                                : to == MHA_DTYPE_BF16 ? mha__f32_to_bf16(v)
                                                       : mha__f32_to_f16(v);
            if ((hv & inf) == inf) {
                st = nonfinite(g, t, r, c, v, to, err);
                break;
            }
            ((uint16_t *)dst)[at] = hv;
        }
    }
    free(raw);
    free(tmp);
    if (st != MHA_STATUS_OK) {
        mha__free(a, dst);
        return st;
    }
    *out = dst;
    return MHA_STATUS_OK;
}

/* Tensor `stem`, which must be [rows, cols] (rows 0: 1-d [cols]), whole (read_part). */
static mha_status read_tensor(mha__gguf *g,
                              int64_t layer,
                              const char *stem,
                              int64_t rows,
                              int64_t cols,
                              int64_t head,
                              mha_dtype to,
                              const mha_allocator *a,
                              void **out,
                              mha_error *err) {
    return read_part(g, layer, stem, 0, rows ? rows : cols, rows, cols, head, to, a, out, err);
}

enum { B_WQ, B_WK, B_WV, B_WO, B_BQ, B_BK, B_BV, B_BO, B_QN, B_KN, N_BUFS };

static mha_status load_layer(mha__gguf *g,
                             int64_t layer,
                             const mha_hf_layer_info *info,
                             const mha_config *given,
                             const mha_allocator *a,
                             void *p[N_BUFS],
                             mha_layer **out,
                             mha_error *err) {
    mha_config c = *given;
    MHA_RETURN_IF(
        c.num_heads < 1 || c.num_heads > GGUF_MAX_HEADS || c.num_kv_heads < 1 ||
            c.num_heads % c.num_kv_heads != 0 || c.head_dim < 1 || c.head_dim > GGUF_MAX_SIZE,
        err, INVALID_ARG,
        "%s: config: num_heads %lld, num_kv_heads %lld, head_dim %lld are not valid", g->path,
        (long long)c.num_heads, (long long)c.num_kv_heads, (long long)c.head_dim);
    MHA_RETURN_IF(!mha__is_float_storage(c.weight_dtype) && !mha__is_block_weight(c.weight_dtype),
                  err, INVALID_ARG,
                  "%s: config.weight_dtype=%d is not MHA_DTYPE_F32 (0), MHA_DTYPE_BF16, "
                  "MHA_DTYPE_F16, MHA_DTYPE_Q8_0 or MHA_DTYPE_Q4_0",
                  g->path, (int)c.weight_dtype);
    const int permuted =
        strcmp(info->model_type, "llama") == 0 || strcmp(info->model_type, "mistral") == 0;
    /* the permutation was made with the file's head size, whatever the caller's config says */
    const int64_t ph = permuted ? info->config.head_dim : 0;
    const int64_t hidden = info->config.q_dim, d = c.head_dim;
    const int64_t qr = c.num_heads * d, kr = c.num_kv_heads * d; /* <= 2^20 * 2^24 */
    const mha_dtype to = c.weight_dtype;
    /* biases and norm weights: float32 in a q8_0 / q4_0 layer, else the weights' dtype */
    const mha_dtype vt = mha__is_block_weight(to) ? MHA_DTYPE_F32 : to;
    /* phi3's fused attn_qkv (its presence checked by info_read): q, k and v are its row blocks
     * [0, qr), [qr, qr + kr), [qr + kr, qr + 2 kr), each read on its own (no fused copy); its
     * row count must be exactly qr + 2 kr */
    char fn[GGUF_TEXT];
    tensor_name(fn, layer, "attn_qkv.weight");
    if (strcmp(info->model_type, "phi3") == 0 && tensor_find(g, fn)) {
        const int64_t tot = qr + 2 * kr;
        MHA_TRY(
            read_part(g, layer, "attn_qkv.weight", 0, tot, qr, hidden, 0, to, a, &p[B_WQ], err));
        MHA_TRY(
            read_part(g, layer, "attn_qkv.weight", qr, tot, kr, hidden, 0, to, a, &p[B_WK], err));
        MHA_TRY(read_part(g, layer, "attn_qkv.weight", qr + kr, tot, kr, hidden, 0, to, a, &p[B_WV],
                          err));
        const int32_t bias = c.bias_q || c.bias_k || c.bias_v;
        if (bias) { /* attn_qkv.bias, split the same way */
            MHA_TRY(read_part(g, layer, "attn_qkv.bias", 0, tot, 0, qr, 0, vt, a, &p[B_BQ], err));
            MHA_TRY(read_part(g, layer, "attn_qkv.bias", qr, tot, 0, kr, 0, vt, a, &p[B_BK], err));
            MHA_TRY(
                read_part(g, layer, "attn_qkv.bias", qr + kr, tot, 0, kr, 0, vt, a, &p[B_BV], err));
        }
        c.bias_q = c.bias_k = c.bias_v = bias;
    } else {
        MHA_TRY(read_tensor(g, layer, "attn_q.weight", qr, hidden, ph, to, a, &p[B_WQ], err));
        MHA_TRY(read_tensor(g, layer, "attn_k.weight", kr, hidden, ph, to, a, &p[B_WK], err));
        MHA_TRY(read_tensor(g, layer, "attn_v.weight", kr, hidden, 0, to, a, &p[B_WV], err));
        if (c.bias_q)
            MHA_TRY(read_tensor(g, layer, "attn_q.bias", 0, qr, ph, vt, a, &p[B_BQ], err));
        if (c.bias_k)
            MHA_TRY(read_tensor(g, layer, "attn_k.bias", 0, kr, ph, vt, a, &p[B_BK], err));
        if (c.bias_v)
            MHA_TRY(read_tensor(g, layer, "attn_v.bias", 0, kr, 0, vt, a, &p[B_BV], err));
    }
    MHA_TRY(read_tensor(g, layer, "attn_output.weight", hidden, qr, 0, to, a, &p[B_WO], err));
    if (c.bias_o)
        MHA_TRY(read_tensor(g, layer, "attn_output.bias", 0, hidden, 0, vt, a, &p[B_BO], err));
    if (c.qk_norm.kind == MHA_QK_NORM_RMS_HEAD) {
        MHA_TRY(read_tensor(g, layer, "attn_q_norm.weight", 0, d, 0, vt, a, &p[B_QN], err));
        MHA_TRY(read_tensor(g, layer, "attn_k_norm.weight", 0, d, 0, vt, a, &p[B_KN], err));
    } else
        MHA_RETURN_IF(c.qk_norm.kind != MHA_QK_NORM_NONE &&
                          c.qk_norm.kind != MHA_QK_NORM_L2_AFTER_ROPE,
                      err, INVALID_ARG,
                      "%s: config.qk_norm: only RMS per head (attn_q_norm, attn_k_norm) has "
                      "weights in a GGUF file",
                      g->path);
    c.q_dim = c.k_dim = c.v_dim = c.out_dim = hidden;
    c.v_head_dim = d;
    c.sinks = 0;
    c.output_gate = 0;
    const mha_weights w = {p[B_WQ], p[B_WK], p[B_WV], p[B_WO], p[B_BQ], p[B_BK],
                           p[B_BV], p[B_BO], NULL,    p[B_QN], p[B_KN]};
    mha_status st = mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, a, out, err);
    if (st != MHA_STATUS_OK && err) {
        char msg[MHA_ERROR_MESSAGE_SIZE];
        memcpy(msg, err->message, sizeof msg);
        msg[sizeof msg - 1] = '\0';
        mha__fail(err, st, "%s: %s", g->path, msg);
    }
    return st;
}

mha_status mha__gguf_load(mha__gguf *g,
                          int64_t layer,
                          const mha_config *config,
                          const mha_allocator *allocator,
                          mha_layer **out,
                          mha_error *err) {
    *out = NULL;
    mha_hf_layer_info info;
    MHA_TRY(info_read(g, layer, &info, err));
    void *p[N_BUFS] = {0};
    const mha_status st =
        load_layer(g, layer, &info, config ? config : &info.config, allocator, p, out, err);
    for (int i = 0; i < N_BUFS; i++)
        mha__free(allocator, p[i]);
    return st;
}

mha_status mha__gguf_load_mem(const void *buf, size_t len, mha_error *err) {
    mha__gguf *g = NULL;
    mha_status st = mha__gguf_open_mem(buf, len, "<fuzz>", &g, err);
    mha_layer *layer = NULL;
    if (st == MHA_STATUS_OK)
        st = mha__gguf_load(g, 0, NULL, NULL, &layer, err);
    mha_layer_destroy(layer);
    mha__gguf_close(g);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Public                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

mha_status
mha_gguf_layer_info_read(const char *path, int64_t layer, mha_hf_layer_info *info, mha_error *err) {
    MHA_RETURN_IF(!path || !info, err, INVALID_ARG,
                  "mha_gguf_layer_info_read: path or info is NULL");
    mha__gguf *g = NULL;
    mha_status st = mha__gguf_open(path, &g, err);
    if (st == MHA_STATUS_OK)
        st = info_read(g, layer, info, err);
    mha__gguf_close(g);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

mha_status mha_layer_load_gguf(const char *path,
                               int64_t layer,
                               const mha_config *config,
                               const mha_allocator *allocator,
                               mha_layer **out,
                               mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "mha_layer_load_gguf: out is NULL");
    *out = NULL;
    MHA_RETURN_IF(!path, err, INVALID_ARG, "mha_layer_load_gguf: path is NULL");
    mha__gguf *g = NULL;
    mha_status st = mha__gguf_open(path, &g, err);
    if (st == MHA_STATUS_OK)
        st = mha__gguf_load(g, layer, config, allocator, out, err);
    mha__gguf_close(g);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

/* SPDX-License-Identifier: MIT */
/* safetensors.c: mha_layer_load_safetensors(), loading an attention layer's weights from a
 * safetensors file (docs/FORMATS.md has the contract: accepted dtypes, name search, size rules).
 *
 * The file is untrusted: the header length is checked against the file size and a cap before
 * anything is allocated, the JSON header is parsed with cJSON, and every tensor entry (dtype,
 * shape, data_offsets) is validated: integer offsets inside the data buffer, sizes that match the
 * shape, no overlapping ranges, no duplicate names. Only the tensors the layer uses are read, each
 * straight into its destination in config.weight_dtype in small chunks (a tensor already in that
 * dtype is copied as its bytes; the others are rounded once).
 */
#define _POSIX_C_SOURCE 200809L

#include "io/safetensors.h"

#include "io/file.h"

#include "base/internal.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

/* Real headers are a few hundred kilobytes at most (a large sharded checkpoint lists a few
 * thousand tensors); the cap keeps a hostile length from causing a huge allocation. */
#define ST_MAX_HEADER   ((uint64_t)100 * 1000 * 1000)
/* Largest integer a JSON number (an IEEE double in cJSON) holds exactly. */
#define ST_MAX_JSON_INT 9007199254740992.0
#define ST_MAX_DIMS     8

/* ---------------------------------------------------------------------------------------------- */
/* The parsed file                                                                                */
/* ---------------------------------------------------------------------------------------------- */

typedef struct st_tensor {
    const char *name;  /* owned by the cJSON tree */
    const char *dtype; /* owned by the cJSON tree */
    int supported;     /* 1 when dtype is F32/F64/F16/BF16 */
    mha_dtype type;    /* valid when supported */
    size_t elem_size;  /* 0 for a dtype whose size we do not know */
    int32_t ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t count;
    uint64_t begin, end; /* byte range inside the data buffer */
} st_tensor;

typedef struct st_file {
    const char *path;
    FILE *f;
    uint64_t data_start; /* 8 + header length */
    uint64_t data_size;
    cJSON *root;
    st_tensor *tensors; /* sorted by name */
    size_t n_tensors;
    const char *prefix;
    char *name_buf; /* scratch for prefix + name */
    size_t name_cap;
} st_file;

/* The dtypes whose element size is known (their byte ranges are checked against the shape). Only
 * the `supported` ones can be read; `type` means nothing for the others. */
static const struct {
    const char *name;
    size_t size;
    int supported;
    mha_dtype type;
} ST_DTYPES[] = {
    {"F32", 4, 1, MHA_DTYPE_F32},    {"F64", 8, 1, MHA_DTYPE_F64},
    {"F16", 2, 1, MHA_DTYPE_F16},    {"BF16", 2, 1, MHA_DTYPE_BF16},
    {"I64", 8, 0, MHA_DTYPE_I64},    {"U64", 8, 0, MHA_DTYPE_I64},
    {"I32", 4, 0, MHA_DTYPE_I32},    {"U32", 4, 0, MHA_DTYPE_I32},
    {"I16", 2, 0, MHA_DTYPE_I32},    {"U16", 2, 0, MHA_DTYPE_I32},
    {"I8", 1, 0, MHA_DTYPE_U8},      {"U8", 1, 0, MHA_DTYPE_U8},
    {"BOOL", 1, 0, MHA_DTYPE_BOOL},  {"F8_E5M2", 1, 0, MHA_DTYPE_U8},
    {"F8_E4M3", 1, 0, MHA_DTYPE_U8}, {"F8_E8M0", 1, 0, MHA_DTYPE_U8},
};

/* "[4, 8]": a shape as safetensors writes it, for messages. */
static void format_shape(char *buf, size_t size, int32_t ndim, const int64_t *shape) {
    size_t used = 0;
    int n = snprintf(buf, size, "[");
    used = n > 0 ? (size_t)n : 0;
    for (int32_t i = 0; i < ndim && i < ST_MAX_DIMS && used < size; i++) {
        n = snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
        used += n > 0 ? (size_t)n : 0;
    }
    if (used < size)
        snprintf(buf + used, size - used, ndim > ST_MAX_DIMS ? ", ...]" : "]");
}

static int cmp_by_name(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static int cmp_by_begin(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

/* A JSON number that is a non-negative integer exactly representable in a double. */
static int json_uint(const cJSON *item, uint64_t *out) {
    if (!cJSON_IsNumber(item))
        return 0;
    const double d = item->valuedouble;
    if (!(d >= 0.0 && d <= ST_MAX_JSON_INT))
        return 0;
    const uint64_t u = (uint64_t)d;
    if ((double)u != d)
        return 0;
    *out = u;
    return 1;
}

static mha_status parse_entry(st_file *sf, const cJSON *entry, st_tensor *t, mha_error *err) {
    const char *path = sf->path;
    t->name = entry->string;
    MHA_RETURN_IF(!cJSON_IsObject(entry), err, BAD_FILE,
                  "%s: tensor '%s': header entry is not a JSON object", path, t->name);

    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    MHA_RETURN_IF(!cJSON_IsString(dtype) || !dtype->valuestring, err, BAD_FILE,
                  "%s: tensor '%s': missing or non-string \"dtype\"", path, t->name);
    t->dtype = dtype->valuestring;
    for (size_t i = 0; i < sizeof ST_DTYPES / sizeof ST_DTYPES[0]; i++)
        if (strcmp(t->dtype, ST_DTYPES[i].name) == 0) {
            t->elem_size = ST_DTYPES[i].size;
            t->supported = ST_DTYPES[i].supported;
            t->type = ST_DTYPES[i].type;
        }

    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(entry, "shape");
    MHA_RETURN_IF(!cJSON_IsArray(shape), err, BAD_FILE,
                  "%s: tensor '%s': missing or non-array \"shape\"", path, t->name);
    t->ndim = 0;
    t->count = 1;
    const cJSON *dim;
    cJSON_ArrayForEach(dim, shape) {
        uint64_t d;
        MHA_RETURN_IF(!json_uint(dim, &d), err, BAD_FILE,
                      "%s: tensor '%s': shape[%d] is not a non-negative integer", path, t->name,
                      (int)t->ndim);
        if (t->ndim < ST_MAX_DIMS)
            t->shape[t->ndim] = (int64_t)d;
        MHA_RETURN_IF(t->ndim == INT32_MAX, err, BAD_FILE, "%s: tensor '%s': too many dims", path,
                      t->name);
        t->ndim++;
        MHA_RETURN_IF(!mha__mul_i64(t->count, (int64_t)d, &t->count), err, BAD_FILE,
                      "%s: tensor '%s': the element count of its shape overflows", path, t->name);
    }

    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(entry, "data_offsets");
    MHA_RETURN_IF(!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2, err, BAD_FILE,
                  "%s: tensor '%s': \"data_offsets\" must be an array [begin, end]", path, t->name);
    MHA_RETURN_IF(!json_uint(cJSON_GetArrayItem(offsets, 0), &t->begin) ||
                      !json_uint(cJSON_GetArrayItem(offsets, 1), &t->end),
                  err, BAD_FILE, "%s: tensor '%s': data_offsets are not non-negative integers",
                  path, t->name);
    MHA_RETURN_IF(t->begin > t->end || t->end > sf->data_size, err, BAD_FILE,
                  "%s: tensor '%s': data_offsets [%llu, %llu] are outside the %llu-byte data "
                  "buffer",
                  path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                  (unsigned long long)sf->data_size);
    if (t->elem_size) {
        int64_t need;
        char shape_text[128];
        format_shape(shape_text, sizeof shape_text, t->ndim, t->shape);
        MHA_RETURN_IF(!mha__mul_i64(t->count, (int64_t)t->elem_size, &need) ||
                          (uint64_t)need != t->end - t->begin,
                      err, BAD_FILE,
                      "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but shape %s "
                      "of %s needs %lld",
                      path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                      (unsigned long long)(t->end - t->begin), shape_text, t->dtype,
                      (long long)need);
    }
    return MHA_STATUS_OK;
}

/* Builds the tensor table from the JSON root and checks names and ranges. */
static mha_status index_tensors(st_file *sf, mha_error *err) {
    const char *path = sf->path;
    MHA_RETURN_IF(!cJSON_IsObject(sf->root), err, BAD_FILE,
                  "%s: the safetensors header is not a JSON object", path);
    size_t n = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, sf->root) {
        n++;
    }
    sf->tensors = calloc(n ? n : 1, sizeof *sf->tensors);
    MHA_RETURN_IF(!sf->tensors, err, NO_MEMORY, "%s: out of memory", path);
    cJSON_ArrayForEach(item, sf->root) {
        MHA_RETURN_IF(!item->string, err, BAD_FILE, "%s: header entry without a name", path);
        if (strcmp(item->string, "__metadata__") == 0) {
            MHA_RETURN_IF(!cJSON_IsObject(item), err, BAD_FILE,
                          "%s: \"__metadata__\" is not a JSON object", path);
            continue;
        }
        mha_status st = parse_entry(sf, item, &sf->tensors[sf->n_tensors], err);
        if (st != MHA_STATUS_OK)
            return st;
        sf->n_tensors++;
    }
    qsort(sf->tensors, sf->n_tensors, sizeof *sf->tensors, cmp_by_name);
    for (size_t i = 1; i < sf->n_tensors; i++)
        MHA_RETURN_IF(strcmp(sf->tensors[i - 1].name, sf->tensors[i].name) == 0, err, BAD_FILE,
                      "%s: duplicate tensor name '%s'", path, sf->tensors[i].name);

    /* Ranges must not overlap (empty tensors may sit anywhere). */
    const st_tensor **by_begin = malloc((sf->n_tensors ? sf->n_tensors : 1) * sizeof *by_begin);
    MHA_RETURN_IF(!by_begin, err, NO_MEMORY, "%s: out of memory", path);
    size_t m = 0;
    for (size_t i = 0; i < sf->n_tensors; i++)
        if (sf->tensors[i].end > sf->tensors[i].begin)
            by_begin[m++] = &sf->tensors[i];
    qsort(by_begin, m, sizeof *by_begin, cmp_by_begin);
    mha_status st = MHA_STATUS_OK;
    for (size_t i = 1; i < m && st == MHA_STATUS_OK; i++)
        if (by_begin[i]->begin < by_begin[i - 1]->end)
            st = mha__fail(err, MHA_STATUS_BAD_FILE,
                           "%s: tensors '%s' and '%s' overlap in the data buffer", path,
                           by_begin[i - 1]->name, by_begin[i]->name);
    free(by_begin);
    return st;
}

static mha_status st_open_header(st_file *sf, uint64_t size, mha_error *err);

/* Opens the file at `path` (a regular file, io/file.h) and parses its header. */
static mha_status st_open(st_file *sf, const char *path, mha_error *err) {
    sf->path = path;
    uint64_t size = 0;
    mha_status st = mha__open_regular(path, &sf->f, &size, NULL, err);
    if (st != MHA_STATUS_OK)
        return st;
    return st_open_header(sf, size, err);
}

/* The same over an in-memory image (fmemopen), so both paths share every check. */
static mha_status
st_open_mem(st_file *sf, const void *buf, size_t len, const char *name, mha_error *err) {
    sf->path = name;
    MHA_RETURN_IF(len < 8, err, BAD_FILE,
                  "%s: the file is %llu bytes, too short for a safetensors header", name,
                  (unsigned long long)len);
    sf->f = fmemopen((void *)(uintptr_t)buf, len, "rb");
    MHA_RETURN_IF(!sf->f, err, NO_MEMORY, "%s: cannot open the memory image: %s", name,
                  strerror(errno));
    return st_open_header(sf, (uint64_t)len, err);
}

/* cJSON 1.7.x records the position of a parse error in a process-wide variable on every parse, so
 * concurrent loads would race on it (benignly: nothing here reads it). Parses are serialised. */
static pthread_mutex_t st_json_lock = PTHREAD_MUTEX_INITIALIZER;

/* The JSON policy (safetensors.h): a NUL inside a string, raw or as \u0000, is refused, since
 * cJSON would cut the string there and Python keeps it whole. Named by its key (for a value: the
 * last key before it). */
mha_status mha__json_check_text(const char *text, size_t len, const char *path, mha_error *err) {
    const char *key = NULL;
    int key_len = 0;
    for (size_t i = 0; i < len; i++) {
        if (text[i] != '"') /* a NUL outside strings is a syntax error for the parser */
            continue;
        const size_t start = ++i;
        int nul = 0;
        for (; i < len && text[i] != '"'; i++) {
            nul |= text[i] == '\0';
            if (text[i] == '\\' && i + 1 < len) {
                nul |= i + 5 < len && text[i + 1] == 'u' && memcmp(text + i + 2, "0000", 4) == 0;
                i++;
            }
        }
        const int n = i - start > 80 ? 80 : (int)(i - start);
        size_t j = i + 1;
        while (j < len && (text[j] == ' ' || text[j] == '\t' || text[j] == '\n' || text[j] == '\r'))
            j++;
        const int is_key = j < len && text[j] == ':';
        if (nul && is_key)
            return mha__fail(err, MHA_STATUS_BAD_FILE,
                             "%s: key \"%.*s\" contains a NUL character (\\u0000): refused (the "
                             "key would be cut short)",
                             path, n, text + start);
        if (nul)
            return mha__fail(err, MHA_STATUS_BAD_FILE,
                             "%s: the value of \"%.*s\" contains a NUL character (\\u0000): "
                             "refused (the string \"%.*s\" would be cut short)",
                             path, key ? key_len : 0, key ? key : "", n, text + start);
        if (is_key)
            key = text + start, key_len = n;
    }
    return MHA_STATUS_OK;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The other half of the policy: no object, at any depth, has the same key twice (cJSON would
 * take the first, Python's json the last). */
mha_status mha__json_check_keys(const cJSON *node, const char *path, mha_error *err) {
    size_t n = 0;
    for (const cJSON *c = node->child; c; c = c->next) {
        if (c->child) {
            mha_status st = mha__json_check_keys(c, path, err);
            if (st != MHA_STATUS_OK)
                return st;
        }
        n++;
    }
    if (!cJSON_IsObject(node) || n < 2)
        return MHA_STATUS_OK;
    const char **keys = malloc(n * sizeof *keys);
    MHA_RETURN_IF(!keys, err, NO_MEMORY, "%s: out of memory", path);
    size_t k = 0;
    for (const cJSON *c = node->child; c; c = c->next)
        keys[k++] = c->string ? c->string : "";
    qsort(keys, n, sizeof *keys, cmp_str_ptr);
    mha_status st = MHA_STATUS_OK;
    for (size_t i = 1; i < n && st == MHA_STATUS_OK; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0)
            st = node->string
                     ? mha__fail(err, MHA_STATUS_BAD_FILE,
                                 "%s: duplicate key \"%.80s\" (in \"%.80s\"): refused (readers "
                                 "disagree on which one counts)",
                                 path, keys[i], node->string)
                     : mha__fail(err, MHA_STATUS_BAD_FILE,
                                 "%s: duplicate key \"%.80s\": refused (readers disagree on which "
                                 "one counts)",
                                 path, keys[i]);
    free(keys);
    return st;
}

struct cJSON *mha__json_parse(const char *text, size_t len, size_t *error_pos) {
    const char *end = NULL;
    pthread_mutex_lock(&st_json_lock);
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    pthread_mutex_unlock(&st_json_lock);
    size_t pos = end ? (size_t)(end - text) : 0;
    while (root && pos < len &&
           (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r'))
        pos++;
    if (root && pos != len) {
        cJSON_Delete(root);
        root = NULL;
    }
    *error_pos = pos;
    return root;
}

/* Reads and checks the length prefix and the JSON header of sf->f, a stream of `size` bytes. */
static mha_status st_open_header(st_file *sf, uint64_t size, mha_error *err) {
    const char *path = sf->path;
    unsigned char len_bytes[8];
    MHA_RETURN_IF(size < 8, err, BAD_FILE,
                  "%s: the file is %llu bytes, too short for a safetensors header", path,
                  (unsigned long long)size);
    MHA_RETURN_IF(fread(len_bytes, 1, 8, sf->f) != 8, err, IO, "%s: read error", path);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | len_bytes[i];
    MHA_RETURN_IF(n > size - 8, err, BAD_FILE,
                  "%s: header length %llu exceeds the file size (%llu bytes)", path,
                  (unsigned long long)n, (unsigned long long)size);
    MHA_RETURN_IF(n > ST_MAX_HEADER, err, BAD_FILE,
                  "%s: header length %llu exceeds the limit of %llu bytes", path,
                  (unsigned long long)n, (unsigned long long)ST_MAX_HEADER);
    sf->data_start = 8 + n;
    sf->data_size = size - 8 - n;

    char *text = malloc((size_t)n + 1);
    MHA_RETURN_IF(!text, err, NO_MEMORY, "%s: cannot allocate %llu bytes for the header", path,
                  (unsigned long long)n);
    if (fread(text, 1, (size_t)n, sf->f) != (size_t)n) {
        free(text);
        return mha__fail(err, MHA_STATUS_IO, "%s: read error in the header", path);
    }
    text[n] = '\0';
    mha_status st = mha__json_check_text(text, (size_t)n, path, err);
    if (st != MHA_STATUS_OK) {
        free(text);
        return st;
    }
    const char *end = NULL;
    pthread_mutex_lock(&st_json_lock);
    sf->root = cJSON_ParseWithLengthOpts(text, (size_t)n, &end, 0);
    pthread_mutex_unlock(&st_json_lock);
    size_t pos = end ? (size_t)(end - text) : 0;
    if (!sf->root) {
        free(text);
        return mha__fail(err, MHA_STATUS_BAD_FILE,
                         "%s: the safetensors header is not valid JSON (error at byte %zu of %llu)",
                         path, pos, (unsigned long long)n);
    }
    /* The format allows padding the header with spaces; anything else after the JSON is junk. */
    while (pos < n &&
           (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r'))
        pos++;
    free(text);
    MHA_RETURN_IF(pos != n, err, BAD_FILE,
                  "%s: unexpected bytes after the JSON header (at byte %zu of %llu)", path, pos,
                  (unsigned long long)n);
    st = index_tensors(sf, err); /* duplicate tensor names are named as such there */
    return st == MHA_STATUS_OK ? mha__json_check_keys(sf->root, path, err) : st;
}

static void st_close(st_file *sf) {
    if (sf->f)
        fclose(sf->f);
    cJSON_Delete(sf->root);
    free(sf->tensors);
    free(sf->name_buf);
}

/* The tensor named prefix + a + b, or NULL. Also leaves that full name in sf->name_buf. */
static const st_tensor *st_find(st_file *sf, const char *a, const char *b) {
    snprintf(sf->name_buf, sf->name_cap, "%s%s%s", sf->prefix, a, b ? b : "");
    st_tensor key;
    memset(&key, 0, sizeof key);
    key.name = sf->name_buf;
    return bsearch(&key, sf->tensors, sf->n_tensors, sizeof *sf->tensors, cmp_by_name);
}

/* Appends "'<prefix><a><b>'" (comma-separated) to a list of tried names. */
static void tried_add(char *list, size_t size, const st_file *sf, const char *a, const char *b) {
    size_t used = strlen(list);
    if (used < size)
        snprintf(list + used, size - used, "%s'%s%s%s'", used ? ", " : "", sf->prefix, a,
                 b ? b : "");
}

/* Double to float, rounding to nearest even; magnitudes that round past FLT_MAX become Inf
 * (refused later as non-finite). The explicit test keeps the conversion defined in ISO C. */
static float narrow_f64(double d) {
    if (d >= 0x1.ffffffp127)
        return INFINITY;
    if (d <= -0x1.ffffffp127)
        return -INFINITY;
    return (float)d;
}

/* Double to float rounding to odd: the nearest float toward zero, its last bit set when the
 * conversion is inexact. Rounding that to a half (11 or 8 significant bits, 13 or more below
 * float32's 24) to nearest even gives d rounded once to the half, as a direct conversion would.
 * Beyond float's range: +-Inf (refused later as non-finite). */
static float f64_to_f32_odd(double d) {
    const float f = narrow_f64(d);
    if (!isfinite(f) || (double)f == d)
        return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (fabs((double)f) > fabs(d)) /* rounded away from zero: one step back (sign-magnitude) */
        u--;
    u |= 1u;
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* Element p (little-endian, of t's dtype) as float32 (F64: rounded to odd when `to` is a half,
 * see f64_to_f32_odd, else to nearest even). */
static float decode_elem(const st_tensor *t, const unsigned char *p, mha_dtype to) {
    if (t->type == MHA_DTYPE_F32) {
        uint32_t u =
            (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        float v;
        memcpy(&v, &u, sizeof v);
        return v;
    }
    if (t->type == MHA_DTYPE_F64) {
        uint64_t u = 0;
        for (int b = 7; b >= 0; b--)
            u = u << 8 | p[b];
        double d;
        memcpy(&d, &u, sizeof d);
        return to == MHA_DTYPE_F32 ? narrow_f64(d) : f64_to_f32_odd(d);
    }
    const uint16_t u = (uint16_t)(p[0] | p[1] << 8);
    return t->type == MHA_DTYPE_F16 ? mha__f16_to_f32(u) : mha__bf16_to_f32(u);
}

static mha_status nonfinite_elem(
    const st_file *sf, const st_tensor *t, int64_t idx, float v, mha_dtype to, mha_error *err) {
    char where[64];
    if (t->ndim == 2 && t->shape[1] > 0)
        snprintf(where, sizeof where, "[%lld, %lld]", (long long)(idx / t->shape[1]),
                 (long long)(idx % t->shape[1]));
    else
        snprintf(where, sizeof where, "[%lld]", (long long)idx);
    if (isfinite(v)) /* finite in float32, beyond the half's range */
        return mha__fail(err, MHA_STATUS_BAD_FILE,
                         "%s: tensor '%s' element %s = %g is beyond %s's range (the layer's "
                         "weight_dtype): weights must be finite",
                         sf->path, t->name, where, (double)v,
                         to == MHA_DTYPE_F16 ? "float16" : "bfloat16");
    return mha__fail(err, MHA_STATUS_BAD_FILE,
                     "%s: tensor '%s' element %s is %s in float32: weights must be finite",
                     sf->path, t->name, where, isnan(v) ? "NaN" : "infinite");
}

/* Reads elements [first, first + count) of t into dst in the storage dtype `to` (F32, BF16 or
 * F16) and refuses non-finite values (naming the element). A tensor already in `to` is copied
 * as its bytes (no widening; its values are checked through float32, which holds every half
 * exactly); any other is rounded once to `to`, to nearest even (F64 to a half through a float32
 * rounded to odd, F16 <-> BF16 through float32, exact). Chunked, so only dst is ever large. */
static mha_status read_elems(st_file *sf,
                             const st_tensor *t,
                             int64_t first,
                             int64_t count,
                             mha_dtype to,
                             void *dst,
                             mha_error *err) {
    const size_t es = t->elem_size;
    const uint64_t offset = sf->data_start + t->begin + (uint64_t)first * es;
    MHA_RETURN_IF(offset > (uint64_t)INT64_MAX || fseeko(sf->f, (off_t)offset, SEEK_SET) != 0, err,
                  IO, "%s: tensor '%s': seek failed: %s", sf->path, t->name, strerror(errno));
    unsigned char chunk[1 << 16];
    const int64_t per_chunk = (int64_t)(sizeof chunk / es);
    const int same = t->type == to;
    for (int64_t done = 0; done < count;) {
        const int64_t k = count - done < per_chunk ? count - done : per_chunk;
        MHA_RETURN_IF(fread(chunk, es, (size_t)k, sf->f) != (size_t)k, err, IO,
                      "%s: tensor '%s': read error (file truncated while reading?)", sf->path,
                      t->name);
        if (same && to != MHA_DTYPE_F32) { /* the file's halves: finite iff exponent not all 1s */
            const uint16_t inf = to == MHA_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
            uint16_t *d = (uint16_t *)dst + done;
            for (int64_t i = 0; i < k; i++) {
                const unsigned char *p = chunk + 2 * (size_t)i;
                d[i] = (uint16_t)(p[0] | p[1] << 8);
                if ((d[i] & inf) == inf)
                    return nonfinite_elem(sf, t, first + done + i, decode_elem(t, p, to), to, err);
            }
            done += k;
            continue;
        }
        for (int64_t i = 0; i < k; i++) {
            const unsigned char *p = chunk + (size_t)i * es;
            const float v = decode_elem(t, p, to);
            const int64_t at = done + i;
            if (!isfinite(v))
                return nonfinite_elem(sf, t, first + at, v, to, err);
            if (to == MHA_DTYPE_F32) {
                ((float *)dst)[at] = v;
                continue;
            }
            const uint16_t h = to == MHA_DTYPE_BF16 ? mha__f32_to_bf16(v) : mha__f32_to_f16(v);
            const uint16_t inf = to == MHA_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
            if ((h & inf) == inf)
                return nonfinite_elem(sf, t, first + at, v, to, err);
            ((uint16_t *)dst)[at] = h;
        }
        done += k;
    }
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Name search                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

enum { ROLE_Q, ROLE_K, ROLE_V, ROLE_O, NUM_ROLES };
static const char *const ROLE_NAME[NUM_ROLES] = {"query", "key", "value", "output"};
static const char *const HF_STEM[NUM_ROLES] = {"q_proj", "k_proj", "v_proj", "o_proj"};
static const char *const TORCH_SEP[NUM_ROLES] = {"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                                 "o_proj_weight"};

typedef enum scheme {
    SCHEME_MAP,   /* the caller's name map */
    SCHEME_HF,    /* Hugging Face: q_proj.weight ... */
    SCHEME_TORCH, /* nn.MultiheadAttention: in_proj_weight or q_proj_weight, out_proj.weight */
    SCHEME_CS336, /* q_proj_weight ... o_proj_weight, no biases */
} scheme;

static const char *const SCHEME_NAME[] = {"the name map", "Hugging Face names",
                                          "nn.MultiheadAttention names", "CS336 names"};

/* One projection: weight rows [row0, row0 + rows) of `w`, bias elements [bias0, bias0 + rows)
 * of `b` (NULL: none). */
typedef struct projection {
    const st_tensor *w;
    int64_t row0, rows, cols;
    const st_tensor *b;
    int64_t bias0;
    int bias_shared;      /* b is in_proj_bias, split over q, k, v */
    char bias_tried[160]; /* where a bias was looked for, for messages */
} projection;

static mha_status check_float_tensor(
    const st_file *sf, const st_tensor *t, int32_t ndim, const char *what, mha_error *err) {
    /* "'name' (role)", or "'name'" where the caller's role would repeat the name (what NULL) */
    char label[320];
    snprintf(label, sizeof label, what ? "'%s' (%s)" : "'%s'", t->name, what);
    MHA_RETURN_IF(!t->supported, err, BAD_FILE,
                  "%s: tensor %s has dtype %s; supported: F32, F64, F16, BF16", sf->path, label,
                  t->dtype);
    char shape_text[128];
    format_shape(shape_text, sizeof shape_text, t->ndim, t->shape);
    MHA_RETURN_IF(t->ndim != ndim, err, BAD_FILE, "%s: tensor %s has shape %s, expected %d-d",
                  sf->path, label, shape_text, (int)ndim);
    for (int32_t i = 0; i < ndim; i++)
        MHA_RETURN_IF(t->shape[i] == 0, err, BAD_FILE, "%s: tensor %s has shape %s (empty)",
                      sf->path, label, shape_text);
    return MHA_STATUS_OK;
}

/* Picks the naming scheme from the first role that the map does not name. */
static mha_status detect_scheme(st_file *sf, int role, scheme *out, mha_error *err) {
    if (st_find(sf, HF_STEM[role], ".weight")) {
        *out = SCHEME_HF;
        return MHA_STATUS_OK;
    }
    const int has_out_proj = st_find(sf, "out_proj.weight", NULL) != NULL;
    if (role != ROLE_O) {
        const int packed = st_find(sf, "in_proj_weight", NULL) != NULL;
        const int sep = st_find(sf, TORCH_SEP[role], NULL) != NULL;
        if (packed || (sep && has_out_proj)) {
            *out = SCHEME_TORCH;
            return MHA_STATUS_OK;
        }
        if (sep) {
            *out = SCHEME_CS336;
            return MHA_STATUS_OK;
        }
    } else if (has_out_proj) {
        *out = SCHEME_TORCH;
        return MHA_STATUS_OK;
    } else if (st_find(sf, TORCH_SEP[role], NULL)) {
        *out = SCHEME_CS336;
        return MHA_STATUS_OK;
    }
    char tried[400] = "";
    tried_add(tried, sizeof tried, sf, HF_STEM[role], ".weight");
    tried_add(tried, sizeof tried, sf, role == ROLE_O ? "out_proj.weight" : "in_proj_weight", NULL);
    tried_add(tried, sizeof tried, sf, TORCH_SEP[role], NULL);
    return mha__fail(err, MHA_STATUS_NOT_FOUND, "%s: no %s weight: tried %s", sf->path,
                     ROLE_NAME[role], tried);
}

/* Finds role's weight (and bias) under scheme `s` (or the map stem when `stem` is not NULL). */
static mha_status
find_projection(st_file *sf, int role, scheme s, const char *stem, projection *p, mha_error *err) {
    char tried[400] = "";
    memset(p, 0, sizeof *p);
    const st_tensor *w = NULL, *b = NULL;
    int packed = 0;
    if (s == SCHEME_MAP) {
        w = st_find(sf, stem, ".weight");
        tried_add(tried, sizeof tried, sf, stem, ".weight");
        b = st_find(sf, stem, ".bias");
        tried_add(p->bias_tried, sizeof p->bias_tried, sf, stem, ".bias");
    } else if (s == SCHEME_HF) {
        w = st_find(sf, HF_STEM[role], ".weight");
        tried_add(tried, sizeof tried, sf, HF_STEM[role], ".weight");
        b = st_find(sf, HF_STEM[role], ".bias");
        tried_add(p->bias_tried, sizeof p->bias_tried, sf, HF_STEM[role], ".bias");
    } else if (s == SCHEME_TORCH && role == ROLE_O) {
        w = st_find(sf, "out_proj.weight", NULL);
        tried_add(tried, sizeof tried, sf, "out_proj.weight", NULL);
        b = st_find(sf, "out_proj.bias", NULL);
        tried_add(p->bias_tried, sizeof p->bias_tried, sf, "out_proj.bias", NULL);
    } else if (s == SCHEME_TORCH) {
        w = st_find(sf, "in_proj_weight", NULL);
        tried_add(tried, sizeof tried, sf, "in_proj_weight", NULL);
        packed = w != NULL;
        if (!w) {
            w = st_find(sf, TORCH_SEP[role], NULL);
            tried_add(tried, sizeof tried, sf, TORCH_SEP[role], NULL);
        }
        b = st_find(sf, "in_proj_bias", NULL);
        p->bias_shared = 1;
        tried_add(p->bias_tried, sizeof p->bias_tried, sf, "in_proj_bias", NULL);
    } else { /* CS336: no biases */
        w = st_find(sf, TORCH_SEP[role], NULL);
        tried_add(tried, sizeof tried, sf, TORCH_SEP[role], NULL);
        snprintf(p->bias_tried, sizeof p->bias_tried, "none: CS336 names have no biases");
    }
    MHA_RETURN_IF(!w, err, NOT_FOUND, "%s: no %s weight: tried %s (%s)", sf->path, ROLE_NAME[role],
                  tried, SCHEME_NAME[s]);
    mha_status st = check_float_tensor(sf, w, 2, ROLE_NAME[role], err);
    if (st != MHA_STATUS_OK)
        return st;
    p->w = w;
    p->cols = w->shape[1];
    if (packed) {
        char shape_text[128];
        format_shape(shape_text, sizeof shape_text, w->ndim, w->shape);
        MHA_RETURN_IF(w->shape[0] % 3 != 0, err, BAD_FILE,
                      "%s: tensor '%s' has shape %s: its rows are not divisible by 3 (q, k, v)",
                      sf->path, w->name, shape_text);
        p->rows = w->shape[0] / 3;
        p->row0 = role * p->rows;
    } else {
        p->rows = w->shape[0];
    }
    if (b) {
        if ((st = check_float_tensor(sf, b, 1, "bias", err)) != MHA_STATUS_OK)
            return st;
        p->b = b;
    }
    return MHA_STATUS_OK;
}

/* Checks each bias length against its weight rows; in_proj_bias is split over q, k, v. */
static mha_status check_biases(const st_file *sf, projection *p, mha_error *err) {
    for (int r = 0; r < NUM_ROLES; r++) {
        const st_tensor *b = p[r].b;
        if (!b)
            continue;
        int64_t want = p[r].rows;
        if (p[r].bias_shared) {
            want = p[ROLE_Q].rows + p[ROLE_K].rows + p[ROLE_V].rows;
            p[r].bias0 = r == ROLE_Q   ? 0
                         : r == ROLE_K ? p[ROLE_Q].rows
                                       : p[ROLE_Q].rows + p[ROLE_K].rows;
        }
        char wshape[128], bshape[128];
        format_shape(wshape, sizeof wshape, p[r].w->ndim, p[r].w->shape);
        format_shape(bshape, sizeof bshape, b->ndim, b->shape);
        MHA_RETURN_IF(b->shape[0] != want, err, BAD_FILE,
                      "%s: bias '%s' has shape %s but %s expects %lld elements (weight '%s' %s)",
                      sf->path, b->name, bshape, ROLE_NAME[r], (long long)want, p[r].w->name,
                      wshape);
    }
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Size inference                                                                                 */
/* ---------------------------------------------------------------------------------------------- */

static mha_status infer_sizes(
    const st_file *sf, const projection *p, const mha_config *in, mha_config *c, mha_error *err) {
    const char *path = sf->path;
    char sq[128], sk[128], sv[128], so[128];
    format_shape(sq, sizeof sq, 2, p[ROLE_Q].w->shape);
    format_shape(sk, sizeof sk, 2, p[ROLE_K].w->shape);
    format_shape(sv, sizeof sv, 2, p[ROLE_V].w->shape);
    format_shape(so, sizeof so, 2, p[ROLE_O].w->shape);
    const char *nq = p[ROLE_Q].w->name, *nk = p[ROLE_K].w->name, *nv = p[ROLE_V].w->name,
               *no = p[ROLE_O].w->name;
    const char *packed_note = p[ROLE_Q].w == p[ROLE_K].w ? " (one third of the rows each)" : "";
    const int64_t h = in->num_heads, rq = p[ROLE_Q].rows, rk = p[ROLE_K].rows, rv = p[ROLE_V].rows;

    MHA_RETURN_IF(rq % h != 0, err, BAD_FILE,
                  "%s: query weight '%s' has shape %s%s: %lld rows are not divisible by num_heads "
                  "%lld",
                  path, nq, sq, packed_note, (long long)rq, (long long)h);
    const int64_t dk = rq / h;
    int64_t g;
    if (in->num_kv_heads > 0) {
        g = in->num_kv_heads;
        MHA_RETURN_IF(h % g != 0, err, INVALID_ARG,
                      "%s: num_kv_heads %lld does not divide num_heads %lld", path, (long long)g,
                      (long long)h);
        MHA_RETURN_IF(rk != g * dk, err, BAD_FILE,
                      "%s: key weight '%s' has shape %s%s: expected %lld rows (num_kv_heads %lld x "
                      "head size %lld, from query weight '%s' %s and num_heads %lld)",
                      path, nk, sk, packed_note, (long long)(g * dk), (long long)g, (long long)dk,
                      nq, sq, (long long)h);
    } else {
        MHA_RETURN_IF(rk % dk != 0, err, BAD_FILE,
                      "%s: key weight '%s' has shape %s%s: %lld rows are not a multiple of the "
                      "head size %lld (query weight '%s' %s / num_heads %lld)",
                      path, nk, sk, packed_note, (long long)rk, (long long)dk, nq, sq,
                      (long long)h);
        g = rk / dk;
        MHA_RETURN_IF(h % g != 0, err, BAD_FILE,
                      "%s: key weight '%s' has shape %s: %lld kv heads of size %lld, which does "
                      "not divide num_heads %lld",
                      path, nk, sk, (long long)g, (long long)dk, (long long)h);
    }
    MHA_RETURN_IF(rv % g != 0, err, BAD_FILE,
                  "%s: value weight '%s' has shape %s%s: %lld rows are not divisible by %lld kv "
                  "heads",
                  path, nv, sv, packed_note, (long long)rv, (long long)g);
    const int64_t dv = rv / g;
    int64_t hdv;
    MHA_RETURN_IF(!mha__mul_i64(h, dv, &hdv) || p[ROLE_O].cols != hdv, err, BAD_FILE,
                  "%s: output weight '%s' has shape %s: expected %lld columns (num_heads %lld x "
                  "value head size %lld from '%s' %s)",
                  path, no, so, (long long)(h * dv), (long long)h, (long long)dv, nv, sv);

    c->q_dim = p[ROLE_Q].cols;
    c->k_dim = p[ROLE_K].cols;
    c->v_dim = p[ROLE_V].cols;
    c->num_heads = h;
    c->num_kv_heads = g;
    c->head_dim = dk;
    c->v_head_dim = dv;
    c->out_dim = p[ROLE_O].rows;

    /* Sizes the caller gave explicitly must agree with the file. */
    const struct {
        const char *field;
        int64_t given, found;
    } checks[] = {
        {"q_dim", in->q_dim, c->q_dim},
        {"k_dim", in->k_dim, c->k_dim},
        {"v_dim", in->v_dim, c->v_dim},
        {"head_dim", in->head_dim, c->head_dim},
        {"v_head_dim", in->v_head_dim, c->v_head_dim},
        {"out_dim", in->out_dim, c->out_dim},
    };
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++)
        MHA_RETURN_IF(checks[i].given != 0 && checks[i].given != checks[i].found, err, BAD_FILE,
                      "%s: config.%s=%lld but the file's shapes give %lld", path, checks[i].field,
                      (long long)checks[i].given, (long long)checks[i].found);
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* The loader                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

static size_t max_len(size_t a, const char *s) {
    size_t n = s ? strlen(s) : 0;
    return n > a ? n : a;
}

/* Allocates and reads count elements of t from `first` into *out, in `to` (read_elems). */
static mha_status load_elems(st_file *sf,
                             const st_tensor *t,
                             int64_t first,
                             int64_t count,
                             mha_dtype to,
                             const mha_allocator *allocator,
                             void **out,
                             mha_error *err) {
    size_t bytes;
    MHA_RETURN_IF(!mha__bytes(count, mha__storage_size(to), &bytes), err, OVERFLOW,
                  "%s: tensor '%s' is too large", sf->path, t->name);
    void *dst = mha__alloc(allocator, bytes);
    MHA_RETURN_IF(!dst, err, NO_MEMORY, "%s: cannot allocate %zu bytes for tensor '%s'", sf->path,
                  bytes, t->name);
    mha_status st = read_elems(sf, t, first, count, to, dst, err);
    if (st != MHA_STATUS_OK) {
        mha__free(allocator, dst);
        return st;
    }
    *out = dst;
    return MHA_STATUS_OK;
}

/* The QK-norm weights a config's kind needs (docs/FORMATS.md): "q_norm.weight" [G_q] and
 * "k_norm.weight" [G_k] (after the prefix, transformers' names), G = head_dim (RMS_HEAD) or
 * heads * head_dim (RMS_ALL); t[0], t[1] stay NULL for a kind without weights. */
static mha_status
find_qk_norm(st_file *sf, const mha_config *c, const st_tensor *t[2], mha_error *err) {
    const mha_qk_norm_kind kind = c->qk_norm.kind;
    if (kind != MHA_QK_NORM_RMS_HEAD && kind != MHA_QK_NORM_RMS_ALL)
        return MHA_STATUS_OK;
    const char *stem[2] = {"q_norm", "k_norm"};
    const int64_t heads[2] = {c->num_heads, c->num_kv_heads};
    for (int i = 0; i < 2; i++) {
        t[i] = st_find(sf, stem[i], ".weight");
        MHA_RETURN_IF(!t[i], err, NOT_FOUND, "%s: config.qk_norm needs '%s%s.weight': not found",
                      sf->path, sf->prefix, stem[i]);
        mha_status st = check_float_tensor(sf, t[i], 1, stem[i], err);
        if (st != MHA_STATUS_OK)
            return st;
        const int64_t want = kind == MHA_QK_NORM_RMS_ALL ? heads[i] * c->head_dim : c->head_dim;
        MHA_RETURN_IF(t[i]->shape[0] != want, err, BAD_FILE,
                      "%s: tensor '%s' has shape [%lld], expected [%lld] (%s)", sf->path,
                      t[i]->name, (long long)t[i]->shape[0], (long long)want,
                      kind == MHA_QK_NORM_RMS_ALL ? "heads x head_dim" : "head_dim");
    }
    return MHA_STATUS_OK;
}

static mha_status load_layer(st_file *sf,
                             const mha_name_map *names,
                             const mha_config *config,
                             const mha_allocator *allocator,
                             void **bufs,
                             mha_layer **out,
                             mha_error *err) {
    const char *path = sf->path;
    const char *stems[NUM_ROLES] = {names ? names->q : NULL, names ? names->k : NULL,
                                    names ? names->v : NULL, names ? names->o : NULL};
    mha_status st;

    /* 1. Pick the naming scheme (from the first role the map leaves to the built-in search). */
    scheme builtin = SCHEME_HF;
    for (int r = 0; r < NUM_ROLES; r++)
        if (!stems[r]) {
            if ((st = detect_scheme(sf, r, &builtin, err)) != MHA_STATUS_OK)
                return st;
            break;
        }

    /* 2. Find the four projections, their biases and the sinks. */
    projection p[NUM_ROLES];
    for (int r = 0; r < NUM_ROLES; r++) {
        st = find_projection(sf, r, stems[r] ? SCHEME_MAP : builtin, stems[r], &p[r], err);
        if (st != MHA_STATUS_OK)
            return st;
    }
    if ((st = check_biases(sf, p, err)) != MHA_STATUS_OK)
        return st;
    const int32_t want_bias[NUM_ROLES] = {config->bias_q, config->bias_k, config->bias_v,
                                          config->bias_o};
    for (int r = 0; r < NUM_ROLES; r++)
        MHA_RETURN_IF(want_bias[r] && !p[r].b, err, NOT_FOUND,
                      "%s: the config asks for a %s bias but the file has none: tried %s", path,
                      ROLE_NAME[r], p[r].bias_tried);

    const char *sinks_name = names && names->sinks ? names->sinks : "sinks";
    const st_tensor *sinks = st_find(sf, sinks_name, NULL);
    MHA_RETURN_IF(!sinks && (config->sinks || (names && names->sinks)), err, NOT_FOUND,
                  "%s: no attention sinks: tried '%s%s'", path, sf->prefix, sinks_name);
    if (sinks) {
        if ((st = check_float_tensor(sf, sinks, 1, "sinks", err)) != MHA_STATUS_OK)
            return st;
        MHA_RETURN_IF(sinks->shape[0] != config->num_heads, err, BAD_FILE,
                      "%s: sinks '%s' have shape [%lld], expected [%lld] (num_heads)", path,
                      sinks->name, (long long)sinks->shape[0], (long long)config->num_heads);
    }

    /* 3. Sizes from the shapes, checked against the heads; non-size options from the caller. */
    mha_config c;
    memset(&c, 0, sizeof c);
    if ((st = infer_sizes(sf, p, config, &c, err)) != MHA_STATUS_OK)
        return st;
    c.bias_q = p[ROLE_Q].b != NULL;
    c.bias_k = p[ROLE_K].b != NULL;
    c.bias_v = p[ROLE_V].b != NULL;
    c.bias_o = p[ROLE_O].b != NULL;
    c.sinks = sinks != NULL;
    c.weight_dtype = config->weight_dtype; /* checked by load_common */
    c.scale = config->scale;
    c.softcap = config->softcap;
    c.alibi = config->alibi;
    c.rope = config->rope;
    c.qk_norm = config->qk_norm;
    c.output_gate = config->output_gate;
    const st_tensor *norm_t[2] = {NULL, NULL};
    if ((st = find_qk_norm(sf, &c, norm_t, err)) != MHA_STATUS_OK)
        return st;

    /* 4. Read everything in the weight_dtype (bufs: w_q w_k w_v w_o b_q b_k b_v b_o sinks q_norm
     *    k_norm). */
    const mha_dtype to = c.weight_dtype;
    for (int r = 0; r < NUM_ROLES; r++) {
        int64_t count;
        MHA_RETURN_IF(!mha__mul_i64(p[r].rows, p[r].cols, &count), err, OVERFLOW,
                      "%s: tensor '%s' is too large", path, p[r].w->name);
        st = load_elems(sf, p[r].w, p[r].row0 * p[r].cols, count, to, allocator, &bufs[r], err);
        if (st != MHA_STATUS_OK)
            return st;
        if (p[r].b) {
            st = load_elems(sf, p[r].b, p[r].bias0, p[r].rows, to, allocator, &bufs[4 + r], err);
            if (st != MHA_STATUS_OK)
                return st;
        }
    }
    if (sinks && (st = load_elems(sf, sinks, 0, sinks->shape[0], to, allocator, &bufs[8], err)) !=
                     MHA_STATUS_OK)
        return st;

    for (int i = 0; i < 2 && norm_t[i]; i++)
        if ((st = load_elems(sf, norm_t[i], 0, norm_t[i]->shape[0], to, allocator, &bufs[9 + i],
                             err)) != MHA_STATUS_OK)
            return st;

    /* 5. The layer takes its own copy. */
    mha_weights w = {bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5],
                     bufs[6], bufs[7], bufs[8], bufs[9], bufs[10]};
    st = mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, allocator, out, err);
    if (st != MHA_STATUS_OK && err) {
        char msg[MHA_ERROR_MESSAGE_SIZE];
        memcpy(msg, err->message, sizeof msg);
        msg[sizeof msg - 1] = '\0';
        mha__fail(err, st, "%s: %s", path, msg);
    }
    return st;
}

/* The loader behind both entry points: the file at `path`, or the image `buf` of `len` bytes when
 * buf is not NULL (then `path` only names it in messages). */
static mha_status load_common(const char *path,
                              const void *buf,
                              size_t len,
                              const char *prefix,
                              const mha_name_map *names,
                              const mha_config *config,
                              const mha_allocator *allocator,
                              mha_layer **out,
                              mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "mha_layer_load_safetensors: out is NULL");
    *out = NULL;
    MHA_RETURN_IF(!path, err, INVALID_ARG, "mha_layer_load_safetensors: path is NULL");
    MHA_RETURN_IF(!config, err, INVALID_ARG, "mha_layer_load_safetensors: config is NULL");
    MHA_RETURN_IF(config->num_heads <= 0, err, INVALID_ARG,
                  "%s: config.num_heads=%lld must be positive", path, (long long)config->num_heads);
    MHA_RETURN_IF(config->num_kv_heads < 0, err, INVALID_ARG,
                  "%s: config.num_kv_heads=%lld is negative", path,
                  (long long)config->num_kv_heads);
    MHA_RETURN_IF(!mha__is_float_storage(config->weight_dtype), err, INVALID_ARG,
                  "%s: config.weight_dtype=%d is not MHA_DTYPE_F32 (0), MHA_DTYPE_BF16 or "
                  "MHA_DTYPE_F16",
                  path, (int)config->weight_dtype);

    st_file sf;
    memset(&sf, 0, sizeof sf);
    sf.prefix = prefix ? prefix : "";
    size_t longest = 32; /* the built-in names */
    if (names) {
        longest = max_len(longest, names->q);
        longest = max_len(longest, names->k);
        longest = max_len(longest, names->v);
        longest = max_len(longest, names->o);
        longest = max_len(longest, names->sinks);
    }
    sf.name_cap = strlen(sf.prefix) + longest + 16;
    sf.name_buf = malloc(sf.name_cap);
    mha_status st;
    if (!sf.name_buf)
        st = mha__fail(err, MHA_STATUS_NO_MEMORY, "%s: out of memory", path);
    else if (buf)
        st = st_open_mem(&sf, buf, len, path, err);
    else
        st = st_open(&sf, path, err);

    void *bufs[11] = {NULL};
    if (st == MHA_STATUS_OK)
        st = load_layer(&sf, names, config, allocator, bufs, out, err);
    for (int i = 0; i < 11; i++)
        mha__free(allocator, bufs[i]);
    st_close(&sf);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

mha_status mha_layer_load_safetensors(const char *path,
                                      const char *prefix,
                                      const mha_name_map *names,
                                      const mha_config *config,
                                      const mha_allocator *allocator,
                                      mha_layer **out,
                                      mha_error *err) {
    return load_common(path, NULL, 0, prefix, names, config, allocator, out, err);
}

mha_status mha__safetensors_load_mem(const void *buf,
                                     size_t len,
                                     const char *name,
                                     const char *prefix,
                                     const mha_name_map *names,
                                     const mha_config *config,
                                     const mha_allocator *allocator,
                                     mha_layer **out,
                                     mha_error *err) {
    if (!name)
        name = "<memory>";
    if (!buf && out)
        *out = NULL;
    MHA_RETURN_IF(!buf, err, INVALID_ARG, "mha__safetensors_load_mem: buf is NULL");
    return load_common(name, buf, len, prefix, names, config, allocator, out, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* Tensor-level access (safetensors.h)                                                            */
/* ---------------------------------------------------------------------------------------------- */

struct mha__st_handle {
    st_file sf;
    char *path; /* owned copy: messages name it */
};

/* Longest tensor name looked up (HF names are under 100 characters). */
#define ST_MAX_NAME 1024

mha_status mha__st_open(const char *path, mha__st_handle **out, mha_error *err) {
    *out = NULL;
    mha__st_handle *h = calloc(1, sizeof *h);
    MHA_RETURN_IF(!h, err, NO_MEMORY, "%s: out of memory", path);
    h->path = malloc(strlen(path) + 1);
    h->sf.name_cap = ST_MAX_NAME + 1;
    h->sf.name_buf = malloc(h->sf.name_cap);
    h->sf.prefix = "";
    if (!h->path || !h->sf.name_buf) {
        mha__st_close(h);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "%s: out of memory", path);
    }
    memcpy(h->path, path, strlen(path) + 1);
    mha_status st = st_open(&h->sf, h->path, err);
    if (st != MHA_STATUS_OK) {
        mha__st_close(h);
        return st;
    }
    *out = h;
    return MHA_STATUS_OK;
}

void mha__st_close(mha__st_handle *h) {
    if (!h)
        return;
    st_close(&h->sf);
    free(h->path);
    free(h);
}

static const st_tensor *handle_find(mha__st_handle *h, const char *name) {
    if (strlen(name) > ST_MAX_NAME)
        return NULL;
    return st_find(&h->sf, name, NULL);
}

int mha__st_has(mha__st_handle *h, const char *name, int32_t *ndim, int64_t shape[8]) {
    const st_tensor *t = handle_find(h, name);
    if (!t)
        return 0;
    *ndim = t->ndim;
    for (int32_t i = 0; i < t->ndim && i < ST_MAX_DIMS; i++)
        shape[i] = t->shape[i];
    return 1;
}

mha_status mha__st_read(mha__st_handle *h,
                        const char *name,
                        int32_t want_ndim,
                        mha_dtype to,
                        const mha_allocator *allocator,
                        void **out,
                        int64_t shape[2],
                        mha_error *err) {
    *out = NULL;
    const st_tensor *t = handle_find(h, name);
    MHA_RETURN_IF(!t, err, NOT_FOUND, "%s: no tensor '%s'", h->path, name);
    mha_status st = check_float_tensor(&h->sf, t, want_ndim, NULL, err);
    if (st != MHA_STATUS_OK)
        return st;
    shape[0] = t->shape[0];
    shape[1] = want_ndim == 2 ? t->shape[1] : 1;
    return load_elems(&h->sf, t, 0, t->count, to, allocator, out, err);
}

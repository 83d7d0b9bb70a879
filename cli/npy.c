/* SPDX-License-Identifier: MIT */
/* npy.c: NumPy .npy reader and float32 writer (format versions 1.0, 2.0 and 3.0), see npy.h and
 * docs/FORMATS.md. Part of the CLI (and compiled into the tests): it uses the public API only.
 *
 * Files are untrusted. The header dict is parsed strictly (exactly the keys 'descr',
 * 'fortran_order' and 'shape', Python literal syntax); every size is overflow-checked and the data
 * must be exactly as long as the shape says, checked against the file size before anything big is
 * allocated. Data are little-endian on disk and converted to the host order. Writes go to a
 * temporary file that is renamed into place (at once, or, for a command's outputs written as one
 * set, all together once every one of them is complete: mha__npy_set_begin).
 */
#define _POSIX_C_SOURCE 200809L

#include "npy.h"

#include <stdarg.h>
#include <stdbool.h>

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef O_CLOEXEC
#    define O_CLOEXEC 0
#endif
#ifndef O_NOCTTY
#    define O_NOCTTY 0
#endif
#ifndef O_NOFOLLOW
#    define O_NOFOLLOW 0
#endif

/* Header dicts are a few hundred bytes; numpy itself refuses more than 10000 by default. The limit
 * keeps a hostile version 2.0/3.0 header length (up to 4 GiB) from causing a huge allocation. */
#define NPY_MAX_HEADER ((size_t)1 << 20)

/* Errors as the library reports them: a status and a message in mha_error (public types only:
 * this file is part of the CLI and the tests, not of the library). */
mha_status mha__npy_fail(mha_error *err, mha_status status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        err->status = status;
    }
    return status;
}

/* The open output set (mha__npy_set_begin): the finished temporaries and their targets, in the
 * order they were written. One set per process (the CLI writes its outputs from one thread). */
static struct {
    int open;
    int count, cap;
    char **tmp, **path;
} npy_set;

static void npy_set_free(void) {
    for (int i = 0; i < npy_set.count; i++) {
        free(npy_set.tmp[i]);
        free(npy_set.path[i]);
    }
    free(npy_set.tmp);
    free(npy_set.path);
    memset(&npy_set, 0, sizeof npy_set);
}

static char *npy_strdup(const char *s) {
    const size_t n = strlen(s) + 1;
    char *c = malloc(n);
    if (c)
        memcpy(c, s, n);
    return c;
}

void mha__npy_set_begin(void) {
    npy_set_free();
    npy_set.open = 1;
}

void mha__npy_set_abort(void) {
    for (int i = 0; i < npy_set.count; i++)
        remove(npy_set.tmp[i]);
    npy_set_free();
}

mha_status mha__npy_set_commit(mha_error *err) {
    mha_status st = MHA_STATUS_OK;
    for (int i = 0; i < npy_set.count; i++) {
        if (st == MHA_STATUS_OK && rename(npy_set.tmp[i], npy_set.path[i]) != 0)
            st = mha__npy_fail(err, MHA_STATUS_IO, "%s: cannot write: %s", npy_set.path[i],
                               strerror(errno));
        if (st != MHA_STATUS_OK)
            remove(npy_set.tmp[i]);
    }
    npy_set_free();
    return st;
}

int mha__npy_place(const char *tmp, const char *path) {
    if (!npy_set.open)
        return rename(tmp, path);
    if (npy_set.count == npy_set.cap) {
        const int cap = npy_set.cap ? 2 * npy_set.cap : 8;
        char **t = realloc(npy_set.tmp, (size_t)cap * sizeof *t);
        if (t)
            npy_set.tmp = t;
        char **p = t ? realloc(npy_set.path, (size_t)cap * sizeof *p) : NULL;
        if (p)
            npy_set.path = p;
        if (!t || !p) {
            errno = ENOMEM;
            return -1;
        }
        npy_set.cap = cap;
    }
    char *t = npy_strdup(tmp), *p = npy_strdup(path);
    if (!t || !p) {
        free(t);
        free(p);
        errno = ENOMEM;
        return -1;
    }
    npy_set.tmp[npy_set.count] = t;
    npy_set.path[npy_set.count++] = p;
    return 0;
}

mha_status mha__npy_commit(FILE *f, int ok, const char *tmp, const char *path, mha_error *err) {
    int e = ok ? 0 : (errno ? errno : EIO);
    if (fclose(f) != 0 && ok) {
        ok = 0;
        e = errno;
    }
    if (ok && mha__npy_place(tmp, path) != 0) {
        ok = 0;
        e = errno;
    }
    if (ok)
        return MHA_STATUS_OK;
    remove(tmp);
    return mha__npy_fail(err, MHA_STATUS_IO, "%s: cannot write: %s", path, strerror(e));
}

FILE *mha__npy_create_tmp(const char *tmp) {
    /* O_EXCL: never open an existing name (O_EXCL fails on a symbolic link too, dangling or not),
     * so a link planted at the predictable name cannot make the write go through it. */
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0)
        return NULL;
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        const int e = errno;
        close(fd);
        remove(tmp);
        errno = e;
    }
    return f;
}

static void npy_ok(mha_error *err) {
    if (err) {
        err->status = MHA_STATUS_OK;
        err->message[0] = '\0';
    }
}

#define NPY_RETURN_IF(cond, err, status, ...)                                                      \
    do {                                                                                           \
        if (cond)                                                                                  \
            return mha__npy_fail((err), MHA_STATUS_##status, __VA_ARGS__);                         \
    } while (0)

/* Product of n non-negative sizes, and count * elem bytes: false on overflow. */
static bool npy_prod(const int64_t *factors, int n, int64_t *out) {
    int64_t p = 1;
    for (int i = 0; i < n; i++) {
        if (factors[i] < 0 || (factors[i] != 0 && p > INT64_MAX / factors[i]))
            return false;
        p *= factors[i];
    }
    *out = p;
    return true;
}

static bool npy_bytes(int64_t count, size_t elem, size_t *out) {
    if (count < 0 || (elem && (uint64_t)count > SIZE_MAX / elem))
        return false;
    *out = (size_t)count * elem;
    return true;
}

static const unsigned char NPY_MAGIC[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

/* The accepted dtype strings, exactly as numpy writes them. */
static const struct {
    const char *descr;
    mha_dtype dtype;
} NPY_DTYPES[] = {
    {"<f4", MHA_DTYPE_F32},
    {"<f8", MHA_DTYPE_F64},
    {"<f2", MHA_DTYPE_F16},
    {"|b1", MHA_DTYPE_BOOL},
    {"|u1", MHA_DTYPE_U8},
    {"<i4", MHA_DTYPE_I32},
    {"<i8", MHA_DTYPE_I64},
    /* bfloat16: numpy has no name for it; np.save of an ml_dtypes.bfloat16 array (ml_dtypes 0.5,
     * numpy 2) writes this descr (a plain 2-byte void is '|V2', refused), and np.load gives a '|V2'
     * array that .view(ml_dtypes.bfloat16) reads back. */
    {"<V2", MHA_DTYPE_BF16},
};
#define NPY_NUM_DTYPES (sizeof NPY_DTYPES / sizeof NPY_DTYPES[0])

static const char *npy_descr_of(mha_dtype dtype) {
    for (size_t i = 0; i < NPY_NUM_DTYPES; i++)
        if (NPY_DTYPES[i].dtype == dtype)
            return NPY_DTYPES[i].descr;
    return "?";
}

static int host_is_little_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* Reverses the bytes of each of `count` elements of `size` bytes (big-endian hosts only). */
static void swap_elements(void *data, int64_t count, size_t size) {
    unsigned char *p = data;
    if (size < 2)
        return;
    for (int64_t i = 0; i < count; i++, p += size)
        for (size_t a = 0, b = size - 1; a < b; a++, b--) {
            unsigned char t = p[a];
            p[a] = p[b];
            p[b] = t;
        }
}

/* "(4, 100)", "(4,)" or "()": the shape as Python prints it, for messages. */
static void format_shape(char *buf, size_t size, int32_t ndim, const int64_t *shape) {
    size_t used = 0;
    int n = snprintf(buf, size, "(");
    used = n > 0 ? (size_t)n : 0;
    for (int32_t i = 0; i < ndim && used < size; i++) {
        n = snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
        used += n > 0 ? (size_t)n : 0;
    }
    if (used < size)
        snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
}

/* ---------------------------------------------------------------------------------------------- */
/* Header parsing                                                                                 */
/* ---------------------------------------------------------------------------------------------- */

typedef struct npy_header {
    mha_dtype dtype;
    char descr[8];
    int32_t ndim;
    int64_t shape[MHA_NPY_MAX_DIMS];
    int64_t count;
    size_t data_bytes;
} npy_header;

/* Checks magic and version in the first bytes of a file of `total` bytes (`avail` of them in
 * buf) and returns where the header dict starts and how long it is. */
static mha_status parse_preamble(const unsigned char *buf,
                                 size_t avail,
                                 uint64_t total,
                                 const char *name,
                                 size_t *dict_start,
                                 size_t *dict_len,
                                 mha_error *err) {
    NPY_RETURN_IF(avail > 0 && memcmp(buf, NPY_MAGIC, avail < 6 ? avail : 6) != 0, err, BAD_FILE,
                  "%s: not a .npy file (bad magic bytes)", name);
    NPY_RETURN_IF(avail < 10, err, BAD_FILE,
                  "%s: truncated header: the file is %llu bytes, a .npy header needs at least 10",
                  name, (unsigned long long)total);
    const unsigned major = buf[6], minor = buf[7];
    NPY_RETURN_IF(major < 1 || major > 3 || minor != 0, err, BAD_FILE,
                  "%s: unsupported .npy format version %u.%u (supported: 1.0, 2.0, 3.0)", name,
                  major, minor);
    size_t start, len;
    if (major == 1) {
        start = 10;
        len = (size_t)buf[8] | (size_t)buf[9] << 8;
    } else {
        NPY_RETURN_IF(avail < 12, err, BAD_FILE,
                      "%s: truncated header: the file is %llu bytes, a version %u.0 header needs "
                      "at least 12",
                      name, (unsigned long long)total, major);
        start = 12;
        len = (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    }
    NPY_RETURN_IF((uint64_t)start + len > total, err, BAD_FILE,
                  "%s: truncated header: the header dict is %zu bytes but the file has only %llu "
                  "after the preamble",
                  name, len, (unsigned long long)(total - start));
    NPY_RETURN_IF(len > NPY_MAX_HEADER, err, BAD_FILE,
                  "%s: header dict is %zu bytes, more than the %zu-byte limit", name, len,
                  NPY_MAX_HEADER);
    *dict_start = start;
    *dict_len = len;
    return MHA_STATUS_OK;
}

/* A cursor over the header text (Python literal syntax, as written by numpy). */
typedef struct cursor {
    const char *s;
    size_t len, pos;
    const char *name;
    mha_error *err;
} cursor;

static int at_end(const cursor *c) {
    return c->pos >= c->len;
}

static char peek(const cursor *c) {
    return at_end(c) ? '\0' : c->s[c->pos];
}

static void skip_ws(cursor *c) {
    while (!at_end(c) && (c->s[c->pos] == ' ' || c->s[c->pos] == '\t' || c->s[c->pos] == '\n' ||
                          c->s[c->pos] == '\r'))
        c->pos++;
}

static mha_status malformed(cursor *c, const char *what) {
    /* Quote up to 60 characters of the dict around the failure, non-printables as '?'. */
    char snippet[64];
    size_t from = c->pos > 20 ? c->pos - 20 : 0, n = 0;
    for (size_t i = from; i < c->len && n < 60; i++, n++) {
        unsigned char ch = (unsigned char)c->s[i];
        snippet[n] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
    }
    snippet[n] = '\0';
    return mha__npy_fail(c->err, MHA_STATUS_BAD_FILE,
                         "%s: malformed .npy header dict at byte %zu: %s (near \"%s\")", c->name,
                         c->pos, what, snippet);
}

/* A quoted string without escapes: 'abc' or "abc". Returns its span. */
static mha_status parse_string(cursor *c, const char **str, size_t *len) {
    const char q = peek(c);
    if (q != '\'' && q != '"')
        return malformed(c, "expected a quoted string");
    size_t begin = ++c->pos;
    while (!at_end(c) && c->s[c->pos] != q) {
        if (c->s[c->pos] == '\\' || c->s[c->pos] == '\n')
            return malformed(c, "unsupported character in a string");
        c->pos++;
    }
    if (at_end(c))
        return malformed(c, "unterminated string");
    *str = c->s + begin;
    *len = c->pos - begin;
    c->pos++;
    return MHA_STATUS_OK;
}

static int is_ident_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_';
}

static int match_word(cursor *c, const char *word) {
    size_t n = strlen(word);
    if (c->len - c->pos < n || memcmp(c->s + c->pos, word, n) != 0)
        return 0;
    if (c->pos + n < c->len && is_ident_char(c->s[c->pos + n]))
        return 0;
    c->pos += n;
    return 1;
}

/* A non-negative decimal integer that fits in int64 (no sign, no leading zeros, no '_'). */
static mha_status parse_dim(cursor *c, int64_t *out) {
    if (peek(c) == '-')
        return mha__npy_fail(
            c->err, MHA_STATUS_BAD_FILE,
            "%s: negative dimension in the .npy shape (byte %zu of the header dict)", c->name,
            c->pos);
    if (peek(c) < '0' || peek(c) > '9')
        return malformed(c, "expected a dimension (a non-negative integer)");
    if (peek(c) == '0' && c->pos + 1 < c->len && c->s[c->pos + 1] >= '0' && c->s[c->pos + 1] <= '9')
        return malformed(c, "leading zero in a dimension");
    int64_t v = 0;
    while (peek(c) >= '0' && peek(c) <= '9') {
        int digit = peek(c) - '0';
        if (v > (INT64_MAX - digit) / 10)
            return mha__npy_fail(c->err, MHA_STATUS_BAD_FILE,
                                 "%s: a dimension in the .npy shape does not fit in 64 bits",
                                 c->name);
        v = v * 10 + digit;
        c->pos++;
    }
    if (is_ident_char(peek(c)))
        return malformed(c, "unexpected character after a dimension");
    *out = v;
    return MHA_STATUS_OK;
}

/* A Python tuple of dimensions: (), (a,), (a, b) or (a, b,). */
static mha_status parse_shape(cursor *c, npy_header *h) {
    mha_status st;
    if (peek(c) != '(')
        return malformed(c, "'shape' must be a tuple");
    c->pos++;
    skip_ws(c);
    h->ndim = 0;
    if (peek(c) == ')') {
        c->pos++;
        return MHA_STATUS_OK;
    }
    for (;;) {
        int64_t dim = 0;
        if ((st = parse_dim(c, &dim)) != MHA_STATUS_OK)
            return st;
        NPY_RETURN_IF(h->ndim >= MHA_NPY_MAX_DIMS, c->err, BAD_FILE,
                      "%s: the .npy shape has more than %d dimensions", c->name, MHA_NPY_MAX_DIMS);
        h->shape[h->ndim++] = dim;
        skip_ws(c);
        if (peek(c) == ')') {
            if (h->ndim == 1)
                return malformed(c, "a one-dimensional shape needs a trailing comma, as in (4,)");
            c->pos++;
            return MHA_STATUS_OK;
        }
        if (peek(c) != ',')
            return malformed(c, "expected ',' or ')' in the shape");
        c->pos++;
        skip_ws(c);
        if (peek(c) == ')') {
            c->pos++;
            return MHA_STATUS_OK;
        }
    }
}

static mha_status parse_descr(cursor *c, npy_header *h) {
    const char *s;
    size_t n;
    if (peek(c) == '[')
        return mha__npy_fail(c->err, MHA_STATUS_BAD_FILE,
                             "%s: structured dtypes (a list 'descr') are not supported", c->name);
    mha_status st = parse_string(c, &s, &n);
    if (st != MHA_STATUS_OK)
        return st;
    for (size_t i = 0; i < NPY_NUM_DTYPES; i++) {
        if (strlen(NPY_DTYPES[i].descr) == n && memcmp(NPY_DTYPES[i].descr, s, n) == 0) {
            h->dtype = NPY_DTYPES[i].dtype;
            memcpy(h->descr, s, n);
            h->descr[n] = '\0';
            return MHA_STATUS_OK;
        }
    }
    const int shown = n > 32 ? 32 : (int)n;
    if (n > 0 && s[0] == '>')
        return mha__npy_fail(
            c->err, MHA_STATUS_BAD_FILE,
            "%s: big-endian dtype '%.*s' is not supported (save it as little-endian, "
            "e.g. a.astype('<%.*s'))",
            c->name, shown, s, shown > 0 ? shown - 1 : 0, s + 1);
    return mha__npy_fail(
        c->err, MHA_STATUS_BAD_FILE,
        "%s: unsupported dtype '%.*s' (supported: <f4 <f8 <f2 <V2 (bfloat16) |b1 |u1 <i4 <i8)",
        c->name, shown, s);
}

/* Parses "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" plus trailing spaces and
 * newline, then checks the shape's size. */
static mha_status
parse_dict(const char *text, size_t len, const char *name, npy_header *h, mha_error *err) {
    cursor c = {text, len, 0, name, err};
    mha_status st;
    int have_descr = 0, have_order = 0, have_shape = 0;
    memset(h, 0, sizeof *h);

    skip_ws(&c);
    if (peek(&c) != '{')
        return malformed(&c, "expected '{'");
    c.pos++;
    for (;;) {
        skip_ws(&c);
        if (peek(&c) == '}')
            break;
        const char *key;
        size_t klen;
        if ((st = parse_string(&c, &key, &klen)) != MHA_STATUS_OK)
            return st;
        skip_ws(&c);
        if (peek(&c) != ':')
            return malformed(&c, "expected ':' after a key");
        c.pos++;
        skip_ws(&c);
        if (klen == 5 && memcmp(key, "descr", 5) == 0) {
            NPY_RETURN_IF(have_descr++, err, BAD_FILE, "%s: duplicate key 'descr' in the header",
                          name);
            st = parse_descr(&c, h);
        } else if (klen == 13 && memcmp(key, "fortran_order", 13) == 0) {
            NPY_RETURN_IF(have_order++, err, BAD_FILE,
                          "%s: duplicate key 'fortran_order' in the header", name);
            if (match_word(&c, "True"))
                st = mha__npy_fail(err, MHA_STATUS_BAD_FILE,
                                   "%s: fortran_order True is not supported: save a C-order array "
                                   "(numpy.ascontiguousarray)",
                                   name);
            else if (!match_word(&c, "False"))
                st = malformed(&c, "'fortran_order' must be True or False");
        } else if (klen == 5 && memcmp(key, "shape", 5) == 0) {
            NPY_RETURN_IF(have_shape++, err, BAD_FILE, "%s: duplicate key 'shape' in the header",
                          name);
            st = parse_shape(&c, h);
        } else {
            st = mha__npy_fail(err, MHA_STATUS_BAD_FILE,
                               "%s: unknown key '%.*s' in the .npy header (expected 'descr', "
                               "'fortran_order', 'shape')",
                               name, klen > 32 ? 32 : (int)klen, key);
        }
        if (st != MHA_STATUS_OK)
            return st;
        skip_ws(&c);
        if (peek(&c) == ',') {
            c.pos++;
            continue;
        }
        if (peek(&c) != '}')
            return malformed(&c, "expected ',' or '}'");
        break;
    }
    c.pos++; /* the '}' */
    skip_ws(&c);
    if (!at_end(&c))
        return malformed(&c, "unexpected text after the dict");
    NPY_RETURN_IF(!have_descr, err, BAD_FILE, "%s: the .npy header has no 'descr'", name);
    NPY_RETURN_IF(!have_order, err, BAD_FILE, "%s: the .npy header has no 'fortran_order'", name);
    NPY_RETURN_IF(!have_shape, err, BAD_FILE, "%s: the .npy header has no 'shape'", name);

    char shape_text[256];
    format_shape(shape_text, sizeof shape_text, h->ndim, h->shape);
    NPY_RETURN_IF(!npy_prod(h->shape, h->ndim, &h->count) ||
                      !npy_bytes(h->count, mha_dtype_size(h->dtype), &h->data_bytes),
                  err, BAD_FILE, "%s: shape %s of %s is too large (its byte size overflows)", name,
                  shape_text, h->descr);
    return MHA_STATUS_OK;
}

static mha_status
check_data_length(const npy_header *h, uint64_t have, const char *name, mha_error *err) {
    if (have == (uint64_t)h->data_bytes)
        return MHA_STATUS_OK;
    char shape_text[256];
    format_shape(shape_text, sizeof shape_text, h->ndim, h->shape);
    return mha__npy_fail(err, MHA_STATUS_BAD_FILE,
                         "%s: data is %llu bytes, shape %s of %s needs %zu", name,
                         (unsigned long long)have, shape_text, h->descr, h->data_bytes);
}

static void fill_result(const npy_header *h, void *data, mha__npy *out) {
    out->dtype = h->dtype;
    out->ndim = h->ndim;
    for (int32_t i = 0; i < MHA_NPY_MAX_DIMS; i++)
        out->shape[i] = i < h->ndim ? h->shape[i] : 0;
    out->count = h->count;
    out->data = data;
    if (!host_is_little_endian())
        swap_elements(out->data, h->count, mha_dtype_size(h->dtype));
}

mha_status
mha__npy_parse(const void *buf, size_t len, const char *name, mha__npy *out, mha_error *err) {
    if (!name)
        name = "<memory>";
    NPY_RETURN_IF(!out, err, INVALID_ARG, "mha__npy_parse: out is NULL");
    memset(out, 0, sizeof *out);
    NPY_RETURN_IF(!buf && len > 0, err, INVALID_ARG, "mha__npy_parse: buf is NULL");
    const unsigned char *p = buf;
    size_t start, dlen;
    npy_header h;
    mha_status st = parse_preamble(p, len, len, name, &start, &dlen, err);
    if (st != MHA_STATUS_OK)
        return st;
    if ((st = parse_dict((const char *)p + start, dlen, name, &h, err)) != MHA_STATUS_OK)
        return st;
    if ((st = check_data_length(&h, len - start - dlen, name, err)) != MHA_STATUS_OK)
        return st;
    void *data = malloc(h.data_bytes ? h.data_bytes : 1);
    NPY_RETURN_IF(!data, err, NO_MEMORY, "%s: cannot allocate %zu bytes for the data", name,
                  h.data_bytes);
    if (h.data_bytes)
        memcpy(data, p + start + dlen, h.data_bytes);
    fill_result(&h, data, out);
    npy_ok(err);
    return MHA_STATUS_OK;
}

/* Reads exactly n bytes at `offset`; false on a short read. */
static int read_at(FILE *f, uint64_t offset, void *dst, size_t n) {
    if (offset > (uint64_t)INT64_MAX || fseeko(f, (off_t)offset, SEEK_SET) != 0)
        return 0;
    return fread(dst, 1, n, f) == n;
}

static mha_status
read_regular(FILE *f, uint64_t total, const char *path, mha__npy *out, mha_error *err) {
    unsigned char pre[12];
    const size_t avail = total < sizeof pre ? (size_t)total : sizeof pre;
    NPY_RETURN_IF(!read_at(f, 0, pre, avail), err, IO, "%s: read error: %s", path, strerror(errno));
    size_t start, dlen;
    mha_status st = parse_preamble(pre, avail, total, path, &start, &dlen, err);
    if (st != MHA_STATUS_OK)
        return st;
    char *dict = malloc(dlen ? dlen : 1);
    NPY_RETURN_IF(!dict, err, NO_MEMORY, "%s: out of memory", path);
    npy_header h;
    if (!read_at(f, start, dict, dlen))
        st = mha__npy_fail(err, MHA_STATUS_IO, "%s: read error in the header", path);
    else
        st = parse_dict(dict, dlen, path, &h, err);
    free(dict);
    if (st != MHA_STATUS_OK)
        return st;
    /* The size check comes before the allocation, so a header declaring a terabyte fails here. */
    if ((st = check_data_length(&h, total - start - dlen, path, err)) != MHA_STATUS_OK)
        return st;
    void *data = malloc(h.data_bytes ? h.data_bytes : 1);
    NPY_RETURN_IF(!data, err, NO_MEMORY, "%s: cannot allocate %zu bytes for the data", path,
                  h.data_bytes);
    if (h.data_bytes && !read_at(f, (uint64_t)start + dlen, data, h.data_bytes)) {
        free(data);
        return mha__npy_fail(err, MHA_STATUS_IO, "%s: read error in the data (file changed?)",
                             path);
    }
    fill_result(&h, data, out);
    return MHA_STATUS_OK;
}

mha_status mha__npy_open_input(const char *path, FILE **out, uint64_t *size, mha_error *err) {
    *out = NULL;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever. */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    NPY_RETURN_IF(fd < 0, err, IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    const char *bad = NULL;
    int e = 0;
    if (fstat(fd, &sb) != 0)
        e = errno, bad = "cannot stat";
    else if (S_ISDIR(sb.st_mode))
        bad = "is a directory";
    else if (!S_ISREG(sb.st_mode))
        bad = S_ISFIFO(sb.st_mode) ? "not a regular file (a FIFO): refused, inputs must be files"
                                   : "not a regular file (a device or socket): refused, inputs "
                                     "must be files";
    else if (sb.st_size < 0)
        bad = "negative size";
    if (!bad) {
        const int flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
            e = errno, bad = "cannot clear O_NONBLOCK";
    }
    FILE *f = NULL;
    if (!bad && !(f = fdopen(fd, "rb")))
        e = errno, bad = "cannot open";
    if (bad) {
        close(fd);
        return e ? mha__npy_fail(err, MHA_STATUS_IO, "%s: %s: %s", path, bad, strerror(e))
                 : mha__npy_fail(err, MHA_STATUS_IO, "%s: %s", path, bad);
    }
    *out = f;
    *size = (uint64_t)sb.st_size;
    return MHA_STATUS_OK;
}

mha_status mha__npy_read(const char *path, mha__npy *out, mha_error *err) {
    NPY_RETURN_IF(!out, err, INVALID_ARG, "mha__npy_read: out is NULL");
    memset(out, 0, sizeof *out);
    NPY_RETURN_IF(!path, err, INVALID_ARG, "mha__npy_read: path is NULL");
    FILE *f = NULL;
    uint64_t size = 0;
    mha_status st = mha__npy_open_input(path, &f, &size, err);
    if (st != MHA_STATUS_OK)
        return st;
    st = read_regular(f, size, path, out, err);
    fclose(f);
    if (st == MHA_STATUS_OK)
        npy_ok(err);
    return st;
}

void mha__npy_free(mha__npy *a) {
    if (!a)
        return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

/* Double to float, rounding to nearest even; magnitudes that round past FLT_MAX become Inf (the
 * explicit test keeps the conversion defined in ISO C). */
static float narrow_f64(double d) {
    if (d >= 0x1.ffffffp127)
        return INFINITY;
    if (d <= -0x1.ffffffp127)
        return -INFINITY;
    return (float)d;
}

/* Element i of a float array as a double (exact: every F32, F16 and BF16 value is a double). */
static double load_double(mha_dtype dt, const void *src, int64_t i) {
    if (dt == MHA_DTYPE_F64)
        return ((const double *)src)[i];
    if (dt == MHA_DTYPE_F32)
        return (double)((const float *)src)[i];
    const uint16_t h = ((const uint16_t *)src)[i];
    if (dt == MHA_DTYPE_BF16) { /* the top half of a float32 */
        const uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return (double)f;
    }
    const int e = (h >> 10) & 31, mant = h & 1023; /* float16: 1 + 5 + 10 bits, bias 15 */
    const double a = e == 31  ? (mant ? (double)NAN : (double)INFINITY)
                     : e == 0 ? ldexp(mant, -24)
                              : ldexp(mant + 1024, e - 25);
    return h & 0x8000 ? -a : a;
}

/* The bfloat16 (bf16 != 0: 8 significant bits, exponents -126..127) or float16 (11 bits,
 * -14..15) bits of d rounded once to nearest even; beyond the largest finite value +-inf, NaN a
 * quiet NaN. With e = max(floor(log2 |d|), emin), r = rint(|d| 2^(p-1-e)) counts quanta of
 * 2^(e-p+1) (rint: nearest even in the default rounding mode); the bits are then
 * (e - emin) << (p-1) plus r, a sum that carries a mantissa overflow into the exponent and needs
 * no special case for subnormals (e = emin, field 0). */
static uint16_t half_bits(double d, int bf16) {
    const int mbits = bf16 ? 7 : 10, emin = bf16 ? -126 : -14;
    const uint32_t inf = bf16 ? 0x7f80u : 0x7c00u, sign = signbit(d) ? 0x8000u : 0u;
    if (isnan(d))
        return (uint16_t)(sign | inf | (bf16 ? 0x40u : 0x200u));
    const double a = fabs(d);
    if (a == 0.0 || isinf(a))
        return (uint16_t)(sign | (a == 0.0 ? 0u : inf));
    int e;
    frexp(a, &e); /* a = f 2^e, f in [0.5, 1) */
    e = e - 1 < emin ? emin : e - 1;
    if (e > 1024) /* cannot happen for a finite double; keeps the shift below defined */
        return (uint16_t)(sign | inf);
    const double r = rint(ldexp(a, mbits - e));
    uint32_t bits = ((uint32_t)(e - emin) << mbits) + (uint32_t)r;
    if (bits >= inf)
        bits = inf;
    return (uint16_t)(sign | bits);
}

void mha__npy_convert(mha_dtype from, const void *src, mha_dtype to, void *dst, int64_t count) {
    if (from == to) {
        if (count > 0)
            memcpy(dst, src, (size_t)count * mha_dtype_size(to));
        return;
    }
    for (int64_t i = 0; i < count; i++) {
        const double d = load_double(from, src, i);
        if (to == MHA_DTYPE_F32)
            ((float *)dst)[i] = narrow_f64(d);
        else if (to == MHA_DTYPE_F64)
            ((double *)dst)[i] = d;
        else
            ((uint16_t *)dst)[i] = half_bits(d, to == MHA_DTYPE_BF16);
    }
}

static int npy_is_float(mha_dtype t) {
    return t == MHA_DTYPE_F32 || t == MHA_DTYPE_F64 || t == MHA_DTYPE_F16 || t == MHA_DTYPE_BF16;
}

mha_status mha__npy_to_dtype(
    const mha__npy *a, mha_dtype dtype, const char *name, void **out, mha_error *err) {
    NPY_RETURN_IF(!a || !out, err, INVALID_ARG, "mha__npy_to_dtype: NULL argument");
    *out = NULL;
    if (!name)
        name = "<array>";
    NPY_RETURN_IF(!npy_is_float(dtype), err, INVALID_ARG,
                  "mha__npy_to_dtype: target dtype %d is not a float type", (int)dtype);
    NPY_RETURN_IF(!npy_is_float(a->dtype), err, BAD_FILE,
                  "%s: dtype %s is not a float type (expected <f4, <f8, <f2 or <V2 (bfloat16))",
                  name, npy_descr_of(a->dtype));
    size_t bytes;
    NPY_RETURN_IF(a->count < 0 || !npy_bytes(a->count, mha_dtype_size(dtype), &bytes), err,
                  OVERFLOW, "%s: %lld elements do not fit in memory", name, (long long)a->count);
    NPY_RETURN_IF(a->count > 0 && !a->data, err, INVALID_ARG, "%s: array has no data", name);
    void *f = malloc(bytes ? bytes : 1);
    NPY_RETURN_IF(!f, err, NO_MEMORY, "%s: cannot allocate %zu bytes", name, bytes);
    mha__npy_convert(a->dtype, a->data, dtype, f, a->count);
    *out = f;
    npy_ok(err);
    return MHA_STATUS_OK;
}

mha_status mha__npy_to_f32(const mha__npy *a, const char *name, float **out, mha_error *err) {
    void *f = NULL;
    mha_status st = mha__npy_to_dtype(a, MHA_DTYPE_F32, name, &f, err);
    if (out)
        *out = f;
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Writing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* Version 1.0 header: magic, version, u16 length, dict padded with spaces and a final newline so
 * that the data start at a multiple of 64 bytes. Returns the total header size. */
static size_t
build_header(char *buf, size_t size, const char *descr, int32_t ndim, const int64_t *shape) {
    char shape_text[256];
    format_shape(shape_text, sizeof shape_text, ndim, shape);
    char dict[384];
    int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                     descr, shape_text);
    const size_t dict_len = (size_t)n;
    const size_t total = (10 + dict_len + 1 + 63) / 64 * 64;
    const size_t hlen = total - 10;
    assert(total <= size && hlen <= 0xffff);
    (void)size;
    memcpy(buf, NPY_MAGIC, 6);
    buf[6] = 1;
    buf[7] = 0;
    buf[8] = (char)(hlen & 0xff);
    buf[9] = (char)(hlen >> 8);
    memcpy(buf + 10, dict, dict_len);
    memset(buf + 10 + dict_len, ' ', hlen - dict_len - 1);
    buf[total - 1] = '\n';
    return total;
}

size_t mha__npy_header(mha_dtype dtype, int32_t ndim, const int64_t *shape, char *buf) {
    const char *descr = npy_descr_of(dtype);
    if (descr[0] == '?' || ndim < 0 || ndim > MHA_NPY_MAX_DIMS)
        return 0;
    return build_header(buf, MHA_NPY_HEADER_MAX, descr, ndim, shape);
}

/* count elements of `size` bytes, little-endian on disk (bytes reversed on a big-endian host). */
static int write_elems(FILE *f, const void *data, int64_t count, size_t size) {
    if (host_is_little_endian() || size < 2)
        return count == 0 || fwrite(data, size, (size_t)count, f) == (size_t)count;
    unsigned char chunk[4096];
    const unsigned char *p = data;
    for (int64_t i = 0; i < count;) {
        size_t n = 0;
        for (; n < sizeof chunk / size && i < count; n++, i++)
            for (size_t b = 0; b < size; b++)
                chunk[n * size + b] = p[(size_t)i * size + size - 1 - b];
        if (fwrite(chunk, size, n, f) != n)
            return 0;
    }
    return 1;
}

mha_status mha__npy_write(const char *path,
                          mha_dtype dtype,
                          const void *data,
                          int32_t ndim,
                          const int64_t *shape,
                          mha_error *err) {
    NPY_RETURN_IF(!path, err, INVALID_ARG, "mha__npy_write: path is NULL");
    const char *descr = npy_descr_of(dtype);
    NPY_RETURN_IF(descr[0] == '?', err, INVALID_ARG, "%s: dtype %d has no .npy name", path,
                  (int)dtype);
    NPY_RETURN_IF(ndim < 0 || ndim > MHA_NPY_MAX_DIMS, err, INVALID_ARG,
                  "%s: ndim=%d is outside [0, %d]", path, (int)ndim, MHA_NPY_MAX_DIMS);
    NPY_RETURN_IF(ndim > 0 && !shape, err, INVALID_ARG, "%s: shape is NULL", path);
    for (int32_t i = 0; i < ndim; i++)
        NPY_RETURN_IF(shape[i] < 0, err, INVALID_ARG, "%s: shape[%d]=%lld is negative", path,
                      (int)i, (long long)shape[i]);
    const size_t esize = mha_dtype_size(dtype);
    int64_t count;
    size_t bytes;
    NPY_RETURN_IF(!npy_prod(shape, ndim, &count) || !npy_bytes(count, esize, &bytes), err, OVERFLOW,
                  "%s: the shape's size overflows", path);
    NPY_RETURN_IF(count > 0 && !data, err, INVALID_ARG, "%s: data is NULL", path);

    char header[512];
    const size_t header_len = build_header(header, sizeof header, descr, ndim, shape);

    const size_t tmp_size = strlen(path) + 32;
    char *tmp = malloc(tmp_size);
    NPY_RETURN_IF(!tmp, err, NO_MEMORY, "%s: out of memory", path);
    snprintf(tmp, tmp_size, "%s.tmp.%ld", path, (long)getpid());

    FILE *f = mha__npy_create_tmp(tmp);
    if (!f) {
        int e = errno;
        mha_status st =
            mha__npy_fail(err, MHA_STATUS_IO, "%s: cannot create '%s': %s", path, tmp, strerror(e));
        free(tmp);
        return st;
    }
    errno = 0;
    const int ok = fwrite(header, 1, header_len, f) == header_len &&
                   write_elems(f, data, count, esize) && fflush(f) == 0;
    const mha_status st = mha__npy_commit(f, ok, tmp, path, err);
    free(tmp);
    if (st == MHA_STATUS_OK)
        npy_ok(err);
    return st;
}

mha_status mha__npy_write_f32(
    const char *path, const float *data, int32_t ndim, const int64_t *shape, mha_error *err) {
    return mha__npy_write(path, MHA_DTYPE_F32, data, ndim, shape, err);
}

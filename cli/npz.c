/* SPDX-License-Identifier: MIT */
/* npz.c: the .npz writer (npz.h). An .npz is a zip archive whose members are .npy files; this
 * writes them "stored" (method 0, no compression: the project links no zlib), which numpy.load
 * and every zip reader accept. Layout (PKWARE APPNOTE 4.3.7, 4.3.12, 4.3.16; all fields
 * little-endian):
 *   per member: local header (30 bytes + name), the .npy bytes
 *   per member: central directory header (46 bytes + name)
 *   end of central directory record (22 bytes)
 * Each member's CRC-32 is computed in a first pass over its bytes, so that the local header can
 * be written before the data without a data descriptor. */
#include "npz.h"

#include "npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), the zip checksum. */
typedef struct crc32_state {
    uint32_t table[256];
    uint32_t crc; /* running value, pre- and post-inverted as zip wants */
} crc32_state;

static void crc32_init(crc32_state *c) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t r = i;
        for (int k = 0; k < 8; k++)
            r = (r & 1u) ? (r >> 1) ^ 0xEDB88320u : r >> 1;
        c->table[i] = r;
    }
    c->crc = 0xFFFFFFFFu;
}

static void crc32_add(crc32_state *c, const unsigned char *p, size_t n) {
    uint32_t r = c->crc;
    for (size_t i = 0; i < n; i++)
        r = c->table[(r ^ p[i]) & 0xFFu] ^ (r >> 8);
    c->crc = r;
}

/* A sink for member bytes: the CRC pass (f == NULL) or the write pass. */
typedef struct sink {
    FILE *f;
    crc32_state *crc;
    int ok;
} sink;

static void put(sink *s, const void *p, size_t n) {
    if (s->crc)
        crc32_add(s->crc, p, n);
    if (s->f && s->ok && n && fwrite(p, 1, n, s->f) != n)
        s->ok = 0;
}

/* The element bytes of a member in little-endian order (copied in chunks on any host). */
static void put_elements(sink *s, const void *data, int64_t count, size_t size) {
    unsigned char chunk[4096];
    const unsigned char *src = data;
    const size_t per = sizeof chunk / size;
    for (int64_t i = 0; i < count;) {
        const size_t n = (size_t)(count - i) < per ? (size_t)(count - i) : per;
        for (size_t e = 0; e < n; e++) {
            uint64_t u = 0;
            if (size == 4) {
                uint32_t w;
                memcpy(&w, src + (size_t)(i + (int64_t)e) * 4, 4);
                u = w;
            } else {
                memcpy(&u, src + (size_t)(i + (int64_t)e) * 8, 8);
            }
            for (size_t b = 0; b < size; b++)
                chunk[e * size + b] = (unsigned char)(u >> (8 * b));
        }
        put(s, chunk, n * size);
        i += (int64_t)n;
    }
}

/* Little-endian field writers into a header buffer. */
static unsigned char *le16(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    return p + 2;
}
static unsigned char *le32(unsigned char *p, uint32_t v) {
    return le16(le16(p, v & 0xFFFFu), v >> 16);
}

/* What the headers of one member need. */
typedef struct entry {
    char name[96];
    char npy[MHA_NPY_HEADER_MAX];
    size_t npy_len, name_len;
    uint64_t size; /* .npy bytes */
    int64_t count;
    size_t elem;
    uint32_t crc, offset;
} entry;

/* Local (local != 0) or central directory header of member e. */
static size_t zip_header(unsigned char *h, const entry *e, int local) {
    unsigned char *p = le32(h, local ? 0x04034b50u : 0x02014b50u);
    if (!local)
        p = le16(p, 20); /* version made by: 2.0, MS-DOS attribute compatibility */
    p = le16(p, 20);     /* version needed to extract: 2.0 */
    p = le16(p, 0);      /* flags */
    p = le16(p, 0);      /* method: stored */
    p = le16(p, 0);      /* time 00:00:00 */
    p = le16(p, 33);     /* date 1980-01-01 (reproducible archives) */
    p = le32(p, e->crc);
    p = le32(p, (uint32_t)e->size); /* compressed size = size */
    p = le32(p, (uint32_t)e->size);
    p = le16(p, (uint32_t)e->name_len);
    p = le16(p, 0); /* extra field length */
    if (!local) {
        p = le16(p, 0); /* comment length */
        p = le16(p, 0); /* disk number */
        p = le16(p, 0); /* internal attributes */
        p = le32(p, 0); /* external attributes */
        p = le32(p, e->offset);
    }
    memcpy(p, e->name, e->name_len);
    return (size_t)(p - h) + e->name_len;
}

/* Member m described in e: its .npy header, sizes, CRC; false when it cannot be stored. */
static mha_status
describe(const mha__npz_member *m, const char *path, entry *e, crc32_state *crc, mha_error *err) {
    e->elem = m->dtype == MHA_DTYPE_F32 ? 4 : m->dtype == MHA_DTYPE_I64 ? 8 : 0;
    const int n = snprintf(e->name, sizeof e->name, "%s.npy", m->name ? m->name : "");
    if (!e->elem || !m->name || n <= 4 || (size_t)n >= sizeof e->name || m->ndim < 0 ||
        m->ndim > MHA_NPY_MAX_DIMS)
        return mha__npy_fail(err, MHA_STATUS_INVALID_ARG, "%s: member '%s' cannot be written", path,
                             m->name ? m->name : "(null)");
    e->name_len = (size_t)n;
    e->npy_len = mha__npy_header(m->dtype, m->ndim, m->shape, e->npy);
    uint64_t count = 1;
    for (int32_t d = 0; d < m->ndim; d++) {
        if (m->shape[d] < 0 || (m->shape[d] && count > UINT64_MAX / 16 / (uint64_t)m->shape[d]))
            return mha__npy_fail(err, MHA_STATUS_OVERFLOW, "%s: member '%s' is too large", path,
                                 m->name);
        count *= (uint64_t)m->shape[d];
    }
    /* Checked on the element count, so a 0-d member (one element) without data is refused too. */
    if (count > 0 && !m->data)
        return mha__npy_fail(err, MHA_STATUS_INVALID_ARG, "%s: member '%s' has no data", path,
                             m->name);
    e->count = (int64_t)count;
    e->size = e->npy_len + count * e->elem;
    if (e->size > 0xFFFFFFFFu)
        return mha__npy_fail(err, MHA_STATUS_OVERFLOW,
                             "%s: member '%s' has %llu bytes, more than a zip without ZIP64 holds "
                             "(4 GiB)",
                             path, m->name, (unsigned long long)e->size);
    crc32_init(crc);
    sink s = {NULL, crc, 1};
    put(&s, e->npy, e->npy_len);
    put_elements(&s, m->data, e->count, e->elem);
    e->crc = crc->crc ^ 0xFFFFFFFFu;
    return MHA_STATUS_OK;
}

/* The whole archive into f. */
static int write_archive(FILE *f, const mha__npz_member *members, entry *es, int count) {
    sink s = {f, NULL, 1};
    unsigned char h[64 + sizeof es->name];
    uint64_t at = 0;
    for (int i = 0; i < count; i++) {
        es[i].offset = (uint32_t)at;
        const size_t hl = zip_header(h, &es[i], 1);
        put(&s, h, hl);
        put(&s, es[i].npy, es[i].npy_len);
        put_elements(&s, members[i].data, es[i].count, es[i].elem);
        at += hl + es[i].size;
    }
    const uint64_t cd_start = at;
    for (int i = 0; i < count; i++) {
        const size_t hl = zip_header(h, &es[i], 0);
        put(&s, h, hl);
        at += hl;
    }
    unsigned char *p = le32(h, 0x06054b50u);
    p = le16(p, 0); /* this disk */
    p = le16(p, 0); /* disk of the central directory */
    p = le16(p, (uint32_t)count);
    p = le16(p, (uint32_t)count);
    p = le32(p, (uint32_t)(at - cd_start));
    p = le32(p, (uint32_t)cd_start);
    p = le16(p, 0); /* comment length */
    put(&s, h, (size_t)(p - h));
    return s.ok;
}

mha_status
mha__npz_write(const char *path, const mha__npz_member *members, int count, mha_error *err) {
    if (!path || !members || count < 1 || count > 1000)
        return mha__npy_fail(err, MHA_STATUS_INVALID_ARG, "mha__npz_write: bad arguments");
    entry *es = calloc((size_t)count, sizeof *es);
    crc32_state *crc = malloc(sizeof *crc);
    char *tmp = malloc(strlen(path) + 32);
    mha_status st = MHA_STATUS_OK;
    if (!es || !crc || !tmp)
        st = mha__npy_fail(err, MHA_STATUS_NO_MEMORY, "%s: out of memory", path);
    /* Offsets are 32-bit: the archive must stay below 4 GiB as a whole. */
    uint64_t total = 22;
    for (int i = 0; st == MHA_STATUS_OK && i < count; i++) {
        st = describe(&members[i], path, &es[i], crc, err);
        total += st ? 0 : 76 + 2 * es[i].name_len + es[i].size;
    }
    if (st == MHA_STATUS_OK && total > 0xFFFFFFFFu)
        st = mha__npy_fail(err, MHA_STATUS_OVERFLOW,
                           "%s: %llu bytes, more than a zip without ZIP64 "
                           "holds (4 GiB)",
                           path, (unsigned long long)total);
    if (st == MHA_STATUS_OK) {
        snprintf(tmp, strlen(path) + 32, "%s.tmp.%ld", path, (long)getpid());
        FILE *f = mha__npy_create_tmp(tmp);
        if (!f) {
            st = mha__npy_fail(err, MHA_STATUS_IO, "%s: cannot create '%s': %s", path, tmp,
                               strerror(errno));
        } else {
            errno = 0;
            const int ok = write_archive(f, members, es, count) && fflush(f) == 0;
            st = mha__npy_commit(f, ok, tmp, path, err);
        }
    }
    free(es);
    free(crc);
    free(tmp);
    if (st == MHA_STATUS_OK && err) {
        err->status = MHA_STATUS_OK;
        err->message[0] = '\0';
    }
    return st;
}

/* SPDX-License-Identifier: MIT */
/* fuzz_npz.c: libFuzzer harness for the CLI's .npz writer (cli/npz.c, mha__npz_write), as a
 * round trip. The input (fuzz_reader) decides the members: count, names (any non-NUL bytes, long
 * or empty or NULL), dtypes (F32, I64 and ones the writer cannot store), ndim (0-d, up to 8 and
 * beyond), shapes (zero-size, huge, negative) and data (from the input, or NULL). The archive is
 * written into a private directory (mkdtemp, removed each run) and parsed back strictly as a
 * stored zip (local headers, CRC-32, central directory, end record, nothing after it); each member
 * goes through the project's .npy reader (mha__npy_parse).
 * Invariants: no crash, leak or out-of-bounds access; the writer succeeds exactly when every member
 * is storable (the harness's own rule, from npz.h), and then every member reads back with the same
 * name, dtype, shape and bytes; on error it fills mha_error consistently and leaves no file (no
 * archive, no temporary) behind.
 */
#define _POSIX_C_SOURCE 200809L

#include "fuzz_common.h"
#include "npz.h"

#include <dirent.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_MEMBERS 8
#define MAX_BYTES   (1 << 16) /* per member: the data the harness builds */

static uint32_t rd16(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
}
static uint32_t rd32(const unsigned char *p) {
    return rd16(p) | rd16(p + 2) << 16;
}

static uint32_t crc32(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    }
    return c ^ 0xFFFFFFFFu;
}

/* Files left in dir (the archive and any temporary). */
static int files_in(const char *dir) {
    DIR *d = opendir(dir);
    FUZZ_REQUIRE(d != NULL, "opendir %s", dir);
    int n = 0;
    const struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

static unsigned char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    FUZZ_REQUIRE(f != NULL, "the archive %s is missing after OK", path);
    FUZZ_REQUIRE(fseek(f, 0, SEEK_END) == 0, "seek");
    const long n = ftell(f);
    FUZZ_REQUIRE(n >= 0 && fseek(f, 0, SEEK_SET) == 0, "tell");
    unsigned char *b = malloc((size_t)n + 1);
    FUZZ_REQUIRE(b != NULL, "malloc");
    FUZZ_REQUIRE(fread(b, 1, (size_t)n, f) == (size_t)n, "read");
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* The archive's member i holds exactly m (a member the writer had to accept). */
static void check_member(const unsigned char *npy, size_t len, const mha__npz_member *m) {
    mha__npy a;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = mha__npy_parse(npy, len, "member", &a, &err);
    FUZZ_REQUIRE(st == MHA_STATUS_OK, "member '%s' written but not readable: %s", m->name,
                 err.message);
    FUZZ_REQUIRE(a.dtype == m->dtype, "member '%s': dtype %d read back as %d", m->name,
                 (int)m->dtype, (int)a.dtype);
    FUZZ_REQUIRE(a.ndim == m->ndim, "member '%s': ndim %d read back as %d", m->name, (int)m->ndim,
                 (int)a.ndim);
    int64_t count = 1;
    for (int32_t d = 0; d < m->ndim; d++) {
        FUZZ_REQUIRE(a.shape[d] == m->shape[d], "member '%s': dim %d %lld read back as %lld",
                     m->name, (int)d, (long long)m->shape[d], (long long)a.shape[d]);
        count *= m->shape[d] ? 1 : 0;
    }
    if (count)
        for (int32_t d = 0; d < m->ndim; d++)
            count *= m->shape[d];
    FUZZ_REQUIRE(a.count == count, "member '%s': count %lld, expected %lld", m->name,
                 (long long)a.count, (long long)count);
    const size_t bytes = (size_t)count * mha_dtype_size(m->dtype);
    FUZZ_REQUIRE(bytes == 0 || memcmp(a.data, m->data, bytes) == 0, "member '%s': data differ",
                 m->name);
    mha__npy_free(&a);
}

/* Parses the whole archive: one stored entry per member, in order, then the directory. */
static void check_archive(const unsigned char *z, size_t len, const mha__npz_member *ms, int n) {
    size_t at = 0;
    uint32_t offsets[MAX_MEMBERS], crcs[MAX_MEMBERS], sizes[MAX_MEMBERS];
    for (int i = 0; i < n; i++) {
        const size_t name_len = strlen(ms[i].name) + 4;
        FUZZ_REQUIRE(at + 30 + name_len <= len, "archive cut in local header %d", i);
        const unsigned char *h = z + at;
        FUZZ_REQUIRE(rd32(h) == 0x04034b50u && rd16(h + 8) == 0 && rd16(h + 6) == 0,
                     "local header %d: signature/method/flags", i);
        FUZZ_REQUIRE(rd32(h + 18) == rd32(h + 22), "local header %d: sizes", i);
        FUZZ_REQUIRE(rd16(h + 26) == name_len && rd16(h + 28) == 0, "local header %d: name", i);
        FUZZ_REQUIRE(memcmp(h + 30, ms[i].name, name_len - 4) == 0 &&
                         memcmp(h + 30 + name_len - 4, ".npy", 4) == 0,
                     "member %d is not named '%s.npy'", i, ms[i].name);
        offsets[i] = (uint32_t)at;
        sizes[i] = rd32(h + 22);
        crcs[i] = rd32(h + 14);
        at += 30 + name_len;
        FUZZ_REQUIRE(sizes[i] <= len - at, "member %d: %u bytes past the end", i,
                     (unsigned)sizes[i]);
        FUZZ_REQUIRE(crc32(z + at, sizes[i]) == crcs[i], "member %d: CRC-32", i);
        check_member(z + at, sizes[i], &ms[i]);
        at += sizes[i];
    }
    const size_t cd = at;
    for (int i = 0; i < n; i++) {
        const size_t name_len = strlen(ms[i].name) + 4;
        FUZZ_REQUIRE(at + 46 + name_len <= len, "archive cut in directory entry %d", i);
        const unsigned char *h = z + at;
        FUZZ_REQUIRE(rd32(h) == 0x02014b50u && rd16(h + 10) == 0 && rd32(h + 16) == crcs[i] &&
                         rd32(h + 20) == sizes[i] && rd32(h + 24) == sizes[i] &&
                         rd16(h + 28) == name_len && rd16(h + 30) == 0 && rd16(h + 32) == 0 &&
                         rd32(h + 42) == offsets[i] &&
                         memcmp(h + 46, z + offsets[i] + 30, name_len) == 0,
                     "directory entry %d does not match its local header", i);
        at += 46 + name_len;
    }
    FUZZ_REQUIRE(at + 22 == len, "end record: %zu bytes left, expected 22", len - at);
    const unsigned char *e = z + at;
    FUZZ_REQUIRE(rd32(e) == 0x06054b50u && rd16(e + 4) == 0 && rd16(e + 6) == 0 &&
                     rd16(e + 8) == (uint32_t)n && rd16(e + 10) == (uint32_t)n &&
                     rd32(e + 12) == at - cd && rd32(e + 16) == cd && rd16(e + 20) == 0,
                 "end of central directory record");
}

/* The member the input describes; *ok: whether npz.h says it can be stored. */
static void make_member(fuzz_reader *r, mha__npz_member *m, char *name, void **buf, int *ok) {
    const uint8_t f = fuzz_u8(r);
    memset(m, 0, sizeof *m);
    *ok = 1;
    /* name: NULL, or 0 .. 120 bytes (none NUL) */
    const uint8_t nl = fuzz_u8(r);
    if (nl == 255) {
        m->name = NULL;
        *ok = 0;
    } else {
        const size_t len = nl % 121;
        for (size_t i = 0; i < len; i++) {
            const uint8_t c = fuzz_u8(r);
            name[i] = (char)(c ? c : 'a' + (char)(i % 26));
        }
        name[len] = '\0';
        m->name = name;
        *ok &= len >= 1 && len + 4 < 96; /* "<name>.npy" in 96 bytes with its NUL */
    }
    /* dtype: F32 / I64 mostly; any other value the writer must refuse */
    const uint8_t dt = f & 7;
    m->dtype = dt < 3 ? MHA_DTYPE_F32 : dt < 6 ? MHA_DTYPE_I64 : (mha_dtype)fuzz_u8(r);
    *ok &= m->dtype == MHA_DTYPE_F32 || m->dtype == MHA_DTYPE_I64;
    /* ndim: 0 .. 8, or a bad one */
    const uint8_t nd = fuzz_u8(r);
    m->ndim = nd < 250 ? nd % 9 : nd == 250 ? -1 : nd == 251 ? INT32_MIN : 9 + (nd - 252);
    *ok &= m->ndim >= 0 && m->ndim <= MHA_NPY_MAX_DIMS;
    const int32_t dims = m->ndim < 0 ? 0 : m->ndim > 8 ? 8 : m->ndim;
    /* dims: small, or (flag) huge / negative */
    int neg = 0;
    for (int32_t d = 0; d < dims; d++) {
        const uint8_t b = fuzz_u8(r);
        if (b < 240)
            m->shape[d] = b % 5;
        else if (b < 250)
            m->shape[d] = (int64_t)(fuzz_u64(r) >> (b - 240)); /* huge */
        else if (b < 253)
            m->shape[d] = -(int64_t)(b - 249);
        else
            m->shape[d] = b == 253 ? INT64_MAX : INT64_MIN;
        neg |= m->shape[d] < 0;
    }
    *ok &= !neg;
    /* The element count and bytes (saturated at 2^64), when the shape is valid. */
    const size_t es = m->dtype == MHA_DTYPE_I64 ? 8 : 4;
    unsigned __int128 count = 1;
    for (int32_t d = 0; d < dims && !neg; d++) {
        count *= (unsigned __int128)m->shape[d];
        if (count > ((unsigned __int128)1 << 64))
            count = ((unsigned __int128)1 << 64);
    }
    unsigned __int128 bytes = count * es;
    /* A storable member too large for the harness to back with data: made small. */
    if (!neg && bytes > MAX_BYTES && bytes + MHA_NPY_HEADER_MAX <= 0xFFFFFFFFu) {
        count = 1;
        for (int32_t d = 0; d < dims; d++)
            count *= (unsigned __int128)(m->shape[d] %= 5);
        bytes = count * es;
    }
    /* npz.h: a member beyond 4 GiB (header included) is refused; the header is under 512 bytes. */
    const int huge = !neg && bytes > MAX_BYTES;
    if (huge)
        *ok = bytes + 128 > 0xFFFFFFFFu ? 0 : -1; /* -1: at the limit, either answer */
    /* Zero-size with other dims whose product overflows (numpy refuses such a shape, "array is
     * too big"): either answer; if written, it must still read back. */
    unsigned __int128 nonzero = 1;
    for (int32_t d = 0; d < dims && !neg && count == 0; d++)
        if (m->shape[d] &&
            (nonzero *= (unsigned __int128)m->shape[d]) > ((unsigned __int128)1 << 64))
            nonzero = (unsigned __int128)1 << 64;
    if (*ok == 1 && count == 0 && nonzero * es >= ((unsigned __int128)1 << 59))
        *ok = -1;
    /* data: NULL (flag), or the input's bytes; a member beyond 4 GiB gets a 1-byte buffer: the
     * writer must refuse it from its size, before reading a byte (so must it with a negative dim).
     */
    const int null_data = (f & 0x18) == 0x18;
    *buf = NULL;
    if (!null_data && !(huge && *ok == -1)) {
        const size_t nb = huge || neg ? 1 : (size_t)bytes;
        *buf = malloc(nb + 1);
        FUZZ_REQUIRE(*buf != NULL, "malloc");
        for (size_t i = 0; i < nb; i++)
            ((unsigned char *)*buf)[i] = fuzz_u8(r);
        m->data = *buf;
    } else if (null_data && !neg && count > 0) {
        *ok = 0; /* no data for a member that has elements (0-d included): must be refused */
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_reader r = {data, size, 0};
    const uint8_t c = fuzz_u8(&r);
    const int count = c < 250 ? 1 + c % MAX_MEMBERS : c == 250 ? 0 : c == 251 ? -1 : 1001;
    const int n = count < 1 ? 0 : count > MAX_MEMBERS ? MAX_MEMBERS : count;
    mha__npz_member ms[MAX_MEMBERS];
    char names[MAX_MEMBERS][128];
    void *bufs[MAX_MEMBERS];
    int all_ok = count >= 1 && count <= 1000, maybe = 0;
    for (int i = 0; i < n; i++) {
        int ok;
        make_member(&r, &ms[i], names[i], &bufs[i], &ok);
        if (ok == -1)
            maybe = 1;
        else
            all_ok &= ok;
    }
    if (getenv("MHA_FUZZ_VERBOSE")) /* what the input decodes to */
        for (int i = 0; i < n; i++)
            fprintf(stderr,
                    "  member %d: name %s, dtype %d, ndim %d, shape %lld %lld %lld, data %s\n", i,
                    ms[i].name ? ms[i].name : "(NULL)", (int)ms[i].dtype, (int)ms[i].ndim,
                    (long long)ms[i].shape[0], (long long)ms[i].shape[1], (long long)ms[i].shape[2],
                    ms[i].data ? "yes" : "NULL");
    char dir[512], path[600];
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/mha-fuzz-npz-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    FUZZ_REQUIRE(mkdtemp(dir) != NULL, "mkdtemp %s", dir);
    snprintf(path, sizeof path, "%s/out.npz", dir);
    mha_error err;
    memset(&err, 0, sizeof err);
    /* count 1001 with 8 members described: the writer must refuse it before reading members[8]. */
    const mha_status st = mha__npz_write(path, ms, count, &err);
    if (st == MHA_STATUS_OK) {
        FUZZ_REQUIRE(all_ok, "OK for a member npz.h says cannot be stored");
        FUZZ_REQUIRE(err.status == MHA_STATUS_OK && err.message[0] == '\0', "err not reset");
        FUZZ_REQUIRE(files_in(dir) == 1, "temporary file left beside the archive");
        size_t len;
        unsigned char *z = read_all(path, &len);
        check_archive(z, len, ms, n);
        free(z);
        FUZZ_REQUIRE(unlink(path) == 0, "unlink");
    } else {
        fuzz_check_error(st, &err);
        FUZZ_REQUIRE(!all_ok || maybe, "error for storable members: %s", err.message);
        FUZZ_REQUIRE(files_in(dir) == 0, "a file left behind after an error");
    }
    FUZZ_REQUIRE(rmdir(dir) == 0, "rmdir %s", dir);
    for (int i = 0; i < n; i++)
        free(bufs[i]);
    return 0;
}

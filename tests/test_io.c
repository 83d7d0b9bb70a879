/* SPDX-License-Identifier: MIT */
/* test_io.c: the file formats and the dtype conversions.
 *
 * .npy: the float32 writer round trip, every accepted dtype and version read from bytes written
 * here by hand, and every error path (status and message). safetensors: layers under each naming
 * scheme (Hugging Face, nn.MultiheadAttention packed and separate, CS336, a name map, a prefix),
 * F16/BF16/F64 tensors, sinks, and every error path. Conversions: f16/bf16 -> f32 -> f16/bf16 over
 * all 65536 patterns, f32 -> f16/bf16 against an independent rint()-based oracle (a strided sweep
 * of all floats; every float with MHA_TEST_FULL=1) and hand-picked rounding cases.
 * All files live in a mkdtemp() directory under /tmp that is removed at the end.
 */
#define _POSIX_C_SOURCE 200809L

#include "base/internal.h"
#include "harness.h"
#include "npy.h"
#include "npz.h"

#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------- */
/* Helpers                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static char g_dir[64];

/* Full path of `name` inside the temporary directory (a ring of buffers, valid for a while). */
static const char *tpath(const char *name) {
    static char ring[8][512];
    static int next;
    char *p = ring[next++ % 8];
    snprintf(p, sizeof ring[0], "%s/%s", g_dir, name);
    return p;
}

static void write_bytes(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "cannot create %s: %s", path, strerror(errno));
    if (!f)
        return;
    CHECK(n == 0 || fwrite(bytes, 1, n, f) == n, "short write to %s", path);
    fclose(f);
}

static void remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
            remove_tree(p);
        else
            remove(p);
    }
    closedir(d);
    rmdir(dir);
}

/* Number of entries of the temporary directory whose name contains ".tmp.". */
static int count_temp_files(void) {
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp."))
            n++;
    if (d)
        closedir(d);
    return n;
}

/* Checks a failing call: its status, err.status and a substring of the message. */
#define CHECK_FAIL(call, errp, want, substr)                                                       \
    do {                                                                                           \
        mha_status st_ = (call);                                                                   \
        CHECK(st_ == (want) && (errp)->status == (want) &&                                         \
                  strstr((errp)->message, (substr)) != NULL,                                       \
              "%s -> %s \"%s\"; want %s containing \"%s\"", #call, mha_status_string(st_),         \
              (errp)->message, mha_status_string(want), (substr));                                 \
    } while (0)

static void put_u32le(unsigned char *p, uint32_t u) {
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(u >> (8 * i));
}

static void put_u64le(unsigned char *p, uint64_t u) {
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(u >> (8 * i));
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---------------------------------------------------------------------------------------------- */
/* .npy                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

/* A .npy image: magic, version major.minor, header length (2 bytes for 1.x, 4 otherwise), the
 * dict padded like numpy (spaces, final newline, 64-byte aligned) unless raw, then the data. */
static unsigned char *npy_image(int major,
                                int minor,
                                const char *dict,
                                int raw,
                                const void *data,
                                size_t data_len,
                                size_t *out_len) {
    const size_t pre = major == 1 ? 10 : 12;
    size_t dlen = strlen(dict);
    size_t hlen = raw ? dlen : (pre + dlen + 1 + 63) / 64 * 64 - pre;
    unsigned char *b = malloc(pre + hlen + data_len + 1);
    memcpy(b, "\x93NUMPY", 6);
    b[6] = (unsigned char)major;
    b[7] = (unsigned char)minor;
    if (major == 1) {
        b[8] = (unsigned char)(hlen & 0xff);
        b[9] = (unsigned char)(hlen >> 8);
    } else {
        put_u32le(b + 8, (uint32_t)hlen);
    }
    memcpy(b + pre, dict, dlen);
    if (!raw) {
        memset(b + pre + dlen, ' ', hlen - dlen);
        b[pre + hlen - 1] = '\n';
    }
    if (data_len)
        memcpy(b + pre + hlen, data, data_len);
    *out_len = pre + hlen + data_len;
    return b;
}

static const char *
write_npy(const char *name, int major, const char *dict, const void *data, size_t data_len) {
    size_t n;
    unsigned char *b = npy_image(major, 0, dict, 0, data, data_len, &n);
    const char *p = tpath(name);
    write_bytes(p, b, n);
    free(b);
    return p;
}

static void test_npy_write_roundtrip(void) {
    mha_error err;
    const int64_t shapes[][3] = {{2, 3, 0}, {5, 0, 0}, {0, 0, 0}, {0, 4, 0}, {2, 3, 4}};
    const int32_t ndims[] = {2, 1, 0, 2, 3};
    const char *texts[] = {"(2, 3)", "(5,)", "()", "(0, 4)", "(2, 3, 4)"};
    for (int c = 0; c < 5; c++) {
        float data[24];
        for (int i = 0; i < 24; i++)
            data[i] = (float)i * 0.37f - 3.0f;
        data[1] = -0.0f;
        data[2] = INFINITY;
        data[3] = NAN;
        const char *p = tpath("round.npy");
        CHECK_OK(mha__npy_write_f32(p, data, ndims[c], shapes[c], &err), &err);
        mha__npy a;
        CHECK_OK(mha__npy_read(p, &a, &err), &err);
        int64_t count = 1;
        for (int i = 0; i < ndims[c]; i++)
            count *= shapes[c][i];
        CHECK(a.dtype == MHA_DTYPE_F32 && a.ndim == ndims[c] && a.count == count,
              "round trip %s: dtype %d ndim %d count %lld", texts[c], (int)a.dtype, (int)a.ndim,
              (long long)a.count);
        for (int i = 0; i < ndims[c] && i < a.ndim; i++)
            CHECK(a.shape[i] == shapes[c][i], "round trip %s: shape[%d]", texts[c], i);
        CHECK(count == 0 || (a.data && memcmp(a.data, data, (size_t)count * 4) == 0),
              "round trip %s: data differ", texts[c]);
        mha__npy_free(&a);
        CHECK(a.data == NULL, "npy_free clears the struct");

        /* The header is version 1.0, 64-byte aligned, and spells the shape like numpy. */
        FILE *f = fopen(p, "rb");
        unsigned char head[256];
        size_t got = f ? fread(head, 1, sizeof head, f) : 0;
        if (f)
            fclose(f);
        size_t hlen = got >= 10 ? (size_t)head[8] | (size_t)head[9] << 8 : 0;
        CHECK(got >= 10 && head[6] == 1 && head[7] == 0 && (10 + hlen) % 64 == 0 &&
                  head[10 + hlen - 1] == '\n',
              "header of %s: version %d.%d, length %zu", texts[c], head[6], head[7], hlen);
        char want[96];
        snprintf(want, sizeof want, "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }",
                 texts[c]);
        CHECK(got >= 10 + strlen(want) && memcmp(head + 10, want, strlen(want)) == 0,
              "header text of %s", texts[c]);
    }
    CHECK(count_temp_files() == 0, "no temporary file left after writes");

    /* Overwriting an existing file replaces it. */
    const float one = 1.5f, two[2] = {2.5f, 3.5f};
    const int64_t s1[1] = {1}, s2[1] = {2};
    const char *p = tpath("over.npy");
    CHECK_OK(mha__npy_write_f32(p, &one, 1, s1, &err), &err);
    CHECK_OK(mha__npy_write_f32(p, two, 1, s2, &err), &err);
    mha__npy a;
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.count == 2 && ((float *)a.data)[1] == 3.5f, "overwrite keeps the new contents");
    mha__npy_free(&a);

    /* Bad writer arguments. */
    const int64_t neg[2] = {2, -1}, big[2] = {INT64_MAX / 2, 4};
    CHECK_FAIL(mha__npy_write_f32(p, two, 2, neg, &err), &err, MHA_STATUS_INVALID_ARG, "negative");
    CHECK_FAIL(mha__npy_write_f32(p, two, 9, neg, &err), &err, MHA_STATUS_INVALID_ARG, "ndim=9");
    CHECK_FAIL(mha__npy_write_f32(p, two, 2, big, &err), &err, MHA_STATUS_OVERFLOW, "overflows");
    CHECK_FAIL(mha__npy_write_f32(p, NULL, 1, s2, &err), &err, MHA_STATUS_INVALID_ARG,
               "data is NULL");

    /* Failures leave no file: into a missing directory, and onto a directory (the temporary
     * file is created, then the rename fails and it must be removed). */
    CHECK_FAIL(mha__npy_write_f32(tpath("nodir/out.npy"), two, 1, s2, &err), &err, MHA_STATUS_IO,
               "nodir/out.npy: cannot create");
    const char *dir = tpath("adir");
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    CHECK_FAIL(mha__npy_write_f32(dir, two, 1, s2, &err), &err, MHA_STATUS_IO, "adir: ");
    CHECK(count_temp_files() == 0, "no temporary file left after failed writes");
    struct stat sb;
    CHECK(stat(tpath("nodir"), &sb) != 0, "nothing created for the missing directory");
}

static void test_npy_dtypes(void) {
    mha_error err;
    mha__npy a;
    float *f = NULL;

    /* <f8, v1.0 */
    const double d[3] = {0.1, -2.5, 1e300};
    unsigned char db[24];
    for (int i = 0; i < 3; i++) {
        uint64_t u;
        memcpy(&u, &d[i], 8);
        put_u64le(db + 8 * i, u);
    }
    const char *p = write_npy(
        "f8.npy", 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", db, sizeof db);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_F64 && a.ndim == 1 && a.shape[0] == 3 &&
              memcmp(a.data, d, sizeof d) == 0,
          "<f8 read");
    CHECK_OK(mha__npy_to_f32(&a, p, &f, &err), &err);
    CHECK(f && f[0] == (float)0.1 && f[1] == -2.5f && isinf(f[2]) && f[2] > 0.0f,
          "<f8 -> f32 (1e300 becomes +inf)");
    free(f);
    mha__npy_free(&a);

    /* <f2, v2.0, 2-d */
    const uint16_t h[4] = {0x3c00, 0xc000, 0x0001, 0x7bff}; /* 1, -2, 2^-24, 65504 */
    unsigned char hb[8];
    for (int i = 0; i < 4; i++) {
        hb[2 * i] = (unsigned char)(h[i] & 0xff);
        hb[2 * i + 1] = (unsigned char)(h[i] >> 8);
    }
    p = write_npy("f2.npy", 2, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 2), }", hb,
                  sizeof hb);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_F16 && a.ndim == 2 && a.count == 4, "<f2 read (v2.0)");
    CHECK_OK(mha__npy_to_f32(&a, p, &f, &err), &err);
    CHECK(f && f[0] == 1.0f && f[1] == -2.0f && f[2] == 0x1p-24f && f[3] == 65504.0f, "<f2 -> f32");
    free(f);
    mha__npy_free(&a);

    /* <f4, v3.0, double-quoted keys, no trailing comma, extra spaces (still valid Python) */
    unsigned char fb[8];
    put_u32le(fb, f32_bits(1.25f));
    put_u32le(fb + 4, f32_bits(-7.0f));
    p = write_npy("f4v3.npy", 3,
                  "{ \"descr\" : \"<f4\" , \"fortran_order\":False,\"shape\":( 2 , ) }", fb,
                  sizeof fb);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_F32 && a.count == 2 && ((float *)a.data)[1] == -7.0f,
          "<f4 read (v3.0)");
    mha__npy_free(&a);

    /* |b1, |u1, <i4, <i8 */
    const unsigned char bools[3] = {1, 0, 1};
    p = write_npy("b1.npy", 1, "{'descr': '|b1', 'fortran_order': False, 'shape': (1, 3), }", bools,
                  3);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_BOOL && a.ndim == 2 && a.shape[1] == 3 &&
              memcmp(a.data, bools, 3) == 0,
          "|b1 read");
    CHECK_FAIL(mha__npy_to_f32(&a, "b1.npy", &f, &err), &err, MHA_STATUS_BAD_FILE,
               "not a float type");
    mha__npy_free(&a);

    const unsigned char u8[2] = {7, 255};
    p = write_npy("u1.npy", 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", u8, 2);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_U8 && ((uint8_t *)a.data)[1] == 255, "|u1 read");
    mha__npy_free(&a);

    unsigned char i4[8];
    put_u32le(i4, (uint32_t)-3);
    put_u32le(i4 + 4, 100000);
    p = write_npy("i4.npy", 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", i4, 8);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_I32 && ((int32_t *)a.data)[0] == -3 &&
              ((int32_t *)a.data)[1] == 100000,
          "<i4 read");
    mha__npy_free(&a);

    unsigned char i8[16];
    put_u64le(i8, (uint64_t)-5);
    put_u64le(i8 + 8, (uint64_t)1 << 40);
    p = write_npy("i8.npy", 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", i8, 16);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_I64 && ((int64_t *)a.data)[0] == -5 &&
              ((int64_t *)a.data)[1] == (int64_t)1 << 40,
          "<i8 read");
    mha__npy_free(&a);

    /* A zero-size dimension and a scalar. */
    p = write_npy("empty.npy", 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 0), }",
                  NULL, 0);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.count == 0 && a.ndim == 2 && a.shape[0] == 3 && a.shape[1] == 0, "shape (3, 0)");
    mha__npy_free(&a);
    p = write_npy("scalar.npy", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", fb,
                  4);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.count == 1 && a.ndim == 0 && ((float *)a.data)[0] == 1.25f, "scalar shape ()");
    mha__npy_free(&a);

    /* The in-memory parser (the fuzzing entry point) gives the same result. */
    size_t n;
    unsigned char *img =
        npy_image(1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 0, fb, 8, &n);
    CHECK_OK(mha__npy_parse(img, n, "mem", &a, &err), &err);
    CHECK(a.count == 2 && ((float *)a.data)[0] == 1.25f, "mha__npy_parse");
    mha__npy_free(&a);
    CHECK_FAIL(mha__npy_parse(img, n - 1, "mem", &a, &err), &err, MHA_STATUS_BAD_FILE,
               "mem: data is 7 bytes, shape (2,) of <f4 needs 8");
    CHECK_FAIL(mha__npy_parse(img, 3, "mem", &a, &err), &err, MHA_STATUS_BAD_FILE,
               "truncated header");
    CHECK_FAIL(mha__npy_parse(NULL, 0, "mem", &a, &err), &err, MHA_STATUS_BAD_FILE,
               "truncated header");
    free(img);

    /* A FIFO is refused, never waited on (issue 28: the open blocked forever without a writer).
     * alarm: a hang fails the test instead of stalling it. */
    const char *fifo = tpath("pipe.npy");
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo: %s", strerror(errno));
    alarm(30);
    CHECK_FAIL(mha__npy_read(fifo, &a, &err), &err, MHA_STATUS_IO,
               "pipe.npy: not a regular file (a FIFO)");
    alarm(0);
    CHECK(a.data == NULL, "FIFO: no data");
    CHECK_FAIL(mha__npy_read("/dev/null", &a, &err), &err, MHA_STATUS_IO,
               "/dev/null: not a regular file (a device or socket)");
    remove(fifo);
}

/* bfloat16 .npy ('<V2', as np.save of an ml_dtypes.bfloat16 array writes it) read, written and
 * read back; '|V2' (a plain 2-byte void) refused; and the CLI's conversions (mha__npy_convert)
 * against the library's float32 -> half rounding (itself checked against the rint() oracles in
 * test_conversions) on random float32 bit patterns, plus float64 rounded ONCE to a half. */
static void test_npy_half(void) {
    mha_error err;
    mha__npy a;
    const uint16_t h[3] = {0x3f80, 0xc000, 0x7f7f}; /* 1, -2, bf16 max */
    unsigned char hb[6];
    for (int i = 0; i < 3; i++) {
        hb[2 * i] = (unsigned char)(h[i] & 0xff);
        hb[2 * i + 1] = (unsigned char)(h[i] >> 8);
    }
    const char *p = write_npy(
        "bf16.npy", 1, "{'descr': '<V2', 'fortran_order': False, 'shape': (3,), }", hb, sizeof hb);
    CHECK_OK(mha__npy_read(p, &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_BF16 && a.count == 3 && memcmp(a.data, h, sizeof h) == 0,
          "<V2 read as bfloat16");
    float *f = NULL;
    CHECK_OK(mha__npy_to_f32(&a, p, &f, &err), &err);
    CHECK(f && f[0] == 1.0f && f[1] == -2.0f && f[2] == bits_f32(0x7f7f0000u), "<V2 -> f32");
    free(f);
    const int64_t shape[2] = {1, 3};
    CHECK_OK(mha__npy_write(tpath("bf16w.npy"), MHA_DTYPE_BF16, a.data, 2, shape, &err), &err);
    mha__npy_free(&a);
    CHECK_OK(mha__npy_read(tpath("bf16w.npy"), &a, &err), &err);
    CHECK(a.dtype == MHA_DTYPE_BF16 && a.ndim == 2 && memcmp(a.data, h, sizeof h) == 0,
          "bf16 written and read back");
    mha__npy_free(&a);
    p = write_npy("v2.npy", 1, "{'descr': '|V2', 'fortran_order': False, 'shape': (3,), }", hb,
                  sizeof hb);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE, "unsupported dtype '|V2'");

    test_rng rng;
    test_rng_seed(&rng, 30);
    int bad = 0;
    for (int i = 0; i < 200000; i++) {
        const float x = bits_f32((uint32_t)test_rng_u64(&rng));
        if (isnan(x))
            continue;
        uint16_t b16, f16;
        mha__npy_convert(MHA_DTYPE_F32, &x, MHA_DTYPE_BF16, &b16, 1);
        mha__npy_convert(MHA_DTYPE_F32, &x, MHA_DTYPE_F16, &f16, 1);
        bad += b16 != mha__f32_to_bf16(x) || f16 != mha__f32_to_f16(x);
        float back;
        mha__npy_convert(MHA_DTYPE_F16, &f16, MHA_DTYPE_F32, &back, 1);
        bad += !(back == mha__f16_to_f32(f16) || (isnan(back) && isnan(mha__f16_to_f32(f16))));
    }
    CHECK(bad == 0, "mha__npy_convert = the library's rounding (%d mismatches)", bad);
    /* 1 + half an ulp + 2^-30: once rounded, up (float32 would tie to even, down). */
    const double d[4] = {1.0 + 0x1p-8 + 0x1p-30, -(1.0 + 0x1p-11 + 0x1p-30), 65520.0, 1e-30};
    uint16_t o[4];
    mha__npy_convert(MHA_DTYPE_F64, d, MHA_DTYPE_BF16, o, 1);
    mha__npy_convert(MHA_DTYPE_F64, d + 1, MHA_DTYPE_F16, o + 1, 3);
    CHECK(o[0] == 0x3f81 && o[1] == 0xbc01 && o[2] == 0x7c00 && o[3] == 0,
          "float64 rounded once: %04x %04x %04x %04x", o[0], o[1], o[2], o[3]);
}

static void test_npy_errors(void) {
    mha_error err;
    mha__npy a;
    float *data = calloc(1604, 1);
    const char *p;

    CHECK_FAIL(mha__npy_read(tpath("missing.npy"), &a, &err), &err, MHA_STATUS_IO,
               "missing.npy: cannot open: No such file");
    CHECK(a.data == NULL && a.ndim == 0, "out zeroed on error");
    CHECK_FAIL(mha__npy_read(g_dir, &a, &err), &err, MHA_STATUS_IO, "is a directory");

    /* Sizes. */
    const char *d4x100 = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 100), }";
    p = write_npy("x.npy", 1, d4x100, data, 1200);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE,
               "x.npy: data is 1200 bytes, shape (4, 100) of <f4 needs 1600");
    p = write_npy("trail.npy", 1, d4x100, data, 1604);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE,
               "data is 1604 bytes, shape (4, 100) of <f4 needs 1600");
    p = write_npy("tb.npy", 1,
                  "{'descr': '<f4', 'fortran_order': False, 'shape': (268435456000,), }", data, 16);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE,
               "data is 16 bytes, shape (268435456000,) of <f4 needs 1073741824000");
    p = write_npy("ovf.npy", 1,
                  "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 8), }",
                  data, 16);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE,
               "shape (4611686018427387904, 8) of <f4 is too large");
    p = write_npy("ovf2.npy", 1,
                  "{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }",
                  data, 16);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE, "is too large");
    p = write_npy("huge.npy", 1,
                  "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
                  data, 16);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE, "does not fit in 64 bits");
    p = write_npy("neg.npy", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }",
                  data, 16);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE, "negative dimension");
    p = write_npy(
        "dims.npy", 1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1, 1, 1, 1, 1), }", data,
        4);
    CHECK_FAIL(mha__npy_read(p, &a, &err), &err, MHA_STATUS_BAD_FILE, "more than 8 dimensions");

    /* Preamble. */
    write_bytes(tpath("short.npy"), "\x93NUM", 4);
    CHECK_FAIL(mha__npy_read(tpath("short.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "short.npy: truncated header");
    write_bytes(tpath("empty.npy"), "", 0);
    CHECK_FAIL(mha__npy_read(tpath("empty.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "truncated header: the file is 0 bytes");
    size_t n;
    unsigned char *img = npy_image(1, 0, d4x100, 0, NULL, 0, &n);
    write_bytes(tpath("cut.npy"), img, 40); /* the header says 118 bytes of dict */
    CHECK_FAIL(mha__npy_read(tpath("cut.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "cut.npy: truncated header: the header dict is 118 bytes");
    CHECK_FAIL(mha__npy_parse(img, 40, "cut", &a, &err), &err, MHA_STATUS_BAD_FILE,
               "truncated header");
    img[0] = 0x92;
    write_bytes(tpath("magic.npy"), img, n);
    CHECK_FAIL(mha__npy_read(tpath("magic.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "magic.npy: not a .npy file (bad magic bytes)");
    write_bytes(tpath("text.npy"), "hello", 5);
    CHECK_FAIL(mha__npy_read(tpath("text.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE, "bad magic");
    free(img);
    img = npy_image(4, 0, d4x100, 0, data, 1600, &n);
    write_bytes(tpath("v4.npy"), img, n);
    CHECK_FAIL(mha__npy_read(tpath("v4.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "unsupported .npy format version 4.0");
    free(img);
    img = npy_image(1, 1, d4x100, 0, data, 1600, &n);
    write_bytes(tpath("v11.npy"), img, n);
    CHECK_FAIL(mha__npy_read(tpath("v11.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE, "version 1.1");
    free(img);
    /* A version 2.0 header that claims 4 GiB. */
    img = npy_image(2, 0, d4x100, 0, NULL, 0, &n);
    put_u32le(img + 8, 0xffffffffu);
    write_bytes(tpath("bighdr.npy"), img, n);
    CHECK_FAIL(mha__npy_read(tpath("bighdr.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "truncated header");
    free(img);

    /* A version 2.0 header of 2 MiB inside a (sparse) 3 MiB file: over the dict limit. */
    img = npy_image(2, 0, d4x100, 0, NULL, 0, &n);
    put_u32le(img + 8, 2u << 20);
    write_bytes(tpath("capped.npy"), img, n);
    CHECK(truncate(tpath("capped.npy"), 3 << 20) == 0, "truncate: %s", strerror(errno));
    CHECK_FAIL(mha__npy_read(tpath("capped.npy"), &a, &err), &err, MHA_STATUS_BAD_FILE,
               "header dict is 2097152 bytes, more than the 1048576-byte limit");
    remove(tpath("capped.npy"));
    free(img);

    /* The dict. */
    static const struct {
        const char *dict, *want;
    } bad[] = {
        {"{'descr': '<f4', 'fortran_order': True, 'shape': (4,), }", "fortran_order True"},
        {"{'descr': '<c8', 'fortran_order': False, 'shape': (4,), }", "unsupported dtype '<c8'"},
        {"{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }",
         "big-endian dtype '>f4' is not supported"},
        {"{'descr': '|i1', 'fortran_order': False, 'shape': (4,), }", "unsupported dtype '|i1'"},
        {"{'descr': 'f4', 'fortran_order': False, 'shape': (4,), }", "unsupported dtype 'f4'"},
        {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", "structured dtypes"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'extra': 1, }",
         "unknown key 'extra'"},
        {"{'descr': '<f4', 'fortran_order': False, }", "no 'shape'"},
        {"{'descr': '<f4', 'shape': (4,), }", "no 'fortran_order'"},
        {"{'fortran_order': False, 'shape': (4,), }", "no 'descr'"},
        {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (4,), }",
         "duplicate key 'descr'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4), }", "trailing comma"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': [4], }", "'shape' must be a tuple"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,,), }", "expected a dimension"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4 2), }", "expected ',' or ')'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (04,), }", "leading zero"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4L,), }", "after a dimension"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4.0,), }", "expected ',' or ')'"},
        {"{'descr': '<f4', 'fortran_order': Flase, 'shape': (4,), }", "True or False"},
        {"{'descr': '<f4', 'fortran_order': 0, 'shape': (4,), }", "True or False"},
        {"{'descr': '<f4' 'fortran_order': False, 'shape': (4,), }", "expected ',' or '}'"},
        {"{'descr' '<f4', 'fortran_order': False, 'shape': (4,), }", "expected ':'"},
        {"{descr: '<f4', 'fortran_order': False, 'shape': (4,), }", "expected a quoted string"},
        {"{'descr': '<f4, 'fortran_order': False, 'shape': (4,), }", "unsupported dtype '<f4, '"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), } \x01", "malformed"},
        {"'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", "expected '{'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), ", "expected a quoted string"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), } x", "unexpected text"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,)}}", "unexpected text"},
        {"", "expected '{'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = write_npy("dict.npy", 1, bad[i].dict, data, 16);
        mha_status st = mha__npy_read(p, &a, &err);
        CHECK(st == MHA_STATUS_BAD_FILE && strstr(err.message, bad[i].want) &&
                  strncmp(err.message, p, strlen(p)) == 0,
              "dict %s -> %s \"%s\"; want BAD_FILE with \"%s\"", bad[i].dict, mha_status_string(st),
              err.message, bad[i].want);
    }
    /* Padding with something other than whitespace after the dict. */
    img = npy_image(1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", 0, data, 16,
                    &n);
    img[10 + 60] = '\0'; /* inside the space padding */
    CHECK_FAIL(mha__npy_parse(img, n, "nul", &a, &err), &err, MHA_STATUS_BAD_FILE,
               "unexpected text");
    free(img);
    img = npy_image(1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", 1, data, 16,
                    &n); /* no newline, no padding: still accepted */
    CHECK_OK(mha__npy_parse(img, n, "raw", &a, &err), &err);
    mha__npy_free(&a);
    free(img);

    CHECK_FAIL(mha__npy_read(NULL, &a, &err), &err, MHA_STATUS_INVALID_ARG, "path is NULL");
    free(data);
}

/* ---------------------------------------------------------------------------------------------- */
/* safetensors                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* A safetensors file under construction: JSON entries and the data buffer. */
typedef struct stb {
    char json[32768];
    size_t json_len;
    unsigned char data[65536];
    size_t data_len;
} stb;

static void stb_init(stb *b) {
    b->json_len = (size_t)snprintf(b->json, sizeof b->json, "{");
    b->data_len = 0;
}

/* Adds a tensor with raw little-endian bytes; shape "[8, 4]" as JSON text. */
static void stb_add(
    stb *b, const char *name, const char *dtype, const char *shape, const void *bytes, size_t n) {
    b->json_len += (size_t)snprintf(b->json + b->json_len, sizeof b->json - b->json_len,
                                    "%s\"%s\": {\"dtype\": \"%s\", \"shape\": %s, "
                                    "\"data_offsets\": [%zu, %zu]}",
                                    b->json_len > 1 ? ", " : "", name, dtype, shape, b->data_len,
                                    b->data_len + n);
    if (n)
        memcpy(b->data + b->data_len, bytes, n);
    b->data_len += n;
}

static void stb_add_f32(stb *b, const char *name, int64_t rows, int64_t cols, const float *v) {
    char shape[64];
    int64_t n = cols ? rows * cols : rows;
    if (cols)
        snprintf(shape, sizeof shape, "[%lld, %lld]", (long long)rows, (long long)cols);
    else
        snprintf(shape, sizeof shape, "[%lld]", (long long)rows);
    unsigned char *bytes = malloc((size_t)n * 4 + 1);
    for (int64_t i = 0; i < n; i++)
        put_u32le(bytes + 4 * i, f32_bits(v[i]));
    stb_add(b, name, "F32", shape, bytes, (size_t)n * 4);
    free(bytes);
}

static void stb_write_raw(
    const char *path, const char *json, uint64_t header_len, const void *data, size_t data_len) {
    size_t jl = strlen(json);
    unsigned char *buf = malloc(8 + jl + data_len + 1);
    put_u64le(buf, header_len);
    memcpy(buf + 8, json, jl);
    if (data_len)
        memcpy(buf + 8 + jl, data, data_len);
    write_bytes(path, buf, 8 + jl + data_len);
    free(buf);
}

static const char *stb_write(stb *b, const char *name) {
    snprintf(b->json + b->json_len, sizeof b->json - b->json_len, "}");
    const char *p = tpath(name);
    stb_write_raw(p, b->json, strlen(b->json), b->data, b->data_len);
    return p;
}

/* Deterministic test values: multiples of 1/64 in [-2, 2), exact in every float format here. */
static float *values(int64_t n, int seed) {
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)((i * 37 + seed * 101) % 256 - 128) / 64.0f;
    return v;
}

static int same(const float *a, const float *b, int64_t n) {
    return a && b && memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static mha_config cfg_heads(int64_t h, int64_t g) {
    mha_config c;
    memset(&c, 0, sizeof c);
    c.num_heads = h;
    c.num_kv_heads = g;
    return c;
}

static void test_st_hf(void) {
    mha_error err;
    mha_layer *L = NULL;
    /* GQA: h = 4, g = 2, d_k = 4, d_v = 3, q_dim 8, out_dim 6; biases on q, k, v only. */
    float *wq = values(16 * 8, 1), *wk = values(8 * 8, 2), *wv = values(6 * 8, 3),
          *wo = values(6 * 12, 4), *bq = values(16, 5), *bk = values(8, 6), *bv = values(6, 7);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "q_proj.bias", 16, 0, bq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add_f32(&b, "k_proj.bias", 8, 0, bk);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "v_proj.bias", 6, 0, bv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    b.json_len += (size_t)snprintf(b.json + b.json_len, sizeof b.json - b.json_len,
                                   ", \"__metadata__\": {\"format\": \"pt\"}");
    const char *p = stb_write(&b, "hf.safetensors");
    mha_config c = cfg_heads(4, 0);
    c.scale = 0.25;
    c.rope.style = MHA_ROPE_HALF;
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        CHECK(r->q_dim == 8 && r->k_dim == 8 && r->v_dim == 8 && r->num_heads == 4 &&
                  r->num_kv_heads == 2 && r->head_dim == 4 && r->v_head_dim == 3 && r->out_dim == 6,
              "HF sizes: q %lld k %lld v %lld h %lld g %lld dk %lld dv %lld out %lld",
              (long long)r->q_dim, (long long)r->k_dim, (long long)r->v_dim,
              (long long)r->num_heads, (long long)r->num_kv_heads, (long long)r->head_dim,
              (long long)r->v_head_dim, (long long)r->out_dim);
        CHECK(r->bias_q && r->bias_k && r->bias_v && !r->bias_o && !r->sinks,
              "HF bias flags (no output bias)");
        CHECK(r->scale == 0.25 && r->rope.style == MHA_ROPE_HALF, "non-size options copied");
        CHECK(same(w->w_q, wq, 128) && same(w->w_k, wk, 64) && same(w->w_v, wv, 48) &&
                  same(w->w_o, wo, 72) && same(w->b_q, bq, 16) && same(w->b_k, bk, 8) &&
                  same(w->b_v, bv, 6) && w->b_o == NULL,
              "HF weights equal what was written");
    }
    mha_layer_destroy(L);
    L = NULL;

    /* The same with explicit kv heads; the wrong kv heads; the wrong heads. */
    c = cfg_heads(4, 2);
    CHECK_OK(mha_layer_load_safetensors(p, "", NULL, &c, NULL, &L, &err), &err);
    mha_layer_destroy(L);
    c = cfg_heads(4, 1);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "key weight 'k_proj.weight' has shape [8, 8]: expected 4 rows");
    CHECK(L == NULL, "*out is NULL on error");
    c = cfg_heads(4, 3);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_INVALID_ARG, "num_kv_heads 3 does not divide num_heads 4");
    c = cfg_heads(3, 0);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "query weight 'q_proj.weight' has shape [16, 8]: 16 rows are not divisible by "
               "num_heads 3");
    c = cfg_heads(16, 0); /* d_k = 1: 8 kv heads, over which the 6 value rows do not split */
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "6 rows are not divisible by 8 kv heads");
    c = cfg_heads(0, 0);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_INVALID_ARG, "num_heads=0");
    c = cfg_heads(4, -1);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_INVALID_ARG, "num_kv_heads=-1");
    c = cfg_heads(4, 0);
    c.q_dim = 16;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "config.q_dim=16 but the file's shapes give 8");
    c = cfg_heads(4, 0);
    c.bias_o = 1;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "output bias but the file has none: tried 'o_proj.bias'");
    c = cfg_heads(4, 0);
    c.sinks = 1;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no attention sinks: tried 'sinks'");
    c = cfg_heads(4, 0);
    CHECK_FAIL(mha_layer_load_safetensors(p, "model.", NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND,
               "no query weight: tried 'model.q_proj.weight', 'model.in_proj_weight', "
               "'model.q_proj_weight'");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, NULL, NULL, &L, &err), &err,
               MHA_STATUS_INVALID_ARG, "config is NULL");
    CHECK_FAIL(
        mha_layer_load_safetensors(tpath("nope.safetensors"), NULL, NULL, &c, NULL, &L, &err), &err,
        MHA_STATUS_IO, "nope.safetensors: cannot open");
    CHECK_FAIL(mha_layer_load_safetensors(g_dir, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_IO, "not a regular file");

    /* W_o with the wrong number of columns; a missing value weight. */
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 12, 6, wo);
    p = stb_write(&b, "wo.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "output weight 'o_proj.weight' has shape [12, 6]: expected 12 columns");
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "nov.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no value weight: tried 'v_proj.weight'");

    /* Key rows that are not a multiple of d_k; kv heads that do not divide h. */
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 6, 8, wk);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "kdiv.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "6 rows are not a multiple of the head size 4");
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 12, 8, wq);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "gdiv.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "3 kv heads of size 4, which does not divide num_heads 4");

    /* Bias of the wrong length; a 1-d weight; an I8 weight. */
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "q_proj.bias", 7, 0, bq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "blen.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "bias 'q_proj.bias' has shape [7] but query expects 16");
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 128, 0, wq);
    p = stb_write(&b, "w1d.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "tensor 'q_proj.weight' (query) has shape [128], expected 2-d");
    stb_init(&b);
    stb_add(&b, "q_proj.weight", "I8", "[16, 8]", wq, 128);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "i8.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "i8.safetensors: tensor 'q_proj.weight' (query) has dtype I8; supported: F32, F64, "
               "F16, BF16");

    /* NaN and Inf weights are refused with the element. */
    float *bad = values(64, 2);
    bad[1 * 8 + 2] = NAN;
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, bad);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "nan.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "nan.safetensors: tensor 'k_proj.weight' element [1, 2] is NaN in float32");
    bad[1 * 8 + 2] = 1.0f;
    bad[63] = -INFINITY;
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 16, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, bad);
    stb_add_f32(&b, "v_proj.weight", 6, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 6, 12, wo);
    p = stb_write(&b, "inf.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "element [7, 7] is infinite");
    free(bad);
    free(wq);
    free(wk);
    free(wv);
    free(wo);
    free(bq);
    free(bk);
    free(bv);
}

static void test_st_torch_mha(void) {
    mha_error err;
    mha_layer *L = NULL;
    mha_config c = cfg_heads(2, 0);
    /* Packed: in_proj_weight [3E, E], E = 8. */
    float *win = values(24 * 8, 11), *bin = values(24, 12), *wo = values(8 * 8, 13),
          *bo = values(8, 14);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "attn.in_proj_weight", 24, 8, win);
    stb_add_f32(&b, "attn.in_proj_bias", 24, 0, bin);
    stb_add_f32(&b, "attn.out_proj.weight", 8, 8, wo);
    stb_add_f32(&b, "attn.out_proj.bias", 8, 0, bo);
    const char *p = stb_write(&b, "mha.safetensors");
    CHECK_OK(mha_layer_load_safetensors(p, "attn.", NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        CHECK(r->q_dim == 8 && r->k_dim == 8 && r->v_dim == 8 && r->num_kv_heads == 2 &&
                  r->head_dim == 4 && r->out_dim == 8 && r->bias_q && r->bias_k && r->bias_v &&
                  r->bias_o,
              "in_proj config");
        CHECK(same(w->w_q, win, 64) && same(w->w_k, win + 64, 64) && same(w->w_v, win + 128, 64) &&
                  same(w->w_o, wo, 64),
              "in_proj_weight split into q, k, v rows");
        CHECK(same(w->b_q, bin, 8) && same(w->b_k, bin + 8, 8) && same(w->b_v, bin + 16, 8) &&
                  same(w->b_o, bo, 8),
              "in_proj_bias split into q, k, v");
    }
    mha_layer_destroy(L);
    L = NULL;

    /* Without any bias. */
    stb_init(&b);
    stb_add_f32(&b, "in_proj_weight", 24, 8, win);
    stb_add_f32(&b, "out_proj.weight", 8, 8, wo);
    p = stb_write(&b, "mha_nobias.safetensors");
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        CHECK(!r->bias_q && !r->bias_k && !r->bias_v && !r->bias_o, "no biases");
    }
    mha_layer_destroy(L);
    L = NULL;

    /* kdim/vdim differ: separate weights, in_proj_bias still [3E]. */
    float *wq = values(8 * 8, 15), *wk = values(8 * 6, 16), *wv = values(8 * 5, 17);
    stb_init(&b);
    stb_add_f32(&b, "q_proj_weight", 8, 8, wq);
    stb_add_f32(&b, "k_proj_weight", 8, 6, wk);
    stb_add_f32(&b, "v_proj_weight", 8, 5, wv);
    stb_add_f32(&b, "in_proj_bias", 24, 0, bin);
    stb_add_f32(&b, "out_proj.weight", 8, 8, wo);
    stb_add_f32(&b, "out_proj.bias", 8, 0, bo);
    p = stb_write(&b, "mha_sep.safetensors");
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        CHECK(r->q_dim == 8 && r->k_dim == 6 && r->v_dim == 5 && r->bias_q && r->bias_o,
              "separate q/k/v_proj_weight sizes");
        CHECK(same(w->w_q, wq, 64) && same(w->w_k, wk, 48) && same(w->w_v, wv, 40) &&
                  same(w->b_v, bin + 16, 8) && same(w->b_o, bo, 8),
              "separate weights and split bias");
    }
    mha_layer_destroy(L);
    L = NULL;

    /* Packed rows not divisible by 3; in_proj_bias of the wrong length. */
    stb_init(&b);
    stb_add_f32(&b, "in_proj_weight", 20, 8, win);
    stb_add_f32(&b, "out_proj.weight", 8, 8, wo);
    p = stb_write(&b, "mha3.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "'in_proj_weight' has shape [20, 8]: its rows are not divisible by 3");
    stb_init(&b);
    stb_add_f32(&b, "in_proj_weight", 24, 8, win);
    stb_add_f32(&b, "in_proj_bias", 16, 0, bin);
    stb_add_f32(&b, "out_proj.weight", 8, 8, wo);
    p = stb_write(&b, "mhab.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "bias 'in_proj_bias' has shape [16] but query expects 24");
    /* nn.MultiheadAttention names without the output projection. */
    stb_init(&b);
    stb_add_f32(&b, "in_proj_weight", 24, 8, win);
    p = stb_write(&b, "mhano.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no output weight: tried 'out_proj.weight'");

    /* CS336: q/k/v/o_proj_weight, no biases (an in_proj_bias is not looked at). */
    stb_init(&b);
    stb_add_f32(&b, "q_proj_weight", 8, 8, wq);
    stb_add_f32(&b, "k_proj_weight", 8, 8, wq);
    stb_add_f32(&b, "v_proj_weight", 8, 8, wo);
    stb_add_f32(&b, "o_proj_weight", 8, 8, wo);
    stb_add_f32(&b, "in_proj_bias", 24, 0, bin);
    p = stb_write(&b, "cs336.safetensors");
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        CHECK(!r->bias_q && !r->bias_k && !r->bias_v && !r->bias_o && r->head_dim == 4,
              "CS336 config");
        CHECK(same(w->w_q, wq, 64) && same(w->w_k, wq, 64) && same(w->w_v, wo, 64) &&
                  same(w->w_o, wo, 64),
              "CS336 weights");
    }
    mha_layer_destroy(L);
    L = NULL;
    c.bias_q = 1;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "CS336 names have no biases");
    c.bias_q = 0;
    stb_init(&b);
    stb_add_f32(&b, "q_proj_weight", 8, 8, wq);
    stb_add_f32(&b, "k_proj_weight", 8, 8, wq);
    stb_add_f32(&b, "v_proj_weight", 8, 8, wo);
    p = stb_write(&b, "cs336no.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no output weight: tried 'o_proj_weight' (CS336 names)");
    free(win);
    free(bin);
    free(wo);
    free(bo);
    free(wq);
    free(wk);
    free(wv);
}

static void test_st_names_prefix_dtypes(void) {
    mha_error err;
    mha_layer *L = NULL;
    mha_config c = cfg_heads(2, 0);
    float *wq = values(8 * 8, 21), *wk = values(8 * 8, 22), *wv = values(8 * 8, 23),
          *wo = values(8 * 8, 24), *bq = values(8, 25), *bo = values(8, 26);

    /* A BERT-style name map under a prefix, plus unrelated tensors of other dtypes. */
    stb b;
    stb_init(&b);
    int64_t ids[3] = {1, 2, 3};
    stb_add(&b, "bert.embeddings.position_ids", "I64", "[3]", ids, sizeof ids);
    stb_add_f32(&b, "bert.attention.self.query.weight", 8, 8, wq);
    stb_add_f32(&b, "bert.attention.self.query.bias", 8, 0, bq);
    stb_add_f32(&b, "bert.attention.self.key.weight", 8, 8, wk);
    stb_add_f32(&b, "bert.attention.self.value.weight", 8, 8, wv);
    stb_add_f32(&b, "bert.attention.output.dense.weight", 8, 8, wo);
    stb_add_f32(&b, "bert.attention.output.dense.bias", 8, 0, bo);
    stb_add(&b, "bert.packed", "F4", "[3]", ids, 2); /* unknown size: not checked, not used */
    const char *p = stb_write(&b, "bert.safetensors");
    mha_name_map names = {"attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense", NULL};
    CHECK_OK(mha_layer_load_safetensors(p, "bert.", &names, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        CHECK(r->bias_q && !r->bias_k && !r->bias_v && r->bias_o, "name map bias flags");
        CHECK(same(w->w_q, wq, 64) && same(w->w_k, wk, 64) && same(w->w_v, wv, 64) &&
                  same(w->w_o, wo, 64) && same(w->b_q, bq, 8) && same(w->b_o, bo, 8),
              "name map weights");
    }
    mha_layer_destroy(L);
    L = NULL;
    names.k = "attention.self.kee";
    CHECK_FAIL(mha_layer_load_safetensors(p, "bert.", &names, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no key weight: tried 'bert.attention.self.kee.weight'");
    names.k = "attention.self.key";
    names.sinks = "attention.sinks";
    CHECK_FAIL(mha_layer_load_safetensors(p, "bert.", &names, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no attention sinks: tried 'bert.attention.sinks'");
    /* A partial map: the other roles use the built-in search. */
    mha_name_map part = {"attention.self.query", NULL, NULL, NULL, NULL};
    CHECK_FAIL(mha_layer_load_safetensors(p, "bert.", &part, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND,
               "no key weight: tried 'bert.k_proj.weight', 'bert.in_proj_weight', "
               "'bert.k_proj_weight'");

    /* HF names under a Llama-style prefix, each tensor in another dtype, with sinks. */
    const char *pre = "model.layers.0.self_attn.";
    uint16_t hq[64], hk[64];
    unsigned char bq16[128], bk16[128], bv64[512];
    float eq[64], ek[64], ev[64];
    double dv[64];
    test_rng rng;
    test_rng_seed(&rng, 7);
    for (int i = 0; i < 64; i++) {
        do
            hq[i] = (uint16_t)test_rng_u64(&rng);
        while ((hq[i] & 0x7c00) == 0x7c00); /* finite f16 only */
        do
            hk[i] = (uint16_t)test_rng_u64(&rng);
        while ((hk[i] & 0x7f80) == 0x7f80); /* finite bf16 only */
        eq[i] = mha__f16_to_f32(hq[i]);
        ek[i] = bits_f32((uint32_t)hk[i] << 16);
        dv[i] = test_rng_normal(&rng);
        ev[i] = (float)dv[i];
        bq16[2 * i] = (unsigned char)(hq[i] & 0xff);
        bq16[2 * i + 1] = (unsigned char)(hq[i] >> 8);
        bk16[2 * i] = (unsigned char)(hk[i] & 0xff);
        bk16[2 * i + 1] = (unsigned char)(hk[i] >> 8);
        uint64_t u;
        memcpy(&u, &dv[i], 8);
        put_u64le(bv64 + 8 * i, u);
    }
    const float sinks[2] = {0.5f, -1.25f};
    char name[128];
    stb_init(&b);
    snprintf(name, sizeof name, "%sq_proj.weight", pre);
    stb_add(&b, name, "F16", "[8, 8]", bq16, sizeof bq16);
    snprintf(name, sizeof name, "%sk_proj.weight", pre);
    stb_add(&b, name, "BF16", "[8, 8]", bk16, sizeof bk16);
    snprintf(name, sizeof name, "%sv_proj.weight", pre);
    stb_add(&b, name, "F64", "[8, 8]", bv64, sizeof bv64);
    snprintf(name, sizeof name, "%so_proj.weight", pre);
    stb_add_f32(&b, name, 8, 8, wo);
    snprintf(name, sizeof name, "%ssinks", pre);
    stb_add_f32(&b, name, 2, 0, sinks);
    snprintf(name, sizeof name, "model.layers.1.self_attn.q_proj.weight");
    stb_add_f32(&b, name, 8, 8, wo);
    p = stb_write(&b, "llama.safetensors");
    CHECK_OK(mha_layer_load_safetensors(p, pre, NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        CHECK(r->sinks && same(w->sinks, sinks, 2), "sinks found and loaded");
        CHECK(same(w->w_q, eq, 64), "F16 weight converted exactly");
        CHECK(same(w->w_k, ek, 64), "BF16 weight converted exactly");
        CHECK(same(w->w_v, ev, 64), "F64 weight rounded to nearest float");
        CHECK(same(w->w_o, wo, 64), "F32 weight");
    }
    mha_layer_destroy(L);
    L = NULL;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "tried 'q_proj.weight', 'in_proj_weight', 'q_proj_weight'");
    c.num_heads = 4;
    CHECK_FAIL(mha_layer_load_safetensors(p, pre, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "sinks 'model.layers.0.self_attn.sinks' have shape [2], expected [4]");
    c.num_heads = 2;

    /* An F64 value beyond float range. */
    double huge[64];
    for (int i = 0; i < 64; i++)
        huge[i] = i == 9 ? -1e300 : 0.5;
    unsigned char hb[512];
    for (int i = 0; i < 64; i++) {
        uint64_t u;
        memcpy(&u, &huge[i], 8);
        put_u64le(hb + 8 * i, u);
    }
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 8, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add(&b, "v_proj.weight", "F64", "[8, 8]", hb, sizeof hb);
    stb_add_f32(&b, "o_proj.weight", 8, 8, wo);
    p = stb_write(&b, "huge.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "tensor 'v_proj.weight' element [1, 1] is infinite");

    /* Header padded with spaces (allowed by the format). */
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 8, 8, wq);
    stb_add_f32(&b, "k_proj.weight", 8, 8, wk);
    stb_add_f32(&b, "v_proj.weight", 8, 8, wv);
    stb_add_f32(&b, "o_proj.weight", 8, 8, wo);
    snprintf(b.json + b.json_len, sizeof b.json - b.json_len, "}       ");
    p = tpath("pad.safetensors");
    stb_write_raw(p, b.json, strlen(b.json), b.data, b.data_len);
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    mha_layer_destroy(L);
    L = NULL;

    free(wq);
    free(wk);
    free(wv);
    free(wo);
    free(bq);
    free(bo);
}

typedef struct counting_alloc {
    int64_t live;
    int64_t calls;
} counting_alloc;

static void *counting_alloc_fn(void *user, size_t bytes, size_t align) {
    counting_alloc *ca = user;
    void *p = aligned_alloc(align, (bytes + align - 1) / align * align);
    if (p) {
        ca->live++;
        ca->calls++;
    }
    return p;
}

static void counting_free_fn(void *user, void *ptr) {
    counting_alloc *ca = user;
    if (ptr)
        ca->live--;
    free(ptr);
}

/* A custom allocator is used for the temporaries and the layer, and all is given back. */
static void test_st_allocator(void) {
    mha_error err;
    mha_layer *L = NULL;
    float *w = values(64, 31);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 8, 8, w);
    stb_add_f32(&b, "k_proj.weight", 8, 8, w);
    stb_add_f32(&b, "v_proj.weight", 8, 8, w);
    stb_add_f32(&b, "o_proj.weight", 8, 8, w);
    const char *p = stb_write(&b, "alloc.safetensors");
    counting_alloc ca = {0, 0};
    mha_allocator a = {&ca, counting_alloc_fn, counting_free_fn};
    mha_config c = cfg_heads(2, 0);
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, &a, &L, &err), &err);
    CHECK(ca.calls >= 4, "the allocator is used (%lld calls)", (long long)ca.calls);
    mha_layer_destroy(L);
    CHECK(ca.live == 0, "every allocation given back (%lld live)", (long long)ca.live);
    free(w);
}

static void test_st_file_errors(void) {
    mha_error err;
    mha_layer *L = NULL;
    mha_config c = cfg_heads(2, 0);
    unsigned char data[256];
    memset(data, 0, sizeof data);
    const char *p = tpath("bad.safetensors");
    const char *ok_entry = "\"q_proj.weight\": {\"dtype\": \"F32\", \"shape\": [8, 8], "
                           "\"data_offsets\": [0, 256]}";
    char json[512];

    write_bytes(p, "\x10\0\0", 3);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "the file is 3 bytes, too short");
    snprintf(json, sizeof json, "{%s}", ok_entry);
    stb_write_raw(p, json, 100000, data, sizeof data);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "bad.safetensors: header length 100000 exceeds the file size");
    stb_write_raw(p, json, (uint64_t)1 << 63, data, sizeof data);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "header length 9223372036854775808 exceeds the file size");
    stb_write_raw(p, json, UINT64_MAX, data, sizeof data);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "exceeds the file size");
    /* A sparse 200 MB file whose header claims 150 MB: within the file, over the cap. */
    {
        unsigned char len8[8];
        put_u64le(len8, 150000000);
        FILE *f = fopen(tpath("sparse.safetensors"), "wb");
        if (f) {
            fwrite(len8, 1, 8, f);
            fclose(f);
        }
        CHECK(truncate(tpath("sparse.safetensors"), 200000000) == 0, "truncate");
        CHECK_FAIL(
            mha_layer_load_safetensors(tpath("sparse.safetensors"), NULL, NULL, &c, NULL, &L, &err),
            &err, MHA_STATUS_BAD_FILE, "exceeds the limit of 100000000 bytes");
        remove(tpath("sparse.safetensors"));
    }

    static const struct {
        const char *json, *want;
    } bad[] = {
        {"{\"q_proj.weight\": {\"dtype\": \"F32\", \"shape\": [8, 8], ", "not valid JSON"},
        {"", "not valid JSON"},
        {"[1, 2]", "header is not a JSON object"},
        {"{} x", "unexpected bytes after the JSON header"},
        {"{\"a\": 1}", "tensor 'a': header entry is not a JSON object"},
        {"{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}",
         "tensor 'a': missing or non-string \"dtype\""},
        {"{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", "non-array \"shape\""},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}",
         "shape[0] is not a non-negative integer"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}",
         "shape[0] is not a non-negative integer"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 4294967296], "
         "\"data_offsets\": [0, 4]}}",
         "the element count of its shape overflows"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", "\"data_offsets\" must be an array"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}",
         "\"data_offsets\" must be an array"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4.5]}}",
         "data_offsets are not non-negative integers"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, \"4\"]}}",
         "data_offsets are not non-negative integers"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}",
         "data_offsets are not non-negative integers"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 1e30]}}",
         "data_offsets are not non-negative integers"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [80], \"data_offsets\": [0, 320]}}",
         "data_offsets [0, 320] are outside the 256-byte data buffer"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 4]}}",
         "data_offsets [8, 4] are outside"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}",
         "tensor 'a': data_offsets [0, 12] hold 12 bytes, but shape [2, 2] of F32 needs 16"},
        {"{\"a\": {\"dtype\": \"BF16\", \"shape\": [4], \"data_offsets\": [0, 16]}}",
         "shape [4] of BF16 needs 8"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
         "\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [16, 32]}}",
         "duplicate tensor name 'a'"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
         "\"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}}",
         "tensors 'a' and 'b' overlap"},
        {"{\"__metadata__\": [1]}", "\"__metadata__\" is not a JSON object"},
        /* One JSON policy (issue 28): duplicate keys at any depth, NUL in a key or a string. */
        {"{\"a\": {\"dtype\": \"F32\", \"dtype\": \"BF16\", \"shape\": [4], "
         "\"data_offsets\": [0, 16]}}",
         "duplicate key \"dtype\" (in \"a\")"},
        {"{\"__metadata__\": {\"format\": \"pt\"}, \"__metadata__\": {}}",
         "duplicate key \"__metadata__\""},
        {"{\"__metadata__\": {\"format\": \"pt\", \"format\": \"np\"}}",
         "duplicate key \"format\" (in \"__metadata__\")"},
        {"{\"a\\u0000b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}",
         "key \"a\\u0000b\" contains a NUL character"},
        {"{\"a\": {\"dtype\": \"F32\\u0000x\", \"shape\": [4], \"data_offsets\": [0, 16]}}",
         "the value of \"dtype\" contains a NUL character"},
    };
    /* Every hostile header is refused whatever the weight_dtype asked for (half: no widening). */
    for (size_t i = 0; i < 3 * (sizeof bad / sizeof bad[0]); i++) {
        const size_t k = i % (sizeof bad / sizeof bad[0]);
        static const mha_dtype dts[3] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
        c.weight_dtype = dts[i / (sizeof bad / sizeof bad[0])];
        stb_write_raw(p, bad[k].json, strlen(bad[k].json), data, sizeof data);
        mha_status st = mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err);
        CHECK(st == MHA_STATUS_BAD_FILE && strstr(err.message, bad[k].want) &&
                  strncmp(err.message, p, strlen(p)) == 0 && L == NULL,
              "header %s (weight_dtype %d) -> %s \"%s\"; want BAD_FILE with \"%s\"", bad[k].json,
              (int)c.weight_dtype, mha_status_string(st), err.message, bad[k].want);
    }
    c.weight_dtype = MHA_DTYPE_F32;
    /* An embedded NUL inside the header is junk too. */
    {
        unsigned char buf[16];
        put_u64le(buf, 4);
        memcpy(buf + 8, "{}\0x", 4);
        write_bytes(p, buf, 12);
        CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
                   MHA_STATUS_BAD_FILE, "unexpected bytes after the JSON header");
    }
    /* A valid file with no tensors at all. */
    const char *meta_only = "{\"__metadata__\": {\"format\": \"pt\"}}";
    stb_write_raw(p, meta_only, strlen(meta_only), NULL, 0);
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_NOT_FOUND, "no query weight");
    CHECK(L == NULL, "*out stays NULL");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, NULL, &err), &err,
               MHA_STATUS_INVALID_ARG, "out is NULL");
}

/* ---------------------------------------------------------------------------------------------- */
/* Conversions                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* Independent oracles: round |x| / ulp with rint() (round to nearest even in the default mode). */
static uint16_t oracle_f16(float x) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    const double ax = fabs((double)x);
    if (isnan(x))
        return 0xffff; /* not compared */
    if (ax >= 65520.0)
        return sign | 0x7c00;
    if (ax < 0x1p-14)
        return (uint16_t)(sign | (uint16_t)rint(ax / 0x1p-24));
    int e;
    frexp(ax, &e); /* ax = m 2^e, m in [0.5, 1): unbiased exponent e - 1 */
    const double r = rint(ax / ldexp(1.0, e - 1 - 10)); /* in [1024, 2048] */
    return (uint16_t)(sign | (uint16_t)(((e - 1 + 15) << 10) + ((int)r - 1024)));
}

static uint16_t oracle_bf16(float x) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    const double ax = fabs((double)x);
    if (isnan(x))
        return 0xffff;
    if (ax >= 0x1p128 - 0x1p119)
        return sign | 0x7f80;
    if (ax < 0x1p-126)
        return (uint16_t)(sign | (uint16_t)rint(ax / 0x1p-133));
    int e;
    frexp(ax, &e);
    const double r = rint(ax / ldexp(1.0, e - 1 - 7)); /* in [128, 256] */
    return (uint16_t)(sign | (uint16_t)(((e - 1 + 127) << 7) + ((int)r - 128)));
}

static void test_conversions(void) {
    /* 1. Every f16 and bf16 pattern: widening is exact, narrowing back is the identity. */
    int64_t bad16 = 0, badb16 = 0, badval = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = mha__f16_to_f32((uint16_t)h);
        const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
        double want;
        if (exp == 31)
            want = mant ? (double)NAN : (double)INFINITY;
        else if (exp == 0)
            want = ldexp((double)mant, -24);
        else
            want = ldexp((double)(1024 + mant), (int)exp - 25);
        if (h & 0x8000)
            want = -want;
        if (isnan(want) ? !isnan(f) : ((double)f != want || !!signbit(f) != !!signbit(want)))
            badval++;
        if (mha__f32_to_f16(f) != h)
            bad16++;
        const float g = mha__bf16_to_f32((uint16_t)h);
        if (f32_bits(g) != h << 16 || mha__f32_to_bf16(g) != h)
            badb16++;
    }
    CHECK(badval == 0, "f16 -> f32 value wrong for %lld patterns", (long long)badval);
    CHECK(bad16 == 0, "f16 -> f32 -> f16 not the identity for %lld patterns", (long long)bad16);
    CHECK(badb16 == 0, "bf16 -> f32 -> bf16 not the identity for %lld patterns", (long long)badb16);

    /* 2. Rounding cases. */
    static const struct {
        float x;
        uint16_t f16, bf16;
    } cases[] = {
        {1.0f, 0x3c00, 0x3f80},
        {-0.0f, 0x8000, 0x8000},
        {65504.0f, 0x7bff, 0x4780 /* 65536 */},
        {65519.996f, 0x7bff, 0x4780},
        {65520.0f, 0x7c00 /* tie -> even -> Inf */, 0x4780},
        {1e10f, 0x7c00, 0x5015},
        {-INFINITY, 0xfc00, 0xff80},
        {INFINITY, 0x7c00, 0x7f80},
        {0x1p-24f, 0x0001, 0x3380},
        {0x1p-25f, 0x0000 /* tie -> even 0 */, 0x3300},
        {0x1.000002p-25f, 0x0001, 0x3300},
        {0x3p-25f, 0x0002 /* 1.5 units, tie -> 2 */, 0x33c0},
        {0x5p-25f, 0x0002 /* 2.5 units, tie -> 2 */, 0x3420},
        {0x1p-14f, 0x0400, 0x3880},
        {0x1p-14f - 0x1p-25f, 0x0400 /* 1023.5 units -> 1024 */, 0x3880},
        {0x1p-14f - 0x3p-25f, 0x03fe /* 1022.5 units -> even 1022 */, 0x3880},
        {1.0f + 0x1p-11f, 0x3c00 /* tie -> even */, 0x3f80},
        {1.0f + 0x3p-11f, 0x3c02 /* tie -> even */, 0x3f80},
        {1.0f + 0x1p-8f, 0x3c04, 0x3f80 /* tie -> even */},
        {1.0f + 0x3p-8f, 0x3c0c, 0x3f82 /* tie -> even */},
        {1e-40f, 0x0000, 0x0001 /* subnormal f32: 1e-40 = 71362 * 2^-149 -> 1.09 units */},
        {FLT_MAX, 0x7c00, 0x7f80 /* above bf16's rounding midpoint */},
        {-FLT_MAX, 0xfc00, 0xff80},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const uint16_t h = mha__f32_to_f16(cases[i].x), b = mha__f32_to_bf16(cases[i].x);
        CHECK(h == oracle_f16(cases[i].x) && b == oracle_bf16(cases[i].x),
              "oracle disagrees with the table for %a", (double)cases[i].x);
        CHECK(h == cases[i].f16, "f32 -> f16 of %a: got 0x%04x want 0x%04x", (double)cases[i].x, h,
              cases[i].f16);
        CHECK(b == cases[i].bf16, "f32 -> bf16 of %a: got 0x%04x want 0x%04x", (double)cases[i].x,
              b, cases[i].bf16);
    }
    /* bf16 exact bit cases, including f32 subnormal ties and the overflow midpoint. */
    static const struct {
        uint32_t in;
        uint16_t out;
    } bcases[] = {
        {0x00008000, 0x0000}, {0x00018000, 0x0002}, {0x00008001, 0x0001},
        {0x7f7f7fff, 0x7f7f}, {0x7f7f8000, 0x7f80}, {0x7f7e8000, 0x7f7e},
        {0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x807fffff, 0x8080},
    };
    for (size_t i = 0; i < sizeof bcases / sizeof bcases[0]; i++)
        CHECK(mha__f32_to_bf16(bits_f32(bcases[i].in)) == bcases[i].out,
              "bf16 of 0x%08x: got 0x%04x want 0x%04x", bcases[i].in,
              mha__f32_to_bf16(bits_f32(bcases[i].in)), bcases[i].out);
    /* NaNs stay NaN with their sign, whatever the payload (also payloads only in low bits). */
    const uint32_t nans[] = {0x7fc00000, 0xffc00000, 0x7f800001,
                             0xff800001, 0x7fbfffff, 0x7f802000};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        const uint16_t h = mha__f32_to_f16(bits_f32(nans[i]));
        const uint16_t b = mha__f32_to_bf16(bits_f32(nans[i]));
        CHECK((h & 0x7c00) == 0x7c00 && (h & 0x3ff) && (h >> 15) == (nans[i] >> 31),
              "f16 of NaN 0x%08x: 0x%04x", nans[i], h);
        CHECK((b & 0x7f80) == 0x7f80 && (b & 0x7f) && (b >> 15) == (nans[i] >> 31),
              "bf16 of NaN 0x%08x: 0x%04x", nans[i], b);
    }

    /* 3. Narrowing against the oracle: a strided sweep of all 2^32 floats (stride 257 is odd,
     * so every low-bit pattern, ties included, is visited); every float with MHA_TEST_FULL=1. */
    const char *full = getenv("MHA_TEST_FULL");
    const uint64_t stride = full && full[0] == '1' ? 1 : 257;
    int64_t wrong16 = 0, wrongb = 0, checked = 0;
    uint32_t first16 = 0, firstb = 0;
    for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += stride) {
        const float x = bits_f32((uint32_t)u);
        if (isnan(x))
            continue;
        checked++;
        if (mha__f32_to_f16(x) != oracle_f16(x) && wrong16++ == 0)
            first16 = (uint32_t)u;
        if (mha__f32_to_bf16(x) != oracle_bf16(x) && wrongb++ == 0)
            firstb = (uint32_t)u;
    }
    CHECK(wrong16 == 0, "f32 -> f16: %lld of %lld wrong (first 0x%08x)", (long long)wrong16,
          (long long)checked, first16);
    CHECK(wrongb == 0, "f32 -> bf16: %lld of %lld wrong (first 0x%08x)", (long long)wrongb,
          (long long)checked, firstb);
}

/* ---------------------------------------------------------------------------------------------- */
/* Hugging Face model directories (mha_hf_layer_info_read / mha_hf_layer_load, docs/MODELS.md)   */
/* ---------------------------------------------------------------------------------------------- */

/* A model directory g_dir/<name> with this config.json and one model.safetensors of `b`. */
static const char *hf_dir(const char *name, const char *config, stb *b) {
    const char *dir = tpath(name);
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s: %s", dir, strerror(errno));
    char file[128];
    snprintf(file, sizeof file, "%s/config.json", name);
    write_bytes(tpath(file), config, strlen(config));
    snprintf(file, sizeof file, "%s/model.safetensors", name);
    stb_write(b, file);
    return dir;
}

/* A model directory g_dir/<prefix>_<i> holding only this config.json: mha_hf_layer_info_read
 * refuses it as BAD_FILE with `want` in the message. */
static void
expect_config_refused(const char *prefix, size_t i, const char *config, const char *want) {
    char name[64], file[96];
    snprintf(name, sizeof name, "%s_%zu", prefix, i);
    const char *dir = tpath(name);
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s: %s", dir, strerror(errno));
    snprintf(file, sizeof file, "%s/config.json", name);
    write_bytes(tpath(file), config, strlen(config));
    mha_error err;
    mha_hf_layer_info info;
    CHECK_FAIL(mha_hf_layer_info_read(dir, 0, &info, &err), &err, MHA_STATUS_BAD_FILE, want);
}

/* Row r of the layer's [rows, cols] matrix equals row src_row of the file's `src`, or (transposed)
 * its column src_row. */
static int same_row(const float *w,
                    int64_t r,
                    int64_t cols,
                    const float *src,
                    int64_t src_row,
                    int64_t src_cols,
                    int transposed) {
    for (int64_t c = 0; c < cols; c++) {
        const float want = transposed ? src[c * src_cols + src_row] : src[src_row * cols + c];
        if (w[r * cols + c] != want)
            return 0;
    }
    return 1;
}

/* GPT-2: Conv1D c_attn [in 8, 3 out] transposed then split into q, k, v; c_proj transposed. */
static void test_hf_gpt2(void) {
    mha_error err;
    mha_layer *L = NULL;
    float *attn = values(8 * 24, 11), *attn_b = values(24, 12), *proj = values(8 * 8, 13),
          *proj_b = values(8, 14);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "h.0.attn.c_attn.weight", 8, 24, attn);
    stb_add_f32(&b, "h.0.attn.c_attn.bias", 24, 0, attn_b);
    stb_add_f32(&b, "h.0.attn.c_proj.weight", 8, 8, proj);
    stb_add_f32(&b, "h.0.attn.c_proj.bias", 8, 0, proj_b);
    const char *dir = hf_dir(
        "gpt2", "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1}", &b);
    mha_hf_layer_info info;
    CHECK_OK(mha_hf_layer_info_read(dir, 0, &info, &err), &err);
    CHECK(strcmp(info.prefix, "h.0.attn.") == 0 && info.causal && !info.use_window &&
              info.config.num_heads == 2 && info.config.head_dim == 4 &&
              info.config.rope.style == MHA_ROPE_NONE && info.config.scale == 0.5,
          "gpt2 info: prefix %s causal %d h %lld d %lld scale %g", info.prefix, info.causal,
          (long long)info.config.num_heads, (long long)info.config.head_dim, info.config.scale);
    CHECK_OK(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err);
    if (L) {
        const mha_weights *w = mha_layer_weights(L);
        int ok = 1;
        for (int64_t r = 0; r < 8; r++)
            ok &= same_row(w->w_q, r, 8, attn, r, 24, 1) &&
                  same_row(w->w_k, r, 8, attn, 8 + r, 24, 1) &&
                  same_row(w->w_v, r, 8, attn, 16 + r, 24, 1) &&
                  same_row(w->w_o, r, 8, proj, r, 8, 1) &&
                  ((const float *)w->b_q)[r] == attn_b[r] &&
                  ((const float *)w->b_k)[r] == attn_b[8 + r] &&
                  ((const float *)w->b_v)[r] == attn_b[16 + r] &&
                  ((const float *)w->b_o)[r] == proj_b[r];
        CHECK(ok, "gpt2: c_attn / c_proj transposed and split into q, k, v, o");
    }
    mha_layer_destroy(L);
    CHECK_FAIL(mha_hf_layer_info_read(dir, 1, &info, &err), &err, MHA_STATUS_INVALID_ARG,
               "layer 1 does not exist");
    CHECK_FAIL(mha_hf_layer_load(dir, 0, NULL, NULL, NULL, &err), &err, MHA_STATUS_INVALID_ARG,
               "out is NULL");
    CHECK_FAIL(mha_hf_layer_load(NULL, 0, NULL, NULL, &L, &err), &err, MHA_STATUS_INVALID_ARG,
               "dir is NULL");
    CHECK_FAIL(mha_hf_layer_info_read(dir, 0, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "NULL");
    free(attn), free(attn_b), free(proj), free(proj_b);
}

/* GPT-NeoX rows [h, 3, d] and Falcon's new architecture rows [g, h/g + 2, d]: the block of each
 * head. */
static void test_hf_fused_orders(void) {
    mha_error err;
    mha_layer *L = NULL;
    float *qkv = values(24 * 8, 21), *dense = values(8 * 8, 22);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.query_key_value.weight", 24, 8, qkv);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.dense.weight", 8, 8, dense);
    const char *dir = hf_dir("neox",
                             "{\"model_type\": \"gpt_neox\", \"hidden_size\": 8, "
                             "\"num_attention_heads\": 2, \"num_hidden_layers\": 1, "
                             "\"rotary_pct\": 0.5, \"attention_bias\": false}",
                             &b);
    mha_hf_layer_info info;
    CHECK_OK(mha_hf_layer_info_read(dir, 0, &info, &err), &err);
    CHECK(info.config.rope.style == MHA_ROPE_HALF && info.config.rope.rotary_dim == 2,
          "neox: rotary_pct 0.5 of head_dim 4 = 2, got %lld",
          (long long)info.config.rope.rotary_dim);
    CHECK_OK(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err);
    if (L) {
        const mha_weights *w = mha_layer_weights(L);
        int ok = 1;
        for (int64_t t = 0; t < 2; t++) /* head t: q rows 12t.., k 12t+4.., v 12t+8.. */
            for (int64_t i = 0; i < 4; i++)
                ok &= same_row(w->w_q, 4 * t + i, 8, qkv, 12 * t + i, 8, 0) &&
                      same_row(w->w_k, 4 * t + i, 8, qkv, 12 * t + 4 + i, 8, 0) &&
                      same_row(w->w_v, 4 * t + i, 8, qkv, 12 * t + 8 + i, 8, 0);
        CHECK(ok && !w->b_q, "neox: per-head [q, k, v] blocks, no bias");
    }
    mha_layer_destroy(L);
    L = NULL;

    /* Falcon new_decoder_architecture: h = 4, g = 2, d = 2: blocks [q q k v | q q k v]. */
    stb_init(&b);
    stb_add_f32(&b, "transformer.h.0.self_attention.query_key_value.weight", 16, 8, qkv);
    stb_add_f32(&b, "transformer.h.0.self_attention.dense.weight", 8, 8, dense);
    dir = hf_dir("falcon",
                 "{\"model_type\": \"falcon\", \"hidden_size\": 8, \"num_attention_heads\": 4, "
                 "\"num_hidden_layers\": 1, \"new_decoder_architecture\": true, "
                 "\"num_kv_heads\": 2, \"rope_theta\": 500.0}",
                 &b);
    CHECK_OK(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err);
    if (L) {
        const mha_weights *w = mha_layer_weights(L);
        static const int q_block[4] = {0, 1, 4, 5}, k_block[2] = {2, 6}, v_block[2] = {3, 7};
        int ok = mha_layer_config(L)->num_kv_heads == 2 && mha_layer_config(L)->rope.theta == 500.0;
        for (int64_t i = 0; i < 2; i++) {
            for (int64_t t = 0; t < 4; t++)
                ok &= same_row(w->w_q, 2 * t + i, 8, qkv, 2 * q_block[t] + i, 8, 0);
            for (int64_t t = 0; t < 2; t++)
                ok &= same_row(w->w_k, 2 * t + i, 8, qkv, 2 * k_block[t] + i, 8, 0) &&
                      same_row(w->w_v, 2 * t + i, 8, qkv, 2 * v_block[t] + i, 8, 0);
        }
        CHECK(ok, "falcon new architecture: per-group [queries, k, v] blocks");
    }
    mha_layer_destroy(L);
    free(qkv), free(dense);
}

/* A fused per-head [h, 3, d] tensor with a num_kv_heads override (the CLI's --kv-heads): the
 * tensor [12, 8] of 4 heads of 2 rows, 1 kv head, passes the (h + 2g) d row count but holds 3h
 * blocks only when g = h. It was read past its end (ASan: heap-buffer-overflow); now refused
 * naming the tensor. The same for Falcon's classic order (multi_query: false). */
static void test_hf_fused_override(void) {
    mha_error err;
    mha_layer *L = NULL;
    float *qkv = values(12 * 8, 31), *qkv_b = values(12, 32), *dense = values(8 * 8, 33);
    static const struct {
        const char *name, *prefix, *config;
    } cases[] = {
        {"neox_kv1", "gpt_neox.layers.0.attention.",
         "{\"model_type\": \"gpt_neox\", \"hidden_size\": 8, \"num_attention_heads\": 4, "
         "\"num_hidden_layers\": 1, \"rotary_pct\": 1.0}"},
        {"falcon_kv1", "transformer.h.0.self_attention.",
         "{\"model_type\": \"falcon\", \"hidden_size\": 8, \"num_attention_heads\": 4, "
         "\"num_hidden_layers\": 1, \"multi_query\": false, \"bias\": true}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char w[128], bn[128], o[128];
        snprintf(w, sizeof w, "%squery_key_value.weight", cases[i].prefix);
        snprintf(bn, sizeof bn, "%squery_key_value.bias", cases[i].prefix);
        snprintf(o, sizeof o, "%sdense.weight", cases[i].prefix);
        stb b;
        stb_init(&b);
        stb_add_f32(&b, w, 12, 8, qkv);
        stb_add_f32(&b, bn, 12, 0, qkv_b);
        stb_add_f32(&b, o, 8, 8, dense);
        const char *dir = hf_dir(cases[i].name, cases[i].config, &b);
        mha_hf_layer_info info;
        CHECK_OK(mha_hf_layer_info_read(dir, 0, &info, &err), &err);
        mha_config c = info.config;
        c.num_kv_heads = 1;
        CHECK_FAIL(mha_hf_layer_load(dir, 0, &c, NULL, &L, &err), &err, MHA_STATUS_BAD_FILE,
                   "query_key_value.weight' stores q, k, v per head");
        CHECK(L == NULL, "%s: no layer", cases[i].name);
        CHECK(strstr(err.message, "num_kv_heads must equal num_heads 4, not 1") != NULL, "%s: %s",
              cases[i].name, err.message);
        /* Without the override the [12, 8] tensor is the wrong size for 4 heads: refused too. */
        CHECK_FAIL(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err, MHA_STATUS_BAD_FILE,
                   "has shape [12, 8], expected [24, 8]");
    }
    /* The concatenated orders (GPT-2's c_attn, Phi-3, Falcon multi_query / new) hold h + 2g
     * blocks: an override is checked by the tensor's exact shape (test_hf_gpt2's directory). */
    mha_hf_layer_info info;
    CHECK_OK(mha_hf_layer_info_read(tpath("gpt2"), 0, &info, &err), &err);
    mha_config c = info.config;
    c.num_kv_heads = 1;
    CHECK_FAIL(mha_hf_layer_load(tpath("gpt2"), 0, &c, NULL, &L, &err), &err, MHA_STATUS_BAD_FILE,
               "tensor 'h.0.attn.c_attn.weight' has shape [8, 24], expected [8, 16]");
    /* A 1-d output weight: the message names the tensor once (it said "'x' (x)" before). */
    float *qkv24 = values(24 * 8, 34);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.query_key_value.weight", 24, 8, qkv24);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.dense.weight", 64, 0, dense);
    const char *dir = hf_dir("neox_1d_dense",
                             "{\"model_type\": \"gpt_neox\", \"hidden_size\": 8, "
                             "\"num_attention_heads\": 4, \"num_hidden_layers\": 1, "
                             "\"rotary_pct\": 1.0, \"attention_bias\": false}",
                             &b);
    CHECK_FAIL(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err, MHA_STATUS_BAD_FILE,
               "model.safetensors: tensor 'gpt_neox.layers.0.attention.dense.weight' has shape "
               "[64], expected 2-d");
    free(qkv), free(qkv_b), free(dense), free(qkv24);
}

/* Every file the library reads is opened without blocking and refused unless regular (issue
 * 28: a FIFO as config.json, the index or model.safetensors blocked in fopen forever). The test
 * arms an alarm: a hang kills it (SIGALRM) instead of stalling. */
static void test_hf_fifo_inputs(void) {
    mha_error err;
    mha_hf_layer_info info;
    mha_layer *L = NULL;
    const char *gpt2 = "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1}";
    alarm(60);
    const char *dir = tpath("fifo_config");
    CHECK(mkdir(dir, 0700) == 0, "mkdir");
    CHECK(mkfifo(tpath("fifo_config/config.json"), 0600) == 0, "mkfifo");
    CHECK_FAIL(mha_hf_layer_info_read(dir, 0, &info, &err), &err, MHA_STATUS_IO,
               "config.json: not a regular file (a FIFO)");
    CHECK_FAIL(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err, MHA_STATUS_IO,
               "config.json: not a regular file (a FIFO)");

    dir = tpath("fifo_index");
    CHECK(mkdir(dir, 0700) == 0, "mkdir");
    write_bytes(tpath("fifo_index/config.json"), gpt2, strlen(gpt2));
    CHECK(mkfifo(tpath("fifo_index/model.safetensors.index.json"), 0600) == 0, "mkfifo");
    CHECK_FAIL(mha_hf_layer_info_read(dir, 0, &info, &err), &err, MHA_STATUS_IO,
               "model.safetensors.index.json: not a regular file (a FIFO)");

    dir = tpath("fifo_weights");
    CHECK(mkdir(dir, 0700) == 0, "mkdir");
    write_bytes(tpath("fifo_weights/config.json"), gpt2, strlen(gpt2));
    CHECK(mkfifo(tpath("fifo_weights/model.safetensors"), 0600) == 0, "mkfifo");
    CHECK_FAIL(mha_hf_layer_info_read(dir, 0, &info, &err), &err, MHA_STATUS_IO,
               "model.safetensors: not a regular file (a FIFO)");
    mha_config c;
    memset(&c, 0, sizeof c);
    c.num_heads = 2;
    CHECK_FAIL(mha_layer_load_safetensors(tpath("fifo_weights/model.safetensors"), NULL, NULL, &c,
                                          NULL, &L, &err),
               &err, MHA_STATUS_IO, "model.safetensors: not a regular file (a FIFO)");
    CHECK_FAIL(mha_layer_load_safetensors("/dev/zero", NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_IO, "/dev/zero: not a regular file (a device or socket)");
    CHECK(L == NULL, "no layer");
    alarm(0);
}

/* config.json and the index under the one JSON policy: duplicate keys (cJSON took the first,
 * Python the last) and NUL characters (cJSON cut the string there) are refused by key name. */
static void test_hf_json_policy(void) {
    static const struct {
        const char *config, *want;
    } bad[] = {
        {"{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_head\": 4, "
         "\"n_layer\": 1}",
         "config.json: duplicate key \"n_head\""},
        {"{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1, "
         "\"task_specific_params\": {\"x\": [{\"y\": 1, \"y\": 2}]}}",
         "duplicate key \"y\""},
        {"{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_head\\u0000x\": 4, "
         "\"n_layer\": 1}",
         "config.json: key \"n_head\\u0000x\" contains a NUL character"},
        {"{\"model_type\": \"gpt2\\u0000evil\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1}",
         "config.json: the value of \"model_type\" contains a NUL character"},
        {"{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1, "
         "\"architectures\": [\"GPT2\\u0000LMHeadModel\"]}",
         "the value of \"architectures\" contains a NUL character"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_config_refused("json", i, bad[i].config, bad[i].want);
    mha_error err;
    mha_hf_layer_info info;
    /* The index: a tensor listed twice in weight_map. */
    const char *gpt2 = "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1}";
    const char *index = "{\"weight_map\": {\"h.0.attn.c_attn.weight\": \"a.safetensors\", "
                        "\"h.0.attn.c_attn.weight\": \"b.safetensors\"}}";
    const char *dir = tpath("json_index");
    CHECK(mkdir(dir, 0700) == 0, "mkdir");
    write_bytes(tpath("json_index/config.json"), gpt2, strlen(gpt2));
    write_bytes(tpath("json_index/model.safetensors.index.json"), index, strlen(index));
    CHECK_FAIL(mha_hf_layer_info_read(dir, 0, &info, &err), &err, MHA_STATUS_BAD_FILE,
               "model.safetensors.index.json: duplicate key \"h.0.attn.c_attn.weight\" (in "
               "\"weight_map\")");
}

/* config.json numbers that leave float's range where they are used (issue 28): they gave a
 * non-finite value in the info (LongRoPE's attention factor) or NaN outputs with exit 0. Each is
 * refused by mha_hf_layer_info_read naming the field. */
static void test_hf_float_range(void) {
#define PHI3                                                                                       \
    "{\"model_type\": \"phi3\", \"hidden_size\": 8, \"num_attention_heads\": 2, "                  \
    "\"num_hidden_layers\": 1, \"max_position_embeddings\": 64, \"rope_scaling\": {\"type\": "     \
    "\"longrope\", \"short_factor\": [1.0, 1.5], \"long_factor\": [2.0, 3.0]}, "
#define GEMMA2                                                                                     \
    "{\"model_type\": \"gemma2\", \"hidden_size\": 8, \"num_attention_heads\": 2, "                \
    "\"num_hidden_layers\": 1, \"head_dim\": 4, "
    static const struct {
        const char *config, *want;
    } bad[] = {
        {PHI3 "\"original_max_position_embeddings\": 0.5}",
         "\"rope_scaling.original_max_position_embeddings\" 0.5 must be > 1"},
        {PHI3 "\"original_max_position_embeddings\": 1}",
         "\"rope_scaling.original_max_position_embeddings\" 1 must be > 1"},
        {GEMMA2 "\"attn_logit_softcapping\": 4e38}", "\"attn_logit_softcapping\" 4e+38 is outside"},
        {GEMMA2 "\"attn_logit_softcapping\": 1e-300}",
         "\"attn_logit_softcapping\" 1e-300 is outside"},
        {GEMMA2 "\"query_pre_attn_scalar\": 1e-300}",
         "\"query_pre_attn_scalar\" 1e-300 gives the scale 1/sqrt(1e-300) = 1e+150, outside"},
        {GEMMA2 "\"query_pre_attn_scalar\": 1e300}", "\"query_pre_attn_scalar\" 1e+300 gives"},
        /* a null rope_theta (transformers' RoPE fails on None) was read as the class default */
        {GEMMA2 "\"rope_theta\": null}", "config.json: \"rope_theta\" is null: give a number"},
        {GEMMA2 "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": null}}",
         "\"rope_parameters.rope_theta\" is null"},
    };
#undef PHI3
#undef GEMMA2
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_config_refused("float", i, bad[i].config, bad[i].want);
}

/* mha__npz_write (cli/npz.c): a 0-d member (one element) with data == NULL dereferenced NULL
 * (issue 28); now INVALID_ARG naming the member, nothing written. A valid 0-d member is stored. */
static void test_npz_write_null_data(void) {
    mha_error err;
    const char *p = tpath("s.npz");
    const float one = 1.5f;
    mha__npz_member m;
    memset(&m, 0, sizeof m);
    m.name = "scalar";
    m.dtype = MHA_DTYPE_F32;
    m.ndim = 0;
    m.data = NULL;
    CHECK_FAIL(mha__npz_write(p, &m, 1, &err), &err, MHA_STATUS_INVALID_ARG,
               "member 'scalar' has no data");
    CHECK(access(p, F_OK) != 0, "nothing written for a member without data");
    m.ndim = 2;
    m.shape[0] = 3;
    m.shape[1] = 0; /* no elements: no data needed */
    CHECK_OK(mha__npz_write(p, &m, 1, &err), &err);
    m.shape[1] = 2;
    CHECK_FAIL(mha__npz_write(p, &m, 1, &err), &err, MHA_STATUS_INVALID_ARG,
               "member 'scalar' has no data");
    m.ndim = 0;
    m.data = &one;
    CHECK_OK(mha__npz_write(p, &m, 1, &err), &err);
    unsigned char head[4] = {0};
    FILE *f = fopen(p, "rb");
    CHECK(f && fread(head, 1, 4, f) == 4 && memcmp(head, "PK\3\4", 4) == 0,
          "a 0-d member is written as a zip");
    if (f)
        fclose(f);
    remove(p);
}

/* A bias tensor in the file that the config does not imply is not applied (issue 28: it was):
 * transformers builds no such bias and ignores the tensor, and mha agrees with it
 * (docs/MODELS.md). A bias the config implies is still required. */
static void test_hf_bias_follows_config(void) {
    mha_error err;
    mha_layer *L = NULL;
    float *qkv = values(24 * 8, 41), *qkv_b = values(24, 42), *dense = values(8 * 8, 43),
          *dense_b = values(8, 44);
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.query_key_value.weight", 24, 8, qkv);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.query_key_value.bias", 24, 0, qkv_b);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.dense.weight", 8, 8, dense);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.dense.bias", 8, 0, dense_b);
    const char *dir = hf_dir("neox_nobias",
                             "{\"model_type\": \"gpt_neox\", \"hidden_size\": 8, "
                             "\"num_attention_heads\": 2, \"num_hidden_layers\": 1, "
                             "\"rotary_pct\": 1.0, \"attention_bias\": false}",
                             &b);
    CHECK_OK(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err);
    if (L) {
        const mha_weights *w = mha_layer_weights(L);
        const mha_config *c = mha_layer_config(L);
        CHECK(!w->b_q && !w->b_k && !w->b_v && !w->b_o && !c->bias_q && !c->bias_o,
              "attention_bias false: the file's biases are not applied");
    }
    mha_layer_destroy(L);
    L = NULL;
    /* The config implies biases the file lacks: refused. */
    stb_init(&b);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.query_key_value.weight", 24, 8, qkv);
    stb_add_f32(&b, "gpt_neox.layers.0.attention.dense.weight", 8, 8, dense);
    dir = hf_dir("neox_bias_missing",
                 "{\"model_type\": \"gpt_neox\", \"hidden_size\": 8, \"num_attention_heads\": 2, "
                 "\"num_hidden_layers\": 1, \"rotary_pct\": 1.0}",
                 &b);
    CHECK_FAIL(mha_hf_layer_load(dir, 0, NULL, NULL, &L, &err), &err, MHA_STATUS_NOT_FOUND,
               "query_key_value.bias' (");
    free(qkv), free(qkv_b), free(dense), free(dense_b);
}

/* ---------------------------------------------------------------------------------------------- */
/* Half-precision weights (config.weight_dtype BF16 / F16): no widening                           */
/* ---------------------------------------------------------------------------------------------- */

static void put_halves(unsigned char *dst, const uint16_t *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        dst[2 * i] = (unsigned char)(h[i] & 0xff);
        dst[2 * i + 1] = (unsigned char)(h[i] >> 8);
    }
}

static uint16_t to_half(mha_dtype dt, float x) {
    return dt == MHA_DTYPE_BF16 ? mha__f32_to_bf16(x) : mha__f32_to_f16(x);
}

/* One file of every dtype: q F16, k BF16, v F64, o F32, biases on q (BF16) and o (F32), F32
 * sinks; values multiples of 1/64 in [-2, 2) (exact in every format) but for v[0], a float64 just
 * above the midpoint of two halves of `dt` that float32 cannot tell from the midpoint: rounded
 * once it goes up, through float32 it would tie to even and go down. Loaded with weight_dtype
 * `dt`: the tensors already in dt are their file bytes, the others are rounded once. */
static void check_half_weights(mha_dtype dt) {
    const char *dn = dt == MHA_DTYPE_BF16 ? "bf16" : "f16";
    mha_error err;
    mha_layer *L = NULL;
    float *q = values(64, 41), *k = values(64, 42), *v = values(64, 43), *o = values(64, 44),
          *bq = values(8, 45), *bo = values(8, 46);
    const float sinks[2] = {0.5f, -1.25f};
    uint16_t q16[64], k16[64], bq16[8];
    unsigned char qb[128], kb[128], bqb[16], vb[512];
    for (int i = 0; i < 64; i++) {
        q16[i] = mha__f32_to_f16(q[i]);
        k16[i] = mha__f32_to_bf16(k[i]);
    }
    for (int i = 0; i < 8; i++)
        bq16[i] = mha__f32_to_bf16(bq[i]);
    put_halves(qb, q16, 64);
    put_halves(kb, k16, 64);
    put_halves(bqb, bq16, 8);
    /* 1 + half an ulp of dt at 1 (2^-8 bf16, 2^-11 f16) + 2^-30: below float32's resolution. */
    const double v0 = 1.0 + (dt == MHA_DTYPE_BF16 ? 0x1p-8 : 0x1p-11) + 0x1p-30;
    for (int i = 0; i < 64; i++) {
        const double d = i == 0 ? v0 : (double)v[i];
        uint64_t u;
        memcpy(&u, &d, 8);
        put_u64le(vb + 8 * i, u);
    }
    stb b;
    stb_init(&b);
    stb_add(&b, "q_proj.weight", "F16", "[8, 8]", qb, sizeof qb);
    stb_add(&b, "q_proj.bias", "BF16", "[8]", bqb, sizeof bqb);
    stb_add(&b, "k_proj.weight", "BF16", "[8, 8]", kb, sizeof kb);
    stb_add(&b, "v_proj.weight", "F64", "[8, 8]", vb, sizeof vb);
    stb_add_f32(&b, "o_proj.weight", 8, 8, o);
    stb_add_f32(&b, "o_proj.bias", 8, 0, bo);
    stb_add_f32(&b, "sinks", 2, 0, sinks);
    const char *p =
        stb_write(&b, dt == MHA_DTYPE_BF16 ? "half_bf16.safetensors" : "half_f16.safetensors");
    mha_config c = cfg_heads(2, 0);
    c.weight_dtype = dt;
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_config *r = mha_layer_config(L);
        const mha_weights *w = mha_layer_weights(L);
        const uint16_t *wq = w->w_q, *wk = w->w_k, *wv = w->w_v, *wo = w->w_o, *wbq = w->b_q,
                       *wbo = w->b_o, *ws = w->sinks;
        CHECK(r->weight_dtype == dt, "%s: the layer's weight_dtype is %d", dn,
              (int)r->weight_dtype);
        int q_ok = 1, k_ok = 1, v_ok = 1, o_ok = 1, b_ok = 1;
        for (int i = 0; i < 64; i++) {
            q_ok &= wq[i] == to_half(dt, q[i]);
            k_ok &= wk[i] == to_half(dt, k[i]);
            v_ok &= i == 0 || wv[i] == to_half(dt, v[i]);
            o_ok &= wo[i] == to_half(dt, o[i]);
        }
        for (int i = 0; i < 8; i++)
            b_ok &= wbq[i] == to_half(dt, bq[i]) && wbo[i] == to_half(dt, bo[i]);
        CHECK(q_ok && k_ok && o_ok && b_ok, "%s: every tensor in %s", dn, dn);
        if (dt == MHA_DTYPE_F16)
            CHECK(memcmp(wq, qb, sizeof qb) == 0, "f16: the F16 weight is the file's bytes");
        else
            CHECK(memcmp(wk, kb, sizeof kb) == 0 && memcmp(wbq, bqb, sizeof bqb) == 0,
                  "bf16: the BF16 weight and bias are the file's bytes");
        const uint16_t up = dt == MHA_DTYPE_BF16 ? 0x3f81 : 0x3c01; /* 1 + one ulp */
        CHECK(v_ok && wv[0] == up, "%s: F64 rounded once (v[0] = 0x%04x, want 0x%04x)", dn, wv[0],
              up);
        CHECK(ws[0] == to_half(dt, 0.5f) && ws[1] == to_half(dt, -1.25f), "%s: sinks", dn);
    }
    mha_layer_destroy(L);
    free(q), free(k), free(v), free(o), free(bq), free(bo);
}

static void test_st_half_weights(void) {
    check_half_weights(MHA_DTYPE_BF16);
    check_half_weights(MHA_DTYPE_F16);
    mha_error err;
    mha_layer *L = NULL;
    mha_config c = cfg_heads(2, 0);
    /* A float32 weight beyond float16's range, and a BF16 Inf kept as its bytes: refused. */
    float *w = values(64, 47);
    w[9] = 70000.0f;
    stb b;
    stb_init(&b);
    stb_add_f32(&b, "q_proj.weight", 8, 8, w);
    stb_add_f32(&b, "k_proj.weight", 8, 8, w);
    stb_add_f32(&b, "v_proj.weight", 8, 8, w);
    stb_add_f32(&b, "o_proj.weight", 8, 8, w);
    const char *p = stb_write(&b, "half_range.safetensors");
    c.weight_dtype = MHA_DTYPE_F16;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE,
               "tensor 'q_proj.weight' element [1, 1] = 70000 is beyond float16's range");
    c.weight_dtype = MHA_DTYPE_BF16;
    CHECK_OK(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err);
    mha_layer_destroy(L);
    L = NULL;
    uint16_t inf16[64];
    unsigned char infb[128];
    for (int i = 0; i < 64; i++)
        inf16[i] = i == 5 ? 0x7f80 : mha__f32_to_bf16(w[i]);
    put_halves(infb, inf16, 64);
    stb_init(&b);
    stb_add(&b, "q_proj.weight", "BF16", "[8, 8]", infb, sizeof infb);
    stb_add_f32(&b, "k_proj.weight", 8, 8, w);
    stb_add_f32(&b, "v_proj.weight", 8, 8, w);
    stb_add_f32(&b, "o_proj.weight", 8, 8, w);
    p = stb_write(&b, "half_inf.safetensors");
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_BAD_FILE, "tensor 'q_proj.weight' element [0, 5] is infinite");
    c.weight_dtype = MHA_DTYPE_F64;
    CHECK_FAIL(mha_layer_load_safetensors(p, NULL, NULL, &c, NULL, &L, &err), &err,
               MHA_STATUS_INVALID_ARG, "config.weight_dtype=1 is not");
    CHECK(L == NULL, "*out stays NULL");
    free(w);
}

/* GPT-2 in BF16 loaded with weight_dtype BF16: c_attn [8, 24] transposed and split, c_proj
 * transposed, all as the file's 16-bit patterns (moved, never widened). */
static void test_hf_half_gpt2(void) {
    mha_error err;
    mha_layer *L = NULL;
    float *attn = values(8 * 24, 51), *attn_b = values(24, 52), *proj = values(8 * 8, 53),
          *proj_b = values(8, 54);
    uint16_t a16[8 * 24], ab16[24], p16[64], pb16[8];
    unsigned char ab[2 * 8 * 24], abb[48], pb[128], pbb[16];
    for (int i = 0; i < 8 * 24; i++)
        a16[i] = mha__f32_to_bf16(attn[i]) ^ (uint16_t)(i & 1); /* a low bit set: not values() */
    for (int i = 0; i < 24; i++)
        ab16[i] = mha__f32_to_bf16(attn_b[i]);
    for (int i = 0; i < 64; i++)
        p16[i] = mha__f32_to_bf16(proj[i]) ^ (uint16_t)(i & 1);
    for (int i = 0; i < 8; i++)
        pb16[i] = mha__f32_to_bf16(proj_b[i]);
    put_halves(ab, a16, 8 * 24);
    put_halves(abb, ab16, 24);
    put_halves(pb, p16, 64);
    put_halves(pbb, pb16, 8);
    stb b;
    stb_init(&b);
    stb_add(&b, "h.0.attn.c_attn.weight", "BF16", "[8, 24]", ab, sizeof ab);
    stb_add(&b, "h.0.attn.c_attn.bias", "BF16", "[24]", abb, sizeof abb);
    stb_add(&b, "h.0.attn.c_proj.weight", "BF16", "[8, 8]", pb, sizeof pb);
    stb_add(&b, "h.0.attn.c_proj.bias", "BF16", "[8]", pbb, sizeof pbb);
    const char *dir =
        hf_dir("gpt2_bf16",
               "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 1}", &b);
    mha_hf_layer_info info;
    CHECK_OK(mha_hf_layer_info_read(dir, 0, &info, &err), &err);
    CHECK(info.config.weight_dtype == MHA_DTYPE_F32, "info: weight_dtype float32 by default");
    mha_config c = info.config;
    c.weight_dtype = MHA_DTYPE_BF16;
    CHECK_OK(mha_hf_layer_load(dir, 0, &c, NULL, &L, &err), &err);
    if (L) {
        const mha_weights *w = mha_layer_weights(L);
        const uint16_t *wq = w->w_q, *wk = w->w_k, *wv = w->w_v, *wo = w->w_o;
        int ok = mha_layer_config(L)->weight_dtype == MHA_DTYPE_BF16;
        for (int64_t r = 0; r < 8; r++) {
            for (int64_t col = 0; col < 8; col++)
                ok &= wq[r * 8 + col] == a16[col * 24 + r] &&
                      wk[r * 8 + col] == a16[col * 24 + 8 + r] &&
                      wv[r * 8 + col] == a16[col * 24 + 16 + r] &&
                      wo[r * 8 + col] == p16[col * 8 + r];
            ok &= ((const uint16_t *)w->b_q)[r] == ab16[r] &&
                  ((const uint16_t *)w->b_k)[r] == ab16[8 + r] &&
                  ((const uint16_t *)w->b_v)[r] == ab16[16 + r] &&
                  ((const uint16_t *)w->b_o)[r] == pb16[r];
        }
        CHECK(ok, "gpt2 bf16: transposed and split as the file's bytes");
    }
    mha_layer_destroy(L);
    L = NULL;
    c.weight_dtype = MHA_DTYPE_I32;
    CHECK_FAIL(mha_hf_layer_load(dir, 0, &c, NULL, &L, &err), &err, MHA_STATUS_INVALID_ARG,
               "config.weight_dtype=6 is not");
    free(attn), free(attn_b), free(proj), free(proj_b);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/mha_test_io_XXXXXX");
    if (!mkdtemp(g_dir)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    test_conversions();
    test_npy_write_roundtrip();
    test_npy_dtypes();
    test_npy_half();
    test_npy_errors();
    test_st_hf();
    test_st_torch_mha();
    test_st_names_prefix_dtypes();
    test_st_allocator();
    test_st_file_errors();
    test_st_half_weights();
    test_hf_half_gpt2();
    test_hf_gpt2();
    test_hf_fused_orders();
    test_hf_fused_override();
    test_npz_write_null_data();
    test_hf_bias_follows_config();
    test_hf_float_range();
    test_hf_json_policy();
    test_hf_fifo_inputs();
    remove_tree(g_dir);
    return test_finish();
}

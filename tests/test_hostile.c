/* SPDX-License-Identifier: MIT */
/* test_hostile.c: the committed hostile-file set (tests/data/hostile/, made by make_hostile.py).
 *
 * expected.json lists every crafted bad file with the exact status its reader must return and a
 * substring of the message. Each .npy goes through mha__npy_read() and mha__npy_parse(); each
 * safetensors file through mha_layer_load_safetensors() (num_heads 2, with and without a counting
 * allocator that must end with nothing live) and through the in-memory entry point, which must
 * agree. Every message must name the file. Leaks are ASan's job (the sanitizer run of ctest).
 * Also here: regression tests for the inputs the fuzzers (fuzz/) found crashing.
 */
#define _POSIX_C_SOURCE 200809L

#include "base/internal.h"
#include "harness.h"
#include "io/safetensors.h"
#include "npy.h"

#include <cjson/cJSON.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name;
    mha_status status;
} STATUS_NAMES[] = {
#define STATUS_NAME_(name, value, text) {#name, MHA_STATUS_##name},
    MHA_STATUS_MAP(STATUS_NAME_)
#undef STATUS_NAME_
};

static int status_from_name(const char *s, mha_status *out) {
    for (size_t i = 0; i < sizeof STATUS_NAMES / sizeof STATUS_NAMES[0]; i++)
        if (strcmp(STATUS_NAMES[i].name, s) == 0) {
            *out = STATUS_NAMES[i].status;
            return 1;
        }
    return 0;
}

/* Whole file into memory (NULL on error); *len gets its size. */
static unsigned char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            unsigned char *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b;
            cap *= 2;
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

typedef struct counting {
    int64_t live, calls;
} counting;

static void *count_alloc(void *user, size_t bytes, size_t align) {
    counting *c = user;
    void *p = aligned_alloc(align, (bytes + align - 1) / align * align);
    if (p) {
        c->live++;
        c->calls++;
    }
    return p;
}

static void count_free(void *user, void *ptr) {
    counting *c = user;
    if (ptr)
        c->live--;
    free(ptr);
}

static void check_result(const char *file,
                         const char *how,
                         mha_status st,
                         const mha_error *err,
                         mha_status want,
                         const char *substr,
                         const char *path) {
    CHECK(st == want && err->status == want, "%s (%s): status %s, want %s; message \"%s\"", file,
          how, mha_status_string(st), mha_status_string(want), err->message);
    if (want != MHA_STATUS_OK) {
        CHECK(strstr(err->message, substr) != NULL, "%s (%s): message \"%s\" lacks \"%s\"", file,
              how, err->message, substr);
        CHECK(strncmp(err->message, path, strlen(path)) == 0,
              "%s (%s): message \"%s\" does not start with the file name", file, how, err->message);
    }
}

static void run_npy(const char *file, const char *path, mha_status want, const char *substr) {
    mha__npy a;
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha__npy_read(path, &a, &err);
    check_result(file, "npy_read", st, &err, want, substr, path);
    if (st == MHA_STATUS_OK) {
        float *f = NULL;
        CHECK_OK(mha__npy_to_f32(&a, path, &f, &err), &err);
        free(f);
    } else {
        CHECK(a.data == NULL && a.count == 0, "%s: result not empty on error", file);
    }
    mha__npy_free(&a);

    size_t len = 0;
    unsigned char *buf = slurp(path, &len);
    CHECK(buf != NULL, "%s: cannot read", path);
    if (!buf)
        return;
    memset(&err, 0, sizeof err);
    st = mha__npy_parse(buf, len, path, &a, &err);
    check_result(file, "npy_parse", st, &err, want, substr, path);
    mha__npy_free(&a);
    free(buf);
}

static void
run_safetensors(const char *file, const char *path, mha_status want, const char *substr) {
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_heads = 2;
    mha_error err;
    mha_layer *L = NULL;
    memset(&err, 0, sizeof err);
    mha_status st = mha_layer_load_safetensors(path, NULL, NULL, &cfg, NULL, &L, &err);
    check_result(file, "load", st, &err, want, substr, path);
    CHECK((st == MHA_STATUS_OK) == (L != NULL), "%s: layer pointer and status disagree", file);
    mha_layer_destroy(L);

    counting c = {0, 0};
    mha_allocator al = {&c, count_alloc, count_free};
    L = NULL;
    st = mha_layer_load_safetensors(path, NULL, NULL, &cfg, &al, &L, &err);
    check_result(file, "load, allocator", st, &err, want, substr, path);
    mha_layer_destroy(L);
    CHECK(c.live == 0, "%s: %lld allocations not given back", file, (long long)c.live);

    size_t len = 0;
    unsigned char *buf = slurp(path, &len);
    CHECK(buf != NULL, "%s: cannot read", path);
    if (!buf)
        return;
    L = NULL;
    st = mha__safetensors_load_mem(buf, len, path, NULL, NULL, &cfg, NULL, &L, &err);
    check_result(file, "load_mem", st, &err, want, substr, path);
    mha_layer_destroy(L);
    free(buf);
}

static void test_hostile_files(void) {
    char *list_path = test_source_path("tests/data/hostile/expected.json");
    size_t len = 0;
    unsigned char *text = slurp(list_path, &len);
    CHECK(text != NULL, "cannot read %s (set MHA_SOURCE_DIR)", list_path);
    cJSON *root = text ? cJSON_ParseWithLength((const char *)text, len) : NULL;
    CHECK(!text || root != NULL, "%s is not valid JSON", list_path);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(root, "cases");
    int n = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const cJSON *file = cJSON_GetObjectItemCaseSensitive(c, "file");
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(c, "kind");
        const cJSON *status = cJSON_GetObjectItemCaseSensitive(c, "status");
        const cJSON *message = cJSON_GetObjectItemCaseSensitive(c, "message");
        mha_status want;
        if (!cJSON_IsString(file) || !cJSON_IsString(kind) || !cJSON_IsString(status) ||
            !cJSON_IsString(message) || !status_from_name(status->valuestring, &want)) {
            CHECK(0, "malformed case #%d in expected.json", n);
            continue;
        }
        char rel[512];
        snprintf(rel, sizeof rel, "tests/data/hostile/%s", file->valuestring);
        char *path = test_source_path(rel);
        if (strcmp(kind->valuestring, "npy") == 0)
            run_npy(file->valuestring, path, want, message->valuestring);
        else
            run_safetensors(file->valuestring, path, want, message->valuestring);
        free(path);
        n++;
    }
    CHECK(n >= 50, "only %d hostile cases listed", n);
    printf("hostile files: %d cases\n", n);
    cJSON_Delete(root);
    free(text);
    free(list_path);
}

/* ---------------------------------------------------------------------------------------------- */
/* Regressions found by the fuzzers                                                               */
/* ---------------------------------------------------------------------------------------------- */

/* Found by fuzz_api (UBSan: signed overflow in mha__flash_key_range): a window side of INT64_MAX
 * overflowed `i + delta + window_right` (signed overflow, UB; in practice every key was masked
 * out). A side larger than any distance must behave exactly like an unbounded (-1) side. */
static void test_window_int64_max(void) {
    enum { B = 1, H = 2, N = 5, M = 7, D = 4 };
    float q[B * H * N * D], k[B * H * M * D], v[B * H * M * D];
    test_rng rng;
    test_rng_seed(&rng, 11);
    test_fill_normal(&rng, q, B * H * N * D, 1.0f);
    test_fill_normal(&rng, k, B * H * M * D, 1.0f);
    test_fill_normal(&rng, v, B * H * M * D, 1.0f);
    const int64_t sides[][2] = {
        {INT64_MAX, INT64_MAX}, {INT64_MAX, -1}, {-1, INT64_MAX}, {((int64_t)1 << 62), 2}};
    const mha_impl impls[] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (size_t s = 0; s < sizeof sides / sizeof sides[0]; s++)
        for (int causal = 0; causal < 2; causal++)
            for (size_t im = 0; im < 2; im++) {
                float out[2][B * H * N * D];
                for (int pass = 0; pass < 2; pass++) {
                    mha_attention_args a;
                    memset(&a, 0, sizeof a);
                    a.batch = B;
                    a.num_heads = H;
                    a.q_len = N;
                    a.kv_len = M;
                    a.head_dim = D;
                    a.q = q;
                    a.k = k;
                    a.v = v;
                    a.out = out[pass];
                    const int64_t qs[3] = {H * N * D, N * D, D}, ks[3] = {H * M * D, M * D, D};
                    memcpy(a.q_strides, qs, sizeof qs);
                    memcpy(a.out_strides, qs, sizeof qs);
                    memcpy(a.k_strides, ks, sizeof ks);
                    memcpy(a.v_strides, ks, sizeof ks);
                    a.mask.causal = causal;
                    a.mask.use_window = 1;
                    /* pass 0: the huge sides; pass 1: the same with huge -> -1 (unbounded) */
                    a.mask.window_left = pass && sides[s][0] > M + N ? -1 : sides[s][0];
                    a.mask.window_right = pass && sides[s][1] > M + N ? -1 : sides[s][1];
                    mha_exec ex = {impls[im], 1, NULL, 0, NULL, NULL};
                    mha_error err;
                    CHECK_OK(mha_attention(&a, &ex, &err), &err);
                }
                CHECK(
                    memcmp(out[0], out[1], sizeof out[0]) == 0,
                    "window (%lld, %lld) causal=%d impl=%d differs from the unbounded window (fix: "
                    "src/check/attention.c must map window sides > 2^33 to -1)",
                    (long long)sides[s][0], (long long)sides[s][1], causal, (int)impls[im]);
            }
}

int main(void) {
    test_hostile_files();
    test_window_int64_max();
    return test_finish();
}

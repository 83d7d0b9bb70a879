/* SPDX-License-Identifier: MIT */
/* harness.c: check counting, seeded RNG and comparison helpers for the C tests. */
#include "harness.h"
#include "mha_experimental.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static int g_passed, g_failed;

void test_record(int ok, const char *file, int line, const char *fmt, ...) {
    if (ok) {
        g_passed++;
        return;
    }
    g_failed++;
    fprintf(stderr, "FAIL %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

int test_finish(void) {
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 && g_passed > 0 ? 0 : 1;
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

void test_rng_seed(test_rng *r, uint64_t seed) {
    /* splitmix64 to spread the seed over the state */
    for (int i = 0; i < 4; i++) {
        seed += 0x9E3779B97F4A7C15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        r->s[i] = z ^ (z >> 31);
    }
}

uint64_t test_rng_u64(test_rng *r) {
    uint64_t *s = r->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double test_rng_uniform(test_rng *r) {
    return (double)(test_rng_u64(r) >> 11) * 0x1.0p-53;
}

double test_rng_normal(test_rng *r) {
    double u1 = test_rng_uniform(r), u2 = test_rng_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void test_fill_normal(test_rng *r, float *x, int64_t n, float stddev) {
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(test_rng_normal(r) * (double)stddev);
}

char *test_source_path(const char *relative) {
    const char *root = getenv("MHA_SOURCE_DIR");
    if (!root)
        root = ".";
    size_t len = strlen(root) + strlen(relative) + 2;
    char *p = malloc(len);
    if (p)
        snprintf(p, len, "%s/%s", root, relative);
    return p;
}

double test_max_abs_diff(const float *a, const double *b, int64_t n) {
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (isnan(d) && !(isnan(a[i]) && isnan(b[i])))
            return (double)INFINITY;
        if (d > worst)
            worst = d;
    }
    return worst;
}

double test_max_abs(const double *b, int64_t n) {
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(b[i]) > worst)
            worst = fabs(b[i]);
    return worst;
}

void test_layer_decode_steps(
    mha_layer *L, const float *x, int64_t B, int64_t N, int64_t E, int64_t prefill, float *y) {
    mha_error err;
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.max_seq = N, kc.batch = B;
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &cache, &err), &err);
    float *xs = malloc(sizeof(float) * (size_t)(B * N * E));
    float *ys = malloc(sizeof(float) * (size_t)(B * N * E));
    CHECK(xs && ys, "decode steps: out of memory");
    for (int64_t t0 = 0, t; cache && xs && ys && t0 < N; t0 += t) {
        t = t0 == 0 ? (prefill < N ? prefill : N) : 1;
        for (int64_t b = 0; b < B; b++)
            memcpy(xs + b * t * E, x + (b * N + t0) * E, sizeof(float) * (size_t)(t * E));
        mha_decode_args d;
        memset(&d, 0, sizeof d);
        d.num_seqs = B, d.num_tokens = t, d.x = xs, d.out = ys;
        CHECK_OK(t0 == 0 ? mha_layer_prefill(L, cache, &d, NULL, &err)
                         : mha_layer_decode_step(L, cache, &d, NULL, &err),
                 &err);
        for (int64_t b = 0; b < B; b++)
            memcpy(y + (b * N + t0) * E, ys + b * t * E, sizeof(float) * (size_t)(t * E));
    }
    free(xs);
    free(ys);
    mha_kv_cache_destroy(cache);
}

int test_quick(void) {
    const char *q = getenv("MHA_TEST_QUICK");
    return q && q[0] && q[0] != '0';
}

int test_generic_decode(void) {
    mha_kernel_desc d;
    const int32_t i = mha_experimental_kernel_active("decode");
    return i >= 0 && mha_experimental_kernel_describe(i, &d, NULL) == MHA_STATUS_OK &&
           strstr(d.name, "__generic") != NULL;
}

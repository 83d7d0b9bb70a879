/* SPDX-License-Identifier: MIT */
/* test_gguf.c: the GGUF reader (src/io/gguf.c) on files built here byte by byte.
 *
 * A small llama file (2 layers, hidden 32, 2 heads of 16, 1 kv head; Q in F16, K in BF16, V in
 * Q8_0, O in F32, with keys of every value type, nested arrays and strings around the ones read)
 * loads, and its weights are exactly the values written with llama.cpp's Q/K row permutation
 * undone (checked element by element against the un-permuted source, computed here
 * independently). Then hostile forms of it: every truncation, every single-byte corruption of the
 * header, metadata and tensor infos (and a strided sample of the data), and hand-made bad fields
 * (magic, version 1, big-endian, huge counts and lengths, alignment, offsets, overlapping data,
 * duplicates, NaN weights, unknown types) each fail with a status and a message naming the problem;
 * none may crash (the sanitizer builds run this too).
 */
#define _POSIX_C_SOURCE 200809L

#include "base/internal.h"
#include "harness.h"
#include "io/gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* A growing byte buffer                                                                          */
/* ---------------------------------------------------------------------------------------------- */

typedef struct buf {
    unsigned char *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p)
            abort();
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_le(buf *b, uint64_t v, int bytes) {
    unsigned char x[8];
    for (int i = 0; i < bytes; i++)
        x[i] = (unsigned char)(v >> (8 * i));
    put(b, x, (size_t)bytes);
}
static void put_str(buf *b, const char *s) {
    put_le(b, strlen(s), 8);
    put(b, s, strlen(s));
}
static void kv_u32(buf *b, const char *key, uint32_t v) {
    put_str(b, key);
    put_le(b, MHA__GGUF_U32, 4);
    put_le(b, v, 4);
}
static void kv_f32(buf *b, const char *key, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    put_str(b, key);
    put_le(b, MHA__GGUF_F32, 4);
    put_le(b, u, 4);
}
static void kv_str(buf *b, const char *key, const char *v) {
    put_str(b, key);
    put_le(b, MHA__GGUF_STRING, 4);
    put_str(b, v);
}

/* ---------------------------------------------------------------------------------------------- */
/* The reference file                                                                             */
/* ---------------------------------------------------------------------------------------------- */

enum { HID = 32, NH = 2, NKV = 1, HD = 16, LAYERS = 2, ALIGN = 32 };
#define N_KV      14
#define N_TENSORS (4 * LAYERS)

/* The source weights (HF order, nn.Linear [out, in]) of layer L: q, k, v, o. */
static float src_w(int L, int which, int r, int c) {
    return (float)sin(0.37 * (r + 1) + 0.11 * (c + 1) * (which + 1) + L) * 0.5f;
}

/* The values the file holds, in HF order, and what it stores per type. */
static float f16_round(float x) {
    return mha__f16_to_f32(mha__f32_to_f16(x));
}
static float bf16_round(float x) {
    return mha__bf16_to_f32(mha__f32_to_bf16(x));
}

/* llama.cpp's row order: file row 2j + s of a head holds HF row s * HD/2 + j. */
static int hf_row_of_file_row(int r) {
    const int in = r % HD;
    return r - in + (in % 2) * (HD / 2) + in / 2;
}

typedef struct tensor_spec {
    char name[64];
    uint32_t type;
    int rows, cols;
    int L, which;
    uint64_t offset, bytes;
} tensor_spec;

static uint64_t type_bytes(uint32_t type, int rows, int cols) {
    switch (type) {
    case MHA__GGML_F32:
        return (uint64_t)rows * cols * 4;
    case MHA__GGML_Q8_0:
        return (uint64_t)rows * (cols / 32) * 34;
    default:
        return (uint64_t)rows * cols * 2;
    }
}

static void put_row(buf *b, const tensor_spec *t, int file_row) {
    const int permuted = t->which <= 1;
    const int r = permuted ? hf_row_of_file_row(file_row) : file_row;
    float v[HID * NH];
    for (int c = 0; c < t->cols; c++)
        v[c] = src_w(t->L, t->which, r, c);
    if (t->type == MHA__GGML_Q8_0) {
        unsigned char blocks[(HID * NH / 32) * 34];
        mha__q8_quantize(v, t->cols, blocks);
        put(b, blocks, (size_t)(t->cols / 32) * 34);
        return;
    }
    for (int c = 0; c < t->cols; c++) {
        if (t->type == MHA__GGML_F32) {
            uint32_t u;
            memcpy(&u, &v[c], 4);
            put_le(b, u, 4);
        } else
            put_le(b, t->type == MHA__GGML_F16 ? mha__f32_to_f16(v[c]) : mha__f32_to_bf16(v[c]), 2);
    }
}

/* The expected weight (HF order) of tensor `which` of layer L as the loader gives it (float32). */
static float expected(int which, int L, int r, int c, const float *q8_row) {
    const float v = src_w(L, which, r, c);
    switch (which) {
    case 0:
        return f16_round(v);
    case 1:
        return bf16_round(v);
    case 2:
        return q8_row[c];
    default:
        return v;
    }
}

static void make_specs(tensor_spec *ts) {
    static const char *const stems[4] = {"attn_q", "attn_k", "attn_v", "attn_output"};
    static const uint32_t types[4] = {MHA__GGML_F16, MHA__GGML_BF16, MHA__GGML_Q8_0, MHA__GGML_F32};
    const int rows[4] = {NH * HD, NKV * HD, NKV * HD, HID};
    const int cols[4] = {HID, HID, HID, NH * HD};
    uint64_t off = 0;
    for (int L = 0; L < LAYERS; L++)
        for (int w = 0; w < 4; w++) {
            tensor_spec *t = &ts[L * 4 + w];
            snprintf(t->name, sizeof t->name, "blk.%d.%s.weight", L, stems[w]);
            t->type = types[w], t->rows = rows[w], t->cols = cols[w], t->L = L, t->which = w;
            t->offset = off;
            t->bytes = type_bytes(t->type, t->rows, t->cols);
            off += (t->bytes + ALIGN - 1) / ALIGN * ALIGN;
        }
}

/* The whole file with `n_extra` more keys written by `extra` (NULL: none). version: 3
 * normally. */
static buf make_file_kv(uint32_t version, void (*extra)(buf *), int n_extra) {
    buf b = {0};
    put(&b, "GGUF", 4);
    put_le(&b, version, 4);
    put_le(&b, N_TENSORS, 8);
    put_le(&b, (uint64_t)(N_KV + n_extra), 8);
    if (extra)
        extra(&b);
    kv_str(&b, "general.architecture", "llama");
    kv_str(&b, "general.name", "tiny");
    kv_u32(&b, "general.alignment", ALIGN);
    kv_u32(&b, "llama.block_count", LAYERS);
    kv_u32(&b, "llama.context_length", 64);
    kv_u32(&b, "llama.embedding_length", HID);
    kv_u32(&b, "llama.attention.head_count", NH);
    kv_u32(&b, "llama.attention.head_count_kv", NKV);
    kv_f32(&b, "llama.rope.freq_base", 10000.0f);
    kv_f32(&b, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    /* every other value type, unread: u8 i8 u16 i16 i32 bool u64 i64 f64 */
    put_str(&b, "test.scalars");
    put_le(&b, MHA__GGUF_ARRAY, 4);
    put_le(&b, MHA__GGUF_ARRAY, 4);
    put_le(&b, 2, 8);
    put_le(&b, MHA__GGUF_U8, 4), put_le(&b, 3, 8), put_le(&b, 0x010203, 3);
    put_le(&b, MHA__GGUF_F64, 4), put_le(&b, 1, 8), put_le(&b, 0x3ff0000000000000ull, 8);
    put_str(&b, "test.strings");
    put_le(&b, MHA__GGUF_ARRAY, 4);
    put_le(&b, MHA__GGUF_STRING, 4);
    put_le(&b, 3, 8);
    put_str(&b, "a"), put_str(&b, ""), put_str(&b, "<s>");
    put_str(&b, "test.bool");
    put_le(&b, MHA__GGUF_BOOL, 4);
    put_le(&b, 1, 1);
    put_str(&b, "test.i64");
    put_le(&b, MHA__GGUF_I64, 4);
    put_le(&b, (uint64_t)-5, 8);
    tensor_spec ts[N_TENSORS];
    make_specs(ts);
    for (int i = 0; i < N_TENSORS; i++) {
        put_str(&b, ts[i].name);
        put_le(&b, 2, 4);
        put_le(&b, (uint64_t)ts[i].cols, 8);
        put_le(&b, (uint64_t)ts[i].rows, 8);
        put_le(&b, ts[i].type, 4);
        put_le(&b, ts[i].offset, 8);
    }
    while (b.n % ALIGN)
        put_le(&b, 0, 1);
    const size_t data = b.n;
    for (int i = 0; i < N_TENSORS; i++) {
        while (b.n < data + ts[i].offset)
            put_le(&b, 0, 1);
        for (int r = 0; r < ts[i].rows; r++)
            put_row(&b, &ts[i], r);
    }
    return b;
}

static buf make_file(uint32_t version) {
    return make_file_kv(version, NULL, 0);
}

/* ---------------------------------------------------------------------------------------------- */
/* Tests                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

static mha_status load(const buf *b, int64_t layer, mha_layer **out, mha_error *err) {
    mha__gguf *g = NULL;
    *out = NULL;
    mha_status st = mha__gguf_open_mem(b->p, b->n, "t.gguf", &g, err);
    if (st == MHA_STATUS_OK)
        st = mha__gguf_load(g, layer, NULL, NULL, out, err);
    mha__gguf_close(g);
    return st;
}

static void test_valid_file(void) {
    buf b = make_file(3);
    for (int L = 0; L < LAYERS; L++) {
        mha_layer *layer = NULL;
        mha_error err;
        CHECK_OK(load(&b, L, &layer, &err), &err);
        if (!layer)
            continue;
        const mha_config *c = mha_layer_config(layer);
        CHECK(c->num_heads == NH && c->num_kv_heads == NKV && c->head_dim == HD &&
                  c->q_dim == HID && c->weight_dtype == MHA_DTYPE_F32,
              "layer %d: config", L);
        CHECK(c->rope.style == MHA_ROPE_HALF && c->rope.theta == 10000.0 &&
                  c->rope.rotary_dim == HD,
              "layer %d: rope", L);
        const mha_weights *w = mha_layer_weights(layer);
        const float *ws[4] = {w->w_q, w->w_k, w->w_v, w->w_o};
        const int rows[4] = {NH * HD, NKV * HD, NKV * HD, HID};
        const int cols[4] = {HID, HID, HID, NH * HD};
        int bad = 0;
        for (int k = 0; k < 4; k++)
            for (int r = 0; r < rows[k]; r++) {
                float src[HID * NH], q8[HID * NH];
                unsigned char blocks[(HID * NH / 32) * 34];
                for (int cc = 0; cc < cols[k]; cc++)
                    src[cc] = src_w(L, k, r, cc);
                mha__q8_quantize(src, cols[k], blocks);
                mha__q8_dequantize(blocks, cols[k], q8);
                for (int cc = 0; cc < cols[k]; cc++)
                    bad += ws[k][r * cols[k] + cc] != expected(k, L, r, cc, q8);
            }
        CHECK(bad == 0, "layer %d: %d weights differ from the un-permuted source", L, bad);
        mha_layer_destroy(layer);
    }
    /* version 2 reads the same */
    buf b2 = make_file(2);
    mha_layer *layer = NULL;
    mha_error err;
    CHECK_OK(load(&b2, 0, &layer, &err), &err);
    mha_layer_destroy(layer);
    /* the public entry points, through a file */
    char path[] = "/tmp/mha_test_gguf_XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd >= 0) {
        FILE *f = fdopen(fd, "wb");
        fwrite(b.p, 1, b.n, f);
        fclose(f);
        mha_hf_layer_info info;
        CHECK_OK(mha_gguf_layer_info_read(path, 1, &info, &err), &err);
        CHECK(strcmp(info.model_type, "llama") == 0 && info.num_layers == LAYERS && info.causal &&
                  strcmp(info.prefix, "blk.1.") == 0,
              "info: %s %lld %s", info.model_type, (long long)info.num_layers, info.prefix);
        info.config.weight_dtype = MHA_DTYPE_BF16;
        CHECK_OK(mha_layer_load_gguf(path, 1, &info.config, NULL, &layer, &err), &err);
        CHECK(layer && mha_layer_config(layer)->weight_dtype == MHA_DTYPE_BF16, "bf16 load");
        mha_layer_destroy(layer);
        CHECK(mha_layer_load_gguf(path, 2, NULL, NULL, &layer, &err) == MHA_STATUS_INVALID_ARG &&
                  strstr(err.message, "layer 2") && !layer,
              "layer 2 of 2: %s", err.message);
        remove(path);
    }
    CHECK(mha_layer_load_gguf("/nonexistent.gguf", 0, NULL, NULL, &layer, &err) == MHA_STATUS_IO &&
              strstr(err.message, "/nonexistent.gguf"),
          "missing file: %s", err.message);
    free(b.p);
    free(b2.p);
}

/* Every status other than OK must come with a message naming the file. */
static int fails_cleanly(const buf *b, const char *what, long at) {
    mha_layer *layer = NULL;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = load(b, 0, &layer, &err);
    mha_layer_destroy(layer);
    if (st == MHA_STATUS_OK)
        return 1;
    const int ok = strncmp(err.message, "t.gguf: ", 8) == 0 && (layer == NULL);
    if (!ok)
        CHECK(0, "%s %ld: status %d, message '%s'", what, at, (int)st, err.message);
    return ok;
}

static void test_truncations_and_flips(void) {
    buf b = make_file(3);
    tensor_spec ts[N_TENSORS];
    make_specs(ts);
    const size_t data_start = b.n - (size_t)(ts[N_TENSORS - 1].offset + ts[N_TENSORS - 1].bytes);
    int failures = 0;
    for (size_t len = 0; len < b.n; len++) {
        buf t = {b.p, len, len};
        mha_layer *layer = NULL;
        mha_error err;
        memset(&err, 0, sizeof err);
        const mha_status st = load(&t, 0, &layer, &err);
        mha_layer_destroy(layer);
        /* a cut inside layer 1's tensors leaves layer 0 loadable */
        if (st == MHA_STATUS_OK)
            continue;
        failures += strncmp(err.message, "t.gguf: ", 8) != 0;
    }
    CHECK(failures == 0, "%d truncations failed without naming the file", failures);
    unsigned char *copy = malloc(b.n);
    static const unsigned char xors[] = {0x01, 0x80, 0xff};
    for (size_t i = 0; i < b.n; i += i < data_start ? 1 : 97)
        for (size_t k = 0; k < sizeof xors; k++) {
            memcpy(copy, b.p, b.n);
            copy[i] ^= xors[k];
            buf t = {copy, b.n, b.n};
            fails_cleanly(&t, "flip at byte", (long)i);
        }
    free(copy);
    free(b.p);
}

/* A file with one field replaced: b's bytes with `n` bytes at `at` set to v (little-endian). */
static void expect_error(const buf *b,
                         size_t at,
                         int n,
                         uint64_t v,
                         mha_status want,
                         const char *words,
                         const char *what) {
    unsigned char *c = malloc(b->n);
    memcpy(c, b->p, b->n);
    for (int i = 0; i < n; i++)
        c[at + (size_t)i] = (unsigned char)(v >> (8 * i));
    buf t = {c, b->n, b->n};
    mha_layer *layer = NULL;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = load(&t, 0, &layer, &err);
    CHECK(st == want && strstr(err.message, words) && !layer, "%s: status %d (want %d), '%s'", what,
          (int)st, (int)want, err.message);
    mha_layer_destroy(layer);
    free(c);
}

/* Byte offset of the first occurrence of `s` in b (the test file's fields are unique). */
static size_t find(const buf *b, const char *s) {
    const size_t n = strlen(s);
    for (size_t i = 0; i + n <= b->n; i++)
        if (memcmp(b->p + i, s, n) == 0)
            return i;
    CHECK(0, "'%s' not in the file", s);
    return 0;
}

static void test_bad_fields(void) {
    buf b = make_file(3);
    expect_error(&b, 0, 1, 'X', MHA_STATUS_BAD_FILE, "not a GGUF file", "magic");
    expect_error(&b, 4, 4, 1, MHA_STATUS_BAD_FILE, "version 1", "version 1");
    expect_error(&b, 4, 4, 0x03000000u, MHA_STATUS_BAD_FILE, "big-endian", "big-endian");
    expect_error(&b, 4, 4, 4, MHA_STATUS_BAD_FILE, "version 4", "version 4");
    expect_error(&b, 8, 8, 1ull << 40, MHA_STATUS_BAD_FILE, "tensors", "tensor count");
    expect_error(&b, 16, 8, ~0ull, MHA_STATUS_BAD_FILE, "metadata keys", "kv count");
    expect_error(&b, 24, 8, ~0ull >> 1, MHA_STATUS_BAD_FILE, "more than 65535", "key length");
    expect_error(&b, 24, 8, 60000, MHA_STATUS_BAD_FILE, "truncated", "key length past the end");
    /* the architecture's string length */
    const size_t arch = find(&b, "general.architecture") + 20 + 4;
    expect_error(&b, arch, 8, 1ull << 62, MHA_STATUS_BAD_FILE, "truncated", "string length");
    expect_error(&b, arch - 4, 4, 13, MHA_STATUS_BAD_FILE, "unknown value type 13", "value type");
    expect_error(&b, arch + 8, 1, 'X', MHA_STATUS_UNSUPPORTED, "'Xlama' is not supported",
                 "architecture");
    expect_error(&b, arch + 8, 1, 0, MHA_STATUS_BAD_FILE, "NUL", "NUL in a value");
    expect_error(&b, find(&b, "general.name"), 1, 0, MHA_STATUS_BAD_FILE, "NUL", "NUL in a key");
    /* alignment: 24 is not a power of two; 0 neither */
    const size_t al = find(&b, "general.alignment") + 17 + 4;
    expect_error(&b, al, 4, 24, MHA_STATUS_BAD_FILE, "power of two", "alignment 24");
    expect_error(&b, al, 4, 0, MHA_STATUS_BAD_FILE, "power of two", "alignment 0");
    expect_error(&b, al - 4, 4, MHA__GGUF_I32, MHA_STATUS_BAD_FILE, "not a uint32",
                 "alignment type");
    /* a duplicated key: llama.context_length renamed general.architecture (both 20 bytes) */
    {
        unsigned char *c = malloc(b.n);
        memcpy(c, b.p, b.n);
        memcpy(c + find(&b, "llama.context_length"), "general.architecture", 20);
        buf t = {c, b.n, b.n};
        mha_layer *layer = NULL;
        mha_error err;
        CHECK(load(&t, 0, &layer, &err) == MHA_STATUS_BAD_FILE &&
                  strstr(err.message, "'general.architecture' appears twice"),
              "duplicate key: %s", err.message);
        free(c);
    }
    /* arrays (the value type at sc, then the element type, the count, the first element) */
    const size_t sc = find(&b, "test.scalars") + 12;
    expect_error(&b, sc + 16, 4, MHA__GGUF_ARRAY, MHA_STATUS_BAD_FILE, "test.scalars",
                 "array of arrays of arrays");
    expect_error(&b, sc + 8, 8, 1ull << 60, MHA_STATUS_BAD_FILE, "does not fit", "array count");
    expect_error(&b, sc + 4, 4, 99, MHA_STATUS_BAD_FILE, "unknown array element type 99",
                 "element type");
    const size_t bo = find(&b, "test.bool") + 9 + 4;
    expect_error(&b, bo, 1, 2, MHA_STATUS_BAD_FILE, "not 0 or 1", "bool");
    /* tensor infos */
    const size_t tq = find(&b, "blk.0.attn_q.weight") + 19;
    expect_error(&b, tq, 4, 5, MHA_STATUS_BAD_FILE, "5 dimensions", "n_dims");
    expect_error(&b, tq + 4, 8, 1ull << 63, MHA_STATUS_BAD_FILE, "overflows", "ne[0]");
    expect_error(&b, tq + 12, 8, 1ull << 40, MHA_STATUS_BAD_FILE, "past the end", "ne[1]");
    /* block types: rows of 32 values are not whole K-quant blocks of 256; IQ*, TQ*, MXFP4 are
     * refused by name (Q4_0 etc. load: tests/test_cli_gguf.py) */
    expect_error(&b, tq + 20, 4, 12, MHA_STATUS_BAD_FILE, "multiple of Q4_K's block of 256",
                 "type Q4_K");
    expect_error(&b, tq + 20, 4, 14, MHA_STATUS_BAD_FILE, "multiple of Q6_K's block of 256",
                 "type Q6_K");
    expect_error(&b, tq + 20, 4, 20, MHA_STATUS_UNSUPPORTED, "type IQ4_NL (20): only F32",
                 "type IQ4_NL");
    expect_error(&b, tq + 20, 4, 39, MHA_STATUS_UNSUPPORTED, "type MXFP4", "type MXFP4");
    expect_error(&b, tq + 20, 4, 35, MHA_STATUS_UNSUPPORTED, "type TQ2_0", "type TQ2_0");
    expect_error(&b, tq + 20, 4, 99, MHA_STATUS_UNSUPPORTED, "type unknown (99)", "type 99");
    expect_error(&b, tq + 24, 8, 8, MHA_STATUS_BAD_FILE, "not a multiple of the alignment",
                 "offset alignment");
    expect_error(&b, tq + 24, 8, 1ull << 62, MHA_STATUS_BAD_FILE, "past the end", "offset");
    expect_error(&b, tq + 4, 8, 31, MHA_STATUS_BAD_FILE, "expected 2 dimensions {32, 32}", "shape");
    /* attn_k's data placed over attn_q's (llama.cpp refuses overlapping tensors too) */
    expect_error(&b, find(&b, "blk.0.attn_k.weight") + 19 + 24, 8, 0, MHA_STATUS_BAD_FILE,
                 "overlap in the data section", "overlapping tensors");
    const size_t tv = find(&b, "blk.0.attn_v.weight") + 19;
    expect_error(&b, tv + 4, 8, 31, MHA_STATUS_BAD_FILE, "multiple of Q8_0's block", "q8_0 shape");
    /* a duplicated tensor: layer 1's q renamed layer 0's */
    expect_error(&b, find(&b, "blk.1.attn_q.weight") + 4, 1, '0', MHA_STATUS_BAD_FILE,
                 "appears twice", "duplicate tensor");
    expect_error(&b, find(&b, "blk.0.attn_k.weight") + 4, 1, '7', MHA_STATUS_NOT_FOUND,
                 "no tensor 'blk.0.attn_k.weight'", "missing tensor");
    /* head counts */
    const size_t hc = find(&b, "llama.attention.head_count_kv") + 29 + 4;
    expect_error(&b, hc, 4, 0, MHA_STATUS_BAD_FILE, "is not in [1,", "kv heads 0");
    expect_error(&b, hc, 4, 3, MHA_STATUS_BAD_FILE, "not a multiple", "kv heads 3");
    /* a NaN weight (F32 o_proj) and a non-finite Q8_0 scale */
    tensor_spec ts[N_TENSORS];
    make_specs(ts);
    const size_t data = b.n - (size_t)(ts[N_TENSORS - 1].offset + ts[N_TENSORS - 1].bytes);
    expect_error(&b, data + ts[3].offset + 4 * 5, 4, 0x7fc00000u, MHA_STATUS_BAD_FILE,
                 "element [0, 5] is NaN", "NaN weight");
    expect_error(&b, data + ts[2].offset, 2, 0x7c00u, MHA_STATUS_BAD_FILE,
                 "row 0: a Q8_0 block's scale is not finite", "q8 scale");
    expect_error(&b, data + ts[0].offset, 2, 0x7e00u, MHA_STATUS_BAD_FILE, "is NaN", "f16 NaN");
    free(b.p);
}

/* A caller's config whose head size differs from the file's: llama's Q and K rows were permuted
 * per head of the FILE's size, so a projection whose rows are not whole heads of that size cannot
 * be un-permuted. The file below says 1 head of 32 (K: 1 kv head of 32), its tensors are sized for
 * the config's 2 heads of 16 (K: 16 rows, half a file head): refused, nothing written past the
 * 16-row buffer (the un-permutation sent K's row 1 to row 16 before the check). */
static void test_config_head_size(void) {
    buf b = make_file(3);
    const size_t hc = find(&b, "llama.attention.head_count") + 26 + 4;
    b.p[hc] = 1; /* head_count 2 -> 1: head size 32 */
    mha__gguf *g = NULL;
    mha_error err;
    CHECK_OK(mha__gguf_open_mem(b.p, b.n, "t.gguf", &g, &err), &err);
    mha_hf_layer_info info;
    if (g)
        CHECK_OK(mha__gguf_info(g, 0, &info, &err), &err);
    if (g && info.config.head_dim == 32) {
        mha_config c = info.config;
        c.num_heads = NH, c.num_kv_heads = NKV, c.head_dim = c.v_head_dim = HD;
        c.rope.rotary_dim = HD;
        mha_layer *layer = NULL;
        const mha_status st = mha__gguf_load(g, 0, &c, NULL, &layer, &err);
        CHECK(st == MHA_STATUS_BAD_FILE && strstr(err.message, "blk.0.attn_k.weight") &&
                  strstr(err.message, "head size 32") && !layer,
              "K of 16 rows under a file head size of 32: status %d, '%s'", (int)st, err.message);
        mha_layer_destroy(layer);
        /* the same config over the unmodified file (head size 16): loads */
        buf ok = make_file(3);
        mha__gguf *g2 = NULL;
        CHECK_OK(mha__gguf_open_mem(ok.p, ok.n, "t.gguf", &g2, &err), &err);
        if (g2)
            CHECK_OK(mha__gguf_load(g2, 0, &c, NULL, &layer, &err), &err);
        mha_layer_destroy(layer);
        mha__gguf_close(g2);
        free(ok.p);
    } else {
        CHECK(0, "the patched file's head size is not 32");
    }
    mha__gguf_close(g);
    free(b.p);
}

/* RoPE keys as llama.cpp reads them (its load_hparams): rope.scaling.factor, else the older
 * rope.scale_linear, is the factor, and a file without rope.scaling.type is linear scaling
 * (llama.cpp's default type); a llama file whose rope.dimension_count is not the head size
 * (llama.cpp: "invalid n_rot") is refused, not read as partial rotary of the un-permuted rows;
 * YaRN whose ramp ends are reversed (ggml's step, mha's reversed ramp) is refused. */
static void extra_factor_only(buf *b) {
    kv_f32(b, "llama.rope.scaling.factor", 2.0f);
}
static void extra_both_factors(buf *b) {
    kv_f32(b, "llama.rope.scaling.factor", 4.0f);
    kv_f32(b, "llama.rope.scale_linear", 2.0f);
}
static void extra_linear_old_key(buf *b) {
    kv_str(b, "llama.rope.scaling.type", "linear");
    kv_f32(b, "llama.rope.scale_linear", 3.0f);
}
static void extra_none_factor(buf *b) {
    kv_str(b, "llama.rope.scaling.type", "none");
    kv_f32(b, "llama.rope.scaling.factor", 2.0f);
}
static void extra_yarn(buf *b) {
    kv_str(b, "llama.rope.scaling.type", "yarn");
    kv_f32(b, "llama.rope.scaling.factor", 4.0f);
}
/* beta_fast < beta_slow: ggml's ramp ends (3, 1) for head size 16, theta 10000 and the original
 * context 256 are reversed (its ramp a step, mha's a reversed ramp): refused */
static void extra_yarn_betas(buf *b) {
    kv_str(b, "llama.rope.scaling.type", "yarn");
    kv_f32(b, "llama.rope.scaling.factor", 4.0f);
    kv_u32(b, "llama.rope.scaling.original_context_length", 256);
    kv_f32(b, "llama.rope.scaling.yarn_beta_fast", 1.0f);
    kv_f32(b, "llama.rope.scaling.yarn_beta_slow", 32.0f);
}
static void extra_rot_half(buf *b) {
    kv_u32(b, "llama.rope.dimension_count", HD / 2);
}
static void extra_rot_full(buf *b) {
    kv_u32(b, "llama.rope.dimension_count", HD);
}

/* A key of the wrong type is named with what it is (was "is a array, not an integer"). */
static void extra_key_length_array(buf *b) {
    put_str(b, "llama.attention.key_length");
    put_le(b, MHA__GGUF_ARRAY, 4);
    put_le(b, MHA__GGUF_F32, 4);
    put_le(b, 2, 8);
    put_le(b, 0x41800000u, 4); /* 16.0f */
    put_le(b, 0x41800000u, 4);
}

static void test_wrong_value_type(void) {
    buf b = make_file_kv(3, extra_key_length_array, 1);
    mha_layer *layer = NULL;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = load(&b, 0, &layer, &err);
    CHECK(st == MHA_STATUS_BAD_FILE &&
              strstr(err.message,
                     "'llama.attention.key_length' is an array of 2 float32 values, not an "
                     "integer") &&
              !layer,
          "key_length as an array: status %d, '%s'", (int)st, err.message);
    mha_layer_destroy(layer);
    free(b.p);
}

static void test_rope_keys(void) {
    static const struct {
        void (*extra)(buf *);
        int n;
        mha_rope_scaling_type scaling;
        double factor;
        const char *what;
    } cases[] = {
        {extra_factor_only, 1, MHA_ROPE_SCALING_LINEAR, 2.0, "rope.scaling.factor without a type"},
        {extra_both_factors, 2, MHA_ROPE_SCALING_LINEAR, 4.0, "rope.scaling.factor first"},
        {extra_linear_old_key, 2, MHA_ROPE_SCALING_LINEAR, 3.0, "linear with rope.scale_linear"},
        {extra_none_factor, 2, MHA_ROPE_SCALING_NONE, 0.0, "type none with a factor"},
        {extra_rot_full, 1, MHA_ROPE_SCALING_NONE, 0.0, "rope.dimension_count = head size"},
        {extra_yarn, 2, MHA_ROPE_SCALING_YARN, 4.0, "yarn with the default betas"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        buf b = make_file_kv(3, cases[i].extra, cases[i].n);
        mha__gguf *g = NULL;
        mha_error err;
        mha_hf_layer_info info;
        CHECK_OK(mha__gguf_open_mem(b.p, b.n, "t.gguf", &g, &err), &err);
        if (g) {
            CHECK_OK(mha__gguf_info(g, 0, &info, &err), &err);
            CHECK(info.config.rope.scaling == cases[i].scaling &&
                      (cases[i].scaling == MHA_ROPE_SCALING_NONE ||
                       info.config.rope.factor == cases[i].factor) &&
                      info.config.rope.rotary_dim == HD,
                  "%s: scaling %d factor %g rotary_dim %lld", cases[i].what,
                  (int)info.config.rope.scaling, info.config.rope.factor,
                  (long long)info.config.rope.rotary_dim);
        }
        mha__gguf_close(g);
        free(b.p);
    }
    buf b = make_file_kv(3, extra_rot_half, 1);
    mha_layer *layer = NULL;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = load(&b, 0, &layer, &err);
    CHECK(st == MHA_STATUS_BAD_FILE && strstr(err.message, "llama.rope.dimension_count = 8") &&
              strstr(err.message, "head size 16") && !layer,
          "llama partial rotary: status %d, '%s'", (int)st, err.message);
    mha_layer_destroy(layer);
    free(b.p);
    b = make_file_kv(3, extra_yarn_betas, 5);
    layer = NULL;
    memset(&err, 0, sizeof err);
    const mha_status st2 = load(&b, 0, &layer, &err);
    CHECK(st2 == MHA_STATUS_UNSUPPORTED && strstr(err.message, "low end 3") &&
              strstr(err.message, "high end 1") && !layer,
          "yarn with reversed ramp ends: status %d, '%s'", (int)st2, err.message);
    mha_layer_destroy(layer);
    free(b.p);
}

int main(void) {
    test_valid_file();
    test_truncations_and_flips();
    test_bad_fields();
    test_config_head_size();
    test_rope_keys();
    test_wrong_value_type();
    return test_finish();
}

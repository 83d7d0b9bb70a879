/* SPDX-License-Identifier: MIT */
/* fuzz_common.h: helpers shared by the libFuzzer harnesses in fuzz/ (header only).
 *
 * fuzz_reader hands out values taken from the front of the fuzz input (zeros once it runs out),
 * so every decision of a harness is a deterministic function of the input. FUZZ_REQUIRE aborts
 * (a "crash" for libFuzzer) when an invariant of the library does not hold.
 */
#ifndef MHA_FUZZ_COMMON_H
#define MHA_FUZZ_COMMON_H

#include "mha.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_REQUIRE(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz invariant failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

typedef struct fuzz_reader {
    const uint8_t *data;
    size_t size, pos;
} fuzz_reader;

static inline uint8_t fuzz_u8(fuzz_reader *r) {
    return r->pos < r->size ? r->data[r->pos++] : 0;
}

static inline uint32_t fuzz_u32(fuzz_reader *r) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v = v << 8 | fuzz_u8(r);
    return v;
}

static inline uint64_t fuzz_u64(fuzz_reader *r) {
    return (uint64_t)fuzz_u32(r) << 32 | fuzz_u32(r);
}

/* An integer in [0, n) (n >= 1). */
static inline int64_t fuzz_below(fuzz_reader *r, int64_t n) {
    return (int64_t)(fuzz_u32(r) % (uint32_t)n);
}

/* Checks that a failed call filled its mha_error consistently: same status, a NUL-terminated,
 * non-empty message. */
static inline void fuzz_check_error(mha_status st, const mha_error *err) {
    FUZZ_REQUIRE(st != MHA_STATUS_OK, "not an error");
    FUZZ_REQUIRE(err->status == st, "err.status %d != returned %d", (int)err->status, (int)st);
    FUZZ_REQUIRE(memchr(err->message, '\0', sizeof err->message) != NULL, "message unterminated");
    FUZZ_REQUIRE(err->message[0] != '\0', "empty message for status %d", (int)st);
}

/* A counting allocator (mha_allocator {&counter, fuzz_count_alloc, fuzz_count_free}): live is the
 * number of blocks handed out and not given back, 0 after every call that failed or whose result
 * was destroyed. */
typedef struct fuzz_counting {
    int64_t live;
} fuzz_counting;

static inline void *fuzz_count_alloc(void *user, size_t bytes, size_t align) {
    fuzz_counting *c = user;
    void *p = aligned_alloc(align, (bytes + align - 1) / align * align);
    if (p)
        c->live++;
    return p;
}

static inline void fuzz_count_free(void *user, void *ptr) {
    fuzz_counting *c = user;
    if (ptr)
        c->live--;
    free(ptr);
}

#endif /* MHA_FUZZ_COMMON_H */

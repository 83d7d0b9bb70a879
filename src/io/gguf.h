/* SPDX-License-Identifier: MIT */
/* gguf.h: the GGUF reader (src/io/gguf.c), internal to the project. The public entry points are
 * mha_gguf_layer_info_read() and mha_layer_load_gguf() in mha.h; the fuzzer and the tests reach
 * the same code through the in-memory forms below (fmemopen: every check is the same).
 *
 * The file is untrusted: every count, length, offset and size is checked for overflow and
 * against the file's size before it is used or allocated; every error names the file and what is
 * wrong. Only the header, the metadata and the tensor infos are read when the file is opened;
 * string and array values and tensor data stay in the file until asked for.
 */
#ifndef MHA_IO_GGUF_H
#define MHA_IO_GGUF_H

#include "mha.h"

#include <stddef.h>
#include <stdint.h>

/* GGUF metadata value types (the spec's gguf_metadata_value_type). */
enum {
    MHA__GGUF_U8 = 0,
    MHA__GGUF_I8 = 1,
    MHA__GGUF_U16 = 2,
    MHA__GGUF_I16 = 3,
    MHA__GGUF_U32 = 4,
    MHA__GGUF_I32 = 5,
    MHA__GGUF_F32 = 6,
    MHA__GGUF_BOOL = 7,
    MHA__GGUF_STRING = 8,
    MHA__GGUF_ARRAY = 9,
    MHA__GGUF_U64 = 10,
    MHA__GGUF_I64 = 11,
    MHA__GGUF_F64 = 12,
};

/* The ggml tensor types this reader knows the sizes of (others are refused by number). */
enum {
    MHA__GGML_F32 = 0,
    MHA__GGML_F16 = 1,
    MHA__GGML_Q4_0 = 2,
    MHA__GGML_Q4_1 = 3,
    MHA__GGML_Q5_0 = 6,
    MHA__GGML_Q5_1 = 7,
    MHA__GGML_Q8_0 = 8,
    MHA__GGML_Q2_K = 10,
    MHA__GGML_Q3_K = 11,
    MHA__GGML_Q4_K = 12,
    MHA__GGML_Q5_K = 13,
    MHA__GGML_Q6_K = 14,
    MHA__GGML_BF16 = 30,
};

typedef struct mha__gguf mha__gguf;

/* Opens and parses `path` (header, metadata, tensor infos). */
mha_status mha__gguf_open(const char *path, mha__gguf **out, mha_error *err);
/* The same on the `len`-byte image at `buf` (kept, not copied: it must outlive the handle);
 * `name` stands for the path in messages (NULL: "<memory>"). */
mha_status
mha__gguf_open_mem(const void *buf, size_t len, const char *name, mha__gguf **out, mha_error *err);
void mha__gguf_close(mha__gguf *g); /* NULL-safe */

/* The layer functions of mha.h on an open file. */
mha_status mha__gguf_info(mha__gguf *g, int64_t layer, mha_hf_layer_info *info, mha_error *err);
mha_status mha__gguf_load(mha__gguf *g,
                          int64_t layer,
                          const mha_config *config,
                          const mha_allocator *allocator,
                          mha_layer **out,
                          mha_error *err);

/* For the fuzzer: open the image, read layer 0's info and load it (errors are the point). */
mha_status mha__gguf_load_mem(const void *buf, size_t len, mha_error *err);

#endif /* MHA_IO_GGUF_H */

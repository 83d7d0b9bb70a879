/* SPDX-License-Identifier: MIT */
/* safetensors.h: the in-memory entry point of the safetensors loader, internal to the project
 * (used by the fuzzer and the tests, not exported from the shared library). The public entry
 * point is mha_layer_load_safetensors() in mha.h; both run exactly the same checks.
 */
#ifndef MHA_SAFETENSORS_H
#define MHA_SAFETENSORS_H

#include "mha.h"

/* mha_layer_load_safetensors() on the `len`-byte file image at `buf` (read through fmemopen, so
 * every size and offset check is the same). `name` stands for the path in messages (NULL gives
 * "<memory>"). */
mha_status mha__safetensors_load_mem(const void *buf,
                                     size_t len,
                                     const char *name,
                                     const char *prefix,
                                     const mha_name_map *names,
                                     const mha_config *config,
                                     const mha_allocator *allocator,
                                     mha_layer **out,
                                     mha_error *err);

/* cJSON_ParseWithLengthOpts under the loader's lock (cJSON 1.7 records parse errors in a global),
 * requiring the whole text to be one JSON value (trailing whitespace allowed). NULL on error, with
 * the byte where parsing stopped in *error_pos. Free with cJSON_Delete. */
struct cJSON;
struct cJSON *mha__json_parse(const char *text, size_t len, size_t *error_pos);
/* The one policy for every JSON the library reads (config.json, the index, safetensors headers):
 * mha__json_check_text, before parsing, refuses a NUL in a key or string (raw or \u0000: cJSON
 * would cut it short); mha__json_check_keys, after, refuses an object with the same key twice at
 * any depth (cJSON takes the first, Python the last). Each message names the key; `path` names
 * the file. */
mha_status mha__json_check_text(const char *text, size_t len, const char *path, mha_error *err);
mha_status mha__json_check_keys(const struct cJSON *node, const char *path, mha_error *err);

/* Tensor-level access to one safetensors file, for loaders that assemble a layer themselves
 * (src/io/hf_config.c: fused and transposed projections). The file gets every check of
 * mha_layer_load_safetensors() when opened. */
typedef struct mha__st_handle mha__st_handle;
mha_status mha__st_open(const char *path, mha__st_handle **out, mha_error *err);
void mha__st_close(mha__st_handle *h); /* NULL-safe */
/* 1 when the file has a tensor named `name` (then *ndim and shape[0 .. min(ndim, 8)) are set). */
int mha__st_has(mha__st_handle *h, const char *name, int32_t *ndim, int64_t shape[8]);
/* The whole tensor `name` (F32/F64/F16/BF16, finite values only) in the storage dtype `to` (F32,
 * BF16 or F16: the file's bytes when it has that dtype, else each value rounded once to nearest
 * even; a value beyond `to`'s range is BAD_FILE) in a new buffer from `allocator`, with its shape;
 * NOT_FOUND when absent, BAD_FILE for another dtype or an empty tensor, or when its rank is not
 * `want_ndim`. */
mha_status mha__st_read(mha__st_handle *h,
                        const char *name,
                        int32_t want_ndim,
                        mha_dtype to,
                        const mha_allocator *allocator,
                        void **out,
                        int64_t shape[2],
                        mha_error *err);

#endif /* MHA_SAFETENSORS_H */

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

#endif /* MHA_SAFETENSORS_H */

/* SPDX-License-Identifier: MIT */
/* safetensors_off.c: the safetensors entry points of a library built with -DMHA_SAFETENSORS=OFF
 * (no cJSON needed): each says so, in place of src/io/safetensors.c and src/io/hf_config.c. */
#include "io/safetensors.h"

#include "base/internal.h"

static mha_status built_without(mha_layer **out, mha_error *err) {
    if (out)
        *out = NULL;
    return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                     "this libmha was built without safetensors support (-DMHA_SAFETENSORS=OFF)");
}

mha_status mha_layer_load_safetensors(const char *path,
                                      const char *prefix,
                                      const mha_name_map *names,
                                      const mha_config *config,
                                      const mha_allocator *allocator,
                                      mha_layer **out,
                                      mha_error *err) {
    (void)path, (void)prefix, (void)names, (void)config, (void)allocator;
    return built_without(out, err);
}

mha_status mha__safetensors_load_mem(const void *buf,
                                     size_t len,
                                     const char *name,
                                     const char *prefix,
                                     const mha_name_map *names,
                                     const mha_config *config,
                                     const mha_allocator *allocator,
                                     mha_layer **out,
                                     mha_error *err) {
    (void)buf, (void)len, (void)name, (void)prefix, (void)names, (void)config, (void)allocator;
    return built_without(out, err);
}

mha_status
mha_hf_layer_info_read(const char *dir, int64_t layer, mha_hf_layer_info *info, mha_error *err) {
    (void)dir, (void)layer, (void)info;
    return built_without(NULL, err);
}

mha_status mha_hf_layer_load(const char *dir,
                             int64_t layer,
                             const mha_config *config,
                             const mha_allocator *allocator,
                             mha_layer **out,
                             mha_error *err) {
    (void)dir, (void)layer, (void)config, (void)allocator;
    return built_without(out, err);
}

mha_status mha_hf_mla_load(const char *dir,
                           int64_t layer,
                           const mha_allocator *allocator,
                           mha_mla **out,
                           mha_hf_layer_info *info,
                           mha_error *err) {
    (void)dir, (void)layer, (void)allocator, (void)info;
    if (out)
        *out = NULL;
    return built_without(NULL, err);
}

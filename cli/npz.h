/* SPDX-License-Identifier: MIT */
/* npz.h: NumPy .npz writer (a zip archive of .npy members, stored without compression), internal
 * to the CLI (cli/). numpy.load(path)[name] reads member "<name>.npy". */
#ifndef MHA_NPZ_H
#define MHA_NPZ_H

#include "npy.h"

/* One member: a C-order array of dtype F32 or I64 (little-endian on disk). */
typedef struct mha__npz_member {
    const char *name; /* without ".npy" */
    mha_dtype dtype;
    int32_t ndim;
    int64_t shape[MHA_NPY_MAX_DIMS];
    const void *data;
} mha__npz_member;

/* Writes the archive atomically ("<path>.tmp.<pid>" renamed; removed on error). A member or an
 * archive beyond 4 GiB (no ZIP64 here) is refused with MHA_STATUS_OVERFLOW, nothing written. */
mha_status
mha__npz_write(const char *path, const mha__npz_member *members, int count, mha_error *err);

#endif /* MHA_NPZ_H */

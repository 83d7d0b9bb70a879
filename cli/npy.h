/* SPDX-License-Identifier: MIT */
/* npy.h: NumPy .npy reader/writer (format versions 1.0, 2.0 and 3.0), internal to the project
 * (cli/: used by the CLI and the tests, not part of the library).
 *
 * Files are untrusted: the header dict is parsed strictly, every size is overflow-checked and the
 * data length must match the shape exactly. Writes go to "<path>.tmp.<pid>" and are renamed, so an
 * error never leaves a half-written file (a command's outputs as one set: mha__npy_set_begin).
 */
#ifndef MHA_NPY_H
#define MHA_NPY_H

#include "mha.h"

#include <stdio.h>

#define MHA_NPY_MAX_DIMS 8

typedef struct mha__npy {
    mha_dtype dtype; /* F32 F64 F16 BF16 BOOL U8 I32 I64 (little-endian only; BF16 is '<V2') */
    int32_t ndim;
    int64_t shape[MHA_NPY_MAX_DIMS];
    int64_t count; /* product of shape */
    void *data;    /* count * mha_dtype_size(dtype) bytes, malloc'ed; C order */
} mha__npy;

/* Parses an in-memory .npy image (the fuzzing entry point). On success out->data is a malloc'ed
 * copy. `name` is used in messages (a file path). */
mha_status
mha__npy_parse(const void *buf, size_t len, const char *name, mha__npy *out, mha_error *err);
/* Opens an input file for reading the way the library opens its own (src/io/file.h): without
 * blocking (a FIFO without a writer cannot hang the open), fstat on the open descriptor, and
 * anything but a regular file (directory, FIFO, device, socket) refused with IO. *size is the
 * file's size. Every file the CLI reads goes through it (.npy inputs and masks, --tokens). */
mha_status mha__npy_open_input(const char *path, FILE **out, uint64_t *size, mha_error *err);
/* Reads a whole regular file (mha__npy_open_input); messages start with the path. */
mha_status mha__npy_read(const char *path, mha__npy *out, mha_error *err);
void mha__npy_free(mha__npy *a);
/* Converts a float tensor (F32/F64/F16/BF16) to a new malloc'ed float32 array. */
mha_status mha__npy_to_f32(const mha__npy *a, const char *name, float **out, mha_error *err);
/* Converts a float tensor (F32/F64/F16/BF16) to a new malloc'ed array of `dtype` (F32, F64, F16 or
 * BF16): a copy when the dtypes agree, else each value rounded once to nearest even (float64 to
 * a half directly, never through float32); a finite value beyond the target's range becomes
 * +-inf (float16: |x| >= 65520), as numpy's astype does. */
mha_status
mha__npy_to_dtype(const mha__npy *a, mha_dtype dtype, const char *name, void **out, mha_error *err);
/* The conversion of mha__npy_to_dtype on `count` elements (dst must not overlap src). */
void mha__npy_convert(mha_dtype from, const void *src, mha_dtype to, void *dst, int64_t count);
/* Largest header mha__npy_header writes. */
#define MHA_NPY_HEADER_MAX 512
/* The version 1.0 header of a C-order little-endian array of `dtype` and `shape` (data then start
 * at a multiple of 64 bytes) into buf (MHA_NPY_HEADER_MAX bytes); returns its size, 0 for a dtype
 * .npy cannot name or a bad ndim. Used by the .npz writer (cli/npz.c). */
size_t mha__npy_header(mha_dtype dtype, int32_t ndim, const int64_t *shape, char *buf);
/* Errors as the library reports them (public types only: this file is the CLI's and the
 * tests'): err->status = status and the formatted message (err may be NULL); returns status. */
mha_status mha__npy_fail(mha_error *err, mha_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The end of an atomic write: f, written to `tmp` (ok = every write and the flush succeeded,
 * errno telling why not), is closed and renamed to `path` (mha__npy_place); on any failure `tmp`
 * is removed and err names `path` and the reason (MHA_STATUS_IO). */
mha_status mha__npy_commit(FILE *f, int ok, const char *tmp, const char *path, mha_error *err);
/* A command's outputs as one set, all or nothing (`mha run`: --out, --attn, --plot,
 * --attn-stats). After mha__npy_set_begin(), every finished temporary (mha__npy_place: .npy,
 * .npz and plot writes) is kept under its temporary name, its target untouched;
 * mha__npy_set_commit() then renames them all into place, in the order they were written, and
 * mha__npy_set_abort() (on any failure) removes them, so that the files at the targets stay as
 * they were before the run and no new one appears. Both close the set. A rename can only fail
 * if the directory changes under the run (the paths were checked before any work): the outputs
 * renamed before it stay, the others' temporaries are removed, and err names the path
 * (MHA_STATUS_IO). One set per process, not thread-safe (the CLI writes from one thread). */
void mha__npy_set_begin(void);
mha_status mha__npy_set_commit(mha_error *err);
void mha__npy_set_abort(void);
/* The finished temporary `tmp` to `path`: renamed now, or, while a set is open, recorded for
 * mha__npy_set_commit. 0, or -1 with errno set (tmp is then left for the caller to remove). */
int mha__npy_place(const char *tmp, const char *path);
/* The start of an atomic write: creates `tmp` new (O_EXCL | O_NOFOLLOW: an existing file or a
 * symbolic link of that name is never opened, truncated or written through) and returns it open
 * for writing, or NULL with errno set. */
FILE *mha__npy_create_tmp(const char *tmp);
/* Writes a C-order array of `dtype` (F32, F64, F16, BF16 as '<V2', or an integer type) atomically
 * (temporary file + rename). */
mha_status mha__npy_write(const char *path,
                          mha_dtype dtype,
                          const void *data,
                          int32_t ndim,
                          const int64_t *shape,
                          mha_error *err);
/* mha__npy_write of a float32 array. */
mha_status mha__npy_write_f32(
    const char *path, const float *data, int32_t ndim, const int64_t *shape, mha_error *err);

#endif /* MHA_NPY_H */

/* SPDX-License-Identifier: MIT */
/* file.h: how the library opens the files it reads (config.json, the index, safetensors).
 *
 * One policy for every input file: it is opened without blocking (O_NONBLOCK, so a FIFO without
 * a writer cannot hang the open), the open descriptor is fstat'ed (no check-then-open race), and
 * anything that is not a regular file (a directory, FIFO, device or socket) is refused before a
 * byte is read. The CLI's .npy reader (cli/npy.c, which stands on the public API only) applies
 * the same policy in its own copy of these lines.
 */
#ifndef MHA_IO_FILE_H
#define MHA_IO_FILE_H

#include "mha.h"

#include <stdint.h>
#include <stdio.h>

/* Opens `path` for reading as above: *out (read mode, close-on-exec) and its size in *size.
 * When `missing` is not NULL and the file does not exist, *missing is set to 1, *out to NULL and
 * OK returned. Errors: IO ("cannot open: ...", "is a directory", "not a regular file ..."). */
mha_status
mha__open_regular(const char *path, FILE **out, uint64_t *size, int *missing, mha_error *err);

#endif /* MHA_IO_FILE_H */

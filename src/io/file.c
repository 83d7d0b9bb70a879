/* SPDX-License-Identifier: MIT */
/* file.c: mha__open_regular, the one way the library opens an input file (file.h). */
#define _POSIX_C_SOURCE 200809L

#include "io/file.h"

#include "base/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef O_CLOEXEC
#    define O_CLOEXEC 0
#endif
#ifndef O_NOCTTY
#    define O_NOCTTY 0
#endif

mha_status
mha__open_regular(const char *path, FILE **out, uint64_t *size, int *missing, mha_error *err) {
    *out = NULL;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever. */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0 && missing && errno == ENOENT) {
        *missing = 1;
        return MHA_STATUS_OK;
    }
    MHA_RETURN_IF(fd < 0, err, IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    const char *bad = NULL;
    int e = 0;
    if (fstat(fd, &sb) != 0)
        e = errno, bad = "cannot stat";
    else if (S_ISDIR(sb.st_mode))
        bad = "not a regular file (a directory)";
    else if (!S_ISREG(sb.st_mode))
        bad = S_ISFIFO(sb.st_mode) ? "not a regular file (a FIFO): refused, inputs must be files"
                                   : "not a regular file (a device or socket): refused, inputs "
                                     "must be files";
    else if (sb.st_size < 0)
        bad = "negative size";
    if (!bad) {
        /* A regular file never blocks; reads go back to the usual blocking mode all the same. */
        const int flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
            e = errno, bad = "cannot clear O_NONBLOCK";
    }
    FILE *f = NULL;
    if (!bad && !(f = fdopen(fd, "rb")))
        e = errno, bad = "cannot open";
    if (bad) {
        close(fd);
        return e ? mha__fail(err, MHA_STATUS_IO, "%s: %s: %s", path, bad, strerror(e))
                 : mha__fail(err, MHA_STATUS_IO, "%s: %s", path, bad);
    }
    *out = f;
    *size = (uint64_t)sb.st_size;
    return MHA_STATUS_OK;
}

/* SPDX-License-Identifier: MIT */
/* cli_paths.c: nothing lost. Every output path of a command is checked before any work:
 *   - an output is never one of the inputs (same device and inode, however it is spelled: a hard
 *     link, "./x.npy", a symlink to it) nor another output (same file, or the same name in the
 *     same directory for files that do not exist yet);
 *   - an output that exists must be a regular file: a symbolic link, a FIFO, a device, a socket or
 *     a directory is refused, never replaced (outputs are written to a temporary file and renamed
 *     over the target, which would replace the link or the device node itself; writing through
 *     instead would not be atomic);
 *   - the output's directory must exist and be writable.
 * The messages name the flag and the file. */
#define _XOPEN_SOURCE 700 /* realpath */
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The directory part of path ("." when there is none), into buf. */
static void dir_of(const char *path, char *buf, size_t size) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(buf, size, ".");
    else if (slash == path)
        snprintf(buf, size, "/");
    else
        snprintf(buf, size, "%.*s", (int)(slash - path), path);
}

/* A name for a file that may not exist yet: realpath of its directory + "/" + its base name. */
static int canonical(const char *path, char *out, size_t size) {
    char dir[PATH_MAX], real[PATH_MAX];
    dir_of(path, dir, sizeof dir);
    if (!realpath(dir, real))
        return 0;
    const char *slash = strrchr(path, '/');
    snprintf(out, size, "%s/%s", real, slash ? slash + 1 : path);
    return 1;
}

/* Checks one output on its own: an existing target is a regular file; its directory exists and
 * is writable. */
static int check_target(const cli_path *out) {
    struct stat st;
    if (lstat(out->path, &st) == 0) {
        if (S_ISLNK(st.st_mode))
            return cli_fail("%s %s: is a symbolic link; refusing to replace it (name the file "
                            "it points to, or another path)",
                            out->flag, out->path);
        if (S_ISDIR(st.st_mode))
            return cli_fail("%s %s: is a directory", out->flag, out->path);
        if (!S_ISREG(st.st_mode))
            return cli_fail("%s %s: exists and is not a regular file (a FIFO, device or "
                            "socket); refusing to replace it",
                            out->flag, out->path);
    } else if (errno != ENOENT) {
        return cli_fail("%s %s: %s", out->flag, out->path, strerror(errno));
    }
    char dir[PATH_MAX];
    dir_of(out->path, dir, sizeof dir);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return cli_fail("%s %s: directory '%s' does not exist", out->flag, out->path, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return cli_fail("%s %s: directory '%s' is not writable", out->flag, out->path, dir);
    return CLI_OK;
}

int cli_check_outputs(const cli_path *inputs, int n_in, const cli_path *outputs, int n_out) {
    for (int o = 0; o < n_out; o++) {
        if (!outputs[o].path)
            continue;
        int rc = check_target(&outputs[o]);
        if (rc)
            return rc;
        struct stat so;
        const int exists = stat(outputs[o].path, &so) == 0;
        for (int i = 0; exists && i < n_in; i++) {
            struct stat si;
            if (inputs[i].path && stat(inputs[i].path, &si) == 0 && si.st_dev == so.st_dev &&
                si.st_ino == so.st_ino)
                return cli_fail("%s %s: is the same file as %s %s; refusing to overwrite an "
                                "input",
                                outputs[o].flag, outputs[o].path, inputs[i].flag, inputs[i].path);
        }
        char co[PATH_MAX + NAME_MAX + 2];
        const int named = canonical(outputs[o].path, co, sizeof co);
        for (int p = 0; p < o; p++) {
            if (!outputs[p].path)
                continue;
            struct stat sp;
            char cp[PATH_MAX + NAME_MAX + 2];
            const int same_file = exists && stat(outputs[p].path, &sp) == 0 &&
                                  sp.st_dev == so.st_dev && sp.st_ino == so.st_ino;
            const int same_name =
                named && canonical(outputs[p].path, cp, sizeof cp) && strcmp(co, cp) == 0;
            if (same_file || same_name)
                return cli_fail("%s %s and %s %s name the same file", outputs[p].flag,
                                outputs[p].path, outputs[o].flag, outputs[o].path);
        }
    }
    return CLI_OK;
}

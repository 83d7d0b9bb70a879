/* SPDX-License-Identifier: MIT */
/* cli_plot.c: what `mha run --plot FILE --tokens FILE` needs besides the drawing itself
 * (cli_plot_cairo.c): the up-front checks, the --tokens file, and the streamed statistics'
 * pooled map turned into the grid the renderer takes (cli_plot_map in cli.h). The renderer never
 * sees an n x m map larger than CLI_PLOT_MAX_CELLS per axis, so a 32k-token map gives a bounded
 * picture.
 */
#include "cli.h"
#include "npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

int cli_plot_check(
    const char *path, int64_t heads, int64_t n, int64_t m, char *msg, size_t msg_size) {
    if (!cli_plot_available()) {
        snprintf(msg, msg_size,
                 "this mha was built without cairo, so it cannot draw plots (install "
                 "libcairo2-dev and rebuild; CMake option MHA_CAIRO)");
        return 0;
    }
    if (!ends_with(path, ".png") && !ends_with(path, ".svg") && !ends_with(path, ".pdf")) {
        snprintf(msg, msg_size, "unknown image type: use a name ending in .png, .svg or .pdf");
        return 0;
    }
    if (heads > CLI_PLOT_MAX_PANELS || n < 1 || m < 1) {
        snprintf(msg, msg_size,
                 "%lld heads are too many to plot (at most %d; --attn-average "
                 "draws their mean)",
                 (long long)heads, CLI_PLOT_MAX_PANELS);
        return 0;
    }
    return 1;
}

void cli_plot_grid(int64_t n, int64_t m, int64_t *rows, int64_t *cols) {
    *rows = n < CLI_PLOT_MAX_CELLS ? n : CLI_PLOT_MAX_CELLS;
    *cols = m < CLI_PLOT_MAX_CELLS ? m : CLI_PLOT_MAX_CELLS;
}

/* ---- --tokens FILE ----------------------------------------------------------------------------
 */

/* Length of the UTF-8 sequence at s (at most len bytes), or 0 when it is not valid UTF-8
 * (overlong forms, surrogates and code points above U+10FFFF are invalid). */
static size_t utf8_len(const unsigned char *s, size_t len) {
    if (s[0] < 0x80)
        return 1;
    size_t k;
    uint32_t cp;
    if ((s[0] & 0xE0) == 0xC0)
        k = 2, cp = s[0] & 0x1Fu;
    else if ((s[0] & 0xF0) == 0xE0)
        k = 3, cp = s[0] & 0x0Fu;
    else if ((s[0] & 0xF8) == 0xF0)
        k = 4, cp = s[0] & 0x07u;
    else
        return 0;
    if (k > len)
        return 0;
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3Fu);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[k] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return k;
}

/* Checks one token (a line without its newline): "" when fine, else the problem. */
static const char *token_problem(const char *s, size_t len) {
    for (size_t i = 0; i < len;) {
        const unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7F)
            return c == 0 ? "a NUL byte" : "a control character";
        const size_t k = utf8_len((const unsigned char *)s + i, len - i);
        if (k == 0)
            return "bytes that are not valid UTF-8";
        i += k;
    }
    return "";
}

static int read_all(const char *path, char **out, size_t *len) {
    enum { MAX_BYTES = 16 << 20 };
    FILE *f = NULL;
    uint64_t size = 0;
    mha_error err;
    if (mha__npy_open_input(path, &f, &size, &err) != MHA_STATUS_OK)
        return cli_fail("%s", err.message); /* regular files only, as every input */
    char *buf = malloc((size_t)MAX_BYTES + 2);
    if (!buf) {
        fclose(f);
        return cli_fail("%s: out of memory", path);
    }
    const size_t got = fread(buf, 1, (size_t)MAX_BYTES + 1, f);
    const int bad = ferror(f);
    fclose(f);
    if (bad || got > MAX_BYTES) {
        free(buf);
        return bad ? cli_fail("%s: cannot read", path)
                   : cli_fail("%s: larger than 16 MiB, too large for a token list", path);
    }
    buf[got] = '\0';
    *out = buf, *len = got;
    return CLI_OK;
}

int cli_plot_read_tokens(const char *path, int64_t count, char **buf, char ***labels) {
    char *text = NULL;
    size_t len = 0;
    int rc = read_all(path, &text, &len);
    if (rc)
        return rc;
    /* Lines: a final newline ends the last line rather than starting an empty one. */
    int64_t lines = 0;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    if (len > 0 && text[len - 1] != '\n')
        lines++;
    if (lines != count) {
        free(text);
        return cli_fail("%s: %lld tokens (lines), but the map has %lld queries: give one token "
                        "per line",
                        path, (long long)lines, (long long)count);
    }
    char **lab = malloc((size_t)(count > 0 ? count : 1) * sizeof *lab);
    if (!lab) {
        free(text);
        return cli_fail("%s: out of memory", path);
    }
    size_t start = 0;
    for (int64_t t = 0; t < count; t++) {
        size_t end = start;
        while (end < len && text[end] != '\n')
            end++;
        size_t tok_end = end;
        if (tok_end > start && text[tok_end - 1] == '\r') /* CR LF line ends */
            tok_end--;
        const char *why = token_problem(text + start, tok_end - start);
        if (*why) {
            free(text), free(lab);
            return cli_fail("%s: line %lld has %s", path, (long long)(t + 1), why);
        }
        text[tok_end] = '\0';
        lab[t] = text + start;
        start = end + 1;
    }
    *buf = text, *labels = lab;
    return CLI_OK;
}

/* ---- The streamed pooled map -> the renderer's input ------------------------------------ */

/* Cell k of the drawn panel from `heads` panels of pooled means and visible shares (one panel, or
 * the mean over them). */
static void cell_value(const float *pooled,
                       const float *visible,
                       int64_t heads,
                       size_t per,
                       size_t k,
                       float *value,
                       float *masked) {
    double sum = 0.0, vis = 0.0;
    for (int64_t h = 0; h < heads; h++) {
        sum += (double)pooled[(size_t)h * per + k];
        if ((double)visible[(size_t)h * per + k] > vis)
            vis = (double)visible[(size_t)h * per + k];
    }
    sum /= (double)heads;
    *value = vis > 0.0 ? (float)(sum / vis) : 0.0f;
    *masked = (float)(1.0 - vis);
}

int cli_plot_write(const char *path,
                   const float *pooled,
                   const float *visible,
                   int64_t heads,
                   cli_plot_map *map,
                   char *msg,
                   size_t msg_size) {
    if (!cli_plot_check(path, map->panels, map->n, map->m, msg, msg_size))
        return 0;
    cli_plot_grid(map->n, map->m, &map->rows, &map->cols);
    /* At most 64 panels of 128 x 128 cells: two small arrays. */
    const size_t per = (size_t)(map->rows * map->cols), cells = (size_t)map->panels * per;
    float *value = malloc(cells * sizeof *value), *masked = malloc(cells * sizeof *masked);
    if (!value || !masked) {
        free(value), free(masked);
        snprintf(msg, msg_size, "out of memory");
        return 0;
    }
    const int64_t merged = map->panels == 1 ? heads : 1; /* heads averaged into each panel */
    for (int64_t p = 0; p < map->panels; p++)
        for (size_t k = 0; k < per; k++)
            cell_value(pooled + (size_t)p * per, visible + (size_t)p * per, merged, per, k,
                       value + (size_t)p * per + k, masked + (size_t)p * per + k);
    map->value = value, map->masked = masked;
    const int ok = cli_plot_render(path, map, msg, msg_size);
    map->value = map->masked = NULL;
    free(value), free(masked);
    return ok;
}

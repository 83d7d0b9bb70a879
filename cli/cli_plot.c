/* SPDX-License-Identifier: MIT */
/* cli_plot.c: attention maps as an image, for `mha run --plot FILE.svg|FILE.png`.
 *
 * One heatmap per head (row = query, column = key, colour = probability on a fixed 0..1 scale),
 * laid out four to a row. SVG carries titles and index labels; PNG is the same grid as pixels,
 * written without zlib (deflate "stored" blocks, which every PNG reader accepts). Both are written
 * to a temporary name and renamed, like every other output of the program. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A perceptually ordered colour scale (dark blue -> teal -> yellow), 9 stops, interpolated. */
static const unsigned char k_scale[9][3] = {
    {13, 8, 60},    {50, 30, 110},  {60, 70, 140},  {45, 110, 142}, {33, 145, 140},
    {60, 180, 115}, {130, 205, 80}, {200, 222, 50}, {250, 231, 35},
};

static void colour(float p, unsigned char rgb[3]) {
    if (!(p >= 0.0f)) /* NaN and negatives: the bottom of the scale */
        p = 0.0f;
    if (p > 1.0f)
        p = 1.0f;
    const float x = p * 8.0f;
    int k = (int)x;
    if (k > 7)
        k = 7;
    const float t = x - (float)k;
    for (int c = 0; c < 3; c++)
        rgb[c] = (unsigned char)((float)k_scale[k][c] * (1.0f - t) + (float)k_scale[k + 1][c] * t +
                                 0.5f);
}

typedef struct grid {
    int64_t heads, n, m;
    int64_t cell, gap, cols, rows, label; /* pixels */
    int64_t width, height;
} grid;

static int grid_plan(grid *g, int64_t heads, int64_t n, int64_t m, int with_labels) {
    g->heads = heads, g->n = n, g->m = m;
    const int64_t big = n > m ? n : m;
    g->cell = big <= 32 ? 16 : (big <= 128 ? 4 : (big <= 512 ? 1 : 0));
    if (g->cell == 0)
        return 0; /* more than 512 rows or columns: too large to draw usefully */
    g->gap = 12;
    g->label = with_labels ? 28 : 0;
    g->cols = heads < 4 ? heads : 4;
    g->rows = (heads + g->cols - 1) / g->cols;
    g->width = g->cols * (g->m * g->cell + g->label + g->gap) + g->gap;
    g->height = g->rows * (g->n * g->cell + g->label + g->gap) + g->gap;
    return g->width <= 16384 && g->height <= 16384;
}

static int write_svg(FILE *f, const grid *g, const float *probs, const char *title) {
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%lld\" height=\"%lld\" "
            "font-family=\"monospace\" font-size=\"9\">\n",
            (long long)g->width, (long long)(g->height + 20));
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(f, "<text x=\"%lld\" y=\"14\" font-size=\"12\">", (long long)g->gap);
    for (const char *c = title; *c; c++) { /* XML-escape the title */
        if (*c == '<')
            fputs("&lt;", f);
        else if (*c == '>')
            fputs("&gt;", f);
        else if (*c == '&')
            fputs("&amp;", f);
        else if ((unsigned char)*c >= 0x20)
            fputc(*c, f);
    }
    fputs("</text>\n", f);
    for (int64_t h = 0; h < g->heads; h++) {
        const int64_t x0 = g->gap + (h % g->cols) * (g->m * g->cell + g->label + g->gap) + g->label;
        const int64_t y0 =
            20 + g->gap + (h / g->cols) * (g->n * g->cell + g->label + g->gap) + g->label;
        fprintf(f, "<text x=\"%lld\" y=\"%lld\">%s %lld</text>\n", (long long)x0,
                (long long)(y0 - 16), g->heads == 1 ? "mean over heads" : "head",
                (long long)(g->heads == 1 ? 0 : h));
        const int64_t step = g->n > 16 ? (g->n + 15) / 16 : 1;
        for (int64_t i = 0; i < g->n; i += step)
            fprintf(f, "<text x=\"%lld\" y=\"%lld\" text-anchor=\"end\">%lld</text>\n",
                    (long long)(x0 - 3), (long long)(y0 + i * g->cell + g->cell), (long long)i);
        const int64_t mstep = g->m > 16 ? (g->m + 15) / 16 : 1;
        for (int64_t j = 0; j < g->m; j += mstep)
            fprintf(f, "<text x=\"%lld\" y=\"%lld\">%lld</text>\n", (long long)(x0 + j * g->cell),
                    (long long)(y0 - 3), (long long)j);
        for (int64_t i = 0; i < g->n; i++)
            for (int64_t j = 0; j < g->m; j++) {
                unsigned char rgb[3];
                const float p = probs[(h * g->n + i) * g->m + j];
                colour(p, rgb);
                fprintf(f,
                        "<rect x=\"%lld\" y=\"%lld\" width=\"%lld\" height=\"%lld\" "
                        "fill=\"#%02x%02x%02x\"><title>q %lld, k %lld: %.4f</title></rect>\n",
                        (long long)(x0 + j * g->cell), (long long)(y0 + i * g->cell),
                        (long long)g->cell, (long long)g->cell, rgb[0], rgb[1], rgb[2],
                        (long long)i, (long long)j, (double)p);
            }
    }
    fputs("</svg>\n", f);
    return !ferror(f);
}

/* ---- PNG, without zlib: CRC-32 (PNG chunks) and Adler-32 (zlib stream) computed here. ---- */

static void crc_table(uint32_t table[256]) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
}

static uint32_t
crc_update(const uint32_t table[256], uint32_t crc, const unsigned char *p, size_t len) {
    for (size_t i = 0; i < len; i++)
        crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
    return crc;
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}

static int write_chunk(
    FILE *f, const uint32_t table[256], const char type[4], const unsigned char *data, size_t len) {
    unsigned char hdr[8];
    put_be32(hdr, (uint32_t)len);
    memcpy(hdr + 4, type, 4);
    uint32_t crc = crc_update(table, 0xFFFFFFFFu, hdr + 4, 4);
    crc = crc_update(table, crc, data, len) ^ 0xFFFFFFFFu;
    unsigned char tail[4];
    put_be32(tail, crc);
    return fwrite(hdr, 1, 8, f) == 8 && (len == 0 || fwrite(data, 1, len, f) == len) &&
           fwrite(tail, 1, 4, f) == 4;
}

static int write_png(FILE *f, const grid *g, const float *probs) {
    const size_t w = (size_t)g->width, h = (size_t)g->height, line = 1 + 3 * w;
    const size_t raw_len = line * h;
    unsigned char *raw = malloc(raw_len);
    /* zlib stream: 2-byte header, stored blocks of <= 65535 bytes (5-byte headers), Adler-32. */
    const size_t blocks = raw_len / 65535 + 1;
    const size_t z_len = 2 + blocks * 5 + raw_len + 4;
    unsigned char *z = malloc(z_len);
    if (!raw || !z) {
        free(raw), free(z);
        errno = ENOMEM;
        return 0;
    }
    for (size_t y = 0; y < h; y++) {
        raw[y * line] = 0; /* filter: none */
        memset(raw + y * line + 1, 255, 3 * w);
    }
    for (int64_t hd = 0; hd < g->heads; hd++) {
        const int64_t x0 = g->gap + (hd % g->cols) * (g->m * g->cell + g->gap);
        const int64_t y0 = g->gap + (hd / g->cols) * (g->n * g->cell + g->gap);
        for (int64_t i = 0; i < g->n; i++)
            for (int64_t j = 0; j < g->m; j++) {
                unsigned char rgb[3];
                colour(probs[(hd * g->n + i) * g->m + j], rgb);
                for (int64_t dy = 0; dy < g->cell; dy++)
                    for (int64_t dx = 0; dx < g->cell; dx++) {
                        unsigned char *px = raw + (size_t)(y0 + i * g->cell + dy) * line + 1 +
                                            3 * (size_t)(x0 + j * g->cell + dx);
                        memcpy(px, rgb, 3);
                    }
            }
    }
    size_t o = 0;
    z[o++] = 0x78, z[o++] = 0x01;
    uint32_t a = 1, b = 0;
    for (size_t done = 0; done < raw_len || done == 0;) {
        const size_t len = raw_len - done > 65535 ? 65535 : raw_len - done;
        z[o++] = (done + len == raw_len) ? 1 : 0; /* BFINAL on the last block, BTYPE = 00 */
        z[o++] = (unsigned char)len, z[o++] = (unsigned char)(len >> 8);
        z[o++] = (unsigned char)~len, z[o++] = (unsigned char)(~len >> 8);
        memcpy(z + o, raw + done, len);
        for (size_t k = 0; k < len; k++) {
            a = (a + raw[done + k]) % 65521u;
            b = (b + a) % 65521u;
        }
        o += len;
        done += len;
        if (raw_len == 0)
            break;
    }
    put_be32(z + o, (b << 16) | a);
    o += 4;

    uint32_t table[256];
    crc_table(table);
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
    unsigned char ihdr[13];
    put_be32(ihdr, (uint32_t)w);
    put_be32(ihdr + 4, (uint32_t)h);
    ihdr[8] = 8, ihdr[9] = 2, ihdr[10] = 0, ihdr[11] = 0, ihdr[12] = 0; /* 8-bit RGB */
    int ok = fwrite(sig, 1, 8, f) == 8 && write_chunk(f, table, "IHDR", ihdr, 13) &&
             write_chunk(f, table, "IDAT", z, o) && write_chunk(f, table, "IEND", NULL, 0);
    free(raw), free(z);
    return ok;
}

static int ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

int cli_plot_check(
    const char *path, int64_t heads, int64_t n, int64_t m, char *msg, size_t msg_size) {
    const int svg = ends_with(path, ".svg"), png = ends_with(path, ".png");
    if (!svg && !png) {
        snprintf(msg, msg_size, "unknown image type: use a name ending in .svg or .png");
        return 0;
    }
    grid g;
    if (!grid_plan(&g, heads, n, m, svg)) {
        snprintf(msg, msg_size,
                 "%lld heads of %lld x %lld are too large to plot (at most 512 rows/columns)",
                 (long long)heads, (long long)n, (long long)m);
        return 0;
    }
    return 1;
}

int cli_plot_write(const char *path,
                   const float *probs,
                   int64_t heads,
                   int64_t n,
                   int64_t m,
                   const char *title,
                   char *msg,
                   size_t msg_size) {
    if (!cli_plot_check(path, heads, n, m, msg, msg_size))
        return 0;
    const int svg = ends_with(path, ".svg");
    grid g;
    grid_plan(&g, heads, n, m, svg);
    const size_t tmp_size = strlen(path) + 32;
    char *tmp = malloc(tmp_size);
    if (!tmp) {
        snprintf(msg, msg_size, "out of memory");
        return 0;
    }
    snprintf(tmp, tmp_size, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(msg, msg_size, "cannot create: %s", strerror(errno));
        free(tmp);
        return 0;
    }
    int ok = svg ? write_svg(f, &g, probs, title) : write_png(f, &g, probs);
    const int saved = errno;
    ok = (fclose(f) == 0) && ok;
    if (ok && rename(tmp, path) != 0)
        ok = 0;
    if (!ok) {
        snprintf(msg, msg_size, "cannot write: %s", strerror(saved ? saved : errno));
        remove(tmp);
    }
    free(tmp);
    return ok;
}

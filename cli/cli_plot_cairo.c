/* SPDX-License-Identifier: MIT */
/* cli_plot_cairo.c: draws a cli_plot_map (cli.h) through cairo as PNG, SVG or PDF (by the file
 * name's ending; cairo's own writers, which compress: PNG by zlib, PDF streams by Flate, and the
 * SVG embeds each panel as one PNG image instead of one element per cell).
 *
 * Figure, top to bottom: the title, a line saying what the colours mean (scale, pooling, the
 * masked swatch), then the panels, four to a row (eight for more than 16 heads). A panel: its
 * title, query labels on the left, key labels below (vertical), the map, and with the per-panel
 * scale its own colour bar; with the fixed scale one colour bar at the right of the figure.
 * A cell's colour is its value on a perceptually ordered scale (dark blue -> yellow); masked cells
 * are hatched grey, which no probability maps to, and a pooled block that is partly masked is
 * blended toward that hatching by its masked fraction. Sizes are in pixels (PNG) or points (SVG,
 * PDF): at most 8 x 8 panels of 384 x 384, so the figure is bounded whatever n and m are.
 *
 * Without cairo (MHA_HAVE_CAIRO undefined: MHA_CAIRO=OFF or no libcairo2-dev at build time) the
 * program still builds and --plot fails up front, saying so. */
#include "cli.h"

#include <stdio.h>

#if defined(MHA_HAVE_CAIRO)

#    include "npy.h" /* mha__npy_create_tmp, mha__npy_place */

#    include <cairo-pdf.h>
#    include <cairo-svg.h>
#    include <cairo.h>
#    include <errno.h>
#    include <math.h>
#    include <stdlib.h>
#    include <string.h>
#    include <unistd.h>

int cli_plot_available(void) {
    return 1;
}

const char *cli_plot_cairo_version(void) {
    return cairo_version_string();
}

/* A perceptually ordered colour scale (dark blue -> teal -> yellow), 9 stops, interpolated. */
static const unsigned char k_scale[9][3] = {
    {13, 8, 60},    {50, 30, 110},  {60, 70, 140},  {45, 110, 142}, {33, 145, 140},
    {60, 180, 115}, {130, 205, 80}, {200, 222, 50}, {250, 231, 35},
};

enum {
    MARGIN = 16,
    HEADER = 58, /* title + the legend line */
    PANEL_TITLE = 22,
    PANEL_GAP = 28,     /* between panels, both ways */
    BAR_AREA = 74,      /* a colour bar (12 wide) with its tick labels */
    MAX_LABEL_CP = 16,  /* code points of a token label before it is cut with an ellipsis */
    LABEL_SPACING = 13, /* pixels between two token labels along an axis, at least */
    INDEX_SPACING = 24, /* between two index labels: numbers need less density */
    LABEL_FONT = 10,
};

/* x in 0..1 (clamped; NaN gives 0) -> RGB 0..255. */
static void scale_rgb(double x, double rgb[3]) {
    if (!(x >= 0.0))
        x = 0.0;
    if (x > 1.0)
        x = 1.0;
    int k = (int)(x * 8.0);
    if (k > 7)
        k = 7;
    const double t = x * 8.0 - k;
    for (int c = 0; c < 3; c++)
        rgb[c] = k_scale[k][c] * (1.0 - t) + k_scale[k + 1][c] * t;
}

/* The hatching of masked cells at pixel (x, y): diagonal stripes of two greys. */
static double hatch_grey(int64_t x, int64_t y) {
    return ((x + y) % 8) < 2 ? 150.0 : 215.0;
}

/* The figure's geometry, computed once from the map and the label sizes. */
typedef struct layout {
    int64_t cell;             /* pixels per cell */
    int64_t map_w, map_h;     /* one panel's map */
    int64_t label_w, label_h; /* query labels' width (left), key labels' height (below) */
    int64_t grid_cols, grid_rows, panel_w, panel_h;
    int64_t width, height;
    int per_panel_bar;
} layout;

/* ---- Labels ------------------------------------------------------------------------------- */

/* A label no longer than MAX_LABEL_CP code points (cut with "…"), into buf. */
static const char *cut_label(const char *s, char *buf, size_t size) {
    size_t i = 0, cp = 0;
    while (s[i] && cp < MAX_LABEL_CP) {
        i++;
        while (((unsigned char)s[i] & 0xC0) == 0x80) /* continuation bytes of this code point */
            i++;
        cp++;
    }
    if (!s[i])
        return s; /* short enough */
    if (i + 4 > size)
        return "";
    memcpy(buf, s, i);
    memcpy(buf + i, "\xE2\x80\xA6", 4); /* U+2026 and the terminating NUL */
    return buf;
}

/* Labels along an axis of len positions drawn as cells of `px` pixels per position: every
 * position when they fit, else every `step` positions; index labels step by 1, 2, 5 x 10^k. */
static int64_t label_step(double px, int indices) {
    int64_t step = 1;
    while ((double)step * px < (indices ? INDEX_SPACING : LABEL_SPACING)) {
        int64_t decade = 1;
        while (step >= 10 * decade)
            decade *= 10;
        const int64_t lead = step / decade;
        step = !indices ? step + 1 : (lead == 1 ? 2 : (lead == 2 ? 5 : 10)) * decade;
    }
    return step;
}

/* The text of the label at position t (a token or an index). */
static const char *label_text(const char *const *labels, int64_t t, char *buf, size_t size) {
    if (labels)
        return cut_label(labels[t], buf, size);
    snprintf(buf, size, "%lld", (long long)t);
    return buf;
}

/* Widest label drawn along an axis (pixels), for the margin that holds them. */
static double labels_extent(cairo_t *cr, const char *const *labels, int64_t len, int64_t step) {
    double w = 0.0;
    char buf[96];
    for (int64_t t = 0; t < len; t += step) {
        cairo_text_extents_t e;
        cairo_text_extents(cr, label_text(labels, t, buf, sizeof buf), &e);
        if (e.x_advance > w)
            w = e.x_advance;
    }
    return w;
}

/* ---- Layout ------------------------------------------------------------------------------- */

/* The legend line's text (before the masked swatch). */
static void legend_text(const cli_plot_map *mp, char *line, size_t size) {
    const int len = snprintf(line, size, "rows: queries, columns: keys; colour: %s",
                             mp->scale == CLI_PLOT_SCALE_FIXED
                                 ? "probability 0..1"
                                 : "probability, 0..99th percentile of each panel");
    if (len > 0 && (size_t)len < size && (mp->rows < mp->n || mp->cols < mp->m))
        snprintf(line + len, size - (size_t)len, "; pooled: each cell the mean of ~%.3g x %.3g",
                 (double)mp->n / (double)mp->rows, (double)mp->m / (double)mp->cols);
}

/* Width of the title and of the legend line with its swatch, whichever is wider. */
static double header_extent(cairo_t *cr, const cli_plot_map *mp) {
    char line[256];
    legend_text(mp, line, sizeof line);
    cairo_text_extents_t e, t, k;
    cairo_set_font_size(cr, 11.0);
    cairo_text_extents(cr, line, &e);
    cairo_text_extents(cr, "masked", &k);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 14.0);
    cairo_text_extents(cr, mp->title ? mp->title : "attention probabilities", &t);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    const double legend = e.x_advance + 33.0 + k.x_advance;
    return legend > t.x_advance ? legend : t.x_advance;
}

static void plan(cairo_t *cr, const cli_plot_map *mp, layout *L) {
    L->grid_cols = mp->panels <= 4 ? mp->panels : (mp->panels <= 16 ? 4 : 8);
    L->grid_rows = (mp->panels + L->grid_cols - 1) / L->grid_cols;
    const int64_t side = L->grid_cols <= 4 ? 384 : 256;
    const int64_t big = mp->rows > mp->cols ? mp->rows : mp->cols;
    L->cell = side / big < 1 ? 1 : (side / big > 40 ? 40 : side / big);
    L->map_w = L->cell * mp->cols, L->map_h = L->cell * mp->rows;
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, LABEL_FONT);
    const char *const *ql = mp->rows == mp->n ? mp->q_labels : NULL;
    const char *const *kl = mp->cols == mp->m ? mp->k_labels : NULL;
    const double qpx = (double)L->cell * (double)mp->rows / (double)mp->n; /* px per query */
    const double kpx = (double)L->cell * (double)mp->cols / (double)mp->m;
    L->label_w = 8 + (int64_t)ceil(labels_extent(cr, ql, mp->n, label_step(qpx, !ql)));
    L->label_h = 8 + (int64_t)ceil(labels_extent(cr, kl, mp->m, label_step(kpx, !kl)));
    L->per_panel_bar = mp->scale == CLI_PLOT_SCALE_PANEL;
    L->panel_w = L->label_w + L->map_w + (L->per_panel_bar ? BAR_AREA : 0) + PANEL_GAP;
    L->panel_h = PANEL_TITLE + L->map_h + L->label_h + PANEL_GAP;
    L->width = 2 * MARGIN + L->grid_cols * L->panel_w + (L->per_panel_bar ? 0 : BAR_AREA);
    const int64_t header_w = 2 * MARGIN + (int64_t)ceil(header_extent(cr, mp));
    if (L->width < header_w)
        L->width = header_w; /* room for the title and the legend line */
    L->height = HEADER + L->grid_rows * L->panel_h + MARGIN;
}

/* ---- Drawing ------------------------------------------------------------------------------ */

static void text_at(cairo_t *cr, double x, double y, const char *s) {
    cairo_move_to(cr, x, y);
    cairo_show_text(cr, s);
}

/* The panel's map as an image, one block of cell x cell pixels per grid cell: painted as one
 * image (small, compressed files in every format; no seams between cells). */
static cairo_surface_t *
panel_image(const cli_plot_map *mp, int64_t p, double vmax, const layout *L) {
    cairo_surface_t *img =
        cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)L->map_w, (int)L->map_h);
    if (cairo_surface_status(img) != CAIRO_STATUS_SUCCESS)
        return img;
    cairo_surface_flush(img);
    unsigned char *data = cairo_image_surface_get_data(img);
    const int stride = cairo_image_surface_get_stride(img);
    const size_t base = (size_t)(p * mp->rows * mp->cols);
    for (int64_t y = 0; y < L->map_h; y++) {
        uint32_t *row = (uint32_t *)(void *)(data + (size_t)y * (size_t)stride);
        for (int64_t x = 0; x < L->map_w; x++) {
            const size_t k = base + (size_t)((y / L->cell) * mp->cols + x / L->cell);
            const double f = mp->masked ? (double)mp->masked[k] : 0.0;
            double rgb[3];
            scale_rgb((double)mp->value[k] / vmax, rgb);
            const double g = hatch_grey(x, y);
            uint32_t px = 0;
            for (int c = 0; c < 3; c++)
                px = (px << 8) | (uint32_t)lround((1.0 - f) * rgb[c] + f * g);
            row[x] = px;
        }
    }
    cairo_surface_mark_dirty(img);
    return img;
}

/* A vertical colour bar of height h at (x, y) for values 0..vmax, with three tick labels; the top
 * one reads ">= vmax" when larger values were clipped to the top colour. */
static void colour_bar(cairo_t *cr, double x, double y, double h, double vmax, int clipped) {
    cairo_pattern_t *g = cairo_pattern_create_linear(0.0, y + h, 0.0, y);
    for (int k = 0; k < 9; k++)
        cairo_pattern_add_color_stop_rgb(g, k / 8.0, k_scale[k][0] / 255.0, k_scale[k][1] / 255.0,
                                         k_scale[k][2] / 255.0);
    cairo_rectangle(cr, x, y, 12.0, h);
    cairo_set_source(cr, g);
    cairo_fill(cr);
    cairo_pattern_destroy(g);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    cairo_set_line_width(cr, 1.0);
    cairo_rectangle(cr, x + 0.5, y + 0.5, 11.0, h - 1.0);
    cairo_stroke(cr);
    cairo_set_font_size(cr, LABEL_FONT);
    for (int k = 0; k <= 2; k++) {
        char s[32];
        snprintf(s, sizeof s, "%s%.3g", k == 2 && clipped ? "\xE2\x89\xA5 " : "", vmax * k / 2.0);
        const double ty = y + h - h * k / 2.0;
        cairo_move_to(cr, x + 12.0, ty);
        cairo_line_to(cr, x + 16.0, ty);
        cairo_stroke(cr);
        text_at(cr, x + 19.0, ty + 3.5, s);
    }
}

/* Query labels left of the map, key labels below it (reading upward). */
static void
axis_labels(cairo_t *cr, const cli_plot_map *mp, const layout *L, double x0, double y0) {
    const char *const *ql = mp->rows == mp->n ? mp->q_labels : NULL;
    const char *const *kl = mp->cols == mp->m ? mp->k_labels : NULL;
    const double qpx = (double)L->cell * (double)mp->rows / (double)mp->n; /* px per query */
    const double kpx = (double)L->cell * (double)mp->cols / (double)mp->m;
    char buf[96];
    cairo_set_font_size(cr, LABEL_FONT);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    for (int64_t t = 0, step = label_step(qpx, !ql); t < mp->n; t += step) {
        const char *s = label_text(ql, t, buf, sizeof buf);
        cairo_text_extents_t e;
        cairo_text_extents(cr, s, &e);
        text_at(cr, x0 - 5.0 - e.x_advance, y0 + ((double)t + 0.5) * qpx + 3.5, s);
    }
    for (int64_t t = 0, step = label_step(kpx, !kl); t < mp->m; t += step) {
        const char *s = label_text(kl, t, buf, sizeof buf);
        cairo_text_extents_t e;
        cairo_text_extents(cr, s, &e);
        cairo_save(cr);
        cairo_translate(cr, x0 + ((double)t + 0.5) * kpx + 3.5, y0 + (double)L->map_h + 5.0);
        cairo_rotate(cr, -1.5707963267948966); /* -pi/2: reading upward */
        text_at(cr, -e.x_advance, 0.0, s);
        cairo_restore(cr);
    }
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The top of panel p's colour scale: the 99th percentile of its values over the blocks that are
 * not fully masked (1 when that is 0), so that a few large values (the first queries of a causal
 * map see few keys) do not darken the rest; larger values take the top colour and the colour bar
 * says so. *clipped: whether any value is above. */
static double panel_max(const cli_plot_map *mp, int64_t p, int *clipped) {
    const size_t cells = (size_t)(mp->rows * mp->cols), base = (size_t)p * cells;
    float *v = malloc(cells * sizeof *v);
    *clipped = 0;
    if (!v)
        return 1.0; /* the fixed scale: still a correct picture */
    size_t len = 0;
    for (size_t k = 0; k < cells; k++)
        if (!mp->masked || mp->masked[base + k] < 1.0f)
            v[len++] = mp->value[base + k];
    double top = 0.0;
    if (len > 0) {
        qsort(v, len, sizeof *v, cmp_float);
        top = (double)v[(len - 1) * 99 / 100];
        *clipped = v[len - 1] > v[(len - 1) * 99 / 100];
    }
    free(v);
    return top > 0.0 ? top : 1.0;
}

static void panel(cairo_t *cr, const cli_plot_map *mp, const layout *L, int64_t p) {
    const double px = MARGIN + (double)((p % L->grid_cols) * L->panel_w);
    const double py = HEADER + (double)((p / L->grid_cols) * L->panel_h);
    const double x0 = px + (double)L->label_w, y0 = py + PANEL_TITLE;
    int clipped = 0;
    const double vmax = mp->scale == CLI_PLOT_SCALE_FIXED ? 1.0 : panel_max(mp, p, &clipped);
    char title[64];
    if (mp->panels_are_heads)
        snprintf(title, sizeof title, "head %lld", (long long)p);
    else
        snprintf(title, sizeof title, "mean over heads");
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 12.0);
    cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
    text_at(cr, x0, y0 - 7.0, title);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_surface_t *img = panel_image(mp, p, vmax, L);
    cairo_set_source_surface(cr, img, x0, y0);
    cairo_paint(cr);
    cairo_surface_destroy(img);
    axis_labels(cr, mp, L, x0, y0);
    if (L->per_panel_bar)
        colour_bar(cr, x0 + (double)L->map_w + 10.0, y0, (double)L->map_h, vmax, clipped);
}

/* The legend line: what the scale, the axes and the hatching mean, with a hatched swatch. */
static void header(cairo_t *cr, const cli_plot_map *mp, const layout *L) {
    cairo_set_source_rgb(cr, 1.0, 1.0, 1.0);
    cairo_paint(cr);
    cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 14.0);
    text_at(cr, MARGIN, MARGIN + 12.0, mp->title ? mp->title : "attention probabilities");
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, 11.0);
    char line[256];
    legend_text(mp, line, sizeof line);
    const double y = MARGIN + 32.0;
    text_at(cr, MARGIN, y, line);
    cairo_text_extents_t e;
    cairo_text_extents(cr, line, &e);
    const double sx = MARGIN + e.x_advance + 14.0;
    cairo_save(cr); /* the swatch: grey with the hatching's stripes */
    cairo_rectangle(cr, sx, y - 10.0, 14.0, 14.0);
    cairo_clip(cr);
    cairo_set_source_rgb(cr, 215 / 255.0, 215 / 255.0, 215 / 255.0);
    cairo_paint(cr);
    cairo_set_source_rgb(cr, 150 / 255.0, 150 / 255.0, 150 / 255.0);
    cairo_set_line_width(cr, 2.0);
    for (int k = -2; k < 4; k++) {
        cairo_move_to(cr, sx + 8.0 * k, y + 4.0);
        cairo_line_to(cr, sx + 8.0 * k + 14.0, y - 10.0);
    }
    cairo_stroke(cr);
    cairo_restore(cr);
    cairo_set_source_rgb(cr, 0.0, 0.0, 0.0);
    text_at(cr, sx + 19.0, y, "masked");
    if (!L->per_panel_bar)
        colour_bar(cr, (double)(MARGIN + L->grid_cols * L->panel_w), HEADER + PANEL_TITLE,
                   (double)L->map_h, 1.0, 0);
}

static int ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* Draws the figure on a surface of the file's type writing to tmp; a cairo status. */
static cairo_status_t draw_to(const char *path, const char *tmp, const cli_plot_map *mp) {
    /* The text sizes decide the layout: measure on a scratch surface first. */
    cairo_surface_t *scratch = cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1);
    cairo_t *m = cairo_create(scratch);
    layout L;
    plan(m, mp, &L);
    cairo_status_t st = cairo_status(m);
    cairo_destroy(m);
    cairo_surface_destroy(scratch);
    if (st != CAIRO_STATUS_SUCCESS)
        return st;
    const int png = ends_with(path, ".png");
    cairo_surface_t *s =
        png ? cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)L.width, (int)L.height)
        : ends_with(path, ".svg")
            ? cairo_svg_surface_create(tmp, (double)L.width, (double)L.height)
            : cairo_pdf_surface_create(tmp, (double)L.width, (double)L.height);
    cairo_t *cr = cairo_create(s);
    header(cr, mp, &L);
    for (int64_t p = 0; p < mp->panels; p++)
        panel(cr, mp, &L, p);
    st = cairo_status(cr);
    cairo_destroy(cr);
    if (st == CAIRO_STATUS_SUCCESS && png)
        st = cairo_surface_write_to_png(s, tmp);
    cairo_surface_finish(s);
    if (st == CAIRO_STATUS_SUCCESS)
        st = cairo_surface_status(s);
    cairo_surface_destroy(s);
    return st;
}

int cli_plot_render(const char *path, const cli_plot_map *map, char *msg, size_t msg_size) {
    const size_t tmp_size = strlen(path) + 32;
    char *tmp = malloc(tmp_size);
    if (!tmp) {
        snprintf(msg, msg_size, "out of memory");
        return 0;
    }
    snprintf(tmp, tmp_size, "%s.tmp.%ld", path, (long)getpid());
    /* The name is created new first (never an existing file or a link: mha__npy_create_tmp);
     * cairo then opens that file of ours. */
    FILE *reserved = mha__npy_create_tmp(tmp);
    if (!reserved) {
        snprintf(msg, msg_size, "cannot create '%s': %s", tmp, strerror(errno));
        free(tmp);
        return 0;
    }
    fclose(reserved);
    const cairo_status_t st = draw_to(path, tmp, map);
    int ok = st == CAIRO_STATUS_SUCCESS;
    if (ok && mha__npy_place(tmp, path) != 0) { /* (renamed now, or with the run's set) */
        snprintf(msg, msg_size, "cannot write: %s", strerror(errno));
        ok = 0;
    } else if (!ok) {
        snprintf(msg, msg_size, "cannot write: %s", cairo_status_to_string(st));
    }
    if (!ok)
        remove(tmp);
    free(tmp);
    return ok;
}

#else /* no cairo */

int cli_plot_available(void) {
    return 0;
}

const char *cli_plot_cairo_version(void) {
    return NULL;
}

int cli_plot_render(const char *path, const cli_plot_map *map, char *msg, size_t msg_size) {
    (void)path, (void)map;
    snprintf(msg, msg_size, "this mha was built without cairo, so it cannot draw plots");
    return 0;
}

#endif

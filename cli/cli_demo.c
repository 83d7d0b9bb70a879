/* SPDX-License-Identifier: MIT */
/* cli_demo.c: `mha demo`, attention made visible with no files.
 *
 * A small layer (d_model 32, 4 heads of d_k 16, RoPE interleaved on 8 of the 16 dims) gets query
 * and key weights set by hand so that each head shows a pattern known from trained models
 * (previous token, first token, same word, subject), and value/output weights from a fixed-seed
 * generator. Token embeddings are built from a small vocabulary plus the position. The layer
 * runs causal self-attention through the public API and the per-head probabilities are drawn
 * as shaded maps. Everything is deterministic and takes well under a millisecond.
 */
#include "cli.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    DEMO_D = 32,    /* d_model */
    DEMO_H = 4,     /* heads */
    DEMO_DK = 16,   /* d_k = d_v */
    DEMO_ROT = 8,   /* rotary dims per head: 0..7 rotate, 8..15 carry content unrotated */
    DEMO_CODE = 10, /* word-identity code size (embedding features 8..17) */
    DEMO_MAX_TOKENS = 32,
    DEMO_LABEL = 40, /* bytes kept of each word */
};
#define DEMO_THETA 10000.0

/* Embedding features. */
enum { F_ONE = 0, F_FIRST = 1, F_POS = 2, F_NOUN = 3, F_ANIMATE = 4, F_SEEKER = 5, F_CODE = 8 };

enum { T_NOUN = 1, T_ANIMATE = 2, T_SEEKER = 4 }; /* seeker: verbs and pronouns */

static const struct {
    const char *word;
    int code; /* one-hot identity code 0..9, or -1 for a hashed code */
    int tags;
} lexicon[] = {
    {"the", 0, 0},
    {"cat", 1, T_NOUN | T_ANIMATE},
    {"sat", 2, T_SEEKER},
    {"on", 3, 0},
    {"mat", 4, T_NOUN},
    {"because", 5, 0},
    {"it", 6, T_SEEKER},
    {"was", 7, T_SEEKER},
    {"tired", 8, 0},
    {"a", 9, 0},
    {"dog", -1, T_NOUN | T_ANIMATE},
    {"bird", -1, T_NOUN | T_ANIMATE},
    {"man", -1, T_NOUN | T_ANIMATE},
    {"woman", -1, T_NOUN | T_ANIMATE},
    {"child", -1, T_NOUN | T_ANIMATE},
    {"rug", -1, T_NOUN},
    {"sofa", -1, T_NOUN},
    {"house", -1, T_NOUN},
    {"tree", -1, T_NOUN},
    {"ball", -1, T_NOUN},
    {"he", -1, T_SEEKER},
    {"she", -1, T_SEEKER},
    {"they", -1, T_SEEKER},
    {"is", -1, T_SEEKER},
    {"ran", -1, T_SEEKER},
    {"slept", -1, T_SEEKER},
    {"saw", -1, T_SEEKER},
    {"chased", -1, T_SEEKER},
    {"liked", -1, T_SEEKER},
    {"were", -1, T_SEEKER},
};

static const char *const head_names[DEMO_H] = {"previous token", "first token", "same word",
                                               "subject"};
static const char *const head_notes[DEMO_H] = {
    "query and key are constant vectors that RoPE rotates, so the score depends only on i - j",
    "keys of position 0 carry a marker the queries look for (an \"attention sink\")",
    "query and key are the word's identity code; ties go to the earliest occurrence",
    "verbs and pronouns look for the animate noun; other words spread over recent tokens",
};

static const char *const default_sentence = "the cat sat on the mat because it was tired";

/* ---- Deterministic pseudo-random numbers (xorshift64*, fixed seed). -------------------------- */
static uint64_t rng_next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1DULL;
}

static float rng_uniform(uint64_t *s) { /* [-1, 1) */
    return (float)((double)(rng_next(s) >> 11) * 0x1.0p-52 - 1.0);
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ULL;
    }
    return h ? h : 1;
}

/* ---- Tokens and embeddings. ------------------------------------------------------------------ */
typedef struct demo_token {
    char label[DEMO_LABEL + 1]; /* as typed (truncated on a character boundary) */
    char key[DEMO_LABEL + 1];   /* lower-case letters and digits, for the lexicon */
} demo_token;

/* Splits on blanks. Returns the token count, or -1 (after a usage line) when there are none or
 * too many. */
static int tokenize(const char *text, demo_token *tok) {
    int n = 0;
    const char *p = text;
    while (*p) {
        while (*p && isspace((unsigned char)*p))
            p++;
        if (!*p)
            break;
        const char *start = p;
        while (*p && !isspace((unsigned char)*p))
            p++;
        if (n == DEMO_MAX_TOKENS) {
            cli_usage("--sentence: more than %d words", DEMO_MAX_TOKENS);
            return -1;
        }
        size_t len = (size_t)(p - start);
        if (len > DEMO_LABEL) { /* cut on a UTF-8 character boundary */
            len = DEMO_LABEL;
            while (len > 0 && ((unsigned char)start[len] & 0xC0) == 0x80)
                len--;
        }
        memcpy(tok[n].label, start, len);
        tok[n].label[len] = '\0';
        size_t k = 0;
        for (size_t i = 0; i < len; i++)
            if (isalnum((unsigned char)start[i]) || ((unsigned char)start[i] & 0x80))
                tok[n].key[k++] = (char)tolower((unsigned char)start[i]);
        tok[n].key[k] = '\0';
        n++;
    }
    if (n == 0)
        cli_usage("--sentence: no words");
    return n == 0 ? -1 : n;
}

static void embed(const demo_token *tok, int n, float *x) {
    memset(x, 0, (size_t)n * DEMO_D * sizeof(float));
    for (int p = 0; p < n; p++) {
        float *e = x + (size_t)p * DEMO_D;
        int code = -1, tags = 0;
        for (size_t i = 0; i < sizeof lexicon / sizeof lexicon[0]; i++)
            if (strcmp(lexicon[i].word, tok[p].key) == 0) {
                code = lexicon[i].code;
                tags = lexicon[i].tags;
            }
        e[F_ONE] = 1.0f;
        e[F_FIRST] = p == 0 ? 1.0f : 0.0f;
        e[F_POS] = (float)p / 4.0f;
        e[F_NOUN] = (tags & T_NOUN) ? 1.0f : 0.0f;
        e[F_ANIMATE] = (tags & T_ANIMATE) ? 1.0f : 0.0f;
        e[F_SEEKER] = (tags & T_SEEKER) ? 1.0f : 0.0f;
        uint64_t h = fnv1a(tok[p].key[0] ? tok[p].key : tok[p].label);
        if (code >= 0) {
            e[F_CODE + code] = 1.0f;
        } else { /* two signed entries chosen by a hash of the word */
            int a = (int)(rng_next(&h) % DEMO_CODE), b = (int)(rng_next(&h) % (DEMO_CODE - 1));
            if (b >= a)
                b++;
            e[F_CODE + a] = (rng_next(&h) & 1) ? 0.70710678f : -0.70710678f;
            e[F_CODE + b] = (rng_next(&h) & 1) ? 0.70710678f : -0.70710678f;
        }
        for (int f = F_CODE + DEMO_CODE; f < DEMO_D; f++) /* "meaning" features for the values */
            e[f] = 0.5f * rng_uniform(&h);
    }
}

/* ---- Weights. -------------------------------------------------------------------------------- */
#define WQ(head, row, feature) wq[((head)*DEMO_DK + (row)) * DEMO_D + (feature)]
#define WK(head, row, feature) wk[((head)*DEMO_DK + (row)) * DEMO_D + (feature)]

static void make_weights(float *wq, float *wk, float *wv, float *wo) {
    const size_t proj = (size_t)DEMO_H * DEMO_DK * DEMO_D;
    memset(wq, 0, proj * sizeof(float));
    memset(wk, 0, proj * sizeof(float));

    /* Head 0, previous token. RoPE turns q at position i by i*f_k and k at j by j*f_k (pair k),
     * so q.k = sum_k a_k cos((i - j) f_k + phi_k). Pre-turning q by phi_k = -f_k puts the
     * maximum at i - j = 1 for the two fastest pairs; a small recency term (key feature F_POS)
     * breaks the remaining ties toward the nearest key. */
    for (int k = 0; k < 2; k++) {
        const double f = pow(DEMO_THETA, -2.0 * k / DEMO_ROT);
        WQ(0, 2 * k, F_ONE) = (float)(40.0 * cos(-f));
        WQ(0, 2 * k + 1, F_ONE) = (float)(40.0 * sin(-f));
        WK(0, 2 * k, F_ONE) = 1.0f;
    }
    WQ(0, 8, F_ONE) = 4.0f;
    WK(0, 8, F_POS) = 1.0f;

    /* Head 1, first token: the key of position 0 carries F_FIRST. */
    WQ(1, 8, F_ONE) = 16.0f;
    WK(1, 8, F_FIRST) = 1.0f;

    /* Head 2, same word: identity codes in dims 6..15 (pair 3 and the unrotated half), and an
     * "earliest" bias in dims 4..5 (pair 2 turns by only 0.01 rad per token). */
    for (int c = 0; c < DEMO_CODE; c++) {
        WQ(2, 6 + c, F_CODE + c) = 10.0f;
        WK(2, 6 + c, F_CODE + c) = 4.0f;
    }
    WQ(2, 4, F_ONE) = 9.0f;
    WK(2, 4, F_POS) = -1.0f;

    /* Head 3, subject: seekers (verbs, pronouns) look for animate nouns, then nouns; everyone
     * else keeps a mild preference for recent tokens. */
    WQ(3, 8, F_SEEKER) = 16.0f;
    WK(3, 8, F_ANIMATE) = 1.0f;
    WK(3, 8, F_NOUN) = 0.4f;
    WQ(3, 9, F_ONE) = 2.0f;
    WK(3, 9, F_POS) = 1.0f;

    /* Values and output: fixed-seed uniform weights, scaled like nn.Linear's init. */
    uint64_t s = 0x6d68612d64656d6fULL; /* "mha-demo" */
    const float bound = 1.0f / sqrtf((float)DEMO_D);
    for (size_t i = 0; i < proj; i++)
        wv[i] = bound * rng_uniform(&s);
    const float obound = 1.0f / sqrtf((float)(DEMO_H * DEMO_DK));
    for (size_t i = 0; i < proj; i++)
        wo[i] = obound * rng_uniform(&s);
}

#undef WQ
#undef WK

/* ---- Drawing. -------------------------------------------------------------------------------- */

/* Decodes one UTF-8 sequence at s (of n >= 1 bytes); returns the code point, or U+FFFD for a
 * malformed one (then *n = 1). */
static uint32_t utf8_next(const char *s, int *n) {
    const unsigned char *u = (const unsigned char *)s;
    int len = 0;
    uint32_t cp = 0;
    if (u[0] < 0x80) {
        len = 1;
        cp = u[0];
    } else if ((u[0] >> 5) == 6) {
        len = 2;
        cp = u[0] & 0x1Fu;
    } else if ((u[0] >> 4) == 14) {
        len = 3;
        cp = u[0] & 0x0Fu;
    } else if ((u[0] >> 3) == 30) {
        len = 4;
        cp = u[0] & 0x07u;
    }
    for (int i = 1; i < len; i++) {
        if ((u[i] & 0xC0) != 0x80) {
            len = 0;
            break;
        }
        cp = (cp << 6) | (u[i] & 0x3Fu);
    }
    if (len == 0) {
        *n = 1;
        return 0xFFFD;
    }
    *n = len;
    return cp;
}

/* Terminal columns of a code point: 2 for the East Asian wide ranges, 0 for combining marks, else
 * 1 (a small table in place of wcwidth(), which would depend on the locale). */
static int cp_width(uint32_t c) {
    if ((c >= 0x0300 && c <= 0x036F) || (c >= 0x200B && c <= 0x200F))
        return 0;
    if ((c >= 0x1100 && c <= 0x115F) || (c >= 0x2E80 && c <= 0xA4CF) ||
        (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xF900 && c <= 0xFAFF) ||
        (c >= 0xFE30 && c <= 0xFE4F) || (c >= 0xFF00 && c <= 0xFF60) ||
        (c >= 0xFFE0 && c <= 0xFFE6) || (c >= 0x1F300 && c <= 0x1FAFF) ||
        (c >= 0x20000 && c <= 0x3FFFD))
        return 2;
    return 1;
}

/* Terminal columns taken by a UTF-8 string. */
static int text_width(const char *s) {
    int w = 0, n;
    for (; *s; s += n)
        w += cp_width(utf8_next(s, &n));
    return w;
}

/* Appends s to buf (of size cap), then spaces up to display width `width`. */
static void append_padded(char *buf, size_t cap, const char *s, int width) {
    size_t used = strlen(buf);
    snprintf(buf + used, cap - used, "%s", s);
    for (int w = text_width(s); w < width; w++) {
        used = strlen(buf);
        if (used + 1 < cap) {
            buf[used] = ' ';
            buf[used + 1] = '\0';
        }
    }
}

/* Label cut to at most `max` columns on a character boundary; with `ascii`, every non-ASCII
 * character becomes '?'. */
static void short_label(const char *label, int max, int ascii, char *out, size_t cap) {
    size_t o = 0;
    int w = 0, n;
    for (const char *p = label; *p; p += n) {
        uint32_t c = utf8_next(p, &n);
        int cw = ascii ? 1 : cp_width(c);
        if (w + cw > max || o + (size_t)n + 1 > cap)
            break;
        if (ascii && c >= 0x80) {
            out[o++] = '?';
        } else {
            memcpy(out + o, p, (size_t)n);
            o += (size_t)n;
        }
        w += cw;
    }
    out[o] = '\0';
}

static const char *shade(float p, int ascii) {
    static const char *const blocks[5] = {" ", "\u2591", "\u2592", "\u2593", "\u2588"};
    static const char *const ramp[10] = {" ", ".", ":", "-", "=", "+", "*", "#", "%", "@"};
    if (ascii) {
        if (p < 0.05f)
            return ramp[0];
        int level = 1 + (int)((p - 0.05f) / 0.95f * 9.0f);
        return ramp[level > 9 ? 9 : level];
    }
    if (p < 0.05f)
        return blocks[0];
    if (p < 0.25f)
        return blocks[1];
    if (p < 0.5f)
        return blocks[2];
    if (p < 0.75f)
        return blocks[3];
    return blocks[4];
}

enum { LINE_CAP = 640, LABEL_COLS = 8 };

/* Builds the lines of one head's map; returns the line count. */
static int map_lines(const float *p,
                     const demo_token *tok,
                     int n,
                     int head,
                     int ascii,
                     char (*lines)[LINE_CAP],
                     int *width) {
    int labw = 0;
    char lab[DEMO_LABEL + 1];
    for (int i = 0; i < n; i++) {
        short_label(tok[i].label, LABEL_COLS, ascii, lab, sizeof lab);
        if (text_width(lab) > labw)
            labw = text_width(lab);
    }
    int L = 0;
    snprintf(lines[L++], LINE_CAP, "head %d: %s", head, head_names[head]);
    *width = 3 + labw + 1 + 2 * n;
    if (text_width(lines[0]) > *width)
        *width = text_width(lines[0]);
    if (n > 10) {
        lines[L][0] = '\0';
        append_padded(lines[L], LINE_CAP, "", 3 + labw + 1);
        for (int j = 0; j < n; j++) {
            char d[16];
            snprintf(d, sizeof d, "%c ", j >= 10 ? (char)('0' + j / 10) : ' ');
            append_padded(lines[L], LINE_CAP, d, 2);
        }
        L++;
    }
    lines[L][0] = '\0';
    append_padded(lines[L], LINE_CAP, "", 3 + labw + 1);
    for (int j = 0; j < n; j++) {
        char d[16];
        snprintf(d, sizeof d, "%d ", j % 10);
        append_padded(lines[L], LINE_CAP, d, 2);
    }
    L++;
    for (int i = 0; i < n; i++) {
        char idx[16];
        snprintf(idx, sizeof idx, "%2d ", i);
        lines[L][0] = '\0';
        append_padded(lines[L], LINE_CAP, idx, 3);
        short_label(tok[i].label, LABEL_COLS, ascii, lab, sizeof lab);
        append_padded(lines[L], LINE_CAP, lab, labw + 1);
        for (int j = 0; j < n; j++) {
            const char *c = j > i ? " " : shade(p[(size_t)i * n + j], ascii);
            char cell[16];
            snprintf(cell, sizeof cell, "%s%s", c, c);
            append_padded(lines[L], LINE_CAP, cell, 2);
        }
        L++;
    }
    return L;
}

static void print_maps(const float *probs, const demo_token *tok, int n, int ascii) {
    char(*lines)[LINE_CAP] = malloc(sizeof(*lines) * (size_t)DEMO_H * (DEMO_MAX_TOKENS + 3));
    if (!lines)
        return;
    int count[DEMO_H], width[DEMO_H];
    for (int h = 0; h < DEMO_H; h++)
        count[h] = map_lines(probs + (size_t)h * n * n, tok, n, h, ascii,
                             lines + (size_t)h * (DEMO_MAX_TOKENS + 3), &width[h]);
    const int side_by_side = 2 * width[0] + 4 <= 100;
    for (int h = 0; h < DEMO_H; h += side_by_side ? 2 : 1) {
        for (int l = 0; l < count[h]; l++) {
            char row[2 * LINE_CAP];
            row[0] = '\0';
            const char *left = lines[(size_t)h * (DEMO_MAX_TOKENS + 3) + (size_t)l];
            if (side_by_side && h + 1 < DEMO_H) {
                append_padded(row, sizeof row, left, width[h] + 4);
                size_t used = strlen(row);
                snprintf(row + used, sizeof row - used, "%s",
                         lines[(size_t)(h + 1) * (DEMO_MAX_TOKENS + 3) + (size_t)l]);
            } else {
                snprintf(row, sizeof row, "%s", left);
            }
            size_t len = strlen(row); /* no trailing blanks */
            while (len > 0 && row[len - 1] == ' ')
                row[--len] = '\0';
            printf("  %s\n", row);
        }
        printf("\n");
    }
    free(lines);
}

static void print_numbers(const float *p, const demo_token *tok, int n, int head, int ascii) {
    printf("Head %d (%s), the probabilities (row = query, column = key; rows sum to 1):\n", head,
           head_names[head]);
    char lab[DEMO_LABEL + 1], line[LINE_CAP * 2];
    line[0] = '\0';
    append_padded(line, sizeof line, "", 12);
    for (int j = 0; j < n; j++) {
        short_label(tok[j].label, 5, ascii, lab, sizeof lab);
        char cell[DEMO_LABEL + 8];
        snprintf(cell, sizeof cell, "%*s%s", 6 - text_width(lab), "", lab);
        append_padded(line, sizeof line, cell, 6);
    }
    printf("  %s\n", line);
    for (int i = 0; i < n; i++) {
        line[0] = '\0';
        short_label(tok[i].label, 8, ascii, lab, sizeof lab);
        char idx[16];
        snprintf(idx, sizeof idx, "%2d ", i);
        append_padded(line, sizeof line, idx, 3);
        append_padded(line, sizeof line, lab, 9);
        for (int j = 0; j <= i; j++) {
            char cell[16];
            snprintf(cell, sizeof cell, "%6.2f", (double)p[(size_t)i * n + j]);
            append_padded(line, sizeof line, cell, 6);
        }
        printf("  %s\n", line);
    }
    printf("\n");
}

static void print_summary(const float *probs, const demo_token *tok, int n, int ascii) {
    printf("What each query attends to most (query %s key; (j) = key index of a repeated word):\n",
           ascii ? "->" : "\u2192");
    for (int h = 0; h < DEMO_H; h++) {
        char line[LINE_CAP];
        snprintf(line, sizeof line, "  head %d, %s:", h, head_names[h]);
        int col = text_width(line);
        printf("%s", line);
        for (int i = 0; i < n; i++) {
            const float *row = probs + ((size_t)h * n + (size_t)i) * n;
            int best = 0;
            for (int j = 1; j <= i; j++)
                if (row[j] > row[best])
                    best = j;
            char a[48], b[48], item[128];
            short_label(tok[i].label, 10, ascii, a, sizeof a);
            short_label(tok[best].label, 10, ascii, b, sizeof b);
            int same = 0; /* a repeated word gets its index, to tell the copies apart */
            for (int j = 0; j < n; j++)
                same += strcmp(tok[j].label, tok[best].label) == 0;
            if (same > 1) {
                size_t used = strlen(b);
                snprintf(b + used, sizeof b - used, "(%d)", best);
            }
            snprintf(item, sizeof item, " %s%s%s", a, ascii ? "->" : "\u2192", b);
            if (col + text_width(item) > 98) {
                printf("\n     ");
                col = 5;
            }
            printf("%s", item);
            col += text_width(item);
        }
        printf("\n");
    }
}

void cli_demo_usage(void) {
    fputs("Usage: mha demo [--sentence TEXT] [--ascii] [--head H]\n"
          "\n"
          "Builds a small attention layer with fixed weights (d_model 32, 4 heads of d_k 16,\n"
          "RoPE interleaved with theta 10000 on 8 of the 16 dims per head), runs causal\n"
          "self-attention on a sentence and draws each head's attention map: one row per query\n"
          "token, one column per key token, darker = more attention; the blank upper triangle is\n"
          "masked (the future). The query/key weights are set by hand so that the heads show\n"
          "patterns found in trained models: previous token, first token, same word, subject.\n"
          "\n"
          "Options:\n"
          "  --sentence TEXT  words separated by blanks, at most 32\n"
          "                   (default: \"the cat sat on the mat because it was tired\").\n"
          "                   Words outside the small built-in vocabulary get hashed codes, so\n"
          "                   the same-word and subject heads are less clean on them.\n"
          "  --ascii          shade with ' .:-=+*#%@' instead of Unicode blocks (default: blocks)\n"
          "  --head H         head whose probabilities are printed as numbers, 0..3 (default: 0)\n"
          "  --help           this text\n"
          "\n"
          "Examples:\n"
          "  mha demo\n"
          "  mha demo --ascii --head 2 --sentence \"the dog saw the cat and the dog ran\"\n",
          stdout);
}

int cli_demo_main(int argc, char **argv) {
    enum { D_HELP, D_SENTENCE, D_ASCII, D_HEAD, D_COUNT };
    static const cli_opt opts[D_COUNT] = {
        [D_HELP] = {"--help", CLI_OPT_FLAG},
        [D_SENTENCE] = {"--sentence", CLI_OPT_VALUE},
        [D_ASCII] = {"--ascii", CLI_OPT_FLAG},
        [D_HEAD] = {"--head", CLI_OPT_VALUE},
    };
    cli_args args;
    int rc = cli_parse(argc, argv, opts, D_COUNT, &args);
    if (rc)
        return rc;
    if (args.given[D_HELP]) {
        cli_demo_usage();
        return CLI_OK;
    }
    const int ascii = args.given[D_ASCII];
    int64_t show = 0;
    if (args.given[D_HEAD] &&
        (rc = cli_parse_i64("--head", args.value[D_HEAD], 0, DEMO_H - 1, &show)))
        return rc;
    const char *sentence = args.given[D_SENTENCE] ? args.value[D_SENTENCE] : default_sentence;
    demo_token *tok = calloc(DEMO_MAX_TOKENS, sizeof *tok);
    if (!tok)
        return cli_fail("out of memory");
    const int n = tokenize(sentence, tok);
    if (n < 0) {
        free(tok);
        return CLI_USAGE;
    }

    const size_t proj = (size_t)DEMO_H * DEMO_DK * DEMO_D;
    const size_t nx = (size_t)n * DEMO_D, np = (size_t)DEMO_H * n * n;
    float *mem = malloc((4 * proj + 2 * nx + np) * sizeof(float));
    if (!mem) {
        free(tok);
        return cli_fail("out of memory");
    }
    float *wq = mem, *wk = wq + proj, *wv = wk + proj, *wo = wv + proj;
    float *x = wo + proj, *y = x + nx, *probs = y + nx;
    make_weights(wq, wk, wv, wo);
    embed(tok, n, x);

    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.q_dim = DEMO_D;
    cfg.num_heads = DEMO_H;
    cfg.head_dim = DEMO_DK;
    cfg.out_dim = DEMO_D;
    cfg.rope.style = MHA_ROPE_INTERLEAVED;
    cfg.rope.theta = DEMO_THETA;
    cfg.rope.rotary_dim = DEMO_ROT;
    mha_weights w;
    memset(&w, 0, sizeof w);
    w.w_q = wq;
    w.w_k = wk;
    w.w_v = wv;
    w.w_o = wo;
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_layer *layer = NULL;
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1;
    fa.q_len = n;
    fa.kv_len = n;
    fa.query = x;
    fa.mask.causal = 1;
    fa.mask.alignment = MHA_ALIGN_BOTTOM_RIGHT;
    fa.mask.window_left = fa.mask.window_right = -1;
    fa.out = y;
    fa.probs = probs;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.impl = MHA_IMPL_AUTO;
    ex.n_threads = 1;
    if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_BORROW, NULL, &layer, &err) != MHA_STATUS_OK ||
        mha_layer_forward(layer, &fa, &ex, &err) != MHA_STATUS_OK) {
        rc = cli_lib_fail("demo", &err);
    } else {
        char text[LINE_CAP]; /* the tokens again, cut to about one line */
        text[0] = '\0';
        for (int i = 0; i < n && text_width(text) < 72; i++) {
            char lab[DEMO_LABEL + 1];
            short_label(tok[i].label, DEMO_LABEL, ascii, lab, sizeof lab);
            size_t used = strlen(text);
            snprintf(text + used, sizeof text - used, "%s%s", i ? " " : "", lab);
        }
        if (text_width(text) >= 72) {
            char cut[LINE_CAP / 2];
            short_label(text, 68, ascii, cut, sizeof cut);
            snprintf(text, sizeof text, "%s ...", cut);
        }
        printf("mha demo: one attention layer with hand-set weights, no files needed.\n"
               "  d_model %d, %d heads of d_k %d, causal self-attention, RoPE interleaved "
               "(theta %.0f)\n  on dims 0..%d of each head; %d token%s: \"%s\"\n\n",
               DEMO_D, DEMO_H, DEMO_DK, DEMO_THETA, DEMO_ROT - 1, n, n == 1 ? "" : "s", text);
        printf("Row = query token, column = key token (by index), shade = attention "
               "probability:\n  %s\n  The blank upper triangle is masked: a token cannot see "
               "the future.\n\n",
               ascii ? "' ' < 5%, then . : - = + * # % @ up to 100%"
                     : "' ' < 5%, \u2591 < 25%, \u2592 < 50%, \u2593 < 75%, \u2588 >= 75%");
        print_maps(probs, tok, n, ascii);
        print_summary(probs, tok, n, ascii);
        printf("\nHow the heads were built:\n");
        for (int h = 0; h < DEMO_H; h++)
            printf("  head %d: %s\n", h, head_notes[h]);
        printf("\n");
        print_numbers(probs + (size_t)show * n * n, tok, n, (int)show, ascii);
        printf("Try: mha demo --sentence \"the dog saw the cat and the dog ran\"; "
               "mha run --help.\n");
        rc = CLI_OK;
    }
    mha_layer_destroy(layer);
    free(mem);
    free(tok);
    return rc;
}

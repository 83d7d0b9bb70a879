/* SPDX-License-Identifier: MIT */
/* q8_interleaved_vnni.c: a key-interleaved q8_0 KV-cache layout decoded with AVX-512 VNNI
 * (VPDPBUSD), float32-accurate: the kernels, the reference check, the L1 floor and the large
 * cache run of `mha_bench_q8_interleaved` (bench_q8_interleaved.c has the header comment with
 * the layouts, the digit split and the shapes). Only called where the CPU has AVX512F/BW/VL,
 * VNNI, VBMI and F16C. */
#include "fma_peak.h"
#include "q8_interleaved.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* d, query rows per kv head, q8_0 blocks per row, keys per superblock and its bytes (16 x 136 =
 * 16 rows of 4 x 34-byte q8_0 blocks), keys of the L1 floor */
enum { D = 128, ROWS = 4, NB = 4, SB = 16, SB_BYTES = 2176, FK = 64 };
#define INL static inline __attribute__((always_inline))

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) { /* xorshift64: the same data on every run and host */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double urand(void) {
    return (double)(rnd() >> 11) * 0x1p-53;
}
static float h2f(uint16_t h) {
    return _cvtsh_ss(h);
}
static uint16_t f2h(float f) {
    return (uint16_t)_cvtss_sh(f, 0);
}

/* VPDPBUSD acc, a (u8), m32{1to16} (s8): the signed operand broadcast from memory inside the
 * instruction (GCC 12 does not fold _mm512_set1_epi32(*m) into it; a separate VPBROADCASTD would
 * cost a uop per dot product) */
INL __m512i dpbusd_bc(__m512i acc, __m512i a, const void *m) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)m));
    return acc;
}
/* the same at address base + a constant: with "m" operands GCC hoists the 96 addresses of a
 * pass-1 block into registers and spills them */
#define DPBUSD_BC_OFF(acc, a, base, off)                                                           \
    __asm__("vpdpbusd %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "r"(base), "i"(off))

/* ---------------- reference data: q8_0 rows as the library holds them ---------------- */
typedef struct refdata {
    int n;
    int8_t *k8, *v8;   /* n x D quants */
    uint16_t *ks, *vs; /* n x NB float16 block scales */
    float q[ROWS][D];  /* the query rows (scale 1/sqrt(d) folded in or not: only values count) */
    float *p;          /* ROWS x n softmax weights in (0, 1], a 1 per row */
} refdata;

static void gen(refdata *r, int n) {
    r->n = n;
    r->k8 = malloc((size_t)n * D);
    r->v8 = malloc((size_t)n * D);
    r->ks = malloc((size_t)n * NB * 2);
    r->vs = malloc((size_t)n * NB * 2);
    r->p = malloc(sizeof(float) * ROWS * (size_t)n);
    if (!r->k8 || !r->v8 || !r->ks || !r->vs || !r->p)
        abort();
    for (size_t i = 0; i < (size_t)n * D; i++) {
        r->k8[i] = (int8_t)((int)(rnd() % 255) - 127);
        r->v8[i] = (int8_t)((int)(rnd() % 255) - 127);
    }
    for (size_t i = 0; i < (size_t)n * NB; i++) {
        r->ks[i] = f2h((float)(0.002 + 0.03 * urand()));
        r->vs[i] = f2h((float)(0.002 + 0.03 * urand()));
    }
    for (int x = 0; x < ROWS; x++)
        for (int d = 0; d < D; d++) /* magnitudes 2^-6 .. 2^2: the digits must carry them all */
            r->q[x][d] = (float)((2 * urand() - 1) * ldexp(1.0, (int)(rnd() % 9) - 6));
    for (int x = 0; x < ROWS; x++) {
        for (int i = 0; i < n; i++) /* exp(s - max): down to e^-12, the row's max 1 */
            r->p[x * n + i] = (float)exp(-12.0 * urand());
        r->p[x * n + (int)(rnd() % (uint64_t)n)] = 1.0f;
    }
}

static void free_ref(refdata *r) {
    free(r->k8), free(r->v8), free(r->ks), free(r->vs), free(r->p);
}

/* ---------------- packing into the interleaved layouts ---------------- */
/* K superblock: [block b][4-byte group j][key][4 bytes k[key][32b + 4j .. + 3]] (2048 bytes),
 * then the float16 scales [block][key] (128 bytes); bytes biased (k ^ 0x80 = k + 128, u8) */
static void pack_k(const refdata *r, int n, uint8_t *out) {
    for (int sb = 0; sb < n / SB; sb++) {
        uint8_t *o = out + (size_t)sb * SB_BYTES;
        uint16_t *s = (uint16_t *)(o + 2048);
        for (int key = 0; key < SB; key++) {
            const int kk = sb * SB + key;
            for (int b = 0; b < NB; b++) {
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++)
                        o[b * 512 + j * 64 + key * 4 + t] =
                            (uint8_t)r->k8[(size_t)kk * D + 32 * b + 4 * j + t] ^ 0x80;
                s[b * 16 + key] = r->ks[(size_t)kk * NB + b];
            }
        }
    }
}
/* V superblock: [group g of 4 keys][d][4 bytes v[4g + t][d]] (2048 bytes), then the scales
 * [block][key]; biased for pass 3 variant S, signed for the plain one */
static void pack_v(const refdata *r, int n, uint8_t *out, int biased) {
    for (int sb = 0; sb < n / SB; sb++) {
        uint8_t *o = out + (size_t)sb * SB_BYTES;
        uint16_t *s = (uint16_t *)(o + 2048);
        for (int key = 0; key < SB; key++) {
            const int kk = sb * SB + key;
            for (int d = 0; d < D; d++)
                o[(key / 4) * 512 + d * 4 + key % 4] =
                    (uint8_t)r->v8[(size_t)kk * D + d] ^ (biased ? 0x80 : 0);
            for (int b = 0; b < NB; b++)
                s[b * 16 + key] = r->vs[(size_t)kk * NB + b];
        }
    }
}

/* ---------------- the query's digits (once per decode step and kv head) ---------------- */
typedef struct qprep {
    int32_t dig[ROWS][3][32];  /* signed balanced digits hi, mid, lo of Q; 4 d per dword */
    int32_t corr[ROWS][NB][3]; /* -128 x the digits' sum over block b (the keys' bias) */
    float inv[ROWS];           /* 2^-e */
} qprep;

static void prep_q(const float q[ROWS][D], qprep *qp) {
    for (int x = 0; x < ROWS; x++) {
        float m = 0;
        for (int d = 0; d < D; d++)
            m = fmaxf(m, fabsf(q[x][d]));
        int E = 0;
        frexpf(m, &E);
        int e = 23 - E;                                 /* m 2^e in [2^22, 2^23) */
        if (nearbyint(ldexp((double)m, e)) > 8355711.0) /* 127 (2^16 + 2^8 + 1): largest digits */
            e--;
        if (m == 0)
            e = 0;
        qp->inv[x] = ldexpf(1.0f, -e);
        int8_t dg[3][D];
        for (int d = 0; d < D; d++) {
            const int32_t Q = (int32_t)nearbyint(ldexp((double)q[x][d], e));
            const int32_t l = ((Q + 128) & 255) - 128, Q1 = (Q - l) / 256;
            const int32_t mid = ((Q1 + 128) & 255) - 128, h = (Q1 - mid) / 256;
            if (h < -128 || h > 127 || h * 65536 + mid * 256 + l != Q)
                abort();
            dg[0][d] = (int8_t)h, dg[1][d] = (int8_t)mid, dg[2][d] = (int8_t)l;
        }
        for (int p = 0; p < 3; p++) {
            memcpy(qp->dig[x][p], dg[p], D);
            for (int b = 0; b < NB; b++) {
                int s = 0;
                for (int i = 0; i < 32; i++)
                    s += dg[p][32 * b + i];
                qp->corr[x][b][p] = -128 * s;
            }
        }
    }
}

/* ---------------- pass 1: the 16 keys of a superblock, 4 rows ---------------- */
/* Per block: 12 accumulator chains (rows x digits) start at the bias correction, 8 VPDPBUSD
 * each (the 64-byte key group in a register, the row's digit dword broadcast from memory), then
 * s += scale (hi 2^16 + (mid 2^8 + lo)) in float32: mid 2^8 + lo is exact in int32 (< 2^29). */
/* block b of 16 keys, its 8 key vectors kc (biased u8, lanes = keys) and scales sc: s[x] +=
 * sc (hi 2^16 + (mid 2^8 + lo)) for the 4 rows */
INL void pass1_block(const __m512i kc[8], __m512 sc, const qprep *qp, int b, __m512 s[ROWS]) {
    __m512i a[ROWS][3]; /* 12 independent chains, interleaved in program order */
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++)
#pragma GCC unroll 3
        for (int p = 0; p < 3; p++)
            a[x][p] = _mm512_set1_epi32(qp->corr[x][b][p]);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
#pragma GCC unroll 4
        for (int x = 0; x < ROWS; x++)
#pragma GCC unroll 3
            for (int p = 0; p < 3; p++)
                DPBUSD_BC_OFF(a[x][p], kc[j], qp, 4 * ((x * 3 + p) * 32 + 8 * b + j));
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++) {
        const __m512i ml = _mm512_add_epi32(_mm512_slli_epi32(a[x][1], 8), a[x][2]);
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[x][0]), _mm512_set1_ps(65536.0f),
                                         _mm512_cvtepi32_ps(ml));
        s[x] = _mm512_fmadd_ps(t, sc, s[x]);
    }
}

INL void pass1_sb(const uint8_t *sb, const qprep *qp, float *sc_out, int ld) {
    __m512 s[ROWS];
    for (int x = 0; x < ROWS; x++)
        s[x] = _mm512_setzero_ps();
    const uint16_t *sc16 = (const uint16_t *)(sb + 2048);
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) {
        __m512i kc[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            kc[j] = _mm512_load_si512(sb + b * 512 + j * 64);
        pass1_block(kc, _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc16 + 16 * b))), qp, b,
                    s);
    }
    for (int x = 0; x < ROWS; x++)
        _mm512_storeu_ps(sc_out + x * ld, _mm512_mul_ps(s[x], _mm512_set1_ps(qp->inv[x])));
}

/* ---------------- pass 3, plain: weights u8 (broadcast), values s8 ---------------- */
/* VPERMB order: bytes 2, 1, 0 of the 16 int32 W (hi, mid, lo digits of 16 keys), then byte 3 */
static const uint8_t digit_perm[64] = {
    2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, /* hi */
    1, 5, 9,  13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, /* mid */
    0, 4, 8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, /* lo */
    3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};

/* max over the chunk of block b's value scales, m = f 2^E with f in [0.5, 1): *e2 = 2^(bits - E)
 * and *einv its inverse, by the exponent bits (m is a normal float16). adj: one less when
 * m 2^(bits - E) would pass 8355711 (variant S: W + 0x808080 must stay below 2^24) */
INL void
chunk_exponents(const uint8_t *V, int nsb, int bits, int adj, float e2[NB], float einv[NB]) {
    __m512 mx[NB];
    for (int b = 0; b < NB; b++)
        mx[b] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint16_t *sc16 = (const uint16_t *)(V + (size_t)sb * SB_BYTES + 2048);
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
            mx[b] = _mm512_max_ps(
                mx[b], _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc16 + 16 * b))));
    }
    for (int b = 0; b < NB; b++) {
        const float m = _mm512_reduce_max_ps(mx[b]);
        uint32_t mb;
        memcpy(&mb, &m, 4);
        const int E = (int)(mb >> 23) - 126 + (adj && (mb & 0x7FFFFF) > 0x7F0000);
        const uint32_t eb = (uint32_t)(127 + bits - E) << 23, ib = (uint32_t)(127 - bits + E) << 23;
        memcpy(&e2[b], &eb, 4);
        memcpy(&einv[b], &ib, 4);
    }
}

/* the weight digits of a chunk of nsb superblocks: wbuf[(sb ROWS + x) NB + b][64] holds the
 * bytes [16 piece + key], piece 0 hi, 1 mid, 2 lo of W = round(p s 2^e_b) < 2^24 */
INL void
build_w(const uint8_t *V, int nsb, const float *p, int ldp, uint8_t *wbuf, float einv[NB]) {
    float e2[NB];
    chunk_exponents(V, nsb, 24, 0, e2, einv);
    const __m512i idx = _mm512_loadu_si512(digit_perm);
    for (int sb = 0; sb < nsb; sb++) {
        const uint16_t *sc16 = (const uint16_t *)(V + (size_t)sb * SB_BYTES + 2048);
        __m512 sc[NB];
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
            sc[b] =
                _mm512_mul_ps(_mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc16 + 16 * b))),
                              _mm512_set1_ps(e2[b]));
#pragma GCC unroll 4
        for (int x = 0; x < ROWS; x++) {
            const __m512 pv = _mm512_loadu_ps(p + x * ldp + 16 * sb);
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++)
                _mm512_store_si512(
                    wbuf + ((sb * ROWS + x) * NB + b) * 64,
                    _mm512_permutexvar_epi8(idx, _mm512_cvtps_epi32(_mm512_mul_ps(pv, sc[b]))));
        }
    }
}

/* prefetch of a quarter of superblock sb of the next phase's data, in block b's loop */
INL void prefetch_quarter(const uint8_t *pf, int sb, int b) {
    for (int l = 9 * b; l < 9 * b + 9 && l < SB_BYTES / 64; l++)
        _mm_prefetch((const char *)pf + (size_t)sb * SB_BYTES + 64 * l, _MM_HINT_T1);
}

/* 4 keys (group g of superblock sb) into block b's 24 accumulators: the 2 value vectors v0, v1
 * (lanes = d, 4 keys' bytes each) against the weight digit dwords, broadcast */
INL void pass3_group(
    __m512i v0, __m512i v1, const uint8_t *wbuf, int sb, int b, int g, __m512i acc[ROWS][3][2]) {
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++) {
        const uint8_t *w = wbuf + ((sb * ROWS + x) * NB + b) * 64 + 4 * g;
#pragma GCC unroll 3
        for (int p = 0; p < 3; p++) {
            int32_t wd;
            memcpy(&wd, w + 16 * p, 4);
            const __m512i wb = _mm512_set1_epi32(wd);
            acc[x][p][0] = _mm512_dpbusd_epi32(acc[x][p][0], wb, v0);
            acc[x][p][1] = _mm512_dpbusd_epi32(acc[x][p][1], wb, v1);
        }
    }
}

/* block b's 24 accumulators (rows x digits x 2 vectors of 16 d) over nsb superblocks: per
 * group of 4 keys, the 2 value vectors in registers, the weight digit dwords broadcast */
INL void pass3_block(const uint8_t *V,
                     int nsb,
                     const uint8_t *wbuf,
                     int b,
                     __m512i acc[ROWS][3][2],
                     const uint8_t *pf) {
    for (int sb = 0; sb < nsb; sb++) {
        if (pf)
            prefetch_quarter(pf, sb, b);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const uint8_t *vp = V + (size_t)sb * SB_BYTES + g * 512 + b * 128;
            pass3_group(_mm512_load_si512(vp), _mm512_load_si512(vp + 64), wbuf, sb, b, g, acc);
        }
    }
}
/* o += 2^-e_b (hi 2^16 + mid 2^8 + lo), each digit's sum less its offset c[3 x + digit] (0:
 * plain) */
INL void pass3_final(__m512i acc[ROWS][3][2], const int32_t *c, float *o, int b, float einv) {
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++)
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            const __m512i h = _mm512_sub_epi32(acc[x][0][i], _mm512_set1_epi32(c[3 * x])),
                          m = _mm512_sub_epi32(acc[x][1][i], _mm512_set1_epi32(c[3 * x + 1])),
                          l = _mm512_sub_epi32(acc[x][2][i], _mm512_set1_epi32(c[3 * x + 2]));
            const __m512 t =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(65536.0f),
                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(256.0f),
                                                _mm512_cvtepi32_ps(l)));
            float *op = o + x * D + 32 * b + 16 * i;
            _mm512_storeu_ps(op, _mm512_fmadd_ps(t, _mm512_set1_ps(einv), _mm512_loadu_ps(op)));
        }
}
INL void zero_acc(__m512i acc[ROWS][3][2]) {
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++)
#pragma GCC unroll 3
        for (int p = 0; p < 3; p++)
            acc[x][p][0] = acc[x][p][1] = _mm512_setzero_si512();
}
/* a whole chunk: weights built, then the 4 blocks, each finalized into o */
INL void pass3_chunk(const uint8_t *V,
                     int nsb,
                     const float *p,
                     int ldp,
                     uint8_t *wbuf,
                     float *o,
                     const uint8_t *pf) {
    static const int32_t none[ROWS][3];
    float einv[NB];
    build_w(V, nsb, p, ldp, wbuf, einv);
    for (int b = 0; b < NB; b++) {
        __m512i acc[ROWS][3][2];
        zero_acc(acc);
        pass3_block(V, nsb, wbuf, b, acc, pf);
        pass3_final(acc, &none[0][0], o, b, einv[b]);
    }
}

/* ---------------- pass 3, variant S: values u8 (biased), weight digits s8 ---------------- */
/* The value vectors stay the register operand and the weight digits the memory one, broadcast
 * inside VPDPBUSD (no VPBROADCASTD uop): W' = round(p s 2^e_b + 0x808080) by one FMA, its bytes
 * ^ 0x80 are W's balanced digits; the offset 128 x (the digits' sum) per (row, block, piece)
 * comes from a VPDPBUSD of the digits against ones, into dsum (lanes 4p .. 4p + 3: piece p). */
INL void build_wS(const uint8_t *V,
                  int nsb,
                  const float *p,
                  int ldp,
                  uint8_t *wbuf,
                  float einv[NB],
                  __m512i dsum[ROWS][NB]) {
    float e2[NB];
    chunk_exponents(V, nsb, 23, 1, e2, einv);
    const __m512i idx = _mm512_loadu_si512(digit_perm), x80 = _mm512_set1_epi8((char)0x80),
                  ones = _mm512_set1_epi8(1);
    const __m512 C = _mm512_set1_ps(8421504.0f); /* 0x808080 */
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
            dsum[x][b] = _mm512_setzero_si512();
    for (int sb = 0; sb < nsb; sb++) {
        const uint16_t *sc16 = (const uint16_t *)(V + (size_t)sb * SB_BYTES + 2048);
        __m512 sc[NB];
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
            sc[b] =
                _mm512_mul_ps(_mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc16 + 16 * b))),
                              _mm512_set1_ps(e2[b]));
#pragma GCC unroll 4
        for (int x = 0; x < ROWS; x++) {
            const __m512 pv = _mm512_loadu_ps(p + x * ldp + 16 * sb);
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const __m512i dg = _mm512_xor_si512(
                    _mm512_permutexvar_epi8(idx, _mm512_cvtps_epi32(_mm512_fmadd_ps(pv, sc[b], C))),
                    x80);
                _mm512_store_si512(wbuf + ((sb * ROWS + x) * NB + b) * 64, dg);
                dsum[x][b] = _mm512_dpbusd_epi32(dsum[x][b], ones, dg);
            }
        }
    }
}
INL void pass3S_block(const uint8_t *V,
                      int nsb,
                      const uint8_t *wbuf,
                      int b,
                      __m512i acc[ROWS][3][2],
                      const uint8_t *pf) {
    for (int sb = 0; sb < nsb; sb++) {
        if (pf)
            prefetch_quarter(pf, sb, b);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const uint8_t *vp = V + (size_t)sb * SB_BYTES + g * 512 + b * 128;
            const __m512i v0 = _mm512_load_si512(vp), v1 = _mm512_load_si512(vp + 64);
#pragma GCC unroll 4
            for (int x = 0; x < ROWS; x++) {
                const uint8_t *w = wbuf + ((sb * ROWS + x) * NB + b) * 64 + 4 * g;
#pragma GCC unroll 3
                for (int p = 0; p < 3; p++) {
                    acc[x][p][0] = dpbusd_bc(acc[x][p][0], v0, w + 16 * p);
                    acc[x][p][1] = dpbusd_bc(acc[x][p][1], v1, w + 16 * p);
                }
            }
        }
    }
}
/* block b's offsets 128 x (digit sums of piece p) from dsum */
INL void digit_offsets(__m512i dsum[ROWS][NB], int b, int32_t c[ROWS][3]) {
    for (int x = 0; x < ROWS; x++) {
        int32_t ds[16];
        _mm512_storeu_si512(ds, dsum[x][b]);
        for (int p = 0; p < 3; p++)
            c[x][p] = 128 * (ds[4 * p] + ds[4 * p + 1] + ds[4 * p + 2] + ds[4 * p + 3]);
    }
}
INL void pass3S_chunk(const uint8_t *V,
                      int nsb,
                      const float *p,
                      int ldp,
                      uint8_t *wbuf,
                      float *o,
                      const uint8_t *pf) {
    float einv[NB];
    __m512i dsum[ROWS][NB];
    build_wS(V, nsb, p, ldp, wbuf, einv, dsum);
    for (int b = 0; b < NB; b++) {
        __m512i acc[ROWS][3][2];
        zero_acc(acc);
        pass3S_block(V, nsb, wbuf, b, acc, pf);
        int32_t c[ROWS][3];
        digit_offsets(dsum, b, c);
        pass3_final(acc, &c[0][0], o, b, einv[b]);
    }
}

/* ---------------- the same passes over ggml's q8_0 rows, reordered in registers ----------------
 * Could the library keep its q8_0 rows (ggml's order, [scale, 32 int8] x 4 per row, 136 bytes)
 * and still use VPDPBUSD? These variants read 16 (pass 1) or 4 (pass 3) rows at a stride of 136
 * bytes and build the interleaved vectors above in registers, then run the same dot products:
 * the same integer sums and float32 operations, so their results equal the interleaved ones bit
 * for bit (checked below). Their cost is the reordering (timed in the L1 floor). */
enum { ROW_BYTES = NB * 34 };

/* ggml's q8_0 rows, n x ROW_BYTES: per block the float16 scale, then its 32 int8 */
static void pack_rows(const int8_t *q8, const uint16_t *sc, int n, uint8_t *out) {
    for (int i = 0; i < n; i++)
        for (int b = 0; b < NB; b++) {
            memcpy(out + (size_t)i * ROW_BYTES + 34 * b, &sc[(size_t)i * NB + b], 2);
            memcpy(out + (size_t)i * ROW_BYTES + 34 * b + 2, &q8[(size_t)i * D + 32 * b], 32);
        }
}

/* the float16 block scales of 16 rows at the stride (one VPGATHERDD of the dword at each
 * scale, its low half kept) */
INL __m256i row_scales16(const uint8_t *at) {
    const __m512i off =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(ROW_BYTES));
    return _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(off, at, 1));
}

/* block b of 16 rows from `rows` as pass 1's 8 key vectors: z[j] lane t = k[t][32b + 4j .. +3].
 * Rows t and t + 8 share a register (vinserti64x4), then an 8 x 8 dword transpose runs in both
 * 256-bit halves at once (unpack 32, unpack 64, one 2-source qword permute per output). */
INL void rows_to_key_vectors(const uint8_t *rows, int b, __m512i z[8]) {
    const uint8_t *at = rows + 34 * b + 2;
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
        z[r] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(at + r * ROW_BYTES))),
            _mm256_loadu_si256((const __m256i *)(at + (r + 8) * ROW_BYTES)), 1);
    __m512i t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) { /* u[4 i + c]: dwords c and c + 4 of rows 4 i .. 4 i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0),
                  hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        z[c] = _mm512_permutex2var_epi64(u[c], lo, u[4 + c]);
        z[c + 4] = _mm512_permutex2var_epi64(u[c], hi, u[4 + c]);
    }
}

/* pass1_sb over 16 rows at the stride: the key vectors biased (^ 0x80) after the reordering */
INL void pass1_rows(const uint8_t *rows, const qprep *qp, float *sc_out, int ld) {
    __m512 s[ROWS];
    for (int x = 0; x < ROWS; x++)
        s[x] = _mm512_setzero_ps();
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) {
        __m512i z[8];
        rows_to_key_vectors(rows, b, z);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            z[j] = _mm512_xor_si512(z[j], x80);
        pass1_block(z, _mm512_cvtph_ps(row_scales16(rows + 34 * b)), qp, b, s);
    }
    for (int x = 0; x < ROWS; x++)
        _mm512_storeu_ps(sc_out + x * ld, _mm512_mul_ps(s[x], _mm512_set1_ps(qp->inv[x])));
}

/* pass 3 (plain) over nsb x 16 rows at the stride. The scales are gathered into the interleaved
 * superblocks' scale order first (sc16[sb][b][key], in `scales`), so build_w runs unchanged on a
 * buffer whose superblocks hold only scales (at offset 2048 of each SB_BYTES); per 4 rows and
 * block, two registers [row 0 | row 1], [row 2 | row 3] and two VPERMT2B give the 2 value vectors
 * of pass3_block. */
static const uint8_t value_perm[2][64] = {
#define MHA_B4_(c) c, 32 + c, 64 + c, 96 + c
    {MHA_B4_(0), MHA_B4_(1), MHA_B4_(2), MHA_B4_(3), MHA_B4_(4), MHA_B4_(5), MHA_B4_(6), MHA_B4_(7),
     MHA_B4_(8), MHA_B4_(9), MHA_B4_(10), MHA_B4_(11), MHA_B4_(12), MHA_B4_(13), MHA_B4_(14),
     MHA_B4_(15)},
    {MHA_B4_(16), MHA_B4_(17), MHA_B4_(18), MHA_B4_(19), MHA_B4_(20), MHA_B4_(21), MHA_B4_(22),
     MHA_B4_(23), MHA_B4_(24), MHA_B4_(25), MHA_B4_(26), MHA_B4_(27), MHA_B4_(28), MHA_B4_(29),
     MHA_B4_(30), MHA_B4_(31)}};
#undef MHA_B4_

INL void pass3_rows_chunk(const uint8_t *rows,
                          int nsb,
                          const float *p,
                          int ldp,
                          uint8_t *wbuf,
                          uint8_t *scales,
                          float *o,
                          const uint8_t *pf) {
    static const int32_t none[ROWS][3];
    for (int sb = 0; sb < nsb; sb++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
            _mm256_store_si256((__m256i *)(scales + (size_t)sb * SB_BYTES + 2048 + 32 * b),
                               row_scales16(rows + (size_t)16 * sb * ROW_BYTES + 34 * b));
    float einv[NB];
    build_w(scales, nsb, p, ldp, wbuf, einv);
    const __m512i i0 = _mm512_loadu_si512(value_perm[0]), i1 = _mm512_loadu_si512(value_perm[1]);
    for (int b = 0; b < NB; b++) {
        __m512i acc[ROWS][3][2];
        zero_acc(acc);
        for (int sb = 0; sb < nsb; sb++) {
            if (pf)
                prefetch_quarter(pf, sb, b);
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                const uint8_t *r = rows + (size_t)(16 * sb + 4 * g) * ROW_BYTES + 34 * b + 2;
                const __m512i A = _mm512_inserti64x4(
                                  _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r)),
                                  _mm256_loadu_si256((const __m256i *)(r + ROW_BYTES)), 1),
                              B = _mm512_inserti64x4(
                                  _mm512_castsi256_si512(
                                      _mm256_loadu_si256((const __m256i *)(r + 2 * ROW_BYTES))),
                                  _mm256_loadu_si256((const __m256i *)(r + 3 * ROW_BYTES)), 1);
                pass3_group(_mm512_permutex2var_epi8(A, i0, B), _mm512_permutex2var_epi8(A, i1, B),
                            wbuf, sb, b, g, acc);
            }
        }
        pass3_final(acc, &none[0][0], o, b, einv[b]);
    }
}

/* ---------------- the reference check ---------------- */
/* errors relative to the row's largest |reference| (normwise) and to sum |q k| (resp. |w v|)
 * of the entry; FAIL above 2^-20 (float32 rounding of a sum of 128 or n terms is ~2^-24 x a
 * few; a lost digit or a wrong offset is >= 2^-16) */
static int within(const char *what, const double e[2]) {
    const double tol = 0x1p-20;
    const int ok = e[0] <= tol && e[1] <= tol; /* NaN fails */
    printf("    %-14s %.3e        %.3e%s\n", what, e[0], e[1], ok ? "" : "   FAIL (> 2^-20)");
    return ok;
}

/* the row-major variants on the same data: scores s and pass-3 output o of the interleaved
 * passes, bit for bit */
static int rows_match(const refdata *r, const qprep *qp, const float *s, const float *o) {
    const int n = r->n;
    uint8_t *KR = malloc((size_t)n * ROW_BYTES), *VR = malloc((size_t)n * ROW_BYTES);
    uint8_t *scales = aligned_alloc(64, (size_t)n / SB * SB_BYTES);
    uint8_t *wbuf = aligned_alloc(64, (size_t)n / SB * ROWS * NB * 64);
    float *sr = malloc(sizeof(float) * ROWS * (size_t)n), orow[ROWS * D];
    if (!KR || !VR || !scales || !wbuf || !sr)
        abort();
    pack_rows(r->k8, r->ks, n, KR);
    pack_rows(r->v8, r->vs, n, VR);
    for (int sb = 0; sb < n / SB; sb++)
        pass1_rows(KR + (size_t)16 * sb * ROW_BYTES, qp, sr + 16 * sb, n);
    memset(orow, 0, sizeof orow);
    pass3_rows_chunk(VR, n / SB, r->p, n, wbuf, scales, orow, NULL);
    const int same1 = !memcmp(s, sr, sizeof(float) * ROWS * (size_t)n),
              same3 = !memcmp(o, orow, sizeof orow);
    printf("  ggml's rows reordered in registers: pass 1 %s, pass 3 %s\n",
           same1 ? "bit-identical" : "DIFFERENT   FAIL",
           same3 ? "bit-identical" : "DIFFERENT   FAIL");
    free(KR), free(VR), free(scales), free(wbuf), free(sr);
    return same1 && same3;
}

static int check_n(int n) {
    refdata r;
    gen(&r, n);
    uint8_t *K = aligned_alloc(64, (size_t)n / SB * SB_BYTES);
    uint8_t *V = aligned_alloc(64, (size_t)n / SB * SB_BYTES);
    uint8_t *VS = aligned_alloc(64, (size_t)n / SB * SB_BYTES);
    uint8_t *wbuf = aligned_alloc(64, (size_t)n / SB * ROWS * NB * 64);
    float *s = malloc(sizeof(float) * ROWS * (size_t)n);
    double *ref = malloc(sizeof(double) * (size_t)n), *abs_ = malloc(sizeof(double) * (size_t)n);
    float *f32 = malloc(sizeof(float) * (size_t)n);
    if (!K || !V || !VS || !wbuf || !s || !ref || !abs_ || !f32)
        abort();
    pack_k(&r, n, K);
    pack_v(&r, n, V, 0);
    pack_v(&r, n, VS, 1);
    qprep qp;
    prep_q((const float(*)[D])r.q, &qp);
    for (int sb = 0; sb < n / SB; sb++)
        pass1_sb(K + (size_t)sb * SB_BYTES, &qp, s + 16 * sb, n);
    double e1[2] = {0, 0}, ef1[2] = {0, 0};
    for (int x = 0; x < ROWS; x++) {
        double mref = 0;
        for (int i = 0; i < n; i++) {
            double sum = 0, a = 0;
            float f = 0;
            for (int d = 0; d < D; d++) {
                const float kd =
                    (float)r.k8[(size_t)i * D + d] * h2f(r.ks[(size_t)i * NB + d / 32]);
                sum += (double)r.q[x][d] * (double)kd;
                a += fabs((double)r.q[x][d] * (double)kd);
                f = fmaf(r.q[x][d], kd, f);
            }
            ref[i] = sum, abs_[i] = a, f32[i] = f;
            mref = fmax(mref, fabs(sum));
        }
        for (int i = 0; i < n; i++) {
            const double a = fabs((double)s[x * n + i] - ref[i]), f = fabs((double)f32[i] - ref[i]);
            e1[0] = fmax(e1[0], a / mref), e1[1] = fmax(e1[1], a / abs_[i]);
            ef1[0] = fmax(ef1[0], f / mref), ef1[1] = fmax(ef1[1], f / abs_[i]);
        }
    }
    printf("check, %d keys, 4 rows (max over rows and keys; 2^-20 = %.2e, 2^-24 = %.2e)\n", n,
           0x1p-20, 0x1p-24);
    printf("  pass 1 scores  |err|/max|s_row|   |err|/sum|q k|\n");
    int ok = within("VNNI", e1);
    printf("    %-14s %.3e        %.3e   (for comparison)\n", "f32 FMA loop", ef1[0], ef1[1]);

    /* pass 3: one chunk of all n keys (n <= 65536: the int32 sums can not overflow) */
    float o[ROWS * D], oS[ROWS * D];
    memset(o, 0, sizeof o);
    memset(oS, 0, sizeof oS);
    pass3_chunk(V, n / SB, r.p, n, wbuf, o, NULL);
    pass3S_chunk(VS, n / SB, r.p, n, wbuf, oS, NULL);
    double e3[2] = {0, 0}, s3[2] = {0, 0}, f3[2] = {0, 0};
    for (int x = 0; x < ROWS; x++) {
        double oref[D], oabs[D], mref = 0;
        float of[D];
        for (int d = 0; d < D; d++) {
            double sum = 0, a = 0;
            float f = 0;
            for (int i = 0; i < n; i++) {
                const float vs = h2f(r.vs[(size_t)i * NB + d / 32]), pi = r.p[x * n + i];
                const double wv = (double)pi * (double)vs * r.v8[(size_t)i * D + d];
                sum += wv, a += fabs(wv);
                f = fmaf(pi * vs, (float)r.v8[(size_t)i * D + d], f); /* float32 weight */
            }
            oref[d] = sum, oabs[d] = a, of[d] = f;
            mref = fmax(mref, fabs(sum));
        }
        for (int d = 0; d < D; d++) {
            const double a = fabs((double)o[x * D + d] - oref[d]),
                         aS = fabs((double)oS[x * D + d] - oref[d]),
                         f = fabs((double)of[d] - oref[d]);
            e3[0] = fmax(e3[0], a / mref), e3[1] = fmax(e3[1], a / oabs[d]);
            s3[0] = fmax(s3[0], aS / mref), s3[1] = fmax(s3[1], aS / oabs[d]);
            f3[0] = fmax(f3[0], f / mref), f3[1] = fmax(f3[1], f / oabs[d]);
        }
    }
    printf("  pass 3 outputs |err|/max|o_row|   |err|/sum|w v|\n");
    ok &= within("VNNI", e3);
    ok &= within("VNNI S", s3);
    printf("    %-14s %.3e        %.3e   (for comparison)\n", "f32 FMA loop", f3[0], f3[1]);
    ok &= rows_match(&r, &qp, s, o);
    free(K), free(V), free(VS), free(wbuf), free(s), free(ref), free(abs_), free(f32);
    free_ref(&r);
    return ok;
}

int q8i_check(void) {
    const int ok = check_n(4096) & check_n(256);
    if (!ok)
        printf("FAIL: a VNNI error above 2^-20, or a row-major variant differs\n");
    return !ok;
}

/* ---------------- the L1 floor: FK keys reused, non-inlined instances ---------------- */
static uint8_t Kf[FK / SB * SB_BYTES] __attribute__((aligned(64)));
static uint8_t Vf[FK / SB * SB_BYTES] __attribute__((aligned(64)));
static uint8_t VfS[FK / SB * SB_BYTES] __attribute__((aligned(64)));
static float Sf[ROWS * FK] __attribute__((aligned(64)));
static float Pf[ROWS * FK] __attribute__((aligned(64)));
static uint8_t Wf[FK / SB * ROWS * NB * 64] __attribute__((aligned(64)));
static float Of[ROWS * D] __attribute__((aligned(64)));
static qprep QP;
/* the accumulators of a "long chunk" (a chunk of reps x FK keys), kept in memory between reps;
 * they wrap in int32 here, which costs the same */
static __m512i ACC[NB][ROWS][3][2];

INL void acc_copy(__m512i dst[ROWS][3][2], __m512i src[ROWS][3][2]) {
#pragma GCC unroll 4
    for (int x = 0; x < ROWS; x++)
#pragma GCC unroll 3
        for (int p = 0; p < 3; p++)
            dst[x][p][0] = src[x][p][0], dst[x][p][1] = src[x][p][1];
}

/* at the start of every rep: the operands in memory may have changed, as in a new decode step
 * (clang 14 otherwise builds the same weights once for all reps) */
#define NEW_STEP() __asm__ volatile("" ::: "memory")

static __attribute__((noinline)) float t_pass1(int reps) {
    for (int r = 0; r < reps; r++) {
        const qprep *qp = &QP;
        const uint8_t *kp = Kf;
        __asm__("" : "+r"(qp), "+r"(kp)); /* per-step data: nothing hoisted across reps */
        for (int sb = 0; sb < FK / SB; sb++)
            pass1_sb(kp + sb * SB_BYTES, qp, Sf + 16 * sb, FK);
    }
    return Sf[0];
}
/* pass 3 with a chunk of FK keys: weights built and accumulators finalized every rep */
static __attribute__((noinline)) float t_pass3(int reps) {
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        pass3_chunk(Vf, FK / SB, Pf, FK, Wf, Of, NULL);
    }
    return Of[0];
}
/* pass 3 in a long chunk: weights built every rep (per-key work), the final once */
static __attribute__((noinline)) float t_pass3_long(int reps) {
    static const int32_t none[ROWS][3];
    float einv[NB];
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        build_w(Vf, FK / SB, Pf, FK, Wf, einv);
        for (int b = 0; b < NB; b++) {
            __m512i acc[ROWS][3][2];
            acc_copy(acc, ACC[b]);
            pass3_block(Vf, FK / SB, Wf, b, acc, NULL);
            acc_copy(ACC[b], acc);
        }
    }
    for (int b = 0; b < NB; b++)
        pass3_final(ACC[b], &none[0][0], Of, b, einv[b]);
    return Of[0];
}
static __attribute__((noinline)) float t_build_w(int reps) {
    float einv[NB] = {0};
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        build_w(Vf, FK / SB, Pf, FK, Wf, einv);
    }
    return einv[0] + Wf[5];
}
static __attribute__((noinline)) float t_pass3_dot(int reps) {
    for (int r = 0; r < reps; r++)
        for (int b = 0; b < NB; b++) {
            __m512i acc[ROWS][3][2];
            acc_copy(acc, ACC[b]);
            pass3_block(Vf, FK / SB, Wf, b, acc, NULL);
            acc_copy(ACC[b], acc);
        }
    return (float)_mm512_reduce_add_epi32(ACC[0][0][0][0]);
}
static __attribute__((noinline)) float t_pass3S(int reps) {
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        pass3S_chunk(VfS, FK / SB, Pf, FK, Wf, Of, NULL);
    }
    return Of[0];
}
static __attribute__((noinline)) float t_pass3S_long(int reps) {
    float einv[NB];
    __m512i dsum[ROWS][NB];
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        build_wS(VfS, FK / SB, Pf, FK, Wf, einv, dsum);
        for (int b = 0; b < NB; b++) {
            __m512i acc[ROWS][3][2];
            acc_copy(acc, ACC[b]);
            pass3S_block(VfS, FK / SB, Wf, b, acc, NULL);
            acc_copy(ACC[b], acc);
        }
    }
    for (int b = 0; b < NB; b++) {
        int32_t c[ROWS][3];
        digit_offsets(dsum, b, c);
        pass3_final(ACC[b], &c[0][0], Of, b, einv[b]);
    }
    return Of[0];
}
static __attribute__((noinline)) float t_build_wS(int reps) {
    float einv[NB] = {0};
    __m512i dsum[ROWS][NB];
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        build_wS(VfS, FK / SB, Pf, FK, Wf, einv, dsum);
        /* the digit sums are part of the work: keep them */
        __asm__ volatile("" ::"v"(dsum[0][0]), "v"(dsum[1][1]), "v"(dsum[2][2]), "v"(dsum[3][3])
                         : "memory");
    }
    return einv[0] + Wf[5];
}
static __attribute__((noinline)) float t_pass3S_dot(int reps) {
    for (int r = 0; r < reps; r++)
        for (int b = 0; b < NB; b++) {
            __m512i acc[ROWS][3][2];
            acc_copy(acc, ACC[b]);
            pass3S_block(VfS, FK / SB, Wf, b, acc, NULL);
            acc_copy(ACC[b], acc);
        }
    return (float)_mm512_reduce_add_epi32(ACC[0][0][0][0]);
}

/* the row-major variants (ggml's rows, reordered in registers) on the same FK keys */
static uint8_t KRf[FK * ROW_BYTES], VRf[FK * ROW_BYTES];
static uint8_t SCf[FK / SB * SB_BYTES] __attribute__((aligned(64)));
static __attribute__((noinline)) float t_pass1_rows(int reps) {
    for (int r = 0; r < reps; r++) {
        const qprep *qp = &QP;
        const uint8_t *kp = KRf;
        __asm__("" : "+r"(qp), "+r"(kp));
        for (int sb = 0; sb < FK / SB; sb++)
            pass1_rows(kp + sb * SB * ROW_BYTES, qp, Sf + 16 * sb, FK);
    }
    return Sf[0];
}
static __attribute__((noinline)) float t_pass3_rows(int reps) {
    for (int r = 0; r < reps; r++) {
        NEW_STEP();
        pass3_rows_chunk(VRf, FK / SB, Pf, FK, Wf, SCf, Of, NULL);
    }
    return Of[0];
}
/* the reordering of pass 1 alone: the 4 blocks' key vectors of each 16 rows, XOR-folded */
static __attribute__((noinline)) float t_reorder1(int reps) {
    __m512i fold = _mm512_setzero_si512();
    for (int r = 0; r < reps; r++) {
        const uint8_t *kp = KRf;
        __asm__("" : "+r"(kp));
        for (int sb = 0; sb < FK / SB; sb++)
            for (int b = 0; b < NB; b++) {
                __m512i z[8];
                rows_to_key_vectors(kp + sb * SB * ROW_BYTES, b, z);
                for (int j = 0; j < 8; j++)
                    fold = _mm512_xor_si512(fold, z[j]);
            }
    }
    return (float)_mm512_reduce_add_epi32(fold);
}

/* 61 short runs (~0.3 ms: some of them escape the other tenants of a shared host), ns per
 * (key, kv head): best and median */
static void time_fn(const char *name, float (*fn)(int), double ghz, double ns[2]) {
    enum { REPS = 1500, RUNS = 61 };
    volatile float sink = 0;
    double t[RUNS];
    sink += fn(REPS);
    for (int r = 0; r < RUNS; r++) {
        const double t0 = bench_now_s();
        sink += fn(REPS);
        t[r] = (bench_now_s() - t0) / ((double)REPS * FK) * 1e9;
    }
    (void)sink;
    qsort(t, RUNS, sizeof t[0], bench_cmp_double);
    printf("  %-44s %7.2f %7.2f %7.1f\n", name, t[0], t[RUNS / 2], t[0] * ghz);
    if (ns)
        ns[0] = t[0], ns[1] = t[RUNS / 2];
}

void q8i_floor(double ghz) {
    refdata r;
    gen(&r, FK);
    pack_k(&r, FK, Kf);
    pack_v(&r, FK, Vf, 0);
    pack_v(&r, FK, VfS, 1);
    pack_rows(r.k8, r.ks, FK, KRf);
    pack_rows(r.v8, r.vs, FK, VRf);
    prep_q((const float(*)[D])r.q, &QP);
    memcpy(Pf, r.p, sizeof Pf);
    free_ref(&r);
    printf("L1 floor, %d keys reused, 4 rows, d 128; ns per (key, kv head), 61 runs; cycles = best "
           "x %.2f GHz\n",
           FK, ghz);
    printf("  %-44s %7s %7s %7s\n", "", "best", "median", "cycles");
    double p1[2], p3[2], p3l[2], s3[2], s3l[2];
    time_fn("pass 1 (k biased u8, q signed digits)", t_pass1, ghz, p1);
    time_fn("pass 3, chunk 64 (build + dot + final)", t_pass3, ghz, p3);
    time_fn("pass 3, long chunk (build + dot)", t_pass3_long, ghz, p3l);
    time_fn("  of which weight building alone", t_build_w, ghz, NULL);
    time_fn("  of which dot products alone", t_pass3_dot, ghz, NULL);
    time_fn("pass 3 S, chunk 64 (build + dot + final)", t_pass3S, ghz, s3);
    time_fn("pass 3 S, long chunk (build + dot)", t_pass3S_long, ghz, s3l);
    time_fn("  of which weight building alone", t_build_wS, ghz, NULL);
    time_fn("  of which dot products alone", t_pass3S_dot, ghz, NULL);
    double r1[2], r3[2];
    time_fn("pass 1, ggml's rows reordered in registers", t_pass1_rows, ghz, r1);
    time_fn("  of which the reordering alone", t_reorder1, ghz, NULL);
    time_fn("pass 3, ggml's rows reordered, chunk 64", t_pass3_rows, ghz, r3);
    printf("  %-44s %7.2f %7.2f %7.1f\n", "pass 1 + pass 3, ggml's rows reordered", r1[0] + r3[0],
           r1[1] + r3[1], (r1[0] + r3[0]) * ghz);
    const struct {
        const char *name;
        const double *p3;
    } sums[] = {{"pass 1 + pass 3, chunk 64", p3},
                {"pass 1 + pass 3, long chunk", p3l},
                {"pass 1 + pass 3 S, chunk 64", s3},
                {"pass 1 + pass 3 S, long chunk", s3l}};
    for (size_t i = 0; i < sizeof sums / sizeof sums[0]; i++)
        printf("  %-44s %7.2f %7.2f %7.1f\n", sums[i].name, p1[0] + sums[i].p3[0],
               p1[1] + sums[i].p3[1], (p1[0] + sums[i].p3[0]) * ghz);
}

/* ---------------- the whole step over a large cache ---------------- */
/* the online softmax of a chunk (flash-decoding style) for row x: the chunk's max; o and l
 * rescaled when it raises the running max m; p = exp(s - m) in place of s by a degree-5
 * polynomial and VSCALEFPS (as the library's kernels); l += sum p */
INL void softmax_chunk(float *sr, int chunk, float *m_run, float *l_run, float *o) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < chunk; i += 16)
        mv = _mm512_max_ps(mv, _mm512_load_ps(sr + i));
    const float mc = _mm512_reduce_max_ps(mv);
    if (mc > *m_run) {
        const float alpha = expf(*m_run - mc);
        *m_run = mc;
        *l_run *= alpha;
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(alpha)));
    }
    const __m512 m = _mm512_set1_ps(*m_run);
    __m512 l = _mm512_setzero_ps();
    for (int i = 0; i < chunk; i += 16) {
        const __m512 t = _mm512_max_ps(/* no subnormal p (FP assists) */
                                       _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(sr + i), m),
                                                     _mm512_set1_ps(1.44269504f)),
                                       _mm512_set1_ps(-100.0f));
        const __m512 ni = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 f = _mm512_sub_ps(t, ni);
        __m512 pl = _mm512_set1_ps(1.3333558e-3f);
        pl = _mm512_fmadd_ps(pl, f, _mm512_set1_ps(9.6181291e-3f));
        pl = _mm512_fmadd_ps(pl, f, _mm512_set1_ps(5.5504109e-2f));
        pl = _mm512_fmadd_ps(pl, f, _mm512_set1_ps(2.4022651e-1f));
        pl = _mm512_fmadd_ps(pl, f, _mm512_set1_ps(6.9314718e-1f));
        pl = _mm512_fmadd_ps(pl, f, _mm512_set1_ps(1.0f));
        const __m512 pv = _mm512_min_ps(_mm512_scalef_ps(pl, ni), _mm512_set1_ps(1.0f));
        _mm512_store_ps(sr + i, pv);
        l = _mm512_add_ps(l, pv);
    }
    *l_run += _mm512_reduce_add_ps(l);
}

typedef struct step {
    const uint8_t *buf; /* per kv head: K of all keys, then V of all keys */
    int heads, n, chunk, pass3_s, prefetch;
    int h0, h1;      /* the kv heads this thread's step runs */
    int rows;        /* ggml's q8_0 rows (reordered in registers), not the interleaved layout */
    uint8_t *scales; /* rows: a chunk's V scales in superblock order (pass3_rows_chunk) */
    const qprep *qp; /* per kv head */
    float *S;        /* ROWS x chunk scores, then weights */
    uint8_t *wbuf;   /* a chunk's weight digits */
    float *O;        /* heads x ROWS x D, unnormalized */
    float *m, *l;    /* heads x ROWS running max and sum */
} step;

/* one decode step: per kv head and chunk, pass 1, the softmax, pass 3. The phase-split
 * prefetch: this chunk's V during pass 1, the next chunk's K (the next head's at the end)
 * during pass 3, so that each pass streams what the other will read */
static __attribute__((noinline)) float big_step(const step *st) {
    const int CH = st->chunk, nsb = CH / SB;
    for (int i = st->h0 * ROWS; i < st->h1 * ROWS; i++)
        st->m[i] = -INFINITY, st->l[i] = 0;
    memset(st->O + st->h0 * ROWS * D, 0, sizeof(float) * ROWS * D * (size_t)(st->h1 - st->h0));
    const size_t hbytes = (size_t)st->n / SB * SB_BYTES;
    for (int h = st->h0; h < st->h1; h++) {
        const uint8_t *K = st->buf + 2 * (size_t)h * hbytes, *V = K + hbytes;
        float *o = st->O + h * ROWS * D;
        for (int c = 0; c < st->n; c += CH) {
            const size_t off = (size_t)c / SB * SB_BYTES;
            for (int sb = 0; sb < nsb; sb++) {
                if (st->prefetch)
                    for (int l = 0; l < SB_BYTES; l += 64)
                        _mm_prefetch((const char *)V + off + (size_t)sb * SB_BYTES + l,
                                     _MM_HINT_T1);
                if (st->rows) /* 16 rows are SB_BYTES too: the same offsets */
                    pass1_rows(K + off + (size_t)sb * SB_BYTES, &st->qp[h], st->S + 16 * sb, CH);
                else
                    pass1_sb(K + off + (size_t)sb * SB_BYTES, &st->qp[h], st->S + 16 * sb, CH);
            }
            for (int x = 0; x < ROWS; x++)
                softmax_chunk(st->S + x * CH, CH, &st->m[h * ROWS + x], &st->l[h * ROWS + x],
                              o + x * D);
            const uint8_t *pf = !st->prefetch    ? NULL
                                : c + CH < st->n ? K + off + (size_t)nsb * SB_BYTES
                                : h + 1 < st->h1 ? K + 2 * hbytes
                                                 : NULL;
            if (st->rows)
                pass3_rows_chunk(V + off, nsb, st->S, CH, st->wbuf, st->scales, o, pf);
            else if (st->pass3_s)
                pass3S_chunk(V + off, nsb, st->S, CH, st->wbuf, o, pf);
            else
                pass3_chunk(V + off, nsb, st->S, CH, st->wbuf, o, pf);
        }
    }
    return st->O[0];
}

/* the plain read loop: every byte once, 4 independent AVX-512 add chains */
static __attribute__((noinline)) uint64_t read_loop(const uint8_t *buf, size_t bytes) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < bytes; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(buf + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(buf + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(buf + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(buf + i + 192));
    }
    return (uint64_t)_mm512_reduce_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}

/* the step and the read loop on T threads (T <= 2): thread t runs kv heads [h0, h1) of its own
 * step (its own scratch) and reads those heads' bytes; thread 0 is the caller */
typedef struct job {
    step *st;
    const uint8_t *buf;
    size_t bytes;
    int read; /* 1: the read loop over buf, 0: the step */
    uint64_t out;
} job;
static void *run_job(void *arg) {
    job *j = arg;
    j->out = j->read ? read_loop(j->buf, j->bytes) : (uint64_t)big_step(j->st);
    return NULL;
}
static uint64_t run_threads(job *jobs, int T) {
    pthread_t th;
    const int spawned = T > 1 && pthread_create(&th, NULL, run_job, &jobs[1]) == 0;
    if (T > 1 && !spawned)
        run_job(&jobs[1]);
    run_job(&jobs[0]);
    if (spawned)
        pthread_join(th, NULL);
    return jobs[0].out + (T > 1 ? jobs[1].out : 0);
}

/* head 0's o / l against float64 (the data repeat every chunk, so l is n / chunk times the
 * chunk's); relative to max |o / l|. The polynomial exp (~1e-7) and float32 l bound it: FAIL
 * above 2^-10 (a broken layout or prefetch address gives O(1)) */
static int big_sanity(const step *st, const refdata *r) {
    const int CH = st->chunk;
    double *sref = malloc(sizeof(double) * (size_t)CH), err = 0, lerr = 0;
    if (!sref)
        abort();
    for (int x = 0; x < ROWS; x++) {
        double m = -1e300, l = 0, oref[D], maxo = 0;
        for (int i = 0; i < CH; i++) {
            double a = 0;
            for (int d = 0; d < D; d++)
                a += (double)r->q[x][d] * r->k8[i * D + d] * (double)h2f(r->ks[i * NB + d / 32]);
            sref[i] = a, m = fmax(m, a);
        }
        for (int d = 0; d < D; d++)
            oref[d] = 0;
        for (int i = 0; i < CH; i++) {
            const double p = exp(sref[i] - m);
            l += p;
            for (int d = 0; d < D; d++)
                oref[d] += p * (double)h2f(r->vs[i * NB + d / 32]) * r->v8[i * D + d];
        }
        for (int d = 0; d < D; d++)
            maxo = fmax(maxo, fabs(oref[d] / l));
        for (int d = 0; d < D; d++)
            err = fmax(err, fabs((double)(st->O[x * D + d] / st->l[x]) - oref[d] / l) / maxo);
        lerr = fmax(lerr, fabs((double)st->l[x] / (st->n / CH) - l) / l);
    }
    free(sref);
    const int ok = err <= 0x1p-10 && lerr <= 0x1p-10;
    printf("  sanity, head 0: max |o/l - ref| / max|ref| = %.2e, l rel. err %.2e%s\n", err, lerr,
           ok ? "" : "   FAIL (> 2^-10)");
    return ok;
}

int q8i_big(
    int keys, int heads, int chunk, int pass3_s, int prefetch, int rows, int threads, double ghz) {
    enum { RUNS = 9 };
    const int T = threads < 2 || heads < 2 ? 1 : 2;
    const size_t hbytes = (size_t)keys / SB * SB_BYTES, total = 2 * hbytes * (size_t)heads,
                 cbytes = (size_t)chunk / SB * SB_BYTES;
    uint8_t *buf = aligned_alloc(4096, total);
    uint8_t *kc = aligned_alloc(64, cbytes), *vc = aligned_alloc(64, cbytes);
    refdata r;
    gen(&r, chunk); /* the content repeats every chunk: only the bytes count here */
    qprep *qp = aligned_alloc(64, sizeof(qprep) * (size_t)heads);
    float *O = aligned_alloc(64, sizeof(float) * ROWS * D * (size_t)heads);
    float *m = malloc(sizeof(float) * ROWS * (size_t)heads);
    float *l = malloc(sizeof(float) * ROWS * (size_t)heads);
    step st[2];
    job steps[2], reads[2];
    int fail = !buf || !kc || !vc || !qp || !O || !m || !l;
    for (int t = 0; t < T; t++) { /* thread t: heads [t heads / T, (t + 1) heads / T) */
        st[t] = (step){.buf = buf,
                       .heads = heads,
                       .n = keys,
                       .chunk = chunk,
                       .pass3_s = pass3_s,
                       .prefetch = prefetch,
                       .h0 = t * heads / T,
                       .h1 = (t + 1) * heads / T,
                       .rows = rows,
                       .qp = qp,
                       .O = O,
                       .m = m,
                       .l = l};
        st[t].scales = aligned_alloc(64, cbytes);
        st[t].S = aligned_alloc(64, sizeof(float) * ROWS * (size_t)chunk);
        st[t].wbuf = aligned_alloc(64, (size_t)chunk / SB * ROWS * NB * 64);
        fail |= !st[t].scales || !st[t].S || !st[t].wbuf;
        steps[t] = (job){.st = &st[t]};
        reads[t] = (job){.buf = buf + 2 * hbytes * (size_t)st[t].h0,
                         .bytes = 2 * hbytes * (size_t)(st[t].h1 - st[t].h0),
                         .read = 1};
    }
    if (fail) {
        fprintf(stderr, "mha_bench_q8_interleaved: out of memory (%.1f MB)\n", (double)total / 1e6);
        return 1;
    }
    if (rows) {
        pack_rows(r.k8, r.ks, chunk, kc);
        pack_rows(r.v8, r.vs, chunk, vc);
    } else {
        pack_k(&r, chunk, kc);
        pack_v(&r, chunk, vc, pass3_s);
    }
    for (int h = 0; h < heads; h++) {
        for (int c = 0; c < keys; c += chunk) {
            const size_t off = (size_t)c / SB * SB_BYTES;
            memcpy(buf + 2 * (size_t)h * hbytes + off, kc, cbytes);
            memcpy(buf + (2 * (size_t)h + 1) * hbytes + off, vc, cbytes);
        }
        prep_q((const float(*)[D])r.q, &qp[h]);
    }
    double tb[RUNS], tr[RUNS];
    volatile uint64_t sink = 0;
    sink += run_threads(reads, T);
    sink += run_threads(steps, T);
    for (int i = 0; i < RUNS; i++) { /* interleaved: the same residency and neighbours */
        double t0 = bench_now_s();
        sink += run_threads(reads, T);
        tr[i] = bench_now_s() - t0;
        t0 = bench_now_s();
        sink += run_threads(steps, T);
        tb[i] = bench_now_s() - t0;
    }
    (void)sink;
    printf("large cache: %d keys x %d kv heads, %.1f MB (K + V int8 + f16 scales, 272 B per "
           "(key, kv head)), chunk %d keys, pass 3%s, %s; %d thread%s (kv heads split); %d runs "
           "interleaved\n",
           keys, heads, (double)total / 1e6, chunk,
           rows      ? " plain over ggml's rows (reordered in registers)"
           : pass3_s ? " S"
                     : " plain",
           prefetch ? "phase-split prefetch" : "no software prefetch", T, T > 1 ? "s" : "", RUNS);
    const int ok = big_sanity(&st[0], &r);
    qsort(tb, RUNS, sizeof(double), bench_cmp_double);
    qsort(tr, RUNS, sizeof(double), bench_cmp_double);
    const double kh = (double)keys * heads;
    printf("  %-32s %8s %8s %8s %8s %10s\n", "", "GB/s", "best", "ns", "cycles", "% of read");
    printf("  %-32s %8.2f %8.2f %8.2f %8.1f\n", "read loop (AVX-512 adds)",
           (double)total / tr[RUNS / 2] / 1e9, (double)total / tr[0] / 1e9, tr[RUNS / 2] / kh * 1e9,
           tr[RUNS / 2] / kh * 1e9 * ghz);
    printf("  %-32s %8.2f %8.2f %8.2f %8.1f %9.0f%%\n", "VNNI pass 1 + softmax + pass 3",
           (double)total / tb[RUNS / 2] / 1e9, (double)total / tb[0] / 1e9, tb[RUNS / 2] / kh * 1e9,
           tb[RUNS / 2] / kh * 1e9 * ghz, 100.0 * tr[RUNS / 2] / tb[RUNS / 2]);
    for (int t = 0; t < T; t++)
        free(st[t].scales), free(st[t].S), free(st[t].wbuf);
    free(buf), free(kc), free(vc), free(qp), free(O), free(m), free(l);
    free_ref(&r);
    return !ok;
}

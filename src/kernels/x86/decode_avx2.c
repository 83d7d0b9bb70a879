/* SPDX-License-Identifier: MIT */
/* decode_avx2.c: the split-KV decode kernel (flash-decoding) with AVX2 + FMA + F16C intrinsics.
 *
 * Same unit and contract as decode_generic.c and decode_avx512.c: keys [j0, j1) of kv head g of
 * one sequence, for all R = group * t query rows that share it, producing an unnormalised
 * (o, m, l) per row:
 *   pass 1: s_rj = q_r . k_j        (blocks of DEC_KB keys, up to 4 query rows x 2 keys at once)
 *   pass 2: s_rj = scale s_rj, soft-capped, minus ALiBi slope_h (p_r - j); -inf where hidden;
 *           m_r = max_j s_rj, e_rj = exp(s_rj - m_r), l_r = sum_j e_rj   (vectorised over keys)
 *   pass 3: o_r += e_rj v_j         (blocks of DEC_KB keys, 4 rows x 16 columns of o in registers)
 * K and V rows are read straight from the cache and widened in registers: float16 with
 * VCVTPH2PS (F16C), bfloat16 by a 16-bit left shift. Every K and V element is loaded and widened
 * once per group of 4 query rows, so for t = 1 and group <= 4 exactly once (many rows: the wide
 * path below).
 *
 * Register budget (16 ymm):
 *   pass 1: 4 rows x 2 keys = 8 accumulators, 2 x 2 widened K vectors (16 elements of 2 keys),
 *           2 q vectors; per 16 elements 16 FMAs for 4 K loads and 8 q loads. One horizontal
 *           reduction per (2 keys, 4 rows): 6 VHADDPS + 2 adds, i.e. per 2 dk / 8 FMAs.
 *   pass 3: 4 rows x 2 vectors = 8 accumulators, 2 widened V vectors, 1 broadcast e; the
 *           accumulators stay in registers over a block of DEC_KB keys (o is loaded and stored
 *           once per block and 16 columns), 8 FMAs per key for 2 V loads and 4 broadcasts.
 * A 4 x 3 tile (12 accumulators) would save loads but leaves 1 register for the widened K
 * vectors of 16 elements; on AMD Zen 1 (the AVX2 host) a 256-bit FMA is 2 uops on the two
 * 128-bit FMA pipes, so the loads are not the limit at 4 x 2.
 *
 * Head sizes: elements are taken 16 at a time (two vectors), then one vector of 8, then (dk or dv
 * not a multiple of 8 only) a partial vector read with VMASKMOVPS (float32) or copied through a
 * zeroed 16-byte buffer (float16 / bfloat16: AVX2 has no 16-bit masked load, and a plain load
 * could read past the end of the cache). So multiples of 8 run plain loads only.
 *
 * bfloat16 is widened 16 elements per 32-byte load, even and odd elements apart: a 32-bit lane i
 * holds elements 2i (low half) and 2i + 1 (high half), so `x << 16` gives the even elements as
 * float32 and `x & 0xFFFF0000` the odd ones (1 vector operation per 8 elements, against 2 for
 * VPMOVZXWD + VPSLLD). q is copied in the same even/odd order per 16 elements, o is accumulated
 * in it and put back in natural order when the unit's o is written out.
 *
 * Layout of the scratch (mha__dec_scratch_floats, 64-byte aligned):
 *   S [R][MHA_DEC_BLOCK]  scores, then exponentials
 *   W                     pass 1: q chunk-major, 8 floats of row r and chunk c at W + (c R + r) 8
 *                         (every row of a group is a constant offset from one pointer);
 *                         pass 3: o [R][dvp] (dvp = dv rounded up to 8: tails need no masks)
 * so W needs R max(dk, dv) + 7 R floats, within the R (d + 16) the scratch has.
 *
 * The wide path: units of R > DEC_WIDE_MIN_ROWS(dtype) query rows (several tokens per call, draft
 * trees: R = 32 for an 8-draft tree at group 4) take dec_wide instead, built for the FMA pipes as
 * decode_avx512.c's wide path but for 16 ymm registers:
 *   pass 1: scores transposed, S^T[key][row]. The query rows are held transposed, Qt[dk][Rp] (Rp
 *           = R rounded up to 8, zero-padded; 8 x 8 in-register transposes, once per unit); each
 *           block of 16 K rows is widened once into float32 scratch (float32 rows are read in
 *           place); tiles of 2 vectors of rows (16 rows) x 6 keys (6 + 6 + 4 per block; a last
 *           single vector of rows: 1 x 8 keys) run acc[v][y] += Qt[d][8 v ..] * broadcast(K[y][d])
 *           for d = 0 .. dk-1: 12 accumulators + 2 q vectors + 1 broadcast = 15 of the 16 ymm
 *           registers; per step d 12 FMAs for 2 q loads and 6 broadcast loads (0.67 loads per FMA,
 *           no shuffle). One FMA chain per score in increasing d, no horizontal sums. Each 8 x 8
 *           tile of S^T is transposed in registers into S [R][MHA_DEC_BLOCK], so pass 2 is the
 *           same code (masks, trees, windows, sinks, soft-cap, ALiBi).
 *   pass 3: blocks of 32 V rows widened once into float32 scratch (float32 with d_v % 16 == 0
 *           read in place), then 6 rows x 16 columns of o in registers over the block (12
 *           accumulators, 2 V vectors, 1 broadcast e): per key 12 FMAs for 2 V loads and 6
 *           broadcasts; o is the unit's output, loaded and stored once per block (masked for the
 *           last d_v % 16 columns); keys in increasing order as above.
 * The FMA floor: R (dk + dv) / 8 256-bit FMAs per (key, kv head), 2 per cycle on the Zen 5 host
 * (each 256-bit FMA takes one of its two FMA pipes): R = 32, d = 128: 512 cycles, 32.2 ms for
 * 32768 keys x 8 kv heads at 4.17 GHz. The groups of 4 rows below already ran that tree at 63-75%
 * of it on Zen 5 (K re-read from the L1 per group: loads and widening ops go to other pipes than
 * the FMAs there); the wide path measured 6-26% faster for float32, q8_0 and fp8 at R = 32, about
 * equal for float16 and bfloat16 (whose in-register widening is nearly free) and slower for R <= 12
 * (a vector of 8 rows is then partly zero padding): hence the per-dtype thresholds
 * (DEC_WIDE_MIN_ROWS; docs/INFERENCE.md). Sums are in a fixed order that does not depend on
 * threads; they differ in rounding from the groups of 4 rows (tolerance-tested).
 *
 * Ring buffers: a unit's keys are one or two runs of consecutive cache rows (a windowed cache's
 * unit may wrap from the last slot to slot 0); each run goes through the same code.
 *
 * Hidden keys: pass 3 skips, per row, a key whose e is exactly 0 (a key the row does not see, or
 * whose exp underflowed), as the generic kernel does: 0 * inf would turn o into NaN. A block in
 * which every row sees every key (the common case) runs without the test.
 *
 * NaN: a NaN score among a row's visible keys makes m NaN (then e, l and o are NaN and the
 * merged row is NaN, as in the generic kernel, whose l becomes NaN).
 *
 * The float32 sums run in an order fixed by the problem (pass 1: 8 lanes, then a fixed
 * reduction tree; pass 3: keys in increasing order per element), not by the thread: results are
 * bit-identical for any thread count; they differ in rounding from the generic kernel's order
 * (tolerance-tested).
 */
#include "kernels/registry.h"

#if defined(__x86_64__) || defined(__i386__)
#    include "kernels/x86/gemm_pack_x86.h"
#    include "kernels/x86/simd_avx2.h"

#    include <string.h>

/* Keys per block: pass 1 runs the row groups of 4 over a block (its K rows stay in L1: 32 rows
 * of 128 float32 or 64 rows of 128 16-bit elements = 16 KiB) and pass 3 keeps o in registers over
 * a block; each block prefetches the next one, so the block is also the prefetch distance. 64
 * float16 / bfloat16 keys per block ran a step beyond the L3 1.03-1.10x faster than 32 on AMD Zen 4
 * (1 thread); float32 measured the same with 32 and 64, and 64 of its rows would fill the L1. At
 * most 64 (the per-key visibility bits of a block are one uint64_t). */
#    define DEC_KB(DT) ((DT) == MHA_DTYPE_F32 ? 32 : 64)

/* The wide path (see the top) serves units of more than this many query rows. Measured on AMD
 * Zen 5 (1 thread, h 32 g 8 d 128, 32768 keys, draft trees / chains of t tokens, R = 4 t; wide
 * against groups of 4 rows, ms per step): float32 R 8 16.3 / 14.1, R 12 21.2 / 20.4, R 16
 * 24.5 / 26.8, R 32 48.2 / 51.4; fp8 R 12 25.6 / 25.5, R 16 28.9 / 34.5, R 32 50.5 / 68.5; q8_0
 * R 16 29.3 / 28.7, R 20 36.2 / 35.4, R 24 40.4 / 45.6, R 32 50.8 / 57.9; bfloat16 R 16
 * 25.7 / 24.7, R 24 37.6 / 37.0, R 32 47.0-47.8 / 47.9-48.5, R 64 103.8 / 107.7; float16 R 16
 * 25.7 / 24.3, R 32 47.8 / 48.0, R 64 106.9 / 108.8. */
#    define DEC_WIDE_MIN_ROWS(DT)                                                                  \
        ((DT) == MHA_DTYPE_F32 || (DT) == MHA_DTYPE_FP8_E4M3 ? 12                                  \
         : (DT) == MHA_DTYPE_Q8_0                            ? 20                                  \
                                                             : 24)

/* ---- Loading cache rows ---------------------------------------------------------------------- */

/* Elements [d, d + n) (0 < n < 8) of a 16-bit row, zero-extended to 8. */
MHA_INLINE __m128i load_part_u16(const uint16_t *row, int64_t d, int64_t n) {
    uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(t, row + d, sizeof(uint16_t) * (size_t)n);
    return _mm_loadu_si128((const __m128i *)t);
}

/* Eight 16-bit floats of type DT (float16 or bfloat16) as float32. */
MHA_INLINE v8 widen8(const mha_dtype DT, __m128i h) {
    if (DT == MHA_DTYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Elements [d, d + 8) of a cache row of type DT as float32, natural order. */
MHA_INLINE v8 load8(const mha_dtype DT, const void *row, int64_t d) {
    if (DT == MHA_DTYPE_FP8_E4M3)
        return v8_fp8_widen((const char *)row + d);
    if (DT == MHA_DTYPE_Q8_0)
        return v8_q8_widen(row, d, v8_q8_scale(row, d));
    if (DT == MHA_DTYPE_F32)
        return _mm256_loadu_ps((const float *)row + d);
    return widen8(DT, _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
}

/* Elements [d, d + n) (0 < n < 8) of a cache row as float32, the other lanes 0 (nothing past
 * the row is read). */
MHA_INLINE v8 load_part8(const mha_dtype DT, const void *row, int64_t d, int64_t n) {
    if (DT == MHA_DTYPE_FP8_E4M3) {
        unsigned char t[8] = {0};
        memcpy(t, (const char *)row + d, (size_t)n);
        return v8_fp8_widen(t);
    }
    if (DT == MHA_DTYPE_Q8_0) { /* (q8_0 head sizes are multiples of 32: not reached) */
        unsigned char t[MHA__Q8_BYTES] = {0};
        memcpy(t, (const char *)row + (d >> 5) * MHA__Q8_BYTES, 2 + (size_t)(d & 31) + (size_t)n);
        return v8_q8_widen(t, d & 31, v8_q8_scale(t, 0));
    }
    if (DT == MHA_DTYPE_F32)
        return _mm256_maskload_ps((const float *)row + d, v8_first((int)n));
    return widen8(DT, load_part_u16((const uint16_t *)row, d, n));
}

/* Elements [d, d + 16) of a cache row as two float32 vectors: float32 / float16 in natural order
 * (*a = d..d+7, *b = d+8..d+15), bfloat16 even / odd (*a = d, d+2, ..., *b = d+1, d+3, ...). */
MHA_INLINE void load16(const mha_dtype DT, const void *row, int64_t d, v8 *a, v8 *b) {
    if (DT == MHA_DTYPE_FP8_E4M3) {
        v8_fp8_widen16((const char *)row + d, a, b);
    } else if (DT == MHA_DTYPE_Q8_0) { /* natural order, one scale for both (d % 16 == 0) */
        const v8 s = v8_q8_scale(row, d);
        *a = v8_q8_widen(row, d, s);
        *b = v8_q8_widen(row, d + 8, s);
    } else if (DT == MHA_DTYPE_BF16) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
        *a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else {
        *a = load8(DT, row, d);
        *b = load8(DT, row, d + 8);
    }
}

/* ---- Software prefetch ------------------------------------------------------------------------
 * Each block prefetches the block that follows it in the unit's stream (K blocks, then the first
 * V rows, then the V blocks, then the next unit's first K rows), spread over its arithmetic: a
 * burst of prefetches fills the line-fill buffers and stalls the loads of the block itself. The
 * level they fill is the CPU's (mha__cpu_prefetch_to_l2): the L1 on Intel and AMD Zen 1, the L2
 * on AMD Zen 4, where filling the L1 ran this kernel up to 20% slower (float32). */
typedef struct prefetch_span {
    const char *p;  /* first byte (NULL: nothing) */
    size_t n;       /* bytes */
    const char *p1; /* then n1 bytes at p1 (the rows ahead may start another run: a page) */
    size_t n1;
    int l2; /* PREFETCHT1 (fill the L2), else PREFETCHT0 */
} prefetch_span;

/* Prefetches the lines of span pf at byte offsets [off, off + 64 lines). */
MHA_INLINE void prefetch_step(prefetch_span pf, size_t off, int lines) {
    for (int i = 0; i < lines; i++, off += 64) {
        const char *at = off < pf.n ? pf.p + off : off - pf.n < pf.n1 ? pf.p1 + (off - pf.n) : NULL;
        if (!at)
            continue;
        if (pf.l2)
            _mm_prefetch(at, _MM_HINT_T1);
        else
            _mm_prefetch(at, _MM_HINT_T0);
    }
}

/* ---- Pass 1: scores ---------------------------------------------------------------------------
 */

/* out[x * BLOCK + y] = the sum of the 8 lanes of acc[x][y] for NR rows and keys y < 1 + two. */
MHA_INLINE void store_scores2(const int NR, v8 acc[4][2], int two, float *out) {
    v8 h[4];
#    pragma GCC unroll 4
    for (int x = 0; x < 4; x++) /* per 128-bit half: [x k0, x k0, x k1, x k1] partial sums */
        h[x] = x < NR ? _mm256_hadd_ps(acc[x][0], acc[x][1]) : v8_zero();
    /* per 128-bit half: [x0 k0, x0 k1, x1 k0, x1 k1] (x2, x3), then the two halves added */
    const v8 h01 = _mm256_hadd_ps(h[0], h[1]), h23 = _mm256_hadd_ps(h[2], h[3]);
    const __m128 s01 = _mm_add_ps(_mm256_castps256_ps128(h01), _mm256_extractf128_ps(h01, 1));
    const __m128 s23 = _mm_add_ps(_mm256_castps256_ps128(h23), _mm256_extractf128_ps(h23, 1));
    const __m128 s[4] = {s01, _mm_movehl_ps(s01, s01), s23, _mm_movehl_ps(s23, s23)};
#    pragma GCC unroll 4
    for (int x = 0; x < NR; x++) {
        if (two)
            _mm_storel_pi((__m64 *)(void *)(out + x * MHA_DEC_BLOCK), s[x]);
        else
            _mm_store_ss(out + x * MHA_DEC_BLOCK, s[x]);
    }
}

/* S[x * BLOCK + y] = q_x . k_y for NR query rows and the nk keys of a run of cache rows
 * (k, stride rb bytes). q: chunk 0 of the first row in the chunk-major copy, qs floats between
 * chunks (8 floats of row x and chunk c at q + c qs + 8 x; bfloat16 in even/odd order per 16).
 * Two keys per sweep of the rows' elements; rows past nk are not read. */
MHA_INLINE void scores_body(const int NR,
                            const mha_dtype DT,
                            const char *k,
                            size_t rb,
                            int64_t nk,
                            const float *q,
                            int64_t qs,
                            int64_t dk,
                            float *S,
                            prefetch_span pf) {
    const int64_t n16 = dk / 16 * 16;
    /* prefetch: the span's bytes spread evenly, E lines per 16 elements of 2 keys
     * (2 rows x 16 elements x elem bytes = 64 E; q8_0: one line every 34 bytes, which touches
     * every line of the span) */
    const int E = DT == MHA_DTYPE_F32 ? 2 : 1;
    const size_t PB = DT == MHA_DTYPE_Q8_0       ? MHA__Q8_BYTES
                      : DT == MHA_DTYPE_FP8_E4M3 ? 32
                                                 : 64 * (size_t)E;
    size_t poff = 0;
    for (int64_t y = 0; y < nk; y += 2, k += 2 * rb) {
        const char *k0 = k, *k1 = y + 1 < nk ? k + rb : k;
        v8 acc[4][2];
#    pragma GCC unroll 4
        for (int x = 0; x < NR; x++)
            acc[x][0] = acc[x][1] = v8_zero();
        const float *qc = q;
        int64_t d = 0;
        for (; d < n16; d += 16, qc += 2 * qs) {
            prefetch_step(pf, poff, E);
            poff += PB;
            v8 a0, b0, a1, b1;
            load16(DT, k0, d, &a0, &b0);
            load16(DT, k1, d, &a1, &b1);
#    pragma GCC unroll 4
            for (int x = 0; x < NR; x++) {
                v8 qa = v8_load(qc + 8 * x), qb = v8_load(qc + qs + 8 * x);
                /* keeps q in registers: GCC otherwise folds the load of each q vector into both
                 * FMAs that use it, and the doubled loads cost this loop 5-8% on AMD Zen */
                __asm__("" : "+x"(qa), "+x"(qb));
                acc[x][0] = v8_fma(qa, a0, acc[x][0]);
                acc[x][1] = v8_fma(qa, a1, acc[x][1]);
                acc[x][0] = v8_fma(qb, b0, acc[x][0]);
                acc[x][1] = v8_fma(qb, b1, acc[x][1]);
            }
        }
        for (; d < dk; d += 8, qc += qs) { /* one vector of 8, then a partial one */
            const int64_t n = dk - d < 8 ? dk - d : 8;
            const v8 a0 = n == 8 ? load8(DT, k0, d) : load_part8(DT, k0, d, n);
            const v8 a1 = n == 8 ? load8(DT, k1, d) : load_part8(DT, k1, d, n);
#    pragma GCC unroll 4
            for (int x = 0; x < NR; x++) {
                const v8 qa = v8_load(qc + 8 * x);
                acc[x][0] = v8_fma(qa, a0, acc[x][0]);
                acc[x][1] = v8_fma(qa, a1, acc[x][1]);
            }
        }
        store_scores2(NR, acc, y + 1 < nk, S + y);
    }
}

/* ---- Pass 3: o += e v -------------------------------------------------------------------------
 */

/* acc[x][c] += e_x v[c] for NR rows (e_x at e + x BLOCK); with CHECK (a constant), a row whose
 * bit y of seen[x] is clear (e_xy == 0) skips the key: 0 * inf would be NaN. */
MHA_INLINE void add_value(const int NR,
                          const int NV,
                          const int CHECK,
                          const uint64_t seen[4],
                          int64_t y,
                          const float *e,
                          const v8 v[2],
                          v8 acc[4][2]) {
#    pragma GCC unroll 4
    for (int x = 0; x < NR; x++) {
        if (CHECK && !(seen[x] >> y & 1u))
            continue;
        const v8 ev = _mm256_broadcast_ss(e + x * MHA_DEC_BLOCK + y);
        for (int c = 0; c < NV; c++)
            acc[x][c] = v8_fma(ev, v[c], acc[x][c]);
    }
}

/* o_x[0, dv) += sum_{y < nk} e_x[y] v_y for NR rows (o_x at o + x os, padded to a multiple of 8;
 * e_x at e + x BLOCK) over the nk keys of a run of value rows (v, stride rbv bytes): per 16
 * columns, the NR x 2 accumulators stay in registers over the nk keys, which are added in
 * increasing order (o = ((o + e0 v0) + e1 v1) + ...: the sum does not depend on the block
 * size). bfloat16's 16-column groups are in even/odd order. */
MHA_INLINE void values_body(const int NR,
                            const mha_dtype DT,
                            const int CHECK,
                            const char *v,
                            size_t rbv,
                            int64_t nk,
                            const float *e,
                            const uint64_t seen[4],
                            float *o,
                            int64_t os,
                            int64_t dv,
                            prefetch_span pf) {
    /* prefetch: the span (nk rows of dv elements) spread evenly over the (16 columns, 2 keys)
     * steps: 2 x 16 x elem bytes = 64 E per step (q8_0: 34 bytes, one line) */
    const int E = DT == MHA_DTYPE_F32 ? 2 : 1;
    const size_t PB = DT == MHA_DTYPE_Q8_0       ? MHA__Q8_BYTES
                      : DT == MHA_DTYPE_FP8_E4M3 ? 32
                                                 : 64 * (size_t)E;
    size_t poff = 0;
    int64_t c0 = 0;
    for (; c0 + 16 <= dv; c0 += 16) {
        v8 acc[4][2];
#    pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            acc[x][0] = v8_load(o + x * os + c0);
            acc[x][1] = v8_load(o + x * os + c0 + 8);
        }
        const char *row = v;
        int64_t y = 0;
        for (; y + 2 <= nk; y += 2, row += 2 * rbv) { /* two keys per step: less loop overhead */
            prefetch_step(pf, poff, E);
            poff += PB;
            v8 va[2], vb[2];
            load16(DT, row, c0, &va[0], &va[1]);
            load16(DT, row + rbv, c0, &vb[0], &vb[1]);
            add_value(NR, 2, CHECK, seen, y, e, va, acc);
            add_value(NR, 2, CHECK, seen, y + 1, e, vb, acc);
        }
        if (y < nk) {
            v8 va[2];
            load16(DT, row, c0, &va[0], &va[1]);
            add_value(NR, 2, CHECK, seen, y, e, va, acc);
        }
#    pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            v8_store(o + x * os + c0, acc[x][0]);
            v8_store(o + x * os + c0 + 8, acc[x][1]);
        }
    }
    for (; c0 < dv; c0 += 8) { /* one vector of 8 columns, then a partial one */
        const int64_t n = dv - c0 < 8 ? dv - c0 : 8;
        v8 acc[4][2];
#    pragma GCC unroll 4
        for (int x = 0; x < NR; x++)
            acc[x][0] = v8_load(o + x * os + c0);
        const char *row = v;
        for (int64_t y = 0; y < nk; y++, row += rbv) {
            const v8 vv[2] = {n == 8 ? load8(DT, row, c0) : load_part8(DT, row, c0, n), v8_zero()};
            add_value(NR, 1, CHECK, seen, y, e, vv, acc);
        }
#    pragma GCC unroll 4
        for (int x = 0; x < NR; x++)
            v8_store(o + x * os + c0, acc[x][0]);
    }
}

/* ---- One non-inlined instance per (dtype, rows[, check]) ------------------------------------
 * Small functions with the dtype and row count constant: the few pointers they walk stay in
 * registers and the loops are fully specialised (the body inlined into the whole kernel spilled
 * in the AVX-512 kernel, see decode_avx512.c). */
typedef void (*scores_fn)(
    const char *, size_t, int64_t, const float *, int64_t, int64_t, float *, prefetch_span);
typedef void (*values_fn)(const char *,
                          size_t,
                          int64_t,
                          const float *,
                          const uint64_t *,
                          float *,
                          int64_t,
                          int64_t,
                          prefetch_span);

#    define DEC_FNS_(tag, dt, nr)                                                                  \
        static __attribute__((noinline)) void scores_##tag##nr(                                    \
            const char *k, size_t rb, int64_t nk, const float *q, int64_t qs, int64_t dk,          \
            float *S, prefetch_span pf) {                                                          \
            scores_body(nr, dt, k, rb, nk, q, qs, dk, S, pf);                                      \
        }                                                                                          \
        static __attribute__((noinline)) void values_##tag##nr(                                    \
            const char *v, size_t rbv, int64_t nk, const float *e, const uint64_t *seen, float *o, \
            int64_t os, int64_t dv, prefetch_span pf) {                                            \
            values_body(nr, dt, 0, v, rbv, nk, e, seen, o, os, dv, pf);                            \
        }                                                                                          \
        static __attribute__((noinline)) void values_chk_##tag##nr(                                \
            const char *v, size_t rbv, int64_t nk, const float *e, const uint64_t *seen, float *o, \
            int64_t os, int64_t dv, prefetch_span pf) {                                            \
            values_body(nr, dt, 1, v, rbv, nk, e, seen, o, os, dv, pf);                            \
        }
#    define DEC_DTYPE_(tag, dt)                                                                    \
        DEC_FNS_(tag, dt, 1) DEC_FNS_(tag, dt, 2) DEC_FNS_(tag, dt, 3) DEC_FNS_(tag, dt, 4)
DEC_DTYPE_(f32_, MHA_DTYPE_F32)
DEC_DTYPE_(f16_, MHA_DTYPE_F16)
DEC_DTYPE_(bf16_, MHA_DTYPE_BF16)
DEC_DTYPE_(q8_, MHA_DTYPE_Q8_0)
DEC_DTYPE_(fp8_, MHA_DTYPE_FP8_E4M3)
#    undef DEC_DTYPE_
#    undef DEC_FNS_

/* [dtype: f32, f16, bf16, q8_0][rows - 1] */
static const scores_fn scores_table[5][4] = {
    {scores_f32_1, scores_f32_2, scores_f32_3, scores_f32_4},
    {scores_f16_1, scores_f16_2, scores_f16_3, scores_f16_4},
    {scores_bf16_1, scores_bf16_2, scores_bf16_3, scores_bf16_4},
    {scores_q8_1, scores_q8_2, scores_q8_3, scores_q8_4},
    {scores_fp8_1, scores_fp8_2, scores_fp8_3, scores_fp8_4}};
/* [check][dtype][rows - 1] */
static const values_fn values_table[2][5][4] = {
    {{values_f32_1, values_f32_2, values_f32_3, values_f32_4},
     {values_f16_1, values_f16_2, values_f16_3, values_f16_4},
     {values_bf16_1, values_bf16_2, values_bf16_3, values_bf16_4},
     {values_q8_1, values_q8_2, values_q8_3, values_q8_4},
     {values_fp8_1, values_fp8_2, values_fp8_3, values_fp8_4}},
    {{values_chk_f32_1, values_chk_f32_2, values_chk_f32_3, values_chk_f32_4},
     {values_chk_f16_1, values_chk_f16_2, values_chk_f16_3, values_chk_f16_4},
     {values_chk_bf16_1, values_chk_bf16_2, values_chk_bf16_3, values_chk_bf16_4},
     {values_chk_q8_1, values_chk_q8_2, values_chk_q8_3, values_chk_q8_4},
     {values_chk_fp8_1, values_chk_fp8_2, values_chk_fp8_3, values_chk_fp8_4}}};

/* ---- Pass 2: score pipeline, mask, max, exp, sum --------------------------------------------- */

/* Lanes [0, n) of a row chunk (n <= 8; the other lanes read 0, nothing past n is read). */
MHA_INLINE v8 load_chunk(const float *p, int64_t n) {
    return n >= 8 ? v8_loadu(p) : v8_loadu_mask(v8_first((int)n), p);
}

/* Row r of the unit: scores S[0, nb) -> e = exp(s - m) (and 0 in [nb, nb rounded up to 8)),
 * *m = max of the visible scores (NaN if one is NaN, -inf if none), *l = sum e. */
static void softmax_row(const mha__dec_problem *p,
                        const mha__dec_unit *u,
                        int64_t r,
                        int64_t nb,
                        float *sr,
                        float *m,
                        float *l) {
    const int64_t L = p->cache->len[p->seq[u->s]];
    const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
    const int64_t pos = mha__dec_tree_pos(p, L, i);
    /* visible keys, relative to j0: [lo, hi], clamped to [0, nb - 1] (hi < lo: none), and with a
     * draft tree the lanes mha__dec_tree_lanes allows */
    int64_t hi = mha__dec_tree_last_key(p, L, pos) - u->j0, lo = mha__dec_first_key(p, pos) - u->j0;
    hi = hi > nb - 1 ? nb - 1 : hi < -1 ? -1 : hi;
    lo = lo < 0 ? 0 : lo > nb ? nb : lo;
    const v8 scale = v8_set1(p->scale), ninf = v8_set1(-INFINITY);
    const v8 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    v8 vmax = ninf;
    int nan_seen = 0;
    /* s = scale dot: with every key visible, no soft-cap, no ALiBi and scale > 0, the max of s is
     * scale times the max of the dot products (rounding is monotonic), and the scores need not be
     * stored twice. NaN dot products are the NaN scores. */
    const int plain = lo == 0 && hi == nb - 1 && !(p->softcap > 0.0f) && !p->slopes &&
                      p->scale > 0.0f && !p->tree_vis;
    if (plain) {
        v8 nan = v8_zero();
        for (int64_t jj = 0; jj < nb; jj += 8) {
            const int64_t n = nb - jj;
            v8 x = load_chunk(sr + jj, n);
            if (n < 8) /* lanes past nb */
                x = _mm256_blendv_ps(ninf, x, _mm256_cmp_ps(iota, v8_set1((float)n), _CMP_LT_OQ));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            vmax = v8_max_nan_ignoring(x, vmax);
        }
        nan_seen = _mm256_movemask_ps(nan);
        vmax = v8_mul(scale, vmax);
    } else {
        const v8 vlo = v8_set1((float)lo), vhi = v8_set1((float)hi);
        const v8 cap = v8_set1(p->softcap);
        const v8 inv_cap = v8_set1(p->softcap > 0.0f ? 1.0f / p->softcap : 0.0f);
        const v8 vslope = v8_set1(p->slopes ? p->slopes[h] : 0.0f);
        const v8 vdist0 = v8_set1((float)(pos - u->j0)); /* pos - j = (pos - j0) - jrel */
        for (int64_t jj = 0; jj < nb; jj += 8) {
            const v8 jrel = v8_add(iota, v8_set1((float)jj));
            v8 vis = _mm256_and_ps(_mm256_cmp_ps(jrel, vlo, _CMP_GE_OQ),
                                   _mm256_cmp_ps(jrel, vhi, _CMP_LE_OQ));
            float shift[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (p->tree_vis) {
                const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
                const __m256i lanes = _mm256_set1_epi32(
                    (int)(mha__dec_tree_lanes(p, u->s, i, L, u->j0 + jj) & 0xFFu));
                vis = _mm256_and_ps(vis, _mm256_castsi256_ps(_mm256_cmpeq_epi32(
                                             _mm256_and_si256(lanes, bit), bit)));
                if (p->slopes)
                    mha__dec_tree_shift(p, L, u->j0 + jj, nb - jj < 8 ? nb - jj : 8, shift);
            }
            v8 s = v8_mul(scale, load_chunk(sr + jj, nb - jj));
            if (p->softcap > 0.0f)
                s = v8_mul(cap, v8_tanh(v8_mul(s, inv_cap)));
            if (p->slopes)
                s = _mm256_fnmadd_ps(vslope, v8_sub(vdist0, jrel), s);
            if (p->tree_vis && p->slopes) /* a draft key's position is not its slot */
                s = _mm256_fnmadd_ps(vslope, v8_loadu(shift), s);
            nan_seen |= _mm256_movemask_ps(_mm256_and_ps(vis, _mm256_cmp_ps(s, s, _CMP_UNORD_Q)));
            s = _mm256_blendv_ps(ninf, s, vis);
            _mm256_storeu_ps(sr + jj, s); /* lanes past nb (within the row's BLOCK floats): -inf */
            vmax = v8_max_nan_ignoring(s, vmax);
        }
    }
    /* NaN scores propagate: a NaN among the visible keys makes m NaN. */
    const float mr = nan_seen ? NAN : v8_hmax(vmax);
    *m = mr;
    if (mr == -INFINITY) {
        memset(sr, 0, sizeof(float) * (size_t)((nb + 7) & ~(int64_t)7));
        *l = 0.0f;
        return;
    }
    const v8 vm = v8_set1(mr);
    v8 vsum = v8_zero();
    for (int64_t jj = 0; jj < nb; jj += 8) { /* exp(-inf - m) = 0: hidden keys and lanes past nb */
        v8 e;
        if (plain) {
            const int64_t n = nb - jj;
            e = v8_exp_nonpos(v8_sub(v8_mul(scale, load_chunk(sr + jj, n)), vm));
            if (n < 8)
                e = _mm256_and_ps(e, _mm256_cmp_ps(iota, v8_set1((float)n), _CMP_LT_OQ));
        } else {
            e = v8_exp_nonpos(v8_sub(v8_loadu(sr + jj), vm));
        }
        _mm256_storeu_ps(sr + jj, e);
        vsum = v8_add(vsum, e);
    }
    *l = v8_hsum(vsum);
}

/* ---- Query and output rows ---- */

/* Even and odd elements of a (16 floats) as (a0, a2, ..., b0, b2, ...), (a1, a3, ..., b1, ...)
 * for a = elements 0..7, b = 8..15. */
MHA_INLINE void split_even_odd(v8 a, v8 b, v8 *even, v8 *odd) {
    /* per 128-bit half: [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit quarters ordered 0 2 1 3 */
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* One query row (dk floats at src) into the chunk-major copy: chunk c at dst + c cs, zero-padded
 * to a multiple of 8; bfloat16 in even/odd order per whole 16 (see load16). */
MHA_INLINE void
copy_q_row(const mha_dtype DT, const float *src, int64_t dk, float *dst, int64_t cs) {
    int64_t d = 0;
    if (DT == MHA_DTYPE_BF16)
        for (; d + 16 <= dk; d += 16, dst += 2 * cs) {
            v8 even, odd;
            split_even_odd(v8_loadu(src + d), v8_loadu(src + d + 8), &even, &odd);
            v8_store(dst, even);
            v8_store(dst + cs, odd);
        }
    for (; d + 8 <= dk; d += 8, dst += cs)
        v8_store(dst, v8_loadu(src + d));
    if (d < dk)
        v8_store(dst, v8_loadu_mask(v8_first((int)(dk - d)), src + d));
}

/* One row of o (dv floats at dst) from the padded accumulator row: bfloat16's whole 16-column
 * groups from even/odd back to natural order (the inverse of split_even_odd). */
MHA_INLINE void store_o_row(const mha_dtype DT, const float *acc, int64_t dv, float *dst) {
    int64_t d = 0;
    if (DT == MHA_DTYPE_BF16)
        for (; d + 16 <= dv; d += 16) {
            const v8 even = v8_load(acc + d), odd = v8_load(acc + d + 8);
            /* [e0 o0 e1 o1 | e4 o4 e5 o5], [e2 o2 e3 o3 | e6 o6 e7 o7] */
            const v8 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
            _mm256_storeu_ps(dst + d, _mm256_permute2f128_ps(lo, hi, 0x20));
            _mm256_storeu_ps(dst + d + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
    for (; d + 8 <= dv; d += 8)
        _mm256_storeu_ps(dst + d, v8_load(acc + d));
    for (; d < dv; d++) /* a masked store is microcoded on AMD Zen */
        dst[d] = acc[d];
}

/* ---- The kernel ---- */

/* A run of consecutive cache rows of the unit: keys [y0, y0 + n) relative to j0, rows of key y0
 * at k and v (cache/kv_cache.h). */
typedef mha__kv_run key_run;

/* Bits y < nk of the result: e[y] != 0 (NaN counts: it must propagate). */
MHA_INLINE uint64_t seen_bits(const float *e, int64_t nk) {
    uint64_t bits = 0;
    for (int64_t y = 0; y < nk; y += 8) {
        const int64_t n = nk - y < 8 ? nk - y : 8;
        const v8 x = n == 8 ? v8_loadu(e + y) : v8_loadu_mask(v8_first((int)n), e + y);
        const uint32_t b = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, v8_zero(), _CMP_NEQ_UQ));
        bits |= (uint64_t)(b & ((1u << n) - 1u)) << y;
    }
    return bits;
}

/* The span of n bytes at p (filling the L2 if l2), or the empty span. */
MHA_INLINE prefetch_span span(const char *p, size_t n, int l2) {
    const prefetch_span s = {p, n, NULL, 0, l2};
    return s;
}

/* The rows a unit reads, in order, as one stream of positions: its K rows (keys 0 .. nb-1), its
 * V rows (nb .. 2 nb - 1), then the first K rows of the next unit of its (sequence, kv head)
 * (2 nb .., next[0 .. nnext)). */
typedef struct unit_stream {
    const key_run *runs, *next;
    int nruns, nnext;
    int64_t nb;
    size_t rb, rbv;
} unit_stream;

/* The address of stream position y; *rows: the rows from it to the end of its run (0: past the
 * stream), *row_bytes: their size. */
MHA_INLINE const char *
stream_at(const unit_stream *us, int64_t y, int64_t *rows, size_t *row_bytes) {
    const int kpart = y < us->nb, vpart = !kpart && y < 2 * us->nb;
    const key_run *runs = kpart || vpart ? us->runs : us->next;
    const int nr = kpart || vpart ? us->nruns : us->nnext;
    const int64_t x = kpart ? y : vpart ? y - us->nb : y - 2 * us->nb;
    *row_bytes = vpart ? us->rbv : us->rb;
    for (int i = 0; i < nr; i++)
        if (x < runs[i].y0 + runs[i].n) {
            *rows = runs[i].y0 + runs[i].n - x;
            return (vpart ? runs[i].v : runs[i].k) + (size_t)(x - runs[i].y0) * *row_bytes;
        }
    *rows = 0;
    return NULL;
}

/* The prefetch of a block of n rows at stream position y: the n rows KB positions ahead, in at
 * most two runs (a third, only where a ring wraps into a run shorter than n, is left out), so
 * that the distance is KB rows whether the rows ahead are one run or blocks of a paged cache. */
MHA_INLINE prefetch_span
stream_span(const unit_stream *us, int64_t y, int64_t n, int64_t KB, int l2) {
    int64_t n0 = 0, n1 = 0;
    size_t b0 = 0, b1 = 0;
    const char *p0 = stream_at(us, y + KB, &n0, &b0);
    n0 = n0 < n ? n0 : n;
    prefetch_span pf = span(p0, (size_t)n0 * b0, l2);
    if (p0 && n0 < n) {
        pf.p1 = stream_at(us, y + KB + n0, &n1, &b1);
        pf.n1 = (size_t)(n1 < n - n0 ? n1 : n - n0) * b1;
    }
    return pf;
}

/* ---- The wide path: R > 4 query rows ----------------------------------------------------------
 * See the top ("The wide path"). Keys per block: MHA_DEC_WIDE_SUB; the row tiles below. */
#    define MHA_DEC_WIDE_SUB  16
/* Keys per block of pass 3 (V rows widened into scratch at once; the accumulators of a tile are
 * loaded and stored once per block). */
#    define MHA_DEC_WIDE_VSUB 32
/* Rows of o per register block of pass 3 (x 16 columns: 12 accumulators). */
#    define MHA_DEC_WIDE_ROWS 6

/* One pass-1 tile: st[y][8 v + lane] = sum_{d < dk} qt[d][8 v + lane] kp[y][d] for NV (1 or 2)
 * vectors of 8 rows (qt at the tile's first row, row stride rp) and NK keys (kp[y]: float32 rows
 * of >= dk), one FMA chain per score in increasing d. Each step d prefetches one line of the span
 * pf while *poff < pf's bytes. */
MHA_INLINE void wide_tile(const int NV,
                          const int NK,
                          const float *const *kp,
                          const float *qt,
                          int64_t rp,
                          int64_t dk,
                          float *st,
                          prefetch_span pf,
                          size_t *poff) {
    v8 acc[2][12];
    const size_t pn = pf.p ? pf.n + pf.n1 : 0;
    size_t off = *poff;
#    pragma GCC unroll 12
    for (int y = 0; y < NK; y++)
        for (int v = 0; v < NV; v++)
            acc[v][y] = v8_zero();
    for (int64_t d = 0; d < dk; d++, qt += rp) {
        if (off < pn) {
            prefetch_step(pf, off, 1);
            off += 64;
        }
        v8 q0 = v8_load(qt), q1 = NV > 1 ? v8_load(qt + 8) : q0;
        /* keeps q in registers (GCC would fold its loads into every FMA that uses it) */
        __asm__("" : "+x"(q0), "+x"(q1));
#    pragma GCC unroll 12
        for (int y = 0; y < NK; y++) {
            const v8 b = _mm256_broadcast_ss(kp[y] + d);
            acc[0][y] = v8_fma(q0, b, acc[0][y]);
            if (NV > 1)
                acc[1][y] = v8_fma(q1, b, acc[1][y]);
        }
    }
#    pragma GCC unroll 12
    for (int y = 0; y < NK; y++)
        for (int v = 0; v < NV; v++)
            v8_store(st + y * rp + 8 * v, acc[v][y]);
    *poff = off;
}

/* The tiles as small non-inlined functions (dtype-independent: K rows are float32 by then), so
 * the pointers they walk stay in registers. */
typedef void (*wide_tile_fn)(
    const float *const *, const float *, int64_t, int64_t, float *, prefetch_span, size_t *);
#    define WIDE_TILE_(nv, nk)                                                                     \
        static __attribute__((noinline)) void wide_tile_##nv##x##nk(                               \
            const float *const *kp, const float *qt, int64_t rp, int64_t dk, float *st,            \
            prefetch_span pf, size_t *poff) {                                                      \
            wide_tile(nv, nk, kp, qt, rp, dk, st, pf, poff);                                       \
        }
WIDE_TILE_(2, 6)
WIDE_TILE_(2, 4)
WIDE_TILE_(1, 8)
#    undef WIDE_TILE_

/* Pass 1 of the wide path over one block of nk <= MHA_DEC_WIDE_SUB keys (kp[y]: float32 K rows,
 * rows nk.. repeat row 0): S[r][y] = q_r . k_y for r < R, with qt [dk][rp] the unit's query rows
 * transposed and st [MHA_DEC_WIDE_SUB][rp] scratch. The block prefetches the span pf. */
MHA_INLINE void scores_wide(const float *const *kp,
                            int64_t nk,
                            const float *qt,
                            int64_t R,
                            int64_t rp,
                            int64_t dk,
                            float *S,
                            float *st,
                            prefetch_span pf) {
    const int64_t nv = rp / 8;
    size_t poff = 0;
    for (int64_t v = 0; v < nv; v += 2) {
        if (v + 1 < nv) { /* 16 rows: keys 6 + 6 + 4 */
            wide_tile_2x6(kp, qt + 8 * v, rp, dk, st + 8 * v, pf, &poff);
            wide_tile_2x6(kp + 6, qt + 8 * v, rp, dk, st + 6 * rp + 8 * v, pf, &poff);
            wide_tile_2x4(kp + 12, qt + 8 * v, rp, dk, st + 12 * rp + 8 * v, pf, &poff);
        } else { /* a last vector of 8 rows: keys 8 + 8 */
            wide_tile_1x8(kp, qt + 8 * v, rp, dk, st + 8 * v, pf, &poff);
            wide_tile_1x8(kp + 8, qt + 8 * v, rp, dk, st + 8 * rp + 8 * v, pf, &poff);
        }
    }
    if (pf.p) /* what the steps did not cover (short rows) */
        for (size_t off = poff; off < pf.n + pf.n1; off += 64)
            prefetch_step(pf, off, 1);
    /* st [16 keys][rp rows] -> S [row][key], 8 x 8 at a time (keys past nk are not stored: a
     * block need not start at a multiple of 8, and S's rows are MHA_DEC_BLOCK floats) */
    for (int64_t v = 0; v < nv; v++)
        for (int64_t y0 = 0; y0 < nk; y0 += 8) {
            v8 t[8];
            for (int y = 0; y < 8; y++)
                t[y] = v8_load(st + (y0 + y) * rp + 8 * v);
            gemm_transpose8x8(t);
            const __m256i k = v8_first(nk - y0 < 8 ? (int)(nk - y0) : 8);
            for (int64_t x = 0; x < 8 && 8 * v + x < R; x++) {
                if (nk - y0 >= 8)
                    _mm256_storeu_ps(S + (8 * v + x) * MHA_DEC_BLOCK + y0, t[x]);
                else
                    v8_storeu_mask(S + (8 * v + x) * MHA_DEC_BLOCK + y0, k, t[x]);
            }
        }
}

/* o_x[c0, c0 + 16) += sum_{y < nk} e_x[y] vp[y][c0, c0 + 16) for NR rows (o_x at o + x dv, e_x
 * at e + x BLOCK) over a block of float32 value rows (vp[y], >= c0 + 16 readable floats each),
 * keys in increasing order: the 2 NR accumulators stay in registers over the block. FULL: the 16
 * columns exist (else masks km). CHECK: a row whose bit y of seen[x] is clear (e_x[y] = 0) skips
 * key y (0 * inf would be NaN). Key y prefetches one line of pf while *poff < its bytes. */
MHA_INLINE void axpy_wide(const int NR,
                          const int FULL,
                          const int CHECK,
                          const float *const *vp,
                          int64_t nk,
                          const float *e,
                          float *o,
                          int64_t dv,
                          int64_t c0,
                          const __m256i *km,
                          const uint64_t *seen,
                          prefetch_span pf,
                          size_t *poff) {
    v8 acc[MHA_DEC_WIDE_ROWS][2];
    const size_t pn = pf.p ? pf.n + pf.n1 : 0;
    size_t off = *poff;
#    pragma GCC unroll 6
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 2; c++)
            acc[x][c] = FULL ? v8_loadu(o + x * dv + c0 + 8 * c)
                             : v8_loadu_mask(km[c], o + x * dv + c0 + 8 * c);
    for (int64_t y = 0; y < nk; y++) {
        if (off < pn) {
            prefetch_step(pf, off, 1);
            off += 64;
        }
        const v8 v0 = v8_loadu(vp[y] + c0), v1 = v8_loadu(vp[y] + c0 + 8);
#    pragma GCC unroll 6
        for (int x = 0; x < NR; x++) {
            if (CHECK && !(seen[x] >> y & 1u))
                continue;
            const v8 ev = _mm256_broadcast_ss(e + x * MHA_DEC_BLOCK + y);
            acc[x][0] = v8_fma(ev, v0, acc[x][0]);
            acc[x][1] = v8_fma(ev, v1, acc[x][1]);
        }
    }
#    pragma GCC unroll 6
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 2; c++) {
            if (FULL)
                _mm256_storeu_ps(o + x * dv + c0 + 8 * c, acc[x][c]);
            else
                v8_storeu_mask(o + x * dv + c0 + 8 * c, km[c], acc[x][c]);
        }
    *poff = off;
}

/* Non-inlined instances of axpy_wide, [rows - 1][full][check]. */
typedef void (*axpy_wide_fn)(const float *const *,
                             int64_t,
                             const float *,
                             float *,
                             int64_t,
                             int64_t,
                             const __m256i *,
                             const uint64_t *,
                             prefetch_span,
                             size_t *);
#    define AXPYW_(nr, full, check)                                                                \
        static __attribute__((noinline)) void axpy_wide_##nr##_##full##check(                      \
            const float *const *vp, int64_t nk, const float *e, float *o, int64_t dv, int64_t c0,  \
            const __m256i *km, const uint64_t *seen, prefetch_span pf, size_t *poff) {             \
            axpy_wide(nr, full, check, vp, nk, e, o, dv, c0, km, seen, pf, poff);                  \
        }
#    define AXPYW4_(nr) AXPYW_(nr, 0, 0) AXPYW_(nr, 0, 1) AXPYW_(nr, 1, 0) AXPYW_(nr, 1, 1)
AXPYW4_(1)
AXPYW4_(2)
AXPYW4_(3)
AXPYW4_(4)
AXPYW4_(5)
AXPYW4_(6)
#    undef AXPYW4_
#    undef AXPYW_
#    define AXPYW4_(nr)                                                                            \
        {                                                                                          \
            {axpy_wide_##nr##_00, axpy_wide_##nr##_01}, {                                          \
                axpy_wide_##nr##_10, axpy_wide_##nr##_11                                           \
            }                                                                                      \
        }
static const axpy_wide_fn axpy_wide_table[MHA_DEC_WIDE_ROWS][2][2] = {
    AXPYW4_(1), AXPYW4_(2), AXPYW4_(3), AXPYW4_(4), AXPYW4_(5), AXPYW4_(6)};
#    undef AXPYW4_

/* Pass 3 of the wide path over one block of nk <= MHA_DEC_WIDE_VSUB keys (vp[y]: float32 V rows
 * of dv rounded up to 16 readable floats, zero-padded): o_r += sum_y e_r[y] vp[y] for r < R (o
 * [R][dv], e_r at e + r BLOCK). The block prefetches the span pf. */
MHA_INLINE void values_wide(const float *const *vp,
                            int64_t nk,
                            const float *e,
                            int64_t R,
                            float *o,
                            int64_t dv,
                            prefetch_span pf) {
    const uint64_t in = nk >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << nk) - 1u;
    size_t poff = 0;
    for (int64_t r0 = 0; r0 < R; r0 += MHA_DEC_WIDE_ROWS) {
        const int64_t nr = R - r0 < MHA_DEC_WIDE_ROWS ? R - r0 : MHA_DEC_WIDE_ROWS;
        const float *er = e + r0 * MHA_DEC_BLOCK;
        float *orow = o + r0 * dv;
        /* which keys each row sees (e != 0; NaN counts as seen) */
        uint64_t seen[MHA_DEC_WIDE_ROWS] = {0, 0, 0, 0, 0, 0}, all = in;
        for (int64_t x = 0; x < nr; x++) {
            seen[x] = seen_bits(er + x * MHA_DEC_BLOCK, nk);
            all &= seen[x];
        }
        const int check = all != in;
        for (int64_t c0 = 0; c0 < dv; c0 += 16) {
            const int full = c0 + 16 <= dv;
            const int64_t n0 = dv - c0 < 8 ? dv - c0 : 8, n1 = dv - c0 - 8;
            const __m256i km[2] = {v8_first((int)n0), v8_first(n1 < 0 ? 0 : n1 > 8 ? 8 : (int)n1)};
            axpy_wide_table[nr - 1][full][check](vp, nk, er, orow, dv, c0, km, seen, pf, &poff);
        }
    }
    if (pf.p) /* what the steps did not cover */
        for (size_t off = poff; off < pf.n + pf.n1; off += 64)
            prefetch_step(pf, off, 1);
}

/* The wide path for cache dtype DT: the unit's passes 1 to 3 (o, m, l as dec_kernel's). */
MHA_INLINE void dec_wide(const mha_dtype DT,
                         const mha__dec_problem *p,
                         const mha__dec_unit *u,
                         const unit_stream *us,
                         float *o,
                         float *m,
                         float *l,
                         float *scratch) {
    const int64_t R = p->group * p->t, nb = u->j1 - u->j0, dk = p->dk, dv = p->dv;
    const int64_t rp = (R + 7) & ~(int64_t)7, dk8 = ((dk + 7) & ~(int64_t)7) + 8;
    const int64_t dv16 = (dv + 15) & ~(int64_t)15;
    const int l2 = p->prefetch_l2;
    /* scratch: S [R][BLOCK], qt [dk][rp], st [16][rp], kw [16][dk8], vw [64][dv16] (within
     * mha__dec_scratch_floats' wide part) */
    float *S = scratch, *qt = S + R * MHA_DEC_BLOCK, *st = qt + dk * rp;
    float *kw = st + MHA_DEC_WIDE_SUB * rp, *vw = kw + MHA_DEC_WIDE_SUB * dk8;

    /* The query rows transposed, 8 rows x 8 elements at a time; rows R .. rp - 1 are zero. */
    for (int64_t r0 = 0; r0 < rp; r0 += 8) {
        const float *src[8];
        for (int64_t x = 0; x < 8; x++) {
            const int64_t r = r0 + x, i = r / p->group, h = u->g * p->group + r % p->group;
            src[x] = r < R ? p->q + u->s * p->q_ss + i * p->q_ts + h * dk : NULL;
        }
        for (int64_t d0 = 0; d0 < dk; d0 += 8) {
            const __m256i k = v8_first(dk - d0 < 8 ? (int)(dk - d0) : 8);
            v8 t[8];
            for (int x = 0; x < 8; x++)
                t[x] = src[x] ? v8_loadu_mask(k, src[x] + d0) : v8_zero();
            gemm_transpose8x8(t);
            for (int64_t y = 0; y < 8 && d0 + y < dk; y++)
                v8_store(qt + (d0 + y) * rp + r0, t[y]);
        }
    }

    /* Pass 1, per block of up to 16 keys within a run: K rows as float32 (float32 in place, the
     * others widened once into kw), then the tiles. Each block prefetches as many rows 16 keys
     * ahead (K, then V rows). */
    for (int ri = 0; ri < us->nruns; ri++) {
        const key_run *kr = &us->runs[ri];
        for (int64_t yb = 0; yb < kr->n; yb += MHA_DEC_WIDE_SUB) {
            const int64_t nk = kr->n - yb < MHA_DEC_WIDE_SUB ? kr->n - yb : MHA_DEC_WIDE_SUB;
            const prefetch_span pf = stream_span(us, kr->y0 + yb, nk, MHA_DEC_WIDE_SUB, l2);
            const float *kp[MHA_DEC_WIDE_SUB];
            for (int64_t y = 0; y < MHA_DEC_WIDE_SUB; y++) {
                const char *row = kr->k + (size_t)(yb + (y < nk ? y : 0)) * us->rb;
                if (DT == MHA_DTYPE_F32) {
                    kp[y] = (const float *)(const void *)row;
                    continue;
                }
                kp[y] = kw + (y < nk ? y : 0) * dk8;
                if (y < nk)
                    for (int64_t d = 0; d < dk; d += 8)
                        v8_store(kw + y * dk8 + d,
                                 dk - d >= 8 ? load8(DT, row, d) : load_part8(DT, row, d, dk - d));
            }
            scores_wide(kp, nk, qt, R, rp, dk, S + kr->y0 + yb, st, pf);
        }
    }

    /* Pass 2, per row. */
    for (int64_t r = 0; r < R; r++)
        softmax_row(p, u, r, nb, S + r * MHA_DEC_BLOCK, &m[r], &l[r]);

    /* Pass 3, per block of up to 64 keys: V rows as float32 (float32 with dv % 16 == 0 in place,
     * else widened once into vw, zero-padded to dv16), o accumulated in place. Each block
     * prefetches as many rows 64 keys ahead (V, then the next unit's K rows). */
    memset(o, 0, sizeof(float) * (size_t)(R * dv));
    const int inplace = DT == MHA_DTYPE_F32 && dv % 16 == 0;
    for (int ri = 0; ri < us->nruns; ri++) {
        const key_run *kr = &us->runs[ri];
        for (int64_t yb = 0; yb < kr->n; yb += MHA_DEC_WIDE_VSUB) {
            const int64_t nk = kr->n - yb < MHA_DEC_WIDE_VSUB ? kr->n - yb : MHA_DEC_WIDE_VSUB;
            const prefetch_span pf = stream_span(us, nb + kr->y0 + yb, nk, MHA_DEC_WIDE_VSUB, l2);
            const float *vp[MHA_DEC_WIDE_VSUB];
            for (int64_t y = 0; y < nk; y++) {
                const char *row = kr->v + (size_t)(yb + y) * us->rbv;
                if (inplace) {
                    vp[y] = (const float *)(const void *)row;
                    continue;
                }
                vp[y] = vw + y * dv16;
                for (int64_t d = 0; d < dv16; d += 8)
                    v8_store(vw + y * dv16 + d, dv - d >= 8 ? load8(DT, row, d)
                                                : d < dv    ? load_part8(DT, row, d, dv - d)
                                                            : v8_zero());
            }
            values_wide(vp, nk, S + kr->y0 + yb, R, o, dv, pf);
        }
    }
    if (DT == MHA_DTYPE_FP8_E4M3)
        mha__kv_fp8_scale_o(p->cache, u->g, o, R, dv);
}

/* The kernel for cache dtype DT (a constant after inlining). */
MHA_INLINE void dec_kernel(const mha_dtype DT,
                           const mha__dec_problem *p,
                           const mha__dec_unit *u,
                           float *o,
                           float *m,
                           float *l,
                           float *scratch) {
    mha__dec_problem fp8p; /* fp8: the scores' scale times 2^8 k_scale (kv_cache.h) */
    if (DT == MHA_DTYPE_FP8_E4M3)
        p = mha__kv_fp8_problem(p, u->g, &fp8p);
    const struct mha_kv_cache *c = p->cache;
    const int64_t R = p->group * p->t, nb = u->j1 - u->j0, dk = p->dk, dv = p->dv;
    const int64_t seq = p->seq[u->s], L = c->len[seq];
    const int64_t dvp = (dv + 7) & ~(int64_t)7;
    const int dti = DT == MHA_DTYPE_F16        ? 1
                    : DT == MHA_DTYPE_BF16     ? 2
                    : DT == MHA_DTYPE_Q8_0     ? 3
                    : DT == MHA_DTYPE_FP8_E4M3 ? 4
                                               : 0;
    float *S = scratch, *W = S + R * MHA_DEC_BLOCK;
    const size_t rb = c->k_row_bytes, rbv = c->v_row_bytes;
    const int l2 = p->prefetch_l2;
    const int64_t KB = DEC_KB(DT);

    /* The unit's keys as runs of consecutive cache rows (cache/kv_cache.h): one, or two when it
     * wraps in a ring buffer, or one per block of a paged cache. */
    key_run runs[MHA__KV_MAX_RUNS];
    const int nruns = mha__kv_runs(c, seq, u->g, u->j0, nb, runs);

    /* The next unit of this (sequence, kv head), if there is one: its first K rows (up to KB)
     * end the unit's prefetch stream. */
    key_run next[MHA__KV_MAX_RUNS];
    const int nnext =
        u->j1 < L ? mha__kv_runs(c, seq, u->g, u->j1, L - u->j1 < KB ? L - u->j1 : KB, next) : 0;
    const unit_stream us = {runs, next, nruns, nnext, nb, rb, rbv};
    if (R > DEC_WIDE_MIN_ROWS(DT)) { /* the wide path (see the top) */
        dec_wide(DT, p, u, &us, o, m, l, scratch);
        return;
    }

    /* The unit's query rows, copied once, chunk-major (see the top): row r = i * group + gh is
     * query head g * group + gh of token i; zero-padded to dkp; bfloat16 in even/odd order. */
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
        copy_q_row(DT, p->q + u->s * p->q_ss + i * p->q_ts + h * dk, dk, W + 8 * r, 8 * R);
    }

    /* Pass 1: scores, per block of up to KB keys (within a run), for each group of up to 4 query
     * rows. Each block prefetches as many rows KB keys ahead (K, then V rows). */
    for (int ri = 0; ri < nruns; ri++) {
        const key_run *kr = &runs[ri];
        for (int64_t yb = 0; yb < kr->n; yb += KB) {
            const int64_t nk = kr->n - yb < KB ? kr->n - yb : KB;
            const prefetch_span pf = stream_span(&us, kr->y0 + yb, nk, KB, l2);
            for (int64_t r0 = 0; r0 < R; r0 += 4) {
                const int64_t nr = R - r0 < 4 ? R - r0 : 4;
                scores_table[dti][nr - 1](kr->k + (size_t)yb * rb, rb, nk, W + r0 * 8, R * 8, dk,
                                          S + r0 * MHA_DEC_BLOCK + kr->y0 + yb,
                                          r0 == 0 ? pf : span(NULL, 0, 0));
            }
        }
    }

    /* Pass 2, per row. */
    for (int64_t r = 0; r < R; r++)
        softmax_row(p, u, r, nb, S + r * MHA_DEC_BLOCK, &m[r], &l[r]);

    /* Pass 3: o_r += e_rj v_j over blocks of KB value rows, o [R][dvp] in W (q is done); each
     * block prefetches as many rows KB keys ahead (V, then the next unit's K rows). */
    memset(W, 0, sizeof(float) * (size_t)(R * dvp));
    for (int ri = 0; ri < nruns; ri++) {
        const key_run *kr = &runs[ri];
        for (int64_t yb = 0; yb < kr->n; yb += KB) {
            const int64_t nk = kr->n - yb < KB ? kr->n - yb : KB;
            const prefetch_span pf = stream_span(&us, nb + kr->y0 + yb, nk, KB, l2);
            const int64_t y = kr->y0 + yb;
            for (int64_t r0 = 0; r0 < R; r0 += 4) {
                const int64_t nr = R - r0 < 4 ? R - r0 : 4;
                /* which keys of the block each row sees; a block all rows see fully skips the
                 * per-key test */
                uint64_t seen[4] = {0, 0, 0, 0},
                         all = nk >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << nk) - 1u;
                const uint64_t full = all;
                for (int64_t x = 0; x < nr; x++) {
                    seen[x] = seen_bits(S + (r0 + x) * MHA_DEC_BLOCK + y, nk);
                    all &= seen[x];
                }
                values_table[all != full][dti][nr - 1](
                    kr->v + (size_t)yb * rbv, rbv, nk, S + r0 * MHA_DEC_BLOCK + y, seen,
                    W + r0 * dvp, dvp, dv, r0 == 0 ? pf : span(NULL, 0, 0));
            }
        }
    }

    /* The unit's o, bfloat16's 16-column groups back in natural order. */
    for (int64_t r = 0; r < R; r++)
        store_o_row(DT, W + r * dvp, dv, o + r * dv);
    if (DT == MHA_DTYPE_FP8_E4M3)
        mha__kv_fp8_scale_o(c, u->g, o, R, dv);
}

void mha_decode_f32acc_splitkv__avx2(const mha__dec_problem *p,
                                     const mha__dec_unit *u,
                                     float *o,
                                     float *m,
                                     float *l,
                                     float *scratch) {
    switch (p->cache->cfg.dtype) {
    case MHA_DTYPE_F16:
        dec_kernel(MHA_DTYPE_F16, p, u, o, m, l, scratch);
        break;
    case MHA_DTYPE_BF16:
        dec_kernel(MHA_DTYPE_BF16, p, u, o, m, l, scratch);
        break;
    case MHA_DTYPE_Q8_0:
        dec_kernel(MHA_DTYPE_Q8_0, p, u, o, m, l, scratch);
        break;
    case MHA_DTYPE_FP8_E4M3:
        dec_kernel(MHA_DTYPE_FP8_E4M3, p, u, o, m, l, scratch);
        break;
    default:
        dec_kernel(MHA_DTYPE_F32, p, u, o, m, l, scratch);
        break;
    }
}

#endif

/* SPDX-License-Identifier: MIT */
/* decode_avx512.c: the split-KV decode kernel (flash-decoding) with AVX-512F/BW/VL intrinsics.
 *
 * Same unit and contract as decode_generic.c: keys [j0, j1) of kv head g of one sequence, for all
 * R = group * t query rows that share it, producing an unnormalised (o, m, l) per row. K and V
 * rows are read straight from the cache and widened in registers (float16 with VCVTPH2PS,
 * bfloat16 by a 16-bit left shift), in blocks of MHA_DEC_SUB keys:
 *   pass 1: scores, 4 keys x up to 4 query rows of accumulators per sweep of the keys' vectors,
 *           one 4-way horizontal sum per row; then, vectorised over the unit: scale, soft-cap
 *           (vector tanh), ALiBi, causal / window mask
 *   pass 2: m = max, e = exp(s - m) (vector exp of simd_avx512.h, 0.06 ULP), l = sum e
 *   pass 3: o += e_j v_j, up to 4 rows x 64 columns of o held in registers over a block of keys
 * For groups of <= 4 query rows (t = 1, g <= 4 heads per kv head) every K/V element is loaded and
 * widened exactly once. Units whose rows are consecutive in the cache (all but the one that wraps
 * in a windowed ring buffer) with head sizes dk % 16 == 0 (bfloat16: 32) and dv % 64 == 0 and
 * <= 4 query rows take the contiguous path (below): the same passes with simpler addressing. The
 * kernel body is instantiated per cache dtype (a constant in the hot loops) and with plain loads
 * when the head sizes are multiples of 16 (masked loads cost the hot loops ~20%). Widening a block
 * into float32 scratch first was measured slower for g <= 4: the extra store and reload cost more
 * than the widening they save. Units with R > 4 query rows (16- and 8-bit caches: R > 8) (t > 1
 * tokens, draft trees) take the wide path (below, "The wide path"): scores computed transposed by
 * broadcast-K FMAs against the query rows held transposed, K and V widened once per block into
 * float32 scratch, no horizontal sums; it replaced groups of 4 rows that each re-read and
 * re-widened the unit (34-44% of the FMA floor on an 8-draft tree). The float32 sums are in a fixed
 * order that does not depend on threads (bit-identical for any thread count); they differ in
 * rounding from the generic kernel's order (tolerance-tested). q8_0 on the contiguous path
 * (session 42, Intel Xeon): the block scales are widened 16 at a time (q8_widen16) and
 * broadcast from memory, and pass 3 multiplies e by the scale once per (row, key, block) instead
 * of every widened value (values_contig): ~100 -> ~92 cycles per key and kv head there.
 */
#include "kernels/registry.h"
#include "kernels/x86/decode_scores_avx512.h"
#include "kernels/x86/simd_avx512.h"

#include <string.h>

/* Elements [d, d+16) of a cache row of type DT as float32; lanes outside mask k read 0. FULL and
 * DT are compile-time constants at every call: FULL says k is all ones (then the load is a plain
 * one). */
MHA_INLINE v16
load_row16(const mha_dtype DT, const int FULL, const void *row, int64_t d, __mmask16 k) {
    if (DT == MHA_DTYPE_FP8_E4M3)
        return v16_fp8_widen(FULL ? _mm_loadu_si128((const __m128i *)((const char *)row + d))
                                  : _mm_maskz_loadu_epi8(k, (const char *)row + d));
    if (DT == MHA_DTYPE_Q8_0) /* rows are whole blocks: a vector is all in or all out */
        return FULL || k ? v16_q8_widen(row, d, v16_q8_scale(row, d)) : v16_zero();
    if (DT == MHA_DTYPE_F32)
        return FULL ? _mm512_loadu_ps((const float *)row + d)
                    : _mm512_maskz_loadu_ps(k, (const float *)row + d);
    const __m256i h = FULL ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))
                           : _mm256_maskz_loadu_epi16(k, (const uint16_t *)row + d);
    if (DT == MHA_DTYPE_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Keys per block of rows (a unit has up to MHA_DEC_BLOCK keys). */
#define MHA_DEC_SUB 16

/* Software prefetch distance in keys. The K pass prefetches the K rows MHA_DEC_PREFETCH keys
 * ahead and, near its end, the first V rows; the V pass likewise the V rows ahead; each block's
 * prefetches are spread over its arithmetic (a burst of them fills the line-fill buffers and
 * stalls). The hardware prefetcher alone keeps too few misses in flight. The level they fill is
 * the CPU's (mha__cpu_prefetch_to_l2): the L1 on Intel, the L2 on AMD Zen 4, where filling the L1
 * ran this kernel at 55-75% of the speed (distances 64 and 128 measured no better there). */
#define MHA_DEC_PREFETCH 32

/* A second prefetch distance in keys, on the contiguous path when the problem asks for it
 * (mha__dec_problem.prefetch_far: AMD Zen 5, float32, float16 and bfloat16 caches, calls reading
 * more than the L3; decode.c far_prefetch): PREFETCHNTA of the rows MHA_DEC_PREFETCH_FAR keys
 * ahead, which MHA_DEC_PREFETCH's PREFETCHT0 of them then finds in the L1. More lines are in flight
 * than the near prefetch and the hardware prefetcher keep, which the blocks of a paged cache need
 * most (every block of B = 16 rows is a new stream for the hardware prefetcher). Zen 5, 1 thread,
 * 32768 keys, h 32 g 8 d 128, blocks of 16 in a shuffled pool, block-major pool (first trials):
 * paged / contiguous bfloat16 1.23 -> 1.10, float32 1.39 -> 1.24, the contiguous cache faster
 * too; far distances 16 and 32 gained less, 64-192 as much or a little less; PREFETCHT1 as the
 * far hint gained about half as much, PREFETCHT0 nothing. q8_0 ran no faster. float16
 * (VCVTPH2PS-bound) ran its contiguous cache 10-13% slower with it then (session 39); with
 * session 40's kernel one thread runs 0.97-1.03x and two threads ~1.1x faster (the batch of 32
 * sequences, and one of 32768 keys; docs/INFERENCE.md, session 41), so it takes it too. */
#define MHA_DEC_PREFETCH_FAR 48

MHA_INLINE void prefetch_far(const char *at) {
    _mm_prefetch(at, _MM_HINT_NTA);
}

/* Prefetches the line at `at` into the L2 (l2) or the L1. */
MHA_INLINE void prefetch_line(const char *at, int l2) {
    if (l2)
        _mm_prefetch(at, _MM_HINT_T1);
    else
        _mm_prefetch(at, _MM_HINT_T0);
}

/* Keys of the block starting at key j of a unit of nb keys (0 past the end). */
MHA_INLINE int64_t block_len(int64_t nb, int64_t j) {
    return j >= nb ? 0 : nb - j < MHA_DEC_SUB ? nb - j : MHA_DEC_SUB;
}

/* Cache rows of one unit (sequence, kv head, keys j0 .. j1-1): the address of each key's row,
 * looked up once per unit by mha__kv_unit_rows (cache/kv_cache.h: ring wrap and pages; a division
 * per row in the loops cost ~15% of the kernel). */
typedef struct row_stream {
    const char *const *rows; /* [nb]: row of unit key y */
    size_t row_bytes;
    int prefetch_l2; /* prefetches fill the L2 (see prefetch_line) */
} row_stream;

MHA_INLINE const void *stream_row(const row_stream *st, int64_t y0, int64_t x) {
    return st->rows[y0 + x];
}

/* Prefetches rows [x0, x1) (clipped to n) of the block whose first row is unit key y0. */
MHA_INLINE void prefetch_rows(const row_stream *st, int64_t y0, int64_t n, int64_t x0, int64_t x1) {
    for (int64_t x = x0; x < x1 && x < n; x++) {
        const char *row = stream_row(st, y0, x);
        for (size_t b = 0; b < st->row_bytes; b += 64)
            prefetch_line(row + b, st->prefetch_l2);
    }
}

/* Rows [0, MHA_DEC_SUB) of the block at unit key y0; rows n.. repeat row 0, so callers may read a
 * full group of four. */
MHA_INLINE void
block_rows(const row_stream *st, int64_t y0, int64_t n, const void *rows[MHA_DEC_SUB]) {
    for (int64_t x = 0; x < MHA_DEC_SUB; x++)
        rows[x] = stream_row(st, y0, x < n ? x : 0);
}

/* Stores the dot products of NR query rows with nk <= 4 keys: out[x * BLOCK + y] = the sum of
 * the 16 lanes of acc[x][y] (v16_hsum16, then rows to 128-bit blocks: block x = row x's keys). */
MHA_INLINE void store_scores4(const int NR, v16 acc[4][4], int64_t nk, float *out) {
    const __m512i rows = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const v16 s = _mm512_permutexvar_ps(rows, v16_hsum16(NR, (const v16(*)[4])acc));
    const __mmask8 keys = (__mmask8)((1u << nk) - 1u);
    _mm_mask_storeu_ps(out, keys, _mm512_castps512_ps128(s));
    if (NR > 1)
        _mm_mask_storeu_ps(out + MHA_DEC_BLOCK, keys, _mm512_extractf32x4_ps(s, 1));
    if (NR > 2)
        _mm_mask_storeu_ps(out + 2 * MHA_DEC_BLOCK, keys, _mm512_extractf32x4_ps(s, 2));
    if (NR > 3)
        _mm_mask_storeu_ps(out + 3 * MHA_DEC_BLOCK, keys, _mm512_extractf32x4_ps(s, 3));
}

/* acc[x][c] += e_x[y] v[c] for NR rows (e_x at e + x * BLOCK). With check set, a row whose bit y
 * of seen[x] is clear (it does not see key y) skips it: 0 * inf would be NaN. */
MHA_INLINE void add_value_row(const int NR,
                              int check,
                              const __mmask16 seen[4],
                              int64_t y,
                              const float *e,
                              const v16 v[4],
                              v16 acc[4][4]) {
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++) {
        if (check && !(seen[x] >> y & 1))
            continue;
        const v16 ev = v16_set1(e[x * MHA_DEC_BLOCK + y]);
        for (int c = 0; c < 4; c++)
            acc[x][c] = v16_fma(ev, v[c], acc[x][c]);
    }
}

/* Scores of NR query rows (q[0..NR), float32, zero-padded) against four keys (kr[0..4), cache
 * rows of type DT): out[x * BLOCK + y] = q_x . k_y for y < nk. Inlined with constant NR, the
 * 4 x NR accumulators live in registers. */
MHA_INLINE void dots(const int NR,
                     const mha_dtype DT,
                     const int FULL,
                     const void *const kr[4],
                     const float *const q[4],
                     int64_t dk,
                     int64_t dkp,
                     __mmask16 ktail,
                     int64_t nk,
                     float *out) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        acc[x][0] = acc[x][1] = acc[x][2] = acc[x][3] = v16_zero();
    for (int64_t d = 0; d < dkp; d += 16) {
        const __mmask16 k = d + 16 <= dk ? (__mmask16)0xFFFF : ktail;
        const v16 k0 = load_row16(DT, FULL, kr[0], d, k), k1 = load_row16(DT, FULL, kr[1], d, k);
        const v16 k2 = load_row16(DT, FULL, kr[2], d, k), k3 = load_row16(DT, FULL, kr[3], d, k);
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            const v16 qv = _mm512_load_ps(q[x] + d);
            acc[x][0] = v16_fma(qv, k0, acc[x][0]);
            acc[x][1] = v16_fma(qv, k1, acc[x][1]);
            acc[x][2] = v16_fma(qv, k2, acc[x][2]);
            acc[x][3] = v16_fma(qv, k3, acc[x][3]);
        }
    }
    store_scores4(NR, acc, nk, out);
}

/* o_x[c0 + 0..64) += sum_{y < nk} e_x[y] v_y[c0 + 0..64) for NR accumulator rows (row stride dv,
 * e_x at e + x * BLOCK) over a block of value rows (cache rows of type DT): the NR x 4 accumulator
 * vectors stay in registers for the whole block. Row y of the block ahead (key pslot, pn rows) is
 * prefetched with key y. Bit y of seen[x] says e_x[y] != 0: a key adds nothing to a row that does
 * not see it, even when its v is not finite. Keys are added in order,
 * o_x = ((o_x + e0 v0) + e1 v1) + ..., so the sum does not depend on the block size. */
MHA_INLINE void axpy_block(const int NR,
                           const mha_dtype DT,
                           const int FULL,
                           const void *const vr[MHA_DEC_SUB],
                           int64_t nk,
                           const float *e,
                           float *o,
                           int64_t dv,
                           int64_t c0,
                           const __mmask16 km[4],
                           const __mmask16 seen[4],
                           const row_stream *pst,
                           int64_t pslot,
                           int64_t pn) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++)
            acc[x][c] = FULL ? _mm512_loadu_ps(o + x * dv + c0 + 16 * c)
                             : _mm512_maskz_loadu_ps(km[c], o + x * dv + c0 + 16 * c);
    for (int64_t y = 0; y < nk; y++) {
        prefetch_rows(pst, pslot, pn, y, y + 1);
        const unsigned bit = 1u << y;
        unsigned any = 0, all = bit;
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            any |= seen[x];
            all &= seen[x];
        }
        if (!(any & bit))
            continue;
        v16 v[4];
        for (int c = 0; c < 4; c++)
            v[c] = load_row16(DT, FULL, vr[y], c0 + 16 * c, km[c]);
        add_value_row(NR, !all, seen, y, e, v, acc);
    }
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++) {
            if (FULL)
                _mm512_storeu_ps(o + x * dv + c0 + 16 * c, acc[x][c]);
            else
                _mm512_mask_storeu_ps(o + x * dv + c0 + 16 * c, km[c], acc[x][c]);
        }
}

/* ---- The contiguous path ---------------------------------------------------------------------
 * For the common case (a unit's keys in consecutive slots, i.e. no ring-buffer wrap inside it
 * (the rows themselves come from the unit's row table, so pages may split them),
 * dk % 16 == 0 (bfloat16: 32), dv % 64 == 0, R <= 4 query rows) the two memory passes run in small
 * non-inlined functions, one per (dtype, rows), so the few pointers they walk stay in registers
 * (inlined into the whole kernel, GCC spilled them to vector registers and reloaded them with
 * port-0 moves inside the FMA loop), and the prefetches are spread evenly: E lines (the bytes of
 * 16 elements of 4 rows) per step of 16 elements. Measured per key and kv head, float16, g = 8
 * (R = 4), medians of 5-7 interleaved runs: L2-resident 44-58 -> 38-41 ns, 32768-key cache
 * beyond the L3 80-89 -> 64-71 ns (a plain read of the same bytes: 51-60 ns); bfloat16
 * L2-resident with the even/odd widening 35 -> 28 ns. */

/* Elements [d, d + 16) of an fp8 row known to hold no NaN byte (fp8_has_nan). */
MHA_INLINE v16 fp8_finite(const char *row, int64_t d) {
    return v16_fp8_widen_finite(_mm_loadu_si128((const __m128i *)(row + d)));
}

/* q8_0 on the contiguous path (docs/INFERENCE.md, "q8_0 on the Intel Xeon", session 42). Per
 * scale, v16_q8_scale's VPINSRW, VCVTPH2PS xmm and VBROADCASTSS zmm take the two 512-bit ports of
 * an Intel core (Emerald Rapids), the FMAs' ports: with 4 scales per key and pass (d 128) they
 * cost ~27 cycles of ~100 per key and kv head. So the scales are widened 16 at a time into a
 * buffer, and the loops broadcast them from memory (a load, no vector ALU operation).
 * q8_pack4 packs four float16 scales into a 64-bit word in general registers (each loaded by its
 * row pointer plus one offset: the addressing mode does the sum), and q8_widen16 widens four
 * such words with one VCVTPH2PS. Through memory instead, the 32-byte load after 16 two-byte
 * stores misses the store forwarding and stalls each group (measured: no gain); the empty asm
 * keeps GCC from gathering them with VPINSRW. */
MHA_INLINE uint64_t
q8_pack4(const char *p0, const char *p1, const char *p2, const char *p3, int64_t off) {
    const char *const p[4] = {p0, p1, p2, p3};
    uint64_t w = 0;
    for (int i = 0; i < 4; i++) {
        uint16_t h;
        memcpy(&h, p[i] + off, 2);
        w |= (uint64_t)h << (16 * i);
    }
    __asm__("" : "+r"(w));
    return w;
}
/* out[4 j + i] = the float16 in bits [16 i, 16 i + 16) of w[j], as float32 */
MHA_INLINE void q8_widen16(const uint64_t w[4], float out[16]) {
    const __m128i lo = _mm_insert_epi64(_mm_cvtsi64_si128((long long)w[0]), (long long)w[1], 1);
    const __m128i hi = _mm_insert_epi64(_mm_cvtsi64_si128((long long)w[2]), (long long)w[3], 1);
    _mm512_storeu_ps(out,
                     _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1)));
}

/* The 16 int8 of elements [d, d + 16) of a q8_0 row (d % 16 == 0) as float32, exactly: the
 * values before their block's scale. */
MHA_INLINE v16 q8_ints(const char *row, int64_t d) {
    const char *q = row + (d >> 5) * MHA__Q8_BYTES + 2 + (d & 31);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

/* Pass 1's q8_0 scales: sc[4 i + y] = row k[y]'s scale of block b + i, for rows of nblk blocks
 * (past the row's end: its first block's, never used). */
MHA_INLINE void q8_group_scales(const char *const k[4], int64_t b, int64_t nblk, float sc[16]) {
    uint64_t w[4];
    for (int i = 0; i < 4; i++)
        w[i] = q8_pack4(k[0], k[1], k[2], k[3], b + i < nblk ? (b + i) * MHA__Q8_BYTES : 0);
    q8_widen16(w, sc);
}

/* Pass 3's q8_0 scales: sc[16 i + y] = row rows[y]'s scale of block b + i (i < 2), for the
 * MHA_DEC_SUB rows of a block (rows y >= n: row 0's, never used). */
_Static_assert(MHA_DEC_SUB == 16, "q8_block_scales packs the scales of 16 rows");
MHA_INLINE void q8_block_scales(const char *const *rows, int64_t n, int64_t b, float sc[32]) {
#define ROW_(y) rows[(y) < n ? (y) : 0]
    for (int i = 0; i < 2; i++) {
        uint64_t w[4];
        for (int j = 0; j < 4; j++)
            w[j] = q8_pack4(ROW_(4 * j), ROW_(4 * j + 1), ROW_(4 * j + 2), ROW_(4 * j + 3),
                            (b + i) * MHA__Q8_BYTES);
        q8_widen16(w, sc + 16 * i);
    }
#undef ROW_
}

/* Pass 1 on the contiguous path: S[x][y] = q_x . k_y for the unit's nb keys (rows krows[y]).
 * qil holds the NR query rows chunk-major: elements [16 s, 16 s + 16) of row x at
 * qil + (s NR + x) 16, so every row is a constant offset from one pointer. The prefetch runs
 * MHA_DEC_PREFETCH keys ahead over the K rows, then over the first V rows (pass 3 reads them); a
 * group of four keys prefetches the bytes of four rows from the row of its key ahead on (four
 * consecutive rows unless a page boundary falls among them: a page of >= 16 rows starting at a
 * key that is not a multiple of 4 of the unit, in a wrapped ring only).
 * How many K rows one sweep over d reads in 64-byte steps, per group of four keys:
 *   float32: two, then the other two (each q vector loaded for 2 FMAs). With a cache beyond the
 *     L3, four interleaved rows ran a step 5-10% slower on AMD Zen 4 (1 thread; one row at a time
 *     was as fast as two, but loads q for every FMA). The AVX2 kernel reads two as well.
 *   float16 / bfloat16: four (each q vector loaded for 4 FMAs). They are bound by the arithmetic
 *     on one thread (4 flops per byte read, against 2 for float32), and one row at a time ran
 *     them 0.95-1.00x.
 * Either way each accumulator is one FMA chain over d in increasing order: the same sums. */
MHA_INLINE void scores_contig(const int NR,
                              const mha_dtype DT,
                              const int FAR,
                              const char *const *krows,
                              const char *const *vrows,
                              int64_t nb,
                              const float *qil,
                              int64_t dk,
                              float *S,
                              int l2) {
    /* elements per step of a row (bfloat16: one load; q8_0: one block, its scale loaded once),
     * and the lines prefetched / bytes advanced per step (4 rows of STEP elements; q8_0's
     * 136 bytes take 3 lines so that the steps' lines cover the stream) */
    const int STEP = DT == MHA_DTYPE_BF16 || DT == MHA_DTYPE_Q8_0 ? 32 : 16;
    const int PL = DT == MHA_DTYPE_Q8_0       ? 3
                   : DT == MHA_DTYPE_BF16     ? 4
                   : DT == MHA_DTYPE_FP8_E4M3 ? 1
                                              : 2;
    const int PB = DT == MHA_DTYPE_Q8_0 ? 4 * MHA__Q8_BYTES : 64 * PL;
    for (int64_t y0 = 0; y0 < nb; y0 += 4) {
        const int64_t nk = nb - y0 < 4 ? nb - y0 : 4;
        /* rows past the unit repeat its first row of the group (their scores are not stored) */
        const char *k0 = krows[y0];
        const char *k1 = nk > 1 ? krows[y0 + 1] : k0, *k2 = nk > 2 ? krows[y0 + 2] : k0,
                   *k3 = nk > 3 ? krows[y0 + 3] : k0;
        const int64_t ahead = y0 + MHA_DEC_PREFETCH;
        const char *pf = ahead < nb        ? krows[ahead]
                         : ahead - nb < nb ? vrows[ahead - nb]
                                           : vrows[nb - 1];
        /* the far prefetch (none past the unit's V rows) */
        const int64_t afar = y0 + MHA_DEC_PREFETCH_FAR;
        const char *pff = !FAR             ? NULL
                          : afar < nb      ? krows[afar]
                          : afar - nb < nb ? vrows[afar - nb]
                                           : NULL;
        /* fp8: the four rows hold no NaN byte (the usual case): widen without the fix-up */
        const int fin = DT == MHA_DTYPE_FP8_E4M3 && !fp8_has_nan(k0, dk) && !fp8_has_nan(k1, dk) &&
                        !fp8_has_nan(k2, dk) && !fp8_has_nan(k3, dk);
        const char *const kr4[4] = {k0, k1, k2, k3};
        float sc[16]; /* q8_0: see q8_group_scales */
        v16 acc[4][4];
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++)
            acc[x][0] = acc[x][1] = acc[x][2] = acc[x][3] = v16_zero();
        if (DT == MHA_DTYPE_F32) { /* two keys at a time (see the comment above) */
            const char *kr[4] = {k0, k1, k2, k3};
#pragma GCC unroll 2
            for (int y = 0; y < 4; y += 2) {
                const float *q = qil;
                for (int64_t d = 0; d < dk; d += 16, q += 16 * NR, pf += 128) {
                    prefetch_line(pf, l2);
                    prefetch_line(pf + 64, l2);
                    if (pff) {
                        prefetch_far(pff);
                        prefetch_far(pff + 64);
                        pff += 128;
                    }
                    const v16 ka = _mm512_loadu_ps((const float *)kr[y] + d),
                              kb = _mm512_loadu_ps((const float *)kr[y + 1] + d);
#pragma GCC unroll 4
                    for (int x = 0; x < NR; x++) {
                        const v16 qx = _mm512_load_ps(q + 16 * x);
                        acc[x][y] = v16_fma(qx, ka, acc[x][y]);
                        acc[x][y + 1] = v16_fma(qx, kb, acc[x][y + 1]);
                    }
                }
            }
            store_scores4(NR, acc, nk, S + y0);
            continue;
        }
        const float *q = qil;
        for (int64_t d = 0; d < dk; d += STEP, q += STEP * NR, pf += PB) {
#pragma GCC unroll 8
            for (int e = 0; e < PL; e++)
                prefetch_line(pf + 64 * e, l2);
            if (pff) {
#pragma GCC unroll 8
                for (int e = 0; e < PL; e++)
                    prefetch_far(pff + 64 * e);
                pff += PB;
            }
            v16 s0 = v16_zero(), s1 = s0, s2 = s0, s3 = s0; /* q8_0: the 4 rows' block scales */
            if (DT == MHA_DTYPE_Q8_0) {
                const int64_t b = d / 32;
                if (b % 4 == 0) /* the scales of blocks [b, b + 4) of the 4 rows: sc[4 i + y] */
                    q8_group_scales(kr4, b, dk / 32, sc);
                const float *sb = sc + 4 * (b % 4);
                s0 = v16_set1(sb[0]), s1 = v16_set1(sb[1]);
                s2 = v16_set1(sb[2]), s3 = v16_set1(sb[3]);
            }
#pragma GCC unroll 2
            for (int half = 0; half < STEP / 16; half++) {
                v16 c0, c1, c2, c3;
                if (DT == MHA_DTYPE_Q8_0) {
                    c0 = v16_q8_widen(k0, d + 16 * half, s0),
                    c1 = v16_q8_widen(k1, d + 16 * half, s1);
                    c2 = v16_q8_widen(k2, d + 16 * half, s2),
                    c3 = v16_q8_widen(k3, d + 16 * half, s3);
                } else if (DT == MHA_DTYPE_BF16) {
                    c0 = v16_bf16_half(k0, d, half), c1 = v16_bf16_half(k1, d, half);
                    c2 = v16_bf16_half(k2, d, half), c3 = v16_bf16_half(k3, d, half);
                } else if (fin) {
                    c0 = fp8_finite(k0, d), c1 = fp8_finite(k1, d);
                    c2 = fp8_finite(k2, d), c3 = fp8_finite(k3, d);
                } else {
                    c0 = load_row16(DT, 1, k0, d, 0xFFFF), c1 = load_row16(DT, 1, k1, d, 0xFFFF);
                    c2 = load_row16(DT, 1, k2, d, 0xFFFF), c3 = load_row16(DT, 1, k3, d, 0xFFFF);
                }
#pragma GCC unroll 4
                for (int x = 0; x < NR; x++) {
                    const v16 qv = _mm512_load_ps(q + 16 * (half * NR + x));
                    acc[x][0] = v16_fma(qv, c0, acc[x][0]);
                    acc[x][1] = v16_fma(qv, c1, acc[x][1]);
                    acc[x][2] = v16_fma(qv, c2, acc[x][2]);
                    acc[x][3] = v16_fma(qv, c3, acc[x][3]);
                }
            }
        }
        store_scores4(NR, acc, nk, S + y0);
    }
}

/* One block of pass 3 on the contiguous path, columns [c0, c0 + 64): o_x += sum_y e_x[y] v_y,
 * the NR x 4 accumulators in registers. CHECK (a constant) says some row does not see some key;
 * FAR (a constant): the far prefetch of pff[y] (may be NULL). */
MHA_INLINE void axpy_contig(const int NR,
                            const mha_dtype DT,
                            const int E,
                            const int CHECK,
                            const int FAR,
                            const int FIN,
                            const char *const *rows,
                            int64_t nkb,
                            const char *const pf[MHA_DEC_SUB],
                            const char *const pff[MHA_DEC_SUB],
                            int l2,
                            const float *e,
                            const __mmask16 seen[4],
                            float *o,
                            int64_t dv,
                            int64_t c0) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++)
            acc[x][c] = _mm512_loadu_ps(o + x * dv + 16 * c);
    /* q8_0: es[2 x + i][y] = e_x[y] d_yi, d_yi row y's scale of block c0 / 32 + i (see
     * values_contig) */
    float es[8][MHA_DEC_SUB];
    if (DT == MHA_DTYPE_Q8_0) {
        float sc[2 * MHA_DEC_SUB];
        q8_block_scales(rows, nkb, c0 / 32, sc);
        const __mmask16 in = v16_first((int)nkb);
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            const v16 ex = _mm512_maskz_loadu_ps(in, e + x * MHA_DEC_BLOCK);
            _mm512_storeu_ps(es[2 * x], _mm512_mul_ps(ex, _mm512_loadu_ps(sc)));
            _mm512_storeu_ps(es[2 * x + 1], _mm512_mul_ps(ex, _mm512_loadu_ps(sc + 16)));
        }
    }
    for (int64_t y = 0; y < nkb; y++) {
        const char *row = rows[y];
#pragma GCC unroll 4
        for (int l = 0; l < E; l++) /* q8_0: columns [c0, c0 + 64) are 2 blocks, 68 bytes */
            prefetch_line(
                pf[y] + (DT == MHA_DTYPE_Q8_0 ? c0 / 32 * MHA__Q8_BYTES : c0 * E) + 64 * l, l2);
        if (FAR && pff[y])
#pragma GCC unroll 4
            for (int l = 0; l < E; l++)
                prefetch_far(pff[y] + (DT == MHA_DTYPE_Q8_0 ? c0 / 32 * MHA__Q8_BYTES : c0 * E) +
                             64 * l);
        v16 v[4];
        if (DT == MHA_DTYPE_Q8_0) {
            for (int c = 0; c < 4; c++)
                v[c] = q8_ints(row, c0 + 16 * c);
#pragma GCC unroll 4
            for (int x = 0; x < NR; x++) {
                if (CHECK && !(seen[x] >> y & 1))
                    continue;
                for (int c = 0; c < 4; c++)
                    acc[x][c] = v16_fma(v16_set1(es[2 * x + c / 2][y]), v[c], acc[x][c]);
            }
            continue;
        } else if (DT == MHA_DTYPE_FP8_E4M3)
            for (int c = 0; c < 4; c++)
                v[c] = v16_fp8_half(FIN, row, c0 + 32 * (c >> 1), c & 1);
        else
            for (int c = 0; c < 4; c++)
                v[c] = DT == MHA_DTYPE_BF16 ? v16_bf16_half(row, c0 + 32 * (c >> 1), c & 1)
                                            : load_row16(DT, 1, row, c0 + 16 * c, 0xFFFF);
        add_value_row(NR, CHECK, seen, y, e, v, acc);
    }
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(o + x * dv + 16 * c, acc[x][c]);
}

/* Pass 3 on the contiguous path: o_x += sum_y e_x[y] v_y (rows vrows[y]), blocks of
 * MHA_DEC_SUB keys, NR x 64 columns of o in registers per block (as axpy_block). q8_0
 * (v = d q per block, q int8): o_x += (e_x[y] d) q, the product e_x[y] d rounded to float32 once
 * per (row, key, block) by one VMULPS per 16 keys, instead of d q (exact) by one VMULPS per 16
 * elements; the sum therefore rounds differently from axpy_block's (within TOL_OUT_REL of the
 * float64 attention over the dequantized values, as every path), so a unit that wraps its ring
 * differs from the contiguous one in the last bits. The prefetch
 * runs MHA_DEC_PREFETCH keys ahead over the V rows, then over the next unit's first K rows
 * (knext[0 .. MHA_DEC_PREFETCH_FAR), NULL entries where there is none); with far, a second one
 * MHA_DEC_PREFETCH_FAR keys ahead. */
MHA_INLINE void values_contig(const int NR,
                              const mha_dtype DT,
                              const int FAR,
                              const char *const *vrows,
                              const char *const *knext,
                              int64_t nb,
                              const float *S,
                              float *o,
                              int64_t dv,
                              int l2) {
    /* lines per 64 columns of a row (q8_0: 68 bytes) */
    const int E = DT == MHA_DTYPE_F32 ? 4 : DT == MHA_DTYPE_FP8_E4M3 ? 1 : 2;
    for (int64_t jb = 0; jb < nb; jb += MHA_DEC_SUB) {
        const int64_t nkb = block_len(nb, jb);
        const __mmask16 in = v16_first((int)nkb);
        const float *e = S + jb;
        /* which keys each row sees (e != 0; NaN counts as seen): a row skips a key it does not
         * see, even when that key's v is not finite (0 * inf would be NaN) */
        __mmask16 seen[4], all = in;
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            seen[x] = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(in, e + x * MHA_DEC_BLOCK),
                                         v16_zero(), _CMP_NEQ_UQ);
            all &= seen[x];
        }
        /* the row each key of the block prefetches (a row already read when there is none) */
        const char *pf[MHA_DEC_SUB];
        for (int64_t y = 0; y < nkb; y++) {
            const int64_t ahead = jb + y + MHA_DEC_PREFETCH;
            pf[y] = ahead < nb                  ? vrows[ahead]
                    : knext[ahead - nb] != NULL ? knext[ahead - nb]
                                                : vrows[0];
        }
        const char *pff[MHA_DEC_SUB];
        for (int64_t y = 0; y < nkb; y++) {
            const int64_t afar = jb + y + MHA_DEC_PREFETCH_FAR;
            pff[y] = !FAR ? NULL : afar < nb ? vrows[afar] : knext[afar - nb];
        }
        const char *const *rows = vrows + jb;
        /* fp8: no row of the block holds a NaN byte (the usual case): widen without the fix-up */
        int fin = DT == MHA_DTYPE_FP8_E4M3;
        if (fin)
            for (int64_t y = 0; y < nkb; y++)
                fin &= !fp8_has_nan(rows[y], dv);
        for (int64_t c0 = 0; c0 < dv; c0 += 64) {
            if (fin && all == in)
                axpy_contig(NR, DT, E, 0, FAR, 1, rows, nkb, pf, pff, l2, e, seen, o + c0, dv, c0);
            else if (fin)
                axpy_contig(NR, DT, E, 1, FAR, 1, rows, nkb, pf, pff, l2, e, seen, o + c0, dv, c0);
            else if (all == in)
                axpy_contig(NR, DT, E, 0, FAR, 0, rows, nkb, pf, pff, l2, e, seen, o + c0, dv, c0);
            else
                axpy_contig(NR, DT, E, 1, FAR, 0, rows, nkb, pf, pff, l2, e, seen, o + c0, dv, c0);
        }
    }
    if (DT == MHA_DTYPE_BF16 || DT == MHA_DTYPE_FP8_E4M3) {
        /* even/odd halves of each 32 columns back to natural order */
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi =
            _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        for (int x = 0; x < NR; x++)
            for (int64_t c = 0; c < dv; c += 32) {
                const v16 even = _mm512_loadu_ps(o + x * dv + c),
                          odd = _mm512_loadu_ps(o + x * dv + c + 16);
                _mm512_storeu_ps(o + x * dv + c, _mm512_permutex2var_ps(even, lo, odd));
                _mm512_storeu_ps(o + x * dv + c + 16, _mm512_permutex2var_ps(even, hi, odd));
            }
    }
}

typedef void (*scores_contig_fn)(
    const char *const *, const char *const *, int64_t, const float *, int64_t, float *, int);
typedef void (*values_contig_fn)(
    const char *const *, const char *const *, int64_t, const float *, float *, int64_t, int);

/* One non-inlined instance per (dtype, rows), and with the far prefetch (FAR, a constant) for
 * float32, float16 and bfloat16, the dtypes that take it (decode.c far_prefetch). */
#define CONTIG_FNS_(tag, dt, nr, far)                                                              \
    static __attribute__((noinline)) void scores_##tag##nr(                                        \
        const char *const *krows, const char *const *vrows, int64_t nb, const float *qil,          \
        int64_t dk, float *S, int l2) {                                                            \
        scores_contig(nr, dt, far, krows, vrows, nb, qil, dk, S, l2);                              \
    }                                                                                              \
    static __attribute__((noinline)) void values_##tag##nr(                                        \
        const char *const *vrows, const char *const *knext, int64_t nb, const float *S, float *o,  \
        int64_t dv, int l2) {                                                                      \
        values_contig(nr, dt, far, vrows, knext, nb, S, o, dv, l2);                                \
    }
#define CONTIG_DTYPE_(tag, dt, far)                                                                \
    CONTIG_FNS_(tag, dt, 1, far)                                                                   \
    CONTIG_FNS_(tag, dt, 2, far) CONTIG_FNS_(tag, dt, 3, far) CONTIG_FNS_(tag, dt, 4, far)
CONTIG_DTYPE_(f32_, MHA_DTYPE_F32, 0)
CONTIG_DTYPE_(f16_, MHA_DTYPE_F16, 0)
CONTIG_DTYPE_(bf16_, MHA_DTYPE_BF16, 0)
CONTIG_DTYPE_(q8_, MHA_DTYPE_Q8_0, 0)
CONTIG_DTYPE_(fp8_, MHA_DTYPE_FP8_E4M3, 0)
CONTIG_DTYPE_(far_f32_, MHA_DTYPE_F32, 1)
CONTIG_DTYPE_(far_f16_, MHA_DTYPE_F16, 1)
CONTIG_DTYPE_(far_bf16_, MHA_DTYPE_BF16, 1)
#undef CONTIG_DTYPE_
#undef CONTIG_FNS_

/* [dtype: f32, f16, bf16, q8_0, fp8_e4m3][rows - 1] */
static const scores_contig_fn scores_contig_table[5][4] = {
    {scores_f32_1, scores_f32_2, scores_f32_3, scores_f32_4},
    {scores_f16_1, scores_f16_2, scores_f16_3, scores_f16_4},
    {scores_bf16_1, scores_bf16_2, scores_bf16_3, scores_bf16_4},
    {scores_q8_1, scores_q8_2, scores_q8_3, scores_q8_4},
    {scores_fp8_1, scores_fp8_2, scores_fp8_3, scores_fp8_4}};
static const values_contig_fn values_contig_table[5][4] = {
    {values_f32_1, values_f32_2, values_f32_3, values_f32_4},
    {values_f16_1, values_f16_2, values_f16_3, values_f16_4},
    {values_bf16_1, values_bf16_2, values_bf16_3, values_bf16_4},
    {values_q8_1, values_q8_2, values_q8_3, values_q8_4},
    {values_fp8_1, values_fp8_2, values_fp8_3, values_fp8_4}};
/* With the far prefetch: [f32, f16, bf16][rows - 1] */
static const scores_contig_fn scores_far_table[3][4] = {
    {scores_far_f32_1, scores_far_f32_2, scores_far_f32_3, scores_far_f32_4},
    {scores_far_f16_1, scores_far_f16_2, scores_far_f16_3, scores_far_f16_4},
    {scores_far_bf16_1, scores_far_bf16_2, scores_far_bf16_3, scores_far_bf16_4}};
static const values_contig_fn values_far_table[3][4] = {
    {values_far_f32_1, values_far_f32_2, values_far_f32_3, values_far_f32_4},
    {values_far_f16_1, values_far_f16_2, values_far_f16_3, values_far_f16_4},
    {values_far_bf16_1, values_far_bf16_2, values_far_bf16_3, values_far_bf16_4}};

/* Pass 1b + 2 of every path, per row, vectorised over the unit: score pipeline (scale, soft-cap,
 * ALiBi), masks (causal, window, chunk, tree lanes), m = max, e = exp(s - m) in place of S,
 * l = sum e; o's R rows zeroed. */
MHA_INLINE void dec_softmax(const mha__dec_problem *p,
                            const mha__dec_unit *u,
                            int64_t R,
                            int64_t nb,
                            int64_t L,
                            float *S,
                            float *o,
                            float *m,
                            float *l) {
    const int64_t dv = p->dv;
    for (int64_t r = 0; r < R; r++) {
        const dec_row w = dec_row_of(p, u, r, nb, L);
        float *sr = S + r * MHA_DEC_BLOCK;
        v16 vmax = v16_set1(-INFINITY);
        __mmask16 nan_seen = 0;
        for (int64_t jj = 0; jj < nb; jj += 16) {
            const int64_t rem = nb - jj;
            const v16 s = dec_score16(p, u, &w, L, jj, nb, sr, &nan_seen);
            _mm512_mask_storeu_ps(sr + jj, v16_first((int)(rem < 16 ? rem : 16)), s);
            vmax = v16_max_nan_ignoring(s, vmax);
        }
        /* NaN scores propagate: a NaN among the visible keys makes m NaN. */
        const float mr = nan_seen ? NAN : v16_hmax(vmax);
        m[r] = mr;
        v16 vsum = v16_zero();
        if (mr == -INFINITY) {
            memset(sr, 0, sizeof(float) * (size_t)nb);
        } else {
            const v16 vm = v16_set1(mr);
            for (int64_t jj = 0; jj < nb; jj += 16) {
                const int64_t rem = nb - jj;
                const __mmask16 in = v16_first((int)(rem < 16 ? rem : 16));
                const v16 e = _mm512_maskz_mov_ps(
                    in, v16_exp_nonpos(v16_sub(_mm512_maskz_loadu_ps(in, sr + jj), vm)));
                _mm512_mask_storeu_ps(sr + jj, in, e);
                vsum = v16_add(vsum, e);
            }
        }
        l[r] = v16_hsum(vsum);
        memset(o + r * dv, 0, sizeof(float) * (size_t)dv);
    }
}

/* ---- The wide path: R > 4 query rows (float32), R > 8 (the other dtypes) ---------------------
 * Many query rows share a kv head when a call verifies several draft tokens (t > 1, a draft tree)
 * of a GQA model: R = group * t, 32 for 8 drafts with group 4. Per (key, kv head) the work is then
 * R (dk + dv) multiply-adds, 256 512-bit FMAs for R = 32 and d = 128: the arithmetic, not the
 * memory, bounds it, so this path is built around the FMA pipes:
 *   pass 1: scores transposed, S^T[key][row]. The query rows are held transposed, Qt[d][Rp]
 *           (Rp = R rounded up to 16, zero-padded; made once per unit), a block of MHA_DEC_SUB K
 *           rows is widened once into float32 scratch (float32 rows are read in place), and a
 *           tile of 8 keys x 32 rows (16 keys x 16 rows for a last odd vector of rows) runs
 *           acc[v][y] += Qt[d][16 v ..] * broadcast(K[y][d]) for d = 0 .. dk-1: 16 accumulators,
 *           one FMA chain per score in increasing d, no horizontal sums. Each 16 x 16 tile of S^T
 *           is transposed in registers into the [R][MHA_DEC_BLOCK] layout of S, so passes 1b and
 *           2 (scale, soft-cap, ALiBi, masks, tree lanes, exp) are the same code as the other
 *           paths.
 *   pass 3: each block of V rows is widened once into float32 scratch (float32 rows with
 *           dv % 64 == 0 read in place), then 6 rows x 64 columns of o stay in registers over the
 *           block (as axpy_block, e broadcast from memory): keys in order, the same sums as the
 *           other paths' pass 3.
 * The prefetch of the block ahead is spread one line per step of the FMA loops
 * (MHA_DEC_WIDE_AHEAD). Cycles per (key, kv head), R = 32, d = 128, against the FMA floor of 128
 * per pass (a harness calling the two passes on one unit, 5 x 2000 calls, best; session 40):
 * L2-resident float32 pass 1 131-146, pass 3 147-162; bfloat16 144-154 / 162-176; q8_0 151-162 /
 * 167-183; a 256 MB cache (beyond the L3) float32 153-179 / 171-185. The broadcast form spends a
 * whole vector of rows per key: for R = 5..15 part of it is zero padding (R = 8: half), which the
 * per-row dot products of the other path do not pay; measured (docs/INFERENCE.md) it is still
 * faster there, as K is widened once instead of once per group of four rows and no horizontal sums
 * remain. Sums are in a fixed order that does not depend on threads; they differ in rounding from
 * the R <= 4 paths' dot products (16 partial sums, then a horizontal sum), tolerance-tested. */

/* Rows of o per register block of pass 3 (x 64 columns: 24 accumulators; 4 rows ran the 8-draft
 * tree's pass 3 ~3% slower, within the noise). The switch in values_wide lists 1 .. 6. */
#define MHA_DEC_WIDE_ROWS 6

/* The wide path serves units of more than 4 rows of a float32 cache, of more than this many rows
 * of the other dtypes. With one vector of rows (R <= 16) pass 1 is bound by the broadcasts (one
 * per FMA: ~112 cycles per key, R = 5..16, against 64 of FMAs), which the 16- and 8-bit caches'
 * R <= 4 path does not pay: 8 rows (as 2 groups of 4) of a bfloat16 cache ran the 32768-key step
 * in 10.0-11.7 ms that way against 14.5-14.7 ms wide, 5 rows 8.6-9.0 against 13.8-14.0 ms; a
 * float32 cache, memory-bound there, ran 8 rows 15.0 ms wide against 17.7-18.8 (5 rows: equal).
 * (Zen 5, 1 thread, session 40.) */
#define MHA_DEC_WIDE_MIN_ROWS 8

/* Keys per pass-1 tile with two vectors of rows (16 accumulators). */
#define MHA_DEC_WIDE_KEYS 8

/* Most lines of a block of rows the wide path's prefetch spreads over its steps (16 rows of up
 * to 2 KiB); the rest go at once. */
#define MHA_DEC_WIDE_LINES 512

/* The wide path's prefetch distance in keys (one block ahead): its passes take ~150 cycles a
 * key, so 16 keys are ~0.6 us ahead of use; 32, 64 and 128 ran a 256 MB cache 10-60% slower
 * (the unit's first keys, which no prefetch reaches, grow with it). */
#define MHA_DEC_WIDE_AHEAD 16

/* One pass-1 tile: St[y][16 v + lane] = sum_d Qt[d][16 v + lane] K_y[d] for NV vectors of rows
 * (Qt at the tile's first row, row stride rp) and NK keys (kp[y]: float32 rows of >= dk). Step d
 * prefetches line pfl[d] (d < npf). */
MHA_INLINE void wide_tile(const int NV,
                          const int NK,
                          const float *const *kp,
                          const float *qt,
                          int64_t rp,
                          int64_t dk,
                          float *st,
                          const char *const *pfl,
                          int64_t npf,
                          int l2) {
    v16 acc[2][16];
#pragma GCC unroll 16
    for (int y = 0; y < NK; y++)
        for (int v = 0; v < NV; v++)
            acc[v][y] = v16_zero();
    for (int64_t d = 0; d < dk; d++, qt += rp) {
        if (d < npf)
            prefetch_line(pfl[d], l2);
        const v16 q0 = _mm512_load_ps(qt), q1 = NV > 1 ? _mm512_load_ps(qt + 16) : q0;
#pragma GCC unroll 16
        for (int y = 0; y < NK; y++) {
            const v16 b = v16_set1(kp[y][d]);
            acc[0][y] = v16_fma(q0, b, acc[0][y]);
            if (NV > 1)
                acc[1][y] = v16_fma(q1, b, acc[1][y]);
        }
    }
#pragma GCC unroll 16
    for (int y = 0; y < NK; y++)
        for (int v = 0; v < NV; v++)
            _mm512_store_ps(st + y * rp + 16 * v, acc[v][y]);
}

/* Pass 1 of the wide path: S[r][y] = q_r . k_y (r < R, y < nb) with Qt [dk][rp] the unit's query
 * rows transposed; scratch kw [MHA_DEC_SUB][dkp] (widened K rows), st [MHA_DEC_SUB][rp]. The
 * prefetch runs MHA_DEC_PREFETCH keys ahead over the K rows, then over the first V rows. */
MHA_INLINE void scores_wide(const mha_dtype DT,
                            const char *const *krows,
                            const char *const *vrows,
                            int64_t nb,
                            const float *qt,
                            int64_t R,
                            int64_t rp,
                            int64_t dk,
                            float *S,
                            float *kw,
                            float *st,
                            const row_stream *ks,
                            const row_stream *vs) {
    const int64_t dkp = (dk + 15) & ~(int64_t)15, nv = rp / 16;
    const __mmask16 ktail = v16_first((int)(dk - (dkp - 16)));
    (void)krows;
    (void)vrows;
    for (int64_t jb = 0; jb < nb; jb += MHA_DEC_SUB) {
        const int64_t nkb = block_len(nb, jb);
        const int64_t ahead = jb + MHA_DEC_WIDE_AHEAD;
        const row_stream *pst = ahead < nb ? ks : vs;
        const int64_t pj = ahead < nb ? ahead : ahead - nb;
        const int64_t pn = block_len(nb, pj);
        const int64_t pslot = pn > 0 ? pj : 0;
        /* the block's K rows as float32: in place, or widened (rows past the unit: row 0) */
        const float *kp[MHA_DEC_SUB];
        for (int64_t y = 0; y < MHA_DEC_SUB; y++) {
            const void *row = stream_row(ks, jb, y < nkb ? y : 0);
            if (DT == MHA_DTYPE_F32) {
                kp[y] = (const float *)row;
                continue;
            }
            kp[y] = kw + (y < nkb ? y : 0) * dkp;
            if (y < nkb)
                for (int64_t d = 0; d < dkp; d += 16)
                    _mm512_store_ps(kw + y * dkp + d,
                                    load_row16(DT, 0, row, d, d + 16 <= dk ? 0xFFFF : ktail));
        }
        /* the lines of the block ahead, prefetched one per step d of the tiles (a burst of them
         * fills the miss queues and the rest are dropped); what the steps do not cover first */
        const char *pfl[MHA_DEC_WIDE_LINES];
        int64_t npf = 0;
        for (int64_t y = 0; y < pn; y++) {
            const char *row = stream_row(pst, pslot, y);
            for (size_t b = 0; b < pst->row_bytes; b += 64) {
                if (npf < MHA_DEC_WIDE_LINES)
                    pfl[npf++] = row + b;
                else
                    prefetch_line(row + b, pst->prefetch_l2);
            }
        }
        int64_t at = 0;
        for (int64_t v = 0; v < nv; v += 2) {
            const int two = v + 1 < nv, nt = two && nkb > MHA_DEC_WIDE_KEYS ? 2 : 1;
            for (int x = 0; x < nt; x++, at += dk) {
                const int64_t n = npf - at < 0 ? 0 : npf - at;
                if (two)
                    wide_tile(2, MHA_DEC_WIDE_KEYS, kp + MHA_DEC_WIDE_KEYS * x, qt + 16 * v, rp, dk,
                              st + MHA_DEC_WIDE_KEYS * x * rp + 16 * v, pfl + (at < npf ? at : 0),
                              n, ks->prefetch_l2);
                else
                    wide_tile(1, MHA_DEC_SUB, kp, qt + 16 * v, rp, dk, st + 16 * v,
                              pfl + (at < npf ? at : 0), n, ks->prefetch_l2);
            }
        }
        for (int64_t x = at; x < npf; x++) /* fewer steps than lines (short rows) */
            prefetch_line(pfl[x], ks->prefetch_l2);
        /* S^T tiles [16 keys][16 rows] -> S[row][jb ..] */
        const __mmask16 in = v16_first((int)nkb);
        for (int64_t v = 0; v < nv; v++) {
            v16 t[16];
            for (int y = 0; y < 16; y++)
                t[y] = _mm512_load_ps(st + y * rp + 16 * v);
            v16_transpose16(t);
            for (int64_t x = 0; x < 16 && 16 * v + x < R; x++)
                _mm512_mask_storeu_ps(S + (16 * v + x) * MHA_DEC_BLOCK + jb, in, t[x]);
        }
    }
}

/* o_x[c0 + 0..64) += sum_{y < nk} e_x[y] vp[y][c0 + 0..64) for NR rows (row stride dv, e_x at
 * e + x * BLOCK) over a block of float32 value rows (vp[y], >= c0 + 64 readable floats each). km:
 * the columns of o that exist; CHECK: some row does not see some key (bit y of seen[x] clear:
 * e_x[y] = 0), which it then skips (0 * inf would be NaN). Keys in order, as axpy_block. Key y
 * prefetches line pfl[y] (y < npf). */
MHA_INLINE void axpy_wide(const int NR,
                          const int FULL,
                          const int CHECK,
                          const float *const *vp,
                          int64_t nk,
                          const float *e,
                          float *o,
                          int64_t dv,
                          int64_t c0,
                          const __mmask16 km[4],
                          const __mmask16 seen[MHA_DEC_WIDE_ROWS],
                          const char *const *pfl,
                          int64_t npf,
                          int l2) {
    v16 acc[MHA_DEC_WIDE_ROWS][4];
#pragma GCC unroll 8
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++)
            acc[x][c] = FULL ? _mm512_loadu_ps(o + x * dv + c0 + 16 * c)
                             : _mm512_maskz_loadu_ps(km[c], o + x * dv + c0 + 16 * c);
    for (int64_t y = 0; y < nk; y++) {
        if (y < npf)
            prefetch_line(pfl[y], l2);
        v16 v[4];
        for (int c = 0; c < 4; c++)
            v[c] = _mm512_loadu_ps(vp[y] + c0 + 16 * c);
#pragma GCC unroll 8
        for (int x = 0; x < NR; x++) {
            if (CHECK && !(seen[x] >> y & 1))
                continue;
            const v16 ev = v16_set1(e[x * MHA_DEC_BLOCK + y]);
            for (int c = 0; c < 4; c++)
                acc[x][c] = v16_fma(ev, v[c], acc[x][c]);
        }
    }
#pragma GCC unroll 8
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++) {
            if (FULL)
                _mm512_storeu_ps(o + x * dv + c0 + 16 * c, acc[x][c]);
            else
                _mm512_mask_storeu_ps(o + x * dv + c0 + 16 * c, km[c], acc[x][c]);
        }
}

/* Pass 3 of the wide path: o_r += sum_y e_r[y] v_y for r < R; scratch vw [MHA_DEC_SUB][dv64]
 * (dv64 = dv rounded up to 64: widened V rows, zero-padded). The prefetch runs MHA_DEC_PREFETCH
 * keys ahead over the V rows. */
MHA_INLINE void values_wide(const mha_dtype DT,
                            const row_stream *vs,
                            int64_t nb,
                            const float *S,
                            int64_t R,
                            float *o,
                            int64_t dv,
                            float *vw) {
    const int64_t dv64 = (dv + 63) & ~(int64_t)63;
    const int inplace = DT == MHA_DTYPE_F32 && dv % 64 == 0, full = dv % 64 == 0;
    for (int64_t jb = 0; jb < nb; jb += MHA_DEC_SUB) {
        const int64_t nkb = block_len(nb, jb);
        const int64_t ahead = jb + MHA_DEC_WIDE_AHEAD;
        const int64_t pn = block_len(nb, ahead);
        const int64_t pslot = pn > 0 ? ahead : 0;
        const __mmask16 in = v16_first((int)nkb);
        const float *vp[MHA_DEC_SUB];
        for (int64_t y = 0; y < nkb; y++) {
            const void *row = stream_row(vs, jb, y);
            if (inplace) {
                vp[y] = (const float *)row;
                continue;
            }
            vp[y] = vw + y * dv64;
            for (int64_t d = 0; d < dv64; d += 16) {
                const __mmask16 k = d + 16 <= dv ? (__mmask16)0xFFFF
                                    : d < dv     ? v16_first((int)(dv - d))
                                                 : (__mmask16)0;
                _mm512_store_ps(vw + y * dv64 + d, load_row16(DT, 0, row, d, k));
            }
        }
        /* the lines of the block ahead, prefetched one per key step (as scores_wide) */
        const char *pfl[MHA_DEC_WIDE_LINES];
        int64_t npf = 0, at = 0;
        for (int64_t y = 0; y < pn; y++) {
            const char *row = stream_row(vs, pslot, y);
            for (size_t b = 0; b < vs->row_bytes; b += 64) {
                if (npf < MHA_DEC_WIDE_LINES)
                    pfl[npf++] = row + b;
                else
                    prefetch_line(row + b, vs->prefetch_l2);
            }
        }
        for (int64_t r0 = 0; r0 < R; r0 += MHA_DEC_WIDE_ROWS) {
            const int64_t nr = R - r0 < MHA_DEC_WIDE_ROWS ? R - r0 : MHA_DEC_WIDE_ROWS;
            const float *e = S + r0 * MHA_DEC_BLOCK + jb;
            float *orow = o + r0 * dv;
            __mmask16 seen[MHA_DEC_WIDE_ROWS] = {0}, all = in;
            for (int64_t x = 0; x < nr; x++) {
                seen[x] = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(in, e + x * MHA_DEC_BLOCK),
                                             v16_zero(), _CMP_NEQ_UQ);
                all &= seen[x];
            }
            const int check = all != in;
            for (int64_t c0 = 0; c0 < dv; c0 += 64, at += nkb) {
                const int64_t n = npf - at < 0 ? 0 : npf - at;
                __mmask16 km[4];
                for (int cc = 0; cc < 4; cc++) {
                    const int64_t d = c0 + 16 * cc;
                    km[cc] = d + 16 <= dv ? (__mmask16)0xFFFF
                             : d < dv     ? v16_first((int)(dv - d))
                                          : (__mmask16)0;
                }
                switch (nr * 4 + full * 2 + check) {
#define AXPYW_(nr_, full_, check_)                                                                 \
    case nr_ * 4 + full_ * 2 + check_:                                                             \
        axpy_wide(nr_, full_, check_, vp, nkb, e, orow, dv, c0, km, seen,                          \
                  pfl + (at < npf ? at : 0), n, vs->prefetch_l2);                                  \
        break;
#define AXPYW4_(nr_) AXPYW_(nr_, 1, 0) AXPYW_(nr_, 1, 1) AXPYW_(nr_, 0, 0) AXPYW_(nr_, 0, 1)
                    // clang-format off
                    AXPYW4_(1) AXPYW4_(2) AXPYW4_(3) AXPYW4_(4) AXPYW4_(5) AXPYW4_(6)
                    // clang-format on
#undef AXPYW4_
#undef AXPYW_
                }
            }
        }
        for (int64_t x = at; x < npf; x++) /* fewer steps than lines */
            prefetch_line(pfl[x], vs->prefetch_l2);
    }
}

/* One non-inlined instance of each wide pass per dtype. */
typedef void (*scores_wide_fn)(const char *const *,
                               const char *const *,
                               int64_t,
                               const float *,
                               int64_t,
                               int64_t,
                               int64_t,
                               float *,
                               float *,
                               float *,
                               const row_stream *,
                               const row_stream *);
typedef void (*values_wide_fn)(
    const row_stream *, int64_t, const float *, int64_t, float *, int64_t, float *);
#define WIDE_FNS_(tag, dt)                                                                         \
    static __attribute__((noinline)) void scores_wide_##tag(                                       \
        const char *const *krows, const char *const *vrows, int64_t nb, const float *qt,           \
        int64_t R, int64_t rp, int64_t dk, float *S, float *kw, float *st, const row_stream *ks,   \
        const row_stream *vs) {                                                                    \
        scores_wide(dt, krows, vrows, nb, qt, R, rp, dk, S, kw, st, ks, vs);                       \
    }                                                                                              \
    static __attribute__((noinline)) void values_wide_##tag(const row_stream *vs, int64_t nb,      \
                                                            const float *S, int64_t R, float *o,   \
                                                            int64_t dv, float *vw) {               \
        values_wide(dt, vs, nb, S, R, o, dv, vw);                                                  \
    }
WIDE_FNS_(f32, MHA_DTYPE_F32)
WIDE_FNS_(f16, MHA_DTYPE_F16)
WIDE_FNS_(bf16, MHA_DTYPE_BF16)
WIDE_FNS_(q8, MHA_DTYPE_Q8_0)
WIDE_FNS_(fp8, MHA_DTYPE_FP8_E4M3)
#undef WIDE_FNS_
/* [dtype: f32, f16, bf16, q8_0, fp8_e4m3] */
static const scores_wide_fn scores_wide_table[5] = {
    scores_wide_f32, scores_wide_f16, scores_wide_bf16, scores_wide_q8, scores_wide_fp8};
static const values_wide_fn values_wide_table[5] = {
    values_wide_f32, values_wide_f16, values_wide_bf16, values_wide_q8, values_wide_fp8};

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
    const int64_t dkp = (dk + 15) & ~(int64_t)15, dvp = (dv + 15) & ~(int64_t)15;
    /* scratch: scores [R][BLOCK], then the unit's query rows [R][dkp] (zero-padded, 64-B aligned)
     */
    float *S = scratch, *qbuf = S + R * MHA_DEC_BLOCK;
    const __mmask16 ktail = v16_first((int)(dk - (dkp - 16))),
                    vtail = v16_first((int)(dv - (dvp - 16)));
    /* The address of each key's K and V row (ring wrap, pages: cache/kv_cache.h). */
    const char *krows[MHA_DEC_BLOCK], *vrows[MHA_DEC_BLOCK];
    mha__kv_unit_rows(c, seq, u->g, u->j0, nb, krows, vrows);
    const row_stream ks = {krows, c->k_row_bytes, p->prefetch_l2};
    const row_stream vs = {vrows, c->v_row_bytes, p->prefetch_l2};

    /* The contiguous path (see above) applies? (A unit wrapping its ring takes the other path,
     * paged or not, so both give the same bits.) */
    const int contig = dk % (DT == MHA_DTYPE_BF16 || DT == MHA_DTYPE_Q8_0 ? 32 : 16) == 0 &&
                       dv % 64 == 0 && R <= 4 && u->j0 % c->slots + nb <= c->slots;
    const int dti = DT == MHA_DTYPE_F16        ? 1
                    : DT == MHA_DTYPE_BF16     ? 2
                    : DT == MHA_DTYPE_Q8_0     ? 3
                    : DT == MHA_DTYPE_FP8_E4M3 ? 4
                                               : 0;
    /* The wide path (R > 4 rows, float32; else R > MHA_DEC_WIDE_MIN_ROWS; see above): the unit's
     * query rows transposed, Qt [dk][rp], then its scratch (mha__dec_scratch_floats). */
    if (R > (DT == MHA_DTYPE_F32 ? 4 : MHA_DEC_WIDE_MIN_ROWS)) {
        const int64_t rp = (R + 15) & ~(int64_t)15;
        float *qt = qbuf, *st = qt + dk * rp, *kw = st + MHA_DEC_SUB * rp;
        float *vw = kw + MHA_DEC_SUB * dkp;
        /* 16 rows x 16 elements at a time, transposed in registers (a scalar copy cost ~3% of
         * the 8-draft tree) */
        for (int64_t r0 = 0; r0 < rp; r0 += 16) {
            const float *src[16];
            for (int64_t x = 0; x < 16; x++) {
                const int64_t r = r0 + x < R ? r0 + x : 0;
                const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
                src[x] = r0 + x < R ? p->q + u->s * p->q_ss + i * p->q_ts + h * dk : NULL;
            }
            for (int64_t d0 = 0; d0 < dk; d0 += 16) {
                const __mmask16 k = d0 + 16 <= dk ? (__mmask16)0xFFFF : ktail;
                v16 t[16];
                for (int x = 0; x < 16; x++)
                    t[x] = src[x] ? _mm512_maskz_loadu_ps(k, src[x] + d0) : v16_zero();
                v16_transpose16(t);
                for (int64_t y = 0; y < 16 && d0 + y < dk; y++)
                    _mm512_store_ps(qt + (d0 + y) * rp + r0, t[y]);
            }
        }
        scores_wide_table[dti](krows, vrows, nb, qt, R, rp, dk, S, kw, st, &ks, &vs);
        dec_softmax(p, u, R, nb, L, S, o, m, l);
        values_wide_table[dti](&vs, nb, S, R, o, dv, vw);
        if (DT == MHA_DTYPE_FP8_E4M3)
            mha__kv_fp8_scale_o(c, u->g, o, R, dv);
        return;
    }
    /* The unit's query rows, copied once: row r = i * group + gh is query head g * group + gh of
     * token i (no division in the loops below); row-major [R][dkp], or chunk-major for the
     * contiguous path. */
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
        const float *src = p->q + u->s * p->q_ss + i * p->q_ts + h * dk;
        for (int64_t d = 0; d < dkp; d += 16)
            _mm512_store_ps(
                qbuf + (contig ? d * R + 16 * r : r * dkp + d),
                _mm512_maskz_loadu_ps(d + 16 <= dk ? (__mmask16)0xFFFF : ktail, src + d));
        if (contig && DT == MHA_DTYPE_BF16) /* even/odd order, see v16_bf16_half */
            for (int64_t d = 0; d < dk; d += 32) {
                const __m512i even =
                    _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
                float *lo = qbuf + d * R + 16 * r, *hi = lo + 16 * R;
                const v16 a = _mm512_load_ps(lo), b = _mm512_load_ps(hi);
                _mm512_store_ps(lo, _mm512_permutex2var_ps(a, even, b));
                _mm512_store_ps(hi, _mm512_permutex2var_ps(a, odd, b));
            }
    }
    /* the far prefetch: float32, float16 and bfloat16 only (decode.c far_prefetch) */
    const int far =
        p->prefetch_far && (DT == MHA_DTYPE_F32 || DT == MHA_DTYPE_F16 || DT == MHA_DTYPE_BF16);
    const int fari = DT == MHA_DTYPE_F16 ? 1 : DT == MHA_DTYPE_BF16 ? 2 : 0;

    /* Pass 1a: raw dot products q_r . k_j, per block of MHA_DEC_SUB keys, four keys by up to four
     * rows per sweep of the keys' vectors. The prefetch runs ahead on the K rows, then on the
     * first V rows (pass 3 reads them next). */
    const int kfull = dk % 16 == 0;
    if (contig)
        (far ? scores_far_table[fari][R - 1]
             : scores_contig_table[dti][R - 1])(krows, vrows, nb, qbuf, dk, S, p->prefetch_l2);
    else
        for (int64_t jb = 0; jb < nb; jb += MHA_DEC_SUB) {
            const int64_t nkb = block_len(nb, jb);
            const int64_t ahead = jb + MHA_DEC_PREFETCH;
            const row_stream *pst = ahead < nb ? &ks : &vs;
            const int64_t pj = ahead < nb ? ahead : ahead - nb;
            const int64_t pn = block_len(nb, pj);
            const int64_t pslot = pn > 0 ? pj : 0;
            const void *kb[MHA_DEC_SUB];
            block_rows(&ks, jb, nkb, kb);
            for (int64_t y0 = 0; y0 < nkb; y0 += 4) {
                const int64_t nk = nkb - y0 < 4 ? nkb - y0 : 4;
                prefetch_rows(pst, pslot, pn, y0, y0 + 4);
                const void *kr[4] = {kb[y0], kb[y0 + 1], kb[y0 + 2], kb[y0 + 3]};
                for (int64_t r0 = 0; r0 < R; r0 += 4) {
                    const int64_t nr = R - r0 < 4 ? R - r0 : 4;
                    const float *q[4];
                    for (int64_t x = 0; x < 4; x++)
                        q[x] = qbuf + (r0 + (x < nr ? x : 0)) * dkp;
                    float *out = S + r0 * MHA_DEC_BLOCK + jb + y0;
                    switch (nr * 2 + kfull) {
#define DOTS_(nr_, full_)                                                                          \
    case nr_ * 2 + full_:                                                                          \
        dots(nr_, DT, full_, kr, q, dk, dkp, ktail, nk, out);                                      \
        break;
                        // clang-format off
                    DOTS_(4, 1) DOTS_(4, 0) DOTS_(3, 1) DOTS_(3, 0) DOTS_(2, 1) DOTS_(2, 0) DOTS_(1, 1) DOTS_(1, 0)
                        // clang-format on
#undef DOTS_
                    }
                }
            }
        }

    /* Pass 1b + 2 */
    dec_softmax(p, u, R, nb, L, S, o, m, l);

    /* Pass 3: o_r += e_rj v_j over blocks of MHA_DEC_SUB value rows, for up to four rows x 64
     * columns of accumulators held in registers across the block. */
    if (contig) {
        /* the first K rows of the next unit of this (sequence, kv head), if there is one, else of
         * the unit this thread takes next (u->next: another pair's first keys start cold
         * otherwise) */
        const char *knext[MHA_DEC_PREFETCH_FAR] = {NULL};
        const int64_t ahead = far ? MHA_DEC_PREFETCH_FAR : MHA_DEC_PREFETCH;
        const mha__dec_unit *nu = L > u->j1 ? NULL : u->next;
        const int64_t nseq = nu ? p->seq[nu->s] : seq, ng = nu ? nu->g : u->g,
                      nj = nu ? nu->j0 : u->j1, nend = nu ? nu->j1 : L;
        const int64_t nn = nend - nj < ahead ? nend - nj : ahead;
        if (nn > 0) {
            mha__kv_run runs[MHA__KV_MAX_RUNS];
            const int nr = mha__kv_runs(c, nseq, ng, nj, nn, runs);
            for (int ri = 0; ri < nr; ri++)
                for (int64_t y = 0; y < runs[ri].n; y++)
                    knext[runs[ri].y0 + y] = runs[ri].k + (size_t)y * c->k_row_bytes;
        }
        (far ? values_far_table[fari][R - 1]
             : values_contig_table[dti][R - 1])(vrows, knext, nb, S, o, dv, p->prefetch_l2);
        if (DT == MHA_DTYPE_FP8_E4M3)
            mha__kv_fp8_scale_o(c, u->g, o, R, dv);
        return;
    }
    const int vfull = dv % 64 == 0;
    for (int64_t jb = 0; jb < nb; jb += MHA_DEC_SUB) {
        const int64_t nkb = block_len(nb, jb);
        const int64_t ahead = jb + MHA_DEC_PREFETCH;
        const int64_t pn = block_len(nb, ahead);
        const int64_t pslot = pn > 0 ? ahead : 0;
        const void *vb[MHA_DEC_SUB];
        block_rows(&vs, jb, nkb, vb);
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int64_t nr = R - r0 < 4 ? R - r0 : 4;
            const float *e = S + r0 * MHA_DEC_BLOCK + jb;
            float *orow = o + r0 * dv;
            /* which keys of the block each row sees (e != 0; NaN counts as seen), shared by the
             * column groups */
            __mmask16 seen[4] = {0, 0, 0, 0};
            for (int64_t x = 0; x < nr; x++)
                seen[x] = _mm512_cmp_ps_mask(
                    _mm512_maskz_loadu_ps(v16_first((int)nkb), e + x * MHA_DEC_BLOCK), v16_zero(),
                    _CMP_NEQ_UQ);
            for (int64_t c0 = 0; c0 < dvp; c0 += 64) {
                /* the block ahead is prefetched during the first (row group, column group) */
                const int64_t pnow = r0 == 0 && c0 == 0 ? pn : 0;
                __mmask16 km[4];
                for (int cc = 0; cc < 4; cc++) {
                    const int64_t d = c0 + 16 * cc;
                    km[cc] = d + 16 <= dv ? (__mmask16)0xFFFF : d < dv ? vtail : (__mmask16)0;
                }
                switch (nr * 2 + vfull) {
#define AXPY_(nr_, full_)                                                                          \
    case nr_ * 2 + full_:                                                                          \
        axpy_block(nr_, DT, full_, vb, nkb, e, orow, dv, c0, km, seen, &vs, pslot, pnow);          \
        break;
                    // clang-format off
                    AXPY_(4, 1) AXPY_(4, 0) AXPY_(3, 1) AXPY_(3, 0) AXPY_(2, 1) AXPY_(2, 0) AXPY_(1, 1) AXPY_(1, 0)
                    // clang-format on
#undef AXPY_
                }
            }
        }
    }
    if (DT == MHA_DTYPE_FP8_E4M3)
        mha__kv_fp8_scale_o(c, u->g, o, R, dv);
}

void mha_decode_f32acc_splitkv__avx512(const mha__dec_problem *p,
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

/* SPDX-License-Identifier: MIT */
/* ggml_quants.h: ggml's block-quantised tensor types as GGUF files store them, read at load
 * (src/io/gguf.c). docs/SEMANTICS.md "GGUF quantised types" has the layouts and formulas. */
#ifndef MHA_IO_GGML_QUANTS_H
#define MHA_IO_GGML_QUANTS_H

#include <stdint.h>

/* Values per block and bytes per block of ggml type t, for the types this reader can size (F32,
 * F16, BF16 and the block types below); bytes 0 for the others (their tensors are listed but
 * never read, so their sizes are not needed). The one table of block sizes: gguf.c sizes and
 * bounds-checks tensors with it, and the row functions below step through blocks with it. */
void mha__ggml_type_block(uint32_t t, uint64_t *values, uint64_t *bytes);

/* `cols` values (a multiple of the type's block: checked by the caller) of one row of ggml type
 * `type` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K) at `src` into float32 at
 * `dst`, each value computed as ggml's CPU dequantiser computes it in float32. Returns 1, or 0
 * when a block's float16 scale (d, or dmin / m) is not finite (dst is then partly written) or the
 * type is not one of these. */
int mha__ggml_dequantize_row(uint32_t type, const unsigned char *src, int64_t cols, float *dst);

/* The same row of Q8_0, Q4_0 or Q5_0 as q8_0 blocks (34 bytes: the block's float16 scale d as
 * stored, then 32 int8) holding exactly the same values: Q8_0 copied, Q4_0's q - 8, Q5_0's
 * q - 16. Returns 1, or 0 for another type (nothing written). */
int mha__ggml_to_q8_0_row(uint32_t type,
                          const unsigned char *src,
                          int64_t cols,
                          unsigned char *dst);

#endif

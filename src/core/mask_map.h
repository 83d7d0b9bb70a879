/* SPDX-License-Identifier: MIT */
/* mask_map.h: building the block mask of a call (mha__mask_map, base/internal.h; mask_map.c). */
#ifndef MHA_MASK_MAP_H
#define MHA_MASK_MAP_H

#include "base/internal.h"

/* Bytes of the block mask of `a` (sizes checked, masks not yet): 0 when it has no element rule.
 * False on overflow. */
bool mha__mask_map_bytes(const mha_attention_args *a, size_t *bytes);

/* The same for a resolved problem (callers that hold one, e.g. the statistics). */
bool mha__mask_map_problem_bytes(const mha__problem *p, size_t *bytes);

/* Builds p's block mask into mem (64-byte aligned, mha__mask_map_bytes of the args p was checked
 * from) on team's threads and points p->map at it; p->map = NULL when p has no element rule. */
mha_status mha__mask_map_build(mha__problem *p, void *mem, mha__team team, mha_error *err);

/* The class of rows [i0, i1) x keys [j0, j0 + nk) of (b, h) (nk <= 64) under every rule: the
 * causal / window band and the block mask (p->map, built; or none). */
mha_tile_class mha__tile_class(
    const mha__problem *p, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int nk);

#endif /* MHA_MASK_MAP_H */

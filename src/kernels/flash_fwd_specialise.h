/* SPDX-License-Identifier: MIT */
/* flash_fwd_specialise.h: the head-size specialisation shared by the SIMD flash forward kernels.
 *
 * Included once by each of attn_fwd_flash_{avx512,avx2,neon}.c, after the file has defined its
 * two tile products (static, inline):
 *   qk_body(q, rows, kt, ldk, nk, dk, s, lds)             S[rows][nk] = Q K^T  (Q rows by
 *                                                         pointer, K^T packed, ldk floats a row)
 *   pv_body(pm, lds, rows, nk, v, vs, dv, alpha, o, ldo)  O[rows][dv] = alpha O + P V
 * It defines qk() and pv(), which the kernel's tile operations call: one instance per common head
 * size (32, 64, 80, 96, 128, 256), where the constant size lets the compiler unroll the loops over
 * d and keep the accumulators in registers, and the run-time-size body for any other size. The
 * instances are compiled with the including file's ISA flags, which is why this is a fragment and
 * not a function of its own file. */
#ifndef MHA_FLASH_FWD_SPECIALISE_H
#define MHA_FLASH_FWD_SPECIALISE_H

#define SPECIALISE(D)                                                                              \
    static void qk_d##D(const float *const *q, int rows, const float *kt, int ldk, int nk,         \
                        float *s, int lds) {                                                       \
        qk_body(q, rows, kt, ldk, nk, D, s, lds);                                                  \
    }                                                                                              \
    static void pv_d##D(const float *pm, int lds, int rows, int nk, const float *v, int64_t vs,    \
                        const float *alpha, float *o, int ldo) {                                   \
        pv_body(pm, lds, rows, nk, v, vs, D, alpha, o, ldo);                                       \
    }
SPECIALISE(32)
SPECIALISE(64)
SPECIALISE(80)
SPECIALISE(96)
SPECIALISE(128)
SPECIALISE(256)
#undef SPECIALISE

static void qk(const float *const *q,
               int rows,
               const float *kt,
               int ldk,
               int nk,
               int64_t dk,
               float *s,
               int lds) {
    switch (dk) {
    case 32:
        qk_d32(q, rows, kt, ldk, nk, s, lds);
        break;
    case 64:
        qk_d64(q, rows, kt, ldk, nk, s, lds);
        break;
    case 80:
        qk_d80(q, rows, kt, ldk, nk, s, lds);
        break;
    case 96:
        qk_d96(q, rows, kt, ldk, nk, s, lds);
        break;
    case 128:
        qk_d128(q, rows, kt, ldk, nk, s, lds);
        break;
    case 256:
        qk_d256(q, rows, kt, ldk, nk, s, lds);
        break;
    default:
        qk_body(q, rows, kt, ldk, nk, dk, s, lds);
        break;
    }
}

static void pv(const float *pm,
               int lds,
               int rows,
               int nk,
               const float *v,
               int64_t vs,
               int64_t dv,
               const float *alpha,
               float *o,
               int ldo) {
    switch (dv) {
    case 32:
        pv_d32(pm, lds, rows, nk, v, vs, alpha, o, ldo);
        break;
    case 64:
        pv_d64(pm, lds, rows, nk, v, vs, alpha, o, ldo);
        break;
    case 80:
        pv_d80(pm, lds, rows, nk, v, vs, alpha, o, ldo);
        break;
    case 96:
        pv_d96(pm, lds, rows, nk, v, vs, alpha, o, ldo);
        break;
    case 128:
        pv_d128(pm, lds, rows, nk, v, vs, alpha, o, ldo);
        break;
    case 256:
        pv_d256(pm, lds, rows, nk, v, vs, alpha, o, ldo);
        break;
    default:
        pv_body(pm, lds, rows, nk, v, vs, dv, alpha, o, ldo);
        break;
    }
}

#endif /* MHA_FLASH_FWD_SPECIALISE_H */

/* SPDX-License-Identifier: MIT */
/* rope.c: rotary position embeddings (Su et al., RoFormer, arXiv:2104.09864) and the frequency
 * scalings used by today's long-context checkpoints. Formulas in docs/SEMANTICS.md:
 *   f_k = theta^(-2k/R), k = 0 .. R/2-1, R = rotary_dim; angle = position * f_k
 *   (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos)
 *   INTERLEAVED: (a, b) = (2k, 2k+1)     HALF: (a, b) = (k, k + R/2)
 * Angles and rotations are computed in double and rounded once to float: positions up to 2^31
 * times f_0 = 1 need more than float's 24 bits to keep the angle accurate. */
#include "layer/rope.h"
#include "check/check.h"

#include <stdlib.h>
#include <string.h>

#define MHA_PI 3.14159265358979323846

/* YaRN: the (fractional) pair index whose wavelength makes `rotations` turns over the original
 * context: R * ln(L / (rotations * 2 pi)) / (2 ln theta). */
static double yarn_correction_dim(double rotations, double R, double theta, double orig_len) {
    return R * log(orig_len / (rotations * 2.0 * MHA_PI)) / (2.0 * log(theta));
}

void mha__rope_freqs(const mha_rope *r, double *freqs, double *cs_factor) {
    const int64_t half = r->rotary_dim / 2;
    const double R = (double)r->rotary_dim;
    double base = r->theta;
    if (r->scaling == MHA_ROPE_SCALING_NTK)
        base = r->theta * pow(r->factor, R / (R - 2.0));
    for (int64_t k = 0; k < half; k++)
        freqs[k] = pow(base, -2.0 * (double)k / R);
    *cs_factor = 1.0;

    switch (r->scaling) {
    case MHA_ROPE_SCALING_LINEAR:
        for (int64_t k = 0; k < half; k++)
            freqs[k] /= r->factor;
        break;
    case MHA_ROPE_SCALING_LLAMA3: {
        /* Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and
         * the band between blended linearly in orig_len / wavelength. */
        const double low_wavelen = r->original_max_position / r->low_freq_factor;
        const double high_wavelen = r->original_max_position / r->high_freq_factor;
        for (int64_t k = 0; k < half; k++) {
            const double wavelen = 2.0 * MHA_PI / freqs[k];
            if (wavelen < high_wavelen)
                continue;
            if (wavelen > low_wavelen) {
                freqs[k] /= r->factor;
            } else {
                const double smooth = (r->original_max_position / wavelen - r->low_freq_factor) /
                                      (r->high_freq_factor - r->low_freq_factor);
                freqs[k] = (1.0 - smooth) * freqs[k] / r->factor + smooth * freqs[k];
            }
        }
        break;
    }
    case MHA_ROPE_SCALING_YARN: {
        double low = yarn_correction_dim(r->beta_fast, R, r->theta, r->original_max_position);
        double high = yarn_correction_dim(r->beta_slow, R, r->theta, r->original_max_position);
        if (!r->yarn_no_truncate) { /* the paper's integer ramp ends; gpt-oss keeps them exact */
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0.0)
            low = 0.0;
        if (high > R - 1.0)
            high = R - 1.0;
        if (low == high)
            high += 0.001; /* avoid a zero-width ramp */
        for (int64_t k = 0; k < half; k++) {
            double ramp = ((double)k - low) / (high - low);
            ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
            const double extrapolation_weight = 1.0 - ramp;
            freqs[k] = freqs[k] / r->factor * (1.0 - extrapolation_weight) +
                       freqs[k] * extrapolation_weight;
        }
        *cs_factor = r->attention_factor;
        break;
    }
    case MHA_ROPE_SCALING_LONGROPE: /* fixed by mha__rope_at_length: both lists are the call's */
        for (int64_t k = 0; k < half; k++)
            freqs[k] /= r->short_factor[k];
        *cs_factor = r->attention_factor;
        break;
    default:
        break;
    }
}

mha_rope mha__rope_at_length(const mha_rope *r, int64_t length) {
    mha_rope fixed = *r;
    if (r->scaling == MHA_ROPE_SCALING_LONGROPE) {
        /* transformers' longrope_frequency_update: the long list beyond the original length. */
        const double *list =
            (double)length > r->original_max_position ? r->long_factor : r->short_factor;
        memcpy(fixed.short_factor, list, sizeof fixed.short_factor);
        memcpy(fixed.long_factor, list, sizeof fixed.long_factor);
        return fixed;
    }
    if (r->scaling != MHA_ROPE_SCALING_DYNAMIC)
        return fixed;
    /* transformers' _compute_dynamic_ntk_parameters: theta (factor L/L_0 - (factor-1))^(R/(R-2))
     * for L > L_0, i.e. NTK with that factor; below L_0 the factor is 1 (unscaled). */
    const double len = (double)length, orig = r->original_max_position;
    fixed.scaling = len > orig ? MHA_ROPE_SCALING_NTK : MHA_ROPE_SCALING_NONE;
    fixed.factor = len > orig ? r->factor * len / orig - (r->factor - 1.0) : 1.0;
    return fixed;
}

int64_t mha__positions_length(
    const int64_t *pos, const int64_t *base, int64_t B, int64_t L, int64_t batch_stride) {
    int64_t last = -1;
    for (int64_t b = 0; b < B; b++) {
        if (!pos) {
            const int64_t p = (base ? base[b] : 0) + L - 1;
            last = p > last ? p : last;
            continue;
        }
        for (int64_t t = 0; t < L; t++)
            last = pos[b * batch_stride + t] > last ? pos[b * batch_stride + t] : last;
    }
    return last + 1;
}

void mha__rope_cos_sin(const mha_rope *r,
                       const double *freqs,
                       double cs_factor,
                       int64_t position,
                       double *cos_out,
                       double *sin_out) {
    const int64_t half = r->rotary_dim / 2;
    for (int64_t k = 0; k < half; k++) {
        const double angle = (double)position * freqs[k];
        cos_out[k] = cs_factor * cos(angle);
        sin_out[k] = cs_factor * sin(angle);
    }
}

void mha__rope_rotate(const mha_rope *r, const double *cos_k, const double *sin_k, float *x) {
    const int64_t half = r->rotary_dim / 2;
    for (int64_t k = 0; k < half; k++) {
        const int64_t a = r->style == MHA_ROPE_INTERLEAVED ? 2 * k : k;
        const int64_t b = r->style == MHA_ROPE_INTERLEAVED ? 2 * k + 1 : k + half;
        const double xa = (double)x[a], xb = (double)x[b];
        x[a] = (float)(xa * cos_k[k] - xb * sin_k[k]);
        x[b] = (float)(xa * sin_k[k] + xb * cos_k[k]);
    }
}

mha_status mha_rope_frequencies(
    const mha_rope *rope, int64_t head_dim, double *freqs, double *cos_sin_factor, mha_error *err) {
    mha_rope r;
    mha_status st = mha__check_rope_frequencies(rope, head_dim, freqs, cos_sin_factor, &r, err);
    if (st != MHA_STATUS_OK)
        return st;
    mha__rope_freqs(&r, freqs, cos_sin_factor);
    return MHA_STATUS_OK;
}

mha_status mha_rope_at_length(
    const mha_rope *rope, int64_t head_dim, int64_t length, mha_rope *out, mha_error *err) {
    mha_rope r;
    mha_status st = mha__check_rope_at_length(rope, head_dim, length, &r, err);
    MHA_RETURN_IF(st == MHA_STATUS_OK && !out, err, INVALID_ARG, "out is NULL");
    if (st == MHA_STATUS_OK)
        *out = mha__rope_at_length(&r, length);
    return st;
}

mha_status mha_rope_apply(const mha_rope *rope,
                          int64_t batch,
                          int64_t seq_len,
                          int64_t num_heads,
                          int64_t head_dim,
                          float *x,
                          const int64_t x_strides[4],
                          const int64_t *positions,
                          int64_t pos_batch_stride,
                          mha_error *err) {
    mha_rope r;
    mha_status st = mha__check_rope_apply(rope, batch, seq_len, num_heads, head_dim, x, x_strides,
                                          positions, pos_batch_stride, &r, err);
    if (st != MHA_STATUS_OK || batch == 0 || seq_len == 0 || num_heads == 0)
        return st;
    const int64_t half = r.rotary_dim / 2;
    double *tab = malloc(sizeof(double) * (size_t)(3 * half));
    MHA_RETURN_IF(!tab, err, NO_MEMORY, "rope: cannot allocate %lld doubles",
                  (long long)(3 * half));
    double *freqs = tab, *cos_k = tab + half, *sin_k = tab + 2 * half, cs;
    r = mha__rope_at_length(
        &r, mha__positions_length(positions, NULL, batch, seq_len, pos_batch_stride));
    mha__rope_freqs(&r, freqs, &cs);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < seq_len; t++) {
            const int64_t pos = positions ? positions[b * pos_batch_stride + t] : t;
            mha__rope_cos_sin(&r, freqs, cs, pos, cos_k, sin_k);
            for (int64_t hh = 0; hh < num_heads; hh++)
                mha__rope_rotate(&r, cos_k, sin_k,
                                 x + b * x_strides[0] + t * x_strides[1] + hh * x_strides[2]);
        }
    free(tab);
    mha__ok(err);
    return MHA_STATUS_OK;
}

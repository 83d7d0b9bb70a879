/* SPDX-License-Identifier: MIT */
/* rope.c: rotary position embeddings (Su et al., RoFormer, arXiv:2104.09864) and the frequency
 * scalings used by today's long-context checkpoints. Formulas in docs/SEMANTICS.md:
 *   f_k = theta^(-2k/R), k = 0 .. R/2-1, R = rotary_dim; angle = position * f_k
 *   (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos)
 *   INTERLEAVED: (a, b) = (2k, 2k+1)     HALF: (a, b) = (k, k + R/2)
 * Angles and rotations are computed in double and rounded once to float: positions up to 2^31
 * times f_0 = 1 need more than float's 24 bits to keep the angle accurate. */
#include "base/internal.h"

#include <stdlib.h>

#define MHA_PI 3.14159265358979323846

static bool finite_positive(double x) {
    return isfinite(x) && x > 0.0;
}

mha_status mha__rope_resolve(const mha_rope *in, int64_t head_dim, mha_rope *out, mha_error *err) {
    MHA_RETURN_IF(!in, err, INVALID_ARG, "rope is NULL");
    mha_rope r = *in;
    MHA_RETURN_IF(r.style != MHA_ROPE_INTERLEAVED && r.style != MHA_ROPE_HALF, err, INVALID_ARG,
                  "rope.style=%d is not interleaved (1) or half (2)", (int)r.style);
    if (r.theta == 0.0)
        r.theta = 10000.0;
    MHA_RETURN_IF(!isfinite(r.theta) || r.theta <= 1.0, err, INVALID_ARG,
                  "rope.theta=%g must be finite and > 1", r.theta);
    if (r.rotary_dim == 0)
        r.rotary_dim = head_dim;
    MHA_RETURN_IF(r.rotary_dim <= 0 || r.rotary_dim % 2 != 0 || r.rotary_dim > head_dim, err,
                  INVALID_ARG, "rope.rotary_dim=%lld must be even, > 0 and <= head_dim=%lld",
                  (long long)r.rotary_dim, (long long)head_dim);
    switch (r.scaling) {
    case MHA_ROPE_SCALING_NONE:
        break;
    case MHA_ROPE_SCALING_LINEAR:
    case MHA_ROPE_SCALING_NTK:
    case MHA_ROPE_SCALING_YARN:
        if (r.factor == 0.0)
            r.factor = 1.0;
        break;
    case MHA_ROPE_SCALING_LLAMA3:
        if (r.factor == 0.0)
            r.factor = 8.0;
        break;
    default:
        return mha__fail(err, MHA_STATUS_INVALID_ARG, "rope.scaling=%d is not a known scaling",
                         (int)r.scaling);
    }
    if (r.scaling != MHA_ROPE_SCALING_NONE)
        MHA_RETURN_IF(!finite_positive(r.factor), err, INVALID_ARG,
                      "rope.factor=%g must be finite and > 0", r.factor);
    if (r.scaling == MHA_ROPE_SCALING_NTK)
        MHA_RETURN_IF(r.rotary_dim <= 2, err, INVALID_ARG,
                      "NTK-aware scaling needs rotary_dim > 2 (got %lld)", (long long)r.rotary_dim);
    if (r.scaling == MHA_ROPE_SCALING_LLAMA3) {
        if (r.original_max_position == 0.0)
            r.original_max_position = 8192.0;
        if (r.low_freq_factor == 0.0)
            r.low_freq_factor = 1.0;
        if (r.high_freq_factor == 0.0)
            r.high_freq_factor = 4.0;
        MHA_RETURN_IF(
            !finite_positive(r.original_max_position) || !finite_positive(r.low_freq_factor) ||
                !finite_positive(r.high_freq_factor) || r.high_freq_factor <= r.low_freq_factor,
            err, INVALID_ARG,
            "llama3 scaling needs original_max_position > 0 and "
            "high_freq_factor (%g) > low_freq_factor (%g) > 0",
            r.high_freq_factor, r.low_freq_factor);
    }
    if (r.scaling == MHA_ROPE_SCALING_YARN) {
        if (r.original_max_position == 0.0)
            r.original_max_position = 4096.0;
        if (r.beta_fast == 0.0)
            r.beta_fast = 32.0;
        if (r.beta_slow == 0.0)
            r.beta_slow = 1.0;
        if (r.attention_factor == 0.0)
            r.attention_factor = r.factor <= 1.0 ? 1.0 : 0.1 * log(r.factor) + 1.0;
        MHA_RETURN_IF(!finite_positive(r.original_max_position) || !finite_positive(r.beta_fast) ||
                          !finite_positive(r.beta_slow) || !finite_positive(r.attention_factor),
                      err, INVALID_ARG,
                      "yarn scaling needs original_max_position, beta_fast, beta_slow and "
                      "attention_factor finite and > 0");
    }
    *out = r;
    mha__ok(err);
    return MHA_STATUS_OK;
}

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
        double low =
            floor(yarn_correction_dim(r->beta_fast, R, r->theta, r->original_max_position));
        double high =
            ceil(yarn_correction_dim(r->beta_slow, R, r->theta, r->original_max_position));
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
    default:
        break;
    }
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
    MHA_RETURN_IF(head_dim <= 0 || head_dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "head_dim=%lld out of range", (long long)head_dim);
    MHA_RETURN_IF(!freqs || !cos_sin_factor, err, INVALID_ARG, "freqs or cos_sin_factor is NULL");
    mha_rope r;
    mha_status st = mha__rope_resolve(rope, head_dim, &r, err);
    if (st != MHA_STATUS_OK)
        return st;
    mha__rope_freqs(&r, freqs, cos_sin_factor);
    return MHA_STATUS_OK;
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
    MHA_RETURN_IF(batch < 0 || seq_len < 0 || num_heads < 0 || batch > MHA_MAX_DIM ||
                      seq_len > MHA_MAX_DIM || num_heads > MHA_MAX_DIM,
                  err, INVALID_ARG, "batch=%lld, seq_len=%lld, num_heads=%lld out of range",
                  (long long)batch, (long long)seq_len, (long long)num_heads);
    MHA_RETURN_IF(head_dim <= 0 || head_dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "head_dim=%lld out of range", (long long)head_dim);
    MHA_RETURN_IF(!x_strides, err, INVALID_ARG, "x_strides is NULL");
    MHA_RETURN_IF(x_strides[3] != 1, err, INVALID_ARG,
                  "x_strides[3]=%lld: the head dimension must be contiguous (stride 1)",
                  (long long)x_strides[3]);
    MHA_RETURN_IF(pos_batch_stride < 0, err, INVALID_ARG, "pos_batch_stride=%lld is negative",
                  (long long)pos_batch_stride);
    mha_rope r;
    mha_status st = mha__rope_resolve(rope, head_dim, &r, err);
    if (st != MHA_STATUS_OK)
        return st;
    if (batch == 0 || seq_len == 0 || num_heads == 0)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!x, err, INVALID_ARG, "x is NULL");
    if (positions) {
        for (int64_t b = 0; b < batch; b++)
            for (int64_t t = 0; t < seq_len; t++) {
                const int64_t pos = positions[b * pos_batch_stride + t];
                MHA_RETURN_IF(pos < 0 || pos > MHA_MAX_POSITION, err, INVALID_ARG,
                              "positions[%lld][%lld]=%lld outside [0, 2^31]", (long long)b,
                              (long long)t, (long long)pos);
            }
    }
    const int64_t half = r.rotary_dim / 2;
    double *tab = malloc(sizeof(double) * (size_t)(3 * half));
    MHA_RETURN_IF(!tab, err, NO_MEMORY, "rope: cannot allocate %lld doubles",
                  (long long)(3 * half));
    double *freqs = tab, *cos_k = tab + half, *sin_k = tab + 2 * half, cs;
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

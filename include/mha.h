/* SPDX-License-Identifier: MIT */
/* mha.h: the one public header of libmha, exact and fast multi-head attention on the CPU.
 *
 * Two levels:
 *   - the LAYER (mha_layer): projections + RoPE + attention + output projection, configured once
 *     with mha_config and run with mha_layer_forward();
 *   - the attention CORE (mha_attention): already projected Q/K/V with explicit strides.
 * RoPE is also exposed on its own (mha_rope_apply).
 *
 * Conventions (docs/SEMANTICS.md has the full contract, with formulas):
 *   - Sizes, strides and indices are int64_t; strides are in ELEMENTS, not bytes.
 *   - Tensors are float32 unless a dtype says otherwise; inputs are const, caller-owned.
 *   - Outputs are OVERWRITTEN, never accumulated. No output may share a byte with an input or
 *     with another output: the address ranges the sizes and strides reach are compared, and the
 *     same pointer or any partial overlap is refused (INVALID_ARG naming both). Inputs here
 *     include masks, positions and a layer's weights. A strided output must not overlap itself
 *     (strides that put two of its elements at one address, e.g. a stride of 0, are INVALID_ARG);
 *     inputs may (a stride of 0 broadcasts). Inputs may share memory. The only in-place forms are
 *     mha_rope_apply (x is rotated in place) and mha_attention_merge (o exactly o_a or o_b, lse
 *     exactly lse_a or lse_b).
 *   - Every fallible function returns mha_status and, when `err` is not NULL, fills it: on
 *     failure with the status and a one-line message naming the offending argument, on success
 *     with MHA_STATUS_OK and an empty message. On error, outputs are untouched (validation
 *     happens before any output is written).
 *   - Scalars are double in the API but float32 in the kernels: scale, softcap and RoPE's
 *     attention_factor must be representable as normal float32 values (see mha_attention_args).
 *   - No global mutable state. A layer is immutable after creation: any number of threads may call
 *     mha_layer_forward() on the same layer at once, as long as their outputs differ.
 *   - Nothing here calls exit() or abort().
 */
#ifndef MHA_H
#define MHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#    define MHA_API __declspec(dllexport)
#elif defined(__GNUC__)
#    define MHA_API __attribute__((visibility("default")))
#else
#    define MHA_API
#endif

#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 1
#define MHA_VERSION_PATCH 0
/** "MAJOR.MINOR.PATCH" of the library actually linked. */
MHA_API const char *mha_version(void);

/* ---------------------------------------------------------------------------------------------- */
/* Status codes. Values are stable: new codes are only ever appended.                             */
/* ---------------------------------------------------------------------------------------------- */
// clang-format off
#define MHA_STATUS_MAP(X)                                                              \
    X(OK,                  0, "success")                                               \
    X(INVALID_ARG,         1, "invalid argument")                                      \
    X(UNSUPPORTED,         2, "unsupported combination of options for this implementation") \
    X(NO_MEMORY,           3, "out of memory")                                         \
    X(WORKSPACE_TOO_SMALL, 4, "workspace smaller than required")                       \
    X(OVERFLOW,            5, "size overflow")                                         \
    X(IO,                  6, "file could not be read or written")                     \
    X(BAD_FILE,            7, "malformed or unsupported file")                         \
    X(NOT_FOUND,           8, "tensor not found in file")                              \
    X(INTERNAL,            9, "internal error")
// clang-format on

typedef enum mha_status {
#define MHA_STATUS_ENUM_(name, value, text) MHA_STATUS_##name = value,
    MHA_STATUS_MAP(MHA_STATUS_ENUM_)
#undef MHA_STATUS_ENUM_
} mha_status;

/** Static English description of a status ("invalid argument"); never NULL. */
MHA_API const char *mha_status_string(mha_status status);

#define MHA_ERROR_MESSAGE_SIZE 512
/** Filled by every call the caller passes one to: a failing call writes the status and a message
 *  naming what was wrong, e.g. "config.num_heads=12 is not divisible by num_kv_heads=5"; a
 *  successful call clears it (status MHA_STATUS_OK, empty message), so a stale message never
 *  survives a later success. Caller-owned, so errors are thread-safe without any global or
 *  thread-local state. */
typedef struct mha_error {
    mha_status status;
    char message[MHA_ERROR_MESSAGE_SIZE];
} mha_error;

/** Optional allocator (NULL members = malloc/free). `alloc` returns memory aligned to `align`. */
typedef struct mha_allocator {
    void *user;
    void *(*alloc)(void *user, size_t bytes, size_t align);
    void (*free)(void *user, void *ptr);
} mha_allocator;

/* ---------------------------------------------------------------------------------------------- */
/* Element types (masks, file tensors).                                                           */
/* ---------------------------------------------------------------------------------------------- */
typedef enum mha_dtype {
    MHA_DTYPE_F32 = 0,
    MHA_DTYPE_F64 = 1,
    MHA_DTYPE_F16 = 2,
    MHA_DTYPE_BF16 = 3,
    MHA_DTYPE_BOOL = 4, /* one byte, 0 or 1 */
    MHA_DTYPE_U8 = 5,
    MHA_DTYPE_I32 = 6,
    MHA_DTYPE_I64 = 7,
    /* ggml's q8_0 block: per 32 values one float16 scale d then 32 int8 q, value = q * d (34
     * bytes per 32 values). Accepted ONLY as mha_kv_cache_config.dtype (docs/SEMANTICS.md "q8_0
     * KV cache") and mha_config.weight_dtype ("q8_0 weights": the projection matrices); every
     * other dtype field refuses it. */
    MHA_DTYPE_Q8_0 = 8,
    /* fp8 e4m3 (OCP "E4M3FN": 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; largest 448,
     * no infinities, NaN = S.1111.111) with a float32 scale per kv head, value = e4m3 * scale
     * (vLLM's fp8 KV cache). Accepted ONLY as mha_kv_cache_config.dtype (docs/SEMANTICS.md "fp8
     * KV cache"); every other dtype field refuses it. One byte per value. */
    MHA_DTYPE_FP8_E4M3 = 9,
    /* ggml's q4_0 block: per 32 values one float16 scale d then 16 bytes of 4-bit q (value i =
     * (q_i - 8) * d, q_i the low nibble of byte i < 16, else the high nibble of byte i - 16; 18
     * bytes per 32 values). Accepted ONLY as mha_config.weight_dtype (docs/SEMANTICS.md "q4_0
     * weights"); every other dtype field refuses it. */
    MHA_DTYPE_Q4_0 = 10,
} mha_dtype;

/** Size in bytes of one element of `dtype`, or 0 for an unknown value or a block type
 *  (MHA_DTYPE_Q8_0: 34 bytes per block of 32 values; MHA_DTYPE_Q4_0: 18; MHA_DTYPE_FP8_E4M3:
 *  1). */
MHA_API size_t mha_dtype_size(mha_dtype dtype);
/** float32 values to q8_0 blocks (docs/SEMANTICS.md "q8_0 KV cache": float16 scale f16(max|x| /
 *  127), q = clamp(rne(x / d), -127, 127), ties to even): count (a multiple of 32) values of src
 *  into count / 32 * 34 bytes at dst, e.g. the weights of a layer with weight_dtype
 *  MHA_DTYPE_Q8_0 (each matrix row of in_features values, in_features a multiple of 32). A block
 *  holding a NaN or an infinity stores a NaN scale (which mha_layer_create refuses).
 *  INVALID_ARG for a negative count or one not a multiple of 32, a NULL pointer, or dst
 *  overlapping src. */
MHA_API mha_status mha_q8_0_quantize(const float *src, int64_t count, void *dst, mha_error *err);
/** q8_0 blocks to float32: count (a multiple of 32) values, dst[i] = q_i * d of its block (exact).
 *  INVALID_ARG as mha_q8_0_quantize. */
MHA_API mha_status mha_q8_0_dequantize(const void *src, int64_t count, float *dst, mha_error *err);
/** float32 values to q4_0 blocks (docs/SEMANTICS.md "q4_0 weights": float16 scale f16(m / -8), m
 *  the block's value of largest |x|, q = clamp(rne(x / d) + 8, 0, 15), ties to even): count (a
 *  multiple of 32) values into count / 32 * 18 bytes at dst, e.g. the weights of a layer with
 *  weight_dtype MHA_DTYPE_Q4_0. A block holding a NaN or an infinity stores a NaN scale.
 *  INVALID_ARG as mha_q8_0_quantize. */
MHA_API mha_status mha_q4_0_quantize(const float *src, int64_t count, void *dst, mha_error *err);
/** q4_0 blocks to float32: dst[i] = (q_i - 8) * d of its block (exact). INVALID_ARG as
 *  mha_q8_0_quantize. */
MHA_API mha_status mha_q4_0_dequantize(const void *src, int64_t count, float *dst, mha_error *err);
/** float16 (MHA_DTYPE_F16) or bfloat16 (MHA_DTYPE_BF16) values to float32, exactly: dst[i] =
 *  src[i] for i < count. INVALID_ARG for another dtype, a negative count or a NULL pointer. */
MHA_API mha_status
mha_half_to_f32(mha_dtype dtype, const uint16_t *src, float *dst, int64_t count, mha_error *err);

#define MHA_MAX_MASK_DIMS 4
/** A C-contiguous tensor that broadcasts, NumPy style (dimensions aligned on the right, size 1
 *  repeats), to a target shape. Used for masks: target [B, h, n, m]; key padding: [B, m].
 *  data == NULL means "absent". */
typedef struct mha_mask_tensor {
    const void *data;
    mha_dtype dtype;
    int32_t ndim;
    int64_t shape[MHA_MAX_MASK_DIMS];
} mha_mask_tensor;

/* ---------------------------------------------------------------------------------------------- */
/* Masks and score modifiers shared by the layer and the core.                                    */
/* ---------------------------------------------------------------------------------------------- */

/** Alignment of query row i (of n) with key column j (of m): the row's "diagonal" position is
 *  p = i + delta. Causal attention allows j <= p; a window allows p - left <= j <= p + right;
 *  ALiBi adds -slope_h * |p - j|.
 *    BOTTOM_RIGHT (default): delta = m - n (FlashAttention >= 2.1, ONNX; equals tril when n == m;
 *                            what decoding with a KV cache needs).
 *    TOP_LEFT:               delta = 0 (PyTorch is_causal / F.scaled_dot_product_attention).
 *    EXPLICIT:               delta = align_offsets[b], one per batch row. */
typedef enum mha_alignment {
    MHA_ALIGN_BOTTOM_RIGHT = 0,
    MHA_ALIGN_TOP_LEFT = 1,
    MHA_ALIGN_EXPLICIT = 2,
} mha_alignment;

/** How a boolean/integer mask is read. Default: nonzero = MAY ATTEND (tril masks, Haiku, Equinox,
 *  F.scaled_dot_product_attention, ONNX). BLOCK: nonzero = masked out (nn.MultiheadAttention). */
typedef enum mha_mask_polarity {
    MHA_MASK_ATTEND = 0,
    MHA_MASK_BLOCK = 1,
} mha_mask_polarity;

/** The class of a tile of rows x keys under a mask (mha_mask_fn.classify; the library's block
 *  masks, docs/SEMANTICS.md "Block masks"). */
typedef enum mha_tile_class {
    MHA_TILE_HIDDEN = 0,  /* no row sees any key of the tile */
    MHA_TILE_VISIBLE = 1, /* every row sees every key */
    MHA_TILE_MIXED = 2,   /* anything else: asked per element */
} mha_tile_class;

/** A mask given as a function instead of an n x m tensor (prefix-LM, packed documents, trees:
 *  docs/SEMANTICS.md "Mask functions"). The library evaluates it once per call to build its block
 *  mask (a bit per score), so it costs no more than a tensor and skips what it hides. Both
 *  functions must be pure (same answer for the same arguments, for the whole call, and for the
 *  backward of that call) and may be called from several threads at once.
 *    visible(ctx, b, h, i, j):  nonzero when query row i of batch row b, query head h may see key
 *                               j (i < n, j < m: the call's own rows and keys).
 *    classify (optional):       the class of rows [i0, i1) x keys [j0, j1) of (b, h); HIDDEN and
 *                               VISIBLE must be exact (every element), MIXED is always allowed.
 *                               visible() is then asked only inside MIXED tiles.
 *  per_batch == 0: the answer does not depend on b (called with b = 0 only); per_head likewise
 *  for h. It combines with every other rule (a key is visible only if all rules allow it). */
typedef struct mha_mask_fn {
    int32_t (*visible)(void *ctx, int64_t b, int64_t h, int64_t i, int64_t j);
    mha_tile_class (*classify)(
        void *ctx, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1);
    void *ctx;
    int32_t per_batch;
    int32_t per_head;
} mha_mask_fn;

typedef struct mha_masking {
    int32_t causal;               /* nonzero: key j visible iff j <= i + delta */
    mha_alignment alignment;      /* how delta is chosen (also used by window and ALiBi) */
    const int64_t *align_offsets; /* [B], only with MHA_ALIGN_EXPLICIT */
    int64_t window_left;          /* sliding window; -1 = unbounded on that side */
    int64_t window_right;         /* both -1 (or use_window == 0): no window */
    int32_t use_window;
    mha_mask_tensor bool_mask; /* BOOL/U8/I32/I64, broadcast to [B, h, n, m] */
    mha_mask_polarity bool_mask_polarity;
    mha_mask_tensor
        additive_mask;            /* F32, broadcast to [B, h, n, m], added to scores; -inf blocks */
    mha_mask_tensor key_padding;  /* BOOL/U8/I32/I64 [B, m] or [m]; nonzero = real token */
    const int32_t *q_segment_ids; /* [B, n]: query i sees key j only if segments are equal */
    const int32_t *kv_segment_ids; /* [B, m]; both or neither */
    mha_mask_fn mask_fn;           /* visible == NULL: none */
    /* Chunked attention (Llama 4's attention_chunk_size); 0 = off, negative is an error. With
     * C = chunk_size > 0, query i (at position p = i + delta, the causal alignment's) sees key j
     * only if floor(j / C) == floor(p / C): causal + chunk_size is Llama 4's chunked causal mask.
     * ANDed with every other rule; a band like the window (fully hidden tiles are skipped). */
    int64_t chunk_size;
} mha_masking;

/** Dropout on the attention probabilities (training only). Element (b, h, i, j) is kept iff
 *  u >= p, with u = (philox4x32_10(counter = {J, I, h, b}, key = {seed lo, seed hi})[0] >> 8)
 *  * 2^-24, I = i + row_offset, J = j + col_offset; kept values are scaled by 1/(1-p).
 *  Independent of threads and blocking. The offsets (0 for a whole call) place a call that is one
 *  block of a larger attention (ring attention's pairs, chunked prefill) at its rows and columns
 *  of the whole, so the blocks draw exactly the whole's mask; each in [0, 2^32 - extent] (the
 *  counter holds I and J as 32-bit words). */
typedef struct mha_dropout {
    float p; /* in [0, 1) */
    uint64_t seed;
    int32_t training;   /* zero: inference, never drops */
    int64_t row_offset; /* I = i + row_offset */
    int64_t col_offset; /* J = j + col_offset */
} mha_dropout;

/** Which implementation runs. AUTO takes the fastest one that supports the request; REFERENCE
 *  is the plain loops (the oracle of every other kernel); FAST fails with MHA_STATUS_UNSUPPORTED
 *  (and a message naming the option) when the fast path cannot do the request. */
typedef enum mha_impl {
    MHA_IMPL_AUTO = 0,
    MHA_IMPL_REFERENCE = 1,
    MHA_IMPL_FAST = 2,
} mha_impl;

/** A persistent thread pool the caller owns: `size` threads in all, the calling thread being one
 *  of them (size - 1 workers are started once, at creation, and sleep between calls). Give it to
 *  calls through mha_exec.pool; a parallel call then starts no thread and allocates nothing for
 *  its threads. One pool may serve calls from several threads at once: they take turns (one
 *  parallel region at a time per pool; a call's other regions interleave with other callers').
 *  Results never depend on the pool or the thread count. Destroy it when no call is using it.
 *  A pool does not survive fork(): its workers exist in the parent only; a child makes its own. */
typedef struct mha_threadpool mha_threadpool;
/** n_threads: 0 = number of online CPUs; at most 1024. allocator: NULL = malloc/free (used for the
 *  pool's own memory, at creation only). *out is NULL on error. */
MHA_API mha_status mha_threadpool_create(int32_t n_threads,
                                         const mha_allocator *allocator,
                                         mha_threadpool **out,
                                         mha_error *err);
/** Stops and joins the workers, frees the pool. NULL is a no-op. */
MHA_API void mha_threadpool_destroy(mha_threadpool *pool);
/** Threads of the pool, the caller's included (>= 1); 0 for NULL. */
MHA_API int32_t mha_threadpool_size(const mha_threadpool *pool);

/** A caller-owned caching allocator for calls repeated with the same shapes, above all a training
 *  loop: mha_layer_forward_train and mha_layer_backward allocate their training state, scratch and
 *  GEMM packing buffers per call, and memory fresh from the OS is zeroed on first touch (through
 *  a cache, a layer training step (2048, 1024, 16) ran 1.03-1.05x faster on 1 thread and
 *  1.11-1.12x on 2 on AMD Zen 4). Put mha_block_cache_allocator(cache) in
 *  mha_exec.allocator: a block freed through it is kept and handed out again to a request of at
 *  least half its size, so steady-state calls touch no fresh page. Idle blocks beyond
 *  max_idle_bytes (0 = no cap) are returned to the system. Thread-safe (one mutex); results do
 *  not depend on it. Objects made with its allocator (training states, layers, KV caches) must be
 *  destroyed before the cache, which frees every block it holds. *out is NULL on error. */
typedef struct mha_block_cache mha_block_cache;
MHA_API mha_status mha_block_cache_create(size_t max_idle_bytes,
                                          mha_block_cache **out,
                                          mha_error *err);
/** The allocator to put in mha_exec.allocator (lives as long as the cache); NULL for NULL. It
 *  serves alignments up to 64 bytes (what the library asks) and returns NULL for larger ones. */
MHA_API const mha_allocator *mha_block_cache_allocator(const mha_block_cache *cache);
/** Bytes the cache holds, in use and idle; 0 for NULL. */
MHA_API size_t mha_block_cache_bytes(mha_block_cache *cache);
/** Frees every block and the cache. NULL is a no-op. */
MHA_API void mha_block_cache_destroy(mha_block_cache *cache);
/** Online CPUs (1 .. 1024): what n_threads = 0 means without a pool. */
MHA_API int32_t mha_default_threads(void);

/** Execution options of a call. A caller workspace may have any alignment: the size a
 *  *_workspace_size query reports (for the same args and exec) includes the slack for rounding
 *  it up to 64 bytes. With a caller workspace and a pool, mha_attention, mha_attention_backward
 *  and mha_layer_forward allocate nothing and start no thread; without a workspace they allocate
 *  it with `allocator` per call (reusing one workspace across calls saves the page faults of a
 *  fresh block every call); without a pool every parallel region starts its threads (and
 *  allocates their records) and joins them. */
typedef struct mha_exec {
    mha_impl impl;
    int32_t n_threads; /* 0 = the pool's size, or the number of online CPUs without a pool,
                          fewer for a call too small to keep them busy (under 2^22 flops per
                          thread); with a pool at most its size is used, without one at most
                          1024 (a larger value counts as 1024); negative is an error.
                          Results never depend on the number of threads. */
    void *workspace;   /* NULL: the library allocates (with `allocator`) */
    size_t workspace_bytes;
    const mha_allocator *allocator; /* NULL: malloc/free */
    mha_threadpool *pool;           /* NULL: threads started per parallel region */
} mha_exec;

/* ---------------------------------------------------------------------------------------------- */
/* RoPE                                                                                           */
/* ---------------------------------------------------------------------------------------------- */
typedef enum mha_rope_style {
    MHA_ROPE_NONE = 0,
    MHA_ROPE_INTERLEAVED = 1, /* pairs (2i, 2i+1): RoFormer, CS336, GPT-J, Meta's Llama code */
    MHA_ROPE_HALF = 2,        /* pairs (i, i + R/2): "rotate_half" of GPT-NeoX and HF Llama */
} mha_rope_style;

typedef enum mha_rope_scaling_type {
    MHA_ROPE_SCALING_NONE = 0,
    MHA_ROPE_SCALING_LINEAR = 1,   /* position interpolation: freq_i / factor */
    MHA_ROPE_SCALING_NTK = 2,      /* NTK-aware: theta' = theta * factor^(R/(R-2)) */
    MHA_ROPE_SCALING_LLAMA3 = 3,   /* Llama 3.1 per-wavelength blend */
    MHA_ROPE_SCALING_YARN = 4,     /* YaRN ramp + attention factor */
    MHA_ROPE_SCALING_DYNAMIC = 5,  /* dynamic NTK (transformers' "dynamic"): NTK at the length L
                                      of the call (1 + its largest position): factor' =
                                      factor L / original_max - (factor - 1) when L >
                                      original_max, unscaled otherwise (mha_rope_at_length) */
    MHA_ROPE_SCALING_LONGROPE = 6, /* LongRoPE (Phi-3 128k, Phi-3.5): f_k / long_factor[k] when
                                      the call's length L > original_max, f_k / short_factor[k]
                                      otherwise; cos and sin times attention_factor */
} mha_rope_scaling_type;

/** Most pairs (rotary_dim / 2) a LONGROPE rope can have factors for. */
#define MHA_ROPE_MAX_PAIRS 128

/** RoPE: pair k (k = 0 .. R/2-1, R = rotary_dim) has frequency f_k = theta^(-2k/R) (then the
 *  scaling below), angle = position * f_k, and (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos)
 *  with (a, b) = (2k, 2k+1) for INTERLEAVED and (k, k + R/2) for HALF. Dimensions >= R pass
 * through. Zeros in the scaling fields mean the documented defaults. */
typedef struct mha_rope {
    mha_rope_style style;
    double theta;       /* 0 = 10000 */
    int64_t rotary_dim; /* even, <= head_dim; 0 = head_dim */
    mha_rope_scaling_type scaling;
    double factor; /* > 0 for every scaling; 0 = 1 for LINEAR/NTK/DYNAMIC/LONGROPE, 8 for
                      LLAMA3 (LONGROPE: the context extension, max / original_max) */
    double original_max_position; /* LLAMA3 (0 = 8192), YARN (0 = 4096), DYNAMIC (required:
                                     transformers' max_position_embeddings), LONGROPE
                                     (required) */
    double low_freq_factor;       /* LLAMA3, 0 = 1 */
    double high_freq_factor;      /* LLAMA3, 0 = 4 */
    double beta_fast;             /* YARN, 0 = 32 */
    double beta_slow;             /* YARN, 0 = 1 */
    double attention_factor;      /* multiplies cos and sin: YARN, 0 = 0.1 ln(factor) + 1;
                                     LONGROPE, 0 = sqrt(1 + ln(factor) / ln(original_max)) (1 if
                                     factor <= 1); at most FLT_MAX (the rotated Q and K are
                                     float32) */
    int32_t yarn_no_truncate;     /* YARN: nonzero keeps the ramp ends unrounded (transformers'
                                     `truncate: false`, gpt-oss); 0 = floor/ceil them */
    /* LONGROPE: the divisors of f_k, k < rotary_dim / 2 (<= MHA_ROPE_MAX_PAIRS), each finite and
     * > 0: short_factor for calls of length <= original_max, long_factor beyond. */
    double short_factor[MHA_ROPE_MAX_PAIRS];
    double long_factor[MHA_ROPE_MAX_PAIRS];
} mha_rope;

/** Largest accepted token position (positions are in [0, MHA_MAX_POSITION]). */
#define MHA_MAX_POSITION ((int64_t)1 << 31)

/** Applies RoPE in place to x viewed as [B, L, H, D] with element strides x_strides (D stride 1).
 *  positions: element (b, t) at positions[b * pos_batch_stride + t]; pos_batch_stride = 0
 *  broadcasts one row over the batch; positions == NULL means t. A DYNAMIC rope is taken at
 *  length 1 + the largest position given (mha_rope_at_length). x_strides[0..2] may be negative
 *  (a view running backwards) but must not put two elements of x at one address; x's whole range
 *  must not overlap positions (INVALID_ARG), and
 *  offsets beyond int64 (of x or of positions) are MHA_STATUS_OVERFLOW. */
MHA_API mha_status mha_rope_apply(const mha_rope *rope,
                                  int64_t batch,
                                  int64_t seq_len,
                                  int64_t num_heads,
                                  int64_t head_dim,
                                  float *x,
                                  const int64_t x_strides[4],
                                  const int64_t *positions,
                                  int64_t pos_batch_stride,
                                  mha_error *err);

/** The (possibly scaled) inverse frequencies f_k, k = 0 .. rotary_dim/2-1, and the factor that
 *  multiplies cos and sin (1 except YaRN and LongRoPE). For inspection and tests. A DYNAMIC rope,
 *  or a LONGROPE one whose two lists differ, has no frequencies of its own (INVALID_ARG): take
 *  mha_rope_at_length first. */
MHA_API mha_status mha_rope_frequencies(
    const mha_rope *rope, int64_t head_dim, double *freqs, double *cos_sin_factor, mha_error *err);

/** The fixed rope a rope becomes for a call of length `length` (1 + its largest position): a
 *  DYNAMIC rope becomes NTK with factor' = factor length / original_max - (factor - 1) when
 *  length > original_max, and unscaled otherwise (transformers' dynamic NTK of a module that
 *  has seen no longer sequence); a LONGROPE rope gets the list of that length in both lists
 *  (its frequencies no longer depend on the length); any other rope comes back as it is,
 *  defaults filled in. The layer and decode calls and mha_rope_apply do this themselves with
 *  the length of the positions they rotate. */
MHA_API mha_status mha_rope_at_length(
    const mha_rope *rope, int64_t head_dim, int64_t length, mha_rope *out, mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* The attention core                                                                             */
/* ---------------------------------------------------------------------------------------------- */

/** Score pipeline for query row i, key j, head h (docs/SEMANTICS.md):
 *    s  = scale * q_i . k_j
 *    s  = softcap * tanh(s / softcap)                 if softcap > 0       (Gemma 2)
 *    s += additive_mask - alibi_slope_h * |i + delta - j|                  (ALiBi if alibi != 0)
 *    s  = -inf where any boolean rule blocks (causal, window, bool mask, key padding, segments)
 *    p_j = exp(s_j) / (exp(sink_h) + sum_j exp(s_j))   (sink term only when sinks != NULL)
 *    o_i = sum_j dropout(p_j) v_j
 *  A row whose scores are all -inf (fully masked) gives o_i = 0, p = 0 and lse = -inf (with
 *  sinks too: the sink term is not counted for such a row).
 *  lse_i = log(exp(sink_h) + sum_j exp(s_j)), i.e. p_j = exp(s_j - lse_i). */
typedef struct mha_attention_args {
    int64_t batch;        /* B */
    int64_t num_heads;    /* h (query heads) */
    int64_t num_kv_heads; /* g; h % g == 0; query head i reads kv head i / (h/g); 0 = h */
    int64_t q_len;        /* n */
    int64_t kv_len;       /* m */
    int64_t head_dim;     /* d_k */
    int64_t v_head_dim;   /* d_v; 0 = d_k */
    /* scale: 0 = 1/sqrt(d_k); otherwise |scale| in [FLT_MIN, FLT_MAX] (about [1.2e-38, 3.4e38]):
     * it multiplies the scores in float32, so a larger value (inf in float) or a smaller one
     * (0 or subnormal) is refused with INVALID_ARG; negative values are allowed. The product
     * scale * q.k itself must stay below FLT_MAX: the library does not scan activations, and a
     * score that overflows gives NaN in its row (the CLI reports such outputs). */
    double scale;
    double softcap;     /* 0 = off; otherwise in [FLT_MIN, FLT_MAX] (used as a float32) */
    int32_t alibi;      /* slopes 2^(-8(k+1)/h), BLOOM interpolation when h is not a power of 2 */
    const float *sinks; /* [h] or NULL */

    /* Tensors, viewed as [B, heads, L, d] with element strides {b, head, row, 1}, each stored
     * in its own dtype (below): float32 by default. */
    const void *q;
    int64_t q_strides[3];
    const void *k;
    int64_t k_strides[3];
    const void *v;
    int64_t v_strides[3];
    void *out; /* [B, h, n, d_v]; its strides must not put two elements at one address */
    int64_t out_strides[3];
    /* Storage dtype of each tensor: MHA_DTYPE_F32 (0, the default), MHA_DTYPE_BF16 or
     * MHA_DTYPE_F16, any mix (docs/SEMANTICS.md "Half precision"). The arithmetic is float32
     * whatever they are: inputs are widened exactly, out is rounded once to its dtype (nearest
     * even); lse and probs are always float32. */
    mha_dtype q_dtype, k_dtype, v_dtype, out_dtype;
    float *lse;   /* optional, contiguous [B, h, n] */
    float *probs; /* optional, contiguous [B, h, n, m], or [B, n, m] if average_probs */
    int32_t average_probs;

    mha_masking mask;
    mha_dropout dropout;
} mha_attention_args;

/** Workspace the core needs for `args` under `exec` (0 is possible). */
MHA_API mha_status mha_attention_workspace_size(const mha_attention_args *args,
                                                const mha_exec *exec,
                                                size_t *bytes,
                                                mha_error *err);
/** Returns MHA_STATUS_OK when the implementation in exec->impl can run `args`, otherwise
 *  MHA_STATUS_UNSUPPORTED / INVALID_ARG with a message naming the option. Does no work. */
MHA_API mha_status mha_attention_supported(const mha_attention_args *args,
                                           const mha_exec *exec,
                                           mha_error *err);
/** Runs the core. exec may be NULL (AUTO, all cores, library-allocated workspace). */
MHA_API mha_status mha_attention(const mha_attention_args *args,
                                 const mha_exec *exec,
                                 mha_error *err);

/** How a call's masks divide its scores into tiles (docs/SEMANTICS.md "Block masks"): tiles of 64
 *  query rows x 64 keys of every (batch row, query head), classified under every rule (causal,
 *  window, chunk, bool mask, key padding, segment ids, additive -inf, mask function) as the fast
 *  kernels do: HIDDEN tiles are skipped (no load, no exp), VISIBLE ones run the unmasked kernel,
 *  MIXED ones read a bit per score. */
typedef struct mha_mask_summary {
    int64_t tiles_hidden, tiles_visible, tiles_mixed;
    int64_t map_bytes;  /* memory of the call's block mask (0: no element rule, none is built) */
    int64_t map_planes; /* (batch row, head) planes it stores: 1 for a mask shared by all */
    int64_t map_rows;   /* query rows per plane: 1 when no rule depends on the row */
} mha_mask_summary;

/** Fills *out for `args` (the checks of mha_attention; q, k, v and out are not read and may be
 *  NULL, lse and probs are ignored). Costs one
 *  build of the block mask plus a pass over its words; scratch from exec->allocator. */
MHA_API mha_status mha_attention_mask_summary(const mha_attention_args *args,
                                              const mha_exec *exec,
                                              mha_mask_summary *out,
                                              mha_error *err);

/** A call's block mask built once for several calls: the forward and the backward of a training
 *  step, or every step that uses the same masks. Built from args' element rules (bool mask,
 *  additive mask, key padding, segment ids, mask function) for its (B, h, n, m); the causal,
 *  window and chunk bands stay each call's own. It keeps the POINTERS of those masks, not their
 *  contents: the caller keeps them alive and unchanged while the block mask is used. Memory from
 *  exec->allocator; q, k, v and out are not read (may be NULL). */
typedef struct mha_block_mask mha_block_mask;
MHA_API mha_status mha_block_mask_create(const mha_attention_args *args,
                                         const mha_exec *exec,
                                         mha_block_mask **out,
                                         mha_error *err);
/** NULL-safe. */
MHA_API void mha_block_mask_destroy(mha_block_mask *mask);
/** mha_attention with a block mask from mha_block_mask_create: INVALID_ARG when it was built for
 *  other sizes or other element rules (pointers, shapes, dtypes, polarity, mask function) than
 *  args'. Same results, bit for bit, as mha_attention. */
MHA_API mha_status mha_attention_masked(const mha_attention_args *args,
                                        const mha_block_mask *mask,
                                        const mha_exec *exec,
                                        mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Attention statistics, streamed (docs/SEMANTICS.md, "Attention statistics")                     */
/* ---------------------------------------------------------------------------------------------- */

/** What mha_attention_statistics computes; every output is caller-owned, contiguous, and NULL
 *  means "not wanted" (at least one must be given). P_ij is the probability of the forward with
 *  the same args (every mask, window, alignment, ALiBi, softcap, sink, GQA and scale; dropout is
 *  ignored: P is the probability before dropout, as the forward's probs output).
 *    received        [B, h, m]     r_j = sum_i P_ij (attention key j receives, per head)
 *    received_total  [B, m]        sum over the h heads of received (in head order)
 *    entropy         [B, h, n]     H_i = -sum_j P_ij ln P_ij - P_sink,i ln P_sink,i (natural log;
 *                                  the sink term only with sinks, P_sink,i = exp(sink_h - lse_i):
 *                                  the entropy of the whole softmax, the sink being one outcome);
 *                                  0 for a fully masked row
 *    topk_index      [B, h, n, k]  the k keys of highest P_ij, by P descending, equal P by the
 *    topk_prob       [B, h, n, k]  lower key index first; only visible keys (score > -inf) are
 *                                  listed; fewer than k visible keys: index -1 and P 0 after them
 *    pooled          [B, h, R, C]  mean of P over cell (r, c): query rows i with floor(i R / n) = r
 *                                  and keys j with floor(j C / m) = c (cells differ by at most one
 *                                  row or key in size; masked elements count as P = 0)
 *    pooled_visible  [B, h, R, C]  fraction of the cell's elements that are visible (score > -inf
 *                                  after every rule): 0 marks a fully masked cell, which a plot
 *                                  can tell apart from a mean probability of 0
 *  Sums are accumulated in double in an order that depends only on the sizes. */
typedef struct mha_attention_stats {
    float *received;
    float *received_total;
    float *entropy;
    int64_t top_k; /* k in [1, m] when topk_index or topk_prob is given */
    int64_t *topk_index;
    float *topk_prob;
    int64_t pool_rows; /* R in [1, n] when pooled or pooled_visible is given */
    int64_t pool_cols; /* C in [1, m] */
    float *pooled;
    float *pooled_visible;
} mha_attention_stats;

/** Statistics of the attention probabilities of `args` without storing any n x m matrix: per
 *  (batch, head) and block of query rows, one pass over the key tiles computes each row's
 *  log-sum-exp, a second pass recomputes P_ij = exp(s_ij - lse_i) tile by tile and accumulates
 *  the requested statistics. Memory beyond the inputs and outputs: B h m doubles (received), per
 *  thread one 64 x 256 score tile, 64 k top-k entries and R C doubles and counts (pooled). Only
 *  q, k and the score options of args are read: v, out, lse, probs and dropout are ignored (v
 *  and out may be NULL). Threads split the (batch, head) pairs; every output is computed in an
 *  order that does not depend on the thread count, so results are bit-identical for any
 *  n_threads. exec may be NULL; exec->workspace and exec->impl are not used (the scores go
 *  through the best GEMM tier of the CPU; scratch comes from exec->allocator).
 *  @return MHA_STATUS_OK, or an error with every output untouched. */
MHA_API mha_status mha_attention_statistics(const mha_attention_args *args,
                                            const mha_attention_stats *stats,
                                            const mha_exec *exec,
                                            mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* The layer                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/** Normalization of q and k inside the layer (docs/SEMANTICS.md "QK-norm"). Over a group x of
 *  G values: r = 1 / sqrt(sum(x^2) / G + eps), y = x r s, s = w (unit_offset = 0), 1 + w
 *  (unit_offset != 0: Gemma's scaling) or 1 (no weights); float32 arithmetic, the sum of squares
 *  accumulated in double. */
typedef enum mha_qk_norm_kind {
    MHA_QK_NORM_NONE = 0,
    /* RMSNorm of each head's q and k over head_dim, before RoPE; weights q_norm and k_norm [d_k]
     * (shared by the heads): Qwen3, Qwen3-MoE, Qwen3-Next, Gemma 3 */
    MHA_QK_NORM_RMS_HEAD = 1,
    /* RMSNorm over the whole projection before the head split, before RoPE; weights q_norm
     * [h*d_k] and k_norm [g*d_k]: OLMo 2 */
    MHA_QK_NORM_RMS_ALL = 2,
    /* weightless x / sqrt(mean(x^2) + eps) of each head's q and k over head_dim AFTER RoPE (a
     * layer without RoPE: after the projection): Llama 4 use_qk_norm (Llama4TextL2Norm) */
    MHA_QK_NORM_L2_AFTER_ROPE = 3,
} mha_qk_norm_kind;

typedef struct mha_qk_norm {
    mha_qk_norm_kind kind;
    double eps;          /* finite, in (0, FLT_MAX] when kind != NONE */
    int32_t unit_offset; /* nonzero: scale by (1 + w) (Gemma 3, Qwen3-Next); RMS kinds only */
} mha_qk_norm;

/** Attention temperature tuning (Llama 4's NoPE layers; docs/SEMANTICS.md "Temperature
 *  tuning"): the query row at position p (the RoPE position: q_positions, t when NULL, the cache
 *  position in decode) is multiplied by
 *      tau(p) = ln(floor((fl32(p) + 1) / fl32(floor_scale)) + 1) * attn_scale + 1
 *  (the sum, quotient and floor in float32, as transformers forms them; the rest in double,
 *  rounded once to float32) after the projection, RoPE and any QK-norm, before the core. */
typedef struct mha_temperature_tuning {
    int32_t enabled;    /* nonzero: on; 0: off, the other fields ignored */
    double floor_scale; /* in [2^-32, FLT_MAX] when enabled (Llama 4: 8192) */
    double attn_scale;  /* finite, |attn_scale| <= 2^100 when enabled (Llama 4: 0.1) */
} mha_temperature_tuning;

/** Layer configuration. Zero means "default" for every optional field, so
 *  `mha_config c = {0}; c.q_dim = 512; c.num_heads = 8;` is a valid self-attention layer. */
typedef struct mha_config {
    int64_t q_dim;                          /* query input features (required) */
    int64_t k_dim;                          /* key input features; 0 = q_dim */
    int64_t v_dim;                          /* value input features; 0 = k_dim */
    int64_t num_heads;                      /* h (required) */
    int64_t num_kv_heads;                   /* g; 0 = h */
    int64_t head_dim;                       /* d_k; 0 = q_dim / h (must divide) */
    int64_t v_head_dim;                     /* d_v; 0 = d_k */
    int64_t out_dim;                        /* 0 = q_dim */
    int32_t bias_q, bias_k, bias_v, bias_o; /* nonzero: that projection has a bias */
    int32_t sinks;                          /* nonzero: learned per-head attention sink logits */
    double scale;   /* 0 = 1/sqrt(d_k); else |scale| in [FLT_MIN, FLT_MAX] (mha_attention_args) */
    double softcap; /* 0 = off; else in [FLT_MIN, FLT_MAX] */
    int32_t alibi;
    mha_rope rope; /* style NONE = no RoPE */
    /* Storage dtype of every tensor of mha_weights (projections, biases, sinks): MHA_DTYPE_F32
     * (0, the default), MHA_DTYPE_BF16 or MHA_DTYPE_F16. The arithmetic is float32 whatever it
     * is: weights are widened exactly where they are read (docs/SEMANTICS.md "Half precision").
     * MHA_DTYPE_Q8_0: the four projection matrices in q8_0 blocks (each row in_features / 32
     * blocks; q_dim, k_dim, v_dim and h*v_head_dim multiples of 32), the biases, sinks and QK-norm
     * weights float32; exactly the float32 layer on the dequantised weights (the AVX2 tier's
     * products of at most 4 rows, e.g. a decode step: in the block-sum order, the same bound, not
     * its bits); inference only (docs/SEMANTICS.md "q8_0 weights"). MHA_DTYPE_Q4_0 likewise in
     * q4_0 blocks (18 bytes per 32 weights): bit-identical to the q8_0 layer holding the same
     * values (docs/SEMANTICS.md "q4_0 weights"). */
    mha_dtype weight_dtype;
    mha_qk_norm qk_norm; /* kind NONE (0) = no normalization of q and k */
    /* nonzero: an output gate (Qwen3-Next): w_q has 2*h*d_k rows, the first h*d_k the query's and
     * the next h*d_k the gate's (b_q likewise [2*h*d_k]); the output projection reads
     * A * sigmoid(x W_gate^T + b_gate) instead of A. Needs v_head_dim = head_dim. */
    int32_t output_gate;
    mha_temperature_tuning temperature; /* enabled 0 = off (every earlier caller) */
} mha_config;

/** Weights in PyTorch nn.Linear layout (y = x W^T + b). Rows [i*d_k, (i+1)*d_k) of w_q belong to
 *  head i. Biases must be given exactly when the config enables them. Every tensor is stored in
 *  config.weight_dtype (float32 by default: float arrays). */
typedef struct mha_weights {
    const void *w_q; /* [h*d_k, q_dim] */
    const void *w_k; /* [g*d_k, k_dim] */
    const void *w_v; /* [g*d_v, v_dim] */
    const void *w_o; /* [out_dim, h*d_v] */
    const void *b_q, *b_k, *b_v, *b_o;
    const void *sinks; /* [h] */
    /* QK-norm weights (config.qk_norm): [d_k] each for RMS_HEAD, [h*d_k] and [g*d_k] for
     * RMS_ALL; given exactly when the kind has weights (NULL for NONE and L2_AFTER_ROPE). */
    const void *q_norm, *k_norm;
} mha_weights;

typedef enum mha_ownership {
    MHA_WEIGHTS_COPY = 0, /* the layer keeps its own copy, in config.weight_dtype */
    MHA_WEIGHTS_BORROW =
        1, /* the layer keeps the pointers; caller keeps them alive and unchanged */
} mha_ownership;

typedef struct mha_layer mha_layer;

/** Creates a layer. Validates the config (divisibility, sizes, overflow) and the weights (non-NULL,
 *  finite: a NaN or Inf weight is refused with its tensor and index). *out is NULL on error. */
MHA_API mha_status mha_layer_create(const mha_config *config,
                                    const mha_weights *weights,
                                    mha_ownership ownership,
                                    const mha_allocator *allocator,
                                    mha_layer **out,
                                    mha_error *err);
/** NULL-safe. */
MHA_API void mha_layer_destroy(mha_layer *layer);
/** The resolved configuration (every default filled in). */
MHA_API const mha_config *mha_layer_config(const mha_layer *layer);
/** The weights the layer uses (its copy, or the borrowed pointers), in config.weight_dtype. */
MHA_API const mha_weights *mha_layer_weights(const mha_layer *layer);

typedef struct mha_forward_args {
    int64_t batch;              /* B */
    int64_t q_len;              /* n */
    int64_t kv_len;             /* m; ignored (= n) for self-attention */
    const void *query;          /* [B, n, q_dim] */
    const void *key;            /* [B, m, k_dim]; NULL = self-attention (key = value = query) */
    const void *value;          /* [B, m, v_dim]; NULL = key */
    const int64_t *q_positions; /* [B, n] RoPE positions; NULL = 0..n-1 */
    const int64_t *k_positions; /* [B, m]; NULL = q_positions for self-attention, else 0..m-1 */
    mha_masking mask;
    mha_dropout dropout;
    void *out;    /* [B, n, out_dim] */
    float *probs; /* optional [B, h, n, m], or [B, n, m] if average_probs; always float32 */
    int32_t average_probs;
    /* Storage dtypes: x_dtype of query, key and value, out_dtype of out; MHA_DTYPE_F32 (0, the
     * default), MHA_DTYPE_BF16 or MHA_DTYPE_F16, independent of the layer's weight_dtype. The
     * arithmetic is float32; Q, K, V, the attention output are stored in float32, except when
     * x_dtype equals a half weight_dtype (a bf16/f16 module): then each is rounded once to that
     * dtype, as PyTorch's bf16 module stores them (docs/SEMANTICS.md "Half precision in the
     * layer"); out is rounded once to out_dtype.
     * mha_layer_backward's dy has out_dtype and its d_query / d_key / d_value have x_dtype. */
    mha_dtype x_dtype, out_dtype;
} mha_forward_args;

MHA_API mha_status mha_layer_forward_workspace_size(const mha_layer *layer,
                                                    const mha_forward_args *args,
                                                    const mha_exec *exec,
                                                    size_t *bytes,
                                                    mha_error *err);
MHA_API mha_status mha_layer_forward_supported(const mha_layer *layer,
                                               const mha_forward_args *args,
                                               const mha_exec *exec,
                                               mha_error *err);
/** y = (concat_h Attn_h(RoPE(x_q W_q^T + b_q), RoPE(x_k W_k^T + b_k), x_v W_v^T + b_v)) W_o^T + b_o
 */
MHA_API mha_status mha_layer_forward(const mha_layer *layer,
                                     const mha_forward_args *args,
                                     const mha_exec *exec,
                                     mha_error *err);

/** mha_attention_statistics of the layer's attention for the forward `args` (the same
 *  projections, RoPE, masks and options as mha_layer_forward): Q and K are projected (B (n h +
 *  m g) d_k floats of scratch from exec->allocator; exec->impl chooses the projections' code as
 *  in the forward; V and the output projection are not computed), then the core's statistics
 *  run. args->out, probs and dropout are ignored (out may
 *  be NULL). Shapes as in mha_attention_stats, with h = the layer's heads. */
MHA_API mha_status mha_layer_attention_statistics(const mha_layer *layer,
                                                  const mha_forward_args *args,
                                                  const mha_attention_stats *stats,
                                                  const mha_exec *exec,
                                                  mha_error *err);

/** The layer's four linear maps, for callers that run the layer's steps themselves (the
 *  distributed layer of mha_mpi.h projects each rank's rows with them). */
typedef enum mha_projection {
    MHA_PROJ_Q = 0, /* x [rows, q_dim]      -> [rows, h*d_k]  (w_q, b_q) */
    MHA_PROJ_K = 1, /* x [rows, k_dim]      -> [rows, g*d_k]  (w_k, b_k) */
    MHA_PROJ_V = 2, /* x [rows, v_dim]      -> [rows, g*d_v]  (w_v, b_v) */
    MHA_PROJ_O = 3, /* A [rows, h*d_v]      -> [rows, out_dim] (w_o, b_o) */
} mha_projection;

/** One of the layer's projections on `rows` rows: y = x W^T (+ b if the layer has that bias),
 *  x and y contiguous row-major float32 (the weights in the layer's weight_dtype, widened), exactly
 * the arithmetic mha_layer_forward runs for that step (the packed GEMM, or plain loops with
 * impl=REFERENCE). No RoPE: apply mha_rope_apply to the Q and K rows with their positions. y must
 * not alias x. exec may be NULL; exec->workspace is not used (packing space comes from
 * exec->allocator).
 *  @return MHA_STATUS_OK, or an error (bad argument, overflow, out of memory) with y untouched. */
MHA_API mha_status mha_layer_project(const mha_layer *layer,
                                     mha_projection which,
                                     int64_t rows,
                                     const float *x,
                                     float *y,
                                     const mha_exec *exec,
                                     mha_error *err);

/** Backward of mha_layer_project: given dy = dL/dy [rows, out] of y = x W^T + b (x [rows, in]),
 *    dx = dy W  [rows, in]      dW = dy^T x  [out, in]      db = sum over rows of dy  [out]
 *  each written (accumulate == 0) or added (nonzero) when not NULL; db only when the layer has that
 *  bias. x is needed only for dW. Buffers must not alias each other, x or dy. The products are the
 *  ones mha_layer_backward runs (the packed GEMM reading the operands in place, or plain loops
 *  with impl=REFERENCE). exec may be NULL; scratch comes from exec->allocator.
 *  @return MHA_STATUS_OK, or an error with every output untouched. */
MHA_API mha_status mha_layer_project_backward(const mha_layer *layer,
                                              mha_projection which,
                                              int64_t rows,
                                              const float *x,
                                              const float *dy,
                                              float *dx,
                                              float *dw,
                                              float *db,
                                              int32_t accumulate,
                                              const mha_exec *exec,
                                              mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Files                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

/** Explicit tensor names: each a stem to which ".weight" / ".bias" are appended. NULL members use
 *  the built-in search (docs/FORMATS.md): HF (q_proj/k_proj/v_proj/o_proj), PyTorch
 *  nn.MultiheadAttention (in_proj_weight, ...), CS336 (q_proj_weight, ...). */
typedef struct mha_name_map {
    const char *q, *k, *v, *o;
    const char *sinks; /* full tensor name of the sink logits; NULL = "sinks" if present */
} mha_name_map;

/** Loads a layer from a safetensors file (F32/F64/F16/BF16 tensors).
 *  `config` gives num_heads (required), num_kv_heads (0 = inferred from the shapes), every
 *  non-size option (scale, rope, softcap, alibi) and weight_dtype, the storage of the layer's
 *  weights (F32 default, BF16 or F16): a tensor already in it is copied as its file bytes (never
 *  widened), any other is rounded once to nearest even (docs/FORMATS.md, "safetensors"); a value
 *  beyond the half's range is BAD_FILE. Sizes and biases are inferred from the tensor shapes and
 *  checked against it. `prefix` (may be NULL) is prepended to every name. The file is untrusted:
 *  every offset and size is checked. */
MHA_API mha_status mha_layer_load_safetensors(const char *path,
                                              const char *prefix,
                                              const mha_name_map *names,
                                              const mha_config *config,
                                              const mha_allocator *allocator,
                                              mha_layer **out,
                                              mha_error *err);

/** What a Hugging Face model directory says about the attention of one layer
 *  (mha_hf_layer_info_read; docs/MODELS.md has the table per `model_type`). */
#define MHA_HF_TEXT_SIZE 128
typedef struct mha_hf_layer_info {
    char model_type[MHA_HF_TEXT_SIZE]; /* config.json's model_type, e.g. "llama" */
    char layout[MHA_HF_TEXT_SIZE];     /* how the projections are stored, e.g. "fused qkv_proj" */
    char prefix[MHA_HF_TEXT_SIZE];     /* the layer's tensor name prefix, e.g.
                                          "model.layers.0.self_attn." */
    int64_t layer;                     /* the layer asked for */
    int64_t num_layers;                /* num_hidden_layers */
    mha_config config;    /* heads, kv heads, sizes, biases, scale, softcap, RoPE, sinks */
    int32_t causal;       /* nonzero: decoder self-attention (causal, bottom-right aligned) */
    int32_t use_window;   /* nonzero: this layer has a sliding window ... */
    int64_t window_left;  /* ... of keys i - window_left .. i (HF's sliding_window - 1) */
    int64_t window_right; /* ... and 0 on the right */
    int64_t chunk_size;   /* > 0: chunked causal attention (Llama 4's attention_chunk_size): pass
                             it as mha_masking.chunk_size (and mha_kv_cache_config.chunk_size);
                             0: none */
} mha_hf_layer_info;

/** Reads `dir`/config.json (and the safetensors index or file, to find the layer's tensor names)
 *  and fills `info` with every attention option the config implies for layer `layer`. A
 *  model_type it does not know, or a config field that changes the attention in a way mha cannot
 *  reproduce, is MHA_STATUS_UNSUPPORTED with a message naming the field; malformed files are
 *  BAD_FILE. config.json is untrusted: every field is type- and range-checked. */
MHA_API mha_status mha_hf_layer_info_read(const char *dir,
                                          int64_t layer,
                                          mha_hf_layer_info *info,
                                          mha_error *err);

/** Loads layer `layer`'s attention from the model directory `dir` (model.safetensors, or the
 *  shards listed by model.safetensors.index.json). Fused projections are split (GPT-2's
 *  transposed Conv1D c_attn, GPT-NeoX's per-head interleaved query_key_value, Phi-3's qkv_proj,
 *  Falcon's layouts). `config` NULL takes the options from mha_hf_layer_info_read(); otherwise it
 *  is that info's config with the caller's changes (heads, kv heads and head_dim decide how fused
 *  tensors are split; scale, softcap, alibi, rope and sinks are taken as given; weight_dtype is
 *  the weights' storage as in mha_layer_load_safetensors: set it to MHA_DTYPE_BF16 to keep a bf16
 *  checkpoint's bytes; the info's is MHA_DTYPE_F32 whatever the checkpoint's torch_dtype). */
MHA_API mha_status mha_hf_layer_load(const char *dir,
                                     int64_t layer,
                                     const mha_config *config,
                                     const mha_allocator *allocator,
                                     mha_layer **out,
                                     mha_error *err);

/** What a GGUF file (llama.cpp's format, versions 2 and 3) says about the attention of layer
 *  `layer`, in the HF info's fields: model_type is general.architecture (llama, mistral, qwen2,
 *  qwen3, phi3), prefix "blk.L.", num_layers {arch}.block_count; heads, kv heads, head_dim,
 *  biases, RoPE (theta, rotary dims, linear scaling, YaRN, Llama 3's rope_freqs.weight as
 *  LONGROPE with equal lists, Phi-3's rope_factors_short/long.weight as LONGROPE; style HALF: see
 *  mha_layer_load_gguf), phi3's fused attn_qkv (its [q; k; v] row blocks), QK-norm
 *  (qwen3), causal, and the sliding window ({arch}.attention.sliding_window - 1 on the left) as
 *  mha_hf_layer_info_read gives them (docs/MODELS.md "GGUF"). An architecture or option mha
 *  cannot reproduce is UNSUPPORTED naming it; a malformed file is BAD_FILE naming the problem.
 *  The file is untrusted: every count, length, offset and size is checked against its size. */
MHA_API mha_status mha_gguf_layer_info_read(const char *path,
                                            int64_t layer,
                                            mha_hf_layer_info *info,
                                            mha_error *err);

/** Loads layer `layer`'s attention from the GGUF file `path` (blk.L.attn_q/k/v/output.weight,
 *  or for phi3 the fused blk.L.attn_qkv.weight whose row blocks [q (h d); k (g d); v (g d)] are
 *  read as q, k and v, each in the types below as any projection; the biases and
 *  attn_q_norm/attn_k_norm when present). Tensors of type F32, F16 and BF16 are
 *  stored in config->weight_dtype (a tensor already in it keeps its bytes, any other is rounded
 *  once to nearest even, as mha_layer_load_safetensors does; mixed types are fine); Q8_0 is
 *  dequantised to float32 (exact) and then stored likewise, as are the other block types
 *  docs/SEMANTICS.md "GGUF quantised types" lists; any other type is UNSUPPORTED naming it. llama
 * and mistral files have their Q and K rows (and biases) permuted by llama.cpp's converter to pair
 * rotary dimensions (2j, 2j+1): the permutation is undone, so the layer is the HF checkpoint's,
 * with HALF (rotate_half) RoPE. `config` NULL takes the options from mha_gguf_layer_info_read();
 * otherwise as in mha_hf_layer_load (set weight_dtype to MHA_DTYPE_BF16 or F16 to keep a half
 * file's bytes; the info's is MHA_DTYPE_F32). With weight_dtype MHA_DTYPE_Q8_0 the projections'
 * Q8_0 blocks are kept as the file holds them (other types quantised by mha_q8_0_quantize; biases
 * and norms float32); with MHA_DTYPE_Q4_0 the Q4_0 blocks are kept and other types quantised by
 * mha_q4_0_quantize. */
MHA_API mha_status mha_layer_load_gguf(const char *path,
                                       int64_t layer,
                                       const mha_config *config,
                                       const mha_allocator *allocator,
                                       mha_layer **out,
                                       mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Training: backward                                                                             */
/* (docs/TRAINING.md: formulas, ownership, accumulate semantics, tolerances)                      */
/* ---------------------------------------------------------------------------------------------- */

/** Gradient buffers of the attention core. Views and strides as in mha_attention_args
 *  ([B, heads, L, d] with element strides {b, head, row}, last dimension contiguous):
 *    dout: [B, h, n, d_v]  the upstream gradient dL/dO (required, read only)
 *    dq:   [B, h, n, d_k]  dL/dQ      dk: [B, g, m, d_k]  dL/dK      dv: [B, g, m, d_v]  dL/dV
 *    dsinks: [h]           dL/dsinks (only when the forward had sinks)
 *  Each of dq, dk, dv, dsinks may be NULL: that gradient is not computed. With GQA/MQA, dk and
 *  dv of kv head g are the sums over the h/g query heads that read it.
 *  accumulate == 0: every requested gradient is OVERWRITTEN; nonzero: the gradient is ADDED to
 *  what the buffer holds (llm.c style += made explicit). Gradient buffers must not alias each
 *  other, themselves (strides putting two elements at one address) or any forward tensor. */
typedef struct mha_attention_grads {
    const void *dout;
    int64_t dout_strides[3];
    void *dq;
    int64_t dq_strides[3];
    void *dk;
    int64_t dk_strides[3];
    void *dv;
    int64_t dv_strides[3];
    float *dsinks;
    int32_t accumulate;
    /* Storage dtypes as in mha_attention_args (0 = float32). Gradients are accumulated in
     * float32 and rounded once to their dtype; with accumulate, the sum old + new is formed in
     * float32 and rounded once. */
    mha_dtype dout_dtype, dq_dtype, dk_dtype, dv_dtype;
    /* Optional upstream gradient of the forward's log-sum-exp, dL/dlse: float32, contiguous
     * [B, h, n] like fwd->lse. NULL = the loss does not read lse (dlse = 0). Used when lse feeds
     * the loss, e.g. when partial attentions are merged by their lse (mha_attention_merge). */
    const float *dlse;
    /* Optional upstream gradient of the forward's probabilities, dL/dprobs: float32, contiguous in
     * fwd->probs' layout, [B, h, n, m], or [B, n, m] when fwd->average_probs (each head then gets
     * dprobs / h). NULL = the loss does not read the probabilities. fwd->probs itself is not read:
     * the probabilities are recomputed. */
    const float *dprobs;
} mha_attention_grads;

/** Workspace mha_attention_backward needs for (fwd, grads) under exec (O(threads * m * d), never
 *  n x m). */
MHA_API mha_status mha_attention_backward_workspace_size(const mha_attention_args *fwd,
                                                         const mha_attention_grads *grads,
                                                         const mha_exec *exec,
                                                         size_t *bytes,
                                                         mha_error *err);

/** Backward of the attention core. `fwd` describes the forward call exactly as it ran: sizes,
 *  q, k, v, every mask, scale, softcap, alibi, sinks and the same dropout (seed, p, training),
 *  plus the forward's results: fwd->out (O, read) and fwd->lse (the log-sum-exp the forward
 *  wrote, REQUIRED, read). fwd->probs is ignored. The probabilities are recomputed tile by tile
 *  as P = exp(S - lse) (and the dropout mask regenerated from its seed); nothing n x m is stored.
 *    dV_j = sum_i z_ij P_ij dO_i        dP_ij = z_ij dO_i . V_j + G_ij
 *    D_i = dO_i . O_i - dlse_i + sum_k P_ik G_ik
 *    dS_ij = P_ij (dP_ij - D_i)  (times 1 - tanh^2 under softcap)
 *    dQ_i = scale sum_j dS_ij K_j       dK_j = scale sum_i dS_ij Q_i
 *    dsink_h = -sum_{b,i} P_sink,i D_i  with P_sink,i = exp(sink_h - lse_i)
 *  (z_ij = dropout keep / (1 - p) or 0; dlse_i = grads->dlse's element, 0 without it: since
 *  d lse_i / d S_ij = P_ij and d lse_i / d sink_h = P_sink,i, the lse's gradient only shifts D;
 *  G_ij = grads->dprobs' element (/ h when averaged), 0 without it: the softmax's own derivative,
 *  at the cost of one more pass of S = Q K^T when given).
 *  Fully masked rows (lse = -inf) contribute nothing:
 *  their dQ is 0, never NaN. Results are bit-identical for any n_threads. exec may be NULL.
 *  @return MHA_STATUS_OK, or an error with outputs untouched. */
MHA_API mha_status mha_attention_backward(const mha_attention_args *fwd,
                                          const mha_attention_grads *grads,
                                          const mha_exec *exec,
                                          mha_error *err);

/** mha_attention_backward with the forward's block mask (mha_attention_masked). */
MHA_API mha_status mha_attention_backward_masked(const mha_attention_args *fwd,
                                                 const mha_attention_grads *grads,
                                                 const mha_block_mask *mask,
                                                 const mha_exec *exec,
                                                 mha_error *err);

/** What a training forward saved for the backward (opaque). It owns float copies of the
 *  post-RoPE Q [B, n, h*d_k], K [B, m, g*d_k], the V [B, m, g*d_v], the concatenated attention
 *  output A [B, n, h*d_v] and the log-sum-exp [B, h, n]: O((n + m) * d) floats, never n x m.
 *  It also remembers the mha_forward_args by value, i.e. the POINTERS to the inputs (query, key,
 *  value, positions, masks, segment ids): the caller keeps those alive and unchanged until the
 *  last mha_layer_backward with this state. It is tied to the layer it was made with. */
typedef struct mha_train_state mha_train_state;

/** Forward in training mode: the same outputs as mha_layer_forward (args->out, args->probs) and
 *  a new *state for mha_layer_backward (free it with mha_train_state_destroy). Dropout, if
 *  args->dropout.training, is applied exactly as in mha_layer_forward and regenerated from its
 *  seed by the backward. *state is NULL on error. Memory comes from exec->allocator
 *  (exec->workspace is not used). */
MHA_API mha_status mha_layer_forward_train(const mha_layer *layer,
                                           const mha_forward_args *args,
                                           const mha_exec *exec,
                                           mha_train_state **state,
                                           mha_error *err);

/** Gradient buffers of the layer (all caller-owned, each may be NULL = not wanted), shapes as the
 *  tensors they differentiate:
 *    d_query [B, n, q_dim]; d_key [B, m, k_dim]; d_value [B, m, v_dim]
 *    dw_q [h*d_k, q_dim], dw_k [g*d_k, k_dim], dw_v [g*d_v, v_dim], dw_o [out_dim, h*d_v]
 *    db_q [h*d_k], db_k [g*d_k], db_v [g*d_v], db_o [out_dim]   (only if the layer has that bias)
 *    d_sinks [h]                                                (only if the layer has sinks)
 *  Self-attention (forward key == NULL): one input fed all three projections, so d_query
 *  receives the SUM of the query, key and value paths; d_key and d_value must be NULL. Cross-
 *  attention with value == NULL (value = key): d_key receives the key and value paths; d_value
 *  must be NULL. accumulate == 0 overwrites every requested buffer; nonzero adds into it.
 *  Dtypes: d_query, d_key, d_value have the forward's x_dtype (a gradient has its tensor's dtype,
 *  as in PyTorch; accumulate adds in float32 and rounds once); the weight, bias and sink
 *  gradients are float32 whatever the layer's weight_dtype (mixed precision's master weights). */
typedef struct mha_layer_grads {
    void *d_query, *d_key, *d_value; /* of the training forward's x_dtype */
    float *dw_q, *dw_k, *dw_v, *dw_o;
    float *db_q, *db_k, *db_v, *db_o;
    float *d_sinks;
    int32_t accumulate;
    float *d_q_norm, *d_k_norm; /* the QK-norm weights' gradients (shapes of q_norm, k_norm) */
    /* Optional dL/dprobs of the training forward's probabilities (a loss that reads the attention
     * weights, e.g. attention distillation): float32, contiguous in args->probs' layout, [B, h, n,
     * m] or [B, n, m] with average_probs (mha_attention_grads.dprobs). NULL = not read. */
    const float *d_probs;
} mha_layer_grads;

/** Backward of the layer given dy = dL/dy [B, n, out_dim] (of the forward's out_dtype) and the
 * state of the training forward that produced y (RoPE's backward is the transposed rotation). The
 * state is not modified: the same state may be used for several backward calls. exec may be NULL;
 * exec->workspace is not used (scratch of O((n + m) d + weights) floats comes from
 * exec->allocator). Bit-identical results for any n_threads.
 *  @return MHA_STATUS_OK, or an error with every gradient buffer untouched (every check runs
 *  first; only an out-of-memory inside a later product can leave them partly written). */
MHA_API mha_status mha_layer_backward(const mha_layer *layer,
                                      const mha_train_state *state,
                                      const void *dy,
                                      const mha_layer_grads *grads,
                                      const mha_exec *exec,
                                      mha_error *err);

/** Frees a training state. NULL-safe. */
MHA_API void mha_train_state_destroy(mha_train_state *state);

/* ---------------------------------------------------------------------------------------------- */
/* Inference: KV cache                                                                            */
/* ---------------------------------------------------------------------------------------------- */
/* Autoregressive decoding (docs/INFERENCE.md). A cache holds post-RoPE K and V of up to max_seq
 * positions for each of `batch` sequences, in float32, float16 or bfloat16 (compute is always
 * float32). Position p of a sequence is its p-th appended token; RoPE is applied at p. New tokens
 * attend causally to the sequence's cache, bottom-right aligned: the result equals the full
 * causal forward over the whole sequence (same options, positions 0..L-1).
 *
 * Thread-safety: a cache is mutable. Calls that append to, reset, truncate or copy sequences of
 * one cache must not run concurrently with any other call on that cache; read-only calls
 * (length, attention without append, read) may run concurrently with each other. */

/** Creation parameters. Zero means "default" where stated. */
typedef struct mha_kv_cache_config {
    int64_t num_kv_heads;    /* g; 0 = the layer's (mha_kv_cache_create with a layer) */
    int64_t head_dim;        /* d_k; 0 = the layer's */
    int64_t v_head_dim;      /* d_v; 0 = the layer's, or head_dim without a layer */
    int64_t max_seq;         /* most positions per sequence (required, in [1, 2^31]) */
    int64_t batch;           /* number of sequences, ids 0 .. batch-1 (required) */
    mha_dtype dtype;         /* storage: MHA_DTYPE_F32 (0, default), MHA_DTYPE_F16, MHA_DTYPE_BF16,
                                MHA_DTYPE_Q8_0 (head_dim and v_head_dim multiples of 32) or
                                MHA_DTYPE_FP8_E4M3 (scales: mha_kv_cache_set_fp8_scales) */
    int64_t window;          /* 0 = none. W > 0: sliding window, a token at p attends to the keys
                                p-W+1 .. p only (the full forward's window (W-1, 0), Mistral's
                                sliding_window = W); storage is then a ring of
                                min(max_seq, W + max_step_tokens - 1) slots per sequence */
    int64_t max_step_tokens; /* window caches: most tokens one mha_kv_cache_append may add to a
                                sequence (the layer calls split longer inputs); 0 = 64 */
    int64_t chunk_size; /* 0 = none. C > 0: chunked attention (Llama 4), a token at p attends to
                           the keys C floor(p / C) .. p only (mha_masking.chunk_size); storage is
                           then a ring like a window-C cache's (ANDed with window if both) */
    int64_t block_size; /* 0 = contiguous storage (one block of `slots` rows per sequence, as
                           before pages). B in [16, 65536]: PAGED, storage in blocks of B slots
                           from a pool, a block table per sequence, blocks shared by
                           mha_kv_cache_copy / _share_prefix and copied on write
                           (docs/INFERENCE.md "Paged cache") */
    int64_t num_blocks; /* paged: blocks in the pool; 0 = batch x ceil(slots / B) (every sequence
                           at full length). Must be 0 for a contiguous cache. */
} mha_kv_cache_config;

typedef struct mha_kv_cache mha_kv_cache;

/** Creates an empty cache (every sequence has length 0). With `layer` != NULL the head sizes
 *  default to the layer's and nonzero ones must match it. Storage: K [batch, g, slots, d_k] and
 *  V [batch, g, slots, d_v] of `dtype`, 64-byte aligned, allocated once here (no allocation on
 *  append); paged (block_size > 0): the pool K [g, num_blocks, block_size, d_k], V likewise.
 *  *out is NULL on error.
 *  @return MHA_STATUS_OK; INVALID_ARG, OVERFLOW or NO_MEMORY with a message. */
MHA_API mha_status mha_kv_cache_create(const mha_kv_cache_config *config,
                                       const mha_layer *layer,
                                       const mha_allocator *allocator,
                                       mha_kv_cache **out,
                                       mha_error *err);
/** NULL-safe. */
MHA_API void mha_kv_cache_destroy(mha_kv_cache *cache);
/** The resolved configuration (defaults filled in). */
MHA_API const mha_kv_cache_config *mha_kv_cache_get_config(const mha_kv_cache *cache);
/** Slots of storage per sequence (max_seq, or the ring size of a window cache). */
MHA_API int64_t mha_kv_cache_slots(const mha_kv_cache *cache);
/** Current length (positions appended so far) of sequence `seq`, or -1 for a bad cache or id. */
MHA_API int64_t mha_kv_cache_length(const mha_kv_cache *cache, int64_t seq);
/** Empties sequence `seq` (length 0). Storage is not cleared; a paged cache releases the
 *  sequence's blocks (a block returns to the pool when no sequence references it). */
MHA_API mha_status mha_kv_cache_reset(mha_kv_cache *cache, int64_t seq, mha_error *err);
/** Rolls sequence `seq` back to new_len <= its length (drop rejected speculative tokens). A
 *  window cache's ring keeps max_step_tokens - 1 positions of slack beyond the window, so it can
 *  roll back at most max_step_tokens positions from the furthest length it reached
 *  (INVALID_ARG beyond, nothing changed); the rule is that the ring still holds the keys the
 *  token at new_len needs, so new_len 0 and a chunk cache's chunk starts are always valid. A
 *  paged cache releases the blocks that hold no
 *  position below new_len (none of a ring that has wrapped). */
MHA_API mha_status mha_kv_cache_truncate(mha_kv_cache *cache,
                                         int64_t seq,
                                         int64_t new_len,
                                         mha_error *err);
/** After verifying a draft tree (tree_parents) appended at positions base_len .. L-1 of sequence
 *  `seq`: keeps the n accepted drafts draft_idx[0..n) (strictly increasing, each in
 *  [0, L - base_len): a root-to-node path lists its drafts in increasing order) by moving their K
 *  and V rows to positions base_len .. base_len+n-1 and setting the length to base_len + n. Exact
 *  for every dtype: the k-th node of a path has depth k, so its K was RoPE'd at its final
 *  position. n = 0 is a truncate to base_len. A window/chunk cache must still hold the keys the
 *  token at base_len needs (as mha_kv_cache_truncate) and, for n > 0, every draft base_len .. L-1.
 *  INVALID_ARG for bad indices, nothing changed. */
MHA_API mha_status mha_kv_cache_accept(mha_kv_cache *cache,
                                       int64_t seq,
                                       int64_t base_len,
                                       int64_t n,
                                       const int64_t *draft_idx,
                                       mha_error *err);
/** Makes sequence dst a copy of sequence src (length and contents): forks a shared prefix.
 *  src == dst is a no-op. A paged cache copies no rows: dst releases its blocks and references
 *  src's (reference counts + 1); the first later write into a shared block (an append to the
 *  partial last block, a ring wrapping) copies that block first, so neither sequence sees the
 *  other's appends. Needs no free block. */
MHA_API mha_status mha_kv_cache_copy(mha_kv_cache *cache,
                                     int64_t src_seq,
                                     int64_t dst_seq,
                                     mha_error *err);
/** MHA_DTYPE_FP8_E4M3 caches: the float32 scales of kv head h's keys (k_scales[h]) and values
 *  (v_scales[h]), h < num_kv_heads; a value x is stored as e4m3(x / scale) and read as
 *  e4m3 * scale (docs/SEMANTICS.md "fp8 KV cache"). Every scale is 1.0 until set. Either array
 *  may be NULL (those scales stay). Scales must lie in [2^-100, 2^100]. Refused (INVALID_ARG) for a
 *  cache of another dtype, and while any sequence holds positions (length > 0): stored values
 *  would change meaning; reset every sequence first. */
MHA_API mha_status mha_kv_cache_set_fp8_scales(mha_kv_cache *cache,
                                               const float *k_scales,
                                               const float *v_scales,
                                               mha_error *err);
/** Makes dst share src's first `len` positions (fork, then truncate dst to len; src unchanged):
 *  a prompt prefix shared between requests. len in [0, length of src] and, for a ring, within
 *  its truncate limit (mha_kv_cache_truncate); src == dst truncates. */
MHA_API mha_status mha_kv_cache_share_prefix(
    mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq, int64_t len, mha_error *err);
/** Paged cache: blocks of the pool no sequence references (an append of t tokens to a sequence
 *  needs at most ceil(t / block_size) + 1 of them). 0 for a contiguous cache, -1 for NULL. */
MHA_API int64_t mha_kv_cache_free_blocks(const mha_kv_cache *cache);
/** Paged cache: moves blocks so that each sequence's blocks have consecutive ids in table order
 *  (sequences by id; a block several sequences share once, where the lowest-id one reaches it)
 *  and the free blocks form one run at the end of the pool (llama.cpp's "defrag"). Changes no
 *  stored value, length, reference count, free_blocks count or result (all bit-identical), only
 *  where blocks lie: the decode kernels then read each sequence's kv head as one run of memory
 *  (docs/INFERENCE.md "Compaction"). Copies each block that moves twice (into and out of a
 *  carry buffer); takes 8 bytes per pool block + 2 blocks' rows of one kv head of working memory
 *  from the cache's allocator for the call (NO_MEMORY: nothing changed). OK and nothing done on
 *  a contiguous cache. Changes the cache: must not overlap other calls on it. */
MHA_API mha_status mha_kv_cache_compact(mha_kv_cache *cache, mha_error *err);

/** Reads position pos of sequence seq as float32: k [g, d_k], v [g, d_v] (either may be NULL).
 *  INVALID_ARG when pos is not stored (>= length, or dropped from a window ring). */
MHA_API mha_status mha_kv_cache_read(
    const mha_kv_cache *cache, int64_t seq, int64_t pos, float *k, float *v, mha_error *err);

/** Core level, for callers with their own projections: appends t post-RoPE key/value rows to
 *  each listed sequence, k [num_seqs, t, g, d_k], v [num_seqs, t, g, d_v] (float32, rounded to
 *  the storage dtype, nearest-even). seq_ids: [num_seqs] distinct ids, NULL = 0 .. num_seqs-1.
 *  Fails with nothing appended if any sequence would exceed max_seq (or t > max_step_tokens in a
 *  window cache), or (NO_MEMORY) when a paged cache's pool has fewer free blocks than the append
 *  needs (new blocks and copies of shared ones, counted over all listed sequences). */
MHA_API mha_status mha_kv_cache_append(mha_kv_cache *cache,
                                       int64_t num_seqs,
                                       const int64_t *seq_ids,
                                       int64_t t,
                                       const float *k,
                                       const float *v,
                                       mha_error *err);

/** Core-level attention of the LAST t positions of each listed sequence (whose K/V are already
 *  appended) to everything the cache holds for it, causal, bottom-right aligned:
 *    query row i (position p = L - t + i) sees key j iff j <= p (and j > p - W with a window,
 *    and floor(j / C) == floor(p / C) with a chunk size C);
 *    s = scale q.k_j, soft-capped, minus ALiBi slope_h |p - j|; sinks as in the core.
 *  q [num_seqs, t, h, d_k] (post-RoPE), out [num_seqs, t, h, d_v], lse optional
 *  [num_seqs, h, t]. Query head i reads kv head i / (h/g): each kv head's K/V is read once for
 *  its whole group. Split-KV ("flash-decoding"): the keys are cut into fixed blocks that threads
 *  share, each block gives a partial (o, lse), merged exactly; the blocks do not depend on the
 *  thread count, so results are bit-identical for any n_threads. impl=REFERENCE runs the
 *  reference core on the dequantised cache instead. A window/chunk ring must still hold every key
 *  the first query sees (INVALID_ARG otherwise: right after a truncate / accept / share_prefix
 *  that rolled a sequence back, append before attending). */
typedef struct mha_kv_attention_args {
    int64_t num_seqs;
    const int64_t *seq_ids; /* [num_seqs] or NULL = 0 .. num_seqs-1 */
    int64_t num_tokens;     /* t >= 1, <= each listed sequence's length */
    int64_t num_heads;      /* h, a multiple of the cache's g */
    double scale;   /* 0 = 1/sqrt(d_k); else |scale| in [FLT_MIN, FLT_MAX] (mha_attention_args) */
    double softcap; /* 0 = off; else in [FLT_MIN, FLT_MAX] */
    int32_t alibi;
    const float *sinks; /* [h] or NULL */
    const float *q;
    float *out;
    float *lse;
    /* Speculative tree verification (docs/SEMANTICS.md "Draft trees"): NULL = the usual chain.
     * Else [t], the same tree for every listed sequence: the last t tokens are drafts, draft i's
     * parent is tree_parents[i] in [0, i) or -1 (a child of the token before the drafts). Draft i
     * is at position L - t + depth(i) (depth 0 for a root) and sees the keys before the drafts by
     * the rule above at that position, plus its ancestors-or-self among the drafts (each still
     * under the window/chunk rule at its own position); ALiBi distances use positions. t <= 16. */
    const int64_t *tree_parents;
} mha_kv_attention_args;

MHA_API mha_status mha_kv_cache_attention(const mha_kv_cache *cache,
                                          const mha_kv_attention_args *args,
                                          const mha_exec *exec,
                                          mha_error *err);

/** One layer call through a cache: x [num_seqs, t, q_dim] are the next t tokens of each listed
 *  sequence; projects them, applies RoPE to Q and K at their absolute positions L .. L+t-1 (L =
 *  the sequence's length before the call), appends K and V (at storage precision) and writes
 *  out [num_seqs, t, out_dim] = the rows the full causal forward over the whole sequence would
 *  give, with every option of the layer (GQA, RoPE, ALiBi, sinks, softcap, scale; the window is
 *  the cache's). Sequences may have different lengths. On error nothing is appended and out is
 *  untouched. exec may be NULL. x and out are float32; the weights are read in the layer's
 *  weight_dtype (a batch-1 step is a matrix-vector product bound by the weights' bytes). */
typedef struct mha_decode_args {
    int64_t num_seqs;
    const int64_t *seq_ids; /* [num_seqs] distinct, or NULL = 0 .. num_seqs-1 */
    int64_t num_tokens;     /* t >= 1 */
    const float *x;         /* [num_seqs, t, q_dim] */
    float *out;             /* [num_seqs, t, out_dim] */
    /* NULL = a chain. Else [t] draft-tree parents (mha_kv_attention_args.tree_parents): token i
     * gets RoPE (and temperature) at L + depth(i) and attends as a draft of the tree; its K/V go
     * to slot L + i. Keep the accepted path with mha_kv_cache_accept. t <= 16, and t <=
     * max_step_tokens for a window/chunk cache. */
    const int64_t *tree_parents;
} mha_decode_args;

/** Appends a prompt (any t; long ones go through the flash core block by block).
 *  exec->workspace is not used by the decode calls: their scratch (a few floats per key block)
 *  comes from exec->allocator. */
MHA_API mha_status mha_layer_prefill(const mha_layer *layer,
                                     mha_kv_cache *cache,
                                     const mha_decode_args *args,
                                     const mha_exec *exec,
                                     mha_error *err);
/** One decoding step: t = 1 (or a few, e.g. speculative drafts) new tokens per sequence. The same
 *  operation as mha_layer_prefill, routed to the split-KV decode kernel. */
MHA_API mha_status mha_layer_decode_step(const mha_layer *layer,
                                         mha_kv_cache *cache,
                                         const mha_decode_args *args,
                                         const mha_exec *exec,
                                         mha_error *err);

/** Exact merge of two partial attention results over disjoint key sets (split-KV, streaming,
 *  ring/distributed attention), row r of `rows`, `dim` values per row:
 *    lse = log(exp(lse_a) + exp(lse_b))
 *    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b
 *  A partial with lse = -inf (all its keys masked) contributes nothing; both -inf gives o = 0,
 *  lse = -inf. Row strides in elements (>= dim). o may be exactly o_a or o_b (same pointer and
 *  stride) and lse exactly lse_a or lse_b: the merge then runs in place; any other overlap (o
 *  shifted into o_a, lse inside an o) is refused. lse may be NULL. OVERFLOW when a row extent
 *  (rows - 1) * stride + dim overflows int64. */
MHA_API mha_status mha_attention_merge(int64_t rows,
                                       int64_t dim,
                                       const float *o_a,
                                       int64_t o_a_stride,
                                       const float *lse_a,
                                       const float *o_b,
                                       int64_t o_b_stride,
                                       const float *lse_b,
                                       float *o,
                                       int64_t o_stride,
                                       float *lse,
                                       mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Multi-head latent attention (DeepSeek-V2/V3; docs/SEMANTICS.md "Multi-head latent attention")  */
/* ---------------------------------------------------------------------------------------------- */

/** An MLA layer (its own handle: its weights, cache and decode differ from mha_layer's). With
 *  dn = qk_nope_head_dim, dr = qk_rope_head_dim, dq = dn + dr, r = kv_lora_rank, per token x:
 *    q    = x W_q^T                                   (q_lora_rank == 0)
 *         = RMSNorm(x W_qa^T + b_qa; w_qn) W_qb^T      (otherwise)       [h, dq] = [q_nope, q_pe]
 *    a    = x W_kva^T + b_kva = [a_c (r), k_pe (dr)];  c = RMSNorm(a_c; w_kvn)
 *    q_pe, k_pe rotated by `rope` at the token's position (k_pe once, shared by every head)
 *    [k_nope_h, v_h] = c W_kvb,h^T   (rows h (dn + dv) .. of W_kvb: dn rows of k, then dv of v)
 *    k_h = [k_nope_h, k_pe];  o_h = Attn(q_h, k_h, v_h) (scale, causal);  y = concat_h o_h W_o^T
 *  RMSNorm(z; w) = w * z / sqrt(mean(z^2) + rms_eps). Float32 weights, copied at creation. */
typedef struct mha_mla_config {
    int64_t hidden;           /* input and output features (required) */
    int64_t num_heads;        /* h (required) */
    int64_t q_lora_rank;      /* 0 = plain q_proj; else the rank of q_a_proj */
    int64_t kv_lora_rank;     /* r (required): the latent c per token */
    int64_t qk_nope_head_dim; /* dn (required) */
    int64_t qk_rope_head_dim; /* dr (required, even) */
    int64_t v_head_dim;       /* dv (required) */
    int32_t bias;             /* nonzero: q_a_proj, kv_a_proj_with_mqa and o_proj have biases
                                 (transformers' attention_bias; q_proj, q_b_proj, kv_b_proj never) */
    double rms_eps;           /* 0 = 1e-6 (the attention norms' eps in transformers) */
    double scale;             /* 0 = 1/sqrt(dq); else as mha_attention_args.scale */
    mha_rope rope;            /* on the dr rotary dimensions: rotary_dim 0 or dr; style NONE is
                                 refused (MLA always rotates k_pe) */
} mha_mla_config;

/** nn.Linear layout (y = x W^T + b). NULL for the tensors the config does not use. */
typedef struct mha_mla_weights {
    const float *w_q;       /* [h dq, hidden] (q_lora_rank == 0) */
    const float *w_q_a;     /* [q_lora_rank, hidden] */
    const float *b_q_a;     /* [q_lora_rank] (bias) */
    const float *q_a_norm;  /* [q_lora_rank] */
    const float *w_q_b;     /* [h dq, q_lora_rank] */
    const float *w_kv_a;    /* [r + dr, hidden] */
    const float *b_kv_a;    /* [r + dr] (bias) */
    const float *kv_a_norm; /* [r] */
    const float *w_kv_b;    /* [h (dn + dv), r] */
    const float *w_o;       /* [hidden, h dv] */
    const float *b_o;       /* [hidden] (bias) */
} mha_mla_weights;

typedef struct mha_mla mha_mla;

/** Checks config and weights (every size, overflow, finite weights) and copies the weights. */
MHA_API mha_status mha_mla_create(const mha_mla_config *config,
                                  const mha_mla_weights *weights,
                                  const mha_allocator *allocator,
                                  mha_mla **out,
                                  mha_error *err);
MHA_API void mha_mla_destroy(mha_mla *mla); /* NULL-safe */
/** The resolved configuration (defaults filled in). */
MHA_API const mha_mla_config *mha_mla_get_config(const mha_mla *mla);
/** The weights the layer uses (its float32 copy; NULL for the tensors the config lacks). */
MHA_API const mha_mla_weights *mha_mla_get_weights(const mha_mla *mla);

/** The expanded form (per-head k and v), for prefill and training: x, out [B, n, hidden]. */
typedef struct mha_mla_forward_args {
    int64_t batch, seq_len;
    const float *x;
    const int64_t *positions; /* [B, n] RoPE positions; NULL = 0 .. n-1 */
    int32_t causal;           /* nonzero: key j visible from query i iff j <= i */
    float *out;
} mha_mla_forward_args;
MHA_API mha_status mha_mla_forward(const mha_mla *mla,
                                   const mha_mla_forward_args *args,
                                   const mha_exec *exec,
                                   mha_error *err);

/** Gradients of mha_mla_forward (the expanded form; the same args, whose out is not written):
 *  given dy = dL/dout [B, n, hidden], each non-NULL buffer is OVERWRITTEN with dL/d of its
 *  tensor, shaped as that tensor (dx as x; the weights as mha_mla_weights, norm weights
 *  included). A gradient of a tensor the config does not have must be NULL. No gradient may
 *  overlap x, positions, dy, the layer's weights or another gradient (INVALID_ARG). The forward is
 *  recomputed (nothing is saved between the calls); the attention's through
 *  mha_attention_backward, RMSNorm's and RoPE's in closed form (docs/SEMANTICS.md). */
typedef struct mha_mla_grads {
    const float *dy;
    float *dx;
    float *w_q, *w_q_a, *b_q_a, *q_a_norm, *w_q_b, *w_kv_a, *b_kv_a, *kv_a_norm, *w_kv_b, *w_o,
        *b_o;
} mha_mla_grads;
MHA_API mha_status mha_mla_backward(const mha_mla *mla,
                                    const mha_mla_forward_args *args,
                                    const mha_mla_grads *grads,
                                    const mha_exec *exec,
                                    mha_error *err);

/** The compressed cache: per token the latent c (r values, after its RMSNorm) and the rotated
 *  k_pe (dr values), r + dr in all (576 for DeepSeek-V3) whatever the heads, in `dtype` (F32, F16
 *  or BF16). batch sequences of at most max_seq tokens each. */
typedef struct mha_mla_cache mha_mla_cache;
MHA_API mha_status mha_mla_cache_create(const mha_mla *mla,
                                        int64_t batch,
                                        int64_t max_seq,
                                        mha_dtype dtype,
                                        const mha_allocator *allocator,
                                        mha_mla_cache **out,
                                        mha_error *err);
MHA_API void mha_mla_cache_destroy(mha_mla_cache *cache); /* NULL-safe */
/** Tokens held by sequence seq, or -1 for a bad cache or id. */
MHA_API int64_t mha_mla_cache_length(const mha_mla_cache *cache, int64_t seq);
/** Bytes the cache stores per token: (r + dr) * the dtype's size. */
MHA_API int64_t mha_mla_cache_bytes_per_token(const mha_mla_cache *cache);
/** Empties sequence seq. */
MHA_API mha_status mha_mla_cache_reset(mha_mla_cache *cache, int64_t seq, mha_error *err);
/** Core level, for callers with their own projections (and benchmarks): appends t rows [c, k_pe]
 *  (c after its RMSNorm, k_pe rotated at its position) to each listed sequence, rows [num_seqs,
 *  t, r + dr] float32 rounded to the cache's dtype. seq_ids as mha_kv_cache_append's. */
MHA_API mha_status mha_mla_cache_append(mha_mla_cache *cache,
                                        int64_t num_seqs,
                                        const int64_t *seq_ids,
                                        int64_t t,
                                        const float *rows,
                                        mha_error *err);

/** The next t tokens of each listed sequence through the compressed cache (the absorbed form):
 *  appends their [c, k_pe] (positions L .. L+t-1, L = the length before the call), then per head
 *    q_lat_h = W_uk,h^T q_nope_h  (r values; W_uk,h = the k rows of W_kvb,h),
 *    o_lat_h = Attn([q_lat_h, q_pe_h], keys [c_j, k_pe_j], values c_j)   (MQA, d_k = r + dr,
 *              d_v = r, causal, the layer's scale),
 *    o_h = W_uv,h o_lat_h (W_uv,h = the v rows of W_kvb,h);  out = concat_h o_h W_o^T + b_o,
 *  which equals mha_mla_forward over the whole sequence up to rounding (q_nope_h . k_nope_h =
 *  q_lat_h . c). args as mha_layer_decode_step's: x, out [num_seqs, t, hidden]. On error nothing
 *  is appended and out is untouched. */
MHA_API mha_status mha_mla_decode_step(const mha_mla *mla,
                                       mha_mla_cache *cache,
                                       const mha_decode_args *args,
                                       const mha_exec *exec,
                                       mha_error *err);

/** Loads layer `layer`'s MLA attention from a Hugging Face model directory of model_type
 *  deepseek_v2 or deepseek_v3 (docs/MODELS.md): sizes, biases, RoPE (interleaved unless
 *  deepseek_v3's rope_interleave is false; YaRN with the mscale_all_dim factor in the scale) from
 *  config.json, tensors by their transformers names, every shape checked. info may be NULL; it
 *  gets the prefix, layer count and model_type (its config and window fields are zero). */
MHA_API mha_status mha_hf_mla_load(const char *dir,
                                   int64_t layer,
                                   const mha_allocator *allocator,
                                   mha_mla **out,
                                   mha_hf_layer_info *info,
                                   mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Mask recognition (docs/SEMANTICS.md, "Recognised masks")                                       */
/* ---------------------------------------------------------------------------------------------- */

/** What a mask tensor equals, element for element, over its whole broadcast [B, h, n, m]. */
typedef enum mha_mask_rule_kind {
    MHA_MASK_RULE_NONE = 0,        /* no built-in rule: keep the tensor */
    MHA_MASK_RULE_ALL_VISIBLE = 1, /* every key visible: drop the tensor */
    MHA_MASK_RULE_BAND = 2,        /* causal and/or sliding window, one delta for every (b, h) */
    MHA_MASK_RULE_KEY_PADDING = 3, /* visible iff key_padding[b, j] != 0, for every (h, i) */
    MHA_MASK_RULE_BAND_AND_KEY_PADDING = 4, /* the band AND the key padding (HF 4-d masks) */
} mha_mask_rule_kind;

/** A recognised mask as mha_masking's fields. With p = i + delta, key j is visible from query
 *  row i iff (causal == 0 or j <= p) and (use_window == 0 or p - window_left <= j <= p +
 *  window_right, a side -1 = unbounded) and (chunk_size == 0 or floor(j / C) == floor(p / C)),
 *  and, for the kinds with key padding, key_padding[b, j].
 *  Canonical form: a band with an upper edge is causal (delta = that edge; a lower edge adds the
 *  window (window_left, 0)); a band with only a lower edge is the window (0, -1) at delta = that
 *  edge. Fields of a kind without a band: causal = use_window = 0, delta = 0, window (-1, -1). */
typedef struct mha_mask_rule {
    mha_mask_rule_kind kind;
    int32_t causal;
    int64_t delta; /* the same for every batch row: see mha_mask_rule_apply for the alignment */
    int32_t use_window;
    int64_t window_left;
    int64_t window_right;
    /* Chunked causal (mha_masking.chunk_size): 0 = none. C > 0 only with causal (the kinds with a
     * band): key j is also hidden unless floor(j / C) == floor(p / C), p = i + delta (Llama 4's
     * chunked mask); use_window is then 0. Appended last: a zeroed rule is the old one. */
    int64_t chunk_size;
} mha_mask_rule;

/** Recognises a mask tensor broadcast to [batch, num_heads, q_len, kv_len] as a built-in rule
 *  (a band, a causal chunked band, key padding, both, nothing hidden), exactly: every distinct
 * element is read once (broadcast dimensions once), stopping at the first element that contradicts
 * every rule. A BOOL/U8/I32/I64 mask (is_additive = 0) is read with `polarity`; an additive F32
 * mask (is_additive != 0, polarity ignored) qualifies only if every element is 0 (either sign:
 * visible) or -inf (hidden); any other value gives NONE. key_padding_out [batch * kv_len] (may be
 * NULL): on success, key_padding_out[b * kv_len + j] = 1 for a real key and 0 for a padded one for
 * the kinds with key padding, all 1 for the others (NONE included). Cost: O(distinct elements)
 * time, O(kv_len) scratch (malloc). The rule gives the tensor's visibility for every (b, h, i, j).
 * With a bool/integer mask the outputs are the same bit for bit; with an additive one too when
 * every row's hidden keys come after its visible ones (causal), else equal to float rounding
 * (docs/SEMANTICS.md, "Recognised masks", which also lists NaN / +inf scores at positions an
 * additive -inf hides).
 *  @return OK (rule filled; NONE is a success), INVALID_ARG (NULL mask, data or rule, a size
 *  outside [1, 2^31], a dtype or polarity that is not a mask's, a shape that does not broadcast,
 *  key_padding_out overlapping the mask), OVERFLOW, NO_MEMORY; on error rule and key_padding_out
 *  are untouched. Thread-safe (no shared state). */
MHA_API mha_status mha_mask_recognize(const mha_mask_tensor *mask,
                                      int32_t is_additive,
                                      mha_mask_polarity polarity,
                                      int64_t batch,
                                      int64_t num_heads,
                                      int64_t q_len,
                                      int64_t kv_len,
                                      mha_mask_rule *rule,
                                      uint8_t *key_padding_out,
                                      mha_error *err);

/** Writes a recognised rule (kind != NONE) into `mask`, which must have no causal, window or key
 *  padding of its own; its bool_mask / additive_mask (the tensor the rule replaces) is the
 *  caller's to clear. Alignment: BOTTOM_RIGHT when delta == kv_len - q_len, else TOP_LEFT when
 *  delta == 0, else EXPLICIT with align_offsets[b] = delta for b < batch (align_offsets [batch],
 *  caller-owned, needed only then). The kinds with key padding point mask->key_padding at
 *  key_padding [batch, kv_len] U8 (mha_mask_recognize's key_padding_out; kept alive by the
 *  caller). A rule's chunk_size goes to mask->chunk_size (placed by the same alignment), which
 *  must then be 0. The alignment also places ALiBi (and a chunk of the mask's own): with ALiBi
 *  on, apply a rule only when the call's own alignment gives the same delta. @return OK, or
 *  INVALID_ARG naming the field; on error
 *  mask is untouched. */
MHA_API mha_status mha_mask_rule_apply(const mha_mask_rule *rule,
                                       int64_t batch,
                                       int64_t q_len,
                                       int64_t kv_len,
                                       const uint8_t *key_padding,
                                       int64_t *align_offsets,
                                       mha_masking *mask,
                                       mha_error *err);

/** One line describing a rule, e.g. "causal (delta 0)", "causal (delta 2) + window (5, 0) + key
 *  padding", "all keys visible", "no built-in rule"; never NULL. Writes at most `size` bytes
 *  (NUL included) into buf and returns buf. */
MHA_API const char *mha_mask_rule_describe(const mha_mask_rule *rule, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif /* MHA_H */

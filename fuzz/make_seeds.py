#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Writes the seed corpora of the fuzzers (fuzz/corpus/<harness>/), small valid and invalid
inputs, a few KB per harness. Deterministic; standard library only. Rerun after changing it:
    python3 fuzz/make_seeds.py
"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def out(harness, name, data):
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def npy(descr, shape, data, major=1, fortran=False, pad=True):
    shape_text = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    d = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape_text)
    pre = 10 if major == 1 else 12
    if pad:
        total = (pre + len(d) + 1 + 63) // 64 * 64
        d = d + " " * (total - pre - len(d) - 1) + "\n"
    h = d.encode("latin1")
    ln = struct.pack("<H", len(h)) if major == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([major, 0]) + ln + h + data


def safetensors(tensors, meta=True, pad=True):
    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    if meta:
        header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def f32(vals):
    return struct.pack("<%df" % len(vals), *vals)


def gguf(arch, kvs, tensors, version=3, align=32):
    """A GGUF file (little-endian): kvs {key: (type number, value)}, tensors [(name, ne list,
    ggml type, raw bytes)], each tensor's data at a multiple of `align`."""
    def gstr(t):
        b = t.encode()
        return struct.pack("<Q", len(b)) + b

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
              11: "<q", 12: "<d"}

    def value(t, v):
        if t == 8:
            return gstr(v)
        if t == 9:
            et, items = v
            return struct.pack("<IQ", et, len(items)) + b"".join(value(et, x) for x in items)
        return struct.pack(scalar[t], v)

    kvs = dict({"general.architecture": (8, arch)}, **kvs)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, (t, v) in kvs.items():
        head += gstr(k) + struct.pack("<I", t) + value(t, v)
    blob, infos = b"", b""
    for name, ne, typ, raw in tensors:
        infos += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n)
                                                                    for n in ne)
        infos += struct.pack("<IQ", typ, len(blob))
        blob += raw + b"\0" * (-len(raw) % align)
    out_ = head + infos
    return out_ + b"\0" * (-len(out_) % align) + blob


def f16(vals):
    return struct.pack("<%de" % len(vals), *vals)


def q8_0(vals):
    """Blocks of 32: float16 scale max|x| / 127, then 32 int8."""
    b = b""
    for i in range(0, len(vals), 32):
        blk = vals[i:i + 32]
        d = max(abs(v) for v in blk) / 127 or 1.0
        b += struct.pack("<e", d) + struct.pack("<32b", *[round(v / d) for v in blk])
    return b


def main():
    rng = random.Random(7)
    # ---- npy
    out("npy", "f32_2x3", npy("<f4", (2, 3), f32([0.5 * i for i in range(6)])))
    out("npy", "f64_4", npy("<f8", (4,), struct.pack("<4d", 1, 2, 3, 4)))
    out("npy", "f16_scalar", npy("<f2", (), struct.pack("<e", 1.5)))
    out("npy", "bool_3", npy("|b1", (3,), b"\x01\x00\x01"))
    out("npy", "i64_2x1", npy("<i8", (2, 1), struct.pack("<2q", -1, 7)))
    out("npy", "i32_v2", npy("<i4", (2,), struct.pack("<2i", 3, 4), major=2))
    out("npy", "u8_v3_raw", npy("|u1", (0, 5), b"", major=3, pad=False))
    out("npy", "fortran", npy("<f4", (2, 2), f32([1, 2, 3, 4]), fortran=True))
    out("npy", "bigendian", npy(">f4", (1,), b"\0\0\x80\x3f"))
    out("npy", "truncated", npy("<f4", (4, 4), f32([1] * 5)))
    out("npy", "bad_magic", b"\x93NUMPX\x01\x00\x10\x00{}")
    # ---- safetensors: small layers under each naming scheme (q_dim 4; --heads 1 or 2)
    def w(rows, cols):
        return ("F32", [rows, cols], f32([rng.uniform(-0.5, 0.5) for _ in range(rows * cols)]))

    out("safetensors", "hf", safetensors({"q_proj.weight": w(4, 4), "k_proj.weight": w(4, 4),
                                          "v_proj.weight": w(4, 4), "o_proj.weight": w(4, 4),
                                          "q_proj.bias": ("F32", [4], f32([0.1] * 4))}))
    out("safetensors", "torch_packed", safetensors({"in_proj_weight": w(12, 4),
                                                    "in_proj_bias": ("F32", [12], f32([0] * 12)),
                                                    "out_proj.weight": w(4, 4),
                                                    "out_proj.bias": ("F32", [4], f32([0] * 4))}))
    out("safetensors", "cs336_f16", safetensors({
        "q_proj_weight": ("F16", [2, 2], struct.pack("<4e", 1, 0.5, -1, 2)),
        "k_proj_weight": ("BF16", [2, 2], b"\x80\x3f\x00\x40\x00\xbf\x00\x00"),
        "v_proj_weight": ("F64", [2, 2], struct.pack("<4d", 1, 2, 3, 4)),
        "o_proj_weight": ("F32", [2, 2], f32([1, 0, 0, 1])), "sinks": ("F32", [1], f32([0.5]))},
        meta=False))
    out("safetensors", "gqa", safetensors({"q_proj.weight": w(4, 2), "k_proj.weight": w(2, 2),
                                           "v_proj.weight": w(2, 2), "o_proj.weight": w(2, 4)}))
    out("safetensors", "overlap", safetensors({"q_proj.weight": w(1, 1)})[:-4] + b"{}")
    out("safetensors", "empty_header", struct.pack("<Q", 2) + b"{}")
    out("safetensors", "not_json", struct.pack("<Q", 5) + b"[1,2]")
    # ---- CLI argument vectors (NUL-separated, without the leading "run")
    vecs = [
        ["--weights", "w.st", "--heads", "8", "--input", "x.npy", "--out", "y.npy"],
        ["--weights=w", "--heads=4", "--kv-heads", "2", "--input", "x", "--out", "y", "--causal",
         "top-left", "--window", "3,-1", "--alibi", "--scale", "0.5", "--softcap", "30"],
        ["--weights", "w", "--heads", "2", "--input", "x", "--out", "y", "--rope-theta", "500000",
         "--rope-style", "half", "--rope-scaling", "yarn", "--rope-factor", "4",
         "--rope-beta-fast", "32", "--positions", "p.npy"],
        ["--weights", "w", "--heads", "2", "--input", "x", "--out", "y", "--names",
         "q=a,k=b,v=c,o=d,sinks=s", "--mask", "m.npy", "--mask-means", "block", "--dropout",
         "0.1", "--seed", "18446744073709551615", "--attn", "a.npy", "--attn-average",
         "--threads", "2", "--impl", "reference"],
        ["--weights", "w", "--heads", "-1", "--input", "x", "--out", "y", "--causal-offsets",
         "o.npy", "--q-segments", "q", "--kv-segments", "k", "--key", "k", "--value", "v"],
        ["--help"],
    ]
    for i, v in enumerate(vecs):
        out("cli_args", "args%d" % i, "\0".join(v).encode())
    # ---- API: bytes that decode to small valid shapes (mode 0 = layer, 1 = core)
    for i in range(12):
        b = bytes([i % 2]) + bytes(rng.randrange(0, 200) for _ in range(160))
        out("api", "seed%02d" % i, b)
    out("api", "layer_plain", bytes([0, 8, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]) + bytes(120))
    out("api", "core_plain", bytes([1, 1, 2, 0, 3, 3, 4, 0, 0, 0]) + bytes(120))
    # ---- paged KV cache: configuration bytes then operations (fuzz_kv_cache.c); random bytes
    # decode to small caches and valid-looking operations often enough
    for i in range(12):
        out("kv_cache", "seed%02d" % i, bytes(rng.randrange(0, 256) for _ in range(240)))

    # ---- model directories: config.json \0 model.safetensors.index.json (may be empty) \0
    # selector bytes (fuzz_model_dir.c: prefix scheme, dtype, biases, a wrong shape, overrides).
    # Small sizes (hidden 16, 4 heads of 4) so that the harness writes and runs the layers.
    small = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=64,
                 hidden_size=16, intermediate_size=32, num_attention_heads=4)

    def model(name, cfg, index=None, sel=b""):
        text = cfg if isinstance(cfg, bytes) else json.dumps(cfg, indent=1).encode()
        tail = b"" if index is None and not sel else b"\0" + (
            json.dumps(index).encode() if index is not None else b"") + b"\0" + sel
        out("model_dir", name, text + tail)

    def rope(kind="default", theta=10000.0, **kw):
        return dict(rope_type=kind, rope_theta=theta, **kw)

    model("llama3", dict(small, model_type="llama", num_key_value_heads=2, attention_bias=True,
                         rope_parameters=rope("llama3", 5e5, factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0,
                                              original_max_position_embeddings=16)))
    model("llama_legacy_yarn", dict(small, model_type="llama", num_key_value_heads=1,
                                    rope_theta=1e4, rope_scaling=dict(type="yarn", factor=4.0,
                                    original_max_position_embeddings=16)), sel=b"\x02")
    model("llama_dynamic", dict(small, model_type="llama", max_position_embeddings=8,
                                rope_parameters=rope("dynamic", 1e4, factor=2.0)), sel=b"\x04")
    model("mistral", dict(small, model_type="mistral", num_key_value_heads=2, sliding_window=5,
                          rope_parameters=rope("linear", 1e4, factor=2.0)), sel=b"\x01")
    model("mixtral", dict(small, model_type="mixtral", num_key_value_heads=2, num_local_experts=2,
                          num_experts_per_tok=1, rope_theta=1e6, sliding_window=None))
    model("qwen2_yarn", dict(small, model_type="qwen2", num_key_value_heads=2,
                             use_sliding_window=True, sliding_window=5, max_window_layers=1,
                             rope_parameters=rope("yarn", 1e6, factor=4.0,
                                                  original_max_position_embeddings=16)))
    model("gemma", dict(small, model_type="gemma", num_key_value_heads=1, head_dim=8,
                        rope_parameters=rope()), sel=b"\x06")
    model("gemma2", dict(small, model_type="gemma2", num_key_value_heads=2, head_dim=8,
                         query_pre_attn_scalar=24, attn_logit_softcapping=3.0, sliding_window=5,
                         layer_types=["sliding_attention", "full_attention"],
                         rope_parameters=rope()))
    model("gpt_oss", dict(small, model_type="gpt_oss", num_key_value_heads=2, head_dim=8,
                          num_local_experts=2, num_experts_per_tok=1, sliding_window=5,
                          max_position_embeddings=4096,
                          rope_parameters=rope("yarn", 1e4, factor=4.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False,
                                               original_max_position_embeddings=1024)))
    model("phi3", dict(small, model_type="phi3", num_key_value_heads=2, sliding_window=None,
                       rope_parameters=rope(partial_rotary_factor=0.5)))
    model("phi3_longrope", dict(small, model_type="phi3", num_key_value_heads=2,
                                original_max_position_embeddings=8,
                                rope_parameters=rope("longrope", 1e4, short_factor=[1.0, 1.5],
                                                     long_factor=[1.0, 4.0])), sel=b"\x08")
    # Issue 31's families: QK-norm per head / over the projection, Qwen3-Next's gated q_proj,
    # NoPE layers, interleaved RoPE, Llama 4's L2 QK-norm and chunks.
    model("qwen3", dict(small, model_type="qwen3", num_key_value_heads=2, head_dim=4,
                        attention_bias=True, rope_parameters=rope()))
    model("qwen3_moe", dict(small, model_type="qwen3_moe", num_key_value_heads=2, head_dim=4,
                            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                            rope_parameters=rope()), sel=b"\x02")
    model("gemma3_text", dict(small, model_type="gemma3_text", num_key_value_heads=2, head_dim=4,
                              query_pre_attn_scalar=24, sliding_window=5,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": rope(theta=1e4),
                                               "full_attention": rope("linear", 1e6,
                                                                      factor=2.0)}))
    model("qwen3_next", dict(small, model_type="qwen3_next", num_key_value_heads=2, head_dim=4,
                             attention_bias=True, layer_types=["full_attention", "full_attention"],
                             rope_parameters=rope(partial_rotary_factor=0.5)))
    model("olmo2", dict(small, model_type="olmo2", num_key_value_heads=2,
                        rope_parameters=rope(theta=5e5)), sel=b"\x04")
    model("smollm3", dict(small, model_type="smollm3", num_key_value_heads=2,
                          no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=5,
                          rope_parameters=rope(theta=2e4)))
    model("cohere2", dict(small, model_type="cohere2", num_key_value_heads=2, sliding_window=5,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters=rope()))
    model("llama4_text", dict(small, model_type="llama4_text", num_key_value_heads=2, head_dim=4,
                              no_rope_layers=[1, 0], attention_chunk_size=5, floor_scale=4,
                              attn_scale=0.5, rope_parameters=rope(theta=5e5)))
    model("gpt2", dict(model_type="gpt2", vocab_size=64, n_embd=16, n_head=4, n_layer=2,
                       n_positions=64, scale_attn_by_inverse_layer_idx=True), sel=b"\x03")
    model("gpt_neox", dict(small, model_type="gpt_neox", rotary_pct=0.5, rotary_emb_base=2000,
                           use_parallel_residual=True))
    model("falcon_old_mq", dict(small, model_type="falcon", multi_query=True, bias=True,
                                alibi=False), sel=b"\x01")
    model("falcon_old_mha", dict(small, model_type="falcon", multi_query=False))
    model("falcon_new", dict(small, model_type="falcon", new_decoder_architecture=True,
                             num_kv_heads=2, rope_theta=1e4))
    model("bert", dict(small, model_type="bert", position_embedding_type="absolute",
                       type_vocab_size=2), sel=b"\x01")
    model("roberta_decoder", dict(small, model_type="roberta", is_decoder=True))
    shards = {}
    for layer in (0, 1):
        for stem in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shards["model.layers.%d.self_attn.%s.weight" % (layer, stem)] = \
                "model-%05d-of-00002.safetensors" % (layer + 1)
    model("llama_sharded", dict(small, model_type="llama", num_key_value_heads=2,
                                rope_parameters=rope()),
          index=dict(metadata=dict(total_size=4096), weight_map=shards))
    model("llama_override", dict(small, model_type="llama", num_key_value_heads=2),
          sel=b"\x00\x00\x4a")  # --heads 2 --kv-heads 1 (0x40 | 1 << 3 | 2)
    model("neox_wrong_shape", dict(small, model_type="gpt_neox"), sel=b"\x20\x09")
    # Issue 28's known loader bugs (fixed on the loader branch): a per-head fused qkv loaded with
    # --kv-heads 1 and a file sized for it (split_fused read past the tensor), LongRoPE with
    # original_max_position_embeddings 1 (an infinite attention factor in the info).
    model("regress-neox-kv-override", dict(small, model_type="gpt_neox"), sel=b"\0\0\xc8")
    model("regress-falcon-kv-override", dict(small, model_type="falcon", multi_query=False),
          sel=b"\0\0\xc8")
    model("regress-longrope-original-1", dict(small, model_type="phi3", num_key_value_heads=2,
                                              original_max_position_embeddings=1,
                                              rope_parameters=rope("longrope", 1e4,
                                                                   short_factor=[1.0, 1.5],
                                                                   long_factor=[1.0, 4.0])))
    model("unknown_type", dict(small, model_type="t5"))
    model("not_json", b'{"model_type": "llama",')
    # ---- GGUF: tiny llama (permuted Q/K), qwen2 (biases, F16), qwen3 (QK-norm, Q8_0 at 32),
    # the other block types (Q4_0..Q5_1 at 32, K-quants at 256: deterministic bytes, scales 1/64)
    qrng = random.Random(11)
    BLOCKS = {2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)), 7: (32, 24, (0, 2)),
              10: (256, 84, (80, 82)), 11: (256, 110, (108,)), 12: (256, 144, (0, 2)),
              13: (256, 176, (0, 2)), 14: (256, 210, (208,))}

    def blocks(typ, vals):
        bv, bb, scales = BLOCKS[typ]
        b = bytearray(qrng.getrandbits(8) for _ in range(len(vals) // bv * bb))
        for k in range(0, len(b), bb):
            for o in scales:
                b[k + o:k + o + 2] = struct.pack("<e", 1 / 64)
        return bytes(b)
    def lw(rows, cols, k=0):
        return [((i * 7 + k) % 11 - 5) * 0.1 for i in range(rows * cols)]

    def layer_tensors(L, hid, h, g, d, typ=0, bias=False, norm=False):
        ts = []
        for k, (stem, rows, cols) in enumerate((("attn_q", h * d, hid), ("attn_k", g * d, hid),
                                                ("attn_v", g * d, hid),
                                                ("attn_output", hid, h * d))):
            t = typ[k] if isinstance(typ, tuple) else typ
            conv = {0: f32, 1: f16, 8: q8_0}.get(t, lambda v, t=t: blocks(t, v))
            ts.append(("blk.%d.%s.weight" % (L, stem), [cols, rows], t, conv(lw(rows, cols, k))))
            if bias and stem != "attn_output":
                ts.append(("blk.%d.%s.bias" % (L, stem), [rows], 0, f32(lw(rows, 1, k))))
        if norm:
            for stem in ("attn_q_norm", "attn_k_norm"):
                ts.append(("blk.%d.%s.weight" % (L, stem), [d], 0, f32([1.0] * d)))
        return ts

    def keys(arch, hid, h, g, layers=1, **extra):
        k = {arch + ".block_count": (4, layers), arch + ".embedding_length": (4, hid),
             arch + ".attention.head_count": (4, h), arch + ".attention.head_count_kv": (4, g),
             arch + ".rope.freq_base": (6, 10000.0),
             arch + ".attention.layer_norm_rms_epsilon": (6, 1e-6),
             "general.name": (8, "seed"), "tokenizer.ggml.tokens": (9, (8, ["<s>", "a", "b"])),
             "tokenizer.ggml.scores": (9, (6, [0.0, -1.0, -2.0]))}
        k.update(extra)
        return k

    out("gguf", "llama", gguf("llama", keys("llama", 4, 2, 1, layers=2,
                                           **{"llama.rope.scaling.type": (8, "linear"),
                                              "llama.rope.scaling.factor": (6, 2.0)}),
                              layer_tensors(0, 4, 2, 1, 2) + layer_tensors(1, 4, 2, 1, 2)))
    out("gguf", "qwen2_f16_v2", gguf("qwen2", keys("qwen2", 4, 2, 2, **{
        "qwen2.attention.sliding_window": (4, 3), "general.alignment": (4, 64)}),
        layer_tensors(0, 4, 2, 2, 2, typ=1, bias=True), version=2, align=64))
    out("gguf", "qwen3_q8", gguf("qwen3", keys("qwen3", 32, 2, 1, **{
        "qwen3.attention.key_length": (4, 16), "qwen3.attention.value_length": (4, 16),
        "qwen3.rope.dimension_count": (4, 16)}),
        layer_tensors(0, 32, 2, 1, 16, typ=8, norm=True)))
    out("gguf", "per_layer_heads", gguf("llama", keys("llama", 4, 2, 1, layers=2, **{
        "llama.attention.head_count": (9, (4, [2, 2])),
        "llama.attention.head_count_kv": (9, (5, [1, 2]))}),
        layer_tensors(0, 4, 2, 1, 2) + layer_tensors(1, 4, 2, 2, 2)))
    out("gguf", "llama3_rope_freqs", gguf("llama", keys("llama", 8, 2, 1, **{
        "llama.context_length": (4, 64)}),
        layer_tensors(0, 8, 2, 1, 4) + [("rope_freqs.weight", [2], 0, f32([1.0, 8.0]))]))
    out("gguf", "qwen2_yarn", gguf("qwen2", keys("qwen2", 4, 2, 2, **{
        "qwen2.rope.scaling.type": (8, "yarn"), "qwen2.rope.scaling.factor": (6, 4.0),
        "qwen2.rope.scaling.original_context_length": (4, 16),
        "qwen2.rope.scaling.attn_factor": (6, 1.5), "qwen2.rope.scaling.yarn_beta_fast": (6, 16.0),
        "qwen2.rope.scaling.yarn_beta_slow": (6, 2.0),
        "qwen2.rope.scaling.yarn_log_multiplier": (6, 0.1)}),
        layer_tensors(0, 4, 2, 2, 2)))
    out("gguf", "qwen2_q4_q5", gguf("qwen2", keys("qwen2", 32, 2, 1),
                                    layer_tensors(0, 32, 2, 1, 16, typ=(2, 6, 3, 7))))
    out("gguf", "llama_kquants", gguf("llama", keys("llama", 256, 1, 1, **{
        "llama.attention.key_length": (4, 32), "llama.attention.value_length": (4, 32)}),
                                      layer_tensors(0, 256, 1, 1, 32, typ=(12, 13, 14, 2))))
    out("gguf", "qwen2_q2k_q3k", gguf("qwen2", keys("qwen2", 256, 1, 1, **{
        "qwen2.attention.key_length": (4, 32), "qwen2.attention.value_length": (4, 32)}),
                                      layer_tensors(0, 256, 1, 1, 32, typ=(10, 11, 10, 6))))
    # phi3: fused attn_qkv ([q; k; v] rows; Q8_0 at width 32, h 2, g 1, d 16: 64 rows), partial
    # rotary 8 of 16 (4 pairs), LongRoPE factor tensors and attn_factor, sliding_window 0 (none)
    out("gguf", "phi3_longrope_q8", gguf("phi3", keys("phi3", 32, 2, 1, **{
        "phi3.context_length": (4, 64), "phi3.rope.scaling.original_context_length": (4, 8),
        "phi3.rope.dimension_count": (4, 8), "phi3.rope.scaling.attn_factor": (6, 1.4142135),
        "phi3.attention.sliding_window": (4, 0)}),
        [("blk.0.attn_qkv.weight", [32, 64], 8, q8_0(lw(64, 32))),
         ("blk.0.attn_output.weight", [32, 32], 8, q8_0(lw(32, 32, 3))),
         ("blk.0.attn_qkv.bias", [64], 0, f32(lw(64, 1, 1))),
         ("rope_factors_short.weight", [4], 0, f32([1.0, 1.25, 1.5, 2.0])),
         ("rope_factors_long.weight", [4], 0, f32([1.0, 2.0, 4.0, 8.0]))]))
    out("gguf", "bad_magic", b"GGUX" + bytes(40))
    # ---- npz members: count byte, then per member: flags (dtype in bits 0-2, NULL data when
    # bits 3-4 are set), name length, name, [dtype byte], ndim byte, dims, data (fuzz_npz.c)
    def member(name, ndim, dims, dtype=0, flags=0, data=b"", dtype_byte=b""):
        return (bytes([dtype | flags, len(name)]) + name + dtype_byte + bytes([ndim]) + bytes(dims)
                + data)

    out("npz", "f32_2x3", bytes([0]) + member(b"x", 2, [2, 3], data=bytes(range(24))))
    out("npz", "i64_and_0d", bytes([1]) + member(b"idx", 1, [3], dtype=3, data=bytes(24)) +
        member(b"scalar", 0, [], data=b"\0\0\x80\x3f"))
    out("npz", "zero_size", bytes([2]) + member(b"empty", 3, [2, 0, 4]) +
        member(b"e1", 1, [0], dtype=3) + member(b"ok", 1, [1], data=b"1234"))
    # a 0-d member without data (issue 28: mha__npz_write read through NULL; loader branch)
    out("npz", "regress-0d-null-data", bytes([0]) + member(b"s", 0, [], flags=0x18))
    out("npz", "eight_dims", bytes([0]) + member(b"d8", 8, [1, 2, 1, 1, 2, 1, 1, 1],
                                               data=bytes(16)))
    out("npz", "huge_dim", bytes([0]) + member(b"big", 2, [245, 0, 0, 0, 0, 0, 0, 1, 0, 1],
                                               data=b"\1"))
    out("npz", "bad_members", bytes([3]) + member(b"", 1, [1], data=bytes(4)) +
        member(b"n" * 100, 1, [1], data=bytes(4)) + member(b"dt", 1, [1], dtype=6, dtype_byte=b"\x09") +
        member(b"neg", 1, [251]))


if __name__ == "__main__":
    main()

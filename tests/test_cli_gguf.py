# SPDX-License-Identifier: MIT
"""`mha run --gguf FILE --layer L` and `mha info --gguf FILE` against Hugging Face transformers.

Tiny random llama, mistral-style (sliding window), qwen2 (q/k/v biases) and qwen3 (QK-norm)
models are built with transformers (nothing from a hub) and written as GGUF files with the `gguf`
package's GGUFWriter the way llama.cpp's converter writes them: the same keys, llama's Q and K
rows permuted to pair rotary dimensions (2j, 2j+1), 1-d tensors (biases, norms) in F32, the
projections in F32, F16, BF16 or Q8_0 (gguf.quants.quantize).

The oracle: the transformers model in float64 whose attention weights are replaced by exactly the
values the GGUF file holds (the F16/BF16 rounding, the Q8_0 dequantisation: gguf.quants), run on
random tokens; the tested layer's attention input and output are recorded with hooks. mha loads
every type into float32 weights exactly (docs/MODELS.md "GGUF"), so the only error left is the
float32 arithmetic's, and every type is gated at TOL_OUT_REL (no new constant). That the rounding
is really there is checked too: Q8_0 and BF16 outputs miss the unrounded model by far more.

Run by ctest with MHA_CLI=<path to mha>; needs numpy, torch, transformers and gguf
(python/requirements-test.txt).
"""
import os
import subprocess

import numpy as np
import pytest
import torch
import transformers as T
from tolerances import TOL_OUT_REL

import gguf
from gguf import GGMLQuantizationType as Q

import hf_models as H

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")

SEQ, BATCH, WINDOW = 12, 2, 5
BASE = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=64, hidden_size=64,
            intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)

# name: (config class, kwargs, model class, GGUF architecture, Q/K permuted, extra keys)
CASES = {
    "llama": (T.LlamaConfig, dict(BASE, rope_parameters=dict(rope_type="linear", factor=2.0,
                                                              rope_theta=1e4)),
              T.LlamaForCausalLM, "llama", True, {"scaling": ("linear", 2.0)}),
    # Llama 3 RoPE scaling: llama.cpp writes it as rope_freqs.weight, one divisor per pair.
    "llama3": (T.LlamaConfig, dict(BASE, rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16)),
        T.LlamaForCausalLM, "llama", True, {"rope_freqs": True}),
    "mistral": (T.MistralConfig, dict(BASE, sliding_window=WINDOW,
                                      rope_parameters=dict(rope_type="default", rope_theta=5e5)),
                T.MistralForCausalLM, "llama", True, {"window": WINDOW}),
    "qwen2": (T.Qwen2Config, dict(BASE, rope_parameters=dict(rope_type="default",
                                                             rope_theta=1e6)),
              T.Qwen2ForCausalLM, "qwen2", False, {}),
    "qwen3": (T.Qwen3Config, dict(BASE, head_dim=16, attention_bias=False,
                                  rope_parameters=dict(rope_type="default", rope_theta=1e6)),
              T.Qwen3ForCausalLM, "qwen3", False, {}),
    # YaRN: llama.cpp's rope.scaling.type "yarn", factor, original_context_length
    "qwen2_yarn": (T.Qwen2Config, dict(BASE, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16)),
        T.Qwen2ForCausalLM, "qwen2", False, {"yarn": (4.0, 16)}),
    # rows of 256 values (head_dim 64): the K-quants' block
    "llama_wide": (T.LlamaConfig, dict(BASE, hidden_size=256, rope_parameters=dict(
        rope_type="default", rope_theta=1e4)), T.LlamaForCausalLM, "llama", True, {}),
}
TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0}
# The types mha reads block-quantised: Q4_0 and Q5_0 exactly (also as q8_0 blocks), the others
# dequantised to float32 at load as ggml computes them (docs/MODELS.md "GGUF files", Types).
QUANTS = {t: getattr(Q, t) for t in ("Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                                     "Q5_K", "Q6_K")}
# the byte ranges of each block's float16 scales (d, and dmin / m)
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
          Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
PROJ = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def run_cli(*args):
    return subprocess.run([CLI, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=120)


def permute(w, heads):
    """llama.cpp's layout of a llama Q or K (rows [heads * d] or a bias [heads * d]): per head,
    HF's element s * d/2 + j (rotate_half pairs (j, j + d/2)) goes to 2j + s."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype, rows, cols, rng, scale=None):
    """[rows, cols] of `qtype` as raw blocks: random bytes, then finite float16 scales: random
    ones (scale None: any finite float16, both signs, subnormals and +-65504 included) or the
    ones that bring each block's largest |value| to about `scale`."""
    bv, bb = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // bv, bb), dtype=np.uint8)
    offs = SCALES[qtype]
    for o in offs:
        if scale is None:
            h = rng.integers(0, 0x7c00, len(raw), dtype=np.uint16) | (
                rng.integers(0, 2, len(raw), dtype=np.uint16) << 15)
            raw[:, o:o + 2] = h.view(np.uint8).reshape(-1, 2)
        else:
            raw[:, o:o + 2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    if scale is not None:  # the values are linear in the scales: rescale them together
        top = np.abs(gguf.quants.dequantize(raw, qtype).reshape(len(raw), bv)).max(axis=1)
        f = (scale / np.maximum(top, 1e-3)).astype(np.float16)
        for o in offs:
            raw[:, o:o + 2] = f.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def stored(w, qtype):
    """(the array GGUFWriter gets, raw_dtype or None, the float64 values the file holds)."""
    w32 = np.ascontiguousarray(w, np.float32)
    if qtype == Q.F32:
        return w32, None, w32.astype(np.float64)
    if qtype == Q.F16:
        h = w32.astype(np.float16)
        return h, None, h.astype(np.float64)
    if qtype not in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # gguf cannot quantise
        rng = np.random.default_rng(int(qtype) * 1000 + w.shape[0])
        raw = random_blocks(qtype, w.shape[0], w.shape[1], rng, scale=float(np.abs(w).max()))
        return raw, qtype, gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(w.shape)
    raw = gguf.quants.quantize(w32, qtype)
    return raw, qtype, gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(w.shape)


def build(name, root):
    cfg_cls, kw, model_cls, _, _, _ = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    d = os.path.join(root, name)
    model.save_pretrained(d)
    return model, d


def record(model, layer, ids):
    store = {}
    handles = H._hooks(model, "model.layers.{L}.self_attn", layer, store)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in handles:
        h.remove()
    return store["x"], store["y"]


def write_gguf(name, model, qtype, path, permuted=None, arch=None, edit=None):
    """The model's attention as llama.cpp's converter writes it; returns the float64 model with
    the file's values put back (the oracle). edit(writer) may add or replace keys."""
    _, kw, _, garch, perm, extra = CASES[name]
    perm = perm if permuted is None else permuted
    cfg = model.config
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    w = gguf.GGUFWriter(path, arch or garch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(h)
    w.add_head_count_kv(g)
    w.add_rope_freq_base(float(kw["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(d)
    if name == "qwen3":
        w.add_key_length(d)
        w.add_value_length(d)
    if "scaling" in extra:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(extra["scaling"][1])
    if "yarn" in extra:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(extra["yarn"][0])
        w.add_rope_scaling_orig_ctx_len(extra["yarn"][1])
    if "window" in extra:
        w.add_sliding_window(extra["window"])
    if "rope_freqs" in extra:  # the divisors of HF's llama3 frequencies, as the converter's
        theta = float(kw["rope_parameters"]["rope_theta"])
        base = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        hf = model.model.rotary_emb.inv_freq.double().numpy()
        w.add_tensor("rope_freqs.weight", (base / hf).astype(np.float32))
    qtypes = qtype if isinstance(qtype, dict) else {gg: qtype for gg in PROJ.values()}
    w.add_file_type(int(qtypes["attn_q"]))
    if edit:
        edit(w)
    oracle = model_cls_copy(name, model)
    mods = dict(oracle.named_modules())
    for L in range(cfg.num_hidden_layers):
        att = mods[f"model.layers.{L}.self_attn"]
        for hf, gg in PROJ.items():
            lin = getattr(att, hf)
            wt = lin.weight.detach().numpy()
            heads = h if hf == "q_proj" else g
            if perm and hf in ("q_proj", "k_proj"):
                wt = permute(wt, heads)
            data, raw, back = stored(wt, qtypes[gg])
            w.add_tensor(f"blk.{L}.{gg}.weight", data, raw_dtype=raw)
            if perm and hf in ("q_proj", "k_proj"):  # the oracle gets HF's order back
                back = back.reshape(heads, d // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(back))
            if lin.bias is not None:
                b = lin.bias.detach().numpy()
                b = permute(b, heads) if perm and hf in ("q_proj", "k_proj") else b
                w.add_tensor(f"blk.{L}.{gg}.bias", b.astype(np.float32))
                with torch.no_grad():
                    lin.bias.copy_(lin.bias.float().double())
        for hf, gg in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if hasattr(att, hf):
                nw = getattr(att, hf).weight
                w.add_tensor(f"blk.{L}.{gg}.weight", nw.detach().numpy().astype(np.float32))
                with torch.no_grad():
                    nw.copy_(nw.float().double())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return oracle


def model_cls_copy(name, model):
    _, _, model_cls, _, _, _ = CASES[name]
    cfg = model.config
    m = model_cls(cfg).to(torch.float64).eval()
    m.load_state_dict(model.state_dict())
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf"))
    return {name: build(name, root) for name in CASES}


def ids_for(name):
    g = torch.Generator().manual_seed(7 + len(name))
    return torch.randint(3, 64, (BATCH, SEQ), generator=g)


def run_gguf(path, layer, x, tmp_path, *flags):
    xp, yp = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(xp, x)
    r = run_cli("run", "--gguf", path, "--layer", layer, "--input", xp, "--out", yp, *flags)
    assert r.returncode == 0, r.stderr
    return np.load(yp)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tname", list(TYPES))
def test_layer_matches_transformers(models, name, tname, tmp_path):
    model, _ = models[name]
    path = str(tmp_path / f"{name}.gguf")
    oracle = write_gguf(name, model, TYPES[tname], path)
    for layer in (0, 1):
        x, ref = record(oracle, layer, ids_for(name))
        y = run_gguf(path, layer, x, tmp_path)
        err = H.max_rel_err(y, ref)
        assert err <= TOL_OUT_REL, f"{name} {tname} layer {layer}: max error {err:.3g}"
        if tname in ("BF16", "Q8_0") and layer == 0:  # the file's rounding is really seen
            _, unrounded = record(model, layer, ids_for(name))
            assert H.max_rel_err(y, unrounded) > 10 * TOL_OUT_REL


@pytest.mark.parametrize("tname", list(QUANTS))
def test_quantized_layer_matches_transformers(models, tname, tmp_path):
    # The quantised types through `mha run --gguf`: Q4_0..Q5_1 quantised by gguf.quants, the
    # K-quants random blocks (gguf cannot quantise them) scaled to the weights' size. mha loads
    # every type into float32 weights equal to gguf's dequantisation (test_dequantised_bits), so
    # the float32 arithmetic's error is all there is: TOL_OUT_REL, as for F32.
    model, _ = models["llama_wide"]
    path = str(tmp_path / "w.gguf")
    oracle = write_gguf("llama_wide", model, QUANTS[tname], path)
    for layer in (0, 1):
        x, ref = record(oracle, layer, ids_for("llama_wide"))
        err = H.max_rel_err(run_gguf(path, layer, x, tmp_path), ref)
        assert err <= TOL_OUT_REL, f"{tname} layer {layer}: max error {err:.3g}"


def write_raw(path, tensors, arch="qwen2", hidden=256, heads=4, kv_heads=2):
    """A one-layer file of the given raw tensors {stem: (uint8 blocks, type)}."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    for stem, (raw, qtype) in tensors.items():
        w.add_tensor(f"blk.0.{stem}.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tname", ["Q8_0", *QUANTS])
def test_dequantised_bits(tname, tmp_path):
    # Random valid blocks (random bytes, any finite float16 scales of both signs, subnormal to
    # 65504) and extreme ones (every bit 0 or 1 with the largest, smallest and negative zero
    # scales): mha's float32 weights are gguf-py's numpy dequantisation bit for bit (the
    # independent oracle: the same float32 operations, written separately); a q8_0 layer holds
    # Q8_0, Q4_0 and Q5_0 exactly (its weights read back as the same bits).
    mha = pytest.importorskip("mha")
    qtype = getattr(Q, tname)
    rng = np.random.default_rng(int(qtype))
    rows = {"attn_q": 256, "attn_k": 128, "attn_v": 128, "attn_output": 256}
    raws = {}
    for stem, r in rows.items():
        if qtype == Q.Q8_0:
            raw = rng.integers(0, 256, (r * 256 // 32, 34), dtype=np.uint8)
            raw[:, 0:2] = (rng.integers(0, 0x7c00, len(raw), dtype=np.uint16)).view(
                np.uint8).reshape(-1, 2)
            raw = raw.reshape(r, -1)
        else:
            raw = random_blocks(qtype, r, 256, rng)
        bb = gguf.constants.GGML_QUANT_SIZES[qtype][1]
        blocks = raw.reshape(-1, bb)
        for k, (fill, sc) in enumerate([(0, 0x7bff), (255, 0xfbff), (255, 0x0001), (0, 0x8000),
                                        (255, 0x7bff), (0, 0x03ff)]):
            blocks[k] = fill
            for o in SCALES.get(qtype, (0,)):
                blocks[k, o:o + 2] = np.frombuffer(np.uint16(sc).tobytes(), np.uint8)
        raws[stem] = (raw, qtype)
    path = str(tmp_path / "bits.gguf")
    write_raw(path, raws)
    layer = mha.MultiheadAttention.from_gguf(path)
    names = {"attn_q": "w_q", "attn_k": "w_k", "attn_v": "w_v", "attn_output": "w_o"}
    for stem, (raw, _) in raws.items():
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        got = layer.weights[names[stem]]
        assert got.shape == want.shape
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (stem, bad[:5], got.ravel()[bad[:5]], want.ravel()[bad[:5]])
    if tname in ("Q8_0", "Q4_0", "Q5_0"):
        q8 = mha.MultiheadAttention.from_gguf(path, weight_dtype="q8_0")
        assert q8.config.weight_dtype == "q8_0"
        for nm in names.values():
            assert np.array_equal(q8.weights[nm].view(np.uint32),
                                  layer.weights[nm].view(np.uint32)), nm


def test_mixed_types(models, tmp_path):
    # A Q4_K_M-style file (Q4_K projections, V in Q6_K) through the CLI, and a file mixing Q4_0,
    # Q5_0, Q8_0 and F16 loaded as a q8_0 layer: Q4_0/Q5_0/Q8_0 become q8_0 blocks exactly (the
    # same bits as the float32 load, so the same output), F16 is quantised by mha at load.
    mha = pytest.importorskip("mha")
    model, _ = models["llama_wide"]
    path = str(tmp_path / "km.gguf")
    km = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K}
    oracle = write_gguf("llama_wide", model, km, path)
    x, ref = record(oracle, 1, ids_for("llama_wide"))
    assert H.max_rel_err(run_gguf(path, 1, x, tmp_path), ref) <= TOL_OUT_REL
    path = str(tmp_path / "mix.gguf")
    mix = {"attn_q": Q.Q4_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.F16}
    oracle = write_gguf("llama_wide", model, mix, path)
    x, ref = record(oracle, 1, ids_for("llama_wide"))
    deq = mha.MultiheadAttention.from_gguf(path, layer=1)
    q8 = mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q8_0")
    for nm in ("w_q", "w_k", "w_v"):
        assert np.array_equal(q8.weights[nm], deq.weights[nm]), nm
    assert not np.array_equal(q8.weights["w_o"], deq.weights["w_o"])  # quantised at load
    y = np.stack([deq.forward(xb.astype(np.float32)) for xb in x])
    assert H.max_rel_err(y, ref) <= TOL_OUT_REL


def test_f32_gguf_equals_the_hf_directory(models, tmp_path):
    # The un-permuted llama layer is the HF checkpoint's, bit for bit: same weights (float64
    # rounded once to float32 either way), same rotate_half RoPE, same linear scaling.
    model, d = models["llama"]
    path = str(tmp_path / "llama.gguf")
    write_gguf("llama", model, Q.F32, path)
    x, _ = record(model, 1, ids_for("llama"))
    y = run_gguf(path, 1, x, tmp_path)
    xp, yp = tmp_path / "x.npy", tmp_path / "ym.npy"
    r = run_cli("run", "--model", d, "--layer", 1, "--input", xp, "--out", yp)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(y, np.load(yp))


@pytest.mark.parametrize("keys", [{}, {"attn_factor": 1.5, "yarn_beta_fast": 16.0,
                                     "yarn_beta_slow": 2.0}])
def test_yarn_gguf_equals_the_hf_directory(models, tmp_path, keys):
    # llama.cpp's YaRN keys give the layer the HF config's YaRN gives, bit for bit: the same
    # factor, original length, betas and truncated ramp; cos/sin times mscale(factor) =
    # 0.1 ln(factor) + 1, times rope.scaling.attn_factor (HF: attention_factor, the product).
    import json
    import math
    model, d = models["qwen2_yarn"]
    path = str(tmp_path / "y.gguf")

    def edit(w):
        for k, v in keys.items():
            w.add_float32(f"qwen2.rope.scaling.{k}", v)
    write_gguf("qwen2_yarn", model, Q.F32, path, edit=edit)
    if keys:
        d2 = tmp_path / "hf"
        d2.mkdir()
        for f in os.listdir(d):
            os.symlink(os.path.join(d, f), d2 / f) if f != "config.json" else None
        cfg = json.load(open(os.path.join(d, "config.json")))
        rp = cfg["rope_parameters"]
        rp["attention_factor"] = (0.1 * math.log(4.0) + 1.0) * keys["attn_factor"]
        rp["beta_fast"], rp["beta_slow"] = keys["yarn_beta_fast"], keys["yarn_beta_slow"]
        json.dump(cfg, open(d2 / "config.json", "w"))
        d = str(d2)
    x, _ = record(model, 1, ids_for("qwen2_yarn"))
    y = run_gguf(path, 1, x, tmp_path)
    xp, yp = tmp_path / "x.npy", tmp_path / "ym.npy"
    r = run_cli("run", "--model", d, "--layer", 1, "--input", xp, "--out", yp)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(y, np.load(yp))
    info_g = run_cli("info", "--gguf", path).stdout
    info_m = run_cli("info", "--model", d).stdout
    rope = [ln for ln in info_g.splitlines() if ln.startswith("rope")]
    assert rope and "yarn" in rope[0] and rope == [ln for ln in info_m.splitlines()
                                                   if ln.startswith("rope")], (info_g, info_m)
    if keys:  # the keys change the layer
        write_gguf("qwen2_yarn", model, Q.F32, path)
        assert not np.array_equal(run_gguf(path, 1, x, tmp_path), y)


def test_permutation_is_undone(models, tmp_path):
    # The same llama file written without llama.cpp's permutation is read as permuted: wrong.
    model, _ = models["llama"]
    path = str(tmp_path / "unpermuted.gguf")
    oracle = write_gguf("llama", model, Q.F32, path, permuted=False)
    x, ref = record(oracle, 0, ids_for("llama"))
    assert H.max_rel_err(run_gguf(path, 0, x, tmp_path), ref) > 100 * TOL_OUT_REL


def test_decode_matches(models, tmp_path):
    model, _ = models["qwen3"]
    path = str(tmp_path / "q3.gguf")
    oracle = write_gguf("qwen3", model, Q.Q8_0, path)
    x, ref = record(oracle, 1, ids_for("qwen3"))
    y = run_gguf(path, 1, x, tmp_path, "--decode", "--prefill", 3)
    assert H.max_rel_err(y, ref) <= TOL_OUT_REL


def test_info_prints_what_it_understood(models, tmp_path):
    model, _ = models["mistral"]
    path = str(tmp_path / "m.gguf")
    write_gguf("mistral", model, Q.F16, path)
    r = run_cli("info", "--gguf", path, "--layer", 1)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "architecture: llama" in out and "layer: 1 of 2" in out, out
    assert "heads: 4, kv heads: 2, head_dim: 16" in out and "blk.1." in out, out
    assert "un-permuted" in out and "rope: style half, theta 500000, rotary_dim 16" in out, out
    assert f"window: {WINDOW - 1},0" in out and "causal: yes" in out, out
    model, _ = models["qwen3"]
    write_gguf("qwen3", model, Q.F32, path)
    out = run_cli("info", "--gguf", path).stdout
    assert "qk-norm: rms per head" in out and "architecture: qwen3" in out, out
    model, _ = models["llama"]
    write_gguf("llama", model, Q.F32, path)
    assert "scaling linear (factor 2)" in run_cli("info", "--gguf", path).stdout
    model, _ = models["llama3"]
    write_gguf("llama3", model, Q.F32, path)
    assert "scaling longrope (factor 1" in run_cli("info", "--gguf", path).stdout


def refused(path, *words, layer=0):
    """`mha info` and `mha run` both fail with exit 1 and one stderr line naming every word."""
    r = run_cli("info", "--gguf", path, "--layer", layer)
    line = r.stderr.strip()
    assert r.returncode == 1 and "\n" not in line and line.startswith("mha: "), (r.stdout, line)
    assert all(wd in line for wd in words), line
    r = run_cli("run", "--gguf", path, "--layer", layer, "--input", "/nonexistent.npy", "--out",
                "/tmp/unused.npy")
    assert r.returncode == 1 and all(wd in r.stderr for wd in words), r.stderr


def test_unsupported_is_refused_by_name(models, tmp_path):
    model, _ = models["llama"]
    p = str(tmp_path / "r.gguf")
    write_gguf("llama", model, Q.F32, p, arch="gemma2")
    refused(p, "general.architecture", "gemma2")

    p = str(tmp_path / "longrope.gguf")
    write_gguf("qwen2", models["qwen2"][0], Q.F32, p,
               edit=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE))
    refused(p, "qwen2.rope.scaling.type", "longrope")
    write_gguf("qwen2_yarn", models["qwen2_yarn"][0], Q.F32, p,
               edit=lambda w: w.add_rope_scaling_yarn_ext_factor(0.5))
    refused(p, "qwen2.rope.scaling.yarn_ext_factor", "only 1")
    write_gguf("qwen2_yarn", models["qwen2_yarn"][0], Q.F32, p,
               edit=lambda w: w.add_rope_scaling_yarn_attn_factor(0.7))
    refused(p, "qwen2.rope.scaling.yarn_attn_factor", "not mapped")

    def freqs(w):
        w.add_tensor("rope_freqs.weight", np.ones(5, np.float32))
    p = str(tmp_path / "freqs.gguf")
    write_gguf("qwen2", models["qwen2"][0], Q.F32, p, edit=freqs)
    refused(p, "rope_freqs.weight must be F32 with 1 dimension {8}")
    p = str(tmp_path / "freqs_linear.gguf")
    write_gguf("llama3", models["llama3"][0], Q.F32, p,
               edit=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                               w.add_rope_scaling_factor(2.0)))
    refused(p, "rope_freqs.weight together with llama.rope.scaling.type")
    p = str(tmp_path / "iq4.gguf")  # random IQ4_NL blocks (32 values, 18 bytes)
    write_raw(p, {stem: (np.zeros((r, 8 * 18), np.uint8), Q.IQ4_NL) for stem, r in
                  (("attn_q", 256), ("attn_k", 128), ("attn_v", 128), ("attn_output", 256))})
    refused(p, "blk.0.attn_q.weight", "type IQ4_NL", "Q4_K", "Q6_K")
    p = str(tmp_path / "q4.gguf")
    write_gguf("qwen2", models["qwen2"][0], Q.Q4_0, p)
    refused(p, "layer 2", "2 layers", layer=2)


def test_block_types_untrusted(tmp_path):
    # Truncated block data and a non-finite block scale are BAD_FILE naming the tensor (the C
    # test, tests/test_gguf.c, covers rows that are not whole blocks).
    rng = np.random.default_rng(5)
    rows = (("attn_q", 256), ("attn_k", 128), ("attn_v", 128), ("attn_output", 256))
    raws = {stem: (random_blocks(Q.Q4_K, r, 256, rng, scale=0.5), Q.Q4_K) for stem, r in rows}
    raws["attn_output"] = (random_blocks(Q.Q6_K, 256, 256, rng, scale=0.5), Q.Q6_K)
    p = str(tmp_path / "t.gguf")
    write_raw(p, raws)
    with open(p, "rb") as f:
        data = f.read()
    with open(p, "wb") as f:
        f.write(data[:-100])
    refused(p, "blk.0.attn_output.weight", "runs past the end")
    raws["attn_k"][0][3, 2:4] = [0x00, 0x7c]  # row 3: its block's dmin = inf
    write_raw(p, raws)
    r = run_cli("run", "--gguf", p, "--input", "/nonexistent.npy", "--out", "/tmp/unused.npy")
    assert r.returncode == 1 and "'blk.0.attn_k.weight' row 3: a Q4_K block's scale is not " \
        "finite" in r.stderr, r.stderr


def test_usage_errors(models, tmp_path):
    _, d = models["llama"]
    r = run_cli("run", "--gguf", "a.gguf", "--model", d, "--input", "x.npy", "--out", "y.npy")
    assert r.returncode == 2 and "exclude each other" in r.stderr
    r = run_cli("run", "--gguf", "a.gguf", "--prefix", "p", "--input", "x.npy", "--out", "y.npy")
    assert r.returncode == 2 and "--prefix cannot be used with --gguf" in r.stderr
    r = run_cli("info", "--gguf", "a.gguf", "--model", d)
    assert r.returncode == 2 and "exclude each other" in r.stderr
    r = run_cli("info", "--gguf", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and "missing.gguf" in r.stderr


def test_python_from_gguf(models, tmp_path):
    # The Python face: mha.MultiheadAttention.from_gguf (same C loader), the model's causal mask
    # and window as the layer's defaults.
    mha = pytest.importorskip("mha")
    model, _ = models["mistral"]
    path = str(tmp_path / "m.gguf")
    oracle = write_gguf("mistral", model, Q.BF16, path)
    x, ref = record(oracle, 1, ids_for("mistral"))
    layer = mha.MultiheadAttention.from_gguf(path, layer=1)
    assert layer.model_info["model_type"] == "llama" and layer.model_info["window"] == (4, 0)
    y = np.stack([layer.forward(xb.astype(np.float32)) for xb in x])
    assert H.max_rel_err(y, ref) <= TOL_OUT_REL
    with pytest.raises(mha.MhaError, match="layer 5"):
        mha.MultiheadAttention.from_gguf(path, layer=5)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_python_from_gguf_keeps_q8_0(models, tmp_path, name):
    # weight_dtype="q8_0": the file's Q8_0 blocks are kept (a q8_0 layer, biases float32), and a
    # q8_0 layer computes exactly the float32 layer on the dequantised weights: the same bits as
    # the default load (Q8_0 dequantised to float32 at load). An F32 file is quantised at load,
    # within the q8_0 quantisation of the oracle's weights.
    mha = pytest.importorskip("mha")
    model, _ = models[name]
    path = str(tmp_path / "q.gguf")
    oracle = write_gguf(name, model, Q.Q8_0, path)
    x, ref = record(oracle, 1, ids_for(name))
    deq = mha.MultiheadAttention.from_gguf(path, layer=1)
    q8 = mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q8_0")
    assert q8.config.weight_dtype == "q8_0" and deq.config.weight_dtype != "q8_0"
    for nm, w in deq.weights.items():
        assert np.array_equal(q8.weights[nm], w), nm
    for xb in x:
        xb = xb.astype(np.float32)
        assert np.array_equal(q8.forward(xb), deq.forward(xb))
    y = np.stack([q8.forward(xb.astype(np.float32)) for xb in x])
    assert H.max_rel_err(y, ref) <= TOL_OUT_REL
    # an F32 file: quantised by mha at load = the Q8_0 file's blocks (gguf's quantiser rounds
    # ties away from zero, mha's to even, and both divide by the f16 scale: equal but for ties)
    path32 = str(tmp_path / "f.gguf")
    write_gguf(name, model, Q.F32, path32)
    q8f = mha.MultiheadAttention.from_gguf(path32, layer=1, weight_dtype="q8_0")
    for nm, w in deq.weights.items():
        if w is None or w.ndim != 2:
            continue
        diff = np.abs(q8f.weights[nm] - w)
        assert (diff > 0).mean() < 0.01, nm  # ties only
    with pytest.raises(ValueError, match="weight_dtype"):
        mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q5_0")


@pytest.mark.parametrize("name,tname", [("mistral", "BF16"), ("qwen2", "Q8_0"), ("qwen3", "F16"),
                                        ("llama3", "F32")])
def test_torch_from_gguf(models, tmp_path, name, tname):
    # The torch face: mha.torch.MultiheadAttention.from_gguf gives the parameters the NumPy
    # loader read (the same C loader; Q8_0 dequantised to float32) and, with no mask, applies the
    # model's causal mask and sliding window: the transformers layer on the file's values.
    mha = pytest.importorskip("mha")
    mt = pytest.importorskip("mha.torch")
    model, _ = models[name]
    path = str(tmp_path / "t.gguf")
    oracle = write_gguf(name, model, TYPES[tname], path)
    x, ref = record(oracle, 1, ids_for(name))
    t = mt.MultiheadAttention.from_gguf(path, 1, batch_first=True)
    src = mha.MultiheadAttention.from_gguf(path, layer=1)
    assert t.model_info == src.model_info
    assert torch.equal(t.q_proj_weight, torch.from_numpy(src.weights["w_q"]))
    assert torch.equal(t.out_proj.weight, torch.from_numpy(src.weights["w_o"]))
    xt = torch.from_numpy(x.astype(np.float32))
    with torch.no_grad():
        y, w = t(xt, xt, xt, need_weights=False)
    assert w is None
    assert H.max_rel_err(y.numpy(), ref) <= TOL_OUT_REL
    with pytest.raises(mha.MhaError, match="layer 5"):
        mt.MultiheadAttention.from_gguf(path, 5)
    with pytest.raises(ValueError, match="layer"):
        mt.MultiheadAttention.from_gguf(path, -1)


def test_cli_weight_dtype_q8_0(models, tmp_path):
    # `mha run --gguf F --weight-dtype q8_0`: a Q4_0 file's projections kept as q8_0 blocks (the
    # same values), so the forward equals the default (float32) load's bit for bit, and matches
    # the float64 oracle; the option's usage errors.
    model, _ = models["llama_wide"]
    path = str(tmp_path / "q4.gguf")
    q4 = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_0}
    oracle = write_gguf("llama_wide", model, q4, path)
    x, ref = record(oracle, 1, ids_for("llama_wide"))
    y32 = run_gguf(path, 1, x, tmp_path)
    y8 = run_gguf(path, 1, x, tmp_path, "--weight-dtype", "q8_0")
    assert np.array_equal(y8, y32)
    assert H.max_rel_err(y8, ref) <= TOL_OUT_REL
    yd = run_gguf(path, 1, x, tmp_path, "--weight-dtype", "q8_0", "--decode")  # the dot path
    assert H.max_rel_err(yd, ref) <= TOL_OUT_REL
    # an F32 file with --weight-dtype q8_0 is quantised at load: not the float32 output, but
    # the output of the same weights as a Q8_0 file (equal blocks but for ties, where gguf's
    # quantiser rounds away from zero and mha's to even: far below one q8_0 step, 1/254)
    p32, p8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    write_gguf("llama_wide", model, Q.F32, p32)
    write_gguf("llama_wide", model, Q.Q8_0, p8)
    yf = run_gguf(p32, 1, x, tmp_path, "--weight-dtype", "q8_0")
    assert not np.array_equal(yf, run_gguf(p32, 1, x, tmp_path))
    assert H.max_rel_err(yf, run_gguf(p8, 1, x, tmp_path)) <= 1.0 / 254
    xp = tmp_path / "x.npy"
    for flags, msg in ((("--weight-dtype", "q5_0"), "is not q8_0 or q4_0"),
                       (("--weight-dtype", "q8_0", "--dtype", "bf16"), "cannot be used with")):
        r = run_cli("run", "--gguf", path, "--layer", 1, "--input", xp, "--out",
                    tmp_path / "z.npy", *flags)
        assert r.returncode == 2 and msg in r.stderr, r.stderr
    r = run_cli("run", "--weights", "w.safetensors", "--heads", 4, "--input", xp, "--out",
                tmp_path / "z.npy", "--weight-dtype", "q8_0")
    assert r.returncode == 2 and "needs --model or --gguf" in r.stderr, r.stderr


def test_q4_0_layer(models, tmp_path):
    # weight_dtype q4_0 (docs/SEMANTICS.md "q4_0 weights"): a Q4_0 file's blocks are kept as they
    # are, and a q4_0 layer computes bit for bit what the q8_0 layer holding the same values does
    # (forward: the packed GEMM; --decode: the dot path), within TOL_OUT_REL of the float64
    # oracle. The Hugging Face loader quantises a float checkpoint to q4_0 (mha_q4_0_quantize) as
    # the constructor does; the CLI's --model --weight-dtype takes it.
    mha = pytest.importorskip("mha")
    model, hf_dir = models["llama_wide"]
    path = str(tmp_path / "q4.gguf")
    q4 = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_0}
    oracle = write_gguf("llama_wide", model, q4, path)
    x, ref = record(oracle, 1, ids_for("llama_wide"))
    for flags in ((), ("--decode",)):
        y4 = run_gguf(path, 1, x, tmp_path, "--weight-dtype", "q4_0", *flags)
        y8 = run_gguf(path, 1, x, tmp_path, "--weight-dtype", "q8_0", *flags)
        assert np.array_equal(y4, y8), flags
        assert H.max_rel_err(y4, ref) <= TOL_OUT_REL, flags
    l4 = mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q4_0")
    l8 = mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q8_0")
    assert l4.config.weight_dtype == "q4_0"
    for nm, w in l8.weights.items():
        assert np.array_equal(l4.weights[nm], w), nm
    for xb in x:
        xb = xb.astype(np.float32)
        assert np.array_equal(l4.forward(xb), l8.forward(xb))
        assert np.array_equal(l4.forward(xb[:1]), l8.forward(xb[:1]))  # one row: the dot path
    # the HF directory, quantised at load = the constructor's quantisation of its float32 weights
    hf = mha.MultiheadAttention.from_pretrained(hf_dir, layer=1)
    hq = mha.MultiheadAttention.from_pretrained(hf_dir, layer=1, weight_dtype="q4_0")
    w = hf.weights
    ref_layer = mha.MultiheadAttention(
        w["w_q"], w["w_k"], w["w_v"], w["w_o"], num_heads=hf.config.num_heads,
        num_kv_heads=hf.config.num_kv_heads, rope=hf.config.rope, weight_dtype="q4_0")
    for nm in ("w_q", "w_k", "w_v", "w_o"):
        assert np.array_equal(hq.weights[nm], ref_layer.weights[nm]), nm
        err = np.abs(hq.weights[nm] - w[nm]).max()
        assert 0 < err <= np.abs(w[nm]).max() / 8 * (1 + 7 * 2.0**-11) + 2.0**-22, nm
    xb = x[0].astype(np.float32)
    assert np.array_equal(hq.forward(xb, causal=True), ref_layer.forward(xb, causal=True))
    xp, yp = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(xp, x)
    r = run_cli("run", "--model", hf_dir, "--layer", 1, "--input", xp, "--out", yp,
                "--weight-dtype", "q4_0")
    assert r.returncode == 0, r.stderr
    yq = np.load(yp)
    assert np.array_equal(yq[0], hq.forward(xb))
    with pytest.raises(ValueError, match="weight_dtype"):
        mha.MultiheadAttention.from_pretrained(hf_dir, layer=1, weight_dtype="int4")


# ---- Phi-3 (general.architecture "phi3"): the fused attn_qkv and LongRoPE ----------------------
#
# llama.cpp's converter (Phi3MiniModel) keeps HF's qkv_proj as blk.L.attn_qkv.weight (rows
# [q (h d); k (g d); v (g d)], not permuted), writes rope.dimension_count = int(partial_rotary *
# hidden) // heads, context_length, rope.scaling.original_context_length, sliding_window (0 when
# the config has none) and, for LongRoPE, the global F32 tensors rope_factors_long.weight /
# rope_factors_short.weight and rope.scaling.attn_factor = sqrt(1 + ln(s) / ln(orig)), s =
# context / orig (1 if s <= 1). Factors exactly representable in float32, so the file holds the
# config's values and the HF directory's layer is the GGUF's bit for bit.
PHI3_SHORT = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0]
PHI3_LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0]
PHI3_ORIG, PHI3_SHORT_SEQ = 8, 6  # calls of 6 tokens take the short list, of SEQ = 12 the long
PHI3 = {
    # partial rotary 0.5 of head_dim 32 (8 pairs), LongRoPE over an original context of 8 (of
    # 64: factor 8, attention factor sqrt(2)), a sliding window of 5
    "phi3_lr": dict(vocab_size=64, num_hidden_layers=2, hidden_size=128, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
                    original_max_position_embeddings=PHI3_ORIG,
                    rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                                         partial_rotary_factor=0.5, short_factor=PHI3_SHORT,
                                         long_factor=PHI3_LONG)),
    # no RoPE scaling, no sliding window (the converter writes 0), partial rotary 0.5
    "phi3": dict(vocab_size=64, num_hidden_layers=2, hidden_size=128, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                      partial_rotary_factor=0.5)),
}


@pytest.fixture(scope="module")
def phi3_models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("phi3"))
    out = {}
    for name, kw in PHI3.items():
        torch.manual_seed(sum(map(ord, name)))
        cfg = T.Phi3Config(**kw)
        cfg._attn_implementation = "eager"
        model = T.Phi3ForCausalLM(cfg).to(torch.float64).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        d = os.path.join(root, name)
        model.save_pretrained(d)
        out[name] = (model, d)
    return out


def write_phi3(name, model, qtype, path, edit=None, lists=("short", "long"), attn_factor=True):
    """The Phi-3 model's attention as llama.cpp's converter writes it (F32 or a quantised fused
    attn_qkv); returns the float64 model holding the file's values (the oracle)."""
    cfg = model.config
    kw = PHI3[name]
    h, g, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    rp = kw["rope_parameters"]
    w = gguf.GGUFWriter(path, "phi3")
    w.add_context_length(cfg.max_position_embeddings)
    orig = kw.get("original_max_position_embeddings", cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(n)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(h)
    w.add_head_count_kv(g)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * n) // h)
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_file_type(int(qtype))
    w.add_sliding_window(kw.get("sliding_window") or 0)
    if "long_factor" in rp:
        import math
        scale = cfg.max_position_embeddings / orig
        if attn_factor:
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        for which in lists:
            w.add_tensor(f"rope_factors_{which}.weight",
                         np.array(rp[f"{which}_factor"], np.float32))
    if edit:
        edit(w)
    oracle = T.Phi3ForCausalLM(cfg).to(torch.float64).eval()
    oracle.load_state_dict(model.state_dict())
    mods = dict(oracle.named_modules())
    for L in range(cfg.num_hidden_layers):
        att = mods[f"model.layers.{L}.self_attn"]
        for hf, gg, qt in (("qkv_proj", "attn_qkv", qtype), ("o_proj", "attn_output", qtype)):
            lin = getattr(att, hf)
            data, raw, back = stored(lin.weight.detach().numpy(), qt)
            w.add_tensor(f"blk.{L}.{gg}.weight", data, raw_dtype=raw)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return oracle


def phi3_ids(seq):
    g = torch.Generator().manual_seed(11 + seq)
    return torch.randint(3, 64, (BATCH, seq), generator=g)


def run_model_dir(d, layer, x, tmp_path):
    xp, yp = tmp_path / "x.npy", tmp_path / "ym.npy"
    np.save(xp, x)
    r = run_cli("run", "--model", d, "--layer", layer, "--input", xp, "--out", yp)
    assert r.returncode == 0, r.stderr
    return np.load(yp)


@pytest.mark.parametrize("name", list(PHI3))
def test_phi3_equals_hf_directory_and_transformers(phi3_models, name, tmp_path):
    # An F32 phi3 file: the layer of the HF directory it came from, bit for bit, and the float64
    # transformers Phi3 attention within TOL_OUT_REL; LongRoPE's short list for a call of 6
    # tokens (<= original 8), its long list for one of 12, partial rotary 0.5, the window.
    model, d = phi3_models[name]
    path = str(tmp_path / f"{name}.gguf")
    oracle = write_phi3(name, model, Q.F32, path)
    outs = {}
    for seq in (PHI3_SHORT_SEQ, SEQ):
        for layer in (0, 1):
            x, ref = record(oracle, layer, phi3_ids(seq))
            y = run_gguf(path, layer, x, tmp_path)
            err = H.max_rel_err(y, ref)
            assert err <= TOL_OUT_REL, f"{name} seq {seq} layer {layer}: max error {err:.3g}"
            np.testing.assert_array_equal(y, run_model_dir(d, layer, x, tmp_path))
            outs[seq, layer] = (x, y)
    if name == "phi3_lr":  # each list is really used: the other one gives another layer
        import json
        d2 = tmp_path / "swapped"
        d2.mkdir()
        for f in os.listdir(d):
            os.symlink(os.path.join(d, f), d2 / f) if f != "config.json" else None
        cfg = json.load(open(os.path.join(d, "config.json")))
        rp = cfg["rope_parameters"]
        rp["short_factor"], rp["long_factor"] = rp["long_factor"], rp["short_factor"]
        json.dump(cfg, open(d2 / "config.json", "w"))
        for seq in (PHI3_SHORT_SEQ, SEQ):
            x, y = outs[seq, 0]
            assert H.max_rel_err(run_model_dir(str(d2), 0, x, tmp_path), y) > 100 * TOL_OUT_REL
    r = run_cli("info", "--gguf", path)
    assert r.returncode == 0, r.stderr
    assert "architecture: phi3" in r.stdout and "attn_qkv" in r.stdout, r.stdout
    assert "rotary_dim 16" in r.stdout, r.stdout
    if name == "phi3_lr":
        assert "scaling longrope (factor 8" in r.stdout and f"window: {WINDOW - 1},0" in r.stdout
    else:
        assert "window" not in r.stdout or "window: none" in r.stdout, r.stdout


def test_phi3_attn_factor(phi3_models, tmp_path):
    # rope.scaling.attn_factor absent: transformers' default sqrt(1 + ln(s) / ln(orig)), the same
    # layer as with the converter's float32 value; another value is the attention factor (the
    # HF config's attention_factor), and changes the layer.
    import json
    model, d = phi3_models["phi3_lr"]
    p1, p2, p3 = (str(tmp_path / f"{i}.gguf") for i in range(3))
    write_phi3("phi3_lr", model, Q.F32, p1)
    write_phi3("phi3_lr", model, Q.F32, p2, attn_factor=False)
    write_phi3("phi3_lr", model, Q.F32, p3, attn_factor=False,
               edit=lambda w: w.add_rope_scaling_attn_factors(1.75))
    x, _ = record(model, 1, phi3_ids(SEQ))
    y1 = run_gguf(p1, 1, x, tmp_path)
    np.testing.assert_array_equal(run_gguf(p2, 1, x, tmp_path), y1)
    y3 = run_gguf(p3, 1, x, tmp_path)
    assert H.max_rel_err(y3, y1) > 100 * TOL_OUT_REL
    d2 = tmp_path / "af"
    d2.mkdir()
    for f in os.listdir(d):
        os.symlink(os.path.join(d, f), d2 / f) if f != "config.json" else None
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["rope_parameters"]["attention_factor"] = 1.75
    json.dump(cfg, open(d2 / "config.json", "w"))
    np.testing.assert_array_equal(y3, run_model_dir(str(d2), 1, x, tmp_path))


@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0"])
def test_phi3_quantised_fused_qkv(phi3_models, tname, tmp_path):
    # A quantised fused attn_qkv: its row blocks are q, k and v as for attn_q etc.: within
    # TOL_OUT_REL of the oracle holding the file's (dequantised) values; as a q8_0 layer the
    # blocks are kept (Q8_0) or mapped exactly (Q4_0): the float32 load's output bit for bit; a
    # q4_0 layer keeps Q4_0 blocks: the q8_0 layer's output bit for bit.
    mha = pytest.importorskip("mha")
    model, _ = phi3_models["phi3_lr"]
    path = str(tmp_path / "q.gguf")
    oracle = write_phi3("phi3_lr", model, getattr(Q, tname), path)
    x, ref = record(oracle, 1, phi3_ids(SEQ))
    y32 = run_gguf(path, 1, x, tmp_path)
    assert H.max_rel_err(y32, ref) <= TOL_OUT_REL
    _, unrounded = record(model, 1, phi3_ids(SEQ))
    assert H.max_rel_err(y32, unrounded) > 10 * TOL_OUT_REL  # the file's rounding is seen
    y8 = run_gguf(path, 1, x, tmp_path, "--weight-dtype", "q8_0")
    assert np.array_equal(y8, y32)
    deq = mha.MultiheadAttention.from_gguf(path, layer=1)
    q8 = mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q8_0")
    for nm in ("w_q", "w_k", "w_v", "w_o"):
        assert np.array_equal(q8.weights[nm], deq.weights[nm]), nm
    if tname == "Q4_0":
        q4 = mha.MultiheadAttention.from_gguf(path, layer=1, weight_dtype="q4_0")
        assert q4.config.weight_dtype == "q4_0"
        for xb in x:
            xb = xb.astype(np.float32)
            assert np.array_equal(q4.forward(xb), q8.forward(xb))
            assert np.array_equal(q4.forward(xb[:1]), q8.forward(xb[:1]))  # the dot path
        assert np.array_equal(run_gguf(path, 1, x, tmp_path, "--weight-dtype", "q4_0"), y8)


def test_phi3_refused_by_name(phi3_models, tmp_path):
    model, _ = phi3_models["phi3_lr"]
    p = str(tmp_path / "bad.gguf")
    write_phi3("phi3_lr", model, Q.F32, p, lists=("long",))
    refused(p, "rope_factors_long.weight without rope_factors_short.weight")
    write_phi3("phi3_lr", model, Q.F32, p, lists=("short",))
    refused(p, "rope_factors_short.weight without rope_factors_long.weight")
    write_phi3("phi3_lr", model, Q.F32, p, lists=(),
               edit=lambda w: (w.add_tensor("rope_factors_short.weight", np.ones(5, np.float32)),
                               w.add_tensor("rope_factors_long.weight", np.ones(5, np.float32))))
    refused(p, "rope_factors_short.weight must be F32 with 1 dimension {8}")
    for bad, word in ((0.0, "= 0 is not"), (-1.0, "= -1 is not"), (np.inf, "= inf is not"),
                      (np.nan, "= nan is not")):
        f = np.array(PHI3_LONG, np.float32)
        f[3] = bad
        write_phi3("phi3_lr", model, Q.F32, p, lists=("short",),
                   edit=lambda w, f=f: w.add_tensor("rope_factors_long.weight", f))
        refused(p, "rope_factors_long.weight[3]", word, "finite number > 0")
    write_phi3("phi3_lr", model, Q.F32, p, lists=(),
               edit=lambda w: (w.add_tensor("rope_factors_short.weight", np.ones(8, np.float16)),
                               w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32))))
    refused(p, "rope_factors_short.weight must be F32", "not F16")
    write_phi3("phi3_lr", model, Q.F32, p, attn_factor=False,
               edit=lambda w: w.add_rope_scaling_attn_factors(-2.0))
    refused(p, "phi3.rope.scaling.attn_factor", "finite number > 0")
    write_phi3("phi3", phi3_models["phi3"][0], Q.F32, p,
               edit=lambda w: w.add_rope_scaling_attn_factors(1.5))
    refused(p, "phi3.rope.scaling.attn_factor", "not supported")
    write_phi3("phi3_lr", model, Q.F32, p,
               edit=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                               w.add_rope_scaling_factor(2.0)))
    refused(p, "rope_factors_short/long.weight together with phi3.rope.scaling.type")
    write_phi3("phi3_lr", model, Q.F32, p,
               edit=lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)))
    refused(p, "rope_factors_short/long.weight together with", "rope_freqs.weight")
    # both the fused and a separate projection; a fused tensor of the wrong row count
    write_phi3("phi3_lr", model, Q.F32, p,
               edit=lambda w: w.add_tensor("blk.0.attn_k.weight", np.zeros((64, 128), np.float32)))
    refused(p, "both the fused blk.0.attn_qkv.weight and the separate blk.0.attn_k.weight")
    # head_count_kv 1 (replacing 2): (4 + 2) x 32 rows expected, the file's attn_qkv has 256
    write_phi3("phi3_lr", model, Q.F32, p, edit=lambda w: w.add_head_count_kv(1))
    refused(p, "tensor 'blk.0.attn_qkv.weight'", "{128, 256", "expected 2 dimensions {128, 192}")
    # more rotary pairs than mha keeps (MHA_ROPE_MAX_PAIRS = 128): refused before any tensor
    w = gguf.GGUFWriter(p, "phi3")
    w.add_block_count(1)
    w.add_embedding_length(258)
    w.add_head_count(1)
    w.add_rope_dimension_count(258)
    w.add_rope_scaling_orig_ctx_len(8)
    for which in ("short", "long"):
        w.add_tensor(f"rope_factors_{which}.weight", np.ones(129, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(p, "rope_factors_short.weight: 129 rotary pairs, more than 128")


def test_phi3_fused_bias_and_separate_projections(phi3_models, tmp_path):
    # attn_qkv.bias (llama.cpp reads one for phi3; HF's Phi-3 has none): its [q; k; v] parts are
    # the three biases; a phi3 file with separate attn_q / attn_k / attn_v instead of the fused
    # tensor is read as they are (llama.cpp accepts either); attn_qkv.bias alone is refused.
    mha = pytest.importorskip("mha")
    model, _ = phi3_models["phi3"]
    rng = np.random.default_rng(3)
    bias = rng.standard_normal(256).astype(np.float32)
    p = str(tmp_path / "b.gguf")
    write_phi3("phi3", model, Q.F32, p, edit=lambda w: w.add_tensor("blk.1.attn_qkv.bias", bias))
    layer = mha.MultiheadAttention.from_gguf(p, layer=1)
    assert np.array_equal(layer.weights["b_q"], bias[:128])
    assert np.array_equal(layer.weights["b_k"], bias[128:192])
    assert np.array_equal(layer.weights["b_v"], bias[192:])
    fused = mha.MultiheadAttention.from_gguf(p, layer=0)
    assert fused.weights.get("b_q") is None
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.detach().numpy().astype(np.float32)
    w = gguf.GGUFWriter(p, "phi3")
    w.add_block_count(1)
    w.add_embedding_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_sliding_window(0)
    for stem, rows in (("attn_q", qkv[:128]), ("attn_k", qkv[128:192]), ("attn_v", qkv[192:]),
                       ("attn_output", fused.weights["w_o"])):
        w.add_tensor(f"blk.0.{stem}.weight", np.ascontiguousarray(rows))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sep = mha.MultiheadAttention.from_gguf(p)
    for nm in ("w_q", "w_k", "w_v", "w_o"):
        assert np.array_equal(sep.weights[nm], fused.weights[nm]), nm
    w = gguf.GGUFWriter(p, "phi3")
    w.add_block_count(1)
    w.add_embedding_length(128)
    w.add_head_count(4)
    w.add_tensor("blk.0.attn_qkv.bias", bias)
    w.add_tensor("blk.0.attn_output.weight", np.zeros((128, 128), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(p, "blk.0.attn_qkv.bias without blk.0.attn_qkv.weight")

# SPDX-License-Identifier: MIT
"""`mha.MultiheadAttention.from_pretrained(DIR, layer=L)` and the torch drop-in's
`mha.torch.MultiheadAttention.from_pretrained` against Hugging Face transformers: the tiny random
models of tests/hf_models.py (every supported model_type, sliding-window layers included), the
attention module's float64 output as the oracle, at the layer tolerance (TOL_OUT_REL of max|ref|).
Unsupported configs raise MhaError naming the field.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import torch  # noqa: E402  (required: CI installs python/requirements-test.txt)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models as H  # noqa: E402
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from tolerances import (TOL_GRAD_REL, TOL_HALF_C, TOL_HALF_LAYER_TILE_C,  # noqa: E402
                        TOL_HALF_U_BF16, TOL_HALF_U_F16, TOL_OUT_REL)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {name: H.build(name, root) for name in H.CASES}


CASE_LAYERS = [(name, layer) for name, case in H.CASES.items() for layer in case[4]]


@pytest.mark.parametrize("name,layer", CASE_LAYERS)
def test_from_pretrained_matches_transformers(models, name, layer):
    d, refs = models[name]
    x, ref = refs[layer]
    m = mha.MultiheadAttention.from_pretrained(d, layer=layer)
    assert m.model_info["model_type"] == H.CASES[name][0].model_type
    assert m.model_info["layer"] == layer
    err = H.max_rel_err(m(x), ref)
    assert err <= TOL_OUT_REL, f"{name} layer {layer}: max error {err:.3g} of max|ref|"
    # The torch drop-in: the same layer as nn.MultiheadAttention-style parameters.
    t = mt.MultiheadAttention.from_pretrained(d, layer, batch_first=True)
    xt = torch.from_numpy(x.astype(np.float32))
    with torch.no_grad():
        yt, w = t(xt, xt, xt, need_weights=False)
    assert w is None
    err = H.max_rel_err(yt.numpy(), ref)
    assert err <= TOL_OUT_REL, f"torch {name} layer {layer}: max error {err:.3g}"


NORM_CASES = [(name, layer) for name in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "qwen3_next")
              for layer in H.CASES[name][4]]
# mha's gradient names of the attention module's parameters (nn.Linear layout on both sides).
GRAD_NAMES = {"q_proj.weight": "w_q", "k_proj.weight": "w_k", "v_proj.weight": "w_v",
              "o_proj.weight": "w_o", "q_proj.bias": "b_q", "k_proj.bias": "b_k",
              "v_proj.bias": "b_v", "o_proj.bias": "b_o", "q_norm.weight": "q_norm",
              "k_norm.weight": "k_norm"}


@pytest.mark.parametrize("name,layer", NORM_CASES)
def test_gradients_match_torch_autograd(models, name, layer):
    # QK-norm layers (issue 31): every weight's gradient, the norm weights' included, and the
    # input's, against torch autograd of transformers' module in float64.
    d, refs = models[name]
    x, ref = refs[layer]
    dy = np.random.default_rng(layer).standard_normal(ref.shape)
    y_ref, g_ref = H.autograd_grads(d, name, layer, x, dy)
    assert H.max_rel_err(y_ref, ref) < 1e-12  # the same module as the recorded oracle
    m = mha.MultiheadAttention.from_pretrained(d, layer=layer)
    y, state = m.forward_train(x)
    g = m.backward(state, dy)
    assert set(GRAD_NAMES[k] for k in g_ref if k != "query") | {"query"} == set(g)
    assert "q_norm" in g and "k_norm" in g
    c = m.config
    for k, ref_g in g_ref.items():
        nm = GRAD_NAMES.get(k, k)
        got = g[nm]
        if c.output_gate and nm in ("w_q", "b_q"):  # mha's [q; gate] rows as HF's [h, 2, d]
            got = got.reshape(2, c.num_heads, c.head_dim, -1).transpose(1, 0, 2, 3).reshape(
                ref_g.shape)
        err = H.max_rel_err(got, ref_g)
        assert err <= TOL_GRAD_REL, f"{name} layer {layer}: d{nm} max error {err:.3g}"


NOPE_CASES = [(name, layer) for name in ("smollm3", "cohere2", "llama4_text")
              for layer in H.CASES[name][4]]


@pytest.mark.parametrize("name,layer", NOPE_CASES)
def test_nope_chunk_temperature_gradients_match_torch_autograd(models, name, layer):
    # NoPE layers, Llama 4's chunks, L2 QK-norm and temperature tuning (issue 31): every
    # weight's gradient and the input's against torch autograd of transformers' module (float64).
    d, refs = models[name]
    x, ref = refs[layer]
    dy = np.random.default_rng(layer).standard_normal(ref.shape)
    y_ref, g_ref = H.autograd_grads(d, name, layer, x, dy)
    assert H.max_rel_err(y_ref, ref) < 1e-12  # the same module as the recorded oracle
    m = mha.MultiheadAttention.from_pretrained(d, layer=layer)
    y, state = m.forward_train(x)
    assert H.max_rel_err(y, ref) <= TOL_OUT_REL
    g = m.backward(state, dy)
    assert set(GRAD_NAMES[k] for k in g_ref if k != "query") | {"query"} == set(g)
    for k, ref_g in g_ref.items():
        nm = GRAD_NAMES.get(k, k)
        err = H.max_rel_err(g[nm], ref_g)
        assert err <= TOL_GRAD_REL, f"{name} layer {layer}: d{nm} max error {err:.3g}"


def test_llama4_layers_use_what_their_config_says(models):
    # Layer 0 rotates, normalises (L2 after RoPE) and attends in chunks; layer 1 is NoPE with
    # temperature tuning; each feature changes the output (so each test above can fail).
    d, refs = models["llama4_text"]
    m0 = mha.MultiheadAttention.from_pretrained(d, layer=0)
    m1 = mha.MultiheadAttention.from_pretrained(d, layer=1)
    assert m0.model_info["chunk_size"] == H.WINDOW and m0.config.qk_norm.kind == "l2_after_rope"
    assert m0.config.rope is not None and m0.config.temperature is None
    assert m1.config.rope is None and m1.config.temperature == (4.0, 0.5)
    assert m1.model_info["chunk_size"] is None and m1.config.qk_norm is None
    x0, ref0 = refs[0]
    assert H.max_rel_err(m0(x0, causal=True), ref0) <= TOL_OUT_REL  # causal brings the chunks
    m0._chunk_size = 0
    assert H.max_rel_err(m0(x0), ref0) > 100 * TOL_OUT_REL
    x1, ref1 = refs[1]
    w = m1.weights
    plain = mha.MultiheadAttention(w["w_q"], w["w_k"], w["w_v"], w["w_o"],
                                   num_heads=m1.config.num_heads,
                                   num_kv_heads=m1.config.num_kv_heads)
    assert H.max_rel_err(plain(x1, causal="bottom-right"), ref1) > 100 * TOL_OUT_REL
    tuned = mha.MultiheadAttention(w["w_q"], w["w_k"], w["w_v"], w["w_o"],
                                   num_heads=m1.config.num_heads,
                                   num_kv_heads=m1.config.num_kv_heads, temperature=(4, 0.5))
    np.testing.assert_array_equal(tuned(x1, causal="bottom-right"), m1(x1))


@pytest.mark.parametrize("name,layer,changes,match", [
    ("llama4_text", 1, {"floor_scale": 0}, "floor_scale"),
    ("llama4_text", 1, {"floor_scale": -8192}, "floor_scale"),
    ("llama4_text", 1, {"attn_scale": "0.1"}, "attn_scale"),
    ("llama4_text", 1, {"attn_scale": 1e300}, "attn_scale"),
    ("llama4_text", 1, {"attn_temperature_tuning": 1}, "attn_temperature_tuning"),
    ("llama4_text", 0, {"attention_chunk_size": 0}, "attention_chunk_size"),
    ("llama4_text", 0, {"attention_chunk_size": -5}, "attention_chunk_size"),
    ("llama4_text", 0, {"attention_chunk_size": None}, "attention_chunk_size"),
    ("llama4_text", 0, {"use_qk_norm": "yes"}, "use_qk_norm"),
    ("llama4_text", 0, {"layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types\[0\]"),
    ("llama4_text", 0, {"no_rope_layers": [1, 0, 1]}, "no_rope_layers"),
    ("smollm3", 1, {"no_rope_layers": [1, 2]}, r"no_rope_layers\[1\]"),
    ("smollm3", 0, {"no_rope_layers": "1, 0"}, "no_rope_layers"),
    ("smollm3", 0, {"layer_types": ["chunked_attention", "full_attention"]},
     r"layer_types\[0\]"),
    ("cohere2", 0, {"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
])
def test_hostile_nope_chunk_temperature_configs_are_refused(models, tmp_path, name, layer,
                                                             changes, match):
    bad = H.edit_config(models[name][0], str(tmp_path / "bad"), **changes)
    with pytest.raises(mha.MhaError, match=match):
        mha.MultiheadAttention.from_pretrained(bad, layer=layer)


def test_from_safetensors_reads_the_norm_weights(models, tmp_path):
    # The generic loader (no config.json) with the QK-norm given by the caller: q_norm.weight
    # and k_norm.weight found under the prefix; without qk_norm the same file is another layer.
    d, refs = models["qwen3"]
    x, ref = refs[0]  # layer 0: full attention
    path = os.path.join(d, "model.safetensors")
    kw = dict(prefix="model.layers.0.self_attn.", rope=mha.Rope(style="half", theta=1e4))
    m = mha.MultiheadAttention.from_safetensors(path, 4, qk_norm=mha.QKNorm("rms_head", 1e-6),
                                                **kw)
    assert m.config.qk_norm == mha.QKNorm("rms_head", 1e-6)
    assert H.max_rel_err(m(x, causal=True), ref) <= TOL_OUT_REL
    plain = mha.MultiheadAttention.from_safetensors(path, 4, **kw)
    assert H.max_rel_err(plain(x, causal=True), ref) > 100 * TOL_OUT_REL
    from safetensors.numpy import load_file, save_file
    t = load_file(path)
    del t["model.layers.0.self_attn.k_norm.weight"]
    bad = str(tmp_path / "no_k_norm.safetensors")
    save_file(t, bad)
    with pytest.raises(mha.MhaError, match="k_norm.weight"):
        mha.MultiheadAttention.from_safetensors(bad, 4, qk_norm={"kind": "rms_head"}, **kw)


def test_qwen3_next_linear_attention_layer_is_refused(models):
    with pytest.raises(mha.MhaError, match=r"layer_types\[1\].*linear_attention"):
        mha.MultiheadAttention.from_pretrained(models["qwen3_next"][0], layer=1)


def test_model_mask_is_the_default_and_can_be_overridden(models):
    d, refs = models["gemma2"]
    x, ref = refs[0]  # a sliding layer
    m = mha.MultiheadAttention.from_pretrained(d, layer=0)
    assert m.model_info["window"] == (H.WINDOW - 1, 0) and m.model_info["causal"]
    y_default = m(x)
    np.testing.assert_array_equal(y_default, m(x, causal=True, window=(H.WINDOW - 1, 0)))
    assert H.max_rel_err(m(x, window=(-1, -1)), ref) > 100 * TOL_OUT_REL
    # A layer built from weights keeps the old default: no mask.
    w = m.weights
    plain = mha.MultiheadAttention(w["w_q"], w["w_k"], w["w_v"], w["w_o"],
                                   num_heads=m.config.num_heads, rope=m.config.rope,
                                   scale=m.config.scale, softcap=m.config.softcap)
    np.testing.assert_array_equal(plain(x), m(x, causal=False, window=(-1, -1)))


def test_torch_drop_in_trains(models):
    # Gradients flow to the loaded parameters (GQA: k/v weights keep their g kv heads).
    d, refs = models["llama"]
    x, _ = refs[0]
    t = mt.MultiheadAttention.from_pretrained(d, 0, batch_first=True)
    assert t.k_proj_weight.shape[0] == 2 * 16 and t.q_proj_weight.shape[0] == 4 * 16
    xt = torch.from_numpy(x.astype(np.float32)).requires_grad_()
    y, _ = t(xt, xt, xt, need_weights=False)
    y.square().sum().backward()
    assert xt.grad is not None and t.k_proj_weight.grad is not None
    assert torch.isfinite(t.in_proj_bias.grad).all()


def test_torch_module_reads_its_qk_norm_buffers_and_attention_dropout(models, tmp_path):
    # The sinks and QK-norm weights of a from_pretrained module are buffers: an in-place edit
    # takes effect at the next call (until session 51 the layer kept the loaded copies). The
    # oracle: the same edit saved in a model directory and loaded afresh.
    d, refs = models["qwen3"]
    x = torch.from_numpy(refs[0][0].astype(np.float32))
    _, _, model_cls, path, _ = H.CASES["qwen3"]
    hf = model_cls.from_pretrained(d, attn_implementation="eager")
    attn = hf.get_submodule(path.format(L=0))
    with torch.no_grad():
        attn.q_norm.weight.mul_(2.0)
        attn.k_norm.weight.add_(0.5)
    hf.save_pretrained(str(tmp_path / "edited"))
    t = mt.MultiheadAttention.from_pretrained(d, 0, batch_first=True)
    fresh = mt.MultiheadAttention.from_pretrained(str(tmp_path / "edited"), 0, batch_first=True)
    with torch.no_grad():
        y0 = t(x, x, x, need_weights=False)[0]
        t.q_norm.mul_(2.0)
        t.k_norm.add_(0.5)
        y1 = t(x, x, x, need_weights=False)[0]
        y2 = fresh(x, x, x, need_weights=False)[0]
    assert (y1 - y0).abs().max() > 0.1
    assert torch.equal(y1, y2)
    # config.json's attention_dropout becomes the module's dropout (applied in training only).
    drop = mt.MultiheadAttention.from_pretrained(
        H.edit_config(d, str(tmp_path / "dropout"), attention_dropout=0.25), 0, batch_first=True)
    assert drop.dropout == 0.25 and t.dropout == 0.0
    with pytest.raises(ValueError, match="attention_dropout"):
        mt.MultiheadAttention.from_pretrained(
            H.edit_config(d, str(tmp_path / "bad_dropout"), attention_dropout=1.5), 0)


def test_unsupported_configs_raise_naming_the_field(models, tmp_path):
    with pytest.raises(mha.MhaError, match="rope_type.*not_a_scaling"):
        mha.MultiheadAttention.from_pretrained(
            H.edit_config(models["llama"][0], str(tmp_path / "unknown"),
                          rope_parameters={"rope_type": "not_a_scaling", "factor": 2.0}))
    with pytest.raises(mha.MhaError, match="long_factor.*8 numbers"):
        mha.MultiheadAttention.from_pretrained(
            H.edit_config(models["llama"][0], str(tmp_path / "long"),
                          rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [2.0] * 7,
                                           "original_max_position_embeddings": 16}))
    with pytest.raises(mha.MhaError, match="model_type"):
        mt.MultiheadAttention.from_pretrained(
            H.edit_config(models["llama"][0], str(tmp_path / "x"), model_type="mamba"))
    with pytest.raises(mha.MhaError, match="layer 7 does not exist"):
        mha.MultiheadAttention.from_pretrained(models["llama"][0], layer=7)
    with pytest.raises(ValueError, match="layer"):
        mha.MultiheadAttention.from_pretrained(models["llama"][0], layer=-1)
    # ctypes would pass 2^64 + 1 as layer 1 (int64_t modulo 2^64): a layer never asked for.
    for big in (2**63, 2**64, 2**64 + 1):
        with pytest.raises(ValueError, match="layer"):
            mha.MultiheadAttention.from_pretrained(models["llama"][0], layer=big)
        with pytest.raises(ValueError, match="layer"):
            mt.MultiheadAttention.from_pretrained(models["llama"][0], big)
        with pytest.raises(ValueError, match="layer"):
            mha.MLA.from_pretrained(models["llama"][0], big)


@pytest.mark.parametrize("name,layer", CASE_LAYERS)
def test_torch_compiled_from_pretrained_matches_transformers(models, name, layer):
    # torch.compile traces the drop-in to torch projections and RoPE around torch.ops.mha.attention
    # with the model's options (not libmha's eager layer): the same HF oracle must hold.
    d, refs = models[name]
    x, ref = refs[layer]
    t = mt.MultiheadAttention.from_pretrained(d, layer, batch_first=True)
    torch._dynamo.reset()  # a new code cache per case (dynamo's recompile limit is 8)
    f = torch.compile(lambda x: t(x, x, x, need_weights=False)[0], backend="eager",
                      fullgraph=True)
    with torch.no_grad():
        y = f(torch.from_numpy(x.astype(np.float32)))
    err = H.max_rel_err(y.numpy(), ref)
    assert err <= TOL_OUT_REL, f"compiled torch {name} layer {layer}: max error {err:.3g}"


HALF_CASES = [(name, dt) for name in ("qwen3", "gemma3_text", "olmo2", "llama4_text", "qwen3_next")
              for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("name,dtype", HALF_CASES,
                         ids=[f"{n}-{str(d)[6:]}" for n, d in HALF_CASES])
def test_half_module_matches_transformers_half(tmp_path, name, dtype):
    """A bf16 / f16 model with a QK-norm, temperature tuning or an output gate (docs/SEMANTICS.md
    "Half precision in the layer": each stage's result rounded to the module's dtype) against the
    same transformers module run in that dtype and in float64 on the same rounded weights and
    input. The float64 module does not round its intermediates, so both half modules are within
    (TOL_HALF_C + TOL_HALF_LAYER_TILE_C) u_s + TOL_OUT_REL of its max|y| (the output's rounding
    plus about one u_s per rounded stage, propagated; measured at most 1.1 u_s for mha, 1.3 u_s
    for transformers, Zen 5), and so within twice that of each other."""
    cfg_cls, kw, model_cls, path, layers = H.CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = model_cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(dtype)  # the weights rounded once
    model.save_pretrained(tmp_path)
    store = {}

    def pre(_m, args, kwargs):  # records the half input; the float64 run is given the same
        if "x" not in store:
            store["x"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
            return None
        x = store["x"].to(torch.float64)
        return ((x,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def post(_m, _args, _kwargs, out):
        store["y"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    u = TOL_HALF_U_BF16 if dtype is torch.bfloat16 else TOL_HALF_U_F16
    for layer in layers:
        ys = {}
        store.clear()
        for prec in (dtype, torch.float64):
            model = model.to(prec)
            mods = dict(model.named_modules())
            m = mods[path.format(L=layer)]
            hs = [m.register_forward_pre_hook(pre, with_kwargs=True),
                  m.register_forward_hook(post, with_kwargs=True)]
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
            for h in hs:
                h.remove()
            ys[prec] = store["y"]
        t = mt.MultiheadAttention.from_pretrained(str(tmp_path), layer, batch_first=True).to(dtype)
        x = store["x"]
        with torch.no_grad():
            y, _ = t(x, x, x, need_weights=False)
        assert y.dtype is dtype
        ref = ys[torch.float64]
        tol = ((TOL_HALF_C + TOL_HALF_LAYER_TILE_C) * u + TOL_OUT_REL) * ref.abs().max().item()
        for what, got, bound in (("mha", y, tol), ("transformers", ys[dtype], tol),
                                 ("mha vs transformers", y, 2 * tol)):
            other = ys[dtype] if what == "mha vs transformers" else ref
            err = (got.double() - other.double()).abs().max().item()
            assert err <= bound, f"{name} layer {layer} {dtype}: {what} {err:.3e} > {bound:.3e}"
        model = model.to(dtype)

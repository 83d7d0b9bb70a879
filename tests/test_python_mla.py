# SPDX-License-Identifier: MIT
"""Multi-head latent attention (mha.MLA, mha.MLACache; mha_mla_* and mha_hf_mla_load) against
transformers 5.24's DeepseekV2Attention / DeepseekV3Attention: tiny random deepseek_v2 and
deepseek_v3 models (with and without q_lora_rank, interleaved and rotate_half RoPE, YaRN with
mscale / mscale_all_dim, attention biases) built in float64, the attention module's own output
recorded with hooks as the oracle.
  - the expanded forward (from_pretrained) within TOL_OUT_REL of max|ref|;
  - the compressed-cache decode, token by token and in chunks, equal to the same rows of the full
    causal forward (TOL_OUT_REL for a float32 cache, TOL_KV_F16_REL / TOL_KV_BF16_REL for half
    caches: each cached value is rounded once, as in the KV cache's tests);
  - hostile config.json / checkpoints refused naming the field or tensor;
  - mha.torch.MLA (torch.ops.mha.mla): gradients against torch autograd of the HF module,
    torch.compile(fullgraph=True) and torch.export equal to eager bit for bit, the C layer cached
    until a weight changes;
  - `mha run --model DIR --layer L` (forward, and --decode through the compressed cache at each
    --cache-dtype within that dtype's tolerance).
"""
import json
import os
import shutil
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import torch  # noqa: E402
import transformers as T  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models as H  # noqa: E402
import mha  # noqa: E402
from tolerances import TOL_GRAD_REL, TOL_KV_BF16_REL, TOL_KV_F16_REL, TOL_OUT_REL  # noqa: E402

SEQ, BATCH = 12, 2
BASE = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=64, hidden_size=32,
            intermediate_size=32, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
            first_k_dense_replace=2)
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
            mscale=0.8, mscale_all_dim=0.9)

# name: (config class, kwargs, model class)
CASES = {
    "v3_lora_yarn": (T.DeepseekV3Config, dict(BASE, q_lora_rank=24, attention_bias=True,
                                              rope_parameters=YARN), T.DeepseekV3ForCausalLM),
    "v3_no_lora_half": (T.DeepseekV3Config, dict(BASE, q_lora_rank=None, rope_interleave=False,
                                                 rope_parameters=dict(rope_type="default",
                                                                      rope_theta=1e4)),
                        T.DeepseekV3ForCausalLM),
    "v2_no_lora": (T.DeepseekV2Config, dict(BASE, q_lora_rank=None,
                                            rope_parameters=dict(rope_type="default",
                                                                 rope_theta=1e4)),
                   T.DeepseekV2ForCausalLM),
}


def build(name, root):
    cfg_cls, kw, model_cls = CASES[name]
    d = os.path.join(root, name)
    torch.manual_seed(sum(map(ord, name)))
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = model_cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for n, p in model.named_parameters():
            if "layernorm" in n and "self_attn" in n:
                p.add_(1.0)  # norm weights around 1, not 0: every element shows
    refs = {}
    for layer in (0, 1):
        store = {}
        handles = H._hooks(model, "model.layers.{L}.self_attn", layer, store)
        ids = torch.randint(3, 64, (BATCH, SEQ))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        for h in handles:
            h.remove()
        refs[layer] = (store["x"], store["y"])
    model.save_pretrained(d)
    MODELS[name] = model
    return d, refs


MODELS = {}  # name: the float64 transformers model (the backward test runs its attention)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mla"))
    return {name: build(name, root) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("layer", [0, 1])
def test_forward_matches_transformers(models, name, layer):
    d, refs = models[name]
    x, ref = refs[layer]
    m = mha.MLA.from_pretrained(d, layer)
    assert m.model_info["model_type"] == CASES[name][0].model_type
    assert m.model_info["prefix"] == f"model.layers.{layer}.self_attn."
    err = H.max_rel_err(m.forward(x), ref)
    print(f"{name} layer {layer}: forward max rel err {err:.2e}")
    assert err <= TOL_OUT_REL
    # Not causal differs (the check can fail).
    assert H.max_rel_err(m.forward(x, causal=False), ref) > 100 * TOL_OUT_REL


def test_config_is_read(models):
    c = mha.MLA.from_pretrained(models["v3_lora_yarn"][0], 0).config
    assert (c.hidden, c.num_heads, c.q_lora_rank, c.kv_lora_rank) == (32, 4, 24, 16)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.bias) == (8, 8, 12, 1)
    assert c.rope.style == 1 and c.rope.scaling == 4  # interleaved, YaRN
    ms = 0.1 * 0.9 * np.log(4.0) + 1.0
    assert c.scale == pytest.approx(16 ** -0.5 * ms * ms, rel=1e-15)
    c2 = mha.MLA.from_pretrained(models["v3_no_lora_half"][0], 0).config
    assert c2.q_lora_rank == 0 and c2.rope.style == 2 and c2.bias == 0


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype,tol", [("float32", TOL_OUT_REL), ("float16", TOL_KV_F16_REL),
                                       ("bfloat16", TOL_KV_BF16_REL)])
def test_compressed_decode_matches_full_forward(models, name, dtype, tol):
    d, refs = models[name]
    x, ref = refs[1]
    m = mha.MLA.from_pretrained(d, 1)
    c = m.config
    cache = mha.MLACache(m, SEQ, batch=BATCH, dtype=dtype)
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    assert cache.bytes_per_token == (c.kv_lora_rank + c.qk_rope_head_dim) * size
    out = np.empty_like(x)
    out[:, :5] = cache.step(x[:, :5])  # a prompt of 5 tokens, then one by one
    for t in range(5, SEQ):
        out[:, t:t + 1] = cache.step(x[:, t:t + 1])
    assert cache.length(0) == cache.length(1) == SEQ
    err = H.max_rel_err(out, ref)
    print(f"{name} {dtype}: compressed-cache decode max rel err {err:.2e}, "
          f"{cache.bytes_per_token} bytes per token")
    assert err <= tol
    # The expanded forward agrees too (the two forms are the same function).
    assert H.max_rel_err(out, m.forward(x).astype(np.float64)) <= tol


def test_decode_sequences_apart(models):
    """seq_ids: the sequences of one cache advance separately; a full cache is refused."""
    d, refs = models["v3_lora_yarn"]
    x, ref = refs[0]
    m = mha.MLA.from_pretrained(d, 0)
    cache = mha.MLACache(m, SEQ, batch=2)
    out1 = np.concatenate([cache.step(x[1:2, t:t + 1], seq_ids=[1]) for t in range(SEQ)], 1)
    assert cache.length(0) == 0 and cache.length(1) == SEQ
    assert H.max_rel_err(out1[0], ref[1]) <= TOL_OUT_REL
    with pytest.raises(mha.MhaError, match="max_seq"):
        cache.step(x[1:2, :1], seq_ids=[1])
    assert cache.length(1) == SEQ
    cache.reset(1)
    assert cache.length(1) == 0


def test_cache_integers_outside_int64_are_refused(models):
    """MLACache's sizes and sequence indices go to C as int64_t: a Python int outside int64
    raises naming the argument (ctypes would pass it modulo 2^64: 2^64 would be sequence 0, and
    2^64 + 2 a batch of 2), as KVCache's do; a non-integer raises TypeError."""
    d, refs = models["v3_lora_yarn"]
    x, _ = refs[0]
    m = mha.MLA.from_pretrained(d, 0)
    cache = mha.MLACache(m, SEQ, batch=2)
    cache.step(x[:, :3])
    with pytest.raises(ValueError, match="seq=18446744073709551616 is outside int64"):
        cache.length(2**64)
    with pytest.raises(ValueError, match="seq=18446744073709551616 is outside int64"):
        cache.reset(2**64)
    assert cache.length(0) == 3  # sequence 0 untouched
    with pytest.raises(ValueError, match="batch=18446744073709551618 is outside int64"):
        mha.MLACache(m, SEQ, batch=2**64 + 2)
    with pytest.raises(ValueError, match="max_seq=18446744073709551628 is outside int64"):
        mha.MLACache(m, 2**64 + SEQ, batch=2)
    with pytest.raises(TypeError, match="batch"):
        mha.MLACache(m, SEQ, batch=2.7)
    assert mha.MLACache(m, SEQ, batch=np.int64(2)).length(1) == 0


HF_NAMES = {"q_proj.weight": "w_q", "q_a_proj.weight": "w_q_a", "q_a_proj.bias": "b_q_a",
            "q_a_layernorm.weight": "q_a_norm", "q_b_proj.weight": "w_q_b",
            "kv_a_proj_with_mqa.weight": "w_kv_a", "kv_a_proj_with_mqa.bias": "b_kv_a",
            "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "w_kv_b",
            "o_proj.weight": "w_o", "o_proj.bias": "b_o"}


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_torch_autograd(models, name):
    """Gradients of every weight (norm weights included) and of x against torch autograd of
    transformers' attention module (float64, causal mask), each within TOL_GRAD_REL of its own
    max|ref| (the layer's gradient tolerance)."""
    d, refs = models[name]
    x, _ = refs[1]
    model = MODELS[name]
    attn = model.model.layers[1].self_attn
    xt = torch.tensor(x, requires_grad=True)
    pos = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    pe = model.model.rotary_emb(xt, pos)
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    rng = np.random.default_rng(3)
    dy = rng.standard_normal(x.shape)
    attn.zero_grad()
    y = attn(hidden_states=xt, position_embeddings=pe, attention_mask=mask)[0]
    assert H.max_rel_err(y.detach().numpy(), refs[1][1]) < 1e-12  # the module as the hooks saw
    y.backward(torch.tensor(dy))
    ref = {HF_NAMES[n]: p.grad.numpy() for n, p in attn.named_parameters()}
    ref["x"] = xt.grad.numpy()
    m = mha.MLA.from_pretrained(d, 1)
    got = m.backward(x, dy)
    assert set(got) == set(ref)
    for k in ref:
        err = H.max_rel_err(got[k], ref[k])
        print(f"{name}: d{k} max rel err {err:.2e}")
        assert err <= TOL_GRAD_REL, k
    # The gradients move with the upstream gradient (the check can fail).
    assert H.max_rel_err(m.backward(x, -dy)["kv_a_norm"], ref["kv_a_norm"]) > 1.0


def _edit(src, dst, **changes):
    return H.edit_config(src, dst, **changes)


@pytest.mark.parametrize("field,value,status", [
    ("kv_lora_rank", 0, "kv_lora_rank"),
    ("q_lora_rank", -3, "q_lora_rank"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("qk_nope_head_dim", 0, "qk_nope_head_dim"),
    ("v_head_dim", 2.5, "v_head_dim"),
    ("num_attention_heads", "4", "num_attention_heads"),
])
def test_hostile_config_names_the_field(models, tmp_path, field, value, status):
    d = _edit(models["v3_lora_yarn"][0], str(tmp_path / "m"), **{field: value})
    with pytest.raises(mha.MhaError, match=status):
        mha.MLA.from_pretrained(d, 0)


@pytest.mark.parametrize("field,value,tensor", [
    ("v_head_dim", 10, "kv_b_proj.weight"),       # sizes that contradict the tensors' shapes
    ("qk_rope_head_dim", 6, "q_b_proj.weight"),
    ("kv_lora_rank", 12, "kv_a_proj_with_mqa.weight"),
    ("q_lora_rank", None, "q_proj.weight"),      # a missing tensor
    ("attention_bias", False, None),             # biases in the file, not in the config: unused
])
def test_config_contradicting_the_tensors(models, tmp_path, field, value, tensor):
    src, refs = models["v3_lora_yarn"]
    d = _edit(src, str(tmp_path / "m"), **{field: value})
    if tensor is None:
        m = mha.MLA.from_pretrained(d, 0)
        assert m.config.bias == 0  # transformers builds no bias either: a different layer
        assert H.max_rel_err(m.forward(refs[0][0]), refs[0][1]) > 100 * TOL_OUT_REL
        return
    with pytest.raises(mha.MhaError, match=tensor.replace(".", r"\.")):
        mha.MLA.from_pretrained(d, 0)


def _transformers_reading(d, layer=0):
    """(x, y) of layer `layer`'s attention module in transformers' own float64 reading of the
    model directory d (its config.json possibly edited), on random tokens."""
    cls = {"deepseek_v2": T.DeepseekV2ForCausalLM, "deepseek_v3": T.DeepseekV3ForCausalLM}
    with open(os.path.join(d, "config.json")) as f:
        model_cls = cls[json.load(f)["model_type"]]
    model = model_cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float64)
    model.config._experts_implementation = "eager"
    model = model.to(torch.float64).eval()
    store = {}
    handles = H._hooks(model, "model.layers.{L}.self_attn", layer, store)
    ids = torch.randint(3, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in handles:
        h.remove()
    return store["x"], store["y"]


def test_rope_interleave_null_is_rotate_half(models, tmp_path):
    """deepseek_v3's `rope_interleave: null`: DeepseekV3Attention's `if config.rope_interleave:`
    takes it as false (rotate_half), unlike an absent key (the default, true)."""
    d = _edit(models["v3_lora_yarn"][0], str(tmp_path / "m"), rope_interleave=None)
    m = mha.MLA.from_pretrained(d, 0)
    assert m.config.rope.style == 2  # HALF
    x, ref = _transformers_reading(d)
    assert H.max_rel_err(m.forward(x), ref) <= TOL_OUT_REL
    cache = mha.MLACache(m, SEQ, batch=BATCH)
    out = np.concatenate([cache.step(x[:, t:t + 1]) for t in range(SEQ)], 1)
    assert H.max_rel_err(out, ref) <= TOL_OUT_REL


def test_refusals(models, tmp_path):
    src = models["v3_lora_yarn"][0]
    with pytest.raises(mha.MhaError, match="mha_hf_mla_load"):
        mha.MultiheadAttention.from_pretrained(src, 0)  # not an mha_layer: says where to go
    d = _edit(src, str(tmp_path / "k"), model_type="kimi_k2")
    with pytest.raises(mha.MhaError, match="kimi_k2"):
        mha.MLA.from_pretrained(d, 0)
    with pytest.raises(mha.MhaError, match="layer 2 does not exist"):
        mha.MLA.from_pretrained(src, 2)
    # transformers reads rope_parameters["factor"] for the mscale_all_dim scale: required then.
    d = _edit(src, str(tmp_path / "y"), rope_parameters=dict(YARN, factor=None))
    with pytest.raises(mha.MhaError, match="mscale_all_dim.*factor"):
        mha.MLA.from_pretrained(d, 0)
    # DeepseekV3Config keeps config.json's head_dim and its rotary embedding takes its
    # frequencies from it (2: one frequency for every pair, a different layer; 16: fails):
    # refused naming the field. DeepseekV2Config overwrites it with qk_rope_head_dim.
    for hd in (2, 16):
        d = _edit(src, str(tmp_path / f"hd{hd}"), head_dim=hd)
        with pytest.raises(mha.MhaError, match=f'"head_dim" {hd} is not "qk_rope_head_dim" 8'):
            mha.MLA.from_pretrained(d, 0)
    d = _edit(models["v3_no_lora_half"][0], str(tmp_path / "hdnull"), head_dim=None)
    assert mha.MLA.from_pretrained(d, 0).config.qk_rope_head_dim == 8  # 32 / 4 heads
    v2, refs = models["v2_no_lora"]
    d = _edit(v2, str(tmp_path / "v2hd"), head_dim=2)
    assert H.max_rel_err(mha.MLA.from_pretrained(d, 0).forward(refs[0][0]), refs[0][1]) \
        <= TOL_OUT_REL
    d2 = str(tmp_path / "nofile")
    shutil.copytree(src, d2)
    os.remove(os.path.join(d2, "model.safetensors"))
    with pytest.raises(mha.MhaError):
        mha.MLA.from_pretrained(d2, 0)


def test_create_checks_name_the_argument():
    from mha import _lib as L
    c = L.mha_mla_config()
    c.hidden, c.num_heads, c.kv_lora_rank = 8, 2, 4
    c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim = 4, 4, 4
    c.rope.style = 1
    rng = np.random.default_rng(0)
    w = {"w_q": rng.standard_normal((16, 8)), "w_kv_a": rng.standard_normal((8, 8)),
         "kv_a_norm": np.ones(4), "w_kv_b": rng.standard_normal((16, 4)),
         "w_o": rng.standard_normal((8, 8))}
    mha.MLA(c, w)
    with pytest.raises(mha.MhaError, match="weights.kv_a_norm is NULL"):
        mha.MLA(c, {k: v for k, v in w.items() if k != "kv_a_norm"})
    bad = dict(w, w_o=np.full((8, 8), np.nan))
    with pytest.raises(mha.MhaError, match=r"weights.w_o\[0\] is nan"):
        mha.MLA(c, bad)
    # Each array must have its weight_shapes() shape: mha_mla_create reads that many elements
    # (a smaller array was read past its end, a transposed one taken in the wrong layout), and
    # one the config does not use would be ignored.
    with pytest.raises(ValueError, match=r"w_q must have shape \(16, 8\), got \(2, 2\)"):
        mha.MLA(c, dict(w, w_q=np.ones((2, 2))))
    with pytest.raises(ValueError, match=r"w_kv_b must have shape \(16, 4\), got \(4, 16\)"):
        mha.MLA(c, dict(w, w_kv_b=w["w_kv_b"].T))
    with pytest.raises(ValueError, match="b_o is given but the config does not use it"):
        mha.MLA(c, dict(w, b_o=np.ones(8)))
    c.rope.style = 0
    with pytest.raises(mha.MhaError, match="rope.style"):
        mha.MLA(c, w)
    c.rope.style, c.qk_rope_head_dim = 1, 3
    with pytest.raises(mha.MhaError, match="qk_rope_head_dim=3"):
        mha.MLA(c, w)


def test_torch_module_trains_like_transformers(models):
    """mha.torch.MLA: forward equal to the HF module, and loss.backward() fills every
    parameter's .grad with torch autograd's of the HF module (TOL_GRAD_REL)."""
    import mha.torch as mt
    d, refs = models["v3_lora_yarn"]
    x, ref = refs[1]
    model = MODELS["v3_lora_yarn"]
    attn = model.model.layers[1].self_attn
    mod = mt.MLA.from_pretrained(d, 1)
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    y = mod(xt)
    assert H.max_rel_err(y.detach().numpy(), ref) <= TOL_OUT_REL
    dy = np.random.default_rng(5).standard_normal(x.shape)
    y.backward(torch.tensor(dy, dtype=torch.float32))
    x64 = torch.tensor(x, requires_grad=True)
    pe = model.model.rotary_emb(x64, torch.arange(SEQ)[None].expand(BATCH, SEQ))
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    attn.zero_grad()
    attn(hidden_states=x64, position_embeddings=pe, attention_mask=mask)[0].backward(
        torch.tensor(dy))
    for n, p in attn.named_parameters():
        assert H.max_rel_err(getattr(mod, HF_NAMES[n]).grad.numpy(), p.grad.numpy()) \
            <= TOL_GRAD_REL, n
    assert H.max_rel_err(xt.grad.numpy(), x64.grad.numpy()) <= TOL_GRAD_REL
    # A parameter update changes the output (the module reads its parameters at every call).
    with torch.no_grad():
        mod.w_o.mul_(2.0)
        mod.b_o.mul_(2.0)
    assert H.max_rel_err(mod(xt).detach().numpy(), 2 * ref) <= TOL_OUT_REL


def _grads(mod, fn, x, dy):
    """(y, dx, {name: d param}) of fn(x) with upstream gradient dy."""
    mod.zero_grad()
    xt = x.clone().requires_grad_(True)
    y = fn(xt)
    y.backward(dy)
    return y.detach(), xt.grad, {n: p.grad.clone() for n, p in mod.named_parameters()}


@pytest.mark.parametrize("name", ["v3_lora_yarn", "v2_no_lora"])
def test_torch_module_compiles_and_exports(models, name):
    """mha.torch.MLA under torch.compile(fullgraph=True) (aot_eager: dynamo and AOT autograd) and
    torch.export: the forward and backward are torch.ops.mha.mla / mla_backward (opaque custom
    ops with fake kernels), so the compiled module's output and every gradient equal eager's bit
    for bit, and the exported program holds torch.ops.mha.mla and gives the eager output."""
    import mha.torch as mt
    d, refs = models[name]
    x = torch.tensor(refs[1][0], dtype=torch.float32)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    mod = mt.MLA.from_pretrained(d, 1)
    y0, dx0, g0 = _grads(mod, mod, x, dy)
    assert H.max_rel_err(y0.numpy(), refs[1][1]) <= TOL_OUT_REL
    torch._dynamo.reset()
    comp = torch.compile(mod, fullgraph=True, backend="aot_eager")
    y1, dx1, g1 = _grads(mod, comp, x, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g0)
    # The compiled module reads its parameters at every call (no stale layer).
    with torch.no_grad():
        mod.w_o.mul_(2.0)
    assert torch.equal(comp(x), mod(x)) and not torch.equal(comp(x), y0)
    with torch.no_grad():
        mod.w_o.mul_(0.5)
    ep = torch.export.export(mod, (x,))
    assert "torch.ops.mha.mla.default" in str(ep.graph_module.code)
    assert torch.equal(ep.module()(x), y0)
    # Another batch and length than traced with (the fake kernel's shapes are symbolic-safe).
    x2 = x[:1, :5].contiguous()
    assert torch.equal(comp(x2), mod(x2))


@pytest.mark.skipif(os.environ.get("MHA_TEST_QUICK") == "1", reason="inductor compiles C++")
def test_torch_module_compiles_with_inductor(models):
    """The default backend (inductor, which generates code around the opaque operator): output
    and gradients equal eager's bit for bit."""
    import mha.torch as mt
    d, refs = models["v3_no_lora_half"]
    x = torch.tensor(refs[0][0], dtype=torch.float32)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    mod = mt.MLA.from_pretrained(d, 0)
    y0, dx0, g0 = _grads(mod, mod, x, dy)
    torch._dynamo.reset()
    y1, dx1, g1 = _grads(mod, torch.compile(mod, fullgraph=True), x, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(torch.equal(g1[n], g0[n]) for n in g0)


def test_torch_op_caches_the_layer_until_a_weight_changes(models):
    """torch.ops.mha.mla builds the C layer once per weights' version: repeated calls (and the
    backward) reuse it; an optimizer step (in-place update: version bumped) rebuilds it, and the
    output is the new weights'."""
    import mha.torch as mt
    from mha import _torch_ops as O
    O.mla_cache_clear()
    d, refs = models["v3_lora_yarn"]
    x = torch.tensor(refs[0][0], dtype=torch.float32)
    mod = mt.MLA.from_pretrained(d, 0)
    mod(x).sum().backward()
    assert len(O._MLA_CACHE) == 1
    layer = next(iter(O._MLA_CACHE.values()))[2]
    y = mod(x)
    assert next(iter(O._MLA_CACHE.values()))[2] is layer and len(O._MLA_CACHE) == 1
    torch.optim.SGD(mod.parameters(), lr=0.1).step()
    y2 = mod(x)  # rebuilt, in place of the old version's layer (one entry per module)
    assert len(O._MLA_CACHE) == 1 and next(iter(O._MLA_CACHE.values()))[2] is not layer
    assert not torch.equal(y2, y)
    fresh = mha.MLA(mod._config, {n: getattr(mod, n).detach().numpy() for n in mod._names})
    assert torch.equal(y2, torch.from_numpy(fresh.forward(x.numpy())))
    other = mt.MLA.from_pretrained(d, 1)
    other(x)
    assert len(O._MLA_CACHE) == 2  # another module's weights: their own entry
    O.mla_cache_clear()
    assert not O._MLA_CACHE


def test_torch_ops_refuse_bad_operands(models):
    """torch.ops.mha.mla refuses, naming the argument, what mha_mla_forward cannot read."""
    import mha.torch as mt
    from mha import _torch_ops as O
    mod = mt.MLA.from_pretrained(models["v2_no_lora"][0], 0)
    x = torch.zeros(1, 3, mod._config.hidden)
    ws = [getattr(mod, n) for n in mod._names]
    cfg = mod._config_str
    with pytest.raises(TypeError, match="x must be float32"):
        torch.ops.mha.mla(x.double(), ws, cfg, True, 0)
    with pytest.raises(ValueError, match="x must have shape"):
        torch.ops.mha.mla(x[..., :5], ws, cfg, True, 0)
    i = mod._names.index("w_o")
    with pytest.raises(ValueError, match="w_o must have shape"):
        torch.ops.mha.mla(x, ws[:i] + [ws[i][:, :3]] + ws[i + 1:], cfg, True, 0)
    with pytest.raises(ValueError, match="expected .* weights"):
        torch.ops.mha.mla(x, ws[:-1], cfg, True, 0)
    with pytest.raises(ValueError, match="config must be"):
        torch.ops.mha.mla(x, ws, cfg[:-2], True, 0)
    with pytest.raises(TypeError, match="must be float32"):
        torch.ops.mha.mla(x, [w.double() for w in ws], cfg, True, 0)
    assert O.mla_config_string(mod._config) == cfg
    torch.library.opcheck(torch.ops.mha.mla.default, (x.normal_().requires_grad_(),
                                                       [w.detach().requires_grad_() for w in ws],
                                                       cfg, True, 0))


def test_cli_run_model(models, tmp_path):
    """`mha run --model DIR --layer L` on a deepseek_v3 directory: the expanded forward, equal to
    the HF module; options an MLA layer does not take are refused naming them."""
    import subprocess
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    d, refs = models["v3_lora_yarn"]
    x, ref = refs[1]
    np.save(tmp_path / "x.npy", x.astype(np.float32))
    r = subprocess.run([cli, "run", "--model", d, "--layer", "1", "--input",
                        str(tmp_path / "x.npy"), "--out", str(tmp_path / "y.npy")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert H.max_rel_err(np.load(tmp_path / "y.npy"), ref) <= TOL_OUT_REL
    r = subprocess.run([cli, "run", "--model", d, "--input", str(tmp_path / "x.npy"), "--out",
                        str(tmp_path / "y.npy"), "--softcap", "3"], capture_output=True, text=True)
    assert r.returncode == 2 and "--softcap" in r.stderr
    r = subprocess.run([cli, "info", "--model", d, "--layer", "1"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "kv_lora_rank: 16" in r.stdout and "style interleaved" in r.stdout
    assert "compressed cache: 24 values per token" in r.stdout
    bad = _edit(d, str(tmp_path / "bad"), kv_lora_rank=0)
    r = subprocess.run([cli, "run", "--model", bad, "--input", str(tmp_path / "x.npy"), "--out",
                        str(tmp_path / "y.npy")], capture_output=True, text=True)
    assert r.returncode == 1 and "kv_lora_rank" in r.stderr
    r = subprocess.run([cli, "info", "--model", bad], capture_output=True, text=True)
    assert r.returncode == 1 and "kv_lora_rank" in r.stderr


@pytest.mark.parametrize("dtype,tol", [("f32", TOL_OUT_REL), ("f16", TOL_KV_F16_REL),
                                       ("bf16", TOL_KV_BF16_REL)])
def test_cli_run_model_decode(models, tmp_path, dtype, tol):
    """`mha run --model DIR --layer L --decode [--prefill P] [--cache-dtype T]` on deepseek
    models: a prompt of P tokens then one token per step through the compressed cache (the
    absorbed form), equal to the HF module and to the CLI's own full forward within the cache
    dtype's tolerance; the decode's usage errors name the option."""
    import subprocess
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    for name in ("v3_lora_yarn", "v2_no_lora"):
        d, refs = models[name]
        x, ref = refs[1]
        np.save(tmp_path / "x.npy", x.astype(np.float32))
        base = [cli, "run", "--model", d, "--layer", "1", "--input", str(tmp_path / "x.npy")]
        r = subprocess.run(base + ["--out", str(tmp_path / "full.npy")], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        for prefill in ("1", "5", str(SEQ)):
            r = subprocess.run(base + ["--out", str(tmp_path / "y.npy"), "--decode", "--prefill",
                                       prefill, "--cache-dtype", dtype], capture_output=True,
                               text=True)
            assert r.returncode == 0, r.stderr
            y = np.load(tmp_path / "y.npy")
            assert y.shape == x.shape and y.dtype == np.float32
            err = H.max_rel_err(y, ref)
            print(f"{name} --cache-dtype {dtype} --prefill {prefill}: max rel err {err:.2e}")
            assert err <= tol, (name, prefill)
            assert H.max_rel_err(y, np.load(tmp_path / "full.npy").astype(np.float64)) <= tol
    # 2-d input (one sequence).
    np.save(tmp_path / "x1.npy", x[0].astype(np.float32))
    r = subprocess.run(base[:-1] + [str(tmp_path / "x1.npy"), "--out", str(tmp_path / "y1.npy"),
                                    "--decode", "--cache-dtype", dtype], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert H.max_rel_err(np.load(tmp_path / "y1.npy"), ref[0]) <= tol
    if dtype != "f32":
        return
    out = ["--out", str(tmp_path / "y.npy"), "--decode"]
    r = subprocess.run(base + out + ["--prefill", str(SEQ + 1)], capture_output=True, text=True)
    assert r.returncode == 1 and "--prefill" in r.stderr
    r = subprocess.run(base + out + ["--cache-dtype", "f8"], capture_output=True, text=True)
    assert r.returncode == 2 and "--cache-dtype" in r.stderr
    np.save(tmp_path / "p.npy", np.zeros((BATCH, SEQ), np.int64))
    r = subprocess.run(base + out + ["--positions", str(tmp_path / "p.npy")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--positions" in r.stderr
    r = subprocess.run(base + out + ["--dtype", "bf16"], capture_output=True, text=True)
    assert r.returncode == 2 and "--dtype" in r.stderr
    # An input of the wrong width names the file and its shape (it said "got 3 dimensions").
    np.save(tmp_path / "xw.npy", x[..., :-1].astype(np.float32))
    r = subprocess.run(base[:-1] + [str(tmp_path / "xw.npy")] + out, capture_output=True,
                       text=True)
    assert r.returncode == 1 and f"xw.npy: shape [{BATCH}, {SEQ}, 31] does not fit" in r.stderr


def test_cli_run_model_checks_output_paths(models, tmp_path):
    """An MLA --model run checks its output paths as every `mha run` does (docs/FORMATS.md): an
    --out that is the --input or a file of the model directory, or a symbolic link, is refused
    (exit 1, naming both) and left as it was. Before, the MLA path skipped the check and
    replaced the input, or the model's own config.json, with the output."""
    import subprocess
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    src, refs = models["v2_no_lora"]
    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    x = tmp_path / "x.npy"
    np.save(x, refs[1][0].astype(np.float32))
    (tmp_path / "t.txt").write_bytes(b"kept")
    os.symlink(tmp_path / "t.txt", tmp_path / "link.npy")
    for out, words in ((x, ["is the same file as --input"]),
                       (os.path.join(d, "config.json"), ["is the same file as --model"]),
                       (tmp_path / "link.npy", ["is a symbolic link"])):
        before = {p: open(p, "rb").read() for p in (x, os.path.join(d, "config.json"),
                                                      tmp_path / "t.txt")}
        r = subprocess.run([cli, "run", "--model", d, "--layer", "1", "--input", str(x),
                            "--out", str(out)], capture_output=True, text=True)
        assert r.returncode == 1, (out, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and all(w in r.stderr for w in words), r.stderr
        for p, data in before.items():
            assert open(p, "rb").read() == data, (out, p)
        assert os.path.islink(tmp_path / "link.npy")


def test_cli_run_model_nonfinite_output_is_exit_3(models, tmp_path):
    """An MLA --model run of finite inputs whose output overflows to NaN / inf fails with exit
    status 3 and writes nothing, as every `mha run` (docs/FORMATS.md "Output check"), forward
    and --decode; --allow-nonfinite writes it with exit 0. Before, the output was written with
    exit 0 (every value NaN)."""
    import subprocess
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    d, refs = models["v2_no_lora"]
    x = tmp_path / "x.npy"
    np.save(x, np.full(refs[1][0].shape, 3e37, np.float32))  # finite; float32 overflows
    y = tmp_path / "y.npy"
    base = [cli, "run", "--model", d, "--layer", "1", "--input", str(x), "--out", str(y)]
    for extra in ([], ["--decode", "--prefill", "3"]):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode == 3, (extra, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "not finite" in r.stderr, r.stderr
        assert not y.exists() and os.listdir(tmp_path) == ["x.npy"]
    r = subprocess.run(base + ["--allow-nonfinite"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not np.all(np.isfinite(np.load(y)))


def test_cli_run_model_verbose(models, tmp_path):
    """--verbose on an MLA --model run reports its stages as the ordinary path does (it was
    accepted and printed nothing)."""
    import subprocess
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    d, refs = models["v2_no_lora"]
    x = tmp_path / "x.npy"
    np.save(x, refs[1][0].astype(np.float32))
    base = [cli, "run", "--model", d, "--layer", "1", "--input", str(x), "--out",
            str(tmp_path / "y.npy"), "--verbose"]
    for extra, stage in (([], "forward computed"), (["--decode"], "prefill and decode steps")):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        lines = [ln.split(" (")[0] for ln in r.stderr.splitlines()]
        assert lines[0] == "mha: weights read" and lines[-1] == "mha: outputs written", lines
        assert any(stage in ln for ln in lines), lines


def test_cli_run_model_positions_shapes(models, tmp_path):
    """--positions of an MLA --model run is read as the ordinary path reads it: int32 or int64,
    [n] (every sequence) or [B, n], in [0, 2^31]. Before, any int64 array of B n values was
    taken as [B, n]: a transposed [n, B] file (or a flat [B n] one) ran with exit 0 on the
    wrong positions, and the documented [n] and int32 forms were refused."""
    import subprocess
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    d, refs = models["v2_no_lora"]
    x = tmp_path / "x.npy"
    np.save(x, refs[1][0].astype(np.float32))
    pos = np.arange(BATCH * SEQ, dtype=np.int64).reshape(BATCH, SEQ) + 3

    def run(name, arr):
        np.save(tmp_path / name, arr)
        return subprocess.run([cli, "run", "--model", d, "--layer", "1", "--input", str(x),
                               "--out", str(tmp_path / "y.npy"), "--positions",
                               str(tmp_path / name)], capture_output=True, text=True)

    for name, arr in (("t.npy", np.ascontiguousarray(pos.T)), ("f.npy", pos.reshape(-1))):
        r = run(name, arr)
        assert r.returncode == 1 and f"{name}: shape" in r.stderr, r.stderr
        assert not (tmp_path / "y.npy").exists()
    r = run("n.npy", pos[0].astype(np.int32))  # [n] int32: the same positions in every row
    assert r.returncode == 0, r.stderr
    y_n = np.load(tmp_path / "y.npy")
    r = run("bn.npy", np.tile(pos[0], (BATCH, 1)))
    assert r.returncode == 0, r.stderr
    assert np.array_equal(y_n, np.load(tmp_path / "y.npy"))
    m = mha.MLA.from_pretrained(d, 1)
    ref = m.forward(refs[1][0].astype(np.float32), np.tile(pos[0], (BATCH, 1)))
    assert H.max_rel_err(y_n, ref) <= TOL_OUT_REL

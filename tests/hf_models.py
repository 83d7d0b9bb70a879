# SPDX-License-Identifier: MIT
"""Tiny random Hugging Face models for the `mha run --model` / `from_pretrained` tests
(tests/test_cli_hf_models.py, tests/test_python_hf_models.py).

Each case builds a model with transformers (nothing from a hub: a config object with tiny sizes),
in float64 with the eager attention, re-draws its weights so that scores are O(1) (the default
0.02 init would make every option invisible), runs a forward pass on random tokens and records,
with forward hooks, what the attention module of the tested layers received (hidden_states) and
returned (its output, after the output projection): the float64 oracle. The model is saved with
save_pretrained (one case sharded with max_shard_size, to cover model.safetensors.index.json).
"""
import json
import os

import numpy as np

import torch
import transformers as T

SEQ, BATCH = 12, 2
WINDOW = 5  # sliding_window of the sliding cases: SEQ > WINDOW, so the window bites
SMALL = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=64)
LLAMA = dict(SMALL, hidden_size=64, intermediate_size=64, num_attention_heads=4)


def _rope(kind="default", theta=10000.0, **kw):
    return dict(rope_type=kind, rope_theta=theta, **kw)


def _phi3_longrope(original):
    """A Phi-3 case with LongRoPE over an original context of `original` tokens (Phi3Config keeps
    original_max_position_embeddings at the top level); factor 64 / original sets the attention
    factor sqrt(1 + ln(factor) / ln(original))."""
    rope = _rope("longrope", 1e4, short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                 long_factor=[1.0, 1.4, 2.2, 3.5, 5.0, 7.5, 9.0, 12.0])
    kw = dict(LLAMA, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              original_max_position_embeddings=original, rope_parameters=rope)
    return (T.Phi3Config, kw, T.Phi3ForCausalLM, "model.layers.{L}.self_attn", (0,))


# name: (config class, kwargs, model class, attention module path ({L} = layer), layers tested).
CASES = {
    "llama": (T.LlamaConfig, dict(LLAMA, num_key_value_heads=2, attention_bias=True,
                                  rope_parameters=_rope("llama3", 5e5, factor=8.0,
                                                        low_freq_factor=1.0,
                                                        high_freq_factor=4.0,
                                                        original_max_position_embeddings=16)),
              T.LlamaForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "llama_yarn": (T.LlamaConfig, dict(LLAMA, num_key_value_heads=1,
                                       rope_parameters=_rope(
                                           "yarn", 1e4, factor=4.0,
                                           original_max_position_embeddings=16)),
                   T.LlamaForCausalLM, "model.layers.{L}.self_attn", (0,)),
    # dynamic NTK compares the length with max_position_embeddings: 8 < SEQ, so it scales.
    "llama_dynamic": (T.LlamaConfig, dict(LLAMA, num_key_value_heads=2, max_position_embeddings=8,
                                          rope_parameters=_rope("dynamic", 1e4, factor=2.0)),
                      T.LlamaForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "mistral": (T.MistralConfig, dict(LLAMA, num_key_value_heads=2, sliding_window=WINDOW,
                                      rope_parameters=_rope("linear", 1e4, factor=2.0)),
                T.MistralForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "mixtral": (T.MixtralConfig, dict(LLAMA, num_key_value_heads=2, num_local_experts=2,
                                      num_experts_per_tok=1, rope_parameters=_rope()),
                T.MixtralForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "qwen2": (T.Qwen2Config, dict(LLAMA, num_key_value_heads=2, use_sliding_window=True,
                                  sliding_window=WINDOW, max_window_layers=1,
                                  rope_parameters=_rope()),
              T.Qwen2ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    "gemma": (T.GemmaConfig, dict(LLAMA, num_key_value_heads=1, head_dim=24,
                                  rope_parameters=_rope()),
              T.GemmaForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "gemma2": (T.Gemma2Config, dict(LLAMA, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                    sliding_window=WINDOW, rope_parameters=_rope()),
               T.Gemma2ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    # gpt-oss's YaRN keeps the ramp ends unrounded (truncate: false); an original context of
    # 1024 puts them at 1.41 and 4.42 (of 8 pairs), so rounding them would change the result.
    "gpt_oss": (T.GptOssConfig, dict(LLAMA, num_key_value_heads=2, head_dim=16,
                                     num_local_experts=2, num_experts_per_tok=1,
                                     sliding_window=WINDOW, max_position_embeddings=4096,
                                     rope_parameters=_rope(
                                         "yarn", 1e4, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                         truncate=False, original_max_position_embeddings=1024)),
                T.GptOssForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    "phi3": (T.Phi3Config, dict(LLAMA, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2,
                                rope_parameters=_rope(partial_rotary_factor=0.5)),
             T.Phi3ForCausalLM, "model.layers.{L}.self_attn", (0,)),
    # NoPE layers (issue 31): SmolLM3's no_rope_layers (1 = RoPE), layer 1 NoPE and sliding;
    # Cohere2's sliding layer 0 rotates (interleaved pairs), its full layer 1 has no RoPE;
    # Llama 4: layer 0 RoPE (interleaved) + L2 QK-norm + chunks of 5, layer 1 NoPE + temperature
    # tuning with floor_scale 4 (tau goes from 1 to 1 + 0.5 ln 4 over the 12 positions).
    "smollm3": (T.SmolLM3Config, dict(LLAMA, num_key_value_heads=2, no_rope_layers=[1, 0],
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      use_sliding_window=True, sliding_window=WINDOW,
                                      rope_parameters=_rope(theta=2e4)),
                T.SmolLM3ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    "cohere2": (T.Cohere2Config, dict(LLAMA, num_key_value_heads=2, sliding_window=WINDOW,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      layer_types=["sliding_attention", "full_attention"],
                                      rope_parameters=_rope()),
                T.Cohere2ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    "llama4_text": (T.Llama4TextConfig, dict(LLAMA, num_key_value_heads=2, head_dim=16,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                             intermediate_size_mlp=64, num_local_experts=2,
                                             num_experts_per_tok=1, no_rope_layers=[1, 0],
                                             attention_chunk_size=WINDOW, floor_scale=4,
                                             attn_scale=0.5, rope_parameters=_rope(theta=5e5)),
                    T.Llama4ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    # LongRoPE: SEQ > 8 takes the long list, SEQ <= 16 the short one.
    "phi3_longrope": _phi3_longrope(8),
    "phi3_longrope_short": _phi3_longrope(16),
    # QK-norm (issue 31): RMSNorm of q and k per head (Qwen3, Qwen3-MoE; Gemma 3 with 1 + w,
    # query_pre_attn_scalar, its sliding layer 0 at the local theta and its full layer 1 at the
    # global theta with linear scaling) or over the whole projection (OLMo 2).
    "qwen3": (T.Qwen3Config, dict(LLAMA, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                  use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1, rope_parameters=_rope()),
              T.Qwen3ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    "qwen3_moe": (T.Qwen3MoeConfig, dict(LLAMA, num_key_value_heads=2, head_dim=16,
                                         num_experts=2, num_experts_per_tok=1,
                                         moe_intermediate_size=32, rope_parameters=_rope()),
                  T.Qwen3MoeForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "gemma3_text": (T.Gemma3TextConfig, dict(
        LLAMA, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": _rope(theta=1e4),
                         "full_attention": _rope("linear", 1e6, factor=2.0)}),
        T.Gemma3ForCausalLM, "model.layers.{L}.self_attn", (0, 1)),
    # Qwen3-Next's full-attention layer: the output gate (q_proj [h, 2, d]), 1 + w QK-norm,
    # partial rotary 0.25 (its layer 1 is a linear-attention layer, refused by name).
    "qwen3_next": (T.Qwen3NextConfig, dict(
        LLAMA, num_key_value_heads=2, head_dim=16, attention_bias=True,
        layer_types=["full_attention", "linear_attention"], num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, rope_parameters=_rope(partial_rotary_factor=0.25)),
        T.Qwen3NextForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "olmo2": (T.Olmo2Config, dict(LLAMA, num_key_value_heads=2, pad_token_id=1, eos_token_id=2,
                                  rope_parameters=_rope(theta=5e5)),
              T.Olmo2ForCausalLM, "model.layers.{L}.self_attn", (0,)),
    "gpt2": (T.GPT2Config, dict(vocab_size=64, n_embd=64, n_head=4, n_layer=2, n_positions=64,
                                scale_attn_by_inverse_layer_idx=True),
             T.GPT2LMHeadModel, "transformer.h.{L}.attn", (1,)),
    "gpt_neox": (T.GPTNeoXConfig, dict(LLAMA, rope_parameters=_rope(theta=2000.0,
                                                                   partial_rotary_factor=0.5)),
                 T.GPTNeoXForCausalLM, "gpt_neox.layers.{L}.attention", (0,)),
    "falcon_mq": (T.FalconConfig, dict(SMALL, hidden_size=64, num_attention_heads=4,
                                       multi_query=True, bias=True),
                  T.FalconForCausalLM, "transformer.h.{L}.self_attention", (0,)),
    "falcon_mha": (T.FalconConfig, dict(SMALL, hidden_size=64, num_attention_heads=4,
                                        multi_query=False),
                   T.FalconForCausalLM, "transformer.h.{L}.self_attention", (0,)),
    "falcon_new": (T.FalconConfig, dict(SMALL, hidden_size=64, num_attention_heads=4,
                                        new_decoder_architecture=True, num_kv_heads=2),
                   T.FalconForCausalLM, "transformer.h.{L}.self_attention", (0,)),
    "bert": (T.BertConfig, dict(SMALL, hidden_size=64, num_attention_heads=4,
                                intermediate_size=64),
             T.BertModel, "encoder.layer.{L}.attention", (0,)),
    "roberta": (T.RobertaConfig, dict(SMALL, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=70),
                T.RobertaModel, "encoder.layer.{L}.attention", (1,)),
}
SHARDED = "llama"  # saved in shards with an index file


def _hooks(model, path, layer, store):
    """Registers hooks recording (input hidden_states, attention output) of one layer. BERT's
    BertAttention adds a residual and a LayerNorm after its output projection, so there the
    input is self's and the output is output.dense's."""
    mods = dict(model.named_modules())
    base = path.format(L=layer)
    inner = base + ".self" if base + ".self" in mods else base
    outer = base + ".output.dense" if base + ".output.dense" in mods else base

    def take_input(_m, args, kwargs):
        store["x"] = (args[0] if args else kwargs["hidden_states"]).detach().numpy().copy()

    def take_output(_m, _args, _kwargs, out):
        y = out[0] if isinstance(out, tuple) else out
        store["y"] = y.detach().numpy().copy()

    return [mods[inner].register_forward_pre_hook(take_input, with_kwargs=True),
            mods[outer].register_forward_hook(take_output, with_kwargs=True)]


def build(name, root):
    """Builds case `name` under root/name; returns (dir, {layer: (x, y_ref)}) in float64."""
    cfg_cls, kw, model_cls, path, layers = CASES[name]
    d = os.path.join(root, name)
    torch.manual_seed(sum(map(ord, name)))
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # MoE (mixtral, gpt_oss): grouped_mm has no float64
    model = model_cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    refs = {}
    for layer in layers:
        store = {}
        handles = _hooks(model, path, layer, store)
        ids = torch.randint(3, 64, (BATCH, SEQ))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        for h in handles:
            h.remove()
        refs[layer] = (store["x"], store["y"])
    kwargs = {"max_shard_size": "40KB"} if name == SHARDED else {}
    model.save_pretrained(d, **kwargs)
    return d, refs


def autograd_grads(d, name, layer, x, dy):
    """The attention module of layer `layer` of the saved model `d`, in float64, run inside the
    model on hidden states x (a pre-hook swaps its input for a leaf tensor holding x) and
    differentiated by torch autograd against dy: (y, {"query": dL/dx, "<param name>": grad})
    with the module's own parameter names (q_proj.weight, q_norm.weight, ...)."""
    _, _, model_cls, path, _ = CASES[name]
    model = model_cls.from_pretrained(d, attn_implementation="eager")
    model.config._experts_implementation = "eager"  # (grouped_mm has no float64)
    model = model.to(torch.float64).eval()
    mod = dict(model.named_modules())[path.format(L=layer)]
    leaf = torch.from_numpy(np.asarray(x, np.float64)).requires_grad_()
    store = {}

    def swap(_m, args, kwargs):
        if args:
            return (leaf,) + tuple(args[1:]), kwargs
        return args, dict(kwargs, hidden_states=leaf)

    def keep(_m, _args, _kwargs, out):
        store["y"] = out[0] if isinstance(out, tuple) else out

    hs = [mod.register_forward_pre_hook(swap, with_kwargs=True),
          mod.register_forward_hook(keep, with_kwargs=True)]
    ids = torch.randint(3, 64, tuple(leaf.shape[:2]))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in hs:
        h.remove()
    names, params = zip(*mod.named_parameters())
    gs = torch.autograd.grad(store["y"], (leaf,) + params, torch.from_numpy(dy))
    res = {"query": gs[0].numpy()}
    res.update({nm: g.numpy() for nm, g in zip(names, gs[1:])})
    return store["y"].detach().numpy(), res


def reference(d, name, layer, seed=0):
    """transformers' own reading of the model directory `d` (a case `name` saved, its config.json
    possibly edited): the attention module of `layer` run inside the float64 model on random tokens,
    (input hidden_states, output) as build() records them."""
    _, _, model_cls, path, _ = CASES[name]
    model = model_cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float64)
    model.config._experts_implementation = "eager"
    model = model.to(torch.float64).eval()
    store = {}
    handles = _hooks(model, path, layer, store)
    ids = torch.randint(3, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in handles:
        h.remove()
    return store["x"], store["y"]


DELETE = object()  # edit_config: remove the key


def edit_config(src_dir, dst_dir, **changes):
    """A copy of a model directory (weights linked) whose config.json has `changes` applied
    (None writes JSON null, transformers' "not set"; DELETE removes the key)."""
    os.makedirs(dst_dir, exist_ok=True)
    for f in os.listdir(src_dir):
        if f != "config.json":
            os.symlink(os.path.join(src_dir, f), os.path.join(dst_dir, f))
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst_dir


def legacy_config(src_dir, dst_dir):
    """The same model with a transformers 4.x style config.json, as most hub checkpoints have:
    rope_theta (GPT-NeoX: rotary_emb_base), partial_rotary_factor (NeoX: rotary_pct) and
    rope_scaling {"type": ...} at the top level instead of rope_parameters, and no layer_types
    (which layers slide then follows each architecture's rule)."""
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    neox = cfg["model_type"] == "gpt_neox"
    changes = {"rope_parameters": DELETE, "layer_types": DELETE}
    rp = dict(cfg.get("rope_parameters") or {})
    if cfg["model_type"] == "gemma3_text":  # 4.x: rope_local_base_freq, a sliding pattern
        local, rp = rp["sliding_attention"], dict(rp["full_attention"])
        changes["rope_local_base_freq"] = local["rope_theta"]
        changes["sliding_window_pattern"] = cfg["layer_types"].index("full_attention") + 1
    if cfg["model_type"] == "cohere2":  # 4.x: every sliding_window_pattern-th layer is full
        changes["sliding_window_pattern"] = cfg["layer_types"].index("full_attention") + 1
    if "rope_theta" in rp:
        changes["rotary_emb_base" if neox else "rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:
        changes["rotary_pct" if neox else "partial_rotary_factor"] = rp.pop(
            "partial_rotary_factor")
    kind = rp.pop("rope_type", "default")
    if rp or kind != "default":
        changes["rope_scaling"] = dict(rp, type=kind)
    return edit_config(src_dir, dst_dir, **changes)


def max_rel_err(y, ref):
    """max|y - ref| / max|ref| (the layer tolerance's measure, TOL_OUT_REL)."""
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))

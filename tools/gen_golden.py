#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_golden.py: writes the PyTorch golden cases of tests/golden/ (issue 2, section 4).

Every case is a small multi-head attention layer (weights in safetensors, inputs and masks in .npy)
and its expected output and attention probabilities, computed in float64 by `reference()` below:
an independent implementation of the layer from the written contract (include/mha.h,
docs/SEMANTICS.md) using explicit torch ops (matmul, masked_fill(-inf), softmax). It never calls
libmha. Before anything is written, every case is computed a second time by `reference_loops()`
(scalar numpy loops, different formulations: complex-number RoPE, rotate_half, BLOOM's slope code,
log-sum-exp softmax) and, where PyTorch can express the case, by torch.nn.MultiheadAttention and
F.scaled_dot_product_attention in float64; all must agree to 1e-12.

The expected values are computed from the inputs exactly as stored (the files are written first and
read back), so float16/bfloat16 weights are used as rounded by storage. Expected arrays are float64.

    pip install -r tools/requirements-golden.txt && python3 tools/gen_golden.py [--out DIR]
    python3 tools/gen_golden.py --check     # regenerate in a temporary directory and compare

Deterministic: each case seeds its generators with crc32(case name).
"""

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import zlib
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

TORCH_VERSION = "2.13.0"
FORMAT_VERSION = 1
F64 = torch.float64
AGREE = 1e-12  # all float64 implementations must agree to this (relative to max|ref|, >= 1)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "golden"))


# ------------------------------------------------------------------------------------------------
# Case description
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Spec:
    name: str
    B: int = 2
    n: int = 5
    m: Optional[int] = None  # None: self-attention (m = n, key = value = query input)
    q_dim: int = 16
    k_dim: Optional[int] = None  # None: q_dim
    v_dim: Optional[int] = None  # None: k_dim
    h: int = 4
    g: Optional[int] = None  # None: h
    dk: Optional[int] = None  # None: q_dim / h
    dv: Optional[int] = None  # None: dk
    out_dim: Optional[int] = None  # None: q_dim
    bias: tuple = (1, 1, 1, 1)  # q, k, v, o
    names: str = "hf"  # hf | mha (nn.MultiheadAttention) | cs336 | map (explicit --names)
    prefix: str = ""
    distractors: bool = False  # extra tensors in the file that must not be picked up
    kv_heads_flag: bool = True  # pass --kv-heads when g is given (else the loader infers it)
    wdtype: object = "F32"  # F32 | F16 | BF16 | F64 | {"q": .., "k": .., "v": .., "o": ..}
    x2d: bool = False  # store inputs as [n, d] (B must be 1)
    xdtype: str = "f32"  # f32 | f64 | f16 (query input file)
    xscale: float = 1.0
    same_kv: bool = False  # cross-attention with --key M --value M (one file)
    decode_of: bool = False  # query = last n rows of the key/value sequence (KV-cache decode)
    scale: Optional[float] = None
    softcap: Optional[float] = None
    alibi: bool = False
    sinks: bool = False
    rope: Optional[dict] = None  # style, theta, dim, scaling, factor, orig, low, high,
    #                              beta_fast, beta_slow, attn_factor (absent: default, no flag)
    positions: Optional[list] = None  # [B][n] ([n] when x2d)
    pos_dtype: str = "int64"
    key_positions: Optional[list] = None  # [B][m]
    causal: Optional[str] = None  # None | "flag" (bare --causal) | "bottom-right" | "top-left"
    offsets: Optional[list] = None  # [B] int64: explicit alignment
    window: Optional[tuple] = None  # (left, right), -1 unbounded
    mask: Optional[dict] = None  # kind bool|add, shape, dtype, means (None: no flag), dead
    kpm: Optional[dict] = None  # dtype, lens [B], shape "Bm"|"m"
    segments: Optional[tuple] = None  # ([B][n], [B][m]) int32
    probs: Optional[str] = None  # None | "full" | "average"
    redundant: tuple = ()  # mutations expected not to move this case (see mutations())
    tags: tuple = ()

    # resolved sizes
    @property
    def cross(self):
        return self.m is not None

    @property
    def M(self):
        return self.m if self.cross else self.n

    @property
    def K_DIM(self):
        return self.k_dim if self.k_dim is not None else self.q_dim

    @property
    def V_DIM(self):
        return self.v_dim if self.v_dim is not None else self.K_DIM

    @property
    def G(self):
        return self.g if self.g is not None else self.h

    @property
    def DK(self):
        if self.dk is not None:
            return self.dk
        assert self.q_dim % self.h == 0, self.name
        return self.q_dim // self.h

    @property
    def DV(self):
        return self.dv if self.dv is not None else self.DK

    @property
    def OUT(self):
        return self.out_dim if self.out_dim is not None else self.q_dim


CASES = []


def case(name, tags, **kw):
    assert all(c.name != name for c in CASES), name
    s = Spec(name=name, tags=tuple(tags), **kw)
    # structural tags derived from the sizes, so the feature counts are complete
    auto = ["batch" if s.B > 1 else "batch1", "cross" if s.cross else "self"]
    auto += ["n1"] if s.n == 1 else []
    auto += ["h1"] if s.h == 1 else []
    auto += ["mqa"] if s.G == 1 and s.h > 1 else (["gqa"] if s.G != s.h else [])
    auto += ["dk_ne_dv"] if s.DK != s.DV else []
    auto += ["n_ne_m"] if s.n != s.M else []
    auto += ["bias"] if all(s.bias) else (["nobias"] if not any(s.bias) else ["bias_partial"])
    auto += ["probs"] if s.probs == "full" else (["probs_avg"] if s.probs else [])
    preds = check_tags(s)
    auto += [t for t, v in preds.items() if v]
    s.tags = tuple(dict.fromkeys(list(s.tags) + auto))
    CASES.append(s)


def check_tags(s):
    """Each feature tag must match the spec (the tags feed the coverage counts)."""
    rope = rope_params(s.rope, s.DK) if s.rope is not None else None
    preds = {
        "alibi": s.alibi, "sinks": s.sinks, "softcap": s.softcap is not None,
        "scale": s.scale is not None, "window": s.window is not None,
        "window_unbounded": s.window is not None and -1 in s.window,
        "segments": s.segments is not None, "key_padding": s.kpm is not None,
        "causal_offsets": s.offsets is not None, "positions": s.positions is not None,
        "key_positions": s.key_positions is not None,
        "positions_i32": s.positions is not None and s.pos_dtype == "int32",
        "causal_default": s.causal == "flag", "causal_top_left": s.causal == "top-left",
        "causal_bottom_right": s.causal in ("bottom-right", "flag"),
        "mask_bool": s.mask is not None and s.mask["kind"] == "bool",
        "mask_additive": s.mask is not None and s.mask["kind"] == "add",
        "polarity_block": s.mask is not None and s.mask.get("means") == "block",
        "polarity_attend": s.mask is not None and s.mask["kind"] == "bool"
        and s.mask.get("means") != "block",
        "rope_interleaved": rope is not None and rope["style"] == "interleaved",
        "rope_half": rope is not None and rope["style"] == "half",
        "rope_partial": rope is not None and rope["dim"] < s.DK,
        "theta": rope is not None and "theta" in s.rope,
        "names_mha": s.names == "mha", "names_cs336": s.names == "cs336",
        "names_map": s.names == "map", "prefix": bool(s.prefix),
        "kv_heads_inferred": s.g is not None and not s.kv_heads_flag,
        "x2d": s.x2d, "input_f64": s.xdtype == "f64", "input_f16": s.xdtype == "f16",
        "out_dim": s.OUT != s.q_dim, "odd_head_dim": s.DK % 2 == 1,
        "kdim_vdim": s.K_DIM != s.q_dim or s.V_DIM != s.q_dim,
        "decode": s.decode_of, "head_dim_explicit": s.h * s.DK != s.q_dim,
        "alibi_pow2": s.alibi and s.h & (s.h - 1) == 0,
        "alibi_non_pow2": s.alibi and s.h & (s.h - 1) != 0,
    }
    for sc in ("linear", "ntk", "llama3", "yarn"):
        preds["rope_" + sc] = rope is not None and rope["scaling"] == sc
    for dt, code in (("f16", "F16"), ("bf16", "BF16"), ("f64", "F64")):
        w = s.wdtype.values() if isinstance(s.wdtype, dict) else [s.wdtype]
        preds["weights_" + dt] = code in w
    for dt, code in (("bool", "bool"), ("u8", "uint8"), ("i32", "int32"), ("i64", "int64")):
        preds["mask_dtype_" + dt] = s.mask is not None and s.mask.get("dtype") == code
        preds["kpm_dtype_" + dt] = s.kpm is not None and s.kpm["dtype"] == code
    for t in s.tags:
        if t in preds:
            assert preds[t], f"{s.name}: tag {t} does not match the spec"
    return preds


# ------------------------------------------------------------------------------------------------
# The case matrix. Tags feed the feature count printed at the end and written to index.json.
# ------------------------------------------------------------------------------------------------
def build_cases():
    R8 = dict(q_dim=16, h=2)  # d_k = 8: four RoPE frequencies
    # -- projections, tensor names, storage dtypes ---------------------------------------------
    case("plain_bias", ["bias", "batch", "probs"], probs="full")
    case("plain_nobias_2d", ["nobias", "x2d", "probs"], B=1, n=6, x2d=True, bias=(0, 0, 0, 0),
         probs="full")
    case("bias_qkv_only", ["bias_partial", "batch"], bias=(1, 1, 1, 0))
    case("bias_o_only", ["bias_partial"], h=2, bias=(0, 0, 0, 1), B=1, n=4)
    case("mha_packed", ["names_mha", "bias", "probs_avg"], names="mha", n=4, probs="average")
    case("mha_packed_nobias_block", ["names_mha", "nobias", "mask_bool", "polarity_block", "probs"],
         names="mha", bias=(0, 0, 0, 0), n=6, h=2,
         mask=dict(kind="bool", shape="nm", dtype="bool", means="block"), probs="full")
    case("mha_kdim_vdim_kpm", ["names_mha", "cross", "kdim_vdim", "key_padding", "probs"],
         names="mha", n=4, m=7, k_dim=12, v_dim=20,
         kpm=dict(dtype="bool", lens=[7, 4]), probs="full")
    case("mha_float_mask", ["names_mha", "mask_additive"], names="mha", n=5,
         mask=dict(kind="add", shape="nm", dtype="float32"))
    case("mha_causal_top_left", ["names_mha", "causal_top_left"], names="mha", n=6, h=2,
         causal="top-left", probs="full")
    case("cs336_rope_causal", ["names_cs336", "rope_interleaved", "causal_default", "probs"],
         names="cs336", bias=(0, 0, 0, 0), n=6, causal="flag",
         rope=dict(style="interleaved", theta=10000.0), probs="full", **R8)
    case("prefix_llama_gqa", ["prefix", "gqa", "rope_half", "causal_default", "nobias", "theta"],
         names="hf", prefix="model.layers.0.self_attn.", distractors=True, bias=(0, 0, 0, 0),
         q_dim=24, h=4, g=2, dk=6, n=7, causal="flag", rope=dict(style="half", theta=500000.0))
    case("names_map_bert", ["names_map", "bias", "key_padding", "probs_avg"], names="map", n=7,
         kpm=dict(dtype="int64", lens=[7, 5]), probs="average")
    case("names_map_prefix_f16", ["names_map", "prefix", "weights_f16"], names="map",
         prefix="bert.encoder.layer.0.", distractors=True, wdtype="F16", n=5)
    case("weights_f16_rope", ["weights_f16", "rope_half"], wdtype="F16",
         rope=dict(style="half"), **R8)
    case("weights_bf16_gqa", ["weights_bf16", "gqa"], wdtype="BF16", h=4, g=2, causal="flag")
    case("weights_f64_cross", ["weights_f64", "cross"], wdtype="F64", n=4, m=6, k_dim=10)
    case("weights_mixed_dtypes", ["weights_f16", "weights_bf16", "weights_f64"],
         wdtype={"q": "BF16", "k": "F16", "v": "F64", "o": "F32"}, n=5)
    case("input_f64", ["input_f64"], xdtype="f64", n=4)
    case("input_f16", ["input_f16", "x2d"], xdtype="f16", B=1, x2d=True, n=5)

    # -- shapes and heads ------------------------------------------------------------------------
    case("n1_self", ["n1", "probs"], n=1, probs="full")
    case("n1_cross", ["n1", "cross", "probs"], n=1, m=9, probs="full")
    case("h1_causal_2d", ["h1", "causal_default", "x2d", "probs"], B=1, x2d=True, n=6, q_dim=8,
         h=1, causal="flag", probs="full")
    case("h1_cross_rope", ["h1", "cross", "rope_interleaved"], q_dim=8, h=1, n=4, m=6, k_dim=12,
         rope=dict(style="interleaved"))
    case("dk_ne_dv", ["dk_ne_dv", "probs"], q_dim=16, h=2, dk=8, dv=4, probs="full")
    case("out_dim", ["out_dim", "odd_head_dim"], q_dim=12, h=3, dk=5, out_dim=7)
    case("head_dim_explicit", ["dk_ne_dv", "out_dim", "head_dim_explicit"], q_dim=12, h=2, dk=8,
         dv=6,
         out_dim=20)
    case("gqa_causal", ["gqa", "causal_default", "probs"], h=4, g=2, causal="flag", probs="full")
    case("mqa_cross_avg", ["mqa", "cross", "probs_avg"], h=4, g=1, n=3, m=6, probs="average")
    case("gqa_inferred", ["gqa", "kv_heads_inferred"], h=4, g=2, kv_heads_flag=False)
    case("gqa_dk_ne_dv_cross", ["gqa", "dk_ne_dv", "cross", "kdim_vdim", "out_dim"], h=4, g=2,
         dk=4, dv=6, q_dim=16, k_dim=10, v_dim=14, n=5, m=8, out_dim=12)
    case("mqa_inferred_dk_ne_dv", ["mqa", "kv_heads_inferred", "dk_ne_dv"], h=4, g=1, dk=4, dv=2,
         kv_heads_flag=False, causal="flag")

    # -- cross-attention and causal alignment ----------------------------------------------------
    case("cross_basic", ["cross", "probs"], n=4, m=7, probs="full")
    case("cross_same_kv", ["cross", "kdim_vdim"], n=4, m=7, k_dim=12, same_kv=True)
    case("cross_n_gt_m", ["cross"], n=8, m=3)
    case("causal_br_n_lt_m", ["cross", "causal_bottom_right", "probs"], n=3, m=8,
         causal="bottom-right", probs="full")
    case("causal_tl_n_lt_m", ["cross", "causal_top_left", "probs"], n=3, m=8, causal="top-left",
         probs="full")
    case("causal_br_n_gt_m", ["cross", "causal_bottom_right", "fully_masked", "probs"], n=7, m=4,
         causal="bottom-right", probs="full")
    case("causal_tl_n_gt_m", ["cross", "causal_top_left", "probs_avg"], n=7, m=4,
         causal="top-left", probs="average")
    case("causal_default_self", ["causal_default", "batch"], n=7, causal="flag")
    case("causal_tl_self", ["causal_top_left"], n=6, causal="top-left", B=1)
    case("causal_offsets", ["causal_offsets", "cross", "probs"], n=4, m=8, causal="flag",
         offsets=[1, 4], probs="full")
    case("causal_offsets_negative", ["causal_offsets", "fully_masked"], n=6, causal="flag",
         offsets=[0, -2])
    case("decode_cache_gqa_rope", ["cross", "decode", "gqa", "rope_half", "positions",
                                   "causal_bottom_right"],
         decode_of=True, n=2, m=7, h=4, g=2, dk=4, causal="bottom-right",
         rope=dict(style="half"), positions=[[5, 6], [5, 6]])

    # -- sliding windows --------------------------------------------------------------------------
    case("window_causal_mistral", ["window", "causal_default"], n=8, causal="flag", window=(2, 0),
         redundant=("not causal",))
    case("window_causal_intersect", ["window", "causal_default"], n=8, causal="flag",
         window=(3, 2))
    case("window_symmetric", ["window", "probs"], n=8, window=(1, 1), probs="full")
    case("window_left_unbounded", ["window", "window_unbounded"], n=7, window=(-1, 1))
    case("window_right_unbounded", ["window", "window_unbounded"], n=7, window=(2, -1))
    case("window_cross_br", ["window", "cross"], n=4, m=9, window=(2, 1), probs="full")
    case("window_cross_top_left", ["window", "cross", "causal_top_left"], n=4, m=9,
         causal="top-left", window=(1, 0))
    case("window_offsets", ["window", "causal_offsets", "cross"], n=4, m=8, window=(1, 1),
         offsets=[2, 5], probs="full")

    # -- masks -----------------------------------------------------------------------------------
    case("boolmask_nm_default", ["mask_bool", "polarity_attend", "mask_dtype_bool", "probs"],
         mask=dict(kind="bool", shape="nm", dtype="bool", means=None), probs="full")
    case("boolmask_u8_B1nm_attend", ["mask_bool", "polarity_attend", "mask_dtype_u8",
                                     "broadcast"],
         mask=dict(kind="bool", shape="B1nm", dtype="uint8", means="attend"))
    case("boolmask_bool_Bhnm_block", ["mask_bool", "polarity_block", "mask_dtype_bool",
                                      "broadcast", "probs"],
         mask=dict(kind="bool", shape="Bhnm", dtype="bool", means="block"), probs="full")
    case("boolmask_i32_nm_block", ["mask_bool", "polarity_block", "mask_dtype_i32"],
         mask=dict(kind="bool", shape="nm", dtype="int32", means="block"))
    case("boolmask_i64_111m_cross", ["mask_bool", "polarity_attend", "mask_dtype_i64",
                                     "broadcast", "cross"],
         n=4, m=7, mask=dict(kind="bool", shape="111m", dtype="int64", means="attend"))
    case("boolmask_u8_m_2d", ["mask_bool", "mask_dtype_u8", "broadcast", "x2d"], B=1, x2d=True,
         n=5, mask=dict(kind="bool", shape="m", dtype="uint8", means=None))
    case("boolmask_1h1m_block_causal", ["mask_bool", "polarity_block", "broadcast",
                                        "causal_default"],
         causal="flag", mask=dict(kind="bool", shape="1h1m", dtype="bool", means="block"))
    case("boolmask_i32_hnm", ["mask_bool", "mask_dtype_i32", "broadcast", "probs_avg"],
         mask=dict(kind="bool", shape="hnm", dtype="int32", means="attend"), probs="average")
    case("boolmask_dead_rows", ["mask_bool", "fully_masked", "broadcast", "probs"],
         mask=dict(kind="bool", shape="B1nm", dtype="bool", means="attend",
                   dead=[(0, 0, 1), (1, 0, 3), (1, 0, 4)]), probs="full")
    case("addmask_nm", ["mask_additive", "probs"], mask=dict(kind="add", shape="nm"),
         probs="full")
    case("addmask_Bhnm_causal", ["mask_additive", "broadcast", "causal_default"], causal="flag",
         mask=dict(kind="add", shape="Bhnm"))
    case("addmask_B11m_cross", ["mask_additive", "broadcast", "cross"], n=4, m=6,
         mask=dict(kind="add", shape="B11m"))
    case("addmask_dead_row", ["mask_additive", "fully_masked", "probs"],
         mask=dict(kind="add", shape="Bhnm", dead=[(0, 1, 2), (1, 3, 0)]), probs="full")
    case("kpm_bool", ["key_padding", "kpm_dtype_bool", "batch"], n=6,
         kpm=dict(dtype="bool", lens=[6, 3]))
    case("kpm_u8_causal_cross", ["key_padding", "kpm_dtype_u8", "causal_default", "cross"], n=3,
         m=6, causal="flag", kpm=dict(dtype="uint8", lens=[5, 6]))
    case("kpm_i32_m_2d", ["key_padding", "kpm_dtype_i32", "x2d"], B=1, x2d=True, n=6,
         kpm=dict(dtype="int32", lens=[4], shape="m"))
    case("kpm_i64_dead_batch", ["key_padding", "kpm_dtype_i64", "fully_masked", "probs"], n=5,
         kpm=dict(dtype="int64", lens=[5, 0]), probs="full")
    case("segments_self_causal", ["segments", "causal_default", "probs"], n=8, causal="flag",
         segments=([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 7, 7, 7, 7]],) * 2, probs="full")
    case("segments_cross", ["segments", "cross"], n=4, m=6,
         segments=([[1, 1, 2, 2], [0, 3, 3, 3]], [[1, 2, 2, 2, 1, 1], [0, 0, 3, 3, 3, 9]]))
    case("segments_dead", ["segments", "cross", "fully_masked", "probs"], n=4, m=5,
         segments=([[1, 4, 2, 2], [6, 6, 0, 0]], [[1, 1, 2, 2, 2], [0, 0, 0, 3, 3]]),
         probs="full")
    case("masks_combined", ["mask_bool", "polarity_block", "causal_default", "window",
                            "key_padding", "segments", "combined"],
         n=8, causal="flag", window=(4, 0), redundant=("not causal",),
         mask=dict(kind="bool", shape="B1nm", dtype="uint8", means="block", density=0.15),
         kpm=dict(dtype="bool", lens=[8, 6]),
         segments=([[0, 0, 0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]],) * 2)

    # -- score modifiers -------------------------------------------------------------------------
    case("scale_explicit", ["scale"], scale=0.3)
    case("softcap", ["softcap", "probs"], softcap=1.5, xscale=3.0, probs="full")
    case("softcap_scale_causal", ["softcap", "scale", "causal_default"], softcap=5.0, scale=1.0,
         xscale=2.0, causal="flag")
    case("alibi_h4_causal", ["alibi", "alibi_pow2", "causal_default", "probs"], h=4, alibi=True,
         causal="flag", probs="full")
    case("alibi_h3_causal", ["alibi", "alibi_non_pow2", "causal_default"], q_dim=12, h=3,
         alibi=True, causal="flag")
    case("alibi_h6_gqa_cross", ["alibi", "alibi_non_pow2", "gqa", "cross"], q_dim=24, h=6, g=3,
         n=4, m=7, alibi=True, probs="full")
    case("alibi_h5_top_left", ["alibi", "alibi_non_pow2", "cross", "causal_top_left"], q_dim=20,
         h=5, n=5, m=7, alibi=True, causal="top-left")
    case("alibi_h2_offsets", ["alibi", "alibi_pow2", "causal_offsets", "cross"], h=2, n=3, m=6,
         alibi=True, offsets=[3, 1])
    case("sinks_basic", ["sinks", "probs"], sinks=True, probs="full")
    case("gptoss_like", ["sinks", "gqa", "window", "causal_default", "rope_half", "rope_yarn"],
         q_dim=16, h=4, g=2, dk=8, n=8, causal="flag", window=(3, 0), sinks=True,
         redundant=("not causal",),
         rope=dict(style="half", theta=150000.0, scaling="yarn", factor=32.0, orig=4096,
                   beta_fast=32.0, beta_slow=1.0),
         positions=[[0, 1, 2, 3, 4, 5, 6, 7], [100, 300, 500, 700, 900, 1100, 1300, 1500]],
         probs="full")
    case("sinks_dead_rows", ["sinks", "fully_masked", "key_padding", "probs"], sinks=True,
         kpm=dict(dtype="uint8", lens=[0, 4]), probs="full")
    case("full_pipeline", ["softcap", "mask_additive", "alibi", "sinks", "causal_bottom_right",
                           "key_padding", "gqa", "cross", "combined", "probs_avg"],
         h=4, g=2, n=4, m=7, softcap=4.0, xscale=2.0, alibi=True, sinks=True,
         causal="bottom-right", mask=dict(kind="add", shape="B1nm"),
         kpm=dict(dtype="bool", lens=[7, 5]), probs="average")

    # -- RoPE --------------------------------------------------------------------------------------
    case("rope_interleaved", ["rope_interleaved", "probs"], rope=dict(style="interleaved"),
         probs="full", **R8)
    case("rope_half_theta", ["rope_half", "theta"], rope=dict(style="half", theta=10000.0), **R8)
    case("rope_interleaved_partial", ["rope_interleaved", "rope_partial"],
         rope=dict(style="interleaved", dim=6), **R8)
    case("rope_half_partial", ["rope_half", "rope_partial", "causal_default"], causal="flag",
         rope=dict(style="half", dim=4), **R8)
    case("rope_half_partial_r2", ["rope_half", "rope_partial"],
         rope=dict(style="half", dim=2), **R8)
    case("rope_theta_500k_gqa", ["rope_half", "theta", "gqa"], q_dim=16, h=4, g=2, dk=8,
         rope=dict(style="half", theta=500000.0))
    case("rope_positions_i32", ["rope_interleaved", "positions", "positions_i32"],
         rope=dict(style="interleaved"), pos_dtype="int32",
         positions=[[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], **R8)
    case("rope_positions_i64_2d", ["rope_half", "positions", "x2d"], B=1, x2d=True,
         rope=dict(style="half"), positions=[10, 11, 12, 20, 21], **R8)
    case("rope_key_positions_self", ["rope_half", "positions", "key_positions"],
         rope=dict(style="half"), positions=[[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]],
         key_positions=[[2, 2, 2, 3, 9], [0, 0, 1, 1, 2]], **R8)
    case("rope_cross_default_kpos", ["rope_half", "cross", "positions"], n=3, m=7,
         rope=dict(style="half"), positions=[[4, 5, 6], [0, 1, 2]], **R8)
    case("rope_cross_kpos", ["rope_interleaved", "cross", "positions", "key_positions"], n=3, m=6,
         rope=dict(style="interleaved", theta=1000.0), positions=[[1, 2, 3], [7, 8, 9]],
         key_positions=[[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]], pos_dtype="int32", **R8)
    case("rope_linear", ["rope_half", "rope_linear", "positions"], rope=dict(
        style="half", scaling="linear", factor=4.0), positions=[[0, 7, 14, 21, 28], [1, 2, 3, 40,
                                                                                     50]], **R8)
    case("rope_ntk", ["rope_interleaved", "rope_ntk", "positions"],
         rope=dict(style="interleaved", scaling="ntk", factor=4.0),
         positions=[[0, 10, 20, 30, 40], [5, 6, 7, 8, 9]], **R8)
    case("rope_ntk_partial", ["rope_half", "rope_ntk", "rope_partial"],
         rope=dict(style="half", scaling="ntk", factor=2.0, dim=6), **R8)
    case("rope_linear_partial_gqa", ["rope_interleaved", "rope_linear", "rope_partial", "gqa"],
         q_dim=16, h=4, g=2, dk=8, rope=dict(style="interleaved", scaling="linear", factor=2.0,
                                             dim=4))
    case("rope_llama3", ["rope_half", "rope_llama3", "positions"],
         rope=dict(style="half", theta=10000.0, scaling="llama3", factor=8.0, orig=1024,
                   low=1.0, high=4.0),
         positions=[[0, 100, 200, 300, 400], [1000, 1001, 1002, 1003, 1004]], **R8)
    case("rope_llama3_defaults", ["rope_half", "rope_llama3", "theta", "causal_default"],
         rope=dict(style="half", theta=500000.0, scaling="llama3"), causal="flag",
         positions=[[0, 1, 2, 3, 4], [0, 3000, 6000, 9000, 12000]], **R8)
    case("rope_llama3_interleaved_custom", ["rope_interleaved", "rope_llama3"],
         rope=dict(style="interleaved", scaling="llama3", factor=4.0, orig=512, low=2.0,
                   high=8.0), positions=[[0, 50, 100, 150, 200], [7, 77, 777, 7, 0]], **R8)
    case("rope_yarn_defaults", ["rope_half", "rope_yarn"],
         rope=dict(style="half", scaling="yarn", factor=4.0),
         positions=[[0, 1, 2, 3, 4], [500, 1000, 1500, 2000, 2500]], **R8)
    case("rope_yarn_explicit", ["rope_interleaved", "rope_yarn"],
         rope=dict(style="interleaved", scaling="yarn", factor=8.0, orig=2048, beta_fast=16.0,
                   beta_slow=2.0, attn_factor=1.25),
         positions=[[0, 3, 6, 9, 12], [40, 30, 20, 10, 0]], **R8)
    case("rope_yarn_partial_cross", ["rope_half", "rope_yarn", "rope_partial", "cross"], n=3, m=6,
         rope=dict(style="half", scaling="yarn", factor=16.0, orig=1024, dim=6, theta=20000.0),
         **R8)
    case("rope_large_positions", ["rope_half", "positions", "large_positions"],
         rope=dict(style="half"), positions=[[30000, 30001, 30002, 30003, 30004],
                                             [99990, 99991, 99992, 99993, 123456]], **R8)
    case("rope_alibi_window_avg", ["rope_interleaved", "alibi", "window", "probs_avg",
                                   "combined"],
         rope=dict(style="interleaved"), alibi=True, window=(2, 2), q_dim=16, h=2, n=7,
         probs="average")
    case("everything_self", ["combined", "gqa", "rope_half", "rope_partial", "softcap", "sinks",
                             "alibi", "mask_bool", "key_padding", "causal_default", "window",
                             "segments", "scale", "probs"],
         q_dim=16, h=4, g=2, dk=8, n=7, bias=(1, 0, 1, 1), scale=0.4, softcap=6.0, sinks=True,
         alibi=True, causal="flag", window=(4, 1),
         rope=dict(style="half", dim=6, theta=5000.0),
         mask=dict(kind="bool", shape="Bhnm", dtype="uint8", means="attend", density=0.15),
         kpm=dict(dtype="int32", lens=[7, 6]),
         segments=([[3, 3, 3, 3, 3, 4, 4], [1, 1, 1, 1, 1, 1, 1]],) * 2,
         positions=[[0, 1, 2, 3, 4, 5, 6], [2, 3, 5, 8, 13, 21, 34]], probs="full")


# ------------------------------------------------------------------------------------------------
# Random data
# ------------------------------------------------------------------------------------------------
def make_rng(name):
    seed = zlib.crc32(name.encode())
    gen = torch.Generator().manual_seed(seed)
    return seed, gen, np.random.default_rng(seed)


def randn(gen, *shape, std=1.0):
    return torch.randn(*shape, generator=gen, dtype=F64) * std


TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F64": torch.float64}
NP_DTYPES = {"f32": np.float32, "f64": np.float64, "f16": np.float16}


def role_dtype(s, role):
    return s.wdtype[role] if isinstance(s.wdtype, dict) else s.wdtype


def tensor_names(s):
    """role -> (weight name, bias name) in the file, for hf/cs336/map names. mha is special."""
    if s.names == "hf":
        return {r: (f"{r}_proj.weight", f"{r}_proj.bias") for r in "qkvo"}
    if s.names == "cs336":
        return {r: (f"{r}_proj_weight", None) for r in "qkvo"}
    if s.names == "map":
        return {r: (stem + ".weight", stem + ".bias") for r, stem in NAME_MAP.items()}
    raise AssertionError(s.names)


NAME_MAP = {"q": "attention.self.query", "k": "attention.self.key",
            "v": "attention.self.value", "o": "attention.output.dense"}


def make_weights(s, gen):
    """Returns the dict written to weights.safetensors (names include the prefix)."""
    h, g, dk, dv = s.h, s.G, s.DK, s.DV
    shapes = {"q": (h * dk, s.q_dim), "k": (g * dk, s.K_DIM), "v": (g * dv, s.V_DIM),
              "o": (s.OUT, h * dv)}
    w = {r: randn(gen, *shp, std=1.0 / math.sqrt(shp[1])) for r, shp in shapes.items()}
    b = {r: randn(gen, shapes[r][0], std=0.5) for r in "qkvo"}
    out = {}
    if s.names == "mha":
        # The state dict of torch.nn.MultiheadAttention(embed_dim=q_dim, num_heads=h, bias,
        # kdim, vdim): packed in_proj_weight when kdim == vdim == embed_dim.
        assert g == h and dk == dv and h * dk == s.q_dim and s.OUT == s.q_dim
        assert all(s.bias) or not any(s.bias)
        if s.K_DIM == s.q_dim and s.V_DIM == s.q_dim:
            out["in_proj_weight"] = torch.cat([w["q"], w["k"], w["v"]])
        else:
            for r in "qkv":
                out[f"{r}_proj_weight"] = w[r]
        if s.bias[0]:
            out["in_proj_bias"] = torch.cat([b["q"], b["k"], b["v"]])
        out["out_proj.weight"] = w["o"]
        if s.bias[3]:
            out["out_proj.bias"] = b["o"]
        dt = TORCH_DTYPES[role_dtype(s, "q")]
        out = {k: v.to(dt) for k, v in out.items()}
    else:
        names = tensor_names(s)
        if s.names == "cs336":
            assert not any(s.bias)
        for i, r in enumerate("qkvo"):
            dt = TORCH_DTYPES[role_dtype(s, r)]
            out[names[r][0]] = w[r].to(dt)
            if s.bias[i]:
                out[names[r][1]] = b[r].to(dt)
    out = {s.prefix + k: v.contiguous() for k, v in out.items()}
    if s.distractors:
        # Tensors that share suffixes with the real ones under other prefixes.
        for k, v in list(out.items()):
            other = "model.layers.1.self_attn." + k[len(s.prefix):]
            out[other] = torch.zeros_like(v)
        out[s.prefix.replace("self_attn.", "") + "mlp.up_proj.weight"] = \
            torch.ones(4, s.q_dim, dtype=torch.float32)
        out["lm_head.weight"] = torch.ones(3, 2, dtype=torch.float32)
    return out


def read_weights(s, tensors):
    """role -> (W, b or None) in float64, read back from the file's tensors."""
    t = {k[len(s.prefix):]: v.to(F64) for k, v in tensors.items() if k.startswith(s.prefix)}
    h, g, dk, dv = s.h, s.G, s.DK, s.DV
    W, Bs = {}, {}
    if s.names == "mha":
        E = s.q_dim
        if "in_proj_weight" in t:
            W["q"], W["k"], W["v"] = t["in_proj_weight"].split(E)
        else:
            for r in "qkv":
                W[r] = t[f"{r}_proj_weight"]
        ib = t.get("in_proj_bias")
        Bs["q"], Bs["k"], Bs["v"] = ib.split(E) if ib is not None else (None,) * 3
        W["o"], Bs["o"] = t["out_proj.weight"], t.get("out_proj.bias")
    else:
        names = tensor_names(s)
        for r in "qkvo":
            W[r] = t[names[r][0]]
            Bs[r] = t.get(names[r][1]) if names[r][1] else None
    assert W["q"].shape == (h * dk, s.q_dim) and W["k"].shape == (g * dk, s.K_DIM)
    assert W["v"].shape == (g * dv, s.V_DIM) and W["o"].shape == (s.OUT, h * dv)
    return W, Bs


def make_bool_mask(s, nrng, shape):
    spec = s.mask
    density = spec.get("density", 0.3)  # fraction of blocked entries
    blocked = nrng.random(shape) < density
    for idx in spec.get("dead", []):
        blocked[idx] = True
    means_block = spec.get("means") == "block"
    nonzero = blocked if means_block else ~blocked
    dt = spec["dtype"]
    if dt == "bool":
        return nonzero.astype(np.bool_)
    # integer masks use several nonzero values: "nonzero", not "== 1"
    choices = {"uint8": [1, 255, 7], "int32": [1, -3, 7], "int64": [1, 2 ** 40, -1]}[dt]
    vals = np.asarray(choices)[nrng.integers(0, 3, size=shape)]
    return np.where(nonzero, vals, 0).astype(dt)


def make_add_mask(s, nrng, shape):
    spec = s.mask
    vals = nrng.normal(0.0, 1.5, size=shape)
    vals[nrng.random(shape) < spec.get("density", 0.15)] = -np.inf
    for idx in spec.get("dead", []):
        vals[idx] = -np.inf
    return vals.astype(np.float32)


def mask_shape(code, s):
    dims = {"B": s.B, "h": s.h, "n": s.n, "m": s.M, "1": 1}
    return tuple(dims[c] for c in code)


# ------------------------------------------------------------------------------------------------
# The float64 reference (torch, vectorised)
# ------------------------------------------------------------------------------------------------
def rope_params(rope, dk):
    """Resolved RoPE parameters with the documented defaults."""
    r = dict(rope)
    r.setdefault("theta", 10000.0)
    r.setdefault("dim", dk)
    sc = r.setdefault("scaling", "none")
    if sc in ("linear", "ntk"):
        r.setdefault("factor", 1.0)
    if sc == "llama3":
        r.setdefault("factor", 8.0)
        r.setdefault("orig", 8192)
        r.setdefault("low", 1.0)
        r.setdefault("high", 4.0)
    if sc == "yarn":
        assert "factor" in r
        r.setdefault("orig", 4096)
        r.setdefault("beta_fast", 32.0)
        r.setdefault("beta_slow", 1.0)
        r.setdefault("attn_factor", 0.1 * math.log(r["factor"]) + 1.0)
    return r


def rope_inv_freq(r):
    """f_k for k = 0..R/2-1 after scaling, and the factor multiplying cos and sin."""
    R, theta, sc = r["dim"], float(r["theta"]), r["scaling"]
    k = torch.arange(R // 2, dtype=F64)
    if sc == "ntk":
        theta = theta * r["factor"] ** (R / (R - 2))
    f = torch.pow(torch.tensor(theta, dtype=F64), -2.0 * k / R)
    af = 1.0
    if sc == "linear":
        f = f / r["factor"]
    elif sc == "llama3":
        factor, orig, low, high = r["factor"], float(r["orig"]), r["low"], r["high"]
        wavelen = 2.0 * math.pi / f
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1.0 - smooth) * f / factor + smooth * f
        f = torch.where(wavelen < orig / high, f,
                        torch.where(wavelen > orig / low, f / factor, blended))
    elif sc == "yarn":
        factor, orig = r["factor"], float(r["orig"])

        def correction_dim(rot):
            return R * math.log(orig / (rot * 2.0 * math.pi)) / (2.0 * math.log(theta))

        low = min(max(math.floor(correction_dim(r["beta_fast"])), 0), R - 1)
        high = min(max(math.ceil(correction_dim(r["beta_slow"])), 0), R - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((k - low) / (high - low), 0.0, 1.0)
        w_extrap = 1.0 - ramp
        f = (f / factor) * (1.0 - w_extrap) + f * w_extrap
        af = r["attn_factor"]
    return f, af


def apply_rope(x, pos, r):
    """x [B, H, L, d], pos [B, L] int -> rotated copy."""
    f, af = rope_inv_freq(r)
    R = r["dim"]
    ang = pos.to(F64)[:, None, :, None] * f  # [B, 1, L, R/2]
    c, sn = torch.cos(ang) * af, torch.sin(ang) * af
    if r["style"] == "interleaved":
        a = torch.arange(0, R, 2)
        b = a + 1
    else:
        a = torch.arange(R // 2)
        b = a + R // 2
    y = x.clone()
    xa, xb = x[..., a], x[..., b]
    y[..., a] = xa * c - xb * sn
    y[..., b] = xa * sn + xb * c
    return y


def alibi_slopes(h):
    def pow2_slopes(c):
        return [2.0 ** (-8.0 * (k + 1) / c) for k in range(c)]

    if h & (h - 1) == 0:
        return pow2_slopes(h)
    c = 1 << (h.bit_length() - 1)
    return pow2_slopes(c) + [2.0 ** (-8.0 * (2 * k + 1) / (2 * c)) for k in range(h - c)]


def load_inputs(s, d):
    """Reads the case's files back (as stored) into float64 tensors / int arrays."""
    def f64(name):
        return torch.from_numpy(np.load(os.path.join(d, name)).astype(np.float64))

    B, n, M = s.B, s.n, s.M
    inp = {"x": f64("x.npy").reshape(B, n, s.q_dim)}
    if s.cross:
        inp["key"] = f64(KEY_FILE(s)).reshape(B, M, s.K_DIM)
        inp["value"] = f64(VALUE_FILE(s)).reshape(B, M, s.V_DIM)
    for key, fname, L in (("qpos", "positions.npy", n), ("kpos", "key_positions.npy", M)):
        p = os.path.join(d, fname)
        if os.path.exists(p):
            a = np.load(p).astype(np.int64)
            inp[key] = torch.from_numpy(np.broadcast_to(a, (B, L)).copy())
    for key, fname in (("mask", "mask.npy"), ("kpm", "key_padding.npy"),
                       ("qseg", "q_segments.npy"), ("kvseg", "kv_segments.npy"),
                       ("offsets", "causal_offsets.npy"), ("sinks", "sinks.npy")):
        p = os.path.join(d, fname)
        if os.path.exists(p):
            inp[key] = np.load(p)
    return inp


def KEY_FILE(s):
    return "memory.npy" if s.same_kv else "key.npy"


def VALUE_FILE(s):
    return "memory.npy" if s.same_kv else "value.npy"


def deltas(s, inp):
    """Per batch row alignment delta (p = i + delta)."""
    if s.offsets is not None:
        return torch.from_numpy(inp["offsets"].astype(np.int64))
    if s.causal == "top-left":
        return torch.zeros(s.B, dtype=torch.int64)
    return torch.full((s.B,), s.M - s.n, dtype=torch.int64)


def project(s, W, Bs, inp):
    """Q [B,h,n,dk], K [B,g,m,dk], V [B,g,m,dv] after RoPE."""
    B, n, M, h, g = s.B, s.n, s.M, s.h, s.G
    xq = inp["x"]
    xk = inp["key"] if s.cross else xq
    xv = inp["value"] if s.cross else xq

    def lin(x, r):
        y = torch.matmul(x, W[r].T)
        return y + Bs[r] if Bs[r] is not None else y

    Q = lin(xq, "q").view(B, n, h, s.DK).transpose(1, 2)
    K = lin(xk, "k").view(B, M, g, s.DK).transpose(1, 2)
    V = lin(xv, "v").view(B, M, g, s.DV).transpose(1, 2)
    if s.rope is not None:
        r = rope_params(s.rope, s.DK)
        qpos = inp.get("qpos", torch.arange(n).expand(B, n))
        if "kpos" in inp:
            kpos = inp["kpos"]
        elif s.cross:
            kpos = torch.arange(M).expand(B, M)
        else:
            kpos = qpos
        Q = apply_rope(Q, qpos, r)
        K = apply_rope(K, kpos, r)
    return Q, K, V


def reference(s, W, Bs, inp, _wrong=None):
    """The float64 layer. Returns dict with out [B,n,out], probs [B,h,n,m], core [B,h,n,dv],
    Q/K/V, allowed [B,h,n,m] and dead [B,h,n]. `_wrong` selects a deliberately wrong variant,
    only for the sensitivity analysis (`mutations()`)."""
    B, n, M, h, g = s.B, s.n, s.M, s.h, s.G
    Q, K, V = project(s, W, Bs, inp)
    rep = h // g
    Kh = K.repeat_interleave(rep, dim=1)  # query head i reads kv head i // (h/g)
    Vh = V.repeat_interleave(rep, dim=1)
    if _wrong == "gqa_modulo":  # head i reads kv head i % g
        Kh, Vh = K.repeat(1, rep, 1, 1), V.repeat(1, rep, 1, 1)
    scale = s.scale if s.scale is not None else 1.0 / math.sqrt(s.DK)
    S = scale * torch.matmul(Q, Kh.transpose(-1, -2))  # [B,h,n,m]
    if s.softcap is not None:
        S = s.softcap * torch.tanh(S / s.softcap)
    i = torch.arange(n).view(1, 1, n, 1)
    j = torch.arange(M).view(1, 1, 1, M)
    delta = deltas(s, inp).view(B, 1, 1, 1)
    p = i + delta
    if s.mask is not None and s.mask["kind"] == "add":
        S = S + torch.from_numpy(inp["mask"].astype(np.float64))
    if s.alibi:
        sl = alibi_slopes(h)
        if _wrong == "alibi_naive_slopes":
            sl = [2.0 ** (-8.0 * (k + 1) / h) for k in range(h)]
        slopes = torch.tensor(sl, dtype=F64).view(1, h, 1, 1)
        S = S - slopes * (p - j).abs().to(F64)
    allowed = torch.ones(B, h, n, M, dtype=torch.bool)
    if s.causal is not None:
        allowed &= j <= p
    if s.window is not None:
        L, Rw = s.window
        if L >= 0:
            allowed &= j >= p - L
        if Rw >= 0:
            allowed &= j <= p + Rw
    if s.mask is not None and s.mask["kind"] == "bool":
        nz = torch.from_numpy(inp["mask"] != 0)
        allowed &= ~nz if s.mask.get("means") == "block" else nz
    if s.kpm is not None:
        allowed &= torch.from_numpy(inp["kpm"] != 0).reshape(-1, M)[:, None, None, :]
    if s.segments is not None:
        qs = torch.from_numpy(inp["qseg"].astype(np.int64))
        ks = torch.from_numpy(inp["kvseg"].astype(np.int64))
        allowed &= qs[:, None, :, None] == ks[:, None, None, :]
    S = S.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(S).all(dim=-1)  # [B,h,n]
    if s.sinks:
        sink = torch.from_numpy(inp["sinks"].astype(np.float64)).view(1, h, 1, 1)
        P = torch.softmax(torch.cat([S, sink.expand(B, h, n, 1)], dim=-1), dim=-1)[..., :M]
    else:
        P = torch.softmax(S, dim=-1)
    P = torch.where(dead[..., None], torch.zeros_like(P), P)
    O = torch.matmul(P, Vh)  # [B,h,n,dv]
    out = torch.matmul(O.transpose(1, 2).reshape(B, n, h * s.DV), W["o"].T)
    if Bs["o"] is not None:
        out = out + Bs["o"]
    return dict(out=out, probs=P, core=O, Q=Q, K=K, V=V, S=S, allowed=allowed, dead=dead,
                scale=scale)


# ------------------------------------------------------------------------------------------------
# Second implementation: scalar loops in numpy, other formulations. Only for cross-checking.
# ------------------------------------------------------------------------------------------------
def loops_rope(x, pos, r):
    """x [L, d] numpy for one (batch, head); pos [L]."""
    R = r["dim"]
    f, af = rope_inv_freq_scalar(r)
    y = x.copy()
    for t in range(x.shape[0]):
        ang = np.array([pos[t] * fk for fk in f])
        if r["style"] == "interleaved":
            # (x_2k + i x_2k+1) * af * e^{i angle}, as Meta's Llama code does with complex numbers
            z = (x[t, 0:R:2] + 1j * x[t, 1:R:2]) * (af * np.exp(1j * ang))
            y[t, 0:R:2], y[t, 1:R:2] = z.real, z.imag
        else:
            # rotate_half: x * cos(cat(ang, ang)) + cat(-x2, x1) * sin(cat(ang, ang))
            xr = x[t, :R]
            rot = np.concatenate([-xr[R // 2:], xr[:R // 2]])
            c = np.cos(np.concatenate([ang, ang])) * af
            sn = np.sin(np.concatenate([ang, ang])) * af
            y[t, :R] = xr * c + rot * sn
    return y


def rope_inv_freq_scalar(r):
    R, theta, sc = r["dim"], float(r["theta"]), r["scaling"]
    if sc == "ntk":
        theta = theta * math.pow(r["factor"], R / (R - 2))
    out = []
    af = 1.0
    if sc == "yarn":
        lo = math.floor(R * math.log(r["orig"] / (r["beta_fast"] * 2 * math.pi))
                        / (2 * math.log(theta)))
        hi = math.ceil(R * math.log(r["orig"] / (r["beta_slow"] * 2 * math.pi))
                       / (2 * math.log(theta)))
        lo, hi = max(lo, 0), min(hi, R - 1)
        lo = min(lo, R - 1)
        hi = max(hi, 0)
        if lo == hi:
            hi += 0.001
        af = r["attn_factor"]
    for k in range(R // 2):
        f = 1.0 / (theta ** (2.0 * k / R))
        if sc == "linear":
            f /= r["factor"]
        elif sc == "llama3":
            wl = 2 * math.pi / f
            if wl < r["orig"] / r["high"]:
                pass
            elif wl > r["orig"] / r["low"]:
                f /= r["factor"]
            else:
                sm = (r["orig"] / wl - r["low"]) / (r["high"] - r["low"])
                f = (1 - sm) * f / r["factor"] + sm * f
        elif sc == "yarn":
            ramp = min(max((k - lo) / (hi - lo), 0.0), 1.0)
            f = f / r["factor"] * ramp + f * (1.0 - ramp)
        out.append(f)
    return out, af


def bloom_slopes(h):
    """BLOOM's build_alibi_tensor slope recipe (powers of a base), written from its description."""
    closest = 2 ** math.floor(math.log2(h))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != h:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        nrem = min(closest, h - closest)
        slopes += [extra_base ** p for p in range(1, 1 + 2 * nrem, 2)]
    return slopes


def reference_loops(s, W, Bs, inp):
    B, n, M, h, g = s.B, s.n, s.M, s.h, s.G
    npW = {r: W[r].numpy() for r in W}
    npB = {r: (Bs[r].numpy() if Bs[r] is not None else np.zeros(npW[r].shape[0])) for r in Bs}
    xq = inp["x"].numpy()
    xk = inp["key"].numpy() if s.cross else xq
    xv = inp["value"].numpy() if s.cross else xq
    Q = np.einsum("bnd,ed->bne", xq, npW["q"]) + npB["q"]
    K = np.einsum("bnd,ed->bne", xk, npW["k"]) + npB["k"]
    V = np.einsum("bnd,ed->bne", xv, npW["v"]) + npB["v"]
    dk, dv = s.DK, s.DV
    Q = Q.reshape(B, n, h, dk)
    K = K.reshape(B, M, g, dk)
    V = V.reshape(B, M, g, dv)
    if s.rope is not None:
        r = rope_params(s.rope, dk)
        qpos = inp["qpos"].numpy() if "qpos" in inp else np.tile(np.arange(n), (B, 1))
        if "kpos" in inp:
            kpos = inp["kpos"].numpy()
        else:
            kpos = np.tile(np.arange(M), (B, 1)) if s.cross else qpos
        for b in range(B):
            for hh in range(h):
                Q[b, :, hh] = loops_rope(Q[b, :, hh], qpos[b], r)
            for hh in range(g):
                K[b, :, hh] = loops_rope(K[b, :, hh], kpos[b], r)
    scale = s.scale if s.scale is not None else 1.0 / math.sqrt(dk)
    slopes = bloom_slopes(h) if s.alibi else None
    addm = (np.broadcast_to(inp["mask"].astype(np.float64), (B, h, n, M))
            if s.mask is not None and s.mask["kind"] == "add" else None)
    boolm = (np.broadcast_to(inp["mask"], (B, h, n, M))
             if s.mask is not None and s.mask["kind"] == "bool" else None)
    kpm = inp["kpm"].reshape(-1, M) if s.kpm is not None else None
    if kpm is not None and kpm.shape[0] == 1:
        kpm = np.repeat(kpm, B, axis=0)
    sinks = inp["sinks"].astype(np.float64) if s.sinks else None
    P = np.zeros((B, h, n, M))
    O = np.zeros((B, h, n, dv))
    allowed = np.zeros((B, h, n, M), dtype=bool)
    for b in range(B):
        if s.offsets is not None:
            delta = int(inp["offsets"][b])
        elif s.causal == "top-left":
            delta = 0
        else:
            delta = M - n
        for hh in range(h):
            kvh = hh // (h // g)
            for i in range(n):
                sc = np.full(M, -np.inf)
                for j in range(M):
                    ok = True
                    if s.causal is not None and j > i + delta:
                        ok = False
                    if s.window is not None:
                        L, Rw = s.window
                        if L != -1 and j < i + delta - L:
                            ok = False
                        if Rw != -1 and j > i + delta + Rw:
                            ok = False
                    if boolm is not None:
                        nz = boolm[b, hh, i, j] != 0
                        if nz == (s.mask.get("means") == "block"):
                            ok = False
                    if kpm is not None and kpm[b, j] == 0:
                        ok = False
                    if s.segments is not None and inp["qseg"][b, i] != inp["kvseg"][b, j]:
                        ok = False
                    allowed[b, hh, i, j] = ok
                    if not ok:
                        continue
                    v = scale * float(np.dot(Q[b, i, hh], K[b, j, kvh]))
                    if s.softcap is not None:
                        v = s.softcap * math.tanh(v / s.softcap)
                    if addm is not None:
                        v += addm[b, hh, i, j]
                    if slopes is not None:
                        v -= slopes[hh] * abs(i + delta - j)
                    sc[j] = v
                fin = np.isfinite(sc)
                if not fin.any():
                    continue  # fully masked: zero probabilities and output
                terms = list(sc[fin]) + ([sinks[hh]] if sinks is not None else [])
                mx = max(terms)
                lse = mx + math.log(sum(math.exp(t - mx) for t in terms))
                for j in range(M):
                    if fin[j]:
                        P[b, hh, i, j] = math.exp(sc[j] - lse)
                O[b, hh, i] = P[b, hh, i] @ V[b, :, kvh]
    cat = O.transpose(0, 2, 1, 3).reshape(B, n, h * dv)
    out = cat @ npW["o"].T + npB["o"]
    return dict(out=out, probs=P, core=O, allowed=allowed)


# ------------------------------------------------------------------------------------------------
# Sensitivity: each case must discriminate the features it is about
# ------------------------------------------------------------------------------------------------
def mutations(s, inp):
    """(label, spec, inputs, wrong) variants with one convention changed or one feature dropped.
    A case whose output does not move under the mutation of one of its features would not test
    that feature."""
    rep = dataclasses.replace
    out = []
    if s.rope is not None:
        r = rope_params(s.rope, s.DK)
        other = "half" if r["style"] == "interleaved" else "interleaved"
        if r["dim"] > 2:
            out.append(("rope style swapped", rep(s, rope={**s.rope, "style": other}), inp, None))
        out.append(("no rope", rep(s, rope=None), inp, None))
        if r["dim"] != s.DK:
            out.append(("rope on all dims", rep(s, rope={**s.rope, "dim": s.DK}), inp, None))
        if r["scaling"] != "none":
            plain = {k: v for k, v in s.rope.items() if k in ("style", "theta", "dim")}
            out.append(("no frequency scaling", rep(s, rope=plain), inp, None))
        if r["scaling"] == "yarn":
            out.append(("yarn without attention factor",
                        rep(s, rope={**s.rope, "attn_factor": 1.0}), inp, None))
        if "qpos" in inp:
            out.append(("default positions", s, {k: v for k, v in inp.items() if k != "qpos"},
                        None))
        if "kpos" in inp:
            out.append(("default key positions", s,
                        {k: v for k, v in inp.items() if k != "kpos"}, None))
    if s.G != s.h and s.G > 1:
        out.append(("gqa head i -> kv i % g", s, inp, "gqa_modulo"))
    if s.alibi:
        out.append(("no alibi", rep(s, alibi=False), inp, None))
        if s.h & (s.h - 1):
            out.append(("alibi slopes 2^(-8(k+1)/h)", s, inp, "alibi_naive_slopes"))
    if s.sinks:
        out.append(("no sinks", rep(s, sinks=False), inp, None))
    if s.softcap is not None:
        out.append(("no softcap", rep(s, softcap=None), inp, None))
    if s.scale is not None:
        out.append(("default scale", rep(s, scale=None), inp, None))
    if s.causal is not None:
        out.append(("not causal", rep(s, causal=None), inp, None))
        if s.n != s.M and s.offsets is None:
            other = "bottom-right" if s.causal == "top-left" else "top-left"
            out.append(("causal alignment swapped", rep(s, causal=other), inp, None))
    if s.offsets is not None:
        out.append(("offsets ignored", rep(s, offsets=None), inp, None))
    if s.window is not None:
        out.append(("no window", rep(s, window=None), inp, None))
    if s.mask is not None:
        out.append(("no mask", rep(s, mask=None), inp, None))
        if s.mask["kind"] == "bool":
            flip = "attend" if s.mask.get("means") == "block" else "block"
            out.append(("mask polarity flipped", rep(s, mask={**s.mask, "means": flip}), inp,
                        None))
    if s.kpm is not None:
        out.append(("no key padding", rep(s, kpm=None), inp, None))
    if s.segments is not None:
        out.append(("no segments", rep(s, segments=None), inp, None))
    return out


def sensitivity(s, W, Bs, inp, ref):
    """Relative change of the output (and the probabilities) under each mutation."""
    res = {}
    scale = float(ref["out"].abs().max())
    for label, ms, minp, wrong in mutations(s, inp):
        mr = reference(ms, W, Bs, minp, _wrong=wrong)
        d = float((mr["out"] - ref["out"]).abs().max()) / scale
        dp = float((mr["probs"] - ref["probs"]).abs().max())
        res[label] = max(d, dp)
    return res


SENSITIVITY_MIN = 1e-3  # 100x the test tolerance: a mutation must move the case this much
WEAK = []


# ------------------------------------------------------------------------------------------------
# Cross-checks against PyTorch's own attention
# ------------------------------------------------------------------------------------------------
def close(a, b, what, s):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (s.name, what, a.shape, b.shape)
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    lim = AGREE * max(1.0, float(np.max(np.abs(b))) if b.size else 1.0)
    if not err <= lim:
        raise AssertionError(f"{s.name}: {what} disagrees: max err {err:.3e} > {lim:.3e}")
    return err


def check_sdpa(s, ref, inp, alt_allowed):
    """F.scaled_dot_product_attention (float64) on the projected, rotated Q/K/V. Expresses every
    case without softcap and sinks; masks come from the loop implementation (allowed) plus the
    additive mask and ALiBi bias built here from scratch."""
    if s.softcap is not None or s.sinks:
        return None
    B, n, M, h = s.B, s.n, s.M, s.h
    Q, K, V = ref["Q"], ref["K"], ref["V"]
    gqa = s.G != h
    only_top_left_causal = (s.causal == "top-left" and s.offsets is None and s.window is None
                            and s.mask is None and s.kpm is None and s.segments is None
                            and not s.alibi)
    if only_top_left_causal:
        O = F.scaled_dot_product_attention(Q, K, V, is_causal=True, scale=ref["scale"],
                                           enable_gqa=gqa)
        tag = "sdpa(is_causal)"
    else:
        bias = torch.zeros(B, h, n, M, dtype=F64)
        if s.mask is not None and s.mask["kind"] == "add":
            bias = bias + torch.from_numpy(inp["mask"].astype(np.float64))
        if s.alibi:
            d = deltas(s, inp).numpy()
            for b in range(B):
                rel = torch.tensor([[abs(i + int(d[b]) - j) for j in range(M)] for i in range(n)],
                                   dtype=F64)
                for hh, sl in enumerate(bloom_slopes(h)):
                    bias[b, hh] -= sl * rel
        allowed = torch.from_numpy(alt_allowed)
        if not s.alibi and (s.mask is None or s.mask["kind"] == "bool"):
            mask = allowed  # boolean attn_mask: True = take part in attention
            tag = "sdpa(bool mask)"
        else:
            mask = bias.masked_fill(~allowed, float("-inf"))
            tag = "sdpa(float mask)"
        O = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=ref["scale"],
                                           enable_gqa=gqa)
    live = ~ref["dead"]
    return tag, close(O[live].numpy(), ref["core"][live].numpy(), tag, s)


def check_nn_mha(s, W, Bs, ref, inp, alt_allowed):
    """torch.nn.MultiheadAttention (float64) where the layer fits it: no GQA/RoPE/softcap/ALiBi/
    sinks, d_k == d_v, h*d_k == q_dim == out_dim, biases all or none."""
    if (s.G != s.h or s.rope is not None or s.softcap is not None or s.alibi or s.sinks
            or s.DK != s.DV or s.h * s.DK != s.q_dim or s.OUT != s.q_dim
            or s.scale is not None or len(set(s.bias)) != 1):
        return None
    B, n, M, h = s.B, s.n, s.M, s.h
    mha = torch.nn.MultiheadAttention(s.q_dim, h, bias=bool(s.bias[0]), kdim=s.K_DIM,
                                      vdim=s.V_DIM, batch_first=True, dtype=F64)
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([W["q"], W["k"], W["v"]]))
        else:
            mha.q_proj_weight.copy_(W["q"])
            mha.k_proj_weight.copy_(W["k"])
            mha.v_proj_weight.copy_(W["v"])
        if s.bias[0]:
            mha.in_proj_bias.copy_(torch.cat([Bs["q"], Bs["k"], Bs["v"]]))
            mha.out_proj.bias.copy_(Bs["o"])
        mha.out_proj.weight.copy_(W["o"])
    mha.eval()
    xq = inp["x"]
    xk = inp["key"] if s.cross else xq
    xv = inp["value"] if s.cross else xq
    kw = {}
    # Express the masks the way nn.MultiheadAttention users do (True = masked out).
    simple = s.offsets is None and s.window is None and s.segments is None
    if simple and s.causal is None and (s.mask is None or s.mask["shape"] == "nm"):
        tag = "nn.MultiheadAttention"
        if s.mask is not None:
            m = inp["mask"]
            if s.mask["kind"] == "bool":
                nz = torch.from_numpy(m != 0)
                kw["attn_mask"] = nz if s.mask.get("means") == "block" else ~nz
            else:
                kw["attn_mask"] = torch.from_numpy(m.astype(np.float64))
            tag += "(attn_mask [n,m])"
        if s.kpm is not None:
            kw["key_padding_mask"] = torch.from_numpy(inp["kpm"] == 0).reshape(-1, M).expand(B, M)
            tag += "(key_padding_mask)"
    elif simple and s.causal == "top-left" and s.mask is None and s.kpm is None:
        kw["attn_mask"] = torch.ones(n, M, dtype=torch.bool).triu(1)
        kw["is_causal"] = True
        tag = "nn.MultiheadAttention(is_causal)"
    else:
        # general: one float mask [B*h, n, m] from the loop implementation's decisions
        allowed = torch.from_numpy(alt_allowed)
        bias = torch.zeros(B, h, n, M, dtype=F64)
        if s.mask is not None and s.mask["kind"] == "add":
            bias = bias + torch.from_numpy(inp["mask"].astype(np.float64))
        kw["attn_mask"] = bias.masked_fill(~allowed, float("-inf")).reshape(B * h, n, M)
        tag = "nn.MultiheadAttention(float attn_mask [B*h,n,m])"
    with torch.no_grad():
        out, wts = mha(xq, xk, xv, need_weights=True, average_attn_weights=False, **kw)
    live = ~ref["dead"].any(dim=1)  # [B, n]: nn.MultiheadAttention gives NaN on dead rows
    e1 = close(out[live].numpy(), ref["out"][live].numpy(), tag + " out", s)
    livep = ~ref["dead"]
    e2 = close(wts[livep].numpy(), ref["probs"][livep].numpy(), tag + " probs", s)
    return tag, max(e1, e2)


# ------------------------------------------------------------------------------------------------
# Writing a case
# ------------------------------------------------------------------------------------------------
def fmt_num(v):
    v = float(v)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def write_case(s, root):
    seed, gen, nrng = make_rng(s.name)
    d = os.path.join(root, s.name)
    os.makedirs(d)
    B, n, M, h = s.B, s.n, s.M, s.h
    assert s.h % s.G == 0
    assert not s.x2d or B == 1
    assert B <= 2 and n <= 9 and M <= 9 and h <= 8 and s.DK <= 8 and s.DV <= 8
    assert max(s.q_dim, s.K_DIM, s.V_DIM, s.OUT) <= 24

    # 1. weights
    st = make_weights(s, gen)
    save_file(st, os.path.join(d, "weights.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(d, "weights.safetensors"), 0o644)

    # 2. inputs
    def save(name, arr):
        np.save(os.path.join(d, name), np.ascontiguousarray(arr), allow_pickle=False)

    def shaped(arr, L):
        return arr.reshape(L, -1) if s.x2d else arr

    if s.decode_of:
        full = (randn(gen, B, M, s.q_dim) * s.xscale).numpy().astype(np.float32)
        save("x.npy", shaped(full[:, M - n:], n))
        save("key.npy", shaped(full, M))
        save("value.npy", shaped(full, M))
    else:
        x = (randn(gen, B, n, s.q_dim) * s.xscale).numpy().astype(NP_DTYPES[s.xdtype])
        save("x.npy", shaped(x, n))
        if s.cross:
            k = (randn(gen, B, M, s.K_DIM) * s.xscale).numpy().astype(np.float32)
            v = (randn(gen, B, M, s.V_DIM) * s.xscale).numpy().astype(np.float32)
            if s.same_kv:
                save("memory.npy", shaped(k, M))
            else:
                save("key.npy", shaped(k, M))
                save("value.npy", shaped(v, M))

    # 3. masks, positions, sinks
    if s.positions is not None:
        save("positions.npy", np.asarray(s.positions, dtype=s.pos_dtype))
    if s.key_positions is not None:
        save("key_positions.npy", np.asarray(s.key_positions, dtype=s.pos_dtype))
    if s.offsets is not None:
        save("causal_offsets.npy", np.asarray(s.offsets, dtype=np.int64))
    if s.mask is not None:
        shp = mask_shape(s.mask["shape"], s)
        arr = make_bool_mask(s, nrng, shp) if s.mask["kind"] == "bool" else \
            make_add_mask(s, nrng, shp)
        save("mask.npy", arr)
    if s.kpm is not None:
        lens = s.kpm["lens"]
        kp = np.zeros((B, M), dtype=np.int64)
        for b, L in enumerate(lens):
            kp[b, :L] = 1 if s.kpm["dtype"] != "int32" else 3  # nonzero, not only 1
        kp = kp.astype(s.kpm["dtype"])
        if s.kpm.get("shape") == "m":
            kp = kp.reshape(M)
        save("key_padding.npy", kp)
    if s.segments is not None:
        save("q_segments.npy", np.asarray(s.segments[0], dtype=np.int32))
        save("kv_segments.npy", np.asarray(s.segments[1], dtype=np.int32))
    if s.sinks:
        save("sinks.npy", randn(gen, h).numpy().astype(np.float32))

    # 4. reference from the files as stored, and the cross-checks
    W, Bs = read_weights(s, load_file(os.path.join(d, "weights.safetensors")))
    inp = load_inputs(s, d)
    ref = reference(s, W, Bs, inp)
    alt = reference_loops(s, W, Bs, inp)
    checks = {}
    checks["loops out"] = close(alt["out"], ref["out"].numpy(), "loops out", s)
    checks["loops probs"] = close(alt["probs"], ref["probs"].numpy(), "loops probs", s)
    assert np.array_equal(alt["allowed"], ref["allowed"].numpy()), s.name
    assert not torch.isnan(ref["out"]).any() and not torch.isnan(ref["probs"]).any()
    r = check_sdpa(s, ref, inp, alt["allowed"])
    if r:
        checks[r[0]] = r[1]
    r = check_nn_mha(s, W, Bs, ref, inp, alt["allowed"])
    if r:
        checks[r[0]] = r[1]
    if s.decode_of:
        # decoding n new tokens against the whole sequence == the last n rows of causal self-attn
        full = dataclasses.replace(s, name=s.name + "/self", m=None, n=M, decode_of=False,
                                   causal="flag",
                                   positions=None)
        finp = {"x": inp["key"]}
        fref = reference(full, W, Bs, finp)
        checks["decode == self-attention tail"] = close(
            ref["out"].numpy(), fref["out"][:, M - n:].numpy(), "decode tail", s)
    sens = sensitivity(s, W, Bs, inp, ref)
    weak = {k: v for k, v in sens.items() if v < SENSITIVITY_MIN and k not in s.redundant}
    if weak:
        WEAK.append((s.name, weak))
    dead_rows = int(ref["dead"].sum())
    if "fully_masked" in s.tags:
        assert dead_rows > 0, s.name

    out = ref["out"].numpy()
    save("expected_out.npy", out.reshape(n, s.OUT) if s.x2d else out)
    probs = ref["probs"].numpy()
    if s.probs == "average":
        probs = probs.mean(axis=1)
    if s.probs:
        save("expected_probs.npy", probs)

    # 5. case.json
    cli = ["--weights", "weights.safetensors"]
    if s.prefix:
        cli += ["--prefix", s.prefix]
    cli += ["--heads", str(h)]
    if s.g is not None and s.kv_heads_flag:
        cli += ["--kv-heads", str(s.g)]
    if s.names == "map":
        cli += ["--names", ",".join(f"{r}={NAME_MAP[r]}" for r in "qkvo")]
    cli += ["--input", "x.npy"]
    if s.cross:
        cli += ["--key", KEY_FILE(s), "--value", VALUE_FILE(s)]
    if s.causal == "flag":
        cli += ["--causal"]
    elif s.causal:
        cli += ["--causal", s.causal]
    if s.offsets is not None:
        cli += ["--causal-offsets", "causal_offsets.npy"]
    if s.window is not None:
        cli += ["--window", f"{s.window[0]},{s.window[1]}"]
    if s.mask is not None:
        cli += ["--mask", "mask.npy"]
        if s.mask.get("means"):
            cli += ["--mask-means", s.mask["means"]]
    if s.kpm is not None:
        cli += ["--key-padding-mask", "key_padding.npy"]
    if s.segments is not None:
        cli += ["--q-segments", "q_segments.npy", "--kv-segments", "kv_segments.npy"]
    rope_cfg = {"style": "NONE", "theta": 0.0, "rotary_dim": 0, "scaling": "NONE", "factor": 0.0,
                "original_max_position": 0.0, "low_freq_factor": 0.0, "high_freq_factor": 0.0,
                "beta_fast": 0.0, "beta_slow": 0.0, "attention_factor": 0.0}
    if s.rope is not None:
        rp = s.rope
        flags = [("theta", "--rope-theta", "theta"), ("style", "--rope-style", "style"),
                 ("dim", "--rope-dim", "rotary_dim"), ("scaling", "--rope-scaling", "scaling"),
                 ("factor", "--rope-factor", "factor"),
                 ("orig", "--rope-original-max", "original_max_position"),
                 ("low", "--rope-low-freq", "low_freq_factor"),
                 ("high", "--rope-high-freq", "high_freq_factor"),
                 ("beta_fast", "--rope-beta-fast", "beta_fast"),
                 ("beta_slow", "--rope-beta-slow", "beta_slow"),
                 ("attn_factor", "--rope-attention-factor", "attention_factor")]
        for key, flag, field in flags:
            if key in rp:
                v = rp[key]
                cli += [flag, v if isinstance(v, str) else fmt_num(v)]
                rope_cfg[field] = v.upper() if isinstance(v, str) else (
                    int(v) if field == "rotary_dim" else float(v))
    if s.positions is not None:
        cli += ["--positions", "positions.npy"]
    if s.key_positions is not None:
        cli += ["--key-positions", "key_positions.npy"]
    if s.scale is not None:
        cli += ["--scale", fmt_num(s.scale)]
    if s.softcap is not None:
        cli += ["--softcap", fmt_num(s.softcap)]
    if s.alibi:
        cli += ["--alibi"]
    if s.sinks:
        cli += ["--sinks", "sinks.npy"]
    if s.probs == "average":
        cli += ["--attn-average"]

    if s.offsets is not None:
        alignment = "EXPLICIT"
    elif s.causal == "top-left":
        alignment = "TOP_LEFT"
    else:
        alignment = "BOTTOM_RIGHT"
    bool_mask = s.mask is not None and s.mask["kind"] == "bool"
    config = {
        "weights": "weights.safetensors",
        "prefix": s.prefix or None,
        "names": dict(NAME_MAP) if s.names == "map" else None,
        "num_heads": h,
        "num_kv_heads": s.g if (s.g is not None and s.kv_heads_flag) else 0,
        "scale": float(s.scale) if s.scale is not None else 0.0,
        "softcap": float(s.softcap) if s.softcap is not None else 0.0,
        "alibi": int(s.alibi),
        "rope": rope_cfg,
        "sinks": "sinks.npy" if s.sinks else None,
        "input": "x.npy",
        "key": KEY_FILE(s) if s.cross else None,
        "value": VALUE_FILE(s) if s.cross else None,
        "q_positions": "positions.npy" if s.positions is not None else None,
        "k_positions": "key_positions.npy" if s.key_positions is not None else None,
        "masking": {
            "causal": int(s.causal is not None),
            "alignment": alignment,
            "align_offsets": "causal_offsets.npy" if s.offsets is not None else None,
            "use_window": int(s.window is not None),
            "window_left": s.window[0] if s.window else -1,
            "window_right": s.window[1] if s.window else -1,
            "bool_mask": "mask.npy" if bool_mask else None,
            "bool_mask_polarity": "BLOCK" if bool_mask and s.mask.get("means") == "block"
            else "ATTEND",
            "additive_mask": "mask.npy" if s.mask is not None and not bool_mask else None,
            "key_padding": "key_padding.npy" if s.kpm is not None else None,
            "q_segment_ids": "q_segments.npy" if s.segments is not None else None,
            "kv_segment_ids": "kv_segments.npy" if s.segments is not None else None,
        },
        "probs": int(s.probs is not None),
        "average_probs": int(s.probs == "average"),
    }
    meta = {
        "format_version": FORMAT_VERSION,
        "name": s.name,
        "generator": "tools/gen_golden.py",
        "torch_version": torch.__version__,
        "seed": seed,
        "tags": list(s.tags),
        "sizes": {"batch": B, "q_len": n, "kv_len": M, "q_dim": s.q_dim, "k_dim": s.K_DIM,
                  "v_dim": s.V_DIM, "num_heads": h, "num_kv_heads": s.G, "head_dim": s.DK,
                  "v_head_dim": s.DV, "out_dim": s.OUT},
        "self_attention": not s.cross,
        "weights_dtype": s.wdtype,
        "cli_args": cli,
        "config": config,
        "expected_out": "expected_out.npy",
        "expected_probs": "expected_probs.npy" if s.probs else None,
        "max_abs_out": float(np.max(np.abs(out))),
        "fully_masked_rows": dead_rows,
        "cross_checks": {k: float(v) for k, v in checks.items()},
        "sensitivity": {k: float(f"{v:.3g}") for k, v in sens.items()},
    }
    with open(os.path.join(d, "case.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=False)
        fh.write("\n")
    return meta


def self_test():
    """Checks of the reference's building blocks against known values."""
    # ALiBi: powers of two and BLOOM's interpolation agree with the closed form.
    for hh in range(1, 17):
        a, b = alibi_slopes(hh), bloom_slopes(hh)
        assert len(a) == hh and np.allclose(a, b, rtol=1e-14, atol=0), hh
    assert alibi_slopes(8)[0] == 0.5 and alibi_slopes(8)[-1] == 2.0 ** -8
    assert alibi_slopes(3) == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]
    # RoPE frequencies: vectorised vs scalar for every scaling.
    for rp in ({"style": "half"}, {"style": "half", "scaling": "linear", "factor": 3.0},
               {"style": "half", "scaling": "ntk", "factor": 4.0},
               {"style": "half", "scaling": "llama3", "orig": 1024},
               {"style": "half", "scaling": "llama3"},
               {"style": "half", "scaling": "yarn", "factor": 4.0},
               {"style": "half", "scaling": "yarn", "factor": 16.0, "orig": 1024, "dim": 6}):
        r = rope_params(rp, 8)
        f, af = rope_inv_freq(r)
        f2, af2 = rope_inv_freq_scalar(r)
        assert np.allclose(f.numpy(), f2, rtol=1e-14, atol=0) and af == af2, rp
    # Llama 3 with its published defaults (theta 500000, R = 128): the three bands exist.
    r = rope_params({"style": "half", "scaling": "llama3", "theta": 500000.0}, 128)
    f, _ = rope_inv_freq(r)
    f0 = torch.pow(torch.tensor(500000.0, dtype=F64), -2.0 * torch.arange(64, dtype=F64) / 128)
    ratio = (f0 / f).numpy()
    assert ratio[0] == 1.0 and ratio[-1] == 8.0 and ((ratio > 1) & (ratio < 8)).any()
    # RoPE with position 0 is the identity; a rotation preserves pair norms.
    x = torch.randn(1, 1, 3, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    for style in ("interleaved", "half"):
        r = rope_params({"style": style}, 8)
        assert torch.equal(apply_rope(x, torch.zeros(1, 3, dtype=torch.int64), r), x)
        y = apply_rope(x, torch.tensor([[1, 5, 9]]), r)
        assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-14)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default tests/golden)")
    ap.add_argument("--allow-torch-version", action="store_true",
                    help=f"run with a torch other than {TORCH_VERSION}")
    ap.add_argument("--only", default=None, help="comma-separated case names (for debugging)")
    ap.add_argument("--check", action="store_true",
                    help="generate into a temporary directory and compare with --out byte for "
                         "byte (the committed goldens are reproducible)")
    args = ap.parse_args()
    if args.check:
        import filecmp
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), "--out", tmp]
            if args.allow_torch_version:
                cmd.append("--allow-torch-version")
            import subprocess
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            bad = []
            for dirpath, _, files in os.walk(tmp):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), tmp)
                    mine = os.path.join(args.out, rel)
                    if not os.path.exists(mine) or not filecmp.cmp(
                            os.path.join(tmp, rel), mine, shallow=False):
                        bad.append(rel)
            for dirpath, _, files in os.walk(args.out):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), args.out)
                    if rel != "README.md" and not os.path.exists(os.path.join(tmp, rel)):
                        bad.append(rel + " (stale)")
            if bad:
                sys.exit(f"gen_golden.py --check: {len(bad)} files differ, e.g. {bad[:5]}")
            print(f"gen_golden.py --check: {args.out} is reproducible")
        return
    if torch.__version__.split("+")[0] != TORCH_VERSION and not args.allow_torch_version:
        sys.exit(f"gen_golden.py: torch {TORCH_VERSION} required, found {torch.__version__} "
                 f"(pip install -r tools/requirements-golden.txt)")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    self_test()
    build_cases()
    cases = CASES
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in CASES if c.name in wanted]
    root = args.out
    # Only directories holding a case.json (ours) and our index/readme are removed.
    if os.path.isdir(root):
        for entry in os.listdir(root):
            p = os.path.join(root, entry)
            if os.path.isdir(p) and (os.path.exists(os.path.join(p, "case.json"))
                                     or entry in {c.name for c in CASES}):
                shutil.rmtree(p)
    os.makedirs(root, exist_ok=True)
    metas = [write_case(s, root) for s in cases]
    if WEAK:
        for name, weak in WEAK:
            print(f"{name}: does not discriminate " +
                  ", ".join(f"{k} ({v:.1e})" for k, v in weak.items()), file=sys.stderr)
        sys.exit(f"gen_golden.py: {len(WEAK)} cases fail the sensitivity check")
    tags = {}
    for m in metas:
        for t in m["tags"]:
            tags[t] = tags.get(t, 0) + 1
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    index = {"format_version": FORMAT_VERSION, "torch_version": torch.__version__,
             "cases": [m["name"] for m in metas],
             "feature_counts": dict(sorted(tags.items()))}
    with open(os.path.join(root, "index.json"), "w") as fh:
        json.dump(index, fh, indent=1)
        fh.write("\n")
    worst = max(max(m["cross_checks"].values()) for m in metas)
    nmha = sum(any(k.startswith("nn.") for k in m["cross_checks"]) for m in metas)
    nsdpa = sum(any(k.startswith("sdpa") for k in m["cross_checks"]) for m in metas)
    print(f"{len(metas)} cases in {root}, {total / 1e6:.2f} MB")
    print(f"cross-checks: loops {len(metas)}, F.scaled_dot_product_attention {nsdpa}, "
          f"nn.MultiheadAttention {nmha}; worst disagreement {worst:.2e}")
    for t, c in sorted(tags.items()):
        print(f"  {t:24s} {c}")


if __name__ == "__main__":
    main()

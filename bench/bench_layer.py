#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_layer.py: the multi-head attention benchmark (issue 3). Not a test; never run by ctest.

In one process and on the same inputs it times
  mha_layer      libmha's whole layer forward, impl=AUTO (projections + attention + output proj.)
  mha_layer_ref  the same with impl=REFERENCE (plain loops; small shapes only, else skipped)
  mha_core       libmha's attention core alone (mha_attention, impl=AUTO) on projected Q/K/V
  blas_layer     a plain BLAS layer: numpy matmul (its bundled OpenBLAS sgemm) for the
                 projections and per head S = QK^T -> softmax (numpy) -> P V
  torch_mha      torch.nn.MultiheadAttention (need_weights=False), when torch imports
  torch_sdpa     F.linear + F.scaled_dot_product_attention (+ enable_gqa) + F.linear
with torch.set_num_threads / threadpoolctl / mha n_threads all set to the same count, and
reports the median, min and max of >= 5 timed runs after one warm-up (round-robin: each round
runs every implementation once, so a busy neighbour slows all alike), GFLOP/s and % of this
machine's fp32 FMA peak, measured in the same run by the `mha_peak` program (bench/peak.c):
at the start, before each case and thread count, and at the end.

FLOPs (docs/BENCHMARKS.md): attention 2*B*h*P*(d_k + d_v) with P the number of unmasked
(query, key) pairs (n*m, or n(n+1)/2 for causal n = m), i.e. FlashAttention's 4*B*h*n*m*d with
causal counted exactly; each projection 2*rows*in*out. The layer's count is the sum of both.

Peak RSS of the mha layer forward is measured in a fresh process per n (VmHWM, see vm_hwm_kb).

--dtype bf16 (issue 30) times, on the same bfloat16-rounded inputs and weights,
  mha_layer_bf16   libmha's layer with bf16 weights (mha_config.weight_dtype), bf16 input and output
                   (x_dtype/out_dtype; float32 arithmetic, Q/K/V and the attention output stored
                   in bf16 as in torch's bf16 module: docs/SEMANTICS.md)
  mha_layer        mha's own float32 layer on the same values widened (the 1.5x target's base)
  mha_core_bf16    the core alone on bf16 Q/K/V/out (q_dtype...), beside mha_core (float32)
  torch_sdpa_bf16  F.linear + F.scaled_dot_product_attention + F.linear on bf16 tensors
  torch_mha_autocast  nn.MultiheadAttention (float32 parameters) under torch.autocast('cpu', bf16)
and the float32 torch rows; blas_layer, mha_layer_ref and mha_layer_alloc are left out. rel_err is
then against torch_sdpa in float32 on the widened values. Each JSONL row names the host (CPU model,
hostname) and the tier (MHA_MAX_ISA if set, else the widest ISA mha_peak found).

Usage: python3 bench/bench_layer.py [--lib build/libmha.so] [--peak build/bench/mha_peak]
         [--threads 1,2] [--reps 5] [--cases NAME,...] [--quick] [--no-torch] [--rss 2048,8192]
         [--dtype f32|bf16]
"""
import argparse
import ctypes as C
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ------------------------------------------------------------------------------------------------
# Minimal ctypes binding of include/mha.h (the real Python package is a later issue).
# Every struct mirrors the header field by field; enums are C ints.
# ------------------------------------------------------------------------------------------------
i64, i32, f64, f32 = C.c_int64, C.c_int32, C.c_double, C.c_float
P_f32 = C.POINTER(C.c_float)
P_i64 = C.POINTER(C.c_int64)
P_i32 = C.POINTER(C.c_int32)

MHA_IMPL_AUTO, MHA_IMPL_REFERENCE, MHA_IMPL_FAST = 0, 1, 2
MHA_DTYPE_F32, MHA_DTYPE_BF16 = 0, 3  # mha_dtype (include/mha.h)


class MhaError(C.Structure):
    _fields_ = [("status", C.c_int), ("message", C.c_char * 512)]


class MaskTensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("ndim", i32), ("shape", i64 * 4)]


class MaskFn(C.Structure):
    _fields_ = [("visible", C.c_void_p), ("classify", C.c_void_p), ("ctx", C.c_void_p),
                ("per_batch", i32), ("per_head", i32)]


class Masking(C.Structure):
    _fields_ = [("causal", i32), ("alignment", C.c_int), ("align_offsets", P_i64),
                ("window_left", i64), ("window_right", i64), ("use_window", i32),
                ("bool_mask", MaskTensor), ("bool_mask_polarity", C.c_int),
                ("additive_mask", MaskTensor), ("key_padding", MaskTensor),
                ("q_segment_ids", P_i32), ("kv_segment_ids", P_i32), ("mask_fn", MaskFn),
                ("chunk_size", i64)]


class Dropout(C.Structure):
    _fields_ = [("p", f32), ("seed", C.c_uint64), ("training", i32), ("row_offset", i64),
                ("col_offset", i64)]


class Exec(C.Structure):
    _fields_ = [("impl", C.c_int), ("n_threads", i32), ("workspace", C.c_void_p),
                ("workspace_bytes", C.c_size_t), ("allocator", C.c_void_p), ("pool", C.c_void_p)]


class Rope(C.Structure):
    _fields_ = [("style", C.c_int), ("theta", f64), ("rotary_dim", i64), ("scaling", C.c_int),
                ("factor", f64), ("original_max_position", f64), ("low_freq_factor", f64),
                ("high_freq_factor", f64), ("beta_fast", f64), ("beta_slow", f64),
                ("attention_factor", f64), ("yarn_no_truncate", i32),
                ("short_factor", f64 * 128), ("long_factor", f64 * 128)]  # MHA_ROPE_MAX_PAIRS


class QKNorm(C.Structure):
    _fields_ = [("kind", C.c_int), ("eps", f64), ("unit_offset", i32)]


class Temperature(C.Structure):
    _fields_ = [("enabled", i32), ("floor_scale", f64), ("attn_scale", f64)]


class Config(C.Structure):
    _fields_ = [("q_dim", i64), ("k_dim", i64), ("v_dim", i64), ("num_heads", i64),
                ("num_kv_heads", i64), ("head_dim", i64), ("v_head_dim", i64), ("out_dim", i64),
                ("bias_q", i32), ("bias_k", i32), ("bias_v", i32), ("bias_o", i32),
                ("sinks", i32), ("scale", f64), ("softcap", f64), ("alibi", i32), ("rope", Rope),
                ("weight_dtype", C.c_int), ("qk_norm", QKNorm), ("output_gate", i32),
                ("temperature", Temperature)]


class Weights(C.Structure):
    _fields_ = [(n, P_f32) for n in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o",
                                     "sinks", "q_norm", "k_norm")]


class ForwardArgs(C.Structure):
    _fields_ = [("batch", i64), ("q_len", i64), ("kv_len", i64), ("query", P_f32),
                ("key", P_f32), ("value", P_f32), ("q_positions", P_i64), ("k_positions", P_i64),
                ("mask", Masking), ("dropout", Dropout), ("out", P_f32), ("probs", P_f32),
                ("average_probs", i32), ("x_dtype", C.c_int), ("out_dtype", C.c_int)]


class AttentionArgs(C.Structure):
    _fields_ = [("batch", i64), ("num_heads", i64), ("num_kv_heads", i64), ("q_len", i64),
                ("kv_len", i64), ("head_dim", i64), ("v_head_dim", i64), ("scale", f64),
                ("softcap", f64), ("alibi", i32), ("sinks", P_f32),
                ("q", P_f32), ("q_strides", i64 * 3), ("k", P_f32), ("k_strides", i64 * 3),
                ("v", P_f32), ("v_strides", i64 * 3), ("out", P_f32), ("out_strides", i64 * 3),
                ("q_dtype", C.c_int), ("k_dtype", C.c_int), ("v_dtype", C.c_int),
                ("out_dtype", C.c_int), ("lse", P_f32), ("probs", P_f32), ("average_probs", i32),
                ("mask", Masking), ("dropout", Dropout)]


def fptr(a):
    """The data pointer of a float32 array, or of a bfloat16 one (its bits in a uint16 array:
    numpy has no bfloat16; the call's dtype field says which), typed as the struct field."""
    assert a.dtype in (np.float32, np.uint16) and a.flags.c_contiguous
    return a.ctypes.data_as(P_f32)


def to_bf16(a):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (finite inputs)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b):
    """bfloat16 bits (uint16) -> float32, exact."""
    return (b.astype(np.uint32) << 16).view(np.float32)


class Mha:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        L = self.lib
        L.mha_version.restype = C.c_char_p
        L.mha_layer_create.argtypes = [C.POINTER(Config), C.POINTER(Weights), C.c_int, C.c_void_p,
                                       C.POINTER(C.c_void_p), C.POINTER(MhaError)]
        L.mha_layer_destroy.argtypes = [C.c_void_p]
        L.mha_layer_forward_workspace_size.argtypes = [C.c_void_p, C.POINTER(ForwardArgs),
                                                       C.POINTER(Exec), C.POINTER(C.c_size_t),
                                                       C.POINTER(MhaError)]
        L.mha_layer_forward.argtypes = [C.c_void_p, C.POINTER(ForwardArgs), C.POINTER(Exec),
                                        C.POINTER(MhaError)]
        L.mha_attention.argtypes = [C.POINTER(AttentionArgs), C.POINTER(Exec),
                                    C.POINTER(MhaError)]
        self.version = L.mha_version().decode()

    def check(self, status, err, what):
        if status != 0:
            raise RuntimeError("%s: status %d: %s" % (what, status, err.message.decode()))


class MhaLayer:
    """A borrowed-weights layer: the numpy weight arrays must outlive it (kept in self.w)."""

    def __init__(self, mha, w, d_model, h, g, dk, dtype=MHA_DTYPE_F32):
        self.mha, self.w, self.dtype = mha, w, dtype  # dtype: the weights' (and x/out's)
        cfg = Config(q_dim=d_model, num_heads=h, num_kv_heads=g, head_dim=dk, bias_q=1, bias_k=1,
                     bias_v=1, bias_o=1, weight_dtype=dtype)
        wt = Weights(w_q=fptr(w["wq"]), w_k=fptr(w["wk"]), w_v=fptr(w["wv"]), w_o=fptr(w["wo"]),
                     b_q=fptr(w["bq"]), b_k=fptr(w["bk"]), b_v=fptr(w["bv"]), b_o=fptr(w["bo"]))
        self.handle = C.c_void_p()
        err = MhaError()
        mha.check(mha.lib.mha_layer_create(C.byref(cfg), C.byref(wt), 1, None,
                                           C.byref(self.handle), C.byref(err)), err, "create")

    def forward(self, x, out, causal, impl, threads, reuse_workspace=True):
        """With reuse_workspace the workspace is queried once per (shape, impl, threads) and
        kept, as an application calling the layer in a loop would (docs/performance.md): the
        forward then allocates nothing. Without it libmha allocates and frees it per call."""
        B, n, _ = x.shape
        a = ForwardArgs(batch=B, q_len=n, kv_len=n, query=fptr(x), out=fptr(out),
                        x_dtype=self.dtype, out_dtype=self.dtype)
        a.mask.causal = 1 if causal else 0
        ex = Exec(impl=impl, n_threads=threads)
        err = MhaError()
        if reuse_workspace:
            key = (x.shape, causal, impl, threads)
            if getattr(self, "_ws_key", None) != key:
                size = C.c_size_t()
                self.mha.check(self.mha.lib.mha_layer_forward_workspace_size(
                    self.handle, C.byref(a), C.byref(ex), C.byref(size), C.byref(err)), err,
                    "layer_forward_workspace_size")
                self._ws = np.zeros(max(1, size.value), np.uint8)  # touched once, here
                self._ws_key = key
            ex.workspace = self._ws.ctypes.data
            ex.workspace_bytes = self._ws.nbytes
        self.mha.check(self.mha.lib.mha_layer_forward(self.handle, C.byref(a), C.byref(ex),
                                                      C.byref(err)), err, "layer_forward")

    def close(self):
        if self.handle:
            self.mha.lib.mha_layer_destroy(self.handle)
            self.handle = C.c_void_p()


def mha_core(mha, q, k, v, out, causal, impl, threads, dtype=MHA_DTYPE_F32):
    """q [B, n, h, dk], k [B, m, g, dk], v [B, m, g, dv], out [B, n, h, dv] (the layer's layout),
    all of `dtype`."""
    B, n, h, dk = q.shape
    _, m, g, dv = v.shape
    a = AttentionArgs(batch=B, num_heads=h, num_kv_heads=g, q_len=n, kv_len=m, head_dim=dk,
                      v_head_dim=dv, q_dtype=dtype, k_dtype=dtype, v_dtype=dtype, out_dtype=dtype)
    a.q, a.k, a.v, a.out = fptr(q), fptr(k), fptr(v), fptr(out)
    a.q_strides[:] = [n * h * dk, dk, h * dk]
    a.k_strides[:] = [m * g * dk, dk, g * dk]
    a.v_strides[:] = [m * g * dv, dv, g * dv]
    a.out_strides[:] = [n * h * dv, dv, h * dv]
    a.mask.causal = 1 if causal else 0
    ex = Exec(impl=impl, n_threads=threads)
    err = MhaError()
    mha.check(mha.lib.mha_attention(C.byref(a), C.byref(ex), C.byref(err)), err, "attention")


# ------------------------------------------------------------------------------------------------
# Cases, FLOPs, inputs
# ------------------------------------------------------------------------------------------------
def all_cases():
    """(name, B, n, d_model, h, g, d_k) x causal. d_model = h * d_k everywhere."""
    # Cheapest first, so that an interrupted run still has the small shapes.
    base = [("n512_d768_h12", 1, 512, 768, 12, 12, 64),
            ("b4_n512_d1024_h16", 4, 512, 1024, 16, 16, 64),
            ("n2048_d1024_h16", 1, 2048, 1024, 16, 16, 64),
            ("gqa_n2048_d4096_h32_g8", 1, 2048, 4096, 32, 8, 128),
            ("n2048_d4096_h32", 1, 2048, 4096, 32, 32, 128),
            ("n8192_d1024_h16", 1, 8192, 1024, 16, 16, 64)]
    out = []
    for (name, B, n, dm, h, g, dk) in base:
        for causal in (False, True):
            out.append(dict(name=name + ("_causal" if causal else ""), B=B, n=n, d_model=dm, h=h,
                            g=g, dk=dk, causal=causal))
    return out


def quick_cases():
    return [dict(name="quick_n256_d256_h4" + ("_causal" if c else ""), B=2, n=256, d_model=256,
                 h=4, g=2, dk=64, causal=c) for c in (False, True)]


def pairs(n, m, causal):
    if not causal:
        return n * m
    # bottom-right alignment: query i sees keys j <= i + (m - n)
    return sum(max(0, min(m, i + (m - n) + 1)) for i in range(n)) if n != m else n * (n + 1) // 2


def flops(c):
    B, n, dm, h, g, dk = c["B"], c["n"], c["d_model"], c["h"], c["g"], c["dk"]
    dv = dk
    proj = 2 * B * n * dm * (h * dk + g * dk + g * dv) + 2 * B * n * h * dv * dm
    attn = 2 * B * h * pairs(n, n, c["causal"]) * (dk + dv)
    return proj, attn


def make_inputs(c, seed=1234):
    rng = np.random.default_rng(seed)
    B, n, dm, h, g, dk = c["B"], c["n"], c["d_model"], c["h"], c["g"], c["dk"]
    s = 1.0 / np.sqrt(dm)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

    w = dict(wq=r(h * dk, dm, scale=s), wk=r(g * dk, dm, scale=s), wv=r(g * dk, dm, scale=s),
             wo=r(dm, h * dk, scale=1.0 / np.sqrt(h * dk)), bq=r(h * dk, scale=0.1),
             bk=r(g * dk, scale=0.1), bv=r(g * dk, scale=0.1), bo=r(dm, scale=0.1))
    x = r(B, n, dm)
    return x, w


# ------------------------------------------------------------------------------------------------
# Peers
# ------------------------------------------------------------------------------------------------
def blas_layer(x, w, c):
    """Plain BLAS attention layer: numpy (OpenBLAS sgemm) -> numpy softmax -> sgemm."""
    B, n, dm, h, g, dk = c["B"], c["n"], c["d_model"], c["h"], c["g"], c["dk"]
    X = x.reshape(B * n, dm)
    q = (X @ w["wq"].T + w["bq"]).reshape(B, n, h, dk)
    k = (X @ w["wk"].T + w["bk"]).reshape(B, n, g, dk)
    v = (X @ w["wv"].T + w["bv"]).reshape(B, n, g, dk)
    att = np.empty((B, n, h, dk), np.float32)
    scale = np.float32(1.0 / np.sqrt(dk))
    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1) if c["causal"] else None
    grp = h // g
    for b in range(B):
        for hh in range(h):
            qh = np.ascontiguousarray(q[b, :, hh, :])
            kh = np.ascontiguousarray(k[b, :, hh // grp, :])
            vh = np.ascontiguousarray(v[b, :, hh // grp, :])
            s = qh @ kh.T
            s *= scale
            if mask is not None:
                s += mask
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True)
            att[b, :, hh, :] = s @ vh
    return (att.reshape(B * n, h * dk) @ w["wo"].T + w["bo"]).reshape(B, n, dm)


class TorchPeers:
    def __init__(self, torch, x, w, c):
        import torch.nn.functional as F
        self.torch, self.F, self.c = torch, F, c
        t = {k: torch.from_numpy(v) for k, v in w.items()}
        self.t, self.x = t, torch.from_numpy(x)
        B, n, dm, h, g = c["B"], c["n"], c["d_model"], c["h"], c["g"]
        self.mha = None
        if g == h:
            m = torch.nn.MultiheadAttention(dm, h, bias=True, batch_first=True)
            with torch.no_grad():
                m.in_proj_weight.copy_(torch.cat([t["wq"], t["wk"], t["wv"]], 0))
                m.in_proj_bias.copy_(torch.cat([t["bq"], t["bk"], t["bv"]], 0))
                m.out_proj.weight.copy_(t["wo"])
                m.out_proj.bias.copy_(t["bo"])
            self.mha = m.eval()
            self.mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) if c["causal"] else None

    def run_mha(self):
        with self.torch.inference_mode():
            return self.mha(self.x, self.x, self.x, need_weights=False, attn_mask=self.mask,
                            is_causal=self.mask is not None)[0]

    def prepare_core(self):
        """Projected q, k, v in SDPA's [B, heads, L, d] layout, for the core-only row."""
        c, t, F = self.c, self.t, self.F
        B, n, h, g, dk = c["B"], c["n"], c["h"], c["g"], c["dk"]
        with self.torch.inference_mode():
            self.cq = F.linear(self.x, t["wq"], t["bq"]).view(B, n, h, dk).transpose(1, 2)
            self.ck = F.linear(self.x, t["wk"], t["bk"]).view(B, n, g, dk).transpose(1, 2)
            self.cv = F.linear(self.x, t["wv"], t["bv"]).view(B, n, g, dk).transpose(1, 2)
            self.cq, self.ck, self.cv = [u.contiguous() for u in (self.cq, self.ck, self.cv)]

    def run_sdpa_core(self):
        c = self.c
        with self.torch.inference_mode():
            return self.F.scaled_dot_product_attention(self.cq, self.ck, self.cv,
                                                       is_causal=c["causal"],
                                                       enable_gqa=c["g"] != c["h"])

    def run_sdpa(self, bf16=False):
        c, F = self.c, self.F
        t, x = (self.tb, self.xb) if bf16 else (self.t, self.x)
        B, n, dm, h, g, dk = c["B"], c["n"], c["d_model"], c["h"], c["g"], c["dk"]
        with self.torch.inference_mode():
            q = F.linear(x, t["wq"], t["bq"]).view(B, n, h, dk).transpose(1, 2)
            k = F.linear(x, t["wk"], t["bk"]).view(B, n, g, dk).transpose(1, 2)
            v = F.linear(x, t["wv"], t["bv"]).view(B, n, g, dk).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"], enable_gqa=g != h)
            return F.linear(o.transpose(1, 2).reshape(B, n, h * dk), t["wo"], t["bo"])

    # bfloat16 peers (--dtype bf16): the same values (already bf16-rounded) in bf16 tensors.
    def prepare_bf16(self):
        bf = self.torch.bfloat16
        self.tb = {k: v.to(bf) for k, v in self.t.items()}
        self.xb = self.x.to(bf)
        self.cqb, self.ckb, self.cvb = (u.to(bf) for u in (self.cq, self.ck, self.cv))

    def run_sdpa_bf16(self):
        return self.run_sdpa(bf16=True)

    def run_sdpa_core_bf16(self):
        c = self.c
        with self.torch.inference_mode():
            return self.F.scaled_dot_product_attention(self.cqb, self.ckb, self.cvb,
                                                       is_causal=c["causal"],
                                                       enable_gqa=c["g"] != c["h"])

    def run_mha_autocast(self):
        with self.torch.autocast("cpu", dtype=self.torch.bfloat16):
            return self.run_mha()


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
def stats(ts):
    ts = sorted(ts)
    return dict(median_ms=1e3 * ts[len(ts) // 2], min_ms=1e3 * ts[0], max_ms=1e3 * ts[-1],
                runs=len(ts))


def time_round_robin(fns, reps):
    """One warm-up call of each, then `reps` rounds calling each function once per round, so a
    busy neighbour on this shared machine slows every implementation alike (the ratios stay
    meaningful even when the absolute numbers move). Returns one stats dict per function."""
    for fn in fns:
        fn()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t0)
    return [stats(t) for t in ts]


def measure_peak(peak_bin, threads, ms=100, reps=5, isa=None):
    cmd = [peak_bin, "--json", "--threads", str(max(threads)), "--ms", str(ms), "--reps",
           str(reps)] + (["--isa", isa] if isa else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    d = json.loads(out)
    best = {}
    for r in d["peak"]:  # first ISA listed is the widest usable one
        key = r["threads"]
        if key not in best:
            best[key] = (r["isa"], r["gflops"])
    return d, best


def machine_info():
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), numpy=np.__version__, cpus=os.cpu_count())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and "cpu" not in info:
                    info["cpu"] = line.split(":", 1)[1].strip()
                if line.startswith("flags") and "flags" not in info:
                    fl = line.split(":", 1)[1].split()
                    info["simd_flags"] = " ".join(x for x in fl if x.startswith(("avx", "fma")))
    except OSError:
        pass
    try:
        info["gcc"] = subprocess.run(["gcc", "--version"], capture_output=True,
                                     text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        pass
    try:
        info["git"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


# ------------------------------------------------------------------------------------------------
# Peak RSS in a fresh process
# ------------------------------------------------------------------------------------------------
def vm_hwm_kb():
    """Peak RSS of this process image in KiB. VmHWM, not getrusage's ru_maxrss: Linux keeps
    ru_maxrss across execve, so a child forked from a big parent (torch loaded) would report the
    parent's size; VmHWM belongs to the new address space. Same quantity otherwise."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss_child(args):
    """Runs one layer forward (d_model 1024, h 16, causal) and prints peak RSS as JSON."""
    n = args.rss_child
    c = dict(name="rss", B=1, n=n, d_model=1024, h=16, g=16, dk=64, causal=True)
    x, w = make_inputs(c)
    out = np.empty_like(x)
    before = vm_hwm_kb()
    if args.rss_impl == "torch_sdpa" or args.rss_impl == "torch_mha":
        import torch
        torch.set_num_threads(1)
        p = TorchPeers(torch, x, w, c)
        before = vm_hwm_kb()
        (p.run_sdpa if args.rss_impl == "torch_sdpa" else p.run_mha)()
    else:
        mha = Mha(args.lib)
        layer = MhaLayer(mha, w, 1024, 16, 16, 64)
        before = vm_hwm_kb()
        layer.forward(x, out, True, MHA_IMPL_AUTO, 1)
        layer.close()
    peak = vm_hwm_kb()
    io_mb = (x.nbytes + out.nbytes + sum(a.nbytes for a in w.values())) / 2**20
    print(json.dumps(dict(bench="rss", impl=args.rss_impl, n=n, d_model=1024, h=16,
                          peak_rss_mb=peak / 1024, rss_before_forward_mb=before / 1024,
                          inputs_outputs_weights_mb=io_mb,
                          ru_maxrss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def find_file(cands):
    for p in cands:
        if p and os.path.exists(p):
            return p
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=None, help="libmha.so (default: env MHA_LIBRARY or build*/)")
    ap.add_argument("--peak", default=None, help="mha_peak program (default: build*/bench/)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="", help="comma-separated case names (prefix match)")
    ap.add_argument("--quick", action="store_true", help="one small case, for a smoke test")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ref-max-s", type=float, default=4.0,
                    help="skip impl=REFERENCE when its estimated time exceeds this")
    ap.add_argument("--rss", default="2048,8192", help="n values for the peak-RSS runs ('' = none)")
    ap.add_argument("--rss-torch", action="store_true", help="also measure torch's RSS")
    ap.add_argument("--out", default=None, help="JSONL file (default bench/results/layer-<date>)")
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16"),
                    help="bf16: mha's bf16 layer and core beside torch's bf16 peers (docstring)")
    ap.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rss-impl", default="mha", help=argparse.SUPPRESS)
    args = ap.parse_args()

    builds = [os.path.join(ROOT, d) for d in sorted(os.listdir(ROOT)) if d.startswith("build")]
    args.lib = args.lib or find_file([os.environ.get("MHA_LIBRARY")] +
                                     [os.path.join(b, "libmha.so") for b in builds])
    if args.rss_child:
        return rss_child(args)
    args.peak = args.peak or find_file([os.path.join(b, "bench", "mha_peak") for b in builds])
    if not args.lib or not args.peak:
        sys.exit("need --lib libmha.so and --peak mha_peak (build with -DMHA_BUILD_BENCH=ON)")
    threads = [int(t) for t in args.threads.split(",") if t]
    reps = max(5, args.reps)

    torch = None
    if not args.no_torch:
        try:
            import torch as _torch
            torch = _torch
        except ImportError:
            print("# torch not importable: torch rows skipped")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
        print("# threadpoolctl not importable: numpy's BLAS runs with its default thread count")

    mha = Mha(args.lib)
    info = machine_info()
    info.update(lib=args.lib, mha_version=mha.version, torch=torch.__version__ if torch else None,
                threads=threads, reps=reps, dtype=args.dtype)
    peak_json, peak = measure_peak(args.peak, threads)
    host = "%s (%s)" % (info.get("cpu"), platform.node())
    tier = os.environ.get("MHA_MAX_ISA") or peak[threads[0]][0]
    info.update(host=host, tier=tier)
    bf16 = args.dtype == "bf16"
    info["peak_start"] = peak_json["peak"]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", "layer-%s%s.jsonl" % (
        "bf16-" if bf16 else "", stamp))
    fout = open(out_path, "w")
    fout.write(json.dumps(dict(bench="env", **info)) + "\n")

    print("# mha %s  (%s)" % (mha.version, args.lib))
    print("# CPU: %s, %s CPUs; %s; numpy %s; torch %s" % (info.get("cpu"), info.get("cpus"),
                                                          info.get("gcc"), np.__version__,
                                                          info["torch"]))
    for t in threads:
        print("# measured fp32 FMA peak, %d thread(s): %.1f GFLOP/s (%s)" % (t, peak[t][1],
                                                                              peak[t][0]))
    print("# FLOPs: attention 2*B*h*pairs*(dk+dv) (causal: exact unmasked pairs), projections "
          "2*rows*in*out; median/min/max of %d round-robin runs after 1 warm-up; rel_err = "
          "max|y - y_torch_sdpa| / max|y_torch_sdpa|" % reps)

    cases = quick_cases() if args.quick else all_cases()
    if args.cases:
        sel = args.cases.split(",")
        cases = [c for c in cases if any(c["name"].startswith(s) for s in sel)]

    rows = []
    for c in cases:
        proj_f, attn_f = flops(c)
        x, w = make_inputs(c)
        B, n, dm, h, g, dk = c["B"], c["n"], c["d_model"], c["h"], c["g"], c["dk"]
        if bf16:  # every row gets the same bf16-rounded values (float32 rows: widened)
            xb, wb = to_bf16(x), {k: to_bf16(v) for k, v in w.items()}
            x, w = from_bf16(xb), {k: from_bf16(v) for k, v in wb.items()}
            layer_bf = MhaLayer(mha, wb, dm, h, g, dk, MHA_DTYPE_BF16)
        layer = MhaLayer(mha, w, dm, h, g, dk)
        # Projected inputs for the core-only row (same as the layer computes; no RoPE).
        X = x.reshape(B * n, dm)
        q = np.ascontiguousarray((X @ w["wq"].T + w["bq"]).reshape(B, n, h, dk))
        k = np.ascontiguousarray((X @ w["wk"].T + w["bk"]).reshape(B, n, g, dk))
        v = np.ascontiguousarray((X @ w["wv"].T + w["bv"]).reshape(B, n, g, dk))
        core_out = np.empty((B, n, h, dk), np.float32)
        if bf16:
            qb, kb, vb = to_bf16(q), to_bf16(k), to_bf16(v)
            core_out_b = np.empty((B, n, h, dk), np.uint16)
        peers = TorchPeers(torch, x, w, c) if torch else None
        print("\n## %s: B=%d n=%d d_model=%d h=%d g=%d d_k=%d causal=%s | GFLOP: layer %.2f "
              "(proj %.2f + attn %.2f)" % (c["name"], B, n, dm, h, g, dk, c["causal"],
                                           (proj_f + attn_f) / 1e9, proj_f / 1e9, attn_f / 1e9))
        print("%-20s %3s %10s %10s %10s %9s %7s %8s %s" % ("impl", "thr", "median_ms", "min_ms",
                                                           "max_ms", "GFLOP/s", "%peak",
                                                           "rel_err", "note"))
        # Reference output for the error column: torch SDPA if present, else the BLAS layer.
        ref_y = (peers.run_sdpa().numpy() if peers else blas_layer(x, w, c)).astype(np.float32)
        for T in threads:
            if torch:
                torch.set_num_threads(T)
            # The peak right before this case's timings, for its widest ISA and this thread
            # count (the start-of-run figure if this quick one comes out lower).
            _, pk = measure_peak(args.peak, [T], ms=60, reps=3, isa=peak[T][0])
            case_peak = max(pk[T][1], peak[T][1])
            y, yr, core_out = np.empty_like(x), np.empty_like(x), core_out
            impls = []  # (name, fn, flops, output-or-None, note)
            if bf16:
                yb = np.empty(x.shape, np.uint16)
                impls.append(("mha_layer_bf16", lambda: layer_bf.forward(xb, yb, c["causal"],
                                                                        MHA_IMPL_AUTO, T),
                              proj_f + attn_f, lambda: from_bf16(yb),
                              "bf16 weights/x/out, impl=auto, workspace reused"))
                impls.append(("mha_core_bf16", lambda: mha_core(mha, qb, kb, vb, core_out_b,
                                                                c["causal"], MHA_IMPL_AUTO, T,
                                                                MHA_DTYPE_BF16),
                              attn_f, None, "attention core only, bf16 q/k/v/out, impl=auto"))
            impls.append(("mha_layer", lambda: layer.forward(x, y, c["causal"], MHA_IMPL_AUTO, T),
                          proj_f + attn_f, lambda: y, "impl=auto, workspace reused"))
            if not bf16:
                impls.append(("mha_layer_alloc", lambda: layer.forward(x, y, c["causal"],
                                                                       MHA_IMPL_AUTO, T, False),
                              proj_f + attn_f, lambda: y,
                              "impl=auto, workspace allocated per call"))
            impls.append(("mha_core", lambda: mha_core(mha, q, k, v, core_out, c["causal"],
                                                       MHA_IMPL_AUTO, T),
                          attn_f, None, "attention core only (no projections), impl=auto"))
            # impl=REFERENCE only where one run takes a few seconds at most, estimated from the
            # flop count at the reference loops' ~2 GFLOP/s per thread.
            est_s = (proj_f + attn_f) / 2e9 / T
            if bf16:
                pass
            elif est_s <= args.ref_max_s:
                impls.append(("mha_layer_ref", lambda: layer.forward(x, yr, c["causal"],
                                                                     MHA_IMPL_REFERENCE, T),
                              proj_f + attn_f, lambda: yr, "impl=reference"))
            else:
                print("%-14s %3d skipped: estimated %.0f s per run at ~2 GFLOP/s" % (
                    "mha_layer_ref", T, est_s))
            blas_out = {}

            def run_blas():
                if threadpool_limits:
                    with threadpool_limits(limits=T, user_api="blas"):
                        blas_out["y"] = blas_layer(x, w, c)
                else:
                    blas_out["y"] = blas_layer(x, w, c)
            if not bf16:
                impls.append(("blas_layer", run_blas, proj_f + attn_f, lambda: blas_out["y"],
                              "numpy %s OpenBLAS sgemm + numpy softmax" % np.__version__))
            if peers:
                if peers.mha is not None:
                    impls.append(("torch_mha", peers.run_mha, proj_f + attn_f,
                                  lambda: peers.run_mha().numpy(),
                                  "nn.MultiheadAttention need_weights=False"))
                else:
                    print("%-14s %3d skipped: nn.MultiheadAttention has no GQA" % ("torch_mha",
                                                                                   T))
                impls.append(("torch_sdpa", peers.run_sdpa, proj_f + attn_f,
                              lambda: peers.run_sdpa().numpy(),
                              "F.linear + F.scaled_dot_product_attention"))
                peers.prepare_core()
                impls.append(("torch_sdpa_core", peers.run_sdpa_core, attn_f, None,
                              "F.scaled_dot_product_attention alone (peer of mha_core)"))
                if bf16:
                    peers.prepare_bf16()
                    impls.append(("torch_sdpa_bf16", peers.run_sdpa_bf16, proj_f + attn_f,
                                  lambda: peers.run_sdpa_bf16().float().numpy(),
                                  "F.linear + F.scaled_dot_product_attention, bf16 tensors"))
                    impls.append(("torch_sdpa_core_bf16", peers.run_sdpa_core_bf16, attn_f, None,
                                  "F.scaled_dot_product_attention alone, bf16 (peer of "
                                  "mha_core_bf16)"))
                    if peers.mha is not None:
                        impls.append(("torch_mha_autocast", peers.run_mha_autocast,
                                      proj_f + attn_f,
                                      lambda: peers.run_mha_autocast().float().numpy(),
                                      "nn.MultiheadAttention (f32 params) under "
                                      "autocast('cpu', bf16)"))
            sts = time_round_robin([im[1] for im in impls], reps)
            results = {}
            for (name, _, fl, outf, note), st in zip(impls, sts):
                gf = fl / (st["median_ms"] * 1e-3) / 1e9
                err = None
                if outf is not None:
                    out = np.asarray(outf(), np.float32)
                    err = float(np.max(np.abs(out - ref_y)) / np.max(np.abs(ref_y)))
                r = dict(bench="layer", host=host, tier=tier, dtype=args.dtype,
                         case=c["name"], impl=name, threads=T, B=B, n=n,
                         d_model=dm, h=h, g=g, dk=dk, causal=c["causal"], flops=fl, gflops=gf,
                         peak_gflops=case_peak, pct_peak=100 * gf / case_peak,
                         rel_err_vs_ref=err, note=note, **st)
                results[name] = r
                rows.append(r)
                fout.write(json.dumps(r) + "\n")
                fout.flush()
                print("%-20s %3d %10.2f %10.2f %10.2f %9.1f %6.1f%% %8s %s" % (
                    name, T, st["median_ms"], st["min_ms"], st["max_ms"], gf, r["pct_peak"],
                    "%.1e" % err if err is not None else "-", note), flush=True)
            lead = "mha_layer_bf16" if bf16 else "mha_layer"
            base = results[lead]["median_ms"]
            cores = ("mha_core", "torch_sdpa_core", "mha_core_bf16", "torch_sdpa_core_bf16")
            ratios = ["%s %.2fx" % (k, r["median_ms"] / base) for k, r in results.items()
                      if k != lead and k not in cores]
            line = "   (peak used: %.1f GFLOP/s) %s speed-up over: %s" % (
                case_peak, lead, ", ".join(ratios))
            for core, peer in (("mha_core", "torch_sdpa_core"),
                               ("mha_core_bf16", "torch_sdpa_core_bf16"),
                               ("mha_core_bf16", "mha_core")):
                if core in results and peer in results:
                    line += "; %s over %s %.2fx" % (core, peer, results[peer]["median_ms"] /
                                                    results[core]["median_ms"])
            print(line, flush=True)
        layer.close()
        if bf16:
            layer_bf.close()
        del peers

    # Peak again at the end: the machine is shared, so print how much it moved.
    peak_json2, peak2 = measure_peak(args.peak, threads)
    fout.write(json.dumps(dict(bench="peak_end", peak=peak_json2["peak"])) + "\n")
    for t in threads:
        print("# FMA peak at the end, %d thread(s): %.1f GFLOP/s (start %.1f)" % (
            t, peak2[t][1], peak[t][1]))

    # Peak RSS, each in a fresh process.
    for n in [int(s) for s in args.rss.split(",") if s]:
        impls = ["mha"] + (["torch_sdpa", "torch_mha"] if args.rss_torch and torch else [])
        for impl in impls:
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--lib", args.lib,
                                  "--rss-child", str(n), "--rss-impl", impl],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                print("# RSS n=%d %s failed: %s" % (n, impl, res.stderr.strip()[-300:]))
                continue
            d = json.loads(res.stdout.strip().splitlines()[-1])
            fout.write(json.dumps(d) + "\n")
            print("# peak RSS %-10s n=%5d d_model=1024: %7.1f MB (%.1f MB before the forward; "
                  "inputs+output+weights %.1f MB)" % (impl, n, d["peak_rss_mb"],
                                                     d["rss_before_forward_mb"],
                                                     d["inputs_outputs_weights_mb"]))
    fout.close()
    print("# results: %s" % out_path)


if __name__ == "__main__":
    main()

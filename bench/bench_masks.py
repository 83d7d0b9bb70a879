#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_masks.py: every mask at full speed (issue 29). Not a test; never run by ctest.

Three groups (--only train,docs,padding), each timed round-robin in one process (every round
runs every row of its table once, so a busy neighbour slows all rows alike and the ratios
printed under each table stay meaningful), median/min/max of >= 5 timed runs after one warm-up:

train    one training step, y = layer(x, x, x, attn_mask, is_causal, need_weights=False)[0];
         y.backward(dy) with a fixed random dy (all parameter and input gradients), of
         mha.torch.MultiheadAttention(1024, 16, batch_first=True) at n = 2048, B = 1 and
         torch.nn.MultiheadAttention with the same weights:
           mha_is_causal     is_causal=True, no tensor (mha.torch: top-left causal from the flag)
           mha_bool_causal   attn_mask = triu(ones(n, n), 1).bool() (True = masked)
           mha_float_causal  attn_mask = nn.Transformer.generate_square_subsequent_mask(n)
                             (both recognised as the causal rule: python/mha/_mask_rule.py)
           mha_bool_blockmask, mha_float_blockmask: the same with recognition off (the tensor
                             goes to C; the block mask alone skips its hidden tiles)
           mha_none          no mask
           torch_bool_causal, torch_float_causal, torch_none: the same tensors in torch
           torch_causal_hint the bool tensor + is_causal=True (torch then drops the tensor and
                             runs SDPA's is_causal: its fastest causal path; reference only)
docs     forward of the attention core, 8 packed documents in n = 2048 tokens, h = 16, d = 64,
         B = 1, float32; unequal lengths (drawn once, fixed seed) and equal 256-token documents,
         each non-causal and causal within documents:
           mha_sdpa_mask     mha.torch.scaled_dot_product_attention, bool [n, n] (True = attend)
           mha_attn_mask     mha.attention (NumPy API), the same bool mask
           mha_attn_segids   mha.attention with q_segment_ids = kv_segment_ids (+ causal)
           torch_sdpa_mask   F.scaled_dot_product_attention, the same bool mask
           mha_full_nomask   reference: mha.attention with no mask at all (all n^2 pairs: what
                             the dense-mask rows cost against doing no masking; not checked)
padding  forward of the core on a key-padding batch, B = 8, lengths 256, 512, ..., 2048
         (shuffled, fixed seed) padded to n = 2048, h = 16, d = 64:
           (i)  key padding only (nn.MultiheadAttention semantics: padded query rows attend to
                the valid keys): mha_keypad (mha.attention key_padding_mask [B, m]),
                mha_kp_mask4d and torch_kp_mask4d (bool [B, 1, 1, m] through
                mha.torch.scaled_dot_product_attention / F.scaled_dot_product_attention)
           (ii) both sides (valid_i & valid_j, padded query rows fully masked): mha_both_mask4d
                and torch_both_mask4d (bool [B, 1, n, m]), mha_both_segids (segment ids
                0 for tokens, -1 / -2 for padded queries / keys)
           the reference cost: mha_unpadded_sum / torch_unpadded_sum, the sum over b of the
                same forward on the unpadded sequence of length L_b (B = 1 each)

FLOPs (docs/BENCHMARKS.md): attention 2*B*h*P*(d_k + d_v), P = the visible (query, key) pairs
counted exactly from the mask; the training step 3.5 x attention forward + 3 x projection
forward (bench_backward.py's convention: backward = 2.5 x attention forward, 2 x projections).
% of peak divides by the fp32 FMA peak measured in the same run by build/bench/mha_peak.

Correctness: each mha row is compared with torch on the same inputs (the training step: y,
x.grad and in_proj_weight.grad): max|a - b| and that over max|b|; above 1e-4 relative the row
is marked FAIL and the program exits with status 1 after the run.

Usage: python3 bench/bench_masks.py [--lib build/libmha.so] [--peak build/bench/mha_peak]
         [--threads 1,2] [--reps 5] [--only train,docs,padding] [--quick] [--json out.jsonl]
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_layer import find_file, machine_info, measure_peak, time_round_robin  # noqa: E402

TOL = 1e-4  # relative to max|reference|


# ------------------------------------------------------------------------------------------------
# Setup: library, package, torch
# ------------------------------------------------------------------------------------------------
def load_package(lib):
    """Imports mha (python/ of this tree unless already importable) with MHA_LIBRARY=lib."""
    os.environ["MHA_LIBRARY"] = os.path.abspath(lib)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import mha
    import mha.torch  # noqa: F401
    return mha


def blas_limits(T):
    """threadpoolctl's BLAS limit to T threads (as bench_layer.py), or a no-op without it."""
    try:
        from threadpoolctl import threadpool_limits
        return threadpool_limits(limits=T, user_api="blas")
    except ImportError:
        import contextlib
        return contextlib.nullcontext()


def cpu_line():
    """'model name' plus family/model/stepping (the model name alone may say only 'AMD EPYC')."""
    got = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("model name", "cpu family", "model", "stepping") and k not in got:
                got[k] = v.strip()
    return "%s (family %s model %s stepping %s)" % (got.get("model name"), got.get("cpu family"),
                                                    got.get("model"), got.get("stepping"))


def mha_info(lib):
    """The kernel lines of `mha info` (the CLI next to the library), or None."""
    cli = os.path.join(os.path.dirname(os.path.abspath(lib)), "mha")
    if not os.path.exists(cli):
        return None
    out = subprocess.run([cli, "info"], capture_output=True, text=True).stdout.splitlines()
    return [s.strip() for s in out
            if re.match(r"\s*\w+\s+\*", s) or s.startswith(("mha ", "cpu tiers"))]


# ------------------------------------------------------------------------------------------------
# Measuring and reporting one table
# ------------------------------------------------------------------------------------------------
class Ctx:
    """What every table needs: torch, the peak per thread count, the output file, failures."""

    def __init__(self, torch, peak_bin, peak_start, fout):
        self.torch, self.peak_bin, self.peak_start, self.fout = torch, peak_bin, peak_start, fout
        self.failures = []

    def peak(self, T):
        """The largest peak measured so far in this run for T threads, this table's own
        measurement included (a neighbour can only lower a measurement, so a low start-of-run
        figure must not stand for the whole run)."""
        if not self.peak_bin:
            return None
        isa, best = self.peak_start[T]
        _, pk = measure_peak(self.peak_bin, [T], ms=60, reps=3, isa=isa)
        self.peak_start[T] = (isa, max(pk[T][1], best))
        return self.peak_start[T][1]


def rel_err(got, ref, rows=None):
    """(max|got - ref|, that / max|ref|) over all elements, or over `rows` of axis -2."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if rows is not None:
        got, ref = got[..., rows, :], ref[..., rows, :]
    d = float(np.max(np.abs(got - ref)))
    return d, d / max(float(np.max(np.abs(ref))), 1e-30)


def run_table(ctx, group, case, T, rows, reps, meta):
    """rows: dicts name, fn, flops, note, check (None or a function returning a list of
    (what, max_abs, rel)). Times them round-robin, prints the table, writes JSON rows; returns
    {name: median_ms}."""
    peak = ctx.peak(T)
    sts = time_round_robin([r["fn"] for r in rows], reps)
    print("%-19s %3s %10s %10s %10s %8s %6s %9s %8s  %s" % (
        "impl", "thr", "median_ms", "min_ms", "max_ms", "GFLOP/s", "%peak", "max_abs", "rel",
        "note"))
    med = {}
    for r, st in zip(rows, sts):
        gf = r["flops"] / (st["median_ms"] * 1e-3) / 1e9
        pct = 100 * gf / peak if peak else None
        checks = r["check"]() if r.get("check") else []
        worst = max(checks, key=lambda c: c[2]) if checks else None
        bad = [c for c in checks if not c[2] <= TOL]
        if bad:
            ctx.failures.append("%s/%s/%s T=%d: %s" % (group, case, r["name"], T, bad))
        print("%-19s %3d %10.1f %10.1f %10.1f %8.1f %6s %9s %8s  %s%s" % (
            r["name"], T, st["median_ms"], st["min_ms"], st["max_ms"], gf,
            "%.1f%%" % pct if pct is not None else "-",
            "%.1e" % worst[1] if worst else "-", "%.1e" % worst[2] if worst else "-",
            r["note"], "  FAIL %s" % bad if bad else ""), flush=True)
        rec = dict(bench="masks", group=group, case=case, impl=r["name"], threads=T,
                   flops=r["flops"], gflops=gf, peak_gflops=peak, pct_peak=pct,
                   checks=[dict(what=c[0], max_abs=c[1], rel=c[2]) for c in checks],
                   note=r["note"], **meta, **st)
        ctx.fout.write(json.dumps(rec) + "\n")
        ctx.fout.flush()
        med[r["name"]] = st["median_ms"]
    print("   (peak used: %s GFLOP/s)" % ("%.1f" % peak if peak else "-"))
    return med


def print_ratios(ctx, group, case, T, med, pairs):
    """pairs: (label, numerator row, denominator row): time ratios num / den."""
    got = [(lab, med[a] / med[b]) for lab, a, b in pairs if a in med and b in med]
    print("   ratios: " + ", ".join("%s %.2fx" % (lab, v) for lab, v in got), flush=True)
    ctx.fout.write(json.dumps(dict(bench="masks_ratios", group=group, case=case, threads=T,
                                   ratios=dict(got))) + "\n")
    ctx.fout.flush()


# ------------------------------------------------------------------------------------------------
# train: one training step of the layer
# ------------------------------------------------------------------------------------------------
def train_flops(n, E):
    """3.5 x causal attention forward + 3 x projection forward (bench_backward.py)."""
    h_dk = E
    attn_fwd_causal = 2 * (n * (n + 1) // 2) * 2 * h_dk
    proj = 4 * 2 * n * E * E
    return attn_fwd_causal, proj


def train_layers(mha, torch, E, h, seed=29):
    """torch.nn.MultiheadAttention and mha.torch.MultiheadAttention with the same random
    weights and biases, in train() mode (dropout 0)."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, h, batch_first=True)
    with torch.no_grad():
        ref.in_proj_bias.normal_(0, 0.1)
        ref.out_proj.bias.normal_(0, 0.1)
    ours = mha.torch.MultiheadAttention(E, h, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    return ours.train(), ref.train()


def train_step_fn(torch, layer, x, dy, attn_mask, is_causal, keep):
    """One step: grads cleared, forward, y.backward(dy); keeps y and two gradients for the check."""
    params = list(layer.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        y = layer(x, x, x, attn_mask=attn_mask, is_causal=is_causal, need_weights=False)[0]
        y.backward(dy)
        keep.update(y=y.detach(), dx=x.grad, dw=layer.in_proj_weight.grad)
    return step


def without_rules(step):
    """step() with mha's mask recognition off: the tensor goes to C, where the block mask alone
    skips its hidden tiles (the rows *_blockmask)."""
    from mha import _mask_rule

    def run():
        _mask_rule.enabled = False
        try:
            step()
        finally:
            _mask_rule.enabled = True
    return run


def bench_train(ctx, mha, args, threads):
    """Group train: the layer's training step with each causal mask form and without a mask."""
    torch = ctx.torch
    n, E, h = (256, 256, 4) if args.quick else (2048, 1024, 16)
    attn_c, proj = train_flops(n, E)
    fl_causal = 3.5 * attn_c + 3 * proj
    fl_full = 3.5 * (2 * n * n * 2 * E) + 3 * proj
    ours, ref = train_layers(mha, torch, E, h)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, E, generator=g).requires_grad_(True)
    dy = torch.randn(1, n, E, generator=g)
    bool_mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    float_mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
    print("\n## train: training step (forward + backward with a fixed dy) of "
          "MultiheadAttention(%d, %d, batch_first=True), n=%d, B=1 | GFLOP: causal %.1f, "
          "no mask %.1f" % (E, h, n, fl_causal / 1e9, fl_full / 1e9))
    for T in threads:
        torch.set_num_threads(T)
        ours.threads = T
        k = {name: {} for name in ("mha_is_causal", "mha_bool_causal", "mha_float_causal",
                                   "mha_bool_blockmask", "mha_float_blockmask",
                                   "mha_none", "torch_bool_causal", "torch_float_causal",
                                   "torch_none", "torch_causal_hint")}
        spec = [  # name, layer, mask, is_causal, flops, note, torch row to check against
            ("mha_is_causal", ours, None, True, fl_causal, "is_causal=True, no tensor",
             "torch_bool_causal"),
            ("mha_bool_causal", ours, bool_mask, False, fl_causal, "bool [n, n] True = masked",
             "torch_bool_causal"),
            ("mha_float_causal", ours, float_mask, False, fl_causal,
             "float [n, n] generate_square_subsequent_mask", "torch_float_causal"),
            ("mha_bool_blockmask", ours, bool_mask, False, fl_causal,
             "bool [n, n], recognition off: the block mask alone", "torch_bool_causal"),
            ("mha_float_blockmask", ours, float_mask, False, fl_causal,
             "float [n, n], recognition off: the block mask alone", "torch_float_causal"),
            ("mha_none", ours, None, False, fl_full, "no mask", "torch_none"),
            ("torch_bool_causal", ref, bool_mask, False, fl_causal, "nn.MHA, bool [n, n]", None),
            ("torch_float_causal", ref, float_mask, False, fl_causal, "nn.MHA, float [n, n]",
             None),
            ("torch_none", ref, None, False, fl_full, "nn.MHA, no mask", None),
            ("torch_causal_hint", ref, bool_mask, True, fl_causal,
             "nn.MHA, bool [n, n] + is_causal=True (tensor not read)", None),
        ]
        rows = []
        for name, layer, mask, causal, fl, note, against in spec:
            fn = train_step_fn(torch, layer, x, dy, mask, causal, k[name])
            rows.append(dict(name=name, fn=without_rules(fn) if "blockmask" in name else fn,
                             flops=fl, note=note, check=train_check(k[name], k.get(against))
                             if against else None))
        print("\n### train n=%d threads=%d" % (n, T))
        with blas_limits(T):
            med = run_table(ctx, "train", "n%d_E%d_h%d" % (n, E, h), T, rows, args.reps,
                            dict(n=n, E=E, h=h, B=1))
        print_ratios(ctx, "train", "n%d" % n, T, med, [
            ("bool/is_causal", "mha_bool_causal", "mha_is_causal"),
            ("float/is_causal", "mha_float_causal", "mha_is_causal"),
            ("bool_blockmask/is_causal", "mha_bool_blockmask", "mha_is_causal"),
            ("float_blockmask/is_causal", "mha_float_blockmask", "mha_is_causal"),
            ("none/is_causal", "mha_none", "mha_is_causal"),
            ("torch_bool/mha_bool", "torch_bool_causal", "mha_bool_causal"),
            ("torch_float/mha_float", "torch_float_causal", "mha_float_causal"),
            ("torch_none/mha_none", "torch_none", "mha_none"),
            ("torch_hint/mha_is_causal", "torch_causal_hint", "mha_is_causal")])


def train_check(got, ref):
    def check():
        return [(w,) + rel_err(got[w].numpy(), ref[w].numpy()) for w in ("y", "dx", "dw")]
    return check


# ------------------------------------------------------------------------------------------------
# docs: packed documents
# ------------------------------------------------------------------------------------------------
def doc_lengths(n, ndocs, equal, seed=29):
    """ndocs lengths summing to n: equal, or drawn once (fixed seed) with at least n/32 each."""
    if equal:
        return [n // ndocs] * ndocs
    lo = n // 32
    rng = np.random.default_rng(seed)
    extra = rng.multinomial(n - ndocs * lo, rng.dirichlet(np.ones(ndocs)))
    return [int(lo + e) for e in extra]


def doc_masks(lengths, causal):
    """(segment ids [n] int32, bool attend mask [n, n]) of packed documents."""
    seg = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    attend = seg[:, None] == seg[None, :]
    if causal:
        attend &= np.tril(np.ones_like(attend))
    return seg, attend


def core_qkv(torch, B, h, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, d, generator=g) for _ in range(3)]


def bench_docs(ctx, mha, args, threads):
    """Group docs: the core forward with a packed-documents mask (bool tensor and segment ids)."""
    torch = ctx.torch
    F = torch.nn.functional
    n, h, d, ndocs = (512, 4, 64, 8) if args.quick else (2048, 16, 64, 8)
    q, k, v = core_qkv(torch, 1, h, n, d, seed=2)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    for equal in (False, True):
        lengths = doc_lengths(n, ndocs, equal)
        for causal in (False, True):
            seg, attend_np = doc_masks(lengths, causal)
            attend = torch.from_numpy(attend_np)
            segb = seg[None]
            P = int(attend_np.sum())
            fl = 2 * h * P * (d + d)
            case = "docs%d_%s%s" % (ndocs, "equal" if equal else "unequal",
                                    "_causal" if causal else "")
            print("\n## docs %s: n=%d h=%d d=%d, lengths %s | visible pairs %d (%.1f%% of n^2), "
                  "GFLOP %.2f" % (case, n, h, d, lengths, P, 100.0 * P / n / n, fl / 1e9))
            for T in threads:
                torch.set_num_threads(T)
                out = {}

                def keep(name, f):
                    def run():
                        with torch.no_grad():
                            out[name] = f()
                    return run
                rows = [
                    dict(name="mha_sdpa_mask", fn=keep("mha_sdpa_mask", lambda: mha.torch.
                         scaled_dot_product_attention(q, k, v, attn_mask=attend, threads=T)),
                         note="mha.torch.scaled_dot_product_attention, bool [n, n]"),
                    dict(name="mha_attn_mask", fn=keep("mha_attn_mask", lambda: mha.attention(
                        qn, kn, vn, mask=attend_np, threads=T)),
                        note="mha.attention mask= bool [n, n]"),
                    dict(name="mha_attn_segids", fn=keep("mha_attn_segids", lambda: mha.attention(
                        qn, kn, vn, q_segment_ids=segb, kv_segment_ids=segb, causal=causal,
                        threads=T)), note="mha.attention q/kv_segment_ids%s" % (
                            " + causal" if causal else "")),
                    dict(name="torch_sdpa_mask", fn=keep("torch_sdpa_mask", lambda: F.
                         scaled_dot_product_attention(q, k, v, attn_mask=attend)),
                         note="F.scaled_dot_product_attention, bool [n, n]"),
                    dict(name="mha_full_nomask", fn=keep("mha_full_nomask", lambda: mha.attention(
                        qn, kn, vn, threads=T)), flops=4 * h * n * n * d,
                        note="reference: mha.attention without a mask (all n^2 pairs; "
                             "another result, not checked)"),
                ]
                for r in rows:
                    r.setdefault("flops", fl)
                    if r["name"].startswith("mha") and r["name"] != "mha_full_nomask":
                        r["check"] = core_check(out, r["name"], "torch_sdpa_mask")
                print("\n### docs %s threads=%d" % (case, T))
                with blas_limits(T):
                    med = run_table(ctx, "docs", case, T, rows, args.reps,
                                    dict(n=n, h=h, d=d, B=1, lengths=lengths, causal=causal,
                                         pairs=P))
                print_ratios(ctx, "docs", case, T, med, [
                    ("torch/mha_sdpa_mask", "torch_sdpa_mask", "mha_sdpa_mask"),
                    ("torch/mha_attn_mask", "torch_sdpa_mask", "mha_attn_mask"),
                    ("torch/mha_segids", "torch_sdpa_mask", "mha_attn_segids"),
                    ("mha_attn_mask/mha_segids", "mha_attn_mask", "mha_attn_segids"),
                    ("mha_attn_mask/mha_full_nomask", "mha_attn_mask", "mha_full_nomask")])


def core_check(out, name, ref_name, rows=None):
    def check():
        return [("out",) + rel_err(np.asarray(out[name]), np.asarray(out[ref_name]), rows)]
    return check


# ------------------------------------------------------------------------------------------------
# padding: key-padding batches
# ------------------------------------------------------------------------------------------------
def pad_lengths(B, n, seed=29):
    """n/B, 2n/B, ..., n, shuffled with a fixed seed."""
    lens = [(i + 1) * n // B for i in range(B)]
    np.random.default_rng(seed).shuffle(lens)
    return [int(x) for x in lens]


def unpadded_fn(out, name, f, qs, ks, vs):
    """Runs f(q_b, k_b, v_b) for every sequence; keeps the outputs (for the check)."""
    def run():
        out[name] = [f(qb, kb, vb) for qb, kb, vb in zip(qs, ks, vs)]
    return run


def bench_padding(ctx, mha, args, threads):
    """Group padding: a padded batch (key padding only; both sides) against its unpadded cost."""
    torch = ctx.torch
    F = torch.nn.functional
    B, n, h, d = (4, 256, 4, 64) if args.quick else (8, 2048, 16, 64)
    lens = pad_lengths(B, n)
    q, k, v = core_qkv(torch, B, h, n, d, seed=3)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    valid_np = np.arange(n)[None, :] < np.array(lens)[:, None]          # [B, n]
    kp4 = torch.from_numpy(valid_np[:, None, None, :].copy())            # [B, 1, 1, m]
    both4 = torch.from_numpy((valid_np[:, :, None] & valid_np[:, None, :])[:, None].copy())
    qseg = np.where(valid_np, 0, -1).astype(np.int32)
    kseg = np.where(valid_np, 0, -2).astype(np.int32)
    # Unpadded sequences, contiguous, B = 1 each (prepared once, outside the timing).
    qs, ks, vs = ([t[b:b + 1, :, :L].contiguous() for b, L in enumerate(lens)] for t in (q, k, v))
    sum_sq = sum(L * L for L in lens)
    fl_kp = 2 * h * n * sum(lens) * 2 * d     # every query row sees its L_b keys
    fl_both = 2 * h * sum_sq * 2 * d         # = the unpadded sum
    case = "b%d_n%d" % (B, n)
    print("\n## padding %s: B=%d lengths %s padded to n=%d, h=%d d=%d | GFLOP: key padding %.1f, "
          "both sides = unpadded sum %.1f, dense %.1f" % (case, B, lens, n, h, d, fl_kp / 1e9,
                                                        fl_both / 1e9, 4 * B * h * n * n * d / 1e9))
    valid_rows = [np.flatnonzero(valid_np[b]) for b in range(B)]
    for T in threads:
        torch.set_num_threads(T)
        out = {}

        def keep(name, f):
            def run():
                with torch.no_grad():
                    out[name] = f()
            return run

        def mha_sdpa(mask):
            return lambda: mha.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                  threads=T)

        def torch_sdpa(mask):
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        rows = [
            dict(name="mha_unpadded_sum", flops=fl_both, note="mha.attention per sequence, B=1",
                 fn=unpadded_fn(out, "mha_unpadded_sum", lambda a, b, c: mha.attention(
                     a.numpy(), b.numpy(), c.numpy(), threads=T), qs, ks, vs)),
            dict(name="torch_unpadded_sum", flops=fl_both, note="F.sdpa per sequence, B=1",
                 fn=unpadded_fn(out, "torch_unpadded_sum", lambda a, b, c: F.
                                scaled_dot_product_attention(a, b, c), qs, ks, vs)),
            dict(name="mha_keypad", flops=fl_kp, note="(i) mha.attention key_padding_mask [B, m]",
                 fn=keep("mha_keypad", lambda: mha.attention(qn, kn, vn,
                                                             key_padding_mask=valid_np,
                                                             threads=T))),
            dict(name="mha_kp_mask4d", flops=fl_kp, note="(i) mha.torch sdpa bool [B, 1, 1, m]",
                 fn=keep("mha_kp_mask4d", mha_sdpa(kp4))),
            dict(name="torch_kp_mask4d", flops=fl_kp, note="(i) F.sdpa bool [B, 1, 1, m]",
                 fn=keep("torch_kp_mask4d", torch_sdpa(kp4))),
            dict(name="mha_both_mask4d", flops=fl_both, note="(ii) mha.torch sdpa bool [B,1,n,m]",
                 fn=keep("mha_both_mask4d", mha_sdpa(both4))),
            dict(name="mha_both_segids", flops=fl_both,
                 note="(ii) mha.attention segment ids (pad q -1, pad k -2)",
                 fn=keep("mha_both_segids", lambda: mha.attention(
                     qn, kn, vn, q_segment_ids=qseg, kv_segment_ids=kseg, threads=T))),
            dict(name="torch_both_mask4d", flops=fl_both, note="(ii) F.sdpa bool [B, 1, n, m]",
                 fn=keep("torch_both_mask4d", torch_sdpa(both4))),
        ]
        for r in rows:
            r["check"] = padding_check(out, r["name"], valid_rows)
        print("\n### padding %s threads=%d" % (case, T))
        with blas_limits(T):
            med = run_table(ctx, "padding", case, T, rows, args.reps,
                            dict(n=n, h=h, d=d, B=B, lengths=lens))
        print_ratios(ctx, "padding", case, T, med, [
            ("mha_keypad/unpadded", "mha_keypad", "mha_unpadded_sum"),
            ("mha_kp_mask4d/unpadded", "mha_kp_mask4d", "mha_unpadded_sum"),
            ("mha_both_mask4d/unpadded", "mha_both_mask4d", "mha_unpadded_sum"),
            ("mha_both_segids/unpadded", "mha_both_segids", "mha_unpadded_sum"),
            ("torch_kp_mask4d/torch_unpadded", "torch_kp_mask4d", "torch_unpadded_sum"),
            ("torch_both_mask4d/torch_unpadded", "torch_both_mask4d", "torch_unpadded_sum"),
            ("torch_kp/mha_keypad", "torch_kp_mask4d", "mha_keypad"),
            ("torch_both/mha_both_mask4d", "torch_both_mask4d", "mha_both_mask4d"),
            ("torch_unpadded/mha_unpadded", "torch_unpadded_sum", "mha_unpadded_sum")])


def padding_check(out, name, valid_rows):
    """(i) rows: against torch_kp_mask4d on every query row; (ii) and the unpadded sums: against
    torch_both_mask4d on the valid query rows (torch's fully masked rows are not mha's 0)."""
    def check():
        if name.startswith("torch") and name != "torch_unpadded_sum":
            return []
        res = []
        if name in ("mha_keypad", "mha_kp_mask4d"):
            return [("out",) + rel_err(np.asarray(out[name]), np.asarray(out["torch_kp_mask4d"]))]
        ref = np.asarray(out["torch_both_mask4d"])
        for b, rows in enumerate(valid_rows):
            if name.endswith("unpadded_sum"):
                got = np.asarray(out[name][b][0])
            else:
                got = np.asarray(out[name][b])
            res.append(("out[%d]" % b,) + rel_err(got[:, :len(rows)] if name.endswith("sum")
                                                  else got[:, rows], ref[b][:, rows]))
        worst = max(res, key=lambda c: c[2])
        return [("out",) + worst[1:]]
    return check


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=None, help="libmha.so (default: env MHA_LIBRARY or build*/)")
    ap.add_argument("--peak", default=None, help="mha_peak program (default: build*/bench/)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per row (at least 5)")
    ap.add_argument("--only", default="train,docs,padding", help="groups to run")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--json", default=None,
                    help="JSONL file to append to (default bench/results/masks-<date>.jsonl)")
    args = ap.parse_args()
    builds = [os.path.join(ROOT, d) for d in sorted(os.listdir(ROOT)) if d.startswith("build")]
    args.lib = args.lib or find_file([os.environ.get("MHA_LIBRARY")] +
                                     [os.path.join(b, "libmha.so") for b in builds])
    if not args.lib:
        sys.exit("need --lib libmha.so")
    libdir = os.path.dirname(os.path.abspath(args.lib))
    args.peak = args.peak or find_file([os.path.join(libdir, "bench", "mha_peak")] +
                                       [os.path.join(b, "bench", "mha_peak") for b in builds])
    threads = [int(t) for t in args.threads.split(",") if t]
    args.reps = max(5, args.reps)
    groups = [g for g in args.only.split(",") if g]
    for g in groups:
        if g not in ("train", "docs", "padding"):
            sys.exit("--only: unknown group %r (train, docs, padding)" % g)

    mha = load_package(args.lib)
    import torch
    info = machine_info()
    info.update(cpu=cpu_line(), lib=os.path.abspath(args.lib), mha_version=mha.__version__,
                torch=torch.__version__, threads=threads, reps=args.reps, groups=groups,
                quick=args.quick, mha_info=mha_info(args.lib))
    peak = None
    if args.peak:
        peak_json, peak = measure_peak(args.peak, threads)
        info["peak_start"] = peak_json["peak"]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.json or os.path.join(HERE, "results", "masks-%s.jsonl" % stamp)
    fout = open(out_path, "a")
    fout.write(json.dumps(dict(bench="env", **info)) + "\n")

    print("# bench_masks.py (issue 29): mha %s (%s), git %s" % (mha.__version__, info["lib"],
                                                               info.get("git")))
    print("# CPU: %s, %s CPUs; torch %s; numpy %s" % (info["cpu"], info["cpus"], torch.__version__,
                                                     np.__version__))
    for line in info["mha_info"] or []:
        print("#   mha info: %s" % line)
    for t in threads:
        if peak:
            print("# measured fp32 FMA peak, %d thread(s): %.1f GFLOP/s (%s)" % (t, peak[t][1],
                                                                                  peak[t][0]))
    print("# median/min/max of %d round-robin runs after 1 warm-up; max_abs/rel: the worst "
          "check against torch (rel = over max|torch|, FAIL above %g)" % (args.reps, TOL))
    ctx = Ctx(torch, args.peak, dict(peak) if peak else None, fout)
    for g in groups:
        {"train": bench_train, "docs": bench_docs, "padding": bench_padding}[g](
            ctx, mha, args, threads)
    if args.peak:
        peak_json2, peak2 = measure_peak(args.peak, threads)
        fout.write(json.dumps(dict(bench="peak_end", peak=peak_json2["peak"])) + "\n")
        for t in threads:
            print("# FMA peak at the end, %d thread(s): %.1f GFLOP/s (start %.1f)" % (
                t, peak2[t][1], peak[t][1]))
    fout.close()
    print("# results: %s" % out_path)
    if ctx.failures:
        print("# FAILED checks (rel > %g):\n#   %s" % (TOL, "\n#   ".join(ctx.failures)))
        sys.exit(1)


if __name__ == "__main__":
    main()

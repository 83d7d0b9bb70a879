# SPDX-License-Identifier: MIT
"""`mha run --model DIR --layer L` and `mha info --model DIR` against Hugging Face transformers.

Tiny random models of every supported model_type are built with transformers at test time
(tests/hf_models.py: nothing from a hub), their attention module's float64 output is the oracle,
and mha's output must match it at the layer tolerance (TOL_OUT_REL of max|ref|). Sliding-window
layers (Mistral, Qwen2's upper layers, Gemma 2's and gpt-oss's alternation) are run with a
sequence longer than the window. Configs mha cannot honour must be refused naming the field,
and hostile directories (bad JSON, wrong types, shards outside the directory, shapes that do not
match the config) must fail with one line naming the file: exit 1, no crash (ASan runs this).

Run by ctest with MHA_CLI=<path to mha>; needs numpy, torch and transformers
(python/requirements-test.txt).
"""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from tolerances import TOL_OUT_REL

import hf_models as H

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")


def run_cli(*args):
    return subprocess.run([CLI, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=120)


# MHA_TEST_QUICK=1 (the sanitizer runs): the fused layouts, sinks + YaRN, a sliding layer, the
# sharded save and an encoder, plus every refusal and hostile case (the parsing under ASan).
QUICK = {"llama", "mistral", "gemma2", "gpt_oss", "phi3", "gpt2", "gpt_neox", "falcon_mq",
         "falcon_new", "bert", "gemma3_text"}
NAMES = [n for n in H.CASES if not os.environ.get("MHA_TEST_QUICK") or n in QUICK]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {name: H.build(name, root) for name in NAMES}


CASE_LAYERS = [(name, layer) for name in NAMES for layer in H.CASES[name][4]]


def run_layer(d, layer, x, tmp_path, *flags):
    xp, yp = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(xp, x)
    r = run_cli("run", "--model", d, "--layer", layer, "--input", xp, "--out", yp, *flags)
    assert r.returncode == 0, r.stderr
    return np.load(yp)


@pytest.mark.parametrize("name,layer", CASE_LAYERS)
def test_layer_matches_transformers(models, name, layer, tmp_path):
    d, refs = models[name]
    x, ref = refs[layer]
    y = run_layer(d, layer, x, tmp_path)
    assert y.shape == ref.shape
    err = H.max_rel_err(y, ref)
    assert err <= TOL_OUT_REL, f"{name} layer {layer}: max error {err:.3g} of max|ref|"


@pytest.mark.parametrize("name,layer", CASE_LAYERS)
def test_legacy_config_matches_transformers(models, name, layer, tmp_path):
    # transformers 4.x config.json (top-level rope_theta / rope_scaling, no layer_types).
    d, refs = models[name]
    x, ref = refs[layer]
    y = run_layer(H.legacy_config(d, str(tmp_path / "legacy")), layer, x, tmp_path)
    err = H.max_rel_err(y, ref)
    assert err <= TOL_OUT_REL, f"{name} layer {layer} (4.x config): max error {err:.3g}"


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "qwen3", "gemma3_text", "olmo2",
                                  "qwen3_next"])
def test_decode_matches_transformers(models, name, tmp_path):
    if name not in models:
        pytest.skip("not in the quick set")
    # KV-cache decoding of a sliding layer (ring-buffer cache; soft-cap / sinks + YaRN).
    d, refs = models[name]
    x, ref = refs[0]
    y = run_layer(d, 0, x, tmp_path, "--decode", "--prefill", 3)
    err = H.max_rel_err(y, ref)
    assert err <= TOL_OUT_REL, f"{name} --decode: max error {err:.3g} of max|ref|"


@pytest.mark.parametrize("name,layer", [(n, L) for n in ("smollm3", "cohere2", "llama4_text")
                                          for L in (0, 1)])
def test_nope_chunk_temperature_decode_matches_transformers(models, name, layer, tmp_path):
    # Token-by-token decode after a prefill of 3 (issue 31): NoPE layers, sliding ones, Llama 4's
    # chunks (the cache keeps the current chunk) and temperature tuning at the cache positions.
    if name not in models:
        pytest.skip("not in the quick set")
    d, refs = models[name]
    x, ref = refs[layer]
    y = run_layer(d, layer, x, tmp_path, "--decode", "--prefill", 3)
    err = H.max_rel_err(y, ref)
    assert err <= TOL_OUT_REL, f"{name} layer {layer} --decode: max error {err:.3g}"


def test_sharded_checkpoint_is_read_through_its_index(models):
    d, _ = models[H.SHARDED]
    files = os.listdir(d)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2


def test_output_that_is_a_file_of_the_model_is_refused(models, tmp_path):
    """Every .json and .safetensors file of --model DIR is an input: an --out naming a shard,
    the index or config.json is refused (exit 1, naming both) and the file is left as it was.
    Before, only config.json, model.safetensors and the index were checked: --out DIR/<a shard>
    replaced the shard with the output (exit 0), and the model no longer loaded."""
    src, refs = models[H.SHARDED]
    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    x = tmp_path / "x.npy"
    np.save(x, refs[sorted(refs)[0]][0])
    files = sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".json")))
    assert sum(f.endswith(".safetensors") for f in files) > 2
    for f in files:
        path = os.path.join(d, f)
        before = open(path, "rb").read()
        r = run_cli("run", "--model", d, "--input", x, "--out", path)
        assert r.returncode == 1, (f, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "is the same file as --model" in r.stderr
        assert open(path, "rb").read() == before, f
    r = run_cli("run", "--model", d, "--input", x, "--out", os.path.join(d, "y.npy"))
    assert r.returncode == 0, r.stderr  # another file in the directory is fine


def test_window_layers_differ_from_full(models, tmp_path):
    # The window really bites: the same sliding layer run without it gives another result.
    d, refs = models["mistral"]
    x, ref = refs[0]
    y = run_layer(d, 0, x, tmp_path, "--window=-1,-1")
    assert H.max_rel_err(y, ref) > 100 * TOL_OUT_REL


def test_yarn_truncate_false_is_honoured(models, tmp_path):
    # gpt-oss's `truncate: false`: the same weights with the rounded ramp miss the oracle.
    d, refs = models["gpt_oss"]
    x, ref = refs[0]
    rp = dict(json.load(open(os.path.join(d, "config.json")))["rope_parameters"], truncate=True)
    y = run_layer(H.edit_config(d, str(tmp_path / "t"), rope_parameters=rp), 0, x, tmp_path)
    assert H.max_rel_err(y, ref) > 10 * TOL_OUT_REL
    assert "truncate no" in run_cli("info", "--model", d).stdout


def test_flags_override_the_config(models, tmp_path):
    # --window replaces the config's window: equal to the model with sliding_window removed.
    d, refs = models["mistral"]
    x, _ = refs[0]
    y_flag = run_layer(d, 0, x, tmp_path, "--window=-1,-1")
    full = H.edit_config(d, str(tmp_path / "full"), sliding_window=None)
    y_cfg = run_layer(full, 0, x, tmp_path)
    np.testing.assert_array_equal(y_flag, y_cfg)
    # --scale / --softcap replace gemma2's query_pre_attn_scalar / attn_logit_softcapping.
    d, refs = models["gemma2"]
    x, _ = refs[1]
    y_flag = run_layer(d, 1, x, tmp_path, "--scale", 0.25, "--softcap", 7)
    other = H.edit_config(d, str(tmp_path / "g2"), query_pre_attn_scalar=16,
                          attn_logit_softcapping=7.0)
    np.testing.assert_array_equal(y_flag, run_layer(other, 1, x, tmp_path))


def test_info_prints_what_it_understood(models, tmp_path):
    d, _ = models["gemma2"]
    r = run_cli("info", "--model", d, "--layer", 0)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "model_type: gemma2" in out and "window: 4,0" in out
    assert "softcap: 3" in out and "scale: 0.2041241452319315" in out  # 24 ** -0.5
    assert "model.layers.0.self_attn." in out and "heads: 4, kv heads: 2, head_dim: 16" in out
    # Keys left out of config.json take the transformers config class's defaults (null: off).
    r = run_cli("info", "--model",
                H.edit_config(d, str(tmp_path / "g2"), attn_logit_softcapping=H.DELETE,
                              query_pre_attn_scalar=H.DELETE, sliding_window=H.DELETE))
    assert "softcap: 50" in r.stdout and "scale: 0.0625" in r.stdout, r.stdout
    assert "window: 4095,0" in r.stdout
    r = run_cli("info", "--model",
                H.edit_config(d, str(tmp_path / "g2n"), attn_logit_softcapping=None))
    assert "softcap: 0" in r.stdout, r.stdout
    r = run_cli("info", "--model", models["gpt_neox"][0])
    assert "rotary_dim 8" in r.stdout and "query_key_value" in r.stdout
    r = run_cli("info", "--model", models["bert"][0])
    assert "causal: no" in r.stdout and "rope: none" in r.stdout


def refused(d, *fields):
    """`mha info` and `mha run` both fail with exit 1 and one stderr line naming every field."""
    r = run_cli("info", "--model", d)
    assert r.returncode == 1, r.stdout
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("mha: "), line
    for f in fields:
        assert f in line, line
    r = run_cli("run", "--model", d, "--input", "/nonexistent.npy", "--out", "/tmp/unused.npy")
    assert r.returncode == 1 and all(f in r.stderr for f in fields), r.stderr
    return line


def test_unsupported_options_are_refused_by_name(models, tmp_path):
    llama = models["llama"][0]
    refused(H.edit_config(llama, str(tmp_path / "unknown"),
                          rope_parameters={"rope_type": "not_a_scaling", "rope_theta": 1e4}),
            "rope_parameters.rope_type", "not_a_scaling")
    refused(H.edit_config(models["falcon_mq"][0], str(tmp_path / "alibi"), alibi=True),
            "\"alibi\"")
    refused(H.edit_config(models["bert"][0], str(tmp_path / "rel"),
                          position_embedding_type="relative_key"),
            "position_embedding_type", "relative_key")
    refused(H.edit_config(llama, str(tmp_path / "mamba"), model_type="mamba"),
            "model_type", "mamba")
    refused(H.edit_config(models["gemma2"][0], str(tmp_path / "chunk"),
                          layer_types=["chunked_attention", "full_attention"]),
            "layer_types[0]", "chunked_attention")
    refused(H.edit_config(llama, str(tmp_path / "cap"), attn_logit_softcapping=5.0),
            "attn_logit_softcapping")
    # Gemma 3 merges rope_scaling into rope_parameters.full_attention: refused, not guessed.
    refused(H.edit_config(models["gemma3_text"][0], str(tmp_path / "g3rope"),
                          rope_scaling={"rope_type": "linear", "factor": 4.0}),
            "rope_parameters", "rope_scaling")
    refused(H.edit_config(models["gemma3_text"][0], str(tmp_path / "g3flat"),
                          rope_parameters={"rope_type": "linear", "rope_theta": 1e6,
                                           "factor": 2.0}),
            "rope_parameters", "sliding_attention")


def hostile(d, *words, layer=0):
    r = run_cli("info", "--model", d, "--layer", layer)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("mha: "), line
    for w in words:
        assert w in line, line
    return line


def test_hostile_model_directories(models, tmp_path):
    llama = models["llama"][0]
    mistral = models["mistral"][0]
    hostile(str(tmp_path / "missing"), "config.json", "cannot open")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{\"model_type\": \"llama\", ")
    hostile(str(bad), "config.json", "not valid JSON")
    (bad / "config.json").write_text("[1, 2]")
    hostile(str(bad), "not a JSON object")
    for i, (field, value) in enumerate([("num_attention_heads", "four"),
                                        ("num_attention_heads", -4),
                                        ("num_attention_heads", 4.5),
                                        ("num_attention_heads", 1e300),
                                        ("hidden_size", 0),
                                        ("num_key_value_heads", 3),
                                        ("head_dim", [16]),
                                        ("sliding_window", -1),
                                        ("model_type", 7)]):
        hostile(H.edit_config(mistral, str(tmp_path / f"f{i}"), **{field: value}), "config.json")
    # (a list transformers reads: Gemma 2's; MistralConfig ignores layer_types, and so does mha)
    hostile(H.edit_config(models["gemma2"][0], str(tmp_path / "lt"),
                          layer_types=["sliding_attention"]), "config.json", "layer_types")
    hostile(H.edit_config(mistral, str(tmp_path / "nohd"), num_attention_heads=None),
            "num_attention_heads")
    hostile(H.edit_config(mistral, str(tmp_path / "nomt"), model_type=H.DELETE), "model_type")
    hostile(H.edit_config(mistral, str(tmp_path / "rp"), rope_parameters="yes"),
            "rope_parameters")
    hostile(mistral, "layer 2 does not exist", layer=2)
    # A config whose sizes disagree with the tensors: refused naming the tensor and both shapes.
    line = run_cli("run", "--model",
                   H.edit_config(mistral, str(tmp_path / "kv"), num_key_value_heads=4),
                   "--input", "/nonexistent.npy", "--out", str(tmp_path / "y.npy")).stderr
    assert "k_proj.weight" in line and "[32, 64]" in line and "expected [64, 64]" in line, line
    # The index may only name files inside the model directory.
    ev = tmp_path / "evil"
    H.edit_config(llama, str(ev))
    idx = json.loads((ev / "model.safetensors.index.json").read_text())
    os.remove(ev / "model.safetensors.index.json")
    for name in idx["weight_map"]:
        idx["weight_map"][name] = "../" + idx["weight_map"][name]
    (ev / "model.safetensors.index.json").write_text(json.dumps(idx))
    hostile(str(ev), "weight_map", "not a file name in the model directory")
    (ev / "model.safetensors.index.json").write_text("{\"weight_map\": []}")
    hostile(str(ev), "weight_map")
    # No weights at all.
    nw = tmp_path / "noweights"
    nw.mkdir()
    (nw / "config.json").write_text((ev / "config.json").read_text())
    hostile(str(nw), "model.safetensors", "cannot open")


def test_usage_errors(models, tmp_path):
    d = models["llama"][0]
    for args, word in [(["--model", d, "--weights", "w.safetensors"], "exclude"),
                       (["--model", d, "--prefix", "x."], "--prefix"),
                       (["--model", d, "--names", "q=a"], "--names"),
                       (["--weights", "w.safetensors", "--heads", 2, "--layer", 0], "--layer"),
                       (["--model", d, "--layer", -1], "--layer"),
                       ([], "--model")]:
        r = run_cli("run", *args, "--input", tmp_path / "x.npy", "--out", tmp_path / "y.npy")
        assert r.returncode == 2 and word in r.stderr, (args, r.stderr)
    # An output may not overwrite the model's files.
    cfg = os.path.join(d, "model.safetensors.index.json")
    before = open(cfg).read()
    r = run_cli("run", "--model", d, "--input", tmp_path / "x.npy", "--out", cfg)
    assert r.returncode == 1 and "refusing to overwrite an input" in r.stderr, r.stderr
    assert open(cfg).read() == before
    r = run_cli("info", "--layer", 0)
    assert r.returncode == 2 and "--model" in r.stderr


def test_qk_norm_info_and_hostile(models, tmp_path):
    """QK-norm (issue 31): `mha info` prints it; a bad rms_norm_eps, an absent or misshapen norm
    tensor, Gemma 3's bidirectional mode are refused naming the field or tensor."""
    from safetensors.numpy import load_file, save_file
    d, _ = models["gemma3_text"]
    out = run_cli("info", "--model", d).stdout
    assert "qk-norm: rms per head, before RoPE (eps 1e-06, scale 1 + w)" in out, out
    assert "theta 10000" in out and "window: 4,0" in out, out
    if "qwen3_next" in models:
        out_n = run_cli("info", "--model", models["qwen3_next"][0]).stdout
        assert "output gate: A * sigmoid" in out_n and "scale 1 + w" in out_n, out_n
    out1 = run_cli("info", "--model", d, "--layer", 1).stdout
    assert "theta 1e+06" in out1 and "linear" in out1 and "window: none" in out1, out1
    for bad in (0, -1e-6, "x", 1e300):
        hostile(H.edit_config(d, str(tmp_path / f"eps{bad}"), rms_norm_eps=bad), "rms_norm_eps")
    refused(H.edit_config(d, str(tmp_path / "bidi"), use_bidirectional_attention=True),
            "use_bidirectional_attention")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    for what, change in (("absent", None), ("shape", np.ones(3, np.float64))):
        dst = tmp_path / f"norm_{what}"
        dst.mkdir()
        os.symlink(os.path.join(d, "config.json"), dst / "config.json")
        t = dict(tensors)
        name = "model.layers.0.self_attn.k_norm.weight"
        if change is None:
            del t[name]
        else:
            t[name] = change
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
        x = np.zeros((1, 3, 64))
        np.save(tmp_path / "x.npy", x)
        r = run_cli("run", "--model", dst, "--layer", 0, "--input", tmp_path / "x.npy", "--out",
                    tmp_path / "y.npy")
        assert r.returncode == 1 and name in r.stderr, r.stderr
        assert ("expected [16]" in r.stderr) if change is not None else True, r.stderr


# Which of two places a RoPE parameter is read from is transformers' choice (its
# convert_rope_params_to_dict / standardize_rope_params): each edited config.json is run by
# transformers itself (the oracle) and by mha.
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0}
ROPE_PRECEDENCE = {
    # rope_scaling replaces rope_parameters whole (transformers: rope_scaling or rope_parameters).
    "rope_scaling_over_rope_parameters": dict(rope_scaling={"type": "linear", "factor": 3.0}),
    # A top-level original_max_position_embeddings wins over the flat rope parameters' one (for
    # llama3, yarn and longrope)...
    "top_level_original_over_yarn_parameters": dict(
        original_max_position_embeddings=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "top_level_original_over_llama3_parameters": dict(original_max_position_embeddings=32),
    # ... and is read for a llama3 scaling written without it in rope_parameters.
    "top_level_original_for_llama3": dict(original_max_position_embeddings=16,
                                          rope_parameters=_LLAMA3),
}


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_max_window_layers_default_is_transformers(models, name, tmp_path):
    # Qwen2Config / Qwen3Config: max_window_layers 28 when absent, so layer 1 does not slide
    # (mha took 0 before: every layer slid).
    if name not in models:
        pytest.skip("not in the quick set")
    d = H.edit_config(models[name][0], str(tmp_path / name), max_window_layers=H.DELETE,
                      layer_types=H.DELETE)
    x, ref = H.reference(d, name, 1)
    err = H.max_rel_err(run_layer(d, 1, x, tmp_path), ref)
    assert err <= TOL_OUT_REL, f"{name} layer 1: max error {err:.3g} of max|ref|"


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "smollm3", "llama4_text"])
def test_rope_theta_default_is_the_config_class_default(models, name, tmp_path):
    # No rope_theta anywhere: transformers takes the class's default_theta (Mixtral 1e6, gpt-oss
    # 150000, SmolLM3 2e6, Llama 4 5e5); mha took 10^4 before.
    if name not in models:
        pytest.skip("not in the quick set")
    d = models[name][0]
    with open(os.path.join(d, "config.json")) as f:
        rp = {k: v for k, v in json.load(f)["rope_parameters"].items() if k != "rope_theta"}
    d = H.edit_config(d, str(tmp_path / name), rope_parameters=rp)
    x, ref = H.reference(d, name, 0)
    err = H.max_rel_err(run_layer(d, 0, x, tmp_path), ref)
    assert err <= TOL_OUT_REL, f"{name}: max error {err:.3g} of max|ref|"


def test_gpt_neox_rotary_pct_default_is_transformers(models, tmp_path):
    # GPTNeoXConfig: rotary_pct 0.25 when neither it nor partial_rotary_factor is given (mha
    # rotated the whole head before).
    d = models["gpt_neox"][0]
    with open(os.path.join(d, "config.json")) as f:
        rp = json.load(f)["rope_parameters"]
    rp.pop("partial_rotary_factor")
    d = H.edit_config(d, str(tmp_path / "neox"), rope_parameters=rp)
    x, ref = H.reference(d, "gpt_neox", 0)
    err = H.max_rel_err(run_layer(d, 0, x, tmp_path), ref)
    assert err <= TOL_OUT_REL, f"max error {err:.3g} of max|ref|"


# Fields transformers reads only for some architectures: elsewhere it ignores them (MistralConfig
# and Phi3Config have no layer_types; only the NeoX, Phi-3 and Qwen3-Next modules rotate part of a
# head), and so does mha (it applied them before, session 47).
_S, _F = "sliding_attention", "full_attention"
IGNORED_AS_TRANSFORMERS = {
    "mistral_layer_types": ("mistral", dict(layer_types=[_F, _F])),
    "phi3_layer_types": ("phi3", dict(sliding_window=5, layer_types=[_F, _F])),
    "llama_partial_rotary": ("llama", dict(rope_parameters=H.DELETE, rope_theta=1e4,
                                           partial_rotary_factor=0.5)),
    "gemma2_partial_rotary": ("gemma2", dict(rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
}


@pytest.mark.parametrize("case", sorted(IGNORED_AS_TRANSFORMERS))
def test_fields_transformers_ignores_are_ignored(models, case, tmp_path):
    name, changes = IGNORED_AS_TRANSFORMERS[case]
    if name not in models:
        pytest.skip("not in the quick set")
    d = H.edit_config(models[name][0], str(tmp_path / case), **changes)
    x, ref = H.reference(d, name, 0)
    err = H.max_rel_err(run_layer(d, 0, x, tmp_path), ref)
    assert err <= TOL_OUT_REL, f"{case}: max error {err:.3g} of max|ref|"


def test_gpt_neox_head_dim_for_rope_only_is_refused(models, tmp_path):
    # transformers' GPT-NeoX splits hidden_size / heads (16 here) per head but rotates with a
    # config's head_dim: refused naming it (mha rotated by 16 before: 0.059 of max|ref|); the
    # same value as the split is the usual layer.
    neox = models["gpt_neox"][0]
    hostile(H.edit_config(neox, str(tmp_path / "hd32"), head_dim=32), "head_dim", "32", "16")
    d = H.edit_config(neox, str(tmp_path / "hd16"), head_dim=16)
    x, ref = H.reference(d, "gpt_neox", 0)
    err = H.max_rel_err(run_layer(d, 0, x, tmp_path), ref)
    assert err <= TOL_OUT_REL, f"max error {err:.3g} of max|ref|"


@pytest.mark.parametrize("kind", ["su", "yarn", "linear"])
def test_phi3_rope_types_as_phi3config_reads_them(models, kind, tmp_path):
    # Phi3Config reads "su" and "yarn" as longrope and refuses other types (mha read "yarn" as
    # YaRN and applied "linear" before).
    if "phi3_longrope" not in models:
        pytest.skip("not in the quick set")
    src = models["phi3_longrope"][0]
    with open(os.path.join(src, "config.json")) as f:
        rp = dict(json.load(f)["rope_parameters"], rope_type=kind)
    d = H.edit_config(src, str(tmp_path / kind), rope_parameters=rp)
    if kind == "linear":
        hostile(d, "rope_type", "Phi-3")
        return
    x, ref = H.reference(d, "phi3_longrope", 0)
    err = H.max_rel_err(run_layer(d, 0, x, tmp_path), ref)
    assert err <= TOL_OUT_REL, f"{kind}: max error {err:.3g} of max|ref|"


@pytest.mark.parametrize("case", sorted(ROPE_PRECEDENCE))
def test_rope_parameters_are_taken_where_transformers_takes_them(models, case, tmp_path):
    d = H.edit_config(models["llama"][0], str(tmp_path / case), **ROPE_PRECEDENCE[case])
    x, ref = H.reference(d, "llama", 0)
    y = run_layer(d, 0, x, tmp_path)
    err = H.max_rel_err(y, ref)
    assert err <= TOL_OUT_REL, f"{case}: max error {err:.3g} of max|ref|"


def test_weights_are_read_from_the_file_transformers_reads(models, tmp_path):
    """Which file holds the weights is transformers' choice (from_pretrained of a directory):
    config.json's "transformers_weights" when set, else model.safetensors, and the index only
    without it. Each directory below also holds a decoy (q_proj doubled) where mha read before."""
    from safetensors.numpy import load_file, save_file
    d0 = models["mistral"][0]
    tensors = load_file(os.path.join(d0, "model.safetensors"))
    decoy = dict(tensors)
    q = "model.layers.0.self_attn.q_proj.weight"
    decoy[q] = decoy[q] * 2

    def directory(name, files, config_changes):
        d = tmp_path / name
        d.mkdir()
        for f, t in files.items():
            save_file(t, str(d / f), metadata={"format": "pt"})
        for f, target in (("model.safetensors.index.json", "decoy.safetensors"),
                          ("alt.safetensors.index.json", "alt.safetensors")):
            if target in files:
                (d / f).write_text(json.dumps({"metadata": {},
                                               "weight_map": {k: target for k in tensors}}))
        with open(os.path.join(d0, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(config_changes)
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    # model.safetensors beside an index: transformers reads model.safetensors.
    both = directory("both", {"model.safetensors": tensors, "decoy.safetensors": decoy}, {})
    # transformers_weights: that file (or that index) and not model.safetensors.
    tw = directory("tw", {"model.safetensors": decoy, "alt.safetensors": tensors},
                   {"transformers_weights": "alt.safetensors"})
    twi = directory("twi", {"model.safetensors": decoy, "alt.safetensors": tensors},
                    {"transformers_weights": "alt.safetensors.index.json"})
    x, ref = H.reference(d0, "mistral", 0)
    for d in (both, tw, twi):
        xd, refd = H.reference(d, "mistral", 0)
        assert np.array_equal(xd, x) and np.array_equal(refd, ref)  # not the decoy's
        err = H.max_rel_err(run_layer(d, 0, x, tmp_path), ref)
        assert err <= TOL_OUT_REL, f"{d}: max error {err:.3g} of max|ref|"
    for bad in ("../alt.safetensors", "sub/alt.safetensors", "alt.bin", 7):
        with open(os.path.join(tw, "config.json")) as f:
            cfg = json.load(f)
        cfg["transformers_weights"] = bad
        with open(os.path.join(tw, "config.json"), "w") as f:
            json.dump(cfg, f)
        hostile(tw, "transformers_weights")


def test_bias_absent_from_config_is_ignored_as_transformers_does(models, tmp_path):
    """A bias tensor in the file that the config does not imply (mistral builds no biases):
    transformers does not build it and ignores the tensor ("weights not used"), so its output is
    the model's without it; mha agrees (it applied it before issue 28). Checked on transformers
    itself: from_pretrained of the modified directory has no q_proj bias, and mha's output equals
    the reference of the bias-free model."""
    import torch
    import transformers as T
    from safetensors.numpy import load_file, save_file
    d, refs = models["mistral"]
    x, ref = refs[0]
    dst = tmp_path / "extra_bias"
    dst.mkdir()
    for f in os.listdir(d):
        if f != "model.safetensors":
            os.symlink(os.path.join(d, f), dst / f)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    rng = np.random.default_rng(5)
    for stem in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = tensors[f"model.layers.0.self_attn.{stem}.weight"]
        tensors[f"model.layers.0.self_attn.{stem}.bias"] = rng.normal(
            0, 3.0, w.shape[0]).astype(w.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    m = T.AutoModelForCausalLM.from_pretrained(str(dst), torch_dtype=torch.float64)
    assert m.model.layers[0].self_attn.q_proj.bias is None  # transformers ignores the tensor
    y = run_layer(str(dst), 0, x, tmp_path)
    err = H.max_rel_err(y, ref)
    assert err <= TOL_OUT_REL, f"the file's bias was applied: max error {err:.3g} of max|ref|"


@pytest.mark.parametrize("model_type", ["gpt_neox", "falcon"])
def test_kv_heads_flag_contradicting_a_fused_tensor_is_refused(model_type, tmp_path):
    """Issue 28: a per-head fused query_key_value [12, 8] (4 heads of 2 rows, bias [12]) with
    --kv-heads 1 passed the (h + 2g) d row count and was read as 3h blocks, past its end (exit 0
    with garbage; ASan heap-buffer-overflow). Refused now, naming the tensor and the heads."""
    from safetensors.numpy import save_file
    d = tmp_path / model_type
    d.mkdir()
    cfg = {"model_type": model_type, "hidden_size": 8, "num_attention_heads": 4,
           "num_hidden_layers": 1}
    pre = "gpt_neox.layers.0.attention." if model_type == "gpt_neox" else \
        "transformer.h.0.self_attention."
    if model_type == "falcon":
        cfg.update(multi_query=False, bias=True)
    else:  # (GPTNeoXConfig's default 0.25 of a head of 2 rotates no dimension)
        cfg.update(rotary_pct=1.0)
    (d / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(1)
    f = lambda *s: rng.normal(0, 1, s).astype(np.float32)  # noqa: E731
    save_file({pre + "query_key_value.weight": f(12, 8), pre + "query_key_value.bias": f(12),
               pre + "dense.weight": f(8, 8), pre + "dense.bias": f(8)}, str(d / "model.safetensors"))
    np.save(tmp_path / "x.npy", f(1, 5, 8))
    r = run_cli("run", "--model", d, "--layer", 0, "--kv-heads", 1, "--input", tmp_path / "x.npy",
                "--out", tmp_path / "y.npy")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert pre + "query_key_value.weight' stores q, k, v per head" in r.stderr, r.stderr
    assert "num_kv_heads must equal num_heads 4, not 1" in r.stderr, r.stderr
    assert not (tmp_path / "y.npy").exists()

# SPDX-License-Identifier: MIT
"""`mha.torch.MhaCache`: a transformers Cache backed by mha's C KV cache, with the attention of
every layer computed by mha (attn_implementation registered by register_hf_attention) over it.

Tiny random decoders of tests/hf_models.py (head_dim 32, so that q8_0 caches apply), built from
configs (no hub): llama and qwen2 / mistral (GQA 4:2, sliding windows: the cache is a ring),
gemma2 (softcap), gpt_oss (sinks), cohere2 (interleaved RoPE, a sliding layer), llama4_text
(chunked attention, temperature tuning). Oracles:
* the float64 full forward of each sequence alone (its real tokens): the logits of a prompt (one
  sequence left-padded; llama: the other with a padding token inside) then single-token steps
  through an MhaCache, at the real tokens, within TOL_OUT_REL of
  max|ref| for a float32 cache, TOL_KV_MODEL_C u max|ref| for float16, bfloat16, q8_0 and fp8;
* greedy `generate` with MhaCache(float32) gives the tokens of the float32 model with eager
  attention and DynamicCache, logits within TOL_OUT_REL;
* a paged cache gives the contiguous cache's logits bit for bit.
What it cannot do is refused with an exception naming it.
"""
import copy
import os
import sys

import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import torch  # noqa: E402
T = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models as H  # noqa: E402
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from tolerances import TOL_FP8_REL, TOL_KV_MODEL_C, TOL_OUT_REL  # noqa: E402

CASES = ["llama", "qwen2", "mistral", "gemma2", "gpt_oss", "cohere2", "llama4_text"]
P, N = 12, 14  # prompt, then N - 1 single-token steps
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "q8_0": 1.0 / 254, "fp8_e4m3": TOL_FP8_REL}


@pytest.fixture(scope="module")
def name():
    return mt.register_hf_attention()


def _models(case, name):
    """(float64 eager reference, float32 eager model, float32 mha model), the same weights."""
    cfg_cls, kw, model_cls, _path, _layers = H.CASES[case]
    torch.manual_seed(sum(map(ord, case)))
    cfg = cfg_cls(**dict(kw, head_dim=32))
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    ref = model_cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    out = [ref]
    for impl in ("eager", name):
        m = model_cls(copy.deepcopy(cfg)).eval()
        m.load_state_dict(ref.state_dict())
        m.set_attn_implementation(impl)
        out.append(m)
    return out


def _tokens(inner=False):
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(3, 64, (2, P + N), generator=g)
    mask = torch.ones_like(seq)
    mask[1, :3] = 0  # left padding
    if inner:  # a padding token inside a prompt (its row's output is not compared); with a
        mask[0, 5] = 0  # sliding window transformers counts it in the window: refused (below)
    return seq, mask


# transformers' Llama 4 scales the queries of its NoPE layers by a function of the cache position,
# padding included, so its padded batch is not each sequence alone: its oracle is the float64
# padded batch (the other models' eager float64 padded batch has NaN rows, hence per sequence).
PADDED_REFERENCE = {"llama4_text"}


def _reference(ref, seq, mask):
    """float64 logits of each sequence alone, without its padding (rows of padding: 0)."""
    want = torch.zeros(seq.shape + (ref.config.vocab_size,), dtype=torch.float64)
    with torch.no_grad():
        if ref.config.model_type in PADDED_REFERENCE:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            want = ref(seq, attention_mask=mask, position_ids=pos).logits
            assert not want.isnan().any()
            return want * mask[..., None]
        for b in range(seq.shape[0]):
            real = mask[b].bool()
            want[b, real] = ref(seq[b:b + 1, real]).logits[0]
    return want


def _decode(m, cache, seq, mask):
    """Prompt of P tokens, then single-token steps; the logits predicting tokens P .. P+N-1."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        outs = [m(seq[:, :P], attention_mask=mask[:, :P], position_ids=pos[:, :P],
                  cache=cache).logits[:, -1:]]
        for i in range(P, P + N - 1):
            outs.append(m(seq[:, i:i + 1], attention_mask=mask[:, :i + 1],
                          position_ids=pos[:, i:i + 1], cache=cache).logits)
    return torch.cat(outs, 1).double()


@pytest.mark.parametrize("case", CASES)
def test_decode_logits_match_the_float64_forward(name, case):
    ref, _, m = _models(case, name)
    inner = case == "llama"  # (no sliding window: an inner padding token is representable)
    seq, mask = _tokens(inner)
    keep = mask[:, P - 1:P + N - 1].bool()  # the rows of real tokens
    want = _reference(ref, seq, mask)[:, P - 1:P + N - 1][keep]
    scale = want.abs().max().item()
    errs = {}
    for dtype in ("float32", "float16", "bfloat16", "q8_0", "fp8_e4m3"):
        got = {}
        for bs in (0, 16):
            cache = mt.MhaCache(m.config, max_seq=P + N, dtype=dtype, block_size=bs)
            got[bs] = _decode(m, cache, seq, mask)[keep]
            # padding is not stored: every sequence holds its own tokens
            assert cache.lengths() == [P + N - 1 - inner, P + N - 4]
            assert cache.get_seq_length() == P + N - 1
        assert torch.equal(got[0], got[16]), (case, dtype)  # paged = contiguous, bit for bit
        errs[dtype] = (got[0] - want).abs().max().item() / scale
    assert errs["float32"] <= TOL_OUT_REL, (case, errs)
    # a ring (sliding / chunked layers) filled in steps of 4: the prompt is appended and attended
    # 4 tokens at a time
    cache = mt.MhaCache(m.config, max_seq=P + N, block_size=16, max_step_tokens=4)
    err = (_decode(m, cache, seq, mask)[keep] - want).abs().max().item() / scale
    assert err <= TOL_OUT_REL, (case, err)
    for dtype, u in UNIT.items():
        assert 0 < errs[dtype] <= TOL_KV_MODEL_C * u, (case, dtype, errs[dtype] / u)


@pytest.mark.parametrize("case", ["llama", "qwen2", "mistral"])
def test_greedy_generate_matches_eager_dynamic_cache(name, case):
    _, eager, m = _models(case, name)
    seq, mask = _tokens()
    ids, am = seq[:, :P], mask[:, :P]
    for a in (None, am):
        kw = dict(attention_mask=a, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                  pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        with torch.no_grad():
            want = eager.generate(ids, **kw)
            for bs in (0, 16):
                cache = mt.MhaCache(m.config, max_seq=P + 16, block_size=bs)
                got = m.generate(ids, cache=cache, **kw)
                assert torch.equal(got.sequences, want.sequences), (case, bs)
                assert got.cache is cache
                for x, y in zip(got.logits, want.logits):
                    assert (x - y).abs().max() <= TOL_OUT_REL * y.abs().max()
                # the deprecated name of the argument works too
                cache.reset()
                with pytest.warns(FutureWarning, match="past_key_values"):
                    again = m.generate(ids, past_key_values=cache, **kw)
                assert torch.equal(again.sequences, want.sequences)


@pytest.mark.parametrize("case", ["llama", "mistral"])
def test_beam_search_matches_eager_dynamic_cache(name, case):
    # reorder_cache: rows kept by one beam are renamed, rows taken by several are copied (paged:
    # shared blocks); the beams equal transformers' with eager attention and DynamicCache.
    _, eager, m = _models(case, name)
    seq, mask = _tokens()
    kw = dict(attention_mask=mask[:, :P], max_new_tokens=10, min_new_tokens=10, num_beams=3,
              num_return_sequences=2, do_sample=False, pad_token_id=0, early_stopping=False,
              return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        want = eager.generate(seq[:, :P], **kw)
        for bs in (0, 16):
            cache = mt.MhaCache(m.config, max_seq=P + 10, block_size=bs)
            got = m.generate(seq[:, :P], cache=cache, **kw)
            assert torch.equal(got.sequences, want.sequences), (case, bs)
            assert torch.allclose(got.sequences_scores, want.sequences_scores, rtol=0,
                                  atol=TOL_OUT_REL)
            # 2 prompts x 3 beams, each holding its own tokens (padding not stored)
            lengths = cache.lengths()
            assert lengths[:3] == [P + 9] * 3 and lengths[3:] == [P + 6] * 3, lengths
            if bs:  # beams share their prompt's blocks
                used = cache.layers[0].cache.num_blocks - cache.free_blocks()[0]
                assert used < 6 * -(-(P + 9) // bs)


def test_crop_and_reset(name):
    # crop (assisted decoding's rollback) truncates each sequence's real tokens; reset empties.
    ref, _, m = _models("qwen2", name)
    seq, mask = _tokens()
    full = mt.MhaCache(m.config, max_seq=P + N, dtype="bfloat16", block_size=16)
    want = _decode(m, full, seq, mask)
    cache = mt.MhaCache(m.config, max_seq=P + N, dtype="bfloat16", block_size=16)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        first = m(seq[:, :P + 3], attention_mask=mask[:, :P + 3], position_ids=pos[:, :P + 3],
                  cache=cache).logits[:, P - 1:P]
        cache.crop(-3)
        assert cache.get_seq_length() == P and cache.lengths() == [P, P - 3]
        free = cache.free_blocks()
        assert free[0] == free[1] > 0
        outs = [first]
        for i in range(P, P + N - 1):
            outs.append(m(seq[:, i:i + 1], attention_mask=mask[:, :i + 1],
                          position_ids=pos[:, i:i + 1], cache=cache).logits)
    assert torch.equal(torch.cat(outs, 1).double(), want)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.lengths() == [0, 0]
    assert torch.equal(_decode(m, cache, seq, mask), want)


def test_refused_append_changes_nothing(name):
    # A paged pool too small for the next forward: the append is refused (NO_MEMORY) and the
    # layer's length stays what the mha cache holds, so the next forward continues correctly
    # (before: get_seq_length counted the refused tokens, the next step's positions were wrong).
    _, _, m = _models("llama", name)
    seq, _ = _tokens()
    seq = seq[:1]
    with torch.no_grad():
        cache = mt.MhaCache(m.config, max_seq=64, block_size=16, num_blocks=1)
        m(seq[:, :10], cache=cache)
        with pytest.raises(mha.MhaError, match="pool exhausted"):
            m(seq[:, 10:20], cache=cache)  # positions 16.. need a second block
        assert cache.get_seq_length() == 10 and cache.lengths() == [10]
        got = m(seq[:, 10:11], cache=cache).logits
        fresh = mt.MhaCache(m.config, max_seq=64, block_size=16, num_blocks=1)
        m(seq[:, :10], cache=fresh)
        ref = m(seq[:, 10:11], cache=fresh).logits
    assert torch.equal(got, ref)


@pytest.mark.parametrize("how", ["gradient", "second layer"])
def test_refused_forward_changes_no_layer(name, how):
    # A forward refused after some updates (gradients enabled: refused at layer 0's attention,
    # after its update counted the token; a failure in layer 1, after layer 0 appended): every
    # layer goes back to what it held, and the next forward is the fresh cache's. Before, the
    # layers disagreed ([11, 10] positions) and the next step's logits were off by 3.2e-3
    # ("gradient") without an error.
    _, _, m = _models("llama", name)
    seq = _tokens()[0][:1]
    cache = mt.MhaCache(m.config, max_seq=64)
    with torch.no_grad():
        m(seq[:, :10], cache=cache)
    assert len(cache.layers) >= 2
    if how == "gradient":
        with pytest.raises(ValueError, match="no gradient"):
            m(seq[:, 10:11], cache=cache)
    else:
        def fail(*args):
            raise RuntimeError("refused (injected)")
        cache.layers[1]._run = fail
        with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
            m(seq[:, 10:11], cache=cache)
        del cache.layers[1]._run
    assert [lay.get_seq_length() for lay in cache.layers] == [10] * len(cache.layers)
    assert all(cache.lengths(i) == [10] for i in range(len(cache.layers)))
    with torch.no_grad():
        got = m(seq[:, 10:11], cache=cache).logits
        fresh = mt.MhaCache(m.config, max_seq=64)
        m(seq[:, :10], cache=fresh)
        ref = m(seq[:, 10:11], cache=fresh).logits
    assert torch.equal(got, ref)


def test_append_that_cannot_be_undone_refuses_until_reset(name, monkeypatch):
    # A refused append whose roll-back fails too (a ring that cannot go back that far; here the
    # roll-back's truncate is made to fail): the layer holds keys it does not count, so every
    # later update is refused, naming reset(), until reset() empties it.
    _, _, m = _models("llama", name)
    seq = _tokens()[0][:1]

    def no_truncate(self, s, n):
        raise RuntimeError("truncate refused (injected)")

    with torch.no_grad():
        cache = mt.MhaCache(m.config, max_seq=64, block_size=16, num_blocks=1)
        m(seq[:, :10], cache=cache)
        with monkeypatch.context() as mp:
            mp.setattr(mha.KVCache, "truncate", no_truncate)
            with pytest.raises(mha.MhaError, match="pool exhausted"):
                m(seq[:, 10:20], cache=cache)
        with pytest.raises(ValueError, match=r"reset\(\) the cache"):
            m(seq[:, 10:11], cache=cache)
        cache.reset()
        got = m(seq[:, :10], cache=cache).logits
        fresh = mt.MhaCache(m.config, max_seq=64, block_size=16, num_blocks=1)
        ref = m(seq[:, :10], cache=fresh).logits
    assert torch.equal(got, ref)


def test_fp8_scales(name):
    # fp8_scales: (k_scales, v_scales) per kv head for every layer, or one pair per layer; they
    # reach each layer's cache (other scales, other rounding, still within the bound).
    ref, _, m = _models("qwen2", name)
    seq, mask = _tokens()
    keep = mask[:, P - 1:P + N - 1].bool()
    want = _reference(ref, seq, mask)[:, P - 1:P + N - 1][keep]
    scale = want.abs().max().item()
    outs = []
    pair = ([0.5, 0.25], [0.125, 2.0])
    for sc in (None, pair, [pair, ([2.0, 1.0], [1.0, 0.5])]):
        cache = mt.MhaCache(m.config, max_seq=P + N, dtype="fp8_e4m3", fp8_scales=sc)
        outs.append(_decode(m, cache, seq, mask)[keep])
        err = (outs[-1] - want).abs().max().item() / scale
        assert err <= TOL_KV_MODEL_C * TOL_FP8_REL, (sc, err)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    with pytest.raises(ValueError, match="2 layers"):
        mt.MhaCache(m.config, max_seq=8, dtype="fp8_e4m3", fp8_scales=[([1.0, 1.0], [1.0, 1.0])])
    with pytest.raises(ValueError, match="k_scales"):
        m(seq[:, :2], cache=mt.MhaCache(m.config, max_seq=8, dtype="fp8_e4m3",
                                        fp8_scales=([1.0], [1.0, 1.0])))


def test_assisted_generation(name):
    # Assisted (speculative) decoding: a 1-layer draft model proposes tokens, the model verifies
    # them in one call and crop()s the rejected ones: the tokens of plain greedy decoding.
    ref, eager, m = _models("llama", name)
    cfg_cls, kw, model_cls, _path, _layers = H.CASES["llama"]
    torch.manual_seed(3)
    draft = model_cls(cfg_cls(**dict(kw, head_dim=32, num_hidden_layers=1))).eval()
    draft.set_attn_implementation("eager")
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.2)
    ids = _tokens()[0][:1, :P]
    gen = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager.generate(ids, **gen)
        for bs in (0, 16):
            cache = mt.MhaCache(m.config, max_seq=P + 24, block_size=bs)
            got = m.generate(ids, assistant_model=draft, cache=cache, **gen)
            assert torch.equal(got, want), bs
            assert cache.lengths() == [got.shape[1] - 1] == [cache.get_seq_length()]
    cache.crop(0)  # (nothing)
    assert cache.lengths() == [got.shape[1] - 1]
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(3)


def test_refusals(name):
    _, eager, m = _models("llama", name)
    seq, mask = _tokens()
    ids = seq[:, :P]
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with pytest.raises(ValueError, match="attention implementation is 'eager'"):
            eager.generate(ids, cache=mt.MhaCache(eager.config, max_seq=32), **kw)
        with pytest.raises(mha.MhaError, match="max_seq"):  # more tokens than it holds
            m.generate(ids, cache=mt.MhaCache(m.config, max_seq=P + 1), max_new_tokens=4,
                       min_new_tokens=4, do_sample=False, pad_token_id=0)
        cache = mt.MhaCache(m.config, max_seq=32)
        m(ids, cache=cache)
        with pytest.raises(ValueError, match="do not match the cache"):
            m(ids[:1, :1], cache=cache)  # another batch size without reset()
        # a mask that is not the causal rule over whole tokens (a 4-d mask is used as given)
        cache = mt.MhaCache(m.config, max_seq=32)
        odd = torch.ones(2, 1, P, P, dtype=torch.bool)
        with pytest.raises(ValueError, match="not the cache's causal rule"):
            m(ids, attention_mask=odd, cache=cache)
        # a padding token inside a sequence, with a sliding window: transformers counts it in
        # the window, mha's cache (which does not store it) cannot
        _, _, mis = _models("mistral", name)
        seq, mask = _tokens(inner=True)
        with pytest.raises(ValueError, match=r"window 5"):
            mis(seq, attention_mask=mask, cache=mt.MhaCache(mis.config, max_seq=P + N))
        with pytest.raises(mha.MhaError, match="multiple of 32|q8_0"):
            _, _, small = _models_small(name)
            small(ids, cache=mt.MhaCache(small.config, max_seq=32, dtype="q8_0"))
    with pytest.raises(ValueError, match="gradient"):  # training through the cache
        m(ids, cache=mt.MhaCache(m.config, max_seq=32))
    # ... also when only the keys need one (a frozen q_proj, a trainable k_proj, and a trainable
    # lm_head so that the loss has a gradient): until session 48 the query alone was checked and
    # k_proj's gradient was silently None
    train = {n for n, _ in m.named_parameters() if "k_proj" in n or "lm_head" in n}
    for n, p in m.named_parameters():
        p.requires_grad_(n in train)
    with pytest.raises(ValueError, match="gradient"):
        m(ids, cache=mt.MhaCache(m.config, max_seq=32))
    with torch.no_grad():  # inference is unaffected
        m(ids, cache=mt.MhaCache(m.config, max_seq=32))
    for p in m.parameters():
        p.requires_grad_(True)
    for bad in (dict(max_seq=0), dict(max_seq=8, dtype="int8"), dict(max_seq=8, dtype="fp8"),
                dict(max_seq=8, fp8_scales=([1.0], [1.0]))):
        with pytest.raises(ValueError, match="MhaCache"):
            mt.MhaCache(m.config, **bad)
    # an update whose keys the attention never read (another implementation ran in between)
    cache = mt.MhaCache(m.config, max_seq=32)
    k = torch.randn(2, 2, 3, 32)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="not consumed"):
        cache.update(k, k, 0)
    # multi-head latent attention: transformers' module caches its latents and expands them
    # after the update, so the placeholders reached kv_b_proj (NaN logits, no error)
    ds = T.DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                            num_hidden_layers=1, vocab_size=64, q_lora_rank=None,
                            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8)
    with pytest.raises(ValueError, match="latent attention .kv_lora_rank 16.*DynamicCache"):
        mt.MhaCache(ds, max_seq=32)
    # Gemma 3n's last layers read earlier layers' K/V (refused at the first forward before,
    # naming no cause: "attention without a pending update")
    g3n = T.Gemma3nTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, num_hidden_layers=4, num_kv_shared_layers=2,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              activation_sparsity_pattern=[0.0] * 4)
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        mt.MhaCache(g3n, max_seq=32)


def _models_small(name):
    """llama with head_dim 16 (q8_0 needs multiples of 32)."""
    cfg_cls, kw, model_cls, _path, _layers = H.CASES["llama"]
    cfg = cfg_cls(**kw)
    m = model_cls(cfg).eval()
    m.set_attn_implementation(name)
    return None, None, m


def test_placeholders_hold_no_keys(name):
    # What update returns is a zero-byte NaN view of the full shape: HF keeps no float K/V.
    _, _, m = _models("llama", name)
    cache = mt.MhaCache(m.config, max_seq=32)
    k = torch.randn(2, 2, 5, 32)
    ks, vs = cache.update(k, k, 1)
    assert ks.shape == (2, 2, 5, 32) and ks.stride() == (0, 0, 0, 0) and ks.isnan().all()
    assert ks.untyped_storage().nbytes() == 4
    with pytest.raises(ValueError, match="lost its tag"):
        from mha._torch_hf import attention_forward
        attention_forward(m.model.layers[1].self_attn, torch.randn(2, 4, 5, 32), ks[:, :], vs,
                          None)  # (a view: the values of the placeholder, not its tag)

# SPDX-License-Identifier: MIT
"""`mha.torch.register_hf_attention()`: transformers models run with attn_implementation="mha"
(every attention layer's core through mha) against the same model in float64 (sdpa, or eager
where the architecture has no sdpa path): the tiny random decoders of tests/hf_models.py (GQA,
sliding windows, Gemma 2's softcap, Gemma 3 / Qwen 3's QK-norm, gpt-oss's sinks), a batch with
left padding. Logits within the layer tolerance (TOL_OUT_REL of max|ref|), and greedy
`generate` giving the float64 model's tokens and the float32 sdpa/eager model's. What mha cannot
compute as asked is refused with ValueError.
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
import mha.torch as mt  # noqa: E402
from tolerances import TOL_OUT_REL  # noqa: E402

CASES = ["llama", "qwen2", "mistral", "gemma2", "gemma3_text", "qwen3", "gpt_oss", "cohere2",
         "llama4_text"]
NEW = 16  # generated tokens


@pytest.fixture(scope="module")
def name():
    return mt.register_hf_attention()


def _models(case):
    """(float64 reference, float32 peer (sdpa or eager), float32 mha) of one tiny case, with
    the same weights drawn so that scores are O(1)."""
    cfg_cls, kw, model_cls, _path, _layers = H.CASES[case]
    torch.manual_seed(sum(map(ord, case)))
    cfg = cfg_cls(**kw)
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    ref = model_cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    peer_impl = "sdpa" if model_cls._supports_sdpa else "eager"
    out = []
    for impl, dtype in ((peer_impl, torch.float64), (peer_impl, torch.float32),
                        ("mha", torch.float32)):
        m = model_cls(copy.deepcopy(cfg)).eval()  # (a model's config carries its attention)
        m.load_state_dict(ref.state_dict())
        if dtype is torch.float64:
            m = m.to(dtype)
        m.set_attn_implementation(impl)
        out.append(m)
    return out


def _inputs():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match(name, case):
    ref, peer, m = _models(case)
    assert m.config._attn_implementation == name
    ids, mask = _inputs()
    with torch.no_grad():
        # Unpadded: every position; padded: the real tokens (transformers' float64 eager gives
        # NaN on padded rows of Gemma 2, the mask-less rows of the reference are compared).
        for am in (None, mask):
            want = ref(ids, attention_mask=am).logits
            got = m(ids, attention_mask=am).logits.double()
            keep = (mask.bool() if am is not None else torch.ones_like(mask, dtype=torch.bool))
            keep = keep & ~want.isnan().any(-1)
            assert keep.sum() >= 9
            err = (got - want)[keep].abs().max().item()
            assert err <= TOL_OUT_REL * want[keep].abs().max().item(), (case, am is not None, err)
        for am in (None, mask):
            kw = dict(attention_mask=am, max_new_tokens=NEW, min_new_tokens=NEW,
                      do_sample=False, pad_token_id=0)
            toks = m.generate(ids, **kw)
            assert toks.shape == (2, 12 + NEW)
            assert torch.equal(toks, peer.generate(ids, **kw)), case
            if am is None or not ref(ids, attention_mask=am).logits.isnan().any():
                assert torch.equal(toks, ref.generate(ids, **kw)), case


def test_attention_function_is_called_and_uses_the_module_options(name, monkeypatch):
    # The registered function really runs (not a silent fallback), with the softcap and sinks
    # the layers give.
    from mha import _torch_hf
    seen = []
    real = _torch_hf.attention_forward

    def spy(module, q, k, v, mask, **kw):
        seen.append((kw.get("softcap"), kw.get("s_aux") is not None, tuple(q.shape)))
        return real(module, q, k, v, mask, **kw)

    monkeypatch.setitem(T.AttentionInterface._global_mapping, name, spy)
    for case, softcap, sinks in (("gemma2", 3.0, False), ("gpt_oss", None, True)):
        seen.clear()
        _, _, m = _models(case)
        with torch.no_grad():
            m.generate(_inputs()[0], max_new_tokens=2, min_new_tokens=2, do_sample=False,
                       pad_token_id=0)
        assert len(seen) == 2 * 2  # 2 layers x (prefill + 1 decode step)
        assert {s[0] for s in seen} == {softcap} and {s[1] for s in seen} == {sinks}
        assert seen[0][2][2] == 12 and seen[-1][2][2] == 1


def test_refusals(name):
    _, _, m = _models("llama")
    ids = _inputs()[0]
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions"):
            m(ids, output_attentions=True)
        with pytest.raises(ValueError, match="float64"):
            m.to(torch.float64)(ids)
    from mha._torch_hf import attention_forward
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="position_bias"):
        attention_forward(m.model.layers[0].self_attn, q, k, k, None,
                          position_bias=torch.zeros(1, 4, 3, 3))
    with pytest.raises(ValueError, match="different dtypes"):
        attention_forward(m.model.layers[0].self_attn, q, k.bfloat16(), k, None)
    with pytest.raises(ValueError, match="bool .* or float"):
        attention_forward(m.model.layers[0].self_attn, q, k, k, torch.ones(1, 1, 3, 3,
                                                                            dtype=torch.int64))
    for bad in ("", "sdpa", "eager", "flash_attention_2", 3):
        with pytest.raises(ValueError, match="name"):
            mt.register_hf_attention(bad)
    with pytest.raises(ValueError, match="threads"):
        mt.register_hf_attention("mha_t", threads=-1)


def test_threads_option_gives_the_same_tokens(name):
    _, peer, m = _models("qwen2")
    ids, mask = _inputs()
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
              pad_token_id=0)
    assert mt.register_hf_attention("mha_2t", threads=2) == "mha_2t"
    with torch.no_grad():
        a = m.generate(ids, **kw)
        m.set_attn_implementation("mha_2t")
        assert torch.equal(m.generate(ids, **kw), a)
        assert torch.equal(peer.generate(ids, **kw), a)


@pytest.mark.parametrize("compiled", [False, True])
def test_training_gradients_include_the_sinks(name, compiled):
    # gpt-oss's learned sinks (s_aux, a parameter) get their gradient through mha (the
    # operator's backward gives d out / d sink = -p_sink out; until session 49 _torch_hf added
    # it): every parameter's gradient equals the float64 eager model's within TOL_OUT_REL, with
    # left padding (a fully masked row adds nothing). Until this test the sinks silently got no
    # gradient (grad None).
    ref, _, m = _models("gpt_oss")
    ids, mask = _inputs()
    labels = ids.masked_fill(mask == 0, -100)
    for model in (ref, m):
        model.zero_grad()
        fn = torch.compile(model, backend="aot_eager") if compiled and model is m else model
        fn(ids, attention_mask=mask, labels=labels).loss.backward()
    want = dict(ref.named_parameters())
    sinks = 0
    for pname, p in m.named_parameters():
        r = want[pname].grad
        assert (p.grad is None) == (r is None), pname
        if r is None:
            continue
        sinks += pname.endswith("sinks")
        err = (p.grad.double() - r).abs().max().item()
        assert err <= TOL_OUT_REL * r.abs().max().item(), (pname, err)  # measured 7.6e-7
    assert sinks == 2

"""A decode token's attention on the CPU (moectl/models/attention_cpu.py, the kernel in moectl/kernels): the kernel
against an fp32 reference, and in the engine against transformers' own SDPA / eager attention, with the cases it
must leave to them (prefill, a sliding window shorter than the cache)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from moectl import kernels
from moectl.kernels import ops
from moectl.models import attention_cpu
from moectl.runtime.engine import Engine
from model_factory import COMMON, family_configs, save_tokenizer
from test_cpu_q8 import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"moectl's CPU kernels: {kernels.why_not()}")


def reference(q, k, v, scale, sinks=None):
    """fp32 attention of one query token: q [H, Dk], k [KV, S, Dk], v [KV, S, Dv] -> [H, Dv]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(rep, 0), v.float().repeat_interleave(rep, 0)       # [H, S, D]
    s = torch.einsum("hd,hsd->hs", q.float(), k) * scale                                    # [H, S]
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None]], -1)
    p = torch.softmax(s, -1)[:, :k.shape[1]]
    return torch.einsum("hs,hsd->hd", p, v)


@pytest.mark.parametrize("H,KV,S,Dk,Dv,sinks", [(32, 8, 1, 128, 128, False), (32, 8, 77, 128, 128, False),
                                                 (4, 4, 300, 64, 64, True), (16, 2, 40, 192, 128, False)])
def test_decode_attention_matches_fp32_within_bf16_output_rounding(H, KV, S, Dk, Dv, sinks, one_thread):
    g = torch.Generator().manual_seed(S)
    q = torch.randn(H, Dk, generator=g).bfloat16()
    cache_k = torch.randn(KV, S + 9, Dk, generator=g).bfloat16()          # a longer buffer: k, v are strided views
    cache_v = torch.randn(KV, S + 9, Dv, generator=g).bfloat16()
    k, v = cache_k[:, 3:3 + S], cache_v[:, 3:3 + S]
    sk = torch.randn(H, generator=g) * 3 if sinks else None
    scale = Dk ** -0.5
    want = reference(q, k, v, scale, sk)
    got = ops.decode_attention(q, k, v, scale, sk)
    assert got.shape == (H, Dv) and got.dtype == torch.bfloat16
    err = (got.float() - want).abs()
    assert (err <= want.abs() * 2 ** -8 + 1e-3).all(), err.max()                     # one bf16 rounding, fp32 sums
    if sk is None:       # no less accurate than torch's SDPA on the same bf16 inputs
        sdpa = F.scaled_dot_product_attention(q[None, :, None], k[None], v[None], scale=scale, enable_gqa=True)
        assert err.max() <= 2 * (sdpa[0, :, 0].float() - want).abs().max() + 1e-3


def _save(family: str, out, **over):
    """A tiny model of `family` with head_dim 32 (the kernel's smallest), bf16 on disk."""
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[family]
    for key, value in dict(head_dim=32, **over).items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(out)
    save_tokenizer(out)
    return out


def _decode(eng: Engine, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Each step's logits, greedy."""
    with torch.inference_mode():
        out, pkv = eng.forward(ids, None)
        logits = [out[0, -1].float()]
        for _ in range(steps):
            out, pkv = eng.forward(logits[-1].argmax().view(1, 1), pkv)
            logits.append(out[0, -1].float())
    return logits


@pytest.mark.parametrize("family,impl", [("mixtral", "moectl_cpu_sdpa"), ("gpt_oss", "moectl_cpu_eager")])
def test_engine_decode_takes_the_kernel_within_bf16_of_transformers(family, impl, tmp_path, monkeypatch, one_thread):
    """In the engine every decode token's attention goes through the kernel and each call's output is within bf16
    rounding of what transformers' own function (SDPA; GPT-OSS's eager, sinks and sliding window) computes from the
    same arguments; prefill stays transformers' (bit-identical logits). Whole-model logits are compared per call,
    not per token: a random tiny model's router flips an expert on a near tie, which moves a token's logits by more
    than any attention error."""
    ckpt = _save(family, tmp_path / family)
    eng = Engine.load(str(ckpt), device="cpu", dtype="bfloat16", threads=1, progress=False)
    assert eng.model.config._attn_implementation == impl
    fallback = attention_cpu.sdpa_or_kernel if impl.endswith("sdpa") else attention_cpu.eager_or_kernel
    calls, worst = [], [0.0]

    def checked(module, query, key, value, attention_mask, **kw):
        got, _ = fallback(module, query, key, value, attention_mask, **kw)
        if attention_cpu._kernel_fits(query, key, value, attention_mask, kw.get("dropout", 0.0), kw):
            with monkeypatch.context() as m:                     # the same call with the kernel out of reach
                m.setattr(attention_cpu, "_kernel_fits", lambda *a: False)
                want, _ = fallback(module, query, key, value, attention_mask, **kw)
            calls.append((module.layer_idx, key.shape[2], kw.get("s_aux") is not None))
            err = ((got.float() - want.float()).abs() / (want.float().abs().max() + 1e-6)).max()
            worst[0] = max(worst[0], float(err))
        return got, None

    from transformers import AttentionInterface

    AttentionInterface.register(impl, checked)
    try:
        ids = torch.randint(2, COMMON["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(1))
        got = _decode(eng, ids, 24)
    finally:
        attention_cpu._register()
    eng.model.set_attn_implementation(impl.removeprefix("moectl_cpu_"))       # transformers' attention throughout
    assert torch.equal(_decode(eng, ids, 0)[0], got[0])                       # prefill: transformers' function
    layers = COMMON["num_hidden_layers"]
    assert len(calls) == 24 * layers                                          # every layer of every decode token
    assert all(sinks == (family == "gpt_oss") for _, _, sinks in calls)
    # two bf16 outputs, each rounded once or more (GPT-OSS's eager rounds scores and softmax to bf16 too): measured
    # 0.007 and 0.008 of the largest output; GPT-OSS without its sinks was off by 0.05
    assert worst[0] <= 2 ** -6, worst[0]
    if family == "gpt_oss":      # the sliding layers' cache holds the window only, the full layers' grows
        window = family_configs()["gpt_oss"].sliding_window
        assert max(s for _, s, _ in calls) == 20 + 24 > window
        assert max(s for layer, s, _ in calls if eng.model.config.layer_types[layer] == "sliding_attention") == window


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_mask_that_masks_something_leaves_the_kernel(impl, tmp_path, monkeypatch):
    """A decode mask hiding a position (a padded batch row, a static cache's empty tail): transformers' function,
    bit-identical, the kernel untouched."""
    ckpt = _save("mixtral" if impl == "sdpa" else "gpt_oss", tmp_path / impl)
    eng = Engine.load(str(ckpt), device="cpu", dtype="bfloat16", threads=1, progress=False)
    module = eng.model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    H, KV, D, S = module.config.num_attention_heads, module.config.num_key_value_heads, 32, 12
    q, k, v = (torch.randn(1, n, s, D, generator=g).bfloat16() for n, s in ((H, 1), (KV, S), (KV, S)))
    kw = dict(scaling=D ** -0.5)
    if impl == "eager":
        kw["s_aux"] = module.sinks
        mask = torch.zeros(1, 1, 1, S, dtype=torch.bfloat16)
        mask[..., :3] = torch.finfo(torch.bfloat16).min
        ours, theirs = attention_cpu.eager_or_kernel, sys.modules[type(module).__module__].eager_attention_forward
    else:
        mask = torch.ones(1, 1, 1, S, dtype=torch.bool)
        mask[..., :3] = False
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as theirs

        ours = attention_cpu.sdpa_or_kernel
    monkeypatch.setattr(ops, "decode_attention", lambda *a: pytest.fail("the kernel despite the mask"))
    with torch.inference_mode():
        got, want = ours(module, q, k, v, mask, **kw)[0], theirs(module, q, k, v, mask, **kw)[0]
        assert torch.equal(got, want)
        assert attention_cpu._kernel_fits(q, k, v, torch.zeros_like(mask) if impl == "eager" else mask | True, 0.0,
                                          {})


def test_no_kernels_leaves_the_model_alone(tmp_path, monkeypatch):
    ckpt = _save("mixtral", tmp_path / "m")
    monkeypatch.setattr(kernels, "library", lambda: None)
    eng = Engine.load(str(ckpt), device="cpu", dtype="bfloat16", threads=1, progress=False)
    assert eng.model.config._attn_implementation == "sdpa"
    assert attention_cpu.cpu_attention(eng.model) is None

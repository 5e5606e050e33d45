"""The dense model's Linears on the CPU (moectl/models/dense_cpu.py): the one-row GEMV swap is lossless, and
`--dense-lowbit q8` quantizes the attention and lm_head (lossy, reported), with clear errors where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moectl import kernels
from moectl.errors import MoectlError
from moectl.formats import vnni
from moectl.models.dense_cpu import GemvLinear, Int8DenseLinear, VnniDenseLinear, check_dense_lowbit, cpu_linears
from moectl.runtime.engine import Engine
from test_cpu_q8 import mixtral_q8, one_thread  # noqa: F401 (fixtures)
from test_bad_input import assert_one_error, run_cli
from test_quantize import _decode


@pytest.fixture(scope="module")
def mixtral(mixtral_q8):
    return mixtral_q8[0]


def test_gemv_swap_keeps_the_module_and_its_products():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    counts = cpu_linears(model)
    assert counts["gemv"] == 2 and counts["int8"] == 0
    assert all(type(m) is GemvLinear for m in model)
    assert model.state_dict().keys() == ref.keys() and all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        want = F.linear(F.linear(x, ref["0.weight"], ref["0.bias"]), ref["1.weight"])
        got = model(x)
        if rows > 1:
            assert torch.equal(got, want)                                         # the same call
        else:
            assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()


@pytest.mark.parametrize("path", ["moectl-kernels", "torch-int8"])
def test_dense_lowbit_q8_quantizes_attention_and_lm_head_and_says_so(mixtral, path, monkeypatch):
    """q8: attention and lm_head q8g64 through moectl's kernels where they build, else int8 per row through torch's
    kernel; said in lossy(), the same model within q8 noise."""
    if path == "moectl-kernels" and kernels.library() is None:
        pytest.skip(f"moectl's CPU kernels cannot run here: {kernels.why_not()}")
    if path == "torch-int8":
        monkeypatch.setattr(kernels, "library", lambda: None)
    want = VnniDenseLinear if path == "moectl-kernels" else Int8DenseLinear
    kw = dict(progress=False, dtype="bfloat16", threads=1)
    base = Engine.load(str(mixtral), **kw)
    eng = Engine.load(str(mixtral), dense_lowbit="q8", **kw)
    hf = eng.model
    kinds = {n: type(m) for n, m in hf.named_modules()}
    assert kinds["lm_head"] is want and kinds["model.layers.0.self_attn.q_proj"] is want
    assert GemvLinear not in {kinds[n] for n in kinds if ".self_attn." in n or n == "lm_head"}
    assert all(kinds[n] is not want for n in kinds if n.endswith("embed_tokens"))
    assert eng.lossy()["dense_lowbit"] == "q8" and "dense_lowbit" not in base.lossy()
    a, b = _decode(base).float(), _decode(eng).float()
    assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * a.abs().max()   # q8 noise, the same model


@pytest.mark.skipif(kernels.library() is None, reason="moectl's CPU kernels cannot run here")
def test_dense_lowbit_q4_is_llamacpps_q4_0_mix(mixtral):
    """q4: attention projections q4g64 through moectl's q4 kernel, the lm_head q6g64 (llama.cpp's Q4_0 files keep
    the output tensor at Q6_K); fewer bytes than q8, said in lossy(), the same model within q4 noise, the lm_head's
    error between q8's and q4's."""
    kw = dict(progress=False, dtype="bfloat16", threads=1)
    base, q8 = Engine.load(str(mixtral), **kw), Engine.load(str(mixtral), dense_lowbit="q8", **kw)
    eng = Engine.load(str(mixtral), dense_lowbit="q4", **kw)
    mods = dict(eng.model.named_modules())
    assert isinstance(mods["model.layers.0.self_attn.q_proj"], VnniDenseLinear)
    assert mods["model.layers.0.self_attn.q_proj"].bits == 4 and mods["lm_head"].bits == 6
    assert eng.lossy()["dense_lowbit"] == "q4"
    attn = [(n, m) for n, m in mods.items() if isinstance(m, VnniDenseLinear) and m.bits == 4]
    attn_q8 = dict(q8.model.named_modules())
    nbytes = lambda m: sum(b.nbytes for b in m.buffers())  # noqa: E731
    assert attn and all(nbytes(m) < 0.6 * nbytes(attn_q8[n]) for n, m in attn)
    a, b, c = _decode(base).float(), _decode(eng).float(), _decode(q8).float()
    err_q4, err_q8 = (a - b).norm() / a.norm(), (a - c).norm() / a.norm()
    assert err_q8 < err_q4 < 0.2                                                  # q4 noise > q8's, the same model
    assert nbytes(mods["lm_head"]) < 0.85 * nbytes(attn_q8["lm_head"])
    w = base.model.lm_head.weight.float()
    errs = {b: (vnni.dequantize(*vnni.quantize_rtn(w.bfloat16(), bits=b), *w.shape).float() - w).norm() / w.norm()
            for b in (4, 6, 8)}
    assert errs[8] < errs[6] < errs[4] / 3                                       # 6 bits: ~4x finer than 4


def test_dense_lowbit_clear_errors(mixtral, capsys, monkeypatch):
    with pytest.raises(MoectlError, match="--device cpu --dtype bfloat16"):
        check_dense_lowbit("q8", torch.device("cpu"), torch.float32)
    with pytest.raises(MoectlError, match="choose q8 or q4"):
        check_dense_lowbit("q2", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.setattr(kernels, "why_not", lambda: "this CPU lacks avx512_vnni")
    with pytest.raises(MoectlError, match="q4 needs moectl's CPU kernels.*lacks avx512_vnni"):
        check_dense_lowbit("q4", torch.device("cpu"), torch.bfloat16)
    monkeypatch.undo()
    check_dense_lowbit(None, torch.device("cuda"), torch.float32)                 # not asked: nothing to check
    code, _, err = run_cli(["generate", "--model", str(mixtral), "--dense-lowbit", "q8", "--prompt", "hi", "-n", "1",
                            "--threads", "1"], capsys, monkeypatch)
    assert_one_error(code, err, "--dense-lowbit q8", "float32")


def test_one_token_cpu_forward_runs_with_onednn_off_and_restores_it(mixtral, monkeypatch):
    """Engine.forward of one token on a CPU turns oneDNN off for the step (the routers' own F.linear then takes the
    native GEMV) and back on after, also when the step fails; a prompt keeps oneDNN (its GEMMs are oneDNN's)."""
    from moectl.kernels import gemv

    seen = []
    eng = Engine.load(str(mixtral), progress=False, dtype="bfloat16", threads=1)
    real = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda **kw: (seen.append(torch._C._get_mkldnn_enabled()), real(**kw))[1])
    assert torch._C._get_mkldnn_enabled()
    _, pkv = eng.forward(torch.tensor([[1, 2, 3]]), None)
    eng.forward(torch.tensor([[4]]), pkv)
    assert seen == [True, False] and torch._C._get_mkldnn_enabled()
    with pytest.raises(RuntimeError, match="boom"), gemv.native_one_row():
        raise RuntimeError("boom")
    assert torch._C._get_mkldnn_enabled()

"""The dense model's Linears on the CPU (moectl/models/dense_cpu.py): the one-row GEMV swap is lossless, and
`--dense-lowbit q8|q4` quantizes the attention and lm_head (lossy, reported) through moectl's kernels, ggml's blocks
where those cannot run, or torch's int8 kernel where neither can, with clear errors where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moectl import kernels
from moectl.errors import MoectlError
from moectl.formats import vnni
from moectl.formats.gguf_dequant import dequantize
from moectl.formats.gguf_encodings import T
from moectl.kernels import ggml
from moectl.models.dense_cpu import (GemvLinear, GgmlDenseLinear, Int8DenseLinear, VnniDenseLinear, check_dense_lowbit,
                                     cpu_linears, ggml_encoding)
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


def _take_path(path: str, monkeypatch) -> None:
    """The kernels `--dense-lowbit` finds: moectl's (skipped where they cannot run), ggml's where moectl's are absent
    (skipped where ggml cannot be built), torch's int8 where neither runs."""
    if path == "moectl-kernels" and kernels.library() is None:
        pytest.skip(f"moectl's CPU kernels cannot run here: {kernels.why_not()}")
    if path == "ggml" and ggml.library() is None:
        pytest.skip(f"ggml cannot run here: {ggml.why_not()}")
    if path != "moectl-kernels":
        monkeypatch.setattr(kernels, "library", lambda: None)
    if path == "torch-int8":
        monkeypatch.setenv("MOECTL_GGML", "0")


@pytest.mark.parametrize("path", ["moectl-kernels", "ggml", "torch-int8"])
def test_dense_lowbit_q8_quantizes_attention_and_lm_head_and_says_so(mixtral, path, monkeypatch):
    """q8: attention and lm_head q8g64 through moectl's kernels where they run, else ggml's Q8_0 blocks, else int8
    per row through torch's kernel; said in lossy(), the same model within q8 noise."""
    _take_path(path, monkeypatch)
    want = {"moectl-kernels": VnniDenseLinear, "ggml": GgmlDenseLinear, "torch-int8": Int8DenseLinear}[path]
    kw = dict(progress=False, dtype="bfloat16", threads=1)
    base = Engine.load(str(mixtral), **kw)
    eng = Engine.load(str(mixtral), dense_lowbit="q8", **kw)
    hf = eng.model
    kinds = {n: type(m) for n, m in hf.named_modules()}
    assert kinds["lm_head"] is want and kinds["model.layers.0.self_attn.q_proj"] is want
    assert GemvLinear not in {kinds[n] for n in kinds if ".self_attn." in n or n == "lm_head"}
    assert all(kinds[n] is not want for n in kinds if n.endswith("embed_tokens"))
    if path == "ggml":
        assert {m.encoding for m in hf.modules() if isinstance(m, GgmlDenseLinear)} == {int(T.Q8_0)}
    assert eng.lossy()["dense_lowbit"] == "q8" and "dense_lowbit" not in base.lossy()
    a, b = _decode(base).float(), _decode(eng).float()
    assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * a.abs().max()   # q8 noise, the same model


@pytest.mark.parametrize("path", ["moectl-kernels", "ggml"])
def test_dense_lowbit_q4_is_llamacpps_q4_0_mix(mixtral, path, monkeypatch):
    """q4: attention projections q4g64 through moectl's q4 kernel, the lm_head q6g64 (llama.cpp's Q4_0 files keep
    the output tensor at Q6_K); where moectl's kernels cannot run, ggml's Q4_0 and (this model's 64-wide lm_head is
    not whole Q6_K blocks) Q8_0, llama-quantize's fallback. Fewer bytes than q8, said in lossy(), the same model
    within q4 noise, the lm_head's error between q8's and q4's."""
    _take_path(path, monkeypatch)
    kw = dict(progress=False, dtype="bfloat16", threads=1)
    base, q8 = Engine.load(str(mixtral), **kw), Engine.load(str(mixtral), dense_lowbit="q8", **kw)
    eng = Engine.load(str(mixtral), dense_lowbit="q4", **kw)
    mods = dict(eng.model.named_modules())
    assert eng.lossy()["dense_lowbit"] == "q4"
    nbytes = lambda m: sum(b.nbytes for b in m.buffers())  # noqa: E731
    attn_q8 = dict(q8.model.named_modules())
    a, b, c = _decode(base).float(), _decode(eng).float(), _decode(q8).float()
    err_q4, err_q8 = (a - b).norm() / a.norm(), (a - c).norm() / a.norm()
    assert err_q8 < err_q4 < 0.2                                                  # q4 noise > q8's, the same model
    if path == "ggml":
        attn = [(n, m) for n, m in mods.items() if ".self_attn." in n and isinstance(m, GgmlDenseLinear)]
        assert len(attn) == 4 * 4 and all(m.encoding == T.Q4_0 for _, m in attn)
        assert isinstance(mods["lm_head"], GgmlDenseLinear) and mods["lm_head"].encoding == T.Q8_0
        assert all(nbytes(m) < 0.6 * nbytes(attn_q8[n]) for n, m in attn)      # Q4_0: 18 bytes / 32, Q8_0: 34
        return
    assert isinstance(mods["model.layers.0.self_attn.q_proj"], VnniDenseLinear)
    assert mods["model.layers.0.self_attn.q_proj"].bits == 4 and mods["lm_head"].bits == 6
    attn = [(n, m) for n, m in mods.items() if isinstance(m, VnniDenseLinear) and m.bits == 4]
    assert attn and all(nbytes(m) < 0.6 * nbytes(attn_q8[n]) for n, m in attn)
    assert nbytes(mods["lm_head"]) < 0.85 * nbytes(attn_q8["lm_head"])
    w = base.model.lm_head.weight.float()
    errs = {b: (vnni.dequantize(*vnni.quantize_rtn(w.bfloat16(), bits=b), *w.shape).float() - w).norm() / w.norm()
            for b in (4, 6, 8)}
    assert errs[8] < errs[6] < errs[4] / 3                                       # 6 bits: ~4x finer than 4


def test_ggml_encoding_is_llamacpps_file_mix():
    """q8: Q8_0; q4: attention Q4_0, lm_head Q6_K where its rows are whole 256-wide blocks, else Q8_0 (as
    llama-quantize); rows not whole 32-wide blocks: none (the matrix stays as it is or goes to torch's int8)."""
    assert ggml_encoding("q8", False, 64) == ggml_encoding("q8", True, 4096) == T.Q8_0
    assert ggml_encoding("q4", False, 64) == T.Q4_0
    assert ggml_encoding("q4", True, 4096) == T.Q6_K and ggml_encoding("q4", True, 2080) == T.Q8_0
    assert ggml_encoding("q4", False, 80) is None and ggml_encoding("q8", True, 80) is None


@pytest.mark.skipif(ggml.library() is None, reason="ggml cannot run here")
@pytest.mark.parametrize("encoding, rel", [(T.Q8_0, 0.01), (T.Q6_K, 0.02), (T.Q4_0, 0.12)])
def test_ggml_dense_linear_is_its_blocks_times_x(encoding, rel):
    """GgmlDenseLinear's y = x W^T equals x times its own blocks dequantised (within the error of x's q8
    quantization, llama.cpp's recipe), its blocks are W within the encoding's noise (Q8_0 < Q6_K < Q4_0), and the
    bias is added; 1 and 5 rows."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(256, 96).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(96, generator=g))
    q = GgmlDenseLinear(lin, int(encoding), "w")
    w = lin.weight.float()
    deq = dequantize(torch.from_numpy(q.matrix.data.reshape(-1)), int(encoding), (96, 256), torch.float32, "w")
    werr = ((deq - w).norm() / w.norm()).item()
    assert 0 < werr < rel
    assert sum(b.nbytes for b in q.buffers()) == 96 * ggml.require().mg_row_size(int(encoding), 256)
    for rows in (1, 5):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        got = q(x).float() - lin.bias.float()
        want = x.float() @ deq.T
        assert got.shape == (rows, 96) and (got - want).norm() / want.norm() < 0.02     # x quantized to q8 per block
        exact = x.float() @ w.T
        assert (got - exact).norm() / exact.norm() < rel + 0.02


@pytest.mark.skipif(ggml.library() is None, reason="ggml cannot run here")
@pytest.mark.parametrize("encoding", [T.Q4_0, T.Q6_K, T.Q8_0])
def test_ggml_quantize_a_chunk_of_rows_at_a_time_gives_the_same_bytes(encoding):
    """ggml quantizes each row on its own: a bf16 W through fp32 7 rows at a time (the last chunk short) gives the
    bytes of W quantized whole in fp32 (`ggml.quantize`'s bounded transient: a Qwen3 lm_head is not copied whole)."""
    w = (torch.randn(45, 256, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    whole = ggml.quantize(int(encoding), w.float(), rows_at_a_time=1 << 30)
    chunked = ggml.quantize(int(encoding), w, rows_at_a_time=7)
    assert chunked.shape == whole.shape == (45, ggml.require().mg_row_size(int(encoding), 256))
    assert (chunked == whole).all()


def test_cpu_linears_frees_the_bf16_weights_it_replaces(monkeypatch):
    """--dense-lowbit: each replaced Linear's bf16 weight is gone once its low-bit module exists (held by nothing:
    a weak reference dies), even where something else still holds the old Linear; the GEMV-swapped ones (the
    router here) and a weight tied to the embedding keep theirs; the counts and bytes are said."""
    import gc
    import weakref

    if kernels.library() is None and ggml.library() is None:
        pytest.skip("neither moectl's kernels nor ggml run here: q4 has no low-bit module")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.q_proj = nn.Linear(256, 256, bias=False)
            self.self_attn.o_proj = nn.Linear(256, 256, bias=False)
            self.gate = nn.Linear(256, 8, bias=False)

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    model.embed = nn.Embedding(512, 256)
    model.lm_head = nn.Linear(256, 512, bias=False)
    model.lm_head.weight = model.embed.weight                              # tied
    model.to(torch.bfloat16)
    replaced = [model.layers[i].self_attn.get_submodule(n) for i in range(2) for n in ("q_proj", "o_proj")]
    gone = [weakref.ref(m.weight) for m in replaced]
    kept_router = model.layers[0].gate.weight
    out = cpu_linears(model, "q4")
    gc.collect()
    assert all(r() is None for r in gone)                 # `replaced` still holds the old Linears: not their weights
    assert all(m.weight is None for m in replaced)
    assert model.layers[0].gate.weight is kept_router and type(model.layers[0].gate) is GemvLinear
    assert model.embed.weight.dtype == torch.bfloat16 and model.embed.weight.shape == (512, 256)
    assert out["gemv"] == 2 and out["bytes_before"] == 4 * 256 * 256 * 2 + 512 * 256 * 2
    assert sum(out[k] for k in ("q4", "q6", "q8", "Q4_0", "Q6_K", "Q8_0", "int8")) == 5
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("q_proj.weight", "o_proj.weight", "lm_head.weight")) for n in names)


def test_dense_lowbit_clear_errors(mixtral, capsys, monkeypatch):
    with pytest.raises(MoectlError, match="--device cpu --dtype bfloat16"):
        check_dense_lowbit("q8", torch.device("cpu"), torch.float32)
    with pytest.raises(MoectlError, match="choose q8 or q4"):
        check_dense_lowbit("q2", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.setattr(kernels, "why_not", lambda: "this CPU lacks avx512_vnni")
    monkeypatch.setenv("MOECTL_GGML", "0")
    with pytest.raises(MoectlError, match="q4 needs moectl's CPU kernels or ggml's.*lacks avx512_vnni; MOECTL_GGML=0"):
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

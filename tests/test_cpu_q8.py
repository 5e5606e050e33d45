"""The q8 CPU kernel path (moectl/formats/int8_cpu.py): q8 copies requantized per output row at load, multiplied by
torch's int8 kernel; lossless against the dequantised per-row copy, the requantization bounded by half a step."""

from __future__ import annotations

import pytest
import torch

from moectl.formats import int8_cpu
from moectl.formats.int8_cpu import Int8CpuFormat, Int8Linear, dequantize, requantize
from moectl.quant.quantize import quantize_model
from moectl.runtime.engine import Engine
from moectl.store import lowbit
from model_factory import build_family, save_tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def mixtral_q8(tmp_path_factory):
    d = tmp_path_factory.mktemp("q8") / "mixtral"
    build_family("mixtral", d)
    save_tokenizer(d)
    wd = tmp_path_factory.mktemp("q8wd")
    quantize_model(str(d), 8, 64, 1, workdir=str(wd), progress=False, method="rtn")
    return d, wd


def test_requantize_is_within_half_a_step_per_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.02
    w[5] = 0                                                                     # an all-zero row
    w0 = w.clone()
    codes, scale = requantize(w, rows=32)                                        # blocks of rows: 96 = 3 x 32
    assert torch.equal(w, w0)                                                    # the input is left alone
    assert codes.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (96,)
    assert codes.abs().max() == 127 and scale[5] == 1 and not codes[5].any()
    err = (w - codes.float() * scale.float()[:, None]).abs()
    assert (err <= scale.float()[:, None] / 2 + 1e-9).all()                      # round to nearest, no clamping
    assert (scale.float() >= w.abs().amax(1) / 127).all()                        # rounded up to a bf16


@pytest.mark.parametrize("rows", [1, 3, int8_cpu.ROWS_KERNEL - 1, int8_cpu.ROWS_KERNEL])
def test_int8_linear_is_lossless_against_its_dequantised_matrix(rows):
    """Both paths (the int8 kernel below ROWS_KERNEL rows, dequantise + bf16 GEMM from it on) equal x @ W^T of the
    dequantised codes computed in fp32, up to the bf16 rounding of the output (and of W on the GEMM path)."""
    g = torch.Generator().manual_seed(1)
    codes, scale = requantize(torch.randn(80, 192, generator=g) * 0.02)
    x = torch.randn(2, rows, 192, generator=g).bfloat16()                        # [B, T, K]: leading dims kept
    y = Int8Linear(codes, scale)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, rows, 80)
    ref = x.float() @ (codes.float() * scale.float()[:, None]).T
    assert (y.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    assert torch.equal(dequantize(codes, scale), (codes.float() * scale.float()[:, None]).bfloat16())


def test_q8_copies_take_moectls_kernel_where_it_builds(mixtral_q8, monkeypatch):
    """Where moectl's CPU kernels build, q8g64 copies are repacked for them (VnniFormat: the copy's own codes, scales
    and zeros, no per-row requantization); the logits differ from HQQ's dequantise-then-matmul of the same copies
    only by the int8 activations (what llama.cpp's Q8_0 x Q8_0 products do), of the order of the copy's own error."""
    from moectl import kernels
    from moectl.formats.vnni import VnniFormat
    from test_quantize import _decode

    if kernels.library() is None:
        pytest.skip(f"moectl's CPU kernels cannot run here: {kernels.why_not()}")
    d, wd = mixtral_q8
    kw = dict(workdir=str(wd), lowbit="q8g64", precision="lowbit-only", progress=False, dtype="bfloat16",
              threads=1)
    eng = Engine.load(str(d), **kw)
    assert isinstance(eng.store.lowbit.format, VnniFormat)
    assert eng.store.lowbit.expert_nbytes < 0.54 * eng.store.expert_nbytes          # 8 bits + 2 bf16 per 64
    fast = _decode(eng)
    lossless = _decode(Engine.load(str(d), workdir=str(wd), progress=False, dtype="bfloat16", threads=1))
    monkeypatch.setattr(lowbit, "cpu_kernel_format", lambda fmt: None)           # HQQ's q8g64, dequantised per use
    hqq = _decode(Engine.load(str(d), **kw))
    assert not torch.equal(fast, hqq)                                              # the int8 activations
    assert (fast - lossless).abs().max() <= 3 * (hqq - lossless).abs().max()      # ~8-bit noise on both sides


def test_q8_copies_take_torchs_int8_kernel_and_match_its_reference(mixtral_q8, monkeypatch):
    """Where moectl's kernels do not run, a bf16 model's q8g64 copies are repacked at load for torch's int8 kernel
    (Int8CpuFormat); its decode logits equal the same copies computed through the dequantised matrices (the kernel
    switched off), up to bf16 rounding, and stay close to the lossless run (q8 error, requantized)."""
    from moectl.formats import cpu_layout as cpu_kernels
    from test_quantize import _decode

    monkeypatch.setattr(cpu_kernels, "vnni_ok", lambda fmt: False)

    d, wd = mixtral_q8
    kw = dict(workdir=str(wd), lowbit="q8g64", precision="lowbit-only", progress=False, dtype="bfloat16",
              threads=1)
    eng = Engine.load(str(d), **kw)
    assert isinstance(eng.store.lowbit.format, Int8CpuFormat)
    assert eng.store.lowbit.expert_nbytes < 0.52 * eng.store.expert_nbytes          # int8 + a scale per row
    fast = _decode(eng)
    monkeypatch.setattr(int8_cpu, "ROWS_KERNEL", 0)                               # every product dequantised
    ref = _decode(eng)
    lossless = _decode(Engine.load(str(d), workdir=str(wd), progress=False, dtype="bfloat16", threads=1))
    scale = ref.abs().max()
    assert (fast - ref).abs().max() <= 0.02 * scale                               # bf16 rounding only
    monkeypatch.setattr(lowbit, "cpu_kernel_format", lambda fmt: None)           # HQQ's q8g64, dequantised per use
    hqq = _decode(Engine.load(str(d), **kw))
    print(f"max |logit diff| kernel-ref {(fast - ref).abs().max():.4f} hqq-lossless {(hqq - lossless).abs().max():.4f}"
          f" kernel-lossless {(fast - lossless).abs().max():.4f} kernel-hqq {(fast - hqq).abs().max():.4f}")
    assert (fast - lossless).abs().max() <= 3 * (hqq - lossless).abs().max()      # the second rounding: same order


def test_in_place_decode_fuses_a_layers_experts_bit_for_bit(mixtral_q8, monkeypatch):
    """In place at lowbit-only, a decode token's experts of a layer go through one fused call
    (`ops.experts_decode`), with the logits of the expert-by-expert path; prefill keeps the batched path."""
    from moectl import kernels
    from moectl.kernels import ops
    from moectl.runtime.offloaded import OffloadedExperts
    from test_quantize import _decode

    if kernels.library() is None:
        pytest.skip(f"moectl's CPU kernels cannot run here: {kernels.why_not()}")
    d, wd = mixtral_q8
    eng = Engine.load(str(d), workdir=str(wd), lowbit="q8g64", precision="lowbit-only", progress=False,
                      dtype="bfloat16", threads=1)
    blocks = [m for m in eng.model.modules() if isinstance(m, OffloadedExperts)]
    assert blocks and all(b.fusable for b in blocks)
    calls = []
    real = ops.experts_decode
    monkeypatch.setattr(ops, "experts_decode", lambda x, ex, w: calls.append(len(ex)) or real(x, ex, w))
    fused = _decode(eng)
    assert calls and set(calls) == {eng.config.num_experts_per_tok}
    n = len(calls)
    for b in blocks:
        b.fusable = False
    assert torch.equal(_decode(eng), fused) and len(calls) == n

"""moectl's own CPU kernels (moectl/kernels/cpu_kernels.cpp) against torch references: the q4 layout's packing,
the int8 activations, the q4 x int8 product, the dequantisation and the bf16 GEMV; and the way they turn off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moectl import kernels

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"kernels cannot run: {kernels.why_not()}")

from moectl.kernels import ops  # noqa: E402
from moectl.formats import vnni  # noqa: E402

GEN = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def two_threads():
    was = torch.get_num_threads()
    torch.set_num_threads(2)                  # the row split across threads is part of what runs
    yield
    torch.set_num_threads(was)


def _lowbit(N: int, K: int, bits: int = 4, group: int = 64):
    """Random codes [N, K] and per-group bf16 (scale, zero') [N, K / group]."""
    q = torch.randint(0, 1 << bits, (N, K), dtype=torch.uint8, generator=GEN)
    scale = (torch.rand(N, K // group, generator=GEN) * 0.02 / (1 << (bits - 4)) + 0.001).bfloat16()
    zero = (torch.rand(N, K // group, generator=GEN) * 15 - 7) * scale.float()
    return q, scale, zero.bfloat16()


def _exact(q, scale, zero, group, bits=4):
    """W [N, K] float64 from codes and per-group values: w = (q - C) scale + zero'."""
    return ((q.double() - (1 << (bits - 1))) * scale.double().repeat_interleave(group, 1)
            + zero.double().repeat_interleave(group, 1))


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("N,K", [(16, 64), (5, 192), (37, 320), (70, 4096)])
def test_packing_round_trips_whatever_the_shape(N, K, bits):
    q, scale, zero = _lowbit(N, K, bits)
    codes = vnni.pack_codes(q, bits)
    assert codes.shape == (-(-N // 16), K // 64, 128 * bits)
    assert torch.equal(vnni.unpack_codes(codes, N, K), q)
    sm = vnni.pack_scales(scale, zero, K)
    assert sm.shape == (-(-N // 16), K // 64, 2, 16)
    assert all(torch.equal(a, b) for a, b in zip(vnni.unpack_scales(sm, N, K), (scale, zero)))
    w = vnni.dequantize(codes, sm, N, K)
    assert torch.equal(w, _exact(q, scale, zero, 64, bits).float().bfloat16())


def test_activations_are_int8_per_block_of_64_within_half_a_step():
    x = (torch.randn(3, 320, generator=GEN) * torch.linspace(0.1, 10, 320)).bfloat16()
    aq, d, xs = ops.q8_act(x)
    a = aq.float().view(3, 5, 64)
    xf = x.float().view(3, 5, 64)
    assert torch.allclose(d, xf.abs().amax(-1) / 127)
    assert ((a * d[..., None] - xf).abs() <= d[..., None] / 2 * (1 + 1e-5)).all()
    assert torch.allclose(xs, (a * d[..., None]).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("N,K,group,bits", [(70, 4096, 64, 4), (48, 192, 64, 4), (33, 512, 128, 4),
                                            (70, 4096, 64, 6), (33, 192, 64, 6),
                                            (70, 4096, 64, 8), (33, 192, 64, 8)])
def test_lowbit_product_is_exact_for_its_int8_activations(M, N, K, group, bits):
    """The product equals, up to fp32 sums and the output's bf16 rounding, the copy's exact weights times the very
    activations the kernel quantized (so the only loss is the int8 step, bounded in the test above); row counts
    that are not a multiple of 16 and token counts past one pass (8) included."""
    q, scale, zero = _lowbit(N, K, bits, group)
    codes, sm = vnni.pack_codes(q, bits), vnni.pack_scales(scale, zero, K)
    x = torch.randn(M, K, generator=GEN).bfloat16()
    aq, d, _ = ops.q8_act(x)
    xq = aq.double() * d.double().repeat_interleave(64, 1)
    w = _exact(q, scale, zero, group, bits)
    want = xq @ w.t()
    got = vnni.VnniLinear(codes, sm, N)(x).double()
    assert got.shape == (M, N)
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all()
    loss = (got - x.double() @ w.t()).norm() / want.norm()
    assert loss < 0.02                                                  # the int8 step, for scale


@pytest.mark.parametrize("N", [70, 3, 1000])
def test_bf16_gemv_sums_exact_products_in_fp32(N):
    """One row: the kernel's output is the fp64 product rounded once to bf16, up to fp32 sums; `gemv.linear` (the
    runtime's one-row path, dense and experts) takes it for bf16."""
    from moectl.kernels import gemv

    w = torch.randn(N, 4096, generator=GEN).bfloat16()
    x = torch.randn(1, 4096, generator=GEN).bfloat16()
    want = (x.double() @ w.double().t())[0]
    got = ops.bf16_gemv(x[0], w).double()
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-4).all()
    assert torch.equal(gemv.linear(x, w)[0], ops.bf16_gemv(x[0], w))


@pytest.mark.parametrize("bits", [4, 6])
def test_quantize_rtn_is_hqqs_round_to_nearest(bits):
    from hqq.core.quantize import Quantizer

    w = torch.randn(300, 256, generator=GEN).bfloat16()
    codes, sm = vnni.quantize_rtn(w, bits=bits, rows=128)           # three row blocks
    W_q, meta = Quantizer.quantize(w, nbits=bits, group_size=64, axis=1, optimize=False, bitpack=False,
                                   compute_dtype=torch.float32, device="cpu")
    assert torch.equal(vnni.unpack_codes(codes, 300, 256), W_q.view(300, 256).to(torch.uint8))
    ref = Quantizer.dequantize(W_q, meta).view(300, 256)
    err = (vnni.dequantize(codes, sm, 300, 256).float() - ref).abs().max()
    assert err <= 0.02 * ref.abs().max() / (1 << (bits - 4))        # bf16 scales and zeros: smaller at q6
    assert (vnni.dequantize(codes, sm, 300, 256).float() - w.float()).abs().max() <= \
        0.6 * w.float().abs().max() / ((1 << bits) - 1) * 2        # within ~half a step of a group's range


def test_switched_off_says_why():
    code = "from moectl import kernels; print(kernels.library() is None, kernels.why_not())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "MOECTL_CPU_KERNELS": "0"}).stdout
    assert out.strip() == "True MOECTL_CPU_KERNELS=0"


@pytest.mark.parametrize("bits", [4, 8])
def test_experts_decode_is_the_composed_torch_path_bit_for_bit(bits):
    """One fused call (q8 activations once, SiLU gating, the weighted bf16 sum in the order given) equals the torch
    operations the runtime composes otherwise, bit for bit: I = 200 leaves a SiLU tail (torch's scalar path) and a
    padded activation block."""
    H, I, weights = 128, 200, [0.61, 0.25, 0.14]
    experts = []
    for _ in weights:
        (gq, gs, gz), (dq, ds, dz) = _lowbit(2 * I, H, bits), _lowbit(H, I, bits)
        experts.append((vnni.VnniLinear(vnni.pack_codes(gq, bits), vnni.pack_scales(gs, gz, H), 2 * I),
                        vnni.VnniLinear(vnni.pack_codes(dq, bits), vnni.pack_scales(ds, dz, I), H)))
    x = torch.randn(1, H, generator=GEN).bfloat16()
    want = torch.zeros(1, H, dtype=torch.bfloat16)
    for (gu, dn), w in zip(experts, weights):
        gate, up = gu(x).chunk(2, -1)
        want = want + (dn(torch.nn.functional.silu(gate) * up) * torch.tensor(w)).to(torch.bfloat16)
    got = ops.experts_decode(x, experts, weights)
    assert got.shape == (1, H) and torch.equal(got, want)
    assert not torch.equal(ops.experts_decode(x, experts[::-1], weights[::-1]), torch.zeros_like(want))

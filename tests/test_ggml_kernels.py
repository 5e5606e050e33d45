"""ggml's CPU backend as moectl's GGUF expert kernel (moectl/kernels/ggml.py): every encoding ggml computes equals
`gguf.quants.dequantize` followed by an fp32 matmul, within the activation quantization llama.cpp itself does.

Legend: T = tokens, K = input width, N = output rows, A = stacked experts, U = experts used per token.

The tolerance, derived: ggml quantizes x per block to its vec_dot type before the dot products (q8_0: d = max|x|/127
stored as fp16, q = round(x/d); q8_1: the same plus s = fp16(d * sum q) for the weights' minimum; q8_K: d = 1/(-127/max)
in fp32 over 256; f16/bf16 weights: x rounded to f16/bf16; f32: none). So
  (1) emulating that quantization (x_hat) in numpy, ggml's y equals dequantize(W) @ x_hat up to fp32 summation
      (2e-5 of |W| @ |x_hat|): ggml computes exactly "the file's weights times llama.cpp's quantized x";
  (2) against the unquantized x, |y - dequantize(W) @ x| <= |W| @ e + 2e-5 |W| @ |x|, with e per element the
      quantization's bound: q8_0 d (1/2 + 127 * 2^-10) (rounding, plus the fp16 scale), q8_K d/2 (1 + 1e-6), f16
      |x| 2^-11, bf16 |x| 2^-8; q8_1 adds |m| |s| 2^-11 per block (the fp16 sum).
Weights are quantized by ggml's own quantizer (`ggml_quantize_chunk`: every type, IQ ones with a flat importance
matrix where they need one), so the blocks are the ones llama-quantize writes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from moectl.kernels import ggml

FLOATS = (T.F32, T.F16, T.BF16)
ENCODINGS = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.Q2_K, T.Q3_K, T.Q4_K,
             T.Q5_K, T.Q6_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.IQ4_NL, T.IQ4_XS,
             T.TQ1_0, T.TQ2_0)
Q8_0, Q8_1, Q8_K = 8, 9, 15                     # ggml_type codes of the activation encodings


@pytest.fixture(scope="module", autouse=True)
def lib():
    if ggml.library() is None:
        why = ggml.why_not()
        if "no cmake" in why or "no C/C++ compiler" in why:
            pytest.skip(why)
        pytest.fail(f"ggml could not be built or loaded: {why}")
    return ggml.library()


def weights(enc: T, N: int, K: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(the encoding's bytes [N, row bytes] as ggml's quantizer writes them, their dequantisation [N, K] fp32 by
    gguf's reference)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    raw = ggml.quantize(enc, w)
    deq = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, enc), dtype=np.float32)).reshape(N, K)
    return raw, deq


def activation(x: torch.Tensor, enc: T, raw: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat: x [T, K] as ggml quantizes it against weights in `enc`, e: the per-element bound of |x - x_hat|).
    Q8_1 (Q4_1, Q5_1 weights): x_hat holds fp16(d) q; its fp16 block sum enters through `q8_1_correction`."""
    vt = ggml.vec_dot_type(enc)
    xn = x.double().numpy()
    Tn, K = xn.shape
    if vt == int(T.F32):
        return x.double(), torch.zeros_like(x.double())
    if vt == int(T.F16):
        return x.half().double(), x.double().abs() * 2.0 ** -11
    if vt == int(T.BF16):
        return x.bfloat16().double(), x.double().abs() * 2.0 ** -8
    if vt in (Q8_0, Q8_1):
        b = xn.astype(np.float32).reshape(Tn, K // 32, 32)
        amax = np.abs(b).max(-1, keepdims=True)
        d = amax / np.float32(127)
        q = np.round(b * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0))
        xh = d.astype(np.float16).astype(np.float64) * q
        e = np.broadcast_to(d * (0.5 + 127 * 2.0 ** -10), b.shape)
        return torch.from_numpy(xh.reshape(Tn, K)), torch.from_numpy(np.ascontiguousarray(e).reshape(Tn, K))
    assert vt == Q8_K, vt
    b = xn.astype(np.float32).reshape(Tn, K // 256, 256)
    at = np.abs(b).argmax(-1)[..., None]
    mx = np.take_along_axis(b, at, -1)                                         # the signed value of largest |x|
    iscale = np.float32(-127) / mx
    q = np.minimum(127, np.round(iscale * b))
    xh = (np.float32(1) / iscale).astype(np.float64) * q
    e = np.broadcast_to(np.abs(1 / iscale.astype(np.float64)) * 0.5 * (1 + 1e-6), b.shape)
    return torch.from_numpy(xh.reshape(Tn, K)), torch.from_numpy(np.ascontiguousarray(e).reshape(Tn, K))


def q8_1_correction(x: torch.Tensor, raw: np.ndarray, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 / Q5_1 weights against q8_1 x: w = d qw + m per 32, and ggml adds m * fp16(d_x sum q_x) per block, not
    m * sum(fp16(d_x) q_x). Returns (what to add to dequantize(W) @ x_hat, its bound |m| |s| 2^-11) [T, N]."""
    xb = x.float().numpy().reshape(x.shape[0], K // 32, 32)
    amax = np.abs(xb).max(-1)
    d = amax / np.float32(127)
    q = np.round(xb * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)[..., None])
    s_exact = d.astype(np.float16).astype(np.float64) * q.sum(-1)              # what x_hat's sum gives
    s_ggml = (d * q.sum(-1)).astype(np.float32).astype(np.float16).astype(np.float64)
    N = raw.shape[0]
    m = raw.reshape(N, K // 32, -1)[:, :, 2:4].copy().view(np.float16).astype(np.float64)[..., 0]   # [N, K/32]
    corr = (s_ggml - s_exact) @ m.T                                            # [T, N]
    return torch.from_numpy(corr), torch.from_numpy(np.abs(s_ggml) @ np.abs(m).T * 2.0 ** -11)


def check_product(enc: T, y: torch.Tensor, deq: torch.Tensor, x: torch.Tensor, raw: np.ndarray) -> None:
    """(1) and (2) of the module's doc for y [T, N] = ggml's W @ x."""
    K = x.shape[1]
    x_hat, e = activation(x, enc)
    e = e.double()
    W = deq.double()
    ref_hat = x_hat @ W.T
    slack = 2e-5 * (x_hat.abs() @ W.abs().T) + 1e-9
    if ggml.vec_dot_type(enc) == Q8_1:
        corr, bound = q8_1_correction(x, raw, K)
        ref_hat, slack = ref_hat + corr, slack + 1e-6 * bound      # the fp16 sums, emulated exactly
    assert ((y.double() - ref_hat).abs() <= slack).all(), (
        f"{enc.name}: ggml differs from dequantize @ quantized x by {(y.double() - ref_hat).abs().max():.3g}")
    bound = e @ W.abs().T + 2e-5 * (x.double().abs() @ W.abs().T) + 1e-9
    if ggml.vec_dot_type(enc) == Q8_1:
        bound = bound + q8_1_correction(x, raw, K)[1]
    err = (y.double() - x.double() @ W.T).abs()
    assert (err <= bound).all(), f"{enc.name}: |ggml - dequantize @ x| {err.max():.3g} over the bound"
    if enc != T.F32:     # not vacuous: the worst case (no cancellation) stays under half the product (q8_K: ~0.27)
        assert bound.mean() < 0.5 * (x.double() @ W.T).abs().mean()


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda t: t.name)
def test_mul_mat_equals_dequantize_then_matmul(enc, tokens):
    N, K = 48, 512
    raw, deq = weights(enc, N, K, seed=int(enc))
    x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(7))
    y = ggml.mul_mat(enc, raw, (N, K), x)
    assert y.shape == (tokens, N)
    check_product(enc, y, deq, x, raw)


@pytest.mark.parametrize("enc", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_XS, T.MXFP4, T.BF16], ids=lambda t: t.name)
def test_mul_mat_id_with_repeated_experts(enc):
    """ggml_mul_mat_id over A stacked experts: several tokens, experts repeated across tokens and within one."""
    A, N, K = 4, 32, 256
    mats = [weights(enc, N, K, seed=100 + a) for a in range(A)]
    stacked = np.ascontiguousarray(np.stack([r for r, _ in mats]))               # [A, N, row bytes]: a ffn_*_exps
    ids = torch.tensor([[0, 2], [3, 3], [1, 0], [2, 2], [0, 1]], dtype=torch.int32)
    x = torch.randn(ids.shape[0], K, generator=torch.Generator().manual_seed(3))
    y = ggml.mul_mat_id(enc, stacked, (A, N, K), x, ids)                        # [T, U, N]
    for t in range(ids.shape[0]):
        for u in range(ids.shape[1]):
            raw, deq = mats[int(ids[t, u])]
            check_product(enc, y[t, u][None], deq, x[t][None], raw)


def silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1 + torch.exp(-v))


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("encs", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0, T.Q8_0), (T.MXFP4, T.MXFP4, T.MXFP4),
                                  (T.IQ3_XXS, T.IQ3_XXS, T.IQ4_XS)], ids=lambda e: "+".join(t.name for t in e))
def test_moe_layer_is_llamacpps_composition(encs, tokens):
    """One call for a layer's routed experts (llama.cpp's build_moe_ffn: mul_mat_id gate and up, SiLU(gate) * up,
    mul_mat_id down, weighted sum over the top-k) equals those steps one by one (each checked against dequantize
    above), and the per-expert-pointer call (`experts`) equals it at decode."""
    A, H, I, U = 4, 256, 512, 2
    g = [weights(encs[0], I, H, seed=10 + a) for a in range(A)]
    u = [weights(encs[1], I, H, seed=20 + a) for a in range(A)]
    d = [weights(encs[2], H, I, seed=30 + a) for a in range(A)]
    G, Up, D = (np.ascontiguousarray(np.stack([r for r, _ in m])) for m in (g, u, d))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(A, generator=gen)[:U] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, U, generator=gen)
    y = ggml.moe(encs, G, Up, D, A, H, I, x, ids, w)
    act = silu(ggml.mul_mat_id(encs[0], G, (A, I, H), x, ids)) * ggml.mul_mat_id(encs[1], Up, (A, I, H), x, ids)
    steps = (ggml.mul_mat_id(encs[2], D, (A, H, I), act, ids) * w[..., None]).sum(1)      # [T, H]
    # the steps differ only where SiLU's two evaluations round an activation across a q8 rounding edge: one
    # element's d/1 times its weight, far below the product
    assert (y - steps).abs().max() <= 1e-3 * steps.abs().max()
    ref = torch.stack([sum(w[t, k] * (d[int(ids[t, k])][1] @ (silu(g[int(ids[t, k])][1] @ x[t]) * (u[int(ids[t, k])][1] @ x[t])))
                           for k in range(U)) for t in range(tokens)])
    assert (y - ref).norm() <= 0.05 * ref.norm()          # the whole layer near the fp32 one (4-8 bit weights)
    if tokens == 1:
        rows = [(a, G.reshape(A, -1)[a], Up.reshape(A, -1)[a], D.reshape(A, -1)[a]) for a in ids[0].tolist()]
        y1 = ggml.experts([((encs[0], gr), (encs[1], ur), (encs[2], dr)) for _, gr, ur, dr in rows], H, I, x,
                          w[0][:, None])
        assert torch.allclose(y1, y, rtol=1e-5, atol=1e-6)


def test_threads_give_the_same_product():
    """ggml's threadpool at 2 threads splits rows, not sums: the product is the same bit for bit."""
    raw, _ = weights(T.Q4_K, 64, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ggml.mul_mat(T.Q4_K, raw, (64, 512), x, n_threads=1),
                       ggml.mul_mat(T.Q4_K, raw, (64, 512), x, n_threads=2))


def test_linear_callable_stacks_gate_and_up():
    """GgmlLinear over two matrices (an expert's gate and up where they lie) gives gate's rows then up's, in x's
    dtype."""
    (rg, dg), (ru, du) = weights(T.Q8_0, 32, 256, 1), weights(T.Q4_0, 16, 256, 2)
    lin = ggml.GgmlLinear([(T.Q8_0, rg.ctypes.data, (32, 256)), (T.Q4_0, ru.ctypes.data, (16, 256))], keep=(rg, ru))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    y = lin(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 48)
    assert torch.equal(lin(x)[:, :32], ggml.mul_mat(T.Q8_0, rg, (32, 256), x))
    assert torch.equal(lin(x)[:, 32:], ggml.mul_mat(T.Q4_0, ru, (16, 256), x))


def test_one_pinned_llamacpp():
    """ggml is built from the same llama.cpp source as the comparison's tools (bench/llamacpp.py)."""
    import llamacpp

    assert llamacpp.VERSION == ggml.LLAMACPP_VERSION


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU as transformers' GptOssExperts._apply_gate computes it."""
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("enc", [T.MXFP4, T.Q8_0, T.F32], ids=lambda t: t.name)
def test_gpt_oss_moe_layer_is_llamacpps_composition(enc, tokens):
    """GPT-OSS's layer in one call (`moe` with biases and swiglu_oai: llama.cpp's openai-moe build_moe_ffn:
    mul_mat_id gate and up, each plus its expert's bias (ggml_add_id), swiglu_oai, mul_mat_id down plus its bias, weighted sum over the top-k)
    equals those steps one by one (each product checked against dequantize above), and the layer equals the
    dequantised fp32 one within q8 activation rounding; F32 weights (x not quantized) equal it to fp32 rounding.
    Gate values reach past the limit (7), so the clamps are exercised."""
    A, H, I, U = 4, 256, 512, 2
    g = [weights(enc, I, H, seed=40 + a) for a in range(A)]
    u = [weights(enc, I, H, seed=50 + a) for a in range(A)]
    d = [weights(enc, H, I, seed=60 + a) for a in range(A)]
    G, Up, D = (np.ascontiguousarray(np.stack([r for r, _ in m])) for m in (g, u, d))
    gen = torch.Generator().manual_seed(tokens)
    bg, bu, bd = torch.randn(A, I, generator=gen), torch.randn(A, I, generator=gen), torch.randn(A, H, generator=gen)
    x = torch.randn(tokens, H, generator=gen) * 8                     # gate products up to ~+-10: past the limit
    ids = torch.stack([torch.randperm(A, generator=gen)[:U] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, U, generator=gen)
    y = ggml.moe((enc, enc, enc), G, Up, D, A, H, I, x, ids, w, biases=(bg, bu, bd), swiglu_oai=(1.702, 7.0))
    il = ids.long()
    gate = ggml.mul_mat_id(enc, G, (A, I, H), x, ids) + bg[il]
    assert (gate > 7).any() and (gate < -7).any()
    act = swiglu_oai(gate, ggml.mul_mat_id(enc, Up, (A, I, H), x, ids) + bu[il])
    steps = ((ggml.mul_mat_id(enc, D, (A, H, I), act, ids) + bd[il]) * w[..., None]).sum(1)    # [T, H]
    assert (y - steps).abs().max() <= 1e-3 * steps.abs().max()
    ref = torch.stack([sum(w[t, k] * (d[e][1] @ swiglu_oai(g[e][1] @ x[t] + bg[e], u[e][1] @ x[t] + bu[e]) + bd[e])
                           for k in range(U) for e in [int(ids[t, k])]) for t in range(tokens)])
    if enc == T.F32:
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
    else:
        assert (y - ref).norm() <= 0.05 * ref.norm()

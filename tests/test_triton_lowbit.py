"""The GPU kernels for low-bit experts (moectl/kernels/triton_lowbit.py), run on the CPU by Triton's interpreter
(conftest sets TRITON_INTERPRET=1 where no GPU is): every format the kernels read, at decode (M 1, 4: the GEMV
kernels) and prefill (M 64: the decode-tile kernel + torch matmul) shapes, against the torch reference (gguf's own
`gguf.quants.dequantize`, moectl's HQQ / vnni dequantisers, then an fp32 matmul); the grouped layer call over slot
indices (repeated, out of order); the dispatch decision with a faked CUDA capability.

Legend: N = output rows, K = input columns, M = tokens, I = intermediate size, H = hidden size, S = slots.
Shapes are small: the interpreter runs a tile in numpy (~1 s a call at 48 x 512)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

tk = pytest.importorskip("moectl.kernels.triton_lowbit")
if not tk.available():
    pytest.skip("triton is not installed (the test extra installs it)", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)", allow_module_level=True)

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from moectl.formats.hqq import HqqFormat  # noqa: E402
from moectl.formats.vnni import VnniFormat  # noqa: E402
from moectl.formats.vnni import dequantize as vnni_dequantize  # noqa: E402

# Marked `cuda` too: `make gpu-check` (pytest -m cuda) runs the same checks on the GPU's compiled kernels.
# Random GGUF blocks give outputs of ~1e3: SiLU's exp(-g) overflows to inf for them, as it should (SiLU -> 0).
pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GGUF = ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "MXFP4", "IQ4_XS"]
MS = (1, 4, 64)
# fp32 sums in another order than torch's: relative to the output's size
REL = 2e-6


def _f16_bytes(rng, shape) -> np.ndarray:
    """Random small fp16 values as bytes [..., 2]: block scales that are finite."""
    return (rng.uniform(-2, 2, shape).astype(np.float16) * np.float16(0.01)).view(np.uint8).reshape(*shape[:-1], -1)


def gguf_matrix(name: str, N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes [N * K / Q * B] uint8, W [N, K] fp32 by gguf's own dequantisation): random codes, every bit pattern
    of the block's code and sub-scale bytes, with finite scales (fp16 d / dmin fields small, MXFP4 exponents near 1)."""
    rng = np.random.default_rng(seed)
    qt = GGMLQuantizationType[name]
    Q, B = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (N, K // Q, B), dtype=np.uint8)
    if name in ("Q8_0", "Q4_0", "IQ4_XS"):
        raw[..., 0:2] = _f16_bytes(rng, (N, K // Q, 1))
    elif name in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = _f16_bytes(rng, (N, K // Q, 2))
    elif name == "Q6_K":
        raw[..., 208:210] = _f16_bytes(rng, (N, K // Q, 1))
    elif name == "MXFP4":
        raw[..., 0] = rng.integers(118, 130, (N, K // Q))
    ref = gguf_dequantize(raw.reshape(N, -1), qt).reshape(N, K).astype(np.float32)
    return torch.from_numpy(raw.reshape(-1).copy()).to(DEV), torch.from_numpy(ref).to(DEV)


def check(y: torch.Tensor, ref: torch.Tensor, rel: float = REL) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item() + 1e-6, (err, ref.abs().max().item())


@pytest.mark.parametrize("name", GGUF)
def test_gguf_matrix_every_m(name):
    """Every GGUF block type, decode and prefill, equals gguf's dequantisation times x in fp32 (M 64: the decoded
    tile is exactly gguf's weights, so the product is torch's own)."""
    N, K = 32, 256
    data, W = gguf_matrix(name, N, K)
    m = tk.Matrix(tk.Spec(tk.GGUF_TYPES[name]), N, K, data)
    torch.manual_seed(0)
    for M in MS:
        x = torch.randn(M, K, device=DEV)
        check(m(x), x @ W.T)
    base, offs = tk.offsets([(m, m)], DEV)
    assert torch.equal(tk.dequantize(base, offs, m, torch.float32)[0], W)


def test_tiles_past_one_block():
    """Rows over two tiles (the second partial) and a row of three K tiles (the interpreter's tiles are 128 x 256):
    masks and the K loop's sums, at decode and prefill."""
    N, K = 136, 768
    data, W = gguf_matrix("Q4_K", N, K, seed=5)
    m = tk.Matrix(tk.Spec("q4_k"), N, K, data)
    for M in (1, 64):
        x = torch.randn(M, K, device=DEV)
        check(m(x), x @ W.T)


LAYOUT = SimpleNamespace(names=["gate_up", "down"], shapes=[(128, 64), (64, 64)])     # I = 64, H = 64


def hqq_expert(bits: int, seed: int = 0, scale_dtype=torch.bfloat16) -> tuple[HqqFormat, torch.Tensor]:
    torch.manual_seed(seed)
    fmt = HqqFormat(LAYOUT, bits, 64, 1, scale_dtype)
    w = {n: torch.randn(*s, dtype=scale_dtype) for n, s in zip(LAYOUT.names, LAYOUT.shapes)}
    return fmt, fmt.quantize(w, optimize=False)


def hqq_fp32(fmt: HqqFormat, views: dict, name: str) -> torch.Tensor:
    """HQQ's own dequantisation of matrix `name`, in fp32 (the stored scales widened)."""
    from hqq.core.quantize import Quantizer

    meta = fmt.meta(name, views)
    meta |= {"scale": meta["scale"].float(), "zero": meta["zero"].float(), "compute_dtype": torch.float32}
    return Quantizer.dequantize(views[f"{name}.W_q"], meta).float()


def hqq_pair(fmt: HqqFormat, v: dict, f16: bool = False) -> tuple[tk.GateUp, tk.Matrix]:
    spec = tk.Spec(f"hqq{fmt.bits}", fmt.group, f16)
    (I2, H), (_, I) = LAYOUT.shapes
    gu = [v["gate_up.W_q"], v["gate_up.scale"], v["gate_up.zero"]]
    return (tk.GateUp(tk.Matrix(spec, I2 // 2, H, *gu, 0, I2), tk.Matrix(spec, I2 // 2, H, *gu, I2 // 2, I2)),
            tk.Matrix(spec, H, I, v["down.W_q"], v["down.scale"], v["down.zero"]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_moectl_hqq_copies(bits, scale_dtype):
    """moectl's stored q4 / q8 copies (HqqFormat, the device slots' layout), gate and up as halves of the packed
    gate_up, equal HQQ's dequantisation times x; with bf16 and fp16 scales."""
    fmt, buf = hqq_expert(bits, scale_dtype=scale_dtype)
    v = {k: t.to(DEV) for k, t in fmt.views(buf).items()}
    gu, down = hqq_pair(fmt, v, scale_dtype == torch.float16)
    Wgu, Wd = hqq_fp32(fmt, v, "gate_up"), hqq_fp32(fmt, v, "down")
    for M in MS:
        x = torch.randn(M, 64, device=DEV)
        check(gu(x), x @ Wgu.T)
        check(down(x), x @ Wd.T)


@pytest.mark.parametrize("bits", [4, 8])
def test_moectl_vnni_copies(bits):
    """The --cpu-experts layout (formats/vnni.py) as a GPU slot holds it equals vnni's dequantisation."""
    fmt, buf = hqq_expert(bits)
    vf = VnniFormat(fmt)                   # the layout only: no CPU kernel needed to repack
    out = torch.zeros(vf.nbytes, dtype=torch.uint8)
    vf.repack(buf, out)
    v = vf.views(out.to(DEV))
    codes, sm = v[f"gate_up.q{bits}"], v["gate_up.sm"]
    m = tk.Matrix(tk.Spec(f"vnni{bits}"), 128, 64, codes, sm)
    W = vnni_dequantize(codes, sm.float(), 128, 64)
    for M in MS:
        x = torch.randn(M, 64, device=DEV)
        check(m(x), x @ W.T)


def test_bf16_activations_round_once():
    """bf16 in, bf16 out (the GPU's case): the GEMV computes in fp32 and rounds once at the store, so it is within
    half a bf16 step of the fp32 product on a GPU; the interpreter's fp32 -> bf16 cast truncates (found here), so a
    whole step there."""
    data, W = gguf_matrix("Q4_K", 32, 256, seed=3)
    m = tk.Matrix(tk.Spec("q4_k"), 32, 256, data)
    x = torch.randn(4, 256, device=DEV).bfloat16()
    y = m(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ W.T
    step = 2 ** -7 if tk.INTERPRET else 2 ** -8                # relative: bf16 has 8 significant bits
    assert ((y.float() - ref).abs() <= ref.abs() * step + 1e-5).all()


def _pool(bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(bufs).to(DEV)                               # uint8 [S, bytes per expert]


def _silu_mlp(x, Wgu, Wd):
    g, u = (x @ Wgu.T).chunk(2, -1)
    return (torch.nn.functional.silu(g) * u) @ Wd.T


def test_grouped_slots_hqq_repeated_out_of_order():
    """One launch over selected slots (repeated, out of order) of a slot pool, the slot indices a device tensor:
    gate and up fused with SiLU, then down with the routing weights; each expert's output is its own."""
    S = 4
    exps = [hqq_expert(4, seed=s) for s in range(S)]
    fmt = exps[0][0]
    pool = _pool([b for _, b in exps])
    slots = torch.tensor([3, 0, 3, 2], device=DEV)
    spans = fmt.spans
    gate_parts = (spans["gate_up.W_q"][0], spans["gate_up.scale"][0], spans["gate_up.zero"][0])
    down_parts = (spans["down.W_q"][0], spans["down.scale"][0], spans["down.zero"][0])
    views = [fmt.views(pool[s]) for s in range(S)]
    gu0, d0 = hqq_pair(fmt, views[0])
    x = torch.randn(1, 64, device=DEV)
    rw = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEV)
    h = tk.gemv(x, pool, tk.slot_offsets(pool, slots, [gate_parts, gate_parts]), gu0.gate, torch.float32, fuse=True,
                up_row0=gu0.up.row0)                                                          # [E, 1, I]
    y = tk.gemv(h, pool, tk.slot_offsets(pool, slots, [down_parts]), d0, torch.float32, routing=rw,
                per_expert_x=True)                                                            # [E, 1, H]
    for j, s in enumerate(slots.tolist()):
        Wgu, Wd = hqq_fp32(fmt, views[s], "gate_up"), hqq_fp32(fmt, views[s], "down")
        g, u = (x @ Wgu.T).chunk(2, -1)
        check(h[j], torch.nn.functional.silu(g) * u)
        check(y[j], rw[j] * _silu_mlp(x, Wgu, Wd))
    assert torch.equal(y[0], y[2] * rw[0] / rw[2]) or torch.allclose(y[0] / rw[0], y[2] / rw[2], rtol=1e-6)


@pytest.mark.parametrize("M, types, I, H", [(1, ("Q4_K", "Q6_K"), 256, 256), (4, ("Q4_0", "Q8_0"), 32, 64)])
def test_experts_decode_gguf_layer(M, types, I, H):
    """A decode layer over GGUF experts in three launches (M 1: Q4_K gate / up and Q6_K down, as a Q4_K_M file
    mixes them): the routing-weighted sum of each expert's SiLU MLP; an expert routed twice counts twice."""
    up_t, down_t = types
    experts = []
    for s in range(3):
        (g, Wg), (u, Wu), (d, Wd) = (gguf_matrix(up_t, I, H, 10 * s), gguf_matrix(up_t, I, H, 10 * s + 1),
                                     gguf_matrix(down_t, H, I, 10 * s + 2))
        spec, dspec = tk.Spec(tk.GGUF_TYPES[up_t]), tk.Spec(tk.GGUF_TYPES[down_t])
        pair = (tk.GateUp(tk.Matrix(spec, I, H, g), tk.Matrix(spec, I, H, u)), tk.Matrix(dspec, H, I, d))
        experts.append((pair, torch.cat([Wg, Wu]), Wd))
    order = [2, 0, 2]
    rw = torch.tensor([0.5, 0.3, 0.2], device=DEV)
    x = torch.randn(M, H, device=DEV)
    ref = torch.zeros(M, H, device=DEV)
    for j, e in enumerate(order):
        _, Wgu, Wd = experts[e]
        ref += rw[j] * _silu_mlp(x, Wgu, Wd)
    y = tk.experts_decode(x, [experts[e][0] for e in order], rw)
    check(y, ref, 1e-5)


# --- the dispatch: which path a device's low-bit experts take ---------------------------------------------------
@pytest.mark.parametrize("cap, reason", [((9, 0), None), ((8, 0), None), ((7, 5), "compute capability 7.5 is below"),
                                         ((6, 1), "compute capability 6.1 is below")])
def test_dispatch_by_capability(cap, reason, monkeypatch, capsys):
    """A CUDA device of compute capability >= 8.0 (faked here) gets the kernels, an older one the dequantise path,
    said once per device on stderr; MOECTL_TRITON=0 turns them off; a CPU never gets them (its own kernels)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(tk, "_said", set())
    dev = torch.device("cuda", 0)
    got = tk.why_not(dev)
    assert got == reason if reason is None else got.startswith(reason)
    assert tk.device_kernels(dev) is (reason is None)
    tk.device_kernels(dev)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("low-bit experts on cuda:0: ")
    assert ("Triton kernels" in err[0]) is (reason is None)
    assert ("dequantised by torch" in err[0]) is (reason is not None)
    monkeypatch.setenv("MOECTL_TRITON", "0")
    assert tk.why_not(dev) == "MOECTL_TRITON=0"
    monkeypatch.delenv("MOECTL_TRITON")
    assert tk.why_not(torch.device("cpu")) == "cpu is not a CUDA device"


def test_load_flags_the_low_bit_formats_only(monkeypatch):
    """`runtime/load.device_expert_kernels`: with the kernels usable, the low-bit copies' format and a GGUF's layer
    formats compute through them; a dense (lossless) format is left as it was; an adapter whose expert forward
    multiplies matrices itself (GPT-OSS) or an unsupported GPU keeps every format on the dequantise path."""
    from moectl.formats.expert import DenseFormat
    from moectl.runtime import load

    def store():
        fmt, _ = hqq_expert(4)
        return SimpleNamespace(lowbit=SimpleNamespace(format=fmt), formats=None, format=DenseFormat(LAYOUT,
                                                                                                  torch.bfloat16))
    monkeypatch.setattr(tk, "_said", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    s = store()
    assert load.device_expert_kernels(s, SimpleNamespace(linear_callables=True), torch.device("cuda", 0))
    assert s.lowbit.format.device_kernels and not hasattr(s.format, "device_kernels")
    s = store()
    assert not load.device_expert_kernels(s, SimpleNamespace(linear_callables=False), torch.device("cuda", 0))
    assert not s.lowbit.format.device_kernels
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    s = store()
    assert not load.device_expert_kernels(s, SimpleNamespace(linear_callables=True), torch.device("cuda", 0))
    assert not s.lowbit.format.device_kernels


def test_hqq_slot_weights_are_the_kernels_when_flagged():
    """A flagged HqqFormat's `weights` of a slot are the kernels' callables; the family's expert forward through
    them (x -> down(SiLU(gate) * up)) equals the one through HQQ's dequantisation (in fp32); fp32 scales (which
    the kernels do not read) keep the dequantise path."""
    from moectl.models.base import FamilyAdapter

    fmt, buf = hqq_expert(4)
    views = fmt.views(buf.to(DEV))
    want = {n: hqq_fp32(fmt, views, n) for n in fmt.matrices}
    fmt.device_kernels = True
    got = fmt.weights(views)
    assert isinstance(got["gate_up"], tk.GateUp) and isinstance(got["down"], tk.Matrix)
    adapter = SimpleNamespace(linear=FamilyAdapter.linear)
    gate = lambda h: torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]     # noqa: E731
    for M in (1, 64):
        x = torch.randn(M, 64, device=DEV)
        check(FamilyAdapter.expert_forward(adapter, got, x, gate), FamilyAdapter.expert_forward(adapter, want, x, gate),
              1e-5)
    fmt32, buf32 = hqq_expert(4, scale_dtype=torch.float32)
    fmt32.device_kernels = True
    assert all(isinstance(w, torch.Tensor) for w in fmt32.weights(fmt32.views(buf32)).values())


@pytest.fixture(scope="module")
def q4km_one_layer(tmp_path_factory):
    """One Mixtral layer of whole 256-weight K blocks as a Q4_K_M file holds it: gate / up Q4_K, down Q6_K."""
    from gguf_build import k256_mixtral, write_gguf

    root = tmp_path_factory.mktemp("triton_q4km")
    return write_gguf(k256_mixtral(root, layers=1), root / "tiny-Q4_K_M.gguf", dense_encoding=GGMLQuantizationType.Q8_0,
                      expert_encoding=lambda layer, proj: GGMLQuantizationType.Q6_K if proj == "down"
                      else GGMLQuantizationType.Q4_K)


def test_gguf_model_in_slots_through_the_kernels(q4km_one_layer, tmp_path, monkeypatch):
    """End to end in emulated device slots: a Q4_K_M-like GGUF with its layer formats flagged as load flags them on
    a GPU: each decode layer is one grouped call, the prompt goes through the decode-tile + matmul path, and the
    greedy tokens and logits are the dequantise path's (fp32: to within the order of the sums)."""
    from test_runtime import _engine_run

    from moectl.runtime import offloaded
    from moectl.runtime.engine import Engine

    q4km, PROMPT = q4km_one_layer, torch.tensor([[5, 17, 42, 9, 100, 7]])

    kw = dict(progress=False, threads=1, emulate_device=True, cache_experts=8, prefetch="none")
    want_logits, want = _engine_run(Engine.load(str(q4km), workdir=str(tmp_path / "a"), **kw), PROMPT, 3)
    if torch.cuda.is_available():                       # the real thing: load flags the formats itself
        eng = Engine.load(str(q4km), workdir=str(tmp_path / "b"), progress=False, device="cuda", cache_experts=8,
                          prefetch="none")
        assert all(fmt.device_kernels for fmt in eng.store.formats)
    else:
        eng = Engine.load(str(q4km), workdir=str(tmp_path / "b"), **kw)
        for fmt in eng.store.formats:
            fmt.device_kernels = True
    calls = []
    real = tk.experts_decode
    monkeypatch.setattr(offloaded.triton_lowbit, "experts_decode", lambda *a: calls.append(1) or real(*a))
    logits, got = _engine_run(eng, PROMPT, 3)
    assert got == want
    assert len(calls) == 3 * len(eng.store.formats)                    # every decode step, every layer: one call
    assert max((a[-1].cpu() - b[-1]).abs().max().item() for a, b in zip(logits, want_logits)) <= 1e-3

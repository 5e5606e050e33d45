"""The GPU check's kernel step (issue 43): low-bit expert matrices timed per format and tokens, four ways.

Legend: M = tokens, N = output rows, K = input columns, I = intermediate size, H = hidden size, k = experts a token
routes to; times are microseconds per call (CUDA events, the median of REPEAT after WARMUP).

  dequant   today's device path: the format's torch dequantisation into bf16 (HQQ's `Quantizer.dequantize`,
            `formats/vnni.dequantize`, `formats/gguf_dequant.dequantize`), then a bf16 matmul
  tinygemm  torch's `_weight_int4pack_mm` where the format maps onto it exactly (HQQ q4 g64 with zero' = (8 - z) s,
            GGUF Q4_0 g32 with zero' 0); its packing made once, outside the timing
  triton    moectl's kernels (`moectl/kernels/triton_lowbit.py`): GEMV up to M = 8, decode tile + cuBLAS above
  gemlite   gemlite's A16W4 HQQ kernels, where `import gemlite` works (HQQ q4 only)

Per format, on a Mixtral expert's gate_up [28672, 4096] and a Qwen3-30B-A3B expert's [1536, 2048], M in
{1, 4, 64, 512}; every triton row checks its output against the dequant path's (max error relative to the
output's size). The "layer" rows time one decode token through k experts (Mixtral k = 2, Qwen3 k = 8): triton's
grouped call (three launches) against the dequant path expert by expert; their bytes over the grouped call's time
are the device's low-bit expert rate (`gpu_lowbit_gbps` of a hardware profile, which the simulator's low-bit rows
use), written into `--hardware FILE` when given.

Dry run (no GPU): Triton's interpreter on the CPU, one 512 x 256 matrix per format, M in {1, 64}, the same table
marked "dry run" (its times are the interpreter's, meaningless as speed).

    python bench/gpu_kernels.py --out DIR [--dry-run] [--hardware FILE] [--json]
    python bench/gpu_kernels.py --compile 80,90     # every kernel to a cubin per arch, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = ("hqq4", "hqq8", "vnni4", "vnni8", "q4_k", "q6_k", "q8_0", "q5_k", "q4_0", "mxfp4", "iq4_xs")
SHAPES = {"mixtral": (14336, 4096, 2), "qwen3": (768, 2048, 8)}            # I, H, k
DRY_SHAPES = {"tiny": (256, 256, 2)}                            # K-quant rows: whole 256 blocks
MS = (1, 4, 64, 512)
DRY_MS = (1, 64)                                    # the interpreter: one GEMV, one decode tile + matmul
WARMUP, REPEAT = 3, 20
GGUF_CODE = {"q4_k": "Q4_K", "q6_k": "Q6_K", "q8_0": "Q8_0", "q5_k": "Q5_K", "q4_0": "Q4_0", "mxfp4": "MXFP4",
             "iq4_xs": "IQ4_XS"}


# --- random matrices in each format, on the device --------------------------------------------------------------
def _f16_field(n: int, g: torch.Generator, device) -> torch.Tensor:
    """n small finite fp16 values as bytes [n, 2]."""
    return ((torch.rand(n, generator=g) - 0.5) * 0.02).half().view(torch.uint8).view(n, 2).to(device)


def random_matrix(fmt: str, N: int, K: int, device, seed: int = 0):
    """A `triton_lowbit.Matrix` of random codes with finite scales, its bytes on `device`."""
    from moectl.kernels import triton_lowbit as tk

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)   # noqa: E731
    if fmt in ("hqq4", "hqq8"):
        G, bits = 64, int(fmt[-1])
        R = N * K // G
        scale = (torch.rand(R, 1, generator=g) * 0.01).bfloat16().to(device)
        zero = (torch.rand(R, 1, generator=g) * ((1 << bits) - 1)).bfloat16().to(device)
        return tk.Matrix(tk.Spec(fmt, G), N, K, rnd(R // (2 if bits == 4 else 1), G), scale, zero)
    if fmt in ("vnni4", "vnni8"):
        bits = int(fmt[-1])
        NG, GB = -(-N // 16), -(-K // 64)
        sm = ((torch.rand(NG, GB, 2, 16, generator=g) - 0.5) * 0.02).bfloat16().to(device)
        return tk.Matrix(tk.Spec(fmt), N, K, rnd(NG, GB, 128 * bits), sm)
    Q, B = tk.GGUF_BLOCKS[fmt]
    blocks = rnd(N * K // Q, B)
    n = blocks.shape[0]
    if fmt in ("q8_0", "q4_0", "iq4_xs"):
        blocks[:, 0:2] = _f16_field(n, g, device)
    elif fmt in ("q4_k", "q5_k"):
        blocks[:, 0:2], blocks[:, 2:4] = _f16_field(n, g, device), _f16_field(n, g, device)
    elif fmt == "q6_k":
        blocks[:, 208:210] = _f16_field(n, g, device)
    elif fmt == "mxfp4":
        blocks[:, 0] = torch.randint(118, 130, (n,), dtype=torch.uint8, generator=g).to(device)
    return tk.Matrix(tk.Spec(fmt), N, K, blocks.reshape(-1))


def packed_nbytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in (m.data, m.scale, m.zero) if t is not None)


# --- the four paths ---------------------------------------------------------------------------------------------
def dequant_fn(m):
    """Today's path for matrix m: x -> x @ dequantise(m)^T (None where moectl has no torch dequantisation)."""
    N, K = m.N, m.K
    if m.spec.fmt in ("hqq4", "hqq8"):
        from hqq.core.quantize import Quantizer

        from moectl.formats.hqq import PACKING

        meta = {"nbits": int(m.spec.fmt[-1]), "group_size": m.spec.group, "shape": torch.Size((N, K)), "axis": 1,
                "scale": m.scale, "zero": m.zero, "packing": PACKING[int(m.spec.fmt[-1])], "view_as_float": False,
                "compute_dtype": torch.bfloat16}
        return lambda x: x @ Quantizer.dequantize(m.data, meta).to(x.dtype).T
    if m.spec.fmt in ("vnni4", "vnni8"):
        from moectl.formats.vnni import dequantize

        return lambda x: x @ dequantize(m.data, m.scale, N, K).to(x.dtype).T
    from gguf import GGMLQuantizationType

    from moectl.formats.gguf_dequant import dequantize
    from moectl.formats.gguf_encodings import SUPPORTED

    code = GGMLQuantizationType[GGUF_CODE[m.spec.fmt]]
    if code not in SUPPORTED:
        return None
    return lambda x: x @ dequantize(m.data, int(code), (N, K), x.dtype).T


def tinygemm_fn(m):
    """torch's int4 CUDA kernel on the same weights, where they map exactly (else None)."""
    if not m.data.is_cuda or m.spec.fmt not in ("hqq4", "q4_0"):
        return None
    N, K = m.N, m.K
    if m.spec.fmt == "hqq4":                           # HQQ: group rows of the flat [N, K] in two nibble halves
        half = m.data.shape[0]
        q = torch.cat([m.data >> 4, m.data & 15]).reshape(N, K)
        s, z = m.scale.float().reshape(N, K // 64), m.zero.float().reshape(N, K // 64)
        G, zero_ = 64, (8 - z) * s
        assert half * 2 * 64 == N * K
    else:                                              # Q4_0: 18-byte blocks, d (q - 8)
        b = m.data.view(-1, 18)
        q = torch.cat([b[:, 2:] & 15, b[:, 2:] >> 4], 1).reshape(N, K)
        s = b[:, :2].contiguous().view(torch.float16).float().reshape(N, K // 32)
        G, zero_ = 32, torch.zeros_like(s)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
    sz = torch.stack([s, zero_], -1).transpose(0, 1).contiguous().bfloat16()          # [K/G, N, 2]
    return lambda x: torch._weight_int4pack_mm(x.bfloat16(), packed, G, sz)


def gemlite_fn(m):
    """gemlite's A16W4 kernel on HQQ q4 (None where gemlite does not import or take it; the reason in `why`)."""
    if m.spec.fmt != "hqq4" or not m.data.is_cuda:
        return None
    try:
        from gemlite.core import DType, GemLiteLinear
    except Exception as e:                              # noqa: BLE001 - any import failure: no gemlite row
        gemlite_fn.why = f"import gemlite: {type(e).__name__}: {e}"
        return None
    N, K = m.N, m.K
    q = torch.cat([m.data >> 4, m.data & 15]).reshape(N, K)
    layer = GemLiteLinear(4, group_size=64, in_features=K, out_features=N, input_dtype=DType.BF16,
                          output_dtype=DType.BF16)
    layer.pack(q, m.scale.reshape(N, K // 64), m.zero.reshape(N, K // 64), bias=None)
    return layer


def timed_us(fn, x, cuda: bool, warmup: int = WARMUP, repeat: int = REPEAT) -> float:
    """Median microseconds of fn(x)."""
    for _ in range(warmup):
        fn(x)
    times = []
    for _ in range(repeat):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


# --- the step ---------------------------------------------------------------------------------------------------
def run(out_dir, dry_run: bool, formats=FORMATS, ms=None, hardware: Path | None = None) -> dict:
    """Time every format x shape x M (dry run: the interpreter on one tiny shape); write gpu-kernels.md and .json
    into out_dir; return {"dry_run", "device", "rows", "layers", "lowbit_gbps"}."""
    cuda = torch.cuda.is_available() and not dry_run
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # read when the kernels are decorated: before their import
    from moectl.kernels import triton_lowbit as tk

    torch.manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    warmup, repeat = (WARMUP, REPEAT) if cuda else (0, 1)
    shapes, ms = (SHAPES, ms or MS) if cuda else (DRY_SHAPES, ms or DRY_MS)
    rows, layers, notes = [], [], []
    for shape, (I, H, k) in shapes.items():
        for fmt in formats:
            m = random_matrix(fmt, 2 * I, H, device)
            paths = {"dequant": dequant_fn(m), "tinygemm": tinygemm_fn(m), "triton": m, "gemlite": gemlite_fn(m)}
            for M in ms:
                x = torch.randn(M, H, device=device).bfloat16()
                row = {"format": fmt, "shape": f"{2 * I}x{H}", "M": M, "bytes": packed_nbytes(m)}
                ref = paths["dequant"](x) if paths["dequant"] is not None else None
                for name, fn in paths.items():
                    if fn is None:
                        continue
                    try:
                        row[name] = timed_us(fn, x, cuda, warmup, repeat)
                        if name != "dequant" and ref is not None:
                            row[f"{name}_err"] = rel_err(fn(x), ref)
                    except Exception as e:                  # noqa: BLE001 - a path that fails is a note, not a stop
                        notes.append(f"{fmt} {row['shape']} M={M} {name}: {type(e).__name__}: {str(e)[:120]}")
                rows.append(row)
            layers.append(layer_row(fmt, shape, I, H, k, device, cuda, warmup, repeat))
            del m, paths
    if getattr(gemlite_fn, "why", None):
        notes.append(gemlite_fn.why)
    # the rate the check's simulator rows use: moectl-q4 (hqq4) on the check's Mixtral-shaped synthetic
    decode = [r for r in layers if r["format"] == "hqq4" and r["shape"] == "mixtral"]
    gbps = decode[0]["bytes"] / (decode[0]["triton"] * 1e-6) / 1e9 if decode and cuda else None
    report = {"dry_run": not cuda, "device": torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter)",
              "rows": rows, "layers": layers, "lowbit_gbps": gbps, "notes": notes}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-kernels.json").write_text(json.dumps(report, indent=1))
    (out / "gpu-kernels.md").write_text(markdown(report))
    if hardware is not None and gbps is not None and Path(hardware).is_file():
        import yaml

        hw = yaml.safe_load(Path(hardware).read_text()) or {}
        hw["gpu_lowbit_gbps"] = round(gbps, 1)
        Path(hardware).write_text(Path(hardware).read_text().split("\n", 1)[0] + "\n" + yaml.safe_dump(hw))
    return report


def layer_row(fmt: str, shape: str, I: int, H: int, k: int, device, cuda: bool, warmup: int, repeat: int) -> dict:
    """One decode token through k experts of this format: triton's grouped call against the dequant path."""
    from moectl.kernels import triton_lowbit as tk

    pairs, fns = [], []
    for e in range(k):
        gu, down = random_matrix(fmt, 2 * I, H, device, seed=2 * e), random_matrix(fmt, H, I, device, 2 * e + 1)
        gate = tk.Matrix(gu.spec, I, H, gu.data, gu.scale, gu.zero, 0, 2 * I)
        up = tk.Matrix(gu.spec, I, H, gu.data, gu.scale, gu.zero, I, 2 * I)
        pairs.append((tk.GateUp(gate, up), down))
        fns.append((dequant_fn(gu), dequant_fn(down)))
    w = torch.full((k,), 1.0 / k, device=device)
    x = torch.randn(1, H, device=device).bfloat16()
    row = {"format": fmt, "shape": shape, "k": k, "bytes": sum(packed_nbytes(g.gate) + packed_nbytes(d)
                                                               for g, d in pairs)}

    def grouped(x):
        return tk.experts_decode(x, pairs, w)

    def dequant(x):
        out = torch.zeros_like(x)
        for j, (fgu, fd) in enumerate(fns):
            g, u = fgu(x).chunk(2, -1)
            out += w[j] * fd(torch.nn.functional.silu(g) * u)
        return out

    row["triton"] = timed_us(grouped, x, cuda, warmup, repeat)
    if all(f is not None for pair in fns for f in pair):
        row["dequant"] = timed_us(dequant, x, cuda, warmup, repeat)
        row["triton_err"] = rel_err(grouped(x), dequant(x))
    return row


def compile_all(archs=(80, 90), formats=FORMATS) -> list[str]:
    """Compile every kernel variant the runtime launches (GEMV fused / routed at M 1 and 4, the decode tile) to a
    cubin for each CUDA arch, without a GPU (triton's own ptxas): proves the source compiles for those targets.
    Returns one line per (arch, format): 'sm_90 q4_k ok 12.3 s' or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moectl.kernels import triton_lowbit as tk
    from moectl.kernels import triton_lowbit_jit as jit

    gemv = {"x_ptr": "*bf16", "x_se": "i32", "x_sm": "i32", "base": "*u8", "offs": "*i64", "out_ptr": "*fp32",
            "o_se": "i32", "o_sm": "i32", "rw_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "HALF": "i32",
            "row0": "i32", "up_row0": "i32", "lut": "*fp32"}
    tile = {"base": "*u8", "offs": "*i64", "out_ptr": "*bf16", "N": "i32", "K": "i32", "HALF": "i32", "row0": "i32",
            "lut": "*fp32"}
    meta = ("FMT", "G", "F16", "FUSE", "ROUTED", "BM", "BN", "BK")
    lines = []
    for arch in archs:
        for fmt in formats:
            t0 = time.perf_counter()
            try:
                base = {"FMT": tk.FORMATS[fmt], "G": 64, "F16": False}
                for x, fuse, routed, bm in (("*bf16", True, False, 1), ("*fp32", False, True, 1),
                                             ("*bf16", True, False, 4), ("*fp32", False, True, 4)):
                    sig = gemv | {"x_ptr": x} | {k: "constexpr" for k in meta}
                    c = base | {"FUSE": fuse, "ROUTED": routed, "BM": bm, "BN": 32, "BK": 128}
                    triton.compile(ASTSource(jit._gemv_kernel, sig, constexprs=c), target=GPUTarget("cuda", arch, 32))
                sig = tile | {k: "constexpr" for k in ("FMT", "G", "F16", "BN", "BK")}
                triton.compile(ASTSource(jit._decode_kernel, sig, constexprs=base | {"BN": 64, "BK": 128}),
                               target=GPUTarget("cuda", arch, 32))
                lines.append(f"sm_{arch} {fmt} ok {time.perf_counter() - t0:.1f} s")
            except Exception as e:                  # noqa: BLE001 - a target that fails is the finding
                lines.append(f"sm_{arch} {fmt} FAILED: {type(e).__name__}: {str(e)[:200]}")
            print(lines[-1], flush=True)
    return lines


def _us(v) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def _err(row: dict) -> str:
    return f"{row['triton_err']:.1e}" if "triton_err" in row else "-"


def markdown(r: dict) -> str:
    head = "dry run: Triton's interpreter, times meaningless" if r["dry_run"] else r["device"]
    lines = [f"# Low-bit expert kernels ({head})", "",
             "Microseconds per call (median); err = max |triton - dequant| / max |dequant|.", "",
             "| format | shape      |   M | dequant | tinygemm |  triton | gemlite | err     |",
             "|--------|------------|----:|--------:|---------:|--------:|--------:|---------|"]
    for x in r["rows"]:
        lines.append(f"| {x['format']:<6} | {x['shape']:<10} | {x['M']:>3} | {_us(x.get('dequant')):>7} | "
                     f"{_us(x.get('tinygemm')):>8} | {_us(x.get('triton')):>7} | {_us(x.get('gemlite')):>7} | "
                     f"{_err(x):<7} |")
    lines += ["", "One decode token through k experts (triton: one grouped call; dequant: expert by",
              "expert); GB/s = the experts' packed bytes over triton's time.", "",
              "| format | shape   |  k |   MB | dequant |  triton |   GB/s | err     |",
              "|--------|---------|---:|-----:|--------:|--------:|-------:|---------|"]
    for x in r["layers"]:
        rate = x["bytes"] / (x["triton"] * 1e-6) / 1e9
        lines.append(f"| {x['format']:<6} | {x['shape']:<7} | {x['k']:>2} | {x['bytes'] / 1e6:>4.1f} | "
                     f"{_us(x.get('dequant')):>7} | {_us(x['triton']):>7} | {rate:>6.1f} | {_err(x):<7} |")
    if r["lowbit_gbps"]:
        lines += ["", f"Low-bit expert rate (hqq4, Mixtral layer row): {r['lowbit_gbps']:.1f} GB/s (gpu_lowbit_gbps)"]
    lines += [""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Time moectl's low-bit expert kernels against today's dequantise path, "
                                "torch's tinygemm and gemlite, per format and M (the GPU check's kernels step).")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="where gpu-kernels.md / .json go")
    p.add_argument("--dry-run", action="store_true", help="no GPU: the interpreter on one tiny shape")
    p.add_argument("--hardware", type=Path, help="a hardware profile yaml to write gpu_lowbit_gbps into")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of formats (default: all)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--compile", metavar="ARCHS", help="no timing: compile every kernel to a cubin for these CUDA "
                   "archs (comma list, e.g. 80,90,120), no GPU needed; exit 1 if any fails")
    a = p.parse_args(argv)
    formats = tuple(f.strip() for f in a.formats.split(",") if f.strip())
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        print(f"error: unknown format {', '.join(bad)}; choose from {', '.join(FORMATS)}")
        return 2
    if a.compile:
        try:
            archs = tuple(int(x) for x in a.compile.split(","))
        except ValueError:
            print(f"error: --compile {a.compile!r}: write CUDA archs as numbers, e.g. 80,90")
            return 2
        os.environ.pop("TRITON_INTERPRET", None)                  # compiling, not interpreting
        return 1 if any("FAILED" in line for line in compile_all(archs, formats)) else 0
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))      # the interpreter's numpy, the CPU side
    r = run(a.out, a.dry_run or not torch.cuda.is_available(), formats, hardware=a.hardware)
    if a.json:
        print(json.dumps({k: r[k] for k in ("dry_run", "device", "lowbit_gbps")} | {"rows": len(r["rows"])}))
    else:
        print(f"kernels: {len(r['rows'])} rows in {a.out / 'gpu-kernels.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

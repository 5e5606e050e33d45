"""llama.cpp with CUDA on the same model and budget as moectl: `make gpu-check`'s step 5.

    python bench/llamacpp_cuda.py --pack llamacpp-src.tar.gz          # here: the source to carry (~8 MB)
    python bench/llamacpp_cuda.py --src llamacpp-src.tar.gz --model CKPT --cache-experts N --json   # on the GPU

A lent GPU machine has no package index, so llama.cpp's source travels with the checkout: `--pack` trims the
llama-cpp-python sdist this machine fetched for bench/vs_llamacpp.py (`bench/llamacpp.py: pack_source`; the sdist is
76 MB, over the device tool's carry limit). On the GPU machine it:
  1. builds llama-bench and llama-quantize with GGML_CUDA=ON for the local GPU (`-DCMAKE_CUDA_ARCHITECTURES=native`)
     into $MOECTL_HOME/llamacpp/<version>-cuda/ (reused when built);
  2. converts the checkpoint with llama.cpp's own converter to BF16 and quantizes it with its own llama-quantize to
     Q4_0 (the BF16 file is deleted after: the synthetic is ~20 GB);
  3. runs llama-bench with every layer on the GPU (`-ngl 99`) and the experts of the first `--n-cpu-moe` layers on
     the CPU: the layers whose experts moectl's budget (`--cache-experts`, a quarter of them in gpu-check) cannot
     hold. llama.cpp places experts by whole layers, moectl by expert: the same bytes on the device, not the same
     experts. Prefill (`-p 512`) and decode (`-n 64`), CPU threads = the machine's cores.
Prints one JSON object (`--json`): decode ms/token, prefill tokens/s, n_cpu_moe, versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llamacpp  # noqa: E402
from moectl.errors import MoectlError  # noqa: E402

DEFAULT_PACK = ROOT / "llamacpp-src.tar.gz"          # gitignored: carried to the device beside the checkout


def n_cpu_moe(layers: int, experts_per_layer: int, cache_experts: int) -> int:
    """Layers whose experts stay on the CPU when the device holds `cache_experts` experts in whole layers."""
    return max(0, layers - cache_experts // experts_per_layer)


def model_shape(model: Path) -> tuple[int, int]:
    cfg = json.loads((model / "config.json").read_text())
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    return int(cfg["num_hidden_layers"]), int(experts)


def build(src: Path) -> Path:
    """The CUDA build, from the carried pack (laid out as the sdist, so `llamacpp.build` unpacks it as one)."""
    root = llamacpp.cuda_home()
    if not llamacpp.built(root, llamacpp.CUDA_TOOLS):
        sdist = root / f"llama_cpp_python-{llamacpp.VERSION}.tar.gz"
        if not sdist.exists():
            if not src.is_file():
                raise MoectlError(f"no llama.cpp source pack at {src}: make one where the sdist was fetched "
                                  f"(python bench/llamacpp_cuda.py --pack {DEFAULT_PACK.name}) and carry it")
            root.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, sdist)
        llamacpp.build(jobs=os.cpu_count() or 4, root=root, cuda=True, echo=lambda m: print(m, file=sys.stderr))
    return root


def quantized(model: Path, work: Path, root: Path) -> Path:
    """The checkpoint as llama.cpp's Q4_0 GGUF (converted, then quantized, by llama.cpp's own tools)."""
    q4 = work / "model-Q4_0.gguf"
    if q4.exists():
        return q4
    work.mkdir(parents=True, exist_ok=True)
    bf16 = llamacpp.convert(model, work / "model-BF16.gguf", "bf16", root=root)
    llamacpp.quantize(bf16, q4, "Q4_0", threads=os.cpu_count() or 4, root=root)
    bf16.unlink()
    return q4


def bench_gpu(gguf: Path, ncmoe: int, root: Path, threads: int, reps: int = 3) -> dict:
    """llama-bench's prefill (512 tokens) and decode (64 tokens) with --n-cpu-moe: ms/token and tokens/s."""
    rows, rss = llamacpp.bench_rows(gguf, ["-ngl", 99, "--n-cpu-moe", ncmoe, "-t", threads, "-p", 512, "-n", 64,
                                           "-r", reps], root)
    pp = next(r for r in rows if r.get("n_prompt", 0) > 0)
    tg = next(r for r in rows if r.get("n_gen", 0) > 0)
    return {"decode_ms_per_token": 1000 / tg["avg_ts"], "decode_tokens_per_s": tg["avg_ts"],
            "decode_stddev_tokens_per_s": tg["stddev_ts"], "prefill_tokens_per_s": pp["avg_ts"],
            "host_peak_rss_gb": rss, "backend": tg.get("backends") or tg.get("backend"),
            "gpu": tg.get("gpu_info"), "build_commit": tg.get("build_commit")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", type=Path, default=None, help="write the trimmed llama.cpp source pack here and stop")
    ap.add_argument("--src", type=Path, default=DEFAULT_PACK, help="the carried source pack")
    ap.add_argument("--model", type=Path, help="the checkpoint (moectl make-synthetic's)")
    ap.add_argument("--cache-experts", type=int, help="experts moectl's budget holds on the device")
    ap.add_argument("--work", type=Path, default=None, help="where the GGUFs go (default: beside --model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.pack:
            out = llamacpp.pack_source(a.pack)
            print(f"{out} ({out.stat().st_size / 1e6:.1f} MB): carry it beside the checkout (gitignored)")
            return 0
        if a.model is None or a.cache_experts is None:
            raise MoectlError("--model and --cache-experts are needed (or --pack)")
        layers, experts = model_shape(a.model)
        ncmoe = n_cpu_moe(layers, experts, a.cache_experts)
        root = build(a.src)
        gguf = quantized(a.model, a.work or a.model.parent / "gguf", root)
        res = {"tool": "llama.cpp", "version": llamacpp.VERSION, "quant": "Q4_0", "n_cpu_moe": ncmoe,
               "layers": layers, "cache_experts": a.cache_experts, "threads": a.threads,
               **bench_gpu(gguf, ncmoe, root, a.threads)}
    except MoectlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res) if a.json else
          f"llama.cpp Q4_0, --n-cpu-moe {ncmoe}: decode {res['decode_ms_per_token']:.1f} ms/token, "
          f"prefill {res['prefill_tokens_per_s']:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

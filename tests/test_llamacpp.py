"""llama.cpp itself beside moectl (`make test-llamacpp`): the build, llama.cpp's converter on moectl's checkpoints, and
the same greedy tokens from llama.cpp at F32, transformers and moectl, so `bench/vs_llamacpp.py` runs one model.

The build and conversion tests run only under `make test-llamacpp` (MOECTL_TEST_LLAMACPP=1): the first build takes
minutes (later runs reuse `$MOECTL_HOME/llamacpp/<version>/`, or the one in ~/.cache/moectl when MOECTL_HOME is a
test's private one)."""

import os
import shutil
from pathlib import Path

import pytest
import torch

import llamacpp
from moectl.errors import MoectlError

needs_build = pytest.mark.skipif(not os.environ.get("MOECTL_TEST_LLAMACPP"),
                                 reason="llama.cpp build: run `make test-llamacpp`")
BUILD_ROOT = llamacpp.home()          # resolved now, before a fixture points MOECTL_HOME at a private directory
PROMPT = "The function returns the"


def test_cuda_build_without_nvcc_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "nvcc" else "/usr/bin/" + name)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    with pytest.raises(MoectlError, match=r"with CUDA needs nvcc"):
        llamacpp.build(root=tmp_path, cuda=True)


def test_missing_cmake_or_compiler_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "cmake" else "/usr/bin/" + name)
    with pytest.raises(MoectlError, match=r"needs cmake: install it \(Debian/Ubuntu: apt-get install cmake\)"):
        llamacpp.build(root=tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    with pytest.raises(MoectlError, match=r"C\+\+ compiler.*apt-get install g\+\+"):
        llamacpp.build(root=tmp_path)
    assert not any(tmp_path.iterdir())                       # nothing fetched or written


def _hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def _moectl_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from moectl.runtime.engine import Engine

    eng = Engine.load(str(path), device="cpu", progress=False, gating="none", workdir=str(path.parent / "wd"))
    got, pkv, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out, pkv = eng.forward(step, pkv)
            got.append(int(out[0, -1].argmax()))
            step = torch.tensor([[got[-1]]])
    return got


def _same_tokens_three_ways(ckpt: Path, gguf: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    hf_ids = AutoTokenizer.from_pretrained(ckpt)(PROMPT, add_special_tokens=False)["input_ids"]
    prompt_ids, llama = llamacpp.greedy_tokens(gguf, PROMPT, n, root=BUILD_ROOT)
    assert prompt_ids == hf_ids                               # llama.cpp tokenizes the prompt as transformers does
    hf = _hf_greedy(ckpt, hf_ids, n)
    assert llama == hf == _moectl_greedy(ckpt, hf_ids, n)
    return llama


@needs_build
def test_tiny_model_at_f32_gives_the_same_greedy_tokens_in_llamacpp_transformers_and_moectl(tiny_small, tmp_path):
    llamacpp.build(root=BUILD_ROOT)
    gguf = llamacpp.convert(tiny_small, tmp_path / "tiny-F32.gguf", "f32", root=BUILD_ROOT)
    toks = _same_tokens_three_ways(tiny_small, gguf, 16)
    assert len(set(toks)) > 2                                 # a trained model, not one token repeated


@needs_build
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_synthetic_checkpoints_convert_and_decode_the_same(family, tmp_path):
    from moectl.synth.checkpoint import write_synthetic

    shape = {"num_layers": 2, "moe_layers": 2, "hidden_size": 128, "intermediate_size": 64, "num_experts": 16,
             "top_k": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1500,
             "dtype": "float32", "name": "small"}
    ckpt = tmp_path / "ck"
    write_synthetic(shape, ckpt, family=family, progress=False, seed=3)
    gguf = llamacpp.convert(ckpt, tmp_path / "s-F32.gguf", "f32", root=BUILD_ROOT)
    _same_tokens_three_ways(ckpt, gguf, 8)
    q4 = llamacpp.quantize(gguf, tmp_path / "s-Q4_0.gguf", "Q4_0", root=BUILD_ROOT)
    assert q4.stat().st_size < 0.3 * gguf.stat().st_size      # llama-quantize ran on the converted file


@needs_build
def test_carried_source_pack_configures_the_cuda_builds_tools(tmp_path):
    """gpu-check's llama.cpp source pack (what a lent GPU machine without a package index builds from) is small
    enough to carry and configures with the CUDA build's flags (the CUDA backend itself needs nvcc: here OFF)."""
    import subprocess
    import tarfile

    llamacpp.build(root=BUILD_ROOT)                                # the sdist is fetched once (cached)
    pack = llamacpp.pack_source(tmp_path / f"llama_cpp_python-{llamacpp.VERSION}.tar.gz", root=BUILD_ROOT)
    assert pack.stat().st_size < 32 * 2**20                       # the device tool carries 64 MiB in all
    with tarfile.open(pack) as tf:
        tf.extractall(tmp_path / "src", filter="data")
    src = llamacpp.source_dir(tmp_path)
    assert (src / "convert_hf_to_gguf.py").exists() and (src / "ggml" / "src" / "ggml-cuda").is_dir()
    assert not (src / "models").exists()
    flags = [f.replace("GGML_CUDA=ON", "GGML_CUDA=OFF") for f in llamacpp.cmake_flags(cuda=True)
             if "CUDA_ARCHITECTURES" not in f]
    p = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "bld"), *flags], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

"""The CUDA twins of the runtime's CPU tests: the same checks where the path differs on a GPU (pinned staging,
the copy stream with per-chunk events, the staging buffers' view swap, device dequantisation of MXFP4 / FP8 /
the int4 layout, the low-bit pools, CPU experts with fills beside the device, device memory within budget).

Marked `cuda` and skipped without a GPU: `make test` runs their CPU twins (named in each docstring);
`make gpu-check` runs these (`pytest -m cuda`). Lossless means: greedy ids equal transformers' float32 forward on
the CPU, logits within CUDA_ATOL (a GPU's matmul kernels round differently from the CPU's BLAS).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_factory import build_family, family_configs, save_tokenizer  # noqa: E402
from quantized_checkpoints import write_fp8_qwen3_moe, write_mxfp4_gpt_oss  # noqa: E402
from test_released_quant import _reference as _released_reference  # noqa: E402
from test_runtime import _reference_run  # noqa: E402

from moectl.runtime.engine import Engine  # noqa: E402

# MOECTL_CUDA_TWINS_ON_CPU=1 runs this file on an emulated device instead (checks the tests' own code without a
# GPU; the paths then are the CPU twins').
ON_CPU = os.environ.get("MOECTL_CUDA_TWINS_ON_CPU") == "1"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()),
                                 reason="needs a CUDA device (make gpu-check)")]

CUDA_ATOL = 1e-4
STEPS = 8
PROMPT = torch.randint(2, 512, (1, 9), generator=torch.Generator().manual_seed(1))


def _load(path, **kw) -> Engine:
    where = dict(device="cpu", emulate_device=True) if ON_CPU else dict(device="cuda")
    return Engine.load(str(path), dtype=kw.pop("dtype", "float32"), progress=False, **where, **kw)


def _sync() -> None:
    if not ON_CPU:
        torch.cuda.synchronize()


def _run(eng: Engine, prompt: torch.Tensor = PROMPT, steps: int = STEPS):
    """Logits per step (on the CPU) and greedy ids of `steps` decode steps after `prompt`."""
    logits, ids, pkv, step = [], [], None, prompt
    for _ in range(steps + 1):
        out, pkv = eng.forward(step, pkv)
        logits.append(out[0].float().cpu())
        ids.append(int(out[0, -1].argmax()))
        step = torch.tensor([[ids[-1]]])
    _sync()
    return logits, ids


def _assert_lossless(got, ref, what: str) -> None:
    assert got[1] == ref[1], f"{what}: greedy ids differ from transformers"
    diff = max((a - b).abs().max().item() for a, b in zip(got[0], ref[0]))
    assert diff <= CUDA_ATOL, f"{what}: max |logit diff| {diff}"


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-families")
    out = {}
    for fam in family_configs():
        build_family(fam, root / fam)
        save_tokenizer(root / fam)
        out[fam] = root / fam
    return out


@pytest.mark.parametrize("family", list(family_configs()))
def test_cuda_lossless_against_transformers_every_family(family, families):
    """Twin of test_runtime.py::test_lossless_against_transformers: 1, E/2 and E slots per layer on the GPU, each
    miss copied through the copy stream from pinned host buffers."""
    path = families[family]
    ref = _reference_run(path, PROMPT, STEPS)
    probe = _load(path, cache_experts=10_000)
    L, E = len(probe.moe_layer_ids), probe.adapter.num_experts
    del probe
    for slots in (1, E // 2, E):
        eng = _load(path, cache_experts=slots * L)
        assert eng.cache.cuda != ON_CPU and eng.cache.slots_per_layer == [slots] * L
        if not ON_CPU:                                        # host buffers pinned for the copy stream
            assert eng.store.buffers is None or all(b.is_pinned() for b in eng.store.buffers if b is not None)
        _assert_lossless(_run(eng), ref, f"{family} at {slots} slots/layer")
        st = eng.cache.snapshot()
        if slots == 1:
            assert st["misses"] > 0 and st["bytes_loaded"] == st["misses"] * eng.store.expert_nbytes


@pytest.mark.parametrize("setup", ["disk", "prefetch", "staged-prefetch", "cpu-experts-always", "prefill-stream"])
def test_cuda_copy_paths_are_lossless(setup, families):
    """Twins of test_data_path.py (disk tier straight into slots), test_runtime.py's prefetch test,
    test_runtime_admission.py's staged prefetch, test_speed.py's CPU experts and streamed prefill: every way an
    expert reaches the GPU (or is computed beside it) gives transformers' output."""
    path = families["mixtral"]
    ref = _reference_run(path, PROMPT, STEPS)
    kw = {"disk": dict(offload="disk", cache_experts=4),
          "prefetch": dict(cache_experts=4, prefetch="gate-reuse", staging=0),
          "staged-prefetch": dict(cache_experts=4, prefetch="gate-reuse", staging=2),
          "cpu-experts-always": dict(cache_experts=4, cpu_experts="always"),
          "prefill-stream": dict(cache_experts=4, prefill="stream")}[setup]
    eng = _load(path, **kw)
    _assert_lossless(_run(eng), ref, setup)
    st = eng.cache.snapshot()
    if setup == "cpu-experts-always":
        assert eng.runtime.cpu_experts > 0                    # misses really ran on the CPU, with fills after
    if setup.endswith("prefetch"):
        assert st["prefetches"] > 0


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_cuda_released_formats_dequantise_on_the_device(method, tmp_path):
    """Twin of test_released_quant.py::test_released_checkpoint_equals_transformers_dequantised: the packed
    MXFP4 / block-FP8 experts are copied packed and dequantised on the GPU."""
    path = (write_mxfp4_gpt_oss(tmp_path / "m") if method == "mxfp4" else write_fp8_qwen3_moe(tmp_path / "f"))
    ref = _released_reference(path, PROMPT, STEPS)
    eng = _load(path, cache_experts=4)
    assert eng.store.format.name.startswith(method)
    _assert_lossless(_run(eng), ref, method)
    st = eng.cache.snapshot()
    assert st["misses"] > 0 and st["bytes_loaded"] == st["misses"] * eng.store.expert_nbytes


def test_cuda_lowbit_pools_match_the_cpu(families, tmp_path):
    """Twin of test_quantize.py::test_t1_one_is_bit_identical_to_lossless and the low-bit pool tests: the int4
    layout dequantised on the GPU gives the CPU's (emulated device) logits, and HOBBIT with T1 = 1 is lossless."""
    from moectl.quant.quantize import quantize_model

    path = families["mixtral"]
    quantize_model(str(path), 4, 64, device="cpu" if ON_CPU else "cuda", workdir=str(tmp_path), progress=False)
    kw = dict(workdir=str(tmp_path), lowbit="q4g64", cache_experts=8, progress=False, dtype="float32")
    gpu = _run(_load(path, precision="lowbit-only", **{k: v for k, v in kw.items() if k != "progress"}))
    cpu = _run(Engine.load(str(path), emulate_device=True, precision="lowbit-only", **kw))
    assert gpu[1] == cpu[1]
    assert max((a - b).abs().max().item() for a, b in zip(gpu[0], cpu[0])) <= CUDA_ATOL
    ref = _reference_run(path, PROMPT, STEPS)
    hob = _load(path, precision="hobbit", t1=1.0, t2=1.0, **{k: v for k, v in kw.items() if k != "progress"})
    _assert_lossless(_run(hob), ref, "hobbit T1=1")


def test_cuda_budget_holds_on_the_device(families):
    """Twin of test_runtime.py::test_budget_option_on_a_model: what torch allocated on the GPU over load and a
    whole generation (`device_peak_allocated_bytes`) stays within --budget."""
    from moectl.store.facts import dense_nbytes, kv_reserve_nbytes
    from moectl.core.shapes import shape_from_hf_config
    from moectl.core.sizing import workspace_bytes

    path = families["mixtral"]
    probe = Engine.load(str(path), dtype="bfloat16", progress=False)
    budget = (dense_nbytes(probe.model) + kv_reserve_nbytes(probe.config, torch.bfloat16)
              + workspace_bytes(shape_from_hf_config(probe.config.to_dict()))
              + 8 * probe.store.expert_nbytes)                # two slots per layer
    del probe
    if not ON_CPU:
        torch.cuda.reset_peak_memory_stats()
    eng = _load(path, budget=budget, dtype="bfloat16")
    assert eng.cache.slots_per_layer == [2, 2, 2, 2]
    res = eng.generate("hello world", max_new_tokens=8, greedy=True)
    assert res.stats["device_held_bytes"] <= budget
    if not ON_CPU:
        peak = torch.cuda.max_memory_allocated()
        assert res.stats["device_peak_allocated_bytes"] == peak
        assert 0 < peak <= budget, f"device peak {peak} B over the {budget} B budget"

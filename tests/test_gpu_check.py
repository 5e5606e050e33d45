"""`make gpu-check`'s dry run (issue 44's one device call rehearsed): on this CPU machine every step's command is
printed and the CPU parts run on tiny stand-ins of both shapes (the checkpoints, their Q4 GGUFs, llama.cpp's
--n-cpu-moe N, the budgets, plan-cache's plans), the bundle checker runs on a fake bundle, and the report is written
from a recorded sample of the device steps' outputs (tests/gpu_check_sample.json, made up: no GPU run yet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_gpu_bundle import fake_bundle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

SAMPLE = Path(__file__).parent / "gpu_check_sample.json"


def test_cuda_tag_follows_the_driver():
    assert gpu_check.pick_cuda_tag((13, 0)) == "cu130"
    assert gpu_check.pick_cuda_tag((12, 9)) == "cu128"
    assert gpu_check.pick_cuda_tag((12, 6)) == "cu126"
    assert gpu_check.pick_cuda_tag((11, 8)) is None               # too old for the pinned torch's wheels


def test_wheels_for_the_image_come_at_the_pinned_versions(tmp_path):
    pins = gpu_check.pinned_versions()
    download, build = gpu_check.wheel_commands(tmp_path)
    assert "--only-binary=:all:" in download and download[download.index("--python-version") + 1] == "3.12"
    asked = {a.split("==")[0]: a.split("==")[1] for a in download + build if "==" in a}
    assert set(asked) == set(gpu_check.IMAGE_LACKS + gpu_check.NO_WHEEL)
    assert all(v == pins[gpu_check._norm(n)] for n, v in asked.items())         # constraints.txt's, every one
    assert asked["transformers"] == pins["transformers"] and build[3] == "wheel"



def test_n_cpu_moe_is_the_layers_a_quarter_of_the_experts_cannot_hold():
    assert gpu_check.n_cpu_moe(4, 8) == (8, 3)              # Mixtral: 8 experts = one whole layer on the device
    assert gpu_check.n_cpu_moe(4, 128) == (128, 3)          # Qwen3
    assert gpu_check.n_cpu_moe(2, 8) == (4, 2)              # half a layer: llama.cpp keeps every layer's on the CPU
    assert gpu_check.n_cpu_moe(8, 8) == (16, 6)


LOG = """load_tensors:        CUDA0 model buffer size =  5120.00 MiB
load_tensors:   CPU_Mapped model buffer size =  9000.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    68.00 MiB
llama_context:      CUDA0 compute buffer size =   300.00 MiB
llama_context:  CUDA_Host compute buffer size =    20.00 MiB
llama_context:      CUDA0 compute buffer size =   400.00 MiB
"""


def test_the_budget_is_the_vram_llamacpp_used_else_the_ggufs_estimate():
    vram = gpu_check.llamacpp_vram(LOG)                    # CUDA0 only; the largest of each kind (a context per test)
    assert vram == {"model_bytes": 5120 * 2**20, "kv_bytes": 68 * 2**20, "compute_bytes": 400 * 2**20,
                    "total_bytes": (5120 + 68 + 400) * 2**20}
    est = {"device_weight_bytes": 10**9}
    assert gpu_check.budget_for({"vram": vram}, est) == (vram["total_bytes"], gpu_check.budget_for({"vram": vram}, est)[1])
    assert gpu_check.budget_for({"vram": vram}, est)[1].startswith("measured")
    b, how = gpu_check.budget_for({}, est)
    assert b == 10**9 + gpu_check.BUFFERS_GUESS and how.startswith("estimated")


def test_a_step_that_does_not_fit_the_minutes_left_is_skipped_never_started():
    S = gpu_check.Step
    by = {"gguf:mixtral": S("gguf:mixtral", [], status="ok"), "install": S("install", [], status="failed")}
    llama = S("llamacpp:mixtral", [], needs=("gguf:mixtral",))
    assert llama.minutes == gpu_check.STEP_MINUTES["llamacpp:mixtral"]
    assert gpu_check.skip_reason(llama, by, set(), minutes_left=5.0) is None
    assert "more than the 0.3 left" in gpu_check.skip_reason(llama, by, set(), minutes_left=0.3)
    assert gpu_check.skip_reason(llama, by, {"llamacpp"}, 5.0) == "--skip"           # by kind
    assert gpu_check.skip_reason(llama, by, {"llamacpp:mixtral"}, 5.0) == "--skip"   # by name
    assert gpu_check.skip_reason(llama, by, {"llamacpp:qwen3-moe"}, 5.0) is None
    bench = S("bench:mixtral", [], needs=("install",))
    assert gpu_check.skip_reason(bench, by, set(), 5.0) == "needs install, which did not run"
    assert gpu_check.skip_reason(llama, by, set(), None) is None                     # the dry run has no clock


def test_rows_and_verdicts_from_the_sample():
    """The first table: moectl / llama.cpp per row on each shape, each moectl row beside its prediction; the goals
    judged (decode <= 0.7x, prefill >= 1x for the default; within 1.3x of the prediction)."""
    sample = json.loads(SAMPLE.read_text())["steps"]
    steps = [gpu_check.Step(name, [], status="ok", figures=f) for name, f in sample.items()]
    rows = {(r["shape"], r["row"]): r for r in gpu_check.rows_table(steps)}
    auto = rows[("mixtral", "auto (default)")]
    assert auto["decode_vs_llamacpp"] == pytest.approx(26.0 / 40.0)
    assert auto["prefill_vs_llamacpp"] == pytest.approx(950.0 / 800.0)
    assert auto["measured_over_predicted"] == pytest.approx(26.0 / 24.0)
    assert rows[("qwen3-moe", "plan-cache's plan")]["decode_ms_per_token"] == 7.9
    assert rows[("mixtral", "llama.cpp --n-cpu-moe 3")]["decode_vs_llamacpp"] == 1.0
    v = gpu_check.verdicts(gpu_check.rows_table(steps))
    assert "mixtral: default decode 0.65x llama.cpp's ms/token: meets the goal (<= 0.7)" in v
    assert [x for x in v if "outside 1.3x" in x] == ["mixtral moectl-q4: measured/predicted 1.67 is outside 1.3x: "
                                                     "correct the profile or the model from this measurement"]
    slow = [gpu_check.Step(n, [], status="ok", figures=f) for n, f in sample.items() if n != "bench-auto:qwen3-moe"]
    slow.append(gpu_check.Step("bench-auto:qwen3-moe", [], status="ok",
                               figures={"runs": {"moectl": {"decode_ms_per_token": 10.0, "prefill_tokens_per_s": 2000.0}}}))
    v = gpu_check.verdicts(gpu_check.rows_table(slow))
    assert "qwen3-moe: default decode 0.83x llama.cpp's ms/token: MISSES the goal (<= 0.7)" in v
    assert "qwen3-moe: default prefill 0.80x llama.cpp's tokens/s: MISSES the goal (>= 1)" in v


def test_dry_run_rehearses_the_whole_device_call(tmp_path):
    """Every device step printed with its command, the CPU ones run on tiny stand-ins of both shapes, the report's
    first table from the recorded sample, the fake bundle checked."""
    from gguf import GGUFReader

    out = tmp_path / "report"
    bundle = fake_bundle(tmp_path)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(out),
                        "--sample", str(SAMPLE), "--bundle", str(bundle)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.startswith("gpu-check: 9 minutes; planned (minutes): install 0.5, tests 1,")
    r = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in r["steps"]}
    assert r["failed"] == [] and r["meta"]["dry_run"] is True and r["meta"]["bundle_problems"] == []
    assert "-m cuda" in steps["tests"]["command"] and "gpu_bundle.py --install" in steps["install"]["command"]
    for shape, experts in (("mixtral", 8), ("qwen3-moe", 16)):
        for kind in ("synthetic", "gguf", "budget", "fits", "plan"):
            assert steps[f"{kind}:{shape}"]["status"] == "ok", (kind, shape)
        for kind in ("llamacpp", "bench", "bench-auto", "bench-q4"):           # the sample's figures, marked so
            assert steps[f"{kind}:{shape}"]["status"] == "sample" and f"[dry run] {kind}:{shape}:" in p.stdout
        assert steps[f"quantize:{shape}"]["status"] == "printed"
        cfg = json.loads((out / shape / "model" / "config.json").read_text())
        assert cfg["num_hidden_layers"] == gpu_check.LAYERS == 4
        assert (cfg.get("num_local_experts") or cfg.get("num_experts")) == experts
        # N and the budget, computed from the GGUF itself: all but token_embd and the first N layers' experts
        b = steps[f"budget:{shape}"]["figures"]
        assert b["n_cpu_moe"] == 3 and b["cache_experts"] == experts and b["layers"] == 4
        reader = GGUFReader(str(out / shape / f"model-{gpu_check.QUANT}.gguf"))
        exps = [t for t in reader.tensors if "_exps." in t.name]
        assert exps and all(t.tensor_type.name in ("Q4_K", "Q5_K", "Q6_K", "Q8_0") for t in exps)   # quantized
        on_device = sum(int(t.n_bytes) for t in reader.tensors if not t.name.startswith("token_embd.")
                        and not any(t.name.startswith(f"blk.{i}.") and "_exps." in t.name for i in range(3)))
        assert b["estimate"]["device_weight_bytes"] == on_device
        assert b["budget_bytes"] == on_device + gpu_check.BUFFERS_GUESS
        llama = steps[f"llamacpp:{shape}"]["command"]
        assert "--n-cpu-moe 3" in llama and f"model-{gpu_check.QUANT}.gguf" in llama
        for kind in ("bench", "bench-auto", "bench-q4"):                   # the budget reached every moectl row
            assert f"--budget {b['budget_bytes']} " in steps[f"{kind}:{shape}"]["command"]
        assert "--cpu-experts never" in steps[f"bench:{shape}"]["command"]
        assert "--cpu-experts" not in steps[f"bench-auto:{shape}"]["command"]           # the default: auto
        assert "--baselines moectl-plan" in steps[f"bench-auto:{shape}"]["command"]
        assert (out / shape / "wd-gguf" / "plan.yaml").is_file()
        fits = steps[f"fits:{shape}"]["figures"]                          # moectl can run the GGUF at that budget
        assert 0 < fits["device_min_bytes"] < fits["budget_bytes"] == b["budget_bytes"]
    if not (ROOT / "bench" / "gpu_kernels.py").is_file():
        assert "gpu_kernels.py" in r["skipped"]["kernels"]
    md = (out / "gpu-check.md").read_text()
    first = md.split("\n\n")[2].splitlines()                             # the first table comes first
    assert first[0].startswith("| shape | row | ms/tok | prefill/s") and len(first) == 2 + 2 * 5
    assert "| mixtral | auto (default) | 26.0 | 950 | 24.0 | 1.08 | 0.65 | 1.19 |" in first
    assert "recorded sample" in md and "MADE-UP" in json.loads(SAMPLE.read_text())["what"]
    assert all(len(line) <= 80 for line in first)


def test_rows_moectl_cannot_run_at_llamacpps_vram_are_skipped_with_the_reason(tmp_path):
    """When llama.cpp's VRAM is below moectl's minimum for the GGUF, the fits step says so and the GGUF rows are
    skipped with that reason, not run into the same error three times."""
    import types

    from gguf import GGMLQuantizationType as T

    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_build import write_gguf
    from model_factory import build_family, save_tokenizer

    build_family("mixtral", tmp_path / "ckpt")
    save_tokenizer(tmp_path / "ckpt")
    gguf = write_gguf(tmp_path / "ckpt", tmp_path / "m.gguf", expert_encoding=T.Q4_K, dense_encoding=T.F32)
    a = types.SimpleNamespace(shapes={"mixtral": {"gguf": gguf, "workdir": tmp_path / "wd", "budget": 10**6}})
    with pytest.raises(gpu_check.StepSkipped, match="moectl cannot run this GGUF at llama.cpp's VRAM: --budget"):
        gpu_check.moectl_fits(a, "mixtral")
    a.shapes["mixtral"]["budget"] = 10**9
    assert gpu_check.moectl_fits(a, "mixtral")["device_min_bytes"] < 10**9

"""A GPU user's defaults (issue 45): `--device auto` by default in every command that takes --device (CUDA when torch
sees a device, else the CPU), said on one stderr line; `cuda:N` checked against the device count and one `error:`
line where torch sees none; on CUDA without --budget, --cache-experts or a plan the budget is the device's free
memory less a margin, checked before anything is loaded.

The CUDA decisions are tested by CPU twins: `fake_cuda` makes torch report devices and their memory
(`torch.cuda.is_available`, `device_count`, `get_device_name`, `mem_get_info`), and the load is stopped at the
host-memory check (`runtime/load.py: check_host`), which comes after the setting is resolved and before any weight
is read, so no kernel ever runs on the faked device.

Legend: L = MoE layers, E = experts.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_bad_input import assert_one_error, run_cli

from moectl.errors import MoectlError
from moectl.store.facts import pick_device

GB = 10**9
GiB = 2**30


def fake_cuda(monkeypatch, count: int = 1, free: int = 70 * GB, total: int = 80 * GB) -> list:
    """torch reports `count` CUDA devices with (`free`, `total`) bytes each; returns the devices mem_get_info was
    asked about."""
    asked = []

    def mem_get_info(device=None):
        asked.append(str(device))
        return free, total

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return asked


def no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


class Stopped(Exception):
    """Raised where the load would start reading weights."""


def resolved_setting(monkeypatch, path, **options) -> dict:
    """Engine.load(path, **options) up to the host-memory check: the options as resolved and the slots taken."""
    import moectl.runtime.load as load_mod
    from moectl.runtime.engine import Engine

    seen = {}

    def check_host(opts, config, adapter, ckpt, dev, dt, L, in_place, full, low, low_fmt, full_tier, mapped_dense=None):
        seen.update(device=opts.device, torch_device=str(dev), budget=opts.budget, sources=dict(opts.sources),
                    device_note=opts.device_note, budget_note=opts.budget_note, slots=list(full), L=L,
                    E=adapter.num_experts)
        raise Stopped

    monkeypatch.setattr(load_mod, "check_host", check_host)
    with pytest.raises(Stopped):
        Engine.load(str(path), progress=False, **options)
    return seen


# --- the device ---------------------------------------------------------------------------------------------------
def test_auto_takes_cuda_when_torch_sees_it_else_the_cpu(monkeypatch):
    no_cuda(monkeypatch)
    device, note = pick_device("auto")
    assert device == "cpu" and note.startswith("device: cpu (--device auto")
    assert pick_device(None)[0] == "cpu" and pick_device("cpu") == ("cpu", "device: cpu (--device cpu)")
    fake_cuda(monkeypatch, count=2)
    assert pick_device("auto") == ("cuda", "device: cuda (Fake GPU; --device auto, 2 CUDA devices)")
    assert pick_device("cuda:1") == ("cuda:1", "device: cuda:1 (Fake GPU; --device cuda:1)")
    assert pick_device("CUDA")[0] == "cuda"


@pytest.mark.parametrize("asked, needle", [
    ("cuda:2", "--device cuda:2: torch sees 2 CUDA devices (cuda:0 to cuda:1"),
    ("cuda:x", "--device must be auto, cpu, cuda or cuda:N, not 'cuda:x'"),
    ("gpu", "--device must be auto, cpu, cuda or cuda:N, not 'gpu'"),
])
def test_a_device_torch_does_not_have_is_one_clear_error(monkeypatch, asked, needle):
    fake_cuda(monkeypatch, count=2)
    with pytest.raises(MoectlError, match="^" + needle.replace("(", r"\(")):
        pick_device(asked)


def test_cuda_without_a_gpu_names_the_fix(monkeypatch):
    no_cuda(monkeypatch)
    with pytest.raises(MoectlError) as e:
        pick_device("cuda:0")
    assert str(e.value).startswith("--device cuda:0: ") and "use --device cpu or auto (the default)" in str(e.value)


RUNS = {        # command -> its arguments besides --model and --device (each would run the model if it got there)
    "generate": ["-p", "hi", "-n", "1"], "eval": [], "bench": [], "profile": [], "sensitivity": [],
    "quantize": [], "train-predictor": [],
}


@pytest.mark.parametrize("command", sorted(RUNS) + ["chat", "serve"])
def test_cuda_0_without_a_gpu_is_one_error_line_in_every_command(command, random_mixtral, capsys, monkeypatch):
    no_cuda(monkeypatch)
    if command == "chat":
        monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hi\n"))
    args = [command, "--model", str(random_mixtral), "--device", "cuda:0", *RUNS.get(command, [])]
    if command == "serve":
        args += ["--port", "0"]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert_one_error(code, err, "--device cuda:0: ", "use --device cpu")


def test_the_default_is_auto_and_says_which_device_it_took(random_mixtral, capsys, monkeypatch):
    no_cuda(monkeypatch)
    code, out, err = run_cli(["generate", "--model", str(random_mixtral), "-p", "hi", "-n", "1", "--greedy", "--json"],
                             capsys, monkeypatch)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("device:")]
    assert len(lines) == 1 and lines[0].startswith("device: cpu (--device auto;"), err
    assert json.loads(out.strip().splitlines()[-1])["config"]["device"] == ["cpu", "default"]  # stdout: JSON only


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "serve", "bench", "profile", "sensitivity",
                                     "quantize", "train-predictor", "inspect"])
def test_every_device_option_defaults_to_auto(cli, command):
    out = cli([command, "--help"], env={"COLUMNS": "300"}).output
    line = next(ln for ln in out.splitlines() if "--device " in ln)
    assert "auto (CUDA when torch sees a device, else the CPU)" in " ".join(out.split()), line
    assert "[default: auto]" in line or "default: auto" in " ".join(out.split()), line


def test_auto_on_a_gpu_loads_onto_it(random_mixtral, monkeypatch):
    fake_cuda(monkeypatch, count=1)
    s = resolved_setting(monkeypatch, random_mixtral, device="auto")
    assert s["device"] == "cuda" and s["torch_device"] == "cuda" and s["sources"]["device"] == "default"
    assert s["device_note"] == "device: cuda (Fake GPU; --device auto, 1 CUDA device)"
    s = resolved_setting(monkeypatch, random_mixtral, device="auto", emulate_device=True)     # the CPU it emulates on
    assert s["device"] == "cpu" and s["sources"]["device"] == "default" and "--emulate-device" in s["device_note"]


# --- the budget -----------------------------------------------------------------------------------------------------
def test_cuda_without_a_budget_takes_the_free_memory_less_a_margin(random_mixtral, monkeypatch):
    asked = fake_cuda(monkeypatch, free=70 * GB, total=80 * GB)
    s = resolved_setting(monkeypatch, random_mixtral, device="cuda:0")
    margin = 4 * GB                                         # 5 % of the 80 GB card (above the 1 GiB floor)
    assert asked == ["cuda:0"]
    assert s["budget"] == 70 * GB - margin and s["sources"]["budget"] == "default"
    assert s["budget_note"] == ("budget: 66.00 GB of device memory, the 70.00 GB free less a 4.00 GB margin "
                                "(--budget, --cache-experts or a plan sets another)")
    assert sum(s["slots"]) == s["L"] * s["E"]               # a model far smaller than the card: every expert


def test_the_free_memory_budget_sizes_the_cache_as_that_budget_given(random_mixtral, monkeypatch):
    import moectl.runtime.load as load_mod

    real, parts = load_mod.resolve, {}

    def spy(options, sizes, *a, **kw):
        setting = real(options, sizes, *a, **kw)
        parts.update(split=setting.split, expert=sizes.expert_bytes())
        return setting

    monkeypatch.setattr(load_mod, "resolve", spy)
    fake_cuda(monkeypatch)
    probe = resolved_setting(monkeypatch, random_mixtral, device="cuda", budget="66GB")
    L, E, split = probe["L"], probe["E"], parts["split"]
    fixed = split.total - split.experts                     # dense + KV reserve + workspace + staging buffers
    need = fixed + (L + 3) * parts["expert"]                # a card whose free memory holds L + 3 experts
    fake_cuda(monkeypatch, free=GiB + need, total=2 * GiB)  # 5 % of 2 GiB is below the 1 GiB floor
    auto = resolved_setting(monkeypatch, random_mixtral, device="cuda")
    given = resolved_setting(monkeypatch, random_mixtral, device="cuda", budget=str(need))
    assert auto["budget"] == need and sum(auto["slots"]) == L + 3 < L * E
    assert auto["slots"] == given["slots"]


def test_a_card_too_small_is_one_error_before_loading(random_mixtral, capsys, monkeypatch):
    fake_cuda(monkeypatch, free=GiB + 1000, total=2 * GiB)
    import moectl.runtime.load as load_mod

    read = []
    monkeypatch.setattr(load_mod, "read_dense", lambda *a, **kw: read.append(1))
    code, out, err = run_cli(["generate", "--model", str(random_mixtral), "-p", "hi", "-n", "1"], capsys, monkeypatch)
    assert_one_error(code, err, "the device's free memory less its margin (1.00 KB) is below the minimum",
                     "free device memory, or run on the CPU (--device cpu)")
    assert read == []


@pytest.mark.parametrize("given", [{"cache_experts": 8}, {"budget": "3GB"}])
def test_a_given_size_is_not_replaced(random_mixtral, monkeypatch, given):
    fake_cuda(monkeypatch)
    s = resolved_setting(monkeypatch, random_mixtral, device="cuda", **given)
    assert s["budget_note"] == "" and s["sources"].get("budget") in (None, "flag")
    if "cache_experts" in given:
        assert s["budget"] is None and sum(s["slots"]) == 8


def test_a_plan_sets_the_slots_not_the_free_memory(random_mixtral, monkeypatch, tmp_path):
    fake_cuda(monkeypatch)
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({"format": "moectl-plan-v1", "slots": [2] * 4}))
    s = resolved_setting(monkeypatch, random_mixtral, device="cuda", plan=str(plan))
    assert s["budget"] is None and s["budget_note"] == "" and s["slots"] == [2] * 4


def test_a_cpu_never_asks_for_device_memory(random_mixtral, monkeypatch):
    no_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("mem_get_info on a CPU run"))
    s = resolved_setting(monkeypatch, random_mixtral, device="auto", emulate_device=True)
    assert s["device"] == "cpu" and s["budget"] is None and s["budget_note"] == ""

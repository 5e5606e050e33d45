"""What a new user was told too little or unreadably (issue 45, part C), one test per item: every table fits 80
columns with no cell cut; help groups its options and gives each a description; plurals, the lossy line's
words, the short GGUF error, `--threads` past the cores, `--budget` where it does nothing, a chat message past the
context; moectl's own calls into transformers raise no deprecation warning.

Legend: L = MoE layers, E = experts, K = top-k.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from test_bad_input import assert_one_error, run_cli


def rendered(fn, *args, width: int = 80, **kw) -> str:
    """What `fn(console, ...)` prints on a `width`-column terminal (no colour)."""
    from rich.console import Console

    buf = io.StringIO()
    fn(Console(file=buf, width=width, color_system=None, legacy_windows=False), *args, **kw)
    return buf.getvalue()


def assert_fits(out: str, width: int = 80) -> None:
    assert out.strip(), "nothing printed"
    assert max(len(line) for line in out.splitlines()) <= width, out
    assert "…" not in out, out


# --- tables -----------------------------------------------------------------------------------------------------
def test_print_table_stacks_columns_that_do_not_fit_and_repeats_the_row_name():
    from moectl.tables import print_table

    names = ["run"] + [f"figure\n{i}" for i in range(14)]
    cells = [[f"all-resident {r}"] + [f"{1000 + 100 * r + i}.25" for i in range(14)] for r in range(3)]
    out = rendered(print_table, names, cells, title="a wide table")
    assert_fits(out)
    assert out.count("all-resident 0") >= 2                      # stacked: each part names its rows
    for r in range(3):                                         # every number whole, once
        for i in range(14):
            assert out.count(f"{1000 + 100 * r + i}.25") == 1
    wide = rendered(print_table, names, cells, title="a wide table", width=250)
    assert wide.count("all-resident 0") == 1 and max(len(ln) for ln in wide.splitlines()) <= 250


def _bench_out() -> dict:
    """A `moectl bench --model M --json` report's shape (three runs; the figures are made up)."""
    run = lambda k: {"ttft_ms": 123.4 + k, "prefill_tokens_per_s": 1234.0, "decode_ms_per_token": 45.67 + k,  # noqa: E731
                     "hit_rate": 0.875, "bytes_per_token": 123_456_789, "stall_ms_per_token": 12.34,
                     "expert_stage_ms_per_token": 30.12, "cpu_side_ms_per_token": 4.56,
                     "predictor_ms_per_token": 0.123}
    runs = {"transformers": {"ttft_ms": 100.0, "prefill_tokens_per_s": 2000.0, "decode_ms_per_token": 40.0},
            "moectl all-resident": run(1), "moectl lru/auto": run(2)}
    return {"model": "tiny", "device": "cpu", "threads": 1, "prompt_len": 64, "gen_len": 32, "runs": runs,
            "predicted": {"moectl lru/auto": {"decode_ms_per_token": 44.44}},
            "measured_over_predicted": {"moectl lru/auto": 1.07}, "all_resident_over_transformers": 1.042,
            "goal_all_resident_ratio": 1.15}


def test_bench_model_table_fits_80_columns_with_every_figure_whole():
    from moectl.commands.bench import _model_table

    out = rendered(_model_table, _bench_out())
    assert_fits(out)
    for v in ("123.4", "124.4", "46.67", "47.67", "87.5%", "0.123", "44.44", "1.07", "1.042"):
        assert v in out
    assert "1 thread," in out and "1 threads" not in out


def test_report_table_fits_80_columns(tmp_path, capsys, monkeypatch):
    from shared_data import SHARED

    trace = SHARED / "traces" / "olmoe.math.jsonl"
    if not trace.is_file():
        pytest.skip("needs ../shared/traces")
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(["report", "--traces", str(trace), "--out", str(tmp_path / "r")], capsys, monkeypatch)
    assert code == 0
    assert_fits(out)
    assert "1 request," in out and "16 layers x" in out


# --- help -------------------------------------------------------------------------------------------------------
def _commands():
    """(command words, click command) of every moectl command, sub-commands included."""
    import typer

    from moectl.cli import app

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, path + [name])
        else:
            yield path, cmd

    return list(walk(typer.main.get_command(app), []))


def test_every_option_of_every_command_has_help_text():
    missing = [f"{' '.join(path)} {p.opts[0]}" for path, cmd in _commands() for p in cmd.params
               if p.param_type_name == "option" and not (p.help or "").strip()]
    assert len(_commands()) >= 15 and missing == []


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "serve", "bench", "simulate", "trace export"])
def test_help_shows_flags_without_bool_and_groups_the_runtime_options(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli([*command.split(), "--help"], capsys, monkeypatch)
    assert code == 0 and "<bool>" not in out + err
    if command in ("generate", "chat", "eval", "serve"):
        lines = out.splitlines()
        panels = [ln.split("─ ")[1].split(" ─")[0] for ln in lines if ln.startswith("╭─ ")]
        assert panels[0] == "Options" and panels.index("Device and cache") < panels.index(
            "Precision and gating (lossy: they change outputs)") and "Speculative decoding" in panels
        first_screen = "\n".join(lines[:60])                   # what most users need, before the policies
        assert "--model" in first_screen and "--device" in first_screen and "--budget" in first_screen


# --- smaller ----------------------------------------------------------------------------------------------------
def test_lossy_line_names_gating_once():
    """It printed "gating gating: sensitivity T_g=0.02"."""
    from types import SimpleNamespace

    from moectl.commands._common import print_lossy
    from moectl.setting.options import RuntimeOptions

    lossy = RuntimeOptions().lossy("gating: sensitivity T_g=0.02 (from sensitivity.json)")
    assert lossy["gating"] == "sensitivity T_g=0.02 (from sensitivity.json)"
    eng = SimpleNamespace(lossy=lambda: lossy)
    out = rendered(lambda console: print_lossy(eng, console), width=200)
    assert "gating sensitivity T_g=0.02" in out and "gating gating" not in out
    assert RuntimeOptions().lossy(None)["gating"] == "off"


def test_kernels_why_not_is_a_sentence_where_they_load(monkeypatch):
    from types import SimpleNamespace

    from moectl import kernels

    monkeypatch.setattr(kernels, "library", lambda: SimpleNamespace(_name="/x/libmoectl_cpu.so"))
    assert kernels.why_not() == "nothing: moectl's CPU kernels are built and in use (/x/libmoectl_cpu.so)"
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.setattr(kernels, "_why", ["this CPU lacks avx512_vnni"])
    assert kernels.why_not() == "this CPU lacks avx512_vnni"


def test_a_20_byte_gguf_is_a_truncated_header_in_plain_words(tmp_path, capsys, monkeypatch):
    """It quoted numpy: "When changing to a larger dtype, its size must be a divisor of ..."."""
    import struct

    path = tmp_path / "short.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQ", 3, 1) + bytes(4))          # 20 of the header's 24 bytes
    code, _, err = run_cli(["inspect", "--model", str(path)], capsys, monkeypatch)
    assert_one_error(code, err, "short.gguf is not a readable GGUF file (truncated GGUF header: the file has 20 "
                                "bytes, the header alone takes 24")
    assert "dtype" not in err and "divisor" not in err


def test_a_directory_named_gguf_is_not_called_a_hugging_face_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "dir.gguf").mkdir()
    for args in (["inspect"], ["generate", "-p", "hi"]):
        code, _, err = run_cli([*args, "--model", str(tmp_path / "dir.gguf")], capsys, monkeypatch)
        assert_one_error(code, err, "dir.gguf is a directory, not a GGUF file")
        assert "Hugging Face" not in err


def test_serve_prints_its_url_on_stdout(random_mixtral, tmp_path, capsys, monkeypatch):
    pytest.importorskip("fastapi", reason="moectl[serve] is not installed")
    import uvicorn

    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)     # bound, loaded, not served
    code, out, err = run_cli(["serve", "--model", str(random_mixtral), "--port", "0", "--threads", "1"], capsys,
                             monkeypatch)
    assert code == 0, err
    assert re.search(r"^serving \S+ on http://127.0.0.1:\d+ ", out) and "http://" not in err


def test_threads_beyond_the_cores_is_one_error(random_mixtral, capsys, monkeypatch):
    from moectl.setting.options import usable_cores

    n = usable_cores() + 1
    code, _, err = run_cli(["generate", "--model", str(random_mixtral), "-p", "hi", "--threads", str(n)], capsys,
                           monkeypatch)
    assert_one_error(code, err, f"--threads {n} is more than the {usable_cores()} CPU cores this process may run on",
                     f"use --threads {usable_cores()} or fewer")


def test_budget_in_place_on_a_cpu_says_it_has_no_effect(random_mixtral, tmp_path, monkeypatch):
    from moectl.runtime.engine import Engine

    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    eng = Engine.load(str(random_mixtral), budget="1GB", threads=1, progress=False)
    assert "--budget 1GB has no effect: on --device cpu with --offload ram the experts are computed in place" \
        in eng.plan_note
    plain = Engine.load(str(random_mixtral), threads=1, progress=False)
    assert "no effect" not in plain.plan_note


def test_a_chat_message_past_the_context_is_refused_and_the_chat_goes_on(capsys):
    """A 40k-token message was cut to the context's last tokens with only transformers' indexing warning: now it
    is refused with the figures (one error line on stderr), the conversation before it kept, the next one answered."""
    from test_chat import FakeEngine, _run

    eng = FakeEngine(context=60)                       # the fake tokenizer: one token per character
    code, out, session = _run(eng, "hi\n" + "x" * 100 + "\nbye\n")
    err = capsys.readouterr().err
    assert code == 0 and len(eng.prompts) == 2 and "x" * 10 not in "".join(eng.prompts)
    assert eng.prompts[1].startswith("<user>hi<assistant>answer1<user>bye")        # the turn before it kept
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: message not sent: it is 117 tokens with the chat "
                                                   "template, and the model's context holds 60 including the answer's 8")
    assert "at most 52 fit" in lines[0]


# --- transformers' deprecations ---------------------------------------------------------------------------------
class _Records(list):
    """A logging handler keeping transformers' log records (its logger does not propagate to pytest's caplog)."""

    def __enter__(self):
        import logging

        self.handler = logging.Handler()
        self.handler.emit = self.append
        logging.getLogger("transformers").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("transformers").removeHandler(self.handler)


@pytest.mark.parametrize("as_gguf", [False, True])
def test_moectls_calls_into_transformers_are_silent(as_gguf, random_mixtral, tmp_path, monkeypatch):
    """transformers 5.24 renamed `past_key_values` to `cache` and warns on every decode ("`past_key_values` is
    deprecated and will be removed in version 5.40.0 ... Use `cache` instead"); `config.torch_dtype` warns too (a
    GGUF load printed "`torch_dtype` is deprecated!"). A load, a prefill and two decode steps raise no
    FutureWarning/DeprecationWarning from transformers or moectl and log no deprecation, with the pinned
    transformers and the newest the ranges allow (`make test-latest`)."""
    import warnings

    import torch

    from moectl.models.kv_cache import cache_kwargs
    from moectl.runtime.engine import Engine

    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    path = random_mixtral
    if as_gguf:
        from gguf_build import write_gguf

        path = write_gguf(random_mixtral, tmp_path / "m.gguf")
    with _Records() as logs, warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            for module in ("transformers", "moectl"):
                warnings.filterwarnings("error", category=category, module=module)
        eng = Engine.load(str(path), threads=1, progress=False)
        logits, pkv = eng.forward(torch.tensor([[1, 2, 3]]))
        for _ in range(2):
            logits, pkv = eng.forward(logits[:, -1:].argmax(-1), pkv)
    assert pkv.get_seq_length() == 5                         # the cache was passed in and came back, filled
    said = [r.getMessage() for r in logs if "deprecated" in r.getMessage()]
    assert said == []
    assert list(cache_kwargs(eng.model, pkv)) in (["cache"], ["past_key_values"])


def test_bench_overhead_prints_no_transformers_progress_bars(capfd):
    """`moectl bench` printed transformers' "Writing model shards" and "Loading weights" tqdm bars."""
    from transformers.utils import logging as hf_logging

    from moectl.benchmark.overhead import runtime_overhead

    r = runtime_overhead(layers=1, hidden=64, intermediate=64, experts=4, prompt=4, decode=2, threads=1)
    out, err = capfd.readouterr()
    assert r["prefill_tokens"] == 4 and "Writing model shards" not in out + err and "Loading weights" not in out + err
    assert hf_logging.is_progress_bar_enabled()              # put back as it was


# --- a GGUF load: its progress and its peak ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def q4_gguf(random_mixtral, tmp_path_factory):
    """The random Mixtral as a GGUF with Q4_0 experts (repacked for the int4 kernel in place) and Q8_0 dense
    tensors."""
    from gguf import GGMLQuantizationType as T
    from gguf_build import write_gguf

    return write_gguf(random_mixtral, tmp_path_factory.mktemp("gguf") / "q4.gguf", expert_encoding=T.Q4_0,
                      dense_encoding=T.Q8_0)


def test_gguf_load_shows_progress_over_its_dense_tensors(q4_gguf, tmp_path, monkeypatch):
    """A GGUF load of 25-50 s showed no bar while it dequantised the dense tensors."""
    import moectl.progress
    from moectl.runtime.engine import Engine

    tasks = {}

    class Recorder:
        def __init__(self, enabled=True, console=None, transient=False):
            self.enabled = enabled

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add(self, label, total=None):
            tasks[label] = {"total": total, "completed": 0}
            return label

        def update(self, task, *, advance=None, completed=None, total=None, info=None):
            tasks[task]["completed"] = completed if completed is not None else tasks[task]["completed"] + (advance or 0)

    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(moectl.progress, "ProgressBar", Recorder)
    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")    # the full load: the lean one reads no dense tensor at load
    eng = Engine.load(str(q4_gguf), threads=1, progress=True)
    dense = tasks["reading dense weights (dequantising)"]
    assert dense["total"] == sum(1 for _ in eng.model.named_parameters()) and dense["completed"] == dense["total"]


def test_gguf_vocabulary_tensors_dequantised_in_row_blocks_are_the_whole_tensors(q4_gguf, monkeypatch):
    from moectl.runtime.engine import Engine
    from moectl.store.gguf import dense

    monkeypatch.setenv("MOECTL_GGML", "0")          # with ggml they stay in the mapped file (models/dense_gguf.py)

    def state():
        eng = Engine.load(str(q4_gguf), threads=1, progress=False)
        return {k: v.clone() for k, v in eng.model.state_dict().items() if "embed" in k or "lm_head" in k}

    monkeypatch.setattr(dense, "CHUNK_WEIGHTS", 64 * 7)           # 7 rows a block: a short last block too
    blocks = state()
    monkeypatch.setattr(dense, "ROW_CHUNKED", ())
    whole = state()
    assert blocks.keys() == whole.keys() and len(whole) == 2
    assert all(torch_equal(blocks[k], whole[k]) for k in whole)


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def test_inspect_reports_a_gguf_loads_peak_from_its_sizes(q4_gguf, capsys, monkeypatch):
    """`inspect` said "host RAM needed 1.94 GB" of a GGUF whose load peaked at 5.25 GB: the dense tensors'
    dequantisation and the experts' repacking hold more for a while than the run keeps. It now says the load's
    peak: the dense weights in the run's dtype + the experts as held in place (repacked) + the larger working set
    of one step (a vocabulary tensor is dequantised a block of rows at a time)."""
    from moectl.store.facts import DENSE_STEP_BYTES_PER_WEIGHT, REPACK_STEP_BYTES_PER_WEIGHT
    from moectl.store.gguf.files import CHUNK_WEIGHTS, ROW_CHUNKED, GgufFiles

    code, js, err = run_cli(["inspect", "--model", str(q4_gguf), "--device", "cpu", "--json"], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(js)
    peak, place = info["memory"]["load_peak"], info["gguf"]["cpu_in_place"]
    files = GgufFiles(q4_gguf)
    experts = {n: t for n, t in files.tensors.items() if "_exps." in n}
    dense = {n: t for n, t in files.tensors.items() if n not in experts}
    numel = lambda t: int(np.prod(t.shape))                                                  # noqa: E731
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[info["dtype"]]
    # with ggml the dense matrices (not the routers) stay in the mapped file at their bytes (models/dense_gguf.py)
    mapped = {n for n, t in dense.items() if place["mapped"] and len(t.shape) == 2 and "ffn_gate_inp" not in n}
    assert peak["dense"] == itemsize * sum(numel(t) for n, t in dense.items() if n not in mapped) + sum(
        dense[n].nbytes for n in mapped)
    # held as the kernel computes them: mapped file bytes for ggml (nothing repacked), else repacked for torch's int4
    assert place["int4_repacked"] != place["mapped"] and peak["experts"] == place["expert_bytes"]
    L, E = len(info["moe_layer_ids"]), info["experts"]
    per_expert = sum(numel(t) for t in experts.values()) // (L * E)
    read = {n: t for n, t in dense.items() if n not in mapped}                  # dequantised while loading
    whole = max((t for n, t in read.items() if n not in ROW_CHUNKED), key=numel)
    steps = [whole.nbytes + DENSE_STEP_BYTES_PER_WEIGHT * numel(whole),
             (sum(t.nbytes for t in experts.values()) // (L * E) + REPACK_STEP_BYTES_PER_WEIGHT * per_expert
              if place["int4_repacked"] else 0),
             DENSE_STEP_BYTES_PER_WEIGHT * min(CHUNK_WEIGHTS, max((numel(t) for n, t in read.items()
                                                                   if n in ROW_CHUNKED), default=0))]
    assert peak["step"] == max(steps) and peak["total"] == peak["dense"] + peak["experts"] + peak["step"]
    if not place["mapped"]:         # repacking and dequantising hold more for a while than the run keeps
        assert peak["total"] > info["memory"]["host"]["total"] - info["memory"]["host"]["kv_reserve"]
    code, out, _ = run_cli(["inspect", "--model", str(q4_gguf), "--device", "cpu"], capsys, monkeypatch)
    assert "host RAM peak while loading" in out


def test_train_predictor_report_fits_80_columns():
    """The widest `train-predictor` table: top-8 of 64 experts (k = 8, 9, 10), 16 layers, two-digit layer pairs."""
    from moectl.commands.train_predictor import print_report

    ks, m = [8, 9, 10], lambda: {**{f"recall@{k}": 0.8765 for k in (8, 9, 10)},        # noqa: E731
                                     **{f"precision@{k}": 0.5432 for k in (8, 9, 10)},
                                     **{f"covered@{k}": 0.1234 for k in (8, 9, 10)}}
    per_layer = [{"source": l, "target": l + 1, "mlp": m(), "gate_reuse": m(), "frequency": m()} for l in range(15)]
    result = {"metrics": {"mlp": {"ks": ks, "test_tokens": 4096, "lookahead": {
        "1": {"per_layer": per_layer, "mean": {"mlp": m(), "gate_reuse": m(), "frequency": m()}}}}},
        "notes": [], "out": "/x/predictors", "kinds": ["mlp"], "seconds": 12.5}
    out = rendered(lambda console: print_report(result, console))
    assert_fits(out)
    assert out.count("0.88") == 16 * 5 and "14->15" in out


def test_a_transient_progress_bar_leaves_nothing_in_a_pipe():
    """Each transient bar (reading experts, reading dense weights, ...) left a blank line on a piped stderr."""
    from rich.console import Console

    from moectl.progress import ProgressBar

    buf = io.StringIO()
    with ProgressBar(console=Console(file=buf, width=80), transient=True) as bar:
        task = bar.add("reading dense weights", total=3)
        bar.update(task, advance=3)
    assert buf.getvalue() == ""
    with ProgressBar(console=Console(file=buf, width=80), transient=False) as bar:   # a kept bar is still shown
        bar.update(bar.add("profiling", total=2), completed=2)
    assert "profiling" in buf.getvalue()

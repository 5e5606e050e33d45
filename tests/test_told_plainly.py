"""What a new user was told too little or unreadably (issue 45, part C), one test per item: every table fits 80
columns with no cell cut; help groups its options and gives each a description; plurals, the lossy line's
words, the short GGUF error, `--threads` past the cores, `--budget` where it does nothing, a chat message past the
context; moectl's own calls into transformers raise no deprecation warning.

Legend: L = MoE layers, E = experts, K = top-k.
"""

from __future__ import annotations

import io
import json

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

"""Bad input as a new user would try it: every artifact reader (traces, predictors, plans) and --bits answer
malformed input with exit code 2 and one `error:` line naming the file (and line); the CLI's last-resort
handler works.

Legend: L = MoE layers, E = experts, K = top-k.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from moectl import cli

L, E, K = 32, 8, 2                          # mixtral's shape, so `--model-shape mixtral` sizes the experts
HEADER = {"format": "moe-routing-v1", "model": "toy", "num_layers": L, "num_experts": E, "top_k": K}


def _row(i: int, **over) -> dict:
    r = {"request": "a", "pos": i, "phase": "decode", "experts": [[(i + l) % E, (i + l + 1) % E] for l in range(L)]}
    return {**r, **over}


def _jsonl(path, header, rows) -> str:
    lines = [header if isinstance(header, str) else json.dumps(header)]
    lines += [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_cli(args, capsys, monkeypatch, stdin: str | None = None) -> tuple[int, str, str]:
    """`moectl ARGS` through the real entry point: (exit code, stdout, stderr); `stdin`: what it reads there."""
    monkeypatch.setattr(sys, "argv", ["moectl", *args])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_error(code, err, *needles):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


GOOD = [_row(i) for i in range(4)]
BAD_TRACES = {       # name -> (header, rows, text the error names besides the file, line)
    "more than top-k": (HEADER, [GOOD[0], _row(1, experts=[[0, 1, 2]] + GOOD[1]["experts"][1:])], "more than top_k", 3),
    "id above int16": ({**HEADER, "num_experts": 40000}, GOOD, "32767", 1),
    "id above num_experts": (HEADER, [_row(0, experts=[[33000, 1]] + GOOD[0]["experts"][1:])], "33000", 2),
    "negative id": (HEADER, [_row(0, experts=[[-1, 1]] + GOOD[0]["experts"][1:])], "-1", 2),
    "non-integer id": (HEADER, [_row(0, experts=[[1.5, 1]] + GOOD[0]["experts"][1:])], "integers", 2),
    "string id": (HEADER, [_row(0, experts=[["3", 1]] + GOOD[0]["experts"][1:])], "integers", 2),
    "no experts": (HEADER, [GOOD[0], {"request": "a", "pos": 1, "phase": "decode"}], "experts", 3),
    "unknown phase": (HEADER, [_row(0, phase="generate")], "phase", 2),
    "row not an object": (HEADER, [GOOD[0], "[1, 2]"], "object", 3),
    "header without num_layers": ({k: v for k, v in HEADER.items() if k != "num_layers"}, GOOD, "num_layers", 1),
    "header not an object": ("[1, 2, 3]", GOOD, "object", 1),
    "header only": (HEADER, [], "no token rows", None),
    "truncated row": (HEADER, [GOOD[0], '{"request": "a", "pos": 1, "exp'], "not valid JSON", 3),
    "wrong layer count": (HEADER, [_row(0, experts=[[0, 1]])], "32 layers", 2),
    "negative pos": (HEADER, [_row(0, pos=-3)], "pos", 2),
}


@pytest.mark.parametrize("case", list(BAD_TRACES))
def test_malformed_jsonl_traces(case, tmp_path, capsys, monkeypatch):
    header, rows, needle, line = BAD_TRACES[case]
    p = _jsonl(tmp_path / "t.jsonl", header, rows)
    code, _, err = run_cli(["simulate", "--trace", p, "--cache-experts", "64", "--model-shape", "mixtral"],
                           capsys, monkeypatch)
    assert_one_error(code, err, p + (f":{line}" if line else ""), needle)


@pytest.mark.parametrize("meta,needle", [("[1, 2]", "list"), ("{broken", "not valid JSON"),
                                         (json.dumps({"format": "moectl-trace", "version": 1}), "num_layers"),
                                         (json.dumps({"format": "moectl-trace", "version": 9, "num_layers": 2}),
                                          "newer")])
def test_malformed_trace_directories(meta, needle, tmp_path, capsys, monkeypatch):
    (tmp_path / "meta.json").write_text(meta)
    code, _, err = run_cli(["simulate", "--trace", str(tmp_path), "--cache-experts", "64"], capsys, monkeypatch)
    assert_one_error(code, err, str(tmp_path / "meta.json"), needle)


BAD_PLANS = {        # name -> (plan.yaml text, text the error names, line)
    "slots not integers": ("format: moectl-plan-v1\nslots:\n" + "".join(f"  - {'two' if i == 3 else 2}\n" for i in range(L)),
                           "slots[3] must be an integer", 6),
    "float slots": ("format: moectl-plan-v1\nslots: [" + ", ".join(["2.5"] + ["2"] * (L - 1)) + "]\n",
                    "slots[0] must be an integer", 2),
    "negative slots": ("format: moectl-plan-v1\nslots:\n" + "".join(f"  - {-1 if i == 5 else 2}\n" for i in range(L)),
                       "slots[5] is -1", 8),
    "zero slots": ("format: moectl-plan-v1\nslots:\n" + "".join(f"  - {0 if i == 0 else 2}\n" for i in range(L)),
                   "at least one slot", 3),
    "plan is a list": ("- 1\n- 2\n", "list", 1),
    "no slots": ("format: moectl-plan-v1\n", "`slots` is missing", None),
    "not yaml": ("format: moectl-plan-v1\nslots: [1, 2\n", "not valid YAML", None),
    "wrong format": ("format: something-else\nslots: [1]\n", "moectl-plan-v1", None),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_malformed_plans(case, tmp_path, capsys, monkeypatch):
    text, needle, line = BAD_PLANS[case]
    trace = _jsonl(tmp_path / "t.jsonl", HEADER, GOOD)
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    code, _, err = run_cli(["simulate", "--trace", trace, "--plan", str(plan), "--model-shape", "mixtral"],
                           capsys, monkeypatch)
    assert_one_error(code, err, str(plan) + (f":{line}" if line else ""), needle)


BAD_PREDICTORS = {   # name -> (predictors.json text, text the error names)
    "a list": ("[1]", "list"),
    "not json": ('{"format": "moectl-predictors", ', "not valid JSON"),
    "wrong format": (json.dumps({"format": "moectl-trace", "format_version": 1}), "moectl-predictors"),
    "newer version": (json.dumps({"format": "moectl-predictors", "format_version": 7, "kinds": []}), "newer"),
    "no kinds": (json.dumps({"format": "moectl-predictors", "format_version": 1}), "kinds"),
    "unknown kind": (json.dumps({"format": "moectl-predictors", "format_version": 1, "kinds": ["magic"],
                                 "architecture": {}}), "magic"),
    "no architecture": (json.dumps({"format": "moectl-predictors", "format_version": 1, "kinds": ["mlp"]}),
                        "architecture"),
}


@pytest.mark.parametrize("case", list(BAD_PREDICTORS))
def test_malformed_predictors(case, tmp_path, capsys, monkeypatch):
    text, needle = BAD_PREDICTORS[case]
    trace = _jsonl(tmp_path / "t.jsonl", HEADER, GOOD)
    pred = tmp_path / "pred"
    pred.mkdir()
    (pred / "predictors.json").write_text(text)
    (pred / "predictors.safetensors").write_bytes(b"")
    code, _, err = run_cli(["simulate", "--trace", trace, "--cache-experts", "64", "--model-shape", "mixtral",
                            "--predictor", str(pred), "--prefetch", "mlp"], capsys, monkeypatch)
    assert_one_error(code, err, str(pred / "predictors.json"), needle)


@pytest.mark.parametrize("bits", ["0", "-4", "64"])
def test_bits_out_of_range(bits, tmp_path, capsys, monkeypatch):
    trace = _jsonl(tmp_path / "t.jsonl", HEADER, GOOD)
    code, _, err = run_cli(["simulate", "--trace", trace, "--cache-experts", "64", "--model-shape", "mixtral",
                            "--bits", bits], capsys, monkeypatch)
    assert_one_error(code, err, "--bits")


def test_a_good_trace_still_simulates(tmp_path, capsys, monkeypatch):
    trace = _jsonl(tmp_path / "t.jsonl", HEADER, GOOD)
    code, out, err = run_cli(["simulate", "--trace", trace, "--cache-experts", "64", "--model-shape", "mixtral",
                              "--bits", "4", "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["tokens"] == 4 and d["bytes_per_token"] > 0


# ----------------------------------------------------------------------------- the last-resort handler

def test_last_resort_handler(monkeypatch, capsys):
    import typer
    from typer._click import exceptions as vendored

    def fake(exc):
        def app(standalone_mode=True):
            raise exc
        return app

    monkeypatch.setattr(sys, "argv", ["moectl"])
    monkeypatch.setattr(cli, "app", fake(typer.Abort()))
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1
    monkeypatch.setattr(cli, "app", fake(vendored.UsageError("no such option: --bogus")))
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2 and "no such option: --bogus" in capsys.readouterr().err
    boom = RuntimeError("a bug")
    monkeypatch.setattr(cli, "app", fake(boom))
    with pytest.raises(RuntimeError) as e:                 # re-raised as is: one traceback, not two chained
        cli.main()
    assert e.value is boom and e.value.__context__ is None


def test_unknown_option_is_a_usage_error(capsys, monkeypatch):
    code, _, err = run_cli(["simulate", "--bogus"], capsys, monkeypatch)
    assert code == 2 and "--bogus" in err and "Traceback" not in err

"""What `moectl` does before a command runs (moectl/cli.py, docs/gguf.md "stop 54"): a command's module is imported
and its click command built only when that command is asked for (`LazyCommands`), and the options' plain values
are converted without pydantic (`PlainValues`). Neither changes what a command receives or prints: each command
built lazily is the command built with every module registered up front (its help text, its options), `moectl
--help` lists the commands in the same order, every option converts every sample value as typer's own conversion
does (the value and its type, or the same error); and a fresh torch-free `moectl generate` imports neither pydantic
nor another command's module, nor numpy.random, answers with the same tokens as the run in this process, and holds
its engine until the process ends (freeing it is teardown the script skips)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import pytest
import typer
import typer.main

from moectl import cli

ROOT = Path(__file__).resolve().parents[1]


def eager_app() -> typer.Typer:
    """moectl's app as cli.py built it before stop 54: every command module imported, every command registered."""
    app = typer.Typer(**cli.APP_SETTINGS)
    for name, module_name in cli.command_modules().items():
        module = importlib.import_module(f"moectl.commands.{module_name}")
        if isinstance(getattr(module, "app", None), typer.Typer):
            for info in module.app.registered_commands:
                if info.cls in (None, typer.core.TyperCommand):
                    info.cls = cli._Command
            app.add_typer(module.app, name=name)
        else:
            fn = getattr(module, module_name, None) or getattr(module, module_name + "_")
            app.command(name, cls=cli._Command)(fn)
    return app


def leaves(group, ctx) -> dict:
    """{"trace import": command, "generate": command, ...}: every command under `group`, groups opened."""
    out = {}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, typer.core.TyperGroup):
            out |= {f"{name} {k}": v for k, v in leaves(cmd, cmd.context_class(cmd, info_name=name)).items()}
        else:
            out[name] = cmd
    return out


def test_lazy_commands_are_the_eager_ones():
    lazy, eager = typer.main.get_command(cli.app), typer.main.get_command(eager_app())
    lazy_ctx, eager_ctx = (g.context_class(g, info_name="moectl") for g in (lazy, eager))
    assert lazy.list_commands(lazy_ctx) == eager.list_commands(eager_ctx)     # --help's order: trace (a group) last
    a, b = leaves(lazy, lazy_ctx), leaves(eager, eager_ctx)
    assert list(a) == list(b) and len(a) >= 19
    for name in a:
        ca, cb = a[name], b[name]
        assert ca.help == cb.help and type(ca) is type(cb), name
        assert [(p.name, p.opts, p.default, p.required) for p in ca.params] == \
               [(p.name, p.opts, p.default, p.required) for p in cb.params], name
        assert ca.get_help(ca.context_class(ca, info_name=name)) == cb.get_help(cb.context_class(cb, info_name=name))


def test_a_command_is_built_when_asked_for():
    group = typer.main.get_command(cli.app)
    commands = group.commands
    assert "generate" in commands and "bench" in commands and "nosuch" not in commands
    assert commands._built == {}                            # asking for a name builds nothing
    commands["generate"]
    assert list(commands._built) == ["generate"]
    with pytest.raises(KeyError):
        commands["nosuch"]


# text a command line or an environment variable gives, and the Python defaults typer passes
SAMPLES = [None, "0", "1", "12", "007", "0.5", "2.25", "1.", ".5", "-1", "+1", "1e3", " 1", "1_0", "abc", "", "\u0663",
           "9" * 25, "0.0000000000000000001", "3.4028236692093846346e38", "inf", "nan", "true", "False", True, False,
           0, 1, 64, -3, 0.5, 0.8, 1.0, 2, 2.5]


def converted(process_value, value, ctx):
    try:
        v = process_value(ctx, value)
        return "value", type(v), v
    except Exception as e:                                  # typer's BadParameter, MissingParameter: its message
        return "error", type(e), str(e)


def test_plain_values_convert_as_typer_does():
    """Every option of every command that takes `PlainValues`, every sample value and its own default: it gives
    typer's answer (its own process_value: pydantic's TypeAdapter) exactly, and answers most of them itself (the test
    is not vacuous); every str / bool / int / float option takes it, a Path or list option is typer's."""
    group = typer.main.get_command(cli.app)
    ctx0 = group.context_class(group, info_name="moectl")
    answered = checked = 0
    kinds = set()
    for name, cmd in leaves(group, ctx0).items():
        ctx = cmd.context_class(cmd, info_name=name, parent=ctx0)
        for param in cmd.get_params(ctx):
            ours = vars(param).get("process_value")
            if not isinstance(ours, cli.PlainValues):
                assert param.multiple or param.name == "help" or "Path" in str(cmd.callback.__annotations__.get(
                    param.name)), (name, param.name)
                continue
            kinds.add(ours.kind)
            for value in [*SAMPLES, param.default]:
                want = converted(ours.typers, value, ctx)
                got = converted(ours, value, ctx)
                if want[0] == "value" and isinstance(want[2], float) and want[2] != want[2]:
                    assert got[0] == "value" and got[2] != got[2], (name, param.name, value)      # nan
                else:
                    assert got == want, (name, param.name, value, got, want)
                checked += 1
                answered += value is None or ours.plain(value) is not None
    assert kinds == {str, bool, int, float}
    assert checked > 5000 and answered > 1000, (checked, answered)


def _declared_variously(a: Annotated[int, typer.Option()] = 1, b: int = typer.Option(2, parser=int),
                        c: Path = typer.Option("."), d: Optional[int] = typer.Option(None, min=0),
                        e: str = typer.Option("x")):
    print(a, b, c, d, e)


def test_a_declaration_plain_values_cannot_read_is_left_to_typer():
    """The guard against a typer upgrade or an unusual declaration: an Annotated or parsed option, a Path: typer's
    conversion; a function whose annotations cannot be read: every option typer's, no error; a bool flag without a
    declaration (--help) takes PlainValues either way."""
    import typer.testing

    one = typer.Typer(add_completion=False)
    one.command(cls=cli._Command)(_declared_variously)
    cmd = typer.main.get_command(one)
    assert set(cli.PlainValues.declared(cmd)) == {"d", "e"}
    taken = {p.name for p in cmd.get_params(cmd.context_class(cmd, info_name="x"))
             if isinstance(vars(p).get("process_value"), cli.PlainValues)}
    assert taken == {"d", "e", "help"}
    r = typer.testing.CliRunner().invoke(one, ["--a", "3", "--b", "4", "--d", "5"])
    assert r.exit_code == 0 and r.stdout.split() == ["3", "4", ".", "5", "x"], r.output
    r = typer.testing.CliRunner().invoke(one, ["--d", "-1"])
    assert r.exit_code == 2 and "greater than or equal to 0" in r.output   # typer's own range message

    def unreadable(x: "NoSuchName" = typer.Option(1)):                    # noqa: F821
        pass

    class Unreadable:
        callback = unreadable

    with pytest.raises(NameError):
        cli.PlainValues.declared(Unreadable())
    typers_own = typer.Typer(add_completion=False)
    typers_own.command()(_declared_variously)                            # typer's command class: nothing installed
    raw = typer.main.get_command(typers_own)
    params = raw.get_params(raw.context_class(raw, info_name="x"))
    assert not [p for p in params if isinstance(vars(p).get("process_value"), cli.PlainValues)]
    cli.PlainValues.install(Unreadable(), params)                         # no error: typer's, the flag aside
    assert [p.name for p in params if isinstance(vars(p).get("process_value"), cli.PlainValues)] == ["help"]


def test_the_help_flag_and_unset_options_need_no_pydantic():
    """`PlainValues` answers the group's unset --help and a command's None / default values without building
    typer's conversion (which imports pydantic)."""
    code = ("import sys, typer.main\nfrom moectl import cli\ng = typer.main.get_command(cli.app)\n"
            "ctx = g.make_context('moectl', ['generate', '-m', 'x', '-p', 'Hi', '-n', '3', '--threads', '2', "
            "'--temperature', '0.5', '--greedy'])\n"
            "cmd = g.get_command(ctx, 'generate')\n"
            "sub = cmd.make_context('generate', ctx.args or ['-m', 'x', '-p', 'Hi', '-n', '3', '--threads', '2', "
            "'--temperature', '0.5', '--greedy'], parent=ctx)\n"
            "p = sub.params\nprint(p['max_new_tokens'], p['threads'], p['temperature'], p['greedy'], p['top_p'], "
            "p['budget'], 'pydantic' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "2", "0.5", "True", "0.95", "None", "False"]


def test_a_fresh_generate_imports_no_pydantic_nor_other_commands(tmp_path, capsys, monkeypatch):
    """The torch-free `moectl generate` as the script runs it (`cli.run`), in a fresh process: the tokens of the run
    in this process; none of the modules stop 54 cut imported (pydantic, typer's pydantic adapters, the other
    commands' modules, numpy.random: greedy draws nothing), nor torch; and its engine still held when the process
    ends (`_common.kept_until_exit`: not freed before `exit_now`), where the in-process run keeps nothing."""
    from gguf import GGMLQuantizationType as T

    from gguf_build import write_gguf
    from moectl.commands import _common
    from test_bad_input import run_cli
    from test_ggml_graph import _checkpoint
    from test_gguf_run import ggml_or_skip

    ggml_or_skip()
    path = write_gguf(_checkpoint("mixtral", tmp_path), tmp_path / "Q.gguf", dense_encoding=T.Q8_0,
                      expert_encoding=T.Q4_0)
    args = ["generate", "--model", str(path), "--prompt", "The capital of France is", "-n", "4", "--threads", "1",
            "--device", "cpu", "--workdir", str(tmp_path / "wd"), "--json", "--greedy"]
    code, out, err = run_cli(args, capsys, monkeypatch)     # the first run (torch) saves config and tokenizer
    assert code == 0, err
    assert _common.kept_until_exit is None                  # main() in a process that goes on: nothing kept
    first = json.loads(out)
    watched = ["pydantic", "typer._adapters", "numpy.random", "torch", "transformers"] + [
        f"moectl.commands.{m}" for m in cli.command_modules().values() if m != "generate"]
    code = ("import atexit, json, sys\n"
            "def report():\n"
            "    from moectl.commands import _common\n"
            "    print(json.dumps({'imported': [m for m in %r if m in sys.modules],\n"
            "                      'kept': [type(e).__name__ for e in _common.kept_until_exit]}), file=sys.stderr)\n"
            "atexit.register(report)\n"
            "from moectl import cli\nsys.argv = %r\ncli.run()\n" % (watched, ["moectl", *args]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "torch-free run" in r.stderr
    assert json.loads(r.stderr.strip().splitlines()[-1]) == {"imported": [], "kept": ["GraphEngine"]}, r.stderr
    assert json.loads(r.stdout)["token_ids"] == first["token_ids"]


def _threads_after(code: str, **env) -> tuple[int, bool]:
    """(the OS threads of a fresh process after `code`, whether OPENBLAS_NUM_THREADS is in its environment then)."""
    env = {k: v for k, v in os.environ.items() if k not in cli.BLAS_THREAD_VARIABLES} | env
    r = subprocess.run([sys.executable, "-c", code + "\nimport os\nprint(len(os.listdir('/proc/self/task')), "
                        "'OPENBLAS_NUM_THREADS' in os.environ)"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=env | {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    n, set_ = r.stdout.split()
    return int(n), set_ == "True"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_script_starts_numpy_with_one_blas_thread_and_puts_the_environment_back():
    """`cli.run` imports numpy with OpenBLAS at one thread (the threads of a process given OPENBLAS_NUM_THREADS=1),
    the variable gone again afterwards; a user's own setting is kept (the threads that setting gives)."""
    ours = "from moectl.cli import numpy_with_one_blas_thread as f\nf()\nimport numpy"
    assert _threads_after(ours) == (_threads_after("import numpy", OPENBLAS_NUM_THREADS="1")[0], False)
    for user in ({"OPENBLAS_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2"}):
        assert _threads_after(ours, **user) == _threads_after("import numpy", **user)

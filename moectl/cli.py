"""The `moectl` command line. One thin module per command under `moectl/commands/`.

Each `moectl/commands/<name>.py` defines the command as a plain top-level function named like the
module (`generate`, `train_predictor` -> `moectl train-predictor`), or a `typer.Typer` called `app` for a
command group (`trace import|export`); this file discovers them, so adding a command never touches this
file, and imports a command's module only when that command is asked for (`LazyCommands`). `MoectlError`, and
click's usage errors (a bad option value, an unknown option), become one red `error:` line and exit code 2.

A torch-free `moectl generate -n 1` is about half a second, so the start-up is kept to what it needs
(docs/gguf.md, "stop 54"): one command built, the options' plain values converted without pydantic
(`PlainValues`), numpy's OpenBLAS started at one thread and the engine kept until the process ends (`run`).
"""

from __future__ import annotations

import atexit
import errno
import importlib
import os
import pkgutil
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path

import typer
from rich.console import Console

from .errors import MoectlError

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # nothing is ever fetched from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the Typer settings of moectl's command group, also those of the one-command Typer a command is built in
APP_SETTINGS = dict(
    name="moectl",
    help="Run Mixture-of-Experts LLMs larger than your GPU: offloading runtime, calibration pipeline, simulator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


class PlainValues:
    """An option's value that needs no parsing, taken as it is before typer would convert it through pydantic.

    Why: typer >= 0.29 converts every option's value, even an unset option's None, through a pydantic TypeAdapter
    built on first use; the first one imports pydantic: ~0.1 s of CPU on the shared 2-core machine, of a torch-free
    `moectl generate -n 1`'s ~0.9 s (docs/gguf.md, "stop 54"). The values here are the ones whose conversion is the
    value itself: None (unset, not required), a str for a str option, a bool for a bool option, an int or float
    default of its own type, and a command line's plain digits for an int ("12") or a float ("0.5") option, each
    within the option's min / max. Any other value (a sign, an exponent, a path, a list, out of range: its error
    message), and every value of any other option, is typer's own conversion, so what a command receives and every
    error it prints are typer's (tests/test_cli_start.py compares the two on every option of every command).

    No typer internals (typer 0.29's private `_runtime_param` and `typer._coercion` before stop 56): installed as the
    parameter's `process_value` (click's documented step that converts a parameter's value and runs its callback;
    typer's own is kept as `typers` and takes every value not plain), and an option's kind read from what moectl
    declares, the command function's annotation (str, bool, int, float, or Optional of one) and its
    `typer.Option(...)` (`parser`, `min`, `max`, `clamp`: typer.Option's own keywords). A declaration read otherwise
    (Annotated, another type, a parser) or one that cannot be read at all leaves the option to typer: slower by
    pydantic's import, never different."""

    PLAIN = (str, bool, int, float)

    def __init__(self, param, kind: type, low=None, high=None):
        self.param, self.kind, self.low, self.high = param, kind, low, high
        self.typers = param.process_value           # typer's conversion (the bound method ours replaces)

    @classmethod
    def install(cls, command, params) -> None:
        """Give each of `params` (of `command`) whose value can be plain this conversion, once."""
        try:
            declared = cls.declared(command)
        except Exception:                           # a function this cannot read: every option left to typer
            declared = {}
        for p in params:
            if isinstance(vars(p).get("process_value"), cls) or p.multiple or p.nargs != 1:
                continue
            kind, low, high = declared.get(p.name) or (
                (bool, None, None) if getattr(p, "is_bool_flag", False) else (None, None, None))   # --help
            if kind is not None:
                p.process_value = cls(p, kind, low, high)

    @classmethod
    def declared(cls, command) -> dict:
        """{parameter name: (kind, min, max)} of `command`'s function's options whose declared kind is plain."""
        import inspect
        import typing

        fn = getattr(command, "callback", None)
        if fn is None:
            return {}
        hints = typing.get_type_hints(fn)           # as typer reads them: a signature set by a decorator keeps text
        out = {}
        for name, p in inspect.signature(fn).parameters.items():
            kind, info = cls.plain_kind(hints.get(name, p.annotation)), p.default
            if (kind is None or not isinstance(info, typer.models.ParameterInfo) or info.parser is not None
                    or getattr(info, "clamp", False)):
                continue
            out[name] = (kind, info.min, info.max)
        return out

    @classmethod
    def plain_kind(cls, annotation) -> type | None:
        """str, bool, int or float where `annotation` is one of them or Optional of one, else None."""
        import types
        import typing

        if annotation in cls.PLAIN:
            return annotation
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
            kind = next(a for a in args if a is not type(None))
            return kind if kind in cls.PLAIN else None
        return None

    def __call__(self, ctx, value):
        p = self.param
        plain = None if value is None else self.plain(value)
        if (value is None and p.required) or (value is not None and plain is None):
            return self.typers(ctx, value)          # typer's value, or its error (a required option's "Missing")
        return plain if p.callback is None else p.callback(ctx, p, plain)

    def plain(self, value):
        """`value` as the option receives it where no parsing is needed, else None (typer's conversion decides)."""
        kind = self.kind
        if kind in (str, bool):
            return value if type(value) is kind else None
        if type(value) is str:                      # a command line's or an environment variable's text
            whole, dot, frac = value.partition(".")
            if not (value.isascii() and whole.isdigit() and len(value) <= 20):
                return None
            if dot and (kind is int or not frac.isdigit()):
                return None
            value = kind(value)
        if type(value) is not kind:
            return None
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            return None                             # typer's conversion: its out-of-range message
        return value


class _Command(typer.core.TyperCommand):
    """A moectl command: its help shows a boolean flag as the flag alone (typer labels it `<bool>`, a value the
    flag does not take), and the runtime's "Device and cache" panel right after the command's own options (typer
    orders panels by their first option: the command's sampling and output ones would come first). Its options'
    plain values are converted without pydantic (`PlainValues`)."""

    def get_params(self, ctx):
        from .commands._common import DEVICE_PANEL

        params = super().get_params(ctx)
        PlainValues.install(self, params)
        for p in params:
            if getattr(p, "is_bool_flag", False) and p.metavar is None:
                p.metavar = ""
        rank = {None: 0, DEVICE_PANEL: 1}
        return sorted(params, key=lambda p: rank.get(getattr(p, "rich_help_panel", None), 2))


def command_modules() -> dict[str, str]:
    """{command name: its module under moectl/commands/}, in the order --help lists them (the modules' names
    sorted; `_common` and other `_` modules are not commands). A directory listing: nothing is imported."""
    from . import commands

    return {m.name.replace("_", "-"): m.name
            for m in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name)
            if not m.name.startswith("_")}


def build_command(name: str, module_name: str):
    """The click command (or group: `trace`) of one moectl command, its module imported now. Built by typer in a
    Typer of moectl's settings that holds this command alone, so it is the command the whole group had when
    every module was imported at start-up."""
    module = importlib.import_module(f"{__package__}.commands.{module_name}")
    one = typer.Typer(**APP_SETTINGS)
    if isinstance(getattr(module, "app", None), typer.Typer):
        for info in module.app.registered_commands:
            if info.cls in (None, typer.core.TyperCommand):
                info.cls = _Command
        one.add_typer(module.app, name=name)
    else:
        command = getattr(module, module_name, None) or getattr(module, module_name + "_")     # eval.py: eval_
        one.command(name, cls=_Command)(command)
    return typer.main.get_group(one).commands[name]


class LazyCommands(MutableMapping):
    """The group's commands ({name: click command}, what click's and typer's group code reads as
    `group.commands`): every name is listed, but a command's module is imported and its command built only when
    that command is looked up. `moectl generate` imports generate.py and what it needs, not the other 16 command
    modules (bench's, serve's, ...), and typer builds one command, not 17 (~0.1 s of a torch-free generate's
    ~0.8 s before, docs/gguf.md "stop 54");
    `moectl --help`, which lists them all, builds them all, as before."""

    def __init__(self, built: dict):
        self._modules = command_modules()
        self._built = dict(built)

    def __getitem__(self, name: str):
        if name not in self._built:
            if name not in self._modules:
                raise KeyError(name)
            self._built[name] = build_command(name, self._modules[name])
        return self._built[name]

    def __contains__(self, name) -> bool:                   # a name's question: nothing built
        return name in self._modules or name in self._built

    def __setitem__(self, name: str, command) -> None:      # click's `add_command`
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._modules.pop(name, None)
        self._built.pop(name, None)

    def __iter__(self):
        return iter(dict.fromkeys([*self._modules, *self._built]))

    def __len__(self) -> int:
        return len(set(self._modules) | set(self._built))


class _Commands(typer.core.TyperGroup):
    """moectl's command group, its commands built when asked for (`LazyCommands`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.commands = LazyCommands(self.commands)

    def get_params(self, ctx):
        params = super().get_params(ctx)
        PlainValues.install(self, params)           # its --help flag's unset value: no pydantic either
        return params

    def list_commands(self, ctx) -> list[str]:
        """Every command, built (--help lists them with their help): the plain commands first, then the groups
        (`trace`), the order typer gives a group whose commands and sub-apps were all registered up front."""
        built = [(name, self.commands[name]) for name in self.commands]
        return ([n for n, c in built if not isinstance(c, typer.core.TyperGroup)]
                + [n for n, c in built if isinstance(c, typer.core.TyperGroup)])


app = typer.Typer(cls=_Commands, **APP_SETTINGS)


@app.callback()
def _group() -> None:
    # no options of its own; registered so that typer makes `app` a group of commands although none is registered
    # with it (typer turns an app with one command and no callback into that command)
    pass


def run() -> None:
    """The `moectl` script and `python -m moectl`: `main()`, then the process ends at once (`exit_now`). Tests call
    `main()` inside their own process, which must go on; only these two entry points end it."""
    numpy_with_one_blas_thread()
    from .commands import _common

    _common.kept_until_exit = []                # the engine lives until the process ends (`_common.kept_until_exit`)
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    exit_now(code)


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")     # OpenBLAS's order


def numpy_with_one_blas_thread() -> None:
    """Import numpy with its OpenBLAS pool at one thread, then put the environment back (OpenBLAS reads
    OPENBLAS_NUM_THREADS once, when numpy loads it; nothing else sees the setting: not torch's BLAS, not a child
    process). Why: numpy's BLAS computes nothing large in moectl (the policies' and predictors' small products; the
    model is torch's or ggml's, their threads set by --threads), and starting a pool of one thread a core took
    ~0.045 s of a ~0.55 s torch-free `generate -n 1` on the 2-core machine (docs/gguf.md, "stop 54"), a pool
    that then spins beside ggml's and torch's threads. A user's own setting (OPENBLAS_NUM_THREADS, or the
    GOTO_NUM_THREADS / OMP_NUM_THREADS that OpenBLAS reads after it) is left as it is."""
    if "numpy" in sys.modules or any(v in os.environ for v in BLAS_THREAD_VARIABLES):
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    except Exception:                               # a broken install: the command meets it where it needs numpy,
        pass                                        # inside main()'s error handling, as before
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


# moectl's own worker pools (expert reads, CPU experts): they only read and compute, so ending the process under
# them loses nothing; any other live non-daemon thread may be writing, and is waited for as Python waits
OWN_THREADS = "moectl-"


def exit_now(code=0) -> None:
    """End the process as `sys.exit(code)` would, without the interpreter's teardown of its heap: after a model's
    load that is seconds of garbage collection over torch's and transformers' objects (1.3-1.8 s on the shared
    2-core machine, a 2-layer GGUF, `bench/gguf_load_time.py`'s "cli" row), which a CLI run that has printed its
    answer spends for nothing. What the teardown would do that matters is done first: the atexit handlers (logging's
    flush, a temporary corpus's removal, ...) and stdout/stderr flushed. Files moectl writes are closed by their
    commands (`with` blocks). Where another thread still runs, or a stream cannot be flushed (a closed pipe), the
    normal exit is taken: Python waits for the thread, and reports the pipe as it always has."""
    if code is None:
        code = 0
    elif not isinstance(code, int):                 # sys.exit("message"): printed, exit status 1
        print(code, file=sys.stderr)
        code = 1
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() and not t.name.startswith(OWN_THREADS)
           for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()                         # what Python runs at exit; each handler's error is printed
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code & 0xFF)


def main() -> None:
    try:
        rc = app(standalone_mode=False)      # typer.Exit(n) and Ctrl-C come back as a return code here
        if isinstance(rc, int) and rc != 0:
            sys.exit(rc)
    except MoectlError as e:
        _error(str(e))
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)
    except MemoryError:                      # an allocation the runtime did not wrap: still one line, exit 2
        _error("out of host memory; use --offload disk, or a smaller --cache-experts / --budget")
    except OSError as e:                     # a file the machine refuses (read-only, not a directory, disk full)
        if e.errno not in FILE_ERRNOS or e.filename is None:
            raise
        _error(file_error(e))
    except SystemExit:
        raise
    except Exception as e:  # click usage errors and aborts come through here in standalone_mode=False
        usage, help_shown, shown, aborts = _click_exception_types()
        if isinstance(e, help_shown):        # `moectl trace` with no sub-command: its help, as before
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, usage):             # a bad option value, a missing or unknown option: one line, exit 2
            _error(usage_message(e))
        if isinstance(e, shown):
            _error(e.format_message())       # a file option that cannot be opened, ...: bad input too
        if isinstance(e, aborts):
            err_console.print("[yellow]aborted[/]")
            sys.exit(1)
        raise


FILE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENOSPC, errno.EDQUOT}


def file_error(e: OSError) -> str:
    """A write the machine refused, where no command checked first: the file and why, and where MOECTL_HOME is
    the reason, what to set."""
    from .core.recipes import moectl_home

    path = Path(e.filename)
    msg = f"{path}: {e.strerror or e}"
    home = moectl_home()
    if path == home or home in path.parents:
        msg += f" (under MOECTL_HOME, {home}: set MOECTL_HOME or --workdir to a writable directory)"
    return msg


def _error(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)   # [..] is text
    sys.exit(2)


def usage_message(e) -> str:
    """click's usage error (`Invalid value for '--depth': ...`, `No such option: --x`) as one line that says which
    command's --help to read, instead of click's Usage/Try/Error block."""
    msg = " ".join(e.format_message().split())
    msg = (msg[:1].lower() + msg[1:]).rstrip(".")
    names, ctx = [], getattr(e, "ctx", None)
    while ctx is not None and ctx.parent is not None:     # the sub-command path, whatever argv[0] was
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    return f"{msg} (see `{' '.join(['moectl', *names])} --help`)"


def _click_exception_types() -> tuple[tuple[type, ...], ...]:
    """(usage errors, usage errors that print help, other exceptions with .format_message() and .exit_code, abort
    exceptions) of click and of the click typer vendors (typer >= 0.29 ships its own copy as typer._click, and its
    Abort is `typer.Abort`)."""
    import click

    usage: list[type] = [click.exceptions.UsageError]
    helps: list[type] = [click.exceptions.NoArgsIsHelpError]
    shown: list[type] = [click.exceptions.ClickException]
    aborts: list[type] = [click.exceptions.Abort, typer.Abort]
    try:
        from typer._click import exceptions as vendored

        usage.append(vendored.UsageError)
        helps += [c for c in (getattr(vendored, "NoArgsIsHelpError", None),) if c is not None]
        shown.append(vendored.ClickException)
        aborts += [c for c in (getattr(vendored, "Abort", None),) if c is not None]
    except ImportError:
        pass
    return tuple(usage), tuple(helps), tuple(shown), tuple(aborts)


if __name__ == "__main__":
    run()

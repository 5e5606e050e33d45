"""Where a torch-free `moectl generate -n 1` spends its time, step by step, source trees alternating (docs/gguf.md,
"Load to first token on files nothing repacks (stop 54)").

Each run is a fresh process that runs the command line (`moectl.cli.run`, as the script does) on
`generate -m FILE -p Hi -n 1 --greedy --device cpu --threads 1` (the file's config and tokenizer saved by an
earlier run: the torch-free engine, runtime/graph_engine.py) and times, with time.perf_counter and
time.process_time:
  import moectl.cli            the command line's module (before stop 54 also every command's module, and numpy)
  numpy (cli.run)              numpy imported with OpenBLAS at one thread, as `cli.run` does first (stop 54 on)
  generate's module            moectl/commands/generate.py and what it imports (the runtime options; numpy
                               where nothing imported it before)
  import the engine            runtime/graph_engine.py and what it imports (gguf, tokenizers, moectl's store)
  options (typer)              main() until generate's load_engine: the group, the parse, each option's value
  load: header                 GgufFiles (the GGUF header parsed, the file mapped)
  load: saved config           the config an earlier run saved, checked against the file
  load: tokenizer              the tokenizer an earlier run saved (tokenizers' Tokenizer.from_file and the rest)
  load: the rest               the rest of the load (sizes, the resolver, the graph's description)
  first token                  GraphEngine.generate: the prompt's forward (ggml), the pick, the decode
  output                       the rest of main(): the status lines, the text, the stats line
and the parent times the whole process ("process": interpreter start and exit included; "interpreter and exit"
is what the steps above do not cover; the child ends as the command line does, `cli.exit_now`, its figures
printed by an atexit handler). Medians over `--repeat` runs, wall and CPU seconds (user + sys: a busy machine
inflates it least; the process's, every thread's: an OpenBLAS pool that spins after its start too). The step rows
are measured in-process; the "process" row is the command as a user runs it, timed from outside.

Usage (a quiet machine; ~1 s a run):
    python bench/gguf_first_token_steps.py --model FILE.gguf [--repeat 7] [--tree /path/a --tree /path/b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_load_time import ROOT, TIMER, add_tree_options, children_cpu, model_and_trees  # noqa: E402

DEFAULT_MODEL = "~/.cache/moectl/gguf_vs_llamacpp/mixtral-2/model-Q5_K_M.gguf"

CHILD = TIMER + r"""
steps, marks = {}, [("start", *now())]
def mark(name):
    marks.append((name, *now()))
def timed(owner, name, row):
    fn = getattr(owner, name)
    def run(*a, **k):
        t = now()
        try:
            return fn(*a, **k)
        finally:
            w, c = now()
            old = steps.get(row, [0.0, 0.0])
            steps[row] = [old[0] + w - t[0], old[1] + c - t[1]]
    setattr(owner, name, run)
from moectl import cli
mark("import moectl.cli")
if hasattr(cli, "numpy_with_one_blas_thread"):  # what cli.run does first (stop 54 on); before, numpy came later
    cli.numpy_with_one_blas_thread()
mark("numpy (cli.run)")
import moectl.commands.generate as G
mark("generate's module")
import moectl.runtime.graph_engine as GE
mark("import the engine")
timed(GE, "GgufFiles", "load: header")
timed(GE, "saved_config", "load: saved config")
timed(GE, "saved_tokenizer", "load: tokenizer")
load_engine = G.load_engine
def load_engine_marked(*a, **k):
    mark("options (typer)")
    out = load_engine(*a, **k)
    mark("load")
    return out
G.load_engine = load_engine_marked
timed(GE.GraphEngine, "generate", "first token")
def report():                           # at exit (`cli.exit_now` runs the atexit handlers): main() is done
    mark("main done")
    rows = {name: [w - pw, c - pc] for (_, pw, pc), (name, w, c) in zip(marks, marks[1:])}
    load = rows.pop("load")
    parts = [steps.get(k, [0.0, 0.0]) for k in ("load: header", "load: saved config", "load: tokenizer")]
    rows |= {k: steps.get(k, [0.0, 0.0]) for k in ("load: header", "load: saved config", "load: tokenizer")}
    rows["load: the rest"] = [load[i] - sum(p[i] for p in parts) for i in (0, 1)]
    rows["first token"] = steps["first token"]
    done = rows.pop("main done")
    rows["output"] = [done[i] - steps["first token"][i] for i in (0, 1)]
    rows["torch-free"] = "torch" not in sys.modules
    print("RESULT " + json.dumps(rows), file=sys.stderr)
import atexit
atexit.register(report)
sys.argv = ["moectl", "generate", "-m", sys.argv[1], "-p", "Hi", "-n", "1", "--greedy", "--device", "cpu",
            "--threads", "1"]
cli.run()                               # as the script runs it: main(), then the process ends at once
"""

ORDER = ("import moectl.cli", "numpy (cli.run)", "generate's module", "import the engine", "options (typer)",
         "load: header", "load: saved config", "load: tokenizer", "load: the rest", "first token", "output")


def run(tree: Path, model: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t, cpu = time.perf_counter(), children_cpu()
    p = subprocess.run([sys.executable, "-c", CHILD, model], env=env, cwd=tree, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t, children_cpu() - cpu
    if p.returncode:
        sys.exit(f"error: moectl from {tree} failed:\n{p.stderr[-2000:]}")
    rows = json.loads([ln for ln in p.stderr.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    if not rows.pop("torch-free"):
        sys.exit(f"error: {model} did not take the torch-free engine from {tree} (run it once first: the first "
                 "run saves its config and tokenizer)")
    rows["interpreter and exit"] = [(wall, cpu)[i] - sum(rows[k][i] for k in ORDER) for i in (0, 1)]
    rows["process"] = [wall, cpu]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_tree_options(ap, DEFAULT_MODEL, "the GGUF file (default: the mixtral 2-layer Q5_K_M)", 7,
                     "runs per tree; medians are shown")
    a = ap.parse_args()
    model, trees = model_and_trees(a)
    for t in trees:
        run(t, model)                               # a warm-up each: the page cache, the bytecode
    runs: dict[Path, list] = {t: [] for t in trees}
    for _ in range(a.repeat):
        for t in trees:
            runs[t].append(run(t, model))
    sys.path.insert(0, str(ROOT))
    from rich.console import Console

    from moectl.tables import print_table

    names = ["step (s, median)"] + [f"{i + 1} {what}" for i in range(len(trees)) for what in ("wall", "CPU")]
    rows = [[step] + [f"{statistics.median(r[step][i] for r in runs[t]):.3f}" for t in trees for i in (0, 1)]
            for step in (*ORDER, "interpreter and exit", "process")]
    caption = "trees: " + "; ".join(f"{i + 1} = {t}" for i, t in enumerate(trees))
    print_table(Console(), names, rows, title=f"torch-free generate -n 1: {Path(model).name}, {a.repeat} runs",
                caption=caption, left=(0,))


if __name__ == "__main__":
    main()

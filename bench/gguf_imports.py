"""What a GGUF's lean load still imports, and what each import costs (issue 42's load to first token).

After the lean load (runtime/load.py) builds no transformers model, a GGUF run's load is mostly imports. Each row is
a fresh process (nothing imported yet) timing one thing with time.perf_counter, wall and CPU (user + sys):
  - `import torch` alone;
  - `import transformers` after torch (its package __init__: every transformers import pays it);
  - the GGUF's config (`store/facts.py: load_config` after both: the config class, its auto docstrings, the header);
  - the tokenizer from the workdir's cache (`gguf-tokenizer/`, as `Engine.tokenizer` reads it: AutoTokenizer) after
    the config, the same tokenizer.json by the `tokenizers` library alone, and moectl's transformers-free reader
    of that directory (`store/gguf/tokenizer.py: SavedTokenizer`, one encode; then, apart, its first chat prompt:
    jinja2 imported, the template compiled and rendered, the text encoded);
  - `import moectl.runtime.engine` after torch (moectl's own modules, numpy, gguf, ...).
The medians of `--repeat` runs, in seconds. The workdir's tokenizer cache must exist (run `moectl generate` on the
file once).

Usage (a quiet machine; a few seconds a run):
    python bench/gguf_imports.py [--model FILE.gguf] [--workdir DIR] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_load_time import DEFAULT_MODEL, ROOT, TIMER  # noqa: E402

# name -> (setup, timed): each a fresh process; `timed` is what the row measures, after `setup`
ROWS = {
    "import torch": ("", "import torch"),
    "import transformers (after torch)": ("import torch", "import transformers"),
    "load_config (after both)": ("import torch, transformers\nfrom moectl.store.facts import load_config",
                                 "load_config(sys.argv[1])"),
    "tokenizer: AutoTokenizer (after config)": (
        "import torch\nfrom moectl.store.facts import load_config\nload_config(sys.argv[1])\n"
        "from transformers import AutoTokenizer",
        "AutoTokenizer.from_pretrained(sys.argv[2])"),
    "tokenizer: tokenizers alone": ("", "import tokenizers\ntokenizers.Tokenizer.from_file(sys.argv[2] + "
                                        "'/tokenizer.json')"),
    "tokenizer: SavedTokenizer, one encode": (
        "from pathlib import Path",
        "from moectl.store.gguf.tokenizer import SavedTokenizer\n"
        "SavedTokenizer(Path(sys.argv[2])).encode('The capital of France is')"),
    "its first chat prompt (jinja2)": (
        "from pathlib import Path\nfrom moectl.store.gguf.tokenizer import SavedTokenizer\n"
        "tok = SavedTokenizer(Path(sys.argv[2]))",
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)"),
    "import moectl.runtime.engine (after torch)": ("import torch", "import moectl.runtime.engine"),
}


def run_row(setup: str, timed: str, model: str, tok_dir: str) -> list[float]:
    code = TIMER + setup + "\nt = now()\n" + timed + "\nprint('RESULT ' + json.dumps(since(t)))\n"
    p = subprocess.run([sys.executable, "-c", code, model, tok_dir], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode:
        sys.exit(f"error: a row failed:\n{p.stderr[-2000:]}")
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the GGUF file")
    ap.add_argument("--workdir", default=None, help="its moectl workdir (default: moectl's, by the file's name)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes a row (median)")
    ap.add_argument("--json", action="store_true", help="the medians as JSON")
    a = ap.parse_args()
    model = str(Path(a.model).expanduser())
    if a.workdir is None:
        sys.path.insert(0, str(ROOT))
        from moectl.core.recipes import resolve_model

        a.workdir = str(resolve_model(model, None).workdir)
    tok_dir = str(Path(a.workdir) / "gguf-tokenizer")
    if not (Path(tok_dir) / "tokenizer.json").exists():
        sys.exit(f"error: no tokenizer cache in {tok_dir}: run `moectl generate -m {model} -p hi -n 1` once first")
    out = {}
    for name, (setup, timed) in ROWS.items():
        runs = [run_row(setup, timed, model, tok_dir) for _ in range(a.repeat)]
        out[name] = [statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)]
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{'step':<44} {'wall s':>8} {'CPU s':>8}")
    for name, (wall, cpu) in out.items():
        print(f"{name:<44} {wall:>8.2f} {cpu:>8.2f}")


if __name__ == "__main__":
    main()

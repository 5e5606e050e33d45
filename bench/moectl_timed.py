"""moectl's side of both llama.cpp comparisons (`bench/vs_llamacpp.py`: moectl's own copies from a checkpoint;
`bench/gguf_vs_llamacpp.py`: the same GGUF file as llama.cpp): one timed run in one fresh process.

What it times, as llama-bench does on its side:
- load to first token (only where asked: `time_load`): `Engine.load` and one forward of one token, from before
  moectl is imported (llama.cpp's side: the wall time of `llama-bench -n 1` less its token);
- a warm-up forward of `prefill` other tokens, untimed: llama-bench's own warm-up (`llama-bench.cpp`: a whole
  `test_prompt(n_prompt)` before a prompt test's timed runs), on the ids it feeds there (below). A shorter one (8
  tokens until stop 53) left the timed prefill paying first-use work llama.cpp's did not (page faults of the mapped
  file; Qwen3 Q4_K_M, 128 experts, top-8: 233-267 against 295-302 tokens/s, the same process's later prefills);
- then the first-use repack finished, untimed (`first_use_repack`: matrices and seconds): ggml repacks an expert when
  a token first routes to it (the one graph's `rp_lazy`), llama.cpp every expert inside its load. A warm-up routes
  few of them: the last layer of a forward keeps one row (a 1-layer GPT-OSS file routed 4 of its 32 experts in a
  64-token forward), so without it the timed decode repacked Mixtral's 100 MB experts as tokens reached them (stop
  53's first run: Q4_0 1.21 / 1.40x llama.cpp's; the 1-layer GPT-OSS file 1.9x);
- prefill: `prefill_reps` forwards of `prefill` tokens (each from an empty cache), the mean of their tokens/s and
  each rep's (`prefill_samples`): llama-bench's `avg_ts` over its `-r` reps. Each rep feeds the ids llama-bench feeds
  that rep (bench/llamacpp.py `bench_prompt_ids`: glibc's unseeded `rand() % n_vocab`, BOS first where the file adds
  one), so both tools route the same rows: until stop 57 every rep fed one fixed draw, which on the Qwen3 shape sent
  13-22 % more of a layer's rows to experts below ggml's 8-row tiled threshold than llama-bench's draws (IQ files:
  3-7 % of moectl's prefill, docs/gguf.md "IQ prefill (stop 57)"). The decode's context is the first rep's ids.
  One forward (0.1-0.5 s) alone moved by 0.8-1.3x between two runs of one file (stop 55's table: Qwen3 Q5_K_M at 1
  thread 1.34x llama.cpp's, Q6_K 0.91x, neither file repacked and both tools on the same ggml loop);
- decode: a `prompt`-token context, then `gen` drawn tokens fed one at a time, no logits read (llama-bench's
  generation test feeds `std::rand() % n_vocab` and reads none: an argmax of a bf16 [1, 151936] took 0.55 ms
  here, 4 % of a 2-layer Qwen3-shape token llama-bench does not pay for), ms/token;
- the process's peak RSS (GB) and which kernels served it (moectl/kernels: ggml's CPU backend, moectl's AVX-512
  kernels, each with why not when not).

Torch-free itself: the run happens in the child process. `torch_free`: the child runs what `moectl generate` runs on a
GGUF the one ggml graph serves (moectl/runtime/graph_engine.py: neither torch nor transformers imported), after one
`moectl generate -n 1` has saved the config and tokenizer in the model's workdir (untimed, as a user's first run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moectl.cli import BLAS_THREAD_VARIABLES

# The timed part both engines run, one place for the warm-up, the prefill reps and the decode. `draw(n)`: n token
# ids from the run's seeded generator ([1, n] tensor, or [n] array for the torch-free engine; `[..., a:b]` slices
# either); `first_use_repack()`: the untimed repack's fields. Fills `res` with the timed fields.
TIMED = """
import resource, sys, time
sys.path.insert(0, {bench!r})
from llamacpp import bench_prompt_ids


def timed(eng, draw, as_ids, V, first_use_repack, res):
    prompts = [as_ids(x) for x in bench_prompt_ids(V, {prefill}, {reps} + 1, {bos!r})]   # llama-bench's own ids
    eng.forward(prompts[0], None, last_only=True)                        # warm-up, untimed
    res.update(first_use_repack())
    pre = []
    for ids in prompts[1:]:
        t0 = time.perf_counter(); eng.forward(ids, None, last_only=True)
        pre.append({prefill} / (time.perf_counter() - t0))
    out, cache = eng.forward(prompts[1][..., :{prompt}], None, last_only=True)   # the decode's context
    feed = draw({gen})
    t0 = time.perf_counter()
    for t in range({gen}):
        out, cache = eng.forward(feed[..., t:t + 1], cache)
    t_dec = time.perf_counter() - t0
    res.update(prefill_tps=sum(pre) / len(pre), prefill_samples=pre, decode_ms=t_dec / {gen} * 1000,
               rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""

# {load}: Engine.load's keyword arguments (repr-able: str, int, None), "model" among them
SCRIPT = """
import json, time, torch
t0 = time.perf_counter()
from moectl.runtime.engine import Engine
from moectl import kernels
from moectl.kernels import ggml


def ggml_loaded():
    # whether the run loaded ggml (asking here would build it: ggml's build takes minutes)
    return ggml._load.cache_info().currsize > 0 and ggml.library() is not None


def kernels_used():
    # what served this run: a kernel library counts when the run loaded it, with ggml's CPU features (its own
    # dispatch) or why it did not load
    g = ggml_loaded()
    k = kernels.library.cache_info().currsize > 0 and kernels.library() is not None
    return {{"ggml": g, "ggml_features": ggml.features() if g else [], "ggml_prefetch": ggml.prefetch_bytes(),
            "own_q6k": ggml.own_q6k_kernel() if g else None,
            "ggml_why_not": None if g else (ggml._why[-1] if ggml._why else "not called by this run"),
            "moectl_avx512": k,
            "moectl_avx512_why_not": None if k else (kernels._why[-1] if kernels._why else "not called by this run"),
            "torch_threads": torch.get_num_threads()}}


def first_use_repack():
    # the experts no warm-up token routed to, repacked now, untimed: ggml repacks an expert on first use, llama.cpp
    # every expert inside its load (outside its timed runs)
    if not ggml_loaded():
        return {{}}
    t1 = time.perf_counter()
    return {{"first_use_repack": {{"matrices": ggml.finish_repack(), "s": time.perf_counter() - t1}}}}


load = {load!r}
eng = Engine.load(load.pop("model"), **load)
res = {{}}
if {time_load!r}:
    with torch.inference_mode():
        eng.forward(torch.tensor([[1]]), None, last_only=True)
    res["load_s"] = time.perf_counter() - t0
g = torch.Generator().manual_seed(0)
V = eng.config.vocab_size
with torch.inference_mode():
    timed(eng, lambda n: torch.randint(0, min(V, 1024), (1, n), generator=g), lambda x: torch.tensor([x]), V,
          first_use_repack, res)
res.update(note=getattr(eng, "plan_note", None) or None, kernels=kernels_used())
print("RESULT " + json.dumps(res))
"""


# the same run through the torch-free engine: numpy ids, no logits read
SCRIPT_TORCH_FREE = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from moectl.kernels import ggml
from moectl.runtime.graph_engine import GraphEngine
from moectl.setting.options import RuntimeOptions


def first_use_repack():
    t1 = time.perf_counter()
    return {{"first_use_repack": {{"matrices": ggml.finish_repack(), "s": time.perf_counter() - t1}}}}


load = {load!r}
model = load.pop("model")
eng, why = GraphEngine.try_load(model, RuntimeOptions(**load))
if eng is None:
    print("NOTREADY " + json.dumps(why))
    raise SystemExit(0)
res = {{}}
if {time_load!r}:
    eng.forward([1], None, last_only=True)
    res["load_s"] = time.perf_counter() - t0
rng = np.random.default_rng(0)
V = eng.graph.V
timed(eng, lambda n: rng.integers(0, min(V, 1024), n), np.array, V, first_use_repack, res)
res.update(note=eng.plan_note,
           kernels={{"ggml": True, "ggml_features": ggml.features(), "ggml_prefetch": ggml.prefetch_bytes(),
                    "own_q6k": ggml.own_q6k_kernel(),
                    "ggml_why_not": None, "moectl_avx512": False,
                    "moectl_avx512_why_not": "the torch-free engine: the one ggml graph computes everything",
                    "torch_threads": None, "torch_free": True, "torch_imported": "torch" in sys.modules}})
print("RESULT " + json.dumps(res))
"""


def script(load: dict, threads: int, prompt: int, gen: int, prefill: int, time_load: bool = False,
           torch_free: bool = False, prefill_reps: int = 1, bos: int | None = None) -> str:
    """The child's Python source. `load` gets `threads`, `device="cpu"`, `progress=False` and `gating="none"` unless
    it says otherwise. The warm-up and the timed prefills feed llama-bench's own prompt ids (bench/llamacpp.py
    `bench_prompt_ids`), `bos` first where llama.cpp adds one (`gguf_bos`)."""
    if gen < 1 or not 1 <= prompt <= prefill:            # the decode's context is the prefill's first `prompt` ids
        raise ValueError(f"gen >= 1 and 1 <= prompt <= prefill (got prompt {prompt}, gen {gen}, prefill {prefill})")
    if prefill_reps < 1:
        raise ValueError(f"prefill_reps >= 1 (got {prefill_reps})")
    load = {"device": "cpu", "threads": threads, "progress": False, "gating": "none", **load}
    body = SCRIPT_TORCH_FREE if torch_free else SCRIPT
    return (TIMED + body).format(load=load, time_load=time_load, prefill=prefill, prompt=prompt, gen=gen,
                                 reps=prefill_reps, bos=bos, bench=str(Path(__file__).resolve().parent))


def gguf_bos(model: str) -> int | None:
    """The BOS id llama.cpp puts first in a prompt of the GGUF file `model` (`tokenizer.ggml.add_bos_token`; without
    it, as llama.cpp's vocabulary: a sentencepiece one adds BOS), None where it adds none or `model` is no GGUF
    file (a checkpoint: its llama.cpp comparison's GGUF is another file, not read here)."""
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        return None
    from moectl.store.gguf.files import GgufFiles

    meta = GgufFiles(path).meta
    add = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    return meta.get("tokenizer.ggml.bos_token_id") if add else None


def first_run(model: str) -> None:
    """One untimed `moectl generate -n 1` on `model` in a fresh process: it saves the config and tokenizer the
    torch-free engine reads (a GGUF file's first run)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    first = [sys.executable, "-m", "moectl", "generate", "-m", model, "-p", "Hello", "-n", "1",
             "--greedy", "--device", "cpu", "--threads", "1", "--json"]
    subprocess.run(first, capture_output=True, text=True, env=env, check=True)


def moectl_run(load: dict, threads: int, prompt: int, gen: int, prefill: int, time_load: bool = False,
               torch_free: bool = False, prefill_reps: int = 1) -> dict:
    """One fresh process: {"prefill_tps", "decode_ms", "rss_gb", "note", "kernels"} and, with `time_load`,
    "load_s". Exits with the child's output tail when it fails. `torch_free`: the torch-free engine (a GGUF the
    one graph serves; its first `moectl generate` run, untimed, saves what it reads)."""
    code = script(load, threads, prompt, gen, prefill, time_load, torch_free, prefill_reps, gguf_bos(load["model"]))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    if not any(v in os.environ for v in BLAS_THREAD_VARIABLES):
        # numpy's OpenBLAS pool at one thread, as `moectl` itself starts it (cli.py numpy_with_one_blas_thread):
        # else its idle threads spin beside ggml's (perf of a 1-thread prefill here: ~2 % in blas_thread_server)
        env["OPENBLAS_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if torch_free and r.stdout.startswith("NOTREADY "):
        first_run(load["model"])
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if r.stdout.startswith("NOTREADY "):
            raise SystemExit(f"the torch-free engine does not serve {load['model']}: {r.stdout[9:].strip()}")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"moectl run failed on {load.get('model')}:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    return json.loads(line[-1][7:])

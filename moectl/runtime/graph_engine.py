"""GraphEngine: a GGUF run that the one ggml graph serves whole, without torch or transformers (issue 42's load).

Why: on a GGUF in place on the CPU, where the one graph (`ggml_model.py`) computes every forward (the lean load of
`load.py`), torch and transformers compute nothing, but importing them took ~3.5 s of a ~6 s `moectl generate -n 1`
on this 2-core machine, against llama.cpp's 1.7 s for its whole load, prompt and token. This engine needs neither:
the config is the dict a previous run saved in the workdir (`store/gguf/saved_config.py`), the tokenizer the one it
saved (`store/gguf/tokenizer.py`), sampling is numpy's (`sampling.py`, the same draws as `Engine`'s), the counters a
dict. It answers what `moectl generate` asks of an engine (`generate`, `lossy`, `resolved_options`, the notes), with
the same figures as `Engine` on the same run (tests/test_graph_engine.py), and what `moectl serve` reads of its cache
(`InPlaceCounters`: totals, no device cache; tests/test_serve_torch_free.py).

Which runs take it (`GraphEngine.try_load`, else `Engine.load` as before, which saves the config and tokenizer for
the next run): a GGUF of a lean-load family (`LEAN_FAMILIES`) on the CPU (--device cpu, or auto where no GPU
device node exists: torch could not see one either), --offload ram, no --emulate-device, no low-bit copies, no
draft, replay or predictor, and nothing in the workdir that the resolver turns into gating or prefetch; the config
and tokenizer saved by an earlier run for this very file. `MOECTL_TORCH_FREE=0` switches it off.

Legend: T = tokens, L = layers, U = experts used a token, V = vocabulary.
"""

from __future__ import annotations

import copy
import glob
import os
from types import SimpleNamespace

import numpy as np

from ..core.cache_model import hit_rate
from ..core.recipes import resolve_model
from ..core.sizing import KV_RESERVE_TOKENS
from ..errors import MoectlError
from ..kernels import ggml
from ..setting.model_sizes import config_sizes
from ..setting.options import DEFAULT, RuntimeOptions
from ..setting.resolve import note_in_place_sizes, resolve
from ..setting.threads import thread_count
from ..formats.gguf_encodings import encoding_name
from ..store.gguf.experts import ExpertIndex, dense_in_place_names, ggml_experts_note, held_dense_bytes
from ..store.gguf.files import GgufFiles
from ..store.gguf.saved_config import saved_config, view_fingerprint
from ..store.gguf.tokenizer import saved_tokenizer
from ..store.memory import (
    check_host_memory,
    host_alloc,
    host_need,
    host_options,
    kv_cache_nbytes,
    rotary_tables_nbytes,
)
from ..tables import plural
from .generation import GenerationResult, PrefillProgress, TokenSink, generate_tokens, generation_stats
from .generation import prompt_ids
from .ggml_model import GgmlModel, gguf_tensors_missing
from .ggml_model import why_not as graph_why_not
from .sampling import Sampling

# the one-graph families whose header figures (`lean_dense_nbytes`, `dense_in_place_names`) tests/test_lean_load.py
# checks against the full load's (the lean load, runtime/load.py, and this engine)
LEAN_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "qwen2_moe")
# --dtype's names (`store/facts.py: parse_dtype`'s) -> (the dtype's name, bytes a value)
DTYPES = {"float32": ("float32", 4), "fp32": ("float32", 4), "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
          "float16": ("float16", 2), "fp16": ("float16", 2)}
COUNTERS = ("hits", "misses", "bytes_loaded", "load_wait_s", "prefetches", "fills")


def gpu_device_nodes() -> list[str]:
    """The GPU device nodes of this machine (NVIDIA's, and AMD's /dev/kfd that ROCm's torch reads as CUDA): where
    there are none, torch's `cuda.is_available()` is False too, so `--device auto` is the CPU without asking torch."""
    return glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/kfd")


class GgufHeader:
    """What the graph reads of a GGUF: its parsed header and mapped files (`GgmlModel.from_gguf` takes `.files`)."""

    def __init__(self, files: GgufFiles):
        self.files = files


# what a dense matrix computed in place is, by its GGUF name, in the note's order (the first that matches)
DENSE_KINDS = (("attention", lambda n: ".attn_" in n), ("shared expert", lambda n: "_shexp." in n),
               ("dense FFN", lambda n: ".ffn_" in n), ("lm_head", lambda n: n.startswith("output.")),
               ("embedding", lambda n: n.startswith("token_embd.")), ("other", lambda n: True))


def mapped_dense_note(names: frozenset, count: int) -> str:
    """The load's note on the `count` dense matrices computed where they lie, `names` their GGUF names (one fewer
    than `count` where a tied lm_head reads the embedding's bytes: `mapped_count`), each kind the file has named:
    attention and embedding always, Qwen2-MoE's shared expert, DeepSeek's dense layers' FFN."""
    kinds = {next(kind for kind, match in DENSE_KINDS if match(n)) for n in names}
    if count > len(names):
        kinds.add("lm_head")
    listed = ", ".join(kind for kind, _ in DENSE_KINDS if kind in kinds)
    return (f"gguf: {plural(count, 'dense matrix', 'dense matrices')} ({listed}) computed by ggml where they lie in "
            "the mapped file")


def mapped_count(names: frozenset, config, files: GgufFiles) -> int:
    """How many modules compute where their matrix lies, from the GGUF names: one more where a tied lm_head reads
    the embedding's bytes (`store/gguf/dense.py: dense_in_place`)."""
    tied = (getattr(config, "tie_word_embeddings", False) and "output.weight" not in files.tensors
            and "token_embd.weight" in names)
    return len(names) + tied


class InPlaceCounters:
    """The torch-free run's expert cache as `moectl serve` (worker, live page, /metrics) and `chat` read it: there is
    none. Every expert of every layer is computed where it lies in the mapped file, so each routed expert is a hit
    and nothing is copied, prefetched or waited for. The counters are the engine's own (`GraphEngine.counts`, read
    live), per layer too (`GraphEngine.layer_hits`, the forward's distinct routed experts a layer)."""

    in_place = True                                 # declared as `runtime/cache.py: ExpertCache.in_place`
    state = None                                    # no `CacheState`: no slots; `layer_rows` gives the rows

    def __init__(self, counts: dict, layer_hits: np.ndarray, n_expert: int, expert_nbytes: int,
                 layer_encodings: list[str]):
        n_layer = len(layer_hits)
        self.counts, self.layer_hits, self.n_layer, self.n_expert = counts, layer_hits, n_layer, n_expert
        self.slots_per_layer = [n_expert] * n_layer
        self.layer_encodings = layer_encodings      # per MoE layer, `GgufExpertFormat`'s name: gguf-Q4_0, ...
        self.store = SimpleNamespace(expert_nbytes=expert_nbytes, num_experts=n_expert)

    @property
    def stats(self):
        return self                                 # `ExpertCache.stats.as_dict()`: the same totals

    def as_dict(self) -> dict:
        """`runtime/cache.py: CacheStats.as_dict`'s totals, in place: hits only, nothing loaded."""
        c = self.counts
        return {"hits": c["hits"], "misses": c["misses"], "hit_rate": hit_rate(c),
                "demand_loads": 0, "cpu_misses": 0, "bytes_loaded": c["bytes_loaded"],
                "load_wait_s": c["load_wait_s"], "prefetches": c["prefetches"], "prefetch_used": 0,
                "fills": c["fills"]}

    def snapshot(self) -> dict:
        return self.as_dict()

    def layer_rows(self) -> list[dict]:
        """Per MoE layer (`runtime/live_view.py: layer_rows`'s rows): every expert held, in its file encoding; its
        hits, no miss (`live_view.layer_hits`' hit rate: 0.0 before any)."""
        return [{"slots": self.n_expert, "resident": dict.fromkeys(range(self.n_expert), name),
                 "hits": int(h), "misses": 0, "hit_rate": 1.0 if h else 0.0}
                for name, h in zip(self.layer_encodings, self.layer_hits)]


def layer_encodings(index: ExpertIndex) -> list[str]:
    """Each MoE layer's expert encodings as `formats/gguf.py: GgufExpertFormat` names them (expert 0's parts)."""
    return ["gguf-" + "+".join(dict.fromkeys(encoding_name(t.encoding) for _, t in index.parts(layer, 0)))
            for layer in index.layers]


class GraphEngine:
    """A GGUF's run through the one ggml graph alone (module docstring). `try_load` -> engine or (None, why not)."""

    speculator = None                               # no --draft here (`Engine` drafts)
    prefetch = None                                 # nor a prefetch policy
    torch_free = True                               # `Engine.torch_free` is False: what `serve` says it runs

    def __init__(self, ref, config, files: GgufFiles, graph: GgmlModel, tokenizer, opts: RuntimeOptions, setting,
                 threads: int, fingerprint: str, dense_nbytes: int, progress: bool, expert_nbytes: int,
                 encodings: list[str]):
        self.config, self.files, self.graph, self.tokenizer, self.ref = config, files, graph, tokenizer, ref
        self.options, self.setting, self.threads, self.fingerprint = opts, setting, threads, fingerprint
        self.plan, self.plan_note = opts.plan_data, opts.plan_note
        self._dense_bytes = dense_nbytes
        self.n_layer = graph.n_layer
        self.counts = dict.fromkeys(COUNTERS, 0)    # the in-place cache's counters: every routed expert a hit
        self.counts["load_wait_s"] = 0.0
        self.expert_calls = 0
        self._progress = PrefillProgress(self.n_layer) if progress else None
        self.layer_hits = np.zeros(self.n_layer, dtype=np.int64)              # [L] routed experts counted a layer
        self.cache = InPlaceCounters(self.counts, self.layer_hits, int(graph.n_expert), expert_nbytes, encodings)

    # --- loading ------------------------------------------------------------------------
    @classmethod
    def try_load(cls, model: str, opts: RuntimeOptions) -> tuple["GraphEngine | None", str | None]:
        """(the engine, None), or (None, why this run takes `Engine.load`). `opts` is used only when it loads (the
        resolver fills a copy; a run that falls back resolves the options as given)."""
        if os.environ.get("MOECTL_TORCH_FREE", "1") == "0":
            return None, "MOECTL_TORCH_FREE=0"
        ref = resolve_model(model, opts.workdir)
        if not ref.gguf:
            return None, "not a GGUF file"
        why = _options_why_not(opts)
        if why:
            return None, why
        files = GgufFiles(ref.path)
        config = saved_config(ref.workdir, files.paths)
        if config is None:
            return None, "no config saved by an earlier run (this run saves it)"
        mapped = dense_in_place_names(files)        # the dense tensors computed where they lie: asked once
        why = _graph_why_not(config, files, mapped, opts)
        if why:
            return None, why
        tokenizer = saved_tokenizer(ref.workdir / "gguf-tokenizer", files.paths)
        if tokenizer is None:
            return None, "no tokenizer saved by an earlier run (this run saves it)"
        eng = cls._load(ref, files, config, tokenizer, copy.deepcopy(opts), mapped)
        return (eng, None) if eng is not None else (None, "the resolved gating or prefetch needs the modules")

    @classmethod
    def _load(cls, ref, files: GgufFiles, config, tokenizer, opts: RuntimeOptions,
              mapped: frozenset) -> "GraphEngine | None":
        opts.check()
        device_note = "device: cpu (--device cpu)" if opts.device == "cpu" else \
            "device: cpu (--device auto; no GPU device on this machine)"
        if opts.device in (None, "auto"):
            opts.sources["device"] = DEFAULT
        opts.device, opts.device_note = "cpu", device_note
        name = str(opts.dtype or getattr(config, "dtype", None) or "float32").replace("torch.", "")
        if name not in DTYPES:
            raise MoectlError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
        dtype, itemsize = DTYPES[name]
        index = ExpertIndex(files)
        L, E, K = int(config.num_hidden_layers), index.num_experts, int(config.num_experts_per_tok)
        fingerprint = view_fingerprint(config)
        n_threads = thread_count(opts.threads, config.hidden_size, index_intermediate(config))
        ggml.set_threads(n_threads)
        slot_nbytes = index.slot_nbytes()          # any expert's buffer, asked once
        header = index.sizes(mapped)
        rotary = rotary_tables_nbytes(config)
        # the sizes `store/facts.py: checkpoint_sizes` gives the lean load (its dense part before anything is mapped)
        sizes = config_sizes(config.to_dict(), fingerprint, dtype, L, E, K,
                             held_dense_bytes(header, itemsize, in_place=False) + rotary,
                             kv_cache_nbytes(config, itemsize, 1), slot_nbytes, f"checkpoint {ref.path}")
        setting = resolve(opts, sizes, ref.workdir, in_place=True)
        if graph_why_not(config, opts, setting.gating, setting.prefetch) or setting.replacement == "belady":
            return None                             # a plan's or the workdir's policies: the modules' (Engine)
        note_in_place_sizes(opts)
        # `load.py: check_host` of this run: the experts mapped (their bytes in the file), the dense part, the KV
        dense, kv = held_dense_bytes(header, itemsize), kv_cache_nbytes(config, itemsize, KV_RESERVE_TOKENS)
        check_host_memory(host_need("ram", True, True, 0, slot_nbytes, L * E, dense, kv),
                          "--offload ram on cpu (experts in place)",
                          lambda free: host_options(free, "ram", True, True, 0, slot_nbytes, L, E, dense, kv))
        encodings = sorted({encoding_name(t.encoding) for layer in index.layers for _, t in index.parts(layer, 0)})
        opts.plan_note = "; ".join(filter(None, [opts.plan_note,
                                                 mapped_dense_note(mapped, mapped_count(mapped, config, files)),
                                                 ggml_experts_note(encodings, n_threads)]))
        files.will_need()                           # the file into the page cache in the background
        graph = GgmlModel.from_gguf(GgufHeader(files), config)
        opts.plan_note = "; ".join(filter(None, [opts.plan_note, (
            "gguf: one ggml graph a forward, as llama.cpp's (torch-free run: neither torch nor transformers loaded)")]))
        eng = cls(ref, config, files, graph, tokenizer, opts, setting, n_threads, fingerprint, dense + rotary,
                  opts.progress, slot_nbytes, layer_encodings(index))
        eng.sizes = sizes
        return eng

    # --- forward and generate -----------------------------------------------------------
    def forward(self, ids, kv=None, last_only: bool = False):
        """Logits [1, T or 1, V] (numpy fp32) and the KV cache after `ids` [T]; the counters as `Engine`'s
        graph forward keeps them (each expert a step routes, once a layer: a hit)."""
        T = len(ids)
        bar = self._progress
        if bar is not None:
            bar.start()
        on_chunk = (lambda done, total: bar.layer(done * self.n_layer // total - 1, T)) if bar else None
        try:
            logits, kv = host_alloc(lambda: self.graph.forward(np.asarray(ids).reshape(1, -1), kv, last_only,
                                                               on_chunk), f"running the model on {T} tokens")
        finally:
            if bar is not None:
                bar.close()
        distinct, calls = routed_counts(self.graph.last_ids, self.n_layer)
        self.layer_hits += distinct
        self.counts["hits"] += int(distinct.sum())
        self.expert_calls += calls
        return logits, kv

    def generate(self, prompt: str | None = None, input_ids=None, max_new_tokens: int = 64, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, on_token=None,
                 stop_at_eos: bool = True, chat: bool = False, should_stop=None) -> GenerationResult:
        """`Engine.generate` (its arguments, its result and figures) through the one graph."""
        ids = prompt_ids(prompt, input_ids, chat, lambda: self.tokenizer)
        sampling = Sampling(greedy, temperature, top_p, seed)
        out = TokenSink.for_generate(self.config, self.tokenizer, max_new_tokens, stop_at_eos, on_token, should_stop)
        before, calls0 = dict(self.counts), self.expert_calls
        run = generate_tokens(ids, out, self.forward, lambda row: sampling.pick(row)[0], lambda: dict(self.counts))
        new = out.tokens
        stats = generation_stats(run, before, self.counts, self.n_layer, self.expert_calls - calls0, 0, self.threads,
                                 {"device_held_bytes": self._dense_bytes + run.kv.nbytes()})
        return GenerationResult(self.tokenizer.decode(new, skip_special_tokens=True), new, ids, stats, run.per_token)

    # --- what the commands print ----------------------------------------------------------
    def lossy(self) -> dict:
        return self.options.lossy(None) | {"precision": self.setting.precision.name}

    def resolved_options(self) -> dict:
        """{option: [value, source]}, as `Engine.resolved_options` (in place: E slots a layer, nothing prefetched)."""
        r = self.setting.replacement
        return self.options.config({"slots_per_layer": self.cache.slots_per_layer,
                                    "replacement": getattr(r, "name", r), "prefetch": "none"})


def index_intermediate(config) -> int | None:
    return getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None)


def routed_counts(last_ids: np.ndarray, n_layer: int) -> tuple[np.ndarray, int]:
    """(distinct experts each layer routed in the last forward [L], expert calls) from its routed ids [L, T, U]
    (-1: a row not routed): a step acquires each expert it routes once per layer (the module path's count)."""
    last = np.asarray(last_ids)
    ids = last.reshape(n_layer, -1)                                                      # [L, T*U]
    if last.shape[1] == 1:                     # a decode step: a row's top-k are distinct experts, no sort (~0.1 ms)
        distinct = (ids >= 0).sum(1)                                                    # [L]
        return distinct, int(distinct.sum())
    ids = np.sort(ids, axis=1)
    distinct = (ids[:, 0] >= 0) + ((ids[:, 1:] != ids[:, :-1]) & (ids[:, 1:] >= 0)).sum(1)    # [L]
    return distinct, int((ids >= 0).sum())


def _options_why_not(opts: RuntimeOptions) -> str | None:
    """Why these options need `Engine` (None: not that), before anything is read."""
    if opts.device not in (None, "auto", "cpu"):
        return f"--device {opts.device}"
    if opts.device in (None, "auto") and gpu_device_nodes():
        return "a GPU device node exists: torch decides --device auto"
    if opts.emulate_device or opts.offload != "ram":
        return "a device cache (--emulate-device, --offload disk)"
    if opts.lowbit or opts.dense_lowbit:
        return "low-bit copies (--lowbit, --dense-lowbit) are the modules'"
    for name in ("draft", "replay_trace", "predictor"):
        if getattr(opts, name, None) not in (None, "none"):
            return f"--{name.replace('_', '-')} needs the modules"
    if opts.gating not in (None, "none") or opts.prefetch not in (None, "auto", "none"):
        return "--gating / --prefetch need the modules"
    return None


def _graph_why_not(config, files: GgufFiles, mapped: frozenset, opts: RuntimeOptions) -> str | None:
    """Why the one graph cannot serve this file's every forward (`load.py: lean_why_not`'s questions, asked of the
    header and the saved config; `mapped`: its `dense_in_place_names`)."""
    if config.model_type not in LEAN_FAMILIES:
        return f"no torch-free run for the {config.model_type} family yet"
    why = graph_why_not(config, opts)               # MOECTL_GGML_GRAPH, the rope and layers, ggml's library
    if why is None and not ggml.planned():
        why = "ggml is not planned"
    if why is None and not mapped:
        why = "no dense matrix computed where it lies"
    return why or gguf_tensors_missing(files, config.num_hidden_layers, config.model_type)

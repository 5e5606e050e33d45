"""Engine: an MoE model whose experts live off the device, and generation with it (gpt-fast style).

A decode step, top to bottom (docs/architecture.md, "One path of a miss"):

    Engine.forward(token)      cache.begin_step("decode"); Runtime.begin_token: the aux gate's predictions offered
     └ the model's own layers; in each MoE block the stock router, then OffloadedExperts.forward (offloaded.py):
          gate -> cache.route + on_route (observers, prefetch -> admission) -> cache.plan -> _place (policies/miss.py)
          -> CPU misses on the worker thread (worker.py) | the device's: cache.acquire (cache.py: hit, or a copy
          through loader.py; device_cache.py) and compute -> _fill -> sum
     └ final norm hook: Runtime.end_token (observers, prefetch.end_token); cache.end_token
    Engine.generate            sample the next id (speculative.py: Sampling), or a speculative pass (Speculator)

The engine owns the model, the cache and the layers' shared state (`self.runtime`, which knows no engine: the
prefill progress is a callback it is given). Loading is `load.py`; the KV cache is transformers' DynamicCache;
greedy or temperature + top-p sampling.
"""

from __future__ import annotations

import torch

from ..errors import MoectlError
from ..kernels import gemv
from ..models import config_fingerprint
from ..setting.options import RuntimeOptions
from ..store.checkpoint import Checkpoint
from ..store.expert_store import ExpertStore
from ..store.facts import dense_nbytes, kv_nbytes
from ..store.memory import host_alloc
from .cache import ExpertCache
from .ggml_model import GraphKV
from .graph_engine import routed_counts
from .load import load
from .offloaded import Runtime
from .generation import GenerationResult, PrefillProgress, TokenSink, generate_tokens, generation_stats
from .generation import prompt_ids
from .sampling import Sampling
from .speculative import Speculator, as_numpy, make_drafter



class Engine:
    torch_free = False                              # `graph_engine.py: GraphEngine`'s is True

    def __init__(self, model, config, adapter, ckpt: Checkpoint, store: ExpertStore,
                 cache: ExpertCache, runtime: Runtime, device: torch.device, dtype: torch.dtype, ref,
                 progress: bool = False):
        self._model, self._build_model = None, None     # the model, or (the lean load) how to build it
        self.config, self.adapter, self.ckpt = config, adapter, ckpt
        self.store, self.cache, self.device, self.dtype = store, cache, device, dtype
        self.runtime = runtime                      # what every layer's experts share (offloaded.py)
        self.ref = ref
        self.fingerprint = config_fingerprint(config)
        self._tokenizer = None
        self._requests = 0
        self._dense_bytes: int | None = None        # dense weights on the device (`device_memory`)
        self.threads = torch.get_num_threads()
        self._progress = PrefillProgress(len(self.moe_layer_ids)) if progress else None
        runtime.on_layer = self._progress.layer if progress else None
        self.speculator = None                      # --draft: speculative.Speculator
        self.graph = None                           # set by `load` where a GGUF's forward is one ggml graph
        if model is not None:
            self._attach(model)

    # --- loading ------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, **options) -> "Engine":
        """Load `model` with the options of `moectl/setting/options.py: RuntimeOptions` (its fields, by name), resolved
        flag > plan.yaml > artifact default > built-in default (`runtime/load.py` says what loading does).
        `emulate_device` (CPU only): give the CPU its own expert slots that misses copy into, as a GPU has.
        `cpu_experts` auto|never|always: a missed expert computed on the CPU from host RAM instead of fetched
        (default: the plan's, else auto on CUDA, never on a CPU). `plan`: "auto" = the workdir's plan.yaml when
        neither --cache-experts nor --budget is given; a path = that plan; None = no plan. `lowbit` (e.g. q4g64)
        with `precision` full | hobbit (t1, t2) | lowbit-only: which copy a miss loads. `admission` on|off,
        `staging` (prefetch staging buffers), `prefill` cache|stream, `replay_trace`: see the CLI's --help."""
        opts = options.pop("options", None) or RuntimeOptions(**options)
        parts = load(model, opts)
        eng = cls(parts.model, parts.config, parts.adapter, parts.ckpt, parts.store, parts.cache, parts.runtime,
                  parts.device, parts.dtype, parts.ref, progress=opts.progress)
        eng.threads = parts.threads
        if parts.model is None:                     # the lean load: the model is built on first need
            eng._build_model, eng._dense_bytes = parts.build_model, parts.dense_bytes
        eng.graph = parts.graph                     # a GGUF in place: one ggml graph a forward (ggml_model.py)
        eng.options = opts
        eng.plan, eng.plan_note = opts.plan_data, opts.plan_note
        if opts.draft is not None:
            eng.speculator = Speculator(make_drafter(eng, opts.draft), opts.draft_tokens, opts.draft_rule,
                                        eng.fingerprint)
        return eng

    @property
    def model(self):
        """transformers' model, its experts offloaded; after a lean load (runtime/load.py: the one graph serves
        every forward) built here on first need: an observer, a module-path forward, a caller's own use."""
        if self._model is None and self._build_model is not None:
            self._attach(self._build_model())
            self._build_model = None
        return self._model

    def _attach(self, model) -> None:
        self._model = model
        model.model.norm.register_forward_hook(self._on_final_norm)

    @property
    def model_built(self) -> bool:
        """Whether transformers' model object exists (a lean load builds it only when needed)."""
        return self._model is not None

    # --- facts --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            gguf = self.adapter.gguf          # a GGUF file: the tokenizer its metadata describes, kept in the workdir
            if gguf is not None:
                self._tokenizer = gguf.tokenizer(self.ref.workdir / "gguf-tokenizer")
                return self._tokenizer
            if not ((self.ref.path / "tokenizer.json").exists() or (self.ref.path / "tokenizer_config.json").exists()
                    or (self.ref.path / "tokenizer.model").exists()):
                raise MoectlError(f"{self.ref.path} has no tokenizer (tokenizer.json / tokenizer_config.json); "
                                  f"text commands need one — copy the tokenizer files into the checkpoint directory")
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.ref.path)
            except Exception as e:
                raise MoectlError(f"cannot load the tokenizer in {self.ref.path}: {e}") from None
        return self._tokenizer

    @property
    def moe_layer_ids(self) -> list[int]:
        return self.store.moe_layer_ids

    @property
    def prefetch(self):
        """The prefetch policy (None: off); the layers' (`Runtime.prefetch`)."""
        return self.runtime.prefetch

    # --- observers ----------------------------------------------------------------------
    def add_observer(self, obs) -> None:
        """`obs.on_route(layer, idx [T,K], weights [T,K], hidden [T,H])` at every MoE layer of every forward (after
        gating), and `obs.on_final_hidden(h [T,H])` if it has one; drafts are not observed."""
        self.runtime.observers.append(obs)

    def remove_observer(self, obs) -> None:
        if obs in self.runtime.observers:
            self.runtime.observers.remove(obs)

    def _on_final_norm(self, module, args, output):
        if self.runtime.drafting:                       # a draft's forward: nobody observes it
            return
        h = output[0] if isinstance(output, tuple) else output
        self.runtime.end_token(h.reshape(-1, h.shape[-1]))

    # --- forward and generate -----------------------------------------------------------
    def begin_request(self, name: str) -> None:
        """A new request: sequence-level policy statistics and the prefetch state reset."""
        self.cache.begin_request(name)
        self.runtime.begin_request()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, past_key_values=None, verify: bool = False, last_only: bool = False):
        """Logits [1,T,V] and the KV cache, for `input_ids` [1,T] after `past_key_values`.
        A forward without a KV cache, or of several tokens, is a prefill step, else a decode step; `verify`: the
        tokens are a speculative verification pass (the last accepted token + drafts), a decode step of T tokens.
        `last_only`: the last position's logits only, [1,1,V] (a prompt's prefill: the lm_head of every position is
        512 x 151936 x 2048 multiply-adds for a 512-token Qwen3 prompt, wasted)."""
        if self._graph_takes(past_key_values, verify):
            return self._graph_forward(input_ids, past_key_values, last_only)
        from transformers import DynamicCache

        from ..models.kv_cache import cache_kwargs, output_cache

        decode = past_key_values is not None and (input_ids.shape[-1] == 1 or verify)
        self.cache.begin_step("decode" if decode else "prefill")
        if decode:                                    # the aux gate: this token's first layer
            self.runtime.begin_token()
        if past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
            if self.speculator is not None:          # drafts are rolled back (sliding-window layers need this)
                past_key_values.activate_past_recording()
        if self._progress is not None:
            self._progress.start()
        try:
            with gemv.native_one_row(self.device.type == "cpu" and input_ids.shape[-1] == 1):
                out = host_alloc(lambda: self.model(input_ids=input_ids.to(self.device), use_cache=True,
                                                    **cache_kwargs(self.model, past_key_values),
                                                    logits_to_keep=1 if last_only else 0),
                                 f"running the model on {input_ids.shape[-1]} tokens")
        finally:
            if self._progress is not None:
                self._progress.close()
        self.cache.end_token()
        if self.runtime.replay is not None:
            self.runtime.replay.advance(input_ids.shape[-1])
        return out.logits, output_cache(out)

    def _graph_takes(self, past_key_values, verify: bool) -> bool:
        """Whether this forward is the one-graph one: a sequence started there continues there; a new one starts
        there unless something watches the layers (observers: profile, predictors) or a draft verifies."""
        if isinstance(past_key_values, GraphKV):
            return True
        return (self.graph is not None and past_key_values is None and not verify and not self.runtime.observers
                and self.speculator is None and self.runtime.replay is None)

    def _graph_forward(self, input_ids: torch.Tensor, kv, last_only: bool):
        """`forward` as one ggml graph (ggml_model.py); the cache's counters as the module path keeps them in
        place: every routed expert a hit, its layer's uses, its phase."""
        T = input_ids.shape[-1]
        self.cache.begin_step("decode" if kv is not None else "prefill")
        bar = self._progress
        if bar is not None:
            bar.start()
        # the bar counts layers; a chunk done is its share of them
        on_chunk = (lambda done, total: bar.layer(done * len(self.moe_layer_ids) // total - 1, T)) if bar else None
        try:
            logits, kv = host_alloc(lambda: self.graph.forward(input_ids, kv, last_only, on_chunk),
                                    f"running the model on {T} tokens")
        finally:
            if bar is not None:
                bar.close()
        distinct, calls = routed_counts(self.graph.last_ids, self.graph.n_layer)    # each expert routed, once a layer
        self.cache.state.count_hits(distinct, self.cache.plan(0, 0, []))   # in place: one pool computes them all
        self.runtime.expert_calls += calls
        self.cache.end_token()
        return torch.from_numpy(logits), kv                     # the graph's numpy logits as a tensor, no copy

    @torch.inference_mode()
    def generate(self, prompt: str | None = None, input_ids=None, max_new_tokens: int = 64, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, on_token=None,
                 stop_at_eos: bool = True, chat: bool = False, should_stop=None) -> GenerationResult:
        """`on_token(id, text_piece)` after each token; `should_stop()` (checked after it) ends the answer early:
        a cancelled request, a stop string. The runtime is left clean for the next call either way. With a draft
        (`--draft`), decoding is speculative (`speculative.py`): the same tokens greedily, the same distribution
        sampled; stats["draft"] holds its figures."""
        ids = prompt_ids(prompt, input_ids, chat, lambda: self.tokenizer)
        sampling = Sampling(greedy, temperature, top_p, seed)           # numpy: the torch-free engine's picks too
        out = TokenSink.for_generate(self.config, self._tokenizer, max_new_tokens, stop_at_eos, on_token, should_stop)
        before = self.cache.snapshot()
        calls0, cpu0 = self.runtime.expert_calls, self.runtime.cpu_experts
        self._requests += 1
        self.begin_request(f"generate-{self._requests}")
        spec = self.speculator if self.speculator is not None and self.speculator.enabled else None
        speculative = None if spec is None else (lambda pkv: spec.decode(self, pkv, ids + out.tokens, out, sampling))
        run = generate_tokens(ids, out, self._forward_ids, lambda row: sampling.pick(as_numpy(row))[0],
                              self.cache.stats.as_dict, speculative)
        new = out.tokens
        text = self._tokenizer.decode(new, skip_special_tokens=True) if self._tokenizer is not None else ""
        stats = generation_stats(run, before, self.cache.snapshot(), len(self.moe_layer_ids),
                                 self.runtime.expert_calls - calls0, self.runtime.cpu_experts - cpu0, self.threads,
                                 self.device_memory(run.kv))
        if self.runtime.gating is not None:
            g = self.runtime.gating
            stats["gating"] = g.describe() + (f" (from {g.source})" if g.source else "")
        per_token = run.per_token
        if run.decoder_figures is not None:         # the speculative decode's figures
            stats["draft"] = spec.stats(run.decoder_figures)
            per_token += run.decoder_figures["per_pass"]
        return GenerationResult(text, new, ids, stats, per_token)

    def _forward_ids(self, ids: list[int], pkv, last_only: bool = False):
        """`forward` of token ids (a list), as `generation.py: generate_tokens` calls it."""
        return self.forward(torch.tensor([ids], dtype=torch.long), pkv, last_only=last_only)

    def lossy(self) -> dict:
        """The settings in force that change outputs (precision, gating, low-bit copies), from the loaded policies."""
        g = self.runtime.gating
        note = (g.describe() + (f" (from {g.source})" if g.source else "")) if g is not None else None
        prec = self.cache.precision
        return self.options.lossy(note) | {"precision": prec.name + (
            f" (T1 {prec.t1:g}, T2 {prec.t2:g})" if prec.name == "hobbit" else "")}

    def resolved_options(self) -> dict:
        """{option: [value, source]}: every runtime option as resolved (`RuntimeOptions.config`)."""
        c = self.cache
        return self.options.config({"slots_per_layer": list(c.slots_per_layer),
                                    "replacement": c.state.policies[next(iter(c.state.policies))].name,
                                    "prefetch": self.prefetch.name if self.prefetch is not None else "none"})

    def device_memory(self, past_key_values=None) -> dict:
        """Device memory held by weights + expert cache + this request's KV cache, by the runtime's own accounting
        (`device_held_bytes`: dense weights, slot pools, KV tensors); on CUDA also the allocator's peak
        (`device_peak_allocated_bytes`, torch.cuda.max_memory_allocated), which includes activations."""
        if self._dense_bytes is None:
            self._dense_bytes = dense_nbytes(self.model, self.config)
        kv = past_key_values.nbytes() if isinstance(past_key_values, GraphKV) else kv_nbytes(past_key_values)
        out = {"device_held_bytes": self._dense_bytes + self.cache.device_nbytes() + kv}
        if self.device.type == "cuda":
            out["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out


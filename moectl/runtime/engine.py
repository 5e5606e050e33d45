"""Engine: load an MoE checkpoint without materialising its experts, and generate.

Load: config -> family adapter -> cache plan and host-memory check from the shard headers (a clear
error before anything is read if it does not fit) -> skeleton under `init_empty_weights` -> each MoE
block's experts swapped for `OffloadedExperts` -> non-expert tensors read from the shards onto the
device -> routed experts read into the `ExpertStore` (host RAM, or left on disk; with `--lowbit`, the
`moectl quantize` copies into host RAM too, and the cache bytes split into a full and a low-bit pool) -> the cache:
`InPlaceExperts` on a CPU with experts in RAM (nothing copied), else `DeviceCache` slots.
Generate: a plain loop over the model with a transformers KV cache; greedy or sampling; prefill,
time to first token and decode time per token measured apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MoectlError
from ..fingerprint import config_fingerprint
from ..cache_model import COUNTERS, FULL, LOW
from ..models import adapter_for
from ..policies.admission import PrefetchGate
from ..policies.base import PrefetchPolicy, ReplacementPolicy
from ..policies.gating import GatingPolicy, gate_rows
from ..policies.precision import SKIP
from ..recipes import format_bytes, parse_size, resolve_model
from ..store.checkpoint import Checkpoint
from ..store.expert_store import ExpertStore
from ..store.memory import check_host_memory, host_alloc, host_need, rss_bytes
from .cache import DeviceCache, split_slots
from .in_place import InPlaceExperts
from .offloaded import OffloadedExperts

KV_RESERVE_TOKENS = 4096     # --budget keeps room for this many tokens of KV cache
# Share of the expert cache's bytes given to low-bit slots under `--precision hobbit` (`--lowbit-fraction`):
# see docs/benchmarks.md (bench/precision.py) for why.
DEFAULT_LOWBIT_FRACTION = 0.25
PREFILL_PROGRESS_AFTER_S = 1.0   # a multi-token forward shows a progress bar once it has run this long


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]                    # generated ids only
    prompt_ids: list[int]
    stats: dict = field(default_factory=dict)
    per_token: list[dict] = field(default_factory=list)   # cache hits/misses/bytes of each forward step


class Engine:
    def __init__(self, model, config, adapter, ckpt: Checkpoint, store: ExpertStore,
                 cache: DeviceCache | InPlaceExperts, device: torch.device, dtype: torch.dtype, ref,
                 prefetch: PrefetchPolicy | None = None, progress: bool = False):
        self.model, self.config, self.adapter, self.ckpt = model, config, adapter, ckpt
        self.store, self.cache, self.device, self.dtype = store, cache, device, dtype
        self.ref = ref
        self.fingerprint = config_fingerprint(config)
        self.prefetch = prefetch
        self.observers: list = []
        self._tokenizer = None
        self._requests = 0
        self._dense_bytes: int | None = None        # dense weights on the device (`device_memory`)
        self.progress = progress
        self.threads = torch.get_num_threads()
        self._prefill_bar = None
        self._prefill_t0 = 0.0
        self.model.model.norm.register_forward_hook(self._on_final_norm)

    # --- loading ------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, device: str = "cpu", cache_experts: int | None = None, budget: str | int | None = None,
             offload: str = "ram", workdir: str | None = None, dtype: str | torch.dtype | None = None,
             replacement: str | ReplacementPolicy | None = None, prefetch: str | PrefetchPolicy | None = None,
             slots_per_layer: list[int] | None = None, progress: bool = True,
             predictor: str | None = None, emulate_device: bool = False, gating: GatingPolicy | str | None = None,
             gating_threshold: float | None = None, gate_prefill: bool = False, threads: int | None = None,
             cpu_experts: str | None = None, cost=None, replay_trace=None, prefill: str = "cache",
             plan: str | Path | None = None, lowbit: str | None = None,
             precision: str | None = None, t1: float = 0.6, t2: float = 0.9,
             lowbit_fraction: float | None = None, admission: str = "off",
             staging: int | None = None) -> "Engine":
        """`emulate_device` (CPU only): give the CPU its own expert slots that misses copy into, as a GPU has;
        the default on a CPU with experts in RAM computes them in place (no slots, no copies).
        `threads`: torch intra-op threads (default `machine.default_threads` for the model's size).
        `cpu_experts` auto|never|always: a missed expert computed on the CPU from host RAM instead of fetched;
        auto prices both with `cost` (a `sim/cost.py` CostModel; default: this machine's measured figures, cached).
        None: the plan's (`plan-cache --cpu-experts`), else never.
        `replay_trace`: a moe-routing-v1 trace (path or Trace) whose routing replaces the router's.
        `prefill` cache|stream: a prompt's missed experts load into the cache (the simulator's rule), or stream
        through two staging buffers without entering it (DuoServe; RAM tier; the budget pays for the two).
        `plan`: "auto" = the workdir's plan.yaml when there is one and neither --cache-experts nor --budget is
        given; a path = that plan; None = no plan. A plan sets the slots per layer and, when `replacement` is
        None, the replacement policy, and when `cpu_experts` is None where misses run (`eng.plan_note` says what was
        applied).
        `lowbit` (e.g. q4g64): also serve the `moectl quantize` copies from host RAM, with a low-bit slot pool
        taking `lowbit_fraction` of the cache's bytes; `precision` full | hobbit (T1, T2) | lowbit-only says which
        copy a miss loads (default: hobbit with --lowbit, else full).
        `admission` on|off: a predicted expert is copied only when its expected saving beats its copy-engine cost
        (policies/admission.py, the rule the simulator applies), priced with `cost` or this machine's figures.
        `staging`: buffers predicted experts are copied into instead of cache slots (a wrong prediction evicts
        nothing; RAM tier, device slots); None: what the loaded plan's budget reserved (`plan-cache`; none in plans
        made before staging), else `prefetch_staging(cpu_experts)` (2 when misses are fetched); 0: slots. The budget
        pays for them (shared with --prefill stream's two)."""
        if prefill not in ("cache", "stream"):
            raise MoectlError(f"--prefill must be cache or stream, not {prefill!r}")
        from ..policies.admission import ADMISSION_MODES

        if admission not in ADMISSION_MODES:
            raise MoectlError(f"--admission must be {' or '.join(ADMISSION_MODES)}, not {admission!r}")
        if emulate_device and device != "cpu":
            raise MoectlError("--emulate-device makes the CPU act as a device; it only applies to --device cpu")
        ref = _built(resolve_model(model, workdir))
        dev = _device(device)
        config, adapter = load_config(ref.path)
        ckpt = Checkpoint(ref.path)
        dt = _dtype(dtype, config)
        if offload not in ("ram", "disk"):
            raise MoectlError(f"--offload must be 'ram' or 'disk', not {offload!r}")
        in_place = dev.type == "cpu" and offload == "ram" and not emulate_device

        from ..machine import set_threads

        n_threads = set_threads(threads, config.hidden_size, adapter.expert_intermediate)
        hf, blocks = _skeleton(config, adapter, dt, ref.path)
        moe_layer_ids = [i for i, _ in blocks]
        fingerprint = config_fingerprint(config)
        gating = _gating(gating, gating_threshold, ref.workdir, fingerprint, len(moe_layer_ids))
        prec, low_fmt = _precision(precision, t1, t2, lowbit, lowbit_fraction, ref.workdir, fingerprint, adapter,
                                   len(moe_layer_ids), dt)
        runtime = _Runtime(adapter, gating, gate_prefill)
        for moe_idx, (layer_idx, block) in enumerate(blocks):
            old = block.experts
            block.experts = OffloadedExperts(moe_idx, layer_idx, runtime, old._apply_gate, adapter.num_experts)
        # Sizing from the config, the skeleton and the shard headers: a bad budget, or a configuration the
        # host RAM cannot hold, fails before any weight is read.
        L, E = len(moe_layer_ids), adapter.num_experts
        expert_nbytes = adapter.format(dt).nbytes
        plan_d, plan_note = _load_plan(plan, ref.workdir, fingerprint, L, E, cache_experts, budget, slots_per_layer)
        plan_low = [int(s) for s in (plan_d or {}).get("slots_low") or []]
        if plan_d is not None:
            slots_per_layer = [int(s) for s in plan_d["slots"]]
            pol = plan_d.get("policies") or {}
            replacement = replacement or pol.get("replacement") or "lru"
            cpu_experts = cpu_experts or pol.get("cpu_experts")
            if any(plan_low):                       # a plan with low-bit pools needs its copy set
                want = plan_d.get("lowbit") or pol.get("lowbit")
                if low_fmt is None or (want and want != lowbit):
                    raise MoectlError(f"plan {plan_d['_path']} serves low-bit copies ({want}): pass --lowbit {want} "
                                      f"(made by `moectl quantize --bits ...`), or --no-plan")
                if precision is None and pol.get("precision"):
                    from ..policies.precision import make_precision

                    prec = make_precision(pol["precision"], pol.get("t1") or t1, pol.get("t2") or t2)
        replacement = replacement or "lru"
        cpu_experts = cpu_experts or "never"
        kv = kv_reserve_nbytes(config, dt)
        # staging buffers: the streamed prefill's two; decode prefetches copy into them too when misses are fetched
        # (a wrong prediction then evicts nothing: policies/admission.py `prefetch_staging`); RAM tier only
        from ..policies.admission import STAGING_BUFFERS, prefetch_staging

        if staging is None and plan_d is not None:      # a plan's budget says whether it paid for them
            staging = int(((plan_d.get("budget") or {}).get("staging") or 0) // expert_nbytes)
        stage_pf = (prefetch_staging(cpu_experts) if staging is None else int(staging)) if (
            prefetch not in (None, "none") and not in_place and offload == "ram") else 0
        staging_bytes = max(STAGING_BUFFERS if prefill == "stream" else 0, stage_pf) * expert_nbytes
        slots_per_layer = cache_slots(L, E, expert_nbytes, dense_nbytes(hf, config) + staging_bytes, kv, cache_experts,
                                      budget, slots_per_layer)
        low_slots = None
        if low_fmt is not None and not in_place and any(plan_low):
            low_slots = plan_low                                    # the plan's split of the bytes
        elif low_fmt is not None and not in_place:
            fraction = lowbit_fraction_for(prec, lowbit_fraction)
            slots_per_layer, low_slots = split_pools(slots_per_layer, E, expert_nbytes, low_fmt.nbytes, fraction)
        low_nbytes = low_fmt.nbytes if low_fmt is not None else 0
        dense = header_dense_nbytes(ckpt, adapter, dt)              # what is read into host RAM
        on_host = dev.type == "cpu"
        need = host_need(offload, on_host, in_place, sum(slots_per_layer), expert_nbytes, L * E, dense, kv,
                         lowbit_nbytes=low_nbytes, low_slots=sum(low_slots or []))

        def fits(free: int) -> list[str]:
            return host_options(free, offload, on_host, in_place, sum(slots_per_layer), expert_nbytes, L, E,
                                dense, kv)

        what = (f"--offload {offload} on {dev.type}" + (" (experts in place)" if in_place else
                                                         f" with {sum(slots_per_layer)} expert slots"))
        check_host_memory(need, what, fits)

        # Non-expert weights straight from the shards onto the device, one tensor at a time.
        # Each tensor takes the dtype the skeleton gives it (a few, like DeepSeek-V3's routing bias, stay fp32).
        want = {k: v.dtype for k, v in hf.state_dict().items()}
        state = {}
        for key in ckpt.keys():
            name = adapter.skeleton_key(key)
            if name is not None:
                t = host_alloc(lambda: adapter.read_dense(ckpt, key), "reading dense weights", ckpt.range(key).nbytes)
                state[name] = t.to(device=dev, dtype=want.get(name, dt) if t.is_floating_point() else t.dtype)
        missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        missing = [k for k in missing if k not in tied]
        if missing:
            raise MoectlError(f"checkpoint {ref.path} lacks {len(missing)} weights the {adapter.family} model needs, "
                              f"e.g. {missing[:3]} (incomplete download?)")
        if tied:
            hf.tie_weights()
        hf.to(dev).eval()
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if t.is_meta:
                raise MoectlError(f"weight {name} was not found in {ref.path}")

        if in_place and prefetch == "auto":
            prefetch = None                          # in place every expert is resident: nothing to prefetch
        policy, prefetch = _policies(replacement, prefetch, hf, adapter, predictor or ref.workdir,
                                     fingerprint, L)
        store = ExpertStore(ckpt, adapter, moe_layer_ids, dt, offload=offload,
                            pin=(dev.type == "cuda"), progress=progress)
        if low_fmt is not None:
            from ..store.lowbit import LowbitCopies

            # On a GPU, misses the CPU may compute (--cpu-experts auto|always) keep the int4 CPU kernel's layout
            # too, when this torch's packing is one the device can dequantise (quant/int4_cpu.py)
            from ..quant.int4_cpu import int4pack_layout

            kernel = dev.type == "cpu" or (cpu_experts != "never" and int4pack_layout() is not None)
            store.lowbit = LowbitCopies(ref.workdir, lowbit, fingerprint, adapter, L, dt, pin=(dev.type == "cuda"),
                                        progress=progress, cpu_kernel=kernel)
        cache = InPlaceExperts(store, policy, prec) if in_place else \
            DeviceCache(store, slots_per_layer, dev, policy, low_slots=low_slots, precision=prec,
                        stream_prefill=prefill == "stream", staging=stage_pf if prefetch is not None else 0)
        runtime.cache = cache
        if plan_d is not None and not in_place:        # the plan's hot set, copied now (load time, not per token)
            from ..sim.run import plan_preload

            cache.preload(plan_preload(plan_d, L, E))
        runtime.placement = _placement(cpu_experts, cost, config, dev, in_place)
        runtime.prefetch_gate, runtime.copy_s = _admission(admission, cost, config, dev, adapter.top_k, expert_nbytes,
                                                          in_place, prefetch, cpu_experts,
                                                          staged=cache.state.staging > 0)
        if replay_trace is not None:
            from .replay import RoutingReplay

            runtime.replay = RoutingReplay(replay_trace, L, E)
        eng = cls(hf, config, adapter, ckpt, store, cache, dev, dt, ref, prefetch, progress=progress)
        eng.threads = n_threads
        eng.plan, eng.plan_note = plan_d, plan_note
        runtime.engine = eng
        eng.runtime = runtime
        return eng

    # --- facts --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

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

    # --- observers ----------------------------------------------------------------------
    def add_observer(self, obs) -> None:
        self.observers.append(obs)

    def remove_observer(self, obs) -> None:
        if obs in self.observers:
            self.observers.remove(obs)

    def _on_final_norm(self, module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h2 = h.reshape(-1, h.shape[-1])
        for obs in self.observers:
            fn = getattr(obs, "on_final_hidden", None)
            if fn is not None:
                fn(h2)
        if self.prefetch is not None and self.cache.state.phase == "decode":
            t0 = time.perf_counter()
            self.prefetch.end_token(h2[-1].float().cpu().numpy())
            self.runtime.predictor_s += time.perf_counter() - t0

    # --- forward and generate -----------------------------------------------------------
    def begin_request(self, name: str) -> None:
        """A new request: sequence-level policy statistics and the prefetch state reset."""
        self.cache.begin_request(name)
        self.runtime.prefetch_gate.reset()
        if self.prefetch is not None:
            self.prefetch.reset()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, past_key_values=None):
        """Logits [1,T,V] and the KV cache, for `input_ids` [1,T] after `past_key_values`.
        A forward without a KV cache, or of several tokens, is a prefill step, else a decode step."""
        from transformers import DynamicCache

        decode = past_key_values is not None and input_ids.shape[-1] == 1
        self.cache.begin_step("decode" if decode else "prefill")
        if decode and self.prefetch is not None:      # the aux gate: this token's first layer
            t0 = time.perf_counter()
            after = self.prefetch.predict_after_token()
            self.runtime.predictor_s += time.perf_counter() - t0
            self.runtime.offer(-1, after)
        if past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        self._prefill_t0 = time.perf_counter()
        try:
            out = host_alloc(lambda: self.model(input_ids=input_ids.to(self.device), past_key_values=past_key_values,
                                                use_cache=True), f"running the model on {input_ids.shape[-1]} tokens")
        finally:
            if self._prefill_bar is not None:
                self._prefill_bar[0].__exit__(None, None, None)
                self._prefill_bar = None
        self.cache.end_token()
        if self.runtime.replay is not None:
            self.runtime.replay.advance(input_ids.shape[-1])
        return out.logits, out.past_key_values

    def _prefill_progress(self, layer: int, tokens: int) -> None:
        """A per-MoE-layer bar for a multi-token forward, shown once it has taken over a second."""
        if not self.progress or tokens < 2:
            return
        if self._prefill_bar is None:
            if time.perf_counter() - self._prefill_t0 < PREFILL_PROGRESS_AFTER_S:
                return
            from ..progress import ProgressBar

            bar = ProgressBar(True).__enter__()          # stays: a long prefill is worth a line
            self._prefill_bar = bar, bar.add(f"prefill ({tokens} tokens), MoE layers", total=len(self.moe_layer_ids))
        bar, task = self._prefill_bar
        bar.update(task, completed=layer + 1)

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        tok = self.tokenizer
        if chat:
            return chat_ids(tok, [{"role": "user", "content": prompt}])
        return tok(prompt, add_special_tokens=True)["input_ids"]

    @torch.inference_mode()
    def generate(self, prompt: str | None = None, input_ids=None, max_new_tokens: int = 64, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, on_token=None,
                 stop_at_eos: bool = True, chat: bool = False, should_stop=None) -> GenerationResult:
        """`on_token(id, text_piece)` after each token; `should_stop()` (checked after it) ends the answer early:
        a cancelled request, a stop string. The runtime is left clean for the next call either way."""
        if input_ids is None:
            if prompt is None:
                raise MoectlError("generate needs a prompt or input_ids")
            input_ids = self.encode_prompt(prompt, chat=chat)
        ids = [int(i) for i in (input_ids.reshape(-1).tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not ids:
            raise MoectlError("the prompt encodes to no tokens")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        eos = _eos_ids(self.config, self._tokenizer)
        before = self.cache.snapshot()
        calls0, cpu0 = self.runtime.expert_calls, self.runtime.cpu_experts
        new: list[int] = []
        text_so_far = ""
        t0 = time.perf_counter()
        pkv = None
        step = torch.tensor([ids], dtype=torch.long)
        self._requests += 1
        self.begin_request(f"generate-{self._requests}")
        per_token = []
        times = {}                      # prefill forward, first token out, each decode step (seconds)
        decode_s: list[float] = []
        for _ in range(max_new_tokens):
            mark = self.cache.stats.as_dict()
            t_step = time.perf_counter()
            first = not new                                 # the prompt's forward (prefill)
            logits, pkv = self.forward(step, pkv)
            if first:
                times["prefill"] = time.perf_counter() - t_step
            now = self.cache.stats.as_dict()
            per_token.append({k: now[k] - mark[k] for k in ("hits", "misses", "bytes_loaded", "prefetches")})
            nxt = sample(logits[0, -1].float().cpu(), greedy, temperature, top_p, gen)
            per_token[-1]["ms"] = (time.perf_counter() - t_step) * 1000
            if first:
                times["ttft"] = time.perf_counter() - t_step
            else:
                decode_s.append(time.perf_counter() - t_step)
            new.append(nxt)
            if on_token is not None:
                piece = ""
                if self._tokenizer is not None:
                    full = self._tokenizer.decode(new, skip_special_tokens=True)
                    piece, text_so_far = full[len(text_so_far):], full
                on_token(nxt, piece)
            if (stop_at_eos and nxt in eos) or (should_stop is not None and should_stop()):
                break
            step = torch.tensor([[nxt]], dtype=torch.long)
        elapsed = time.perf_counter() - t0
        after = self.cache.snapshot()
        text = self._tokenizer.decode(new, skip_special_tokens=True) if self._tokenizer is not None else ""
        computed = (len(ids) + len(new) - 1) * len(self.moe_layer_ids)           # tokens x layers run
        stats = run_stats(before, after, len(new), elapsed) | {
            "prefill_ms": times["prefill"] * 1000, "ttft_ms": times["ttft"] * 1000,
            "decode_ms_per_token": 1000 * sum(decode_s) / len(decode_s) if decode_s else 0.0,
            "host_rss_gb": rss_bytes()[0] / 1e9, "host_peak_rss_gb": rss_bytes()[1] / 1e9,
            "experts_per_token": (self.runtime.expert_calls - calls0) / max(computed, 1),
            "cpu_experts": self.runtime.cpu_experts - cpu0, "threads": self.threads,
            "prefill_tokens_per_s": len(ids) / times["prefill"] if times.get("prefill") else 0.0,
            **self.device_memory(pkv)}
        if self.runtime.gating is not None:
            g = self.runtime.gating
            stats["gating"] = g.describe() + (f" (from {g.source})" if g.source else "")
        return GenerationResult(text, new, ids, stats, per_token)

    def device_memory(self, past_key_values=None) -> dict:
        """Device memory held by weights + expert cache + this request's KV cache, by the runtime's own accounting
        (`device_held_bytes`: dense weights, slot pools, KV tensors); on CUDA also the allocator's peak
        (`device_peak_allocated_bytes`, torch.cuda.max_memory_allocated), which includes activations."""
        if self._dense_bytes is None:
            self._dense_bytes = dense_nbytes(self.model, self.config)
        out = {"device_held_bytes": self._dense_bytes + self.cache.device_nbytes() + kv_nbytes(past_key_values)}
        if self.device.type == "cuda":
            out["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out


class _Runtime:
    """What every OffloadedExperts module shares: the adapter, the cache, observers, prefetch, gating, where
    missed experts run (placement + the CPU worker), forced routing (replay)."""

    def __init__(self, adapter, gating: GatingPolicy | None = None, gate_prefill: bool = False):
        self.adapter = adapter
        self.cache: DeviceCache | None = None
        self.engine: Engine | None = None
        self.gating = gating                # adaptive top-k (None: every chosen expert runs)
        self.gate_prefill = gate_prefill    # gate every row of a multi-token forward too, not only decode's one
        self.expert_calls = 0               # (token, expert) FFN computations, all layers, since load
        self.placement = None               # ComputePlacement: a missed expert fetched or computed on the CPU
        self.replay = None                  # RoutingReplay: the router's choice replaced by a trace's
        self._cpu_pool = None               # the CPU-experts worker thread
        self._host_views: dict = {}
        self.cpu_experts = 0                # experts computed on the CPU (missed, placed there)
        self.device_side_s = 0.0            # time this thread spent fetching + computing a layer's other experts
        self.cpu_side_s = 0.0               # time the worker spent computing CPU experts
        self.cpu_wait_s = 0.0               # time a layer waited for the worker after its own side was done
        self.expert_stage_s = 0.0           # wall time of the layers' expert stages (both sides, overlapped)
        self.predictor_s = 0.0              # time the prefetch policy took to observe and predict
        self.prefetch_gate = PrefetchGate()        # predictions -> copies: protect resident, admit missing ones
        self.copy_s = 0.0                   # one expert's copy time (the cost model's), for admission

    # --- CPU compute of missed experts (Fiddler / llama.cpp --n-cpu-moe) -------------------
    def cpu_side(self, layer: int, plan: dict[int, str], tokens: dict[int, int]) -> list[tuple[int, str]]:
        """The missed experts the placement computes on the CPU instead of fetching: (expert, precision) for each
        entry of the layer's precision `plan` ({e: FULL|LOW|SKIP}) that is not resident, priced at the bytes of the
        copy the plan chose (a low-bit miss reads its packed copy; `moectl-q4` is all low-bit misses). A full-precision
        miss needs the RAM tier (the disk tier keeps no host copy to compute from); low-bit copies are always in RAM."""
        cache = self.cache
        if self.placement is None or self.placement.mode == "never" or getattr(cache, "jobs", None) is None \
                or torch.is_grad_enabled():
            return []
        store, out = cache.store, []
        for e, p in plan.items():
            if p == SKIP or cache.contains(layer, e, p) or (p == FULL and store.buffers is None):
                continue
            if self.placement.decide(tokens.get(e, 1), store.nbytes(p), lowbit=p == LOW) == "cpu":
                out.append((e, p))
        return out

    def host_views(self, layer: int, expert: int, precision: str = FULL) -> dict:
        key = (layer, expert, precision)
        if key not in self._host_views:
            store = self.cache.store
            self._host_views[key] = store.format_of(precision).views(store.host(layer, expert, precision))  # no copy
        return self._host_views[key]

    def cpu_forward(self, w: dict, x: torch.Tensor, apply_gate) -> torch.Tensor:
        """One expert on the CPU: x [t,H] from the device, the weights in host RAM, y back on x's device."""
        return self.adapter.expert_forward(w, x.to("cpu"), apply_gate).to(x.device)

    def start_cpu(self, layer: int, experts: list[tuple[int, str]], compute, gate):
        """Run `compute(e, expert)` for `experts` [(expert, precision)] on the CPU worker thread from their host
        copies; torch ops release the GIL, so it runs while this thread fetches and computes the device's experts.
        A low-bit copy is computed as the store holds it: q4 axis-1 copies in torch's int4 CPU kernel layout
        (`quant/int4_cpu.py`, no dequantisation), others dequantised here."""
        from concurrent.futures import ThreadPoolExecutor

        if self._cpu_pool is None:
            self._cpu_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moectl-cpu-experts")
        inference = torch.is_inference_mode_enabled()
        self.cpu_experts += len(experts)
        fmt = self.cache.store.format_of

        def work() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode(inference):
                for e, p in experts:
                    w = fmt(p).weights(self.host_views(layer, e, p))
                    compute(e, lambda x, w=w: self.cpu_forward(w, x, gate))
            return time.perf_counter() - t0
        return self._cpu_pool.submit(work)

    def finish_cpu(self, fut) -> None:
        t0 = time.perf_counter()
        self.cpu_side_s += fut.result()
        self.cpu_wait_s += time.perf_counter() - t0

    def fill(self, layer: int, on_cpu: list[tuple[int, str]]) -> None:
        """The simulator's fill rule: a miss the CPU computed is copied into the cache in the background, only
        while the copy engine has nothing committed (a fill never delays a demand load or a prefetch; one at a
        time). Without it a cache whose misses all run on the CPU would never change after the prompt."""
        cache = self.cache
        for e, p in on_cpu:
            if cache.backlog_bytes() > 0:
                break
            if not cache.contains(layer, e, p):
                cache.fill(layer, e, p)

    def gate(self, layer: int, idx: torch.Tensor, w: torch.Tensor):
        """The routing `idx`, `w` [T,K] after gating: decode drops the tail (fewer columns); a gated multi-token
        forward marks dropped entries -1 with weight 0. Unchanged when nothing is dropped. With a replay, the
        trace's routing first replaces the router's."""
        if self.replay is not None:
            idx, w = self.replay.route(layer, idx, w)
        if self.gating is None or (idx.shape[0] > 1 and not self.gate_prefill):
            return idx, w
        idx_np = idx.cpu().numpy()
        e, g = gate_rows(self.gating, layer, idx_np, w.detach().float().cpu().numpy())
        if (e == idx_np).all():
            return idx, w
        if idx.shape[0] == 1:
            keep = torch.from_numpy(e[0] >= 0)
            return idx[:, keep], torch.from_numpy(g[:, keep.numpy()]).to(w.device, w.dtype)
        return torch.from_numpy(e).to(idx.device, idx.dtype), torch.from_numpy(g).to(w.device, w.dtype)

    def on_route(self, layer, top_k_index, top_k_weights, hidden):
        eng = self.engine
        eng._prefill_progress(layer, top_k_index.shape[0])
        for obs in eng.observers:
            obs.on_route(layer, top_k_index, top_k_weights, hidden)
        if self.prefetch_gate.pending.get(layer):                             # admission's outcomes for this layer
            self.prefetch_gate.route(layer, top_k_index.reshape(-1).tolist())
        pf = eng.prefetch
        if pf is not None and self.cache.state.phase == "decode":      # predict ahead in decode steps only
            t0 = time.perf_counter()
            pf.observe(layer, top_k_index[0].tolist(), top_k_weights[0].float().tolist(),
                       hidden[0].float().cpu().numpy())
            preds = pf.predict(layer)
            self.predictor_s += time.perf_counter() - t0
            self.offer(layer, preds, top_k_index[0].tolist())            # later layers of this token

    # --- prefetch admission (policies/admission.py: the simulator's gate and rule) ------------------
    def offer(self, layer: int, preds, routed=()) -> None:
        """Predictions made after `layer` (-1: after the previous token) through the shared gate: resident ones
        protected, missing ones copied when admitted; the backlog is the copy engine's unrun chunks, timed."""
        cache = self.cache

        def issue(target: int, expert: int, held: str | None) -> bool:
            if held is not None:
                cache.state.prefetch(target, expert, held)              # protect only
                return False
            return cache.prefetch(target, expert)
        backlog_s = self.copy_s * cache.backlog_bytes() / cache.store.expert_nbytes if self.copy_s else 0.0
        self.prefetch_gate.offer(cache.state, layer, preds, self.copy_s, backlog_s, issue, routed=routed)

    def decode_misses(self, layer: int) -> int:
        """Demand loads of `layer` in decode steps so far (all pools): `layer_done`'s count is the difference."""
        return sum(int(c["decode"][layer, COUNTERS.index("misses")]) for c in self.cache.state.counts.values())


# --- helpers (pure functions; the CLI and tests use them too) -----------------------------

def _built(ref):
    """`ref`, or a clear error when it is the built-in tiny model and nobody built it yet."""
    if (ref.recipe or {}).get("builtin") == "tiny" and not ref.path.exists():
        raise MoectlError(f"the built-in tiny model is not built in {ref.workdir} yet: run `moectl build-tiny`")
    return ref


def load_config(path: Path):
    """(HF config, family adapter) of a checkpoint directory, with clear errors."""
    from transformers import AutoConfig

    Checkpoint.check_dir(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise MoectlError(f"cannot read {Path(path) / 'config.json'}: {e}") from None
    return config, adapter_for(config)


def _skeleton(config, adapter, dtype: torch.dtype, path):
    """The model with parameters on meta (buffers such as rotary tables real) and its MoE blocks."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    blocks = adapter.moe_blocks(hf)
    if not blocks:
        raise MoectlError(f"{path} has no sparse MoE layers; moectl offloads experts of MoE models")
    return hf, blocks


def _device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise MoectlError("--device cuda asked for, but torch sees no CUDA device (CPU build, or no GPU)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise MoectlError(f"--device must be cpu or cuda, not {device!r}")
    return torch.device(device)


def _dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    name = str(name).replace("torch.", "")
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise MoectlError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return table[name]


def _policies(replacement, prefetch, model, adapter, predictor_dir, fingerprint: str,
              num_layers: int) -> tuple[ReplacementPolicy, PrefetchPolicy | None]:
    """Replacement and prefetch policies by name (or given objects), through the policy builder the
    simulator uses. Prefetch 'auto': the calibrated predictors when the workdir has them (aux gate + mlp,
    or mlp), else gate reuse; 'gate-reuse' reads the model's routers; 'mlp', 'routing', 'aux-gate' load the
    predictors artifact in `predictor_dir` (the model workdir unless --predictor says)."""
    from ..policies import PolicyInputs, build_prefetch, build_replacement

    inputs = PolicyInputs(num_layers, adapter.num_experts, adapter.top_k,
                          predictor_hint=f" in {predictor_dir}: run `moectl train-predictor --kind {prefetch}`")
    if replacement == "belady":
        raise MoectlError("belady needs the future: it exists in `moectl simulate` only")
    policy = replacement if isinstance(replacement, ReplacementPolicy) else build_replacement(replacement, inputs)
    if prefetch is None or isinstance(prefetch, PrefetchPolicy):
        return policy, prefetch
    from ..predict.artifact import JSON_NAME, load_predictors

    if prefetch == "auto":
        preds = load_predictors(predictor_dir, fingerprint) if (Path(predictor_dir) / JSON_NAME).exists() else None
        kinds = set(preds.kinds) if preds else set()
        prefetch = "aux-gate" if {"mlp", "aux_gate"} <= kinds else "mlp" if "mlp" in kinds else "gate-reuse"
        inputs.predictor_hint = ""
    if prefetch == "gate-reuse":
        inputs.routers, inputs.router_bias = {}, {}
        for moe_idx, (_, block) in enumerate(adapter.moe_blocks(model)):
            r = adapter.router(block)
            inputs.routers[moe_idx] = r.weight.detach().float().cpu().numpy()
            if getattr(r, "bias", None) is not None:
                inputs.router_bias[moe_idx] = r.bias.detach().float().cpu().numpy()
    elif prefetch in ("mlp", "routing", "aux-gate"):
        preds = load_predictors(predictor_dir, expect_fingerprint=fingerprint)
        inputs.mlp, inputs.routing, inputs.aux_gate = preds.mlp, preds.routing, preds.aux_gate
    return policy, build_prefetch(prefetch, inputs)


def _placement(mode: str, cost, config, dev: torch.device, in_place: bool):
    """The ComputePlacement behind --cpu-experts (None when nothing can miss: experts computed in place). `auto`
    without a cost model prices with this machine's measured figures (`moectl/machine.py`, cached per machine)."""
    from ..policies.placement import CPU_EXPERT_MODES, ComputePlacement

    if mode not in CPU_EXPERT_MODES:
        ComputePlacement(mode)                                   # the clear error naming the choices
    if mode == "never" or in_place:
        return None
    if mode == "auto" and cost is None:
        cost = _machine_cost(config, dev)
    return ComputePlacement(mode, cost)


def _admission(mode: str, cost, config, dev: torch.device, top_k: int, expert_nbytes: int, in_place: bool,
               prefetch, cpu_experts: str = "never", staged: bool = False):
    """(the PrefetchGate behind --admission, one expert's copy time): `on` prices copies and layer compute with
    `cost`, or this machine's measured figures (as `_placement` does); `staged`: prefetches copy into staging
    buffers (they evict nothing)."""
    from ..policies.admission import make_admission

    if mode == "off" or in_place or prefetch is None:
        return PrefetchGate(make_admission("off"), top_k), 0.0
    cost = cost if cost is not None else _machine_cost(config, dev)
    return (PrefetchGate(make_admission(mode, cost, top_k, cpu_experts=cpu_experts, staged=staged), top_k),
            cost.load_s(expert_nbytes))


def _machine_cost(config, dev: torch.device):
    """This machine's CostModel for the model (`moectl/machine.py` figures, measured once and cached)."""
    from ..machine import machine_figures, machine_hardware
    from ..sim.cost import CostModel, shape_from_hf_config

    return CostModel(machine_hardware(machine_figures(dev.type)), shape_from_hf_config(config.to_dict()))


def _gating(gating, threshold: float | None, workdir, fingerprint: str, num_layers: int) -> GatingPolicy | None:
    """A GatingPolicy object, None (off), or a spec: 'auto' (the T_g stored by `moectl sensitivity --target-ppl-delta`
    in the workdir's sensitivity.json, when there is one), 'score:TAU', 'sensitivity:T_G', 'none';
    `threshold` (--gating-threshold T_g, 0 = off) overrides the stored T_g."""
    if isinstance(gating, GatingPolicy):
        return gating
    from ..calib.sensitivity import JSON_NAME, load_sensitivity, rule_sensitivities
    from ..policies.gating import parse_gating

    spec = None if gating in (None, "auto") else gating
    if gating is None and threshold is None:
        return None
    f = Path(workdir) / JSON_NAME
    needs = threshold is not None or gating == "auto" or (spec or "").startswith("sensitivity")
    meta = load_sensitivity(f, fingerprint, num_layers) if needs and f.exists() else None
    policy = parse_gating(threshold, spec, rule_sensitivities(meta) if meta else None,
                          meta.get("threshold") if meta and gating == "auto" else None)
    if policy is not None and gating == "auto" and threshold is None:
        policy.source = str(f)          # on by default: the status lines say where it came from
    return policy


def _load_plan(plan, workdir, fingerprint: str, num_layers: int, num_experts: int, cache_experts, budget,
               slots_per_layer) -> tuple[dict | None, str]:
    """The plan to apply (read by `sim/run.py: load_plan`, checked against this model) and one line saying so."""
    from ..plan.artifact import PLAN_NAME, check_plan_model
    from ..sim.run import load_plan, plan_slots

    if plan is None:
        return None, "plan: none (--no-plan)"
    explicit = plan != "auto"
    path = Path(plan).expanduser() if explicit else Path(workdir) / PLAN_NAME
    if not explicit and not path.exists():
        return None, ""
    given = [f for f, v in (("--cache-experts", cache_experts), ("--budget", budget), ("slots", slots_per_layer))
             if v is not None]
    if given:
        if explicit:
            raise MoectlError(f"give a plan or {given[0]}, not both")
        return None, f"plan: {path} not used ({given[0]} given)"
    d = load_plan(path)
    plan_slots(d, d["_path"])
    check_plan_model(d, fingerprint, num_layers, num_experts, "the model loaded")
    pred = d.get("predicted") or {}
    ms = pred.get("ms_per_token")
    return d, (f"plan: {d['_path']} ({sum(d['slots'])} expert slots, {min(d['slots'])}-{max(d['slots'])} per layer"
               + (f"; predicted {ms:.3g} ms/token on {d.get('hardware')}" if ms else "") + "; --no-plan ignores it)")


def _precision(name, t1, t2, lowbit, fraction, workdir, fingerprint, adapter, num_layers, dtype):
    """(precision policy, low-bit format or None) from --precision/--t1/--t2/--lowbit, checked before loading."""
    from ..policies.precision import make_precision

    if fraction is not None and not 0.0 <= fraction < 1.0:
        raise MoectlError(f"--lowbit-fraction {fraction:g}: give a share of the cache's bytes in [0, 1)")
    prec = make_precision(name or ("hobbit" if lowbit else "full"), t1, t2)
    if prec.uses_lowbit and not lowbit:
        raise MoectlError(f"--precision {prec.name} loads low-bit copies: give --lowbit q<bits>g<group> "
                          f"(made by `moectl quantize`)")
    if not lowbit:
        return prec, None
    from ..store.lowbit import lowbit_format, read_lowbit_meta

    meta, path = read_lowbit_meta(workdir, lowbit, fingerprint, num_layers, adapter.num_experts)
    return prec, lowbit_format(meta, adapter, dtype, path)


def lowbit_fraction_for(precision, fraction: float | None) -> float:
    """The low-bit pools' share of the cache bytes: none for full precision, all but one full slot per layer for
    lowbit-only, `--lowbit-fraction` (default DEFAULT_LOWBIT_FRACTION) for HOBBIT."""
    if not precision.uses_lowbit:
        return 0.0
    if precision.name == "lowbit-only":
        return 1.0
    return DEFAULT_LOWBIT_FRACTION if fraction is None else fraction


def split_pools(full_slots: list[int], num_experts: int, full_nbytes: int, low_nbytes: int,
                fraction: float) -> tuple[list[int], list[int]]:
    """The cache's bytes (`full_slots` x full bytes) split: `fraction` to low-bit slots, the rest to full slots,
    each pool's total split evenly over the layers (`split_slots`); at least one slot of each per layer (the
    only way the split exceeds the bytes), at most E. fraction 1 (lowbit-only): one full slot per layer."""
    L = len(full_slots)
    total = sum(full_slots) * full_nbytes
    n_full = L if fraction >= 1 else max(L, min(L * num_experts, int(total * (1 - fraction)) // full_nbytes))
    n_low = max(L, min(L * num_experts, (total - n_full * full_nbytes) // low_nbytes))
    return split_slots(n_full, L, num_experts), split_slots(int(n_low), L, num_experts)


def kv_nbytes(past_key_values) -> int:
    """Bytes of the key/value tensors a transformers KV cache holds (0 for None)."""
    if past_key_values is None:
        return 0
    n = 0
    for layer in getattr(past_key_values, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t):
                n += t.numel() * t.element_size()
    return n


def dense_nbytes(model, config=None) -> int:
    """Bytes of everything resident besides the expert cache (OffloadedExperts own no parameters). Works on
    the skeleton before loading too (meta parameters count by shape and dtype): tied output embeddings
    count once."""
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    if config is not None and getattr(config, "tie_word_embeddings", False):
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and emb is not None and out.weight is not emb.weight:     # not tied yet
            n -= out.weight.numel() * out.weight.element_size()
    return n


def cache_slots(num_layers: int, num_experts: int, expert_nbytes: int, dense: int, kv: int,
                cache_experts: int | None = None, budget: str | int | None = None,
                slots_per_layer: list[int] | None = None) -> list[int]:
    """Slots per MoE layer from exactly one of --cache-experts, --budget, a plan (default: every expert)."""
    if sum(x is not None for x in (cache_experts, budget, slots_per_layer)) > 1:
        raise MoectlError("give one of --cache-experts, --budget or a plan, not several")
    if slots_per_layer is not None:
        if len(slots_per_layer) != num_layers:
            raise MoectlError(f"cache plan has {len(slots_per_layer)} layers, the model has {num_layers} MoE layers")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in slots_per_layer):
            raise MoectlError(f"cache plan slots must be integers >= 1, got {slots_per_layer}")
        return [min(s, num_experts) for s in slots_per_layer]
    if budget is not None:
        return budget_slots(parse_size(budget) if isinstance(budget, str) else int(budget), dense, kv,
                            expert_nbytes, num_layers, num_experts)
    return split_slots(num_layers * num_experts if cache_experts is None else int(cache_experts),
                       num_layers, num_experts)


def header_dense_nbytes(ckpt: Checkpoint, adapter, dtype: torch.dtype) -> int:
    """Bytes of the non-expert weights once loaded (floating tensors in `dtype`), from the shard headers."""
    return sum(math.prod(r.shape) * (dtype.itemsize if r.dtype.is_floating_point else r.dtype.itemsize)
               for key, r in ckpt.ranges.items() if adapter.skeleton_key(key) is not None)


def host_options(free: int, offload: str, on_host: bool, in_place: bool, slots: int, expert_nbytes: int,
                 num_layers: int, num_experts: int, dense: int, kv: int) -> list[str]:
    """Configurations of this model that fit `free` bytes of host RAM, for the not-enough-memory error."""
    out = []
    total = num_layers * num_experts
    if on_host and offload == "ram" and not in_place:
        need = host_need("ram", True, True, 0, expert_nbytes, total, dense, kv).total
        if need <= free:
            out.append(f"drop --emulate-device (experts computed in place: {format_bytes(need)})")
    fixed = host_need("disk", on_host, False, 0, expert_nbytes, total, dense, kv).total
    n = min(total, (free - fixed) // expert_nbytes) if free > fixed else 0
    if n >= num_layers and (offload == "ram" or n < slots):
        need = host_need("disk", on_host, False, int(n), expert_nbytes, total, dense, kv).total
        out.append(f"--offload disk --cache-experts {int(n)} ({format_bytes(need)})")
    return out


def kv_reserve_nbytes(config, dtype: torch.dtype, tokens: int = KV_RESERVE_TOKENS) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * tokens * torch.empty((), dtype=dtype).element_size()


def budget_slots(budget: int, dense: int, kv: int, expert_nbytes: int, num_layers: int, num_experts: int) -> list[int]:
    """Slots per layer that fit `budget` after the dense weights and the KV reserve."""
    minimum = dense + kv + num_layers * expert_nbytes
    if budget < minimum:
        raise MoectlError(f"--budget {format_bytes(budget)} is below the minimum {format_bytes(minimum)} "
                          f"(dense weights {format_bytes(dense)} + KV reserve {format_bytes(kv)} + one expert slot "
                          f"per MoE layer: {num_layers} x {format_bytes(expert_nbytes)})")
    total = min((budget - dense - kv) // expert_nbytes, num_layers * num_experts)
    return split_slots(int(total), num_layers, num_experts)


def describe(config, adapter, expert_nbytes: int, dense: int, num_moe_layers: int) -> dict:
    E = adapter.num_experts
    return {"family": adapter.family, "layers": int(config.num_hidden_layers), "moe_layers": num_moe_layers,
            "experts": E, "top_k": adapter.top_k, "hidden_size": int(config.hidden_size),
            "expert_intermediate_size": adapter.expert_intermediate, "bytes_per_expert": expert_nbytes,
            "dense_bytes": dense, "expert_bytes": expert_nbytes * E * num_moe_layers,
            "total_bytes": dense + expert_nbytes * E * num_moe_layers}


def sample(logits: torch.Tensor, greedy: bool, temperature: float, top_p: float, gen) -> int:
    """Next token from logits [V]: argmax, or temperature + nucleus (top-p) sampling."""
    if greedy or temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p          # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def run_stats(before: dict, after: dict, tokens: int, elapsed: float) -> dict:
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    loaded = after["bytes_loaded"] - before["bytes_loaded"]
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "bytes_loaded": loaded, "bytes_per_token": loaded / tokens if tokens else 0.0,
            "load_wait_s": after["load_wait_s"] - before["load_wait_s"],   # every wait for a copy or read
            "prefetches": after["prefetches"] - before["prefetches"],
            **{k: after[k] - before[k] for k in ("low_misses", "full_misses", "skips", "fills") if k in after}}


def _eos_ids(config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the model's chat template, or a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(i) for i in out]
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return tokenizer(text)["input_ids"]


def memory_plan(config, adapter, dtype: torch.dtype, dense: int, num_moe_layers: int, lowbit: str | None = None,
                offload: str = "ram", device: str = "cuda", budget: str | None = None,
                lowbit_fraction: float | None = None, axis: int = 1) -> dict:
    """Host RAM and device memory of one configuration, by part, from shapes alone (nothing read): dense weights,
    copies per tier, KV reserve, cache slots. Without --budget the cache is the minimum, one slot per layer of
    each pool. `lowbit` (e.g. q4g64) sizes the low-bit tier from the format (HQQ, `axis`, scales in `dtype`)."""
    from ..quant.hqq_format import HqqFormat, parse_lowbit

    L, E = num_moe_layers, adapter.num_experts
    full = adapter.format(dtype).nbytes
    low = HqqFormat(adapter.layout(), *parse_lowbit(lowbit), axis, dtype).nbytes if lowbit else 0
    kv = kv_reserve_nbytes(config, dtype)
    slots = cache_slots(L, E, full, dense, kv, budget=budget) if budget else [1] * L
    low_slots = []
    if lowbit:
        f = DEFAULT_LOWBIT_FRACTION if lowbit_fraction is None else lowbit_fraction
        slots, low_slots = split_pools(slots, E, full, low, f) if budget else (slots, [1] * L)
    on_host = device == "cpu"
    host = host_need(offload, on_host, False, sum(slots), full, L * E, dense, kv, lowbit_nbytes=low,
                     low_slots=sum(low_slots))
    dev = 0 if on_host else dense + kv + sum(slots) * full + sum(low_slots) * low
    return {"offload": offload, "device": device, "lowbit": lowbit, "budget": budget,
            "bytes_per_expert_full": full, "bytes_per_expert_lowbit": low, "full_copies_bytes": L * E * full,
            "lowbit_copies_bytes": L * E * low, "dense_bytes": dense, "kv_reserve_bytes": kv,
            "full_slots": sum(slots), "lowbit_slots": sum(low_slots),
            "host": {"dense": host.dense, "full_copies": host.experts, "lowbit_copies": host.lowbit,
                     "cache_buffers": host.cache, "kv_reserve": host.kv, "total": host.total},
            "device_total": dev}


def inspect_model(model: str, workdir: str | None = None, dtype: str | None = None, lowbit: str | None = None,
                  offload: str = "ram", device: str = "cuda", budget: str | None = None,
                  lowbit_fraction: float | None = None) -> dict:
    """Family, layers, experts, sizes of a checkpoint, from its config and shard headers only. Experts are
    sized in their packed format (as released: MXFP4 / block FP8, else `dtype`); the memory needs are the
    GPU runtime's: host RAM with `--offload ram` (experts, pinned) and device memory for the dense weights +
    KV reserve + one expert slot per layer (the minimum), or + every expert (all resident); `memory` is the
    configuration given (--lowbit, --offload, --device, --budget) by part."""
    ref = _built(resolve_model(model, workdir))
    config, adapter = load_config(ref.path)
    ckpt = Checkpoint(ref.path)                        # validates the shards (headers only)
    dt = _dtype(dtype, config)
    hf, blocks = _skeleton(config, adapter, dt, ref.path)
    for moe_idx, (layer_idx, block) in enumerate(blocks):   # the runtime's stand-ins: experts are not dense
        block.experts = OffloadedExperts(moe_idx, layer_idx, None, None, adapter.num_experts)
    fmt = adapter.format(dt)
    expert_nbytes = fmt.nbytes
    L, E = len(blocks), adapter.num_experts
    dense, kv = dense_nbytes(hf, config), kv_reserve_nbytes(config, dt)
    info = describe(config, adapter, expert_nbytes, dense, L)
    weights = sum(math.prod(s) for s in adapter.layout().shapes if len(s) == 2)      # biases are not weights
    info["memory"] = memory_plan(config, adapter, dt, info["dense_bytes"], L, lowbit, offload, device,
                                 budget, lowbit_fraction)
    return info | {"model": ref.name, "path": str(ref.path), "dtype": str(dt).replace("torch.", ""),
                   "expert_format": fmt.name, "bits_per_weight": expert_nbytes * 8 / weights,
                   "quantization": adapter.quant.describe() if adapter.quant else None,
                   "host_ram_bytes": host_need("ram", False, False, 0, expert_nbytes, L * E,
                                               header_dense_nbytes(ckpt, adapter, dt), kv).total,
                   "device_min_bytes": dense + kv + L * expert_nbytes,
                   "device_all_bytes": dense + kv + L * E * expert_nbytes, "kv_reserve_bytes": kv,
                   "moe_layer_ids": [i for i, _ in blocks],
                   "fingerprint": config_fingerprint(config)}

"""Engine: load an MoE checkpoint without materialising its experts, and generate.

Load: config -> family adapter -> cache plan and host-memory check from the shard headers (a clear
error before anything is read if it does not fit) -> skeleton under `init_empty_weights` -> each MoE
block's experts swapped for `OffloadedExperts` -> non-expert tensors read from the shards onto the
device -> routed experts read into the `ExpertStore` (host RAM, or left on disk) -> the cache:
`InPlaceExperts` on a CPU with experts in RAM (nothing copied), else `DeviceCache` slots.
Generate: a plain loop over the model with a transformers KV cache; greedy or sampling; prefill,
time to first token and decode time per token measured apart.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MoectlError
from ..fingerprint import model_fingerprint
from ..models import adapter_for
from ..policies.aux_gate import AFTER_TOKEN, AuxGatePrefetch
from ..policies.base import LRU, PrefetchPolicy, ReplacementPolicy
from ..recipes import format_bytes, parse_size, resolve_model
from ..store.checkpoint import Checkpoint
from ..store.expert_store import ExpertStore
from ..store.memory import check_host_memory, host_alloc, host_need, rss_bytes
from .cache import DeviceCache, split_slots
from .in_place import InPlaceExperts
from .offloaded import OffloadedExperts

KV_RESERVE_TOKENS = 4096     # --budget keeps room for this many tokens of KV cache
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
        self.fingerprint = model_fingerprint(config.to_dict(), adapter.family)
        self.prefetch = prefetch
        self.observers: list = []
        self.phase = "prefill"
        self._tokenizer = None
        self._requests = 0
        self.progress = progress
        self._prefill_bar = None
        self._prefill_t0 = 0.0
        self.model.model.norm.register_forward_hook(self._on_final_norm)

    # --- loading ------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, device: str = "cpu", cache_experts: int | None = None, budget: str | int | None = None,
             offload: str = "ram", workdir: str | None = None, dtype: str | torch.dtype | None = None,
             replacement: str | ReplacementPolicy = "lru", prefetch: str | PrefetchPolicy | None = None,
             slots_per_layer: list[int] | None = None, progress: bool = True,
             predictor: str | None = None, emulate_device: bool = False) -> "Engine":
        """`emulate_device` (CPU only): give the CPU its own expert slots that misses copy into, as a GPU has;
        the default on a CPU with experts in RAM computes them in place (no slots, no copies)."""
        if emulate_device and device != "cpu":
            raise MoectlError("--emulate-device makes the CPU act as a device; it only applies to --device cpu")
        ref = resolve_model(model, workdir)
        dev = _device(device)
        config, adapter = load_config(ref.path)
        ckpt = Checkpoint(ref.path)
        dt = _dtype(dtype, config)
        if offload not in ("ram", "disk"):
            raise MoectlError(f"--offload must be 'ram' or 'disk', not {offload!r}")
        in_place = dev.type == "cpu" and offload == "ram" and not emulate_device

        hf, blocks = _skeleton(config, adapter, dt, ref.path)
        moe_layer_ids = [i for i, _ in blocks]
        L, E = len(moe_layer_ids), adapter.num_experts
        expert_nbytes = adapter.layout().numel * dt.itemsize
        dense, kv = header_dense_nbytes(ckpt, adapter, dt), kv_reserve_nbytes(config, dt)
        if slots_per_layer is None:
            if cache_experts is not None and budget is not None:
                raise MoectlError("give --cache-experts or --budget, not both")
            if budget is not None:
                slots_per_layer = budget_slots(parse_size(budget) if isinstance(budget, str) else int(budget),
                                               dense, kv, expert_nbytes, L, E)
            else:
                slots_per_layer = split_slots(L * E if cache_experts is None else int(cache_experts), L, E)
        on_host = dev.type == "cpu"
        need = host_need(offload, on_host, in_place, sum(slots_per_layer), expert_nbytes, L * E, dense, kv)

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
                t = host_alloc(lambda: ckpt.get(key), "reading dense weights", ckpt.range(key).nbytes)
                state[name] = t.to(device=dev, dtype=want.get(name, dt) if t.is_floating_point() else t.dtype)
        runtime = _Runtime(adapter)
        for moe_idx, (layer_idx, block) in enumerate(blocks):
            old = block.experts
            block.experts = OffloadedExperts(moe_idx, layer_idx, runtime, old._apply_gate, adapter.num_experts)
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

        store = ExpertStore(ckpt, adapter, moe_layer_ids, dt, offload=offload,
                            pin=(dev.type == "cuda"), progress=progress)
        policy = _replacement(replacement, L, E)
        if in_place and prefetch == "auto":
            prefetch = None                          # in place every expert is resident: nothing to prefetch
        prefetch = _prefetch(prefetch, hf, adapter, predictor or ref.workdir, config, adapter.family)
        cache = InPlaceExperts(store, policy) if in_place else DeviceCache(store, slots_per_layer, dev, policy)
        runtime.cache = cache
        eng = cls(hf, config, adapter, ckpt, store, cache, dev, dt, ref, prefetch, progress=progress)
        runtime.engine = eng
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

    def describe(self) -> dict:
        return describe(self.config, self.adapter, self.store.expert_nbytes, dense_nbytes(self.model),
                        len(self.moe_layer_ids)) | {"fingerprint": self.fingerprint,
                                                    "cache_slots": self.cache.slots_per_layer,
                                                    "in_place": isinstance(self.cache, InPlaceExperts)}

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
        if self.prefetch is not None:
            self.prefetch.end_token(h2[-1].float().cpu().numpy())
            if isinstance(self.prefetch, AuxGatePrefetch):      # the aux gate: next token's first layer
                for target, expert, _score in self.prefetch.predict(AFTER_TOKEN):
                    self.cache.prefetch(target, int(expert))

    # --- forward and generate -----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, past_key_values=None):
        """Logits [1,T,V] and the KV cache, for `input_ids` [1,T] after `past_key_values`."""
        from transformers import DynamicCache

        if past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        self._prefill_t0 = time.perf_counter()
        try:
            out = host_alloc(lambda: self.model(input_ids=input_ids.to(self.device), past_key_values=past_key_values,
                                                use_cache=True), f"running the model on {input_ids.shape[-1]} tokens")
        finally:
            if self._prefill_bar is not None:
                self._prefill_bar.close()
                self._prefill_bar = None
        self.cache.end_token()
        return out.logits, out.past_key_values

    def _prefill_progress(self, layer: int, tokens: int) -> None:
        """A per-MoE-layer bar for a multi-token forward, shown once it has taken over a second."""
        if not self.progress or tokens < 2:
            return
        if self._prefill_bar is None:
            if time.perf_counter() - self._prefill_t0 < PREFILL_PROGRESS_AFTER_S:
                return
            from tqdm import tqdm

            self._prefill_bar = tqdm(total=len(self.moe_layer_ids), desc=f"prefill ({tokens} tokens)",
                                     unit="layer", leave=False)
        self._prefill_bar.n = layer + 1
        self._prefill_bar.refresh()

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        tok = self.tokenizer
        if chat:
            return chat_ids(tok, [{"role": "user", "content": prompt}])
        return tok(prompt, add_special_tokens=True)["input_ids"]

    @torch.inference_mode()
    def generate(self, prompt: str | None = None, input_ids=None, max_new_tokens: int = 64, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, on_token=None,
                 stop_at_eos: bool = True, chat: bool = False) -> GenerationResult:
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
        new: list[int] = []
        text_so_far = ""
        t0 = time.perf_counter()
        pkv = None
        step = torch.tensor([ids], dtype=torch.long)
        self.phase = "prefill"
        self._requests += 1
        self.cache.policy.on_request_start(f"generate-{self._requests}")
        if self.prefetch is not None:
            self.prefetch.reset()
        per_token = []
        times = {}                      # prefill forward, first token out, each decode step (seconds)
        decode_s: list[float] = []
        for _ in range(max_new_tokens):
            mark = self.cache.stats.as_dict()
            t_step = time.perf_counter()
            logits, pkv = self.forward(step, pkv)
            if self.phase == "prefill":
                times["prefill"] = time.perf_counter() - t_step
            now = self.cache.stats.as_dict()
            per_token.append({k: now[k] - mark[k] for k in ("hits", "misses", "bytes_loaded", "prefetches")})
            nxt = sample(logits[0, -1].float().cpu(), greedy, temperature, top_p, gen)
            per_token[-1]["ms"] = (time.perf_counter() - t_step) * 1000
            if self.phase == "prefill":
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
            if stop_at_eos and nxt in eos:
                break
            self.phase = "decode"
            step = torch.tensor([[nxt]], dtype=torch.long)
        elapsed = time.perf_counter() - t0
        self.phase = "prefill"
        after = self.cache.snapshot()
        text = self._tokenizer.decode(new, skip_special_tokens=True) if self._tokenizer is not None else ""
        stats = run_stats(before, after, len(new), elapsed) | {
            "prefill_ms": times["prefill"] * 1000, "ttft_ms": times["ttft"] * 1000,
            "decode_ms_per_token": 1000 * sum(decode_s) / len(decode_s) if decode_s else 0.0,
            "host_rss_gb": rss_bytes()[0] / 1e9, "host_peak_rss_gb": rss_bytes()[1] / 1e9}
        return GenerationResult(text, new, ids, stats, per_token)


class _Runtime:
    """What every OffloadedExperts module shares: the adapter, the cache, observers, prefetch."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.cache: DeviceCache | None = None
        self.engine: Engine | None = None

    def on_route(self, layer, top_k_index, top_k_weights, hidden):
        eng = self.engine
        eng._prefill_progress(layer, top_k_index.shape[0])
        for obs in eng.observers:
            obs.on_route(layer, top_k_index, top_k_weights, hidden)
        pf = eng.prefetch
        if pf is not None and top_k_index.shape[0] == 1:       # decode: one token, predict ahead
            pf.observe(layer, top_k_index[0].tolist(), top_k_weights[0].float().tolist(),
                       hidden[0].float().cpu().numpy())
            for target, expert, _score in pf.predict(layer):
                if 0 <= target < len(self.cache.slots_per_layer):
                    self.cache.prefetch(target, int(expert))


# --- helpers (pure functions; the CLI and tests use them too) -----------------------------

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


def _replacement(replacement, num_layers: int, num_experts: int) -> ReplacementPolicy:
    if isinstance(replacement, ReplacementPolicy):
        return replacement
    if replacement == "lru":
        return LRU()
    if replacement == "belady":
        raise MoectlError("belady needs the future: it exists in `moectl simulate` only")
    from .. import policies

    if not hasattr(policies, "make_replacement"):
        raise MoectlError(f"unknown replacement policy {replacement!r}")
    return policies.make_replacement(replacement, num_layers=num_layers, num_experts=num_experts)


def _prefetch(prefetch, model, adapter, predictor_dir, config, family) -> PrefetchPolicy | None:
    """None/'none', a PrefetchPolicy object, 'gate-reuse' (next routers on the current hidden state), or a
    learned one ('mlp', 'routing', 'aux-gate' = aux gate for layer 0 + mlp for the rest) loaded from the
    predictors artifact in `predictor_dir` (the model workdir unless --predictor says)."""
    if prefetch is None or isinstance(prefetch, PrefetchPolicy):
        return prefetch
    if prefetch == "none":
        return None
    K = adapter.top_k
    if prefetch == "auto":       # the calibrated predictors when the workdir has them, else gate reuse
        from ..predict.artifact import JSON_NAME

        f = Path(predictor_dir) / JSON_NAME
        kinds = json.loads(f.read_text()).get("kinds", []) if f.exists() else []
        prefetch = "aux-gate" if {"mlp", "aux_gate"} <= set(kinds) else "mlp" if "mlp" in kinds else "gate-reuse"
    if prefetch == "gate-reuse":
        from ..policies.prefetch import GateReuse

        routers, bias = {}, {}
        for moe_idx, (_, block) in enumerate(adapter.moe_blocks(model)):
            r = adapter.router(block)
            routers[moe_idx] = r.weight.detach().float().cpu().numpy()
            if getattr(r, "bias", None) is not None:
                bias[moe_idx] = r.bias.detach().float().cpu().numpy()
        return GateReuse(routers, bias, depth=1, per_layer=K)
    if prefetch in ("mlp", "routing", "aux-gate"):
        from ..policies import MLPPrefetch, RoutingPrefetch
        from ..predict.artifact import load_predictors

        preds = load_predictors(predictor_dir, expect_fingerprint=model_fingerprint(config.to_dict(), family))
        need = {"mlp": "mlp", "routing": "routing", "aux-gate": "aux_gate"}[prefetch]
        if getattr(preds, need) is None:
            raise MoectlError(f"the predictors in {predictor_dir} have no {need} predictor; "
                              f"run `moectl train-predictor --kind {prefetch}`")
        if prefetch == "mlp":
            return MLPPrefetch(preds.mlp, depth=max(preds.mlp.lookaheads), per_layer=K)
        if prefetch == "routing":
            return RoutingPrefetch(preds.routing, per_layer=K)
        inner = MLPPrefetch(preds.mlp, depth=max(preds.mlp.lookaheads), per_layer=K) if preds.mlp else None
        return AuxGatePrefetch(preds.aux_gate, inner, per_layer=K)
    raise MoectlError(f"unknown prefetch {prefetch!r}; use auto, none, gate-reuse, mlp, routing or aux-gate")


def dense_nbytes(model) -> int:
    """Bytes of everything resident besides the expert cache (OffloadedExperts own no parameters)."""
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


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
            "prefetches": after["prefetches"] - before["prefetches"]}


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


def inspect_model(model: str, workdir: str | None = None, dtype: str | None = None) -> dict:
    """Family, layers, experts, sizes of a checkpoint, from its config and shard headers only."""
    ref = resolve_model(model, workdir)
    config, adapter = load_config(ref.path)
    Checkpoint(ref.path)                               # validates the shards (headers only)
    dt = _dtype(dtype, config)
    hf, blocks = _skeleton(config, adapter, dt, ref.path)
    size = torch.empty((), dtype=dt).element_size()
    dense = sum(t.numel() * size for k, t in hf.state_dict().items() if adapter.skeleton_key(k) is not None)
    if getattr(config, "tie_word_embeddings", False):
        dense -= hf.get_output_embeddings().weight.numel() * size
    expert_nbytes = adapter.layout().numel * size
    info = describe(config, adapter, expert_nbytes, dense, len(blocks))
    return info | {"model": ref.name, "path": str(ref.path), "dtype": str(dt).replace("torch.", ""),
                   "moe_layer_ids": [i for i, _ in blocks],
                   "fingerprint": model_fingerprint(config.to_dict(), adapter.family)}

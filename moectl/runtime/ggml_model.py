"""A GGUF model's whole forward as one ggml graph, as llama.cpp computes it (`mg_model_eval` in
moectl/kernels/ggml_shim.c): for a CPU run in place, where every weight is the mapped file's.

Why: in place on the CPU, every matrix was already ggml's, but a token still went through transformers' modules
and moectl's expert block: ~40 torch operations and 5 ggml calls a layer, each waking ggml's threadpool. On a
2-layer Qwen3-shaped Q8_0 file that was 6.4 ms of a 31 ms token (docs/gguf.md), and it grows with the layer count
(48 layers: ~150 ms a token) where llama.cpp's one graph a token has none of it. Here a forward (a prompt's prefill,
or one decode token) is one call: embedding rows, flash attention over an f16 KV cache held here (llama.cpp's CPU
default), routing, the experts' mul_mat_id and the lm_head, in the file's own blocks.

Which runs take it (`why_not`, runtime/load.py: `one_graph`): the families whose graph is written (Mixtral as
llama.cpp's `llama`, Qwen3-MoE, OLMoE: softmax routing, stacked experts; Qwen2-MoE as its `qwen2moe`: q/k/v biases
and a shared expert scaled by a sigmoid gate a token; GPT-OSS as its `gpt-oss`: attention sinks, sliding-window
layers, YaRN, biases, softmax_weight routing, swiglu_oai), in place on the CPU with ggml, from a GGUF (`from_gguf`)
or from a checkpoint with moectl's ggml copies (`from_modules`; not GPT-OSS), and nothing that needs the module
path: no gating or prefetch policy, no draft, no replay, no observers (profile, predictors). Every other run keeps
the module path, unchanged. `MOECTL_GGML_GRAPH=0` switches it off.

Legend: T = tokens, U = experts used a token, V = vocabulary, L = layers, C = KV capacity (positions), KV = KV
heads x head dim.

No torch here at import, nor in `from_gguf`, `forward`, `new_kv`: a GGUF's run through the graph takes numpy ids
and gives numpy logits, its KV cache numpy arrays, so its load need not import torch (~2 s). `from_modules` (a
checkpoint's modules, torch's tensors) imports it.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MoectlError
from ..kernels import ggml

if TYPE_CHECKING:                   # annotations only: from_modules imports torch
    import torch

ROPE_NORM, ROPE_NEOX = 0, 2                 # llama.cpp's LLAMA_ROPE_TYPE_NORM / _NEOX (ggml_rope_ext's mode)
GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT = 0, 1    # the shim's MG_GATING_*: llama.cpp's expert gating funcs
FAMILIES = {"mixtral": dict(rope_mode=ROPE_NORM, norm_topk=True, qk_norm_full=False),   # on the converter's Q/K rows
            "qwen3_moe": dict(rope_mode=ROPE_NEOX, norm_topk=True, qk_norm_full=False),  # per-head q/k norm
            "olmoe": dict(rope_mode=ROPE_NEOX, norm_topk=False, qk_norm_full=True),      # q/k norm over all heads
            # llama.cpp's qwen2moe: q/k/v biases, a shared expert gated by a sigmoid a token
            "qwen2_moe": dict(rope_mode=ROPE_NEOX, norm_topk=False, qk_norm_full=False),
            # llama.cpp's openai-moe: YaRN, sinks, sliding-window layers, biases, softmax_weight, swiglu_oai
            "gpt_oss": dict(rope_mode=ROPE_NEOX, norm_topk=False, qk_norm_full=False)}
# GPT-OSS's swiglu_oai: alpha as llama.cpp's LLM_FFN_SWIGLU_OAI_MOE and transformers' GptOssExperts fix it; the
# limit is the config's swiglu_limit (7.0 in both)
OAI_ALPHA = 1.702

LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm", "ffn_norm",
                "router", "gate", "up", "down", "router_b", "gate_b", "up_b", "down_b", "sinks",
                "shexp_gate_inp", "shexp_gate", "shexp_up", "shexp_down")
# the GGUF tensor of each field (blk.N.<name>); those in OPTIONAL may be absent
LAYER_TENSORS = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
                 "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias",
                 "bv": "attn_v.bias", "bo": "attn_output.bias", "q_norm": "attn_q_norm.weight",
                 "k_norm": "attn_k_norm.weight", "ffn_norm": "ffn_norm.weight", "router": "ffn_gate_inp.weight",
                 "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight",
                 "router_b": "ffn_gate_inp.bias", "gate_b": "ffn_gate_exps.bias", "up_b": "ffn_up_exps.bias",
                 "down_b": "ffn_down_exps.bias", "sinks": "attn_sinks.weight",
                 "shexp_gate_inp": "ffn_gate_inp_shexp.weight", "shexp_gate": "ffn_gate_shexp.weight",
                 "shexp_up": "ffn_up_shexp.weight", "shexp_down": "ffn_down_shexp.weight"}
SHARED_EXPERT = {"shexp_gate_inp", "shexp_gate", "shexp_up", "shexp_down"}
OPTIONAL = {"bq", "bk", "bv", "bo", "q_norm", "k_norm", "router_b", "gate_b", "up_b", "down_b", "sinks"} | SHARED_EXPERT
# GPT-OSS: the norm before the MoE is `post_attention_norm` (llama.cpp's attn_post_norm), and every field it reads
# is required (a file without its sinks or biases is not GPT-OSS's graph)
FAMILY_TENSORS = {"gpt_oss": {"ffn_norm": "post_attention_norm.weight"}}
# Qwen2-MoE: its shared expert (llama.cpp's qwen2moe requires it; its q/k/v biases are optional there, as here)
FAMILY_REQUIRED = {"gpt_oss": {"bq", "bk", "bv", "bo", "router_b", "gate_b", "up_b", "down_b", "sinks"},
                   "qwen2_moe": SHARED_EXPERT}
F32 = 0                                                     # GGML_TYPE_F32
CHUNK = 512                                                 # tokens a graph takes at most (llama.cpp's ubatch)


def layer_tensors(family: str | None) -> dict[str, str]:
    """field -> the GGUF tensor (blk.N.<name>) of this family's layers."""
    return LAYER_TENSORS | FAMILY_TENSORS.get(family, {})


_DESC_SERIAL = itertools.count(1)


class MgW(ctypes.Structure):
    _fields_ = [("ne", ctypes.c_int64 * 3), ("nb2", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("type", ctypes.c_int32), ("pad", ctypes.c_int32)]


class MgLayer(ctypes.Structure):
    _fields_ = [(n, MgW) for n in LAYER_FIELDS]


class MgModel(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab",
                                               "n_expert", "n_used", "n_ctx")]
                + [(n, ctypes.c_float) for n in ("eps", "freq_base", "freq_scale", "ext_factor", "attn_factor",
                                                 "beta_fast", "beta_slow", "freq_base_swa", "act_alpha", "act_limit")]
                + [(n, ctypes.c_int32) for n in ("rope_mode", "n_rot", "n_ctx_orig", "norm_topk", "qk_norm_full",
                                                 "kv_type", "gating", "n_swa")]
                + [("tok_embd", MgW), ("out_norm", MgW), ("output", MgW), ("layers", ctypes.POINTER(MgLayer)),
                   ("is_swa", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                   ("serial", ctypes.c_int64)])


def graphs_built() -> int:
    """The graphs `mg_model_eval` has built in this process: a decode step keeps its graph while the model, its
    cache buffers and the positions' bucket are unchanged (the shim's decode_step), a prefill builds its own."""
    return _declare(ggml.require()).mg_model_graphs_built()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, the loaded shim, with the one graph's entry points declared (once) and the shim's model layout checked
    against this file's structs (each model made). Not an import, so nothing the layering rule counts: a ctypes
    declaration, here rather than in kernels/ggml.py's `_load` (which declares every other entry point) because
    `mg_model_eval` takes `MgModel`, this file's descriptor, and the kernels layer does not import the runtime.
    At first use, not at import: this module is imported by every load (runtime/load.py: `why_not`), and the
    shim is loaded (built, the first time: minutes) only when a run asks for ggml; a run that never takes the graph
    neither loads it nor checks its layout."""
    if lib.mg_model_eval.argtypes is None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32
        lib.mg_model_eval.argtypes = [ptr, ctypes.POINTER(MgModel), ptr, i64, i64, i32, ptr, ptr]
        lib.mg_model_eval.restype = ctypes.c_int
        lib.mg_model_abi.restype = ctypes.c_int
        lib.mg_model_graphs_built.restype = ctypes.c_int64
    want = (ctypes.sizeof(MgModel) * 10000 + ctypes.sizeof(MgLayer)) * 100 + ctypes.sizeof(MgW)   # as the shim's
    if lib.mg_model_abi() != want:
        raise MoectlError(f"ggml shim's model layout {lib.mg_model_abi()} is not moectl's {want}: rebuild it")
    return lib


def why_not(config, options=None, gating=None, prefetch=None) -> str | None:
    """Why this run cannot take the one-graph forward (None: it can, if its weights are ones the graph reads:
    `GgmlModel.from_gguf` / `from_modules` say). `options`: the run's RuntimeOptions (None: not asked);
    `gating`, `prefetch`: the run's policies (None: none)."""
    if os.environ.get("MOECTL_GGML_GRAPH", "1") == "0":
        return "MOECTL_GGML_GRAPH=0"
    if gating is not None:
        return f"--gating {gating.describe()} needs the module path (adaptive top-k is not in the graph)"
    if prefetch is not None:
        return f"--prefetch {getattr(prefetch, 'name', prefetch)} needs the module path"
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"no one-graph forward for the {family} family yet"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "yarn"):
        return f"rope {rope.get('rope_type')} is not in the one-graph forward"
    if rope.get("rope_type") == "yarn" and family != "gpt_oss":
        return f"rope yarn is in the one-graph forward for GPT-OSS only (not {family})"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"attention {sorted(layer_types)} is not in the one-graph forward"
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) not in (1, None):
        return "dense (non-MoE) layers are not in the one-graph forward"
    if options is not None:
        for name in ("draft", "replay_trace"):
            v = getattr(options, name, None)
            if v not in (None, "none"):
                return f"--{name.replace('_', '-')} {v} needs the module path"
    if ggml.library() is None:
        return f"ggml is not available: {ggml.why_not()}"
    return None


def gguf_tensors_missing(files, n_layer: int, family: str | None = None) -> str | None:
    """A required tensor of the graph the file lacks, or None. Where it is a routed expert's stack, the file likely
    holds its experts one tensor each, or gate and up fused: said."""
    required = FAMILY_REQUIRED.get(family, set())
    for l in range(n_layer):
        for field, name in layer_tensors(family).items():
            if (field not in OPTIONAL or field in required) and f"blk.{l}.{name}" not in files:
                why = " (per-expert or fused tensors)" if field in ("gate", "up", "down") else ""
                return f"blk.{l}.{name} is not in the file{why}"
    return None


SMALL = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "bq", "bk", "bv", "bo", "router_b", "gate_b", "up_b", "down_b",
         "sinks")                                                                # handed over as fp32
# a weight's ggml type, by its dtype's name (torch's or numpy's: "float16"), so that no torch is needed here
GGML_TYPE = {"float32": 0, "float16": 1, "bfloat16": 30}
KV_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}    # the graph's KV cache


def dtype_name(dtype) -> str:
    """"float16" for torch.float16, np.float16, np.dtype("float16") or "float16"."""
    if isinstance(dtype, type):                               # np.float16 (a scalar type)
        try:
            return np.dtype(dtype).name
        except TypeError:
            return str(dtype)
    return str(dtype).removeprefix("torch.")


def kv_dtype_of(dtype) -> np.dtype:
    """The graph's KV cache dtype named by `dtype` (numpy's or torch's fp16 / fp32); ValueError for another."""
    got = KV_DTYPES.get(dtype_name(dtype))
    if got is None:
        raise ValueError(f"the graph's KV cache is fp16 or fp32, not {dtype}")
    return got


def _mgw(addr: int, encoding: int, shape: tuple, stride: int = 0) -> MgW:
    """A matrix (or stack of them: `stride` bytes apart, 0 back to back) of torch-order `shape` [A,] N, K at
    `addr`, in ggml order."""
    w = MgW()
    dims = list(reversed([int(d) for d in shape])) + [1] * (3 - len(shape))
    for i in range(3):
        w.ne[i] = dims[i]
    w.nb2, w.data, w.type = int(stride), int(addr), int(encoding)
    return w


def _weight(t: torch.Tensor, keep: list) -> MgW:
    if dtype_name(t.dtype) not in GGML_TYPE or t.device.type != "cpu" or t.is_meta:
        raise MoectlError(f"a {t.dtype} weight on {t.device} is not in the one-graph forward")
    t = t.detach().contiguous()
    keep.append(t)
    return _mgw(t.data_ptr(), GGML_TYPE[dtype_name(t.dtype)], tuple(t.shape))


def _linear(mod, keep: list) -> MgW | str:
    """A Linear's matrix as the graph reads it, or why not: ggml blocks (GgufLinear / GgmlDenseLinear with
    rows in order) or a bf16 / fp16 / fp32 weight."""
    import torch

    from ..models.dense_gguf import GgufLinear

    if isinstance(mod, GgufLinear):
        if mod.perm is not None:
            return "rows permuted (a GGUF's Q/K): read the file instead"
        mat = mod.matrix
        keep.append(mat.data)
        return _mgw(mat.data.ctypes.data, mat.encoding, mat.shape)
    w = getattr(mod, "weight", None)
    if type(mod).__name__ not in ("Linear", "GemvLinear") or not isinstance(w, torch.Tensor) \
            or dtype_name(w.dtype) not in GGML_TYPE or w.is_meta:
        return f"{type(mod).__name__} is not a matrix ggml reads"
    return _weight(w, keep)


def _experts(cache, layer: int) -> tuple[MgW, MgW, MgW] | str:
    """A layer's experts as the in-place cache computes them, when they are ggml stacks (a GGUF's ffn_*_exps, or
    moectl's ggml copies one expert a row of a buffer): (gate, up, down) descriptors; else why not."""
    if not getattr(cache, "in_place", False):
        return "not computed in place"
    w = cache.resident_weights(layer, 0)
    g, d = (w or {}).get("gate_up"), (w or {}).get("down")
    if not (isinstance(g, ggml.GgmlLinear) and isinstance(d, ggml.GgmlLinear) and type(g) is ggml.GgmlLinear
            and g.stacked is not None and d.stacked is not None):
        return "not ggml blocks (moectl's own kernels or torch's compute them)"
    (bg, A, bu, bd), stride = ggml._stacked_bases(g, d)
    (eg, _, (I, H)), (eu, _, _) = g.mats
    (ed, _, _), = d.mats
    return (_mgw(bg, eg, (A, I, H), stride), _mgw(bu, eu, (A, I, H), stride), _mgw(bd, ed, (A, H, I), stride))


def _hyper(config, rope_mode: int, vocab: int, experts: int) -> MgModel:
    """A descriptor with the config's sizes, norm, RoPE and routing (weights not set)."""
    fam = FAMILIES[config.model_type]
    m = MgModel()
    H = int(config.hidden_size)
    NH, NKV = int(config.num_attention_heads), int(config.num_key_value_heads)
    D = int(getattr(config, "head_dim", None) or H // NH)
    rope = getattr(config, "rope_parameters", None) or {}
    m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.head_dim = int(config.num_hidden_layers), H, NH, NKV, D
    m.n_vocab, m.n_expert, m.n_used = vocab, experts, int(config.num_experts_per_tok)
    m.eps = float(config.rms_norm_eps)
    m.freq_base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    m.freq_base_swa = m.freq_base
    kind = rope.get("rope_type", "default")
    m.freq_scale = 1.0 / float(rope["factor"]) if kind in ("linear", "yarn") else 1.0
    # llama.cpp's hparams defaults: the betas are not read from the file for these architectures
    m.ext_factor, m.attn_factor, m.beta_fast, m.beta_slow = 0.0, 1.0, 32.0, 1.0
    m.rope_mode, m.n_rot = rope_mode, D
    m.n_ctx_orig = int(getattr(config, "max_position_embeddings", 4096))
    if kind == "yarn":
        # llama-context.cpp: ext_factor 1 for YaRN; attn_factor = mscale(factor) / (1 + 0.1 ln factor), which
        # cancels ggml_rope's own (1 + 0.1 ln(1 / freq_scale)) so the net magnitude scale is mscale(factor)
        factor = float(rope["factor"])
        mscale = 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0
        m.ext_factor = 1.0
        m.attn_factor = mscale / (1.0 + 0.1 * math.log(factor))
        m.n_ctx_orig = int(rope.get("original_max_position_embeddings") or m.n_ctx_orig)   # n_ctx_orig_yarn
    m.gating = GATING_SOFTMAX_WEIGHT if config.model_type == "gpt_oss" else GATING_SOFTMAX
    if config.model_type == "gpt_oss":
        m.act_alpha, m.act_limit = OAI_ALPHA, float(getattr(config, "swiglu_limit", 7.0))
    if swa_layers(config) is not None:
        m.n_swa = int(config.sliding_window)
    # Mixtral always renormalises its top-k; Qwen3-MoE, OLMoE and Qwen2-MoE as their config says (llama.cpp's
    # qwen2moe never does, as Qwen1.5-MoE-A2.7B's config says: false, transformers' default too)
    m.norm_topk = 1 if config.model_type == "mixtral" else int(bool(getattr(config, "norm_topk_prob",
                                                                             fam["norm_topk"])))
    m.qk_norm_full = int(fam["qk_norm_full"])
    return m


def swa_layers(config) -> np.ndarray | None:
    """uint8 [L]: 1 where the layer attends a sliding window (GPT-OSS's config's layer_types: its even layers, as
    llama.cpp's swa pattern 2), or None where no layer does (the other families' graphs in llama.cpp have no
    sliding window, whatever a config says)."""
    types = getattr(config, "layer_types", None) or ()
    if config.model_type != "gpt_oss" or "sliding_attention" not in types:
        return None
    return np.array([t == "sliding_attention" for t in types], dtype=np.uint8)


class GraphKV:
    """The KV cache of one sequence in the one-graph forward: K and V [L, C, KV] numpy arrays of `dtype` (np.float16
    or np.float32; torch's names of them are taken too), `pos` positions filled. fp16 is llama.cpp's default cache
    type (its flash attention reads it); fp32 keeps an fp32 model's forward lossless (GgmlModel.kv_dtype)."""

    def __init__(self, layers: int, kv: int, capacity: int, dtype=np.float16):
        dtype = kv_dtype_of(dtype)
        self.k = np.zeros((layers, capacity, kv), dtype=dtype)
        self.v = np.zeros((layers, capacity, kv), dtype=dtype)
        self.pos = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def reserve(self, n: int) -> None:
        """Room for n positions (doubling, the filled ones kept)."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], cap, old.shape[2]), dtype=old.dtype)
            new[:, :self.pos] = old[:, :self.pos]
            setattr(self, name, new)

    def get_seq_length(self, layer: int = 0) -> int:
        return self.pos

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class GgmlModel:
    """The one-graph forward: `forward(ids [1, T], kv | None, last_only)` -> (logits [1, T or 1, V] float32, kv),
    numpy, and each layer's routed experts of the last forward (`last_ids` [L, T, U] int32 numpy, -1 where a row was
    not routed).
    Made by `from_gguf` (a GGUF's tensors where they lie in the mapped file) or `from_modules` (a checkpoint's
    loaded modules and expert copies in ggml blocks)."""

    def __init__(self, desc: MgModel, layers, keep: list, kv_dtype=np.float16, config=None):
        self.lib = _declare(ggml.require())
        swa = swa_layers(config) if config is not None else None
        if swa is not None:
            keep.append(swa)
            desc.is_swa = swa.ctypes.data
        # the shim keeps a decode step's graph while the descriptor is unchanged: a new model's own number, so one
        # made where a freed one lay (same addresses) is not taken for it
        desc.serial = next(_DESC_SERIAL)
        self.desc, self.layers, self._keep = desc, layers, keep     # keep: what the descriptors point at
        self.kv_dtype = kv_dtype
        self.n_layer, self.V, self.U, self.n_expert = desc.n_layer, desc.n_vocab, desc.n_used, desc.n_expert
        self.KV = desc.n_head_kv * desc.head_dim

    @property
    def kv_dtype(self) -> np.dtype:
        """The KV cache's dtype (a new cache's: `new_kv`): np.float16 or np.float32. Set with numpy's or torch's
        fp16 / fp32 (another: ValueError)."""
        return self._kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype) -> None:
        self._kv_dtype = kv_dtype_of(dtype)
        self.desc.kv_type = GGML_TYPE[self._kv_dtype.name]

    @classmethod
    def from_gguf(cls, gguf, config) -> "GgmlModel":
        """From a GGUF's tensors where they lie in its mapped file(s): `gguf` is anything with `.files` (a
        store/gguf/files.py `GgufFiles`; it is kept alive as long as the graph), `config` anything with the
        config's attributes (transformers' config, or a namespace of its `to_dict()`). No torch."""
        files, keep = gguf.files, [gguf]
        fam = FAMILIES[config.model_type]
        for part in files.paths:            # the mapped file(s): ggml may repack a matrix on first use (CPU_REPACK)
            ggml.register_stable(files.bytes_of(part, 0, 1))

        def w(name: str, f32: bool = False) -> MgW:
            # a weight where it lies in the mapped file; `f32`: a norm or bias, handed over as fp32 (a copy
            # unless the file's is)
            e = files.entry(name)
            if f32 and e.encoding != F32:
                from gguf.quants import dequantize

                raw = files.bytes_of(e.file, e.offset, e.nbytes)
                arr = np.ascontiguousarray(dequantize(raw, e.encoding).astype(np.float32).reshape(-1))
                keep.append(arr)
                return _mgw(arr.ctypes.data, F32, e.shape)
            return _mgw(files.bytes_of(e.file, e.offset, e.nbytes).ctypes.data, int(e.encoding), e.shape)

        L = int(config.num_hidden_layers)
        layers = (MgLayer * L)()
        names = layer_tensors(config.model_type)
        for l in range(L):
            for field in LAYER_FIELDS:
                name = f"blk.{l}.{names[field]}"
                if name in files:
                    setattr(layers[l], field, w(name, f32=field in SMALL))
        m = _hyper(config, fam["rope_mode"], int(files.entry("token_embd.weight").shape[0]),
                   int(files.entry("blk.0.ffn_gate_inp.weight").shape[0]))
        m.n_rot = int(files.get("{arch}.rope.dimension_count", m.head_dim))
        m.freq_base_swa = float(files.get("{arch}.rope.freq_base_swa", m.freq_base))
        m.attn_factor *= float(files.get("{arch}.rope.scaling.attn_factor", 1.0))   # hparams.rope_attn_factor
        m.tok_embd = w("token_embd.weight")
        m.out_norm = w("output_norm.weight", f32=True)
        if "output.weight" in files:
            m.output = w("output.weight")
        m.layers = layers
        # the KV cache: fp16 as llama.cpp's, fp32 for an fp32 file (its forward stays lossless)
        return cls(m, layers, keep, np.float32 if files.entry("blk.0.attn_q.weight").encoding == F32
                   else np.float16, config)

    @classmethod
    def from_modules(cls, model, config, cache) -> "GgmlModel | str":
        """From a loaded skeleton's modules (norms, attention, router, embedding, lm_head: bf16 / fp32 weights, or
        ggml blocks: `--dense-lowbit` through ggml) and the experts the cache computes in place as ggml stacks
        (moectl's `--format ggml-*` copies). The checkpoint's Q/K rows are transformers' order: NEOX RoPE (its
        rotate_half), every family. A str: why not (a module or expert kind the graph cannot read)."""
        if config.model_type == "gpt_oss":
            return "GPT-OSS's graph reads a GGUF's tensors (sinks, biases), not a checkpoint's modules"
        import torch

        keep: list = []
        inner = model.model
        L = len(inner.layers)
        layers = (MgLayer * L)()

        def f32(t: torch.Tensor) -> MgW:
            t = t.detach().float().contiguous()
            keep.append(t)
            return _mgw(t.data_ptr(), F32, tuple(t.shape))

        for l, layer in enumerate(inner.layers):
            attn, block = layer.self_attn, layer.mlp
            dst = layers[l]
            for field, mod in (("wq", attn.q_proj), ("wk", attn.k_proj), ("wv", attn.v_proj), ("wo", attn.o_proj)):
                got = _linear(mod, keep)
                if isinstance(got, str):
                    return f"layer {l} {field}: {got}"
                setattr(dst, field, got)
                if getattr(mod, "bias", None) is not None:
                    setattr(dst, "b" + field[1], f32(mod.bias))
            for field, mod in (("q_norm", getattr(attn, "q_norm", None)), ("k_norm", getattr(attn, "k_norm", None))):
                if mod is not None:
                    setattr(dst, field, f32(mod.weight))
            dst.attn_norm, dst.ffn_norm = f32(layer.input_layernorm.weight), f32(layer.post_attention_layernorm.weight)
            router = getattr(block, "gate", None)
            if router is None or not isinstance(getattr(router, "weight", None), torch.Tensor):
                return f"layer {l}: no router weight"
            dst.router = f32(router.weight)
            shared = getattr(block, "shared_expert", None)          # Qwen2-MoE's, with its sigmoid gate
            if shared is not None:
                for field, mod in (("shexp_gate", shared.gate_proj), ("shexp_up", shared.up_proj),
                                   ("shexp_down", shared.down_proj), ("shexp_gate_inp", block.shared_expert_gate)):
                    got = _linear(mod, keep)
                    if isinstance(got, str):
                        return f"layer {l} shared expert: {got}"
                    setattr(dst, field, got)
            got = _experts(cache, l)
            if isinstance(got, str):
                return f"layer {l} experts: {got}"
            dst.gate, dst.up, dst.down = got
        emb = inner.embed_tokens
        head = model.lm_head
        m = _hyper(config, ROPE_NEOX, int(emb.weight.shape[0]), int(layers[0].router.ne[1]))
        m.tok_embd = _weight(emb.weight, keep)
        m.out_norm = f32(inner.norm.weight)
        out = _linear(head, keep)
        if isinstance(out, str):
            return f"lm_head: {out}"
        m.output = out
        m.layers = layers
        q_w = getattr(inner.layers[0].self_attn.q_proj, "weight", None)
        return cls(m, layers, keep, np.float32 if isinstance(q_w, torch.Tensor) and q_w.dtype == torch.float32
                   else np.float16, config)

    def new_kv(self, capacity: int = 256) -> GraphKV:
        return GraphKV(self.n_layer, self.KV, capacity, self.kv_dtype)

    def forward(self, input_ids, kv: GraphKV | None = None, last_only: bool = False, on_chunk=None):
        """Logits [1, T or 1, V] float32 (numpy) and the KV cache after `input_ids` [1, T] or [T] (any array of
        ints: numpy, a list, a CPU torch tensor). A long prompt goes in chunks of CHUNK tokens, as llama.cpp's
        ubatch: a chunk's attention scores are [P, CHUNK, heads] floats, where one graph of T tokens would hold
        [P, T, heads] (4096 tokens, 32 heads: 2 GB). `on_chunk(done, total)` after each chunk."""
        given = np.asarray(input_ids)               # a torch tensor through its __array__: no torch call here
        if given.ndim > 2 or (given.ndim == 2 and given.shape[0] != 1):
            raise MoectlError(f"the one-graph forward takes one sequence of token ids, not an array {given.shape}")
        if given.size and given.dtype.kind not in "iu":
            raise MoectlError(f"token ids are integers, not {given.dtype}")
        T = given.size
        if T == 0:
            raise MoectlError("a forward needs at least one token")
        lo, hi = int(given.min()), int(given.max())         # before the int32 cast, which could wrap one
        if lo < 0 or hi >= self.V:
            raise MoectlError(f"token id {hi if hi >= self.V else lo} is outside the vocabulary (0..{self.V - 1})")
        ids = np.ascontiguousarray(given.reshape(-1), dtype=np.int32)                          # [T]
        kv = kv if kv is not None else self.new_kv(max(256, T))
        if kv.k.dtype != self.kv_dtype:
            raise ValueError(f"a {kv.k.dtype} KV cache given to a graph whose cache is {self.kv_dtype}")
        kv.reserve(kv.pos + T)
        m = self.desc
        m.n_ctx, m.k_cache, m.v_cache = kv.capacity, kv.k.ctypes.data, kv.v.ctypes.data
        logits, routed = [], []
        for c0 in range(0, T, CHUNK):
            chunk = ids[c0:c0 + CHUNK]
            n, final = chunk.size, c0 + CHUNK >= T
            # only the kept rows' logits: the last chunk's last row (last_only), else every row
            out = np.empty((1 if last_only else n, self.V), dtype=np.float32)
            # each layer's routed experts [L, n, U]; -1 where a row was not routed (last_only: the last layer
            # routes one row, the only one whose output is used)
            ids_out = np.full((self.n_layer, n, self.U), -1, dtype=np.int32)
            rc = self.lib.mg_model_eval(ggml.handle(), ctypes.byref(m), chunk.ctypes.data, n, kv.pos,
                                        int(last_only), out.ctypes.data, ids_out.ctypes.data)
            if rc:
                raise MoectlError(f"ggml's graph failed (code {rc}) on {n} tokens at position {kv.pos}")
            kv.pos += n
            if final or not last_only:
                logits.append(out)
            routed.append(ids_out)
            if on_chunk is not None:
                on_chunk(min(c0 + CHUNK, T), T)
        # one chunk (a decode step): no copies
        self.last_ids = routed[0] if len(routed) == 1 else np.concatenate(routed, axis=1)          # [L, T, U]
        return (logits[0] if len(logits) == 1 else np.concatenate(logits))[None], kv

"""A GGUF model's whole forward as one ggml graph, as llama.cpp computes it (`mg_model_eval` in
moectl/kernels/ggml_shim.c): for a CPU run in place, where every weight is the mapped file's.

Why: in place on the CPU, every matrix was already ggml's, but a token still went through transformers' modules
and moectl's expert block: ~40 torch operations and 5 ggml calls a layer, each waking ggml's threadpool. On a
2-layer Qwen3-shaped Q8_0 file that was 6.4 ms of a 31 ms token (docs/gguf.md), and it grows with the layer count
(48 layers: ~150 ms a token) where llama.cpp's one graph a token has none of it. Here a forward (a prompt's prefill,
or one decode token) is one call: embedding rows, attention with a KV cache held here, routing, the experts'
mul_mat_id and the lm_head, in the file's own blocks.

Which runs take it (`why_not`): a GGUF of the families whose graph is written (Mixtral as llama.cpp's `llama`,
Qwen3-MoE, OLMoE: softmax routing, stacked experts, no shared experts, RoPE without YaRN), in place on the CPU
with ggml, nothing that needs the module path: no gating policy (adaptive top-k), no low-bit copies, no draft,
no replay, no observers (profile, predictors). Every other run keeps the module path, unchanged.
`MOECTL_GGML_GRAPH=0` switches it off.

Legend: T = tokens, U = experts used a token, V = vocabulary, L = layers, C = KV capacity (positions), KV = KV
heads x head dim.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ..errors import MoectlError
from ..kernels import ggml

FAMILIES = {"mixtral": dict(rope_mode=0, norm_topk=True, qk_norm_full=False),     # llama.cpp: LLAMA_ROPE_TYPE_NORM
            "qwen3_moe": dict(rope_mode=2, norm_topk=True, qk_norm_full=False),   # NEOX, per-head q/k norm
            "olmoe": dict(rope_mode=2, norm_topk=False, qk_norm_full=True)}       # NEOX, q/k norm over all heads

LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm", "ffn_norm",
                "router", "gate", "up", "down")
# the GGUF tensor of each field (blk.N.<name>); None: required, else optional
LAYER_TENSORS = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
                 "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias",
                 "bv": "attn_v.bias", "bo": "attn_output.bias", "q_norm": "attn_q_norm.weight",
                 "k_norm": "attn_k_norm.weight", "ffn_norm": "ffn_norm.weight", "router": "ffn_gate_inp.weight",
                 "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}
OPTIONAL = {"bq", "bk", "bv", "bo", "q_norm", "k_norm"}
F32 = 0                                                     # GGML_TYPE_F32


class MgW(ctypes.Structure):
    _fields_ = [("ne", ctypes.c_int64 * 3), ("data", ctypes.c_void_p), ("type", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


class MgLayer(ctypes.Structure):
    _fields_ = [(n, MgW) for n in LAYER_FIELDS]


class MgModel(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab",
                                               "n_expert", "n_used", "n_ctx")]
                + [(n, ctypes.c_float) for n in ("eps", "freq_base", "freq_scale", "ext_factor", "attn_factor",
                                                 "beta_fast", "beta_slow")]
                + [(n, ctypes.c_int32) for n in ("rope_mode", "n_rot", "n_ctx_orig", "norm_topk", "qk_norm_full",
                                                 "pad")]
                + [("tok_embd", MgW), ("out_norm", MgW), ("output", MgW), ("layers", ctypes.POINTER(MgLayer)),
                   ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)])


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.mg_model_eval.argtypes is None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32
        lib.mg_model_eval.argtypes = [ptr, ctypes.POINTER(MgModel), ptr, i64, i64, i32, ptr, ptr]
        lib.mg_model_eval.restype = ctypes.c_int
        lib.mg_model_abi.restype = ctypes.c_int
    want = ctypes.sizeof(MgModel) * 1000 + ctypes.sizeof(MgW)
    if lib.mg_model_abi() != want:
        raise MoectlError(f"ggml shim's model layout {lib.mg_model_abi()} is not moectl's {want}: rebuild it")
    return lib


def why_not(gguf, config, options=None, gating=None, prefetch=None) -> str | None:
    """Why this run cannot take the one-graph forward (None: it can). `gguf`: the GgufModel; `options`: the
    run's RuntimeOptions (None: not asked); `gating`, `prefetch`: the run's policies (None: none)."""
    if os.environ.get("MOECTL_GGML_GRAPH", "1") == "0":
        return "MOECTL_GGML_GRAPH=0"
    if gating is not None:
        return f"--gating {gating.describe()} needs the module path (adaptive top-k is not in the graph)"
    if prefetch is not None:
        return f"--prefetch {getattr(prefetch, 'name', prefetch)} needs the module path"
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"no one-graph forward for the {family} family yet"
    files = gguf.files
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear"):
        return f"rope {rope.get('rope_type')} is not in the one-graph forward"
    n_layer = int(config.num_hidden_layers)
    for l in range(n_layer):
        for field, name in LAYER_TENSORS.items():
            if field not in OPTIONAL and f"blk.{l}.{name}" not in files:
                return f"blk.{l}.{name} is not in the file (per-expert or fused tensors)"
    if options is not None:
        for name in ("lowbit", "draft", "replay_trace", "dense_lowbit"):
            v = getattr(options, name, None)
            if v not in (None, "none"):
                return f"--{name.replace('_', '-')} {v} needs the module path"
    if ggml.library() is None:
        return f"ggml is not available: {ggml.why_not()}"
    return None


class GraphKV:
    """The KV cache of one sequence in the one-graph forward: K and V [L, C, KV] fp32, `pos` positions filled."""

    def __init__(self, layers: int, kv: int, capacity: int):
        self.k = torch.zeros(layers, capacity, kv)
        self.v = torch.zeros(layers, capacity, kv)
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
            new = torch.zeros(old.shape[0], cap, old.shape[2])
            new[:, :self.pos] = old[:, :self.pos]
            setattr(self, name, new)

    def get_seq_length(self, layer: int = 0) -> int:
        return self.pos

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class GgmlModel:
    """The one-graph forward over a GgufModel's mapped file: `forward(ids [1, T], kv | None, last_only)` ->
    (logits [1, T or 1, V] fp32, kv), and each layer's routed experts of the last forward (`last_ids`
    [L, T, U] int32, for the cache's counters)."""

    def __init__(self, gguf, config):
        self.gguf, self.config = gguf, config
        self.lib = _declare(ggml.require())
        files = gguf.files
        fam = FAMILIES[config.model_type]
        self._keep: list = []                       # arrays the descriptors point at (fp32 copies of norms)
        L = self.n_layer = int(config.num_hidden_layers)
        self.layers = (MgLayer * L)()
        for l in range(L):
            for field in LAYER_FIELDS:
                name = f"blk.{l}.{LAYER_TENSORS[field]}"
                if name in files:
                    small = field in ("attn_norm", "ffn_norm", "q_norm", "k_norm", "bq", "bk", "bv", "bo")
                    setattr(self.layers[l], field, self._w(name, f32=small))
        m = self.desc = MgModel()
        H = int(config.hidden_size)
        NH, NKV = int(config.num_attention_heads), int(config.num_key_value_heads)
        D = int(getattr(config, "head_dim", None) or H // NH)
        rope = getattr(config, "rope_parameters", None) or {}
        self.U = int(config.num_experts_per_tok)
        self.n_expert = int(files.entry("blk.0.ffn_gate_inp.weight").shape[0])
        m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.head_dim = L, H, NH, NKV, D
        m.n_vocab = int(files.entry("token_embd.weight").shape[0])
        m.n_expert = self.n_expert
        m.n_used = self.U
        m.eps = float(config.rms_norm_eps)
        m.freq_base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        m.freq_scale = 1.0 / float(rope["factor"]) if rope.get("rope_type") == "linear" else 1.0
        m.ext_factor, m.attn_factor, m.beta_fast, m.beta_slow = 0.0, 1.0, 32.0, 1.0
        m.rope_mode, m.n_rot = fam["rope_mode"], int(files.get("{arch}.rope.dimension_count", D))
        m.n_ctx_orig = int(getattr(config, "max_position_embeddings", 4096))
        m.norm_topk = int(bool(getattr(config, "norm_topk_prob", fam["norm_topk"])) if config.model_type != "mixtral"
                          else 1)
        m.qk_norm_full = int(fam["qk_norm_full"])
        m.tok_embd = self._w("token_embd.weight")
        m.out_norm = self._w("output_norm.weight", f32=True)
        if "output.weight" in files:
            m.output = self._w("output.weight")
        m.layers = self.layers
        self.V, self.KV = m.n_vocab, NKV * D

    def _w(self, name: str, f32: bool = False) -> MgW:
        """A weight where it lies in the mapped file (ggml order: ne[0] the row length); `f32`: a norm or bias,
        handed over as fp32 (a copy unless the file's is)."""
        e = self.gguf.files.entry(name)
        w = MgW()
        dims = list(reversed(e.shape)) + [1] * (3 - len(e.shape))
        for i in range(3):
            w.ne[i] = int(dims[i])
        if f32 and e.encoding != F32:
            from gguf.quants import dequantize

            raw = self.gguf.files.bytes_of(e.file, e.offset, e.nbytes)
            arr = np.ascontiguousarray(dequantize(raw, e.encoding).astype(np.float32).reshape(-1))
            self._keep.append(arr)
            w.data, w.type = arr.ctypes.data, F32
        else:
            w.data, w.type = self.gguf.files.bytes_of(e.file, e.offset, e.nbytes).ctypes.data, int(e.encoding)
        return w

    def new_kv(self, capacity: int = 256) -> GraphKV:
        return GraphKV(self.n_layer, self.KV, capacity)

    def forward(self, input_ids: torch.Tensor, kv: GraphKV | None = None, last_only: bool = False):
        ids = input_ids.reshape(-1).to(torch.int32).contiguous()
        T = ids.numel()
        if T == 0:
            raise MoectlError("a forward needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.V:
            raise MoectlError(f"token id {int(ids.max()) if int(ids.max()) >= self.V else int(ids.min())} is outside "
                              f"the vocabulary (0..{self.V - 1})")
        kv = kv if kv is not None else self.new_kv(max(256, T))
        kv.reserve(kv.pos + T)
        m = self.desc
        m.n_ctx, m.k_cache, m.v_cache = kv.capacity, kv.k.data_ptr(), kv.v.data_ptr()
        rows = 1 if last_only else T
        logits = torch.empty(rows, self.V)
        # each layer's routed experts; -1 where a row was not routed (last_only: the last layer routes one row)
        self.last_ids = torch.full((self.n_layer, T, self.U), -1, dtype=torch.int32)
        rc = self.lib.mg_model_eval(ggml.handle(), ctypes.byref(m), ids.data_ptr(), T, kv.pos, int(last_only),
                                    logits.data_ptr(), self.last_ids.data_ptr())
        if rc:
            raise MoectlError(f"ggml's graph failed (code {rc}) on {T} tokens at position {kv.pos}")
        kv.pos += T
        return logits[None], kv

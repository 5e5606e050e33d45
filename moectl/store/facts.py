"""What a checkpoint needs, from its config and shard headers alone (nothing but the dense skeleton on meta):
the facts the sizing (`moectl/core/sizing.py`) takes (dense bytes of the skeleton, KV bytes), the memory a
configuration needs by part (`memory_plan`, `moectl inspect`), and the checks every loader of a checkpoint shares
(a built model, a readable config, a dtype, a device)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..core.recipes import is_gguf_path, resolve_model
from ..core.sizing import KV_RESERVE_TOKENS, ModelSizes, budget_pools, lowbit_fraction_for, split_budget
from ..errors import MoectlError
from ..models import adapter_for, config_fingerprint
from .checkpoint import Checkpoint
from .memory import host_need, kv_cache_nbytes, rotary_tables_nbytes


def checkpoint_sizes(config, adapter, dtype: torch.dtype, dense: int, num_moe_layers: int, name: str | None = None,
                     path=None) -> ModelSizes:
    """The sizing's facts of a checkpoint directory or GGUF file, from its config (`load_config`) and the dense bytes
    of its skeleton (`dense_nbytes`, experts offloaded): KV bytes per token, one expert's bytes in its packed format,
    the shape (`sim/cost.py: shape_from_hf_config`, at `dtype`). One of the two constructors of ModelSizes; the
    other estimates them from a shape (`setting/model_sizes.py: shape_sizes`). `model_sizes` reads them by name."""
    from ..setting.model_sizes import config_sizes

    return config_sizes(config.to_dict(), config_fingerprint(config), str(dtype).replace("torch.", ""), num_moe_layers,
                        adapter.num_experts, adapter.top_k, dense, kv_reserve_nbytes(config, dtype, 1),
                        adapter.format(dtype).nbytes, f"checkpoint {path}" if path else "", name)


def model_sizes(model: str, workdir=None) -> ModelSizes:
    """The sizes of `model`: its checkpoint's (or the built tiny model's; `checkpoint_sizes`), else, when the
    checkpoint is absent, its recipe's `shape:` block's (plans from traces alone)."""
    from ..core.recipes import load_recipe, recipes_dir
    from ..setting.model_sizes import shape_sizes

    try:
        ref = resolve_model(model, workdir)
        present = ref.path.is_dir() or ref.gguf
    except MoectlError:
        if not (recipes_dir() / f"{model}.yaml").exists():
            raise
        ref, present = None, False
    if present:
        ref, config, adapter, _, dt, hf, blocks = offloaded_skeleton(model, workdir)
        return checkpoint_sizes(config, adapter, dt, dense_nbytes(hf, config), len(blocks), ref.name, ref.path)
    recipe = load_recipe(model) if ref is None else ref.recipe
    if not recipe or "shape" not in recipe:
        raise MoectlError(f"--model {model}: no checkpoint at {ref.path if ref else '?'} and no recipe shape: block")
    shape = {"name": recipe.get("name", model), **recipe["shape"]}
    return shape_sizes(shape, source=f"recipe {shape['name']} (shape: block; no checkpoint)")


def built(ref):
    """`ref`, or a clear error when it is the built-in tiny model and nobody built it yet."""
    if (ref.recipe or {}).get("builtin") == "tiny" and not ref.path.exists():
        raise MoectlError(f"the built-in tiny model is not built in {ref.workdir} yet: run `moectl build-tiny`")
    return ref


def load_config(path: Path):
    """(HF config, family adapter) of a checkpoint directory, with clear errors; of a GGUF file, its config from
    the metadata and the family adapter reading the GGUF's experts (moectl/store/gguf/store.py)."""
    from transformers import AutoConfig

    if is_gguf_path(path):
        from .gguf.model import open_gguf
        from .gguf.store import GgufAdapter

        g = open_gguf(path)
        return g.config, GgufAdapter(g)
    Checkpoint.check_dir(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise MoectlError(f"cannot read {Path(path) / 'config.json'}: {e}") from None
    return config, adapter_for(config)


def open_checkpoint(path, adapter) -> Checkpoint:
    """The byte ranges of the checkpoint's tensors (headers only): the safetensors shards, or the GGUF's tensors."""
    gguf = adapter.gguf
    if gguf is not None:
        from .gguf.store import GgufCheckpoint

        return GgufCheckpoint(gguf)
    return Checkpoint(path)


def skeleton(config, adapter, dtype: torch.dtype, path):
    """The model with parameters on meta (buffers such as rotary tables real) and its MoE blocks."""
    from accelerate import init_empty_weights

    from ..models.hf_modeling import import_model_code

    import_model_code()                                 # first, so that hqq's compiled kernels stay unimported
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    blocks = adapter.moe_blocks(hf)
    if not blocks:
        raise MoectlError(f"{path} has no sparse MoE layers; moectl offloads experts of MoE models")
    return hf, blocks


DEVICES = "auto, cpu, cuda or cuda:N"       # what --device takes


def pick_device(asked: str | None = "auto") -> tuple[str, str]:
    """(the device a run takes for --device `asked`, one status line saying which and why). auto (or None): CUDA
    when torch sees a device (`cuda`, torch's current one), else the CPU; `cuda` and `cuda:N` need a CUDA device, N
    below the count. Anything else is one clear error, raised before anything is loaded."""
    import re

    name = "auto" if asked is None else str(asked).strip().lower()
    if name == "auto":
        if not torch.cuda.is_available():
            return "cpu", f"device: cpu (--device auto; {_no_cuda_why()})"
        return "cuda", f"device: cuda ({_cuda_name(0)}; --device auto, {_count(torch.cuda.device_count())})"
    if name == "cpu":
        return "cpu", "device: cpu (--device cpu)"
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m is None:
        raise MoectlError(f"--device must be {DEVICES}, not {asked!r}")
    if not torch.cuda.is_available():
        raise MoectlError(f"--device {asked}: {_no_cuda_why()}; use --device cpu or auto (the default)")
    n, index = torch.cuda.device_count(), int(m.group(1) or 0)
    if index >= n:
        raise MoectlError(f"--device {asked}: torch sees {_count(n)} (cuda:0" + (f" to cuda:{n - 1}" if n > 1 else "")
                          + "; CUDA_VISIBLE_DEVICES renumbers them)")
    return name, f"device: {name} ({_cuda_name(index)}; --device {asked})"


def _count(n: int) -> str:
    return f"{n} CUDA device" + ("s" if n != 1 else "")


def _no_cuda_why() -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return "torch sees no CUDA device"


def _cuda_name(index: int) -> str:
    """The GPU's name, for the status line (a name is not worth failing over)."""
    try:
        return torch.cuda.get_device_name(index)
    except Exception:                           # noqa: BLE001 -- a faked or half-visible device: no name
        return f"CUDA device {index}"


def parse_dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or getattr(config, "dtype", None) or "float32"         # (config.torch_dtype warns from 5.24 on)
    name = str(name).replace("torch.", "")
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise MoectlError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return table[name]


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
        w_out, w_emb = getattr(out, "weight", None), getattr(emb, "weight", None)   # none: in the mapped file
        if w_out is not None and w_emb is not None and w_out is not w_emb:           # not tied yet
            n -= w_out.numel() * w_out.element_size()
    return n


def mapped_dense_nbytes(model, mapped: dict) -> tuple[int, int]:
    """(bytes the `mapped` weights ({name: (encoding, data, ...)}, a GGUF's `dense_in_place`) take in `model`'s
    skeleton, their bytes in the file); a table the lm_head shares with the embedding counts once in each."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen, skeleton, packed = set(), 0, 0
    for name, (_, data, *_rest) in mapped.items():
        if data.ctypes.data not in seen:
            seen.add(data.ctypes.data)
            p = params[name]
            skeleton += p.numel() * p.element_size()
            packed += data.nbytes
    return skeleton, packed


def header_dense_nbytes(ckpt: Checkpoint, adapter, dtype: torch.dtype, mapped: dict | None = None) -> int:
    """Bytes of the non-expert weights once loaded (floating tensors in `dtype`), from the shard headers (a GGUF's:
    every dense tensor dequantised to `dtype`, but the `mapped` ones at their bytes in the file)."""
    gguf = adapter.gguf
    if gguf is not None:
        return gguf.sizes(dtype.itemsize, mapped_names(mapped))["dense_bytes"]
    return sum(math.prod(r.shape) * (dtype.itemsize if r.dtype.is_floating_point else r.dtype.itemsize)
               for key, r in ckpt.ranges.items() if adapter.skeleton_key(key) is not None)


def kv_reserve_nbytes(config, dtype: torch.dtype, tokens: int = KV_RESERVE_TOKENS) -> int:
    """Bytes of the KV cache for `tokens` tokens (K and V, every layer) at the config's shapes."""
    return kv_cache_nbytes(config, dtype.itemsize, tokens)


def describe(config, adapter, expert_nbytes: int, dense: int, num_moe_layers: int) -> dict:
    E = adapter.num_experts
    return {"family": adapter.family, "layers": int(config.num_hidden_layers), "moe_layers": num_moe_layers,
            "experts": E, "top_k": adapter.top_k, "hidden_size": int(config.hidden_size),
            "expert_intermediate_size": adapter.expert_intermediate, "bytes_per_expert": expert_nbytes,
            "dense_bytes": dense, "expert_bytes": expert_nbytes * E * num_moe_layers,
            "total_bytes": dense + expert_nbytes * E * num_moe_layers}


def memory_plan(config, adapter, dtype: torch.dtype, dense: int, num_moe_layers: int, lowbit: str | None = None,
                offload: str = "ram", device: str = "cuda", budget: str | None = None,
                lowbit_fraction: float | None = None, axis: int = 1, precision: str | None = None) -> dict:
    """Host RAM and device memory of one configuration, by part, from shapes alone (nothing read): dense weights,
    copies per tier, KV reserve, cache slots. Without --budget the cache is the minimum, one slot per layer of
    each pool. `lowbit` (e.g. q4g64) sizes the low-bit tier from the format (HQQ, `axis`, scales in `dtype`)."""
    from ..formats.ggml_copies import GgmlCopyFormat, is_ggml_copy
    from ..formats.hqq import HqqFormat, parse_lowbit

    L, E = num_moe_layers, adapter.num_experts
    full = adapter.format(dtype).nbytes
    low = (0 if not lowbit else GgmlCopyFormat(adapter.layout(), lowbit, dtype).nbytes if is_ggml_copy(lowbit)
           else HqqFormat(adapter.layout(), *parse_lowbit(lowbit), axis, dtype).nbytes)
    kv = kv_reserve_nbytes(config, dtype)
    low_only = bool(lowbit) and precision == "lowbit-only"          # no full-precision pool (`sizing.split_pools`)
    split = split_budget(budget, checkpoint_sizes(config, adapter, dtype, dense, L),
                         min_slot_bytes=low if low_only else full) if budget else None
    pooled = bool(lowbit) and precision != "full"
    f = lowbit_fraction_for(precision or "hobbit", True, lowbit_fraction) if pooled else 0.0
    pools = budget_pools(split, L, E, full, low if pooled else None, f) if budget else \
        {"full": [0 if low_only else 1] * L, **({"low": [1] * L} if pooled else {})}
    slots, low_slots = pools.get("full", [0] * L), pools.get("low", [])
    on_host = device == "cpu"
    host = host_need(offload, on_host, False, sum(slots), full, L * E, dense, kv, lowbit_nbytes=low,
                     low_slots=sum(low_slots))
    dev = 0 if on_host else dense + kv + (split.workspace if split else 0) + sum(slots) * full + sum(low_slots) * low
    return {"offload": offload, "device": device, "lowbit": lowbit, "budget": budget,
            "bytes_per_expert_full": full, "bytes_per_expert_lowbit": low, "full_copies_bytes": L * E * full,
            "lowbit_copies_bytes": L * E * low, "dense_bytes": dense, "kv_reserve_bytes": kv,
            "workspace_bytes": split.workspace if split else 0,
            "full_slots": sum(slots), "lowbit_slots": sum(low_slots),
            "host": {"dense": host.dense, "full_copies": host.experts, "lowbit_copies": host.lowbit,
                     "cache_buffers": host.cache, "kv_reserve": host.kv, "total": host.total},
            "device_total": dev}


def inspect_model(model: str, workdir: str | None = None, dtype: str | None = None, lowbit: str | None = None,
                  offload: str = "ram", device: str = "cuda", budget: str | None = None,
                  lowbit_fraction: float | None = None, precision: str | None = None) -> dict:
    """Family, layers, experts, sizes of a checkpoint, from its config and shard headers only. Experts are
    sized in their packed format (as released: MXFP4 / block FP8, else `dtype`); the memory needs are the
    GPU runtime's: host RAM with `--offload ram` (experts, pinned) and device memory for the dense weights +
    KV reserve + one expert slot per layer (the minimum), or + every expert (all resident); `memory` is the
    configuration given (--lowbit, --offload, --device, --budget) by part."""
    ref, config, adapter, ckpt, dt, hf, blocks = offloaded_skeleton(model, workdir, dtype)
    fmt = adapter.format(dt)
    expert_nbytes = fmt.nbytes
    L, E = len(blocks), adapter.num_experts
    dense, kv = dense_nbytes(hf, config), kv_reserve_nbytes(config, dt)
    from .gguf.cpu import dense_mapped

    # a GGUF in place on the CPU with ggml: its dense matrices stay in the mapped file (`dense_in_place`)
    # (not with --budget: on the CPU that sizes the slots of an emulated device, whose dense part is read as before)
    mapped = dense_mapped(adapter, hf) if device == "cpu" and offload == "ram" and budget is None else {}
    if mapped:
        skeleton_bytes, file_bytes = mapped_dense_nbytes(hf, mapped)
        dense += file_bytes - skeleton_bytes
    info = describe(config, adapter, expert_nbytes, dense, L)
    weights = sum(math.prod(s) for s in adapter.layout().shapes if len(s) == 2)      # biases are not weights
    gguf = gguf_facts(adapter, dt, mapped, hf)
    info["memory"] = memory_plan(config, adapter, dt, info["dense_bytes"], L, lowbit, offload, device,
                                 budget, lowbit_fraction, precision=precision)
    if gguf and device == "cpu" and offload == "ram" and not lowbit:    # the run loads in place: its load's peak
        info["memory"]["load_peak"] = gguf["gguf"]["cpu_in_place"]["load_peak"]
        info["memory"]["ggml_repack"] = gguf["gguf"]["cpu_in_place"]["ggml_repack"]
    return info | {"model": ref.name, "path": str(ref.path), "dtype": str(dt).replace("torch.", ""),
                   "expert_format": fmt.name, "bits_per_weight": expert_nbytes * 8 / weights,
                   "quantization": adapter.quant.describe() if adapter.quant else None,
                   "host_ram_bytes": host_need("ram", False, False, 0, expert_nbytes, L * E,
                                               header_dense_nbytes(ckpt, adapter, dt), kv).total,
                   "device_min_bytes": dense + kv + L * expert_nbytes,
                   "device_all_bytes": dense + kv + L * E * expert_nbytes, "kv_reserve_bytes": kv,
                   "moe_layer_ids": [i for i, _ in blocks],
                   "fingerprint": config_fingerprint(config)} | gguf


def offloaded_skeleton(model: str, workdir=None, dtype: str | None = None):
    """(ref, config, adapter, checkpoint, dtype, skeleton, MoE blocks) of `model`, its shards' headers checked, each
    MoE block's experts a stand-in owning no weights, as the runtime's own (so `dense_nbytes` counts what stays
    resident)."""
    ref = built(resolve_model(model, workdir))
    config, adapter = load_config(ref.path)
    ckpt = open_checkpoint(ref.path, adapter)          # validates the shards (headers only)
    dt = parse_dtype(dtype, config)
    hf, blocks = skeleton(config, adapter, dt, ref.path)
    for _, block in blocks:                             # experts are not dense
        block.experts = torch.nn.Module()
    return ref, config, adapter, ckpt, dt, hf, blocks


def mapped_names(mapped: dict | frozenset | None) -> frozenset:
    """The GGUF names of a `dense_in_place` mapping (a frozenset: those names already, the lean load's)."""
    if isinstance(mapped, frozenset):
        return mapped
    return frozenset(v[3] for v in (mapped or {}).values())


def lean_dense_nbytes(config, adapter, dtype: torch.dtype, mapped: frozenset = frozenset()) -> int:
    """`dense_nbytes` of a one-graph family's GGUF model, from the header and config alone (the lean load builds no
    model, runtime/load.py): every dense tensor in `dtype` (the `mapped` ones, GGUF names, at their bytes in the
    file: the modules `swap_in` made hold them as buffers) plus the rotary tables, the skeleton's only buffers
    (transformers 5's `inv_freq` and `original_inv_freq`, fp32, half the rotary width each). Empty `mapped`: the
    skeleton's, before any is read; the mapped set: the loaded model's. tests/test_lean_load.py checks both equal
    the full load's on each family."""
    return adapter.gguf.sizes(dtype.itemsize, mapped)["dense_bytes"] + rotary_tables_nbytes(config)


def gguf_facts(adapter, dtype: torch.dtype, mapped: dict | None = None, model=None) -> dict:
    """A GGUF model's figures for `inspect`, from its header (moectl/store/gguf/experts.py `sizes`): the layers'
    formats (`gguf-Q4_K+Q6_K,gguf-Q4_K`), bits per weight of the experts as stored (packed bytes over weights, all
    layers), and the file's figures under `gguf`, with what the CPU in place holds (`cpu_in_place`: the file's expert
    bytes, mapped, where ggml computes them; else Q4 matrices repacked for the int4 kernel, moectl/store/gguf/cpu.py).
    `ggml_repack`: of those bytes, the matrices ggml's CPU repack copies into anonymous memory on first use
    (`gguf/cpu.py: ggml_repacked_bytes`; `model` says which mapped dense weights are multiplied by). Empty for a
    safetensors checkpoint."""
    g = adapter.gguf
    if g is None:
        return {}
    from .gguf.cpu import ggml_in_place, ggml_repacked_bytes, in_place_expert_bytes

    s = g.sizes(dtype.itemsize, mapped_names(mapped))
    mapped_dense = mapped
    repacked = in_place_expert_bytes(adapter, dtype)
    mapped = ggml_in_place(adapter)         # ggml on the mapped file: the pages of the file's expert bytes
    return {"expert_format": adapter.format_names(dtype), "bits_per_weight": s["bits_per_weight"],
            "gguf": {k: s[k] for k in ("architecture", "files", "file_bytes", "encodings", "encoding_bits",
                                       "expert_bytes", "bytes_per_expert", "dense_packed_bytes", "dense_weights")}
            | {"cpu_in_place": {"kernel": "ggml" if mapped else "torch-int4" if repacked is not None else "dequantise",
                                "mapped": mapped,
                                "int4_repacked": repacked is not None, "scale_dtype": str(dtype).removeprefix("torch."),
                                "expert_bytes": repacked if repacked is not None else s["expert_bytes"],
                                "host_bytes": (repacked if repacked is not None else s["expert_bytes"])
                                + s["dense_bytes"], "load_peak": gguf_load_peak(s, repacked),
                                "ggml_repack": ggml_repacked_bytes(adapter, model, mapped_dense)}}}


# The working set of one GGUF load step beyond what it keeps (`gguf_load_peak`), in bytes per weight, measured on
# this project's build machine (RssAnon sampled every 0.5 ms): a dense tensor dequantised in fp32 through
# transformers' K-quant code holds several fp32 temporaries (Q6_K 19.5, Q4_K 14.6, Q4_0 12.1, Q8_0 8.1 bytes per
# weight beside the packed input); an expert repacked for the int4 kernel, its codes unpacked, concatenated and
# packed with their scales, 7.6 (a 6.3 M-weight Q4_0 expert: 48 MB with its scratch buffer).
DENSE_STEP_BYTES_PER_WEIGHT = 20
REPACK_STEP_BYTES_PER_WEIGHT = 8


def gguf_load_peak(s: dict, repacked: int | None) -> dict:
    """The host RAM a GGUF load into the CPU in place peaks at, by part, from the header sizes `s`
    (`GgufModel.sizes`) and the repacked experts' bytes: what it keeps -- the dense weights at the run's dtype
    (`dense_bytes`) and the experts as held (`repacked`, else as packed) -- plus the larger working set of one
    step: the largest dense tensor read packed and dequantised (`gguf/dense.py: dense_tensors`, one at a time), or
    one expert repacked (`gguf/cpu.py: repack_for_cpu`: its packed bytes read into a scratch buffer, then unpacked).
    The KV cache is not allocated while loading (the run's "host RAM needed" counts its reserve)."""
    from .gguf.files import CHUNK_WEIGHTS

    held = repacked if repacked is not None else s["expert_bytes"]
    big = s.get("largest_dense") or {"name": None, "packed_bytes": 0, "weights": 0}
    dense_step = big["packed_bytes"] + DENSE_STEP_BYTES_PER_WEIGHT * big["weights"]
    chunk_step = DENSE_STEP_BYTES_PER_WEIGHT * min(CHUNK_WEIGHTS, s.get("row_chunked_weights", 0))
    repack_step = s["bytes_per_expert"] + REPACK_STEP_BYTES_PER_WEIGHT * s["weights_per_expert"] if repacked else 0
    step, what = max((dense_step, f"dequantising {big['name']}"), (repack_step, "repacking one expert"),
                     (chunk_step, "dequantising a block of the vocabulary's rows"))
    return {"dense": s["dense_bytes"], "experts": held, "step": step, "step_what": what,
            "total": s["dense_bytes"] + held + step}

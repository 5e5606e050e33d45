"""Loading: a checkpoint into the runtime without materialising its experts.

config -> family adapter -> the setting (`moectl/setting/resolve.py`: flag > plan > artifact default > built-in; the
gating, the precision, `--prefetch auto`, the cache's pools and staging buffers) -> a host-memory check from the shard
headers (a clear error before anything is read) -> skeleton under `init_empty_weights`, each MoE block's experts
swapped for `OffloadedExperts` -> non-expert tensors read onto the device -> routed experts into the `ExpertStore`
(host RAM, or left on disk; with `--lowbit` the `moectl quantize` copies too) -> the cache: `InPlaceExperts` on a CPU
with experts in RAM (nothing copied), else `DeviceCache` slots -> the policies (`runtime/policy_objects.py`).

The lean load: a GGUF in place on the CPU whose every forward the one ggml graph serves (`lean_why_not`, decided
before the skeleton from the options; then from the resolved gating and prefetch) builds no transformers model:
no skeleton, no dense weights read, no CPU Linears. The sizes, the host-memory check and the dense bytes come from
the header (`store/facts.py: lean_dense_nbytes`, `store/gguf/dense.py: dense_in_place_names`), equal to the full
load's. The model object is built on first need (`Loaded.build_model`, called by `Engine.model`): an observer
(profile, predictors), a module-path forward, `eval`'s fidelity. A draft or a routing replay is decided at load:
those runs take the full load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.cache_model import FULL, LOW
from ..core.gc_pause import collector_paused
from ..core.recipes import resolve_model
from ..errors import MoectlError
from ..formats.ggml_copies import GgmlCopyFormat
from ..formats.gguf_ggml import GgufMappedFormat
from ..kernels.ggml import library as ggml_library
from ..kernels.ggml import set_threads as ggml_threads
from ..models import config_fingerprint
from ..models.attention_cpu import cpu_attention
from ..models.dense_cpu import check_dense_lowbit, cpu_linears
from ..models.dense_gguf import swap_in
from ..setting.options import DEFAULT, RuntimeOptions
from ..setting.resolve import note_in_place_sizes, resolve
from ..store.checkpoint import Checkpoint
from ..store.expert_store import ExpertStore
from ..store.facts import (
    built,
    checkpoint_sizes,
    dense_nbytes,
    header_dense_nbytes,
    kv_reserve_nbytes,
    lean_dense_nbytes,
    load_config,
    mapped_names,
    open_checkpoint,
    parse_dtype,
    pick_device,
    skeleton,
)
from ..store.gguf.experts import dense_in_place_names
from ..store.gguf.saved_config import save_config
from ..store.gguf.cpu import (
    dense_mapped,
    ggml_in_place,
    in_place_expert_bytes,
    int4_repackable,
    map_for_ggml,
    repack_for_cpu,
)
from ..store.memory import check_host_memory, host_alloc, host_need, host_options, release_freed
from .cache import InPlaceExperts
from .device_cache import DeviceCache
from .ggml_model import GgmlModel, gguf_tensors_missing
from .ggml_model import why_not as graph_why_not
from .graph_engine import LEAN_FAMILIES, mapped_count, mapped_dense_note
from .offloaded import OffloadedExperts, Runtime
from .policy_objects import admission_gate, build_policies, placement
from .worker import CpuWorker


@dataclass
class Loaded:
    """What `Engine` is made of."""
    model: object
    config: object
    adapter: object
    ckpt: Checkpoint
    store: ExpertStore
    cache: object
    device: torch.device
    dtype: torch.dtype
    ref: object
    runtime: Runtime                # the layers' shared state: gating, prefetch, placement, the CPU worker
    opts: RuntimeOptions
    threads: int
    graph: object = None            # a GGUF in place: its whole forward as one ggml graph (ggml_model.py), or None
    build_model: object = None      # the lean load (model None): builds the model on first need, returns it
    dense_bytes: int | None = None  # the lean load: `dense_nbytes` of the model it did not build (from the header)


def load(model: str, opts: RuntimeOptions) -> Loaded:
    with collector_paused():                            # the heap this builds, traversed once (core/gc_pause.py)
        return _load(model, opts)


def _load(model: str, opts: RuntimeOptions) -> Loaded:
    take_device(opts)                                   # checks the options too
    ref = built(resolve_model(model, opts.workdir))
    dev = torch.device(opts.device)
    config, adapter = load_config(ref.path)
    if adapter.gguf is not None:                        # for the next run's torch-free engine (graph_engine.py)
        save_config(ref.workdir, adapter.gguf.files.paths, config)
    ckpt = open_checkpoint(ref.path, adapter)
    dt = parse_dtype(opts.dtype, config)
    check_dense_lowbit(opts.dense_lowbit, dev, dt)
    in_place = dev.type == "cpu" and opts.offload == "ram" and not opts.emulate_device
    from .machine import set_threads

    n_threads = set_threads(opts.threads, config.hidden_size, adapter.expert_intermediate, dev.type == "cuda")
    ggml_threads(n_threads)
    runtime = Runtime(adapter, None, opts.gate_prefill)
    lean = in_place and lean_why_not(config, adapter, opts) is None
    if lean:                                            # no model: the one graph serves every forward
        hf, layer_ids, dense = None, list(range(config.num_hidden_layers)), lean_dense_nbytes(config, adapter, dt)
    else:
        hf, layer_ids = model_skeleton(config, adapter, dt, ref.path, runtime)
        dense = dense_nbytes(hf, config)
    L, E, fingerprint = len(layer_ids), adapter.num_experts, config_fingerprint(config)
    low_fmt = None
    if opts.lowbit:                                     # --lowbit names the copies; a plan never loads them unasked
        from ..store.lowbit import lowbit_format, read_lowbit_meta

        meta, path = read_lowbit_meta(ref.workdir, opts.lowbit, fingerprint, L, E)
        low_fmt = lowbit_format(meta, adapter, dt, path)
    sizes = checkpoint_sizes(config, adapter, dt, dense, L, path=ref.path)
    setting = resolve(opts, sizes, ref.workdir, in_place=in_place,
                      low_nbytes=low_fmt.nbytes if low_fmt is not None else None,
                      device_memory=torch.cuda.mem_get_info(dev) if dev.type == "cuda" else None)
    if lean and graph_why_not(config, opts, setting.gating, setting.prefetch) is not None:
        lean = False                                    # a plan's or the workdir's gating or prefetch: the modules
        hf, layer_ids = model_skeleton(config, adapter, dt, ref.path, runtime)
    if in_place:                                        # said, not silently ignored: nothing is cached in place
        note_in_place_sizes(opts)
    prec = setting.precision
    runtime.gating = setting.gating
    # In place at --precision lowbit-only nothing computes from the full-precision experts: they stay in the file
    # (the store's disk tier, read only if asked), so RAM holds the low-bit copies and dense weights, as llama.cpp's
    full_tier = "disk" if in_place and prec.name == "lowbit-only" else opts.offload
    full, low = setting.pools.get(FULL, [0] * L), setting.pools.get(LOW)
    # A GGUF in place with ggml: its dense matrices and embedding are computed where they lie in the mapped file, as
    # llama.cpp's (models/dense_gguf.py); --dense-lowbit asks for moectl's own low-bit copies instead. The lean
    # load: their GGUF names, from the header (the same set)
    if lean:
        mapped_dense = dense_in_place_names(adapter.gguf.files)
    else:
        mapped_dense = dense_mapped(adapter, hf) if (in_place and not opts.dense_lowbit
                                                     and ggml_library() is not None) else {}
    check_host(opts, config, adapter, ckpt, dev, dt, L, in_place, full, low, low_fmt, full_tier, mapped_dense)
    if not lean:   # experts in ggml's blocks (the file's, moectl's ggml copies): --dense-lowbit's are ggml's too
        fill_model(hf, config, adapter, ckpt, dev, dt, ref.path, opts, mapped_dense,
                   ggml_first=isinstance(low_fmt, GgmlCopyFormat) or (in_place and ggml_in_place(adapter)))
    if mapped_dense:
        count = mapped_count(mapped_dense, config, adapter.gguf.files) if lean else len(mapped_dense)
        note = mapped_dense_note(mapped_names(mapped_dense), count)
        opts.plan_note = "; ".join(filter(None, [opts.plan_note, note]))
    if opts.predictor is not None and not Path(opts.predictor).expanduser().exists():
        raise MoectlError(f"--predictor {opts.predictor} does not exist (a directory with predictors.json from "
                          "`moectl train-predictor`)")
    policy, prefetch = build_policies(setting.replacement, setting.prefetch, hf, adapter, opts.predictor or ref.workdir,
                                      fingerprint, L)
    # A GGUF in place: its experts computed by ggml where they lie in the mapped file (nothing read at load), else
    # its Q4 experts read and repacked for torch's int4 kernel
    mapped = in_place and full_tier == "ram" and ggml_in_place(adapter)
    repack = in_place and full_tier == "ram" and int4_repackable(adapter)
    store = ExpertStore(ckpt, adapter, layer_ids, dt, offload="disk" if mapped or repack else full_tier,
                        pin=(dev.type == "cuda"), progress=opts.progress)
    note = map_for_ggml(store) if mapped else None
    if mapped:                          # the file into the page cache in the background (first tokens touch it all)
        adapter.gguf.files.will_need()
    if note is None and (mapped or repack):
        if mapped and not repack:                   # ggml failed to load: the packed bytes read into RAM instead
            store = ExpertStore(ckpt, adapter, layer_ids, dt, offload=full_tier, pin=False,
                                progress=opts.progress)
        else:
            note = repack_for_cpu(store, dt, opts.progress)
        if mapped:
            from ..kernels.ggml import why_not

            note = "; ".join(filter(None, [f"gguf: ggml not used ({why_not()})", note]))
    if note:
        opts.plan_note = "; ".join(filter(None, [opts.plan_note, note]))
    if low_fmt is not None:
        from ..formats.int4_cpu import int4pack_layout
        from ..store.lowbit import LowbitCopies

        # On a GPU, misses the CPU may compute (--cpu-experts auto|always) keep the int4 CPU kernel's layout too,
        # when this torch's packing is one the device can dequantise (formats/int4_cpu.py)
        kernel = dev.type == "cpu" or (setting.cpu_experts != "never" and int4pack_layout() is not None)
        store.lowbit = LowbitCopies(ref.workdir, opts.lowbit, fingerprint, adapter, L, dt, pin=(dev.type == "cuda"),
                                    progress=opts.progress, cpu_kernel=kernel)
    if dev.type == "cuda":
        device_expert_kernels(store, adapter, dev)
    experts_ggml = (store.formats is not None and all(isinstance(f, GgufMappedFormat) for f in store.formats)) or (
        in_place and prec.name == "lowbit-only" and isinstance(low_fmt, GgmlCopyFormat) and ggml_library() is not None)
    if experts_ggml and n_threads > 1 and not (_header_torch_matrices(adapter, mapped_dense) if lean
                                               else _torch_matrices(hf)):
        # Every large matrix is ggml's (its own threadpool, --threads wide); torch keeps norms, rotary, attention. torch's
        # OpenMP workers spin after each of its ops (libgomp's default wait policy), so beside ggml's workers on the
        # same cores they starve them: 2 threads under load took 437-504 ms/token against 133-247 with
        # OMP_WAIT_POLICY=PASSIVE (qwen3-moe 2-layer Q4_K_M). One torch thread has no workers to spin.
        torch.set_num_threads(1)
    cache = InPlaceExperts(store, policy, prec) if in_place else \
        DeviceCache(store, full, dev, policy, low_slots=low, precision=prec, stream_prefill=opts.prefill == "stream",
                    staging=setting.staging if prefetch is not None else 0)
    runtime.cache, runtime.cpu, runtime.prefetch = cache, CpuWorker(adapter, store), prefetch
    if setting.plan is not None and not in_place:      # the plan's hot set, copied now (load time, not per token)
        from ..artifacts.plan import plan_preload

        cache.preload(plan_preload(setting.plan, L, E))
    runtime.placement = placement(setting.cpu_experts, opts.cost, config, dev, in_place)
    runtime.prefetch_gate, runtime.copy_s = admission_gate(setting.admission, opts.cost, config, dev, adapter.top_k,
                                                           store.nbytes(cache.pf_precision), in_place, prefetch,
                                                           setting.cpu_experts, staged=cache.state.staging > 0)
    if opts.replay_trace is not None:
        from .replay import RoutingReplay

        # a make-synthetic checkpoint cut to its recipe's first layers replays the recipe's deeper trace
        runtime.replay = RoutingReplay(opts.replay_trace, L, E, adapter.top_k,
                                       prefix=bool(getattr(config, "moectl_synthetic", None)))
    graph = one_graph(hf, config, adapter, cache, opts, runtime, prefetch, mapped_dense, experts_ggml, lean) \
        if in_place else None
    if lean and graph is None:      # not expected (lean_why_not asks what one_graph does): the modules, now
        hf = lazy_model(config, adapter, ckpt, dev, dt, ref.path, opts, runtime)()
        lean = False
    if not lean:
        return Loaded(hf, config, adapter, ckpt, store, cache, dev, dt, ref, runtime, opts, n_threads, graph)
    return Loaded(None, config, adapter, ckpt, store, cache, dev, dt, ref, runtime, opts, n_threads, graph,
                  build_model=lazy_model(config, adapter, ckpt, dev, dt, ref.path, opts, runtime),
                  dense_bytes=lean_dense_nbytes(config, adapter, dt, mapped_dense))


def one_graph(hf, config, adapter, cache, opts: RuntimeOptions, runtime: Runtime, prefetch, mapped_dense,
              experts_ggml: bool, lean: bool = False):
    """The run's whole forward as one ggml graph (ggml_model.py), or None with the reason in the load's note: a
    GGUF in place (its tensors where they lie) or a checkpoint whose experts are ggml copies computed in place."""
    if not experts_ggml or (adapter.gguf is not None and not mapped_dense):
        return None                                  # not ggml's run: nothing to say
    why = graph_why_not(config, opts, runtime.gating, prefetch)
    if why is None and adapter.gguf is not None:
        why = gguf_tensors_missing(adapter.gguf.files, config.num_hidden_layers, config.model_type)
        graph = GgmlModel.from_gguf(adapter.gguf, config) if why is None else None
    elif why is None:
        graph = GgmlModel.from_modules(hf, config, cache)
        why, graph = (graph, None) if isinstance(graph, str) else (None, graph)
    what = "gguf" if adapter.gguf is not None else "ggml"
    note = f"{what}: one ggml graph a forward, as llama.cpp's" if why is None else f"{what}: module path ({why})"
    if why is None and lean:
        note += " (lean load: transformers' model built only if a module-path forward needs it)"
    opts.plan_note = "; ".join(filter(None, [opts.plan_note, note]))
    return graph if why is None else None


def lean_why_not(config, adapter, opts: RuntimeOptions) -> str | None:
    """Why this in-place CPU run cannot take the lean load (None: it can, unless the resolved gating or prefetch
    needs the modules; `_load` asks that after resolving): the one graph must serve every forward it runs, from
    the options alone, before anything is built."""
    if adapter.gguf is None:
        return "not a GGUF"
    if opts.dense_lowbit or opts.lowbit:
        return "low-bit copies (--dense-lowbit, --lowbit) are the modules'"
    why = graph_why_not(config, opts)               # the family, MOECTL_GGML_GRAPH, --draft, --replay-trace, ggml
    if why is None and not ggml_in_place(adapter):
        why = "ggml is not planned"
    if why is None and not dense_in_place_names(adapter.gguf.files):
        why = "no dense matrix computed where it lies"  # one_graph takes a GGUF's graph only with them mapped
    if why is None and config.model_type not in LEAN_FAMILIES:
        why = f"no lean load for the {config.model_type} family yet"
    return why or gguf_tensors_missing(adapter.gguf.files, config.num_hidden_layers, config.model_type)


def model_skeleton(config, adapter, dt: torch.dtype, path, runtime: Runtime) -> tuple[object, list[int]]:
    """(transformers' model on meta, its MoE layers' ids): each MoE block's experts swapped for `OffloadedExperts`
    sharing `runtime`."""
    hf, blocks = skeleton(config, adapter, dt, path)
    for moe_idx, (layer_idx, block) in enumerate(blocks):
        block.experts = OffloadedExperts(moe_idx, layer_idx, runtime, block.experts._apply_gate, adapter.num_experts)
    return hf, [i for i, _ in blocks]


def fill_model(hf, config, adapter, ckpt: Checkpoint, dev, dt, path, opts: RuntimeOptions, mapped_dense,
               ggml_first: bool = False) -> None:
    """The skeleton's dense weights read (or mapped), then on a CPU its Linears and attention made moectl's
    (`ggml_first`: --dense-lowbit's in ggml's blocks, `models/dense_cpu.py: cpu_linears`)."""
    read_dense(hf, config, adapter, ckpt, dev, dt, path, opts.progress, mapped_dense)
    if dev.type == "cpu":          # the dense Linears: one-row GEMV, or low-bit: --dense-lowbit (models/dense_cpu.py)
        if cpu_linears(hf, opts.dense_lowbit, ggml_first)["bytes_before"]:
            release_freed()        # the bf16 matrices the low-bit ones replaced leave the RSS
        cpu_attention(hf)          # a decode token's attention through moectl's kernel (models/attention_cpu.py)


def lazy_model(config, adapter, ckpt, dev, dt, path, opts: RuntimeOptions, runtime: Runtime):
    """The lean load's model, built when first needed: what the full load builds (skeleton, dense weights mapped
    where they lie, CPU Linears and attention), with the runtime, cache and store the load made."""
    def build():
        with collector_paused(), torch.inference_mode(False):     # a forward's inference mode: not the weights'
            hf, _ = model_skeleton(config, adapter, dt, path, runtime)
            fill_model(hf, config, adapter, ckpt, dev, dt, path, opts, dense_mapped(adapter, hf))
        return hf

    return build


def _header_torch_matrices(adapter, mapped: frozenset) -> list[str]:
    """The lean load's `_torch_matrices`, from the header: its unmapped matrices (the routers) of a million weights
    or more."""
    files = adapter.gguf.files
    return [n for n, t in files.tensors.items() if "ffn_gate_inp" in n and n not in mapped and len(t.shape) == 2
            and t.shape[0] * t.shape[1] >= 1 << 20]


def _torch_matrices(model) -> list[str]:
    """The model's nn.Linear of a million weights or more (torch computes them; routers are smaller)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= 1 << 20]


def device_expert_kernels(store: ExpertStore, adapter, dev: torch.device) -> bool:
    """On CUDA, low-bit experts in device slots (moectl's q4 / q8 copies, a GGUF's blocks) are computed by moectl's
    Triton kernels (kernels/triton_lowbit.py) where triton imports and the GPU is one it supports, and where the
    family's expert forward takes callables; else dequantised by torch as before. Said once (stderr). Lossless
    (dense) experts are untouched."""
    from ..kernels.triton_lowbit import device_kernels

    if not adapter.linear_callables or not device_kernels(dev):
        return False
    formats = [store.lowbit.format] if store.lowbit is not None else []
    formats += store.formats if store.formats is not None else [store.format]
    for fmt in formats:
        if hasattr(fmt, "device_kernels"):
            fmt.device_kernels = True
    return True


def take_device(opts: RuntimeOptions) -> None:
    """--device auto | cpu | cuda | cuda:N as the device the run takes (`store/facts.py: pick_device`), its status
    line in `opts.device_note`; the options' own checks first (`RuntimeOptions.check`: --emulate-device with cuda is
    that error, not the device's), all before anything is read. auto with --emulate-device is the CPU it emulates on."""
    auto = opts.device in (None, "auto")
    if auto and opts.emulate_device:
        opts.device = "cpu"
    opts.check()
    opts.device, opts.device_note = pick_device(opts.device)
    if auto:
        opts.sources["device"] = DEFAULT
        if opts.emulate_device:
            opts.device_note = "device: cpu (--device auto with --emulate-device: the CPU acts as the device)"


def check_host(opts: RuntimeOptions, config, adapter, ckpt, dev, dt, L: int, in_place: bool, full: list[int],
               low: list[int] | None, low_fmt, full_tier: str, mapped_dense: dict | None = None) -> None:
    """The host-memory check of the resolved cache (`store/memory.py`): a configuration the host RAM cannot hold fails
    before any weight is read, naming the options that fit. `full_tier`: where the full-precision experts live (ram,
    or disk: read from the file when needed)."""
    E, expert_nbytes = adapter.num_experts, adapter.format(dt).nbytes
    kv = kv_reserve_nbytes(config, dt)
    dense = header_dense_nbytes(ckpt, adapter, dt, mapped_dense)    # what is read (or mapped) into host RAM
    on_host = dev.type == "cpu"
    held = in_place_expert_bytes(adapter, dt) if in_place else None      # a GGUF's experts repacked in place
    need = host_need(full_tier, on_host, in_place, sum(full), -(-held // (L * E)) if held else expert_nbytes, L * E,
                     dense, kv,
                     lowbit_nbytes=low_fmt.nbytes if low_fmt is not None else 0, low_slots=sum(low or []))

    def fits(free: int) -> list[str]:
        return host_options(free, opts.offload, on_host, in_place, sum(full), expert_nbytes, L, E, dense, kv)

    what = (f"--offload {opts.offload} on {dev.type}" + (" (experts in place)" if in_place else
                                                         f" with {sum(full)} expert slots"))
    check_host_memory(need, what, fits)


def read_dense(hf, config, adapter, ckpt: Checkpoint, dev: torch.device, dt: torch.dtype, path,
               progress: bool = False, mapped: dict | None = None) -> None:
    """Non-expert weights straight from the shards onto the device, one tensor at a time, under a progress bar (a
    GGUF's are dequantised: a 150k-token embedding takes seconds). Each tensor takes the dtype the skeleton gives it
    (a few, like DeepSeek-V3's routing bias, stay fp32). `mapped` (a GGUF's `dense_in_place`): weights not read,
    their modules swapped for ones that compute where the weights lie (models/dense_gguf.py)."""
    from ..progress import ProgressBar

    want = {k: v.dtype for k, v in hf.state_dict().items()}
    state = {}
    n_params = sum(1 for name, _ in hf.named_parameters() if name not in (mapped or ()))
    with ProgressBar(progress, transient=True) as bar:
        task = bar.add("reading dense weights" + (" (dequantising)" if adapter.gguf is not None else ""), n_params)
        for name, t in dense_tensors(hf, adapter, ckpt, lambda name: want.get(name, dt), skip=set(mapped or ())):
            state[name] = t.to(device=dev, dtype=want.get(name, dt) if t.is_floating_point() else t.dtype)
            bar.update(task, completed=min(len(state), n_params))
    release_freed()                                     # the dequantisation's freed temporaries leave the RSS
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    swapped = set(swap_in(hf, mapped, dt)) if mapped else set()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied and k not in swapped]
    if missing:
        raise MoectlError(f"checkpoint {path} lacks {len(missing)} weights the {adapter.family} model needs, "
                          f"e.g. {missing[:3]} (incomplete download?)")
    if tied and not swapped & tied:
        hf.tie_weights()
    hf.to(dev).eval()
    for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
        if t.is_meta:
            raise MoectlError(f"weight {name} was not found in {path}")


def dense_tensors(hf, adapter, ckpt: Checkpoint, dtype_of, skip=()):
    """(skeleton name, tensor) of every non-expert weight, one at a time: read from the shards, or a GGUF's
    dequantised once into `dtype_of(name)` (moectl/store/gguf/dense.py), but those in `skip` (a GGUF's only)."""
    gguf = adapter.gguf
    if gguf is not None:
        yield from gguf.dense_tensors(hf, dtype_of, skip)
        return
    for key in ckpt.keys():
        name = adapter.skeleton_key(key)
        if name is not None:
            yield name, host_alloc(lambda: adapter.read_dense(ckpt, key), "reading dense weights",
                                   ckpt.range(key).nbytes)

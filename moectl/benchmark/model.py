"""`moectl bench --model M`: the runtime on one model against the baselines, in one run, with the simulator's
prediction beside it.

Legend: L = MoE layers, E = experts per layer, K = top-k, N = trace rows (tokens).

Every configuration runs the same request `repeat` times on one engine (the cache stays warm between them;
times are the median request's, cache figures count every decode step): `prompt_len` seeded random token ids (one prefill forward), then
`gen_len` greedy decode steps; with `replay_trace` the trace's routing replaces the router's in every moectl
configuration. Per configuration: TTFT (prefill + first token), prefill tokens/s, decode ms/token, and for the
cached ones decode hit rate, bytes loaded per token, stall (load wait) ms per token, CPU-computed experts per
token and prefetch-predictor ms per token.

Configurations (those that fit the machine; each is loaded, run and freed in turn):
  moectl        the cache asked for (--budget / --cache-experts; default half the experts) with the given
                replacement / prefetch / --cpu-experts
  moectl-plan   the workdir's plan.yaml slots per layer (when there is one)
  all-resident  every expert in device memory: the upper bound (on a CPU: computed in place)
  transformers  plain transformers on the CPU, or transformers + accelerate device_map offload on a GPU
                (the model's own routing: it cannot replay a trace)
  on-demand     no cache: one slot per layer, every miss loaded when needed, no prefetch
  lru           the same cache size with LRU and no prefetch (mixtral-offloading's policy)
On a CPU the cached configurations run with `emulate_device` (the CPU acts as a device with slots and copies),
otherwise every expert would be resident and they would all be the all-resident run.

Prediction: the moectl run's own routing (recorded, with hidden states for prefetchers that read them) is
simulated (`moectl.sim.simulate.simulate`) with the run's slots and policies and this machine's measured figures
(`moectl/runtime/machine.py`), the simulator's per-layer overhead calibrated on the all-resident run (the simulator
knows bandwidths, not Python's dispatch cost); `measured_over_predicted` compares decode ms/token.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from ..errors import MoectlError

BASELINES = ("all-resident", "transformers", "on-demand", "lru", "moectl-plan")
# The runtime's timers (driver.Runtime, runtime/worker.py), reported per decode token: the layers' expert stages
# (wall, both sides overlapped), this thread's side of them (fetch + device experts), the CPU worker's experts and
# how long a layer waited for it. Decode time minus the expert stage is everything else (attention, norms, Python).
_STAGES = ("expert_stage_s", "device_side_s", "cpu_side_s", "cpu_wait_s")


def _prompt(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, max(4, vocab), (1, n), generator=torch.Generator().manual_seed(seed))


def _run_steps(step_fn, ids: torch.Tensor, gen_len: int, on_prefill=None) -> dict:
    """Prefill + `gen_len` greedy decode steps through `step_fn(step, pkv) -> (logits, pkv)`; times each."""
    t0 = time.perf_counter()
    logits, pkv = step_fn(ids, None)
    t_prefill = time.perf_counter() - t0
    nxt = logits[:, -1:].argmax(-1)
    ttft = time.perf_counter() - t0
    if on_prefill is not None:
        on_prefill()
    t1 = time.perf_counter()
    tokens = [int(nxt)]
    for _ in range(gen_len - 1):
        logits, pkv = step_fn(nxt.to(ids.device), pkv)
        nxt = logits[:, -1:].argmax(-1)
        tokens.append(int(nxt))
    decode = time.perf_counter() - t1
    steps = max(gen_len - 1, 1)
    return {"ttft_ms": ttft * 1e3, "prefill_ms": t_prefill * 1e3,
            "prefill_tokens_per_s": ids.shape[-1] / t_prefill if t_prefill > 0 else 0.0,
            "decode_ms_per_token": decode * 1e3 / steps, "decode_steps": steps, "tokens": tokens}


def run_engine(eng, ids: torch.Tensor, gen_len: int, record: bool = False, repeat: int = 1) -> tuple[dict, object]:
    """`repeat` requests (the same prompt) on a loaded engine, one after another on the same cache: the median
    request's times, the cache figures over all decode steps, and (record=True) the routing as one Trace."""
    from ..calib.profile import TraceRecorder

    rt, cache = eng.runtime, eng.cache
    times, traces = [], []
    tot = {"hits": 0, "misses": 0, "bytes": 0, "wait": 0.0, "cpu": 0, "pred": 0.0, "steps": 0}
    split = dict.fromkeys(_STAGES, 0.0)                # where a decode token's time went (seconds, all requests)
    for r in range(repeat):
        rec = None
        if record:
            rec = TraceRecorder(len(eng.moe_layer_ids), eng.adapter.top_k)
            rec.start_request(set(range(ids.shape[-1] + gen_len)))     # hidden states of every row
            eng.add_observer(rec)
        eng.begin_request(f"bench-{r}")
        marks = {}

        def mark():
            marks.update(stats=cache.snapshot(), cpu=rt.cpu_experts, pred=rt.predictor_s,
                         stages={k: getattr(rt, k) for k in _STAGES})
        out = _run_steps(eng.forward, ids, gen_len, on_prefill=mark)
        after, before = cache.snapshot(), marks["stats"]
        tot["hits"] += after["decode"]["hits"] - before["decode"]["hits"]
        tot["misses"] += after["decode"]["misses"] - before["decode"]["misses"]
        tot["bytes"] += after["bytes_loaded"] - before["bytes_loaded"]
        tot["wait"] += after["load_wait_s"] - before["load_wait_s"]
        tot["cpu"] += rt.cpu_experts - marks["cpu"]
        tot["pred"] += rt.predictor_s - marks["pred"]
        tot["steps"] += out["decode_steps"]
        for k in _STAGES:
            split[k] += getattr(rt, k) - marks["stages"][k]
        times.append(out)
        if rec is not None:
            eng.remove_observer(rec)
            traces.append(_trace_of(eng, rec.finish_request(), ids.shape[-1], f"bench-{r}"))
    out = sorted(times, key=lambda o: o["decode_ms_per_token"])[len(times) // 2]     # the median request
    # each request in turn: the first pays one-time costs the median hides (a GPU's lazily loaded kernels, plans
    # built per new shape), which a user's first request pays too
    each = {"decode_ms_per_token_each": [o["decode_ms_per_token"] for o in times],
            "prefill_ms_each": [o["prefill_ms"] for o in times]}
    steps, n = tot["steps"], tot["hits"] + tot["misses"]
    out = dict(out) | {
        "repeat": repeat, "hit_rate": tot["hits"] / n if n else 1.0, "decode_misses": tot["misses"],
        "bytes_per_token": tot["bytes"] / steps, "stall_ms_per_token": tot["wait"] * 1e3 / steps,
        "cpu_experts_per_token": tot["cpu"] / steps, "predictor_ms_per_token": tot["pred"] * 1e3 / steps,
        **{f"{k[:-2]}_ms_per_token": v * 1e3 / steps for k, v in split.items()},
        "prefill_misses": cache.snapshot()["prefill"]["misses"], "slots_per_layer": list(cache.slots_per_layer),
        "pools": _pools(cache)} | each
    trace = None
    if traces:
        from ..sim.simulate import concat

        trace = concat(traces)
    return out, trace


def _trace_of(eng, req, prompt_len: int, name: str):
    """The recorded request as an in-memory Trace (rows, phases, hidden states, routers) for the simulator."""
    from ..calib.profile import router_weights
    from ..core.trace import DECODE, PREFILL, HiddenSamples, Trace

    ex = np.concatenate(req.experts)                                        # [N, L, K]
    N = ex.shape[0]
    phase = np.array([PREFILL] * prompt_len + [DECODE] * (N - prompt_len), dtype=np.uint8)
    hidden = None
    if req.hidden_rows:
        hidden = HiddenSamples(np.array(req.hidden_rows, dtype=np.int64),
                               np.stack(req.moe_inputs).astype(np.float16), np.stack(req.prev_final).astype(np.float16))
    routers, bias = ({l: t.detach().float().cpu().numpy() for l, t in d.items()} for d in router_weights(eng))
    return Trace(eng.ref.name, ex.shape[1], eng.adapter.num_experts, ex.shape[2], [name] * N,
                 np.arange(N, dtype=np.int32), phase, ex, np.concatenate(req.weights), eng.fingerprint,
                 list(eng.moe_layer_ids), hidden, routers, bias or None)


def _transformers_run(path, dtype, device: str, budget: int | None, ids, gen_len: int, repeat: int) -> dict:
    """Plain transformers (CPU) or transformers + accelerate device_map offload (GPU), same request."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    from ..models.kv_cache import cache_kwargs, output_cache

    hf_logging.disable_progress_bar()
    kw = {"dtype": dtype}
    if device != "cpu":
        kw |= {"device_map": "auto", "max_memory": {0: int(budget) if budget else "90%", "cpu": "1000GiB"}}
    model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    dev = next(model.parameters()).device

    def step(x, pkv):
        with torch.inference_mode():
            out = model(input_ids=x.to(dev), **cache_kwargs(model, pkv or DynamicCache(config=model.config)),
                        use_cache=True)
        return out.logits, output_cache(out)
    try:
        runs = sorted((_run_steps(step, ids, gen_len) for _ in range(repeat)), key=lambda o: o["decode_ms_per_token"])
        return runs[len(runs) // 2] | {"repeat": repeat}
    finally:
        del model
        gc.collect()


def _pools(cache) -> dict[str, list[int]] | None:
    """{precision: slots per layer} of a cache with slots (None in place): what the simulator replays the run at."""
    state = getattr(cache, "state", None)
    if state is None or not hasattr(cache, "slots_per_layer"):
        return None
    return {p: [layer[p].capacity for layer in state.pools] for p in state.pools[0]}


def _predict(trace, caps, replacement: str, prefetch_name: str, figs: dict, shape: dict, overhead_ms: float,
             predictors=None, admission: str = "off", run: dict | None = None):
    """The simulator on the run's own routing (`trace`), this machine's figures; `run` (a bench row) gives the
    miss settings the runtime resolved: --cpu-experts, and --precision with --lowbit."""
    from ..policies.precision import make_precision
    from ..runtime.machine import machine_hardware
    from ..sim.cost import CostModel
    from ..sim.simulate import simulate

    run = run or {}
    lowbit = run.get("lowbit")
    precision = make_precision(run["precision"], run.get("t1", 0.6), run.get("t2", 0.9)) if lowbit else None

    cost = CostModel(machine_hardware(figs, layer_overhead_ms=overhead_ms), shape)
    mlp = getattr(predictors, "mlp", None)
    aux = getattr(predictors, "aux_gate", None)
    routing = getattr(predictors, "routing", None)
    r = simulate(trace, caps, replacement, prefetch_name, cost, predictor=routing if prefetch_name == "routing" else mlp,
                 belady=False, aux_gate=aux, admission=admission, precision=precision, lowbit=lowbit,
                 cpu_experts=run.get("cpu_experts") or "never")
    return {"decode_ms_per_token": r.ms_per_token, "prefill_ms": r.prefill_ms, "hit_rate": r.hit_rate,
            "stall_ms_per_token": r.stall_ms_per_token, "bytes_per_token": r.bytes_per_token}


def bench_model(model: str, workdir: str | None = None, device: str = "cpu", budget: str | None = None,
                cache_experts: int | None = None, prompt_len: int = 64, gen_len: int = 32,
                replay_trace: str | None = None, threads: int | None = None, replacement: str = "lru",
                prefetch: str = "auto", cpu_experts: str | None = None, dtype: str | None = None,
                baselines: tuple[str, ...] = BASELINES, repeat: int = 3, prefill: str = "cache",
                progress: bool = True, admission: str = "off", lowbit: str | None = None,
                precision: str | None = None, t1: float = 0.6, t2: float = 0.9, gating: str | None = None,
                gating_threshold: float | None = None, gate_prefill: bool = False,
                runtime_kw: dict | None = None, draft: str | None = None, draft_tokens: int = 4,
                draft_rule: str = "auto") -> dict:
    """`lowbit`/`precision`/`t1`/`t2`, the gating options and `runtime_kw` (more `Engine.load` options: offload,
    staging, predictor, lowbit_fraction) apply to the moectl rows (the baselines stay lossless and full precision);
    the prediction models the precision and --cpu-experts, not gating. `draft`: also the moectl configuration with
    speculative decoding (`benchmark/draft.py`), row "moectl+draft"."""
    from ..artifacts.plan import load_plan, plan_slots
    from ..core.shapes import shape_from_hf_config
    from ..progress import ProgressBar
    from ..runtime.engine import Engine
    from ..runtime.machine import machine_figures

    if prompt_len < 1 or gen_len < 2:
        raise MoectlError("--prompt-len must be >= 1 and --gen-len >= 2 (decode is timed after the first token)")
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise MoectlError(f"--baselines: unknown {sorted(unknown)}; choose from {', '.join(BASELINES)}")
    emulate = device == "cpu"
    common = dict(device=device, workdir=workdir, dtype=dtype, threads=threads, progress=False, gating="none")
    # the model's facts from its config and shard headers (nothing loaded yet)
    from ..core.recipes import resolve_model
    from ..store.facts import inspect_model, load_config, parse_dtype

    info = inspect_model(model, workdir, dtype)
    ref = resolve_model(model, workdir)
    config, _ = load_config(ref.path)
    L, E, K, fp = info["moe_layers"], info["experts"], info["top_k"], info["fingerprint"]
    dt, expert_nbytes = parse_dtype(info["dtype"], config), info["bytes_per_expert"]
    ids = _prompt(config.vocab_size, prompt_len)
    skipped = {}
    if ref.gguf and "transformers" in baselines:      # its GGUF loader drops a Mixtral's experts (docs/gguf.md)
        baselines = tuple(b for b in baselines if b != "transformers")
        skipped["transformers"] = ("skipped: transformers' GGUF loader does not load these experts (Mixtral as "
                                   "Llama, no experts); compare with llama.cpp on the same file (bench/vs_llamacpp.py)")
    size = {"budget": budget} if budget is not None else {"cache_experts": cache_experts or max(L, L * E // 2)}
    plan = None
    if "moectl-plan" in baselines and (ref.workdir / "plan.yaml").is_file():
        plan = load_plan(ref.workdir / "plan.yaml")
        if plan.get("fingerprint") and plan["fingerprint"] != fp:
            raise MoectlError(f"{ref.workdir / 'plan.yaml'} was made for model {plan['fingerprint']}, not {fp}")
    cached = dict(common, emulate_device=emulate, replay_trace=replay_trace)
    ours = dict(cached, lowbit=lowbit, precision=precision, t1=t1, t2=t2, gate_prefill=gate_prefill, **(runtime_kw or {}))
    if gating is not None or gating_threshold is not None:
        ours |= dict(gating=gating, gating_threshold=gating_threshold)
    configs = [("moectl", dict(ours, **size, replacement=replacement, prefetch=prefetch, cpu_experts=cpu_experts,
                                  prefill=prefill, admission=admission))]
    if plan is not None:
        pol = plan.get("policies") or {}                       # what plan-cache measured the plan with
        configs.append(("moectl-plan", dict(ours, slots_per_layer=plan_slots(plan, plan.get("_path")),
                                             replacement=pol.get("replacement") or replacement,
                                             prefetch=pol.get("prefetch") or prefetch,
                                             cpu_experts=cpu_experts or pol.get("cpu_experts"),
                                             prefill=prefill, admission=admission)))
    if "all-resident" in baselines:
        configs.append(("all-resident", dict(common, replay_trace=replay_trace, prefetch="none")
                        if device == "cpu" else dict(cached, prefetch="none")))
    if "on-demand" in baselines:
        configs.append(("on-demand", dict(cached, cache_experts=L, replacement="lru", prefetch="none")))
    if "lru" in baselines:
        configs.append(("lru", dict(cached, **size, replacement="lru", prefetch="none")))
    runs, notes, traces = {}, dict(skipped), {}
    with ProgressBar(progress, transient=True) as bar:
        task = bar.add(f"bench {ref.name}", total=len(configs) + ("transformers" in baselines) + bool(draft))
        for name, kw in configs:
            eng = Engine.load(model, **kw)
            out, tr = run_engine(eng, ids, gen_len, record=name in ("moectl", "moectl-plan", "all-resident"),
                                 repeat=repeat)
            o = eng.options                                   # the settings the runtime resolved
            out |= {"replacement": getattr(eng.cache.policy, "name", replacement),
                    "prefetch": _prefetch_name(eng), "threads": eng.threads, "cpu_experts": o.cpu_experts,
                    "lowbit": o.lowbit, "precision": o.precision if isinstance(o.precision, str) else "full",
                    "t1": o.t1, "t2": o.t2}
            runs[name], traces[name] = out, (tr, eng.prefetch)
            del eng
            gc.collect()
            bar.update(task, advance=1)
        if draft:                                   # the moectl configuration again, drafting
            from .draft import draft_row

            eng = Engine.load(model, **configs[0][1], draft=draft, draft_tokens=draft_tokens, draft_rule=draft_rule)
            runs["moectl+draft"] = draft_row(eng, ids, gen_len, repeat, runs["moectl"].get("tokens"))
            del eng
            gc.collect()
            bar.update(task, advance=1)
        if "transformers" in baselines:
            runs["transformers"] = _transformers_run(ref.path, dt, device, None, ids, gen_len, repeat)
            runs["transformers"]["what"] = ("plain transformers" if device == "cpu" else
                                            "transformers + accelerate device_map offload")
            if replay_trace:
                notes["transformers"] = "routes with its own router (a trace cannot be replayed into it)"
            bar.update(task, advance=1)
    if device == "cpu" and "all-resident" in runs:
        notes["all-resident"] = "CPU: experts computed in place from host RAM (no slots, no copies)"
    figs = machine_figures(device)
    shape = shape_from_hf_config(config.to_dict())
    predicted, ratio = {}, {}
    if "all-resident" in runs and traces["all-resident"][0] is not None:
        # the simulator's per-layer overhead: what the all-resident run took beyond the bandwidth model
        base = _predict(traces["all-resident"][0], [E] * L, "lru", "none", figs, shape, 0.0)
        overhead = max(0.0, (runs["all-resident"]["decode_ms_per_token"] - base["decode_ms_per_token"]) / L)
    else:
        overhead = 0.02
    for name in ("moectl", "moectl-plan"):
        if name not in runs:
            continue
        tr, pf = traces[name]
        caps = runs[name]["pools"] or runs[name]["slots_per_layer"]      # the runtime's own split, as it ran
        pname = runs[name]["prefetch"]
        preds = None
        if pname in ("mlp", "aux-gate", "routing"):
            from ..predictors.file import load_predictors

            preds = load_predictors(ref.workdir, fp)
        try:
            predicted[name] = _predict(tr, caps, runs[name]["replacement"], pname, figs, shape, overhead, preds,
                                       admission if pname != "none" else "off", runs[name])
        except MoectlError as e:
            notes[name + " prediction"] = str(e)
            continue
        ratio[name] = runs[name]["decode_ms_per_token"] / predicted[name]["decode_ms_per_token"]
    for r in runs.values():
        r.pop("tokens", None)
    vs = None
    if "all-resident" in runs and "transformers" in runs:
        vs = runs["all-resident"]["decode_ms_per_token"] / runs["transformers"]["decode_ms_per_token"]
    return {"model": ref.name, "path": str(ref.path), "device": device, "emulate_device": emulate,
            "dtype": str(dt).replace("torch.", ""), "threads": torch.get_num_threads(), "prompt_len": prompt_len,
            "gen_len": gen_len, "repeat": repeat, "replay_trace": replay_trace, "layers": L, "experts": E, "top_k": K,
            "bytes_per_expert": expert_nbytes, "cache": size, "plan": plan.get("_path") if plan else None,
            "machine": {k: figs[k] for k in ("mem_read_gbps", "cpu_expert_gbps", "copy_gbps")},
            "sim_layer_overhead_ms": overhead, "runs": runs, "predicted": predicted,
            "measured_over_predicted": ratio, "all_resident_over_transformers": vs, "goal_all_resident_ratio": 1.15,
            "notes": notes}


def _prefetch_name(eng) -> str:
    p = eng.prefetch
    return "none" if p is None else p.name

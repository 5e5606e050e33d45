"""Options shared by the commands that load a model into the runtime (one definition each)."""

from __future__ import annotations

import copy

import typer

from ..policies import PREFETCH_NAMES, REPLACEMENT_NAMES


class CacheOpts:
    @staticmethod
    def cache_experts():
        return typer.Option(None, "--cache-experts", min=1,
                            help="Expert slots on the device in total, split evenly over MoE layers (default: all).")

    @staticmethod
    def budget():
        return typer.Option(None, "--budget",
                            help="Device memory budget, e.g. 20GB: dense weights and a KV reserve come off first.")

    @staticmethod
    def device():
        return typer.Option("auto", "--device",
                            help="auto (CUDA when torch sees a device, else the CPU), cpu, cuda or cuda:N. On cpu "
                                 "with --offload ram (the default) experts are computed in place from host RAM: no "
                                 "slots, no copies, --cache-experts has no effect. On CUDA without --budget, "
                                 "--cache-experts or a plan the budget is the device's free memory less a margin.")

    @staticmethod
    def emulate_device():
        return typer.Option(False, "--emulate-device",
                            help="cpu only: make the CPU act as a device with its own expert slots that misses copy "
                                 "into (the cache behaviour a GPU has; for testing policies). Off by default.")

    @staticmethod
    def offload():
        return typer.Option("ram", "--offload", help="Where experts live: ram (host memory) or disk (each miss reads the expert's bytes from the "
                                 "shards straight into its cache slot).")

    @staticmethod
    def replacement():
        names = ", ".join(n for n in REPLACEMENT_NAMES if n != "belady")        # belady needs the future
        return typer.Option(None, "--replacement", help=f"Cache replacement policy: {names} (default: the plan's, "
                                                        "else lru).")

    @staticmethod
    def no_plan():
        return typer.Option(False, "--no-plan", help="Ignore the workdir's plan.yaml (from `moectl plan-cache`), which "
                                                     "otherwise sets the slots per layer when neither --cache-experts "
                                                     "nor --budget is given.")

    @staticmethod
    def prefetch():
        names = ", ".join(n for n in PREFETCH_NAMES if n != "oracle")      # oracle knows the future
        return typer.Option(None, "--prefetch", show_default=False,
                            help="Runtime prefetch: auto (the workdir's trained predictors: aux gate for layer 0 + MLP; "
                                 f"gate-reuse when there are none), {names}. Default: the loaded plan's, else auto.")

    @staticmethod
    def admission():
        return typer.Option(None, "--admission", show_default=False,
                            help="on: copy a predicted expert only when its expected saving (calibrated confidence x "
                                 "the load time it hides) beats its expected copy-engine cost, capped by the time left "
                                 "before its layer (the rule `moectl simulate --admission` applies; times from "
                                 "this machine's measured figures); off: copy every prediction. Default: the loaded plan's, else off.")

    @staticmethod
    def staging_buffers():
        return typer.Option(None, "--staging-buffers", min=0, show_default=False,
                            help="Device buffers a predicted expert is copied into instead of a cache slot, so a wrong "
                                 "prediction evicts nothing and a right one is installed as its miss would have been "
                                 "(the budget pays for them). Default: 2 when misses are fetched (--cpu-experts "
                                 "never), else 0 (into slots).")

    @staticmethod
    def predictor():
        return typer.Option(None, "--predictor", help="Directory of predictors.json (default: the model workdir).")

    @staticmethod
    def workdir():
        return typer.Option(None, "--workdir", help="Artifact directory (default ~/.cache/moectl/<model>).")

    @staticmethod
    def threads():
        return typer.Option(None, "--threads", min=1,
                            help="torch intra-op CPU threads (default: 1 for small models, whose ops are dispatch "
                                 "bound, else every core this process may use).")

    @staticmethod
    def cpu_experts():
        return typer.Option(None, "--cpu-experts", show_default=False,
                            help="Where a missed expert runs: never (fetch it to the device), always (compute it on the "
                                 "CPU from host RAM), auto (whichever this machine's measured copy and CPU speeds make "
                                 "cheaper, per expert; figures measured once and cached in $MOECTL_HOME/machine.json). "
                                 "Default: the loaded plan's (plan-cache --cpu-experts), else never.")

    @staticmethod
    def prefill():
        return typer.Option("cache", "--prefill",
                            help="cache: a prompt's missed experts load into the expert cache; stream: they stream "
                                 "through two staging buffers while the previous one computes and never enter the cache "
                                 "(DuoServe; the budget pays for the two buffers).")

    @staticmethod
    def replay_trace():
        return typer.Option(None, "--replay-trace",
                            help="A moe-routing-v1 trace (JSONL or trace directory) whose routing replaces the router's "
                                 "choice: real routing on (synthetic) real-size experts.")

    @staticmethod
    def dtype():
        return typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's).")


class SamplingOpts:
    """How `generate` and `chat` draw tokens (the "Sampling" panel of their --help); one definition for both."""

    @staticmethod
    def greedy():
        return typer.Option(False, "--greedy", rich_help_panel="Sampling", help="Greedy decoding (default: sampling).")

    @staticmethod
    def temperature():
        return typer.Option(0.8, "--temperature", rich_help_panel="Sampling", min=0.0,
                            help="Sampling temperature: lower is more deterministic (ignored with --greedy).")

    @staticmethod
    def top_p():
        return typer.Option(0.95, "--top-p", rich_help_panel="Sampling", min=0.0, max=1.0,
                            help="Nucleus sampling: sample from the smallest set of tokens whose probability sums "
                                 "to this (1 = all).")

    @staticmethod
    def seed(help: str = "Sampling seed."):
        return typer.Option(0, "--seed", rich_help_panel="Sampling", help=help)


class PrecisionOpts:
    """Low-bit copies and the precision a miss loads (`moectl quantize`, policies/precision.py)."""

    @staticmethod
    def lowbit():
        return typer.Option(None, "--lowbit",
                            help="Also serve the low-bit expert copies made by `moectl quantize`, e.g. q4g64, or "
                                 "ggml-q4_0 (--format ggml-q4_0: llama.cpp's blocks, computed by ggml on the CPU) "
                                 "(kept in host RAM; a pool of low-bit slots on the device).")

    @staticmethod
    def dense_lowbit():
        return typer.Option(None, "--dense-lowbit",
                            help="q8: keep the attention projections and the lm_head 8-bit on the CPU (q8g64 "
                                 "through moectl's AVX-512 kernels; elsewhere ggml's Q8_0, or int8 per row where "
                                 "ggml cannot build); q4: the attention projections q4g64, the lm_head q6g64 "
                                 "(llama.cpp's Q4_0 mix; elsewhere ggml's Q4_0 and Q6_K). Lossy; llama.cpp's "
                                 "quantized files quantize them too. --device cpu, bf16.")

    @staticmethod
    def precision():
        return typer.Option(None, "--precision",
                            help="Which copy a miss loads: full; hobbit (rank score s <= T1 full, <= T2 low-bit, "
                                 "else skipped and the rest renormalised); lowbit-only (every expert low-bit). "
                                 "Default: hobbit with --lowbit, else full.")

    @staticmethod
    def t1():
        return typer.Option(0.6, "--t1", min=0.0, max=1.0, help="HOBBIT T1: misses scoring <= T1 load in full "
                                                                "precision (1 = never low-bit: lossless).")

    @staticmethod
    def t2():
        return typer.Option(0.9, "--t2", min=0.0, max=1.0, help="HOBBIT T2: misses scoring in (T1, T2] load "
                                                                "low-bit, above T2 are skipped.")

    @staticmethod
    def fraction():
        return typer.Option(None, "--lowbit-fraction", min=0.0, max=0.99,
                            help="Share of the expert cache's bytes given to low-bit slots under --precision hobbit "
                                 "(default 0.25; lowbit-only gives them all: no full-precision slots).")


def say(note: str, one_line: bool = False) -> None:
    """One dim status line on stderr (JSON on stdout stays clean); `one_line`: never wrapped at the terminal's width
    (a line a script or a test reads whole, as the `error:` line)."""
    from rich.console import Console

    Console(stderr=True).print(f"[dim]{note}[/]", highlight=False, soft_wrap=one_line)


def prepare_model(model: str, workdir=None) -> None:
    """Build the built-in tiny model on first use (the runtime itself never builds or trains anything). Through
    `ensure_tiny` even when a checkpoint is there: a build is keyed by its seed ($MOECTL_TINY_SEED), and one made
    with another seed is rebuilt, not reused."""
    from ..core.recipes import resolve_model

    ref = resolve_model(model, str(workdir) if workdir else None)
    if (ref.recipe or {}).get("builtin") == "tiny":
        from ..synth.tiny import ensure_tiny, tiny_built

        if not tiny_built(ref.workdir):
            writable_workdir(model, workdir)         # a build writes there: say so now, not mid-build
        ensure_tiny(ref.workdir)
    if (ref.recipe or {}).get("builtin") == "reference" and not ref.path.exists():     # ~1 h: never implicit
        from ..errors import MoectlError

        raise MoectlError(f"the reference model is not built in {ref.workdir}: run `moectl build-tiny --size "
                          f"reference` (about an hour on 2 cores, resumable) or `make bench-fidelity`")


def writable_workdir(model: str, workdir=None):
    """The model's workdir, checked writable before a command's work that ends by writing there
    (`core/paths.py: writable_dir`)."""
    from ..core.paths import writable_dir
    from ..core.recipes import resolve_model

    return writable_dir(resolve_model(model, str(workdir) if workdir else None).workdir, "the workdir")


class DraftOpts:
    """Speculative decoding (issue 33; runtime/speculative.py)."""

    @staticmethod
    def draft():
        return typer.Option(None, "--draft",
                            help="Speculative decoding: draft tokens, then verify them in one pass through the "
                                 "offloaded layers (a layer loads the union of their experts once). cached: the model "
                                 "drafts itself with only the experts already on the device (a missing one skipped, the "
                                 "rest renormalised: drafting loads nothing); PATH or recipe: a small model with the "
                                 "same tokenizer, run fully resident; none: no drafting. Greedy output is the same token "
                                 "for token; sampled output has the same distribution. Default: the plan's (plan-cache "
                                 "--draft-tokens with the cached draft), else off.")

    @staticmethod
    def draft_tokens():
        return typer.Option(None, "--draft-tokens", min=1, help="The most tokens drafted per verification pass (K; "
                            "default: the plan's, when plan-cache planned for drafting, else 4).")

    @staticmethod
    def draft_rule():
        return typer.Option("auto", "--draft-rule",
                            help="auto: draft 0..K tokens per pass, whichever the measured acceptance and pass times "
                                 "make fastest (off where drafting does not pay); always: K every pass (measurements).")


class GatingOpts:
    @staticmethod
    def threshold():
        return typer.Option(None, "--gating-threshold",
                            help="Adaptive top-k (AdapMoE): in decode, drop a token's lower-ranked experts while "
                                 "(dropped gate weight)^2 x S_layer <= T_g (needs `moectl sensitivity`). Default: the "
                                 "T_g that `moectl sensitivity --target-ppl-delta` stored in the workdir, if any; "
                                 "0 turns gating off.")

    @staticmethod
    def spec():
        return typer.Option(None, "--gating",
                            help="score:TAU = the score-only baseline (drop the tail while its weight sum <= TAU, "
                                 "same TAU in every layer); sensitivity:T_G = --gating-threshold T_G; none = off.")

    @staticmethod
    def prefill():
        return typer.Option(False, "--gate-prefill", help="Gate the prompt's tokens too (default: decode steps only).")


# --- the runtime options, declared once (generate, chat, eval, serve, bench) ------------------------------------
# (field of RuntimeOptions, annotation, its typer option). Every runtime command takes exactly these; the command
# function receives them as one `opts: RuntimeOptions` (`runtime_options`).
def _runtime_option_table():
    from typing import Optional

    return [
        ("dense_lowbit", Optional[str], PrecisionOpts.dense_lowbit()),          # issue 28 (models/dense_cpu.py)
        ("cache_experts", Optional[int], CacheOpts.cache_experts()), ("budget", Optional[str], CacheOpts.budget()),
        ("device", str, CacheOpts.device()), ("emulate_device", bool, CacheOpts.emulate_device()),
        ("offload", str, CacheOpts.offload()), ("replacement", Optional[str], CacheOpts.replacement()),
        ("no_plan", bool, CacheOpts.no_plan()), ("prefetch", Optional[str], CacheOpts.prefetch()),
        ("admission", Optional[str], CacheOpts.admission()), ("staging", Optional[int], CacheOpts.staging_buffers()),
        ("predictor", Optional[str], CacheOpts.predictor()), ("workdir", Optional[str], CacheOpts.workdir()),
        ("dtype", Optional[str], CacheOpts.dtype()), ("threads", Optional[int], CacheOpts.threads()),
        ("cpu_experts", Optional[str], CacheOpts.cpu_experts()), ("prefill", str, CacheOpts.prefill()),
        ("replay_trace", Optional[str], CacheOpts.replay_trace()),
        ("gating_threshold", Optional[float], GatingOpts.threshold()), ("gating", Optional[str], GatingOpts.spec()),
        ("gate_prefill", bool, GatingOpts.prefill()), ("lowbit", Optional[str], PrecisionOpts.lowbit()),
        ("precision", Optional[str], PrecisionOpts.precision()), ("t1", float, PrecisionOpts.t1()),
        ("t2", float, PrecisionOpts.t2()), ("lowbit_fraction", Optional[float], PrecisionOpts.fraction()),
        ("draft", Optional[str], DraftOpts.draft()), ("draft_tokens", Optional[int], DraftOpts.draft_tokens()),
        ("draft_rule", str, DraftOpts.draft_rule()),
    ]


# --help's panels of the runtime options, in the order they are shown (after the command's own options): the device
# and its memory first (what most users set), the lossy settings under their own heading.
DEVICE_PANEL, PREFETCH_PANEL, LOSSY_PANEL, DRAFT_PANEL, OUTPUT_PANEL = (
    "Device and cache", "Cache policy and prefetch", "Precision and gating (lossy: they change outputs)",
    "Speculative decoding", "Output")
RUNTIME_PANELS = {
    DEVICE_PANEL: ("device", "budget", "cache_experts", "offload", "threads", "dtype", "workdir", "no_plan",
                   "emulate_device"),
    PREFETCH_PANEL: ("replacement", "prefetch", "predictor", "admission", "staging", "cpu_experts", "prefill",
                     "replay_trace"),
    LOSSY_PANEL: ("lowbit", "precision", "t1", "t2", "lowbit_fraction", "dense_lowbit", "gating", "gating_threshold",
                  "gate_prefill"),
    DRAFT_PANEL: ("draft", "draft_tokens", "draft_rule"),
}


def runtime_options(fn=None, *, helps: dict[str, str] | None = None):
    """Give a command every runtime option (one declaration) and pass them as `opts: RuntimeOptions`: what the
    command leaves unset is the plan's (the workdir's plan.yaml unless --no-plan), else the workdir's artifacts'
    (predictors for --prefetch auto, the stored T_g for gating), else the built-in default (`setting/resolve.py: resolve`).
    `helps` {field: text}: a command's own help for an option whose default it reads its own way (`bench`: half
    the experts cached, the CPU emulating a device); the flag, its field and its parsing stay the shared ones."""
    if fn is None:
        return lambda f: runtime_options(f, helps=helps)
    import functools
    import inspect

    from ..setting.options import RuntimeOptions

    table = _runtime_option_table()
    panel_of = {n: panel for panel, ns in RUNTIME_PANELS.items() for n in ns}
    for i, (n, ann, opt) in enumerate(table):
        opt = copy.copy(opt)
        opt.rich_help_panel = panel_of[n]
        if n in (helps or {}):
            opt.help = helps[n]
        table[i] = (n, ann, opt)
    order = [n for ns in RUNTIME_PANELS.values() for n in ns]
    table.sort(key=lambda row: order.index(row[0]))          # --help lists a panel's options in this order
    names = [n for n, _, _ in table]
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
             for n, ann, opt in table]

    @functools.wraps(fn)
    def command(**kw):
        given = {n: kw.pop(n) for n in names}
        no_plan = given.pop("no_plan")
        kw["opts"] = RuntimeOptions(plan=None if no_plan else "auto", workdir_defaults=True, **given)
        return fn(**kw)

    command.__signature__ = sig.replace(parameters=own + extra)
    command.__annotations__ = {**{p.name: p.annotation for p in own}, **{n: a for n, a, _ in table}}
    return command


def print_draft_line(d: dict, console=None) -> None:
    """One line of speculative decoding's figures (stats["draft"] of a generation), on stderr."""
    from rich.console import Console

    acc = ", ".join(f"{p:.2f}" for p in d["acceptance"]["per_position"])
    (console or Console(stderr=True)).print(
        f"[dim]draft {d['source']} (K {d['draft_tokens']}, rule {d['rule']}): {d['passes']} passes, "
        f"{d['tokens_per_pass']:.2f} tokens/pass, acceptance per position [{acc}], {d['ms_per_token']:.1f} ms/token"
        + (f"; {d['note']}" if d["note"] else "") + "[/]", highlight=False)


# What a command's run leaves behind when the process ends with the command (`cli.run` sets a list here): the
# engine it loaded last is held there, so it is not freed before the process ends at once (`cli.exit_now`). Freeing
# it when the command returns is the interpreter's teardown by another name: a 152k-token tokenizer's maps dropped
# (~0.07 s) and the GGUF unmapped (~0.01 s) after the answer is printed (docs/gguf.md, "stop 54"). None where the
# process goes on after the command (tests call `cli.main()`): nothing is kept.
kept_until_exit: list | None = None


def load_engine(model: str, opts, progress: bool, torch_free: bool = False):
    """(engine, its lossy settings) for a command that runs the model: the built-in tiny model built on first use,
    the load (a progress bar when `progress`), then the start-up lines: device, plan, lossy settings (stderr).
    `torch_free`: a command that needs no more of the engine than `generate` and `chat` do takes the torch-free
    engine where it serves the run (a GGUF the one ggml graph computes: runtime/graph_engine.py), else the `Engine`
    as always."""
    from ..status import print_device, print_plan_note

    prepare_model(model, opts.workdir)
    opts.progress = progress
    eng = None
    if torch_free:
        from ..runtime.graph_engine import GraphEngine

        eng, _ = GraphEngine.try_load(model, opts)
    if eng is None:
        from ..runtime.engine import Engine

        eng = Engine.load(model, options=opts)
    if kept_until_exit is not None:
        kept_until_exit[:] = [eng]              # the last one: a command that loaded two would free the first
    print_device(eng)
    print_plan_note(eng)
    return eng, print_lossy(eng)


def print_lossy(eng, console=None) -> dict:
    """One start-up line naming the lossy settings in force (precision, gating, low-bit copies); returns them for
    `--json`. stderr: JSON on stdout stays clean."""
    from rich.console import Console

    lossy = eng.lossy()
    console = console or Console(stderr=True)
    console.print(
        f"[dim]lossy settings: precision {lossy['precision']}; gating {lossy['gating']}; low-bit copies "
        f"{lossy['lowbit'] or 'none'}[/]", highlight=False)
    spec = getattr(eng, "speculator", None)
    if spec is not None:                        # drafting is lossless: said on its own line
        console.print(f"[dim]speculative decoding: --draft {spec.drafter.name}, up to {spec.k_max} tokens per pass, "
                      f"rule {spec.rule_name}" + (f"; {spec.drafter.note}" if spec.drafter.note else "") + "[/]",
                      highlight=False)
    return lossy

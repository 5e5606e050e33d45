"""RuntimeOptions: everything a run of the runtime is configured by, and where each value came from.

One dataclass, declared once for the CLI (`commands/_common.py: runtime_options` turns its fields into the typer
options every runtime command takes: generate, chat, eval, serve, bench), passed to `Engine.load`. `resolve()`
fills what the user left unset, in one documented order:

    explicit flag  >  plan.yaml (plan-cache)  >  artifact default (sensitivity.json's T_g, predictors.json's kinds)
                   >  built-in default

and records the source of each value (`sources`: flag | plan | sensitivity.json | predictors.json | default), which
`generate --json` prints as "config": {name: [value, source]}. `lossy()` names the settings in force that change
outputs (precision, gating, low-bit copies): every runtime command prints them at start-up and in `--json`.
No torch: the simulator and the commands use it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from ..artifacts.plan import PLAN_POLICIES, plan_policies
from ..errors import MoectlError

FLAG, PLAN, SENSITIVITY, PREDICTORS, DEFAULT = "flag", "plan", "sensitivity.json", "predictors.json", "default"
DRAFT_RULES = ("auto", "always")           # --draft-rule (runtime/speculative.py)


@dataclass
class RuntimeOptions:
    device: str = "cpu"
    cache_experts: int | None = None
    budget: str | int | None = None
    offload: str = "ram"
    workdir: str | None = None
    dtype: object = None
    replacement: object = None              # a name or a ReplacementPolicy
    prefetch: object = None                 # a name or a PrefetchPolicy; None: the plan's, else none (CLI: auto)
    slots_per_layer: list[int] | None = None
    progress: bool = True
    predictor: str | None = None
    emulate_device: bool = False
    gating: object = None                   # a spec or a GatingPolicy; "auto": the stored T_g
    gating_threshold: float | None = None
    gate_prefill: bool = False
    threads: int | None = None
    cpu_experts: str | None = None
    cost: object = None
    replay_trace: object = None
    prefill: str = "cache"
    plan: str | Path | None = None          # "auto": the workdir's plan.yaml; None: no plan
    lowbit: str | None = None
    dense_lowbit: str | None = None         # q8: attention + lm_head int8 on the CPU (models/dense_cpu.py)
    precision: str | None = None
    t1: float = 0.6
    t2: float = 0.9
    lowbit_fraction: float | None = None
    admission: str | None = None
    staging: int | None = None
    draft: str | None = None                # speculative decoding: cached | a draft model's path or recipe | none
    draft_tokens: int | None = None         # the most tokens drafted per verification pass (None: the plan's, else 4)
    draft_rule: str = "auto"                # auto: drafting only where it pays (OnlineDraftRule); always: fixed K
    workdir_defaults: bool = False          # CLI: unset prefetch / gating mean the workdir's predictors / stored T_g
    sources: dict = field(default_factory=dict, repr=False)
    plan_data: dict | None = field(default=None, repr=False)   # the plan applied (resolve)
    plan_note: str = ""

    def __post_init__(self):
        for f in fields(self):
            if f.name not in ("sources", "plan_data", "plan_note", "workdir_defaults") and \
                    getattr(self, f.name) != f.default:
                self.sources.setdefault(f.name, FLAG)

    def set(self, name: str, value, source: str) -> None:
        """`name` = `value` from `source`, unless a flag (or an earlier source) already set it."""
        if getattr(self, name) is None and value is not None:
            setattr(self, name, value)
            self.sources[name] = source

    # --- resolve: flag > plan > artifact default > built-in default --------------------------------
    def check(self) -> "RuntimeOptions":
        """The checks that need nothing loaded (before the device, the checkpoint, anything read)."""
        from ..policies.admission import ADMISSION_MODES

        if self.prefill not in ("cache", "stream"):
            raise MoectlError(f"--prefill must be cache or stream, not {self.prefill!r}")
        if self.admission is not None and self.admission not in ADMISSION_MODES:
            raise MoectlError(f"--admission must be {' or '.join(ADMISSION_MODES)}, not {self.admission!r}")
        if self.emulate_device and self.device != "cpu":
            raise MoectlError("--emulate-device makes the CPU act as a device; it only applies to --device cpu")
        if self.offload not in ("ram", "disk"):
            raise MoectlError(f"--offload must be 'ram' or 'disk', not {self.offload!r}")
        if self.draft_rule not in DRAFT_RULES:
            raise MoectlError(f"--draft-rule must be {' or '.join(DRAFT_RULES)}, not {self.draft_rule!r}")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise MoectlError(f"--draft-tokens must be at least 1 with --draft, not {self.draft_tokens}")
        if self.draft is not None and self.replay_trace is not None:
            raise MoectlError("--draft and --replay-trace do not go together: a replayed trace routes tokens in "
                              "order, and drafting runs tokens that are then rolled back")
        return self

    def resolve(self, workdir, fingerprint: str, num_layers: int, num_experts: int) -> "RuntimeOptions":
        self.check()
        self._apply_plan(workdir, fingerprint, num_layers, num_experts)
        if self.draft == "none":                                # --draft none: not even the plan's drafting
            self.draft = None
        self.set("draft_tokens", 4, DEFAULT)
        cuda, wd = self.device != "cpu", self.workdir_defaults
        for name, value in (("replacement", "lru"), ("admission", "off"),
                            ("cpu_experts", "auto" if cuda else "never"),        # in place on a CPU nothing misses
                            ("precision", "hobbit" if self.lowbit else "full"),
                            ("prefetch", "auto" if wd else None)):              # auto: predictors.json, else gate reuse
            self.set(name, value, DEFAULT)
        if self.gating is None and self.gating_threshold is None:
            if wd:
                self.set("gating", "auto", SENSITIVITY)         # sensitivity.json's T_g when there is one
            self.sources.setdefault("gating", DEFAULT)
        return self

    def _apply_plan(self, workdir, fingerprint, num_layers, num_experts) -> None:
        """The plan to apply (`artifacts/plan.py`, checked against this model) and one line saying so."""
        from ..artifacts.plan import PLAN_NAME, check_plan_model, load_plan, plan_slots

        if self.plan is None:
            self.plan_note = "plan: none (--no-plan)"
            return
        explicit = self.plan != "auto"
        path = Path(self.plan).expanduser() if explicit else Path(workdir) / PLAN_NAME
        if not explicit and not path.exists():
            return
        given = [f for f, v in (("--cache-experts", self.cache_experts), ("--budget", self.budget),
                                ("slots", self.slots_per_layer)) if v is not None]
        if given:
            if explicit:
                raise MoectlError(f"give a plan or {given[0]}, not both")
            self.plan_note = f"plan: {path} not used ({given[0]} given)"
            return
        d = load_plan(path)
        slots = plan_slots(d, d["_path"])                   # checked: integers, at least one per layer
        check_plan_model(d, fingerprint, num_layers, num_experts, "the model loaded")
        self.plan_data = d
        self.slots_per_layer = slots
        self.sources["slots"] = PLAN
        # its precision comes with its low-bit pools (and the copies, which --lowbit names: never loaded unasked)
        low_pools = any(int(s) for s in d.get("slots_low") or [])
        self.take_plan(d, ("replacement", "prefetch", "cpu_experts", "admission") + (("precision",) if low_pools
                                                                                    else ()))
        self._take_plan_draft(d)
        if self.staging is None and (d.get("budget") or {}).get("staging") is not None:
            self.sources["staging"] = PLAN
        pred = d.get("predicted") or {}
        ms = pred.get("ms_per_token")
        self.plan_note = (f"plan: {d['_path']} ({sum(d['slots'])} expert slots, {min(d['slots'])}-{max(d['slots'])} "
                          f"per layer" + (f"; predicted {ms:.3g} ms/token on {d.get('hardware')}" if ms else "")
                          + "; --no-plan ignores it)")

    def _take_plan_draft(self, plan: dict) -> None:
        """A plan made with `plan-cache --draft-tokens` (`plan/speculative.py`'s `draft` block) drafts as it was priced:
        `--draft cached` when it drafted with the resident experts and found some K that pays (tokens > 0; 0 means
        its replay found drafting does not pay here), and its K for a draft the command names. A draft model's path
        is not in the plan: with `source: model` only K is taken, when the command gives `--draft PATH`."""
        block = plan.get("draft") or {}
        tokens = int(block.get("tokens") or 0)
        if tokens < 1:
            return
        if block.get("source") == "cached":
            self.set("draft", "cached", PLAN)
        if self.draft not in (None, "none"):
            self.set("draft_tokens", tokens, PLAN)

    def take_plan(self, plan: dict, names=PLAN_POLICIES):
        """The plan's value (`artifacts/plan.py: plan_policies`) of each option in `names` left unset, HOBBIT's T1/T2
        with its hobbit precision, and its gating unless the command gave one; returns that gating (or None)."""
        pol = plan_policies(plan)
        for name in names:
            self.set(name, pol.get(name), PLAN)
        if pol.get("precision") == self.precision == "hobbit":
            for k in ("t1", "t2"):
                if k in pol and self.sources.get(k) != FLAG:
                    setattr(self, k, pol[k])
                    self.sources[k] = PLAN
        if pol.get("gating") and self.gating in (None, "auto") and self.gating_threshold is None:
            from ..policies.gating import SensitivityGating

            self.gating = SensitivityGating(*pol["gating"])         # the T_g the plan was measured with
            self.sources["gating"] = PLAN
            return self.gating
        return None

    # --- what is in force -----------------------------------------------------------------------
    def lossy(self, gating_note: str | None) -> dict:
        """The settings in force that change outputs: precision (and its thresholds), low-bit copies, gating."""
        prec = self.precision or "full"
        return {"precision": prec + (f" (T1 {self.t1:g}, T2 {self.t2:g})" if prec == "hobbit" else ""),
                "lowbit": self.lowbit, "gating": gating_note or "off"} | (
            {"dense_lowbit": self.dense_lowbit} if self.dense_lowbit else {})

    def config(self, resolved: dict | None = None) -> dict:
        """{name: [value, source]} of every option (values made JSON-safe), `resolved` overriding values."""
        out = {}
        for f in fields(self):
            if f.name in ("sources", "plan_data", "plan_note", "cost", "progress", "workdir_defaults"):
                continue
            v = (resolved or {}).get(f.name, getattr(self, f.name))
            if f.name == "slots_per_layer":
                f_name, src = "slots", self.sources.get("slots", DEFAULT)
            else:
                f_name, src = f.name, self.sources.get(f.name, DEFAULT)
            if not isinstance(v, (str, int, float, bool, list, type(None))):
                v = getattr(v, "name", None) or str(v)
            out[f_name] = [v, src]
        return out

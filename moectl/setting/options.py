"""RuntimeOptions: everything a run of the runtime is configured by, and where each value came from.

One dataclass, declared once for the CLI (`commands/_common.py: runtime_options` turns its fields into the typer
options every runtime command takes: generate, chat, eval, serve, bench), passed to `Engine.load`; `simulate` and
`plan-cache` fill one with their flags too. The resolver (`setting/resolve.py: resolve`) fills what the user left
unset, in one documented order:

    explicit flag  >  plan.yaml (plan-cache)  >  artifact default (sensitivity.json's T_g, predictors.json's kinds)
                   >  built-in default

and records the source of each value here (`sources`: flag | plan | sensitivity.json | predictors.json | default),
which `generate --json` prints as "config": {name: [value, source]} (`config()`). `lossy()` names the settings in
force that change outputs (precision, gating, low-bit copies): every runtime command prints them at start-up and in
`--json`. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import MoectlError

FLAG, PLAN, SENSITIVITY, PREDICTORS, DEFAULT = "flag", "plan", "sensitivity.json", "predictors.json", "default"
DRAFT_RULES = ("auto", "always")           # --draft-rule (runtime/speculative.py)
NOTES = ("device_note", "budget_note")      # status lines, not options


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
    plan: str | Path | dict | None = None   # "auto": the workdir's plan.yaml; None: no plan; a dict: a plan read
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
    plan_data: dict | None = field(default=None, repr=False)   # the plan applied (`setting/resolve.py`)
    plan_note: str = ""
    device_note: str = ""                   # the device taken and why (`store/facts.py: pick_device`)
    budget_note: str = ""                   # the budget taken when none was given (`setting/resolve.py`)

    def __post_init__(self):
        for f in fields(self):
            if f.name not in ("sources", "plan_data", "plan_note", "workdir_defaults") + NOTES and \
                    getattr(self, f.name) != f.default:
                self.sources.setdefault(f.name, FLAG)

    def set(self, name: str, value, source: str) -> None:
        """`name` = `value` from `source`, unless a flag (or an earlier source) already set it."""
        if getattr(self, name) is None and value is not None:
            setattr(self, name, value)
            self.sources[name] = source

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
        cores = usable_cores()
        if self.threads is not None and self.threads > cores:
            raise MoectlError(f"--threads {self.threads} is more than the {cores} CPU cores this process may run on "
                              f"(threads beyond the cores only wait on each other): use --threads {cores} or fewer")
        if self.draft is not None and self.replay_trace is not None:
            raise MoectlError("--draft and --replay-trace do not go together: a replayed trace routes tokens in "
                              "order, and drafting runs tokens that are then rolled back")
        return self

    # --- what is in force -----------------------------------------------------------------------
    def lossy(self, gating_note: str | None) -> dict:
        """The settings in force that change outputs: precision (and its thresholds), low-bit copies, gating."""
        prec = self.precision or "full"
        return {"precision": prec + (f" (T1 {self.t1:g}, T2 {self.t2:g})" if prec == "hobbit" else ""),
                "lowbit": self.lowbit, "gating": (gating_note or "off").removeprefix("gating: ")} | (
            {"dense_lowbit": self.dense_lowbit} if self.dense_lowbit else {})

    def config(self, resolved: dict | None = None) -> dict:
        """{name: [value, source]} of every option (values made JSON-safe), `resolved` overriding values."""
        out = {}
        for f in fields(self):
            if f.name in ("sources", "plan_data", "plan_note", "cost", "progress", "workdir_defaults") + NOTES:
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

"""The scoreboard's fidelity column: for each preset's precision setting, the perplexity delta `moectl eval`
measures for that setting on the built-in tiny model -- a proxy (another model, the tiny one's own gating
threshold), labelled as such. Speed is only comparable at matched fidelity; this says what each setting costs
in quality on a model we can run here.

    setting      precision (full | hobbit T1/T2 | lowbit-only) x low-bit copy set x gated or not
    measured     `calib/fidelity.py: evaluate` (what `moectl eval --decode-steps` runs) on the tiny model with the
                 setting: emulated device slots holding a quarter of the experts (the scoreboards' budgets hold
                 ~25 %), every held-out window scored one decode step at a time, so HOBBIT's per-token choice on
                 a miss applies as in a decode; low-bit copies made by `moectl quantize` when missing (q2g16 on
                 axis 0, as Mixtral-offloading's HQQ v0.1 config; others on axis 1); gating = the tiny workdir's
                 stored T_g (`moectl sensitivity --target-ppl-delta`), not measured without one
    cached       <tiny workdir>/ppl-proxy.json: format, version, fingerprint and weights of the tiny model, the
                 eval settings, one result per setting; reused while they match (a --compare stays fast)

The full setting is measured too (lossless by definition: its delta must come out exactly 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROXY_NAME = "ppl-proxy.json"
PROXY_LABEL = "ppl delta (tiny-model proxy)"          # the scoreboard column it fills
FORMAT, VERSION = "moectl-ppl-proxy", 1
EVAL = {"dataset": "default", "window": 128, "max_tokens": 1024, "prompts": 2, "generate": 16, "decode": True,
        "cache_fraction": 0.25, "replacement": "lru", "prefetch": "none"}


@dataclass(frozen=True)
class Setting:
    precision: str = "full"          # full | hobbit | lowbit-only
    lowbit: str | None = None
    t1: float = 0.6
    t2: float = 0.9
    gated: bool = False

    @property
    def key(self) -> str:
        p = {"full": "full", "hobbit": f"hobbit {self.lowbit} T1 {self.t1:g} T2 {self.t2:g}",
             "lowbit-only": f"lowbit-only {self.lowbit}"}[self.precision]
        return p + (" + gating" if self.gated else "")

    @classmethod
    def parse(cls, key: str) -> "Setting":
        """The setting whose `key` this is."""
        base, gated = (key[: -len(" + gating")], True) if key.endswith(" + gating") else (key, False)
        words = base.split()
        if words[0] == "hobbit":
            return cls("hobbit", words[1], float(words[3]), float(words[5]), gated)
        return cls(words[0], words[1] if len(words) > 1 else None, gated=gated)


# The presets' settings (scoreboard.PRESETS; moectl's plans at their default precision), each also gated where a
# preset or a plan gates.
SETTINGS = [Setting(), Setting(gated=True), Setting("hobbit", "q4g64"), Setting("hobbit", "q4g64", gated=True),
            Setting("lowbit-only", "q2g16"), Setting("lowbit-only", "q2g16", gated=True), Setting("lowbit-only", "q4g64"),
            Setting("lowbit-only", "q4g64", gated=True)]


def setting_of(precision: str, lowbit: str | None, t1: float, t2: float, gated: bool) -> Setting:
    return Setting(precision, lowbit if precision != "full" else None, t1 if precision == "hobbit" else 0.6,
                   t2 if precision == "hobbit" else 0.9, bool(gated))


def tiny_workdir() -> Path:
    from ..core.recipes import resolve_model

    return resolve_model("tiny").workdir


def _identity(wd: Path) -> dict:
    from ..calib.fidelity import weights_id
    from ..models import checkpoint_fingerprint

    ckpt = wd / "checkpoint"
    return {"fingerprint": checkpoint_fingerprint(ckpt), "weights": [list(w) for w in weights_id(ckpt)]}


def _cached(path: Path, ident: dict, ev: dict) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ok = d.get("format") == FORMAT and d.get("format_version") == VERSION and d.get("eval") == ev
    return d if ok and all(d.get(k) == v for k, v in ident.items()) else None


def proxies(wd: Path | None = None, measure: bool = True, settings=SETTINGS, ev: dict | None = None,
            progress=None) -> dict:
    """{"label", "status", "path", "settings": {key: eval result or {"not_measured": why}}} for the tiny model in
    `wd` (default: `moectl build-tiny`'s workdir). Cached results are reused; missing ones are measured when
    `measure`, else reported as not measured. Never fails for want of a built tiny model."""
    from ..synth.tiny import tiny_report

    wd = Path(wd) if wd is not None else tiny_workdir()
    ev = EVAL | (ev or {})
    out = {"label": PROXY_LABEL, "path": str(wd / PROXY_NAME), "settings": {}}
    if tiny_report(wd) is None or not (wd / "checkpoint" / "config.json").exists():
        return out | {"status": f"not measured: the tiny model is not built in {wd} (moectl build-tiny)"}
    ident = _identity(wd)
    path = wd / PROXY_NAME
    d = _cached(path, ident, ev) or {"format": FORMAT, "format_version": VERSION, **ident, "eval": ev, "settings": {}}
    todo = [s for s in settings if s.key not in d["settings"]]
    skipped = {}
    if todo and measure:
        for s in todo:
            r = measure_setting(wd, s, ev)
            (skipped if "not_measured" in r else d["settings"])[s.key] = r     # only results are cached
            if progress is not None:
                progress()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(path)
    got = {s.key: d["settings"].get(s.key) or skipped.get(s.key)
           or {"not_measured": "not in the cache (plan-cache --compare measures it)"} for s in settings}
    status = "cached" if not todo else "measured" if measure else "partly cached"
    return out | {"status": status, "fingerprint": ident["fingerprint"], "eval": ev, "settings": got}


def measure_setting(wd: Path, s: Setting, ev: dict) -> dict:
    """`moectl eval` of the tiny model in `wd` with setting `s` (see the module docstring)."""
    from ..artifacts.sensitivity import JSON_NAME
    from ..calib.dataset import load_calibration
    from ..calib.fidelity import evaluate, token_windows
    from ..formats.hqq import parse_lowbit
    from ..quant.quantize import quantize_model
    from ..runtime.engine import Engine

    ckpt = str(wd / "checkpoint")
    if s.gated:
        try:
            tg = json.loads((wd / JSON_NAME).read_text()).get("threshold")
        except (OSError, json.JSONDecodeError):
            tg = None
        if not tg:
            return {"not_measured": f"no gating threshold in {wd / JSON_NAME} (moectl sensitivity --model tiny "
                                    f"--target-ppl-delta 0.01)"}
    if s.lowbit is not None:
        bits, group = parse_lowbit(s.lowbit)
        quantize_model(ckpt, bits, group, 0 if bits <= 2 else 1, workdir=str(wd), progress=False)  # no-op if made
    from ..synth.tiny import tiny_report

    spec = tiny_report(wd)["spec"]
    slots = max(spec["num_layers"], round(ev["cache_fraction"] * spec["num_layers"] * spec["num_experts"]))
    eng = Engine.load(ckpt, workdir=str(wd), emulate_device=True, cache_experts=slots, replacement=ev["replacement"],
                      prefetch=ev["prefetch"], lowbit=s.lowbit, precision=s.precision, t1=s.t1, t2=s.t2,
                      gating="auto" if s.gated else "none", threads=1, progress=False)
    windows = token_windows(eng.tokenizer, load_calibration(ev["dataset"]), ev["window"], ev["max_tokens"])
    starts = [w[: max(2, ev["window"] // 4)] for w in windows[: ev["prompts"]]]
    r = evaluate(eng, windows, starts, ev["generate"], wd, decode=ev["decode"])
    st = eng.cache.stats.as_dict()
    return r | {"cache_experts": slots, "low_misses": st.get("low_misses", 0), "skips": st.get("skips", 0)}

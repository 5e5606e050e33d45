"""The model a fidelity benchmark runs on (`--model`): its checkpoint, workdir, held-out and fitting text.

    tiny        the built-in tiny model (built on first use, ~2 min); held out: calibration/default.yaml (the
                built-in corpus's validation documents), fitting text: the built-in corpus's train split
    reference   the reference model (`moectl build-tiny --size reference`, `make bench-fidelity`); held out:
                calibration/reference.yaml (the stdlib corpus's held-out split), fitting text: its train split
    other       any recipe or checkpoint directory: held out = its recipe's calibration set, else the default
"""

from __future__ import annotations

import json

from moectl.calib.dataset import load_calibration
from moectl.commands._common import prepare_model
from moectl.core.recipes import REPO_ROOT, ModelRef, resolve_model

MODEL_HELP = "recipe name (tiny, reference) or checkpoint directory; reference: make bench-fidelity builds it"


def bench_model(name: str) -> ModelRef:
    """The model's reference, built first when it is the tiny one (the reference model is never built here)."""
    prepare_model(name)
    return resolve_model(name)


def held_out_dataset(ref: ModelRef) -> str:
    """The calibration set its recipe names (the held-out text it never trained on), else the default."""
    name = ((ref.recipe or {}).get("defaults") or {}).get("calibration")
    if not name or name == "calibration/default.yaml":
        return "default"
    return str(REPO_ROOT / name) if (REPO_ROOT / name).exists() else name


def fit_texts(ref: ModelRef, max_samples: int = 64) -> list[str]:
    """Training-split text for fitting (sensitivities): the same corpus as the held-out set, other documents."""
    dataset = held_out_dataset(ref)
    return load_calibration("builtin" if dataset == "default" else dataset, split="train", max_samples=max_samples)


def experts_of(ref: ModelRef) -> tuple[int, int]:
    """(MoE layers, experts per layer) from the checkpoint's config (Mixtral family: every layer is MoE)."""
    config = json.loads((ref.path / "config.json").read_text())
    return config["num_hidden_layers"], config["num_local_experts"]


def half_the_experts(ref: ModelRef) -> int:
    layers, experts = experts_of(ref)
    return layers * experts // 2

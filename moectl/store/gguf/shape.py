"""The simulator's shape of a GGUF model (`moectl simulate --model-shape file.gguf`), torch-free: the config's
fields as for a checkpoint directory's config.json, and the experts at their packed size as stored
(`expert_nbytes`: the buffer a RAM-tier row and a cache slot hold, moectl/store/gguf/experts.py `slot_nbytes`)."""

from __future__ import annotations

from pathlib import Path

from ...core.recipes import model_name
from ...core.shapes import shape_from_hf_config
from .config import config_dict
from .experts import ExpertIndex
from .files import GgufFiles


def gguf_shape(path: str | Path) -> dict:
    files = GgufFiles(path)
    index = ExpertIndex(files)
    return shape_from_hf_config(config_dict(files) | {"gguf_expert_nbytes": index.slot_nbytes()}) | {
        "name": model_name(Path(path)), "moe_layers": len(index.layers)}

"""A checkpoint cut to its first layers: a draft model for `--draft PATH` that shares the target's tokenizer,
embeddings and head (early exit as a separate model). Used by the speculative-decoding tests and benchmark."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import MoectlError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")


def truncate_checkpoint(src: str | Path, dst: str | Path, layers: int) -> Path:
    """Save `src`'s first `layers` decoder layers (+ embeddings, final norm, head) and its tokenizer to `dst`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    src, dst = Path(src), Path(dst)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    n = model.config.num_hidden_layers
    if not 1 <= layers <= n:
        raise MoectlError(f"{src} has {n} layers: keep 1..{n}, not {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    return dst

"""The built-in tiny model: it has learned (ppl far below unigram, non-uniform routing) and is an ordinary checkpoint."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open


def test_tiny_small_has_learned(tiny_small):
    report = json.loads((tiny_small.parent / "tiny.json").read_text())
    assert report["steps"] == report["planned_steps"] == 150
    assert report["val_tokens"] >= 4096
    # validation perplexity far below a unigram model scored on the very same tokens
    assert report["val_ppl"] < 0.5 * report["unigram_ppl"], report
    assert report["unigram_ppl"] > 50                               # the baseline itself is not degenerate
    # routing: no layer collapsed onto an expert or two, no layer's usage is exactly uniform, and the per-token
    # router entropy is below uniform. (The load-balancing loss pushes the usage towards uniform, so how close one
    # training run comes is its own: 2.50-2.97 bits across seeds and kernels; a bound at 0.99 x 3 bits failed some.)
    uniform = math.log2(8)
    assert report["uniform_entropy_bits"] == pytest.approx(uniform)
    assert len(report["usage_entropy_bits"]) == 2
    for usage_h, router_h in zip(report["usage_entropy_bits"], report["router_entropy_bits"]):
        assert 1.0 < usage_h < uniform
        assert router_h < uniform
    for row in report["usage"]:
        assert sum(row) == pytest.approx(1.0, abs=1e-3)


def test_tiny_small_is_an_ordinary_hf_checkpoint(tiny_small):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_small.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    with safe_open(str(tiny_small / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # per-expert keys in the original Mixtral layout, like a real checkpoint
    for e in range(8):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys

    tok = AutoTokenizer.from_pretrained(tiny_small)
    text = "Return the index where to insert item x in list a. héllo ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 1

    model = AutoModelForCausalLM.from_pretrained(tiny_small).eval()
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 8
    assert model.generation_config.eos_token_id == [3, 0]          # <|im_end|>, <|endoftext|>
    ids = tok("The module contains the following public classes", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_build_is_deterministic_and_cached(tmp_path, tiny_small, monkeypatch):
    from moectl.synth.tiny import build_tiny

    monkeypatch.setenv("MOECTL_HOME", str(tiny_small.parent.parent / "home"))    # reuse the session's corpus cache
    a = build_tiny(tmp_path / "a", steps=3, small=True, progress=False)
    b = build_tiny(tmp_path / "b", steps=3, small=True, progress=False)
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for key in ("model.layers.0.block_sparse_moe.experts.3.w1.weight", "lm_head.weight"):
            assert torch.equal(fa.get_tensor(key), fb.get_tensor(key))
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    stamp = os.path.getmtime(a / "model.safetensors")
    assert build_tiny(tmp_path / "a", small=True, progress=False) == a             # existing build is kept
    assert os.path.getmtime(a / "model.safetensors") == stamp


def test_seed_switch_trains_another_model_and_keys_the_cache(tmp_path, tiny_small, monkeypatch):
    """MOECTL_TINY_SEED picks the training seed when the caller gives none (the suite's check that it needs no one
    trained model); the seed is part of the cache key: a build of another seed is rebuilt, one of this seed kept."""
    from moectl.errors import MoectlError
    from moectl.synth.tiny import build_tiny, tiny_report

    monkeypatch.setenv("MOECTL_HOME", str(tiny_small.parent.parent / "home"))    # reuse the session's corpus cache
    key = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    monkeypatch.setenv("MOECTL_TINY_SEED", "5")
    a = build_tiny(tmp_path / "a", steps=3, small=True, progress=False)
    assert tiny_report(tmp_path / "a")["seed"] == 5
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        w5 = f.get_tensor(key)
    stamp = os.path.getmtime(a / "model.safetensors")
    assert build_tiny(tmp_path / "a", small=True, progress=False) == a             # same seed: kept
    assert os.path.getmtime(a / "model.safetensors") == stamp
    monkeypatch.setenv("MOECTL_TINY_SEED", "6")
    assert build_tiny(tmp_path / "a", steps=3, small=True, progress=False) == a    # another seed: trained anew
    assert tiny_report(tmp_path / "a")["seed"] == 6
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        assert not torch.equal(f.get_tensor(key), w5)
    build_tiny(tmp_path / "a", steps=3, small=True, progress=False, seed=6)        # an explicit seed: kept too
    assert tiny_report(tmp_path / "a")["seed"] == 6
    monkeypatch.setenv("MOECTL_TINY_SEED", "five")
    with pytest.raises(MoectlError, match="MOECTL_TINY_SEED"):
        build_tiny(tmp_path / "b", steps=3, small=True, progress=False)

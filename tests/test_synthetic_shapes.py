"""`make-synthetic`: Qwen3-MoE, Qwen2-MoE and GPT-OSS-like shapes next to Mixtral's, each with a usable
tokenizer."""

import json

import pytest
import torch
import yaml

from moectl.errors import MoectlError
from moectl.synth.checkpoint import write_synthetic
from test_runtime import assert_runs_as_transformers, run_cli  # noqa: E402

SMALL = {"num_layers": 4, "moe_layers": 4, "hidden_size": 64, "intermediate_size": 32, "num_experts": 16,
         "top_k": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2000,
         "dtype": "float32", "name": "small"}


@pytest.mark.parametrize("family,arch", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                         ("gpt_oss", "MixtralForCausalLM")])
def test_family_checkpoint_runs_as_transformers_does(tmp_path, family, arch):
    info = write_synthetic(SMALL | {"shared_expert_intermediate_size": 48}, tmp_path / "ck", layers=2, family=family,
                           progress=False)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == 2 and info["shards"] == 3
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 16 and cfg["num_experts_per_tok"] == 4
    assert_runs_as_transformers(tmp_path / "ck", torch.tensor([[5, 6, 7, 8]]), 3, cache_experts=8, emulate_device=True)


def test_synthetic_tokenizer_round_trips_and_generate_runs(tmp_path, capsys):
    from transformers import AutoTokenizer

    write_synthetic(SMALL, tmp_path / "ck", layers=1, progress=False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    text = "def add(a, b):\n    return a + b  # ünïcode"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode())          # merges learnt, bytes round trip
    assert len(tok) == 1024 and max(ids) < cfg["vocab_size"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    code, out, err = run_cli(["generate", "-m", str(tmp_path / "ck"), "-p", "hello", "-n", "4", "--greedy",
                              "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == 4


def test_qwen2_moe_without_a_shared_expert_width_is_a_clear_error(tmp_path):
    with pytest.raises(MoectlError, match="no shared_expert_intermediate_size"):
        write_synthetic(SMALL, tmp_path / "ck", layers=1, family="qwen2_moe", progress=False)


def test_vocab_too_small_for_bytes_is_a_clear_error(tmp_path):
    with pytest.raises(MoectlError, match="too small for a byte-level tokenizer"):
        write_synthetic(SMALL | {"vocab_size": 200}, tmp_path / "ck", layers=1, progress=False)
    assert not (tmp_path / "ck").exists()


def test_make_synthetic_takes_the_qwen3_recipe_family(tmp_path, capsys):
    shape = SMALL | {"num_layers": 2}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "q", "family": "qwen3_moe", "shape": shape}))
    code, out, err = run_cli(["make-synthetic", "--shape", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "ck"),
                              "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["layers"] == 2
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["model_type"] == "qwen3_moe"

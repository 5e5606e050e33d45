"""GGUF files written by llama.cpp's own converter and quantized by its own `llama-quantize` (`make test-llamacpp`,
MOECTL_TEST_LLAMACPP=1; the build in $MOECTL_HOME/llamacpp/<version>/ is reused, never rebuilt here):

- every family llama.cpp's converter writes that moectl runs (Mixtral as `llama`, Qwen2-MoE, Qwen3-MoE, OLMoE), tiny,
  at F32, Q8_0, Q4_0 and Q4_K_M (GPT-OSS and DeepSeek-V2/V3 too, from model_factory's configs, at the end): every expert moectl decodes from the file equals `gguf.quants.dequantize`
  bit for bit (fp32);
- greedy tokens of the F32 GGUF through moectl equal the safetensors original's through moectl and through
  transformers;
- the perplexity `moectl eval --llamacpp-windows` reports on each quantized file is within 0.5 % of
  `llama-perplexity`'s on the same text and windows; also, on k256 Qwen3-MoE and Mixtral, at every other type
  llama-quantize makes (Q5_K_M, Q6_K, IQ4_XS, Q3_K_M, Q2_K, IQ3_XXS, IQ2_XXS, MXFP4_MOE). How the windows are matched: llama-perplexity tokenizes the
  whole file as one text (BOS first when the vocabulary adds one), cuts it into `-c` token chunks evaluated as
  one batch each (`-b` = `-c`), replaces each chunk's first token with BOS (when added) and scores only the
  second half: the tokens predicted from positions c/2 .. c-2. `--llamacpp-windows` does exactly that
  (calib/fidelity.py `llamacpp_windows`, `score_from = window // 2`); the text file is one line, so moectl's
  dataset reader gives it as one text, and llamacpp.perplexity reads llama-perplexity's running estimate after
  the same number of chunks.
Tiny shapes (rows of 128 weights) make llama-quantize fall back from Q4_K to Q5_0/Q5_1 on some tensors, as it
does for real models whose rows are not whole 256-weight blocks (Qwen2-MoE's 1408-wide down_proj): the
`k256` checkpoints (every row 256 wide) keep real Q4_K/Q6_K.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from moectl import cli
import llamacpp

needs_build = pytest.mark.skipif(not os.environ.get("MOECTL_TEST_LLAMACPP"),
                                 reason="llama.cpp build: run `make test-llamacpp`")
pytestmark = needs_build
BUILD_ROOT = llamacpp.home()
QTYPES = ("Q8_0", "Q4_0", "Q4_K_M")
CTX, CHUNKS = 64, 16


def _family_checkpoint(family: str, out: Path, width: int) -> Path:
    """A random tiny checkpoint of `family` with hidden and expert widths `width`, weights scaled up (x2) so that its
    next-token distributions are not uniform. Settings llama.cpp's graphs fix are the real models' (it reads no
    key for them): Qwen3-MoE renormalises its top-k weights, OLMoE's attention has as many KV heads as heads
    (its k_norm spans them all)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    from model_factory import save_tokenizer

    common = dict(vocab_size=512, hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                  pad_token_id=1, initializer_range=0.04)
    cfg = {"mixtral": lambda: MixtralConfig(**common, intermediate_size=width, num_local_experts=4,
                                            num_experts_per_tok=2),
           "qwen2_moe": lambda: Qwen2MoeConfig(**common, intermediate_size=width, moe_intermediate_size=width,
                                               shared_expert_intermediate_size=width, num_experts=4,
                                               num_experts_per_tok=2),
           "qwen3_moe": lambda: Qwen3MoeConfig(**common, head_dim=width // 4, intermediate_size=width,
                                               moe_intermediate_size=width, num_experts=4, num_experts_per_tok=2,
                                               norm_topk_prob=True),
           "olmoe": lambda: OlmoeConfig(**common | {"num_key_value_heads": 4}, intermediate_size=width,
                                        num_experts=4, num_experts_per_tok=2),
           }[family]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out, save_original_format=True)
    save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from moectl.calib.builtin_corpus import builtin_corpus

    f = tmp_path_factory.mktemp("lc_text") / "heldout.txt"
    f.write_text(" ".join(" ".join(builtin_corpus("validation")).split())[:20000])    # one line: one text
    return f


CASES = {"tiny-mixtral": None, **{f"k256-{f}": f for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")}}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tiny_small, tmp_path_factory):
    """(safetensors checkpoint, {F32, Q8_0, Q4_0, Q4_K_M: GGUF file}) written by llama.cpp's tools."""
    root = tmp_path_factory.mktemp(request.param)
    family = CASES[request.param]
    ckpt = tiny_small if family is None else _family_checkpoint(family, root / "ckpt", 256)
    f32 = llamacpp.convert(ckpt, root / "m-F32.gguf", "f32", root=BUILD_ROOT)
    files = {"F32": f32}
    for qt in QTYPES:
        files[qt] = llamacpp.quantize(f32, root / f"m-{qt}.gguf", qt, threads=1, root=BUILD_ROOT)
    return ckpt, files


def _experts_and_references(files: dict):
    """(encoding, layer, expert, moectl's weights, {gate, up, down: gguf's reference dequantisation}) of every expert
    of every file."""
    from gguf.quants import dequantize as reference

    from moectl.store.gguf.model import GgufModel
    from moectl.store.gguf.store import GgufAdapter, GgufCheckpoint
    from moectl.store.expert_store import ExpertStore

    for qt, path in files.items():
        g = GgufModel(path)
        store = ExpertStore(GgufCheckpoint(g), GgufAdapter(g), g.index.layers, torch.float32, offload="ram",
                            progress=False)
        for pos, layer in enumerate(g.index.layers):
            fmt = store.format_of("full", pos)
            for e in range(g.index.num_experts):
                w = fmt.weights(store.format.views(store.host(pos, e)))
                ref = {n: torch.from_numpy(reference(g.files.bytes_of(t.file, t.offset, t.nbytes), t.encoding)
                                           .reshape(t.shape)) for n, t in g.index.parts(layer, e)}
                yield qt, layer, e, w, ref


def test_experts_equal_gguf_reference_dequantisation(converted):
    for qt, layer, e, w, ref in _experts_and_references(converted[1]):
        assert torch.equal(w["gate_up"], torch.cat([ref["gate"], ref["up"]])), (qt, layer, e)
        assert torch.equal(w["down"], ref["down"]), (qt, layer, e)


def _greedy(eng, ids: list[int], n: int) -> list[int]:
    from test_runtime import _engine_run

    with torch.no_grad():
        return _engine_run(eng, torch.tensor([ids]), n - 1)[1]


def test_f32_gguf_greedy_tokens_equal_the_safetensors_original(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    from moectl.runtime.engine import Engine

    ckpt, files = converted
    ids = [5, 17, 42, 9, 100, 7, 33, 2]
    gguf = _greedy(Engine.load(str(files["F32"]), progress=False, threads=1, workdir=str(tmp_path / "g")), ids, 12)
    st = _greedy(Engine.load(str(ckpt), progress=False, threads=1, workdir=str(tmp_path / "s")), ids, 12)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    # transformers' greedy argmax, step by step: `generate(min_new_tokens=...)` suppresses EOS, which these random
    # models may pick (tiny-mixtral does at step 6) while moectl's engine runs on through it
    seq = list(ids)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert gguf == st == seq[len(ids):]


def _moectl_ppl(path: Path, text: Path, tmp_path: Path, monkeypatch, capsys) -> float:
    monkeypatch.setattr(sys, "argv", ["moectl", "eval", "--model", str(path), "--dataset", str(text),
                                      "--llamacpp-windows", "--window", str(CTX), "--max-tokens", str(CTX * CHUNKS),
                                      "--prompts", "1", "--generate", "2", "--threads", "1", "--json",
                                      "--workdir", str(tmp_path)])
    try:
        cli.main()
    except SystemExit as e:
        assert e.code in (0, None)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"]


@pytest.mark.parametrize("qt", ("F32",) + QTYPES)
def test_perplexity_within_half_a_percent_of_llama_perplexity(converted, qt, text_file, tmp_path, monkeypatch,
                                                              capsys):
    _, files = converted
    llama = llamacpp.perplexity(files[qt], text_file, CTX, 1, chunks=CHUNKS, root=BUILD_ROOT)["ppl"]
    ours = _moectl_ppl(files[qt], text_file, tmp_path, monkeypatch, capsys)
    print(f"perplexity {files[qt].parent.name} {qt}: moectl {ours:.4f}, llama-perplexity {llama:.4f}, "
          f"{(ours / llama - 1) * 100:+.3f}%")
    assert abs(ours / llama - 1) < 0.005, (qt, ours, llama)


def test_kl_divergence_pairs_a_quantized_file_with_f32(converted, text_file, tmp_path):
    """`llamacpp.kl_divergence` (bench/fidelity.py's paired llama.cpp rows): F32 against itself is a ratio of 1 with
    an error near 0 and KLD ~0; Q4_0 against F32 has the same ratio as the two plain perplexities, and a KLD above
    Q8_0's."""
    _, files = converted
    logits = tmp_path / "f32.kld"
    kw = dict(ctx=CTX, threads=1, chunks=CHUNKS, root=BUILD_ROOT, logits=logits)
    same = llamacpp.kl_divergence(files["F32"], files["F32"], text_file, **kw)
    assert abs(same["ppl_ratio"] - 1) < 1e-3 and same["ppl_ratio_err"] < 1e-3 and abs(same["kld"]) < 1e-4
    q8, q4 = (llamacpp.kl_divergence(files["F32"], files[t], text_file, **kw) for t in ("Q8_0", "Q4_0"))
    plain = {t: llamacpp.perplexity(files[t], text_file, CTX, 1, chunks=CHUNKS, root=BUILD_ROOT)["ppl"]
             for t in ("F32", "Q4_0")}
    assert q4["ppl_ratio"] == pytest.approx(plain["Q4_0"] / plain["F32"], rel=2e-3)
    assert q4["ppl_ratio_err"] > 0 and q4["kld"] > q8["kld"] > 0 and 0 < q4["same_top"] <= q8["same_top"] <= 1


# GPT-OSS and DeepSeek-V2/V3 through llama.cpp's own converter and llama-quantize too, at the same encodings.
# llama.cpp's DeepSeek converter splits MLA's kv_b_proj per KV head and asserts as many KV heads as heads, which
# the real checkpoints have: the tiny configs here are set so.
MORE_FAMILIES = ("gpt_oss", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=MORE_FAMILIES)
def converted_more(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    import model_factory

    root = tmp_path_factory.mktemp(f"more-{request.param}")
    cfg = model_factory.family_configs()[request.param]
    if request.param.startswith("deepseek"):
        cfg.num_key_value_heads = cfg.num_attention_heads
        cfg.q_lora_rank = cfg.q_lora_rank or 32     # llama-quantize 0.3.36 requires deepseek2.attention.q_lora_rank
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():                       # random init leaves some tensors at 0: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt)
    model_factory.save_tokenizer(ckpt)
    files = {"F32": llamacpp.convert(ckpt, root / "m-F32.gguf", "f32", root=BUILD_ROOT)}
    for qt in QTYPES:
        files[qt] = llamacpp.quantize(files["F32"], root / f"m-{qt}.gguf", qt, threads=1, root=BUILD_ROOT)
    return ckpt, files


def test_more_families_experts_equal_gguf_reference_dequantisation(converted_more, request):
    if "gpt_oss" not in request.node.name:
        return test_experts_equal_gguf_reference_dequantisation(converted_more)
    for qt, layer, e, w, ref in _experts_and_references(converted_more[1]):
        gu = w["gate_up"]                       # GPT-OSS: transformers' layout, [H, 2I] with gate/up interleaved
        assert torch.equal(gu[:, 0::2], ref["gate"].T), (qt, layer, e)
        assert torch.equal(gu[:, 1::2], ref["up"].T), (qt, layer, e)
        assert torch.equal(w["down"], ref["down"].T), (qt, layer, e)                # [I, H]


def test_more_families_f32_gguf_runs_as_the_safetensors_original(converted_more, tmp_path, monkeypatch):
    """Logits of the F32 GGUF through moectl equal the safetensors original's through moectl (and greedy tokens).
    GPT-OSS's on the module path (`MOECTL_GGML_GRAPH=0`): its one graph is llama.cpp's, whose YaRN truncates the
    correction range where transformers (as GPT-OSS's config says) does not (tests/test_ggml_graph_gpt_oss.py)."""
    from moectl.runtime.engine import Engine

    ckpt, files = converted_more
    if (ckpt / "config.json").read_text().count('"gpt_oss"'):
        monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    ids = torch.tensor([[5, 17, 42, 9, 100, 7, 33, 2]])
    g = Engine.load(str(files["F32"]), progress=False, threads=1, workdir=str(tmp_path / "g"))
    s = Engine.load(str(ckpt), progress=False, threads=1, workdir=str(tmp_path / "s"))
    lg, ls = g.forward(ids)[0].float(), s.forward(ids)[0].float()
    assert torch.allclose(lg, ls, atol=1e-5, rtol=0), (lg - ls).abs().max()
    assert _greedy(g, ids[0].tolist(), 8) == _greedy(s, ids[0].tolist(), 8)


@pytest.mark.parametrize("qt", ("F32",) + QTYPES)
def test_more_families_perplexity_within_half_a_percent_of_llama_perplexity(converted_more, qt, text_file, tmp_path,
                                                                            monkeypatch, capsys):
    test_perplexity_within_half_a_percent_of_llama_perplexity(converted_more, qt, text_file, tmp_path, monkeypatch,
                                                              capsys)


# Issue 42: every other type llama-quantize makes of an MoE file, each through ggml in place (experts and dense)
EVERY_QTYPE = ("Q5_K_M", "Q6_K", "IQ4_XS", "Q3_K_M", "Q2_K", "IQ3_XXS", "IQ2_XXS", "MXFP4_MOE")


@pytest.fixture(scope="module", params=["k256-qwen3_moe", "k256-mixtral"])
def every_encoding(request, text_file, tmp_path_factory):
    """{type: GGUF file} of a k256 checkpoint (every row whole 256-weight blocks, so the K and IQ types are real) at
    EVERY_QTYPE; the IQ2/IQ3 types with an importance matrix from llama-imatrix on the held-out text, as users'
    dynamic quants are made."""
    root = tmp_path_factory.mktemp(f"every-{request.param}")
    ckpt = _family_checkpoint(CASES[request.param], root / "ckpt", 256)
    f32 = llamacpp.convert(ckpt, root / "m-F32.gguf", "f32", root=BUILD_ROOT)
    im = llamacpp.imatrix(f32, text_file, root / "imatrix.gguf", ctx=CTX, chunks=8, threads=1, root=BUILD_ROOT)
    return {qt: llamacpp.quantize(f32, root / f"m-{qt}.gguf", qt, threads=1, root=BUILD_ROOT,
                                  imatrix=im if qt.startswith(("IQ2", "IQ3")) else None) for qt in EVERY_QTYPE}


@pytest.mark.parametrize("qt", EVERY_QTYPE)
def test_every_encoding_perplexity_within_half_a_percent_of_llama_perplexity(every_encoding, qt, text_file, tmp_path,
                                                                             monkeypatch, capsys):
    test_perplexity_within_half_a_percent_of_llama_perplexity((None, every_encoding), qt, text_file, tmp_path,
                                                              monkeypatch, capsys)

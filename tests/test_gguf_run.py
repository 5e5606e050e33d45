"""`--model file.gguf` on the runtime: the F32 GGUF of a model runs as its safetensors original (logits and greedy
tokens); a Q4_K_M-like file (layers of different encodings) runs its packed experts in place, in emulated device
slots and from the disk tier with the same tokens as transformers' forward of gguf's reference dequantisation;
`inspect` states from the header what the run then holds; the packed size is the experts' size in sizing,
simulate and plan-cache; bad files are one `error:` line through the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_build import k256_mixtral, model_from_gguf, write_gguf
from model_factory import save_tokenizer
from moectl.runtime.engine import Engine
from moectl.store.facts import dense_nbytes, header_dense_nbytes
from test_bad_input import run_cli
from test_runtime import LOSSLESS_ATOL, _engine_run, _reference_run

PROMPT = torch.tensor([[5, 17, 42, 9, 100, 7]])
STEPS = 8


@pytest.fixture(scope="module")
def f32(tiny_small, tmp_path_factory):
    return write_gguf(tiny_small, tmp_path_factory.mktemp("run") / "tiny-F32.gguf")


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """Mixtral with whole 256-weight K blocks: gate/up Q4_K, down Q6_K in layer 0 and Q4_K in layer 1 (llama.cpp's
    Q4_K_M gives some layers' down_proj more bits), dense Q8_0."""
    root = tmp_path_factory.mktemp("run_q4km")
    return write_gguf(k256_mixtral(root), root / "tiny-Q4_K_M.gguf", dense_encoding=T.Q8_0,
                      expert_encoding=lambda layer, proj: T.Q6_K if (proj == "down" and layer == 0) else T.Q4_K)


@pytest.mark.parametrize("kw", [{}, {"ggml": False}, {"emulate_device": True, "cache_experts": 6},
                                {"emulate_device": True, "offload": "disk", "cache_experts": 6}],
                         ids=["in-place", "in-place-torch", "one-slot-per-layer", "disk"])
def test_f32_gguf_runs_as_the_safetensors_original(tiny_small, f32, kw, tmp_path, monkeypatch):
    """Logits of the F32 GGUF through the runtime equal transformers' forward of the safetensors checkpoint
    (within the project's lossless tolerance: the runtime computes each expert as its own matmuls) and the
    greedy tokens are the same. In place: ggml's kernels on the mapped file where built (F32 weights: x stays
    f32, so the wiring is checked exactly), and torch's path (`MOECTL_GGML=0`)."""
    kw = dict(kw)
    if not kw.pop("ggml", True):
        monkeypatch.setenv("MOECTL_GGML", "0")
    ref_logits, ref_ids = _reference_run(tiny_small, PROMPT, STEPS)
    eng = Engine.load(str(f32), progress=False, threads=1, workdir=str(tmp_path), **kw)
    logits, ids = _engine_run(eng, PROMPT, STEPS)
    assert ids == ref_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= LOSSLESS_ATOL
    st = Engine.load(str(tiny_small), progress=False, threads=1, workdir=str(tmp_path / "st"), **kw)
    a, b = eng.generate("The cat", max_new_tokens=8), st.generate("The cat", max_new_tokens=8)  # tokenizer too
    assert (a.prompt_ids, a.token_ids, a.text) == (b.prompt_ids, b.token_ids, b.text)
    assert eng.tokenizer("The cat sat")["input_ids"] == st.tokenizer("The cat sat")["input_ids"]


def test_split_gguf_runs(tiny_small, f32, tmp_path):
    first = write_gguf(tiny_small, tmp_path / "split.gguf", split_max_tensors=8)
    assert first.name == "split-00001-of-00008.gguf" or first.name.startswith("split-00001-of-")
    eng = Engine.load(str(first), progress=False, threads=1)
    assert eng.ref.name == "split" and eng.ref.workdir.name == "split"
    assert _engine_run(eng, PROMPT, 4)[1] == _engine_run(Engine.load(str(f32), progress=False, threads=1),
                                                         PROMPT, 4)[1]


# ggml's kernels quantize x to 8 bits per block before each expert product (each product within the bound
# tests/test_ggml_kernels.py derives and at its emulation's fp32 summation); through this random model's 2 layers the
# logits moved by 0.028 against a largest logit of 1.12 (2.5 %): twice that. The wiring itself is exact: an F32
# file's experts through ggml (f32 x, no quantization) equal the original within LOSSLESS_ATOL
# (test_f32_gguf_runs_as_the_safetensors_original[in-place]).
GGML_LOGITS_RTOL = 0.05


def ggml_or_skip():
    from moectl.kernels import ggml

    if ggml.library() is None:
        pytest.skip(f"ggml is not built here: {ggml.why_not()}")


@pytest.mark.parametrize("kw", [{}, {"ggml": True}, {"emulate_device": True, "cache_experts": 2},
                                {"emulate_device": True, "offload": "disk", "cache_experts": 2},
                                {"emulate_device": True, "cache_experts": 2, "prefill": "stream",
                                 "prefetch": "gate-reuse"}],
                         ids=["in-place", "in-place-ggml", "slots", "disk", "streamed-prefill"])
def test_mixed_encodings_run_as_reference_dequantisation(q4km, kw, tmp_path, monkeypatch):
    """Every layer's experts dequantised with its own encodings, wherever they are computed: greedy tokens and
    logits as transformers' forward of the model rebuilt with gguf's reference dequantisation (fp32: equal up to
    the order of the expert sums, LOSSLESS_ATOL). In place with ggml (the experts where they lie in the mapped
    file, x quantized per block as llama.cpp does): the same tokens, logits within GGML_LOGITS_RTOL."""
    kw = dict(kw)
    use_ggml = kw.pop("ggml", False)
    monkeypatch.setenv("MOECTL_GGML", "1" if use_ggml else "0")
    if use_ggml:
        ggml_or_skip()
    ref = model_from_gguf(q4km)
    want_logits, want = [], []
    with torch.no_grad():
        ids = PROMPT
        for _ in range(STEPS + 1):
            logits = ref(input_ids=ids).logits[0]
            want_logits.append(logits[-1])
            want.append(int(logits[-1].argmax()))
            ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
    eng = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path), **kw)
    logits, got = _engine_run(eng, PROMPT, STEPS)
    assert got == want
    err = max((a[-1] - b).abs().max().item() for a, b in zip(logits, want_logits))
    if use_ggml:
        from moectl.formats.gguf_ggml import GgufMappedFormat

        assert all(isinstance(f, GgufMappedFormat) for f in eng.store.formats)     # ggml, on the mapped file
        assert sum(b.numel() for b in eng.store.buffers) == 2 * 4 * 8              # nothing read: indices only
        scale = max(b.abs().max().item() for b in want_logits)
        assert err <= GGML_LOGITS_RTOL * scale, (err, scale)
    else:
        assert err <= LOSSLESS_ATOL
    if kw:
        assert eng.cache.stats.misses > 0               # the slots were really filled from the packed copies


def test_inspect_states_what_the_run_holds_with_ggml(q4km, capsys, monkeypatch, tmp_path):
    """With ggml the CPU in place holds the file's expert bytes, mapped: `inspect` says so, and the run reads none of
    them into its own buffers."""
    ggml_or_skip()
    code, out, err = run_cli(["inspect", "--model", str(q4km), "--json", "--device", "cpu",
                              "--workdir", str(tmp_path)], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(out)
    cpu = info["gguf"]["cpu_in_place"]
    assert cpu["kernel"] == "ggml" and cpu["mapped"] and not cpu["int4_repacked"]
    assert cpu["expert_bytes"] == info["gguf"]["expert_bytes"] == 4 * (5 * 256 * 144 + 256 * 210)
    eng = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path))
    assert sum(b.numel() for b in eng.store.buffers) == 2 * 4 * 8                  # the experts' indices only
    assert "ggml" in eng.plan_note
    # rows of the stacked ffn_*_exps: a decode layer is one mul_mat_id graph (kernels/ggml.py: experts_decode)
    w = eng.store.formats[1].weights({"expert": torch.tensor([3])})
    assert w["down"].stacked[0] == 3 and w["gate_up"].stacked[1][0][1] == 4


def test_inspect_states_what_the_run_holds(q4km, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MOECTL_GGML", "0")                     # torch's int4 path (where ggml is not built)
    code, out, err = run_cli(["inspect", "--model", str(q4km), "--json", "--device", "cpu",
                              "--workdir", str(tmp_path)], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(out)
    q4k, q6k = 256 * 256 // 256 * 144, 256 * 256 // 256 * 210
    assert info["expert_format"] == "gguf-Q4_K+Q6_K,gguf-Q4_K"
    assert info["bits_per_weight"] == pytest.approx(8 * 4 * (5 * q4k + q6k) / (2 * 4 * 3 * 256 * 256))
    assert info["gguf"]["expert_bytes"] == 4 * (5 * q4k + q6k)                     # the file's
    assert info["bytes_per_expert"] == 2 * q4k + q6k                               # a slot holds layer 0's
    eng = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path))
    store = eng.store
    assert store.expert_nbytes == info["bytes_per_expert"]
    assert info["expert_bytes"] == info["memory"]["full_copies_bytes"] == 2 * 4 * (2 * q4k + q6k)  # slots, RAM tier
    # in place on the CPU the Q4_K matrices are repacked for the int4 kernel (fp32 scales: 6 bits per weight), the
    # Q6_K down_proj of layer 0 as two 4-bit planes with fp32 (scale, zero') per 16 weights (12 bits per weight)
    cpu = info["gguf"]["cpu_in_place"]
    assert cpu["int4_repacked"] and sum(b.numel() for b in store.buffers) == cpu["expert_bytes"] == \
        4 * ((2 * 256 * 256 * 6 // 8 + 256 * 256 * 12 // 8) + 3 * 256 * 256 * 6 // 8)
    disk = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path), emulate_device=True)
    assert sum(b.numel() for b in disk.store.buffers) == info["expert_bytes"]        # the RAM tier: packed as stored
    assert info["dense_bytes"] == dense_nbytes(eng.model, eng.config)
    assert header_dense_nbytes(eng.ckpt, eng.adapter, torch.float32) == sum(
        p.numel() * 4 for p in eng.model.parameters())               # the host check's dense, from the header


def test_packed_size_in_sizing_simulate_and_plan(q4km, tmp_path, capsys, monkeypatch):
    from moectl.core.shapes import expert_bytes
    from moectl.store.facts import model_sizes
    from moectl.store.gguf.shape import gguf_shape

    slot = 2 * 256 * 256 // 256 * 144 + 256 * 256 // 256 * 210
    assert expert_bytes(gguf_shape(q4km)) == slot                           # simulate --model-shape x.gguf
    assert model_sizes(str(q4km), str(tmp_path)).full_expert_bytes == slot        # plan-cache, --budget
    from moectl.core.sizing import DEVICE_LIBRARY_BYTES

    budget = str(18_000_000 + DEVICE_LIBRARY_BYTES)                               # 18 MB besides the libraries'
    common = ["--model", str(q4km), "--budget", budget, "--device", "cpu", "--json", "--workdir", str(tmp_path)]
    code, out, err = run_cli(["inspect", *common], capsys, monkeypatch)
    assert code == 0, err
    plan = json.loads(out)["memory"]
    assert plan["bytes_per_expert_full"] == slot
    # 18 MB less dense, KV reserve and workspace leaves room for a few packed experts (bf16 ones would not fit one)
    assert 2 < plan["full_slots"] < 8, plan
    code, out, err = run_cli(["generate", *common, "--prompt", "ab", "--max-new-tokens", "2", "--threads", "1",
                              "--emulate-device", "--prefetch", "none"], capsys, monkeypatch)
    assert code == 0, err
    assert sum(json.loads(out)["config"]["slots"][0]) == plan["full_slots"]


def test_fingerprint_sees_the_encodings(tiny_small, f32, tmp_path):
    from moectl.models import config_fingerprint
    from moectl.store.gguf.model import GgufModel

    q8 = write_gguf(tiny_small, tmp_path / "tiny-Q8_0.gguf", expert_encoding=T.Q8_0)
    assert config_fingerprint(GgufModel(q8).config) != config_fingerprint(GgufModel(f32).config)


def test_quantize_says_the_experts_are_low_bit(q4km, capsys, monkeypatch, tmp_path):
    code, out, err = run_cli(["quantize", "--model", str(q4km), "--workdir", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and err.startswith("error:") and "already stored low-bit (gguf-Q4_K+Q6_K,gguf-Q4_K" in err


def _truncated(good, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:good.stat().st_size - 4096])
    return bad


def _missing_part(tiny_small, tmp_path):
    first = write_gguf(tiny_small, tmp_path / "m.gguf", split_max_tensors=8)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    return first


def _unsupported_encoding(tiny_small, tmp_path):
    # Q8_1: ggml's activation encoding, never a weight's (IQ4_NL, here before, is computed now: ggml)
    return write_gguf(tiny_small, tmp_path / "q8_1.gguf", expert_encoding=T.Q8_1)


def _contradicting(tiny_small, tmp_path):
    return write_gguf(tiny_small, tmp_path / "bad.gguf", meta={"{arch}.feed_forward_length": 96})


def _unsupported_arch(tiny_small, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    w = GGUFWriter(path, "phi2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BAD = {"truncated": (lambda ts, f, tp: _truncated(f, tp), ["cut.gguf", "truncated"]),
       "missing split part": (lambda ts, f, tp: _missing_part(ts, tp), ["m-00002-of-00003.gguf"]),
       "unsupported encoding": (lambda ts, f, tp: _unsupported_encoding(ts, tp), ["q8_1.gguf", "Q8_1"]),
       "contradicting metadata": (lambda ts, f, tp: _contradicting(ts, tp), ["bad.gguf", "metadata"]),
       "unsupported architecture": (lambda ts, f, tp: _unsupported_arch(ts, tp), ["phi.gguf", "phi2"])}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("command", ["generate", "inspect"])
def test_bad_gguf_is_one_error_line(case, command, tiny_small, f32, tmp_path, capsys, monkeypatch):
    make, needles = BAD[case]
    path = make(tiny_small, f32, tmp_path)
    args = [command, "--model", str(path), "--workdir", str(tmp_path / "wd")]
    args += ["--prompt", "a", "--max-new-tokens", "1", "--threads", "1"] if command == "generate" else []
    code, out, err = run_cli(args, capsys, monkeypatch)
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_gguf_name_without_path_separator(f32, tmp_path, monkeypatch, capsys):
    """`--model tiny-F32.gguf` in the current directory is the file, not a recipe name."""
    shutil.copy(f32, tmp_path / "here.gguf")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["inspect", "--model", "here.gguf", "--json", "--workdir", str(tmp_path / "wd")],
                             capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["model"] == "here"


def test_chat_and_serve_on_a_gguf(q4km, tmp_path):
    """`moectl chat` (piped stdin) and `moectl serve` (OpenAI client) take a GGUF: the chat template from its
    metadata, the server's greedy answer the runtime's own."""
    import os
    import subprocess
    import sys

    from serve_helpers import MODEL, cli_server, greedy_chat

    env = dict(os.environ, MOECTL_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "moectl.cli", "chat", "--model", str(q4km), "--max-new-tokens", "6",
                           "--greedy", "--threads", "1"], input="hello\n/exit\n", capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert sum("tok/s" in line for line in proc.stdout.splitlines()) == 1
    eng = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path / "wd"))
    assert eng.tokenizer.chat_template                                   # tokenizer.chat_template of the file
    ids, want = greedy_chat(eng, "hello", 6)
    with cli_server(q4km, tmp_path) as live:
        got = live.client().chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                                     messages=[{"role": "user", "content": "hello"}])
    assert got.choices[0].message.content == want


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_every_family_runs_its_f32_gguf_as_the_original(family, tmp_path):
    """The runtime (experts in emulated device slots, one per layer: each expert copied as the file's bytes, then
    computed) on each family's F32 GGUF gives the safetensors original's greedy tokens, logits within the lossless
    tolerance (DeepSeek-V3 from today's attn_k_b / attn_v_b layout)."""
    from test_gguf_model import build_with_rope

    build_with_rope(family, tmp_path / "ckpt")
    save_tokenizer(tmp_path / "ckpt")
    path = write_gguf(tmp_path / "ckpt", tmp_path / f"{family}.gguf", mla_split=family == "deepseek_v3")
    kw = dict(progress=False, threads=1, emulate_device=True, cache_experts=4)
    want_logits, want = _engine_run(Engine.load(str(tmp_path / "ckpt"), workdir=str(tmp_path / "s"), **kw), PROMPT, 6)
    logits, got = _engine_run(Engine.load(str(path), workdir=str(tmp_path / "g"), **kw), PROMPT, 6)
    assert got == want
    assert max((a - b).abs().max().item() for a, b in zip(logits, want_logits)) <= LOSSLESS_ATOL


def test_q8_0_in_place_on_the_int4_kernel(tiny_small, tmp_path, monkeypatch):
    """Q8_0 experts in place are two 4-bit planes on the int4 kernel (fp32 scales): tokens and logits as
    transformers' forward of gguf's reference dequantisation, and as the emulated device's dequantise-per-use."""
    monkeypatch.setenv("MOECTL_GGML", "0")
    path = write_gguf(tiny_small, tmp_path / "tiny-Q8_0.gguf", expert_encoding=T.Q8_0)
    eng = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path))
    assert all(f.planes == {"gate_up", "down"} for f in eng.store.formats)
    ref = model_from_gguf(path)
    with torch.no_grad():
        want = ref(input_ids=PROMPT).logits[0]
    got, _ = eng.forward(PROMPT)
    assert (got[0] - want).abs().max().item() <= LOSSLESS_ATOL
    slots = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path), emulate_device=True)
    assert _engine_run(eng, PROMPT, 6)[1] == _engine_run(slots, PROMPT, 6)[1]


@pytest.mark.parametrize("encoding", [T.Q4_0, T.Q8_0], ids=["Q4_0", "Q8_0"])
def test_in_place_int4_kernel_with_experts_narrower_than_the_kernels_row_block(encoding, tmp_path, monkeypatch):
    """Qwen2-MoE-like experts of 32 rows (gate and up each): repacked in place for the CPU int4 kernel (Q4_0 direct,
    Q8_0 as two planes), gate and up stacked as one matrix. Packing each and stacking the packed bytes computed
    garbage when a part is not a whole number of the kernel's row blocks; the run equals transformers' forward of the
    model rebuilt from gguf's reference dequantisation."""
    from model_factory import build_family

    ckpt = tmp_path / "ckpt"
    build_family("qwen2_moe", ckpt)
    save_tokenizer(ckpt)
    path = write_gguf(ckpt, tmp_path / "m.gguf", expert_encoding=encoding)
    with torch.no_grad():
        want = model_from_gguf(path)(input_ids=PROMPT).logits[0]
    monkeypatch.setenv("MOECTL_GGML", "0")
    eng = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path / "w"))
    assert eng.store.formats[0].int4 or eng.store.formats[0].planes          # the kernel path, not dequantisation
    with torch.no_grad():
        got = eng.forward(PROMPT)[0][0].float()
    assert (got - want).abs().max().item() <= LOSSLESS_ATOL


def test_cpu_experts_side_computes_gguf_bytes_with_ggml(q4km, tmp_path):
    """`--cpu-experts` (the CPU side of a GPU run, emulated): misses computed from the RAM tier's GGUF bytes by ggml
    (`GgufExpertFormat.cpu_weights`: no dequantisation); the tokens of transformers' forward of the dequantised
    model, logits within GGML_LOGITS_RTOL."""
    ggml_or_skip()
    from moectl.kernels.ggml import GgmlLinear

    ref = model_from_gguf(q4km)
    with torch.no_grad():
        ids, want, want_logits = PROMPT, [], []
        for _ in range(STEPS + 1):
            logits = ref(input_ids=ids).logits[0]
            want_logits.append(logits[-1])
            want.append(int(logits[-1].argmax()))
            ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
    eng = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path), emulate_device=True,
                      cache_experts=2, cpu_experts="always")
    store = eng.store
    w = store.format_of("full", 0).cpu_weights(eng.runtime.cpu.host_views(0, 1))
    assert isinstance(w["gate_up"], GgmlLinear) and isinstance(w["down"], GgmlLinear)
    logits, got = _engine_run(eng, PROMPT, STEPS)
    assert eng.runtime.cpu_experts > 0                      # misses were computed on the CPU side
    assert got == want
    err = max((a[-1] - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= GGML_LOGITS_RTOL * max(b.abs().max().item() for b in want_logits)

"""The GGUF tokenizer saved in the workdir, read back without transformers (moectl/store/gguf/tokenizer.py:
SavedTokenizer) is transformers' tokenizer loaded from the same directory: the same ids, text, special tokens and
chat-template ids, on a byte-level BPE vocabulary (gpt2 / qwen2 style, with a Qwen3-style chat template) and a
sentencepiece one (llama style: BOS added, byte fallback, with Mixtral's template), and on the 152k-token
Qwen3-MoE file of bench/gguf_vs_llamacpp.py where it is on this machine. Reading it, encoding and decoding import
neither torch nor transformers (a fresh interpreter)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from gguf_build import k256_mixtral, write_gguf
from moectl.store.gguf.model import GgufModel
from moectl.store.gguf.saved_config import cache_key
from moectl.store.gguf.tokenizer import SavedTokenizer, clean_up_tokenization, saved_tokenizer, tokenizer_key

ROOT = Path(__file__).resolve().parents[1]
REAL = Path.home() / ".cache/moectl/gguf_vs_llamacpp/qwen3-moe-2/model-Q4_K_M.gguf"

TEXTS = ["", " ", "   leading and trailing   ", "Hello world", "ünïcödé ñ 日本語 Ελληνικά", "emoji 😀👍🏽🇫🇷",
         "a\nb\n\n c\t\td\r\n", "<|im_start|>user\nwhat is 2+2?<|im_end|>\n", "<|endoftext|>x<|pad|>",
         "<s>[INST] hi [/INST]</s>", "don't , . ? it 's , they 're", "<unk> <0x41> \u2581word", "1234567 + 89"]

# Qwen3's chat template (Qwen/Qwen3-30B-A3B, tokenizer_config.json), reproduced for the test: namespace, a
# reversed loop, string methods, `is string` / `is defined` tests, enable_thinking.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Mixtral-8x7B-Instruct's template: the BOS token as a variable, raise_exception on roles out of turn
MIXTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
                    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
                    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
                    "roles are supported!') }}{% endif %}{% endfor %}")

CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "user", "content": "What is 2+2?"},
          {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4", "tool_calls": None}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "ünïcode 😀 and <|im_end|> inside, </s> too"}]]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{"bpe": a GGUF with the checkpoint's byte-level BPE and Qwen3's template, "spm": the same model with a
    sentencepiece-style vocabulary and Mixtral's template}, written the way llama.cpp's converter does."""
    root = tmp_path_factory.mktemp("gguf_tok")
    ckpt = k256_mixtral(root, layers=1)
    (ckpt / "chat_template.jinja").write_text(QWEN3_TEMPLATE)     # SpecialVocab takes it into the metadata
    return {"bpe": write_gguf(ckpt, root / "bpe.gguf"),
            "spm": write_gguf(ckpt, root / "spm.gguf", spm_vocab=True, chat_template=MIXTRAL_TEMPLATE)}


def _saved(gguf: Path, cache: Path):
    """(ours, transformers') from the directory GgufModel.tokenizer(cache) saves (a first run)."""
    from transformers import AutoTokenizer

    GgufModel(gguf).tokenizer(cache)
    ours = saved_tokenizer(cache, [gguf])
    assert isinstance(ours, SavedTokenizer)
    return ours, AutoTokenizer.from_pretrained(cache)


@pytest.fixture(scope="module", params=["bpe", "spm"])
def pair(request, ggufs, tmp_path_factory):
    return (request.param,) + _saved(ggufs[request.param], tmp_path_factory.mktemp("cache") / "gguf-tokenizer")


def _same_ids_and_text(ours, theirs, texts):
    for text in texts:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), \
                    (text, special, skip)


def test_same_ids_and_text_as_transformers(pair):
    kind, ours, theirs = pair
    _same_ids_and_text(ours, theirs, TEXTS)
    assert ours._backend.to_str() == theirs.backend_tokenizer.to_str()     # the very same backend, added tokens and all
    if kind == "bpe":       # no BOS added; the special-token strings are one token each, dropped by skip
        assert ours("Hello world")["input_ids"] == ours("Hello world", add_special_tokens=False)["input_ids"]
        ids = ours("<|im_start|>user\nhi<|im_end|>")["input_ids"]
        assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>") == 2 and ids[-1] == 3
        assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"
    else:                   # llama.cpp's sentencepiece: BOS (1) first; bytes outside the pieces by fallback
        assert ours("Hello world")["input_ids"][0] == 1
        assert ours("Hello world", add_special_tokens=False)["input_ids"][0] != 1
        ids = ours("😀")["input_ids"]
        assert ids == [1, ours.convert_tokens_to_ids("\u2581")] + [3 + b for b in "😀".encode()]
        assert ours.decode(ids, skip_special_tokens=True) == "😀" and ours.decode(ids) == "<s> 😀"


def test_special_tokens_and_vocabulary(pair):
    kind, ours, theirs = pair
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "special_tokens_map", "all_special_tokens", "all_special_ids", "vocab_size",
                 "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    expected = {"bpe": (0, 0, 1, None), "spm": (1, 2, None, 0)}[kind]       # the files' bos, eos, pad, unk ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == expected
    assert len(ours) == len(theirs) == 512 and ours.get_vocab() == theirs.get_vocab()
    ids = [ours.bos_token_id, 100, 200, ours.eos_token_id, 300]
    for skip in (True, False):
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
            theirs.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(100) == theirs.convert_ids_to_tokens(100)
    assert ours.convert_tokens_to_ids(["<|im_end|>", "</s>", "no-such-token"]) == \
        theirs.convert_tokens_to_ids(["<|im_end|>", "</s>", "no-such-token"])
    twin = copy.deepcopy(ours)                              # serve encodes with a copy (serve/app.py)
    assert twin.encode(TEXTS[7]) == ours.encode(TEXTS[7]) and twin.decode([100, 200]) == ours.decode([100, 200])


def test_chat_template_ids_as_transformers(pair):
    """apply_chat_template(add_generation_prompt=True), as moectl's chat_ids calls it: the same text and ids for
    one to four messages; Qwen3's template also with enable_thinking=False; a template's raise_exception the same
    error."""
    from moectl.runtime.generation import chat_ids

    kind, ours, theirs = pair
    chats = CHATS if kind == "bpe" else [CHATS[0], CHATS[1], CHATS[2][1:]]   # Mixtral's has no system role
    for chat in chats:
        for extra in ({}, {"enable_thinking": False}) if kind == "bpe" else ({},):
            text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **extra)
            assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **extra) == text
            ids = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, **extra)["input_ids"]
            assert ours.apply_chat_template(chat, add_generation_prompt=True, **extra)["input_ids"] == ids
            assert ours.apply_chat_template(chat, add_generation_prompt=True, return_dict=False, **extra) == ids
        assert chat_ids(ours, chat) == chat_ids(theirs, chat)
    other = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"     # a template given
    assert ours.apply_chat_template(CHATS[0], tokenize=False, chat_template=other) == \
        theirs.apply_chat_template(CHATS[0], tokenize=False, chat_template=other)
    if kind == "bpe":       # Qwen3's tools branch: the schemas through its tojson
        tools = [{"type": "function", "function": {"name": "weather", "description": "Météo à Paris",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        assert ours.apply_chat_template(CHATS[2], tools=tools, add_generation_prompt=True)["input_ids"] == \
            theirs.apply_chat_template(CHATS[2], tools=tools, add_generation_prompt=True)["input_ids"]
        assert "Météo" in ours.apply_chat_template(CHATS[2], tools=tools, tokenize=False)
    if kind == "bpe":
        text = ours.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
        assert text == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n"
                        "</think>\n\n4<|im_end|>\n<|im_start|>assistant\n")
        assert chat_ids(ours, CHATS[0])[0] == 2 and chat_ids(ours, CHATS[0])[-1] != 2   # <|im_start|> whole
    else:
        ids = chat_ids(ours, CHATS[0])
        assert ids[0] == 1 and ids.count(1) == 1            # the template's {{ bos_token }}, encoded once
        bad = [{"role": "assistant", "content": "first"}]
        with pytest.raises(jinja2.TemplateError, match="must alternate") as mine:
            ours.apply_chat_template(bad, add_generation_prompt=True)
        with pytest.raises(jinja2.TemplateError) as ref:
            theirs.apply_chat_template(bad, add_generation_prompt=True)
        assert str(mine.value) == str(ref.value)


def test_template_environment_as_transformers(ggufs, tmp_path):
    """The jinja environment transformers renders in: trim/lstrip blocks, loop controls, namespace, its tojson
    (non-ASCII kept), dict(), strftime_now, the {% generation %} tag, the special tokens as variables, a message
    key set to None dropped, reasoning under its aliases; a namespace attribute with an underscore refused."""
    from transformers import AutoTokenizer

    template = """{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {{ m | tojson }}|{{ dict(a=1) | tojson }}|{{ m.thinking is defined }}|{{ 'name' in m }}
{% endfor %}
{% generation %}{{ ns.n }} {{ bos_token }} {{ eos_token }} {{ pad_token }} {{ strftime_now('%Y') }}{% endgeneration %}
{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"""
    cache = tmp_path / "gguf-tokenizer"
    GgufModel(ggufs["bpe"]).tokenizer(cache)
    (cache / "chat_template.jinja").write_text(template)
    ours, theirs = saved_tokenizer(cache, [ggufs["bpe"]]), AutoTokenizer.from_pretrained(cache)
    chat = [{"role": "user", "content": "ünï \"q\" <b>", "name": None}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "ok", "reasoning": "because"}, {"role": "user", "content": "4th"}]
    text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
    assert '"ünï \\"q\\" <b>"' in text and "False|False" in text and "True|False" in text and "4th" not in text
    assert ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == \
        theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    (cache / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        saved_tokenizer(cache, [ggufs["bpe"]]).apply_chat_template(chat)


def test_clean_up_tokenization_spaces_as_transformers(ggufs, tmp_path):
    """clean_up_tokenization_spaces: transformers skips it for a BPE model unless told to corrupt; so does this."""
    from transformers import AutoTokenizer

    cache = tmp_path / "gguf-tokenizer"
    GgufModel(ggufs["bpe"]).tokenizer(cache)
    config = json.loads((cache / "tokenizer_config.json").read_text())
    text = "don't , . ? ! it 's , they 're , we 've I 'm"
    for flags in ({"clean_up_tokenization_spaces": True},
                  {"clean_up_tokenization_spaces": True,
                   "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}):
        (cache / "tokenizer_config.json").write_text(json.dumps(config | flags))
        ours, theirs = saved_tokenizer(cache, [ggufs["bpe"]]), AutoTokenizer.from_pretrained(cache)
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, clean_up_tokenization_spaces=False) == \
            theirs.decode(ids, clean_up_tokenization_spaces=False) == text
    assert ours.decode(ids) == "don't,.?! it's, they're, we've I'm"               # the second: cleaned
    assert clean_up_tokenization(text) == theirs.clean_up_tokenization(text)


def _plain_token(cache: Path) -> str:
    """A multi-character token of the vocabulary that is no added token (text containing it splits otherwise)."""
    vocab = json.loads((cache / "tokenizer.json").read_text())["model"]["vocab"]
    return max((t for t in vocab if t.isalpha() and not t.startswith("<")), key=len)


# saved directories other files or transformers versions write, each read by transformers in its own way
VARIANTS = {
    "pad is a plain token": lambda c, t: _edit(c, "tokenizer_config.json", pad_token=t),
    "extra special tokens": lambda c, t: _edit(c, "tokenizer_config.json", extra_special_tokens=[t, "<|new|>"]),
    "legacy additional_special_tokens": lambda c, t: _edit(c, "tokenizer_config.json",
                                                           additional_special_tokens=[t]),
    "AddedToken dict": lambda c, t: _edit(c, "tokenizer_config.json", eos_token={
        "__type": "AddedToken", "content": t, "lstrip": False, "rstrip": False, "normalized": False,
        "single_word": False, "special": True}),
    "special_tokens_map.json": lambda c, t: (c / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": t, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
         "pad_token": "<|mask|>"})),
    "no post-processor": lambda c, t: _edit(c, "tokenizer.json", post_processor=None),
    "add_bos_token in the config": lambda c, t: _edit(c, "tokenizer_config.json", add_bos_token=False,
                                                      add_eos_token=True),
    "a named token that strips": lambda c, t: _edit(c, "tokenizer.json", added_tokens=[
        a | {"lstrip": True, "rstrip": True} for a in json.loads((c / "tokenizer.json").read_text())["added_tokens"]]),
    "split_special_tokens": lambda c, t: _edit(c, "tokenizer_config.json", split_special_tokens=True),
}


def _edit(cache: Path, name: str, **fields) -> None:
    (cache / name).write_text(json.dumps(json.loads((cache / name).read_text()) | fields))


@pytest.mark.parametrize("kind", ["bpe", "spm"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_saved_variants_read_as_transformers_reads_them(ggufs, tmp_path, kind, variant):
    """A named special token that is a plain vocabulary token becomes special (whole in text, skipped in
    decode), new ones are added, special_tokens_map.json overrides the config, add_bos/eos_token in the config
    are ignored beside a tokenizer.json whose post-processor says it, a missing post-processor adds nothing:
    the same backend, ids, text and special ids as transformers in every case."""
    from transformers import AutoTokenizer

    cache = tmp_path / "gguf-tokenizer"
    GgufModel(ggufs[kind]).tokenizer(cache)
    plain = _plain_token(cache)
    VARIANTS[variant](cache, plain)
    ours, theirs = saved_tokenizer(cache, [ggufs[kind]]), AutoTokenizer.from_pretrained(cache)
    assert ours is not None
    assert ours._backend.to_str() == theirs.backend_tokenizer.to_str()
    _same_ids_and_text(ours, theirs, TEXTS + [f"a{plain}b {plain}. <|new|> <|mask|>", "x  </s>  y <|endoftext|> z"])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_tokens", "all_special_ids",
                 "special_tokens_map"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs)


def test_saved_tokenizer_only_for_this_file_and_these_versions(ggufs, tmp_path):
    """None (the caller builds it with transformers) without a cache, for a rewritten file, a cache another
    transformers wrote, or a directory holding what SavedTokenizer does not model; the key is GgufModel's, with the
    installed versions read without importing transformers; the saved config's key names the file the same way."""
    import tokenizers
    import transformers

    f = tmp_path / "m.gguf"
    shutil.copy(ggufs["spm"], f)
    cache = tmp_path / "work" / "gguf-tokenizer"
    assert saved_tokenizer(cache, [f]) is None                               # nothing saved yet
    g = GgufModel(f)
    g.tokenizer(cache)
    assert tokenizer_key([f]) == g._tokenizer_key() == json.loads((cache / "source.json").read_text())
    assert tokenizer_key([f])["transformers"] == transformers.__version__
    assert tokenizer_key([f])["tokenizers"] == tokenizers.__version__
    # the saved config's key (saved_config.py) names the same file as it is now, and the same transformers
    config_key = cache_key([f])
    assert config_key["files"] == tokenizer_key([f])["files"] == [[str(f), f.stat().st_size, f.stat().st_mtime_ns]]
    assert config_key["transformers"] == transformers.__version__
    assert g.saved_tokenizer(cache).encode("hi") == g.tokenizer(cache).encode("hi")
    source = json.loads((cache / "source.json").read_text())
    (cache / "source.json").write_text(json.dumps(source | {"transformers": "0.0-other"}))
    assert saved_tokenizer(cache, [f]) is None
    (cache / "source.json").write_text(json.dumps(source))
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))                 # the file rewritten
    assert saved_tokenizer(cache, [f]) is None
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert saved_tokenizer(cache, [f]) is not None
    config = json.loads((cache / "tokenizer_config.json").read_text())
    (cache / "tokenizer_config.json").write_text(json.dumps(config | {"image_token": "<img>"}))
    assert saved_tokenizer(cache, [f]) is None                               # a key it does not model
    (cache / "tokenizer_config.json").write_text(json.dumps(config))
    (cache / "added_tokens.json").write_text("{}")
    assert saved_tokenizer(cache, [f]) is None                               # a file it does not read
    (cache / "added_tokens.json").unlink()
    (cache / "tokenizer.json").write_text("{")
    assert saved_tokenizer(cache, [f]) is None                               # half-written


CHILD = r"""
import json, sys
from pathlib import Path
from moectl.store.gguf.tokenizer import saved_tokenizer
tok = saved_tokenizer(Path(sys.argv[1]), [Path(sys.argv[2])])
texts = json.loads(sys.argv[3])
ids = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
out = {"ids": ids, "text": [tok.decode(i, skip_special_tokens=True) for i in ids],
       "chat": tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"],
       "eos": tok.eos_token_id, "modules": sorted(m for m in ("torch", "transformers") if m in sys.modules)}
print("RESULT " + json.dumps(out))
"""


def test_reading_encoding_decoding_imports_neither_torch_nor_transformers(pair, ggufs, tmp_path):
    kind, ours, theirs = pair
    cache = tmp_path / "gguf-tokenizer"
    GgufModel(ggufs[kind]).tokenizer(cache)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(cache), str(ggufs[kind]), json.dumps(TEXTS)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["modules"] == []
    assert out["ids"] == [theirs(t)["input_ids"] for t in TEXTS]
    assert out["text"] == [theirs.decode(i, skip_special_tokens=True) for i in out["ids"]]
    chat = [{"role": "user", "content": "hi"}]
    assert out["chat"] == theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert out["eos"] == theirs.eos_token_id


@pytest.mark.skipif(not REAL.exists(), reason=f"{REAL} is not on this machine (bench/gguf_vs_llamacpp.py makes it)")
def test_real_qwen3_moe_file(tmp_path):
    """The 151,936-token vocabulary and the chat template of the Qwen3-MoE-shaped file that
    bench/gguf_vs_llamacpp.py has llama.cpp's converter write."""
    ours, theirs = _saved(REAL, tmp_path / "gguf-tokenizer")
    assert len(ours) == len(theirs) == 151936
    assert ours._backend.to_str() == theirs.backend_tokenizer.to_str()
    _same_ids_and_text(ours, theirs, TEXTS + ["<think>\nreasoning\n</think>\n\nanswer", "def f(x):\n    return x"])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_ids", "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    for chat in CHATS:
        assert ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == \
            theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]

"""A GGUF's tokenizer read back from the workdir without torch or transformers (issue 42: load to first token).

The first run of a GGUF file builds its tokenizer with transformers (`config.py: gguf_tokenizer`) and
`GgufModel.tokenizer(cache)` saves it in the workdir's `gguf-tokenizer/` (tokenizer.json, tokenizer_config.json,
chat_template.jinja) with `source.json`, the key of the file and the versions that wrote it. Reading it back
through `AutoTokenizer` costs importing transformers (~1.5 s); `saved_tokenizer(cache, paths)` reads it with the
`tokenizers` library and jinja2 alone, as a `SavedTokenizer`: the part of transformers' tokenizer that
the generate / chat / serve paths use (`tok(text)["input_ids"]`, encode, decode, the special tokens and their
ids, the chat template), giving the same ids and text (tests/test_gguf_tokenizer.py compares the two).

What transformers 5.x does when it loads such a directory, and this does the same way:
  - tokenizer.json is the backend as saved; `add_bos_token` / `add_eos_token` in the config are dropped when a
    tokenizer.json exists (its post-processor, written by the converter, already adds BOS or not);
  - the named special tokens (bos_token, eos_token, ...; special_tokens_map.json over the config) and the extra
    ones are (re-)added to the backend as special tokens, the added tokens of tokenizer.json first;
  - `decode` cleans up tokenization spaces only where the config asks and the model is not a BPE;
  - the chat template is rendered like `transformers.utils.chat_template_utils`: an immutable sandbox with
    trim_blocks, lstrip_blocks and loop controls, `raise_exception`, `strftime_now`, its `tojson`, `dict` and
    `namespace`, the `{% generation %}` tag, the special tokens as variables; then encoded without special tokens.
A directory saved with anything this does not model (another tokenizer class, a config key not listed in
`CONFIG_KEYS`, several chat templates, added_tokens.json) is not read: `saved_tokenizer` returns None and the
caller takes transformers' path.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from .files import source_key

# transformers' named special tokens, in its order (SPECIAL_TOKENS_ATTRIBUTES)
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys whose effect this class reproduces (or which change nothing it answers)
CONFIG_KEYS = frozenset(NAMED_SPECIAL) | {
    "backend", "tokenizer_class", "model_max_length", "add_bos_token", "add_eos_token", "chat_template",
    "clean_up_tokenization_spaces", "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
    "extra_special_tokens", "additional_special_tokens", "split_special_tokens", "padding_side",
    "truncation_side", "model_input_names", "errors"}
TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# files save_pretrained writes that this reads (source.json is moectl's key); any other file: not ours to read
KNOWN_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
               "source.json"}


class Unsupported(ValueError):
    """The saved directory holds something SavedTokenizer does not reproduce (the caller uses transformers)."""


def tokenizer_key(paths, transformers_version: str | None = None, tokenizers_version: str | None = None) -> dict:
    """`source.json`'s content: the GGUF file(s) (`files.py: source_key`) and the transformers and tokenizers
    versions that saved the tokenizer. The versions default to the installed distributions' (importlib.metadata: no
    import of transformers); GgufModel passes the imported modules' `__version__`, the same strings."""
    return source_key(paths, {"transformers": transformers_version, "tokenizers": tokenizers_version})


def saved_tokenizer(cache: Path, paths) -> SavedTokenizer | None:
    """The tokenizer saved in `cache` (a workdir's `gguf-tokenizer/`) when its `source.json` is this very file's
    (`paths`: the GGUF's file or split parts) under the installed transformers and tokenizers, and holds only what
    SavedTokenizer reproduces; else None (none saved, a stale or foreign one, unreadable, unsupported), and the
    caller builds it with transformers (`GgufModel.tokenizer(cache)`, which saves it for the next run)."""
    cache = Path(cache)
    try:
        if json.loads((cache / "source.json").read_text()) != tokenizer_key(paths):
            return None
        return SavedTokenizer(cache)
    except Exception:           # unreadable, half-written or unsupported: transformers' path, which rewrites it
        return None


class SavedTokenizer:
    """A tokenizer directory saved by transformers' `save_pretrained` (a TokenizersBackend), read without it."""

    def __init__(self, directory: Path):
        from tokenizers import AddedToken, Tokenizer, processors

        directory = Path(directory)
        other = sorted(p.name for p in directory.iterdir() if p.name not in KNOWN_FILES)
        if other:
            raise Unsupported(f"{directory}: files this does not read: {other}")
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        unknown = sorted(set(config) - CONFIG_KEYS)
        if unknown:
            raise Unsupported(f"{directory}: tokenizer_config.json keys this does not model: {unknown}")
        if config.get("tokenizer_class", TOKENIZER_CLASSES[0]) not in TOKENIZER_CLASSES:
            raise Unsupported(f"{directory}: tokenizer class {config['tokenizer_class']!r}")
        template_file = directory / "chat_template.jinja"          # the file wins over the config's entry
        self.chat_template = (template_file.read_text(encoding="utf-8") if template_file.exists()
                              else config.get("chat_template"))
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise Unsupported(f"{directory}: several chat templates")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe = bool(config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))

        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # the added tokens as tokenizer.json spells them (transformers reads them from the JSON; the backend holds
        # the same, without parsing a 152k-token file twice): a named special token takes its flags from there
        added = backend.get_added_tokens_decoder()
        by_content = {str(t): t for t in added.values()}

        def token(value):
            if isinstance(value, dict):          # {"__type": "AddedToken", "content": ...}
                return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
            if value is None or isinstance(value, str):
                return value
            raise Unsupported(f"{directory}: a special token {value!r}")

        named = {name: token(config.get(name)) for name in NAMED_SPECIAL}
        if (directory / "special_tokens_map.json").exists():    # legacy file: over the config (transformers too)
            for name, value in json.loads((directory / "special_tokens_map.json").read_text(encoding="utf-8")).items():
                if name in NAMED_SPECIAL:
                    named[name] = (AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
                                   if isinstance(value, dict) else value)
                elif name not in ("additional_special_tokens", "extra_special_tokens") or value:
                    raise Unsupported(f"{directory}: special_tokens_map.json entry {name!r}")
        named = {name: by_content.get(str(v), v) if v is not None else None for name, v in named.items()}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if not isinstance(extra, list):
            raise Unsupported(f"{directory}: model-specific special tokens {extra!r}")
        extra = [token(t) for t in extra]

        # TokenizersBackend.__init__: no truncation; every added token, then the special tokens it lacks
        if backend.truncation is not None:
            raise Unsupported(f"{directory}: a saved truncation")
        backend.no_truncation()
        update_post_processor = backend.post_processor is None
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        to_add = [added[i] for i in sorted(added)]
        have = set(by_content)
        for value in [v for v in named.values() if v is not None] + extra:
            if str(value) not in have and value not in to_add:
                to_add.append(value)
        names = [str(v) for v in named.values() if v]
        tokens = []
        for t in to_add:
            if isinstance(t, str):
                t = AddedToken(t, special=True)
            elif not t.special and str(t) in names:
                t.special = True
            tokens.append(t)
        if tokens:
            backend.add_tokens(tokens)
        # its _post_init (from_pretrained): the named and extra special tokens added as special
        post = [v if isinstance(v, AddedToken) else AddedToken(v, special=True, normalized=False)
                for v in [v for v in named.values() if v is not None] + extra]
        if post:
            backend.add_special_tokens(post)
        if update_post_processor or backend.post_processor is None:   # add_bos/eos_token were dropped: neither
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        backend.no_padding()                    # transformers' call pads nothing unless asked (never here)
        self._backend = backend
        self._named = {name: str(v) for name, v in named.items() if v is not None}
        self._extra = [str(t) for t in extra]

    # --- special tokens ---------------------------------------------------------------------------
    def _token_id(self, name: str) -> int | None:
        return self.convert_tokens_to_ids(self._named[name]) if name in self._named else None

    bos_token = property(lambda self: self._named.get("bos_token"))
    eos_token = property(lambda self: self._named.get("eos_token"))
    unk_token = property(lambda self: self._named.get("unk_token"))
    pad_token = property(lambda self: self._named.get("pad_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (the chat template sees them as variables)."""
        return dict(self._named)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(list(self._named.values()) + self._extra))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # --- vocabulary -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return index if index is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # --- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """{"input_ids", "attention_mask"} of one text, like transformers' BatchEncoding of a single input."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers skips the clean-up for a BPE model (it would eat real spaces before punctuation)
        if clean and (type(self._backend.model).__name__ != "BPE" or self._clean_up_bpe):
            text = clean_up_tokenization(text)
        return text

    # --- chat -------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, chat_template: str | None = None,
                            **kwargs):
        """The conversation through the chat template: the text (tokenize=False), or its ids encoded without
        special tokens ({"input_ids", "attention_mask"} with return_dict, as transformers 5.x gives by default).
        `tools` are JSON schemas (not functions, which transformers converts), `documents` dicts; `kwargs` are
        template variables (e.g. enable_thinking), over the special tokens. `chat_template`: a template's text to
        render instead of the saved one (as transformers takes it)."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        messages = _aliased_reasoning([{k: v for k, v in m.items() if v is not None} for m in conversation])
        text = _compiled(template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces a word-piece tokenizer leaves before punctuation."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# the names a message's reasoning goes under; templates read the first (transformers' _REASONING_FIELDS)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _aliased_reasoning(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in transformers' environment (utils/chat_template_utils.py), compiled once."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's part (for a mask nobody asks for
        here); its body renders as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)

"""What the built-in `tiny` model is (`moectl/synth/tiny.py` builds it): its sizes (`SIZES`), the corpus each trains on,
the question/answer chats made from it, the byte-level BPE tokenizer with a ChatML template, the MixtralConfig,
and how a trained model is scored (`evaluate`: validation perplexity beside a unigram baseline, router entropy)."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]      # ids 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinySpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    heads: int
    kv_heads: int
    num_experts: int
    top_k: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    aux_loss_coef: float = 0.02
    chat_fraction: float = 0.15     # share of training sequences that start a question/answer chat
    eval_tokens: int = 32768        # validation tokens scored (at most)
    corpus: str = "builtin"         # builtin (pydoc text) | stdlib (+ the standard library's source: calib/stdlib_corpus)
    train_stride: int = 1           # keep every n-th training document (small variants)
    val_stride: int = 1
    tokenizer_stride: int = 1       # the tokenizer learns from every n-th training document
    threads: int = 0                # 0: 2, or 1 when the cores are busy; else exactly this many (reproducible)
    time_cap: bool = True           # without an explicit --steps, stop at MAX_TRAIN_SECONDS
    checkpoint_every: int = 0       # save a resumable training state every n steps (0: never)


FULL = TinySpec(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=6, heads=4, kv_heads=2,
                num_experts=8, top_k=2, seq_len=64, batch_size=8, steps=600, lr=1e-2, eval_tokens=16384)
SMALL = TinySpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, heads=4, kv_heads=2,
                 num_experts=8, top_k=2, seq_len=64, batch_size=16, steps=150, lr=1e-2, eval_tokens=8192,
                 train_stride=4, val_stride=2, threads=1, time_cap=False)
# The reference model (`--size reference`, see moectl/reference.py): big and trained enough that its quality
# depends on its expert weights; fixed steps, fixed threads, resumable. 700 steps (0.7 M tokens) left llama.cpp's
# Q4_0 inside the measurement's noise; transformers' grouped expert matmul trains ~1,700 tokens/s at 2 threads
# here (it was ~200 with the per-expert loop), so 4,000 steps (4.1 M tokens) take ~40 min.
REFERENCE = TinySpec(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=8, heads=8, kv_heads=4,
                     num_experts=8, top_k=2, seq_len=256, batch_size=4, steps=4000, lr=6e-3, chat_fraction=0.0,
                     eval_tokens=32768, corpus="stdlib", tokenizer_stride=3, threads=2, time_cap=False,
                     checkpoint_every=100)
# The reference recipe scaled down for tests: same corpus and resume logic, seconds of training.
REFERENCE_SMALL = TinySpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, heads=4, kv_heads=2,
                           num_experts=8, top_k=2, seq_len=64, batch_size=16, steps=32, lr=1e-2, eval_tokens=2048,
                           corpus="stdlib", train_stride=40, val_stride=8, threads=1, time_cap=False,
                           checkpoint_every=8)
SIZES = {"tiny": FULL, "small": SMALL, "reference": REFERENCE, "reference-small": REFERENCE_SMALL}


# ---------------------------------------------------------------------------------------------- data

def qa_pairs(docs: list[str], seed: int = 0) -> list[tuple[str, str]]:
    """Question/answer chats made from the docs: 'What does f do?' -> 'f(sig): first docstring sentence.'"""
    pairs = []
    entry = re.compile(r"^(?P<ind> *)(?P<name>[A-Za-z_][\w.]*)\((?P<args>[^)\n]{0,80})\)\n(?P=ind) +(?P<doc>\S[^\n]+)", re.M)
    module = re.compile(r"^Name\n +(?P<name>[\w.]+) - (?P<doc>[^\n]+)", re.M)
    questions = ["What does {} do?", "Explain {}.", "How do I use {}?", "Tell me about {}.", "What is {}?"]
    rng = random.Random(seed)
    for text in docs:
        for m in module.finditer(text):
            pairs.append((f"What is the {m['name']} module?", f"The {m['name']} module: {m['doc'].strip()}"))
        for m in entry.finditer(text):
            name = m["name"]
            if name.startswith("_"):
                continue
            answer = f"{name}({m['args']}): {m['doc'].strip()}"
            pairs.append((rng.choice(questions).format(name), answer))
    greetings = ["hello", "hi", "Hello!", "hi there", "hey"]
    intro = "Hello! I am the tiny moectl model. I know a little about the Python standard library."
    pairs += [(g, intro) for g in greetings] * 20
    rng.shuffle(pairs)
    return pairs


def chat_text(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer) trained on `texts`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                 pad_token="<|pad|>", unk_token=None)
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 1 << 30             # we tokenize whole documents; set to the context length on save
    return hf


def token_stream(tokenizer, texts: list[str]):
    """Texts -> one LongTensor of ids, each text followed by <|endoftext|> (id 0)."""
    import torch

    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    flat = [t for seq in ids for t in (*seq, 0)]
    return torch.tensor(flat, dtype=torch.long)


# ---------------------------------------------------------------------------------------------- model

def tiny_config(spec: TinySpec):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k, max_position_embeddings=1024,
        router_aux_loss_coef=spec.aux_loss_coef, output_router_logits=True, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=3, pad_token_id=1, rms_norm_eps=1e-5,
    )


def evaluate(model, val_ids, spec: TinySpec, unigram_logp) -> dict:
    """Validation perplexity, the unigram baseline on the same target tokens, routing entropies per layer."""
    import torch

    E, K = spec.num_experts, spec.top_k
    n_windows = max(1, min(len(val_ids) - 1, spec.eval_tokens) // spec.seq_len)
    windows = val_ids[: n_windows * spec.seq_len + 1]
    inputs = windows[:-1].view(n_windows, spec.seq_len)              # [W, S]
    targets = windows[1:].view(n_windows, spec.seq_len)
    nll, count = 0.0, 0
    usage = torch.zeros(spec.num_layers, E, dtype=torch.float64)      # [L, E] top-k picks
    router_entropy = torch.zeros(spec.num_layers, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for start in range(0, n_windows, spec.batch_size):
            x, y = inputs[start:start + spec.batch_size], targets[start:start + spec.batch_size]
            out = model(input_ids=x, output_router_logits=True)
            logp = torch.log_softmax(out.logits.float(), -1)         # [B, S, V]
            nll -= logp.gather(-1, y[..., None]).sum().item()
            count += y.numel()
            for layer, logits in enumerate(out.router_logits):        # [B*S, E]
                probs = torch.softmax(logits.double(), -1)
                router_entropy[layer] -= (probs * probs.clamp_min(1e-12).log2()).sum()
                top = torch.topk(logits, K, -1).indices
                usage[layer] += torch.bincount(top.flatten(), minlength=E).double()
    model.train()
    usage_p = usage / usage.sum(-1, keepdim=True)
    usage_entropy = -(usage_p * usage_p.clamp_min(1e-12).log2()).sum(-1)
    unigram_nll = -unigram_logp[targets.flatten()].sum().item()
    return {
        "val_tokens": count,
        "val_ppl": math.exp(nll / count),
        "unigram_ppl": math.exp(unigram_nll / count),
        "uniform_entropy_bits": math.log2(E),
        # marginal expert usage (the load-balancing loss pushes it towards uniform)
        "usage_entropy_bits": [round(v, 4) for v in usage_entropy.tolist()],
        # mean per-token entropy of the router softmax: low = each token routes decisively
        "router_entropy_bits": [round(v, 4) for v in (router_entropy / count).tolist()],
        "usage": [[round(p, 4) for p in row] for row in usage_p.tolist()],
    }


def corpus_texts(spec: TinySpec) -> tuple[list[str], list[str], list[str]]:
    """(training texts, held-out texts, texts the chat pairs are made from) of a recipe."""
    from ..calib.builtin_corpus import builtin_corpus
    from ..calib.stdlib_corpus import stdlib_corpus

    if spec.corpus == "stdlib":
        train, val, docs = stdlib_corpus("train"), stdlib_corpus("heldout"), stdlib_corpus("train", kind="doc")
    else:
        train, val = builtin_corpus("train"), builtin_corpus("validation")
        docs = train
    return train[::spec.train_stride], val[::spec.val_stride], docs[::spec.train_stride]

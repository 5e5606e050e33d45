"""The built-in `tiny` model: a small Mixtral trained on the built-in corpus, so the whole tool can run anywhere.

`build_tiny(workdir)` does, from a fixed seed, on the CPU:
  1. the built-in corpus (pydoc text of the standard library, `moectl.calib.dataset`), train/validation split;
  2. a byte-level BPE tokenizer trained on the train split, with a ChatML chat template;
  3. a MixtralForCausalLM (full: 6 layers, hidden 128, 8 experts of intermediate 384, top-2, vocab 2048:
     7.9 M params, 2.3 M active per token) trained with next-token loss plus the router load-balancing loss,
     on the train text and on short question/answer chats made from it (so `moectl chat` answers in the chat
     format and stops at <|im_end|>);
  4. `save_pretrained` -> `<workdir>/checkpoint/` (safetensors with per-expert keys, tokenizer, generation config),
     an ordinary Hugging Face checkpoint that every command reads like a real one;
  5. `<workdir>/tiny.json`: validation perplexity next to a unigram baseline on the very same tokens, and per-layer
     routing entropies (bits) next to uniform (log2 E).

Training is bounded: `steps` (default 600 of 8x64 tokens) and, only when `steps` is not given, a wall-time cap
(`MAX_TRAIN_SECONDS`, the learning-rate schedule follows whichever runs out first) so that a busy machine still
finishes within about 3 minutes; tiny.json records the steps done. Measured on the shared 2-core box: 300-420
steps in 120 s, val ppl 51-92 vs unigram 415, per-token router entropy 0.5-1.9 bits vs 3. An explicit `steps`
(and the small variant) has no time cap: same steps and thread count -> same weights (seeded init and data order).
Threads: 2, or 1 when the cores are already busy (2 OpenMP threads fighting other work are 3-50x slower).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import MoectlError

TINY_FORMAT = 1
STATE_DIR = "train-state"                # resumable training state (sizes with checkpoint_every)
MAX_TRAIN_SECONDS = 120.0
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
# depends on its expert weights; fixed steps, fixed threads, resumable.
REFERENCE = TinySpec(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=8, heads=8, kv_heads=4,
                     num_experts=8, top_k=2, seq_len=256, batch_size=4, steps=700, lr=6e-3, chat_fraction=0.0,
                     eval_tokens=32768, corpus="stdlib", tokenizer_stride=3, threads=1, time_cap=False,
                     checkpoint_every=50)
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


def build_tiny(workdir: Path, steps: int | None = None, force: bool = False, small: bool = False,
               progress: bool = True, seed: int = 0, size: str | None = None, stop_after: int | None = None) -> Path:
    """Build and train the tiny model into `<workdir>/checkpoint`; returns that directory.

    `size` picks the recipe (`SIZES`: tiny, small, reference, reference-small; `small=True` is size "small").
    An existing build (tiny.json + checkpoint) is kept unless `force`. Concurrent builders of one workdir
    wait on a lock file and then reuse the build the first one made. A size with `checkpoint_every` saves a
    training state as it goes and a new call continues from it; `stop_after` ends this call after that many
    steps (the state stays for the next call) and returns None."""
    import torch

    size = size or ("small" if small else "tiny")
    if size not in SIZES:
        raise MoectlError(f"unknown size {size!r}; sizes: {', '.join(SIZES)}")
    workdir = Path(workdir).expanduser()
    ckpt = workdir / "checkpoint"
    if steps is not None and steps <= 0:
        raise MoectlError(f"--steps must be positive, got {steps}")
    if _built(workdir) and not force:
        return ckpt
    workdir.mkdir(parents=True, exist_ok=True)
    with _locked(workdir / ".build.lock"):
        if _built(workdir) and not force:
            return ckpt                                        # another process built it while we waited
        if force:
            shutil.rmtree(workdir / STATE_DIR, ignore_errors=True)
        threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
        try:
            return _build(workdir, size, steps, progress, seed, stop_after)
        finally:                                               # leave the process as we found it
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)


def _built(workdir: Path) -> bool:
    try:
        report = json.loads((workdir / "tiny.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return report.get("format") == TINY_FORMAT and (workdir / "checkpoint" / "config.json").exists()


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def corpus_texts(spec: TinySpec) -> tuple[list[str], list[str], list[str]]:
    """(training texts, held-out texts, texts the chat pairs are made from) of a recipe."""
    from .calib.dataset import builtin_corpus
    from .calib.stdlib_corpus import stdlib_corpus

    if spec.corpus == "stdlib":
        train, val, docs = stdlib_corpus("train"), stdlib_corpus("heldout"), stdlib_corpus("train", kind="doc")
    else:
        train, val = builtin_corpus("train"), builtin_corpus("validation")
        docs = train
    return train[::spec.train_stride], val[::spec.val_stride], docs[::spec.train_stride]


def _build(workdir: Path, size: str, steps: int | None, progress: bool, seed: int, stop_after: int | None):
    import torch
    from transformers import GenerationConfig, MixtralForCausalLM

    ckpt = workdir / "checkpoint"
    report_path = workdir / "tiny.json"
    report_path.unlink(missing_ok=True)                        # no report until the new checkpoint is complete
    spec = SIZES[size]
    planned_steps = steps if steps is not None else spec.steps
    time_cap = MAX_TRAIN_SECONDS if (steps is None and spec.time_cap) else None
    t_start = time.perf_counter()
    torch.manual_seed(seed)
    threads = spec.threads or (1 if _busy() else 2)
    torch.set_num_threads(threads)   # on a shared, busy machine 2 threads spin against other work: 1 is 3-50x faster
    torch.use_deterministic_algorithms(True, warn_only=True)
    label = size if size != "small" else "tiny (small)"
    state_dir = workdir / STATE_DIR
    run_key = {"size": size, "spec": asdict(spec), "seed": seed, "planned_steps": planned_steps, "threads": threads}
    resume = _load_state(state_dir, run_key) if spec.checkpoint_every else None

    say = _say if progress else (lambda msg: None)
    say(f"building {label} into {workdir}: corpus and tokenizer")
    # 1-2. corpus, tokenizer, token streams
    train_docs, val_docs, qa_docs = corpus_texts(spec)
    pairs = qa_pairs(qa_docs, seed)
    if resume is not None:                     # the very tokenizer the saved weights were trained with
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(state_dir / "tokenizer")
        tokenizer.model_max_length = 1 << 30
    else:
        tokenizer = train_tokenizer(train_docs[::spec.tokenizer_stride] + [chat_text(q, a) for q, a in pairs[:2000]],
                                    spec.vocab_size)
    train_ids = token_stream(tokenizer, train_docs)                           # [N]
    chat_ids = token_stream(tokenizer, [chat_text(q, a) for q, a in pairs])   # [M]
    val_ids = token_stream(tokenizer, val_docs)
    counts = torch.bincount(train_ids, minlength=spec.vocab_size).double() + 1.0   # add-one unigram model
    unigram_logp = (counts / counts.sum()).log()

    # 3. model + training
    config = tiny_config(spec)
    model = MixtralForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    n_chat = round(spec.batch_size * spec.chat_fraction)
    start, losses, trained_before = 0, [], 0.0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        gen.set_state(resume["generator"])
        torch.set_rng_state(resume["torch_rng"])
        start, losses, trained_before = resume["step"], resume["losses"], resume["train_seconds"]
        say(f"resuming from step {start} of {planned_steps} ({state_dir})")
    elif spec.checkpoint_every:
        shutil.rmtree(state_dir, ignore_errors=True)
        tokenizer.save_pretrained(state_dir / "tokenizer")

    # chat windows start where a chat starts, so the model learns "<|im_start|>user ... assistant\n" -> answer
    chat_starts = torch.cat([torch.zeros(1, dtype=torch.long), (chat_ids == 0).nonzero().flatten() + 1])
    chat_starts = chat_starts[chat_starts < len(chat_ids) - spec.seq_len - 1]

    def windows(stream, n, starts=None):                                      # n random windows [n, S+1]
        if starts is None:
            starts = torch.randint(0, len(stream) - spec.seq_len - 1, (n,), generator=gen)
        else:
            starts = starts[torch.randint(0, len(starts), (n,), generator=gen)]
        return torch.stack([stream[s:s + spec.seq_len + 1] for s in starts.tolist()])

    from .progress import ProgressBar

    done, t_train = start, time.perf_counter()
    with ProgressBar(progress) as bar:
        task = bar.add(f"training {label}", planned_steps)
        bar.update(task, advance=start)
        for step in range(start, planned_steps):
            # progress drives the schedule: steps done, or wall time used when the time cap binds first, so a
            # busy machine still warms up and anneals fully (just over fewer steps)
            frac = step / planned_steps
            if time_cap is not None:
                frac = max(frac, (time.perf_counter() - t_train) / time_cap)
            if frac >= 1.0:
                break
            if stop_after is not None and step - start >= stop_after:
                return None                                    # the saved state carries on next time
            warm = min(1.0, (frac + 1e-3) / 0.05)                              # 5% warmup, cosine to 10%
            for group in opt.param_groups:
                group["lr"] = spec.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
            batch = windows(train_ids, spec.batch_size - n_chat)                      # [B, S+1]
            if n_chat:
                batch = torch.cat([batch, windows(chat_ids, n_chat, chat_starts)])
            out = model(input_ids=batch, labels=batch, output_router_logits=True)   # labels shift inside: S targets
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            done = step + 1
            losses.append(out.loss.item())
            bar.update(task, advance=1, info=f"loss {losses[-1]:.3f} aux {out.aux_loss.item():.3f}")
            if spec.checkpoint_every and done % spec.checkpoint_every == 0 and done < planned_steps:
                _save_state(state_dir, run_key, model, opt, gen, done, losses,
                            trained_before + time.perf_counter() - t_train)
    train_seconds = trained_before + time.perf_counter() - t_train

    # 4. evaluation and save
    say("evaluating on the held-out split and saving the checkpoint")
    metrics = evaluate(model, val_ids, spec, unigram_logp)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[3, 0], pad_token_id=1)
    from transformers.utils import logging as hf_logging

    tmp = workdir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()                  # one tiny shard: no "Writing model shards" bar
    model.save_pretrained(tmp)
    hf_logging.enable_progress_bar()
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(ckpt, ignore_errors=True)
    _drop_stale_artifacts(workdir)
    tmp.rename(ckpt)
    report = {
        "format": TINY_FORMAT, "variant": {"tiny": "full"}.get(size, size), "seed": seed,
        "params": n_params, "threads": threads, "steps": done, "planned_steps": planned_steps,
        "stopped_by_time_cap": done < planned_steps, "resumed_at_step": start if resume is not None else None,
        "train_seconds": round(train_seconds, 1), "build_seconds": round(time.perf_counter() - t_start, 1),
        "train_tokens": int(done * spec.batch_size * spec.seq_len), "corpus_tokens": int(len(train_ids)),
        "chat_pairs": len(pairs), "final_train_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "spec": asdict(spec), **metrics,
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=1))
    shutil.rmtree(state_dir, ignore_errors=True)       # the checkpoint is complete: the training state is spent
    return ckpt


def _drop_stale_artifacts(workdir: Path) -> None:
    """Remove what was made from the previous weights: low-bit copies and sensitivities are checked against the
    model fingerprint, which hashes the config only, so a rebuilt model (same config, new weights) would
    silently reuse them. (eval/ and ppl-proxy.json also key on the weights' files: they stay.)"""
    from .calib.sensitivity import JSON_NAME

    for path in [*workdir.glob("experts-*"), workdir / JSON_NAME]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _save_state(state_dir: Path, run_key: dict, model, opt, gen, step: int, losses: list, train_seconds: float):
    """Everything the next step depends on (weights, optimizer moments, data-order RNG), written atomically."""
    import torch

    tmp = state_dir / "state.pt.tmp"
    torch.save({"key": run_key, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "generator": gen.get_state(), "torch_rng": torch.get_rng_state(), "step": step,
                "losses": list(losses), "train_seconds": train_seconds}, tmp)
    tmp.replace(state_dir / "state.pt")


def _load_state(state_dir: Path, run_key: dict) -> dict | None:
    """The saved training state of this very run (same recipe, seed, steps, threads), else None."""
    import torch

    path = state_dir / "state.pt"
    if not path.exists() or not (state_dir / "tokenizer" / "tokenizer.json").exists():
        return None
    try:
        state = torch.load(path, weights_only=False)
    except Exception:                                  # a torn or foreign file: start over
        return None
    return state if state.get("key") == run_key else None


def _busy() -> bool:
    """Is another process already using the cores (1-minute load average)?"""
    try:
        return os.getloadavg()[0] > 1.0
    except OSError:
        return False


def ensure_tiny(workdir: Path, progress: bool = True) -> Path:
    """The tiny checkpoint directory, built on first use."""
    return build_tiny(Path(workdir), progress=progress)


def tiny_report(workdir: Path) -> dict | None:
    path = Path(workdir).expanduser() / "tiny.json"
    return json.loads(path.read_text()) if path.exists() else None


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[dim]{msg}[/]", highlight=False)

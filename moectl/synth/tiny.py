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
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import MoectlError
from .tiny_recipe import SIZES, chat_text, corpus_texts, evaluate, qa_pairs, tiny_config, token_stream, train_tokenizer

TINY_FORMAT = 1
STATE_DIR = "train-state"                # resumable training state (sizes with checkpoint_every)
MAX_TRAIN_SECONDS = 120.0
SEED_ENV = "MOECTL_TINY_SEED"            # another seed, another model (the suite's check that it needs no one model)


def default_seed() -> int:
    """The training seed when the caller gives none: $MOECTL_TINY_SEED, else 0."""
    raw = os.environ.get(SEED_ENV, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise MoectlError(f"{SEED_ENV} must be an integer, not {raw!r}") from None


def build_tiny(workdir: Path, steps: int | None = None, force: bool = False, small: bool = False,
               progress: bool = True, seed: int | None = None, size: str | None = None,
               stop_after: int | None = None) -> Path:
    """Build and train the tiny model into `<workdir>/checkpoint`; returns that directory.

    `size` picks the recipe (`SIZES`: tiny, small, reference, reference-small; `small=True` is size "small").
    An existing build (tiny.json + checkpoint) is kept unless `force`. Concurrent builders of one workdir
    wait on a lock file and then reuse the build the first one made. A size with `checkpoint_every` saves a
    training state as it goes and a new call continues from it; `stop_after` ends this call after that many
    steps (the state stays for the next call) and returns None. `seed` defaults to `default_seed()`
    ($MOECTL_TINY_SEED, else 0); a build made with another seed is not reused (it is rebuilt in place)."""
    import torch

    size = size or ("small" if small else "tiny")
    if size not in SIZES:
        raise MoectlError(f"unknown size {size!r}; sizes: {', '.join(SIZES)}")
    workdir = Path(workdir).expanduser()
    ckpt = workdir / "checkpoint"
    if steps is not None and steps <= 0:
        raise MoectlError(f"--steps must be positive, got {steps}")
    seed = default_seed() if seed is None else seed
    if _built(workdir, seed) and not force:
        return ckpt
    workdir.mkdir(parents=True, exist_ok=True)
    with _locked(workdir / ".build.lock"):
        if _built(workdir, seed) and not force:
            return ckpt                                        # another process built it while we waited
        if force:
            shutil.rmtree(workdir / STATE_DIR, ignore_errors=True)
        threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
        try:
            return _build(workdir, size, steps, progress, seed, stop_after)
        finally:                                               # leave the process as we found it
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)


def _built(workdir: Path, seed: int | None = None) -> bool:
    """A complete build of this format and seed (default: `default_seed()`; the seed is part of the cache key:
    another one trains anew)."""
    seed = default_seed() if seed is None else seed
    try:
        report = json.loads((workdir / "tiny.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (report.get("format") == TINY_FORMAT and report.get("seed", 0) == seed
            and (workdir / "checkpoint" / "config.json").exists())


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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

    from ..progress import ProgressBar

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
    from ..artifacts.sensitivity import JSON_NAME

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


def tiny_built(workdir: Path) -> bool:
    """Whether `workdir` holds a complete tiny build of this format and of the seed in force (`default_seed`)."""
    return _built(Path(workdir).expanduser())


def tiny_report(workdir: Path) -> dict | None:
    path = Path(workdir).expanduser() / "tiny.json"
    return json.loads(path.read_text()) if path.exists() else None


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[dim]{msg}[/]", highlight=False)

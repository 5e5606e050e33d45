"""Chat loop over the offloading runtime: streamed answers, /reset, /stats, /exit.

Interactive on a terminal (rich prompt, tokens streamed as they come); line-oriented when stdin is a pipe:
one user message per input line, the answer on stdout, then a status line (tokens/s, cache hit rate, bytes
loaded). Multi-turn: the conversation is kept as messages and the chat template is re-applied each turn
(no KV reuse across turns), with the oldest turns dropped when the context would overflow.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, TextIO

HELP = "/reset clears the conversation, /stats shows session totals, /exit (or Ctrl-D) quits"


@dataclass
class SessionTotals:
    turns: int = 0
    tokens: int = 0
    seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    load_wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, stats: dict) -> None:
        self.turns += 1
        self.tokens += stats["tokens"]
        self.seconds += stats["seconds"]
        self.hits += stats["hits"]
        self.misses += stats["misses"]
        self.bytes_loaded += stats["bytes_loaded"]
        self.load_wait_s += stats["load_wait_s"]

    def as_dict(self) -> dict:
        lookups = self.hits + self.misses
        return {"turns": self.turns, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                "hits": self.hits, "misses": self.misses, "hit_rate": self.hits / lookups if lookups else 0.0,
                "bytes_loaded": self.bytes_loaded,
                "bytes_per_token": self.bytes_loaded / self.tokens if self.tokens else 0.0,
                "load_wait_s": self.load_wait_s}


class ChatSession:
    """One conversation with an Engine: messages in, streamed answers out."""

    def __init__(self, engine, max_new_tokens: int = 128, greedy: bool = False, temperature: float = 0.8,
                 top_p: float = 0.95, seed: int | None = 0, system: str | None = None):
        self.engine = engine
        self.max_new_tokens, self.greedy, self.temperature, self.top_p = max_new_tokens, greedy, temperature, top_p
        from ..runtime.generation import check_text

        self.seed, self.system = seed, system if system is None else check_text(system, "--system")
        self.messages: list[dict] = []
        self.totals = SessionTotals()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> list[int]:
        """The conversation through the chat template (plain 'User: ...' fallback), oldest turns dropped to fit."""
        from ..errors import MoectlError
        from ..runtime.generation import chat_ids

        limit = getattr(self.engine.config, "max_position_embeddings", None) or 4096
        keep = 1 if self.system else 0
        messages = list(self.messages)                       # the turns dropped only once the prompt fits
        while True:
            ids = chat_ids(self.engine.tokenizer, messages)
            if len(ids) + self.max_new_tokens <= limit:
                self.messages = messages
                return ids
            if len(messages) <= keep + 1:                    # the message alone does not fit: refused, not cut
                raise MoectlError(
                    f"message not sent: it is {len(ids):,} tokens with the chat template, and the model's context "
                    f"holds {limit:,} including the answer's {self.max_new_tokens:,} (--max-new-tokens): at most "
                    f"{limit - self.max_new_tokens:,} fit; send a shorter one")
            del messages[keep:keep + 2]                      # drop the oldest user/assistant pair

    def ask(self, text: str, on_token: Callable[[int, str], None] | None = None):
        """Add the user's message, generate the answer (streamed through on_token), remember it."""
        return self.answer(self.add_message(text), on_token)

    def add_message(self, text: str) -> list[int]:
        """Add the user's message; the prompt's token ids. A message that cannot fit the context even alone is an
        error and left out of the conversation."""
        from ..runtime.generation import check_text

        self.messages.append({"role": "user", "content": check_text(text, "the message")})
        try:
            return self.prompt_ids()
        except Exception:
            self.messages.pop()
            raise

    def answer(self, ids: list[int], on_token: Callable[[int, str], None] | None = None):
        """Generate the answer to prompt `ids` (streamed through on_token), remember it."""
        seed = None if self.seed is None else self.seed + self.totals.turns
        result = self.engine.generate(input_ids=ids, max_new_tokens=self.max_new_tokens,
                                      greedy=self.greedy, temperature=self.temperature, top_p=self.top_p,
                                      seed=seed, on_token=on_token)
        self.messages.append({"role": "assistant", "content": result.text.strip()})
        self.totals.add(result.stats)
        return result


def _read_lines(interactive: bool, console, stdin: TextIO) -> Iterable[str]:
    while True:
        try:
            line = console.input("[bold green]you>[/] ") if interactive else stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return                                           # end of piped input
        yield line.rstrip("\n")


def print_session_stats(session: ChatSession, console) -> None:
    from rich.table import Table

    from ..core.recipes import format_bytes
    from ..tables import plural

    t = session.totals.as_dict()
    cache = session.engine.cache
    table = Table(title="session stats", show_header=False)
    table.add_row("turns", str(t["turns"]))
    table.add_row("tokens generated", str(t["tokens"]))
    table.add_row("tokens/s", f"{t['tokens_per_s']:.1f}")
    table.add_row("cache hit rate", f"{t['hit_rate']:.1%} ({t['hits']} hits, {t['misses']} misses)")
    table.add_row("bytes loaded", f"{format_bytes(t['bytes_loaded'])} ({format_bytes(t['bytes_per_token'])}/token)")
    table.add_row("load wait", f"{t['load_wait_s'] * 1000:.1f} ms")
    slots = getattr(cache, "slots_per_layer", None)
    if slots is not None:
        table.add_row("cache slots", f"{sum(slots)} over {plural(len(slots), 'MoE layer')}")
    table.add_row("messages in context", str(len(session.messages)))
    console.print(table)


def run_chat(session: ChatSession, console=None, stdin: TextIO | None = None, interactive: bool | None = None) -> int:
    """The read-answer loop; returns the exit code (0)."""
    from rich.console import Console
    from rich.markup import escape

    from ..errors import MoectlError
    from ..runtime.generation import check_text
    from ..status import print_stats_line

    console = console or Console()
    stdin = stdin or sys.stdin
    if interactive is None:
        interactive = stdin.isatty() and console.is_terminal
    if interactive:
        from ..status import prefetch_note

        console.print(f"[bold]moectl chat[/] with [cyan]{session.engine.ref.name}[/] ({prefetch_note(session.engine)}) — {HELP}")

    def stream(_token_id: int, piece: str) -> None:
        console.file.write(piece)
        console.file.flush()

    for n, line in enumerate(_read_lines(interactive, console, stdin), start=1):
        text = line.strip()
        if not text:
            continue
        try:
            check_text(text, "the message" if interactive else f"input line {n}")
        except MoectlError as e:
            if not interactive:                 # a pipe: one error line, exit code 2 (the CLI's)
                raise
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)     # retype it
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit", "/q"):
                break
            if command == "/reset":
                session.reset()
                console.print("[yellow]conversation reset[/]")
            elif command == "/stats":
                print_session_stats(session, console)
            else:
                console.print(f"[yellow]unknown command {command}[/]: {HELP}")
            continue
        try:
            ids = session.add_message(text)
        except MoectlError as e:                             # a message past the context: said, and the chat goes on
            Console(stderr=True).print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
            continue
        if interactive:
            console.print("[bold blue]assistant>[/] ", end="")
        result = session.answer(ids, on_token=stream)
        console.file.write("\n")
        console.file.flush()
        print_stats_line(result.stats, console)
    return 0

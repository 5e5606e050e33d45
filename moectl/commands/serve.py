"""`moectl serve`: an OpenAI-compatible HTTP server over the offloading runtime, with a live cache page."""

from __future__ import annotations

import os
from typing import Optional

import typer

from ..setting.options import RuntimeOptions
from ._common import load_engine, runtime_options

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@runtime_options
def serve(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral), checkpoint directory or .gguf file."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0: every interface; set --api-key)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: any free port)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MOECTL_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1/* (or $MOECTL_API_KEY)."),
    max_queue: int = typer.Option(16, "--max-queue", min=1,
                                  help="Requests that may wait behind the running one; more get 429 + Retry-After."),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1,
                                   help="Answer length when a request gives no max_tokens (capped by the context)."),
    served_name: Optional[str] = typer.Option(None, "--served-model-name",
                                              help="Model id clients must send (default: the recipe/directory name)."),
    opts: RuntimeOptions = None,
):
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), with /health,
    /metrics (Prometheus) and a live expert-cache page at /. Requests are served one at a time. A GGUF that the
    one ggml graph computes on the CPU is served by the torch-free engine once a first run saved its config and
    tokenizer (as `generate`; MOECTL_TORCH_FREE=0 turns it off)."""
    from rich.console import Console

    from ..errors import MoectlError
    from ..serve.listen import bind

    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as e:
        raise MoectlError(f"`moectl serve` needs the serve extra: pip install 'moectl[serve]' ({e.name} is missing)")
    err = Console(stderr=True)
    if host not in LOOPBACK and not api_key:
        err.print(f"[yellow]warning:[/] serving on {host} without --api-key: anyone who can reach this machine "
                  f"can use the model", highlight=False)
    sock = bind(host, port)                                  # a port in use fails here, before the model loads
    try:
        # a GGUF the one ggml graph serves: the torch-free engine (neither torch nor transformers imported), as
        # `generate` and `chat`; else `Engine`
        eng, _ = load_engine(model, opts, progress=err.is_terminal, torch_free=True)
        app = create_app(eng, served_name or eng.ref.name, api_key=api_key, max_queue=max_queue,
                         default_max_tokens=max_tokens)
        bound_host, bound_port = sock.getsockname()[:2]
        url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
        engine = "torch-free engine, " if eng.torch_free else ""
        Console().print(f"serving [cyan]{served_name or eng.ref.name}[/] on {url}  ({engine}OpenAI API: {url}/v1, "
                        f"cache view: {url}/, metrics: {url}/metrics)", highlight=False, soft_wrap=True)  # stdout
        server = uvicorn.Server(uvicorn.Config(app, log_level=os.environ.get("MOECTL_LOG_LEVEL", "warning"),
                                               timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        sock.close()

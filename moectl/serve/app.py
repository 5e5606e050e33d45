"""`moectl serve`: the OpenAI-compatible HTTP API over one Engine, and the live cache page.

Routes: POST /v1/chat/completions, POST /v1/completions (both streamed as SSE with `stream: true`),
GET /v1/models, GET /health, GET /metrics (Prometheus), GET / (the cache page), GET /api/state (its data).
Every request is checked in this order: API key (401), JSON (400), fields (400), model (404), context
length (400), queue room (429 + Retry-After); then it waits for the runtime worker. A client that goes
away cancels its job. Every error is an OpenAI error body; no traceback ever reaches a client.
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..runtime.generation import chat_ids
from .metrics import CONTENT_TYPE, Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, validation_error
from .worker import Job, Worker

PAGE = Path(__file__).with_name("page.html")
MAX_BODY = 16 * 2**20           # bytes; a longer body is refused (413) before it is read
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/", "/api/state"}


class CountRequests:
    """ASGI middleware: every response counted by endpoint and status (streams pass through untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]                       # a fixed label set: unknown paths must not grow /metrics
        path = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.count(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def create_app(engine, model_name: str, api_key: str | None = None, max_queue: int = 16,
               default_max_tokens: int = 256) -> FastAPI:
    worker = Worker(engine, max_queue)
    metrics = Metrics(worker)
    tokenizer = copy.deepcopy(engine.tokenizer)     # encoding here while the worker decodes with the engine's
    context = getattr(engine.config, "max_position_embeddings", None) or 4096
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        yield
        worker.stop()

    app = FastAPI(title="moectl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.worker = worker

    # --- errors: always the OpenAI body ---------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, e: RequestValidationError):
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http(_request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(_request, e: Exception):
        return JSONResponse(ApiError(500, f"internal error ({type(e).__name__})", type="server_error").body(),
                            status_code=500)

    # --- request checks ---------------------------------------------------------------------
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise ApiError(401, "no API key: send the header 'Authorization: Bearer <key>'", code="missing_api_key")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def parse(request: Request, kind):
        authorize(request)
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY // 2**20} MB", code="body_too_large")
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        if req.model != model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return req

    def budget(req, ids: list[int]) -> int:
        """max_tokens for `ids`, with the context limit enforced."""
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_value")
        limit = req.token_limit()
        if len(ids) >= context or (limit is not None and len(ids) + limit > context):
            raise ApiError(400, f"this model's context is {context} tokens; the prompt has {len(ids)} tokens"
                           + (f" and max_tokens asks for {limit} more" if limit is not None else ""),
                           param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        return limit if limit is not None else min(default_max_tokens, context - len(ids))

    # --- generation -----------------------------------------------------------------------------
    def submit(req, ids: list[int]) -> Job:
        job = Job(ids=ids, max_tokens=budget(req, ids), greedy=req.temperature == 0, temperature=req.temperature,
                  top_p=req.top_p, seed=req.seed, stops=req.stop, ignore_eos=req.ignore_eos,
                  loop=asyncio.get_running_loop())
        if not worker.submit(job):
            raise ApiError(429, f"the server is busy: {worker.queue_depth} requests already wait (--max-queue "
                           f"{max_queue}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(worker.retry_after())})
        return job

    def usage(info: dict) -> dict:
        p, c = info.get("prompt_tokens", 0), info.get("completion_tokens", 0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def answer(request: Request, job: Job) -> tuple[str, dict]:
        """The whole answer; cancels the job if the client disconnects while it waits."""
        pieces, next_check = [], time.monotonic() + 0.25
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() >= next_check:                 # every 0.25 s, tokens flowing or not
                    next_check = time.monotonic() + 0.25
                    if await request.is_disconnected():
                        job.cancelled.set()
                if kind is None:
                    continue
                if kind == "token":
                    pieces.append(payload)
                elif kind == "error":
                    raise ApiError(500, f"generation failed: {payload}", type="server_error")
                else:
                    return "".join(pieces), payload
        finally:
            job.cancelled.set()          # no-op once done; stops the runtime if this handler was cancelled

    def stream(job: Job, chunk) -> StreamingResponse:
        """SSE: `chunk(text, finish_reason, usage)` -> one data event per piece, then [DONE]."""
        async def events():
            try:
                head = chunk(None, None, None)
                if head is not None:
                    yield f"data: {json.dumps(head)}\n\n"
                while True:
                    kind, payload = await job.events.get()
                    if kind == "token":
                        yield f"data: {json.dumps(chunk(payload, None, None))}\n\n"
                    elif kind == "error":
                        err = ApiError(500, f"generation failed: {payload}", type="server_error")
                        yield f"data: {json.dumps(err.body())}\n\n"
                        return
                    else:
                        yield f"data: {json.dumps(chunk('', payload['finish_reason'], usage(payload)))}\n\n"
                        yield "data: [DONE]\n\n"
                        return
            finally:
                job.cancelled.set()      # the client left (the task was cancelled) or we are done

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def respond(request: Request, req, ids: list[int], chat: bool):
        """Queue the job; the answer as one JSON body or as SSE chunks (OpenAI's chat or text shapes)."""
        job = submit(req, ids)
        rid, now = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())

        def body(choice: dict, finish, use, kind: str) -> dict:
            out = {"id": rid, "object": kind, "created": now, "model": model_name,
                   "choices": [{"index": 0, **choice, "finish_reason": finish, "logprobs": None}]}
            return out | ({"usage": use} if use else {})

        if req.stream:
            def chunk(text, finish, use):
                if not chat:
                    return None if text is None else body({"text": text}, finish, use, "text_completion")
                delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
                return body({"delta": delta}, finish, use, "chat.completion.chunk")
            return stream(job, chunk)
        text, info = await answer(request, job)
        if chat:
            return body({"message": {"role": "assistant", "content": text}}, info["finish_reason"], usage(info),
                        "chat.completion")
        return body({"text": text}, info["finish_reason"], usage(info), "text_completion")

    # --- routes ---------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        return await respond(request, req, chat_ids(tokenizer, messages), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        ids = list(req.prompt) if isinstance(req.prompt, list) else tokenizer(req.prompt)["input_ids"]
        if any(not 0 <= i < len(tokenizer) for i in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {len(tokenizer)})", param="prompt",
                           code="invalid_value")
        return await respond(request, req, ids, chat=False)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "moectl"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):
        authorize(request)
        if name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return card

    @app.get("/health")
    async def health():
        ok = worker.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "dead", "model": model_name, "busy": worker.state["busy"],
                             "queue_depth": worker.queue_depth}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/api/state")
    async def state():
        return worker.state | {"model": model_name, "context": context, "auth": api_key is not None,
                               "queue_depth": worker.queue_depth}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    return app

"""An OpenAI-compatible server over the generation engine, as vLLM serves the API: `python -m launchers.serve`.

    python -m launchers.serve --base=HF_DIR [--lora_modules=dpo28=PEFT_DIR] [--port=8000]
    curl localhost:8000/v1/completions -d '{"model": "dpo28", "prompt": "def add(a, b):", "max_tokens": 32}'

What it is for: evaluating a checkpoint (base + LoRA adapters, unmerged, or a merged export as the base) from
the clients researchers already run (the `openai` SDK, lm-evaluation-harness: docs/guides/lm-eval.md), and
serving rollouts / evaluations / online training to `--backend=server --server_url=...` exactly as the in-process
jax backend would draw them. FastAPI + uvicorn, as vLLM. The parts: this module (the app, its routes, the limits
on bodies), jaxrl/serve/protocol.py (request models, the error shape), handlers.py (completions and chat:
prompts, rows, the stopping rule, log-probs, streaming), registry.py (the base and the adapters by name),
loop.py (the one thread that drives the engine and scores), compiler.py (the thread that compiles programs ahead of
their first call).

  GET  /health, /version ({"version", "server": "jaxrl"}), /v1/models (the base, then each adapter with its
       `root` folder, `parent` and the `adapter_digest` read back from the attached parameters; `max_model_len`),
       /metrics (Prometheus text: compiled programs, the warm-up's programs and seconds, programs compiling,
       resident memory, waiting and running rows),
       /tokenizer_info
  POST /v1/completions       prompt: a string, strings, token ids or lists of them; n, max_tokens (0 with echo:
                             scoring only), temperature, top_p, top_k, seed, stop (strings), stop_token_ids,
                             include_stop_str_in_output, ignore_eos, logprobs (k: the top k of every token and
                             the token itself), echo (the prompt and its token log-probs, the first null),
                             prompt_logprobs (k: vLLM's per-prompt-token dicts with ranks, handlers.py),
                             stream (+ stream_options.include_usage), return_token_ids, skip_special_tokens
  POST /v1/chat/completions  messages through the base's chat template (chat_template_kwargs.enable_thinking);
                             stops at the chat stop ids; logprobs (bool) and top_logprobs; max_completion_tokens;
                             stream; tools (to the template; Qwen3.5 <tool_call> blocks in the answer come back as
                             tool_calls, finish_reason "tool_calls"; a malformed one as text) and tool messages
  POST /tokenize, /detokenize (vLLM's), /v1/load_lora_adapter {"lora_name", "lora_path"} (an absolute path
       under --allowed_lora_roots: a PEFT folder in the base's layout or a trainer adapter checkpoint),
       /v1/unload_lora_adapter {"lora_name"}

Errors: {"error": {"message", "type", "param", "code"}} with 400 (a request this server refuses: context overflow,
unsupported field, n or logprobs over their bounds: --max_logprobs), 404 (unknown model or route), 413 (body over --max_body_mb),
422 (a field of the wrong type or out of range), 503 (overloaded or shutting down).

What keeps it up: max_tokens is bounded by max_model_len minus the prompt (HTTP 400 naming both); a text prompt
longer than any prompt of max_prompt_len tokens could be is refused before it is tokenized; bodies are bounded;
n, logprobs and the number of prompts per request are bounded; the engine's programs are per prompt bucket and
generation bucket; at most --max_pending_rows rows wait (503 beyond); uvicorn's backlog takes thousands of
connections. Runtime adapter loading reads only absolute paths under --allowed_lora_roots. Request bodies are parsed
and validated in worker threads, and responses encoded there (handlers.py: what runs off the event loop); a stop
string has at most MAX_STOP_CHARS characters, a response at most --max_response_entries entries (refused up front).

Shutdown (SIGINT / SIGTERM, `begin_shutdown`): from the signal on, every new request is answered 503 in the OpenAI
shape; the requests in flight may finish for --graceful_shutdown_s, and those still running then are answered 503
(their rows leave the engine); uvicorn waits a little longer for those answers to leave before it closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import resource
import socket
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Optional, Sequence

import jax.numpy as jnp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl.data.chat import load_tokenizer, render_chat
from jaxrl.generation.buckets import generation_buckets as default_generation_buckets
from jaxrl.generation.buckets import prompt_buckets as default_prompt_buckets
from jaxrl.generation.engine import DEFAULT_ROUND_STEPS
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.serve.handlers import Handlers
from jaxrl.serve.loop import ServeLoop, ShuttingDown, compiled_programs
from jaxrl.serve.protocol import (JAXRL_SERVER, ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  LoadLoraRequest, TokenizeRequest, UnloadLoraRequest, template_message)
from jaxrl.serve.registry import AdapterRegistry
from jaxrl.serve.settings import ServeLimits

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Seconds uvicorn waits past --graceful_shutdown_s before it cancels what still runs: the 503s of the requests the
# grace period ended (answered at once by `begin_shutdown`'s timer) leave within it, and no handler is cancelled.
ANSWER_MARGIN_S = 5


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class CompletionServer:
    """The model, its registry, the serve loop, the handlers and the FastAPI app of `launchers.serve`.

    model / tokenizer: already loaded objects (tests); default from `base_dir` in `dtype`.
    allowed_lora_roots: folders under which POST /v1/load_lora_adapter may read (empty: runtime loading refused).
    batch_size: the engine's slots per pool (and rows per scoring call); round_steps: decode steps per round (0,
    the default of --round_steps: the engine's DEFAULT_ROUND_STEPS); round_delay_s: a sleep after every round
    (`--debug_round_delay_s`: a slower accelerator emulated).
    start: run the serve loop's thread (False: a test drives `loop.step()` itself).
    """

    def __init__(self, base_dir: str, *, model=None, tokenizer=None, dtype: str = "bfloat16",
                 limits: ServeLimits = ServeLimits(), batch_size: int = 32,
                 prompt_buckets: Optional[Sequence[int]] = None, generation_buckets: Optional[Sequence[int]] = None,
                 served_model_name: Optional[str] = None, allow_lora_updating: bool = True,
                 allowed_lora_roots: Sequence[str] = (), round_steps: int = DEFAULT_ROUND_STEPS,
                 round_delay_s: float = 0.0, start: bool = True):
        self.base_dir = os.path.abspath(base_dir)
        self.model = model if model is not None else qwen35.from_pretrained(base_dir, dtype=getattr(jnp, dtype))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(base_dir)
        positions = int(self.model.config.max_position_embeddings)
        max_model_len = min(int(limits.max_model_len or positions), positions)
        self.limits = dataclasses.replace(limits, max_model_len=max_model_len,
                                          max_prompt_len=min(int(limits.max_prompt_len), max_model_len))
        self.max_model_len, self.max_prompt_len = max_model_len, self.limits.max_prompt_len
        eos = self.model.config.eos_token_id
        eos_ids = tuple(sorted({int(eos)} if isinstance(eos, int) else {int(t) for t in eos or ()}))
        self.registry = AdapterRegistry(self.model, base_name=served_model_name or base_dir, base_dir=base_dir,
                                        layout=load_hf_config(base_dir)[1].kind, allowed_roots=allowed_lora_roots,
                                        max_model_len=self.max_model_len)
        self.allow_lora_updating = bool(allow_lora_updating)
        gen = sorted({int(b) for b in generation_buckets}) if generation_buckets else \
            list(default_generation_buckets(self.max_model_len))
        if gen[-1] < self.max_model_len:  # every max_tokens the context allows has a bucket
            gen.append(self.max_model_len)
        self.loop = ServeLoop(self.model, self.registry, max_model_len=self.max_model_len,
                              prompt_buckets=tuple(prompt_buckets) if prompt_buckets else
                              default_prompt_buckets(self.max_prompt_len),
                              generation_buckets=gen, slots=batch_size, pad_id=self.tokenizer.pad_token_id,
                              max_pending_rows=self.limits.max_pending_rows,
                              round_steps=round_steps or DEFAULT_ROUND_STEPS, round_delay_s=round_delay_s, start=start)
        self.handlers = Handlers(self.tokenizer, self.registry, self.loop, self.limits, eos_ids=eos_ids,
                                 vocab_size=int(self.model.config.vocab_size))
        self.stopping = False  # set by a signal: every new request is answered 503
        self.app = build_app(self)

    # the registry's operations, as the launcher and the tests name them
    def load_adapter(self, name: str, path: str, load_inplace: bool = False, runtime: bool = True) -> str:
        return self.registry.load(name, path, load_inplace, runtime)

    def unload_adapter(self, name: str) -> str:
        return self.registry.unload(name)

    def models(self) -> dict:
        return self.registry.cards()

    def warm_up(self) -> int:
        """Compiles the programs of the configured buckets for the base and every adapter loaded so far (one set per
        shape of weights) before the first request (`ServeLoop.warm_up`); returns how many."""
        return self.loop.warm_up([self.registry.base.name, *self.registry.adapters])

    def metrics_text(self) -> str:
        stats = self.loop.stats()
        lines = []
        for name, kind, value, help_text in (
                ("jaxrl:compiled_programs", "gauge", compiled_programs(), "engine and scoring programs traced"),
                ("jaxrl:warmup_programs", "gauge", stats["warmup_programs"],
                 "programs compiled at start-up (launchers.serve --warmup)"),
                ("jaxrl:warmup_seconds", "gauge", round(stats["warmup_seconds"], 3), "seconds the start-up warm-up took"),
                ("jaxrl:programs_compiling", "gauge", stats["programs_compiling"],
                 "programs queued or compiling on the compiler's thread now (their requests wait, the others go on)"),
                ("jaxrl:programs_compiled_ahead_total", "counter", stats["programs_compiled_ahead"],
                 "programs compiled on the compiler's thread, the warm-up's included"),
                ("jaxrl:inline_compiles_total", "counter", stats["inline_compiles"],
                 "XLA compiles run on the serve loop's thread (each stalled every request)"),
                ("process_resident_memory_bytes", "gauge", resident_bytes(), "resident memory of the process"),
                ("jaxrl:num_requests_waiting", "gauge", stats["requests_waiting"], "requests queued"),
                ("jaxrl:num_rows_waiting", "gauge", stats["rows_waiting"], "rows queued"),
                ("jaxrl:num_rows_running", "gauge", stats["rows_running"], "rows decoding or being scored"),
                ("jaxrl:rows_generated_total", "counter", stats["rows_generated"], "rows sampled"),
                ("jaxrl:rows_scored_total", "counter", stats["rows_scored"], "rows scored (echo, top-k)"),
                ("jaxrl:rows_cancelled_total", "counter", stats["rows_cancelled"],
                 "rows of requests whose client disconnected (taken out of the engine at the next round end)"),
                ("jaxrl:engine_rows_cancelled_total", "counter", stats["engine_cancelled"],
                 "of those, rows the engine had queued or was decoding"),
                ("jaxrl:weight_swaps_in_flight_total", "counter", stats["weight_swaps_in_flight"],
                 "adapter reloads the engine took with rows in flight (partial rollouts)"),
                ("jaxrl:engine_rounds_total", "counter", stats["rounds"], "decode rounds"),
                ("jaxrl:engine_inserts_total", "counter", stats["inserts"], "inserts moving rows into free slots"),
                ("jaxrl:engine_decode_steps_total", "counter", stats["decode_steps"], "decode steps")):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    def tokenizer_info(self) -> dict:
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": self.max_model_len}

    def close(self) -> None:
        self.loop.close()

    def begin_shutdown(self, grace_s: float) -> None:
        """From now on new requests are answered 503; after `grace_s` seconds the requests still in flight are
        answered 503 too (module docstring). Safe to call from a signal handler (it only sets flags and starts a
        timer thread); idempotent."""
        if self.stopping:
            return
        self.stopping = True
        self.loop.refuse_new()
        error = ShuttingDown(f"the server is shutting down: this request was still running when its grace period "
                             f"(launchers.serve --graceful_shutdown_s={grace_s:g}) ended; send it again to another "
                             "server")
        timer = threading.Timer(max(0.0, float(grace_s)), self.loop.abort, args=(error,))
        timer.daemon = True
        timer.start()

    # ----------------------------------------------------------------------------------------------- serving
    def bind(self, host: str = "127.0.0.1", port: int = 8000, backlog: int = 2048) -> socket.socket:
        """A listening socket (port 0: any free port); connections wait in its backlog until `run` serves."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(backlog)
        sock.set_inheritable(True)
        return sock

    def uvicorn_server(self, sock: socket.socket, graceful_timeout_s: int = 30, backlog: int = 2048):
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", backlog=backlog,
                                timeout_graceful_shutdown=graceful_timeout_s + ANSWER_MARGIN_S, lifespan="off",
                                access_log=False)
        return _Uvicorn(config, lambda: self.begin_shutdown(graceful_timeout_s))


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling ours when a signal arrives (uvicorn alone stops accepting connections but still
    answers requests on open ones, and cancels the handlers still running at its timeout: a plain-text 500)."""

    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig, frame) -> None:
        self.on_signal()
        super().handle_exit(sig, frame)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resident_bytes() -> int:
    """Resident memory of this process now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------------------------
# The HTTP layer


class BodyLimit:
    """ASGI middleware: once the server is stopping every request is answered 503; a request body over `max_bytes`
    is answered 413, at once when its Content-Length says so,
    else as soon as the bytes read exceed it (a chunked body); the app gets the body only once it is whole and
    within the limit. A malformed Content-Length never reaches the app (uvicorn answers 400)."""

    def __init__(self, app, max_bytes: int, stopping=lambda: False):
        self.app, self.max_bytes, self.stopping = app, int(max_bytes), stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.stopping():
            closing = ApiError("the server is shutting down; send the request to another server", 503)
            return await JSONResponse(closing.body(), 503, headers={"Connection": "close"})(scope, receive, send)
        too_large = ApiError(f"the request body is over this server's limit of {self.max_bytes} bytes "
                             "(launchers.serve --max_body_mb)", 413)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await JSONResponse(too_large.body(), 413)(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await JSONResponse(too_large.body(), 413)(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: a disconnect, which a streaming response listens for

        await self.app(scope, replay, send)


def _validation_error(exc) -> ApiError:
    """The 400 / 422 of a body FastAPI (RequestValidationError) or `parse_body` (ValidationError) refused."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError("the request body is not valid JSON", 400)
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return ApiError("the request body must be a JSON object", 400)
    text = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}"
                     for e in errors[:5])
    return ApiError(f"invalid request: {text}", 422, param)


def _parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError("the request body is not valid JSON", 400) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """A request body as `model`, parsed and validated in a worker thread (a body may be tens of MB)."""
    return await asyncio.to_thread(_parse, model, await request.body())


def build_app(server: CompletionServer) -> FastAPI:
    app = FastAPI(title="jaxrl", docs_url=None, redoc_url=None, openapi_url=None)
    handlers, registry = server.handlers, server.registry

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        message = "Not Found" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(ApiError(message, exc.status_code).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(f"{type(exc).__name__}: {exc}", 500).body(), 500)

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/version")
    async def version_info():
        try:
            v = version("jaxrl")
        except PackageNotFoundError:
            v = "unknown"
        return {"version": v, "server": JAXRL_SERVER}

    @app.get("/v1/models")
    async def models():
        return registry.cards()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_body(request, TokenizeRequest)
        registry.served(req.model)
        return await asyncio.to_thread(_tokenize, server, req)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse_body(request, DetokenizeRequest)
        registry.served(req.model)
        if any(not 0 <= t < handlers.vocab_size for t in req.tokens):
            raise ApiError(f"tokens outside [0, {handlers.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(server.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completions(await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handlers.chat_completions(await parse_body(request, ChatCompletionRequest), request)

    if server.allow_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora(req: LoadLoraRequest):
            text = await asyncio.to_thread(registry.load, req.lora_name, req.lora_path, req.load_inplace)
            return PlainTextResponse(text)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(req: UnloadLoraRequest):
            return PlainTextResponse(registry.unload(req.lora_name))

    return BodyLimit(app, server.limits.max_body_bytes, lambda: server.stopping)


def _tokenize(server: CompletionServer, req: TokenizeRequest) -> dict:
    handlers = server.handlers
    if req.messages is not None:
        text = render_chat(server.tokenizer, [template_message(m) for m in req.messages], False,
                           req.add_generation_prompt)
        ids = handlers.encode_text(text, "the templated conversation", add_special_tokens=False)
    elif req.prompt is not None:
        ids = handlers.encode_text(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise ApiError("give `prompt` or `messages`", param="prompt")
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}


class ServerThread:
    """A CompletionServer's uvicorn in a background thread (benchmarks, in-process use): `url`, `stop()`."""

    def __init__(self, server: CompletionServer, host: str = "127.0.0.1", port: int = 0, backlog: int = 2048):
        self.server = server
        self.sock = server.bind(host, port, backlog)
        self.url = url_of(self.sock)
        self.uvicorn = server.uvicorn_server(self.sock, backlog=backlog)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="jaxrl-serve-http")
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
        self.server.close()
        self.sock.close()

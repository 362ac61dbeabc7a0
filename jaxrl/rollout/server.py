"""An OpenAI-compatible completions server backed by the JAX sampler: `python -m launchers.serve`.

    python -m launchers.serve --base=HF_DIR [--lora_modules=dpo28=PEFT_DIR] [--port=8000]
    curl localhost:8000/v1/completions -d '{"model": "dpo28", "prompt": "def add(a, b):", "max_tokens": 32}'
    curl localhost:8000/v1/chat/completions -d '{"model": "dpo28", "messages": [{"role": "user", "content": "hi"}]}'

What it is for: inspecting a checkpoint (base + LoRA adapters, unmerged) from any OpenAI client, and serving
rollouts / evaluations to `--backend=server --server_url=...` exactly as the in-process jax backend would draw
them. It speaks the subset of vLLM 0.33's API that jaxrl's server backend uses, with vLLM's semantics:

  GET  /health, /version ({"version", "server": "jaxrl"}), /v1/models (the base, then each adapter with its
       `root` folder, `parent` and the `adapter_digest` read back from the attached parameters)
  POST /v1/completions       prompt: token ids, lists of them, a string or strings; n, max_tokens, temperature,
                             top_p, top_k, seed, stop_token_ids, ignore_eos, logprobs (0: the sampled token's),
                             return_token_ids, skip_special_tokens
  POST /v1/chat/completions  messages through the base's chat template (chat_template_kwargs.enable_thinking);
                             stops at the chat stop ids
  POST /v1/load_lora_adapter {"lora_name", "lora_path"}: a PEFT folder in the base's layout or a trainer
                             adapter checkpoint; POST /v1/unload_lora_adapter {"lora_name"}

Seeds: choice i of a request with seed R is sampled with the jax backend's key for `split_request_seed(R + i)` =
(seed, group id, sample index) (`jaxrl.rollout.backends.openai_client`), as vLLM seeds choice i with R + i; a
request without a seed gets a random one. So the same request twice gives the same tokens, and the server
backend's requests reproduce the in-process jax backend's samples key for key.

Requests are batched: the worker thread takes the oldest request and, for `batch_wait_s`, every later one with the
same model and sampling settings, up to `batch_size` rows, into one Sampler call. A sample does not depend on the
batch it lands in (its key is its own). Unsupported fields with a non-default value (streaming, echo, stop
strings, penalties, top-n log-probs) are refused with HTTP 400 naming the field; unknown fields are ignored, as
vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time
import uuid
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Sequence

import jax.numpy as jnp

from jaxrl.data.chat import chat_stop_ids, format_chat, load_tokenizer
from jaxrl.export.peft import is_peft_folder, mismatch_message, read_adapter, read_peft_adapter
from jaxrl.models import qwen35
from jaxrl.models.adapters import AdapterError, attach, attached_digest, check_against_model, detach
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.rollout.backends.base import SamplingParams
from jaxrl.rollout.backends.openai_client import JAXRL_SERVER, split_request_seed
from jaxrl.rollout.collect import decode_completion
from jaxrl.rollout.sampler import Sampler

logger = logging.getLogger(__name__)

# Fields a request may carry only with these values (anything else would be silently different sampling).
_NEUTRAL = {"stream": (False, None), "echo": (False, None), "use_beam_search": (False, None),
            "repetition_penalty": (1.0, None), "presence_penalty": (0.0, None), "frequency_penalty": (0.0, None),
            "min_p": (0.0, None), "min_tokens": (0, None), "logit_bias": (None, {}), "suffix": (None, ""),
            "prompt_logprobs": (None,), "best_of": (None, 1), "stop": (None, [], "")}


class RequestError(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, kind: str = "BadRequestError",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": int(self.status)}}


class _RowSampler(Sampler):
    """A Sampler whose rows carry their own sample index (a request names it in its seed), one prompt per row."""

    row_samples: Optional[Sequence[int]] = None

    def plan(self, prompts, n, group_ids):
        batches = super().plan(prompts, n, group_ids)
        if self.row_samples is not None:
            for b in batches:  # n == 1: row r is prompt r
                b.sample_ids[:len(b.rows)] = [self.row_samples[r] % 2 ** 32 for r in b.rows]
        return batches


@dataclasses.dataclass
class _Job:
    """Rows of one request that share a sampler call (the same model, settings and seed bits)."""

    key: tuple  # (model, max_tokens, stop ids, temperature, top_p, top_k, seed)
    prompts: list  # per row
    groups: list
    samples: list
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Optional[list] = None  # per row: (tokens, logprobs, finish_reason)
    error: Optional[BaseException] = None


@dataclasses.dataclass
class _Served:
    name: str
    path: str
    adapter: object = None  # jaxrl Adapter; None for the base
    digest: Optional[str] = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class CompletionServer:
    """The engine and HTTP front of `launchers.serve` (module docstring).

    model / tokenizer: already loaded objects (tests); default from `base_dir` in `dtype`.
    """

    def __init__(self, base_dir: str, *, model=None, tokenizer=None, dtype: str = "bfloat16",
                 max_prompt_len: int = 4096, batch_size: int = 32, prompt_buckets: Optional[Sequence[int]] = None,
                 served_model_name: Optional[str] = None, allow_lora_updating: bool = True,
                 batch_wait_s: float = 0.005):

        self.base_dir = os.path.abspath(base_dir)
        self.model = model if model is not None else qwen35.from_pretrained(base_dir, dtype=getattr(jnp, dtype))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(base_dir)
        self.layout = load_hf_config(base_dir)[1].kind
        eos = self.model.config.eos_token_id
        self.eos_ids = tuple(sorted({int(eos)} if isinstance(eos, int) else {int(t) for t in eos or ()}))
        self.chat_stop_ids = chat_stop_ids(self.tokenizer, eos)
        self.max_prompt_len, self.batch_size = int(max_prompt_len), int(batch_size)
        self.prompt_buckets = tuple(prompt_buckets) if prompt_buckets else None
        self.pad_id = self.tokenizer.pad_token_id
        self.vocab_size = int(self.model.config.vocab_size)
        self.base = _Served(served_model_name or base_dir, self.base_dir)
        self.adapters: dict[str, _Served] = {}
        self.allow_lora_updating = bool(allow_lora_updating)
        self.batch_wait_s = float(batch_wait_s)
        self._attached: Optional[str] = None  # the adapter the model carries now (None: the base)
        self._samplers: dict[tuple, _RowSampler] = {}
        self._pending: list[_Job] = []
        self._cond = threading.Condition()
        self._registry_lock = threading.Lock()
        self._stop = False
        self._worker = threading.Thread(target=self._work, name="jaxrl-serve-worker", daemon=True)
        self._worker.start()
        self.httpd: Optional[ThreadingHTTPServer] = None

    # ------------------------------------------------------------------------------------------------ models
    def models(self) -> dict:
        def card(s: _Served, parent: Optional[str]) -> dict:
            out = {"id": s.name, "object": "model", "created": s.created, "owned_by": "jaxrl", "root": s.path,
                   "parent": parent, "max_model_len": None}
            if s.adapter is not None:
                out["adapter_digest"] = s.digest
            return out
        with self._registry_lock:
            return {"object": "list", "data": [card(self.base, None)] +
                    [card(s, self.base.name) for s in self.adapters.values()]}

    def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> str:
        """Reads and checks an adapter (PEFT folder or trainer checkpoint) and registers it as model `name`."""
        if not name or not path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base.name:
            raise RequestError(f"The lora adapter '{name}' conflicts with a served base model.")
        with self._registry_lock:
            if name in self.adapters and not load_inplace:
                raise RequestError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.")
        if not os.path.isdir(path):
            raise RequestError(f"Loading lora {name} failed: No adapter found for {path}", HTTPStatus.NOT_FOUND,
                               "NotFoundError")
        try:
            if is_peft_folder(path):
                adapter, layout = read_peft_adapter(path)
                if layout != self.layout:
                    raise RequestError(mismatch_message(layout, self.layout, path))
            else:
                adapter = read_adapter(path)
            check_against_model(adapter, self.model)
        except (AdapterError, OSError, ValueError) as e:
            if isinstance(e, RequestError):
                raise
            raise RequestError(f"Loading lora {name} from {path} failed: {e}") from None
        with self._registry_lock:
            self.adapters[name] = _Served(name, os.path.abspath(path), adapter, adapter.digest())
            if self._attached == name:
                self._attached = "\0stale"  # re-attach on the next batch
        logger.info("loaded adapter %s from %s (%d modules, rank %d)", name, path, len(adapter.modules),
                    adapter.rank)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, name: str) -> str:
        with self._registry_lock:
            if not name:
                raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.")
            if name not in self.adapters:
                raise RequestError(f"The lora adapter '{name}' cannot be found.", HTTPStatus.NOT_FOUND,
                                   "NotFoundError")
            del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _served(self, model: Optional[str]) -> _Served:
        with self._registry_lock:
            if model in (None, "", self.base.name):
                return self.base
            if model in self.adapters:
                return self.adapters[model]
        raise RequestError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "NotFoundError", "model")

    # ------------------------------------------------------------------------------------------- completions
    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt must be token ids, a list of token-id lists, a string or a list of strings",
                               param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                p = list(self.tokenizer(p, add_special_tokens=True)["input_ids"])
            if not (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
                raise RequestError("each prompt must be a non-empty list of token ids or a string", param="prompt")
            out.append(p)
        return out

    def _rows(self, body: dict, prompts: list[list[int]], default_stop: Sequence[int],
              max_tokens_field: str = "max_tokens") -> tuple[list[_Job], dict]:
        """Validates the sampling fields and splits the request into jobs; returns (jobs, settings)."""
        for field, allowed in _NEUTRAL.items():
            if field in body and body[field] not in allowed:
                raise RequestError(f"`{field}`={body[field]!r} is not supported by this server (the jax sampler); "
                                   f"leave it out", param=field)
        served = self._served(body.get("model"))
        n = body.get("n", 1)
        max_tokens = body.get(max_tokens_field, body.get("max_tokens", 16))
        temperature = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        top_k = body.get("top_k", 0)
        top_k = 0 if top_k in (None, -1) else top_k
        try:
            SamplingParams(n=int(n), max_new_tokens=int(max_tokens), temperature=float(
                1.0 if temperature is None else temperature), top_p=float(1.0 if top_p is None else top_p),
                top_k=int(top_k))
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        stop = [int(t) for t in (body.get("stop_token_ids") or [])] + list(default_stop)
        if not body.get("ignore_eos", False):
            stop += list(self.eos_ids)
        bad = [t for t in stop if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids")
        for j, p in enumerate(prompts):
            if len(p) > self.max_prompt_len:
                raise RequestError(f"prompt {j} has {len(p)} tokens, over this server's max_prompt_len "
                                   f"{self.max_prompt_len} (launchers.serve --max_prompt_len)", param="prompt")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise RequestError(f"prompt {j} has token ids outside [0, {self.vocab_size})", param="prompt")
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbits(63)
        settings = {"model": served.name, "max_tokens": int(max_tokens),
                    "temperature": float(1.0 if temperature is None else temperature),
                    "top_p": float(1.0 if top_p is None else top_p), "top_k": int(top_k),
                    "stop": tuple(sorted(set(stop))), "n": int(n)}
        jobs: dict[int, _Job] = {}
        order = []
        for j, p in enumerate(prompts):
            for i in range(int(n)):
                s, group, sample = split_request_seed(int(seed) + i)
                key = (served.name, settings["max_tokens"], settings["stop"], settings["temperature"],
                       settings["top_p"], settings["top_k"], s)
                job = jobs.setdefault(s, _Job(key, [], [], []))
                job.prompts.append(p)
                job.groups.append(group)
                job.samples.append(sample)
                order.append((s, len(job.prompts) - 1))
        settings["order"] = order
        return list(jobs.values()), settings

    def _results(self, jobs: list[_Job], order) -> list[tuple]:
        for job in jobs:
            self._submit(job)
        for job in jobs:
            job.done.wait()
            if job.error is not None:
                if isinstance(job.error, RequestError):
                    raise job.error
                raise RequestError(f"generation failed: {type(job.error).__name__}: {job.error}",
                                   HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        by_seed = {job.key[-1]: job for job in jobs}
        return [by_seed[s].result[k] for s, k in order]

    def _token_strings(self, tokens: Sequence[int], as_ids: bool) -> list[str]:
        if as_ids:
            return [f"token_id:{t}" for t in tokens]
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(tokens))]

    def completions(self, body: dict) -> dict:
        """POST /v1/completions (module docstring)."""
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0):
            raise RequestError("this server returns the sampled token's log-probability only: logprobs must be 0 or "
                               "absent", param="logprobs")
        prompts = self._prompt_ids(body.get("prompt"))
        jobs, settings = self._rows(body, prompts, ())
        rows = self._results(jobs, settings.pop("order"))
        stop_requested = set(int(t) for t in body.get("stop_token_ids") or [])
        choices, completion_tokens = [], 0
        for idx, (tokens, lps, reason) in enumerate(rows):
            text = decode_completion(self.tokenizer, tokens, settings["stop"]) if body.get(
                "skip_special_tokens", True) else self.tokenizer.decode(tokens)
            choice = {"index": idx, "text": text, "logprobs": None, "finish_reason": reason,
                      "stop_reason": tokens[-1] if reason == "stop" and tokens[-1] in stop_requested and
                      tokens[-1] not in self.eos_ids else None}
            if logprobs is not None:
                strings = self._token_strings(tokens, bool(body.get("return_tokens_as_token_ids")))
                # text_offset is left empty: per-token decoding would cost more than the sampling of a token
                choice["logprobs"] = {"tokens": strings, "token_logprobs": [float(x) for x in lps],
                                      "top_logprobs": [{s: float(x)} for s, x in zip(strings, lps)],
                                      "text_offset": []}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(tokens)
                choice["prompt_token_ids"] = prompts[idx // settings["n"]]
            choices.append(choice)
            completion_tokens += len(tokens)
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": settings["model"], "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def chat_completions(self, body: dict) -> dict:
        """POST /v1/chat/completions: the base's chat template, the chat stop ids (module docstring)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} with string content",
                               param="messages")
        top = body.get("top_logprobs")
        if top not in (None, 0):
            raise RequestError("top_logprobs must be 0 or absent (only the sampled token's log-probability)",
                               param="top_logprobs")
        kwargs = body.get("chat_template_kwargs") or {}
        prompt = format_chat(self.tokenizer, [{"role": m.get("role", "user"), "content": m["content"]}
                                              for m in messages], bool(kwargs.get("enable_thinking", False)))
        body = dict(body, max_tokens=body.get("max_completion_tokens", body.get("max_tokens", 512)))
        jobs, settings = self._rows(body, [prompt], self.chat_stop_ids)
        rows = self._results(jobs, settings.pop("order"))
        choices, completion_tokens = [], 0
        for idx, (tokens, lps, reason) in enumerate(rows):
            choice = {"index": idx, "message": {"role": "assistant",
                                                "content": decode_completion(self.tokenizer, tokens, settings["stop"])},
                      "finish_reason": reason, "logprobs": None}
            if body.get("logprobs"):
                strings = self._token_strings(tokens, False)
                choice["logprobs"] = {"content": [{"token": s, "logprob": float(x), "top_logprobs": []}
                                                  for s, x in zip(strings, lps)]}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(tokens)
            choices.append(choice)
            completion_tokens += len(tokens)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": settings["model"], "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt) + completion_tokens}}

    # ------------------------------------------------------------------------------------------------- engine
    def _submit(self, job: _Job) -> None:
        with self._cond:
            if self._stop:
                raise RequestError("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE,
                                   "ServiceUnavailable")
            self._pending.append(job)
            self._cond.notify_all()

    def _take(self) -> list[_Job]:
        """The oldest job and, after batch_wait_s, every later compatible one (up to batch_size rows)."""
        with self._cond:
            while not self._pending and not self._stop:
                self._cond.wait()
            if self._stop:
                return []
            first_seen = time.monotonic()
            while time.monotonic() - first_seen < self.batch_wait_s and not self._stop:
                rows = sum(len(j.prompts) for j in self._pending if j.key == self._pending[0].key)
                if rows >= self.batch_size:
                    break
                self._cond.wait(self.batch_wait_s - (time.monotonic() - first_seen))
            key, taken, rows, rest = self._pending[0].key, [], 0, []
            for job in self._pending:
                if job.key == key and (not taken or rows + len(job.prompts) <= self.batch_size):
                    taken.append(job)
                    rows += len(job.prompts)
                else:
                    rest.append(job)
            self._pending = rest
            return taken

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if not jobs:
                return
            try:
                self._run(jobs)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request threads
                for job in jobs:
                    job.error = e
            finally:
                for job in jobs:
                    job.done.set()

    def _attach(self, name: str) -> None:
        if self._attached == name:
            return
        served = self._served(name)
        detach(self.model)
        if served.adapter is not None:
            attach(self.model, served.adapter)
            got = attached_digest(self.model)
            if got != served.digest:  # what the parameters hold now, read back
                raise RuntimeError(f"attached adapter digest {got} != {served.digest} of {served.path}")
        self._attached = name

    def _sampler(self, max_tokens: int, stop: tuple) -> _RowSampler:
        key = (max_tokens, stop)
        if key not in self._samplers:
            self._samplers[key] = _RowSampler(
                self.model, max_new_tokens=max_tokens, max_prompt_len=self.max_prompt_len,
                prompt_buckets=self.prompt_buckets, batch_size=self.batch_size, eos_token_ids=stop,
                pad_token_id=self.pad_id)
        return self._samplers[key]

    def _run(self, jobs: list[_Job]) -> None:
        model, max_tokens, stop, temperature, top_p, top_k, seed = jobs[0].key
        self._attach(model)
        prompts = [p for job in jobs for p in job.prompts]
        groups = [g for job in jobs for g in job.groups]
        sampler = self._sampler(max_tokens, stop)
        sampler.row_samples = [s for job in jobs for s in job.samples]
        try:
            out = sampler.sample(prompts, n=1, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                 group_ids=groups)
        finally:
            sampler.row_samples = None
        k = 0
        for job in jobs:
            job.result = []
            for _ in job.prompts:
                job.result.append((list(out.tokens[k]), [float(x) for x in out.logprobs[k]],
                                   out.finish_reasons[k]))
                k += 1

    # --------------------------------------------------------------------------------------------------- HTTP
    def handle(self, method: str, path: str, body: Optional[dict]):
        """(status, JSON-able or str) of one request; the HTTP layer only moves bytes."""
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if method == "GET" and path == "/health":
            return HTTPStatus.OK, ""
        if method == "GET" and path == "/version":
            try:
                v = version("jaxrl")
            except PackageNotFoundError:
                v = "unknown"
            return HTTPStatus.OK, {"version": v, "server": JAXRL_SERVER}
        if method == "GET" and path == "/v1/models":
            return HTTPStatus.OK, self.models()
        if method == "POST" and path == "/v1/completions":
            return HTTPStatus.OK, self.completions(body or {})
        if method == "POST" and path == "/v1/chat/completions":
            return HTTPStatus.OK, self.chat_completions(body or {})
        if self.allow_lora_updating and method == "POST" and path == "/v1/load_lora_adapter":
            body = body or {}
            name, folder = str(body.get("lora_name") or ""), str(body.get("lora_path") or "")
            return HTTPStatus.OK, self.load_adapter(name, folder, bool(body.get("load_inplace", False)))
        if self.allow_lora_updating and method == "POST" and path == "/v1/unload_lora_adapter":
            return HTTPStatus.OK, self.unload_adapter(str((body or {}).get("lora_name") or ""))
        return HTTPStatus.NOT_FOUND, {"detail": "Not Found"}

    def serve(self, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
        """Binds the HTTP server (port 0: any free port; see `url`); `serve_forever()` on the result runs it."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self, status, payload) -> None:
                if isinstance(payload, str):
                    data, ctype = payload.encode("utf-8"), "text/plain; charset=utf-8"
                else:
                    data, ctype = json.dumps(payload).encode("utf-8"), "application/json"
                self.send_response(int(status))
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _dispatch(self, method: str) -> None:
                body = None
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    if length:
                        raw = self.rfile.read(length)
                        try:
                            body = json.loads(raw)
                        except json.JSONDecodeError as e:
                            raise RequestError(f"request body is not JSON: {e}") from None
                        if not isinstance(body, dict):
                            raise RequestError("request body must be a JSON object")
                    status, payload = server.handle(method, self.path, body)
                except RequestError as e:
                    status, payload = e.status, e.body()
                except Exception as e:  # noqa: BLE001 - a failed request must not take the server down
                    logger.exception("request %s %s failed", method, self.path)
                    status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, RequestError(
                        f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError").body()
                self._reply(status, payload)

            def do_GET(self):  # noqa: N802 - http.server's names
                self._dispatch("GET")

            def do_POST(self):  # noqa: N802
                self._dispatch("POST")

            def log_message(self, fmt, *args):
                logger.debug("%s " + fmt, self.address_string(), *args)

        ThreadingHTTPServer.daemon_threads = True
        self.httpd = ThreadingHTTPServer((host, int(port)), Handler)
        return self.httpd

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        with self._cond:
            self._stop = True
            for job in self._pending:
                job.error = RequestError("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE,
                                         "ServiceUnavailable")
                job.done.set()
            self._pending = []
            self._cond.notify_all()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()

"""An OpenAI-compatible server backed by the JAX sampler, as vLLM serves the API: `python -m launchers.serve`.

    python -m launchers.serve --base=HF_DIR [--lora_modules=dpo28=PEFT_DIR] [--port=8000]
    curl localhost:8000/v1/completions -d '{"model": "dpo28", "prompt": "def add(a, b):", "max_tokens": 32}'

What it is for: evaluating a checkpoint (base + LoRA adapters, unmerged, or a merged export as the base) from
the clients researchers already run (the `openai` SDK, lm-evaluation-harness: docs/guides/lm-eval.md), and
serving rollouts / evaluations to `--backend=server --server_url=...` exactly as the in-process jax backend would
draw them. FastAPI + uvicorn, as vLLM; the request models, the error shape and the text rules live in
jaxrl/rollout/serve_protocol.py, the continuous-batching engine in jaxrl/rollout/serve_continuous.py (new
requests join free decode slots at the next round end; the static-batch engine it replaced, kept as the
reference, in jaxrl/rollout/serve_engine.py).

  GET  /health, /version ({"version", "server": "jaxrl"}), /v1/models (the base, then each adapter with its
       `root` folder, `parent` and the `adapter_digest` read back from the attached parameters; `max_model_len`),
       /metrics (Prometheus text: compiled programs, resident memory, waiting and running rows),
       /tokenizer_info
  POST /v1/completions       prompt: a string, strings, token ids or lists of them; n, max_tokens (0 with echo:
                             scoring only), temperature, top_p, top_k, seed, stop (strings), stop_token_ids,
                             include_stop_str_in_output, ignore_eos, logprobs (k: the top k of every token and
                             the token itself), echo (the prompt and its token log-probs, the first null),
                             stream (+ stream_options.include_usage), return_token_ids, skip_special_tokens
  POST /v1/chat/completions  messages through the base's chat template (chat_template_kwargs.enable_thinking);
                             stops at the chat stop ids; logprobs (bool) and top_logprobs; max_completion_tokens;
                             stream
  POST /tokenize, /detokenize (vLLM's), /v1/load_lora_adapter {"lora_name", "lora_path"} (an absolute path
       under --allowed_lora_roots: a PEFT folder in the base's layout or a trainer adapter checkpoint),
       /v1/unload_lora_adapter {"lora_name"}

Semantics as vLLM's: `stop` strings are matched on the decoded text and left out of it (finish_reason "stop",
stop_reason the string); a stop id is kept in token_ids, left out of the text, and named in stop_reason unless it
is an EOS id. Log-probs are at temperature 1 and unfiltered (vLLM's raw_logprobs): with `logprobs: 0` the
sampler's own, with k > 0 or `echo` the teacher-forced pass of the trainer over prompt + completion (the same
`hidden_states` + `token_logprobs`; a top-k dict holds the k most likely tokens and the token itself). `usage` is
in every response. `stream` sends a completion's chunks (one per token) once it is done: the engine answers whole
completions. Errors: {"error": {"message", "type", "param", "code"}} with 400 (a request this server refuses:
context overflow, unsupported field, n or logprobs over their bounds), 404 (unknown model or route), 413 (body
over --max_body_mb), 422 (a field of the wrong type or out of range), 503 (overloaded or shutting down).

Seeds: choice i of a request with seed R is sampled with the jax backend's key for `split_request_seed(R + i)` =
(seed, group id, sample index) (`jaxrl.rollout.backends.openai_client`), as vLLM seeds choice i with R + i; a
request without a seed gets a random group id under the server's own seed.

What keeps it up: max_tokens is bounded by max_model_len minus the prompt (HTTP 400 naming both); a text prompt
longer than any prompt of max_prompt_len tokens could be is refused before it is tokenized; bodies are bounded;
n, logprobs and the number of prompts per request are bounded; sampler programs are per prompt bucket and generation
bucket (serve_continuous.py); at most --max_pending_rows rows wait (503 beyond); uvicorn's backlog takes thousands of
connections. Runtime adapter loading reads only absolute paths under --allowed_lora_roots (resolved, symlinks
followed), answering the same error for a path that is missing as for one that holds no adapter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import secrets
import socket
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Optional, Sequence

import jax.numpy as jnp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl.data.chat import chat_stop_ids, load_tokenizer, render_chat
from jaxrl.export.peft import is_peft_folder, mismatch_message, read_adapter, read_peft_adapter
from jaxrl.models import qwen35
from jaxrl.models.adapters import AdapterError, attach, attached_digest, check_against_model, detach
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.rollout.backends.openai_client import JAXRL_SERVER, SEED_BITS, request_seed, split_request_seed
from jaxrl.rollout.engine import DEFAULT_ROUND_STEPS
from jaxrl.rollout.serve_continuous import ContinuousServeEngine
from jaxrl.rollout.serve_engine import (BatchingEngine, GenerateRows, Overloaded, ScoreRows, ShuttingDown,
                                        compiled_programs)
from jaxrl.rollout.serve_protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          LoadLoraRequest, TokenizeRequest, UnloadLoraRequest, cut_at_stop_string,
                                          message_text, new_id, now, refuse_unsupported, sse, stop_strings,
                                          token_pieces, token_strings, usage)

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
NORMALISATION_SLACK = 4  # a text prompt may shrink this much in characters under Unicode normalisation


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for and how much may wait (module docstring, 'What keeps it up')."""

    max_model_len: Optional[int] = None  # prompt + completion tokens; None: the model's max_position_embeddings
    max_prompt_len: int = 4096
    max_n: int = 256
    max_logprobs: int = 20
    max_prompts: int = 1024  # prompts in one completions request
    max_pending_rows: int = 8192
    max_body_bytes: int = 32 * 2 ** 20


@dataclasses.dataclass
class _Served:
    name: str
    path: str
    adapter: object = None  # jaxrl Adapter; None for the base
    digest: Optional[str] = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class _Choice:
    """One finished completion, as the response builders need it."""

    prompt: int  # index into the request's prompts
    tokens: list
    logprobs: list  # the sampler's, per token
    finish_reason: str
    stop_reason: object  # None | a stop id | a stop string
    text: str


class CompletionServer:
    """The model registry, the engine and the FastAPI app of `launchers.serve` (module docstring).

    model / tokenizer: already loaded objects (tests); default from `base_dir` in `dtype`.
    allowed_lora_roots: folders under which POST /v1/load_lora_adapter may read (empty: runtime loading refused).
    engine: "continuous" (ContinuousServeEngine: batch_size decode slots, round_steps steps per round) or "static"
      (BatchingEngine, the reference the tests and benchmarks/bench_server.py compare against: batch_size rows
      per sampler call, batch_wait_s to gather them).
    """

    def __init__(self, base_dir: str, *, model=None, tokenizer=None, dtype: str = "bfloat16",
                 limits: ServeLimits = ServeLimits(), batch_size: int = 32,
                 prompt_buckets: Optional[Sequence[int]] = None, generation_buckets: Optional[Sequence[int]] = None,
                 served_model_name: Optional[str] = None, allow_lora_updating: bool = True,
                 allowed_lora_roots: Sequence[str] = (), batch_wait_s: float = 0.005,
                 engine: str = "continuous", round_steps: int = DEFAULT_ROUND_STEPS):
        self.base_dir = os.path.abspath(base_dir)
        self.model = model if model is not None else qwen35.from_pretrained(base_dir, dtype=getattr(jnp, dtype))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(base_dir)
        self.layout = load_hf_config(base_dir)[1].kind
        eos = self.model.config.eos_token_id
        self.eos_ids = tuple(sorted({int(eos)} if isinstance(eos, int) else {int(t) for t in eos or ()}))
        self.chat_stop_ids = chat_stop_ids(self.tokenizer, eos)
        self.vocab_size = int(self.model.config.vocab_size)
        positions = int(self.model.config.max_position_embeddings)
        self.max_model_len = min(int(limits.max_model_len or positions), positions)
        self.limits = dataclasses.replace(limits, max_model_len=self.max_model_len,
                                          max_prompt_len=min(int(limits.max_prompt_len), self.max_model_len))
        self.max_prompt_len = self.limits.max_prompt_len
        self.pad_id = self.tokenizer.pad_token_id
        # the most characters one token stands for: a text longer than max_prompt_len of them (with slack for
        # normalisation) has more than max_prompt_len tokens, whatever they are
        self.max_token_chars = max(len(t) for t in self.tokenizer.get_vocab())
        self.base = _Served(served_model_name or base_dir, self.base_dir)
        self.adapters: dict[str, _Served] = {}
        self.allow_lora_updating = bool(allow_lora_updating)
        self.allowed_lora_roots = tuple(os.path.realpath(r) for r in allowed_lora_roots)
        self.server_seed = secrets.randbelow(2 ** SEED_BITS)  # unseeded requests: random group ids under it
        self._attached: Optional[str] = None  # the adapter the model carries now (None: the base)
        self._registry_lock = threading.Lock()
        common = dict(activate=self.attach_model, max_model_len=self.max_model_len,
                      max_prompt_len=self.max_prompt_len, prompt_buckets=prompt_buckets,
                      gen_buckets=generation_buckets, pad_id=self.pad_id,
                      max_pending_rows=self.limits.max_pending_rows)
        if engine == "continuous":
            # version: the registry entry, another object once an adapter is reloaded in place (its lanes then
            # take a fresh snapshot of the weights)
            self.engine = ContinuousServeEngine(self.model, slots=batch_size, round_steps=round_steps,
                                                version=self.served, **common)
        elif engine == "static":
            self.engine = BatchingEngine(self.model, batch_size=batch_size, batch_wait_s=batch_wait_s, **common)
        else:
            raise ValueError(f"engine must be 'continuous' or 'static', got {engine!r}")
        self.app = build_app(self)

    # ------------------------------------------------------------------------------------------------ models
    def models(self) -> dict:
        def card(s: _Served, parent: Optional[str]) -> dict:
            out = {"id": s.name, "object": "model", "created": s.created, "owned_by": "jaxrl", "root": s.path,
                   "parent": parent, "max_model_len": self.max_model_len}
            if s.adapter is not None:
                out["adapter_digest"] = s.digest
            return out
        with self._registry_lock:
            return {"object": "list", "data": [card(self.base, None)] +
                    [card(s, self.base.name) for s in self.adapters.values()]}

    def _check_lora_path(self, path: str) -> str:
        """The resolved folder of a runtime load; ApiError unless it lies under --allowed_lora_roots. Whether
        the path exists is not told apart from whether it holds an adapter (no probing the file system)."""
        if not os.path.isabs(path):
            raise ApiError(f"lora_path must be an absolute path, got {path!r}", param="lora_path")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.allowed_lora_roots):
            roots = ", ".join(self.allowed_lora_roots) or "none: start the server with --allowed_lora_roots"
            raise ApiError(f"lora_path {path} is not under the server's allowed adapter roots ({roots})",
                           param="lora_path")
        return real

    def load_adapter(self, name: str, path: str, load_inplace: bool = False, runtime: bool = True) -> str:
        """Reads and checks an adapter (PEFT folder or trainer checkpoint) and registers it as model `name`.
        runtime: a request's path (confined to the allowed roots); False for --lora_modules at start-up."""
        if not name or not path:
            raise ApiError("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base.name:
            raise ApiError(f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
        with self._registry_lock:
            if name in self.adapters and not load_inplace:
                raise ApiError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", param="lora_name")
        folder = self._check_lora_path(path) if runtime else os.path.abspath(path)
        try:
            if is_peft_folder(folder):
                adapter, layout = read_peft_adapter(folder)
                if layout != self.layout:
                    raise ApiError(mismatch_message(layout, self.layout, path), param="lora_path")
            else:
                adapter = read_adapter(folder)
            check_against_model(adapter, self.model)
        except (AdapterError, OSError, ValueError) as e:
            if isinstance(e, ApiError):
                raise
            if runtime:  # the same answer for a missing path and a folder without an adapter
                raise ApiError(f"Loading lora {name} failed: no adapter could be loaded from {path}",
                               param="lora_path") from None
            raise ApiError(f"Loading lora {name} from {path} failed: {e}") from None
        with self._registry_lock:
            self.adapters[name] = _Served(name, folder, adapter, adapter.digest())
            if self._attached == name:
                self._attached = "\0stale"  # re-attach on the next batch
        logger.info("loaded adapter %s from %s (%d modules, rank %d)", name, folder, len(adapter.modules),
                    adapter.rank)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, name: str) -> str:
        with self._registry_lock:
            if not name:
                raise ApiError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
            if name not in self.adapters:
                raise ApiError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name")
            del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def served(self, model: Optional[str]) -> _Served:
        with self._registry_lock:
            if model in (None, "", self.base.name):
                return self.base
            if model in self.adapters:
                return self.adapters[model]
        raise ApiError(f"The model `{model}` does not exist.", 404, "model")

    def attach_model(self, name: str) -> None:
        """Makes the held model carry model `name`'s adapter (the engine's worker thread calls it before it
        generates or scores with that model)."""
        if self._attached == name:
            return
        served = self.served(name)
        detach(self.model)
        if served.adapter is not None:
            attach(self.model, served.adapter)
            got = attached_digest(self.model)
            if got != served.digest:  # what the parameters hold now, read back
                raise RuntimeError(f"attached adapter digest {got} != {served.digest} of {served.path}")
        self._attached = name

    # ---------------------------------------------------------------------------------------------- prompts
    def encode_text(self, text: str, what: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt; a text too long to fit max_prompt_len tokens is refused before tokenizing."""
        if len(text) > NORMALISATION_SLACK * self.max_token_chars * self.max_prompt_len:
            raise ApiError(f"{what} has {len(text)} characters: more than {self.max_prompt_len} tokens (this "
                           f"server's max_prompt_len) could hold", param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def prompt_ids(self, prompt) -> tuple[list[list[int]], list[Optional[str]]]:
        """(token ids, text or None) of each prompt of a completions request."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise ApiError("prompt is empty", param="prompt")
        if len(prompt) > self.limits.max_prompts:
            raise ApiError(f"{len(prompt)} prompts in one request; at most {self.limits.max_prompts}",
                           param="prompt")
        ids, texts = [], []
        for j, p in enumerate(prompt):
            if isinstance(p, str):
                texts.append(p)
                p = self.encode_text(p, f"prompt {j}")
            else:
                texts.append(None)
            if not p:
                raise ApiError(f"prompt {j} is empty", param="prompt")
            ids.append(self.check_prompt(p, j))
        return ids, texts

    def check_prompt(self, ids: Sequence[int], j: int = 0) -> list[int]:
        if len(ids) > self.max_prompt_len:
            raise ApiError(f"prompt {j} has {len(ids)} tokens, over this server's max_prompt_len "
                           f"{self.max_prompt_len} (launchers.serve --max_prompt_len)", param="prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ApiError(f"prompt {j} has token ids outside [0, {self.vocab_size})", param="prompt")
        return [int(t) for t in ids]

    def max_tokens(self, requested: Optional[int], prompts: list[list[int]], field: str = "max_tokens") -> int:
        """The completion cap: as requested (None: the rest of the context, as vLLM), within max_model_len."""
        longest = max(len(p) for p in prompts)
        room = self.max_model_len - longest
        if requested is None:
            return max(room, 0)
        if int(requested) > room:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {longest + int(requested)} tokens ({longest} in the prompt, {int(requested)} "
                           f"in the completion). Please reduce the prompt or {field}.", param=field)
        return int(requested)

    # -------------------------------------------------------------------------------------------- generation
    def _stops(self, req, default_stop: Sequence[int]) -> tuple[tuple, set, list, dict]:
        """(the sampler's stop ids, the requested stop ids, the stop strings, {id: stop string} of strings that
        are one token: rows also stop on those ids)."""
        requested = [int(t) for t in (req.stop_token_ids or [])]
        bad = [t for t in requested if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        strings = stop_strings(req.stop)
        one_token = {}
        for s in strings:
            ids = self.tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                one_token.setdefault(int(ids[0]), s)
        stop = set(requested) | set(default_stop) | set(one_token)
        if not req.ignore_eos:
            stop |= set(self.eos_ids)
        return tuple(sorted(stop)), set(requested), strings, one_token

    def _sampling(self, req) -> tuple[float, float, int]:
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        top_k = 0 if req.top_k in (None, -1) else int(req.top_k)
        return temperature, top_p, top_k

    def _check_counts(self, req, prompts: list) -> None:
        if req.n > self.limits.max_n:
            raise ApiError(f"n={req.n} is over this server's bound {self.limits.max_n} (launchers.serve --max_n)",
                           param="n")
        if len(prompts) * req.n > self.limits.max_pending_rows:
            raise ApiError(f"{len(prompts)} prompts x n={req.n} rows exceed what this server queues "
                           f"({self.limits.max_pending_rows})", param="n")

    def submit_generation(self, req, served: _Served, prompts: list[list[int]], max_tokens: int,
                          stop_ids: tuple) -> list:
        """Queues the rows of a request (prompt-major, n per prompt); returns [(future, [choice index])]."""
        seed = req.seed if req.seed is not None else request_seed(self.server_seed, secrets.randbits(32))
        temperature, top_p, top_k = self._sampling(req)
        by_seed: dict[int, dict] = {}
        for j, p in enumerate(prompts):
            for i in range(req.n):
                s, group, sample = split_request_seed(int(seed) + i)
                part = by_seed.setdefault(s, {"prompts": [], "groups": [], "samples": [], "index": []})
                part["prompts"].append(p)
                part["groups"].append(group)
                part["samples"].append(sample)
                part["index"].append(j * req.n + i)
        out = []
        try:
            for s, part in by_seed.items():
                work = GenerateRows(served.name, part["prompts"], part["groups"], part["samples"],
                                    [max_tokens] * len(part["prompts"]), stop_ids, temperature, top_p, top_k, s)
                out.append((self.engine.submit(work), part["index"]))
        except Overloaded as e:
            raise ApiError(str(e), 503) from None
        except ShuttingDown as e:
            raise ApiError(str(e), 503) from None
        return out

    async def gather_rows(self, parts: list, rows: int) -> list:
        got: list = [None] * rows
        for future, index in parts:
            try:
                result = await asyncio.wrap_future(future)
            except ShuttingDown as e:
                raise ApiError(str(e), 503) from None
            for k, row in zip(index, result):
                got[k] = row
        return got

    async def score(self, served: _Served, sequences: list[list[int]], top_k: int) -> list:
        try:
            future = self.engine.submit(ScoreRows(served.name, sequences, top_k))
        except (Overloaded, ShuttingDown) as e:
            raise ApiError(str(e), 503) from None
        try:
            return await asyncio.wrap_future(future)
        except ShuttingDown as e:
            raise ApiError(str(e), 503) from None

    def finish(self, row, prompt: int, stop_ids: set, requested: set, strings: list, one_token: dict,
               include_stop: bool, skip_special: bool) -> _Choice:
        """A sampled row as the client sees it: stop strings cut, the text decoded (module docstring)."""
        tokens, lps, reason = list(row.tokens), list(row.logprobs), row.finish_reason
        ended_on = tokens[-1] if reason == "stop" and tokens and tokens[-1] in stop_ids else None
        body = tokens[:-1] if ended_on is not None else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=skip_special)
        cut = cut_at_stop_string(self.tokenizer, body, text, strings, include_stop, skip_special) if strings else None
        if cut is not None:
            tokens, text, stop_reason = cut
            return _Choice(prompt, tokens, lps[:len(tokens)], "stop", stop_reason, text)
        stop_reason = None
        if ended_on is not None and ended_on in one_token and ended_on not in requested:
            stop_reason = one_token[ended_on]
            if include_stop:
                text += stop_reason
        elif ended_on is not None and ended_on in requested and ended_on not in self.eos_ids:
            stop_reason = ended_on
        return _Choice(prompt, tokens, lps, reason, stop_reason, text)

    async def generate(self, req, served, prompts, max_tokens, default_stop) -> list[_Choice]:
        stop_ids, requested, strings, one_token = self._stops(req, default_stop)
        rows = len(prompts) * req.n
        if max_tokens == 0:
            return [_Choice(k // req.n, [], [], "length", None, "") for k in range(rows)]
        parts = self.submit_generation(req, served, prompts, max_tokens, stop_ids)
        got = await self.gather_rows(parts, rows)
        return [self.finish(row, k // req.n, set(stop_ids), requested, strings, one_token,
                            req.include_stop_str_in_output, req.skip_special_tokens) for k, row in enumerate(got)]

    # ------------------------------------------------------------------------------------------- completions
    def _logprob_entries(self, ids: Sequence[int], values: Sequence, top_ids, top_values, as_ids: bool) -> tuple:
        """(token strings, token log-probs, top-log-prob dicts) of tokens whose scores are given."""
        strings = token_strings(self.tokenizer, ids, as_ids)
        tops = []
        for k, (t, v) in enumerate(zip(ids, values)):
            if top_ids is None:
                tops.append({strings[k]: float(v)})
                continue
            entry: dict = {}
            for s, x in zip(token_strings(self.tokenizer, top_ids[k], as_ids), top_values[k]):
                entry.setdefault(s, float(x))  # two ids of one text: the likelier one's value (greedy checks)
            entry.setdefault(strings[k], float(v))  # the token itself, as vLLM, when outside the top k
            tops.append(entry)
        return strings, [float(v) for v in values], tops

    async def completions(self, req: CompletionRequest):
        refuse_unsupported(req)
        served = self.served(req.model)
        if req.logprobs is not None and req.logprobs > self.limits.max_logprobs:
            raise ApiError(f"logprobs={req.logprobs} is over this server's bound {self.limits.max_logprobs}",
                           param="logprobs")
        prompts, texts = self.prompt_ids(req.prompt)
        self._check_counts(req, prompts)
        max_tokens = self.max_tokens(req.max_tokens, prompts)
        if req.stream and req.echo and req.n > 1:
            raise ApiError("echo with stream and n > 1 is not supported", param="echo")
        choices = await self.generate(req, served, prompts, max_tokens, ())
        k = req.logprobs
        scores = None
        if k is not None and (req.echo or k > 0):  # teacher-forced: the prompt's log-probs, every token's top k
            scores = await self.score(served, [prompts[c.prompt] + c.tokens for c in choices], k or 0)
        model = served.name
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.tokens) for c in choices)
        out = []
        for idx, c in enumerate(choices):
            p = prompts[c.prompt]
            prompt_text = (texts[c.prompt] if texts[c.prompt] is not None else
                           self.tokenizer.decode(p, skip_special_tokens=False)) if req.echo else ""
            choice = {"index": idx, "text": prompt_text + c.text, "logprobs": None, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if k is not None:
                choice["logprobs"] = self._completion_logprobs(req, p, c, scores[idx] if scores else None)
            if req.return_token_ids:
                choice["token_ids"] = list(c.tokens)
                choice["prompt_token_ids"] = list(p)
            out.append(choice)
        body = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model,
                "choices": out, "usage": usage(prompt_tokens, completion_tokens)}
        if req.stream:
            return StreamingResponse(self._stream_completion(req, body, choices, prompts),
                                     media_type="text/event-stream")
        return body

    def _completion_logprobs(self, req, prompt: list, c: _Choice, score) -> dict:
        as_ids = req.return_tokens_as_token_ids
        if score is None:  # logprobs=0 without echo: the sampler's log-prob of each sampled token
            strings, values, tops = self._logprob_entries(c.tokens, c.logprobs, None, None, as_ids)
        else:
            start = 0 if req.echo else len(prompt) - 1  # score position t-1 holds token t
            ids = (prompt + c.tokens)[start + 1:] if not req.echo else (prompt + c.tokens)[1:]
            values = score.logprobs[start:]
            top_ids = score.top_ids[start:] if req.logprobs else None
            strings, values, tops = self._logprob_entries(ids, values, top_ids, score.top_logprobs[start:], as_ids)
            if req.echo:  # the first prompt token has no log-prob
                strings = token_strings(self.tokenizer, prompt[:1], as_ids) + strings
                values, tops = [None] + values, [None] + tops
        if not req.logprobs and score is not None:
            tops = [None if t is None else {s: v} for t, s, v in zip(tops, strings, values)]
        pieces = (token_pieces(self.tokenizer, prompt, False) if req.echo else []) + token_pieces(
            self.tokenizer, c.tokens, req.skip_special_tokens)
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    async def _stream_completion(self, req, body: dict, choices: list[_Choice], prompts: list):
        head = {k: body[k] for k in ("id", "object", "created", "model")}
        for idx, c in enumerate(choices):
            full = body["choices"][idx]
            lp = full["logprobs"]
            echo_len = len(prompts[c.prompt]) if req.echo else 0
            if req.echo:
                prompt_text = full["text"][:len(full["text"]) - len(c.text)]
                chunk_lp = None if lp is None else {key: lp[key][:echo_len] for key in lp}
                yield sse({**head, "choices": [{"index": idx, "text": prompt_text, "logprobs": chunk_lp,
                                                "finish_reason": None, "stop_reason": None}]})
            for k, piece in enumerate(_clip_pieces(token_pieces(self.tokenizer, c.tokens, req.skip_special_tokens),
                                                   c.text)):
                chunk_lp = None if lp is None else {key: lp[key][echo_len + k:echo_len + k + 1] for key in lp}
                yield sse({**head, "choices": [{"index": idx, "text": piece, "logprobs": chunk_lp,
                                                "finish_reason": None, "stop_reason": None}]})
            yield sse({**head, "choices": [{"index": idx, "text": "", "logprobs": None,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": body["usage"]})
        yield sse("[DONE]")

    # -------------------------------------------------------------------------------------------------- chat
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": message_text(m.content)} for m in req.messages]
        kwargs = req.chat_template_kwargs or {}
        text = render_chat(self.tokenizer, messages, bool(kwargs.get("enable_thinking", False)),
                           req.add_generation_prompt)
        return self.check_prompt(self.encode_text(text, "the templated conversation", add_special_tokens=False))

    async def chat_completions(self, req: ChatCompletionRequest):
        refuse_unsupported(req)
        if req.echo:
            raise ApiError("echo is not supported for chat completions (use /v1/completions with echo)",
                           param="echo")
        served = self.served(req.model)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if top > self.limits.max_logprobs:
            raise ApiError(f"top_logprobs={top} is over this server's bound {self.limits.max_logprobs}",
                           param="top_logprobs")
        prompt = self.chat_prompt(req)
        self._check_counts(req, [prompt])
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None
                                     else req.max_tokens, [prompt], field)
        choices = await self.generate(req, served, [prompt], max_tokens, self.chat_stop_ids)
        scores = await self.score(served, [prompt + c.tokens for c in choices], top) if top else None
        out = []
        for idx, c in enumerate(choices):
            choice = {"index": idx, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(req, prompt, c, scores[idx] if scores else None)}
            if req.return_token_ids:
                choice["token_ids"] = list(c.tokens)
            out.append(choice)
        body = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": served.name,
                "choices": out, "usage": usage(len(prompt), sum(len(c.tokens) for c in choices))}
        if req.stream:
            return StreamingResponse(self._stream_chat(req, body, choices), media_type="text/event-stream")
        return body

    def _chat_logprobs(self, req, prompt: list, c: _Choice, score) -> list:
        as_ids = req.return_tokens_as_token_ids
        strings = token_strings(self.tokenizer, c.tokens, as_ids)
        start = len(prompt) - 1
        values = c.logprobs if score is None else score.logprobs[start:start + len(c.tokens)]
        entries = []
        for k, (s, v) in enumerate(zip(strings, values)):
            top = []
            if score is not None:
                for t, x in zip(score.top_ids[start + k], score.top_logprobs[start + k]):
                    ts = token_strings(self.tokenizer, [t], as_ids)[0]
                    top.append({"token": ts, "logprob": float(x), "bytes": list(ts.encode("utf-8"))})
            entries.append({"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8")), "top_logprobs": top})
        return entries

    async def _stream_chat(self, req, body: dict, choices: list[_Choice]):
        head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        for idx, c in enumerate(choices):
            yield sse({**head, "choices": [{"index": idx, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
            entries = (body["choices"][idx]["logprobs"] or {}).get("content")
            for k, piece in enumerate(_clip_pieces(token_pieces(self.tokenizer, c.tokens, req.skip_special_tokens),
                                                   c.text)):
                lp = None if entries is None else {"content": entries[k:k + 1]}
                yield sse({**head, "choices": [{"index": idx, "delta": {"content": piece}, "logprobs": lp,
                                                "finish_reason": None}]})
            yield sse({**head, "choices": [{"index": idx, "delta": {}, "logprobs": None,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": body["usage"]})
        yield sse("[DONE]")

    # ------------------------------------------------------------------------------------------------ misc
    def metrics_text(self) -> str:
        stats = self.engine.stats()
        lines = []
        for name, kind, value, help_text in (
                ("jaxrl:compiled_programs", "gauge", compiled_programs(), "sampler and scorer programs traced"),
                ("process_resident_memory_bytes", "gauge", resident_bytes(), "resident memory of the process"),
                ("jaxrl:num_requests_waiting", "gauge", stats["requests_waiting"], "requests queued"),
                ("jaxrl:num_rows_waiting", "gauge", stats["rows_waiting"], "rows queued"),
                ("jaxrl:num_rows_running", "gauge", stats["rows_running"], "rows decoding or being scored"),
                ("jaxrl:rows_generated_total", "counter", stats["rows_generated"], "rows sampled"),
                ("jaxrl:rows_scored_total", "counter", stats["rows_scored"], "rows scored (echo, top-k)"),
                # the continuous engine's own counters (absent for the static one)
                ("jaxrl:engine_rounds_total", "counter", stats.get("rounds"), "decode rounds"),
                ("jaxrl:engine_inserts_total", "counter", stats.get("inserts"), "prefills moving rows into free slots"),
                ("jaxrl:engine_decode_steps_total", "counter", stats.get("decode_steps"), "decode steps")):
            if value is not None:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    def tokenizer_info(self) -> dict:
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": self.max_model_len}

    def close(self) -> None:
        self.engine.close()

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
                                timeout_graceful_shutdown=graceful_timeout_s, lifespan="off", access_log=False)
        return uvicorn.Server(config)


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


def _clip_pieces(pieces: list[str], text: str) -> list[str]:
    """Per-token pieces trimmed to a completion's final `text` (cut at a stop string); what is missing of it
    (an incomplete character at the end) joins the last piece."""
    out, at = [], 0
    for piece in pieces:
        keep = piece[:max(0, len(text) - at)]
        out.append(keep)
        at += len(keep)
    if at < len(text):
        if out:
            out[-1] += text[at:]
        else:
            out.append(text[at:])
    return out


# ---------------------------------------------------------------------------------------------------------------
# The HTTP layer


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413, at once when its Content-Length says so,
    else as soon as the bytes read exceed it (a chunked body); the app gets the body only once it is whole and
    within the limit. A malformed Content-Length never reaches the app (uvicorn answers 400)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, int(max_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
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


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError("the request body is not valid JSON", 400)
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return ApiError("the request body must be a JSON object", 400)
    text = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}"
                     for e in errors[:5])
    return ApiError(f"invalid request: {text}", 422, param)


def build_app(server: CompletionServer) -> FastAPI:
    app = FastAPI(title="jaxrl", docs_url=None, redoc_url=None, openapi_url=None)

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
        return server.models()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        server.served(req.model)
        if req.messages is not None:
            text = render_chat(server.tokenizer, [{"role": m.role, "content": message_text(m.content)}
                                                  for m in req.messages], False, req.add_generation_prompt)
            ids = server.encode_text(text, "the templated conversation", add_special_tokens=False)
        elif req.prompt is not None:
            ids = server.encode_text(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise ApiError("give `prompt` or `messages`", param="prompt")
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.served(req.model)
        if any(not 0 <= t < server.vocab_size for t in req.tokens):
            raise ApiError(f"tokens outside [0, {server.vocab_size})", param="tokens")
        return {"prompt": server.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await server.completions(req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await server.chat_completions(req)

    if server.allow_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora(req: LoadLoraRequest):
            text = await asyncio.to_thread(server.load_adapter, req.lora_name, req.lora_path, req.load_inplace)
            return PlainTextResponse(text)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(req: UnloadLoraRequest):
            return PlainTextResponse(server.unload_adapter(req.lora_name))

    return BodyLimit(app, server.limits.max_body_bytes)


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

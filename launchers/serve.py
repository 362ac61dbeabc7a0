r"""Serve a base model and LoRA adapters (unmerged) over the OpenAI API as vLLM speaks it, backed by the JAX sampler.

    python -m launchers.serve --base=/models/Qwen3.5-4B --lora_modules=dpo28=RUN/export/peft_28 --port=8000
    # any OpenAI client: completions (text or token ids; stop strings, logprobs, echo, stream) and chat
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "dpo28", "messages": [{"role": "user", "content": "Write FizzBuzz."}], "max_tokens": 256}'
    # lm-evaluation-harness against it: docs/guides/lm-eval.md
    # rollouts / evaluation through it, sample for sample what --backend=jax draws
    python -m launchers.evaluate ... --backend=server --server_url=http://127.0.0.1:8000

Adapters: PEFT folders in the base's layout or trainer adapter checkpoints, at start-up (--lora_modules) or at
run time (POST /v1/load_lora_adapter {"lora_name", "lora_path"}, /v1/unload_lora_adapter). Runtime loading is on
by default only on a loopback bind, and reads only absolute paths under --allowed_lora_roots (default there: the
working directory); on another address it takes --enable_lora_updating and explicit --allowed_lora_roots.
The API, the seed semantics and the limits: jaxrl/rollout/server.py; the batching: jaxrl/rollout/serve_continuous.py
(continuous: --batch_size rows decode at once, and a new request takes a free slot at the next round end).
Binds 127.0.0.1 unless --host says otherwise; --port=0 picks a free port (written to --ready_file, with the URL,
once the server listens; the file is removed when it stops). SIGINT / SIGTERM: stop accepting, answer the
requests in flight (up to --graceful_shutdown_s), exit 130 / 143.
"""

from __future__ import annotations

import contextlib
import os

from absl import app, flags, logging

from launchers import _main

_BASE = flags.DEFINE_string("base", None, "Base HF folder (weights, config.json, tokenizer, chat template); a "
                            "merged export serves as a base too.")
_LORA = flags.DEFINE_list("lora_modules", [], "NAME=PATH,...: adapters served at start-up (PEFT folders or "
                          "trainer adapter checkpoints).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "Port; 0 = any free port.")
_READY = flags.DEFINE_string("ready_file", None, "Write the server's URL here once it listens (removed on exit).")
_NAME = flags.DEFINE_string("served_model_name", None, "Model id of the base (default: --base as given).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 0, "Prompt + completion tokens of one request (0: the model's "
                                      "max_position_embeddings); max_tokens is bounded by it minus the prompt.")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 4096, "Longest prompt accepted, in tokens.")
_PROMPT_BUCKETS = flags.DEFINE_list("prompt_buckets", [], "Prompt lengths with their own compiled program "
                                    "(default 32, 64, ... up to --max_prompt_len).")
_GEN_BUCKETS = flags.DEFINE_list("generation_buckets", [], "Generation lengths with their own compiled program; "
                                 "max_tokens is rounded up to one (default 16, 64, 256, ... up to --max_model_len).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Rows decoded at once (slots per prompt bucket and generation "
                                    "bucket), and rows per scoring call.")
_ROUND_STEPS = flags.DEFINE_integer("round_steps", 0, "Decode steps per round at most: a request that finds every "
                                    "slot busy waits up to this many steps for one to free (0: the engine's "
                                    "DEFAULT_ROUND_STEPS).")
_MAX_N = flags.DEFINE_integer("max_n", 256, "Largest `n` of one request.")
_MAX_PENDING = flags.DEFINE_integer("max_pending_rows", 8192, "Rows waiting or running before new requests get "
                                    "HTTP 503.")
_MAX_BODY = flags.DEFINE_float("max_body_mb", 32.0, "Largest request body, in MiB (HTTP 413 beyond).")
_BACKLOG = flags.DEFINE_integer("backlog", 2048, "Connections the listening socket queues.")
_GRACE = flags.DEFINE_integer("graceful_shutdown_s", 30, "On SIGINT / SIGTERM, how long requests in flight may "
                              "take to finish.")
_UPDATING = flags.DEFINE_bool("enable_lora_updating", None, "Offer /v1/load_lora_adapter and "
                              "/v1/unload_lora_adapter (default: on for a loopback --host only).")
_ROOTS = flags.DEFINE_list("allowed_lora_roots", [], "Folders runtime adapter loads may read under (default on a "
                           "loopback --host: the working directory).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _BASE.value:
        raise app.UsageError("--base is required")
    from jaxrl.rollout.serve_protocol import ApiError
    from jaxrl.rollout.server import CompletionServer, ServeLimits, is_loopback, url_of
    loopback = is_loopback(_HOST.value)
    updating = loopback if _UPDATING.value is None else _UPDATING.value
    roots = list(_ROOTS.value) or ([os.getcwd()] if loopback else [])
    if updating and not roots:
        raise app.UsageError(f"--enable_lora_updating on a non-loopback --host={_HOST.value} needs "
                             "--allowed_lora_roots (the folders adapters may be loaded from)")
    limits = ServeLimits(max_model_len=_MAX_MODEL_LEN.value or None, max_prompt_len=_MAX_PROMPT_LEN.value,
                         max_n=_MAX_N.value, max_pending_rows=_MAX_PENDING.value,
                         max_body_bytes=int(_MAX_BODY.value * 2 ** 20))
    round_steps = {"round_steps": _ROUND_STEPS.value} if _ROUND_STEPS.value else {}
    server = CompletionServer(_BASE.value, dtype=_DTYPE.value, limits=limits, batch_size=_BATCH_SIZE.value,
                              prompt_buckets=tuple(int(b) for b in _PROMPT_BUCKETS.value) or None,
                              generation_buckets=tuple(int(b) for b in _GEN_BUCKETS.value) or None,
                              served_model_name=_NAME.value, allow_lora_updating=updating,
                              allowed_lora_roots=roots, **round_steps)
    sock = None
    try:
        for spec in _LORA.value:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise app.UsageError(f"--lora_modules: expected NAME=PATH, got {spec!r}")
            try:
                server.load_adapter(name, path, runtime=False)
            except ApiError as e:
                raise app.UsageError(f"--lora_modules {name}: {e}") from None
        sock = server.bind(_HOST.value, _PORT.value, _BACKLOG.value)
        httpd = server.uvicorn_server(sock, _GRACE.value, _BACKLOG.value)
        url = url_of(sock)
        if _READY.value:
            tmp = _READY.value + ".tmp"
            with open(tmp, "w") as f:
                f.write(url + "\n")
            os.replace(tmp, _READY.value)
        logging.info("serving %s (+ %d adapters) on %s; runtime adapter loading %s", server.base.name,
                     len(server.adapters), url, f"under {', '.join(roots)}" if updating else "off")
        print(f"serve: listening on {url}", flush=True)
        # uvicorn handles SIGINT / SIGTERM (stop accepting, finish the requests in flight), then raises the signal
        # again, which the launcher turns into exit status 130 / 143 (launchers/_main.py)
        httpd.run(sockets=[sock])
    finally:
        server.close()
        if sock is not None:
            sock.close()
        if _READY.value:
            with contextlib.suppress(FileNotFoundError):
                os.remove(_READY.value)


if __name__ == "__main__":
    _main.run(main)

r"""Serve a base model and LoRA adapters (unmerged) over the OpenAI API as vLLM speaks it, backed by the generation
engine.

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
The API, the seed semantics and the limits: jaxrl/serve/app.py and handlers.py; the scheduling is the engine's
(jaxrl/generation/engine.py: --batch_size rows decode at once per pool, a new request takes a free slot at the
next round end). Before it listens it compiles the programs of its buckets (--warmup; false to start at once); a
request whose programs are not compiled waits while a thread of their own compiles them, and the others go on.
Binds 127.0.0.1 unless --host says otherwise; --port=0 picks a free port (written to --ready_file,
with the URL, once the server listens; the file is removed when it stops). SIGINT / SIGTERM: stop accepting,
answer the requests in flight (up to --graceful_shutdown_s), exit 130 / 143.
"""

from __future__ import annotations

import contextlib
import os

from absl import app, logging

from jaxrl.serve.settings import ServeLimits, ServeSettings
from jaxrl.utils import dataclass_flags
from launchers import _main

_LIMITS = dataclass_flags.define_flags(ServeLimits)  # a flag per ServeLimits field (its NOT_A_FLAG ones aside)
_SETTINGS = dataclass_flags.define_flags(ServeSettings)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(ServeSettings, _SETTINGS)
    limits = dataclass_flags.config_from_flags(ServeLimits, _LIMITS)
    if not s.base:
        raise app.UsageError("--base is required")
    if limits.max_logprobs < -1:
        raise app.UsageError(f"--max_logprobs={limits.max_logprobs}: a k of top log-probs, or -1 (the vocabulary)")
    from jaxrl.serve.app import CompletionServer, is_loopback, url_of
    from jaxrl.serve.protocol import ApiError
    loopback = is_loopback(s.host)
    updating = loopback if s.enable_lora_updating is None else s.enable_lora_updating
    roots = list(s.allowed_lora_roots) or ([os.getcwd()] if loopback else [])
    if updating and not roots:
        raise app.UsageError(f"--enable_lora_updating on a non-loopback --host={s.host} needs "
                             "--allowed_lora_roots (the folders adapters may be loaded from)")
    server = CompletionServer(s.base, dtype=s.dtype, limits=limits, batch_size=s.batch_size,
                              prompt_buckets=s.prompt_buckets or None, generation_buckets=s.generation_buckets or None,
                              served_model_name=s.served_model_name, allow_lora_updating=updating,
                              allowed_lora_roots=roots, round_steps=s.round_steps,
                              round_delay_s=s.debug_round_delay_s)
    sock = None
    try:
        for spec in s.lora_modules:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise app.UsageError(f"--lora_modules: expected NAME=PATH, got {spec!r}")
            try:
                server.load_adapter(name, path, runtime=False)
            except ApiError as e:
                raise app.UsageError(f"--lora_modules {name}: {e}") from None
        if s.warmup:
            server.warm_up()
        sock = server.bind(s.host, s.port, s.backlog)
        httpd = server.uvicorn_server(sock, s.graceful_shutdown_s, s.backlog)
        url = url_of(sock)
        if s.ready_file:
            tmp = s.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(url + "\n")
            os.replace(tmp, s.ready_file)
        logging.info("serving %s (+ %d adapters) on %s; runtime adapter loading %s", server.registry.base.name,
                     len(server.registry.adapters), url, f"under {', '.join(roots)}" if updating else "off")
        print(f"serve: listening on {url}", flush=True)
        # uvicorn handles SIGINT / SIGTERM (stop accepting, finish the requests in flight), then raises the signal
        # again, which the launcher turns into exit status 130 / 143 (launchers/_main.py)
        httpd.run(sockets=[sock])
    finally:
        server.close()
        if sock is not None:
            sock.close()
        if s.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.remove(s.ready_file)


if __name__ == "__main__":
    _main.run(main)

r"""Serve a base model and LoRA adapters (unmerged) over an OpenAI-compatible API, backed by the JAX sampler.

    python -m launchers.serve --base=/models/Qwen3.5-4B --lora_modules=dpo28=RUN/export/peft_28 --port=8000
    # any OpenAI client: completions (token ids or text) and chat completions, base or adapter by model name
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "dpo28", "messages": [{"role": "user", "content": "Write FizzBuzz."}], "max_tokens": 256}'
    # rollouts / evaluation through it, sample for sample what --backend=jax draws
    python -m launchers.evaluate ... --backend=server --server_url=http://127.0.0.1:8000

Adapters: PEFT folders in the base's layout or trainer adapter checkpoints, at start-up (--lora_modules) or at
run time (POST /v1/load_lora_adapter {"lora_name", "lora_path"}, /v1/unload_lora_adapter; off with
--noenable_lora_updating). The API, the seed semantics and the batching: jaxrl/rollout/server.py.
Binds 127.0.0.1 unless --host says otherwise; --port=0 picks a free port (written to --ready_file, with the URL,
once the server listens).
"""

from __future__ import annotations

import os
import signal
import threading

from absl import app, flags, logging

from launchers import _main

_BASE = flags.DEFINE_string("base", None, "Base HF folder (weights, config.json, tokenizer, chat template).")
_LORA = flags.DEFINE_list("lora_modules", [], "NAME=PATH,...: adapters served at start-up (PEFT folders or "
                          "trainer adapter checkpoints).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "Port; 0 = any free port.")
_READY = flags.DEFINE_string("ready_file", None, "Write the server's URL here once it listens.")
_NAME = flags.DEFINE_string("served_model_name", None, "Model id of the base (default: --base as given).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 4096, "Longest prompt accepted, in tokens.")
_PROMPT_BUCKETS = flags.DEFINE_list("prompt_buckets", [], "Prompt lengths with their own compiled program "
                                    "(default 32, 64, ... up to --max_prompt_len).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Rows per compiled sampler call.")
_BATCH_WAIT = flags.DEFINE_float("batch_wait_ms", 5.0, "How long the first request waits for others to batch with.")
_UPDATING = flags.DEFINE_bool("enable_lora_updating", True, "Offer /v1/load_lora_adapter and /v1/unload_lora_adapter.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _BASE.value:
        raise app.UsageError("--base is required")
    from jaxrl.rollout.server import CompletionServer, RequestError
    server = CompletionServer(_BASE.value, dtype=_DTYPE.value, max_prompt_len=_MAX_PROMPT_LEN.value,
                              batch_size=_BATCH_SIZE.value,
                              prompt_buckets=tuple(int(b) for b in _PROMPT_BUCKETS.value) or None,
                              served_model_name=_NAME.value, allow_lora_updating=_UPDATING.value,
                              batch_wait_s=_BATCH_WAIT.value / 1000.0)
    for spec in _LORA.value:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise app.UsageError(f"--lora_modules: expected NAME=PATH, got {spec!r}")
        try:
            server.load_adapter(name, path)
        except RequestError as e:
            raise app.UsageError(f"--lora_modules {name}: {e}") from None
    httpd = server.serve(_HOST.value, _PORT.value)
    # SIGINT (Ctrl-C) and SIGTERM (what process managers send) stop serving; the server closes cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    if _READY.value:
        tmp = _READY.value + ".tmp"
        with open(tmp, "w") as f:
            f.write(server.url + "\n")
        os.replace(tmp, _READY.value)
    logging.info("serving %s (+ %d adapters) on %s", server.base.name, len(server.adapters), server.url)
    print(f"serve: listening on {server.url}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        server.close()


if __name__ == "__main__":
    _main.run(main)

"""The settings of a server, each declared once: `ServeLimits` (what one request may ask for and how much may wait)
and `ServeSettings` (the rest of `launchers.serve`: the model, the engine's sizes, the socket, adapters). Their
fields are the launcher's flags (jaxrl.utils.dataclass_flags); no jax here, so `--help` stays quick.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrl.utils.dataclass_flags import NOT_A_FLAG, flag_field

DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for and how much may wait (jaxrl/serve/app.py, 'What keeps it up')."""

    max_model_len: int = flag_field(0, help="Prompt + completion tokens of one request (0: the model's "
                                    "max_position_embeddings); max_tokens is bounded by it minus the prompt.")
    max_prompt_len: int = flag_field(4096, help="Longest prompt accepted, in tokens.")
    max_n: int = flag_field(256, help="Largest `n` of one request.")
    max_pending_rows: int = flag_field(8192, help="Rows waiting or running before new requests get HTTP 503.")
    max_body_mb: float = flag_field(32.0, help="Largest request body, in MiB (HTTP 413 beyond).")
    max_response_entries: int = flag_field(2 ** 22, help="Entries one response may carry: each returned token "
                                           "(echoed prompt tokens included) counts 1, plus 1 + k when log-probs with "
                                           "top k are asked for; a request that could return more is refused (HTTP "
                                           "400) before it runs.")
    max_logprobs: int = flag_field(20, help="Most top log-probs of one token a request may ask for (logprobs, "
                                   "top_logprobs, prompt_logprobs), as vLLM's --max-logprobs and its default; -1 = "
                                   "the vocabulary. Each k over 20 compiles its own scoring program (k rounded up to "
                                   "a power of two).")
    max_prompts: int = dataclasses.field(default=1024, metadata=NOT_A_FLAG)  # prompts in one completions request

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2 ** 20)


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Everything else `launchers.serve` is told (its flags, with ServeLimits')."""

    base: Optional[str] = flag_field(None, help="Base HF folder (weights, config.json, tokenizer, chat template); "
                                     "a merged export serves as a base too.")
    lora_modules: tuple[str, ...] = flag_field((), help="NAME=PATH,...: adapters served at start-up (PEFT folders "
                                               "or trainer adapter checkpoints).")
    host: str = flag_field("127.0.0.1", help="Address to bind.")
    port: int = flag_field(8000, help="Port; 0 = any free port.")
    ready_file: Optional[str] = flag_field(None, help="Write the server's URL here once it listens (removed on "
                                           "exit).")
    served_model_name: Optional[str] = flag_field(None, help="Model id of the base (default: --base as given).")
    dtype: str = flag_field("bfloat16", choices=DTYPES, help="Compute dtype.")
    prompt_buckets: tuple[int, ...] = flag_field((), help="Prompt lengths with their own compiled program "
                                                 "(default 32, 64, ... up to --max_prompt_len).")
    generation_buckets: tuple[int, ...] = flag_field((), help="Generation lengths with their own compiled program; "
                                                     "max_tokens is rounded up to one (default 16, 64, 256, ... up "
                                                     "to --max_model_len).")
    warmup: bool = flag_field(True, help="Compile the programs of the configured buckets before listening (every "
                              "prompt bucket x generation bucket, greedy and temperature sampling; scoring of every "
                              "length and batch bucket for top-k 0 and 1), for the base and the --lora_modules "
                              "adapters; false: each compiles at its first request, on the compiler's thread, while "
                              "requests of compiled shapes go on.")
    batch_size: int = flag_field(32, help="Rows decoded at once (slots per prompt bucket and generation bucket), and "
                                 "rows per scoring call.")
    round_steps: int = flag_field(0, help="Decode steps per round at most: a request that finds every slot busy "
                                  "waits up to this many steps for one to free (0: the engine's "
                                  "DEFAULT_ROUND_STEPS).")
    debug_round_delay_s: float = flag_field(0.0, help="Seconds the serve loop sleeps after every engine round: "
                                            "emulates a slower accelerator for tests and benchmarks of rollout "
                                            "scheduling (0: off).")
    backlog: int = flag_field(2048, help="Connections the listening socket queues.")
    graceful_shutdown_s: int = flag_field(30, help="On SIGINT / SIGTERM, how long requests in flight may take to "
                                          "finish.")
    enable_lora_updating: Optional[bool] = flag_field(None, help="Offer /v1/load_lora_adapter and "
                                                      "/v1/unload_lora_adapter (default: on for a loopback --host "
                                                      "only).")
    allowed_lora_roots: tuple[str, ...] = flag_field((), help="Folders runtime adapter loads may read under "
                                                     "(default on a loopback --host: the working directory).")

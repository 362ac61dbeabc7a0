"""The vllm backend: `vllm serve` (vLLM 0.33) started from its own environment, adapters served as LoRA.

vLLM cannot share jaxrl's environment: vLLM 0.31-0.33 pin `torch==2.14` and `transformers<5.21`, jaxrl needs
`transformers>=5.24`, so `pip install vllm` next to jaxrl resolves to vLLM 0.30 (no Qwen3.5 text-layout LoRA
remap). So vLLM lives in a venv of its own (ENV_RECIPE, docs/guides/vllm.md) and runs as a server, as TRL and verl run it
beside a trainer; this process only speaks HTTP to it (`jaxrl.backends.openai_client.ServerBackend`).

    backend = VLLMBackend(BASE, out_dir="run/eval", python="~/.venvs/vllm", stop_ids=stop_ids,
                          tensor_parallel_size=1, data_parallel_size=8)
    backend.load(ModelSpec("step_28", "adapter", ".../adapters/28"), adapter)   # starts vllm serve, loads the LoRA
    backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))

What it runs (`VLLMServer.command`), the equivalent by hand::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ~/.venvs/vllm/bin/python -m vllm.entrypoints.cli.main serve BASE \\
        --host 127.0.0.1 --port PORT --tokenizer BASE --dtype bfloat16 --max-model-len N --seed S \\
        --generation-config vllm --tensor-parallel-size T --data-parallel-size D --gpu-memory-utilization 0.9 \\
        --enable-lora --max-lora-rank R --max-loras 1 [--api-server-count 1 when D > 1]

`--generation-config vllm`: the model folder's generation_config.json (Qwen3.5: top_k 20, top_p 0.95, ...) would
otherwise fill in every sampling field a request leaves out. `--max-lora-rank` is the smallest value vLLM accepts
(1, 8, 16, ..., vllm/config/lora.py:27) that holds the adapter, and the server restarts if a later adapter needs
more. Runtime adapter loading is refused with more than one API server (vllm/entrypoints/cli/serve.py:315-318),
which is vLLM's default for D > 1, hence `--api-server-count 1`. The backend's `extra_args` are appended verbatim.

Checks before anything heavy starts (ServerError naming the fix): the interpreter exists and has vLLM installed, in
the version TARGET_VLLM; at start-up, the server's own /version again, and the log tail if it dies. Qwen3.5's
hybrid cache rejects `--mamba-cache-mode=all`; keep vLLM's default. vLLM's LoRA on hybrid GDN models has an open
report of generations not changing (vllm#49354): compare a LoRA model's completions with the base's
(benchmarks/gpu_vllm.py does).
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from jaxrl.backends.openai_client import (TARGET_VLLM, ServerBackend, ServerError, http_json,
                                                  lora_rank_slot, parse_version)
from jaxrl.backends.options import DEFAULT_MAX_LORA_RANK
from jaxrl.backends.options import VLLMLaunchOptions as _LAUNCH  # the launch options' one set of defaults

VLLM_VERSION = "0.33.0"
VLLM_REQUIREMENT = f"vllm=={VLLM_VERSION}"
DEFAULT_VENV = "~/.venvs/vllm"
# The two lines that make the vLLM environment on a GPU machine (docs/guides/vllm.md; tests/test_vllm_env.py resolves
# them with pip and checks the version they give).
ENV_RECIPE = (f"python3 -m venv {DEFAULT_VENV}", f"{DEFAULT_VENV}/bin/pip install '{VLLM_REQUIREMENT}'")


def resolve_python(python: Optional[str]) -> str:
    """The interpreter of the vLLM environment: `python` as an interpreter path or a venv folder; default
    $JAXRL_VLLM_PYTHON, else DEFAULT_VENV."""
    python = os.path.expanduser(python or os.environ.get("JAXRL_VLLM_PYTHON") or DEFAULT_VENV)
    if os.path.isdir(python):
        python = os.path.join(python, "bin", "python")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ServerError(f"no vLLM environment at {python}: make one with\n    " + "\n    ".join(ENV_RECIPE) +
                          "\nand pass its interpreter or folder (backend option python=..., $JAXRL_VLLM_PYTHON), or "
                          "connect to a running server with --server_url")
    return python


def installed_vllm(python: str) -> str:
    """The vLLM version installed for `python` (read from its package metadata: no vLLM import, no GPU)."""
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise ServerError(f"{python} has no vLLM installed ({proc.stderr.strip().splitlines()[-1:]}); install it "
                          f"with: {os.path.dirname(python)}/pip install '{VLLM_REQUIREMENT}'")
    version = proc.stdout.strip()
    if parse_version(version)[:2] < TARGET_VLLM:
        raise ServerError(f"{python} has vLLM {version}, older than the {'.'.join(map(str, TARGET_VLLM))} this "
                          f"backend targets; upgrade: {os.path.dirname(python)}/pip install '{VLLM_REQUIREMENT}'")
    return version


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """One `vllm serve` process at a time, started from the vLLM environment (module docstring)."""

    def __init__(self, *, python: Optional[str] = None, tokenizer: Optional[str] = None, dtype: str = "bfloat16",
                 seed: int = 0, host: str = "127.0.0.1", port: int = 0,
                 tensor_parallel_size: int = _LAUNCH.tensor_parallel_size,
                 data_parallel_size: int = _LAUNCH.data_parallel_size,
                 gpu_memory_utilization: float = _LAUNCH.gpu_memory_utilization, max_loras: int = _LAUNCH.max_loras,
                 extra_args: Sequence[str] = _LAUNCH.extra_args, env: Optional[dict] = None,
                 log_path: Optional[str] = None, startup_timeout_s: float = _LAUNCH.startup_timeout_s,
                 check_install: bool = True):
        self.python = resolve_python(python)
        self.version = installed_vllm(self.python) if check_install else None
        self.tokenizer, self.dtype, self.seed = tokenizer, dtype, int(seed)
        self.host, self.port = host, int(port)
        self.tensor_parallel_size, self.data_parallel_size = int(tensor_parallel_size), int(data_parallel_size)
        self.gpu_memory_utilization, self.max_loras = float(gpu_memory_utilization), int(max_loras)
        self.extra_args = [str(a) for a in extra_args]
        self.env = dict(env or {})
        self.log_path, self.startup_timeout_s = log_path, float(startup_timeout_s)
        self.model_dir: Optional[str] = None
        self.max_model_len, self.max_lora_rank = 0, 0
        self._proc: Optional[subprocess.Popen] = None
        self._log = None
        self._atexit = False

    def command(self, model_dir: str, max_model_len: int, max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                port: Optional[int] = None) -> list[str]:
        """The argv of `vllm serve` for `model_dir` (module docstring)."""
        args = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
                "--host", self.host, "--port", str(port if port is not None else self.port),
                "--tokenizer", self.tokenizer or model_dir, "--dtype", self.dtype,
                "--max-model-len", str(int(max_model_len)), "--seed", str(self.seed),
                "--generation-config", "vllm",
                "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--data-parallel-size", str(self.data_parallel_size),
                "--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if max_lora_rank:
            args += ["--enable-lora", "--max-lora-rank", str(lora_rank_slot(max_lora_rank)),
                     "--max-loras", str(self.max_loras)]
        if self.data_parallel_size > 1 and "--api-server-count" not in self.extra_args:
            args += ["--api-server-count", "1"]
        return args + self.extra_args

    def shell_command(self, model_dir: str, max_model_len: int, max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> str:
        return "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True " + " ".join(
            shlex.quote(a) for a in self.command(model_dir, max_model_len, max_lora_rank))

    def start(self, model_dir: str, max_model_len: int, max_lora_rank: int = 0) -> str:
        """(Re)starts the server on `model_dir`; returns its URL once /health answers and /version checks out."""
        self.stop()
        port = self.port or free_port(self.host)
        rank = lora_rank_slot(max_lora_rank) if max_lora_rank else 0
        argv = self.command(model_dir, max_model_len, rank, port=port)
        env = {**os.environ, **self.env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        env.pop("PYTHONPATH", None)  # jaxrl's environment must not leak into vLLM's
        log_path = self.log_path or os.path.join(os.getcwd(), "vllm_server.log")
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self._log = open(log_path, "ab")
        self._log.write(f"\n$ {' '.join(shlex.quote(a) for a in argv)}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)  # its own group: stop() ends its workers too
        if not self._atexit:  # a server in its own session outlives this process unless stopped
            atexit.register(self.stop)
            self._atexit = True
        url = f"http://{self.host}:{port}"
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise ServerError(f"vllm serve exited with code {code} before it was ready; the end of its log "
                                  f"({log_path}):\n{tail(log_path)}")
            try:
                status, _ = http_json("GET", url + "/health", timeout=5)
                if status == 200:
                    break
            except ServerError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"vllm serve was not ready after {self.startup_timeout_s:.0f} s (log: {log_path}):"
                                  f"\n{tail(log_path)}")
            time.sleep(2.0)
        self.model_dir, self.max_model_len, self.max_lora_rank = model_dir, int(max_model_len), rank
        return url

    def stop(self) -> None:
        """Ends the server this object started (its process group), politely first."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        self.model_dir, self.max_model_len, self.max_lora_rank = None, 0, 0


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.read().splitlines(keepends=True)[-lines:]).decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"


class VLLMBackend(ServerBackend):
    """The server backend on a `vllm serve` it starts (module docstring), or on a running vLLM at `url`.

    python: the vLLM environment (interpreter or venv folder; default $JAXRL_VLLM_PYTHON, else DEFAULT_VENV).
    max_lora_rank: the LoRA rank the server on the base starts with (raised, with a restart, for a larger adapter;
      0 = no LoRA until an adapter is loaded).
    tensor_parallel_size / data_parallel_size / gpu_memory_utilization / max_loras / extra_args: passed to
      `vllm serve` (the launch options, jaxrl.backends.options.VLLMLaunchOptions); the other keywords (stop_ids,
      max_prompt_len, max_new_tokens, the ServerOptions) are ServerBackend's.
    """

    name = "vllm"

    def __init__(self, base_dir: str, *, out_dir: Optional[str] = None, url: Optional[str] = None,
                 python: Optional[str] = None, dtype: str = "bfloat16", seed: int = 0,
                 tensor_parallel_size: int = _LAUNCH.tensor_parallel_size,
                 data_parallel_size: int = _LAUNCH.data_parallel_size,
                 gpu_memory_utilization: float = _LAUNCH.gpu_memory_utilization, max_loras: int = _LAUNCH.max_loras,
                 extra_args: Sequence[str] = _LAUNCH.extra_args, startup_timeout_s: float = _LAUNCH.startup_timeout_s,
                 max_lora_rank: int = DEFAULT_MAX_LORA_RANK, **kwargs):
        launcher = None
        if url is None:
            log = os.path.join(out_dir, "vllm_server.log") if out_dir else None
            launcher = VLLMServer(python=python, tokenizer=os.path.abspath(base_dir), dtype=dtype, seed=seed,
                                  tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                                  gpu_memory_utilization=gpu_memory_utilization, max_loras=max_loras,
                                  extra_args=extra_args, log_path=log, startup_timeout_s=startup_timeout_s)
        super().__init__(base_dir, url=url, launcher=launcher, out_dir=out_dir, **kwargs)
        self.base_lora_rank = int(max_lora_rank or 0)  # so the base's server takes the run's adapters unrestarted
        if url is not None and not (self.description or "").startswith("vllm"):
            raise ServerError(f"{url} is a {self.description} server, not vLLM; use --backend=server for it")


if __name__ == "__main__":  # print the recipe (for docs and scripts)
    sys.stdout.write("\n".join(ENV_RECIPE) + "\n")

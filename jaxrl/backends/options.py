"""The options of the server backends, declared once: how requests reach a server (`ServerOptions`) and how a vLLM
the run starts is launched (`VLLMLaunchOptions`). The backends take their defaults from here; algorithm blocks nest
them (`grpo.rollout_server.*`, `grpo.rollout_vllm.*`, `distill.teacher_server.*`: jaxrl.backends.settings), and the
offline launchers make their flags from them (jaxrl.backends.flags). No jax here: configs import this module."""

from __future__ import annotations

import dataclasses

from jaxrl.utils.typed_config import Block, setting

__all__ = ["DEFAULT_MAX_LORA_RANK", "ServerOptions", "VLLMLaunchOptions"]

# The LoRA rank a vLLM started on the base enables (raised, with a restart, for a larger adapter; 0: no LoRA until an
# adapter is loaded): evaluation's and offline rollouts' default, and VLLMBackend's.
DEFAULT_MAX_LORA_RANK = 16


@dataclasses.dataclass(frozen=True)
class ServerOptions(Block):
    """How a run talks to its rollout servers (`<algorithm>.rollout_server.*`; rollout_backend server | vllm)."""

    concurrency: int = setting(64, doc="requests in flight per server (the server batches them)")
    request_timeout_s: float = setting(0.0, doc="seconds one request may take before the rollout fails naming the "
                                       "server (a hung server); 0 = sized from the request: 60 s + 0.1 s per "
                                       "max_tokens")
    progress_every_s: float = setting(30.0, doc="while requests are out, a progress line this often: rows answered "
                                      "/ sent, per server (0 = none)")
    fleet_wait_s: float = setting(600.0, doc="several servers (a training run's pool, distillation's teachers): a "
                                  "server that stops answering is taken out and its requests go to the others; with "
                                  "none left the run waits this long for one to answer again, then stops at its last "
                                  "checkpoint")

    def __post_init__(self):
        if self.fleet_wait_s < 0:  # NaN and inf are refused by Block's own check, after this one
            raise ValueError(f"fleet_wait_s (rollout_server / teacher_server) must be >= 0 seconds, got "
                             f"{self.fleet_wait_s}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class VLLMLaunchOptions(Block):
    """The `vllm serve` a run starts (`<algorithm>.rollout_vllm.*`; rollout_backend vllm without rollout_servers),
    as evaluation's launcher starts it (jaxrl.backends.vllm_backend.VLLMServer)."""

    python: str = setting("", doc="the vLLM environment: an interpreter or a venv folder; '' = $JAXRL_VLLM_PYTHON, "
                          "else ~/.venvs/vllm")
    tensor_parallel_size: int = setting(1)
    data_parallel_size: int = setting(1, doc="engine replicas behind one API server")
    gpu_memory_utilization: float = setting(0.90)
    extra_args: tuple = setting((), tuple, "more `vllm serve` arguments, appended verbatim")
    startup_timeout_s: float = setting(1800.0, doc="seconds to wait for the server to answer")
    max_loras: int = setting(1, doc="adapters resident at once")

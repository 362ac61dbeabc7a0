"""What the launcher tests run their commands against: a tiny model folder with its tokenizer, a problems file,
two adapter checkpoints of a run, and one way to run a launcher as a user does (a fresh interpreter).

    env = build(folder)                       # {"model": ..., "problems": ..., "run": ..., "root": ...}
    proc = launch("evaluate", "--problems=...", cache=...)   # subprocess.CompletedProcess (text)
    snapshot(folder)                          # {relative path: bytes} of every file below folder

Built with numpy weights (no per-shape jax compilations) and one full-attention layer, so that every launcher
that samples compiles one small program; the XLA compilation cache given to `launch` shares it between
processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"


def numpy_model(cfg, seed=0):
    """A random Qwen3.5 of `cfg` drawn with numpy, small weights (near-uniform next-token distributions)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl.models.qwen35.model import Qwen35
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(state))
    for var in flat.values():
        shape = tuple(var.shape)
        var.set_value(jnp.asarray(rng.standard_normal(shape) * (0.02 if len(shape) > 1 else 0.1), jnp.float32))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build(folder: str | os.PathLike, n_problems: int = 4) -> dict:
    """The tiny model folder, a problems file of `n_problems` toy tasks and a run folder with adapter checkpoints
    of steps 2 and 5 (same modules and rank: one compiled program serves both)."""
    import numpy as np

    from jaxrl.models import qwen35
    from jaxrl.models.adapters import Adapter, write_adapter_checkpoint
    from jaxrl.models.lora import linears
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    problems = [json.loads(line) for line in TASKS.read_text().splitlines()][:n_problems]
    path = root / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    model_dir = root / "model"
    model = numpy_model(tiny(num_hidden_layers=1, layer_types=("full_attention",)))
    qwen35.save_pretrained(model, str(model_dir), base_dir=None, layout="container")
    build_tiny_tokenizer(str(model_dir), [m["content"] for p in problems for m in p["messages"]])
    run = root / "run"
    lin = dict(linears(model))
    for step in (2, 5):
        rng = np.random.default_rng(step)
        params = {}
        for m in ("layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"):
            params[m + ".lora.lora_A"] = (0.3 * rng.standard_normal((2, lin[m].in_features))).astype(np.float32)
            params[m + ".lora.lora_B"] = (0.3 * rng.standard_normal((lin[m].out_features, 2))).astype(np.float32)
        write_adapter_checkpoint(str(run), step, Adapter(params=params, rank=2, alpha=4.0, source=f"step {step}"))
    return {"root": root, "model": str(model_dir), "problems": str(path), "run": str(run),
            "ids": [p["id"] for p in problems]}


# Sampling flags of the tiny model: short completions, one prompt bucket (one compiled program), a toy reward.
SAMPLING = ("--num_samples=2", "--temperature=1.0", "--max_new_tokens=8", "--max_prompt_len=192",
            "--prompt_buckets=192", "--batch_size=4", "--dtype=float32", "--seed=3", "--noprogress")


def launch(name: str, *args: str, cache: str | os.PathLike | None = None, timeout: float = 600,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m launchers.<name> ARGS` in a fresh interpreter from the repository root; text output."""
    return subprocess.run([sys.executable, "-m", f"launchers.{name}", *args], cwd=ROOT, env=launch_env(cache, env),
                          capture_output=True, text=True, timeout=timeout)


def launch_env(cache=None, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    env.pop("JAXRL_VERBOSE", None)
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        # every process compiles alike; a low LLVM optimisation level compiles quicker
        env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    env.update(extra or {})
    return env


def snapshot(folder: str | os.PathLike) -> dict[str, bytes]:
    """Every file below `folder` (relative path -> bytes): what "unchanged byte for byte" compares."""
    folder = Path(folder)
    if not folder.exists():
        return {}
    if folder.is_file():
        return {folder.name: folder.read_bytes()}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The non-empty lines of stderr."""
    return [line for line in proc.stderr.splitlines() if line.strip()]

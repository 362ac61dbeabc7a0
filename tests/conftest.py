"""Shared pytest set-up: 8 fake CPU devices (sharding tests), offline HF, tiny reference checkpoints, and the
tiny run configs the trainer tests start from (`from conftest import tiny_config`)."""

import importlib
import os

# Must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


def tiny_config(preset: str, **block):
    """configs/<preset>_tiny.py made quiet for a test: no TensorBoard, synchronous checkpoints, LLVM -O0 compiles;
    `block` overrides keys of the preset's own block (`data` for dpo, `grpo` / `ppo` for those)."""
    cfg = importlib.import_module(f"configs.{preset}_tiny").get_config()
    cfg.tensorboard = False
    cfg.checkpoint_async = False
    cfg.compile_options = {"xla_backend_optimization_level": 0}
    section = cfg.data if preset == "dpo" else cfg[preset]
    for key, value in block.items():
        section[key] = value
    return cfg


def first_batch(trainer, step: int = 0):
    """The task's batch of `step` through the phases the Trainer calls (jaxrl.train.task): setup, the rollout
    when one is due, batch."""
    task = trainer.task
    task.setup(trainer.context())
    if task.needs_rollout(step):
        task.rollout(step, trainer.current_model())
    return task.batch(step)


def make_rollout(task, model, rollout: int = 0, workdir: str = ""):
    """(buffer, metrics) of an online task's rollout `rollout` sampled from `model` outside a Trainer: opens the
    task's rollouts on `model` (what its setup does; the in-process backend needs no workdir), samples, closes."""
    task.rollouts.open(workdir, model)
    try:
        buffer, metrics, _ = task.make_rollout(rollout, model)
        return buffer, metrics
    finally:
        task.rollouts.close()


def jitted_forward(model, fn=None):
    """`model(ids, attention_mask=, cache=)`, or `fn(model, *args, **kwargs)`, as one jitted program per shape
    (static values go in `fn`'s closure). Eager calls dispatch and compile every primitive one by one, several
    times slower than one jitted program, and the programs users run are jitted."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = fn or (lambda m, ids, attention_mask=None, cache=None: m(ids, attention_mask=attention_mask, cache=cache))
    call = jax.jit(lambda state, *args, **kwargs: fn(nnx.merge(graphdef, state), *args, **kwargs))
    return lambda *args, **kwargs: call(state, *args, **kwargs)


@pytest.fixture(scope="session")
def hf_container(tmp_path_factory):
    """(folder, torch model) of a tiny container checkpoint with perturbed norms, fp32."""
    import hf_tiny
    return hf_tiny.build_container(str(tmp_path_factory.mktemp("hf_container")), seed=0)


@pytest.fixture(scope="session")
def hf_text(tmp_path_factory):
    """(folder, torch model) of a tiny text-only checkpoint whose GDN value heads are 3x the key heads."""
    import hf_tiny
    return hf_tiny.build_text(str(tmp_path_factory.mktemp("hf_text")), seed=1, linear_num_value_heads=6)


# The longest files (minutes each, mostly end-to-end runs) start first, so that `-n 2 --dist loadfile` does not
# end with one worker running the demo alone while the other idles. Order inside a file is kept. (The Makefile
# passes --no-loadscope-reorder: xdist otherwise reorders files by their number of tests.)
_LONGEST_FIRST = ("test_multihost_train.py", "test_real_width_smoke.py", "test_demo.py", "test_interrupts.py",
                  "test_sweep.py", "test_ppo_task.py", "test_grpo_task.py", "test_dpo_train.py",
                  "test_sharded_rollouts.py", "test_fast_paths.py", "test_resume.py", "test_qwen35_cache.py",
                  "test_qwen35_parity.py")


def pytest_collection_modifyitems(config, items):
    # A test's tier is marked in its own file (`pytestmark = pytest.mark.heavy` or `@pytest.mark.heavy`); the
    # heavy tier (minutes-long proofs) is part of the slow one, so `make test-fast` skips it too.
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

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
                  "test_sweep.py", "test_ppo_trainer.py", "test_grpo_trainer.py", "test_dpo_train.py",
                  "test_sharded_rollouts.py", "test_fast_paths.py", "test_resume.py", "test_qwen35_cache.py",
                  "test_qwen35_parity.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

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
    if hasattr(task, "needs_rollout") and task.needs_rollout(step):
        task.rollout(step, trainer.current_model())
    return task.batch(step)


def jitted_forward(model, fn=None):
    """`model(ids, attention_mask=, cache=)`, or `fn(model, *args, **kwargs)`, as one jitted program per shape
    (static values go in `fn`'s closure). Eager calls dispatch and compile every primitive one by one: a cache
    test took 50 s eager and 14 s jitted, and the users' programs are jitted."""
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


# The heavy tier (`make test-heavy`; `make test` skips it, CI runs both): the proofs that take from half a minute
# to six minutes each on two idle cores (durations of the full idle run of 2026-12-01): real multi-process
# training and rollouts, end-to-end learning curves, killed-and-resumed chains through the launchers, sweeps,
# servers, the demo, the 4B/9B real-width smoke. A file name maps to None (the whole file) or to test names
# (parametrized ids included). The exactness proofs stay in `make test`: parity with torch, cache and layout
# equivalences, sharded = unsharded, micro-batch invariance of one step, the review's bug tests.
_HEAVY = {
    "test_multihost_train.py": None,      # two processes, a kill and a resume, per algorithm: 285 s, 353 s
    "test_real_width_smoke.py": None,     # the 4B / 9B widths with the full vocabulary: 131 s, 251 s
    "test_demo.py": None,                 # the demo end to end (285 s)
    "test_interrupts.py": None,           # 20 SIGINTs at random moments (165 s); signals from outside (38 s, 29 s)
    "test_sweep.py": None,                # sweeps of real training runs (119 s setup, 80 s, 29 s)
    "test_server_backend.py": None,       # an OpenAI-compatible server over loopback (65 s, 30 s, 18 s, ...)
    "test_sharded_rollouts.py": {"test_rollouts_over_two_processes_equal_one_device_and_resume_per_part",
                                 "test_evaluation_over_two_processes_equals_one_device"},  # 53 s, 33 s
    "test_ppo_task.py": {"test_ppo_raises_reward_and_lowers_value_loss",               # 100 s
                            "test_resume_inside_a_rollout_gives_identical_adapters"},      # 29 s
    "test_grpo_task.py": {"test_grpo_raises_reward_from_chance_to_above_0_8",          # 54 s
                             "test_kl_stays_bounded_and_shrinks_with_beta",               # 42 s
                             "test_update_is_invariant_to_the_micro_batch_split",         # 61 s
                             "test_grpo_curve_is_reproducible"},  # 50 s: it reruns the learning run's first steps
    "test_dpo_train.py": {"test_dpo_learns_the_preferred_pattern_on_cpu",                 # 48 s
                          "test_killed_dpo_run_resumes_to_the_same_adapter"},             # 50 s
    "test_resume.py": {"test_killed_runs_resume_bit_identical"},                          # 60 s
    "test_launcher_refusals.py": {"test_train_resumes_from_the_newest_intact_state_and_keeps_the_damaged_one"},
    "test_evaluate.py": {"test_the_launcher_selects_confirms_and_refuses_a_second_confirmation",  # 50 s
                         "test_killed_evaluation_resumes_without_redoing_finished_samples"},      # 15 s
    "test_rollout_launcher.py": {"test_cli", "test_records_resume_and_settings"},          # 39 s, 14 s
    "test_train_benchmarks.py": None,     # the benchmark scripts' own smoke runs (34 s, ...)
    "test_qwen35_checkpoint.py": {"test_mesh_load_matches_single_device"},                # 60 s
    "test_vllm_env.py": {"test_the_recipe_resolves_to_the_targeted_vllm"},                # 64 s (pip resolves)
}


def _is_heavy(item) -> bool:
    if item.path.name not in _HEAVY:
        return False
    names = _HEAVY[item.path.name]
    return names is None or item.originalname in names or item.name in names


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_heavy(item):
            item.add_marker(pytest.mark.heavy)
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

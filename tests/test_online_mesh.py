"""The rollout phase of online GRPO and PPO samples over every device of the training mesh: the engine's backend
holds the trainer's mesh, its compiled batches split over data x fsdp = 8 fake devices, and the rollout is the
one a one-device mesh draws, token for token (each sample depends on (seed, prompt group, sample index) only)."""

import jax
import numpy as np
import pytest

from configs import grpo_tiny, ppo_tiny
from jaxrl.algorithms.run import build_model, resolve_config
from jaxrl.algorithms.tasks import get_task_factory
from jaxrl.parallel.mesh import DATA, FSDP, make_mesh
from jaxrl.train.loop import Trainer

pytestmark = pytest.mark.slow  # two rollouts compiled per algorithm
CONFIGS = {"grpo": grpo_tiny, "ppo": ppo_tiny}


def first_rollout(name, shape, tmp_path):
    cfg = CONFIGS[name].get_config()
    cfg.tensorboard, cfg.checkpoint_async = False, False
    cfg.mesh.shape = shape
    mesh = make_mesh(shape)
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    task = get_task_factory(name)(cfg, model, mesh)
    trainer = Trainer(cfg, model, task, str(tmp_path / f"{name}_{mesh.devices.size}"), mesh=mesh)
    task.setup(trainer.context())
    sampled = task.rollouts.run(trainer.current_model(), 0)
    backend = task.rollouts.collector.backend
    (sampler,) = backend._samplers.values()  # the one cap of this run
    return sampled, backend, sampler, mesh


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_online_rollout_runs_on_every_device_of_the_training_mesh(name, tmp_path):
    assert jax.device_count() == 8, "tests/conftest.py fakes 8 CPU devices"
    one, _, _, _ = first_rollout(name, (1, 1, 1), tmp_path)
    eight, backend, sampler, mesh = first_rollout(name, (1, -1, 1), tmp_path)
    assert backend.mesh is mesh and mesh.shape[DATA] * mesh.shape[FSDP] == 8
    assert sampler.mesh is mesh and all(b % 8 == 0 for b in sampler.batch_buckets)
    np.testing.assert_array_equal(eight.input_ids, one.input_ids)  # prompts and completions, token for token
    np.testing.assert_array_equal(eight.rewards, one.rewards)
    np.testing.assert_allclose(eight.behaviour_logp, one.behaviour_logp, atol=1e-4)

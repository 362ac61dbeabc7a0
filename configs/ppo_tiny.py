r"""PPO (value head, KL-penalised rewards, GAE) on the tiny random Qwen3.5 with the token task of
configs/grpo_tiny.py (each prompt's instruction token selects the half of the vocabulary its completion should
use; reward = fraction of the 8 completion tokens in it, chance 0.5). A couple of minutes on a CPU: the mean
reward rises and the value loss falls.

    python -m launchers.train --config=configs/ppo_tiny.py --workdir=/tmp/ppo_tiny
    python -m launchers.train --config=configs/ppo_tiny.py --workdir=/tmp/ppo_tiny --config.ppo.adaptive_kl=True
"""

from configs import grpo_tiny, ppo


def get_config():
    c = ppo.get_config("model=tiny")
    g = grpo_tiny.get_config()
    for key in ("model_path", "model_preset", "model_overrides", "dtype", "remat", "mesh", "logprob_chunk_size",
                "data", "reward", "lora"):
        c[key] = g[key]
    c.steps = 160
    c.checkpoint_every = 10
    c.keep_checkpoints = 2
    c.max_consecutive_nonfinite = 3
    c.optimizer.learning_rate = 3e-3
    c.optimizer.schedule = "constant_with_warmup"
    c.optimizer.warmup_steps = 2
    c.optimizer.warmup_ratio = 0.0

    c.ppo.prompts_per_rollout = 64  # one sample each
    c.ppo.num_generations = 1
    c.ppo.max_new_tokens = 8
    c.ppo.temperature = grpo_tiny.get_config().grpo.temperature
    c.ppo.epochs = 2
    c.ppo.minibatches = 2  # 2 x 2 = 4 updates per rollout
    # the per-token KL penalty is noise in the returns (more so at temperature 0.2); keep it small here
    c.ppo.init_kl_coef = 0.01
    # the value head learns 10x faster than the adapters: it fits the mean return within a few rollouts
    c.ppo.value_learning_rate = 3e-2
    c.ppo.kl_estimator = "k1"
    c.ppo.logprob_batch_size = 64
    c.batch.micro_batch_size = 16
    c.batch.grad_accum = 2
    return c

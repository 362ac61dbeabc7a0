r"""GRPO on the tiny random Qwen3.5 with the token task (jaxrl.rewards.toy.TokenTask): each prompt ends
in one of two instruction tokens and the completion should use tokens of that instruction's half of the
vocabulary; reward = fraction of the 8 completion tokens in the right half, so a random model starts at chance
(0.5). A couple of minutes on a CPU, most of it compilation; mean reward passes 0.8.

    python -m launchers.train --config=configs/grpo_tiny.py --workdir=/tmp/grpo_tiny
    python -m launchers.train --config=configs/grpo_tiny.py --workdir=/tmp/grpo_tiny \
        --config.grpo.num_iterations=2 --config.grpo.aggregation=token_mean
"""

from configs import grpo


def get_config():
    c = grpo.get_config("model=tiny")
    c.model_path = ""
    c.model_preset = "tiny"
    # two layers (Gated DeltaNet, full attention): every module kind, half the compile time of the 4-layer tiny
    c.model_overrides.num_hidden_layers = 2
    c.model_overrides.layer_types = ("linear_attention", "full_attention")
    c.model_overrides.vocab_size = 64
    c.dtype = "float32"
    c.remat = "none"
    c.steps = 50
    c.checkpoint_every = 10
    c.keep_checkpoints = 2
    c.max_consecutive_nonfinite = 3
    c.optimizer.learning_rate = 5e-3
    c.optimizer.schedule = "constant_with_warmup"
    c.optimizer.warmup_steps = 2
    c.optimizer.warmup_ratio = 0.0
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.batch.micro_batch_size = 16
    c.batch.grad_accum = 4
    c.mesh.shape = (1, 1, 1)  # one device: the tiny model gains nothing from more
    c.logprob_chunk_size = 64

    c.grpo.num_generations = 8
    c.grpo.prompts_per_step = 8  # 64 completions per rollout = one global batch
    c.grpo.max_new_tokens = 8
    # a random tiny model is near-uniform over its vocabulary and its frozen head bounds how far LoRA can move
    # the logits; sampling (and training, TRL-style) at temperature 0.2 lets the policy become as peaked as a
    # trained LM's
    c.grpo.temperature = 0.2
    c.grpo.beta = 0.04
    c.grpo.logprob_batch_size = 64
    c.data.source = "token_task"
    c.data.max_prompt_len = 6
    c.data.prompt_len = 6
    c.data.num_classes = 2
    c.data.score_tokens = 8
    c.reward.name = "token_block"
    return c

r"""DPO on the tiny random Qwen3.5 with synthetic pairs (the chosen completion continues the prompt's arithmetic
progression, the rejected one breaks it with random tokens of the same range); about a minute on a CPU, most of
it compilation. Held-out preference accuracy reaches 1.0 and greedy samples follow the progression.
Used by the tests and the demo.

    python -m launchers.train --config=configs/dpo_tiny.py --workdir=/tmp/dpo_tiny
    python -m launchers.train --config=configs/dpo_tiny.py --workdir=/tmp/dpo_tiny \
        --config.data.source=pairs --config.data.pairs=pairs/cohort     # pre-tokenised or text pairs
"""

from configs import dpo


def get_config():
    c = dpo.get_config("model=tiny")
    c.model_path = ""
    c.model_preset = "tiny"
    # two layers (Gated DeltaNet, full attention): every module kind, half the compile time of the 4-layer tiny
    c.model_overrides.num_hidden_layers = 2
    c.model_overrides.layer_types = ("linear_attention", "full_attention")
    c.dtype = "float32"
    c.steps = 20
    c.checkpoint_every = 4
    c.keep_checkpoints = 2
    c.max_consecutive_nonfinite = 3
    c.optimizer.learning_rate = 3e-3
    c.optimizer.schedule = "constant_with_warmup"
    c.optimizer.warmup_steps = 2
    c.optimizer.weight_decay = 0.0
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.batch.micro_batch_size = 4
    c.batch.grad_accum = 2
    c.mesh.shape = (1, 1, 1)  # one device: the tiny model gains nothing from more
    c.logprob_chunk_size = 64
    c.dpo.beta = 0.1
    c.data.source = "synthetic"
    c.data.synthetic_pairs = 192
    c.data.synthetic_prompt_len = 6
    c.data.synthetic_completion_len = 4
    # 32 tokens: a 64-wide model with rank-8 adapters can learn "next = previous + 1" over them in 20 steps, and
    # the rejected completions use the same tokens, so only the order separates them
    c.data.synthetic_num_tokens = 32
    c.data.max_length = 64
    c.data.min_prompt_tokens = 1
    c.data.pad_multiple = 16
    c.data.eval_fraction = 0.125
    c.data.enable_thinking = False
    return c

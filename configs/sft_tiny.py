r"""Next-token (SFT) training of the tiny random Qwen3.5 on synthetic token sequences; runs in seconds on a CPU.
Used by the tests and the benchmarks.

    python -m launchers.train --config=configs/sft_tiny.py --workdir=/tmp/sft_tiny
    python -m launchers.train --config=configs/sft_tiny.py --workdir=/tmp/sft_tiny --config.steps=50 \
        --config.batch.micro_batch_size=2 --config.batch.grad_accum=4
"""

from configs import base


def get_config():
    c = base.get_config()
    c.algorithm = "sft"
    c.model_path = ""
    c.model_preset = "tiny"
    # two layers (Gated DeltaNet, full attention): every module kind, half the compile time of the 4-layer tiny
    c.model_overrides.num_hidden_layers = 2
    c.model_overrides.layer_types = ("linear_attention", "full_attention")
    c.dtype = "float32"
    c.steps = 12
    c.checkpoint_every = 4
    c.keep_checkpoints = 2
    c.max_consecutive_nonfinite = 3
    c.optimizer.learning_rate = 1e-3
    c.optimizer.schedule = "linear"
    c.optimizer.warmup_steps = 2
    c.optimizer.weight_decay = 0.01
    c.lora.rank = 4
    c.lora.alpha = 8.0
    c.batch.micro_batch_size = 2
    c.batch.grad_accum = 2
    c.mesh.shape = (1, 1, 1)  # one device: the tiny model gains nothing from more
    c.data.source = "synthetic"
    c.data.seq_len = 32
    c.logprob_chunk_size = 64
    return c

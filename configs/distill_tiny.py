r"""On-policy distillation on the tiny random Qwen3.5 with the token task (jaxrl.rewards.toy.TokenTask), the model and
task of configs/grpo_tiny.py: the student is the two-layer tiny model at its preset init; the teacher is an HF
folder of the same vocabulary (64 tokens) that `distill.teacher_path` must name. Seconds per step on a CPU, most of
the first one compilation. A teacher to try it with (a random tiny Qwen3.5 of that vocabulary, another shape, made
with transformers: `pip install -e '.[test]'`):

    python -c "import sys; sys.path.insert(0, 'tests'); import hf_tiny; \
        hf_tiny.build_text('/tmp/teacher', seed=7, vocab_size=64, num_hidden_layers=2)"
    python -m launchers.train --config=configs/distill_tiny.py --workdir=/tmp/distill_tiny \
        --config.distill.teacher_path=/tmp/teacher
"""

from configs import base, grpo_tiny


def get_config():
    c = base.get_config("distill")
    tiny = grpo_tiny.get_config()
    # the tiny model, its compile-time settings and the token task, as GRPO's tiny run has them
    for key in ("model_path", "model_preset", "model_overrides", "dtype", "remat", "max_consecutive_nonfinite",
                "logprob_chunk_size", "lora", "mesh", "data", "reward"):
        c[key] = tiny[key]
    c.steps = 20
    c.checkpoint_every = 5
    c.keep_checkpoints = 2
    c.optimizer.learning_rate = 3e-2
    c.optimizer.schedule = "constant_with_warmup"
    c.optimizer.warmup_steps = 2
    c.optimizer.warmup_ratio = 0.0
    c.batch.micro_batch_size = 16
    c.batch.grad_accum = 2
    d = c.distill
    d.num_generations = 4
    d.prompts_per_step = 8  # 32 completions = one global batch
    d.max_new_tokens = tiny.grpo.max_new_tokens
    # as configs/grpo_tiny.py: the random tiny model is near-uniform and its frozen head bounds how far LoRA moves
    # the logits; at temperature 0.3 (sampling and the divergence) both models are as peaked as trained LMs.
    # forward_kl_topk: the dense top-k signal moves the tiny student within a few steps, where reverse_kl's
    # one-sample advantages (no baseline) did not within 16 (tests/test_distill_task.py)
    d.temperature = 0.3
    d.loss = "forward_kl_topk"
    d.teacher_top_k = 8
    d.logprob_batch_size = 32
    return c

r"""GRPO with LoRA on Qwen3.5 4B / 9B (online rollouts): one family file; every run is a preset plus overrides.

    python -m launchers.train --config=configs/grpo.py:OVERRIDES --workdir=DIR [--config.key=value ...]

OVERRIDES is a comma-separated list of key=value (big_vision style); later entries win, and `--config.x=y` flags
win over all of them:

    run=NAME        one of the users' runs below (sets everything it is known to have used)
    model=4b|9b     (tiny: the CPU test model; configs/grpo_tiny.py is the complete CPU run)
    start=base|m0   which weights model_path must point to (recorded in config.start)
    probe=default|aggressive|capacity     the three 9B step-16 probes (lr / beta / LoRA, see below)
    lr=1e-6|5e-6|...   beta=0.01|0.05|...   lora=r16 (alpha 32)|r32 (alpha 64)
    k=8 (grpo.num_generations)   prompts=20 (grpo.prompts_per_step)   max_new_tokens=1024|1536|4096
    prompt_len=2048 (data.max_prompt_len: prompts are left-padded to it; longer ones are skipped and logged)
    steps=N   mb=M (rows per micro-batch; grad_accum = prompts x k / M, so one rollout = one update)
    aggregation=sequence_mean|token_mean|dr_grpo   problems=PATH (data.problems)

model_path and data.problems must be set: model_path from `--config.model_path=` or the environment
(JAXRL_QWEN35_4B_BASE, JAXRL_QWEN35_4B_M0, JAXRL_QWEN35_9B_BASE, JAXRL_QWEN35_9B_M0), data.problems from
`problems=` or `--config.data.problems=` (a problems.jsonl; `python -m launchers.import_problems` writes one).

The users' runs (the users' report). Values the report does not state are marked "inferred":

    # 4B Base GRPO: lr 5e-6, beta 0.01, K = 8, 20 prompts per step, 4,096-token completions, 1,000 random
    # prompts (steps 50 = one pass; the users stopped at step 39)
    python -m launchers.train --config=configs/grpo.py:run=4b_base --workdir=runs/grpo_4b_base \
        --config.model_path=$BASE_4B --config.data.problems=cohort_1000/problems.jsonl
    # the three 9B step-16 probes (inferred: from M0, 20 prompts x 8, 1,536-token completions as the 9B tuned
    # formal run)
    python -m launchers.train --config=configs/grpo.py:run=9b_probe,probe=default --workdir=runs/grpo_9b_default \
        --config.model_path=$M0_9B --config.data.problems=cohort_1000/problems.jsonl          # lr 1e-6, beta 0.05, r16/a32
    python -m launchers.train --config=configs/grpo.py:run=9b_probe,probe=aggressive --workdir=runs/grpo_9b_aggr \
        --config.model_path=$M0_9B --config.data.problems=cohort_1000/problems.jsonl          # lr 5e-6, beta 0.01, r16/a32
    python -m launchers.train --config=configs/grpo.py:run=9b_probe,probe=capacity --workdir=runs/grpo_9b_r32 \
        --config.model_path=$M0_9B --config.data.problems=cohort_1000/problems.jsonl          # lr 1e-6, beta 0.05, r32/a64
    # initial M0-v4 comparison (inferred: lr 1e-6, beta 0.05, 1,024 tokens, 125 steps)
    python -m launchers.train --config=configs/grpo.py:run=m0_initial,model=4b --workdir=runs/grpo_4b_m0 \
        --config.model_path=$M0_4B --config.data.problems=cohort_1000/problems.jsonl

Every run: the code verifier's partial reward (`reward.name=code`, `reward.score=partial`), temperature 1.0,
group-scaled advantages, clip 0.2, k3 KL to the base weights (adapters off, precomputed once per rollout),
`sequence_mean` aggregation (TRL's grpo loss), one optimizer update per rollout (on-policy), checkpoints every
4 steps, AdamW with linear decay, clipping 1.0, bf16 base weights, rematerialisation chosen from the
memory estimate (`remat=auto`).
"""

import os

import ml_collections

from configs import base, overrides
from configs.overrides import choice

MODELS = {"4b": "qwen3.5-4b", "9b": "qwen3.5-9b", "tiny": "tiny"}
LORA = {"r16": (16, 32.0), "r32": (32, 64.0)}
PROBES = {  # the users' 9B step-16 probes
    "default": dict(lr="1e-6", beta="0.05", lora="r16"),
    "aggressive": dict(lr="5e-6", beta="0.01", lora="r16"),
    "capacity": dict(lr="1e-6", beta="0.05", lora="r32"),
}
RUNS = {
    "4b_base": dict(model="4b", start="base", lr="5e-6", beta="0.01", lora="r16", k="8", prompts="20",
                    max_new_tokens="4096", steps="50"),
    "9b_probe": dict(model="9b", start="m0", k="8", prompts="20", max_new_tokens="1536", steps="16",
                     probe="default"),
    "m0_initial": dict(start="m0", lr="1e-6", beta="0.05", lora="r16", k="8", prompts="20", max_new_tokens="1024",
                       steps="125"),
}
KEYS = ("run", "model", "start", "probe", "lr", "beta", "lora", "k", "prompts", "max_new_tokens", "prompt_len",
        "steps", "mb", "aggregation", "problems")


WHERE = "configs/grpo.py"


def parse_overrides(arg: str) -> dict:
    return overrides.parse_overrides(arg, KEYS, RUNS, PROBES, WHERE)


def model_block(c, o: dict, where: str) -> str:
    """model_path / preset / start / LoRA / optimizer keys shared by the GRPO and PPO families."""
    model = choice("model", o.get("model", "4b"), MODELS, where)
    start = choice("start", o.get("start", "base"), ("base", "m0"), where)
    c.start = start
    c.model_preset = "tiny" if model == "tiny" else ""  # real runs load weights; never fall back to random init
    c.model_path = "" if model == "tiny" else os.environ.get(f"JAXRL_QWEN35_{model.upper()}_{start.upper()}", "")
    c.dtype = "bfloat16"
    c.checkpoint_every = 4
    c.keep_checkpoints = 2
    c.seed = 0
    c.optimizer.learning_rate = float(o.get("lr", "1e-6"))
    if not c.optimizer.learning_rate > 0:
        raise ValueError(f"{where}: lr={o.get('lr')} must be positive")
    c.optimizer.schedule = "linear"
    c.optimizer.weight_decay = 0.0
    c.optimizer.max_grad_norm = 1.0
    rank, alpha = LORA[choice("lora", o.get("lora", "r16"), LORA, where)]
    c.lora.rank, c.lora.alpha = rank, alpha
    c.lora.targets = "all-linear"
    c.lora.dropout = 0.0
    return model


def rollout_batch(c, rows: int, o: dict, where: str) -> None:
    """batch.micro_batch_size = mb, grad_accum = rows / mb (one rollout = one global batch)."""
    mb = int(o.get("mb", 4 if rows % 4 == 0 else 1))
    if mb < 1 or rows % mb:
        raise ValueError(f"{where}: mb={mb} must divide the {rows} rows of a rollout")
    c.batch.micro_batch_size, c.batch.grad_accum = mb, rows // mb


def code_problems(c, o: dict):
    """The online algorithms' data and reward: the users' code problems (`problems=` override), prompts up to
    `prompt_len=` tokens, the code verifier's partial score."""
    c.data.source = "problems"
    c.data.problems = o.get("problems", "")
    c.data.max_prompt_len = int(o.get("prompt_len", 2048))
    c.reward.name = "code"
    c.reward.score = "partial"
    return c


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    where = WHERE
    o = parse_overrides(arg)
    c = base.get_config("grpo")
    c.run = o.get("run", "")
    c.probe = o.get("probe", "")
    model_block(c, o, where)
    c.steps = int(o.get("steps", 125))

    c.grpo.beta = float(o.get("beta", "0.05"))
    c.grpo.num_generations = int(o.get("k", 8))
    c.grpo.prompts_per_step = int(o.get("prompts", 20))
    c.grpo.max_new_tokens = int(o.get("max_new_tokens", 1024))
    c.grpo.aggregation = choice("aggregation", o.get("aggregation", "sequence_mean"),
                                ("sequence_mean", "token_mean", "dr_grpo"), where)
    c.grpo.temperature = 1.0
    c.grpo.kl_estimator = "k3"
    c.grpo.logprob_batch_size = 8
    rollout_batch(c, c.grpo.num_generations * c.grpo.prompts_per_step, o, where)

    return code_problems(c, o)

r"""PPO with LoRA and a value head on Qwen3.5 4B / 9B (online rollouts): one family file, presets plus overrides.

    python -m launchers.train --config=configs/ppo.py:OVERRIDES --workdir=DIR [--config.key=value ...]

OVERRIDES is a comma-separated list of key=value (big_vision style); later entries win, `--config.x=y` flags win
over all of them:

    run=NAME        one of the users' runs below
    model=4b|9b     (tiny: the CPU test model; configs/ppo_tiny.py is the complete CPU run)
    start=base|m0   which weights model_path must point to (recorded in config.start)
    kl=0.05|0.1     ppo.init_kl_coef        adaptive=0|1 (ppo.adaptive_kl; target ppo.kl_target)
    lr=1e-6|5e-7|...   lora=r16 (alpha 32)|r32 (alpha 64)   steps=N
    prompts=32 (ppo.prompts_per_rollout)   max_new_tokens=1024|1536|4096   prompt_len=2048 (data.max_prompt_len)
    epochs=4 (ppo.epochs)   minibatches=1 (ppo.minibatches)   mb=M (rows per micro-batch; grad_accum follows)
    problems=PATH (data.problems)

model_path and data.problems must be set (as in configs/grpo.py: `--config.model_path=` or JAXRL_QWEN35_<4B|9B>_
<BASE|M0>, and `problems=` / `--config.data.problems=`).

The users' runs (the users' report: PPO at initial KL coefficient 0.05 and 0.1; the 4B M0 run completed 125 steps
after skipping eight non-finite updates). Values the report does not state are "inferred": lr 1e-6, TRL's PPO
defaults (fixed KL controller, k1 estimator, clip 0.2, value clip 0.2, vf_coef 0.1, gamma 1, lambda 0.95,
4 epochs), 32 prompts per rollout x 1 sample (125 steps / 4 epochs x 32 = the 1,000-prompt cohort once),
1,024-token completions (the 9B tuned run: kl 0.1, lr 5e-7, 1,536 tokens):

    python -m launchers.train --config=configs/ppo.py:run=4b_kl005 --workdir=runs/ppo_4b_kl005 \
        --config.model_path=$M0_4B --config.data.problems=cohort_1000/problems.jsonl
    python -m launchers.train --config=configs/ppo.py:run=4b_kl01 --workdir=runs/ppo_4b_kl01 \
        --config.model_path=$M0_4B --config.data.problems=cohort_1000/problems.jsonl
    python -m launchers.train --config=configs/ppo.py:run=9b_kl005 --workdir=runs/ppo_9b_kl005 \
        --config.model_path=$M0_9B --config.data.problems=cohort_1000/problems.jsonl
    python -m launchers.train --config=configs/ppo.py:run=9b_kl01 --workdir=runs/ppo_9b_kl01 \
        --config.model_path=$M0_9B --config.data.problems=cohort_1000/problems.jsonl
    python -m launchers.train --config=configs/ppo.py:run=9b_tuned --workdir=runs/ppo_9b_tuned \
        --config.model_path=$M0_9B --config.data.problems=cohort_1000/problems.jsonl
    # from the Base weights instead of M0: add start=base and point model_path at the Base folder

Every run: non-finite updates are skipped and counted (`max_consecutive_nonfinite` = 10 in a row stops with a
checkpoint), checkpoints every 4 steps, AdamW with linear decay, clipping 1.0, bf16 base weights.
"""

import ml_collections

from configs import base
from configs.grpo import code_problems, model_block
from configs.overrides import choice, parse_overrides

RUNS = {
    "4b_kl005": dict(model="4b", start="m0", kl="0.05", lr="1e-6", lora="r16", steps="125"),
    "4b_kl01": dict(model="4b", start="m0", kl="0.1", lr="1e-6", lora="r16", steps="125"),
    "9b_kl005": dict(model="9b", start="m0", kl="0.05", lr="1e-6", lora="r16", steps="125"),
    "9b_kl01": dict(model="9b", start="m0", kl="0.1", lr="1e-6", lora="r16", steps="125"),
    "9b_tuned": dict(model="9b", start="m0", kl="0.1", lr="5e-7", lora="r16", steps="125", max_new_tokens="1536"),
}
KEYS = ("run", "model", "start", "kl", "adaptive", "lr", "lora", "steps", "prompts", "max_new_tokens", "prompt_len",
        "epochs", "minibatches", "mb", "problems")
WHERE = "configs/ppo.py"


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    o = parse_overrides(arg, keys=KEYS, runs=RUNS, probes={}, where=WHERE)
    c = base.get_config("ppo")
    c.run = o.get("run", "")
    model_block(c, o, WHERE)
    c.steps = int(o.get("steps", 125))
    c.max_consecutive_nonfinite = 10

    c.ppo.init_kl_coef = float(o.get("kl", "0.05"))
    c.ppo.adaptive_kl = choice("adaptive", o.get("adaptive", "0"), ("0", "1"), WHERE) == "1"
    c.ppo.prompts_per_rollout = int(o.get("prompts", 32))
    c.ppo.num_generations = 1
    c.ppo.max_new_tokens = int(o.get("max_new_tokens", 1024))
    c.ppo.epochs = int(o.get("epochs", 4))
    c.ppo.minibatches = int(o.get("minibatches", 1))
    c.ppo.logprob_batch_size = 8
    rows = c.ppo.prompts_per_rollout * c.ppo.num_generations
    if rows % c.ppo.minibatches:
        raise ValueError(f"{WHERE}: minibatches={c.ppo.minibatches} must divide the {rows} rows of a rollout")
    per_update = rows // c.ppo.minibatches
    mb = int(o.get("mb", 4 if per_update % 4 == 0 else 1))
    if mb < 1 or per_update % mb:
        raise ValueError(f"{WHERE}: mb={mb} must divide the {per_update} rows of a minibatch")
    c.batch.micro_batch_size, c.batch.grad_accum = mb, per_update // mb

    return code_problems(c, o)

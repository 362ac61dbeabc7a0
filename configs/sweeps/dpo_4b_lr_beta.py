r"""The users' 4B DPO learning-rate x beta grid (the users' report, "Hyperparameter probes"): LR 5e-7, 1e-6, 5e-6,
1e-5 x beta 0.01, 0.05, 0.1 = 12 points, everything else as the final 4B Base run (configs/dpo.py
run=4b_base_final: r16/alpha32, 125 steps of 8 pairs, max length 6144, a checkpoint every 4 steps). Each point's
checkpoints at steps 4, 8, 12, 16, 28, 40 and 125 are evaluated on the same fixed held-out prompts (one greedy
rollout, 8,192-token cap, the code verifier), and the table gives every point's difference to lr 1e-6 / beta 0.1
at the same step with a paired bootstrap interval over prompts.

    SWEEP=configs/sweeps/dpo_4b_lr_beta.py:pairs=pairs_4b_base/cohort,problems=heldout100.jsonl
    python -m launchers.sweep --sweep=$SWEEP --out=runs/dpo_4b_lr_beta --dry_run
    python -m launchers.sweep --sweep=$SWEEP --out=runs/dpo_4b_lr_beta   # one point after the other; rerun to resume
    python -m launchers.sweep --sweep=$SWEEP --out=runs/dpo_4b_lr_beta --print_commands   # one line per point
    python -m launchers.compare --sweep_dir=runs/dpo_4b_lr_beta --sort=-diff:partial_reward_mean@28

Arguments (`:key=value,...`): pairs (data.pairs, required to train), problems (held-out problems.jsonl; without
it no evaluation runs and the table has the training columns only), model_path (default: the
JAXRL_QWEN35_4B_BASE / _M0 environment variable of configs/dpo.py), start=base|m0, seeds=0+1+2 (default: one
seed, as the users ran), limit=100 (held-out prompts), steps=4+8+12+16+28+40+125 (checkpoints evaluated).
"""

from jaxrl.sweep.spec import parse_sweep_args

KEYS = ("pairs", "problems", "model_path", "start", "seeds", "limit", "steps")


def get_sweep(arg: str = ""):
    o = parse_sweep_args(arg, KEYS, "configs/sweeps/dpo_4b_lr_beta.py")
    fixed = {"data.pairs": o.get("pairs", "")}
    if o.get("model_path"):
        fixed["model_path"] = o["model_path"]
    sweep = {
        "name": "dpo_4b_lr_beta",
        "description": "4B DPO: learning rate x beta (users' hyper-parameter probes)",
        "base": f"configs/dpo.py:run=4b_base_final,start={o.get('start', 'base')}",
        "axes": {"optimizer.learning_rate": [5e-7, 1e-6, 5e-6, 1e-5], "dpo.beta": [0.01, 0.05, 0.1]},
        "fixed": fixed,
        "baseline": {"optimizer.learning_rate": 1e-6, "dpo.beta": 0.1},  # the final 4B Base run's setting
    }
    if o.get("seeds"):
        sweep["seeds"] = [int(s) for s in o["seeds"].split("+")]
    if o.get("problems"):
        sweep["evaluate"] = {"problems": o["problems"], "steps": o.get("steps", "4+8+12+16+28+40+125").split("+"),
                             "num_samples": 1, "temperature": 0.0, "max_new_tokens": 8192,
                             "limit": int(o.get("limit", 100)), "reward": "code"}
    return sweep

r"""The users' three 9B GRPO step-16 probes (the users' report) as one sweep: a zipped axis `probe` whose values
set learning rate, beta and LoRA capacity together --

    default     lr 1e-6, beta 0.05, r16 / alpha 32
    aggressive  lr 5e-6, beta 0.01, r16 / alpha 32
    capacity    lr 1e-6, beta 0.05, r32 / alpha 64   (the strongest on the 100-prompt held-out diagnostic)

-- on top of configs/grpo.py run=9b_probe (from M0, 20 prompts x 8 samples a step, 1,536-token completions, 16
steps, a checkpoint every 4). Checkpoints 4, 8, 12, 16 are evaluated on the same fixed held-out prompts (one
greedy rollout, 8,192-token cap), and the table compares each probe with `default` at the same step with a
paired bootstrap interval (the users' +2.05 pp partial-reward interval for r32 crossed zero: this is the
number to re-check, with seeds=0+1+2).

    SWEEP=configs/sweeps/grpo_9b_probes.py:problems=cohort_1000/problems.jsonl,heldout=heldout100.jsonl
    python -m launchers.sweep --sweep=$SWEEP --out=runs/grpo_9b_probes
    python -m launchers.sweep --sweep=$SWEEP --out=runs/grpo_9b_probes --print_commands
    python -m launchers.compare --sweep_dir=runs/grpo_9b_probes --metric=partial_reward_mean,strict_rate

Arguments (`:key=value,...`): problems (training problems.jsonl, data.problems), heldout (evaluation
problems.jsonl; without it no evaluation runs), model_path (default: JAXRL_QWEN35_9B_M0), seeds (e.g. 0+1+2;
default one seed), limit=100 (held-out prompts).
"""

from jaxrl.sweep.spec import parse_sweep_args

KEYS = ("problems", "heldout", "model_path", "seeds", "limit")
PROBES = {  # as in configs/grpo.py PROBES, written out so the table shows what each probe sets
    "default": {"probe": "default", "optimizer.learning_rate": 1e-6, "grpo.beta": 0.05, "lora.rank": 16,
                "lora.alpha": 32.0},
    "aggressive": {"probe": "aggressive", "optimizer.learning_rate": 5e-6, "grpo.beta": 0.01, "lora.rank": 16,
                   "lora.alpha": 32.0},
    "capacity": {"probe": "capacity", "optimizer.learning_rate": 1e-6, "grpo.beta": 0.05, "lora.rank": 32,
                 "lora.alpha": 64.0},
}


def get_sweep(arg: str = ""):
    o = parse_sweep_args(arg, KEYS, "configs/sweeps/grpo_9b_probes.py")
    fixed = {"data.problems": o.get("problems", "")}
    if o.get("model_path"):
        fixed["model_path"] = o["model_path"]
    sweep = {
        "name": "grpo_9b_probes",
        "description": "9B GRPO step-16 probes: default, aggressive (lr/beta), higher capacity (r32/alpha64)",
        "base": "configs/grpo.py:run=9b_probe",
        "cases": {"probe": PROBES},
        "fixed": fixed,
        "baseline": {"probe": "default"},
    }
    if o.get("seeds"):
        sweep["seeds"] = [int(s) for s in o["seeds"].split("+")]
    if o.get("heldout"):
        sweep["evaluate"] = {"problems": o["heldout"], "steps": [4, 8, 12, 16], "num_samples": 1,
                             "temperature": 0.0, "max_new_tokens": 8192, "limit": int(o.get("limit", 100)),
                             "reward": "code"}
    return sweep

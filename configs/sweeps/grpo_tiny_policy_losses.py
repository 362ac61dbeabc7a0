r"""The policy-loss ablation on the CPU: every built-in policy loss (jaxrl.algorithms.policy_loss) x 3 seeds on the
token task of configs/grpo_tiny.py (a random tiny Qwen3.5 learns to answer in the instruction's half of the
vocabulary; chance is 0.5), two passes over each rollout so the ratio leaves 1 and the losses differ. A point is
about a minute on two cores, most of it compilation.

    python -m launchers.sweep --sweep=configs/sweeps/grpo_tiny_policy_losses.py --out=/tmp/loss_ablation
    python -m launchers.sweep --sweep=configs/sweeps/grpo_tiny_policy_losses.py:losses=ppo_clip+cispo,seeds=0 \
        --out=/tmp/loss_ablation_small
    python -m launchers.compare --sweep_dir=/tmp/loss_ablation --sort=-reward_mean_last5

Argument (optional, `:key=value,...`): `losses=ppo_clip+gspo+...` ('+'-separated; a plug-in name works with
`plugin=`), `seeds=0+1+2`, `steps=24`, `estimators=grpo` (advantage estimators, '+'-separated: a second axis),
`plugin=path/to/file.py:fn` (a policy_loss plug-in, registered under the function's name).
"""

from jaxrl.sweep.spec import parse_sweep_args

KEYS = ("losses", "seeds", "steps", "estimators", "plugin")
LOSSES = "ppo_clip+gspo+cispo+sapo+gmpo+kl_cov+clip_cov"


def get_sweep(arg: str = ""):
    o = parse_sweep_args(arg, KEYS, "configs/sweeps/grpo_tiny_policy_losses.py")
    steps = int(o.get("steps", 24))
    fixed = {
        "steps": steps,
        "checkpoint_every": steps // 2,
        "keep_checkpoints": 1,
        "tensorboard": False,
        "grpo.num_iterations": 2,  # the second pass is off-policy: clipping, gates and weights act
        "grpo.epsilon_high": 0.28,
        # CPU: a low LLVM optimisation level compiles several times faster; these programs run for milliseconds
        "compile_options": {"xla_backend_optimization_level": 0},
    }
    if o.get("plugin"):
        fixed["plugins"] = [{"kind": "policy_loss", "name": o["plugin"].rpartition(":")[2], "path": o["plugin"]}]
    axes = {"grpo.policy_loss": o.get("losses", LOSSES).split("+")}
    if o.get("estimators"):
        axes["grpo.advantage_estimator"] = o["estimators"].split("+")
    return {
        "name": "grpo_tiny_policy_losses",
        "description": "GRPO policy loss x seed on the token task (two passes per rollout)",
        "base": "configs/grpo_tiny.py",
        "axes": axes,
        "seeds": [int(s) for s in o.get("seeds", "0+1+2").split("+")],
        "fixed": fixed,
        "baseline": {"grpo.policy_loss": "ppo_clip"},
    }

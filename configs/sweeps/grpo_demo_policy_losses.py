r"""The loss ablation with a held-out verdict, one command on the CPU: every built-in policy loss
(jaxrl.algorithms.policy_loss) x 3 seeds of GRPO on the demo's task (configs/grpo_demo.py: M0 answers "in digits"
or "in letters" as the prompt asks; partial reward = the fraction of answer characters in that alphabet), two
passes over each rollout so the ratio leaves 1 and the losses differ. Each point's last checkpoint and M0 are
evaluated on the demo's 128 held-out prompts (4 samples each); the comparison table gives each variant's held-out
reward against `ppo_clip` of the same seed with a paired interval, the simultaneous interval over every cell (a
claim survives choosing the best of the grid), and over seeds the recipe-level interval (seeds, then prompts,
resampled), also simultaneous across the variants. The sweep first makes the demo's model, tasks and M0 in
`demo=` (its `prepare` command: `launchers.demo --until=warm_up`, skipped where they exist: `make demo`'s folder
has them). About a minute a point on two cores.

    python -m launchers.sweep --sweep=configs/sweeps/grpo_demo_policy_losses.py --out=/tmp/loss_ablation
    python -m launchers.sweep --sweep=configs/sweeps/grpo_demo_policy_losses.py:losses=ppo_clip,estimators=grpo+rloo+reinforce_plus_plus+reinforce_plus_plus_baseline+pass_at_k+pass_at_k@2 \
        --out=/tmp/estimator_ablation
    python -m launchers.compare --sweep_dir=/tmp/loss_ablation --sort=-diff:partial_reward_mean@48

Argument (optional, `:key=value,...`): `losses=ppo_clip+gspo+...` ('+'-separated; a plug-in name works with
`plugin=`), `seeds=0+1+2`, `steps=48`, `estimators=grpo+pass_at_k@2` (advantage estimators, '+'-separated: a
second axis, `estimator`; `pass_at_k@K` sets grpo.pass_at_k_k=K; the baseline is then `grpo` with the first loss), `plugin=path/to/file.py:fn` (a policy_loss plug-in, registered under
the function's name), `demo=demo_workdir` (where the demo's model and tasks are, or are made).
"""

import os

from jaxrl.demo_settings import PATHS
from jaxrl.sweep.spec import parse_sweep_args

KEYS = ("losses", "seeds", "steps", "estimators", "plugin", "demo")
LOSSES = "ppo_clip+gspo+cispo+sapo+gmpo+kl_cov+clip_cov"


def get_sweep(arg: str = ""):
    o = parse_sweep_args(arg, KEYS, "configs/sweeps/grpo_demo_policy_losses.py")
    steps = int(o.get("steps", 48))
    demo = os.path.abspath(o.get("demo", "demo_workdir"))
    fixed = {
        "steps": steps,
        "checkpoint_every": steps,
        "keep_checkpoints": 1,
        "tensorboard": False,
        "grpo.num_iterations": 2,  # the second pass is off-policy: clipping, gates and weights act
        "grpo.epsilon_high": 0.28,
        # CPU: a low LLVM optimisation level compiles several times faster; these programs run for milliseconds
        "compile_options": {"xla_backend_optimization_level": 0},
    }
    if o.get("plugin"):
        fixed["plugins"] = [{"kind": "policy_loss", "name": o["plugin"].rpartition(":")[2], "path": o["plugin"]}]
    losses = o.get("losses", LOSSES).split("+")
    axes = {"grpo.policy_loss": losses}
    baseline = {"grpo.policy_loss": losses[0] if "ppo_clip" not in losses else "ppo_clip"}
    cases = {}
    if o.get("estimators"):
        # NAME, or pass_at_k@K: the estimator with grpo.pass_at_k_k = K (PKPO below the group size)
        for label in o["estimators"].split("+"):
            name, _, k = label.partition("@")
            cases[label] = {"grpo.advantage_estimator": name, **({"grpo.pass_at_k_k": int(k)} if k else {})}
        baseline["estimator"] = "grpo" if "grpo" in cases else next(iter(cases))
    return {
        "name": "grpo_demo_policy_losses",
        "description": "GRPO policy loss x seed on the demo's task (two passes per rollout), held-out reward",
        "base": f"configs/grpo_demo.py:demo={demo}",
        "prepare": [["python", "-m", "launchers.demo", f"--workdir={demo}", "--until=warm_up"]],
        "axes": axes,
        **({"cases": {"estimator": cases}} if cases else {}),
        "seeds": [int(s) for s in o.get("seeds", "0+1+2").split("+")],
        "fixed": fixed,
        # the same held-out prompts and sampling as the demo's evaluation: M0 (step 0) and the last checkpoint
        "evaluate": {"problems": os.path.join(demo, PATHS["eval"]), "steps": [steps], "num_samples": 4,
                     "temperature": 1.0, "max_new_tokens": 8, "max_prompt_len": 64, "reward": "charset",
                     "dtype": "float32", "batch_size": 128, "seed": 0},
        "baseline": baseline,
    }

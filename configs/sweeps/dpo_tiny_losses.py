r"""The CPU sweep of the tests and the demo: 2 DPO loss types x 2 betas x 2 seeds on the toy DPO task
(configs/dpo_tiny.py: arithmetic-progression pairs, held-out preference accuracy at every checkpoint), 8 points of
4 steps each, a checkpoint every 2 steps; seconds a point on two CPU cores (the persistent compilation cache makes
the second seed of each (loss, beta) cheaper).

    python -m launchers.sweep --sweep=configs/sweeps/dpo_tiny_losses.py --out=/tmp/tiny_sweep
    python -m launchers.sweep --sweep=configs/sweeps/dpo_tiny_losses.py --out=/tmp/tiny_sweep --dry_run
    python -m launchers.compare --sweep_dir=/tmp/tiny_sweep --sort=-eval_preference_accuracy@4

Argument (optional, `:key=value,...`): `losses=sigmoid+ipo` (loss types, '+'-separated; a plug-in name works
with `plugin=`), `betas=0.1+0.5`, `seeds=0+1`, `steps=4`, `plugin=path/to/file.py:fn` (a DPO loss plug-in,
registered under the function's name, e.g. `losses=sigmoid+my_loss,plugin=my_losses.py:my_loss`).
"""


from jaxrl.sweep.spec import parse_sweep_args

KEYS = ("losses", "betas", "seeds", "steps", "plugin")


def get_sweep(arg: str = ""):
    o = parse_sweep_args(arg, KEYS, "configs/sweeps/dpo_tiny_losses.py")
    steps = int(o.get("steps", 4))
    fixed = {
        "steps": steps,
        "checkpoint_every": 2,
        "keep_checkpoints": 2,
        "tensorboard": False,
        # one full-attention layer: the point's cost is compilation, and one layer compiles in half the time
        "model_overrides.num_hidden_layers": 1,
        "model_overrides.layer_types": ("full_attention",),
        # CPU: a low LLVM optimisation level compiles several times faster; these programs run for milliseconds
        "compile_options": {"xla_backend_optimization_level": 0},
    }
    if o.get("plugin"):
        fn = o["plugin"].rpartition(":")[2]
        fixed["plugins"] = [{"kind": "dpo_loss", "name": fn, "path": o["plugin"]}]
    return {
        "name": "dpo_tiny_losses",
        "description": "DPO loss type x beta x seed on the toy arithmetic-progression pairs",
        "base": "configs/dpo_tiny.py",
        "axes": {
            "dpo.loss_type": o.get("losses", "sigmoid+ipo").split("+"),
            "dpo.beta": [float(b) for b in o.get("betas", "0.1+0.5").split("+")],
        },
        "seeds": [int(s) for s in o.get("seeds", "0+1").split("+")],
        "fixed": fixed,
        "baseline": {"dpo.loss_type": "sigmoid", "dpo.beta": 0.1},
    }

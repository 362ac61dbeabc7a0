r"""The users' length-clean vs unfiltered DPO pairs comparison (the users' report, section 3) as one sweep: the axis
`pairs` is the pair set -- the original M0-derived 1,000 pairs, or the pairs left after dropping near-cap and
length-mismatched ones (433 for 4B, 245 for 9B: `python -m launchers.build_pairs --pairs_in=... --out_dir=...`)
-- on top of the users' length-clean run (configs/dpo.py run=4b_m0_clean / run=9b_m0_clean). Every checkpoint
the users looked at (4, 8, 12, 16, 28, 125) is evaluated on the same held-out prompts, and the table gives the
clean run's difference to the unfiltered one at each step with a paired bootstrap interval: the early-dev gain
that reversed later is exactly a sign change along these columns.

    S=configs/sweeps/dpo_length_clean.py
    python -m launchers.sweep --out=runs/dpo_4b_length_clean \
        --sweep=$S:model=4b,unfiltered=pairs_4b_m0/cohort,clean=clean_4b/pairs.jsonl,problems=heldout100.jsonl
    python -m launchers.sweep --out=runs/dpo_9b_length_clean --print_commands \
        --sweep=$S:model=9b,unfiltered=pairs_9b_m0/cohort,clean=clean_9b/pairs.jsonl,problems=heldout100.jsonl
    python -m launchers.compare --sweep_dir=runs/dpo_4b_length_clean --metric=partial_reward_mean,strict_rate

Arguments (`:key=value,...`): model=4b|9b, unfiltered (pairs of the original cohort), clean (the filtered pairs),
clean_pairs=N (expected size of the clean set; default 433 for 4b, 245 for 9b), problems (held-out problems.jsonl;
without it no evaluation runs), model_path (default: JAXRL_QWEN35_<MODEL>_M0), seeds (e.g. 0+1+2), limit=100.
"""

from jaxrl.sweep.spec import parse_sweep_args

KEYS = ("model", "unfiltered", "clean", "clean_pairs", "problems", "model_path", "seeds", "limit")
CLEAN_PAIRS = {"4b": 433, "9b": 245}  # what the users' filter left of 1,000 pairs


def get_sweep(arg: str = ""):
    where = "configs/sweeps/dpo_length_clean.py"
    o = parse_sweep_args(arg, KEYS, where)
    model = o.get("model", "4b")
    if model not in CLEAN_PAIRS:
        raise ValueError(f"{where}: model={model!r}; choose 4b or 9b")
    fixed = {"model_path": o["model_path"]} if o.get("model_path") else {}
    sweep = {
        "name": f"dpo_{model}_length_clean",
        "description": f"{model} DPO from M0: unfiltered pairs vs length-clean pairs",
        "base": f"configs/dpo.py:run={model}_m0_clean",
        "cases": {"pairs": {
            "unfiltered": {"data.pairs": o.get("unfiltered", ""), "data.expected_pairs": 1000},
            "length_clean": {"data.pairs": o.get("clean", ""),
                             "data.expected_pairs": int(o.get("clean_pairs", CLEAN_PAIRS[model]))},
        }},
        "fixed": fixed,
        "baseline": {"pairs": "unfiltered"},
    }
    if o.get("seeds"):
        sweep["seeds"] = [int(s) for s in o["seeds"].split("+")]
    if o.get("problems"):
        sweep["evaluate"] = {"problems": o["problems"], "steps": [4, 8, 12, 16, 28, 125], "num_samples": 1,
                             "temperature": 0.0, "max_new_tokens": 8192, "limit": int(o.get("limit", 100)),
                             "reward": "code"}
    return sweep

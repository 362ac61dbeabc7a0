r"""How many prompts (and samples a prompt) an evaluation needs to detect an effect: power planning from a pilot.

    # from a pilot evaluation (its per-sample files): variance split, model-base correlation, prompts x samples
    python -m launchers.plan --results=runs/dpo_4b_base/eval --effect=0.02 --power=0.8
    # from the users' own numbers: SD of the per-prompt differences 15.9 pp, or the interval it came from
    python -m launchers.plan --sd_diff=0.159 --effect=0.02 --family=7
    python -m launchers.plan --pilot_interval=0.0005,0.063 --pilot_n=100 --effect=0.02
    # a base-only pilot: assume a model whose per-prompt means correlate 0.8 with the base's
    python -m launchers.plan --results=eval_base --correlation=0.8 --effect=0.02

Prints, for each number of samples a prompt, the prompts needed for a true effect of --effect at --power
(two-sided --alpha), without and with a Bonferroni correction over --family comparisons (default: the pilot
file's family size, i.e. every model x metric it compared). With a pilot that has one sample a prompt the
within-prompt variance cannot be separated, so more samples are assumed not to help (said in the output).
--out=FILE also writes the plan as JSON. The arithmetic: jaxrl/evaluation/planning.py.
"""

from __future__ import annotations

from absl import app

from jaxrl.evaluation.planning import (PlanSettings, minimum_detectable_effect, plan_table, power_at,
                                     sd_from_interval, variance_components)
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(PlanSettings)  # a flag per PlanSettings field


def _components(s: PlanSettings):
    """(variance components, pilot family size or None, description)."""
    if s.sd_diff is not None or s.pilot_interval:
        if s.pilot_interval:
            if s.sd_diff is not None or not s.pilot_n or len(s.pilot_interval) != 2:
                raise app.UsageError("--pilot_interval=LOW,HIGH needs --pilot_n and excludes --sd_diff")
            lo, hi = s.pilot_interval
            sd = sd_from_interval(lo, hi, s.pilot_n)
            what = f"SD implied by the interval [{lo:+.4f}, {hi:+.4f}] on {s.pilot_n} prompts: {sd:.4f}"
        else:
            sd = s.sd_diff
            what = f"given SD of the per-prompt differences {sd:.4f}"
        comps = {"between": sd * sd, "within": 0.0, "sd_diff": sd, "k": 1, "within_identified": False,
                 "source": what, "measured": False}
        if s.pilot_interval:
            comps["n_prompts"] = s.pilot_n
        return comps, None, what
    if not s.results:
        raise app.UsageError("give --results (a pilot evaluation), --sd_diff or --pilot_interval")
    from pathlib import Path

    from jaxrl.data.formats import read_results, read_samples, samples_path
    path = Path(s.results)
    folder = path if path.is_dir() else path.parent
    results = read_results(folder)
    baseline = (results.get("evaluation") or {}).get("baseline", "base")
    family = (results.get("family") or {}).get("size")
    base = read_samples(samples_path(folder, baseline))
    if s.correlation is not None:
        comps = variance_components(None, base, s.metric, correlation=s.correlation)
        return comps, family, f"base-only pilot {folder} ({comps['n_prompts']} prompts x {comps['k']} samples)"
    rows = [c for c in results.get("comparisons", []) if c["metric"] == s.metric]
    name = s.model or (max(rows, key=lambda c: abs(c["diff"]))["model"] if rows else None)
    if name is None:
        raise app.UsageError(f"{folder}: no model compared on {s.metric}; pass --correlation for a base-only "
                             "pilot")
    comps = variance_components(read_samples(samples_path(folder, name)), base, s.metric)
    return comps, family, (f"pilot {folder}: {name} vs {baseline}, {comps['n_prompts']} prompts x {comps['k']} "
                           f"samples")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(PlanSettings, _F)  # --samples: integers; --pilot_interval: numbers
    for name, value, ok in (("effect", s.effect, s.effect != 0), ("power", s.power,
                             0 < s.power < 1), ("alpha", s.alpha, 0 < s.alpha < 1),
                            ("family", s.family, s.family is None or s.family >= 1),
                            ("sd_diff", s.sd_diff, s.sd_diff is None or s.sd_diff > 0)):
        if not ok:
            raise app.UsageError(f"--{name}={value}: expected " + {"effect": "a non-zero effect",
                                 "family": "an integer >= 1", "sd_diff": "a positive SD"}.get(name, "a value in (0, 1)"))
    ks = list(s.samples)
    comps, pilot_family, what = _components(s)  # a missing or malformed pilot file: one line (launchers/_main.py)
    family = s.family or pilot_family or 1
    if not comps["within_identified"]:
        ks = [1]
    rows = plan_table(comps, s.effect, power=s.power, alpha=s.alpha, family=family, ks=ks)
    eff = s.effect
    print(what)
    if "correlation" in comps and comps["correlation"] is not None:
        print(f"model-base correlation of the per-prompt means: {comps['correlation']:.3f}")
    if comps["within_identified"]:
        print(f"variance of the per-prompt difference: between prompts {comps['between']:.5f}, within a prompt "
              f"{comps['within']:.5f} (a single paired sample), so sd(k) = sqrt(between + within / k)")
    elif comps.get("measured", True):
        print("one sample a prompt: between- and within-prompt variance cannot be separated; planned for k = 1 "
              "(a pilot with --num_samples >= 2 shows what more samples buy)")
    else:
        print("planned at the samples a prompt that SD was measured with (a pilot evaluation, --results, splits "
              "it into between- and within-prompt parts)")
    n_pilot = comps.get("n_prompts")
    if n_pilot:
        print(f"at the pilot's {n_pilot} prompts: minimum detectable effect "
              f"{100 * minimum_detectable_effect(comps['sd_diff'], n_pilot, s.power, s.alpha):.2f} pp, "
              f"power for {100 * eff:+.2f} pp {power_at(n_pilot, comps['sd_diff'], eff, s.alpha):.0%}")
    print(f"\nto detect {100 * eff:+.2f} pp with {s.power:.0%} power (two-sided alpha {s.alpha}; "
          f"family of {family} with Bonferroni):")
    print(f"{'samples/prompt':>15} {'sd_diff':>8} {'prompts':>8} {'samples':>8} {'prompts (family)':>17} "
          f"{'samples (family)':>17}")
    for r in rows:
        print(f"{r['k']:>15} {r['sd_diff']:>8.4f} {r['prompts']:>8} {r['samples']:>8} {r['prompts_family']:>17} "
              f"{r['samples_family']:>17}")
    if s.out:
        from jaxrl.utils.io import atomic_write_json
        atomic_write_json(s.out, {"source": what, "components": comps, "effect": eff, "power": s.power,
                                       "alpha": s.alpha, "family": family, "rows": rows})
        print(f"plan: wrote {s.out}")
    return 0


if __name__ == "__main__":
    _main.run(main)

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

from absl import app, flags

from launchers import _main

_RESULTS = flags.DEFINE_string("results", None, "Pilot evaluation folder (or its results.json) with samples/.")
_MODEL = flags.DEFINE_string("model", None, "Pilot model compared with the baseline (default: the one with the "
                             "largest |diff| on --metric).")
_METRIC = flags.DEFINE_enum("metric", "partial_reward_mean", ["partial_reward_mean", "strict_rate"], "Metric.")
_EFFECT = flags.DEFINE_float("effect", 0.02, "True effect to detect, in the metric's units (0.02 = 2 pp).")
_POWER = flags.DEFINE_float("power", 0.8, "Probability of detecting it.")
_ALPHA = flags.DEFINE_float("alpha", 0.05, "Two-sided level of each test.")
_FAMILY = flags.DEFINE_integer("family", None, "Comparisons to correct for (default: the pilot's family size, "
                               "else 1).")
_SAMPLES = flags.DEFINE_list("samples", ["1", "2", "4", "8", "16"], "Samples a prompt to plan for.")
_SD_DIFF = flags.DEFINE_float("sd_diff", None, "SD of the per-prompt differences (no pilot files needed).")
_PILOT_INTERVAL = flags.DEFINE_list("pilot_interval", None, "LOW,HIGH: a pilot's 95% interval of the difference "
                                    "(with --pilot_n): its SD is implied.")
_PILOT_N = flags.DEFINE_integer("pilot_n", None, "Prompts behind --pilot_interval.")
_CORRELATION = flags.DEFINE_float("correlation", None, "Base-only pilot: assumed model-base correlation of the "
                                  "per-prompt means.")
_OUT = flags.DEFINE_string("out", None, "Also write the plan as JSON here.")


def _components():
    """(variance components, pilot family size or None, description)."""
    if _SD_DIFF.value is not None or _PILOT_INTERVAL.value:
        from jaxrl.evaluation.planning import sd_from_interval
        if _PILOT_INTERVAL.value:
            if _SD_DIFF.value is not None or not _PILOT_N.value or len(_PILOT_INTERVAL.value) != 2:
                raise app.UsageError("--pilot_interval=LOW,HIGH needs --pilot_n and excludes --sd_diff")
            lo, hi = (float(x) for x in _PILOT_INTERVAL.value)
            sd = sd_from_interval(lo, hi, _PILOT_N.value)
            what = f"SD implied by the interval [{lo:+.4f}, {hi:+.4f}] on {_PILOT_N.value} prompts: {sd:.4f}"
        else:
            sd = _SD_DIFF.value
            what = f"given SD of the per-prompt differences {sd:.4f}"
        comps = {"between": sd * sd, "within": 0.0, "sd_diff": sd, "k": 1, "within_identified": False,
                 "source": what, "measured": False}
        if _PILOT_INTERVAL.value:
            comps["n_prompts"] = _PILOT_N.value
        return comps, None, what
    if not _RESULTS.value:
        raise app.UsageError("give --results (a pilot evaluation), --sd_diff or --pilot_interval")
    from pathlib import Path

    from jaxrl.data.formats import read_results, read_samples, samples_path
    from jaxrl.evaluation.planning import variance_components
    path = Path(_RESULTS.value)
    folder = path if path.is_dir() else path.parent
    results = read_results(folder)
    baseline = (results.get("evaluation") or {}).get("baseline", "base")
    family = (results.get("family") or {}).get("size")
    base = read_samples(samples_path(folder, baseline))
    if _CORRELATION.value is not None:
        comps = variance_components(None, base, _METRIC.value, correlation=_CORRELATION.value)
        return comps, family, f"base-only pilot {folder} ({comps['n_prompts']} prompts x {comps['k']} samples)"
    rows = [c for c in results.get("comparisons", []) if c["metric"] == _METRIC.value]
    name = _MODEL.value or (max(rows, key=lambda c: abs(c["diff"]))["model"] if rows else None)
    if name is None:
        raise app.UsageError(f"{folder}: no model compared on {_METRIC.value}; pass --correlation for a base-only "
                             "pilot")
    comps = variance_components(read_samples(samples_path(folder, name)), base, _METRIC.value)
    return comps, family, (f"pilot {folder}: {name} vs {baseline}, {comps['n_prompts']} prompts x {comps['k']} "
                           f"samples")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from jaxrl.evaluation.planning import minimum_detectable_effect, plan_table, power_at
    for name, value, ok in (("effect", _EFFECT.value, _EFFECT.value != 0), ("power", _POWER.value,
                             0 < _POWER.value < 1), ("alpha", _ALPHA.value, 0 < _ALPHA.value < 1),
                            ("family", _FAMILY.value, _FAMILY.value is None or _FAMILY.value >= 1),
                            ("sd_diff", _SD_DIFF.value, _SD_DIFF.value is None or _SD_DIFF.value > 0)):
        if not ok:
            raise app.UsageError(f"--{name}={value}: expected " + {"effect": "a non-zero effect",
                                 "family": "an integer >= 1", "sd_diff": "a positive SD"}.get(name, "a value in (0, 1)"))
    try:
        ks = [int(k) for k in _SAMPLES.value]
    except ValueError:
        raise app.UsageError(f"--samples: expected integers, got {','.join(_SAMPLES.value)}") from None
    comps, pilot_family, what = _components()  # a missing or malformed pilot file: one line (launchers/_main.py)
    family = _FAMILY.value or pilot_family or 1
    if not comps["within_identified"]:
        ks = [1]
    rows = plan_table(comps, _EFFECT.value, power=_POWER.value, alpha=_ALPHA.value, family=family, ks=ks)
    eff = _EFFECT.value
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
              f"{100 * minimum_detectable_effect(comps['sd_diff'], n_pilot, _POWER.value, _ALPHA.value):.2f} pp, "
              f"power for {100 * eff:+.2f} pp {power_at(n_pilot, comps['sd_diff'], eff, _ALPHA.value):.0%}")
    print(f"\nto detect {100 * eff:+.2f} pp with {_POWER.value:.0%} power (two-sided alpha {_ALPHA.value}; "
          f"family of {family} with Bonferroni):")
    print(f"{'samples/prompt':>15} {'sd_diff':>8} {'prompts':>8} {'samples':>8} {'prompts (family)':>17} "
          f"{'samples (family)':>17}")
    for r in rows:
        print(f"{r['k']:>15} {r['sd_diff']:>8.4f} {r['prompts']:>8} {r['samples']:>8} {r['prompts_family']:>17} "
              f"{r['samples_family']:>17}")
    if _OUT.value:
        from jaxrl.utils.io import atomic_write_json
        atomic_write_json(_OUT.value, {"source": what, "components": comps, "effect": eff, "power": _POWER.value,
                                       "alpha": _ALPHA.value, "family": family, "rows": rows})
        print(f"plan: wrote {_OUT.value}")
    return 0


if __name__ == "__main__":
    _main.run(main)

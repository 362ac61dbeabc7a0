"""Seeded simulations through the project's own statistics (tests/eval_sim.py generates the data): coverage of the
paired intervals, agreement of every p-value with its interval, family-wise error after the max-T correction,
the near-identical pair, and the selection-adjusted gain of the best of 8 null checkpoints.

Each figure is printed (``pytest -s``) and asserted. Monte Carlo SE of a coverage cell: about 0.5 pp (2,000
replications)."""

import numpy as np
import pytest

import eval_sim as S
from jaxrl.evaluation import selection, stats

pytestmark = pytest.mark.slow  # Monte Carlo coverage and error-rate simulations

ALPHA = 0.05


def _check_agreement(r):
    """p < alpha exactly when the interval excludes 0, on every row."""
    sig = r["p_value"] < ALPHA
    excludes = (r["ci_low"] > 0) | (r["ci_high"] < 0)
    assert np.array_equal(sig, excludes), np.flatnonzero(sig != excludes)[:10]


def _coverage(n, k, reward, effect, rho, reps=2000, n_resamples=999):
    rng = np.random.default_rng([n, k, int(rho * 10), int(round(effect * 100)), reward == "partial"])
    model, base, true = S.paired(rng, reps, n, k, reward, effect, rho)
    r = stats.paired_difference_rows(model, base, n_resamples=n_resamples, seed=1)
    _check_agreement(r)
    assert np.all(r["ci_high"] > r["ci_low"])  # never a zero-width interval
    return float(np.mean((r["ci_low"] <= true) & (true <= r["ci_high"])))


@pytest.mark.parametrize("reward,k", [("binary", 1), ("binary", 4), ("partial", 1), ("partial", 4)])
def test_coverage_at_100_prompts_is_nominal(reward, k):
    """n=100, model uncorrelated (rho 0) and correlated with the base (rho 0.7: 70% of the draws shared),
    true effects 0, +2 and +5 pp: every cell in 93-97%."""
    cells = {(rho, eff): _coverage(100, k, reward, eff, rho) for rho in (0.0, 0.7) for eff in (0.0, 0.02, 0.05)}
    print(reward, k, {key: round(v, 3) for key, v in cells.items()})
    for key, cov in cells.items():
        assert 0.93 <= cov <= 0.97, (reward, k, key, cov)


def test_coverage_of_a_nearby_checkpoint_stays_near_nominal():
    """rho 0.8 (a nearby checkpoint, one sample a prompt): only ~6 of 100 prompts are discordant, where no
    non-randomised test can hold its size at 5% (the mid-p McNemar test rejects 2.8% of the time at effect 0), so
    coverage runs a little above 95%; the percentile bootstrap had 12.5% type-I error at 4 discordant pairs."""
    cells = {eff: _coverage(100, 1, "binary", eff, 0.8) for eff in (0.0, 0.02, 0.05)}
    print("binary k=1 rho=0.8", cells)
    for eff, cov in cells.items():
        assert 0.93 <= cov <= 0.975, (eff, cov)


def test_coverage_at_20_binary_prompts():
    """The LiveCodeBench subset: 20 problems, one sample each. The bootstrap fell to 58% here."""
    cells = {(rho, eff): _coverage(20, 1, "binary", eff, rho) for rho in (0.0, 0.8) for eff in (0.0, 0.02, 0.05)}
    print("n=20 binary", cells)
    assert min(cells.values()) >= 0.93, cells


def test_four_wins_no_losses_is_not_a_difference_and_p_agrees():
    model = np.r_[np.ones(4), np.zeros(96)]
    r = stats.paired_difference(model, np.zeros(100))
    assert r["test"] == "mcnemar_midp" and r["p_value"] == pytest.approx(0.0625) and r["p_value_exact"] == 0.125
    assert r["ci_low"] < 0 < r["ci_high"] and r["diff"] == 0.04
    # five wins: significant by the mid-p test, and then the interval excludes 0 too
    r5 = stats.paired_difference(np.r_[np.ones(5), np.zeros(95)], np.zeros(100))
    assert r5["p_value"] == pytest.approx(2 * 0.5 / 32) and r5["ci_low"] > 0
    # ... also through compare, with the row flags
    row = stats.compare({"base": {"strict_rate": np.zeros(100)}, "near": {"strict_rate": model}}, "base",
                        ["strict_rate"], n_resamples=2000)[0]
    assert row["significant"] is False and row["ci_crosses_zero"] is True
    assert row["significant_after_selection"] is False and row["family_size"] == 1
    # every possible table of 100 binary pairs with up to 30 discordant: p and interval agree, width > 0
    b10, b01 = np.meshgrid(np.arange(31), np.arange(31))
    keep = (b10 + b01) <= 30
    r = stats.paired_binary(b10[keep], b01[keep], 100)
    _check_agreement(r)
    assert np.all(r["ci_high"] - r["ci_low"] > 0.01)


def test_intervals_on_all_equal_differences_have_width():
    """Twenty near-identical greedy prompts: the data show no spread, which is not certainty."""
    psi = 1 - (ALPHA / 2) ** (1 / 20)  # share of differing prompts that 20 identical ones still allow
    same = stats.paired_difference(np.full(20, 0.5), np.full(20, 0.5))  # k=4 rates, identical on every prompt
    assert same["test"] == "zero_spread" and same["p_value"] == 1.0
    assert (same["ci_low"], same["ci_high"]) == pytest.approx((-psi, psi))
    binary = stats.paired_difference(np.ones(20), np.ones(20))  # one sample a prompt, no discordant prompt
    assert binary["test"] == "mcnemar_midp" and binary["ci_low"] < -0.05 and binary["ci_high"] > 0.05
    shifted = stats.paired_difference(np.full(20, 0.5), np.full(20, 0.25))  # +0.25 on every prompt
    assert shifted["ci_low"] == pytest.approx(0.25 - psi * 1.25) and shifted["ci_high"] == pytest.approx(
        0.25 + psi * 0.75)
    assert shifted["p_value"] == pytest.approx(2 * 0.8 ** 20) and shifted["ci_low"] > 0  # 2 (1 - 0.25/1.25)^20
    small = stats.paired_difference(np.full(20, 0.05), np.zeros(20))  # +5 pp everywhere: not enough prompts
    assert small["p_value"] > ALPHA and small["ci_low"] < 0


def _null_family(k, stay, reps=1000, n=100, m=8):
    rng = np.random.default_rng([5, k, int(stay * 100)])
    part, strict = S.checkpoints(rng, reps, n, k, m, stay, difficulty=(1, 1))
    model = np.concatenate([part[:, 1:], strict[:, 1:]], axis=1)  # [R, 16, n]: 8 checkpoints x 2 metrics
    base = np.concatenate([np.repeat(part[:, :1], m, 1), np.repeat(strict[:, :1], m, 1)], axis=1)
    marg = stats.paired_difference_rows(model.reshape(-1, n), base.reshape(-1, n), n_resamples=999, seed=2)
    _check_agreement(marg)
    est, lo, hi, p = (marg[key].reshape(reps, 2 * m) for key in ("diff", "ci_low", "ci_high", "p_value"))
    sim = stats.simultaneous(model - base, est, lo, hi, p_values=p, n_resamples=1000, seed=3,
                             bounds=[(-1.0, 1.0)] * (2 * m))
    _check_agreement(sim)
    assert np.all(sim["ci_low"] <= lo) and np.all(sim["ci_high"] >= hi)  # never narrower than the marginal one
    return {"any_significant": float(np.mean((p < ALPHA).any(1))),
            "any_gain_significant": float(np.mean(((p < ALPHA) & (est > 0)).any(1))),
            "after_selection": float(np.mean((sim["p_value"] < ALPHA).any(1))),
            "critical_value": float(np.mean(sim["critical_value"]))}


@pytest.mark.parametrize("k,stay", [(1, 0.85), (1, 0.5), (4, 0.85)])
def test_family_wise_false_positives_of_8_null_checkpoints_x_2_metrics(k, stay):
    """No checkpoint differs from the base. Marginal intervals call at least one of the 16 rows significant in
    20-35% of runs (the audit's 16-19% counted gains only); the simultaneous intervals in at most 6%."""
    f = _null_family(k, stay)
    print(k, stay, f)
    assert f["any_significant"] > 0.15  # the trap is real in this simulation
    assert f["after_selection"] <= 0.06, f


def test_selection_adjusted_gain_of_the_best_of_8_null_checkpoints_is_centred_on_0():
    ids = [f"p{i}" for i in range(100)]
    fold = selection.fold_of(ids, seed=0)
    assert fold.sum() == 50 and np.array_equal(fold, selection.fold_of(list(reversed(ids)), 0)[::-1])
    for stay in (0.85, 0.5):
        rng = np.random.default_rng([9, int(stay * 100)])
        part, _ = S.checkpoints(rng, 2000, 100, 1, 8, stay, difficulty=(1, 1))
        d = part[:, 1:] - part[:, :1]
        naive = d.mean(-1).max(-1)
        values, _ = selection.cross_fit_values(d, fold)
        adjusted = values.mean(-1)
        se = adjusted.std() / np.sqrt(adjusted.size)
        print(stay, "naive %.4f, cross-fit %.4f (MC se %.4f)" % (naive.mean(), adjusted.mean(), se))
        assert 0.02 <= naive.mean() <= 0.04  # the winner's curse: +2 to +4 pp from noise alone
        assert abs(adjusted.mean()) < max(3 * se, 0.002)


def test_recipe_level_interval_covers_what_one_seed_cannot():
    """A recipe with a +2 pp effect whose trained adapters vary by 3 pp from seed to seed: the paired interval of
    one adapter covers the recipe's effect ~60% of the time; seeds, then prompts, resampled (5 seeds) ~90%."""
    from jaxrl.evaluation.seeds import seeds_then_prompts
    rng = np.random.default_rng(21)
    reps, seeds, prompts = 200, 5, 100
    two_stage = one_seed = 0
    for r in range(reps):
        d = (rng.normal(0.02, 0.03, seeds)[:, None] + rng.normal(0, 0.1, prompts)[None, :]
             + rng.normal(0, 0.1, (seeds, prompts)))
        out = seeds_then_prompts(d, n_resamples=1000, seed=r)
        assert (out["p_value"] < ALPHA) == (out["ci_low"] > 0 or out["ci_high"] < 0)
        two_stage += out["ci_low"] <= 0.02 <= out["ci_high"]
        single = stats.sign_flip(d[0], n_resamples=499, seed=r)
        one_seed += single["ci_low"] <= 0.02 <= single["ci_high"]
    print("recipe coverage: seeds then prompts", two_stage / reps, "one seed", one_seed / reps)
    assert two_stage / reps >= 0.87 and one_seed / reps <= 0.75


def test_recipe_family_holds_its_error_rate_over_the_choice():
    """Five recipes that do nothing (each seed's adapter off by a seed effect, prompts noisy), each against the
    baseline recipe of the same seeds: someone who reports the recipe whose interval excludes 0 is wrong whenever
    any of the five does. The marginal two-stage intervals are wrong in about a fifth of the families; the
    simultaneous ones (seeds_then_prompts_family, max-T over the five) in about 1 in 20."""
    from jaxrl.evaluation.seeds import seeds_then_prompts_family
    rng = np.random.default_rng(5)
    reps, recipes, seeds, prompts = 120, 5, 6, 60
    marginal_wrong = family_wrong = 0
    for r in range(reps):
        d = rng.normal(0, 0.02, (recipes, seeds))[:, :, None] + rng.normal(0, 0.1, (recipes, seeds, prompts))
        out = seeds_then_prompts_family(d, n_resamples=600, seed=r)
        lo, hi, slo, shi = (np.array(out[k]) for k in ("ci_low", "ci_high", "sim_low", "sim_high"))
        assert np.all(slo <= lo + 1e-12) and np.all(shi >= hi - 1e-12)  # never narrower than the marginal
        assert out["critical_value"] > 1.96 and out["family_size"] == recipes and out["n_seeds"] == seeds
        marginal_wrong += bool(np.any((lo > 0) | (hi < 0)))
        family_wrong += bool(np.any((slo > 0) | (shi < 0)))
    print("family-wise error: marginal", marginal_wrong / reps, "simultaneous", family_wrong / reps)
    assert marginal_wrong / reps >= 0.12 and family_wrong / reps <= 0.10

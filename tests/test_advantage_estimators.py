"""The advantage estimators added beside grpo / rloo (jaxrl/algorithms/grpo.py) against verl's
`verl/trainer/ppo/core_algos.py` at commit b178a3cd56f58b2d502255daba591e92833930a7: `grpo_passk` (line 361),
`reinforce_plus_plus_baseline` (425), `reinforce_plus_plus` (583), with `verl/utils/torch_functional.py`'s
`masked_whiten` (322). The references are those formulas written out in float64 torch here; ours must agree within
1e-6 on right-padded rows (where verl's reset of the return at a masked position is the same as ours), including a
row with no token, binary and continuous rewards, and the KL in the reward.
"""

import numpy as np
import pytest
import torch

from jaxrl.algorithms import grpo
from jaxrl.algorithms.grpo_config import GRPOConfig, TOKEN_LEVEL_ESTIMATORS

G, GROUPS, C = 4, 5, 9


def rollout(seed: int, binary: bool, empty_row: bool = True):
    rng = np.random.default_rng(seed)
    rewards = (rng.random(G * GROUPS) > 0.5).astype(np.float64) if binary else rng.random(G * GROUPS)
    lengths = rng.integers(1, C + 1, G * GROUPS)
    if empty_row:  # a row with no loss token (verl would have no position for its score: not for the baseline)
        lengths[3] = 0
    mask = (np.arange(C)[None, :] < lengths[:, None]).astype(np.float64)
    kl = 0.05 * rng.standard_normal((G * GROUPS, C))
    return rewards, mask, kl


def whiten(x, m):  # verl masked_whiten: token mean, Bessel-corrected token variance, rsqrt(var + 1e-8)
    mean = (x * m).sum() / (m.sum() + 1e-8)
    var = (((x - mean) ** 2) * m).sum() / (m.sum() + 1e-8) * m.sum() / (m.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def verl_token_rewards(rewards, mask, kl, coef):
    r = torch.zeros_like(mask)
    for i, n in enumerate(mask.sum(-1).long().tolist()):
        if n:
            r[i, n - 1] = rewards[i]
    return r - coef * kl * mask


def verl_reinforce_plus_plus(rewards, mask, kl, coef):
    token_rewards = verl_token_rewards(rewards, mask, kl, coef)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(mask.shape[0], dtype=mask.dtype)
    for t in reversed(range(mask.shape[1])):
        running = token_rewards[:, t] + running
        returns[:, t] = running
        running = running * mask[:, t]
    return whiten(returns, mask) * mask


def verl_reinforce_plus_plus_baseline(rewards, mask, kl, coef):
    scores = verl_token_rewards(rewards, mask, kl, coef).sum(-1)
    groups = scores.reshape(-1, G)
    scores = (groups - groups.mean(-1, keepdim=True)).reshape(-1)
    return whiten(scores[:, None] * mask, mask) * mask


def verl_passk(rewards):
    out = torch.zeros_like(rewards)
    for j, group in enumerate(rewards.reshape(-1, G)):
        top, idx = torch.topk(group, 2)
        out[j * G + idx[0]] = (top[0] - top[1]) / (torch.std(group) + 1e-6)
    return out


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "continuous"])
@pytest.mark.parametrize("coef", [0.0, 0.3])
@pytest.mark.parametrize("name,reference", [("reinforce_plus_plus", verl_reinforce_plus_plus),
                                            ("reinforce_plus_plus_baseline", verl_reinforce_plus_plus_baseline)])
def test_reinforce_plus_plus_equals_verl(name, reference, coef, binary):
    for seed in range(3):
        rewards, mask, kl = rollout(seed, binary, empty_row=name == "reinforce_plus_plus")
        ours = np.asarray(grpo.compute_advantages(np.float32(rewards), G, name, mask=np.float32(mask),
                                                  kl_penalty=np.float32(coef * kl) if coef else None))
        want = reference(*(torch.tensor(np.float64(np.float32(a))) for a in (rewards, mask, kl)), coef).numpy()
        assert ours.shape == (G * GROUPS, C)
        np.testing.assert_allclose(ours, want, rtol=1e-6, atol=2e-6, err_msg=f"{name} seed {seed}")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "continuous"])
def test_pass_at_k_equals_verls_grpo_passk(binary):
    for seed in range(4):
        rewards, _, _ = rollout(seed, binary)
        if binary:
            rewards[:G] = [1.0, 0.0, 0.0, 0.0]  # one solver: the whole group's credit goes to it
        ours = np.asarray(grpo.compute_advantages(np.float32(rewards), G, "pass_at_k"))
        want = verl_passk(torch.tensor(np.float64(np.float32(rewards)))).numpy()
        np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")
        assert np.count_nonzero(ours.reshape(-1, G), axis=1).max() <= 1


def test_reinforce_plus_plus_carries_the_return_across_an_episodes_observation():
    """A masked hole (an observation between two turns) does not cut the first turn off from the final reward."""
    mask = np.array([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]], np.float32)
    adv = np.asarray(grpo.compute_advantages(np.array([1.0, 0.0], np.float32), 1, "reinforce_plus_plus",
                                             mask=mask))
    assert np.all(adv[0, [0, 1, 4, 5]] > 0) and np.all(adv[1] < 0) and np.all(adv[0, 2:4] == 0)


def test_nan_rewards_are_left_out_and_the_estimators_are_declared_token_level_in_both_places():
    rewards = np.array([1.0, np.nan, 0.0, 0.5], np.float32)
    mask = np.ones((4, 3), np.float32)
    for name in TOKEN_LEVEL_ESTIMATORS:
        assert grpo.token_level(name)
        adv = np.asarray(grpo.compute_advantages(rewards, 2, name, mask=mask))
        assert np.all(np.isfinite(adv)) and not np.any(adv[1])
    assert {n for n in grpo.ADVANTAGES.names() if grpo.token_level(n)} == set(TOKEN_LEVEL_ESTIMATORS)
    assert np.asarray(grpo.compute_advantages(rewards, 2, "pass_at_k"))[:2].tolist() == [0.0, 0.0]


def test_kl_in_reward_needs_a_token_level_estimator():
    GRPOConfig(advantage_estimator="reinforce_plus_plus", kl_in_reward=0.01)
    with pytest.raises(ValueError, match=r"grpo.kl_in_reward puts the KL in each token's reward: it needs a "
                                         r"token-level advantage_estimator"):
        GRPOConfig(kl_in_reward=0.01)
    with pytest.raises(ValueError, match=r"grpo.kl_in_reward must be >= 0"):
        GRPOConfig(advantage_estimator="reinforce_plus_plus", kl_in_reward=float("nan"))


def test_the_best_of_group_reward_is_logged_for_what_pass_at_k_trains():
    """`reward/group_best_mean`: the mean over prompts of each group's best reward (pass@G on pass/fail rewards);
    a prompt whose rewards were all masked (NaN) is left out, a partly masked one takes its scored best."""
    from types import SimpleNamespace
    from jaxrl.algorithms.online.rollouts import sample_metrics
    r = np.array([0.0, 1.0, 0.0, 0.0, 0.2, np.nan, np.nan, np.nan, np.nan, 0.5, 0.0, 0.25], np.float32)
    s = SimpleNamespace(rewards=r, strict=(r == 1).astype(np.float32), lengths=np.full(12, 4),
                        truncated=np.zeros(12, bool), difficulty={}, fleet={})
    m = sample_metrics(s, 8, group=4)
    assert m["reward/group_best_mean"] == pytest.approx((1.0 + 0.2 + 0.5) / 3)
    assert "reward/group_best_mean" not in sample_metrics(s, 8)


def _pkpo_brute_force(r, k):
    """PKPO's Eq. 33 written out: s_i = 1 / C(n, k) * sum over k-subsets I holding i of (max_I - max_{I \\ i})."""
    import itertools
    import math
    n, out = len(r), np.zeros(len(r))
    for i in range(n):
        for subset in itertools.combinations(range(n), k):
            if i in subset:
                out[i] += max(r[j] for j in subset) - max(r[j] for j in subset if j != i)
    return out / math.comb(n, k)


@pytest.mark.parametrize("k", [2, 3, 5, 6])
def test_pass_at_k_below_the_group_size_is_pkpos_leave_one_out_transform(k):
    """`grpo.pass_at_k_k` = k: each sample's average gain to the best of k (Walder & Karkhanis 2025, Eq. 33), over
    the group's std as verl's grpo_passk scales; ties, unscored (NaN) members and a group of fewer than k scored
    ones included; k = G is verl's (the existing test above proves that one against verl's code)."""
    G = 6
    rng = np.random.default_rng(k)
    rewards = np.round(rng.uniform(0, 1, (5, G)) * 4) / 4
    rewards[1, [0, 3]] = np.nan
    rewards[2, :5] = np.nan  # one scored member: no advantage
    rewards[3] = 0.5  # all equal: no advantage
    adv = np.asarray(grpo.compute_advantages(np.float32(rewards.reshape(-1)), G, "pass_at_k",
                                             options={"k": k})).reshape(5, G)
    for p in range(5):
        v = rewards[p][~np.isnan(rewards[p])]
        want = np.zeros(G)
        if len(v) >= 2:
            want[~np.isnan(rewards[p])] = _pkpo_brute_force(v, min(k, len(v))) / (v.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(adv[p], want, rtol=1e-6, atol=1e-6, err_msg=f"group {p}")
    full = grpo.compute_advantages(np.float32(rewards.reshape(-1)), G, "pass_at_k", options={"k": G})
    np.testing.assert_array_equal(np.asarray(full), np.asarray(grpo.compute_advantages(
        np.float32(rewards.reshape(-1)), G, "pass_at_k")))


def test_pass_at_k_k_is_refused_out_of_range_or_with_another_estimator():
    with pytest.raises(ValueError, match=r"grpo.pass_at_k_k=9 .* 2..num_generations \(8\)"):
        GRPOConfig(advantage_estimator="pass_at_k", pass_at_k_k=9)
    with pytest.raises(ValueError, match=r"grpo.pass_at_k_k=4 is the k of advantage_estimator='pass_at_k' "
                                         r"\(got 'rloo'\)"):
        GRPOConfig(advantage_estimator="rloo", pass_at_k_k=4)
    assert GRPOConfig(advantage_estimator="pass_at_k", pass_at_k_k=4).advantage_options() == {"k": 4}

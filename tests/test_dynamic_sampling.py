"""GRPO dynamic sampling with refill (grpo.dynamic_sampling, issue 29 item 3) on a toy task with known pass rates:
every step trains exactly prompts_per_step groups with reward signal, the extra draws are logged, the cap is
honoured (the step then trains on what it has), and a rollout with extra draws is a function of (seed, rollout,
draw) and the policy, so a resumed run redraws it bit for bit."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from conftest import make_rollout, tiny_config
from jaxrl.algorithms.grpo_task import GRPOTask, take_groups
from jaxrl.algorithms.online.prompts import TokenTaskPrompts
from jaxrl.algorithms.online.rollouts import Sampled
from jaxrl.algorithms.run import build_model, resolve_config, run_training
from jaxrl.parallel.mesh import make_mesh
from jaxrl.rewards.base import RewardResult
from jaxrl.rewards.toy import TokenTask

MESH = (1, 1, 1)


def pass_rate(problem_id: str, coin_every: int) -> float:
    """The known pass rate of a prompt: 1 in `coin_every` prompts is a coin flip (0.5); the others always fail
    (0) or always pass (1), half each. Only the coin flips give a group reward signal."""
    h = zlib.crc32(problem_id.encode())
    if h % coin_every == 0:
        return 0.5
    return float((h // coin_every) % 2)


class KnownRates:
    """The toy reward (`reward.name = "test_dynamic_sampling:KnownRates"`): a coin-flip prompt passes when its first
    completion token id is even (32 of the 64 ids: probability about 1/2 under the tiny random model at temperature
    1, whose next-token distribution is nearly uniform); the others pass always or never."""

    def __init__(self, coin_every: int = 2):
        self.coin_every = coin_every

    def score(self, completions, problems, truncated=None):
        out = []
        for text, problem in zip(completions, problems):
            rate = pass_rate(problem["id"], self.coin_every)
            first = text.split()[:1]  # empty: the first token was the stop token (id 1, odd), dropped from the text
            ok = rate == 1.0 or (rate == 0.5 and bool(first) and int(first[0]) % 2 == 0)
            out.append(RewardResult(partial=float(ok), strict=ok, tests=["pass" if ok else "wrong"]))
        return out


def _config(coin_every: int, max_extra_draws: int, dynamic_sampling: bool = True):
    cfg = tiny_config("grpo", dynamic_sampling=dynamic_sampling, max_extra_draws=max_extra_draws, temperature=1.0,
                      beta=0.0)
    cfg.reward.name = "test_dynamic_sampling:KnownRates"
    cfg.reward.coin_every = coin_every
    return cfg


# ------------------------------------------------------------------------------------------------- host parts


def test_extra_draws_are_new_prompts_seeded_by_seed_rollout_and_draw():
    source = TokenTaskPrompts(TokenTask(vocab_size=64), seed=3)
    base = source.prompts(5, 8)
    one = source.extra_prompts(5, 1, 8)
    assert one[0] != base[0] and one[0] == source.extra_prompts(5, 1, 8)[0]  # new, and reproducible
    assert source.extra_prompts(5, 2, 8)[0] != one[0] and source.extra_prompts(6, 1, 8)[0] != one[0]
    assert TokenTaskPrompts(TokenTask(vocab_size=64), seed=4).extra_prompts(5, 1, 8)[0] != one[0]
    ids = {p["id"] for p in base[1]} | {p["id"] for p in one[1]}
    assert len(ids) == 16 and len(set(one[2]) | set(base[2])) == 16  # problem ids and sampling group keys unique


def test_take_groups_keeps_whole_groups_in_the_order_given():
    G = 2

    def sampled(tag: float, groups: int) -> Sampled:
        n = groups * G
        rows = tag + np.arange(n, dtype=np.float32)
        return Sampled(input_ids=np.repeat(rows[:, None], 3, 1).astype(np.int32),
                       attention_mask=np.ones((n, 3), np.int32), completion_mask=np.ones((n, 2), np.float32),
                       behaviour_logp=np.repeat(rows[:, None], 2, 1), lengths=np.full(n, 2, np.int32),
                       truncated=np.zeros(n, bool), rewards=rows, strict=np.zeros(n, np.float32),
                       prompt_lengths=np.full(n, 1, np.int32), times={"sample_s": tag + 1.0, "score_s": 0.5})

    a, b = sampled(0.0, 3), sampled(100.0, 3)
    out = take_groups([a, b], [(1, 2), (0, 0), (1, 0)], G)
    np.testing.assert_array_equal(out.rewards, [104, 105, 0, 1, 100, 101])
    np.testing.assert_array_equal(out.input_ids[:, 0], out.rewards)
    np.testing.assert_array_equal(out.behaviour_logp[:, 1], out.rewards)
    assert out.times == {"sample_s": 1.0 + 101.0, "score_s": 1.0}  # every draw was sampled and scored


# ------------------------------------------------------------------------------------------------- real rollouts


@pytest.mark.heavy
@pytest.mark.slow
def test_every_step_trains_prompts_per_step_groups_with_signal(tmp_path):
    """Half the prompts are coin flips (rate 0.5), a quarter always fail, a quarter always pass: about half of each
    draw's 8 groups carry signal. With dynamic sampling every one of 3 steps trains exactly 8 groups, all with
    signal, after one or more extra draws, which are logged."""
    cfg = _config(coin_every=2, max_extra_draws=10)
    cfg.steps = 3
    records = run_training(cfg, str(tmp_path / "run")).records
    for r in records:
        print(r["step"], {k: v for k, v in r.items() if k.startswith("dynamic_sampling/")},
              r["zero_variance_groups"], r["update_skipped"])
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["dynamic_sampling/signal_groups"] == 8 and r["dynamic_sampling/cap_reached"] == 0
        assert r["zero_variance_groups"] == 0.0  # the groups trained on all have signal
        assert r["dynamic_sampling/drawn_groups"] == 8 * (1 + r["dynamic_sampling/extra_draws"])
        assert 0.2 < r["dynamic_sampling/signal_rate"] < 0.8  # the known rate: 1/2 x (1 - 2/2^8)
        assert r["update_skipped"] == 0
    assert sum(r["dynamic_sampling/extra_draws"] for r in records) >= 3  # each step needed at least one


@pytest.mark.heavy
@pytest.mark.slow
def test_the_cap_is_honoured_and_a_rollout_with_extra_draws_is_reproducible():
    """1 prompt in 8 is a coin flip: one extra draw (the cap) cannot find 8 groups with signal; the rollout keeps
    its 8 groups, the ones with signal first, then the earliest without (advantage 0), and logs the cap. A second
    task made from the same config and weights (what a resumed run is) gives the same rollout bit for bit."""
    cfg = resolve_config(_config(coin_every=8, max_extra_draws=1))
    model = build_model(cfg)
    buffer, metrics = make_rollout(GRPOTask(cfg, model, make_mesh(MESH)), model)
    print({k: v for k, v in metrics.items() if k.startswith("dynamic_sampling/")})
    assert metrics["dynamic_sampling/extra_draws"] == 1 and metrics["dynamic_sampling/drawn_groups"] == 16
    assert metrics["dynamic_sampling/cap_reached"] == 1
    have = int(metrics["dynamic_sampling/signal_groups"])
    assert 0 < have < 8
    assert buffer["input_ids"].shape[0] == 64  # still prompts_per_step x num_generations rows
    adv = buffer["advantages"].reshape(8, 8)
    assert np.all(np.abs(adv[:have]).max(1) > 0) and np.all(adv[have:] == 0)
    assert metrics["zero_variance_groups"] == pytest.approx((8 - have) / 8)
    again, metrics2 = make_rollout(GRPOTask(cfg, model, make_mesh(MESH)), model)
    for k in buffer:
        np.testing.assert_array_equal(again[k], buffer[k], err_msg=k)
    assert {k: v for k, v in metrics2.items() if not k.startswith("time/")} == \
        {k: v for k, v in metrics.items() if not k.startswith("time/")}
    # without dynamic sampling the same rollout's groups are draw 0's, signal or not
    plain = resolve_config(_config(coin_every=8, max_extra_draws=1, dynamic_sampling=False))
    _, m0 = make_rollout(GRPOTask(plain, model, make_mesh(MESH)), model)
    assert "dynamic_sampling/extra_draws" not in m0 and m0["zero_variance_groups"] > (8 - have) / 8
    assert m0["reward/mean"] == metrics["reward/mean"]  # reward/* describe draw 0 either way

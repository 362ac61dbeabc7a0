"""Registries and user plug-ins: a good plug-in loads, registers and is used by name; a bad one fails at load
time with an error naming the plug-in, the expected signature and what was wrong."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import dpo, grpo, ppo, registry
from jaxrl.algorithms.registry import PluginError


@pytest.fixture
def plugin_file(tmp_path):
    """Write a plug-in source file; unregister what the test registered afterwards."""
    made = []

    def write(body, name="my_plugin.py"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return str(path)

    yield write
    for kind in ("dpo_loss", "advantage", "kl"):
        for n in registry.names(kind):
            if n.startswith("t_"):
                made.append((kind, n))
    for kind, n in made:
        registry.unregister(kind, n)


GOOD_DPO = """
import jax
import jax.numpy as jnp

def t_shifted_sigmoid(p):
    # DPO with a target margin: -log sigmoid(beta * delta - 0.5)
    return -jax.nn.log_sigmoid(p.beta * p.delta - 0.5)
"""


def test_good_dpo_plugin_loads_registers_and_is_used_by_name(plugin_file):
    path = plugin_file(GOOD_DPO)
    fn = registry.load_plugin(f"{path}:t_shifted_sigmoid", kind="dpo_loss")
    assert registry.get("dpo_loss", "t_shifted_sigmoid") is fn
    assert "t_shifted_sigmoid" in registry.names("dpo_loss")
    c, r = jnp.array([-10.0, -12.0, -3.0]), jnp.array([-11.0, -10.0, -3.0])
    rc, rr = jnp.array([-10.5, -12.0, -4.0]), jnp.array([-10.0, -10.0, -2.0])
    out = dpo.dpo_loss(c, r, rc, rr, loss_type="t_shifted_sigmoid", beta=0.5)
    delta = (np.asarray(c) - np.asarray(rc)) - (np.asarray(r) - np.asarray(rr))
    np.testing.assert_allclose(np.asarray(out), np.logaddexp(0, -(0.5 * delta - 0.5)), rtol=1e-6)
    # it also works inside the combined objective and under jit, with f-divergences
    inp = dpo.DPOInputs(jnp.ones((3, 2)) * -1, jnp.ones((3, 2)), jnp.ones((3, 2)) * -2, jnp.ones((3, 2)), rc, rr)
    loss, m = jax.jit(lambda i: dpo.combined_dpo_loss(i, ("t_shifted_sigmoid", "sft"), (1.0, 0.1),
                                                      f_divergence="js_divergence"))(inp)
    assert np.isfinite(float(loss)) and "loss/t_shifted_sigmoid" in m
    # loading the same file again (e.g. on resume) is fine and replaces the entry
    registry.load_plugin(f"{path}:t_shifted_sigmoid", kind="dpo_loss")


def test_module_path_spec_and_custom_name(plugin_file, monkeypatch, tmp_path):
    plugin_file(GOOD_DPO, name="t_user_losses.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.load_plugin("t_user_losses:t_shifted_sigmoid", kind="dpo_loss", name="t_margin_dpo")
    x = jnp.zeros(2)
    np.testing.assert_allclose(np.asarray(dpo.dpo_loss(x, x, x, x, "t_margin_dpo")), np.log1p(np.exp(0.5)),
                               rtol=1e-6)


@pytest.mark.parametrize(
    "body,fn,needles",
    [
        ("def t_bad(chosen, rejected):\n    return chosen - rejected\n", "t_bad",
         ["t_bad", "wrong signature", "(chosen, rejected)", "PairInputs", "[B]"]),
        ("import jax.numpy as jnp\ndef t_bad(p):\n    return jnp.mean(p.delta)\n", "t_bad",
         ["t_bad", "returned a scalar", "(3,)", "[B]"]),
        ("import jax.numpy as jnp\ndef t_bad(p):\n    return jnp.log(p.delta - 1e9)\n", "t_bad",
         ["t_bad", "non-finite", "NaN"]),
        ("def t_bad(p):\n    return p.delta if p.beta > 0 and float(p.delta[0]) > -1e9 else -p.delta\n", "t_bad",
         ["t_bad", "jax.jit", "expected fn(p: jaxrl.algorithms.dpo.PairInputs)"]),
        ("def t_bad(p):\n    return p.delta > 0\n", "t_bad",
         ["t_bad", "dtype bool"]),
    ],
    ids=["wrong-signature", "scalar-output", "nan-output", "not-jittable", "bool-output"],
)
def test_malformed_dpo_plugins_fail_clearly(plugin_file, body, fn, needles):
    path = plugin_file(body)
    with pytest.raises(PluginError) as ei:
        registry.load_plugin(f"{path}:{fn}", kind="dpo_loss")
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"
    assert fn not in registry.names("dpo_loss")  # nothing half-registered


def test_nan_gradient_is_caught(plugin_file):
    path = plugin_file("import jax.numpy as jnp\ndef t_sqrt0(p):\n    return jnp.sqrt(0.0 * p.delta)\n")
    with pytest.raises(PluginError, match=r"t_sqrt0.*non-finite.*gradient"):
        registry.load_plugin(f"{path}:t_sqrt0", kind="dpo_loss")


def test_import_problems_fail_clearly(plugin_file, tmp_path):
    with pytest.raises(PluginError, match="does not exist"):
        registry.load_plugin(f"{tmp_path}/nope.py:f", kind="dpo_loss")
    path = plugin_file("def t_other(p):\n    return p.delta\n")
    with pytest.raises(PluginError, match=r"defines no 't_missing'.*t_other"):
        registry.load_plugin(f"{path}:t_missing", kind="dpo_loss")
    bad = plugin_file("import not_a_module_xyz\n", name="broken.py")
    with pytest.raises(PluginError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        registry.load_plugin(f"{bad}:f", kind="dpo_loss")
    with pytest.raises(PluginError, match="expected 'path/to/file.py:function'"):
        registry.load_plugin(path, kind="dpo_loss")
    with pytest.raises(KeyError, match="unknown registry kind"):
        registry.load_plugin(f"{path}:t_other", kind="nonsense")


def test_builtin_names_are_protected(plugin_file):
    path = plugin_file("import jax\ndef sigmoid(p):\n    return 2.0 * p.delta\n")
    with pytest.raises(PluginError, match="already taken"):
        registry.load_plugin(f"{path}:sigmoid", kind="dpo_loss")
    x = jnp.zeros(2)
    np.testing.assert_allclose(np.asarray(dpo.dpo_loss(x, x, x, x, "sigmoid")), np.log(2.0), rtol=1e-6)
    with pytest.raises(KeyError, match="already registered"):
        registry.register("dpo_loss", "sigmoid")(lambda p: p.delta)


@pytest.mark.slow
def test_advantage_and_kl_plugins(plugin_file):
    path = plugin_file("""
        import jax.numpy as jnp

        def t_center(rewards, num_generations):
            g = rewards.reshape(-1, num_generations)
            return (g - g.mean(axis=1, keepdims=True)).reshape(-1)

        def t_per_group(rewards, num_generations):
            return rewards.reshape(-1, num_generations).mean(axis=1)   # [N/G], not [N]

        def t_sq(logp, ref_logp):
            return (logp - ref_logp) ** 2

        def t_seq_kl(logp, ref_logp):
            return (logp - ref_logp).sum(-1)                           # [B], not [B, T]
    """)
    registry.load_plugin(f"{path}:t_center", kind="advantage")
    out = grpo.compute_advantages(jnp.array([1.0, 3.0, 0.0, 4.0]), 2, "t_center")
    np.testing.assert_allclose(np.asarray(out), [-1.0, 1.0, -2.0, 2.0])
    with pytest.raises(PluginError, match=r"t_per_group.*shape \(3,\).*expected shape \(12,\)"):
        registry.load_plugin(f"{path}:t_per_group", kind="advantage")

    registry.load_plugin(f"{path}:t_sq", kind="kl")
    lp, rf = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]])
    rewards, kl = ppo.kl_penalty_rewards(lp, rf, jnp.ones((1, 2)), jnp.array([1.0]), 0.1, "t_sq")
    np.testing.assert_allclose(np.asarray(kl), [[0.25, 1.0]])
    np.testing.assert_allclose(np.asarray(rewards), [[-0.025, 0.9]], rtol=1e-6)
    norm = grpo.global_normalizers(jnp.ones((1, 2)))
    loss, m = grpo.grpo_loss(lp, None, jnp.array([0.0]), jnp.ones((1, 2)), norm, ref_logp=rf, beta=1.0,
                             kl_estimator="t_sq")
    np.testing.assert_allclose(float(loss), 0.625, rtol=1e-6)  # A = 0: only the KL term, mean(0.25, 1)
    with pytest.raises(PluginError, match=r"t_seq_kl.*shape \(2,\).*\(2, 5\)"):
        registry.load_plugin(f"{path}:t_seq_kl", kind="kl")


def test_registry_import_is_light():
    code = ("import sys; import jaxrl.algorithms.registry as r; "
            "assert 'jax' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules); "
            "print(r.kinds())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "dpo_loss" in out.stdout and "advantage" in out.stdout and "kl" in out.stdout

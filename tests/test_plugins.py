"""User plug-ins (jaxrl.algorithms.plugins): a good plug-in registers and is used by name; a bad one fails when it
is registered, with an error naming the plug-in, the expected signature and what was wrong; registering in code
and loading from the config are the same way in (same check, same error, same use by name)."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import dpo, grpo, kl, plugins, ppo
from jaxrl.algorithms.plugins import PluginError
from jaxrl.rewards import get_reward
from jaxrl.rewards.registry import example_problem
from jaxrl.utils.registry import origin_of


@pytest.fixture(autouse=True)
def forget_test_plugins():
    """Unregister every "t_*" name a test registered, of every kind."""
    yield
    for kind in plugins.KINDS:
        for name in plugins.names(kind):
            if name.startswith("t_"):
                plugins.unregister(kind, name)


@pytest.fixture
def plugin_file(tmp_path):
    """Write a plug-in source file; returns its path."""

    def write(body, name="my_plugin.py"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return str(path)

    return write


GOOD_DPO = """
import jax
import jax.numpy as jnp

def t_shifted_sigmoid(p):
    # DPO with a target margin: -log sigmoid(beta * delta - 0.5)
    return -jax.nn.log_sigmoid(p.beta * p.delta - 0.5)
"""


def test_good_dpo_plugin_loads_registers_and_is_used_by_name(plugin_file):
    path = plugin_file(GOOD_DPO)
    fn = plugins.load("dpo_loss", f"{path}:t_shifted_sigmoid")
    assert plugins.get("dpo_loss", "t_shifted_sigmoid") is fn
    assert "t_shifted_sigmoid" in plugins.names("dpo_loss")
    assert dpo.loss_spec("t_shifted_sigmoid") == dpo.PLUGIN_SPEC  # declared nothing
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
    again = plugins.load("dpo_loss", f"{path}:t_shifted_sigmoid")
    assert plugins.get("dpo_loss", "t_shifted_sigmoid") is again


def test_module_path_spec_and_custom_name(plugin_file, monkeypatch, tmp_path):
    plugin_file(GOOD_DPO, name="t_user_losses.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.load("dpo_loss", "t_user_losses:t_shifted_sigmoid", name="t_margin_dpo")
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
        plugins.load("dpo_loss", f"{path}:{fn}")
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"
    assert fn not in plugins.names("dpo_loss")  # nothing half-registered


def test_nan_gradient_is_caught(plugin_file):
    path = plugin_file("import jax.numpy as jnp\ndef t_sqrt0(p):\n    return jnp.sqrt(0.0 * p.delta)\n")
    with pytest.raises(PluginError, match=r"t_sqrt0.*non-finite.*gradient"):
        plugins.load("dpo_loss", f"{path}:t_sqrt0")


def test_import_problems_fail_clearly(plugin_file, tmp_path):
    with pytest.raises(PluginError, match="does not exist"):
        plugins.load("dpo_loss", f"{tmp_path}/nope.py:f")
    path = plugin_file("def t_other(p):\n    return p.delta\n")
    with pytest.raises(PluginError, match=r"defines no 't_missing'.*t_other"):
        plugins.load("dpo_loss", f"{path}:t_missing")
    bad = plugin_file("import not_a_module_xyz\n", name="broken.py")
    with pytest.raises(PluginError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        plugins.load("dpo_loss", f"{bad}:f")
    with pytest.raises(PluginError, match="expected 'path/to/file.py:function'"):
        plugins.load("dpo_loss", path)
    with pytest.raises(PluginError, match="unknown plug-in kind 'nonsense'; kinds: dpo_loss, advantage, kl, "
                                          "policy_loss, reward"):
        plugins.load("nonsense", f"{path}:t_other")
    with pytest.raises(PluginError, match="unknown plug-in kind 'loss'"):
        plugins.register("loss", "t_x")


def test_builtin_names_are_protected(plugin_file):
    path = plugin_file("import jax\ndef sigmoid(p):\n    return 2.0 * p.delta\n")
    with pytest.raises(PluginError, match="'sigmoid' is already taken by jaxrl.algorithms.dpo:sigmoid_loss"):
        plugins.load("dpo_loss", f"{path}:sigmoid")
    with pytest.raises(PluginError, match="'sigmoid' is already taken"):
        plugins.register("dpo_loss", "sigmoid")(lambda p: p.delta)
    x = jnp.zeros(2)
    np.testing.assert_allclose(np.asarray(dpo.dpo_loss(x, x, x, x, "sigmoid")), np.log(2.0), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ code = config
# Functions of this module, registered in code and named by config entries ("<this module>:function").


def t_scalar_loss(p):
    return jnp.mean(p.delta)  # a scalar, where per-pair losses [B] are due


def t_per_group(rewards, num_generations):
    return rewards.reshape(-1, num_generations).mean(axis=1)  # [N/G], not [N]


def t_seq_kl(logp, ref_logp):
    return (logp - ref_logp).sum(-1)  # [B], not [B, T]


def t_out_of_range(completion, problem):
    return 2.0  # rewards are in [0, 1]


@pytest.mark.parametrize("kind,fn,needle", [
    ("dpo_loss", t_scalar_loss, "returned a scalar eagerly; expected shape (3,)"),
    ("advantage", t_per_group, "returned shape (3,) eagerly; expected shape (12,)"),
    ("kl", t_seq_kl, "returned shape (2,) eagerly; expected shape (2, 5)"),
    ("reward", t_out_of_range, "returned 2.0 on the example completion"),
])
def test_register_in_code_refuses_what_a_config_entry_refuses(kind, fn, needle):
    """plugins.register runs the check a `plugins` entry gets: the same PluginError, the same words after the
    label (which names the function's origin, or the config entry and its path), nothing registered."""
    spec = f"{__name__}:{fn.__name__}"
    with pytest.raises(PluginError) as from_code:
        plugins.register(kind, "t_bad")(fn)
    with pytest.raises(PluginError) as from_config:
        plugins.load_plugins(plugins.parse_plugins([f"{kind}:t_bad={spec}"]))
    code_label = f"{kind} plug-in 't_bad' ({origin_of(fn)}): "
    config_label = f"plugins[0]: {kind} plug-in 't_bad' ({spec}): "
    assert str(from_code.value).startswith(code_label), str(from_code.value)
    assert str(from_config.value).startswith(config_label), str(from_config.value)
    problem = str(from_code.value)[len(code_label):]
    assert needle in problem
    assert str(from_config.value)[len(config_label):] == problem
    assert "t_bad" not in plugins.names(kind)


def t_margin(p):
    return -jax.nn.log_sigmoid(p.beta * (p.chosen_logps / p.chosen_lengths - p.rejected_logps / p.rejected_lengths))


def t_center(rewards, num_generations):
    g = rewards.reshape(-1, num_generations)
    return (g - g.mean(axis=1, keepdims=True)).reshape(-1)


def t_half_sq(logp, ref_logp):
    return 0.5 * (logp - ref_logp) ** 2


def t_has_code(completion, problem):
    return 1.0 if "```python" in completion else 0.0


def test_a_function_registered_in_code_and_one_from_the_config_are_used_identically():
    """Each kind: the same function registered in code as t_code and listed in the config as t_conf; the
    consumers that take a name (dpo_loss, compute_advantages, kl, get_reward) give the same results for both."""
    decl = {"reference_free": True, "needs_lengths": True}  # a reference-free, length-normalised DPO loss
    plugins.register("dpo_loss", "t_code", **decl)(t_margin)
    loaded = plugins.load_plugins(plugins.parse_plugins(
        [{"kind": "dpo_loss", "name": "t_conf", "path": f"{__name__}:t_margin", **decl}]))
    assert loaded == [{"kind": "dpo_loss", "name": "t_conf", "path": f"{__name__}:t_margin", **decl}]
    assert dpo.loss_spec("t_code") == dpo.loss_spec("t_conf") == dpo.PLUGIN_SPEC._replace(**decl)
    c, r, lc, lr = jnp.array([-10.0, -12.0]), jnp.array([-11.0, -9.0]), jnp.array([2.0, 4.0]), jnp.array([3.0, 3.0])
    by_code, by_config = (dpo.dpo_loss(c, r, None, None, name, beta=0.5, chosen_lengths=lc, rejected_lengths=lr)
                          for name in ("t_code", "t_conf"))  # reference-free: no reference log-probs needed
    np.testing.assert_allclose(np.asarray(by_code), np.logaddexp(0, -0.5 * (c / lc - r / lr)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(by_code), np.asarray(by_config))

    for kind, fn in (("advantage", t_center), ("kl", t_half_sq), ("reward", t_has_code)):
        plugins.register(kind, "t_code")(fn)
        plugins.load_plugins(plugins.parse_plugins([f"{kind}:t_conf={__name__}:{fn.__name__}"]))
    rewards = jnp.array([1.0, 3.0, 0.0, 4.0])
    np.testing.assert_allclose(np.asarray(grpo.compute_advantages(rewards, 2, "t_code")), [-1.0, 1.0, -2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(grpo.compute_advantages(rewards, 2, "t_code")),
                                  np.asarray(grpo.compute_advantages(rewards, 2, "t_conf")))
    lp, rf = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]])
    np.testing.assert_allclose(np.asarray(kl.kl(lp, rf, "t_code")), [[0.125, 0.5]])
    np.testing.assert_array_equal(np.asarray(kl.kl(lp, rf, "t_code")), np.asarray(kl.kl(lp, rf, "t_conf")))
    problem = example_problem()
    completions = ["no code", "```python\nprint(1)\n```"]
    scores = {name: [s.partial for s in get_reward(name).score(completions, [problem, problem])]
              for name in ("t_code", "t_conf")}
    assert scores == {"t_code": [0.0, 1.0], "t_conf": [0.0, 1.0]}


def test_a_file_that_registers_itself_can_also_be_listed_in_the_config(plugin_file):
    """A user module that calls plugins.register at import, listed in `plugins` too (or loaded again on resume):
    the same function under the same name, not a clash."""
    path = plugin_file("""
        import jax
        from jaxrl.algorithms import plugins

        @plugins.register("dpo_loss")
        def t_self_registered(p):
            return -jax.nn.log_sigmoid(p.beta * p.delta)
    """)
    for _ in range(2):
        assert plugins.load_plugins(plugins.parse_plugins([f"dpo_loss:{path}:t_self_registered"]))[0]["name"] == \
            "t_self_registered"
    x = jnp.zeros(2)
    np.testing.assert_allclose(np.asarray(dpo.dpo_loss(x, x, x, x, "t_self_registered")), np.log(2.0), rtol=1e-6)


def test_registration_options_are_checked():
    with pytest.raises(PluginError, match=r"unknown option\(s\) \['reference_fre'\]; a dpo_loss plug-in takes "
                                          r"label_smoothing, f_divergence, reference_free"):
        plugins.register("dpo_loss", "t_x", reference_fre=True)(t_margin)
    with pytest.raises(PluginError, match=r"unknown option\(s\) \['needs_lengths'\]; a kl plug-in takes none"):
        plugins.register("kl", "t_x", needs_lengths=True)(t_half_sq)
    with pytest.raises(PluginError, match=r"option\(s\) \['reference_free'\] must be True or False"):
        plugins.register("dpo_loss", "t_x", reference_free="yes")(t_margin)
    with pytest.raises(PluginError, match=r"plugins\[0\].*'reference_free'.*unknown keys \['ref_free'\]"):
        plugins.parse_plugins([{"kind": "dpo_loss", "path": "a.py:f", "ref_free": True}])
    with pytest.raises(PluginError, match=r"plugins\[0\]=.*optionally 'name'; unknown keys \['across_pairs'\]"):
        plugins.parse_plugins([{"kind": "advantage", "path": f"{__name__}:t_center", "across_pairs": True}])
    with pytest.raises(PluginError, match="not a usable name"):
        plugins.register("kl", "t x")(t_half_sq)
    assert "t_x" not in plugins.names("dpo_loss") and "t_x" not in plugins.names("kl")


def test_the_checker_reads_old_configs_with_dpo_plugin(plugin_file, tmp_path, capsys):
    """`python -m jaxrl.algorithms.plugins CONFIG.json` (main): a config.json written before `dpo.plugin` became an
    alias still loads that loss and finds the name; an unknown name exits 2 naming the key."""
    path = plugin_file(GOOD_DPO)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"plugins": [], "dpo": {"plugin": f"{path}:t_shifted_sigmoid",
                                                         "loss_type": "t_shifted_sigmoid,sft"}}))
    assert plugins.main([str(config)]) == 0
    assert f"ok: dpo_loss 't_shifted_sigmoid' ({path}:t_shifted_sigmoid)" in capsys.readouterr().out
    config.write_text(json.dumps({"dpo": {"plugin": "", "loss_type": "t_shifted_sigmoid"},
                                  "grpo": {"kl_estimator": "k4"}}))
    assert plugins.main([str(config)]) == 2
    assert "grpo.kl_estimator='k4': no kl named 'k4'" in capsys.readouterr().err


def test_advantage_and_kl_plugins(plugin_file):
    path = plugin_file("""
        import jax.numpy as jnp

        def t_center(rewards, num_generations):
            g = rewards.reshape(-1, num_generations)
            return (g - g.mean(axis=1, keepdims=True)).reshape(-1)

        def t_sq(logp, ref_logp):
            return (logp - ref_logp) ** 2
    """)
    plugins.load("advantage", f"{path}:t_center")
    out = grpo.compute_advantages(jnp.array([1.0, 3.0, 0.0, 4.0]), 2, "t_center")
    np.testing.assert_allclose(np.asarray(out), [-1.0, 1.0, -2.0, 2.0])

    plugins.load("kl", f"{path}:t_sq")
    lp, rf = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]])
    rewards, kl_values = ppo.kl_penalty_rewards(lp, rf, jnp.ones((1, 2)), jnp.array([1.0]), 0.1, "t_sq")
    np.testing.assert_allclose(np.asarray(kl_values), [[0.25, 1.0]])
    np.testing.assert_allclose(np.asarray(rewards), [[-0.025, 0.9]], rtol=1e-6)
    norm = grpo.global_normalizers(jnp.ones((1, 2)))
    loss, _ = grpo.grpo_loss(lp, None, jnp.array([0.0]), jnp.ones((1, 2)), norm, ref_logp=rf, beta=1.0,
                             kl_estimator="t_sq", aggregation="token_mean")
    np.testing.assert_allclose(float(loss), 0.625, rtol=1e-6)  # A = 0: only the KL term, mean(0.25, 1)

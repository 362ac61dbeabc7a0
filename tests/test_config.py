"""One typed default per config key (declared by its owner, composed in jaxrl/algorithms/config.py): the family
configs build from it, a config not built on configs/base.py resolves to the same values, a typo in any block is an
error naming the nearest valid key, the resolved TrainConfig is typed, and run_training writes it to
config.json."""

import dataclasses
import json
import subprocess
import sys

import ml_collections
import pytest

from configs import base, distill, distill_tiny, dpo_tiny, grpo_tiny, ppo_tiny, sft_tiny
from jaxrl.algorithms.run import resolve_config, run_training
from jaxrl.algorithms import config as train_config
from jaxrl.algorithms.tasks import default_config, get_algorithm
from jaxrl.utils.typed_config import ConfigKeyError, setting, to_plain


def test_configs_are_built_from_the_schema_without_importing_jax():
    code = ("import sys\n"
            "from configs import base, dpo, grpo, ppo, distill, dpo_tiny, grpo_tiny, ppo_tiny, sft_tiny, distill_tiny\n"
            "for m in (dpo, grpo, ppo, distill): m.get_config('')\n"
            "for m in (dpo_tiny, grpo_tiny, ppo_tiny, sft_tiny, distill_tiny): m.get_config()\n"
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    for algorithm in ("sft", "dpo", "grpo", "ppo", "distill"):
        assert to_plain(base.get_config(algorithm)) == to_plain(default_config(algorithm))


@pytest.mark.parametrize("make", [sft_tiny.get_config, dpo_tiny.get_config, grpo_tiny.get_config,
                                  ppo_tiny.get_config, distill_tiny.get_config, lambda: distill.get_config("")])
def test_family_configs_are_complete(make):
    c = make()
    before = to_plain(c)
    assert train_config.complete(c, get_algorithm(c.algorithm)) == before  # nothing to fill, nothing refused
    assert resolve_config(c).to_json() == before


@pytest.mark.parametrize("algorithm,given", [
    ("sft", {"steps": 3, "data": {"seq_len": 32}}),
    ("dpo", {"dpo": {"beta": 0.2}, "data": {"source": "synthetic"}, "optimizer": {"learning_rate": 1e-5}}),
    ("grpo", {"grpo": {"num_generations": 4}, "reward": {"name": "token_block"}}),
    ("ppo", {"ppo": {"epochs": 2}, "lora": {"rank": 8}}),
])
def test_a_config_without_base_resolves_like_one_with_it(algorithm, given):
    bare = resolve_config(ml_collections.ConfigDict({"algorithm": algorithm, **given}))
    expected = base.get_config(algorithm)
    for key, value in given.items():
        if isinstance(value, dict):
            for k, v in value.items():
                expected[key][k] = v
        else:
            expected[key] = value
    assert bare.to_json() == to_plain(expected)
    assert (bare.dtype, bare.max_consecutive_nonfinite, bare.keep_checkpoints) == ("bfloat16", 10, 2)


TYPOS = [  # (algorithm, block ("" = top level), wrong key, the key it should suggest)
    ("sft", "", "stpes", "steps"),
    ("sft", "", "max_consecutive_nonfinte", "max_consecutive_nonfinite"),
    ("sft", "optimizer", "learning_rat", "learning_rate"),
    ("sft", "lora", "rnak", "rank"),
    ("sft", "batch", "grad_acum", "grad_accum"),
    ("sft", "mesh", "shap", "shape"),
    ("sft", "data", "seq_lenn", "seq_len"),
    ("dpo", "dpo", "betta", "beta"),
    ("dpo", "data", "max_lenght", "max_length"),
    ("grpo", "grpo", "num_generation", "num_generations"),
    ("grpo", "data", "max_prompt_lenn", "max_prompt_len"),
    ("grpo", "reward", "scroe", "score"),
    ("grpo", "reward", "timeout", "timeout_s"),  # a constructor argument of the reward (CodeVerifier)
    ("ppo", "ppo", "cliprange_valu", "cliprange_value"),
    ("dpo", "model_overrides", "num_hidden_layer", "num_hidden_layers"),
]


@pytest.mark.parametrize("algorithm,block,wrong,right", TYPOS)
def test_a_typo_in_any_block_names_the_key_and_the_nearest_valid_one(algorithm, block, wrong, right):
    c = base.get_config(algorithm)
    if block:
        c[block][wrong] = 1
    else:
        c[wrong] = 1
    where = f"{block}." if block else ""
    with pytest.raises(ConfigKeyError) as info:
        resolve_config(c)
    message = str(info.value)
    assert f"unknown config key '{where}{wrong}'" in message and f"did you mean '{where}{right}'?" in message, message


def test_a_value_of_the_wrong_type_names_the_key():
    # (a ConfigDict refuses such an assignment itself; a config read from JSON or built from dicts does not)
    c = ml_collections.ConfigDict({"algorithm": "dpo", "dpo": {"beta": "high"}})
    with pytest.raises(ConfigKeyError, match=r"config key dpo.beta='high': expected float or int, got str"):
        resolve_config(c)
    c = ml_collections.ConfigDict({"algorithm": "sft", "steps": True})
    with pytest.raises(ConfigKeyError, match=r"config key steps=True: expected int"):
        resolve_config(c)
    c = ml_collections.ConfigDict({"algorithm": "sft", "mesh": [1, 1, 1]})
    with pytest.raises(ConfigKeyError, match="expected a block of keys"):
        resolve_config(c)


def test_the_family_configs_json_round_trip(tmp_path):
    """What a sweep point reads back from config.json (lists for tuples) resolves to the same config."""
    for make in (dpo_tiny.get_config, grpo_tiny.get_config, ppo_tiny.get_config):
        c = make()
        again = resolve_config(ml_collections.ConfigDict(json.loads(c.to_json_best_effort())))
        assert again.to_json() == json.loads(c.to_json_best_effort())
        assert resolve_config(again.to_json()) == again  # config.json read back: the same typed config


@dataclasses.dataclass(frozen=True)
class MineConfig:
    alpha: float = setting(1.0)
    beta: float = setting(0.5)


def test_an_algorithm_of_your_own_may_declare_its_blocks():
    def build(config, model, mesh):  # never called here
        raise AssertionError

    c = ml_collections.ConfigDict({"algorithm": "my_pkg.algo:build", "mine": {"alpha": 2}})
    with pytest.raises(ConfigKeyError, match="unknown config key 'mine'"):
        resolve_config(c, build)  # no declared blocks: a block nobody reads is refused
    build.config_blocks = {"mine": MineConfig}
    resolved = resolve_config(c, build)
    assert resolved.block("mine") == MineConfig(alpha=2.0, beta=0.5)
    assert (resolved.dtype, resolved.block("data"), "data" in resolved.to_json()) == ("bfloat16", None, False)
    c.mine.alhpa = 3.0
    with pytest.raises(ConfigKeyError, match="did you mean 'mine.alpha'"):
        resolve_config(c, build)


def test_the_resolved_config_is_typed_and_frozen():
    """Values are cast once, where the config is resolved: an int learning rate is a float, a JSON list a tuple."""
    c = ml_collections.ConfigDict({"algorithm": "grpo", "optimizer": {"learning_rate": 1}, "mesh": {"shape": [1, 1, 1]},
                                   "grpo": {"beta": 0}, "reward": {"name": "code", "timeout_s": 3}})
    run = resolve_config(c.to_dict())
    assert isinstance(run.optimizer.learning_rate, float) and run.optimizer.learning_rate == 1.0
    assert run.mesh.shape == (1, 1, 1) and isinstance(run.grpo.beta, float)
    assert (run.reward.name, run.reward.options) == ("code", {"timeout_s": 3})
    assert run.to_json()["reward"] == {"name": "code", "score": "partial", "timeout_s": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.steps = 3


@pytest.mark.parametrize("block,key,value,message", [
    ("", "steps", 0, "config: steps must be an integer >= 1, got 0"),
    ("batch", "grad_accum", 0, "batch.grad_accum must be an integer >= 1, got 0"),
    ("optimizer", "schedule", "cosin", "optimizer.schedule='cosin'; choose one of"),
    ("grpo", "num_generations", 0, "grpo.num_generations must be >= 1, got 0"),
    ("grpo", "scale_rewards", "groups", "grpo.scale_rewards='groups'; choose one of"),
    ("ppo", "init_kl_coef", -1.0, "ppo.init_kl_coef must be >= 0, got -1.0"),
    ("reward", "score", "full", "reward.score='full'; choose one of"),
    # seeds outside [0, 2**32) alias others (jax keeps a seed's low 32 bits; -1 is 2**32 - 1)
    ("", "seed", -1, "config: seed must be an integer in [0, 2**32), got -1"),
    ("", "model_seed", 2 ** 63, f"model_seed must be an integer in [0, 2**32), got {2 ** 63}"),
    # an infinite temperature samples uniformly (with an overflow warning): never meant
    ("grpo", "temperature", float("inf"), "grpo.temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ("ppo", "temperature", -0.5, "ppo.temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
])
def test_a_bad_value_fails_where_the_config_is_resolved(block, key, value, message):
    algorithm = block if block in ("grpo", "ppo") else "grpo" if block == "reward" else "sft"
    c = base.get_config(algorithm)
    if block:
        c[block][key] = value
    else:
        c[key] = value
    with pytest.raises(ValueError) as info:
        resolve_config(c)
    assert message in str(info.value)


def test_run_training_refuses_a_typo_before_building_anything(tmp_path):
    c = sft_tiny.get_config()
    c.optimizer.warmup_step = 2
    with pytest.raises(ConfigKeyError, match="did you mean 'optimizer.warmup_steps'"):
        run_training(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_training_fills_a_bare_config_and_writes_it_to_config_json(tmp_path):
    """A config of a few keys trains like one built on configs/base.py: bf16 weights, the non-finite stop at 10,
    two kept states; config.json holds every resolved key."""
    bare = ml_collections.ConfigDict({
        "algorithm": "sft", "steps": 1, "tensorboard": False,
        "model_overrides": {"num_hidden_layers": 1, "layer_types": ("full_attention",)},
        "batch": {"micro_batch_size": 1, "grad_accum": 1}, "mesh": {"shape": (1, 1, 1)},
        "data": {"seq_len": 16}, "lora": {"rank": 2, "alpha": 4.0}, "logprob_chunk_size": 64,
        "compile_options": {"xla_backend_optimization_level": 0},
    })
    result = run_training(bare, str(tmp_path / "run"))
    assert result.final_step == 1
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    expected = base.get_config("sft")
    for key in ("steps", "tensorboard", "logprob_chunk_size"):
        expected[key] = bare[key]
    for block in ("model_overrides", "batch", "mesh", "data", "lora", "compile_options"):
        for k, v in bare[block].items():
            expected[block][k] = v
    assert written == json.loads(expected.to_json_best_effort())
    assert (written["dtype"], written["max_consecutive_nonfinite"], written["keep_checkpoints"]) == ("bfloat16",
                                                                                                     10, 2)
    assert result.state.params and all(str(v.dtype) == "float32" for v in result.state.params.values())


def test_scan_layers_is_none_by_default_and_true_or_false_from_the_command_line():
    """`scan_layers` defaults to None (the model decides: `Qwen35Config.scan_decision`); the command line sets it
    to true or false (a typed placeholder: ml_collections refuses to override a plain None); anything else is
    refused naming the key."""
    from absl import flags
    from ml_collections import config_flags

    for argv, want in (([], None), (["--config.scan_layers=false"], False), (["--config.scan_layers=true"], True)):
        flag_values = flags.FlagValues()
        holder = config_flags.DEFINE_config_dict("config", base.get_config("sft"), flag_values=flag_values,
                                                 sys_argv=["train", *argv])
        flag_values(["train", *argv])
        assert resolve_config(holder.value).scan_layers is want
    with pytest.raises(ValueError, match="scan_layers"):
        resolve_config({"algorithm": "sft", "scan_layers": "auto"})

"""The sampler as trainers hold it: LoRA adapters attached, data-parallel on a mesh, new weights each step.

A 2-layer tiny model (one Gated DeltaNet layer, one attention layer) keeps the compile time down while covering
both cache kinds.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl.models import lora, qwen35
from jaxrl.models.qwen35.config import tiny  # not qwen35.tiny: the tiny.py submodule shadows it once imported
from jaxrl.parallel.mesh import make_mesh
from jaxrl.generation import TRACE_COUNTS, Engine, Request, Sampler, programs

SETTINGS = dict(max_new_tokens=8, prompt_buckets=(32,), batch_size=8)
SAMPLING = dict(n=2, temperature=1.0, top_p=0.95, seed=0)


def tiny2():
    return tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def base():
    return qwen35.init_model(tiny2(), seed=0)


@pytest.fixture(scope="module")
def adapted():
    """The same base weights with rank-4 adapters on every projection; B is random so adapters matter."""
    model = qwen35.init_model(tiny2(), seed=0)
    lora.apply_lora(model, "all-linear", rank=4, alpha=8, seed=1)
    key = jax.random.PRNGKey(2)
    for i, (_, adapter) in enumerate(lora.iter_lora(model)):
        b = adapter.lora_B
        b[...] = 0.5 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape)
    return model


def merged_copy(adapted):
    """A plain model whose weights are W + s B A: what the adapted model computes, without adapters."""
    model = qwen35.init_model(tiny2(), seed=0)
    deltas = {path: a.delta_weight() for path, a in lora.iter_lora(adapted)}
    for path, module in nnx.iter_modules(model):
        name = ".".join(map(str, path))
        if name in deltas:
            module.weight[...] = module.weight[...] + deltas[name]
    return model


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_lora_generation_equals_merged_weights_and_disabled_equals_base(base, adapted):
    prompts = prompts_of([3, 9, 17, 30])
    sampler = Sampler(adapted, **SETTINGS)
    with_adapters = sampler.sample(prompts, **SAMPLING)
    merged = Sampler(merged_copy(adapted), **SETTINGS).sample(prompts, **SAMPLING)
    plain = Sampler(base, **SETTINGS).sample(prompts, **SAMPLING)
    assert with_adapters.tokens == merged.tokens
    for a, b in zip(with_adapters.logprobs, merged.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert with_adapters.tokens != plain.tokens  # the adapters change the policy ...
    with lora.adapters_disabled(adapted):  # ... and switching them off samples the base policy
        assert sampler.sample(prompts, **SAMPLING).tokens == plain.tokens
    assert sampler.sample(prompts, **SAMPLING).tokens == with_adapters.tokens


@pytest.mark.slow
def test_sharded_lora_generation_equals_unsharded(adapted):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = make_mesh((4, 2, 1))  # rows over data x fsdp = 8; hidden dims of the weights over fsdp = 2
    prompts = prompts_of([3, 9, 17, 30])
    ref = Sampler(adapted, **SETTINGS).sample(prompts, **SAMPLING)
    sharded = Sampler(adapted, mesh=mesh, **SETTINGS)
    out = sharded.sample(prompts, **SAMPLING)
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)

    # It really ran sharded: slots over 8 devices, base weights and LoRA factors split by the sharding rules.
    engine = Engine(adapted, slots=8, prompt_buckets=(32,), generation_buckets=(8,), mesh=mesh, round_steps=1)
    engine.set_params(None)
    for j, p in enumerate(prompts):
        engine.submit(Request(p, group_id=j, temperature=1.0, top_p=0.95))
    engine.step()
    (pool,) = engine.pools.values()
    assert isinstance(pool.state.tokens.sharding, NamedSharding) and len(pool.state.tokens.sharding.device_set) == 8
    assert tuple(pool.state.tokens.sharding.spec)[0] == ("data", "fsdp")
    # the rows run over data x fsdp; what a round hands the host comes back replicated, so that every process of a
    # multi-process mesh can read the whole rollout (placement.replicate_rows)
    weights = engine._weights
    _, status, outputs = programs.decode_round(weights.structure, weights.leaves, engine._decode_weights,
                                               pool.state, np.ones((pool.size,), bool), np.int32(1), np.int32(9),
                                               mode=pool.mode,
                                               pad_id=engine.pad_id, mesh=mesh)
    assert status.sharding.is_fully_replicated and outputs[0].sharding.is_fully_replicated
    up = nnx.state(weights.structure.merge(weights.leaves))["layers"][0]["mlp"]["up_proj"]
    assert tuple(up["weight"][...].sharding.spec) == ("tensor", "fsdp")
    assert up["weight"][...].addressable_shards[0].data.shape == (128, 32)
    assert tuple(up["lora"]["lora_A"][...].sharding.spec) == (None, "fsdp")


@pytest.mark.slow
def test_sharded_continuous_batching_equals_the_unsharded_engine(adapted):
    """The engine on a mesh (slots over data x fsdp = 8, weights and fused adapters split by the sharding rules),
    with more rows than slots so slots are refilled: the unsharded engine's samples."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = make_mesh((4, 2, 1))
    prompts = prompts_of([3, 9, 17, 30, 12, 5, 22, 8], seed=3)
    sampling = dict(SAMPLING, n=2)
    ref = Sampler(adapted, **SETTINGS).sample(prompts, **sampling)
    out = Sampler(adapted, mesh=mesh, **SETTINGS).sample(prompts, **sampling)
    assert out.stats["inserts"] > 1  # 16 rows through 8 slots
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_held_sampler_uses_new_weights_without_recompiling(adapted):
    """A trainer keeps one Sampler and passes its current (trainable, frozen) states each step: the samples
    follow the new weights (equal to a model holding them), and nothing is traced again."""
    sampler = Sampler(adapted, **SETTINGS)
    prompts = prompts_of([5, 6, 7, 8], seed=3)
    before = sampler.sample(prompts, **SAMPLING)
    graphdef, trainable, frozen = lora.split_lora(adapted)  # what the trainer holds
    sampler.sample(prompts, params=(trainable, frozen), **SAMPLING)
    traces = sum(TRACE_COUNTS.values())

    updated = jax.tree.map(lambda x: x * 1.5, trainable)  # "a training step"
    after = sampler.sample(prompts, params=(updated, frozen), **SAMPLING)
    assert sum(TRACE_COUNTS.values()) == traces
    assert after.tokens != before.tokens
    again = Sampler(nnx.merge(graphdef, updated, frozen), **SETTINGS).sample(prompts, **SAMPLING)
    assert again.tokens == after.tokens
    # The held model itself is untouched: sampling without params still gives the old samples.
    assert sampler.sample(prompts, **SAMPLING).tokens == before.tokens


@pytest.mark.slow  # an Orbax save and restore, two samplers compiled
def test_adapter_checkpoint_loads_for_rollouts(adapted, tmp_path):
    """`launchers.rollout --adapter`: a trainer adapter checkpoint attached to a fresh base model samples exactly
    what the trained model samples."""
    from jaxrl.models.peft import read_adapter
    from jaxrl.models.adapters import attach
    from jaxrl.train.checkpoints import RunCheckpoints

    ckpt = RunCheckpoints(str(tmp_path), async_save=False)
    ckpt.save(3, {"step": jnp.zeros((), jnp.int32)}, {"step": 3}, lora.lora_state(adapted),
              {"step": 3, "lora": lora.lora_targets_report(adapted)})
    ckpt.close()
    fresh = qwen35.init_model(tiny2(), seed=0)
    attach(fresh, read_adapter(str(tmp_path)))  # what the rollout runner's backend does with --adapter
    prompts = prompts_of([4, 11, 19, 30], seed=4)
    assert Sampler(fresh, **SETTINGS).sample(prompts, **SAMPLING).tokens == \
        Sampler(adapted, **SETTINGS).sample(prompts, **SAMPLING).tokens

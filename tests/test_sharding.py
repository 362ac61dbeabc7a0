"""The jitted train step on 8 fake CPU devices: meshes (2, 2, 2) and (1, 8, 1) give the loss and gradients of
one device; every weight kind is really sharded; config and multi-host flag handling."""

import ml_collections
import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

from jaxrl.models import lora, qwen35
from jaxrl.parallel import distributed
from jaxrl.parallel import sharding as shd
from jaxrl.algorithms.run import resolve_config
from jaxrl.parallel.mesh import MeshConfigError, make_mesh, mesh_from_config
from jaxrl.train.objective import NextToken
from jaxrl.algorithms.sft_task import synthetic_batch
from jaxrl.models.qwen35.init import init_model_jit
from jaxrl.train.state import ParamCodec, create_train_state
from jaxrl.utils.tree import dotted
from jaxrl.train.step import jit_train_step, make_train_step, put_batch, split_batch

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices: XLA_FLAGS in conftest")


@pytest.fixture(scope="module")
def parts():
    model = init_model_jit(qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")))
    # column-parallel (q_proj, in_proj_qkv) and row-parallel (out_proj, down_proj) adapters: both LoRA layouts
    lora.apply_lora(model, "q_proj,in_proj_qkv,out_proj,down_proj", rank=4, alpha=8)
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    rng = np.random.default_rng(0)
    # random B as well, so that both factors get gradients
    params = {n: np.asarray(v) if n.endswith("lora_A") else (rng.normal(size=v.shape) * 0.3).astype(np.float32)
              for n, v in codec.to_flat(trainable).items()}
    batch = synthetic_batch(0, batch_size=8, seq_len=16, vocab_size=256, seed=1)
    return graphdef, codec, params, jax.device_get(frozen), batch


def norm(spec) -> tuple:
    """A PartitionSpec as a tuple without trailing Nones."""
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def sgd_step(parts, mesh_shape, grad_accum):
    """One jitted step with plain SGD at lr 1 (so params_before - params_after = the summed gradient)."""
    graphdef, codec, params, frozen, batch = parts
    mesh = make_mesh(mesh_shape)
    tx = optax.sgd(1.0)
    step_fn = make_train_step(NextToken(chunk_size=32), tx, lambda c: jnp.float32(1.0), graphdef, codec)
    state = create_train_state(params, tx, seed=0, mesh=mesh)
    split = put_batch(split_batch(batch, grad_accum), mesh)
    jitted = jit_train_step(step_fn, mesh, state, frozen, split,
                            compiler_options={"xla_backend_optimization_level": 0})  # quicker compile
    new_state, metrics = jitted(state, frozen, split)
    return mesh, jitted, new_state, jax.device_get(metrics)


@pytest.mark.slow
def test_meshes_give_the_loss_and_gradients_of_one_device(parts):
    _, _, params, _, _ = parts
    results = {}
    for shape, accum in [((1, 1, 1), 2), ((2, 2, 2), 2), ((1, 8, 1), 1)]:
        mesh, jitted, state, metrics = sgd_step(parts, shape, accum)
        new = jax.device_get(state.params)
        results[shape] = (metrics["loss"], {n: params[n] - new[n] for n in params})
        if shape == (2, 2, 2):
            # explicit shardings: the output state is laid out by the rules, weights really split
            q_a = state.params["layers.1.self_attn.q_proj.lora.lora_A"]
            assert norm(q_a.sharding.spec) == (None, "fsdp") and q_a.addressable_shards[0].data.shape == (4, 32)
            q_b = state.params["layers.1.self_attn.q_proj.lora.lora_B"]
            assert norm(q_b.sharding.spec) == ("tensor",) and q_b.addressable_shards[0].data.shape == (64, 4)
            # the frozen base goes in with the rule shardings (those jit_train_step declares): check them
            frozen = jax.device_put(parts[3], shd.nnx_state_shardings(parts[3], mesh))
            shards = {dotted(p): (norm(x.sharding.spec), x.addressable_shards[0].data.shape, x.shape)
                      for p, x in jax.tree_util.tree_flatten_with_path(frozen)[0]}
            expect = {"in_proj_qkv.weight": ("tensor", "fsdp"), "conv1d": ("tensor",),
                      "out_proj.weight": ("fsdp", "tensor"), "down_proj.weight": ("fsdp", "tensor"),
                      "q_proj.weight": ("tensor", "fsdp"), "embed_tokens": ("tensor", "fsdp"),
                      "lm_head.weight": ("tensor", "fsdp"), "gate_proj.weight": ("tensor", "fsdp")}
            for key, spec in expect.items():
                hits = [v for n, v in shards.items() if n.endswith(key)]
                assert hits and all(h[0] == spec for h in hits), (key, hits)
                ways = int(np.prod([mesh.shape[a] for a in spec]))  # each device holds 1/ways of the weight
                assert all(np.prod(h[1]) * ways == np.prod(h[2]) for h in hits), (key, hits)
    ref_loss, ref_grads = results[(1, 1, 1)]
    assert max(float(np.abs(g).max()) for g in ref_grads.values()) > 1e-3
    for shape in [(2, 2, 2), (1, 8, 1)]:
        loss, grads = results[shape]
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), shape
        for name, g in grads.items():
            np.testing.assert_allclose(g, ref_grads[name], rtol=0, atol=1e-5, err_msg=f"{shape} {name}")


def test_batch_that_cannot_split_over_the_mesh_fails_clearly(parts):
    mesh = make_mesh((1, 8, 1))
    with pytest.raises(ValueError, match=r"batch.micro_batch_size=4 must be a multiple of data x fsdp = 8"):
        put_batch(split_batch(parts[4], 2), mesh)


def test_mesh_from_config():
    cfg = resolve_config(ml_collections.ConfigDict({"mesh": {"shape": (2, -1, 2)}}))
    assert dict(mesh_from_config(cfg.mesh).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert make_mesh((1, 1, 1)).devices.size == 1  # a subset of the devices on one process
    with pytest.raises(MeshConfigError, match="needs 16 devices"):
        make_mesh((2, 8, 1))
    with pytest.raises(MeshConfigError, match="at most one -1"):
        make_mesh((-1, -1, 1))


def test_distributed_settings_from_flags_and_environment():
    assert distributed.settings_from(environ={}) is None
    env = {"JAXRL_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAXRL_NUM_PROCESSES": "4", "JAXRL_PROCESS_ID": "2",
           "JAXRL_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed.settings_from(environ=env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                                      "process_id": 2, "local_device_ids": [0, 1]}
    assert distributed.settings_from("h:1", 2, 1, environ=env)["process_id"] == 1  # flags win
    with pytest.raises(distributed.DistributedConfigError, match="--num_processes"):
        distributed.settings_from("h:1", environ={})
    with pytest.raises(distributed.DistributedConfigError, match="without --coordinator_address"):
        distributed.settings_from(num_processes=2, environ={})
    with pytest.raises(distributed.DistributedConfigError, match="must be in"):
        distributed.settings_from("h:1", 2, 2, environ={})


@pytest.mark.slow
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_users_micro_batch_of_one_is_refit_to_the_mesh_keeping_the_global_batch(tmp_path):
    # The users' DPO runs: micro-batch 1 x accumulation 8. On 8 data-parallel devices that split cannot shard;
    # the trainer takes 8 x 1 instead (the update does not depend on the split) and config.json records it.
    import json
    from configs import sft_tiny
    from jaxrl.algorithms.run import fit_micro_batch_to_mesh, resolve_config, run_training
    mesh = make_mesh((1, 8, 1))
    c = sft_tiny.get_config()
    c.batch.micro_batch_size, c.batch.grad_accum, c.steps, c.checkpoint_every = 1, 8, 2, 2
    c.mesh.shape = (1, 8, 1)
    result = run_training(c, str(tmp_path / "run"))
    assert result.final_step == 2 and all(r["update_skipped"] == 0 for r in result.records if "loss" in r)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["batch"]
    assert (saved["micro_batch_size"], saved["grad_accum"]) == (8, 1)
    c2 = sft_tiny.get_config()
    c2.batch.micro_batch_size, c2.batch.grad_accum = 2, 6  # 12 rows over 8 devices: no split exists
    with pytest.raises(ValueError, match=r"12 rows per step cannot be split over data x fsdp = 8 devices"):
        fit_micro_batch_to_mesh(resolve_config(c2), mesh)
    c3 = sft_tiny.get_config()
    c3.batch.micro_batch_size, c3.batch.grad_accum = 4, 4  # 4 -> 8 x 2
    fitted = fit_micro_batch_to_mesh(resolve_config(c3), mesh)
    assert (fitted.batch.micro_batch_size, fitted.batch.grad_accum) == (8, 2)
    assert fit_micro_batch_to_mesh(fitted, mesh) is fitted  # already fits: unchanged

"""LoRA on the Flax Qwen3.5: targeting, PEFT layout and math (against peft + torch), exact base at step 0,
adapters off = base, fp32 adapters on a bf16 base, dropout semantics."""

import functools
import math

import numpy as np
import pytest
import torch

import hf_tiny
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import lora, qwen35
from jaxrl.train.objective import NextToken
from jaxrl.train.state import ParamCodec
from jaxrl.train.step import make_micro_loss


# A low LLVM optimisation level compiles quicker; the comparisons here are exact or against torch anyway.
QUICK = {"xla_backend_optimization_level": 0}


def tiny2(**kw):
    """2 layers (Gated DeltaNet, full attention): every module kind, half the compile time of the 4-layer tiny."""
    return qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), **kw)


def abstract_apply(targets, **kw) -> dict:
    """apply_lora on an abstract (shape-only) 4-layer tiny model: the targeting logic without computing weights."""
    out = {}

    def build():
        model = qwen35.Qwen35(qwen35.tiny(), rngs=nnx.Rngs(0))
        out["report"] = lora.apply_lora(model, targets, **kw)
        return model

    nnx.eval_shape(build)
    return out["report"]


# ------------------------------------------------------------------------------------------------ targeting


def test_all_linear_targets_the_12_tower_projections_never_lm_head():
    report = abstract_apply("all-linear", rank=4, alpha=8)
    # 2 GDN layers x (5 + 3 MLP) + 2 attention layers x (4 + 3 MLP)
    assert len(report["modules"]) == 2 * 8 + 2 * 7
    assert set(report["by_name"]) == set(lora.ALL_LINEAR)
    assert report["by_name"]["gate_proj"] == 4 and report["by_name"]["in_proj_qkv"] == 2
    assert not any("lm_head" in m for m in report["modules"])
    # PEFT on the tiny container with the same shapes, docs/design/qwen35-architecture.md §6 (r=4): 17,984 trainable parameters
    assert report["trainable_params"] == 17984


@pytest.mark.parametrize("targets, expected", [
    (["q_proj", "v_proj"], {"q_proj": 2, "v_proj": 2}),
    ("q_proj,v_proj", {"q_proj": 2, "v_proj": 2}),
    ("self_attn.o_proj", {"o_proj": 2}),
    (r".*language_model.*\.(in_proj_qkv|out_proj)", {"in_proj_qkv": 2, "out_proj": 2}),  # a PEFT container regex
    (r"layers\.0\..*_proj", None),  # our own paths
])
def test_target_forms(targets, expected):
    report = abstract_apply(targets, rank=2, alpha=2)
    if expected is None:
        assert report["modules"] and all(m.startswith("layers.0.") for m in report["modules"])
        # fullmatch, as PEFT: in_proj_qkv etc. do not end in "_proj"
        assert set(report["by_name"]) == {"out_proj", "gate_proj", "up_proj", "down_proj"}
    else:
        assert report["by_name"] == expected


@pytest.mark.parametrize("targets, message", [
    (["q_proj", "q_prj"], "'q_prj' matches no module"),
    ("nothing_here_at_all", "matches no module"),
    (r"foo\.(bar)+", "matches no module path"),
    (["lm_head"], "lm_head cannot carry an adapter"),
    (r".*_head", "selects lm_head"),
    (7, "lora.targets must be"),
])
def test_bad_targets_fail_clearly(targets, message):
    with pytest.raises(lora.LoRAError, match=message):
        abstract_apply(targets, rank=2, alpha=2)


def test_shapes_scale_init_and_split(bf16_models):
    _, model = bf16_models
    q = model.layers[1].self_attn.q_proj
    assert q.lora.lora_A.shape == (4, 64) and q.lora.lora_B.shape == (128, 4)  # PEFT [r, in], [out, r]
    assert q.lora.scale == 2.0
    a = np.asarray(q.lora.lora_A[...])
    assert a.dtype == np.float32 and np.abs(a).max() <= 1 / math.sqrt(64) and np.abs(a).max() > 0.5 / math.sqrt(64)
    assert not np.asarray(q.lora.lora_B[...]).any()
    graphdef, trainable, frozen = lora.split_lora(model)
    names = ParamCodec(trainable).names
    assert len(names) == (8 + 7) * 2 and all(".lora.lora_" in n for n in names)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(trainable))
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(frozen))  # the base stays bf16, frozen
    assert lora.peft_key("layers.1.self_attn.q_proj.lora.lora_A") == \
        "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight"
    assert abstract_apply(["q_proj"], rank=4, alpha=16, use_rslora=True)["scale"] == 8.0  # 16/sqrt(4), as PEFT
    with pytest.raises(lora.LoRAError, match="already carries"):
        lora.apply_lora(model, ["q_proj"], rank=4, alpha=16)


# ------------------------------------------------------------------------------------------------ exactness


@pytest.fixture(scope="module")
def bf16_models():
    """(base, the same weights with all-linear LoRA r4/alpha8 attached): a bf16 2-layer tiny model."""
    from jaxrl.models.qwen35.init import init_model_jit
    base = init_model_jit(tiny2(), jnp.bfloat16, seed=0)
    model = nnx.clone(base)
    lora.apply_lora(model, "all-linear", rank=4, alpha=8, seed=3)
    return base, model


@pytest.mark.slow
def test_step0_equals_base_exactly_and_adapters_off_always(bf16_models):
    """bf16 base: with B = 0 the logits are bitwise the base's; with a trained (random) B the adapters change
    them, and adapters_disabled gives the base again, bitwise, inside jit."""
    base, model = bf16_models
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 250, size=(2, 12)), jnp.int32)
    mask = jnp.asarray(np.r_[[[0] * 3 + [1] * 9], [[1] * 12]], jnp.int32)

    g_base, s_base = nnx.split(base)
    g_model, s_lora, s_rest = nnx.split(model, lora.LoRAParam, ...)

    @functools.partial(jax.jit, compiler_options=QUICK)
    def logits(s_base, s_lora, s_rest):
        b = nnx.merge(g_base, s_base)(ids, attention_mask=mask)
        m = nnx.merge(g_model, s_lora, s_rest)
        on = m(ids, attention_mask=mask)
        with lora.adapters_disabled(m):
            off = m(ids, attention_mask=mask)
        return b, on, off

    base_logits, on0, off0 = jax.device_get(logits(s_base, s_lora, s_rest))
    assert on0.dtype == jnp.bfloat16
    np.testing.assert_array_equal(on0, base_logits)
    np.testing.assert_array_equal(off0, base_logits)

    rng = np.random.default_rng(1)
    trained = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.5, jnp.float32), s_lora)
    _, on1, off1 = jax.device_get(logits(s_base, trained, s_rest))
    assert np.abs(on1.astype(np.float32) - base_logits.astype(np.float32)).max() > 1e-2
    np.testing.assert_array_equal(off1, base_logits)

    # eagerly too: the context manager restores the adapters afterwards
    eager = nnx.merge(g_model, trained, s_rest)
    with lora.adapters_disabled(eager):
        assert all(not a.enabled for _, a in lora.iter_lora(eager))
    assert all(a.enabled for _, a in lora.iter_lora(eager))


def test_dropout_follows_peft_and_only_inside_the_context():
    adapter = lora.LoRA(6, 6, rank=6, alpha=6.0, dropout=0.5, key=jax.random.key(0))  # scale 1
    adapter.lora_A[...] = jnp.eye(6)
    adapter.lora_B[...] = jnp.eye(6)
    x = jnp.arange(1.0, 1.0 + 4 * 6).reshape(4, 6)
    np.testing.assert_allclose(np.asarray(adapter(x)), np.asarray(x))  # no context: deterministic, no dropout

    class Holder(nnx.Module):
        def __init__(self):
            self.a = adapter

    holder = Holder()
    with lora.lora_dropout(holder, jax.random.key(1)):
        y1 = np.asarray(adapter(x))
    with lora.lora_dropout(holder, jax.random.key(2)):
        y2 = np.asarray(adapter(x))
    xs = np.asarray(x)
    for y in (y1, y2):  # every input is either dropped or scaled by 1 / (1 - p)
        assert np.all(np.isclose(y, 0) | np.isclose(y, 2 * xs))
        assert 0.2 < np.mean(np.isclose(y, 0)) < 0.8
    assert not np.array_equal(y1, y2)
    assert not adapter.dropout_active


# ------------------------------------------------------------------------------------------------ PEFT parity


@pytest.fixture(scope="module")
def hf_two_layer(tmp_path_factory):
    return hf_tiny.build_text(str(tmp_path_factory.mktemp("hf2")), seed=4, num_hidden_layers=2)


@pytest.mark.slow
def test_forward_and_gradients_match_peft(hf_two_layer):
    """rsLoRA r=4 alpha=8 on all 12 projections, random A and B copied into PEFT: logits, next-token loss and
    every adapter gradient agree with peft 0.21 + torch. Every layer is rematerialised (remat="full", a model
    edit), so the recomputing backward is checked against torch too."""
    from peft import LoraConfig, get_peft_model

    folder, hf = hf_two_layer
    model = qwen35.from_pretrained(folder, dtype=jnp.float32, remat="full")
    lora.apply_lora(model, "all-linear", rank=4, alpha=8, use_rslora=True, seed=5)
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    rng = np.random.default_rng(2)
    params = {n: jnp.asarray(v) if n.endswith("lora_A") else jnp.asarray(rng.normal(size=v.shape) * 0.2, jnp.float32)
              for n, v in codec.to_flat(trainable).items()}

    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.0,
                                               target_modules=list(lora.ALL_LINEAR)))
    named = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, value in params.items():
            key = lora.peft_key(name, "base_model.model.model.").replace(".weight", ".default.weight")
            named[key].copy_(torch.from_numpy(np.array(value)))
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == sum(v.size for v in params.values())

    ids = np.random.default_rng(3).integers(2, 250, size=(2, 20))
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.ones((2, 20), jnp.int32)}
    objective = NextToken(chunk_size=16)
    micro_loss = make_micro_loss(objective, graphdef, codec)
    norms = objective.normalisers(batch)

    @functools.partial(jax.jit, compiler_options=QUICK)
    def run(params, frozen):
        (loss, _), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, frozen, batch, norms,
                                                                         jax.random.key(0))
        logits = nnx.merge(graphdef, codec.to_state(params), frozen)(batch["input_ids"])
        return loss, grads, logits

    loss, grads, logits = jax.device_get(run(params, frozen))

    out = peft_model(input_ids=torch.from_numpy(ids))
    ref_logits = out.logits.detach().numpy()
    ref_loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                                 torch.from_numpy(ids[:, 1:]).reshape(-1))
    ref_loss.backward()
    assert np.abs(logits - ref_logits).max() / np.abs(ref_logits).max() < 2e-5
    assert abs(float(loss) - ref_loss.item()) < 1e-5 * max(1.0, ref_loss.item())
    worst = 0.0
    for name, g in grads.items():
        key = lora.peft_key(name, "base_model.model.model.").replace(".weight", ".default.weight")
        ref = named[key].grad.numpy()
        assert np.abs(ref).max() > 0, name
        worst = max(worst, float(np.abs(g - ref).max() / np.abs(ref).max()))
    assert worst < 1e-4, worst  # observed 6e-6 (fp32; the logits agree to 3e-6)


"""Scanned layers (`scan_layers`, jaxrl/models/qwen35/model.py): the training forward as one `lax.scan` over the
repeats of the layer block gives the unrolled model's logits and LoRA gradients within fp32 rounding (dk != dv,
grouped heads, Qwen3.5's three-linear-one-full block, the remat policies inside the scanned body, LoRA dropout,
the sharded train step on a mesh); an irregular pattern runs the unrolled layers and says so once in the log;
prefill and decode stay unrolled. The default (`scan_layers=None`) scans a pass that rematerialises its layers
and unrolls one that keeps every activation (the tests of the scanned path force it with `scan_layers=True`).
The tiny train step's compile times scanned vs unrolled are printed (and, in the heavy tier, a 16-layer model's,
with XLA's memory analysis: what benchmarks/RESULTS.md records)."""

import dataclasses
import functools
import logging
import os
import time

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.algorithms.sft_task import synthetic_batch
from jaxrl.models import lora, qwen35
from jaxrl.models.qwen35 import model as model_module
from jaxrl.models.qwen35.config import default_layer_types, parse_hf_config, repeat_cycle
from jaxrl.parallel.mesh import make_mesh
from jaxrl.train.objective import NextToken
from jaxrl.train.state import ParamCodec, create_train_state
from jaxrl.train.step import (accumulate_gradients, jit_train_step, make_micro_loss, make_train_step, put_batch,
                              split_batch)

# A low LLVM optimisation level compiles quicker; the comparisons are against the same model unrolled.
QUICK = {"xla_backend_optimization_level": 0}
# fp32 rounding: the scanned and unrolled programs fuse differently, so they agree to a few ulps of the largest
# value, not bit for bit.
RTOL = 1e-5

CASES = {
    # 4 layers (linear, full) x 2; GDN value heads wider than its key heads (dk 16, dv 32); grouped heads in both
    # mixers: 8 query heads on 2 key/value heads, 4 GDN value heads on 1 key head.
    "dk_ne_dv_gqa": dict(linear_key_head_dim=16, linear_value_head_dim=32, num_attention_heads=8,
                         num_key_value_heads=2, linear_num_key_heads=1, linear_num_value_heads=4),
    # Qwen3.5's block (three Gated DeltaNet layers, one attention layer) twice.
    "qwen35_block": dict(num_hidden_layers=8, layer_types=default_layer_types(8, 4), linear_value_head_dim=32),
}


def build(cfg, scan, remat: str = "none", targets="all-linear", dropout: float = 0.0):
    model = qwen35.init_model(cfg, seed=3, remat=remat)
    model.set_compute(scan_layers=scan)
    lora.apply_lora(model, targets, rank=4, alpha=8, dropout=dropout, seed=5)
    return model


def batch(rows: int = 2, length: int = 12) -> dict:
    ids = np.random.default_rng(4).integers(2, 250, size=(rows, length))
    mask = np.ones((rows, length), np.int32)
    mask[0, :3] = 0  # a left-padded row
    mask[-1, -2:] = 0  # a right-padded row
    return {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(mask)}


def train_program(model, data: dict, n_micro: int = 1, compiler_options=QUICK):
    """(jitted program, params, frozen): `program(params, frozen) -> (loss, LoRA gradients, logits)`, the loss
    and gradients as the train step accumulates them over `n_micro` micro-batches (LoRA dropout on), and the
    teacher-forced logits of the first micro-batch. B is random too, so every factor has a non-zero gradient."""
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    rng = np.random.default_rng(2)
    params = {n: v if n.endswith("lora_A") else jnp.asarray(rng.normal(size=v.shape) * 0.2, jnp.float32)
              for n, v in codec.to_flat(trainable).items()}
    objective = NextToken(chunk_size=16)
    micro_loss = make_micro_loss(objective, graphdef, codec)
    micro = jax.tree.map(lambda x: x.reshape((n_micro, -1) + x.shape[1:]), data)

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def program(params, frozen):
        loss, grads, _ = accumulate_gradients(micro_loss, objective, params, frozen, micro, jax.random.key(0))
        first = jax.tree.map(lambda x: x[0], micro)
        logits = nnx.merge(graphdef, codec.to_state(params), frozen)(first["input_ids"], first["attention_mask"])
        return loss, grads, logits

    return program, params, frozen


@pytest.fixture
def scan_calls(monkeypatch):
    """The block length of every traced forward that took the scanned path."""
    calls = []
    real = model_module._scan_layers

    def spy(layers, cycle, *args):
        calls.append(cycle)
        return real(layers, cycle, *args)

    monkeypatch.setattr(model_module, "_scan_layers", spy)
    return calls


def assert_close(got, want, what, floor: float = 0.0):
    """max |got - want| within RTOL of max |want| (or of `floor`, when the values carry rounding of that size)."""
    got, want = np.asarray(got), np.asarray(want)
    assert np.abs(want).max() > 0, what
    scale = max(float(np.abs(want).max()), floor)
    err = np.abs(got - want).max() / scale
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def run_both(cfg, remat: str, dropout: float, scan_calls) -> dict:
    """{scan: (loss, grads, logits, compile seconds)} of the scanned and the unrolled model."""
    out = {}
    for scan in (True, False):
        model = build(cfg, scan, remat, dropout=dropout)
        cycle, why = model.layer_cycle()
        assert (cycle is not None) == scan, why
        program, params, frozen = train_program(model, batch())
        start = time.perf_counter()
        compiled = program.lower(params, frozen).compile()
        seconds = time.perf_counter() - start
        out[scan] = (*jax.device_get(compiled(params, frozen)), seconds)
    assert scan_calls and set(scan_calls) == {repeat(cfg.layer_types)}
    (loss_s, grads_s, logits_s, _), (loss_u, grads_u, logits_u, _) = out[True], out[False]
    assert_close(logits_s, logits_u, "logits")
    assert abs(float(loss_s) - float(loss_u)) <= RTOL * abs(float(loss_u))
    assert grads_s.keys() == grads_u.keys()
    for name in grads_u:
        assert_close(grads_s[name], grads_u[name], name)
    return out


def repeat(types) -> int:
    return repeat_cycle(types)


@pytest.mark.parametrize("remat,dropout", [pytest.param("matmuls", 0.1, marks=pytest.mark.heavy),
                                           pytest.param("none", 0.0, marks=pytest.mark.slow)])
def test_scanned_equals_unrolled(remat, dropout, scan_calls, capsys):
    """Logits, loss and every LoRA gradient of the scanned model agree with the unrolled one within fp32
    rounding: the remat policy's named saves inside the scanned body, no remat at all, LoRA dropout (each layer's
    own key). The jit's (trace, lower, compile) seconds are printed; no timed assertion."""
    out = run_both(qwen35.tiny(**CASES["dk_ne_dv_gqa"]), remat, dropout, scan_calls)
    with capsys.disabled():
        print(f"\n[scan_layers] tiny 4-layer train step (remat={remat}) jit: scanned {out[True][-1]:.2f} s, "
              f"unrolled {out[False][-1]:.2f} s")


@pytest.mark.slow
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_qwen35_block_scanned_equals_unrolled(scan_calls, capsys):
    """Qwen3.5's block of four (three Gated DeltaNet, one attention) scanned twice under remat="full" agrees with
    the 8 layers unrolled."""
    out = run_both(qwen35.tiny(**CASES["qwen35_block"]), "full", 0.0, scan_calls)
    assert scan_calls[0] == 4
    with capsys.disabled():
        print(f"\n[scan_layers] tiny 8-layer train step (remat=full) jit: scanned {out[True][-1]:.2f} s, "
              f"unrolled {out[False][-1]:.2f} s")


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices: XLA_FLAGS in conftest")
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_scanned_train_step_on_a_mesh():
    """The real jitted train step on a (2, 2, 2) mesh, weights laid out by the sharding rules: the scanned
    model's loss and summed gradients are the unrolled model's (the stack of sharded layer weights compiles and
    computes the same)."""
    mesh = make_mesh((2, 2, 2))
    data = synthetic_batch(0, batch_size=8, seq_len=16, vocab_size=256, seed=1)
    results = {}
    for scan in (True, False):
        model = build(qwen35.tiny(**CASES["dk_ne_dv_gqa"]), scan, "full")
        graphdef, trainable, frozen = lora.split_lora(model)
        codec = ParamCodec(trainable)
        rng = np.random.default_rng(0)
        params = {n: np.asarray(v) if n.endswith("lora_A") else (rng.normal(size=v.shape) * 0.3).astype(np.float32)
                  for n, v in codec.to_flat(trainable).items()}
        tx = optax.sgd(1.0)  # lr 1: params before - after = the summed gradient
        step_fn = make_train_step(NextToken(chunk_size=32), tx, lambda c: jnp.float32(1.0), graphdef, codec)
        state = create_train_state(params, tx, seed=0, mesh=mesh)
        split = put_batch(split_batch(data, 2), mesh)
        jitted = jit_train_step(step_fn, mesh, state, jax.device_get(frozen), split, compiler_options=QUICK)
        new_state, metrics = jitted(state, jax.device_get(frozen), split)
        new = jax.device_get(new_state.params)
        results[scan] = (float(metrics["loss"]), {n: params[n] - new[n] for n in params})
    (loss_s, grads_s), (loss_u, grads_u) = results[True], results[False]
    assert abs(loss_s - loss_u) <= RTOL * abs(loss_u)
    for name in grads_u:
        # a gradient read as params - updated params carries the parameters' rounding
        assert_close(grads_s[name], grads_u[name], name, floor=float(np.abs(params[name]).max()))


def test_repeat_cycle():
    linear, full = "linear_attention", "full_attention"
    assert repeat(default_layer_types(32, 4)) == 4  # the 4B and 9B
    assert repeat(default_layer_types(4, 2)) == 2  # the tiny preset
    assert repeat((linear,) * 3) == 1
    assert repeat(default_layer_types(6, 4)) is None  # linear x3, full, linear x2: not a whole number of blocks
    assert repeat((linear, full)) is None  # one block: nothing to scan
    assert repeat((linear, full, linear, linear, full, linear)) == 3


def test_irregular_patterns_fall_back(scan_calls, monkeypatch, caplog):
    """A pattern that does not repeat (6 layers of Qwen3.5's rule: three linear, one full, two linear) and LoRA
    on some layers only both trace the unrolled layers, the same program as scan_layers off (equal jaxprs),
    each said once in the log however often it is traced."""
    monkeypatch.setattr(model_module, "_FALLBACKS_LOGGED", set())
    caplog.set_level(logging.INFO, logger=model_module.__name__)
    data = batch()
    six = qwen35.tiny(num_hidden_layers=6, layer_types=default_layer_types(6, 4))
    partial_lora = r"layers\.[01]\..*_proj"  # layers 2 and 3 get no adapters: unlike layers 0 and 1
    for cfg, targets, reason in ((six, "all-linear", "does not repeat"),
                                 (qwen35.tiny(), partial_lora, "layer 2 is built unlike layer 0")):
        jaxprs = []
        for scan in (True, False):
            model = nnx.eval_shape(functools.partial(build, cfg, scan, targets=targets))  # shapes: all a trace needs
            cycle, why = model.layer_cycle()
            assert cycle is None and (reason in why if scan else why == "scan_layers is off")
            graphdef, state = nnx.split(model)

            def forward(state, ids, mask, graphdef=graphdef):
                return nnx.merge(graphdef, state)(ids, mask)

            jaxprs.append(str(jax.make_jaxpr(forward)(state, data["input_ids"], data["attention_mask"])))
            if scan:  # a second trace, another shape: not logged again
                jax.make_jaxpr(forward)(state, data["input_ids"][:1], data["attention_mask"][:1])
        assert jaxprs[0] == jaxprs[1]
        said = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
        assert len(said) == 1 and "unrolled" in said[0], said
    assert scan_calls == []


def test_prefill_and_decode_stay_unrolled(scan_calls):
    """With scanning on, the training pass scans; a prefill and a cached step trace the unrolled loop."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: qwen35.init_model(qwen35.tiny(scan_layers=True), seed=1)))
    ids = batch()["input_ids"][:, :8]

    def hidden(state, ids, **kw):
        return nnx.merge(graphdef, state).hidden_states(ids, **kw)

    jax.eval_shape(hidden, state, ids)
    assert scan_calls == [2]
    _, cache = jax.eval_shape(functools.partial(hidden, cache_length=8), state, ids[:, :7])
    jax.eval_shape(lambda state, cache: hidden(state, ids[:, 7:], cache=cache), state, cache)
    per_row = jax.eval_shape(lambda state: nnx.merge(graphdef, state).init_cache(2, 8, per_row=True), state)
    jax.eval_shape(lambda state, cache: hidden(state, ids[:, 7:], cache=cache), state, per_row)
    assert scan_calls == [2]


@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_default_scans_the_passes_that_rematerialise(monkeypatch):
    """`scan_layers=None` (the default) decides from the config and the pass's remat policy (no weight allocated):
    the train-step benchmark's model (benchmarks.common.SMALL_TEXT_CONFIG, loaded with remat "none") and the tiny
    preset run unrolled without remat and scan with it; the 4B and 9B train steps of the AOT benchmark at the
    users' shapes (remat "auto" against an H200's allocator limit: "matmuls" or "attention") scan in blocks of
    four, the programs they compiled before the default changed; True and False force it whatever the policy."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # aot_real_shapes edits it on import
    from benchmarks import aot_real_shapes
    from benchmarks.common import SMALL_TEXT_CONFIG

    bench = parse_hf_config(dict(SMALL_TEXT_CONFIG, model_type="qwen3_5_text"))[0]
    for cfg in (bench, qwen35.tiny()):
        assert cfg.scan_layers is None and repeat(cfg.layer_types) == 2
        cycle, why = cfg.scan_decision("none")
        assert cycle is None and "remat policy none" in why, why
        for policy in ("matmuls", "attention", "full", "dots", None):  # None: not yet resolved
            assert cfg.scan_decision(policy) == (2, "")
        assert dataclasses.replace(cfg, scan_layers=True).scan_decision("none") == (2, "")
        assert dataclasses.replace(cfg, scan_layers=False).scan_decision("full") == (None, "scan_layers is off")
    chosen = {}
    with aot_real_shapes.H200(0.75 * 139 * 2**30):
        for name, spec in aot_real_shapes.PROGRAMS.items():
            if spec["kind"] == "decode" or spec["kind"] in aot_real_shapes.PASSES:  # no backward, no remat choice
                continue
            cfg = aot_real_shapes.model_config(spec["model"], "real", None)
            assert cfg.scan_layers is None and cfg.num_hidden_layers == 32
            model = aot_real_shapes.abstract_model(cfg, "auto")  # shapes only: nothing allocated
            rows, seq_len = ((2 * spec["micro_batch"], spec["seq_len"]) if spec["kind"] == "dpo"
                             else (spec["micro_batch"], spec["prompt_len"] + spec["new_tokens"]))
            # the AOT programs run on one device; `remat_policy` splits the rows over this process's devices
            chosen[name] = model.remat_policy(rows * jax.device_count(), seq_len)
            assert cfg.scan_decision(chosen[name]) == (4, "") and model.layer_cycle(chosen[name]) == (4, "")
            assert dataclasses.replace(cfg, scan_layers=False).scan_decision(chosen[name])[0] is None
    assert chosen == {"dpo_4b": "matmuls", "dpo_9b_mb1": "attention", "dpo_9b_mb2": "attention",
                      "grpo_4b": "attention", "distill_4b": "attention"}


def test_default_rule_traces_the_unrolled_layers_and_says_why(scan_calls, monkeypatch, caplog):
    """The tiny preset under the default: without remat its training forward is the same program as with
    scan_layers=False (equal jaxprs), and the log says why once; with remat "full" it takes the scanned path,
    as it does without remat when scan_layers=True."""
    monkeypatch.setattr(model_module, "_FALLBACKS_LOGGED", set())
    caplog.set_level(logging.INFO, logger=model_module.__name__)
    data = batch()
    jaxprs = {}
    for scan, remat in ((None, "none"), (False, "none"), (True, "none"), (None, "full")):
        model = nnx.eval_shape(functools.partial(build, qwen35.tiny(), scan, remat))
        graphdef, state = nnx.split(model)

        def forward(state, ids, mask, graphdef=graphdef):
            return nnx.merge(graphdef, state)(ids, mask)

        jaxprs[scan, remat] = str(jax.make_jaxpr(forward)(state, data["input_ids"], data["attention_mask"]))
    assert jaxprs[None, "none"] == jaxprs[False, "none"] != jaxprs[True, "none"]
    assert scan_calls == [2, 2]  # (True, "none") and (None, "full")
    said = [r.getMessage() for r in caplog.records if "scan_layers" in r.getMessage()]
    assert len(said) == 1 and "remat policy none" in said[0] and "unrolled" in said[0], said


def measure_compile(num_layers: int) -> list[str]:
    """Per scan setting: the jit seconds (trace + lower, compile; wall and CPU) of a train step over 2
    micro-batches of 2 x 64 under remat="full", and XLA's memory analysis, on `num_layers` layers of Qwen3.5's
    block with small widths."""
    cfg = qwen35.tiny(num_hidden_layers=num_layers, layer_types=default_layer_types(num_layers, 4),
                      hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                      linear_value_head_dim=32)
    data = batch(rows=4, length=64)
    lines = []
    for scan in (True, False):
        model = build(cfg, scan, "full")
        layer_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param)))
        program, params, frozen = train_program(model, data, n_micro=2, compiler_options=None)
        start, cpu_start = time.perf_counter(), time.process_time()
        lowered = program.lower(params, frozen)
        traced, cpu_traced = time.perf_counter() - start, time.process_time() - cpu_start
        compiled = lowered.compile()
        total, cpu_total = time.perf_counter() - start, time.process_time() - cpu_start
        mem = compiled.memory_analysis()
        # CPU seconds too: on a shared machine the wall clock measures the neighbours as well.
        lines.append(f"{num_layers} layers {'scanned ' if scan else 'unrolled'}: jit {total:.1f} s wall, "
                     f"{cpu_total:.1f} s CPU (trace+lower {traced:.1f} / {cpu_traced:.1f}, compile "
                     f"{total - traced:.1f} / {cpu_total - cpu_traced:.1f}); temporaries "
                     f"{mem.temp_size_in_bytes / 2**20:.2f} MiB, arguments {mem.argument_size_in_bytes / 2**20:.2f} "
                     f"MiB, layer weights {layer_bytes / 2**20:.2f} MiB")
    return lines


@pytest.mark.heavy
def test_compile_time_deeper(capsys):
    """16 layers with small widths (Qwen3.5's block x 4), scanned vs unrolled, printed for benchmarks/RESULTS.md
    (`measure_compile`). The XLA flags are the environment's: run it without
    `--xla_backend_optimization_level=0` for the numbers there."""
    lines = measure_compile(16)
    with capsys.disabled():
        print("\n[scan_layers] train step, 2 micro-batches of 2 x 64, remat=full:\n  " + "\n  ".join(lines))

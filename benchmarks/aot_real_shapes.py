r"""Compile time and XLA's memory estimate of the real programs at the users' shapes, ahead of time, from abstract
shapes only (no weight is allocated); one JSON object per program on stdout (and appended to --out).

    python -m benchmarks.aot_real_shapes --shape=tiny                      # every program, tiny model: seconds
    python -m benchmarks.aot_real_shapes --programs=dpo_4b --scan_layers=off --out=bench_out/aot.jsonl
    python -m benchmarks.aot_real_shapes --programs=dpo_9b_mb2 --scan_layers=both --llvm_opt=0

Programs (bf16 base weights, LoRA r16 / alpha 32 on all 12 projections, fp32 adapters and AdamW state, one device):

  dpo_4b       the DPO train step (`jaxrl.train.step` with `DPOObjective`, sigmoid, beta 0.1), Qwen3.5-4B,
               T=4096, micro-batch 1 pair x grad_accum 8 (the users' global batch of 8 pairs)
  dpo_9b_mb1   the same at 9B, T=6144, micro-batch 1 x 8
  dpo_9b_mb2   9B, T=6144, micro-batch 2 x 4
  grpo_4b      the GRPO train step (`GRPOObjective`, GRPOConfig's defaults: k3 KL to the reference log-probs in
               the batch, sequence_mean), 4B, 20 prompts x 8 samples = 160 rows of 2,048 prompt + 4,096
               completion tokens, micro-batch 4 rows x grad_accum 40 (configs/grpo.py's default split)
  decode_4b    the generation engine's decode round (`jaxrl.generation.programs.decode_round`: a while loop of
               decode steps) over 160 slots, 4B, cache 2,048 + 4,096 slots, LoRA fused, plain sampling
  distill_4b   the on-policy distillation train step (`DistillObjective`, DistillConfig's defaults: reverse_kl,
               teacher_top_k 16: the student's log-probs on the teacher's top-16 support inside the step), 4B, the
               GRPO step's rows (20 x 8 = 160 of 2,048 + 4,096 tokens, micro-batch 4 x 40); the object adds the
               9B teacher's resident bf16 weights (`teacher_resident_gib`, the in-process teacher) to its peak
  teacher_9b   the in-process teacher's pass (`jaxrl.backends.jax_teacher.teacher_pass`: a frozen bf16 9B
               without LoRA, top-16 support of every completion token), logprob_batch_size 8 rows of 2,048 + 4,096
               tokens a call; the object adds the 4B student's resident state (bf16 weights, fp32 adapters and
               AdamW moments) to its peak
  reference_4b GRPO's reference pass (`jaxrl.algorithms.online.passes._pass`, the policy with its adapters off),
               8 rows of 2,048 + 4,096 tokens a call: what the teacher pass replaces

`--layouts=padded,packed,shared_prefix` compiles `grpo_4b` and `reference_4b` in each online layout
(jaxrl/algorithms/online/layout.py) for a draw of the users' lengths (`users_draw`, `--seed`): 20 prompts x 8
samples, each prompt's length uniform on [P/2, P] (1,024-2,048 tokens) and shared by its 8 samples, 45% of the
completions (72 of 160, drawn at random) at the cap C (4,096: their evaluations hit it 43-49% of the time) and the
others uniform on [C/16, C) (256-4,095). `padded`: the rollout's [N, P + C] rows (the programs above, unchanged);
`packed`: the rows packed end to end with `segment_ids` at the shape `OnlineLayout.plan` picks for the draw (the
train step per micro-batch of 4 rows, the pass per call of 8); `shared_prefix`: the padded rows with each group's
prompt computed once and its completions continuing the prompt's caches (jaxrl/algorithms/online/shared_prefix.py;
`prefix_rows` [N, n] in the batch, n found in the rows: 4 per micro-batch, 8 per call). Each object's `layout`
says what the plan chose (packed: rows per group and their length, the rows each group needs; shared_prefix: n),
the row and padding tokens against the padded layout's, and what `layout="auto"` would decide, with its reason.

`--scan_layers=both` compiles each train step with the layers scanned (`Qwen35Config.scan_layers`: one
compiled block of three Gated DeltaNet layers and one attention layer) and unrolled; decode is never scanned.
`--num_layers=N` compiles the programs at the model's widths with N layers of its block (what scanning saves at
a given depth); each train step's object says what `scan_layers`' default (None) would choose for it, with the
remat policy it runs (`default_scan_decision`).

What each object holds:
  compile_s, lower_s    seconds to lower (trace + StableHLO) and to compile on this machine's CPU (`llvm_opt`:
                        XLA:CPU's LLVM level; buffer assignment, and so the memory figures, do not depend on it);
                        *_cpu_s the CPU seconds of this process meanwhile (what a loaded machine does not inflate)
  memory                `compiled.memory_analysis()`: arguments, outputs, aliased (donated) bytes, temporaries,
                        generated code, XLA's own peak, and `peak_gib` = arguments + outputs - aliases +
                        temporaries (or XLA's peak when larger: on the CPU it reports less than that sum)
  fit                   that peak against the H200 (`--device_memory_gib`, 139 GiB usable of its 141 GB) and
                        against the allocator's default limit (`--mem_fraction` 0.75 of it: JAX preallocates 75%
                        unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise), with the margins
  remat                 what `remat="auto"` resolved to for the H200 (`Qwen35.remat_policy` with the allocator
                        limit above and cuDNN attention, as the GPU run decides), the activation budget,
                        `activation_bytes` of each policy, and `kept_activations`: the residuals the backward of
                        one micro-batch keeps (from the jaxpr, before any compiler: the same on every backend)
  flops                 `compiled.cost_analysis()` FLOPs against the MFU formula of benchmarks/gpu_train_step.py
                        (`model_flops`). XLA counts the body of a while loop once: one micro-batch of the
                        accumulation scan, and with scanned layers one block of layers, so the comparison is
                        per micro-batch and only meaningful unrolled; the counted FLOPs include remat's
                        recomputation, which the MFU formula does not
  host_peak_rss_gib     this process's peak resident memory so far (compiling is what takes it)
  largest_temporaries   with --dump_dir: the program's memory by shape (XLA's memory-usage-report dump: each
                        buffer region attributed to the shape that uses it most), to tell the CPU's own
                        temporaries (fp32 copies of bf16 activations, XLA attention blocks) from what the GPU
                        program would hold too

The compiled programs are the CPU's. Two differences from the GPU program matter: attention runs as XLA's
blocked softmax (the GPU's is cuDNN's fused kernel, without any T x T block in memory), and XLA:GPU fuses and
schedules differently. The memory figures are therefore an estimate of the GPU's, not its measurement
(benchmarks/gpu_all.py measures it where a GPU is lent).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import sys
import time
from typing import Optional

import numpy as np

# One CPU device: the train steps' meshes are (1, 1, 1), and `remat="auto"` divides tokens by the device count. The
# test suite's 8 fake devices (XLA_FLAGS) would change both; drop them before jax starts.
os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                 os.environ.get("XLA_FLAGS", "")).strip()

GIB = 2**30
LORA_RANK, LORA_ALPHA = 16, 32.0
PROGRAMS = {
    "dpo_4b": dict(kind="dpo", model="4b", seq_len=4096, micro_batch=1, grad_accum=8),
    "dpo_9b_mb1": dict(kind="dpo", model="9b", seq_len=6144, micro_batch=1, grad_accum=8),
    "dpo_9b_mb2": dict(kind="dpo", model="9b", seq_len=6144, micro_batch=2, grad_accum=4),
    "grpo_4b": dict(kind="grpo", model="4b", prompt_len=2048, new_tokens=4096, rows=160, micro_batch=4),
    "decode_4b": dict(kind="decode", model="4b", slots=160, prompt_len=2048, new_tokens=4096),
    "distill_4b": dict(kind="distill", model="4b", prompt_len=2048, new_tokens=4096, rows=160, micro_batch=4,
                       top_k=16),
    "teacher_9b": dict(kind="teacher", model="9b", prompt_len=2048, new_tokens=4096, rows=8, top_k=16),
    "reference_4b": dict(kind="reference", model="4b", prompt_len=2048, new_tokens=4096, rows=8),
}
PASSES = ("teacher", "reference")  # forward-only programs (no backward, no remat choice)
# --shape=tiny: the same programs at the tiny model (4 layers: linear, full, linear, full) and short sequences.
TINY = {
    "dpo_4b": dict(seq_len=64),
    "dpo_9b_mb1": dict(seq_len=96),
    "dpo_9b_mb2": dict(seq_len=96),
    "grpo_4b": dict(prompt_len=16, new_tokens=32, rows=16),
    "decode_4b": dict(slots=8, prompt_len=16, new_tokens=32),
    "distill_4b": dict(prompt_len=16, new_tokens=32, rows=16),
    "teacher_9b": dict(prompt_len=16, new_tokens=32, rows=4),
    "reference_4b": dict(prompt_len=16, new_tokens=32, rows=4),
}


LAYOUT_KINDS = ("grpo", "reference")  # the programs compiled in the online layouts (--layouts)
ONLINE_LAYOUTS = ("padded", "packed", "shared_prefix")
CAP_SHARE = 0.45  # the users' completions at the cap (43-49% of their evaluations)


def users_draw(spec: dict, seed: int = 0, cap_share: float = CAP_SHARE) -> tuple[np.ndarray, np.ndarray, dict]:
    """(attention mask [N, P + C] in the rollout's layout, input ids, a description) of the users' lengths (module
    docstring): groups of 8 rows sharing a prompt of uniform length on [P/2, P]; round(cap_share x N) completions,
    drawn at random, at C, the others uniform on [C/16, C). N: the train step's rows (`rows`) or, for a pass, 160
    (the step's rollout). The ids: each group's prompt one token, each row's completion another (what tells the
    shared_prefix layout which rows share a prompt)."""
    P, C = spec["prompt_len"], spec["new_tokens"]
    n = spec["rows"] if spec["kind"] != "reference" else spec.get("rollout_rows", 160)
    k = 8  # samples per prompt
    rng = np.random.default_rng(seed)
    prompts = np.repeat(rng.integers(P // 2, P + 1, -(-n // k)), k)[:n]
    at_cap = np.zeros(n, bool)
    at_cap[rng.permutation(n)[:int(round(cap_share * n))]] = True
    completions = np.where(at_cap, C, rng.integers(max(1, C // 16), C, n))
    columns = np.arange(P + C)
    attn = ((columns >= (P - prompts)[:, None]) & (columns < (P + completions)[:, None])).astype(np.int32)
    token = np.where(columns[None, :] < P, 1 + np.arange(n)[:, None] // k, 1000 + np.arange(n)[:, None])
    ids = (attn * token).astype(np.int32)
    about = {"seed": seed, "rows": int(n), "samples_per_prompt": k,
             "prompt_len": f"uniform [{P // 2}, {P}] per prompt",
             "completion_len": (f"{C} for {int(at_cap.sum())} of {n} rows at random, else uniform "
                                f"[{max(1, C // 16)}, {C - 1}]"),
             "at_cap": round(float(at_cap.mean()), 4), "mean_prompt": round(float(prompts.mean()), 1),
             "mean_completion": round(float(completions.mean()), 1),
             "real_over_padded_tokens": round(float(attn.sum() / attn.size), 4)}
    return attn, ids, about


def layout_plan(spec: dict, layout: str, seed: int = 0):
    """(plan or None, report) of `layout` for the users' draw: the group is the train step's micro-batch or the
    pass's rows per call, as GRPOTask.batch and RolloutPasses apply it."""
    from jaxrl.algorithms.online.layout import OnlineLayout
    from jaxrl.data import packing
    attn, ids, about = users_draw(spec, seed)
    C, total = spec["new_tokens"], attn.shape[1]
    group = spec["micro_batch"] if spec["kind"] == "grpo" else spec["rows"]
    auto = OnlineLayout("auto", width=C, name="grpo").plan(attn, group, ids)
    auto_kind = "packed" if auto.packed else "shared_prefix" if auto.shared else "padded"
    report = {"layout": layout, "draw": about, "group": group,
              "auto": {"chosen": auto_kind, "reason": auto.reason}, "padded_row_tokens": float(attn.size),
              "padding_tokens_padded": float(attn.size - attn.sum())}
    if layout == "padded":
        return None, report
    plan = OnlineLayout(layout, width=C, name="grpo").plan(attn, group, ids)
    if layout == "shared_prefix":
        report.update({"prefix_group": plan.shared, "reason": plan.reason,
                       **{k: plan.counters[k] for k in ("row_tokens", "padding_tokens", "prompt_tokens")},
                       "share_of_padded": round(plan.counters["row_tokens"] / attn.size, 4)})
        if not plan.shared:
            raise ValueError(f"shared_prefix fell back to padded: {plan.reason}")
        return plan, report
    lengths = attn.sum(1)
    need = [next(r for r in range(1, group + 1)  # the fewest rows of L each group fits in
                 if packing.first_fit(lengths[g:g + group].tolist(), r, plan.row_len))
            for g in range(0, len(lengths), group)]
    report.update({"rows_per_group": plan.rows, "row_len": plan.row_len, "row_tokens": plan.counters["row_tokens"],
                   "padding_tokens": plan.counters["padding_tokens"],
                   "share_of_padded": round(plan.counters["row_tokens"] / attn.size, 4),
                   "groups_by_rows_needed": {str(r): need.count(r) for r in sorted(set(need))}})
    return plan, report


def model_config(name: str, shape: str, scan: Optional[bool], num_layers: Optional[int] = None):
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import default_layer_types
    cfg = qwen35.tiny() if shape == "tiny" else {"4b": qwen35.qwen35_4b, "9b": qwen35.qwen35_9b}[name]()
    if num_layers is not None:  # the same widths and layer block, another depth
        interval = next(i + 1 for i, t in enumerate(cfg.layer_types) if t == "full_attention")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers,
                                  layer_types=default_layer_types(num_layers, interval))
    if scan is not None:
        cfg = dataclasses.replace(cfg, scan_layers=scan)
    return cfg


def scan_available() -> bool:
    """Whether the model has the `scan_layers` setting (scanned layer cycles)."""
    from jaxrl.models.qwen35.config import Qwen35Config
    return any(f.name == "scan_layers" for f in dataclasses.fields(Qwen35Config))


class H200:
    """The model's memory-dependent choices made as on the GPU: `remat="auto"` and the decode weight copies read
    `_device_memory_bytes()` (here the allocator's limit on the H200, not this host's RAM), and the activation
    estimate assumes the cuDNN attention that `resolve_implementation` picks there for bf16 and head dim 256
    (the XLA attention's T x T blocks would be counted otherwise). Only the model module's names are replaced,
    so the program still compiles the CPU's attention."""

    def __init__(self, limit_bytes: float):
        self.limit = float(limit_bytes)

    def __enter__(self):
        import jax.numpy as jnp

        from jaxrl.models.qwen35 import model as model_module
        self.module = model_module
        self.saved = (model_module._device_memory_bytes, model_module.resolve_implementation)
        real = self.saved[1]

        def resolve(implementation, dtype, head_dim, masked=False):
            if (implementation == "auto" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
                    and head_dim <= 256 and head_dim % 8 == 0):
                return "cudnn"
            return real(implementation, dtype, head_dim, masked)

        model_module._device_memory_bytes = lambda: self.limit
        model_module.resolve_implementation = resolve
        return self

    def __exit__(self, *exc):
        self.module._device_memory_bytes, self.module.resolve_implementation = self.saved


def abstract_model(cfg, remat: str, adapters: bool = True):
    """The bf16 model with LoRA r16 on every projection (`adapters`; without: a frozen teacher), as shapes only
    (nnx.eval_shape: nothing allocated)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models import lora, qwen35

    def build():
        model = qwen35.Qwen35(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), remat=remat)
        if adapters:
            lora.apply_lora(model, "all-linear", rank=LORA_RANK, alpha=LORA_ALPHA)
        return model

    return nnx.eval_shape(build)


def resident_gib(cfg, trainable: bool) -> float:
    """What a model holds between its programs: bf16 weights, and with `trainable` the fp32 LoRA r16 adapters and
    their two AdamW moments (a student's train state); without, a frozen teacher's weights."""
    import jax
    from flax import nnx

    from jaxrl.models import lora
    model = abstract_model(cfg, "none", adapters=trainable)
    frozen = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not trainable:
        return frozen / GIB
    _, adapters, _ = lora.split_lora(model)
    n = sum(x.size for x in jax.tree.leaves(adapters))
    frozen -= sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters))
    return (frozen + 3 * 4 * n) / GIB  # fp32 adapters, mu and nu


def pass_program(spec: dict, cfg, plan=None):
    """(jitted pass, positional args, static kwargs, abstract model) of a forward-only pass: the in-process
    teacher's (`teacher`) or GRPO's reference (`reference`), `rows` rows of P + C tokens a call, as
    `jaxrl.parallel.batched_forward` calls them (chunk_size = TrainConfig.logprob_chunk_size's default 512)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.algorithms.online import passes
    from jaxrl.backends import jax_teacher
    T, C = spec["prompt_len"] + spec["new_tokens"], spec["new_tokens"]
    ids = jax.ShapeDtypeStruct((spec["rows"], T), jnp.int32)
    shared = getattr(plan, "shared", 0)
    if shared:  # padded rows, each group of `shared` rows one prompt (jaxrl/algorithms/online/shared_prefix.py)
        batch = {"input_ids": ids, "attention_mask": ids,
                 "prefix_rows": jax.ShapeDtypeStruct((spec["rows"], shared), jnp.int8)}
    elif plan is not None:  # packed rows of one call (layout.py): R x L stored as rows x R L / rows
        storage = jax.ShapeDtypeStruct((spec["rows"], plan.rows * plan.row_len // spec["rows"]), jnp.int32)
        batch = {"input_ids": storage, "attention_mask": storage, "segment_ids": storage,
                 "completion_index": jax.ShapeDtypeStruct((spec["rows"], C), jnp.int32),
                 "packed_rows": jax.ShapeDtypeStruct((spec["rows"], plan.rows), jnp.int8)}
    if spec["kind"] == "teacher":
        model = abstract_model(cfg, "none", adapters=False)
        fn = jax.jit(jax_teacher.teacher_pass, static_argnames=("graphdef", "max_new_tokens", "k", "temperature",
                                                                "chunk_size"))
        static = dict(max_new_tokens=C, k=spec["top_k"], temperature=1.0, chunk_size=512)
    else:
        model = abstract_model(cfg, "none")
        fn = jax.jit(passes._pass, static_argnames=("graphdef", "max_new_tokens", "adapters", "temperature",
                                                    "chunk_size", "values"))
        static = dict(max_new_tokens=C, adapters=False, temperature=1.0, chunk_size=512, values=False)
    graphdef, state = nnx.split(model)
    if spec["kind"] == "teacher":
        return fn, (graphdef, state, ids, ids), static, model
    if plan is not None:
        return fn, (graphdef, state, batch), static, model
    return fn, (graphdef, state, {"input_ids": ids, "attention_mask": ids}), static, model


def pass_flops_per_token(cfg, seq_len: int) -> float:
    """The MFU formula's forward of one token in a row of `seq_len` (benchmarks/gpu_train_step.py `model_flops`:
    one linear pass and one pass of the attention cores, what `formula_flops` takes off for a reference forward;
    no LoRA: the reference pass runs with its adapters off, the teacher has none)."""
    from benchmarks.gpu_train_step import model_flops
    f = model_flops(cfg, 0, 1, seq_len)
    return f["share_linear"] * f["per_token"] / 3 + f["share_attention_cores"] * f["per_token"] / 4


def distill_shares(shape: str, seq_len: int, scan: Optional[bool]) -> dict:
    """Per row of P + C tokens, the MFU formula's FLOPs of the train step (policy forward and backward, no
    reference: `formula_flops`, the same for GRPO's step and distillation's), of GRPO's reference pass (4B) and of
    the teacher pass (9B), and each pass's share of its step (pass / (pass + train step); sampling is not
    counted)."""
    step = formula_flops(model_config("4b", shape, scan), "grpo", 1, seq_len, "batch")["per_token"] * seq_len
    reference = pass_flops_per_token(model_config("4b", shape, scan), seq_len) * seq_len
    teacher = pass_flops_per_token(model_config("9b", shape, scan), seq_len) * seq_len
    return {"train_step_per_row": step, "reference_pass_per_row": reference, "teacher_pass_per_row": teacher,
            "teacher_over_reference": round(teacher / reference, 3),
            "reference_share_of_grpo": round(reference / (reference + step), 3),
            "teacher_share_of_distill": round(teacher / (teacher + step), 3)}


def remat_report(model, rows: int, seq_len: int, limit: float) -> dict:
    """What `remat="auto"` resolves to for a training pass over [rows, seq_len] (inside `H200`), the budget, and
    each policy's activation estimate (GiB)."""
    import jax.numpy as jnp

    from jaxrl.models.qwen35 import model as model_module
    chosen = model.remat_policy(rows, seq_len)
    tokens = rows * seq_len
    estimate = {p: round(model_module.activation_bytes(model.config, p, tokens, seq_len, 2) / GIB, 2)
                for p in ("none", "matmuls", "attention", "full")}
    budget = model.activation_budget(limit)
    return {"setting": model.remat, "chosen": chosen, "budget_gib": round(budget / GIB, 2),
            "activation_estimate_gib": estimate, "weights_gib": round(model.weight_bytes() / GIB, 2),
            "dtype_bytes": jnp.dtype(model.dtype).itemsize}


def kept_activations(micro_loss, params, frozen, micro_batch, normalisers, rng) -> dict:
    """What the backward of one micro-batch keeps from its forward, before any compiler sees it: the residuals
    of `jax.vjp` of the micro-batch loss in the LoRA parameters (the jaxpr's residual outputs that are not its
    inputs: the weights are counted once, as arguments), in GiB, with the five largest shapes. The same on every
    backend; the compiled program's temporaries add the working set of the layer being recomputed."""
    import collections

    import jax
    from jax.extend import core

    def vjp_of(params, frozen, micro_batch, normalisers, rng):
        return jax.vjp(lambda p: micro_loss(p, frozen, micro_batch, normalisers, rng)[0], params)[1]

    jaxpr = jax.make_jaxpr(vjp_of)(params, frozen, micro_batch, normalisers, rng).jaxpr
    inputs = set(jaxpr.invars)
    seen, by_shape = set(), collections.Counter()
    for v in jaxpr.outvars:
        if isinstance(v, core.Literal) or v in inputs or v in seen:
            continue
        seen.add(v)
        by_shape[f"{v.aval.dtype}{list(v.aval.shape)}"] += v.aval.size * v.aval.dtype.itemsize
    return {"gib": round(sum(by_shape.values()) / GIB, 2),
            "largest": [[round(b / GIB, 2), shape] for shape, b in by_shape.most_common(5)]}


def train_step_program(spec: dict, cfg, remat: str, dpo_reference: str, limit: float, plan=None):
    """(jitted step, abstract args, remat report, rows per micro-batch, tokens per row, abstract model, a function
    of no arguments giving `kept_activations`) of a DPO or GRPO step."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxrl.algorithms.distill_task import DistillObjective
    from jaxrl.algorithms.dpo_task import DPOObjective
    from jaxrl.algorithms.grpo_task import GRPOObjective
    from jaxrl.models import lora
    from jaxrl.parallel.mesh import make_mesh
    from jaxrl.train.optim import make_optimizer
    from jaxrl.train.state import ParamCodec, init_train_state
    from jaxrl.train.step import jit_train_step, make_micro_loss, make_train_step, merge_micro
    from jaxrl.algorithms.distill_config import DistillConfig
    from jaxrl.algorithms.grpo_config import GRPOConfig
    from jaxrl.train.settings import OptimizerConfig

    model = abstract_model(cfg, remat)
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    params = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32) for k, v in codec.to_flat(trainable).items()}
    tx, schedule = make_optimizer(OptimizerConfig(), total_steps=125)
    state = jax.eval_shape(lambda p: init_train_state(p, tx, 0, False), params)
    sds = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    if spec["kind"] == "dpo":
        objective = DPOObjective(loss_types=("sigmoid",), beta=0.1, reference=dpo_reference)
        n_micro, mb, T = spec["grad_accum"], spec["micro_batch"], spec["seq_len"]
        batch = {f"{side}_{key}": sds((n_micro, mb, T), i32) for side in ("chosen", "rejected")
                 for key in ("input_ids", "attention_mask", "loss_mask")}
        if dpo_reference == "batch":
            batch.update({f"ref_{side}_logps": sds((n_micro, mb), f32) for side in ("chosen", "rejected")})
        rows = 2 * mb  # one forward over the chosen and rejected rows
    elif spec["kind"] == "distill":
        d = DistillConfig()
        P, C, mb, k = spec["prompt_len"], spec["new_tokens"], spec["micro_batch"], spec["top_k"]
        n_micro, T = spec["rows"] // mb, P + C
        objective = DistillObjective(loss_name=d.loss, jsd_beta=d.jsd_beta, temperature=d.temperature,
                                     reward_weight=d.reward_weight, chunk_size=512)
        # the teacher's scores ride in the batch (DistillTask.train_keys)
        batch = {"input_ids": sds((n_micro, mb, T), i32), "attention_mask": sds((n_micro, mb, T), i32),
                 "completion_mask": sds((n_micro, mb, C), f32), "teacher_logp": sds((n_micro, mb, C), f32),
                 "teacher_rest_logp": sds((n_micro, mb, C), f32), "teacher_top_logp": sds((n_micro, mb, C, k), f32),
                 "teacher_top_ids": sds((n_micro, mb, C, k), i32)}
        rows = mb
    else:
        grpo = GRPOConfig()
        P, C, mb = spec["prompt_len"], spec["new_tokens"], spec["micro_batch"]
        n_micro, T = spec["rows"] // mb, P + C
        objective = GRPOObjective(max_new_tokens=C, aggregation=grpo.aggregation, beta=grpo.beta,
                                  kl_estimator=grpo.kl_estimator, epsilon_low=grpo.epsilon_low,
                                  epsilon_high=grpo.epsilon_high, importance_sampling_level=grpo.importance_sampling_level,
                                  temperature=grpo.temperature, entropy=grpo.log_entropy, entropy_coef=grpo.entropy_coef)
        # on-policy (one update per rollout): no old_logp; beta != 0: the reference log-probs ride in the batch
        batch = {"input_ids": sds((n_micro, mb, T), i32), "attention_mask": sds((n_micro, mb, T), i32),
                 "completion_mask": sds((n_micro, mb, C), f32), "advantages": sds((n_micro, mb), f32),
                 "sequence_mask": sds((n_micro, mb), f32), "ref_logp": sds((n_micro, mb, C), f32)}
        rows = mb
        if getattr(plan, "shared", 0):  # padded rows + prefix_rows [mb, n]: each group's prompt once
            batch["prefix_rows"] = sds((n_micro, mb, plan.shared), jnp.int8)
        elif plan is not None:  # each micro-batch's rows packed: R rows of L tokens, stored as mb rows of R L / mb
            storage = sds((n_micro, mb, plan.rows * plan.row_len // mb), i32)
            batch.update({"input_ids": storage, "attention_mask": storage, "segment_ids": storage,
                          "completion_index": sds((n_micro, mb, C), i32),
                          "packed_rows": sds((n_micro, mb, plan.rows), jnp.int8)})
            rows, T = plan.rows, plan.row_len  # what the model computes
    step_fn = make_train_step(objective, tx, schedule, graphdef, codec)
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    jitted = jit_train_step(step_fn, mesh, state, frozen, batch)
    micro_batch = {k: sds(v.shape[1:], v.dtype) for k, v in batch.items()}
    normalisers = jax.eval_shape(lambda b: objective.normalisers(merge_micro(b)), batch)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    kept = functools.partial(kept_activations, make_micro_loss(objective, graphdef, codec), params, frozen,
                             micro_batch, normalisers, rng)
    return jitted, (state, frozen, batch), remat_report(model, rows, T, limit), rows, T, model, kept


def decode_program(spec: dict, cfg, limit: float):
    """(jitted round, positional args, static kwargs) of the engine's decode round, from abstract shapes."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxrl.generation import programs
    from jaxrl.generation.engine import STOP_WIDTH
    from jaxrl.generation.placement import Weights
    from jaxrl.generation.sampling import sampling_mode

    model = abstract_model(cfg, "none")
    weights = Weights.of(model)  # the structure and the flat (abstract) leaves the engine's programs take
    decode_weights = jax.eval_shape(functools.partial(programs.prepare, weights.structure, fuse_adapters=True),
                                    weights.leaves)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    state = jax.eval_shape(functools.partial(
        programs.init_state, weights.structure, slots=spec["slots"],
        cache_len=spec["prompt_len"] + spec["new_tokens"], max_new_tokens=spec["new_tokens"],
        stop_width=STOP_WIDTH, pad_id=pad_id, mesh=None), weights.leaves)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    mode = sampling_mode(1.0, 1.0, 0, cfg.vocab_size)
    live = jax.ShapeDtypeStruct((spec["slots"],), jnp.bool_)  # the slots the host holds a row for
    args = (weights.structure, weights.leaves, decode_weights, state, live, scalar, scalar)
    return programs.decode_round, args, dict(mode=mode, pad_id=pad_id, mesh=None), model, decode_weights


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def largest_temporaries(dump_dir: str, module: str, top: int = 10) -> list:
    """[[GiB, regions, shape], ...]: the regions of the first table of `module`'s newest memory-usage-report dump
    (XLA's listing of the program's memory by offset range, with the values that use each range over time),
    each attributed to the shape that uses it most often, summed by that shape. XLA lists a range per value
    extent, so ranges overlap and the GiB are an attribution (what dominates), not a partition of the peak."""
    import collections
    import glob
    files = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations-memory-usage-report.txt")),
                   key=os.path.getmtime)
    if not files:
        return []
    by_shape: dict = collections.defaultdict(lambda: [0, 0])
    tables = 0
    for line in open(files[-1]):
        tables += "cumulative_size;" in line
        if tables > 1:  # the later tables are the single-value allocations (parameters) again
            break
        m = re.match(r"\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*\d+;\s*(.*)$", line)
        if not m:
            continue
        size = float(m.group(1)) * _UNITS[m.group(2)]
        counts = collections.Counter()
        for item in m.group(3).split(", "):
            n, _, shape = item.rpartition("\u00d7")
            counts[shape.strip()] += int(n) if n.isdigit() else 1
        shape = counts.most_common(1)[0][0]
        by_shape[shape][0] += size
        by_shape[shape][1] += 1
    ranked = sorted(by_shape.items(), key=lambda kv: -kv[1][0])[:top]
    return [[round(size / GIB, 2), regions, shape] for shape, (size, regions) in ranked]


def memory_report(compiled, capacity: float, limit: float) -> tuple[dict, dict]:
    m = compiled.memory_analysis()
    arg, out, alias, temp = (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                             m.temp_size_in_bytes)
    xla_peak = getattr(m, "peak_memory_in_bytes", 0) or 0
    # XLA:CPU's own peak leaves out what its buffer assignment runs inside loops; the sum bounds it from above
    peak = max(xla_peak, arg + out - alias + temp)
    memory = {"argument_gib": arg / GIB, "output_gib": out / GIB, "alias_gib": alias / GIB, "temp_gib": temp / GIB,
              "generated_code_mib": m.generated_code_size_in_bytes / 2**20, "xla_peak_gib": xla_peak / GIB,
              "sum_gib": (arg + out - alias + temp) / GIB, "peak_gib": peak / GIB}
    memory = {k: round(v, 3) for k, v in memory.items()}
    fit = {"capacity_gib": round(capacity / GIB, 1), "allocator_limit_gib": round(limit / GIB, 1),
           "margin_capacity_gib": round((capacity - peak) / GIB, 2),
           "margin_allocator_gib": round((limit - peak) / GIB, 2),
           "fits_capacity": peak <= capacity, "fits_allocator_default": peak <= limit}
    return memory, fit


def cost_flops(compiled) -> Optional[float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost["flops"]) if cost and "flops" in cost else None


def formula_flops(cfg, kind: str, rows: int, seq_len: int, dpo_reference: str, completion: int = 0) -> dict:
    """The MFU formula (benchmarks/gpu_train_step.py `model_flops`) for one micro-batch: policy forward and
    backward plus the reference forward (the DPO step with `adapters_off`); without the in-step reference
    (DPO with the reference in the batch, GRPO with ref_logp in the batch) the reference forward's share
    (one linear pass and one pass of the attention cores) is taken off."""
    from benchmarks.gpu_train_step import model_flops
    f = model_flops(cfg, LORA_RANK, rows, seq_len)
    per_token = f["per_token"]
    linear = f["share_linear"] * per_token / 3
    cores = f["share_attention_cores"] * per_token / 4
    in_step_reference = kind == "dpo" and dpo_reference == "adapters_off"
    if not in_step_reference:
        per_token -= linear + cores
    return {"formula": per_token * f["tokens"], "per_token": per_token, "tokens": f["tokens"],
            "reference_forward_in_step": in_step_reference}


def run_program(name: str, shape: str, scan: Optional[bool], remat: str, dpo_reference: str, capacity: float,
                limit: float, llvm_opt: Optional[int], emulate: bool = True, dump_dir: Optional[str] = None,
                analysis_only: bool = False, num_layers: Optional[int] = None, layout: Optional[str] = None,
                seed: int = 0) -> dict:
    import contextlib

    import jax

    spec = dict(PROGRAMS[name], **(TINY[name] if shape == "tiny" else {}))
    cfg = model_config(spec["model"], shape, scan, num_layers)
    options = {} if llvm_opt is None else {"xla_backend_optimization_level": llvm_opt}
    result = {"program": name, "shape": shape, "kind": spec["kind"], "model": spec["model"] if shape == "real"
              else "tiny", "spec": spec, "scan_layers": scan, "backend": jax.default_backend(),
              "jax": jax.__version__, "llvm_opt": llvm_opt, "emulated_h200": emulate,
              "num_layers": cfg.num_hidden_layers}
    plan = None
    if layout is not None:  # an online layout of the users' draw (module docstring)
        plan, result["layout"] = layout_plan(spec, layout, seed)
    with H200(limit) if emulate else contextlib.nullcontext():
        t0, c0 = time.perf_counter(), time.process_time()
        if spec["kind"] in PASSES:
            fn, args, static, model = pass_program(spec, cfg, plan)
            lowered = None if analysis_only else fn.lower(*args, **static)
            result["remat"] = {"setting": "none (a forward pass has no backward)"}
            rows, seq_len = spec["rows"], spec["prompt_len"] + spec["new_tokens"]
            if plan is not None and plan.packed:
                rows, seq_len = plan.rows, plan.row_len
            if spec["kind"] == "teacher":  # what the student holds meanwhile, in the same process
                result["student_resident_gib"] = round(resident_gib(model_config("4b", shape, scan), True), 2)
        elif spec["kind"] == "decode":
            fn, args, static, model, decode_weights = decode_program(spec, cfg, limit)
            lowered = None if analysis_only else fn.lower(*args, **static)
            result["remat"] = {"setting": "none (decode has no backward)"}
            result["decode_weight_copies_gib"] = round(sum(
                x.size * x.dtype.itemsize for x in jax.tree.leaves(decode_weights)) / GIB, 3)
            rows, seq_len = spec["slots"], 1
        else:
            jitted, args, remat_info, rows, seq_len, model, kept = train_step_program(spec, cfg, remat,
                                                                                       dpo_reference, limit, plan)
            lowered = None if analysis_only else jitted.lower(*args)
            result["remat"] = remat_info
        policy = result["remat"].get("chosen")  # the train step's remat policy; decode: none chosen
        result["layer_cycle"] = list(model.layer_cycle(policy)) if hasattr(model, "layer_cycle") else None
        train_step = spec["kind"] not in PASSES + ("decode",)
        if train_step and hasattr(cfg, "scan_decision"):  # what scan_layers=None would do here
            result["default_scan_decision"] = list(dataclasses.replace(cfg, scan_layers=None).scan_decision(policy))
        result["lower_s"] = round(time.perf_counter() - t0, 1)
        result["lower_cpu_s"] = round(time.process_time() - c0, 1)
        del args
        if train_step:
            c0 = time.process_time()
            result["remat"]["kept_activations"] = kept()
            result["remat"]["kept_activations"]["trace_cpu_s"] = round(time.process_time() - c0, 1)
        if analysis_only:
            return result
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = lowered.compile(compiler_options=options or None)
        result["compile_s"] = round(time.perf_counter() - t0, 1)
        # CPU seconds of this process (every thread): on a shared machine the wall time above is mostly waiting
        result["compile_cpu_s"] = round(time.process_time() - c0, 1)
    result["memory"], result["fit"] = memory_report(compiled, capacity, limit)
    if dump_dir:
        result["largest_temporaries"] = largest_temporaries(dump_dir, "_round" if spec["kind"] == "decode"
                                                            else "step")
    counted = cost_flops(compiled)
    if spec["kind"] == "distill":  # the in-process 9B teacher's weights stay resident through the step
        result["teacher_resident_gib"] = round(resident_gib(model_config("9b", shape, scan), False), 2)
        result["passes"] = distill_shares(shape, seq_len, scan)
    if spec["kind"] in ("distill", "teacher"):
        other = result.get("teacher_resident_gib", result.get("student_resident_gib"))
        peak = result["memory"]["peak_gib"] + other
        result["with_the_other_model"] = {
            "peak_gib": round(peak, 2), "fits_capacity": peak <= capacity / GIB,
            "fits_allocator_default": peak <= limit / GIB, "margin_capacity_gib": round(capacity / GIB - peak, 2),
            "margin_allocator_gib": round(limit / GIB - peak, 2)}
    if spec["kind"] in PASSES:
        result["flops"] = {"counted": counted, "formula_per_call": pass_flops_per_token(cfg, seq_len) * seq_len * rows,
                           "rows_per_call": rows, "tokens_per_row": seq_len,
                           "note": "XLA counts a while-loop body once (the head's chunk map, scanned layers)"}
    elif spec["kind"] == "decode":
        # one decode step of every slot: 2 FLOPs per weight (the head included) and row, the LoRA products, and
        # attention over the cache are what the while loop's body holds
        from flax import nnx
        weights = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if len(x.shape) >= 2)
        result["flops"] = {"counted": counted, "weights_x2_x_rows": 2.0 * weights * rows,
                           "note": "XLA counts the round's while-loop body once: one decode step"}
    else:
        f = formula_flops(cfg, spec["kind"], rows, seq_len, dpo_reference)
        ratio = None if counted is None or scan else round(counted / f["formula"], 3)
        result["flops"] = {"counted": counted, "formula_per_micro_batch": f["formula"],
                           "counted_over_formula": ratio, "rows_per_micro_batch": rows, "tokens_per_row": seq_len,
                           "reference_forward_in_step": f["reference_forward_in_step"],
                           "note": ("XLA counts a while-loop body once: with scanned layers one block, so no ratio"
                                    if scan else "one micro-batch (the accumulation scan's body); counted includes "
                                    "remat's recomputation")}
        if spec["kind"] == "dpo":
            result["dpo_reference"] = dpo_reference
    result["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)
    return result


def run(programs: str = ",".join(PROGRAMS), shape: str = "real", scan_layers: str = "both", remat: str = "auto",
        dpo_reference: str = "adapters_off", device_memory_gib: float = 139.0, mem_fraction: float = 0.75,
        llvm_opt: Optional[int] = None, out: Optional[str] = None, dump_dir: Optional[str] = None,
        analysis_only: bool = False, num_layers: Optional[int] = None, layouts: str = "", seed: int = 0) -> dict:
    """Every program of `programs` (comma list) at each scan setting; {"programs": [result, ...], ...}. On a GPU
    (benchmarks/gpu_all.py's `aot_real_shapes`) the programs are the GPU's, nothing is emulated, and the
    allocator limit is the device's own."""
    import jax

    names = [n for n in programs.split(",") if n]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        raise ValueError(f"programs: unknown {unknown}; choose from {list(PROGRAMS)}")
    capacity = device_memory_gib * GIB
    emulate = jax.default_backend() == "cpu"
    if emulate:
        limit = mem_fraction * capacity
    else:
        from jaxrl.models.qwen35.model import _device_memory_bytes
        limit = _device_memory_bytes()
    if not scan_available():
        print("[aot] the model has no scan_layers setting: every program runs unrolled", file=sys.stderr)
        settings = [None]
    else:
        settings = {"both": [True, False], "on": [True], "off": [False]}[scan_layers]
    chosen_layouts = [x for x in layouts.split(",") if x]
    bad = [x for x in chosen_layouts if x not in ONLINE_LAYOUTS]
    if bad:
        raise ValueError(f"layouts: unknown {bad}; choose from {', '.join(ONLINE_LAYOUTS)}")
    results = []
    for name in names:
        for scan, layout in [(scan, layout)
                             for scan in ([False] if PROGRAMS[name]["kind"] == "decode" and settings != [None]
                                          else settings)
                             for layout in (chosen_layouts or [None] if PROGRAMS[name]["kind"] in LAYOUT_KINDS
                                            else [None])]:
            print(f"[aot {time.strftime('%H:%M:%S')}] {name} ({shape}, scan_layers={scan}"
                  f"{'' if layout is None else ', layout=' + layout}) ...", file=sys.stderr, flush=True)
            try:
                result = run_program(name, shape, scan, remat, dpo_reference, capacity, limit, llvm_opt, emulate,
                                     dump_dir, analysis_only, num_layers, layout, seed)
            except Exception as e:  # noqa: BLE001 - a program that does not compile is a result too
                result = {"program": name, "shape": shape, "scan_layers": scan, "layout": layout,
                          "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                          "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
                                                     2)}
            line = json.dumps(result, default=str)
            print(line, flush=True)
            if out:
                os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
                with open(out, "a") as f:
                    f.write(line + "\n")
            results.append(result)
    return {"programs": results, "device_kind": jax.devices()[0].device_kind, "emulated_h200": emulate}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", default=",".join(PROGRAMS), help="comma list of: " + ", ".join(PROGRAMS))
    ap.add_argument("--shape", choices=("real", "tiny"), default="real")
    ap.add_argument("--scan_layers", choices=("both", "on", "off"), default="both",
                    help="train steps with the layers scanned, unrolled, or both (decode: unrolled always)")
    ap.add_argument("--remat", default="auto", help="the train steps' remat setting (default auto)")
    ap.add_argument("--dpo_reference", choices=("adapters_off", "batch"), default="adapters_off",
                    help="adapters_off: the reference forward inside the step (benchmarks/gpu_train_step.py, the "
                         "MFU formula); batch: precomputed reference log-probs (dpo.precompute_ref_logps)")
    ap.add_argument("--device_memory_gib", type=float, default=139.0, help="usable memory of the target GPU")
    ap.add_argument("--mem_fraction", type=float, default=0.75,
                    help="the allocator's share of it (JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION); CPU only: "
                         "on a GPU the device's own limit")
    ap.add_argument("--llvm_opt", type=int, default=None,
                    help="XLA:CPU LLVM optimisation level (default: XLA's; 0 compiles faster, same memory)")
    ap.add_argument("--out", default=None, help="also append each JSON object as one line to this file")
    ap.add_argument("--dump_dir", default=None, help="XLA's dumps of the compiled programs go here (HLO, buffer "
                    "assignment, memory report); adds largest_temporaries to each object")
    ap.add_argument("--num_layers", type=int, default=None, help="the model's widths and layer block at this "
                    "depth (a multiple of the block; default: the model's own)")
    ap.add_argument("--analysis_only", action="store_true", help="only what needs no compile: remat's choice and "
                    "the kept activations (seconds per program)")
    ap.add_argument("--layouts", default="", help="comma list of padded, packed, shared_prefix: grpo_4b and "
                    "reference_4b in each online layout at the users' draw of lengths (module docstring); default: "
                    "padded, no draw")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the users' draw of lengths (--layouts)")
    args = ap.parse_args(argv)
    if args.dump_dir:  # read when the backend starts, which nothing has done yet
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.dump_dir} "
                                   "--xla_dump_hlo_module_re=.*(step|_round).* --xla_dump_hlo_as_text").strip()
    try:
        return run(**vars(args))
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()

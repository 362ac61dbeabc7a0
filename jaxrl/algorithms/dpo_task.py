"""`algorithm = "dpo"`: DPO-family preference training on the shared training core (jaxrl.train).

    python -m launchers.train --config=configs/dpo.py:model=4b,start=base --workdir=runs/dpo \
        --config.model_path=/models/Qwen3.5-4B --config.data.pairs=pairs/cohort

Data (`config.data`): `pairs` is a pairs.jsonl, a frozen cohort folder (its manifest's sha256 is verified at
start; a changed file is an error naming it), or a build folder holding `cohort/`; records are text pairs
(chat-templated with the tokenizer of `tokenizer` or `model_path`) or pre-tokenised
`{"prompt_ids", "chosen_ids", "rejected_ids"}`. `source = "synthetic"` makes arithmetic-progression pairs
instead (tests, demo). Sequences, the `max_length` policy and its counts: `jaxrl.data.dpo_data`.
A held-out slice (`eval_fraction`, or a separate `eval_pairs` file) is scored at every checkpoint.

Objective (`DPOObjective`, the micro-batch contract of jaxrl.train.objective): chosen and rejected rows go
through ONE forward ([2b, T]); per-sequence log-probs are sums over completion tokens (the one teacher-forced
pass, `jaxrl.models.teacher_forced.next_token_logprobs`); the reference log-probs come from the batch (precomputed
once with the adapters off and cached in `<workdir>/ref_logps.npz`, `dpo.precompute_ref_logps=True`) or from a
second forward with the adapters off under `stop_gradient`; the loss is `combined_dpo_loss` with the global pair /
chosen-token counts, so any micro-batch split gives the same update.

Metrics per step (global means over the step's pairs): loss (the trainer's), `loss/<type>`,
`preference_accuracy`, `reward_margin`, `chosen_rewards`, `rejected_rewards` (beta * log-ratio),
`chosen_logps`, `rejected_logps`, `ref_chosen_logps`, `ref_rejected_logps`, `chosen_length`,
`rejected_length` (completion tokens), and the host metrics `epoch` and `fill_ratio` (real tokens / row tokens
of the step's batch). At checkpoints: `eval_*` on held-out pairs.

Packed pairs (`data.pack`, `pack_pairs`): each micro-batch's chosen and rejected sequences are laid end to end,
first-fit, in as many rows as it has pairs (so the trainer's micro-batch split and sharding are unchanged, and
a pair's two sequences meet in the micro-batch that scores them), at the shortest of a fixed set of row lengths
that fits every micro-batch of the step: 2T x {1/4, 3/8, 1/2, 5/8, 3/4, 1} rounded up to `pad_multiple` (T: the
padded length of the data set), so at most six compiled steps. One forward over the packed rows computes each
sequence as if it were alone (`Qwen35.hidden_states(segment_ids=)`); per-sequence log-prob sums come back by
`sequence_index` (`packed_sequence_sums`), so losses, gradients and metrics are those of the padded rows up to the
order of float sums (tests/test_packing.py). The reference log-probs and held-out passes stay padded.

Batches are a pure function of (seed, step): pairs are drawn in an epoch-wise seeded permutation, so a resumed
run needs only the step (the position is still recorded in every checkpoint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.algorithms import dpo as dpo_lib
from jaxrl.data import dpo_data, packing
from jaxrl.data.chat import load_tokenizer
from jaxrl.data.pairs import read_pairs, read_problem_messages, verify_cohort
from jaxrl.data.stream import epoch_stream, warn_if_under_a_batch
from jaxrl.models.teacher_forced import next_token_logprobs
from jaxrl.parallel import batched_forward
from jaxrl.parallel.distributed import is_main_process
from jaxrl.train.objective import target_mask
from jaxrl.train.task import Task, TaskContext
from jaxrl.utils.io import atomic_write_bytes, atomic_write_json, read_jsonl
from jaxrl.algorithms.config import TrainConfig
from jaxrl.algorithms.dpo_config import DPOConfig, DPODataConfig
REF_CACHE = "ref_logps.npz"
DATA_STATS = "data_stats.json"

def parse_loss_types(value) -> tuple[str, ...]:
    if isinstance(value, str):
        names = tuple(n.strip() for n in value.split(",") if n.strip())
    else:
        names = tuple(str(n) for n in value)
    if not names:
        raise ValueError("dpo.loss_type is empty; e.g. 'sigmoid' or 'sigmoid,sft'")
    return names


# ------------------------------------------------------------------------------------------------- objective


def _rows(batch, side: str) -> dict:
    return {"input_ids": batch[f"{side}_input_ids"], "attention_mask": batch[f"{side}_attention_mask"],
            "loss_mask": batch[f"{side}_loss_mask"]}


def pair_token_logps(model, batch, chunk_size: int, adapters: bool = True) -> tuple[jax.Array, jax.Array]:
    """(token log-probs [2b, T-1], target mask [2b, T-1]) of chosen rows 0..b-1 then rejected rows b..2b-1,
    from one forward (adapters False: the reference's, with the LoRA adapters off). Position t holds
    log p(x_{t+1} | x_<=t); the mask is 1 on completion targets only."""
    both = {k: jnp.concatenate([_rows(batch, "chosen")[k], _rows(batch, "rejected")[k]]) for k in
            ("input_ids", "attention_mask", "loss_mask")}
    logp = next_token_logprobs(model, both["input_ids"], both["attention_mask"], chunk_size=chunk_size,
                               adapters=adapters).logp
    return logp, target_mask(both)


def pair_sequence_logps(model, batch, chunk_size: int, adapters: bool = True) -> tuple[jax.Array, jax.Array]:
    """(chosen_logps [b], rejected_logps [b]): sums of completion-token log-probs (padded or packed rows), with
    the adapters on (the policy) or off (the reference)."""
    if is_packed(batch):
        c, _, r, _ = packed_sequence_sums(model, batch, chunk_size, adapters)
        return c, r
    logp, mask = pair_token_logps(model, batch, chunk_size, adapters)
    sums, _ = dpo_lib.sequence_logps(logp, mask)
    b = sums.shape[0] // 2
    return sums[:b], sums[b:]


# Packed pairs (`pack_pairs`, data.pack): the micro-batch's chosen and rejected sequences laid end to end in as many
# rows as it has pairs; `sequence_index` 2j is pair j's chosen sequence, 2j + 1 its rejected one.
PACKED_KEYS = ("input_ids", "attention_mask", "loss_mask", "segment_ids", "sequence_index")


def is_packed(batch) -> bool:
    return "segment_ids" in batch


def packed_sequence_sums(model, batch, chunk_size: int, adapters: bool = True):
    """(chosen_logps, chosen_lengths, rejected_logps, rejected_lengths), each [b], of a packed micro-batch of b
    pairs (b rows): one forward over the packed rows (each sequence computed as if alone in its row,
    `Qwen35.hidden_states(segment_ids=)`), the chunked token log-probs, and per-sequence sums gathered by
    `sequence_index`: the numbers `pair_token_logps` + `sequence_logps` give on padded rows, up to the order of
    float sums. adapters False: the reference's (the LoRA adapters off)."""
    pairs = batch["input_ids"].shape[0]
    logp = next_token_logprobs(model, batch["input_ids"], batch["attention_mask"], segment_ids=batch["segment_ids"],
                               chunk_size=chunk_size, adapters=adapters).logp
    keep = target_mask(batch) > 0
    index = batch["sequence_index"][:, 1:].reshape(-1)
    # jnp.where keeps a padded position's garbage (even inf) out of the sums, as `sequence_logps` does
    sums = jax.ops.segment_sum(jnp.where(keep, logp, 0.0).reshape(-1), index, num_segments=2 * pairs)
    counts = jax.ops.segment_sum(keep.astype(jnp.float32).reshape(-1), index, num_segments=2 * pairs)
    return sums[0::2], counts[0::2], sums[1::2], counts[1::2]


def pack_pairs(arrays: dict, index: np.ndarray, pairs_per_group: int, lengths: Sequence[int], pad_id: int
               ) -> dict[str, np.ndarray]:
    """The pairs `index` of `arrays` (dpo_data.ARRAY_KEYS, padded [N, T]) as packed rows (PACKED_KEYS, [len(index),
    L]): consecutive groups of `pairs_per_group` pairs (the micro-batches, as `split_batch` cuts them) each packed
    first-fit into that many rows, at the shortest length L of `lengths` that fits every group
    (jaxrl.data.packing). Pair j of a group: sequence_index 2j (chosen) and 2j + 1 (rejected)."""
    index = np.asarray(index)
    if len(index) % pairs_per_group:
        raise ValueError(f"pack_pairs: {len(index)} pairs do not split into groups of {pairs_per_group}")
    groups = []  # per group: its 2 * pairs_per_group sequences
    for start in range(0, len(index), pairs_per_group):
        seqs = []
        for row in index[start:start + pairs_per_group]:
            for side in dpo_data.SIDES:
                n = int(arrays[f"{side}_attention_mask"][row].sum())
                seqs.append({"input_ids": arrays[f"{side}_input_ids"][row, :n],
                             "loss_mask": arrays[f"{side}_loss_mask"][row, :n]})
        groups.append(seqs)
    row_len, placed = packing.plan([[len(x["input_ids"]) for x in g] for g in groups], pairs_per_group, lengths)
    parts = [packing.pack_rows(seqs, rows, row_len, pad_id) for seqs, rows in zip(groups, placed)]
    return {k: np.concatenate([p[k] for p in parts]) for k in PACKED_KEYS}


@dataclasses.dataclass(frozen=True)
class DPOObjective:
    """DPO-family loss of one micro-batch (module docstring). `reference`: "batch" (ref_*_logps in the batch),
    "adapters_off" (a second forward with the LoRA adapters disabled), "none" (reference-free losses only)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: Optional[tuple[float, ...]] = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    discopop_tau: float = 0.05
    f_divergence: str = "reverse_kl"
    f_alpha: float = 0.5
    reference: str = "batch"
    chunk_size: int = 512

    def __post_init__(self):
        if self.reference not in ("batch", "adapters_off", "none"):
            raise ValueError(f"reference={self.reference!r}")

    def normalisers(self, batch):
        if is_packed(batch):  # as many rows as pairs; chosen sequences have even indices
            chosen = target_mask(batch) * (batch["sequence_index"][:, 1:] % 2 == 0)
            return {"num_pairs": jnp.float32(batch["input_ids"].shape[0]),
                    "num_chosen_tokens": jnp.maximum(jnp.sum(chosen), 1.0)}
        chosen = target_mask(_rows(batch, "chosen"))
        return {"num_pairs": jnp.float32(batch["chosen_input_ids"].shape[0]),
                "num_chosen_tokens": jnp.maximum(jnp.sum(chosen), 1.0)}

    def loss(self, model, micro_batch, normalisers, rng):
        if is_packed(micro_batch):
            b = micro_batch["input_ids"].shape[0]
            c_logps, c_len, r_logps, r_len = packed_sequence_sums(model, micro_batch, self.chunk_size)
        else:
            b = micro_batch["chosen_input_ids"].shape[0]
            logp, mask = pair_token_logps(model, micro_batch, self.chunk_size)
            c_logps, c_len = dpo_lib.sequence_logps(logp[:b], mask[:b])
            r_logps, r_len = dpo_lib.sequence_logps(logp[b:], mask[b:])
        if self.reference == "batch":
            ref_c, ref_r = micro_batch["ref_chosen_logps"], micro_batch["ref_rejected_logps"]
        elif self.reference == "adapters_off":
            ref_c, ref_r = pair_sequence_logps(model, micro_batch, self.chunk_size, adapters=False)
            ref_c, ref_r = jax.lax.stop_gradient(ref_c), jax.lax.stop_gradient(ref_r)
        else:
            ref_c = ref_r = None
        sums = dpo_lib.SequenceSums(c_logps, c_len, r_logps, r_len, ref_c, ref_r)
        n_pairs, n_tokens = normalisers["num_pairs"], normalisers["num_chosen_tokens"]
        total, parts = dpo_lib.combined_dpo_loss_from_sums(
            sums, self.loss_types, self.loss_weights, beta=self.beta, label_smoothing=self.label_smoothing,
            gamma=self.gamma, discopop_tau=self.discopop_tau, f_divergence=self.f_divergence,
            f_alpha=self.f_alpha, num_pairs=n_pairs, num_chosen_tokens=n_tokens)
        metrics = pair_metrics(sums, self.beta, n_pairs)
        for name in self.loss_types:
            if name == "sft":  # token mean over the global batch's chosen tokens: an additive share as is
                metrics["loss/sft"] = -jnp.sum(c_logps) / n_tokens
            else:  # combined_dpo_loss reports the micro-batch mean; turn it into the share of the global mean
                metrics[f"loss/{name}"] = parts[f"loss/{name}"] * (b / n_pairs)
        return total, metrics


def pair_metrics(sums: dpo_lib.SequenceSums, beta: float, num_pairs) -> dict[str, jax.Array]:
    """Additive shares (sum over these pairs / num_pairs) of the per-pair diagnostics."""
    c_logps, c_len, r_logps, r_len = sums[:4]
    ref_c = jnp.zeros_like(c_logps) if sums.ref_chosen_logps is None else sums.ref_chosen_logps
    ref_r = jnp.zeros_like(r_logps) if sums.ref_rejected_logps is None else sums.ref_rejected_logps
    per_pair = {
        "preference_accuracy": dpo_lib.preference_accuracy(c_logps, r_logps, ref_c, ref_r, beta),
        "reward_margin": dpo_lib.reward_margin(c_logps, r_logps, ref_c, ref_r, beta),
        "chosen_rewards": dpo_lib.chosen_rewards(c_logps, ref_c, beta),
        "rejected_rewards": dpo_lib.rejected_rewards(r_logps, ref_r, beta),
        "chosen_logps": c_logps, "rejected_logps": r_logps,
        "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r,
        "chosen_length": c_len, "rejected_length": r_len,
    }
    return {k: jnp.sum(jnp.asarray(v, jnp.float32)) / num_pairs for k, v in per_pair.items()}


# ------------------------------------------------------------------------------------------------- batched passes


def _logps(graphdef, state, batch, *, adapters: bool, chunk_size: int):
    return pair_sequence_logps(nnx.merge(graphdef, state), batch, chunk_size, adapters)


def sequence_logps_all(model, arrays: dict, *, adapters: bool, batch_size: int, chunk_size: int = 512,
                       mesh=None, compile_options: Optional[dict] = None) -> tuple[np.ndarray, np.ndarray]:
    """(chosen_logps [N], rejected_logps [N]) of every pair in `arrays` (dpo_data.ARRAY_KEYS, [N, T]) under
    `model` with its adapters on or off; one jitted program, `batch_size` pairs a call
    (jaxrl.parallel.batched_forward.map_batches)."""
    program = batched_forward.jit_program(_logps, ("graphdef", "adapters", "chunk_size"), compile_options, mesh)
    graphdef, state = nnx.split(model)
    chosen, rejected = batched_forward.map_batches(
        lambda batch: program(graphdef, state, batch, adapters=adapters, chunk_size=chunk_size), arrays,
        dpo_data.ARRAY_KEYS, batch_size=batch_size, mesh=mesh)
    return chosen, rejected


def preference_summary(chosen, rejected, ref_chosen, ref_rejected, objective: DPOObjective,
                       chosen_lengths=None, rejected_lengths=None, prefix: str = "") -> dict[str, float]:
    """Means over all given pairs ([N] sequence log-probs): preference accuracy, margin, rewards, log-probs, and
    the objective's loss without its sft term (that needs token log-probs)."""
    beta = objective.beta
    c, r, rc, rr = (jnp.asarray(x, jnp.float32) for x in (chosen, rejected, ref_chosen, ref_rejected))
    out = {
        "preference_accuracy": jnp.mean(dpo_lib.preference_accuracy(c, r, rc, rr, beta)),
        "reward_margin": jnp.mean(dpo_lib.reward_margin(c, r, rc, rr, beta)),
        "chosen_rewards": jnp.mean(dpo_lib.chosen_rewards(c, rc, beta)),
        "rejected_rewards": jnp.mean(dpo_lib.rejected_rewards(r, rr, beta)),
        "chosen_logps": jnp.mean(c), "rejected_logps": jnp.mean(r),
    }
    weights = dict(zip(objective.loss_types, objective.loss_weights or (1.0,) * len(objective.loss_types)))
    names = [n for n in objective.loss_types if n != "sft"]
    if names and (chosen_lengths is not None or not any(dpo_lib.loss_spec(n).needs_lengths for n in names)):
        out["loss"] = sum(weights[n] * jnp.mean(dpo_lib.dpo_loss(
            c, r, rc, rr, loss_type=n, beta=beta, label_smoothing=objective.label_smoothing,
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths, gamma=objective.gamma,
            discopop_tau=objective.discopop_tau, f_divergence=objective.f_divergence, f_alpha=objective.f_alpha))
            for n in names)
    return {prefix + k: float(v) for k, v in out.items()}


def check_pair_coupled_losses(loss_types: Sequence[str], micro_batch_size: int, grad_accum: int) -> None:
    """Losses that sort the pairs of a micro-batch (aot, aot_unpaired) see only that micro-batch.

    With one pair there is nothing to sort and they silently become smoothed sigmoid DPO, which is never what a
    user asked for: refused. From two pairs on they are what TRL computes (it sorts within a device batch), but
    the update then depends on the split of the global batch, not only on the batch itself: a warning.
    """
    coupled = [n for n in loss_types if n != "sft" and dpo_lib.loss_spec(n).across_pairs]
    if not coupled:
        return
    if micro_batch_size < 2:
        total = micro_batch_size * grad_accum
        raise ValueError(
            f"dpo.loss_type={','.join(loss_types)!r}: {' and '.join(coupled)} sorts the pairs of each micro-batch, "
            f"and batch.micro_batch_size={micro_batch_size} leaves one pair to sort, so it would be plain smoothed "
            f"sigmoid DPO. Use batch.micro_batch_size >= 2 (batch.micro_batch_size={total} batch.grad_accum=1 keeps "
            f"the global batch of {total} pairs), or loss_type 'sigmoid' / 'robust' with dpo.label_smoothing")
    warnings.warn(f"dpo.loss_type {' and '.join(coupled)} sorts the {micro_batch_size} pairs of each micro-batch: the "
                  f"update depends on batch.micro_batch_size, not only on the global batch (as in TRL, which sorts "
                  f"within a device batch)", UserWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------------- data


def resolve_pairs_path(path: str) -> tuple[Path, Optional[dict]]:
    """(the pairs file, the cohort manifest or None). A folder with `manifest.json` (or `cohort/manifest.json`)
    is a frozen cohort and is verified; so is a pairs file that a manifest beside it names."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data.pairs={path!r}: no such file or folder")
    if p.is_dir():
        for cohort in (p, p / "cohort"):
            if (cohort / "manifest.json").is_file():
                manifest = verify_cohort(cohort)
                return cohort / manifest.get("file", "pairs.jsonl"), manifest
        if (p / "pairs.jsonl").is_file():
            return p / "pairs.jsonl", None
        raise FileNotFoundError(f"data.pairs={path!r}: a folder without manifest.json, cohort/ or pairs.jsonl")
    manifest_path = p.parent / "manifest.json"
    if manifest_path.is_file():
        try:
            named = json.loads(manifest_path.read_text(encoding="utf-8")).get("file", "pairs.jsonl")
        except (json.JSONDecodeError, AttributeError):
            named = None
        if named == p.name:
            return p, verify_cohort(p.parent)
    return p, None


def load_encoded_pairs(path: str, data: DPODataConfig, tokenizer_path: str) -> tuple[list, Optional[dict]]:
    """Encoded pairs of a pairs file / cohort (text or pre-tokenised) and the cohort manifest, if any."""
    file, manifest = resolve_pairs_path(path)
    records = read_jsonl(file)
    if not records:
        raise ValueError(f"{file}: no pairs")
    if dpo_data.is_pretokenized(records[0]):
        return dpo_data.pretokenized_pairs(records, where=str(file)), manifest
    records = read_pairs(file)  # checks the docs/reference/interfaces.md keys, naming file and line
    if not tokenizer_path:
        raise ValueError(f"{file} holds text pairs: set data.tokenizer or model_path to a folder with a tokenizer "
                         "and chat template")
    tokenizer = load_tokenizer(tokenizer_path)
    messages = read_problem_messages(data.problems) if data.problems else None
    return dpo_data.tokenize_pairs(records, tokenizer, data.enable_thinking, messages), manifest


def _model_identity(config: TrainConfig) -> dict:
    """What identifies the base weights, for the reference cache's fingerprint."""
    path = config.model_path
    if path:
        files = sorted(Path(path).glob("*.safetensors")) + sorted(Path(path).glob("config.json"))
        return {"model_path": os.path.abspath(path),
                "files": [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]}
    return {"model_preset": config.model_preset, "model_seed": config.model_seed,
            "model_overrides": dict(config.model_overrides)}


def build_objective(dpo: DPOConfig, chunk_size: int) -> DPOObjective:
    """The objective of a run's `dpo` block: loss names and weights checked, the reference source chosen (batch /
    adapters_off / none for reference-free losses). Plug-in losses are registered before this (run_training)."""
    loss_types = parse_loss_types(dpo.loss_type)
    for name in loss_types:
        if name != "sft":
            try:
                dpo_lib.loss_spec(name)
            except KeyError as e:
                raise ValueError(f"dpo.loss_type: {e}") from None
    weights = tuple(float(w) for w in dpo.loss_weights)
    if weights and len(weights) != len(loss_types):
        raise ValueError(f"dpo.loss_weights has {len(weights)} entries for {len(loss_types)} loss types "
                         f"{loss_types}")
    reference_free = all(n == "sft" or dpo_lib.loss_spec(n).reference_free for n in loss_types)
    reference = "none" if reference_free else ("batch" if dpo.precompute_ref_logps else "adapters_off")
    objective = DPOObjective(
        loss_types=loss_types, loss_weights=weights or None, beta=dpo.beta, label_smoothing=dpo.label_smoothing,
        gamma=dpo.simpo_gamma, discopop_tau=dpo.discopop_tau, f_divergence=dpo.f_divergence, f_alpha=dpo.f_alpha,
        reference=reference, chunk_size=chunk_size)
    # Argument checks of the loss (f-divergence validity, label smoothing ranges) now, not inside the jit.
    z = jnp.zeros((1,), jnp.float32)
    dpo_lib.combined_dpo_loss(dpo_lib.DPOInputs(jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.zeros((1, 1)),
                                                jnp.ones((1, 1)), None if reference_free else z,
                                                None if reference_free else z),
                              loss_types, weights or None, beta=objective.beta,
                              label_smoothing=objective.label_smoothing, gamma=objective.gamma,
                              discopop_tau=objective.discopop_tau, f_divergence=objective.f_divergence,
                              f_alpha=objective.f_alpha)
    return objective


# ------------------------------------------------------------------------------------------------- task


class DPOTask(Task):
    """Batches of pairs for the Trainer, reference log-probs, held-out evaluation (module docstring)."""

    def __init__(self, config: TrainConfig, model, mesh):
        self.config, self.mesh = config, mesh
        self.data: DPODataConfig = config.data
        self.seed = config.seed
        self.global_batch = config.batch.global_batch
        self.chunk_size = config.logprob_chunk_size
        self.ref_batch_size = config.dpo.ref_batch_size or config.batch.micro_batch_size
        self.compile_options = dict(config.compile_options)

        self.objective = build_objective(config.dpo, self.chunk_size)  # first: a bad loss fails before data work
        check_pair_coupled_losses(self.objective.loss_types, config.batch.micro_batch_size, config.batch.grad_accum)
        self.precompute = self.objective.reference == "batch"

        self.train, self.eval = self._build_data(model)
        if len(self.train) == 0:
            raise ValueError("no training pairs")
        source = f"data.pairs={self.data.pairs}" if self.data.source == "pairs" else "data.synthetic_pairs"
        warn_if_under_a_batch(len(self.train), self.global_batch, source, unit="pair")
        # data.pack: every step's rows have one of these lengths (a pair's two sequences always fit a row of
        # twice the padded length, so the widest always works)
        self.micro_batch_size = config.batch.micro_batch_size
        self.pack_lengths: Optional[tuple[int, ...]] = None
        if self.data.pack:
            self.pack_lengths = packing.row_lengths(2 * int(self.train.arrays["chosen_input_ids"].shape[1]),
                                                    self.seq_cfg.pad_multiple)
            logging.info("DPO data.pack: %d pairs a micro-batch in as many rows of one of %s tokens",
                         self.micro_batch_size, list(self.pack_lengths))
        self.position = 0
        self.ref: Optional[dict[str, np.ndarray]] = None  # train: {"chosen", "rejected"}, set by setup()
        self.eval_ref: Optional[dict[str, np.ndarray]] = None
        self.context: Optional[TaskContext] = None

    # ---------------------------------------------------------------------------------------------- building
    def _build_data(self, model) -> tuple[dpo_data.PairSequences, Optional[dpo_data.PairSequences]]:
        """(training pairs, held-out pairs or None) as arrays, after the length policy; sets seq_cfg, manifest,
        stats."""
        data = self.data
        pad = model.config.pad_token_id
        self.seq_cfg = dpo_data.SequenceConfig(
            max_length=data.max_length, max_prompt_length=data.max_prompt_length or None, overlong=data.overlong,
            min_prompt_tokens=data.min_prompt_tokens, pad_multiple=data.pad_multiple,
            pad_id=0 if pad is None else int(pad))
        encoded, self.manifest = self._load(model)
        if data.expected_pairs and len(encoded) != data.expected_pairs:
            raise ValueError(f"data.pairs={data.pairs!r} holds {len(encoded)} pairs; "
                             f"data.expected_pairs={data.expected_pairs}")
        full = dpo_data.build_sequences(encoded, self.seq_cfg)
        logging.info("DPO data: %s", dpo_data.format_stats(full.stats))
        vocab = int(model.config.vocab_size)
        top = int(max(full.arrays["chosen_input_ids"].max(), full.arrays["rejected_input_ids"].max()))
        if top >= vocab:
            raise ValueError(f"data.pairs: token id {top} is outside the model's vocabulary ({vocab})")
        self.stats = {"train": full.stats}

        if data.eval_fraction:
            train_rows, eval_rows = dpo_data.split_eval(full.pair_ids, data.eval_fraction, self.seed)
            return full.subset(train_rows), full.subset(eval_rows)
        if data.eval_pairs:
            enc, _ = load_encoded_pairs(data.eval_pairs, data, self._tokenizer_path())
            held = dpo_data.build_sequences(enc, self.seq_cfg)
            self.stats["eval"] = held.stats
            logging.info("DPO held-out data (%s): %s", data.eval_pairs, dpo_data.format_stats(held.stats))
            return full, held
        return full, None

    # ---------------------------------------------------------------------------------------------- loading
    def _tokenizer_path(self) -> str:
        return self.data.tokenizer or self.config.model_path

    def _load(self, model):
        data = self.data
        if data.source == "synthetic":
            records = dpo_data.synthetic_pairs(
                data.synthetic_pairs, int(model.config.vocab_size), self.seed, prompt_len=data.synthetic_prompt_len,
                completion_len=data.synthetic_completion_len, num_tokens=data.synthetic_num_tokens or None,
                eos_id=int(np.ravel(model.config.eos_token_id)[0]))
            return dpo_data.pretokenized_pairs(records, where="synthetic"), None
        if data.source != "pairs":
            raise ValueError(f"data.source={data.source!r}; choose 'pairs' or 'synthetic'")
        if not data.pairs:
            raise ValueError("data.pairs is empty: set it to a pairs.jsonl or a frozen cohort folder")
        encoded, manifest = load_encoded_pairs(data.pairs, data, self._tokenizer_path())
        if manifest is not None:
            logging.info("cohort %s verified: %d pairs, sha256 %s", data.pairs, manifest.get("size", 0),
                         manifest["sha256"])
        return encoded, manifest

    # ---------------------------------------------------------------------------------------------- reference
    def fingerprint(self, seqs: dpo_data.PairSequences) -> dict:
        return {"data_sha256": seqs.digest(), "num_pairs": len(seqs),
                "pair_ids_sha256": hashlib.sha256("\n".join(seqs.pair_ids).encode()).hexdigest(),
                "max_length": self.seq_cfg.max_length, "seq_len": int(seqs.arrays["chosen_input_ids"].shape[1]),
                "dtype": self.config.dtype, "logprob_chunk_size": self.chunk_size,
                "model": _model_identity(self.config)}

    def _reference(self, context: TaskContext, seqs: dpo_data.PairSequences, name: str) -> dict[str, np.ndarray]:
        """Reference log-probs of `seqs` from `<workdir>/<name>` when its fingerprint matches, else computed
        with the adapters off and written there (atomically)."""
        path = os.path.join(context.workdir, name)
        want = json.loads(json.dumps(self.fingerprint(seqs), sort_keys=True))  # as read back (tuples -> lists)
        if os.path.exists(path):
            try:
                with np.load(path, allow_pickle=False) as f:
                    have = json.loads(str(f["fingerprint"]))
                    cached = {"chosen": np.asarray(f["ref_chosen_logps"]),
                              "rejected": np.asarray(f["ref_rejected_logps"])}
            except (OSError, KeyError, ValueError) as e:
                logging.warning("%s is unreadable (%s); recomputing the reference log-probs", path, e)
            else:
                if have == want:
                    logging.info("reference log-probs of %d pairs loaded from %s", len(seqs), path)
                    return cached
                diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
                logging.warning("%s is stale (differs in %s); recomputing the reference log-probs", path, diff)
        model = context.current_policy()
        chosen, rejected = sequence_logps_all(model, seqs.arrays, adapters=False, batch_size=self.ref_batch_size,
                                              chunk_size=self.chunk_size, mesh=self.mesh,
                                              compile_options=self.compile_options)
        if not (np.all(np.isfinite(chosen)) and np.all(np.isfinite(rejected))):
            raise FloatingPointError(f"non-finite reference log-probs ({name}); check the model and dtype")
        if is_main_process():
            buf = io.BytesIO()
            np.savez(buf, ref_chosen_logps=chosen, ref_rejected_logps=rejected,
                     fingerprint=np.asarray(json.dumps(want, sort_keys=True)),
                     pair_ids=np.asarray(seqs.pair_ids))
            atomic_write_bytes(path, buf.getvalue())
        logging.info("reference log-probs of %d pairs computed (adapters off) and cached in %s", len(seqs), path)
        return {"chosen": chosen, "rejected": rejected}

    def setup(self, context: TaskContext) -> None:
        """Before the first step: reference log-probs (cached in the workdir) and data_stats.json."""
        self.context = context
        if self.precompute:
            self.ref = self._reference(context, self.train, REF_CACHE)
            if self.eval is not None:
                self.eval_ref = self._reference(context, self.eval, "eval_" + REF_CACHE)
        if is_main_process():
            info = {**self.stats, "train_pairs": len(self.train), "eval_pairs": 0 if self.eval is None else
                    len(self.eval), "global_batch": self.global_batch,
                    "steps_per_epoch": len(self.train) / self.global_batch,
                    "reference": self.objective.reference, "loss_types": list(self.objective.loss_types),
                    "pack_row_lengths": None if self.pack_lengths is None else list(self.pack_lengths)}
            if self.manifest is not None:
                info["cohort"] = {k: self.manifest.get(k) for k in ("sha256", "size", "seed", "source", "file")}
            atomic_write_json(os.path.join(context.workdir, DATA_STATS), info)

    # ---------------------------------------------------------------------------------------------- Task
    def rows(self, step: int) -> np.ndarray:
        """Training pair indices of `step`: positions step*B ... step*B+B-1 of the stream of epoch-wise seeded
        permutations (epoch e: permutation(seed, e))."""
        return epoch_stream(len(self.train), step * self.global_batch, self.global_batch, seed=self.seed, salt=6121)

    def batch(self, step: int):
        if self.context is None:
            raise RuntimeError("DPOTask.batch before setup(context): the reference log-probs are not prepared")
        index = self.rows(step)
        if self.pack_lengths is not None:
            out = pack_pairs(self.train.arrays, index, self.micro_batch_size, self.pack_lengths, self.seq_cfg.pad_id)
            fill = packing.fill_ratio(out["attention_mask"])
        else:
            out = {k: v[index] for k, v in self.train.arrays.items()}
            fill = packing.fill_ratio(np.stack([out["chosen_attention_mask"], out["rejected_attention_mask"]]))
        if self.objective.reference == "batch":
            out["ref_chosen_logps"] = self.ref["chosen"][index]
            out["ref_rejected_logps"] = self.ref["rejected"][index]
        self.position = (step + 1) * self.global_batch
        # fill_ratio: real tokens / row tokens of this step's batch (padded or packed)
        return out, {"epoch": self.position / len(self.train), "fill_ratio": fill}

    def num_tokens(self, batch) -> int:
        if is_packed(batch):
            return int(np.sum(batch["attention_mask"]))
        return int(np.sum(batch["chosen_attention_mask"]) + np.sum(batch["rejected_attention_mask"]))

    def state_dict(self) -> dict:
        # Batches are a function of the step; the position is recorded for people reading checkpoints.
        return {"position": self.position, "train_pairs": len(self.train)}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state.get("position", 0))

    def evaluate(self, model, seqs: Optional[dpo_data.PairSequences] = None, ref: Optional[dict] = None
                 ) -> dict[str, float]:
        """Preference metrics of `model` (adapters on) on held-out pairs (default: the task's eval slice)."""
        seqs = self.eval if seqs is None else seqs
        if seqs is None:
            return {}
        if ref is None:
            ref = self.eval_ref if seqs is self.eval and self.eval_ref is not None else None
        if ref is None:
            rc, rr = sequence_logps_all(model, seqs.arrays, adapters=False, batch_size=self.ref_batch_size,
                                        chunk_size=self.chunk_size, mesh=self.mesh,
                                        compile_options=self.compile_options)
            ref = {"chosen": rc, "rejected": rr}
            if seqs is self.eval and self.context is not None:  # the base never changes: score it once per run
                self.eval_ref = ref
        c, r = sequence_logps_all(model, seqs.arrays, adapters=True, batch_size=self.ref_batch_size,
                                  chunk_size=self.chunk_size, mesh=self.mesh, compile_options=self.compile_options)
        lengths = [seqs.arrays[f"{side}_loss_mask"].sum(-1) for side in dpo_data.SIDES]  # completion tokens
        out = preference_summary(c, r, ref["chosen"], ref["rejected"], self.objective, *lengths, prefix="eval_")
        out["eval_pairs"] = float(len(seqs))
        return out

    def on_checkpoint(self, step: int, policy) -> Optional[dict]:
        if self.eval is None:
            return None
        out = self.evaluate(policy)
        logging.info("step %d held-out: preference accuracy %.3f, reward margin %.4f (%d pairs)", step,
                     out["eval_preference_accuracy"], out["eval_reward_margin"], len(self.eval))
        return out


def build_dpo(config: TrainConfig, model, mesh) -> DPOTask:
    return DPOTask(config, model, mesh)

"""Online rows laid out for the teacher-forced passes and the train step: padded, as the rollouts make them,
packed, or padded with each group's prompt computed once (shared_prefix) (issue 51).

    layout = OnlineLayout("auto", width=C, pad_id=0, name="grpo")
    arrays, metrics = layout.apply(arrays, group=8, where="pass")  # packed: input_ids, attention_mask,
                                                                    # segment_ids [N, L], completion_index [N, C]

padded: the rollout's layout (jaxrl/algorithms/online/rollouts.py): [N, P + C], prompts left-padded, completions
right-padded; one shape for the whole run.

packed: each group of k consecutive rows -- a micro-batch of the train step (the trainer splits the global batch
into consecutive micro-batches, jaxrl.train.step.split_batch), one call of a rollout pass
(jaxrl.parallel.batched_forward) -- becomes R <= k packed rows of L tokens holding the group's sequences (each
row's real tokens, prompt then completion, no padding) end to end with `segment_ids` (jaxrl.data.packing:
first-fit decreasing). L is the shortest length of the ladder `packing.row_lengths(P + C)` that holds the batch's
longest sequence, R the fewest of the ladder ROW_FRACTIONS x k into which every group of the batch fits, so a run
compiles few shapes. The R x L tokens are stored as k rows of R x L / k (the trainer and the passes split and shard
batches by rows; `packed_rows`, an empty [k, R] array, carries R) and the model sees them as R x L. For completion
column t of row i, `completion_index` [N, C] holds the flat index (within the group's R x L tokens) of the hidden
state that predicts that token. The passes read the head at those hidden states only (jaxrl.models.teacher_forced,
`positions=`), so log-probs, entropies, values (PPO's value head reads the same hidden states) and a distillation
support come back [N, C] in the padded order: every loss, per-sequence normaliser and metric downstream runs its
padded code unchanged, and the gradient flows back through the gather. Why this layout: packing is then a layout
of the model's input only, row i of every [N, C] array is still sequence i, so the micro-batch split and the
losses are untouched; and the head (a vocabulary-wide matmul) runs over the completion tokens only, as in the
padded layout, never over the prompts. (On a mesh the gather crosses the rows' shards: correct, with the
communication XLA adds.)

Where it pays (`layout = "auto"`), decided per batch from its lengths: the layout that computes the fewest row
tokens (padding included), if they are at most PACK_MARGIN of the padded row tokens (N x (P + C)); padded otherwise:
it compiles one shape, and its numbers are the ones earlier runs logged. Weighed: packed (its rows x L), only for
rows of at least MIN_PACKED_ROW tokens; shared_prefix (G x P + N x C), only for prompts of at least
MIN_SHARED_PROMPT columns and rows whose aligned blocks share one. Below those sizes a step is bound by dispatch and
compiles, not by row tokens, so the tests' and the demo's rows stay padded. `layout = "padded" | "packed" |
"shared_prefix"` forces one. The first decision of the train step and of the rollout passes is logged with its
reason (every candidate's share), and again the first time it changes. Memory does not enter the rule: the packed
programs are the padded shapes, and the shared-prefix pass keeps less than the padded one under the same remat
(`Qwen35.branched_hidden_states`; benchmarks/aot_real_shapes.py measures all three at the users' 4B shape).

Counters (metrics of every step): `layout/packed` and `layout/shared_prefix` (0/1), `layout/prefix_group` (n, 1
when not shared), `layout/row_tokens` (tokens the forward computes, padding included), `layout/padding_tokens` (of
those, the ones that hold no token) and `layout/prompt_tokens` (prompt tokens computed: each row's own prompt, so a
group's prompt num_generations times, or once per group when shared) of the train step's batch; `layout/pass_*` the
same of one of the rollout's teacher-forced passes.

shared_prefix: padded rows whose consecutive groups of n rows hold one prompt (GRPO's rows are prompt-major: rows
j*n .. j*n + n - 1 sample prompt j) keep their padded arrays and gain `prefix_rows`, an empty [N, n] array whose
shape carries n; every pass and the train step then compute each group's prompt once and its n completions from
the prompt's caches (jaxrl/algorithms/online/shared_prefix.py). n is found in the rows themselves: the largest
divisor of the call / micro-batch rows such that every aligned block of n rows has one prompt (ids and mask); none
(n = 1): padded, with the reason in the log. Counters: `row_tokens` G x P + N x C, `prompt_tokens` the group
prompts' real tokens (once per group).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Optional

import numpy as np
from absl import logging

from jaxrl.data import packing

LAYOUTS = ("auto", "padded", "packed", "shared_prefix")
PACK_MARGIN = 0.8  # auto packs when its row tokens are at most this share of the padded ones
PAD_MULTIPLE = 64  # packed row lengths round up to it (jaxrl.data.packing.row_lengths)
# auto leaves rows shorter than this padded: such steps are bound by dispatch and compiles (a new shape costs seconds
# to minutes), not by row tokens; and the tests' and the demo's rows keep the numbers earlier runs logged
MIN_PACKED_ROW = 1024
# auto weighs shared_prefix only for prompts of at least this many columns: below it a step is bound by dispatch and
# its two calls per layer (prefill, continuation), not by the prompt tokens it would save (benchmarks/RESULTS.md,
# section 'CPU: packed online passes (issue 51)'); the tests' and the demo's prompts stay padded
MIN_SHARED_PROMPT = 256
PACKED_KEYS = ("input_ids", "attention_mask", "segment_ids", "completion_index", "packed_rows")
SHARED_KEYS = ("input_ids", "attention_mask", "prefix_rows")  # a shared-prefix batch's model inputs


def keeps_groups(setting: str, prompt_columns: int) -> bool:
    """Whether minibatches should hold whole prompt groups (jaxrl/algorithms/online/buffer.py `Schedule.group`):
    under a layout that may compute a prompt once for its rows (shared_prefix, or auto for prompts it would weigh
    it for), a minibatch of rows permuted one by one would leave few aligned blocks sharing a prompt."""
    return setting == "shared_prefix" or (setting == "auto" and prompt_columns >= MIN_SHARED_PROMPT)


def is_packed(batch) -> bool:
    return "completion_index" in batch


def is_shared(batch) -> bool:
    """Rows whose groups of n share a prompt (`prefix_rows` [N, n] carries n)."""
    return "prefix_rows" in batch


def prefix_group(input_ids: np.ndarray, attention_mask: np.ndarray, width: int, group: int) -> int:
    """The largest n dividing `group` (the rows of a call / micro-batch) and the row count such that every aligned
    block of n consecutive rows holds one prompt (the columns before the last `width`: ids and mask); 1 if none."""
    ids, attn = np.asarray(input_ids), np.asarray(attention_mask) > 0
    rows, prompt = ids.shape[0], ids.shape[1] - int(width)
    if prompt <= 0 or rows == 0:
        return 1
    key = np.where(attn[:, :prompt], ids[:, :prompt], -1)
    same = np.concatenate([[False], np.all(key[1:] == key[:-1], axis=1)])  # row i holds row i - 1's prompt
    for n in sorted((d for d in range(2, group + 1) if group % d == 0 and rows % d == 0), reverse=True):
        starts = np.zeros(rows, bool)
        starts[::n] = True
        if np.all(same | starts) and np.all(attn[::n, prompt - 1]):
            return n
    return 1


@dataclasses.dataclass(frozen=True)
class Plan:
    """One batch's layout: packed or not, the packed rows of a group (their count and length, and which of the
    group's sequences each holds), the counters of the chosen layout and the reason."""

    packed: bool
    row_len: int
    rows: int  # packed rows per group
    placed: list
    group: int
    counters: dict
    reason: str
    shared: int = 0  # shared_prefix: rows per prompt (n >= 2); 0: not shared


def _counters(attention_mask: np.ndarray, width: int, row_tokens: int) -> dict[str, float]:
    real = int(np.count_nonzero(attention_mask))
    prompt = int(np.count_nonzero(attention_mask[:, :attention_mask.shape[1] - width]))
    return {"row_tokens": float(row_tokens), "padding_tokens": float(row_tokens - real),
            "prompt_tokens": float(prompt)}


class OnlineLayout:
    """Chooses and applies the layout of online rows (module docstring). `setting`: auto | padded | packed;
    `width`: C, the completion columns; `name`: the block's, for the log line."""

    def __init__(self, setting: str = "auto", *, width: int, pad_id: int = 0, name: str = "",
                 multiple: int = PAD_MULTIPLE):
        if setting not in LAYOUTS:
            raise ValueError(f"{name or 'online'}.layout={setting!r}; choose one of {LAYOUTS}")
        self.setting, self.width, self.pad_id, self.name = setting, int(width), int(pad_id), name
        self.multiple = int(multiple)
        self._said: dict[str, set] = {}
        self._lock = threading.Lock()  # rollouts sampled ahead run their passes on producer threads

    def plan(self, attention_mask: np.ndarray, group: int, input_ids: Optional[np.ndarray] = None) -> Plan:
        """The layout of rows with this attention mask [N, P + C] in groups of `group` consecutive rows (a last
        group of fewer rows is planned as if padded with empty rows). input_ids: which rows share a prompt
        (shared_prefix, and auto's weighing of it; without them auto weighs padded and packed only)."""
        attn = np.asarray(attention_mask) > 0
        n, total = attn.shape
        group = max(1, int(group))
        if self.setting == "shared_prefix":
            return self._plan_shared(attn, group, input_ids)
        lengths = attn.sum(1).astype(int)
        groups = [lengths[g:g + group].tolist() for g in range(0, n, group)]
        row_len, rows, placed = packed_rows(groups, group, packing.row_lengths(total, self.multiple))
        padded_tokens, packed_tokens = n * total, len(groups) * rows * row_len
        share = packed_tokens / max(padded_tokens, 1)
        shape = f"{rows} rows of {row_len} tokens per {group} sequences"
        packed_plan = lambda reason: Plan(True, row_len, rows, placed, group,  # noqa: E731
                                          _counters(attn, self.width, packed_tokens), reason)
        padded_plan = lambda reason: Plan(False, row_len, rows, placed, group,  # noqa: E731
                                          _counters(attn, self.width, padded_tokens), reason)
        if self.setting != "auto":
            reason = f"{self.name}.layout={self.setting!r} (packed: {shape}, {share:.2f} of the padded row tokens)"
            return packed_plan(reason) if self.setting == "packed" else padded_plan(reason)
        # auto: the layout computing the fewest row tokens, if at most PACK_MARGIN of the padded ones
        weighed = []
        if total >= MIN_PACKED_ROW:
            weighed.append((share, "packed", f"packed ({shape}) {share:.2f}"))
        else:
            weighed.append((1.0, "padded", f"packed: rows of {total} tokens are short of {MIN_PACKED_ROW}"))
        prompt = total - self.width
        shared = None
        if input_ids is not None and prompt >= MIN_SHARED_PROMPT:
            shared = self._plan_shared(attn, group, input_ids)
            if shared.shared:
                shared_share = shared.counters["row_tokens"] / max(padded_tokens, 1)
                weighed.append((shared_share, "shared_prefix",
                                f"shared_prefix (n={shared.shared}) {shared_share:.2f}"))
            else:
                weighed.append((1.0, "padded", "shared_prefix: no aligned block of rows shares a prompt"))
        elif input_ids is not None:
            weighed.append((1.0, "padded", f"shared_prefix: prompts of {prompt} columns are short of "
                                           f"{MIN_SHARED_PROMPT}"))
        best, kind, _ = min(weighed, key=lambda w: w[0])
        chosen = kind if best <= PACK_MARGIN else "padded"
        reason = (f"{chosen}: of the padded row tokens ({group} rows of {total}), "
                  + "; ".join(w[2] for w in weighed) + f" (auto takes the fewest if <= {PACK_MARGIN})")
        if chosen == "packed":
            return packed_plan(reason)
        if chosen == "shared_prefix":
            return dataclasses.replace(shared, reason=reason)
        return padded_plan(reason)

    def _plan_shared(self, attn: np.ndarray, group: int, input_ids: Optional[np.ndarray]) -> Plan:
        """shared_prefix (module docstring): n rows per prompt, or padded when no two rows of a block share one."""
        rows, total = attn.shape
        prompt = total - self.width
        if input_ids is None:
            raise ValueError("OnlineLayout('shared_prefix').plan needs the input_ids (which rows share a prompt)")
        n = prefix_group(input_ids, attn, self.width, group)
        if n < 2:
            reason = (f"{self.name}.layout='shared_prefix', but no aligned block of rows of the {group}-row "
                      f"calls holds one prompt: padded")
            counters = _counters(attn, self.width, rows * total)
            return Plan(False, total, group, [], group, counters, reason)
        leaders = attn[::n, :prompt]
        row_tokens = leaders.shape[0] * prompt + rows * self.width
        real = int(np.count_nonzero(leaders)) + int(np.count_nonzero(attn[:, prompt:]))
        counters = {"row_tokens": float(row_tokens), "padding_tokens": float(row_tokens - real),
                    "prompt_tokens": float(np.count_nonzero(leaders))}
        reason = (f"{self.name}.layout='shared_prefix': each prompt computed once for its {n} rows "
                  f"({row_tokens / max(rows * total, 1):.2f} of the padded row tokens)")
        return Plan(False, total, group, [], group, counters, reason, shared=n)

    def apply(self, arrays: dict, group: int, where: str = "train") -> tuple[dict, dict[str, float]]:
        """(arrays in the chosen layout, metrics): padded arrays are returned as they are; packed ones have
        PACKED_KEYS replaced or added and every other key unchanged. where: "train" (metrics `layout/*`) or
        "pass" (`layout/pass_*`)."""
        plan = self.plan(arrays["attention_mask"], group, arrays.get("input_ids"))
        self._log(plan, where)
        prefix = "layout/" if where == "train" else "layout/pass_"
        metrics = {prefix + "packed": float(plan.packed), prefix + "shared_prefix": float(plan.shared > 0),
                   prefix + "prefix_group": float(max(plan.shared, 1)),
                   **{prefix + k: v for k, v in plan.counters.items()}}
        if plan.shared:
            rows = len(arrays["input_ids"])
            return {**arrays, "prefix_rows": np.zeros((rows, plan.shared), np.int8)}, metrics
        if not plan.packed:
            return arrays, metrics
        return pack(arrays, plan, self.width, self.pad_id), metrics

    def _log(self, plan: Plan, where: str) -> None:
        kind = "packed" if plan.packed else f"shared_prefix (n={plan.shared})" if plan.shared else "padded"
        with self._lock:
            said = self._said.setdefault(where, set())
            if kind in said:
                return
            first = not said
            said.add(kind)
        what = "the train step" if where == "train" else "the rollout passes"
        logging.info("%s layout of %s%s: %s (%s)", self.name or "online", what, "" if first else " changes",
                     kind, plan.reason)


def packed_rows(groups: list, group: int, lengths) -> tuple[int, int, list]:
    """(row length L, rows per group R, per group its rows' sequence indices): L the shortest of the ladder
    `lengths` that holds the longest sequence, R the fewest of the row-count ladder (ROW_FRACTIONS of `group`)
    into which every group fits first-fit decreasing, L then rounded up so that R x L splits into `group` equal
    rows of storage (module docstring)."""
    longest = max((max(g) for g in groups if g), default=1)
    row_len = min((length for length in lengths if length >= longest), default=max(longest, 1))
    for rows in sorted({max(1, int(np.ceil(f * group))) for f in packing.ROW_FRACTIONS} | {group}):
        placed = [packing.first_fit(g, rows, row_len) for g in groups]
        if all(p is not None for p in placed):
            break
    step = group // math.gcd(rows, group)
    return -(-row_len // step) * step, rows, placed


def pack(arrays: dict, plan: Plan, width: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """`arrays` (the rollout layout: input_ids, attention_mask [N, P + C], other per-row arrays) laid out by
    `plan` (module docstring): PACKED_KEYS replaced or added; with N not a multiple of the group, every array
    gets empty rows up to the next multiple (a pass's results are cut back to N)."""
    ids, attn = np.asarray(arrays["input_ids"]), np.asarray(arrays["attention_mask"]) > 0
    n, total = ids.shape
    group, rows, L = plan.group, plan.rows, plan.row_len
    padded_n = -(-n // group) * group
    prompt, storage = total - width, rows * L // group
    out = {k: np.zeros((padded_n // group, rows, L), np.int32) for k in PACKED_KEYS[:3]}
    out["input_ids"][:] = pad_id
    index = np.zeros((padded_n, width), np.int32)
    for g, placed in zip(range(0, n, group), plan.placed):
        seqs = [{"input_ids": ids[i][attn[i]]} for i in range(g, min(g + group, n))]
        part = packing.pack_rows(seqs, placed, L, pad_id)
        for k in PACKED_KEYS[:3]:
            out[k][g // group] = part[k]
        for r, members in enumerate(placed):
            offset = r * L  # flat position in the group's R x L tokens
            for j in members:
                i = g + j
                # each column's position in its sequence (the model's own count: the mask's cumulative sum), so
                # completion column t sits at offset + that position, and the state before it predicts it
                at = (np.cumsum(attn[i]) - 1)[prompt:]
                index[i] = np.where(attn[i, prompt:] & (at > 0), offset + at - 1, 0)
                offset += len(seqs[j]["input_ids"])
    packed = {k: v.reshape(padded_n, storage) for k, v in out.items()}
    packed["completion_index"] = index
    packed["packed_rows"] = np.zeros((padded_n, rows), np.int8)  # its shape carries R (static in the program)
    rest = {k: v for k, v in arrays.items() if k not in packed}
    if padded_n > n:
        rest = {k: np.concatenate([np.asarray(v), np.zeros((padded_n - n,) + np.shape(v)[1:], np.asarray(v).dtype)])
                for k, v in rest.items()}
    return {**rest, **packed}


def model_inputs(batch: dict) -> tuple:
    """(input_ids, attention_mask, segment_ids) of a packed batch (or micro-batch, or pass call) of k rows of
    storage as the model computes them: R x L (`packed_rows` carries R)."""
    rows = batch["packed_rows"].shape[-1]
    return tuple(batch[k].reshape(rows, -1) for k in PACKED_KEYS[:3])

"""The teacher of on-policy distillation in this process (`distill.teacher_backend = "jax"`, a `Scorer`): a frozen
model that scores every completion token of a rollout; and the check every teacher passes first.

    check_same_vocabulary(student_dir, student_vocab, teacher_dir)   # before any work: refuses another tokenizer
    teacher = JaxTeacherSpec(path, adapter).build(ScorerContext(...))  # jaxrl.backends.scorers: JaxTeacher.load
    scores = teacher.score(arrays, k=16, temperature=1.0, batch_size=8, chunk_size=512)
    # {"logp": [N, C] the sampled token's, "top_logp" / "top_ids": [N, C, k], "rest_logp": [N, C]}

The teacher is loaded like the policy's base (`qwen35.from_pretrained` over the same mesh: its memory is budgeted
as the reference model's is, one more set of base weights), optionally with a PEFT adapter attached, and is never
trained: the Trainer only sees the student. Its pass is the one teacher-forced pass
(`jaxrl.models.teacher_forced.next_token_logprobs` from `completion_start`: completion token t predicted by column
P + t - 1, the layout of jaxrl/algorithms/online/rollouts.py) with the top-k support head (`Head.top_k(k,
rest=True)`: jaxrl.ops.logprobs.topk_support), through one jitted program `batch_size` rows a call
(jaxrl.parallel.batched_forward). The served teachers (jaxrl.backends.teacher_client) return the same arrays.

`check_same_vocabulary` applies to every teacher backend (the losses compare the two models' probabilities token
id by token id); it reads only configs and tokenizer files.
"""

from __future__ import annotations

import os
from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.backends.base import Scorer
from jaxrl.data.chat import load_tokenizer
from jaxrl.models import qwen35
from jaxrl.models.adapters import attach
from jaxrl.models.peft import read_peft_adapter
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.models.teacher_forced import Head, completion_start, next_token_logprobs
from jaxrl.parallel import batched_forward

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _has_tokenizer(folder: str) -> bool:
    return bool(folder) and any(os.path.exists(os.path.join(folder, f)) for f in _TOKENIZER_FILES)


def check_same_vocabulary(student: str, student_vocab: int, teacher: str) -> None:
    """Refuses (ValueError, one line naming both) a teacher whose vocabulary size or tokenizer differs from the
    student's: the losses compare the two models' probabilities token id by token id. `student`: the folder of the
    student's tokenizer ('' for a preset model); only configs and tokenizer files are read."""
    if not teacher:
        raise ValueError("distill.teacher_path is required: the teacher's HF folder")
    if not os.path.isdir(teacher):
        raise ValueError(f"distill.teacher_path={teacher}: no such folder")
    try:
        teacher_vocab = load_hf_config(teacher)[0].vocab_size
    except (OSError, ValueError) as e:
        raise ValueError(f"distill.teacher_path={teacher}: not a Qwen3.5 HF folder: {e}") from e
    who = student or "the preset student"
    if teacher_vocab != student_vocab:
        raise ValueError(f"distill.teacher_path={teacher} has a vocabulary of {teacher_vocab} tokens, the student "
                         f"({who}) {student_vocab}: a teacher must share the student's tokenizer")
    if _has_tokenizer(student) != _has_tokenizer(teacher):
        has, lacks = (student, teacher) if _has_tokenizer(student) else (teacher, who)
        raise ValueError(f"distill: {has} holds a tokenizer and {lacks} none; the teacher's tokenizer must be shown "
                         f"to be the student's ({teacher} vs {who})")
    if not _has_tokenizer(student):
        return
    a, b = load_tokenizer(student).get_vocab(), load_tokenizer(teacher).get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:1]
        raise ValueError(f"distill: the teacher's tokenizer ({teacher}) differs from the student's ({student}): "
                         f"{len(set(a.items()) ^ set(b.items()))} (token, id) entries differ, e.g. {diff[0]!r}")


def teacher_pass(graphdef, state, input_ids, attention_mask, *, max_new_tokens, k, temperature, chunk_size):
    """The teacher's scores of one batch of rows (jitted by `JaxTeacher.score`): the top-k support head over the
    last `max_new_tokens` columns."""
    out = next_token_logprobs(nnx.merge(graphdef, state), input_ids, attention_mask,
                              start=completion_start(input_ids, max_new_tokens), temperature=temperature,
                              chunk_size=chunk_size, head=Head.top_k(k, rest=True))
    return {"logp": out.logp, "top_logp": out.top_logp, "top_ids": out.top_ids, "rest_logp": out.rest_logp}


class JaxTeacher(Scorer):
    """A frozen teacher in this process (module docstring)."""

    name = "jax"

    def __init__(self, model, mesh=None, compile_options: Optional[dict] = None):
        self.model, self.mesh, self.compile_options = model, mesh, compile_options

    @classmethod
    def load(cls, path: str, adapter: str = "", *, dtype, mesh=None, compute: Optional[dict] = None,
             compile_options: Optional[dict] = None) -> "JaxTeacher":
        model = qwen35.from_pretrained(path, dtype=jnp.dtype(dtype), mesh=mesh, remat="none")
        if compute:
            model.set_compute(**compute)
        if adapter:
            attach(model, read_peft_adapter(adapter)[0])
        return cls(model, mesh, compile_options)

    def score(self, arrays: dict, *, k: int, temperature: float, batch_size: int, chunk_size: int = 512) -> dict:
        """The teacher's view of every row of `arrays` (input_ids, attention_mask [N, P + C], completion_mask
        [N, C]): see the module docstring; zero (ids 0) off the completion mask."""
        program = batched_forward.jit_program(teacher_pass, ("graphdef", "max_new_tokens", "k", "temperature",
                                                             "chunk_size"), self.compile_options, self.mesh)
        graphdef, state = nnx.split(self.model)
        width = np.asarray(arrays["completion_mask"]).shape[1]
        out = batched_forward.map_batches(
            lambda b: program(graphdef, state, b["input_ids"], b["attention_mask"], max_new_tokens=width, k=int(k),
                              temperature=float(temperature), chunk_size=int(chunk_size)),
            arrays, ("input_ids", "attention_mask"), batch_size=batch_size, mesh=self.mesh)
        mask = np.asarray(arrays["completion_mask"]) > 0
        clean = {name: np.where(mask if v.ndim == 2 else mask[..., None], v, 0.0) for name, v in out.items()}
        clean["top_ids"] = clean["top_ids"].astype(np.int32)  # exact: ids < 2**24 survive float32
        return {name: v if name == "top_ids" else v.astype(np.float32) for name, v in clean.items()}

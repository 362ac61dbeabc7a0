"""Where a distillation teacher scores, as a typed union whose members build their `Scorer`
(jaxrl.backends.base): `JaxTeacherSpec | ServerTeacherSpec | VLLMTeacherSpec`, each `build(context) -> Scorer`, the
way the rollout backends are built from `JaxRollout | ServerRollout | VLLMRollout` (jaxrl.backends.settings).

    spec = block.teacher_spec             # a distillation block's choice (teacher_backend, teacher_path,
                                          # teacher_adapter, teacher_servers, teacher_server.*) as its typed member
    teacher = spec.build(ScorerContext(width=P + C, top_k=k, vocab_size=V, dtype="bfloat16", mesh=mesh))
    scores = teacher.score(arrays, k=k, temperature=1.0, batch_size=8, chunk_size=512)

Members: `jax` (the teacher loaded in this process: jaxrl.backends.jax_teacher.JaxTeacher), `server` (the
OpenAI-compatible servers of the teacher, echo + logprobs: jaxrl.backends.teacher_client.ServerTeacher), `vllm`
(vLLM servers, prompt_logprobs: VLLMTeacher). A served member probes every server when it is built: one that
cannot serve refuses the run there. `SCORER_SPECS` names them; jaxrl.backends.settings derives TEACHER_BACKENDS
and SERVED_TEACHERS (the members that score over HTTP) from it.

No jax here: configs import this module (the class a member builds is imported when it builds it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

from jaxrl.backends.options import ServerOptions
from jaxrl.utils.registry import resolve

__all__ = ["JaxTeacherSpec", "SCORER_SPECS", "ScorerContext", "ScorerSpec", "ServerTeacherSpec", "VLLMTeacherSpec"]


@dataclasses.dataclass(frozen=True)
class ScorerContext:
    """What a teacher is built for: the rows it scores (`width` = P + C, the longest; `top_k`, the k of its
    support, which a server is probed for) and the student it scores them for (`vocab_size`: every returned id must
    be below it). `dtype`, `mesh`, `compute` (Qwen35.set_compute's fields), `compile_options`: how the in-process
    teacher is loaded and compiled, as the policy is."""

    width: int
    top_k: int
    vocab_size: int = 0
    dtype: Optional[str] = "bfloat16"
    mesh: Any = None
    compute: Optional[dict] = None
    compile_options: Optional[dict] = None


class ScorerSpec:
    """A member of the teacher union: `name` (what `distill.teacher_backend` says), `served` (it scores over HTTP,
    at `teacher_servers`) and `build`."""

    name: ClassVar[str] = ""
    served: ClassVar[bool] = False

    @classmethod
    def of(cls, *, path: str, adapter: str, urls: tuple, options: ServerOptions) -> "ScorerSpec":
        """The member from a block's teacher keys (teacher_path, teacher_adapter, teacher_servers,
        teacher_server.*), each member taking what it uses."""
        raise NotImplementedError

    def build(self, context: ScorerContext):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class JaxTeacherSpec(ScorerSpec):
    """The teacher at `path` (an HF folder), with the PEFT adapter at `adapter` attached ('' = none), frozen in this
    process (jaxrl.backends.jax_teacher.JaxTeacher)."""

    name: ClassVar[str] = "jax"
    path: str = ""
    adapter: str = ""

    @classmethod
    def of(cls, *, path: str, adapter: str, urls: tuple, options: ServerOptions) -> "JaxTeacherSpec":
        return cls(path, adapter)

    def build(self, context: ScorerContext):
        return resolve("jaxrl.backends.jax_teacher:JaxTeacher").load(
            self.path, self.adapter, dtype=context.dtype, mesh=context.mesh, compute=context.compute,
            compile_options=context.compile_options)


@dataclasses.dataclass(frozen=True)
class ServerTeacherSpec(ScorerSpec):
    """OpenAI-compatible servers of the teacher at `urls` (launchers.serve: echo + logprobs), reached with `options`;
    `path`: the folder they should serve (a server reporting another one gets a warning)."""

    name: ClassVar[str] = "server"
    served: ClassVar[bool] = True
    client: ClassVar[str] = "jaxrl.backends.teacher_client:ServerTeacher"
    urls: tuple = ()
    options: ServerOptions = ServerOptions()
    path: str = ""

    @classmethod
    def of(cls, *, path: str, adapter: str, urls: tuple, options: ServerOptions) -> "ServerTeacherSpec":
        return cls(tuple(urls), options, path)

    def build(self, context: ScorerContext):
        o = self.options
        return resolve(self.client)(self.urls, k=context.top_k, teacher_path=self.path, width=context.width,
                                    vocab_size=context.vocab_size, concurrency=o.concurrency,
                                    request_timeout_s=o.request_timeout_s, progress_every_s=o.progress_every_s,
                                    fleet_wait_s=o.fleet_wait_s)


@dataclasses.dataclass(frozen=True)
class VLLMTeacherSpec(ServerTeacherSpec):
    """Running `vllm serve` of the teacher at `urls` (prompt_logprobs; --max-logprobs >= k)."""

    name: ClassVar[str] = "vllm"
    client: ClassVar[str] = "jaxrl.backends.teacher_client:VLLMTeacher"


SCORER_SPECS = {spec.name: spec for spec in (JaxTeacherSpec, ServerTeacherSpec, VLLMTeacherSpec)}

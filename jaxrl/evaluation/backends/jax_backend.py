"""The default backend: our JAX model and `jaxrl.rollout.Sampler`, with the adapter attached unmerged.

One base model is loaded once and kept; switching checkpoints swaps the LoRA factors in place (no reload). A
model given as a full HF folder (`ModelSpec.kind == "hf"`, e.g. a merged export) is loaded on its own.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

from jaxrl.evaluation.backends import Generation
from jaxrl.models import qwen35
from jaxrl.models.adapters import attach, attached_digest, detach
from jaxrl.rollout.sampler import Sampler

DTYPES = ("bfloat16", "float32")


class JaxBackend:
    name = "jax"

    def __init__(self, base_dir: str, *, dtype: str = "bfloat16", batch_size: int = 64, max_prompt_len: int = 4096,
                 prompt_buckets: Optional[Sequence[int]] = None, stop_ids: Sequence[int] = (),
                 pad_id: Optional[int] = None, model=None, mesh=None, **_unused):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.base_dir, self.dtype = base_dir, dtype
        self.batch_size, self.max_prompt_len = int(batch_size), int(max_prompt_len)
        self.prompt_buckets = tuple(prompt_buckets) if prompt_buckets else None
        self.stop_ids, self.pad_id, self.mesh = tuple(stop_ids), pad_id, mesh
        if model is not None:
            if jnp.dtype(model.dtype) != jnp.dtype(dtype):
                # the cache settings record `dtype`: a model of another dtype would be misdescribed
                raise ValueError(f"the given base model computes in {jnp.dtype(model.dtype).name}, not {dtype}")
        self._base = model  # tests and trainers may hand in an already loaded base model
        self._model = None
        self._samplers: dict[int, object] = {}

    def _load_folder(self, folder: str):
        return qwen35.from_pretrained(folder, dtype=getattr(jnp, self.dtype), mesh=self.mesh)

    def load(self, spec, adapter=None) -> None:
        """Make `spec` (base, base + adapter, or an HF folder) the model that `generate` samples from."""
        if spec.kind == "hf":
            if adapter is not None:
                raise ValueError(f"model {spec.name!r}: an HF folder takes no adapter")
            self._model = self._load_folder(spec.path)
        else:
            if self._base is None:
                self._base = self._load_folder(self.base_dir)
            detach(self._base)
            if adapter is not None:
                attach(self._base, adapter)
            self._model = self._base
        self._samplers = {}

    def loaded_digest(self) -> Optional[str]:
        """Digest of the LoRA factors the loaded model really carries (read back from its parameters)."""
        return attached_digest(self._model)

    def served_fingerprint(self) -> None:
        """None: the jax backend serves the weights it loaded itself (base + attached adapter), whose digest
        `loaded_digest` reads back."""
        return None

    def _sampler(self, max_new_tokens: int):
        if max_new_tokens not in self._samplers:
            self._samplers[max_new_tokens] = Sampler(
                self._model, max_new_tokens=max_new_tokens, max_prompt_len=self.max_prompt_len,
                prompt_buckets=self.prompt_buckets, batch_size=self.batch_size, eos_token_ids=self.stop_ids,
                pad_token_id=self.pad_id, mesh=self.mesh)
        return self._samplers[max_new_tokens]

    def generate(self, prompts, group_ids, *, n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int) -> list[Generation]:
        if self._model is None:
            raise RuntimeError("JaxBackend.generate before load()")
        out = self._sampler(int(max_new_tokens)).sample(
            prompts, n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, group_ids=group_ids)
        return [Generation(list(out.tokens[i]), out.finish_reasons[i], out.prompt_indices[i], out.sample_indices[i])
                for i in range(len(out))]

    def close(self) -> None:
        self._model = self._base = None
        self._samplers = {}

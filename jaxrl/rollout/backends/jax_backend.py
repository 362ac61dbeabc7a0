"""The default backend: our JAX model and `jaxrl.rollout.Sampler`, with adapters attached unmerged.

Two ways to hold a model:
  * from folders (`base_dir`): `load(spec, adapter)` loads the base once and swaps LoRA factors in place when the
    checkpoint changes (no reload); a model given as a full HF folder (`spec.kind == "hf"`) is loaded on its own;
  * a model object (`model=`): an already built base (tests, the demo) or the live policy of online training,
    whose current weights each `generate(..., params=nnx.state(policy))` call passes in (nothing recompiles).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

from jaxrl.models.adapters import attach, attached_digest, detach
from jaxrl.models import qwen35
from jaxrl.parallel.sharding import batch_shards
from jaxrl.rollout.backends.base import Generation, ModelSpec, SamplingParams
from jaxrl.rollout.sampler import Sampler

DTYPES = ("bfloat16", "float32")


class JaxBackend:
    name = "jax"

    def __init__(self, base_dir: Optional[str] = None, *, dtype: Optional[str] = "bfloat16", batch_size: int = 64,
                 max_prompt_len: int = 4096, prompt_buckets: Optional[Sequence[int]] = None,
                 stop_ids: Sequence[int] = (), pad_id: Optional[int] = None, model=None, mesh=None, **_unused):
        """dtype: compute dtype of models loaded from folders; None with `model=` (take the model's own).
        mesh: rows split over its data x fsdp axes, weights placed by the sharding rules; `batch_size` (rows per
        compiled call) is rounded up to a multiple of data x fsdp."""
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if base_dir is None and model is None:
            raise ValueError("JaxBackend needs a base_dir or a model")
        if model is not None and dtype is not None and jnp.dtype(model.dtype) != jnp.dtype(dtype):
            # the cache settings record `dtype`: a model of another dtype would be misdescribed
            raise ValueError(f"the given base model computes in {jnp.dtype(model.dtype).name}, not {dtype}")
        self.base_dir, self.dtype = base_dir, dtype
        self.batch_size, self.max_prompt_len = int(batch_size), int(max_prompt_len)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if mesh is not None:  # every compiled batch splits evenly over the data-parallel devices
            dp = batch_shards(mesh)
            self.batch_size = -(-self.batch_size // dp) * dp
        self.prompt_buckets = tuple(prompt_buckets) if prompt_buckets else None
        self.stop_ids, self.pad_id, self.mesh = tuple(int(t) for t in stop_ids), pad_id, mesh
        self._base = model
        self._model = model  # a given model is ready to sample from without load()
        self._samplers: dict[int, Sampler] = {}

    def _load_folder(self, folder: str):
        return qwen35.from_pretrained(folder, dtype=getattr(jnp, self.dtype or "bfloat16"), mesh=self.mesh)

    def load(self, spec: ModelSpec, adapter=None) -> None:
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
        """None: the jax backend serves the weights it loaded itself, whose adapter digest `loaded_digest` reads
        back from the parameters."""
        return None

    def sampler(self, max_new_tokens: int) -> Sampler:
        """The Sampler of this cap (built once per cap; its programs compile once per bucket)."""
        if self._model is None:
            raise RuntimeError("JaxBackend: no model loaded (call load() first)")
        if max_new_tokens not in self._samplers:
            self._samplers[max_new_tokens] = Sampler(
                self._model, max_new_tokens=max_new_tokens, max_prompt_len=self.max_prompt_len,
                prompt_buckets=self.prompt_buckets, batch_size=self.batch_size, eos_token_ids=self.stop_ids,
                pad_token_id=self.pad_id, mesh=self.mesh)
        return self._samplers[max_new_tokens]

    def generate(self, prompts, group_ids, sampling: SamplingParams, *, params=None) -> list[Generation]:
        """params: weights to sample with instead of the held model's current ones (online training)."""
        out = self.sampler(int(sampling.max_new_tokens)).sample(
            prompts, params=params, n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, group_ids=group_ids)
        return [Generation(list(out.tokens[i]), out.finish_reasons[i], out.prompt_indices[i], out.sample_indices[i],
                           [float(x) for x in out.logprobs[i]]) for i in range(len(out))]

    def close(self) -> None:
        self._model = self._base = None
        self._samplers = {}

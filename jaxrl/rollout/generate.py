"""`generate`: the one-call entry point of docs/reference/interfaces.md over the continuous-batching sampler
(`jaxrl.rollout.engine.ContinuousSampler`; `batching="static"`: the static reference `Sampler`).

    from jaxrl.rollout import generate
    out = generate(model, prompts, max_new_tokens=64, temperature=0.0, top_p=1.0, n=1, seed=0,
                   eos_token_ids=(eos,))
    out.tokens[i], out.logprobs[i], out.finish_reasons[i]      # prompt-major: prompt j -> rows j*n ... j*n+n-1

Repeated calls with the same model structure and buckets reuse the compiled programs (jax's jit cache is keyed
by the static structure, not by the Sampler object), so calling `generate` in a loop does not recompile.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from flax import nnx
from jax.sharding import Mesh

from jaxrl.rollout.collect import decode_completion
from jaxrl.rollout.engine import ContinuousSampler
from jaxrl.rollout.sampler import MIN_PROMPT_BUCKET, GenerationOutput, Sampler

DEFAULT_BATCH_SIZE = 32


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def decode_texts(tokenizer: Any, tokens: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> list[str]:
    """Completion texts by `jaxrl.rollout.collect.decode_completion` (the final stop id dropped, special tokens
    skipped), the one decoding every part of the project uses."""
    stop = frozenset(int(t) for t in stop_ids)
    return [decode_completion(tokenizer, toks, stop) for toks in tokens]


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, n: int = 1, seed: int = 0,
             eos_token_ids: Optional[Sequence[int] | int] = None, stop_token_ids: Sequence[int] = (),
             batch_size: Optional[int] = None, tokenizer: Any = None, *, max_prompt_len: Optional[int] = None,
             prompt_buckets: Optional[Sequence[int]] = None, mesh: Optional[Mesh] = None,
             params=None, batching: str = "continuous") -> GenerationOutput:
    """Samples `n` completions for each prompt (lists of token ids, any lengths).

    Args:
      eos_token_ids: ids that end a completion; None means the model config's eos_token_id, () means none.
      stop_token_ids: more ids that end a completion (like EOS: finish_reason "stop", the id is kept).
      temperature: 0 = greedy; top_p in (0, 1]; top_k 0 = off.
      batch_size: rows decoded at once (default 32, or all rows if fewer).
      tokenizer: if given, `texts` holds the decoded completions (final stop token dropped).
      max_prompt_len: longest accepted prompt; default: the longest given prompt rounded up to a power of two.
      prompt_buckets: prompt lengths that get their own program (default 32, 64, ... up to max_prompt_len);
        prompts are left-padded to their bucket.
      mesh: shard rows over (data, fsdp) and parameters by the sharding rules.
      params: weights to use instead of the model's current ones (an nnx.State or a tuple of States).
      batching: "continuous" (the engine: `batch_size` slots, refilled as rows finish) or "static" (the
        reference: batches that run until their longest row stops); the same samples either way.
    """
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    if eos_token_ids is None:
        eos_token_ids = model.config.eos_token_id
    lengths = [len(p) for p in prompts]
    if not lengths:
        raise ValueError("no prompts given")
    if max_prompt_len is None and prompt_buckets is None:
        # A power of two (>= 32): prompt sets of similar lengths share the bucket ladder and its programs.
        max_prompt_len = max(MIN_PROMPT_BUCKET, 1 << (max(lengths) - 1).bit_length())
    rows = len(prompts) * n
    if batch_size is None:
        batch_size = min(DEFAULT_BATCH_SIZE, 1 << max(rows - 1, 0).bit_length())
    sampler_class = ContinuousSampler if batching == "continuous" else Sampler
    sampler = sampler_class(model, max_new_tokens=max_new_tokens, max_prompt_len=max_prompt_len,
                            prompt_buckets=prompt_buckets, batch_size=batch_size,
                            eos_token_ids=_as_ids(eos_token_ids), stop_token_ids=_as_ids(stop_token_ids), mesh=mesh)
    out = sampler.sample(prompts, params=params, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=seed)
    if tokenizer is not None:
        out.texts = decode_texts(tokenizer, out.tokens, _as_ids(eos_token_ids) + _as_ids(stop_token_ids))
    return out

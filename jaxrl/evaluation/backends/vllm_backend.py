"""Optional backend: vLLM on GPU, serving MERGED full containers (`pip install 'jaxrl[vllm]'`).

Not exercised by the test suite (no GPU, vLLM not installed there); importing this module never imports vllm.
vLLM is imported when the first model is loaded, with an error that says how to install it.

Why merged containers and not vLLM's LoRA: for Qwen3.5, vLLM's LoRA path has had crashes on the Gated DeltaNet
projections, a silent no-op when the adapter's key prefix does not match, and an open report that `enable_lora`
leaves generations unchanged (docs/qwen35-architecture.md §7). Merging into the language tower and writing the
full container back (`jaxrl.export.merge.export_merged`) avoids all of them, and the weight audit proves that
the served folder holds base + adapter: `fingerprint(FolderSource(merged)) == fingerprint(MergedSource(base,
adapter))`, which the evaluator records per model.

What a model becomes:
  * base: the base folder as is;
  * an adapter (trainer checkpoint or PEFT folder): `<out>/merged/<name>/`, exported once and reused while its
    `jaxrl_export.json` names the same adapter digest and base;
  * an HF folder: served as is.

Each model is run in-process as ``vllm.LLM(model=DIR, tokenizer=BASE, dtype=..., seed=..., max_model_len=...,
enable_prefix_caching=False, ...)`` and ``llm.generate([{"prompt_token_ids": ids}, ...], [SamplingParams(n=...,
temperature=..., top_p=..., top_k=..., max_tokens=CAP, seed=<per prompt>, stop_token_ids=[...])])``, i.e. the
same token ids as the jax backend (our chat template, our stop ids). The equivalent server, for reproducing one
model by hand (``VLLMBackend.command``)::

    vllm serve DIR --tokenizer BASE --dtype bfloat16 --max-model-len N --seed S --no-enable-prefix-caching \\
        --tensor-parallel-size T

(Qwen3.5's hybrid GDN cache rejects ``--mamba-cache-mode=all``; keep prefix caching off or use ``align``.)

Differences from the jax backend, recorded in the cache settings so samples of the two are never mixed: vLLM's
random streams are its own (per-request seed = hash of (seed, problem id)), so sampled completions differ from
the jax backend's; greedy ones should agree up to kernel numerics. Completion token counts include the stop token
on both backends (appended when vLLM leaves it out), so truncation and length metrics are comparable.
"""

from __future__ import annotations

import gc
import os
import shlex
from typing import Optional, Sequence

from jaxrl.evaluation.backends import Generation
from jaxrl.export.merge import export_merged, read_provenance

INSTALL_HINT = ("the vllm backend needs vLLM on a CUDA machine: pip install 'jaxrl[vllm]' (or pip install vllm); "
                "use --backend=jax otherwise")


def _import_vllm():
    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return LLM, SamplingParams


class VLLMBackend:
    name = "vllm"

    def __init__(self, base_dir: str, *, out_dir: str, dtype: str = "bfloat16", max_prompt_len: int = 4096,
                 max_new_tokens: int = 4096, stop_ids: Sequence[int] = (), seed: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.90,
                 engine_args: Optional[dict] = None, **_unused):
        self.base_dir, self.out_dir, self.dtype = os.path.abspath(base_dir), out_dir, dtype
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.stop_ids, self.seed = tuple(int(t) for t in stop_ids), int(seed)
        self.tensor_parallel_size, self.gpu_memory_utilization = int(tensor_parallel_size), gpu_memory_utilization
        self.engine_args = dict(engine_args or {})
        self._llm = None
        self._dir: Optional[str] = None
        self._digest: Optional[str] = None
        self._model_len = 0

    # --------------------------------------------------------------------------------------------- model folders
    def model_dir(self, spec, adapter=None) -> str:
        """The folder vLLM serves for `spec` (exports the merged container for an adapter, once)."""
        if spec.kind == "hf":
            return os.path.abspath(spec.path)
        if adapter is None:
            return self.base_dir
        target = os.path.join(self.out_dir, "merged", spec.name)
        info = read_provenance(target) if os.path.isdir(target) else None
        if not (info and info.get("adapter_digest") == adapter.digest() and info.get("base") == self.base_dir):
            export_merged(adapter, self.base_dir, target, overwrite=True)
        return target

    def command(self, model_dir: str, max_model_len: Optional[int] = None) -> str:
        """The `vllm serve` command equivalent to what `load` runs in-process."""
        args = ["vllm", "serve", model_dir, "--tokenizer", self.base_dir, "--dtype", self.dtype,
                "--max-model-len", str(max_model_len or self.max_prompt_len + self.max_new_tokens),
                "--seed", str(self.seed), "--no-enable-prefix-caching",
                "--tensor-parallel-size", str(self.tensor_parallel_size)]
        return " ".join(shlex.quote(a) for a in args)

    # ----------------------------------------------------------------------------------------------------- API
    def load(self, spec, adapter=None) -> None:
        self._dir = self.model_dir(spec, adapter)
        self._digest = adapter.digest() if adapter is not None else None
        self._start(self.max_prompt_len + self.max_new_tokens)

    def _start(self, model_len: int) -> None:
        LLM, _ = _import_vllm()
        self._stop()
        kwargs = dict(model=self._dir, tokenizer=self.base_dir, dtype=self.dtype, seed=self.seed,
                      max_model_len=model_len, tensor_parallel_size=self.tensor_parallel_size,
                      gpu_memory_utilization=self.gpu_memory_utilization, enable_prefix_caching=False)
        kwargs.update(self.engine_args)
        self._llm = LLM(**kwargs)
        self._model_len = model_len

    def _stop(self) -> None:
        if self._llm is not None:
            del self._llm
            self._llm = None
            gc.collect()
            try:
                import torch
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - best effort: freeing GPU memory between models
                pass

    def served_fingerprint(self) -> Optional[str]:
        """The language-tower fingerprint recorded in the served merged folder's jaxrl_export.json (None for a
        folder that is not a merged export); the evaluator checks it against the audit's."""
        info = read_provenance(self._dir) if self._dir else None
        return (info or {}).get("fingerprint") if self._digest is not None else None

    def loaded_digest(self) -> Optional[str]:
        """Digest of the adapter merged into the served folder (from its provenance; vLLM has no adapter)."""
        return self._digest

    def generate(self, prompts, group_ids, *, n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int) -> list[Generation]:
        if self._dir is None:
            raise RuntimeError("VLLMBackend.generate before load()")
        _, SamplingParams = _import_vllm()
        need = max(len(p) for p in prompts) + int(max_new_tokens)
        if need > self._model_len:  # a larger cap (termination re-sampling): restart with room for it
            self._start(need)
        params = [SamplingParams(n=n, temperature=float(temperature), top_p=float(top_p),
                                 top_k=int(top_k) if top_k > 0 else -1, max_tokens=int(max_new_tokens),
                                 seed=(int(seed) * 1_000_003 + int(g)) % (2 ** 63),
                                 stop_token_ids=list(self.stop_ids), detokenize=False)
                  for g in group_ids]
        outs = self._llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], params,
                                  use_tqdm=False)
        rows = []
        for j, out in enumerate(outs):
            for i, c in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                tokens = list(c.token_ids)
                reason = "length" if c.finish_reason == "length" else "stop"
                if reason == "stop" and (not tokens or tokens[-1] not in self.stop_ids):
                    stop = c.stop_reason if isinstance(c.stop_reason, int) else (self.stop_ids or (None,))[0]
                    if stop is not None:
                        tokens.append(int(stop))
                rows.append(Generation(tokens, reason, j, i))
        return rows

    def close(self) -> None:
        self._stop()

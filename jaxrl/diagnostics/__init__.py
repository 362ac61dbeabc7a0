"""Debugging diagnostics and the run report, computed from files on disk (no trainer internals).

Modules (import the one you need; ``report`` pulls in matplotlib, ``drift`` jax only when a model is used):

* the files read here (metrics.jsonl, eval/results.json, eval/samples/NAME.jsonl, diagnostics/) are defined,
  read and validated in ``jaxrl.data.formats``;
* ``drift``: KL to the base and LoRA update norms per checkpoint;
* ``pair_audit``: length bias, filters and a semantic re-run of the verifier on a pairs file;
* ``generation_diff``: two models' samples side by side, changes tagged termination/format/algorithm/...;
* ``termination``: reward vs length, truncation, metrics without truncated samples or re-sampled at a larger cap;
* ``curves``: every evaluation metric per checkpoint step with its interval vs base;
* ``red_flags``: the plain-language flags; ``plots`` and ``report``: the self-contained report.html;
* ``flags``: the settings of ``launchers.diagnose`` (its command-line flags), where the diagnostics' defaults live.

Command line: ``python -m launchers.diagnose --what=drift|pairs|diff|termination|curves`` and
``python -m launchers.report --workdir=DIR``.
"""

__all__ = ["drift", "pair_audit", "generation_diff", "termination", "curves", "red_flags", "flags", "plots", "report"]

r"""Evaluate the base model and checkpoints on a problems file: metrics, paired comparisons, weight audit.

    # every adapter checkpoint of a run (or --steps=4,8,28,125), greedy, 8192-token cap, code verifier (LCB mode)
    python -m launchers.evaluate --problems=heldout.jsonl --checkpoints=RUN_DIR --steps=28,125 \
        --num_samples=1 --temperature=0 --max_new_tokens=8192
    # adapters trained elsewhere (PEFT folders), merged containers; on vLLM 0.33 (GPU, its own environment,
    # docs/guides/vllm.md: adapters served unmerged as LoRA) or on a running server (--backend=server --server_url=URL)
    python -m launchers.evaluate --problems=lcb.jsonl --base=/models/Qwen3.5-4B --out=eval_lcb \
        --adapters=dpo28=/adapters/dpo_step28 --models=merged125=/export/merged_125 --backend=vllm \
        --server_concurrency=512 --vllm_python=~/.venvs/vllm --vllm_tensor_parallel_size=1
    # the backend flags: --server_<key> (concurrency, request_timeout_s, progress_every_s), --vllm_<key> (python,
    # tensor_parallel_size, data_parallel_size, gpu_memory_utilization, extra_args, startup_timeout_s, max_loras),
    # --vllm_max_lora_rank (jaxrl.backends.flags); --backend_kwargs='{...}' is their deprecated JSON form

Writes to --out (default RUN_DIR/eval): results.json, results.md, samples/<model>.jsonl, audit.json, and the
resume cache cache/<model>.jsonl. Rerun the same command after an interruption: finished samples are kept.
Models: `base` (always; the baseline unless --baseline), `step_<N>` for run checkpoints, and the names given in
--adapters / --models; --references=NAME=HF_DIR (`teacher` alone: a distillation run's teacher) adds reference
rows, compared with the baseline but outside the simultaneous family and never selected. Every model is scored on the same prompts with the same sample keys; comparisons are
model - baseline with a paired interval over prompts that agrees with its test, and simultaneous intervals over
every comparison of the file. --resample_max_new_tokens=N re-runs only the truncated samples at a larger cap N,
keeps the merged records in resampled/N/<model>.jsonl, writes termination.json (how much of each score the cap
decided; jaxrl.diagnostics.termination) and rewrites results.json/md with every model compared with the baseline
BOTH at the larger cap (censoring.extended_cap).

Multi-turn episodes (docs/guides/episodes.md): each sample is an episode of an environment; results.json adds
solved within t turns (t = 1..T), turns and tokens per episode:

    python -m launchers.evaluate --problems=heldout.jsonl --checkpoints=RUN_DIR --environment=code_feedback \
        --max_turns=3 --environment_options='{"public_tests": 1}' --num_samples=4 --temperature=1.0

Select on dev, confirm once on held-out (jaxrl.evaluation.protocol):

    # 1. choose among the checkpoints on the dev split (a frozen split: launchers.import_problems --split)
    python -m launchers.evaluate --problems=data/splits/dev.jsonl --checkpoints=RUN --steps=4,8,12,16,28,40,125 \
        --out=RUN/eval_dev --role=select --select_metric=partial_reward_mean      # -> RUN/eval_dev/selection.json
    # 2. evaluate the chosen checkpoint (and base) once on held-out: the confirmatory claim. The settings (reward
    #    and its options, caps, dtype, sampling, seed) and the base folder are the selection's; a flag contradicting
    #    the settings is refused before anything is written (--base may name the same weights elsewhere)
    python -m launchers.evaluate --problems=data/splits/heldout.jsonl --confirm=RUN/eval_dev/selection.json \
        --out=RUN/eval_heldout
    # a confirmation run by mistake: withdraw it (kept in the ledger and in its folder, marked withdrawn; its claim
    # becomes exploratory); the model may then be confirmed again, and that result says one was withdrawn
    python -m launchers.evaluate --withdraw=RUN/eval_heldout --reason="confirmed on the wrong split"

Several hosts (the flags of launchers.train): each process samples every n-th problem on its devices (--mesh_shape,
default all local devices data-parallel), process 0 merges the caches and writes the results:

    python -m launchers.evaluate ... --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=$i

A second --confirm of the same weights on the same split is refused (data/splits/confirmations.jsonl) unless the
first was withdrawn, and so is --overwrite into a folder that holds a confirmation (withdrawn or not): a
confirmation is written once. --baseline other than the selection's is refused with --confirm (the claim is the
comparison the selection was made on). One writer per --out: a second evaluation into a folder another process writes is refused,
naming that process.
Temperature 0 with --num_samples > 1 is refused: greedy decoding repeats one completion.

Every flag value, model folder and adapter is checked before a model is loaded or anything is written. An --out
holding results of models or prompts this run does not have (a narrower rerun: fewer models, another --limit) is
refused unless --overwrite. Ctrl-C / SIGTERM: the batch in flight is cached, exit status 130 / 143; rerun the
same command to resume. Exit status 1 for refused work, 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

import os

import jax
from absl import app, flags, logging

from jaxrl.data import formats
from jaxrl.diagnostics.termination import resample_evaluation
from jaxrl.evaluation import flags as evaluate_flags
from jaxrl.evaluation import protocol
from jaxrl.evaluation.runner import EPISODE_KEYS, Evaluator
from jaxrl.parallel import distributed
from launchers import _main

_F = evaluate_flags.define_flags()
flags.adopt_module_key_flags(evaluate_flags)  # --helpshort lists them as this launcher's own


def _start_processes(role: str, confirm) -> None:
    """jax.distributed from --coordinator_address etc.; the steps that write outside the caches and results (the
    protocol's claims, re-sampling) run in one process only."""
    distributed.initialize_from_flags(_F)
    if jax.process_count() > 1 and (confirm or role == "select" or _F["resample_max_new_tokens"].value):
        raise app.UsageError("--confirm, --role=select and --resample_max_new_tokens run in one process; evaluate "
                             "over several processes first, then rerun the same command in one process (the "
                             "merged samples are reused)")


def _withdraw(out: str) -> None:
    if _F["problems"].value or _F["confirm"].value or _F["role"].value != "explore":
        raise app.UsageError("--withdraw takes only --reason (it changes no evaluation)")
    record = protocol.withdraw_confirmation(out, _F["reason"].value)
    print(f"evaluate: withdrew the confirmation in {os.path.abspath(out)} ({record['reason']}); its claim is now "
          "exploratory and the ledger keeps both lines")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _F["withdraw"].value:
        return _withdraw(_F["withdraw"].value)
    if _F["reason"].value:
        raise app.UsageError("--reason goes with --withdraw")
    role, confirm, metric = _F["role"].value, _F["confirm"].value, _F["select_metric"].value
    _start_processes(role, confirm)
    if confirm and role == "select":
        raise app.UsageError("--confirm and --role=select exclude each other")
    if _F["resample_max_new_tokens"].value and _F["environment"].value:
        raise app.UsageError("--resample_max_new_tokens re-draws single completions; it does not apply to episodes "
                             "(--environment)")
    if _F["resample_max_new_tokens"].value < 0:
        raise app.UsageError(f"--resample_max_new_tokens must be >= 0, got {_F['resample_max_new_tokens'].value}")
    selection = protocol.read_selection(confirm) if confirm else None
    cfg = evaluate_flags.build_config(_F, selection)
    # refused here, before any model is loaded: bad values, unreadable model folders or adapters, an --out that
    # holds other results (ResumeError, AdapterError, ServerError, OutputExistsError, ...: launchers/_main.py)
    ev = Evaluator(cfg)
    try:
        with ev.lock():  # one writer per --out: refused here, naming the other process, before anything is written
            _evaluate(ev, cfg, selection, role, metric)
    finally:
        ev.close()
    print(f"evaluate: wrote {ev.out / 'results.json'} and results.md")


def _evaluate(ev: Evaluator, cfg, selection, role: str, metric: str) -> None:
    if selection is not None:  # claims the one confirmation before any sample is drawn
        proto = protocol.begin_confirmation(selection, cfg.problems, cfg.out, settings=evaluation_settings(ev))
        protocol.check_fingerprint(proto, ev.run_audit()["fingerprints"])
    elif role == "select":
        protocol.begin_selection(cfg.problems, cfg.out, metric)
    ev.run()
    cap = _F["resample_max_new_tokens"].value
    if cap:
        # the truncated samples at the larger cap: kept in <out>/resampled/<cap>/, termination.json written,
        # results.json / results.md rewritten with every model vs the baseline both at `cap`
        logging.info("termination analysis: %s", resample_evaluation(ev, cap))
    print((ev.out / "results.md").read_text())
    if role == "select":
        rec = protocol.write_selection(ev.out, formats.read_results(ev.out), metric=metric,
                                       base=os.path.abspath(cfg.base))
        selection_file = ev.out / protocol.SELECTION_FILE
        print(f"evaluate: selected {rec['model']['name']} on {rec['metric']} ({selection_file}); confirm it once "
              f"with --confirm={selection_file}")


def evaluation_settings(ev: Evaluator) -> dict:
    """The settings of an evaluation a confirmation is checked against (protocol.SELECTION_SETTINGS; the reward's
    options with its defaults, as results.json records them)."""
    episode = ev.episode_settings()  # resolved (the episode budget), and only for episodes, as results.json has them
    settings = {k: getattr(ev.cfg, k) for k in protocol.SELECTION_SETTINGS if k not in EPISODE_KEYS}
    settings.update(episode, reward_kwargs=ev.reward_kwargs)
    return settings


if __name__ == "__main__":
    _main.run(main, interruptible=True)

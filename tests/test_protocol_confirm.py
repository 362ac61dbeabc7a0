"""The one confirmation cannot be spent on the wrong settings: `--confirm` evaluates with the settings the selection
was made with (base, reward and its options, caps, dtype, sampling, seed), a flag that contradicts them is refused
before any work with every file byte for byte as it was, and a mistaken confirmation is withdrawn by a documented
command that keeps its record (marked withdrawn), after which the model may be confirmed again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from absl import app, flags

import launcher_env
from launcher_env import error_lines, launch, snapshot

# The selection's settings: none of them is the flag's default (reward code, cap 8192, bfloat16, 1 sample, greedy,
# seed 0), so a confirmation that fell back to the defaults would differ in every one.
SELECTED = dict(reward="exact_match", max_new_tokens=8, max_prompt_len=192, dtype="float32", num_samples=2,
                temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def selected(tmp_path_factory):
    """A frozen dev / held-out split of the tiny env's problems, and a selection made on dev (in this process)."""
    from jaxrl.data.problems import load_problems
    from jaxrl.data.splits import freeze_splits
    from jaxrl.evaluation import protocol
    from jaxrl.evaluation.runner import EvalConfig, Evaluator, checkpoint_specs
    root = tmp_path_factory.mktemp("confirm")
    env = launcher_env.build(root / "env")
    splits = root / "splits"
    freeze_splits(load_problems(env["problems"]), splits, seed=0)
    dev = root / "eval_dev"
    ev = Evaluator(EvalConfig(problems=str(splits / "dev.jsonl"), base=env["model"], out=str(dev),
                              models=checkpoint_specs(env["run"]), prompt_buckets=(192,), batch_size=4,
                              n_resamples=200, progress=False, **SELECTED))
    try:
        protocol.begin_selection(ev.cfg.problems, ev.out)
        results = ev.run()
        protocol.write_selection(dev, results, base=env["model"])
    finally:
        ev.close()
    return {"env": env, "root": root, "splits": splits, "dev": dev}


def confirm_flags(selected, *args):
    from jaxrl.evaluation import flags as evaluate_flags
    from jaxrl.evaluation import protocol
    values = flags.FlagValues()
    holders = evaluate_flags.define_flags(values)
    values(["evaluate", f"--problems={selected['splits'] / 'heldout.jsonl'}", f"--confirm={selected['dev']}",
            f"--out={selected['root'] / 'held_flags'}", *args])
    return evaluate_flags.build_config(holders, protocol.read_selection(selected["dev"]))


@pytest.mark.slow  # the selection: an evaluation of base and two checkpoints
@pytest.mark.parametrize("flag, recorded", [("--max_new_tokens=8192", "8"), ("--dtype=bfloat16", "'float32'"),
                                            ("--seed=0", "3"), ("--reward_kwargs={\"lcb_compat\": true}", "{}"),
                                            # named as the contradiction it is, not as greedy sampling (the flag's
                                            # default temperature 0 is not what a confirmation runs)
                                            ("--num_samples=8", "2"),
                                            # the claim is the selected model vs the baseline it was selected against
                                            ("--baseline=step_2", "'base'")])
def test_each_contradicting_setting_is_refused_and_an_agreeing_one_is_accepted(selected, flag, recorded):
    with pytest.raises(app.UsageError, match=rf"contradicts the selection being confirmed \(\w+: {recorded} in "):
        confirm_flags(selected, flag)
    cfg = confirm_flags(selected, "--max_new_tokens=8", "--temperature=1.0")  # the selection's values: no conflict
    assert {k: getattr(cfg, k) for k in SELECTED} == SELECTED
    # the selection's own num_samples and baseline, given without --temperature: sampled at its temperature 1
    cfg = confirm_flags(selected, "--num_samples=2", "--baseline=base")
    assert (cfg.num_samples, cfg.temperature, cfg.baseline) == (2, 1.0, "base")


@pytest.mark.slow
def test_a_confirmation_with_another_reward_is_refused_before_any_work(selected):
    root = selected["root"]
    before = snapshot(root)
    proc = launch("evaluate", f"--problems={selected['splits'] / 'heldout.jsonl'}", f"--confirm={selected['dev']}",
                  f"--out={root / 'held_wrong'}", "--reward=code")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc) == [
        f"evaluate: --reward='code' contradicts the selection being confirmed (reward: 'exact_match' in "
        f"{selected['dev'] / 'selection.json'}): a confirmation evaluates with the settings the model was selected "
        "with; drop --reward"]
    assert snapshot(root) == before  # no ledger line, no folder: the one confirmation is still unspent


@pytest.mark.heavy  # one confirmation of the tiny model as a user runs it, then the refusals and a withdrawal
def test_the_readme_confirmation_takes_the_selection_settings_and_a_mistaken_one_can_be_withdrawn(selected):
    from jaxrl.evaluation import protocol
    root, splits = selected["root"], selected["splits"]
    held = root / "eval_heldout"
    proc = launch("evaluate", f"--problems={splits / 'heldout.jsonl'}", f"--confirm={selected['dev']}",
                  f"--out={held}", "--noprogress")  # the README's command: --problems --confirm --out
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((held / "results.json").read_text())
    assert {k: results["evaluation"][k] for k in SELECTED} == SELECTED
    assert [c["claim"] for c in results["comparisons"] if c["metric"] == "partial_reward_mean"] == ["confirmatory"]

    # written once: a second look into the same folder (--overwrite, fewer prompts) is refused, nothing changes
    before = snapshot(root)
    rerun = (f"--problems={splits / 'heldout.jsonl'}", f"--confirm={selected['dev']}", f"--out={held}",
             "--noprogress", "--limit=1", "--overwrite")
    proc = launch("evaluate", *rerun)
    assert proc.returncode == 1, proc.stderr[-3000:]
    [line] = error_lines(proc)
    model = results["protocol"]["primary"]["model"]
    assert line.startswith(f"evaluate: {held.resolve()}: holds the confirmation of {model!r} on split 'heldout' "
                           "(started 20")
    assert line.endswith(f"--overwrite would replace the one look at that split. Read that result, or withdraw it "
                         f"(python -m launchers.evaluate --withdraw={held.resolve()} --reason='...') and confirm "
                         "again into another --out")
    assert snapshot(root) == before

    withdrawn = launch("evaluate", f"--withdraw={held}", "--reason=confirmed before the reward fix")
    assert withdrawn.returncode == 0, withdrawn.stderr[-3000:]
    ledger = [json.loads(line) for line in (splits / "confirmations.jsonl").read_text().splitlines()]
    assert [e.get("withdrawn", False) for e in ledger] == [False, True]  # the claim's line kept, a withdrawal added
    assert ledger[1]["reason"] == "confirmed before the reward fix" and ledger[1]["out"] == str(held.resolve())
    results = json.loads((held / "results.json").read_text())
    assert results["protocol"]["withdrawn"]["reason"] == "confirmed before the reward fix"
    assert {c["claim"] for c in results["comparisons"]} == {"exploratory"}
    assert (held / "results.md").read_text().startswith("> **Withdrawn** confirmation")

    selection = protocol.read_selection(selected["dev"])
    with pytest.raises(protocol.ProtocolError, match="holds a withdrawn confirmation"):
        protocol.begin_confirmation(selection, splits / "heldout.jsonl", held)
    again = protocol.begin_confirmation(selection, splits / "heldout.jsonl", root / "eval_heldout_2")
    assert [e["out"] for e in again["after_withdrawn"]] == [str(held.resolve())]
    twice = launch("evaluate", f"--withdraw={held}", "--reason=again")
    assert twice.returncode == 1 and "was already withdrawn" in twice.stderr
    before = snapshot(root)
    proc = launch("evaluate", *rerun)  # a withdrawn confirmation is the record of that look: not overwritten either
    assert proc.returncode == 1 and error_lines(proc)[0].endswith(
        "(confirmed before the reward fix); it stays on the record, so --overwrite is refused: evaluate into "
        "another --out"), proc.stderr[-3000:]
    assert snapshot(root) == before

    # the new confirmation (in this process: the selection's programs are compiled) and the withdrawn one are
    # both on the record, and both in the report
    from jaxrl.diagnostics.report import collect, render_html
    from jaxrl.evaluation.runner import Evaluator
    cfg = confirm_flags(selected, "--prompt_buckets=192", "--batch_size=4", "--n_resamples=200", "--noprogress")
    ev = Evaluator(dataclasses.replace(cfg, out=str(root / "eval_heldout_2")))
    try:
        ev.run()
    finally:
        ev.close()
    data = collect(selected["env"]["run"], eval_dir=selected["dev"])
    assert {Path(c["dir"]).name: (c["row"]["claim"], c["row"].get("withdrawn")) for c in data["confirmations"]} == {
        "eval_heldout": ("exploratory", "confirmed before the reward fix"),
        "eval_heldout_2": ("confirmatory", None)}
    assert "withdrawn: confirmed before the reward fix" in render_html(data)

"""launchers/evaluate and jaxrl.evaluation.runner on the tiny model with a toy task: metrics reproduced by hand
from the written samples and from a fixed set of completions, fingerprints of every model, the truncation
warning, termination re-sampling, and a run killed with SIGKILL that resumes without redoing finished work."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
N, CAP = 2, 24  # samples per problem, completion cap (a random model stops within 24 tokens ~17% of the time)
REWARD = "test_evaluate:vowel_reward"


def vowel_reward(completion, problem):
    """Toy reward: the fraction of the five vowels the completion contains (1.0 = strict pass). The subprocess
    of the kill test sleeps here so that it can be killed half-way."""
    time.sleep(float(os.environ.get("JAXRL_TEST_REWARD_SLEEP", "0")))
    return sum(v in completion for v in "aeiou") / 5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.evaluation.runner import ModelSpec, checkpoint_specs
    from jaxrl.models.adapters import Adapter, write_adapter_checkpoint
    from jaxrl.export.merge import export_merged
    from jaxrl.models.peft import export_peft
    from jaxrl.models import qwen35
    from jaxrl.models.lora import linears
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.data.chat import load_tokenizer
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("evaluate")
    problems = [json.loads(line) for line in TASKS.read_text().splitlines()]
    too_long = dict(problems[0], id="toy/too_long",
                    messages=[{"role": "user", "content": problems[0]["messages"][0]["content"] * 3}])
    path = root / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems[:4] + [too_long] + problems[4:8]))
    model_dir = str(root / "base")
    # One layer: the compile time of the sampler dominates this file. Not qwen35.tiny.write_tiny_checkpoint, whose
    # import rebinds `qwen35.tiny` for the other test files of this process.
    cfg = tiny(num_hidden_layers=1, layer_types=("full_attention",))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in problems for m in p["messages"]])
    model = qwen35.from_pretrained(model_dir, dtype=jnp.float32)

    workdir = str(root / "run")
    targets = ("layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj", "layers.0.mlp.down_proj")
    lin = dict(linears(model))
    adapters = {}
    for step in (2, 5):
        rng = np.random.default_rng(step)
        params = {}
        for m in targets:  # same modules and rank: one compiled program serves both checkpoints
            params[m + ".lora.lora_A"] = (0.3 * rng.standard_normal((2, lin[m].in_features))).astype(np.float32)
            params[m + ".lora.lora_B"] = (0.3 * rng.standard_normal((lin[m].out_features, 2))).astype(np.float32)
        adapters[step] = Adapter(params=params, rank=2, alpha=4.0, source=f"step {step}")
        write_adapter_checkpoint(workdir, step, adapters[step])
    peft_dir, merged_dir = str(root / "peft5"), str(root / "merged5")
    export_peft(adapters[5], peft_dir, model_dir)
    export_merged(adapters[5], model_dir, merged_dir)
    # step 5 three ways: trainer checkpoint, PEFT folder (both attached unmerged), merged full folder
    specs = checkpoint_specs(workdir) + [ModelSpec("peft5", "adapter", peft_dir),
                                         ModelSpec("merged5", "hf", merged_dir)]
    e = {"root": root, "problems": str(path), "model_dir": model_dir, "model": model, "workdir": workdir,
         "peft": peft_dir, "merged": merged_dir, "specs": specs, "tokenizer": load_tokenizer(model_dir),
         "ids": [p["id"] for p in problems[:4] + problems[4:8]]}
    ev = evaluator(e, e["root"] / "eval")
    e["results"] = ev.run()
    e["ev"] = ev
    yield e
    ev.close()


def numpy_init(cfg, seed=0):
    """A random model drawn with numpy (init_model's eager jax.random compiles one program per parameter
    shape). Small weights as in init_model: near-uniform next-token distributions,
    so completions stop (on one of the two stop ids) often enough within the cap to be scored."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl.models.qwen35.model import Qwen35
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        shape = tuple(var.shape)
        value = rng.standard_normal(shape) * (0.02 if len(shape) > 1 else 0.1)
        var.set_value(jnp.asarray(value, jnp.float32))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def config(env, out, **kw):
    from jaxrl.evaluation.runner import EvalConfig
    base = dict(problems=env["problems"], base=env["model_dir"], out=str(out), models=list(env["specs"]),
                num_samples=N, temperature=1.0, max_new_tokens=CAP, max_prompt_len=192, prompt_buckets=(192,),
                reward=REWARD, batch_size=4, dtype="float32", seed=3, n_resamples=2000, progress=False)
    base.update(kw)
    return EvalConfig(**base)


def evaluator(env, out, **kw):
    from jaxrl.evaluation.runner import Evaluator
    return Evaluator(config(env, out, **kw), model=env["model"], tokenizer=env["tokenizer"])


# ------------------------------------------------------------------------------------------------ by hand


def hand_metrics(records):
    """model_metrics recomputed with plain Python: per prompt first, then over prompts; unbiased pass@k."""
    groups = {}
    for r in records:
        groups.setdefault(r["problem_id"], []).append(r)

    def agg(gs, with_trunc=True):
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        out = {"partial_reward_mean": mean([mean([r["partial"] for r in g]) for g in gs.values()]),
               "strict_rate": mean([mean([float(r["strict"]) for r in g]) for g in gs.values()]),
               "mean_completion_tokens": mean([mean([r["completion_tokens"] for r in g]) for g in gs.values()]),
               "n_prompts": len(gs), "n_samples": sum(len(g) for g in gs.values())}
        if with_trunc:
            out["truncation_rate"] = mean([mean([float(r["finish_reason"] == "length") for r in g])
                                           for g in gs.values()])
        n_min = min(len(g) for g in gs.values())
        out["pass_at_k"] = {str(k): mean([1 - math.comb(len(g) - sum(r["strict"] for r in g), k) /
                                          math.comb(len(g), k) for g in gs.values()])
                            for k in (1, 2) if k <= n_min}
        return out

    full = agg(groups)
    kept = {p: [r for r in g if r["finish_reason"] != "length"] for p, g in groups.items()}
    kept = {p: g for p, g in kept.items() if g}
    full["untruncated"] = agg(kept, with_trunc=False) if kept else None
    return full


def assert_close(got, want, where):
    for key, value in want.items():
        if isinstance(value, dict):
            assert_close(got[key], value, f"{where}.{key}")
        else:
            assert got[key] == pytest.approx(value, abs=1e-12), f"{where}.{key}"


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_metrics_reproduced_by_hand_from_the_written_samples(env):
    from jaxrl.data import formats
    results = formats.read_results(env["root"] / "eval")
    assert list(results["models"]) == ["base", "step_2", "step_5", "peft5", "merged5"]
    assert results["max_new_tokens"] == CAP
    for name, entry in results["models"].items():
        records = formats.read_samples(formats.samples_path(env["root"] / "eval", name))
        assert len(records) == len(env["ids"]) * N and {r["problem_id"] for r in records} == set(env["ids"])
        for r in records:
            assert r["max_new_tokens"] == CAP and 1 <= r["completion_tokens"] <= CAP
            if r["finish_reason"] == "length":
                assert r["completion_tokens"] == CAP and r["partial"] == 0.0 and r["reason"] == "truncated"
            else:
                assert r["partial"] == sum(v in r["completion"] for v in "aeiou") / 5
                assert r["strict"] == (r["partial"] == 1.0)
        want = hand_metrics(records)
        assert_close(entry, {k: v for k, v in want.items() if k != "untruncated"}, name)
        if want["untruncated"] is not None:
            assert_close(entry["untruncated"], want["untruncated"], name + ".untruncated")
    # A toy task a random model sometimes passes in part: the numbers are not trivially zero.
    assert any(m["partial_reward_mean"] > 0 for m in results["models"].values())

    # Steps and fingerprints: the PEFT and merged exports of step 5 have step 5's weights; nothing else coincides.
    models = results["models"]
    assert [models[n]["step"] for n in models] == [None, 2, 5, None, None]
    assert models["peft5"]["fingerprint"] == models["step_5"]["fingerprint"] == models["merged5"]["fingerprint"]
    assert models["peft5"]["adapter_digest"] == models["step_5"]["adapter_digest"]
    assert models["merged5"]["adapter_digest"] is None and models["merged5"]["source"]["kind"] == "hf"
    assert len({models[n]["fingerprint"] for n in ("base", "step_2", "step_5")}) == 3
    assert models["step_2"]["weights_vs_base"]["changed_tensors"] == 3
    assert any("step_5, peft5, merged5 have bit-identical language weights" in w for w in results["warnings"])
    audit = json.loads((env["root"] / "eval" / "audit.json").read_text())
    assert audit["fingerprints"] == {n: m["fingerprint"] for n, m in models.items()}

    # Comparisons: every model against base, on the same prompts, diff = model - base by hand.
    rows = {(c["model"], c["metric"]): c for c in results["comparisons"]}
    assert len(rows) == 4 * 5  # the 4 per-prompt metrics and pass@2 (N = 2 samples a prompt)

    def value(name, metric):
        return models[name]["pass_at_k"]["2"] if metric == "pass_at_2" else models[name][metric]
    for (name, metric), c in rows.items():
        assert c["baseline"] == "base" and c["n_pairs"] == len(env["ids"])
        assert c["diff"] == pytest.approx(value(name, metric) - value("base", metric), abs=1e-12)
        assert c["ci_low"] <= c["diff"] <= c["ci_high"]
        # every row: a test that agrees with its interval, and the simultaneous interval over all 20
        assert c["significant"] == (c["p_value"] < 0.05) == (c["ci_low"] > 0 or c["ci_high"] < 0)
        assert c["family_size"] == 20 and c["simultaneous_ci_low"] <= c["ci_low"]
    # One over-long prompt was skipped, and said so.
    assert any("1 of 9 problems were skipped" in w for w in results["warnings"])


def test_truncation_warning_in_results_json_and_md(env):
    results = env["results"]
    md = (env["root"] / "eval" / "results.md").read_text()
    for name, m in results["models"].items():
        assert m["truncation_rate"] > 0.10, (name, m["truncation_rate"])  # the cap censors most completions
        warning = next(w for w in results["warnings"] if w.startswith(f"{name}: truncation"))
        assert f"censored by the {CAP}-token cap" in warning and warning in md
    assert "## Weights (audit.json)" in md and results["models"]["step_2"]["fingerprint"][:12] in md


def test_fixed_completions_give_hand_computed_numbers(env, tmp_path):
    """Known texts through the same path (decode -> reward -> records -> metrics -> comparisons -> files)."""
    import dataclasses

    from jaxrl.data import formats
    from jaxrl.backends import Generation
    from jaxrl.evaluation.runner import summarize
    ev = env["ev"]
    tok, stop = env["tokenizer"], ev.stop_ids[0]
    p1, p2, p3 = env["ids"][:3]
    fixed = {  # (problem, text, finished?)  -> partial by hand
        "base": [(p1, "aeiou", True), (p1, "ae", True), (p2, "xyz", True), (p2, "aeiou", False),
                 (p3, "i", True), (p3, "eeee", True)],
        "step_2": [(p1, "aeiou", True), (p1, "uoiea", True), (p2, "a", True), (p2, "o u", True),
                   (p3, "aeiou", False), (p3, "e", True)]}
    records, tokens = {}, {}
    for name, rows in fixed.items():
        gens, pids = [], []
        for i, (pid, text, done) in enumerate(rows):
            ids = tok(text, add_special_tokens=False)["input_ids"] + ([stop] if done else [])
            gens.append(Generation(ids, "stop" if done else "length", i, i % 2))
            pids.append(pid)
        scored = ev.collector.score(gens, [ev.by_id[pid] for pid in pids])  # the decoding + reward every run uses
        records[name] = [ev.record(sample, pids[sample.prompt_index], CAP) for sample in scored]
        tokens[name] = [len(g.tokens) for g in gens]
        assert [r["completion"] for r in records[name]] == [t for _, t, _ in rows]
    metrics, comps = summarize(records, "base", n_resamples=2000, seed=0)
    b, s = metrics["base"], metrics["step_2"]
    # base: p1 (1.0, 0.4), p2 (0, truncated 0), p3 (0.2, 0.2); step_2: p1 (1, 1), p2 (0.2, 0.4), p3 (trunc 0, 0.2)
    assert b["partial_reward_mean"] == pytest.approx((0.7 + 0.0 + 0.2) / 3)
    assert s["partial_reward_mean"] == pytest.approx((1.0 + 0.3 + 0.1) / 3)
    assert (b["strict_rate"], s["strict_rate"]) == (pytest.approx(1 / 6), pytest.approx(1 / 3))
    assert (b["pass_at_k"], s["pass_at_k"]) == ({"1": pytest.approx(1 / 6), "2": pytest.approx(1 / 3)},
                                                {"1": pytest.approx(1 / 3), "2": pytest.approx(1 / 3)})
    assert b["truncation_rate"] == s["truncation_rate"] == pytest.approx(1 / 6)
    t = tokens["base"]
    assert b["mean_completion_tokens"] == pytest.approx(((t[0] + t[1]) / 2 + (t[2] + t[3]) / 2 + (t[4] + t[5]) / 2) / 3)
    assert b["untruncated"]["partial_reward_mean"] == pytest.approx((0.7 + 0.0 + 0.2) / 3)
    assert (b["untruncated"]["n_prompts"], b["untruncated"]["n_samples"]) == (3, 5)
    assert s["untruncated"]["partial_reward_mean"] == pytest.approx((1.0 + 0.3 + 0.2) / 3)
    rows = {c["metric"]: c for c in comps}
    assert rows["partial_reward_mean"]["diff"] == pytest.approx(0.5 / 3)
    assert rows["strict_rate"]["diff"] == pytest.approx(1 / 6)
    # per-prompt strict rates (0.5, 0, 0) vs (1, 0, 0): one discordant prompt, exact sign-flip test p = 1
    assert (rows["strict_rate"]["p_value"], rows["strict_rate"]["test"]) == (1.0, "sign_flip")
    assert rows["strict_rate"]["ci_low"] < 0 < rows["strict_rate"]["ci_high"]  # and the interval agrees

    # Written out: 1/6 truncation is above the default 10% threshold, below a 20% one.
    out = tmp_path / "fixed"
    results = ev.write(records, out=str(out))
    assert any(w.startswith("base: truncation 17%") for w in results["warnings"])
    assert formats.read_results(out)["models"]["step_2"]["strict_rate"] == pytest.approx(1 / 3)
    cfg = ev.cfg
    ev.cfg = dataclasses.replace(cfg, truncation_threshold=0.2)
    try:
        assert not [w for w in ev.write(records, out=str(out))["warnings"] if "truncation" in w]
    finally:
        ev.cfg = cfg


@pytest.mark.slow
def test_resample_truncated_continues_the_same_samples(env):
    from jaxrl.data import formats
    from jaxrl.diagnostics.termination import resample_truncated
    ev = env["ev"]
    records = formats.read_samples(formats.samples_path(ev.out, "step_2"))
    out = resample_truncated(records, ev.resample_fn("step_2"), 2 * CAP, n_resamples=500)
    truncated = [r for r in records if r["finish_reason"] == "length"]
    assert out["n_resampled"] == len(truncated) > 0
    new = {(r["problem_id"], r["sample_index"]): r for r in out["records"]}
    for old in truncated:
        r = new[(old["problem_id"], old["sample_index"])]
        assert r["resampled"] and r["max_new_tokens"] == 2 * CAP and r["completion_tokens"] > CAP - 1
        # Same sample key, larger cap: the first CAP tokens are the original completion.
        assert r["completion"].startswith(old["completion"]), (old["completion"], r["completion"])
    assert out["after"]["truncation_rate"] <= out["before"]["truncation_rate"]


@pytest.mark.slow
def test_resampled_records_are_kept_and_every_model_compared_with_base_at_the_larger_cap(env, tmp_path):
    """launchers.evaluate --resample_max_new_tokens: the merged records stay on disk and results.json compares
    each model with the base, BOTH re-sampled at the larger cap (the comparison that matters)."""
    import shutil

    from jaxrl.data import formats
    from jaxrl.diagnostics.termination import resample_evaluation
    from jaxrl.evaluation.censoring import load_resampled, resampled_path
    out = tmp_path / "eval"
    shutil.copytree(env["root"] / "eval", out)
    ev = evaluator(env, out)
    results = ev.run()  # everything cached: nothing is drawn again
    assert (results.get("censoring") or {}).get("extended_cap") is None
    term = json.loads(Path(resample_evaluation(ev, 2 * CAP)).read_text())
    kept = load_resampled(out)
    assert list(kept) == [2 * CAP] and set(kept[2 * CAP]) == set(results["models"])
    for name in results["models"]:
        before = formats.read_samples(formats.samples_path(out, name))
        after = {(r["problem_id"], r["sample_index"]): r for r in kept[2 * CAP][name]}
        assert len(after) == len(before)
        for r in before:  # truncated samples re-drawn (continuing the same stream), the others unchanged
            new = after[(r["problem_id"], r["sample_index"])]
            if r["finish_reason"] == "length":
                assert new["resampled"] and new["max_new_tokens"] == 2 * CAP
                assert new["completion"].startswith(r["completion"])
            else:
                assert new == r
        assert term["resampled"][name]["records_file"] == str(resampled_path(out, 2 * CAP, name))
    res = formats.read_results(out)
    ext = res["censoring"]["extended_cap"]
    assert ext["max_new_tokens"] == 2 * CAP and set(ext["models"]) == set(res["models"]) - {"base"}
    assert term["extended_cap"]["models"].keys() == ext["models"].keys()
    row = next(c for c in ext["models"]["step_2"]["comparisons"] if c["metric"] == "partial_reward_mean")
    from jaxrl.evaluation.metrics import per_prompt_values
    a = per_prompt_values(kept[2 * CAP]["step_2"])["partial_reward_mean"]
    b = per_prompt_values(kept[2 * CAP]["base"])["partial_reward_mean"]
    assert row["diff"] == pytest.approx(sum(a[i] - b[i] for i in b) / len(b), abs=1e-12)
    assert row["n_pairs"] == len(env["ids"]) and (row["p_value"] < 0.05) == (row["ci_low"] > 0 or row["ci_high"] < 0)
    md = (out / "results.md").read_text()
    assert f"### Both re-sampled at {2 * CAP} tokens" in md and "## Censoring" in md


def test_select_on_dev_then_confirm_once_on_heldout(env, tmp_path):
    """The protocol with the real evaluator: choose among the checkpoints on dev, record it, evaluate base + the
    chosen one on held-out (the one confirmatory claim), and refuse a second confirmation."""
    from jaxrl.data.problems import load_problems
    from jaxrl.data.splits import freeze_splits
    from jaxrl.data import formats
    from jaxrl.evaluation import protocol as P
    from jaxrl.evaluation.runner import ModelSpec
    split_dir = tmp_path / "splits"
    freeze_splits(load_problems(env["problems"]), split_dir, seed=0)
    dev_out = tmp_path / "dev"
    P.write_protocol(dev_out, {"role": "selection", "split": P.split_identity(split_dir / "dev.jsonl")})
    dev = evaluator(env, dev_out, problems=str(split_dir / "dev.jsonl")).run()
    assert dev["protocol"]["role"] == "selection" and dev["protocol"]["split"]["split"] == "dev"
    assert {c["claim"] for c in dev["comparisons"]} == {"exploratory"}
    sel = P.write_selection(dev_out, formats.read_results(dev_out), base=env["model_dir"])
    best = max((c for c in dev["comparisons"] if c["metric"] == "partial_reward_mean"), key=lambda c: c["diff"])
    assert sel["model"]["name"] == best["model"] and sel["model"]["fingerprint"] == \
        dev["models"][best["model"]]["fingerprint"]
    selection = P.read_selection(dev_out)
    src = selection["model"]["source"]
    held_out = tmp_path / "heldout"
    spec = ModelSpec(selection["model"]["name"], src["kind"], src["path"], step=selection["model"]["step"])
    proto = P.begin_confirmation(selection, split_dir / "heldout.jsonl", held_out)
    ev = evaluator(env, held_out, problems=str(split_dir / "heldout.jsonl"), models=[spec])
    P.check_fingerprint(proto, ev.run_audit()["fingerprints"])
    held = ev.run()
    claims = {(c["model"], c["metric"]): c["claim"] for c in held["comparisons"]}
    assert claims.pop((spec.name, "partial_reward_mean")) == "confirmatory"
    assert set(claims.values()) == {"exploratory"}
    assert "Role: **confirmation**" in (held_out / "results.md").read_text()
    with pytest.raises(P.ProtocolError, match="already confirmed"):
        P.begin_confirmation(selection, split_dir / "heldout.jsonl", tmp_path / "again")


@pytest.mark.heavy
@pytest.mark.slow
def test_the_launcher_selects_confirms_and_refuses_a_second_confirmation(env, tmp_path):
    from jaxrl.data.problems import load_problems
    from jaxrl.data.splits import freeze_splits
    split_dir = tmp_path / "splits"
    freeze_splits(load_problems(env["problems"]), split_dir, seed=0)
    common = [f"--base={env['model_dir']}", f"--num_samples={N}", "--temperature=1.0", f"--max_new_tokens={CAP}",
              "--max_prompt_len=192", "--prompt_buckets=192", "--batch_size=1", "--mesh_shape=1,1,1", f"--reward={REWARD}",
              "--dtype=float32", "--seed=3", "--n_resamples=500", "--noprogress"]
    sub_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))

    def evaluate(*args):
        return subprocess.run([sys.executable, "-m", "launchers.evaluate", *common, *args], cwd=ROOT, env=sub_env,
                              capture_output=True, text=True, timeout=600)
    loose = evaluate(f"--problems={env['problems']}", f"--checkpoints={env['workdir']}", f"--out={tmp_path / 'x'}",
                     "--role=select")
    assert loose.returncode != 0 and "needs a frozen split" in loose.stderr
    dev = evaluate(f"--problems={split_dir / 'dev.jsonl'}", f"--checkpoints={env['workdir']}",
                   f"--out={tmp_path / 'dev'}", "--role=select")
    assert dev.returncode == 0, dev.stderr[-3000:]
    selection = json.loads((tmp_path / "dev" / "selection.json").read_text())
    assert f"evaluate: selected {selection['model']['name']}" in dev.stdout
    held = evaluate(f"--problems={split_dir / 'heldout.jsonl'}", f"--confirm={tmp_path / 'dev'}",
                    f"--out={tmp_path / 'held'}")
    assert held.returncode == 0, held.stderr[-3000:]
    res = json.loads((tmp_path / "held" / "results.json").read_text())
    assert list(res["models"]) == ["base", selection["model"]["name"]]
    assert [c["claim"] for c in res["comparisons"] if c["metric"] == selection["metric"]] == ["confirmatory"]
    again = evaluate(f"--problems={split_dir / 'heldout.jsonl'}", f"--confirm={tmp_path / 'dev'}",
                     f"--out={tmp_path / 'held2'}")
    assert again.returncode != 0 and "already confirmed" in again.stderr
    assert not (tmp_path / "held2" / "results.json").exists()


@pytest.mark.slow
def test_greedy_decoding_with_several_samples_is_refused(env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launchers.evaluate", f"--problems={env['problems']}",
                           f"--base={env['model_dir']}", f"--out={tmp_path}", "--temperature=0", "--num_samples=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "temperature 0 with num_samples=4" in proc.stderr


@pytest.mark.heavy
@pytest.mark.slow
def test_killed_evaluation_resumes_without_redoing_finished_samples(env, tmp_path):
    from jaxrl.data import formats
    from jaxrl.evaluation.runner import ResumeError
    out = tmp_path / "eval"
    log = tmp_path / "evaluate.log"
    cmd = [sys.executable, "-m", "launchers.evaluate", f"--problems={env['problems']}", f"--base={env['model_dir']}",
           f"--checkpoints={env['workdir']}", f"--adapters=peft5={env['peft']}", f"--models=merged5={env['merged']}",
           f"--out={out}",
           f"--num_samples={N}", "--temperature=1.0", f"--max_new_tokens={CAP}", "--max_prompt_len=192",
           "--prompt_buckets=192", "--batch_size=1", "--mesh_shape=1,1,1", f"--reward={REWARD}", "--dtype=float32", "--seed=3",
           "--n_resamples=2000", "--noprogress"]
    sub_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
                   JAXRL_TEST_REWARD_SLEEP="0.25")
    cache = out / "cache" / "base.jsonl"
    # --batch_size=1 on one device: one engine slot, so a written batch is 4 rows (JaxBackend hands a call 4 slots' worth:
    # collect_factor), two problems; the kill lands after the first batch and before the last. The resume below
    # runs at batch_size 4: samples do not depend on the batch.
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=sub_env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if cache.exists() and len(cache.read_text().splitlines()) >= 2 * N:  # two problems done
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the evaluation ended before it could be killed:\n{log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "results.json").exists()
    done = cache.read_text()
    assert 2 * N <= len(done.splitlines()) < len(env["ids"]) * N
    with open(cache, "a") as f:
        f.write('{"problem_id": "toy/sum_two", "sample_in')  # a record torn by the kill

    with pytest.raises(ResumeError, match="temperature"):  # other settings never mix with these samples
        evaluator(env, out, temperature=0.5).run()

    results = evaluator(env, out).run()
    after = cache.read_text()
    assert after.startswith(done)  # finished samples kept byte for byte, the torn line cut, nothing redone
    assert len(after.splitlines()) == len(env["ids"]) * N
    # ... and the result is exactly what the uninterrupted run produced.
    for name in results["models"]:
        mine = formats.read_samples(formats.samples_path(out, name))
        ref = formats.read_samples(formats.samples_path(env["root"] / "eval", name))
        key = lambda r: (r["problem_id"], r["sample_index"], r["completion"], r["finish_reason"], r["partial"])  # noqa
        assert [key(r) for r in mine] == [key(r) for r in ref], name
    assert results["models"] == env["results"]["models"]


def test_vllm_backend_without_its_environment_fails_before_any_work(env, tmp_path):
    """vLLM runs from its own environment (docs/guides/vllm.md); without one, the evaluator refuses to start with the two
    lines that make it, and nothing is written."""
    from jaxrl.backends import ServerError
    from jaxrl.backends.options import VLLMLaunchOptions
    from jaxrl.backends.vllm_backend import ENV_RECIPE
    out = tmp_path / "eval_vllm"
    with pytest.raises(ServerError, match="no vLLM environment at") as e:
        evaluator(env, out, backend="vllm", vllm=VLLMLaunchOptions(python=str(tmp_path / "no_venv")))
    assert all(line in str(e.value) for line in ENV_RECIPE)
    assert not (out / "cache").exists()


# --------------------------------------------------------------------------------------- reference rows


def test_references_teacher_is_the_distillation_runs_teacher(tmp_path):
    """--references=teacher reads distill.teacher_path of RUN/config.json; a run that is not a distillation, a
    teacher with an adapter, or no --checkpoints: one usage error naming what to do."""
    from absl import app
    from jaxrl.evaluation.flags import _references
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": "distill", "distill": {"teacher_path": "/m/9B"}}))
    assert _references(["teacher", "t2=/m/other"], str(run)) == [("teacher", "/m/9B"), ("t2", "/m/other")]
    (run / "config.json").write_text(json.dumps({"algorithm": "distill",
                                                 "distill": {"teacher_path": "/m/9B", "teacher_adapter": "/a"}}))
    with pytest.raises(app.UsageError, match="merge it"):
        _references(["teacher"], str(run))
    (run / "config.json").write_text(json.dumps({"algorithm": "grpo"}))
    with pytest.raises(app.UsageError, match="not a distillation run"):
        _references(["teacher"], str(run))
    with pytest.raises(app.UsageError, match="--checkpoints=RUN"):
        _references(["teacher"], None)


@pytest.mark.slow
def test_a_teacher_of_another_shape_is_a_reference_row_in_results_and_the_report(env, tmp_path):
    """The teacher (a 2-layer model, the base being 1-layer; the base's tokenizer) evaluated beside base and the
    checkpoints: scored like any model, labelled a reference in results.json / results.md and the report, outside
    the simultaneous family (whose size is what it is without the teacher)."""
    import shutil
    from jaxrl.diagnostics.report import build_report
    from jaxrl.evaluation.runner import ModelSpec
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    teacher = str(tmp_path / "teacher")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    qwen35.save_pretrained(numpy_init(cfg, seed=4), teacher, base_dir=None, layout="container")
    for name in os.listdir(env["model_dir"]):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(env["model_dir"], name), teacher)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": "distill", "distill": {"teacher_path": teacher}}))
    out = run / "eval"
    ev = evaluator(env, out, models=list(env["specs"]) + [ModelSpec("teacher", "hf", teacher)],
                   references=("teacher",))
    try:
        results = ev.run()
    finally:
        ev.close()
    assert results["models"]["teacher"]["reference"] is True
    assert results["models"]["teacher"]["n_samples"] == results["models"]["base"]["n_samples"]
    teacher_rows = [c for c in results["comparisons"] if c["model"] == "teacher"]
    assert teacher_rows and all(c["reference"] and "simultaneous_ci_low" not in c for c in teacher_rows)
    assert "teacher" not in results["family"]["models"]
    assert results["family"]["size"] == env["results"]["family"]["size"]
    assert "| teacher (reference) |" in (out / "results.md").read_text()
    html = build_report(str(run)).read_text()
    assert ">teacher<" in html and ">reference<" in html

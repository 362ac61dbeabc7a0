"""The embedded demo (`make demo`): the whole product on a tiny Qwen3.5 in a few minutes on two CPU cores.

Stages (each resumes or is skipped when its output exists, so an interrupted demo continues where it stopped):

  1. pretrained/  a random tiny Qwen3.5 container (vision + MTP tensors, as official checkpoints have) and a
                  character-level tokenizer with Qwen's chat template;
  2. m0/          a short supervised warm-up (LoRA SFT) teaching the answer format: two to four characters of one
                  alphabet, then <|im_end|>, the alphabet drawn at random (so M0 answers as asked only by chance),
                  merged into base_model/ (the users' "M0" start; also a merged-export round trip);
  3. rollouts.jsonl  K=8 samples per training prompt from base_model, scored by the `charset` reward;
  4. pairs/       every admissible pair per prompt, with the users' filters (margin, truncation buffer, length
                  difference);
  5. dpo/         DPO (RPO: sigmoid + NLL on the chosen) with LoRA on those pairs, a checkpoint every 8 steps;
  6. grpo/        GRPO from the same base on the same task (online rollouts), as many steps as DPO;
  7. export/      PEFT and merged exports of the last DPO checkpoint (+ PEFT of every step, for drift); the exact
                  average of the last three DPO checkpoints (dpo/averages/avg_<steps>/, launchers.export --average);
  8. dpo/eval/    evaluation of base, every DPO checkpoint, that average and the GRPO adapter on the dev half of the
                  held-out prompts (tasks/eval_splits/), with paired and simultaneous intervals over all of them;
                  the truncated samples re-drawn at twice the cap; the best candidate recorded (selection.json) and
                  confirmed once on the other half (dpo/eval_heldout/: the confirmatory claim);
  9. dpo/diagnostics/ drift, pair audit, termination, checkpoint curves; report.html.

The folder is marked as the demo's (`MARKER`, written when the demo creates it or finds it empty): `--fresh`
deletes only a folder with that mark, so a mistyped --workdir never costs a user's files.

The task: each prompt asks for an answer "in digits" or "in letters"; the reward is the fraction of answer
characters in that alphabet (`jaxrl.rewards.toy.CharsetReward`). The tiny model must read the request from the
prompt, which LoRA can teach it in tens of steps, so the report shows a real gain with an interval.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np

from configs import base as base_config
from configs import dpo as dpo_config
from configs import grpo_demo
from jaxrl.algorithms.run import run_training
from jaxrl.data import formats
from jaxrl.data import pairs as pairs_lib
from jaxrl.data.chat import encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.data.splits import freeze_splits
from jaxrl.diagnostics import drift
from jaxrl.diagnostics.pair_audit import audit_pairs
from jaxrl.diagnostics.report import build_report
from jaxrl.diagnostics.termination import resample_evaluation
from jaxrl.evaluation import protocol
from jaxrl.evaluation.runner import EvalConfig, Evaluator, ModelSpec, checkpoint_specs
from jaxrl.export import export_average, export_checkpoint
from jaxrl.models import qwen35
from jaxrl.models.adapters import adapter_steps
from jaxrl.models.qwen35.config import tiny
from jaxrl.models.qwen35.tiny_checkpoint import write_tiny_checkpoint
from jaxrl.rollout.runner import RolloutConfig, run_rollouts
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer, minimal_vocab_size
from jaxrl.demo_settings import MARKER, PATHS, STAGES, DemoSettings, common_run_settings
from jaxrl.utils.io import write_jsonl

DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
ALPHABETS = {"digits": DIGITS, "letters": LETTERS}
# The random head at std 0.02 caps every logit near 1, so no adapter could make an answer likely (see
# write_tiny_checkpoint); 10x gives the frozen head the range of a trained one.
HEAD_SCALE = 10.0
STAGE_TITLES = {"model": "model and tokenizer", "tasks": "tasks", "warm_up": "M0 warm-up (SFT) and merge",
                "rollouts": "rollouts", "pairs": "pairs", "dpo": "DPO", "grpo": "GRPO", "exports": "exports",
                "evaluation": "evaluation", "diagnostics": "diagnostics", "report": "report"}
WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "lemon", "piano", "zebra", "north",
         "candle", "forest", "silver", "rocket", "garden")


# ------------------------------------------------------------------------------------------------------ data


def make_problems(n: int, seed: int, split: str) -> list[dict]:
    """`n` canonical problem records (docs/reference/interfaces.md schema), half asking for digits, half for letters."""
    rng = np.random.default_rng([seed, {"train": 1, "eval": 2}[split]])
    out = []
    for i in range(n):
        kind = ("digits", "letters")[i % 2]
        words = " ".join(rng.choice(WORDS, size=2, replace=False))
        out.append({
            "id": f"demo/{split}/{i:03d}", "messages": [{"role": "user", "content": f"{words}: reply in {kind}"}],
            "test_type": "stdin", "fn_name": None, "starter_code": "",
            # the toy reward reads metadata.charset; the test documents the same for the canonical schema
            "tests": [{"input": "", "output": ALPHABETS[kind]}], "time_limit_s": None, "source": "jaxrl-demo",
            "metadata": {"charset": ALPHABETS[kind], "kind": kind}})
    return out


def sft_rows(tokenizer, problems: list[dict], seed: int, copies: int = 4) -> list[dict]:
    """Warm-up rows: chat prompt + a 2-4 character answer + <|im_end|>, loss on the answer. The answer's alphabet
    is drawn at random, NOT from the prompt: M0 learns the format and answers in the requested alphabet only by
    chance; reading the request is what DPO and GRPO must teach it."""
    enc = encode_prompts(tokenizer, [p["messages"] for p in problems], False, 256, on_overlong="error")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = np.random.default_rng([seed, 3])
    rows = []
    for _ in range(copies):
        for ids in enc.ids:
            alphabet = (DIGITS, LETTERS)[int(rng.integers(0, 2))]
            answer = "".join(rng.choice(list(alphabet), size=int(rng.integers(2, 5))))
            target = tokenizer.encode(answer, add_special_tokens=False) + [end]
            rows.append({"input_ids": list(map(int, ids)) + target,
                         "loss_mask": [0] * len(ids) + [1] * len(target)})
    return rows


def write_tiny_model(out: Path, corpus: list[str], seed: int) -> str:
    """The demo's pretrained model at `out` (written beside it, then moved in place): a character-level tokenizer
    of `corpus`'s characters and a random 2-layer tiny Qwen3.5 container of that vocabulary; a one-line summary."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # one token per character (answers are scored per character), and no characters outside the task's
    vocab = minimal_vocab_size(corpus, printable_ascii=False)
    build_tiny_tokenizer(os.fspath(tmp), corpus, vocab_size=vocab, printable_ascii=False)
    # 4 spare ids at the top: the container's image/video/vision-start/end tokens (vocab - 4 ... vocab - 1)
    cfg = tiny(vocab_size=vocab + 4, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
               eos_token_id=1)
    write_tiny_checkpoint(os.fspath(tmp), cfg, seed=seed, layout="container", head_scale=HEAD_SCALE)
    os.replace(tmp, out)
    return f"vocab {vocab + 4}, hidden {cfg.hidden_size}, 2 layers (Gated DeltaNet + full attention)"


# ------------------------------------------------------------------------------------------------------ stages


class Demo:
    def __init__(self, workdir: str, settings: DemoSettings = DemoSettings(), log: Callable[[str], None] = print):
        self.dir = Path(workdir).resolve()
        self.s = settings
        self.log = log
        self.timings: dict[str, float] = {}
        self.p = {name: self.dir / rel for name, rel in PATHS.items()}

    # -- helpers
    def _stage(self, name: str, fn: Callable[[], Optional[str]]) -> None:
        t0 = time.perf_counter()
        self.log(f"[demo] {name} ...")
        summary = fn()
        self.timings[name] = time.perf_counter() - t0
        self.log(f"[demo] {name}: done in {self.timings[name]:.0f} s" + (f" - {summary}" if summary else ""))

    def _train(self, config, workdir: Path):
        return run_training(config, os.fspath(workdir))

    def run(self, until: str = "") -> Optional[Path]:
        """Every stage in order (`until`: stop after that one of STAGES); the report's path, or None when stopped
        before it."""
        if until and until not in STAGES:
            raise ValueError(f"until={until!r}: not a stage of the demo; stages: {', '.join(STAGES)}")
        self.claim_folder()
        for stage in STAGES:
            self._stage(STAGE_TITLES[stage], getattr(self, stage))
            if stage == until:
                break
        with open(self.dir / "demo_timings.json", "w") as f:
            json.dump(self.timings, f, indent=2)
        return self.p["report"] if not until or until == STAGES[-1] else None

    def claim_folder(self) -> None:
        """Creates the folder with the demo's mark, or marks an empty one; a folder with other files in it and no
        mark is left alone (the demo writes beside them, and --fresh will not delete it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not any(self.dir.iterdir()):
            (self.dir / MARKER).write_text("made by `python -m launchers.demo`; --fresh deletes this folder\n")

    # -- 1
    def model(self) -> str:
        out = self.p["pretrained"]
        if (out / "tokenizer.json").exists():
            return "exists"
        corpus = [p["messages"][0]["content"] for p in make_problems(64, self.s.seed, "train")]
        return write_tiny_model(out, corpus + [DIGITS, LETTERS, "system user assistant\n"], self.s.seed)

    # -- 2
    def tasks(self) -> str:
        for split, n in (("train", self.s.train_problems), ("eval", self.s.eval_problems)):
            if not self.p[split].exists():
                write_jsonl(self.p[split], make_problems(n, self.s.seed, split))
            load_problems(self.p[split])  # the canonical schema check every launcher applies
        return f"{self.s.train_problems} training and {self.s.eval_problems} held-out prompts"

    def warm_up(self) -> str:
        if (self.p["base"] / "config.json").exists():
            return "exists"
        if not self.p["sft_data"].exists():
            problems = make_problems(self.s.train_problems, self.s.seed + 100, "train")
            write_jsonl(self.p["sft_data"], sft_rows(load_tokenizer(os.fspath(self.p["pretrained"])), problems,
                                                     self.s.seed))
        c = base_config.get_config()
        c.algorithm = "sft"
        common_run_settings(c, model_path=self.p["pretrained"], steps=self.s.sft_steps,
                            checkpoint_every=self.s.sft_steps, learning_rate=3e-3, schedule="cosine", warmup_steps=5,
                            rank=16, micro_batch=32)
        c.data.source = "jsonl"
        c.data.path = os.fspath(self.p["sft_data"])
        longest = max(len(json.loads(line)["input_ids"]) for line in open(self.p["sft_data"]) if line.strip())
        c.data.seq_len = -(-longest // 16) * 16
        result = self._train(c, self.p["m0"])
        loss = [r["nll"] for r in result.records if "nll" in r]
        export_checkpoint(os.fspath(self.p["m0"]), os.fspath(self.p["pretrained"]), os.fspath(self.p["base"]),
                          merge=True, overwrite=True)
        return (f"loss {loss[0]:.2f} -> {loss[-1]:.2f}; merged into {self.p['base'].name}/" if loss else
                f"merged into {self.p['base'].name}/")

    # -- 3
    def rollouts(self) -> str:
        cfg = RolloutConfig(problems=os.fspath(self.p["train"]), model=os.fspath(self.p["base"]),
                            out=os.fspath(self.p["rollouts"]), num_samples=self.s.samples, temperature=1.0,
                            max_new_tokens=self.s.max_new_tokens, max_prompt_len=64, reward="charset",
                            dtype="float32", batch_size=128, seed=self.s.seed, progress=False)
        summary = run_rollouts(cfg)
        return ", ".join(f"{k} {v}" for k, v in summary.items() if isinstance(v, (int, float)))[:200]

    # -- 4
    def pair_config(self):
        # The users' filters, scaled to an 8-token cap (the default 24-token buffer would exceed the cap itself);
        # every admissible pair of a prompt, not just best-vs-worst: the tiny model needs the data.
        return pairs_lib.PairConfig(min_margin=0.5, truncation_buffer=1, max_length_diff=6,
                                    max_new_tokens=self.s.max_new_tokens, pairing="all")

    def pairs(self) -> str:
        out = self.p["pairs"]
        if (out / "pairs.jsonl").exists():
            return "exists"
        # the users' filters, scaled to an 8-token cap: the default 24-token buffer would exceed the cap itself
        config = self.pair_config()
        samples = pairs_lib.read_rollouts(self.p["rollouts"])
        pairs, audit = pairs_lib.build_pairs(samples, config, pairs_lib.read_problem_messages(self.p["train"]))
        audit["reward"] = pairs_lib.rollouts_reward(self.p["rollouts"])  # the pair audit re-scores with it
        pairs_lib.write_pairs(out, pairs, audit)
        if len(pairs) < 8:
            raise RuntimeError(f"only {len(pairs)} pairs survived the filters ({out / 'audit.json'})")
        return f"{len(pairs)} pairs from {len(samples)} samples (counts per filter: pairs/audit.json)"

    # -- 5
    def dpo(self) -> str:
        c = dpo_config.get_config("model=tiny")
        common_run_settings(c, model_path=self.p["base"], steps=self.s.dpo_steps,
                            checkpoint_every=self.s.dpo_checkpoint_every, learning_rate=3e-3,
                            schedule="constant_with_warmup", warmup_steps=2, rank=8, micro_batch=32)
        c.dpo.beta = 0.1
        # RPO (sigmoid DPO + NLL on the chosen): plain sigmoid lets both log-probs fall on this tiny model and its
        # reward swings (0.48 -> 0.30 -> 0.71 over 48 steps); the NLL term keeps the chosen answers likely
        c.dpo.loss_type = "sigmoid,sft"
        c.data.source = "pairs"
        c.data.pairs = os.fspath(self.p["pairs"] / "pairs.jsonl")
        c.data.max_length = 64
        c.data.pad_multiple = 16
        c.data.eval_fraction = 0.125
        result = self._train(c, self.p["dpo"])
        return summarize_records(result.records, ("loss", "preference_accuracy", "reward_margin"))

    # -- 6
    def grpo(self) -> str:
        c = grpo_demo.build(self.p["base"], self.p["train"], self.s)
        result = self._train(c, self.p["grpo"])
        return summarize_records(result.records, ("reward/mean", "kl"))

    # -- 7
    def exports(self) -> str:
        steps = adapter_steps(os.fspath(self.p["dpo"]))
        base, ckpt = os.fspath(self.p["base"]), os.fspath(self.p["dpo"])
        export_checkpoint(ckpt, base, os.fspath(self.p["export"] / "peft"), overwrite=True)
        export_checkpoint(ckpt, base, os.fspath(self.p["export"] / "merged"), merge=True, overwrite=True)
        for step in steps:  # the drift diagnostic reads PEFT folders named step_N
            export_checkpoint(ckpt, base, os.fspath(self.p["export"] / "steps" / f"step_{step}"), step=step,
                              overwrite=True)
        # a candidate beside the steps: the exact mean of the last three checkpoints' updates, where the evaluation
        # of the run's checkpoints finds it (dpo/averages/)
        average = export_average(ckpt, base, None, average=f"last:{min(3, len(steps))}", overwrite=True)
        return (f"export/peft, export/merged (step {steps[-1]}), export/steps/step_{{{','.join(map(str, steps))}}}, "
                f"dpo/averages/{os.path.basename(average['out'])} (rank {average['rank']})")

    # -- 8
    def evaluation(self) -> str:
        grpo_steps = adapter_steps(os.fspath(self.p["grpo"]))
        models = [ModelSpec("base", "base")] + checkpoint_specs(os.fspath(self.p["dpo"]))
        models.append(ModelSpec("grpo", "adapter", os.fspath(self.p["grpo"] / "checkpoints" / "adapters" /
                                                           str(grpo_steps[-1]))))
        models.append(ModelSpec("merged", "hf", os.fspath(self.p["export"] / "merged")))
        # Select on dev, confirm once on held-out (jaxrl.evaluation.protocol): the prompts frozen into two halves.
        splits = self.p["tasks"] / "eval_splits"
        freeze_splits(load_problems(self.p["eval"]), splits, seed=self.s.seed)
        common = dict(base=os.fspath(self.p["base"]), num_samples=self.s.eval_samples, temperature=1.0,
                      max_new_tokens=self.s.max_new_tokens, max_prompt_len=64, reward="charset", dtype="float32",
                      batch_size=128, seed=self.s.seed, n_resamples=2000, progress=False)
        ev = Evaluator(EvalConfig(problems=os.fspath(splits / "dev.jsonl"), out=os.fspath(self.p["dpo"] / "eval"),
                                  models=models, **common))
        try:
            protocol.begin_selection(ev.cfg.problems, ev.out)
            ev.run()
            resample_evaluation(ev, 2 * self.s.max_new_tokens)  # the truncated samples at twice the cap
            results = formats.read_results(ev.out)
            chosen = protocol.write_selection(ev.out, results, base=os.fspath(self.p["base"]))["model"]
        finally:
            ev.close()
        selection = protocol.read_selection(self.p["dpo"] / "eval")
        spec = ModelSpec(chosen["name"], chosen["source"]["kind"], chosen["source"]["path"], step=chosen["step"])
        ev = Evaluator(EvalConfig(problems=os.fspath(splits / "heldout.jsonl"),
                                  out=os.fspath(self.p["dpo"] / "eval_heldout"), models=[spec], **common))
        try:
            proto = protocol.begin_confirmation(selection, ev.cfg.problems, ev.out, settings=common)
            protocol.check_fingerprint(proto, ev.run_audit()["fingerprints"])
            held = ev.run()
        finally:
            ev.close()
        row = next(c for c in held["comparisons"] if c["claim"] == "confirmatory")
        lines = [f"{name} {m['partial_reward_mean']:.3f}" for name, m in results["models"].items()]
        return (f"partial reward (dev): {', '.join(lines)}; selected {chosen['name']}, confirmed on held-out: "
                f"{100 * row['diff']:+.1f} pp [{100 * row['ci_low']:+.1f}, {100 * row['ci_high']:+.1f}] over "
                f"{row['n_pairs']} prompts")

    # -- 9
    def diagnostics(self) -> str:
        wd = self.p["dpo"]
        found = drift.find_peft_checkpoints(self.p["export"] / "steps")
        model = qwen35.from_pretrained(os.fspath(self.p["base"]), dtype=jnp.float32)
        seqs = drift.fixed_sequences(model, os.fspath(self.p["base"]), os.fspath(self.p["eval"]), n_prompts=16,
                                     max_new_tokens=self.s.max_new_tokens)
        res = drift.model_checkpoint_drift(os.fspath(self.p["base"]),
                                           {s: drift.load_peft_adapter(found[s]) for s in sorted(found)}, seqs,
                                           steps=sorted(found), batch_size=16, model=model)
        formats.write_diagnostic(formats.diagnostics_path(wd, "drift"), res)
        # re-scored with the reward the pairs were scored with (recorded in pairs/audit.json)
        audit = audit_pairs(self.p["pairs"] / "pairs.jsonl", problems=os.fspath(self.p["train"]),
                            config=self.pair_config())
        formats.write_diagnostic(formats.diagnostics_path(wd, "pairs"), audit)
        kl = ", ".join(f"step {r['step']} {r['kl_to_base']:.4f}" for r in res["per_step"])
        return f"KL to base per token: {kl}"

    def report(self) -> str:
        path = build_report(self.p["dpo"], out=self.p["report"])
        return os.fspath(path)


def summarize_records(records: list, keys) -> str:
    rows = [r for r in records if any(k in r for k in keys)]
    if not rows:
        return ""
    first, last = rows[0], rows[-1]
    return ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys if k in first and k in last)

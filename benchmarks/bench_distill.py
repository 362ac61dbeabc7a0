"""On-policy distillation against GRPO on the token task (configs/grpo_tiny.py's tiny model and task): how many steps
(and sampled tokens) each needs to reach 90% of a trained teacher's reward.

    python -m benchmarks.bench_distill                                 # teacher 40 GRPO steps, students 30 steps
    python -m benchmarks.bench_distill --teacher_steps=60 --steps=40 --loss=jsd
    python -m benchmarks.bench_distill --score=strict --steps=45         # a sparse (pass/fail) reward

1. base/: a random tiny Qwen3.5 (2 layers, vocabulary 64) written as an HF folder, the start of every run;
2. teacher/: GRPO from base for `teacher_steps` (configs/grpo_tiny.py), merged into an HF folder;
3. the teacher's held-out reward: GRPO from teacher/ at learning rate 0 for `eval_steps` steps on prompts of
   another seed (the token task draws fresh random prompts every step), its mean `reward/mean`;
4. the student from base, twice with the same seed (the same prompts each step) and the same samples per step
   (8 prompts x 8, temperature 0.2, 8 new tokens): GRPO on the task's reward (configs/grpo_tiny.py) and
   distillation from teacher/ (configs/distill_tiny.py with this temperature and batch; `loss`), both at GRPO's
   tuned learning rate 5e-3 (`--lr`; distill_tiny's 3e-2 made the top-k loss fall while the reward swung and the
   gradient norm reached 64 at this temperature). The student's reward per step is its rollout's
   `reward/mean` (on-policy samples on that step's fresh prompts), which distillation computes and logs without
   training on it.

Reported as JSON: the teacher's reward, both curves (reward/mean per step, the sampled completion tokens up to
that step; for distillation also `distill/reverse_kl` per step, the student's per-token reverse KL to the teacher
on that step's fresh prompts before its update, and its last-3 / first-3 ratio), and for each the first step whose reward, averaged with the two before it, reaches 90% of the
teacher's (null when none does).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

GENS, PROMPTS = 8, 8  # samples per prompt, prompts per step: configs/grpo_tiny.py's 64 rows per step


def write_base(folder: str, seed: int = 0) -> str:
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.models.qwen35.tiny_checkpoint import write_tiny_checkpoint
    cfg = tiny(vocab_size=64, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    return write_tiny_checkpoint(folder, cfg, seed=seed, layout="text", with_mtp=False)


def quiet(c, steps: int, seed: int, base: str):
    c.model_path, c.model_overrides = base, {}
    c.steps, c.checkpoint_every, c.seed = steps, steps, seed
    c.tensorboard = False
    c.checkpoint_async = False
    return c


def grpo_config(base: str, steps: int, seed: int, lr: float = 5e-3, score: str = "partial"):
    from configs import grpo_tiny
    c = quiet(grpo_tiny.get_config(), steps, seed, base)
    c.optimizer.learning_rate = lr
    c.reward.score = score
    return c


def distill_config(base: str, teacher: str, steps: int, seed: int, loss: str, lr: float = 5e-3,
                   score: str = "partial"):
    from configs import distill_tiny, grpo_tiny
    c = quiet(distill_tiny.get_config(), steps, seed, base)
    c.optimizer.learning_rate = lr
    c.reward.score = score  # logged only: distillation does not train on it (reward_weight 0)
    g = grpo_tiny.get_config().grpo
    d = c.distill
    d.teacher_path, d.loss = teacher, loss
    d.num_generations, d.prompts_per_step, d.temperature = GENS, PROMPTS, g.temperature
    d.logprob_batch_size = GENS * PROMPTS
    c.batch.micro_batch_size, c.batch.grad_accum = 16, GENS * PROMPTS // 16
    return c


def curve(records) -> dict:
    reward = [float(r["reward/mean"]) for r in records]
    tokens = np.cumsum([float(r["completion/length_mean"]) * GENS * PROMPTS for r in records])
    out = {"reward": [round(x, 4) for x in reward], "sampled_tokens": [int(t) for t in tokens]}
    if "distill/reverse_kl" in records[0]:
        # per token on the step's own samples of fresh prompts (the token task draws new ones every step), before
        # the step's update: each step's value is the student's reverse KL to the teacher on prompts it never saw
        kl = [float(r["distill/reverse_kl"]) for r in records]
        out["reverse_kl"] = [round(x, 4) for x in kl]
        out["reverse_kl_first3"], out["reverse_kl_last3"] = float(np.mean(kl[:3])), float(np.mean(kl[-3:]))
        out["reverse_kl_last3_over_first3"] = out["reverse_kl_last3"] / out["reverse_kl_first3"]
    return out


def steps_to(c: dict, target: float):
    smooth = np.convolve(c["reward"], np.ones(3) / 3, mode="valid")  # step i + 2: the mean of steps i..i+2
    hit = np.nonzero(smooth >= target)[0]
    if not len(hit):
        return None, None
    step = int(hit[0]) + 3
    return step, c["sampled_tokens"][step - 1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher_steps", type=int, default=40)
    p.add_argument("--eval_steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--loss", default="forward_kl_topk", choices=("forward_kl_topk", "jsd", "reverse_kl"))
    p.add_argument("--lr", type=float, default=5e-3, help="both students' (GRPO's tuned rate)")
    p.add_argument("--distill_lr", type=float, default=0.0, help="distillation's, when another; 0 = --lr")
    p.add_argument("--score", default="partial", choices=("partial", "strict"),
                   help="the reward the students are measured (and GRPO trained) on: partial = the fraction of the 8 "
                        "tokens in the right half (dense); strict = 1 only when all 8 are (the sparse, pass/fail kind "
                        "of reward distillation is for). The teacher is trained on the partial reward either way")
    p.add_argument("--workdir", default="")
    args = p.parse_args(argv)
    from jaxrl.algorithms.run import run_training
    from jaxrl.export import export_checkpoint

    root = args.workdir or tempfile.mkdtemp(prefix="bench_distill_")
    t0 = time.perf_counter()
    base = write_base(os.path.join(root, "base"))
    teacher_run = os.path.join(root, "teacher_run")
    taught = run_training(grpo_config(base, args.teacher_steps, seed=1), teacher_run).records
    teacher = os.path.join(root, "teacher")
    export_checkpoint(teacher_run, base, teacher, merge=True, overwrite=True)
    held_out = run_training(grpo_config(teacher, args.eval_steps, seed=7, lr=0.0, score=args.score),
                            os.path.join(root, "eval")).records
    teacher_reward = float(np.mean([r["reward/mean"] for r in held_out]))
    target = 0.9 * teacher_reward
    curves = {}
    distill_lr = args.distill_lr or args.lr
    for name, cfg in (("grpo", grpo_config(base, args.steps, seed=2, lr=args.lr, score=args.score)),
                      (f"distill_{args.loss}", distill_config(base, teacher, args.steps, seed=2, loss=args.loss,
                                                              lr=distill_lr, score=args.score))):
        t = time.perf_counter()
        c = curve(run_training(cfg, os.path.join(root, name)).records)
        c["steps_to_90pct"], c["sampled_tokens_to_90pct"] = steps_to(c, target)
        c["seconds"] = round(time.perf_counter() - t, 1)
        curves[name] = c
    result = {"teacher_reward_held_out": round(teacher_reward, 4), "target_90pct": round(target, 4),
              "base_reward_step1": curves["grpo"]["reward"][0],
              "teacher_training_reward_last": round(float(taught[-1]["reward/mean"]), 4),
              "teacher_steps": args.teacher_steps, "steps": args.steps, "lr": args.lr, "distill_lr": distill_lr,
              "score": args.score,
              "rows_per_step": GENS * PROMPTS,
              "curves": curves, "total_seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
